/*
 * rt_cond: condition variables between fibers and real threads.
 *
 * Phase A (real thread -> fiber): fiber W waits on c1 for flag1; a ticker
 * fiber counts 1 ms sleeps; the real main thread sleeps 200 ms, then sets
 * flag1 and signals. A fiber-aware wait parks W, so the ticker keeps ticking;
 * glibc's wait blocks the carrier and the ticker stops.
 *   prints: a_woke=0|1 a_on_fiber=0|1 a_ticks=T a_ms=X
 * Phase B (fiber -> real thread): the main thread waits on c2 (timedwait,
 * 5 s cap); fiber S sleeps 50 ms, offloads, then sets flag2 and signals.
 *   prints: b_woke=0|1 b_ms=X
 * Phase C (fiber -> fibers, broadcast): 4 fibers wait on c3; a fifth sleeps
 * 50 ms, sets flag3 and broadcasts. With glibc's wait on fibers the first
 * waiter blocks the carrier and the broadcaster never runs (deadlock; the
 * test bounds it with a timeout).
 *   prints: c_woken=N c_on_fiber=K
 * Phase D (real thread -> fiber in a timed wait): fiber D waits on c4 with a
 * 5 s pthread_cond_timedwait deadline and then a 5 s pthread_cond_clockwait
 * one; the main thread signals each 50 ms in. Both must return 0 well before
 * their deadline.
 *   prints: d_rc=R d_ms=X d_clock_rc=R d_clock_ms=X
 */
#define _GNU_SOURCE
#include "common.h"
#include "toffload_accel.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c1 = PTHREAD_COND_INITIALIZER, c2 = PTHREAD_COND_INITIALIZER,
                      c3 = PTHREAD_COND_INITIALIZER;
static int flag1, flag2, flag3, stop_ticks, ticks, a_on_fiber, finished;
static int c_woken, c_on_fiber, c_waiting;
static pthread_cond_t c4 = PTHREAD_COND_INITIALIZER;
static int flag4, flag5, d_waiting, d_rc = -1, d_clock_rc = -1;
static double d_ms, d_clock_ms;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_cond: %s: %s\n", what, strerror(e));
    exit(2);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

static void spawn(void *(*fn)(void *), void *arg)
{
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int e = pthread_create(&t, &a, fn, arg);
    if (e)
        die("pthread_create", e);
    pthread_attr_destroy(&a);
}

static int wait_for(int *n, int want, int timeout_ms)
{
    for (int i = 0; i < timeout_ms && __atomic_load_n(n, __ATOMIC_SEQ_CST) < want; i++)
        sleep_ms(1);
    return __atomic_load_n(n, __ATOMIC_SEQ_CST) >= want ? 0 : -1;
}

