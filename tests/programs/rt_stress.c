/*
 * rt_stress: a bounded queue (16 slots) under one mutex and two condition
 * variables, hammered by real threads and fibers together.
 *   producers: the real main thread (items 0..N/2) and 4 fiber producers
 *              (the other half);
 *   consumers: 1 real thread, created before the process's first accept (so
 *              TOFFLOAD_FIBERIZE=after-accept, the default, keeps it real), and
 *              4 fibers created after it.
 * Every item is a distinct number; consumers mark it seen. A lost wake-up
 * shows as a stall: a watchdog prints "stuck ..." after 20 s and exits 3.
 *   prints: items=N seen=S dups=D real_consumed=R fiber_consumed=F on_fiber=K
 */
#define _GNU_SOURCE
#include "common.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

enum { ITEMS = 200000, QCAP = 16, PRODUCERS = 4, CONSUMERS = 4 };
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t not_empty = PTHREAD_COND_INITIALIZER, not_full = PTHREAD_COND_INITIALIZER;
static int q[QCAP], qh, qn, produced_all;
static unsigned char *seen;
static long seen_n, dups, real_consumed, fiber_consumed;
static int on_fiber, consumers_done;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_stress: %s: %s\n", what, strerror(e));
    exit(2);
}

static void put(int v)
{
    pthread_mutex_lock(&m);
    while (qn == QCAP)
        pthread_cond_wait(&not_full, &m);
    q[(qh + qn) % QCAP] = v;
    qn++;
    pthread_cond_signal(&not_empty);
    pthread_mutex_unlock(&m);
}

/* -1 when everything was produced and the queue is empty. */
static int get(void)
{
    pthread_mutex_lock(&m);
    while (qn == 0 && !produced_all)
        pthread_cond_wait(&not_empty, &m);
    int v = -1;
    if (qn > 0) {
        v = q[qh];
        qh = (qh + 1) % QCAP;
        qn--;
        pthread_cond_signal(&not_full);
    }
    pthread_mutex_unlock(&m);
    return v;
}

static void *consumer(void *p)
{
    int real = p != NULL;
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    long n = 0;
    for (int v; (v = get()) >= 0;) {
        if (__atomic_exchange_n(&seen[v], 1, __ATOMIC_SEQ_CST))
            __atomic_fetch_add(&dups, 1, __ATOMIC_SEQ_CST);
        else
            __atomic_fetch_add(&seen_n, 1, __ATOMIC_SEQ_CST);
        n++;
    }
    __atomic_fetch_add(real ? &real_consumed : &fiber_consumed, n, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&consumers_done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static int producers_done;

static void *producer(void *p)
{
    long k = (long)p;
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    for (int v = ITEMS / 2 + (int)k; v < ITEMS; v += PRODUCERS)
        put(v);
    __atomic_fetch_add(&producers_done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *watchdog(void *p)
{
    (void)p;
    sleep(20);
    printf("stuck seen=%ld qn=%d producers_done=%d consumers_done=%d\n", seen_n, qn, producers_done,
           consumers_done);
    fflush(stdout);
    _exit(3);
}

/* Makes the process's first successful accept, so that with the default
 * TOFFLOAD_FIBERIZE=after-accept later threads become fibers. */
static void first_accept(void)
{
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t len = sizeof sa;
    if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) || listen(l, 1) ||
        getsockname(l, (struct sockaddr *)&sa, &len))
        die("listen", errno);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, (struct sockaddr *)&sa, sizeof sa))
        die("connect", errno);
    int s = accept(l, NULL, NULL);
    if (s < 0)
        die("accept", errno);
    close(s);
    close(c);
    close(l);
}

int main(void)
{
    seen = calloc(ITEMS, 1);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int e;
    /* Real threads: created before the first accept. */
    if ((e = pthread_create(&t, &a, watchdog, NULL)) ||
        (e = pthread_create(&t, &a, consumer, (void *)1)))
        die("pthread_create", e);
    first_accept();
    for (long i = 0; i < CONSUMERS; i++)
        if ((e = pthread_create(&t, &a, consumer, NULL)))
            die("pthread_create", e);
    for (long i = 0; i < PRODUCERS; i++)
        if ((e = pthread_create(&t, &a, producer, (void *)i)))
            die("pthread_create", e);
    for (int v = 0; v < ITEMS / 2; v++)
        put(v);
    while (__atomic_load_n(&producers_done, __ATOMIC_SEQ_CST) < PRODUCERS) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&m);
    produced_all = 1;
    pthread_cond_broadcast(&not_empty);
    pthread_mutex_unlock(&m);
    while (__atomic_load_n(&consumers_done, __ATOMIC_SEQ_CST) < CONSUMERS + 1) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    printf("items=%d seen=%ld dups=%ld real_consumed=%ld fiber_consumed=%ld on_fiber=%d\n", ITEMS,
           seen_n, dups, real_consumed, fiber_consumed, on_fiber);
    return 0;
}
