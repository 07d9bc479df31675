/*
 * rt_xoffload: an extra offload row (TOFFLOAD_OFFLOAD=blocking:submit:done:release).
 *
 * The blocking call is xoff_block(long us, long tag), from a small library the
 * test builds and preloads (weak here, so this program links without it).
 * xoff_block really blocks its caller in the kernel for `us` microseconds
 * (raw syscalls, out of the runtime's reach); the library's xoff_submit /
 * xoff_done / xoff_release implement the same wait as a pollable operation,
 * and xoff_submit rejects (-EINVAL) a tag that does not match `us`, so the
 * arguments must reach it unchanged. xoff_real_calls() counts calls that
 * reached the blocking function itself.
 * A second row, xoff_block6, takes six arguments (us and five tags that
 * xoff_submit6 checks). N workers (fibers under TOFFLOAD_FIBERIZE=all), released
 * together, each make one call: even workers xoff_block, odd ones xoff_block6.
 * Before any worker exists, the real main thread makes one xoff_block call of
 * 1 ms itself: on a real thread the blocking function must be the real one.
 *   rt_xoffload [N] [US]   prints
 *   fibers=N on_fiber=K elapsed_ms=E rc_bad=B real_calls=R main_rc=M
 * real_calls counts calls that reached the library's blocking functions
 * (the main thread's included).
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

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }
int xoff_block(long us, long tag) __attribute__((weak));
int xoff_block6(long us, long t1, long t2, long t3, long t4, long t5) __attribute__((weak));
long xoff_real_calls(void) __attribute__((weak));

static int nworkers = 16;
static long us = 100000;
static int ready, go, finished, on_fiber, rc_bad;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void *worker(void *p)
{
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&ready, 1, __ATOMIC_SEQ_CST);
    while (!__atomic_load_n(&go, __ATOMIC_SEQ_CST))
        sched_yield();
    long me = (long)p;
    int rc = me % 2 ? xoff_block6(us, us + 1, us + 2, us + 3, us + 4, us + 5)
                    : xoff_block(us, us ^ 0x5eed);
    if (rc != 0)
        __atomic_fetch_add(&rc_bad, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        nworkers = atoi(argv[1]);
    if (argc > 2)
        us = atol(argv[2]);
    if (nworkers < 1 || nworkers > 1000 || us < 1 || us > 10000000) {
        fprintf(stderr, "usage: rt_xoffload [N 1..1000] [US 1..10000000]\n");
        return 2;
    }
    if (!xoff_block || !xoff_block6 || !xoff_real_calls) {
        fprintf(stderr, "rt_xoffload: xoff_block not found: preload the test's libxoff.so\n");
        return 2;
    }
    int main_rc = xoff_block(1000, 1000 ^ 0x5eed);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < nworkers; i++) {
        pthread_t t;
        int e = pthread_create(&t, &a, worker, (void *)(long)i);
        if (e) {
            fprintf(stderr, "rt_xoffload: pthread_create: %s\n", strerror(e));
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
        fprintf(stderr, "rt_xoffload: workers did not finish within 60 s\n");
        return 2;
    }
    printf("fibers=%d on_fiber=%d elapsed_ms=%.1f rc_bad=%d real_calls=%ld main_rc=%d\n", nworkers,
           on_fiber, elapsed, rc_bad, xoff_real_calls(), main_rc);
    return 0;
}
