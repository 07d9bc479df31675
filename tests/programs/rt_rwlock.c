/*
 * rt_rwlock: pthread rwlocks held across an offload.
 *
 * 4 reader fibers each do 5 rounds of rdlock, accel_run, unlock; 2 writer
 * fibers each do 5 rounds of wrlock, check exclusivity, bump a value, sleep
 * 5 ms, unlock. Readers parked in the offload with the read lock held must
 * not stop each other (max_readers > 1 shows they overlapped) and must keep
 * writers out (violations = 0); a writer that finds the lock read-held must
 * park, not block the carrier (with glibc's rwlock on fibers it blocks the
 * carrier, the readers never resume: deadlock, bounded by the test).
 * tryrdlock while a writer holds and trywrlock while readers hold must say
 * EBUSY (busy counts those).
 *   prints: fibers=6 on_fiber=K max_readers=R violations=V value=X expected=10 busy=B
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

enum { READERS = 4, WRITERS = 2, ROUNDS = 5 };
static pthread_rwlock_t rw = PTHREAD_RWLOCK_INITIALIZER;
static int readers_in, writers_in, max_readers, violations, value, busy;
static int started, finished, on_fiber;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_rwlock: %s: %s\n", what, strerror(e));
    exit(2);
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

static void begin(void)
{
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&started, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&started, __ATOMIC_SEQ_CST) < READERS + WRITERS)
        sched_yield();
}

static void *reader(void *p)
{
    (void)p;
    unsigned char buf[64] = {0};
    begin();
    for (int r = 0; r < ROUNDS; r++) {
        int e = pthread_rwlock_rdlock(&rw);
        if (e)
            die("pthread_rwlock_rdlock", e);
        if (__atomic_load_n(&writers_in, __ATOMIC_SEQ_CST))
            __atomic_fetch_add(&violations, 1, __ATOMIC_SEQ_CST);
        int n = __atomic_add_fetch(&readers_in, 1, __ATOMIC_SEQ_CST);
        int mx = __atomic_load_n(&max_readers, __ATOMIC_SEQ_CST);
        while (n > mx && !__atomic_compare_exchange_n(&max_readers, &mx, n, 0, __ATOMIC_SEQ_CST,
                                                      __ATOMIC_SEQ_CST))
            ;
        if (pthread_rwlock_trywrlock(&rw) == EBUSY)
            __atomic_fetch_add(&busy, 1, __ATOMIC_SEQ_CST);
        int rc = accel_run(buf, (int)sizeof buf);
        if (rc < 0)
            die("accel_run", -rc);
        __atomic_sub_fetch(&readers_in, 1, __ATOMIC_SEQ_CST);
        if ((e = pthread_rwlock_unlock(&rw)))
            die("pthread_rwlock_unlock", e);
        usleep(1000);
    }
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *writer(void *p)
{
    (void)p;
    begin();
    for (int r = 0; r < ROUNDS; r++) {
        int e = pthread_rwlock_wrlock(&rw);
        if (e)
            die("pthread_rwlock_wrlock", e);
        if (__atomic_load_n(&readers_in, __ATOMIC_SEQ_CST) ||
            __atomic_add_fetch(&writers_in, 1, __ATOMIC_SEQ_CST) != 1)
            __atomic_fetch_add(&violations, 1, __ATOMIC_SEQ_CST);
        else if (pthread_rwlock_tryrdlock(&rw) == EBUSY)
            __atomic_fetch_add(&busy, 1, __ATOMIC_SEQ_CST);
        int v = value;
        usleep(5000);
        value = v + 1;
        __atomic_store_n(&writers_in, 0, __ATOMIC_SEQ_CST);
        if ((e = pthread_rwlock_unlock(&rw)))
            die("pthread_rwlock_unlock", e);
        usleep(1000);
    }
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(void)
{
    for (int i = 0; i < READERS; i++)
        spawn(reader, NULL);
    for (int i = 0; i < WRITERS; i++)
        spawn(writer, NULL);
    for (int i = 0; i < 20000 && __atomic_load_n(&finished, __ATOMIC_SEQ_CST) < READERS + WRITERS;
         i++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < READERS + WRITERS) {
        fprintf(stderr, "rt_rwlock: did not finish within 20 s\n");
        return 2;
    }
    printf("fibers=%d on_fiber=%d max_readers=%d violations=%d value=%d expected=%d busy=%d\n",
           READERS + WRITERS, on_fiber, max_readers, violations, value, WRITERS * ROUNDS, busy);
    return 0;
}
