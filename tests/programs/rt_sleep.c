/*
 * rt_sleep: the sleep family parks a fiber instead of its carrier.
 *
 * N workers (fibers under TOFFLOAD_FIBERIZE=all), released together, each
 * sleep MS milliseconds once, by nanosleep, usleep, clock_nanosleep (relative)
 * or clock_nanosleep (TIMER_ABSTIME) in turn. On one carrier that blocks in
 * the kernel they take N x MS; parked, about MS.
 *   rt_sleep [N] [MS]   prints
 *   fibers=N on_fiber=K elapsed_ms=E min_ms=A max_ms=B early=X
 * min/max: the shortest and longest single sleep; early: sleeps that returned
 * before MS had passed.
 */
#define _GNU_SOURCE
#include "common.h"

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

static int nworkers = 16, ms = 100;
static int ready, go, finished, on_fiber, early;
static double min_ms = 1e9, max_ms;
static pthread_mutex_t stats = PTHREAD_MUTEX_INITIALIZER;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void *worker(void *p)
{
    int me = (int)(long)p;
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&ready, 1, __ATOMIC_SEQ_CST);
    while (!__atomic_load_n(&go, __ATOMIC_SEQ_CST))
        sched_yield();
    double t0 = now_ms();
    struct timespec rel = {ms / 1000, (long)(ms % 1000) * 1000000L};
    switch (me % 4) {
    case 0:
        while (nanosleep(&rel, &rel) < 0 && errno == EINTR)
            ;
        break;
    case 1:
        usleep((useconds_t)ms * 1000);
        break;
    case 2:
        while (clock_nanosleep(CLOCK_MONOTONIC, 0, &rel, &rel) == EINTR)
            ;
        break;
    default: {
        struct timespec abs;
        clock_gettime(CLOCK_MONOTONIC, &abs);
        abs.tv_sec += rel.tv_sec;
        abs.tv_nsec += rel.tv_nsec;
        if (abs.tv_nsec >= 1000000000L) {
            abs.tv_sec++;
            abs.tv_nsec -= 1000000000L;
        }
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &abs, NULL) == EINTR)
            ;
    }
    }
    double d = now_ms() - t0;
    pthread_mutex_lock(&stats);
    if (d < min_ms)
        min_ms = d;
    if (d > max_ms)
        max_ms = d;
    if (d < ms - 0.5) /* allow clock granularity */
        early++;
    pthread_mutex_unlock(&stats);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        nworkers = atoi(argv[1]);
    if (argc > 2)
        ms = atoi(argv[2]);
    if (nworkers < 1 || nworkers > 10000 || ms < 1 || ms > 10000) {
        fprintf(stderr, "usage: rt_sleep [N 1..10000] [MS 1..10000]\n");
        return 2;
    }
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < nworkers; i++) {
        pthread_t t;
        int e = pthread_create(&t, &a, worker, (void *)(long)i);
        if (e) {
            fprintf(stderr, "rt_sleep: pthread_create: %s\n", strerror(e));
            return 2;
        }
    }
    struct timespec tick = {0, 1000 * 1000};
    for (int i = 0; i < 10000 && __atomic_load_n(&ready, __ATOMIC_SEQ_CST) < nworkers; i++)
        nanosleep(&tick, NULL);
    double t0 = now_ms();
    __atomic_store_n(&go, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < nworkers && now_ms() - t0 < 60000)
        nanosleep(&tick, NULL);
    double elapsed = now_ms() - t0;
    if (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < nworkers) {
        fprintf(stderr, "rt_sleep: workers did not finish within 60 s\n");
        return 2;
    }
    printf("fibers=%d on_fiber=%d elapsed_ms=%.1f min_ms=%.1f max_ms=%.1f early=%d\n", nworkers,
           on_fiber, elapsed, min_ms, max_ms, early);
    return 0;
}
