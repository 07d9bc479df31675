/*
 * rt_identity: what a fiber sees of its own thread.
 *
 * Workers (fibers under TOFFLOAD_FIBERIZE=all) check that
 *   - pthread_self() is a real thread, not the main thread, and the same
 *     before and after a yield only when they cannot have moved (self_real
 *     counts workers whose pthread_self() is a live thread per
 *     pthread_kill(self, 0) == 0);
 *   - pthread_getattr_np(pthread_self()) describes the stack they run on:
 *     the address of a local lies inside [stackaddr, stackaddr + stacksize)
 *     (attr_ok counts those);
 *   - a thread created with a 1 MiB stack attribute really gets at least that:
 *     it uses 768 KiB of stack without dying (big_ok=1; big_stack_kb reports
 *     what pthread_getattr_np says).
 *   prints: fibers=N on_fiber=K self_real=A attr_ok=B big_ok=0|1 big_stack_kb=S
 */
#define _GNU_SOURCE
#include "common.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

enum { N = 8 };
static pthread_t main_thread;
static int finished, on_fiber, self_real, attr_ok, big_ok;
static long big_stack_kb;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_identity: %s: %s\n", what, strerror(e));
    exit(2);
}

/* 1 if `p` lies on the stack pthread_getattr_np reports for this thread. */
static int on_my_stack(const void *p, size_t *size)
{
    pthread_attr_t a;
    void *addr;
    size_t sz;
    if (pthread_getattr_np(pthread_self(), &a))
        return 0;
    int e = pthread_attr_getstack(&a, &addr, &sz);
    pthread_attr_destroy(&a);
    if (e)
        return 0;
    if (size)
        *size = sz;
    uintptr_t lo = (uintptr_t)addr, x = (uintptr_t)p;
    return x >= lo && x < lo + sz;
}

static void *worker(void *p)
{
    (void)p;
    volatile int local = 1;
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    sched_yield();
    pthread_t self = pthread_self();
    if (!pthread_equal(self, main_thread) && pthread_kill(self, 0) == 0)
        __atomic_fetch_add(&self_real, 1, __ATOMIC_SEQ_CST);
    usleep(1000);
    if (on_my_stack((const void *)&local, NULL))
        __atomic_fetch_add(&attr_ok, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

/* Touches `kb` KiB of stack, one page at a time, recursively. */
static __attribute__((noinline)) long use_stack(int kb)
{
    volatile char page[4096];
    page[0] = (char)kb;
    page[sizeof page - 1] = (char)(kb >> 8);
    if (kb <= 4)
        return page[0];
    return use_stack(kb - 4) + page[sizeof page - 1];
}

static void *big(void *p)
{
    (void)p;
    volatile int local = 1;
    size_t sz = 0;
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    int mine = on_my_stack((const void *)&local, &sz);
    big_stack_kb = (long)(sz / 1024);
    use_stack(768);
    big_ok = mine;
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(void)
{
    main_thread = pthread_self();
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    int e;
    for (int i = 0; i < N; i++) {
        pthread_t t;
        if ((e = pthread_create(&t, &a, worker, NULL)))
            die("pthread_create", e);
    }
    pthread_attr_setstacksize(&a, 1024 * 1024);
    pthread_t t;
    if ((e = pthread_create(&t, &a, big, NULL)))
        die("pthread_create (1 MiB stack)", e);
    for (int i = 0; i < 10000 && __atomic_load_n(&finished, __ATOMIC_SEQ_CST) < N + 1; i++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < N + 1) {
        fprintf(stderr, "rt_identity: did not finish within 10 s\n");
        return 2;
    }
    printf("fibers=%d on_fiber=%d self_real=%d attr_ok=%d big_ok=%d big_stack_kb=%ld\n", N + 1,
           on_fiber, self_real, attr_ok, big_ok, big_stack_kb);
    return 0;
}
