/*
 * rt_overflow: a thread (a fiber under TOFFLOAD_FIBERIZE=all) recurses until it
 * runs off its stack. Under the runtime the guard page below a fiber's stack
 * must stop it: "toffload: fiber stack overflow ..." on stderr, then death by
 * SIGSEGV, never silent corruption of a neighbour's memory.
 * Prints "started on_fiber=0|1" (flushed) before recursing; reaching the end
 * would print "survived" and exit 0 (the limit is far beyond any stack).
 */
#define _GNU_SOURCE
#include "common.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

static volatile long limit = 1L << 40; /* volatile: the compiler cannot bound it */

static __attribute__((noinline)) long deep(long n)
{
    volatile char pad[1024];
    pad[0] = (char)n;
    pad[sizeof pad - 1] = (char)(n >> 8);
    if (n >= limit)
        return pad[0];
    return deep(n + 1) + pad[sizeof pad - 1]; /* not a tail call */
}

static void *worker(void *p)
{
    (void)p;
    printf("started on_fiber=%d\n", fiber_id() > 0);
    fflush(stdout);
    long r = deep(0);
    printf("survived %ld\n", r);
    fflush(stdout);
    return NULL;
}

int main(void)
{
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, 256 * 1024);
    pthread_t t;
    int e = pthread_create(&t, &a, worker, NULL);
    if (e) {
        fprintf(stderr, "rt_overflow: pthread_create: %s\n", strerror(e));
        return 2;
    }
    pthread_join(t, NULL);
    return 0;
}
