/*
 * rt_mutex_types: recursive and error-checking mutexes held across an offload.
 *
 * glibc decides who owns such a mutex by thread id; fibers on one carrier share
 * it. A fiber-aware mutex must know the owning fiber instead:
 *   recursive: 4 workers (fibers under TOFFLOAD_FIBERIZE=all) each do 5 rounds
 *     of lock, lock again, accel_run with the mutex held, unlock, unlock.
 *     Another worker must never get in meanwhile (rec_violations counts
 *     workers found inside with it), and no call may fail (rec_errors).
 *   errorcheck: the same with one lock; a relock by the owner must say EDEADLK
 *     (self_edeadlk counts those, one per round), a lock by a worker that does
 *     not own it must wait, never fail (err_errors: any failure, EDEADLK
 *     included), and an unlock by a non-owner must say EPERM
 *     (foreign_unlock_eperm counts those, foreign_unlock_tries the attempts).
 *   prints: fibers=8 on_fiber=K rec_violations=A rec_errors=B err_violations=C
 *           err_errors=D self_edeadlk=E foreign_unlock_tries=F foreign_unlock_eperm=G
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

enum { WORKERS = 4, ROUNDS = 5 };
static pthread_mutex_t rec, chk;
static int in_rec, in_chk, chk_held;
static int rec_violations, rec_errors, err_violations, err_errors, self_edeadlk;
static int foreign_unlock_tries, foreign_unlock_eperm;
static int started, finished, on_fiber;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_mutex_types: %s: %s\n", what, strerror(e));
    exit(2);
}

static void count(int *n) { __atomic_fetch_add(n, 1, __ATOMIC_SEQ_CST); }

static void begin(void)
{
    if (fiber_id() > 0)
        count(&on_fiber);
    count(&started);
    while (__atomic_load_n(&started, __ATOMIC_SEQ_CST) < 2 * WORKERS)
        sched_yield();
}

static void offload(void)
{
    unsigned char buf[64] = {0};
    int rc = accel_run(buf, (int)sizeof buf);
    if (rc < 0)
        die("accel_run", -rc);
}

static void *recursive_worker(void *p)
{
    (void)p;
    begin();
    for (int r = 0; r < ROUNDS; r++) {
        if (pthread_mutex_lock(&rec) || pthread_mutex_lock(&rec)) {
            count(&rec_errors);
            continue;
        }
        if (__atomic_add_fetch(&in_rec, 1, __ATOMIC_SEQ_CST) != 1)
            count(&rec_violations);
        offload();
        __atomic_sub_fetch(&in_rec, 1, __ATOMIC_SEQ_CST);
        if (pthread_mutex_unlock(&rec) || pthread_mutex_unlock(&rec))
            count(&rec_errors);
        usleep(500);
    }
    count(&finished);
    return NULL;
}

static void *errorcheck_worker(void *p)
{
    (void)p;
    begin();
    for (int r = 0; r < ROUNDS; r++) {
        /* While someone else holds it, try to unlock it: must be EPERM. */
        if (__atomic_load_n(&chk_held, __ATOMIC_SEQ_CST)) {
            count(&foreign_unlock_tries);
            int e = pthread_mutex_unlock(&chk);
            if (e == EPERM)
                count(&foreign_unlock_eperm);
        }
        int e = pthread_mutex_lock(&chk);
        if (e) {
            count(&err_errors);
            continue;
        }
        __atomic_store_n(&chk_held, 1, __ATOMIC_SEQ_CST);
        if (__atomic_add_fetch(&in_chk, 1, __ATOMIC_SEQ_CST) != 1)
            count(&err_violations);
        if (pthread_mutex_lock(&chk) == EDEADLK)
            count(&self_edeadlk);
        offload();
        __atomic_sub_fetch(&in_chk, 1, __ATOMIC_SEQ_CST);
        __atomic_store_n(&chk_held, 0, __ATOMIC_SEQ_CST);
        if (pthread_mutex_unlock(&chk))
            count(&err_errors);
        usleep(500);
    }
    count(&finished);
    return NULL;
}

int main(void)
{
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_RECURSIVE);
    int e = pthread_mutex_init(&rec, &ma);
    if (e)
        die("pthread_mutex_init(recursive)", e);
    pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_ERRORCHECK);
    if ((e = pthread_mutex_init(&chk, &ma)))
        die("pthread_mutex_init(errorcheck)", e);
    pthread_mutexattr_destroy(&ma);

    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < WORKERS; i++) {
        pthread_t t;
        if ((e = pthread_create(&t, &a, recursive_worker, NULL)) ||
            (e = pthread_create(&t, &a, errorcheck_worker, NULL)))
            die("pthread_create", e);
    }
    for (int i = 0; i < 20000 && __atomic_load_n(&finished, __ATOMIC_SEQ_CST) < 2 * WORKERS; i++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < 2 * WORKERS) {
        fprintf(stderr, "rt_mutex_types: workers did not finish within 20 s\n");
        return 2;
    }
    printf("fibers=%d on_fiber=%d rec_violations=%d rec_errors=%d err_violations=%d err_errors=%d "
           "self_edeadlk=%d foreign_unlock_tries=%d foreign_unlock_eperm=%d\n",
           2 * WORKERS, on_fiber, rec_violations, rec_errors, err_violations, err_errors,
           self_edeadlk, foreign_unlock_tries, foreign_unlock_eperm);
    return 0;
}