static void *ticker(void *p)
{
    (void)p;
    while (!__atomic_load_n(&stop_ticks, __ATOMIC_SEQ_CST)) {
        usleep(1000);
        __atomic_fetch_add(&ticks, 1, __ATOMIC_SEQ_CST);
        sched_yield(); /* lets others run even where usleep blocks the carrier */
    }
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *waiter_a(void *p)
{
    (void)p;
    a_on_fiber = fiber_id() > 0;
    pthread_mutex_lock(&m);
    while (!flag1) {
        int e = pthread_cond_wait(&c1, &m);
        if (e)
            die("pthread_cond_wait", e);
    }
    pthread_mutex_unlock(&m);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *signaller_b(void *p)
{
    (void)p;
    unsigned char buf[64] = {0};
    usleep(50 * 1000);
    int rc = accel_run(buf, (int)sizeof buf);
    if (rc < 0)
        die("accel_run", -rc);
    pthread_mutex_lock(&m);
    flag2 = 1;
    pthread_cond_signal(&c2);
    pthread_mutex_unlock(&m);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *waiter_c(void *p)
{
    (void)p;
    if (fiber_id() > 0)
        __atomic_fetch_add(&c_on_fiber, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&m);
    c_waiting++;
    while (!flag3) {
        int e = pthread_cond_wait(&c3, &m);
        if (e)
            die("pthread_cond_wait(c3)", e);
    }
    c_woken++;
    pthread_mutex_unlock(&m);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *broadcaster_c(void *p)
{
    (void)p;
    usleep(50 * 1000);
    pthread_mutex_lock(&m);
    flag3 = 1;
    pthread_cond_broadcast(&c3);
    pthread_mutex_unlock(&m);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *waiter_d(void *p)
{
    (void)p;
    struct timespec dl;
    pthread_mutex_lock(&m);
    __atomic_store_n(&d_waiting, 1, __ATOMIC_SEQ_CST);
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 5;
    double t0 = now_ms();
    int e = 0;
    while (!flag4 && e == 0)
        e = pthread_cond_timedwait(&c4, &m, &dl);
    d_rc = e;
    d_ms = now_ms() - t0;
    __atomic_store_n(&d_waiting, 2, __ATOMIC_SEQ_CST);
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += 5;
    t0 = now_ms();
    e = 0;
    while (!flag5 && e == 0)
        e = pthread_cond_clockwait(&c4, &m, CLOCK_MONOTONIC, &dl);
    d_clock_rc = e;
    d_clock_ms = now_ms() - t0;
    pthread_mutex_unlock(&m);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(void)
{
    /* Phase A */
    spawn(ticker, NULL);
    spawn(waiter_a, NULL);
    sleep_ms(200);
    int a_ticks = __atomic_load_n(&ticks, __ATOMIC_SEQ_CST);
    double t0 = now_ms();
    pthread_mutex_lock(&m);
    flag1 = 1;
    pthread_cond_signal(&c1);
    pthread_mutex_unlock(&m);
    int woke = wait_for(&finished, 1, 5000) == 0;
    double a_ms = now_ms() - t0;
    __atomic_store_n(&stop_ticks, 1, __ATOMIC_SEQ_CST);
    if (wait_for(&finished, 2, 5000) < 0) {
        printf("a_woke=%d a_on_fiber=%d a_ticks=%d a_ms=%.1f\n", woke, a_on_fiber, a_ticks, a_ms);
        fprintf(stderr, "rt_cond: phase A did not finish\n");
        return 2;
    }
    printf("a_woke=%d a_on_fiber=%d a_ticks=%d a_ms=%.1f\n", woke, a_on_fiber, a_ticks, a_ms);
    fflush(stdout);

    /* Phase B */
    __atomic_store_n(&finished, 0, __ATOMIC_SEQ_CST);
    t0 = now_ms();
    spawn(signaller_b, NULL);
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 5;
    pthread_mutex_lock(&m);
    while (!flag2) {
        int e = pthread_cond_timedwait(&c2, &m, &dl);
        if (e == ETIMEDOUT)
            break;
        if (e)
            die("pthread_cond_timedwait", e);
    }
    int b_woke = flag2;
    pthread_mutex_unlock(&m);
    printf("b_woke=%d b_ms=%.1f\n", b_woke, now_ms() - t0);
    fflush(stdout);
    if (wait_for(&finished, 1, 5000) < 0) {
        fprintf(stderr, "rt_cond: phase B signaller did not finish\n");
        return 2;
    }

    /* Phase C */
    __atomic_store_n(&finished, 0, __ATOMIC_SEQ_CST);
    for (int i = 0; i < 4; i++)
        spawn(waiter_c, NULL);
    spawn(broadcaster_c, NULL);
    if (wait_for(&finished, 5, 10000) < 0) {
        fprintf(stderr, "rt_cond: phase C did not finish within 10 s\n");
        return 2;
    }
    printf("c_woken=%d c_on_fiber=%d\n", c_woken, c_on_fiber);
    fflush(stdout);

    /* Phase D */
    __atomic_store_n(&finished, 0, __ATOMIC_SEQ_CST);
    spawn(waiter_d, NULL);
    for (int want = 1; want <= 2; want++) {
        wait_for(&d_waiting, want, 5000);
        sleep_ms(50);
        pthread_mutex_lock(&m);
        if (want == 1)
            flag4 = 1;
        else
            flag5 = 1;
        pthread_cond_signal(&c4);
        pthread_mutex_unlock(&m);
    }
    if (wait_for(&finished, 1, 10000) < 0) {
        fprintf(stderr, "rt_cond: phase D did not finish within 10 s\n");
        return 2;
    }
    printf("d_rc=%d d_ms=%.1f d_clock_rc=%d d_clock_ms=%.1f\n", d_rc, d_ms, d_clock_rc, d_clock_ms);
    return 0;
}
