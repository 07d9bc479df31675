/*
 * rt_join: pthread_join, pthread_detach and pthread_exit on fibers.
 *
 *   join:     8 joinable workers (fibers under TOFFLOAD_FIBERIZE=all); worker i
 *             sleeps a little, offloads, and returns i*7+1 (odd i through
 *             pthread_exit from a nested call). The real main thread joins each
 *             one and checks the value.                    -> join_ok=8
 *   late:     a worker that returns at once, joined 50 ms later. -> late_ok=1
 *   detach:   4 workers created detached, 4 joinable ones detached while
 *             running; all 8 must run to the end.           -> detached_done=8
 *   fiber:    a fiber creates another and joins it.          -> fiber_join_ok=1
 * Also on_fiber=K: workers that saw toffload_fiber_id() > 0 (of 17).
 * Lines are printed as each part finishes.
 */
#define _GNU_SOURCE
#include "common.h"
#include "toffload_accel.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

static int on_fiber, detached_done, release_detached;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_join: %s: %s\n", what, strerror(e));
    exit(2);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void note_fiber(void)
{
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
}

static __attribute__((noinline)) void exit_with(long v) { pthread_exit((void *)v); }

static void *joinable(void *p)
{
    long i = (long)p;
    unsigned char buf[64] = {0};
    note_fiber();
    usleep((useconds_t)(5000 * (i % 3)));
    int rc = accel_run(buf, (int)sizeof buf);
    if (rc < 0)
        die("accel_run", -rc);
    if (i % 2)
        exit_with(i * 7 + 1);
    return (void *)(i * 7 + 1);
}

static void *quick(void *p)
{
    note_fiber();
    return p;
}

static void *detached(void *p)
{
    (void)p;
    note_fiber();
    while (!__atomic_load_n(&release_detached, __ATOMIC_SEQ_CST))
        usleep(1000);
    usleep(2000);
    __atomic_fetch_add(&detached_done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *child(void *p)
{
    note_fiber();
    usleep(10 * 1000);
    return (void *)((intptr_t)p + 1);
}

static void *parent(void *p)
{
    (void)p;
    note_fiber();
    pthread_t t;
    int e = pthread_create(&t, NULL, child, (void *)(intptr_t)41);
    if (e)
        die("pthread_create (in a fiber)", e);
    void *v = NULL;
    e = pthread_join(t, &v);
    return (void *)(intptr_t)(e == 0 && v == (void *)(intptr_t)42);
}

int main(void)
{
    enum { N = 8 };
    pthread_t t[N];
    int e, ok = 0;
    for (long i = 0; i < N; i++)
        if ((e = pthread_create(&t[i], NULL, joinable, (void *)i)))
            die("pthread_create", e);
    for (long i = 0; i < N; i++) {
        void *v = NULL;
        if ((e = pthread_join(t[i], &v)))
            die("pthread_join", e);
        ok += v == (void *)(i * 7 + 1);
    }
    printf("join_ok=%d\n", ok);
    fflush(stdout);

    pthread_t q;
    if ((e = pthread_create(&q, NULL, quick, (void *)(intptr_t)99)))
        die("pthread_create", e);
    sleep_ms(50);
    void *qv = NULL;
    if ((e = pthread_join(q, &qv)))
        die("pthread_join (late)", e);
    printf("late_ok=%d\n", qv == (void *)(intptr_t)99);
    fflush(stdout);

    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < 4; i++) {
        pthread_t d;
        if ((e = pthread_create(&d, &a, detached, NULL)))
            die("pthread_create (detached)", e);
    }
    for (int i = 0; i < 4; i++) {
        pthread_t d;
        if ((e = pthread_create(&d, NULL, detached, NULL)))
            die("pthread_create", e);
        if ((e = pthread_detach(d)))
            die("pthread_detach", e);
    }
    __atomic_store_n(&release_detached, 1, __ATOMIC_SEQ_CST);
    for (int i = 0; i < 5000 && __atomic_load_n(&detached_done, __ATOMIC_SEQ_CST) < 8; i++)
        sleep_ms(1);
    printf("detached_done=%d\n", detached_done);
    fflush(stdout);

    pthread_t pt;
    if ((e = pthread_create(&pt, NULL, parent, NULL)))
        die("pthread_create", e);
    void *pv = NULL;
    if ((e = pthread_join(pt, &pv)))
        die("pthread_join (parent)", e);
    printf("fiber_join_ok=%d\n", pv == (void *)(intptr_t)1);
    printf("on_fiber=%d\n", on_fiber);
    return 0;
}
