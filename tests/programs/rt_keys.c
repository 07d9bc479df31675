/*
 * rt_keys: pthread keys are per fiber, and their destructors run when a fiber
 * exits.
 *
 * Key k1 has a destructor, k2 none; EXTRA more keys (default 64, up to 1000:
 * glibc allows 1024 in all) are created on top so that fibers use many keys
 * at once. N workers (fibers under TOFFLOAD_FIBERIZE=all)
 * each check that k1 starts out NULL (a new fiber must not see another's
 * value), set k1 to a heap object tagged with their index, k2 and the extra
 * keys to their index, then yield (sched_yield, usleep, accel_run) ROUNDS
 * times, checking every key after each yield. When a worker returns, the k1
 * destructor must run with that worker's object.
 *   prints: fibers=N on_fiber=K initial_bad=I bad=B dtor_calls=D dtor_bad=X
 *   rt_keys [N] [EXTRA]
 * initial_bad: workers that saw a non-NULL k1 before setting it; bad: checks
 * where a key held someone else's value; dtor_calls: destructor calls with a
 * worker's object (the main thread waits up to 2 s for N of them); dtor_bad:
 * objects destroyed twice or calls with an unknown object.
 */
#define _GNU_SOURCE
#include "common.h"
#include "toffload_accel.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

enum { MAXW = 256, MAXEXTRA = 1000, ROUNDS = 12 };
static int nworkers = 16, nextra = 64;
static pthread_key_t k1, k2, extra[MAXEXTRA];
static int started, finished, on_fiber, initial_bad, bad, dtor_calls, dtor_bad;
static int destroyed[MAXW];

struct obj {
    uint32_t magic;
    int owner;
};
#define MAGIC 0x6b657973u

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_keys: %s: %s\n", what, strerror(e));
    exit(2);
}

static void dtor(void *p)
{
    struct obj *o = p;
    if (!o || o->magic != MAGIC || o->owner < 0 || o->owner >= nworkers) {
        __atomic_fetch_add(&dtor_bad, 1, __ATOMIC_SEQ_CST);
        return;
    }
    if (__atomic_fetch_add(&destroyed[o->owner], 1, __ATOMIC_SEQ_CST) != 0)
        __atomic_fetch_add(&dtor_bad, 1, __ATOMIC_SEQ_CST);
    else
        __atomic_fetch_add(&dtor_calls, 1, __ATOMIC_SEQ_CST);
    /* Not freed: a runtime that calls the destructor twice must be caught,
     * not turned into a double free. The process is short-lived. */
    o->magic = 0;
}

static int check(int me, struct obj *mine)
{
    int wrong = pthread_getspecific(k1) != mine;
    wrong |= (intptr_t)pthread_getspecific(k2) != me + 1;
    for (int i = 0; i < nextra; i++)
        wrong |= (intptr_t)pthread_getspecific(extra[i]) != (me + 1) * 10000 + i;
    return wrong;
}

static void *worker(void *p)
{
    int me = (int)(long)p;
    unsigned char buf[64];
    memset(buf, me, sizeof buf);
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&started, 1, __ATOMIC_SEQ_CST);
    /* Stagger the starts: later workers begin after earlier ones have set
     * their values, so an initial NULL really means per-fiber storage. */
    while (__atomic_load_n(&started, __ATOMIC_SEQ_CST) < nworkers)
        sched_yield();
    usleep(500 * (unsigned)me);
    if (pthread_getspecific(k1) != NULL)
        __atomic_fetch_add(&initial_bad, 1, __ATOMIC_SEQ_CST);
    struct obj *mine = malloc(sizeof *mine);
    if (!mine)
        die("malloc", ENOMEM);
    mine->magic = MAGIC;
    mine->owner = me;
    int e = pthread_setspecific(k1, mine);
    if (!e)
        e = pthread_setspecific(k2, (void *)(intptr_t)(me + 1));
    for (int i = 0; i < nextra && !e; i++)
        e = pthread_setspecific(extra[i], (void *)(intptr_t)((me + 1) * 10000 + i));
    if (e)
        die("pthread_setspecific", e);
    for (int r = 0; r < ROUNDS; r++) {
        switch (r % 3) {
        case 0:
            sched_yield();
            break;
        case 1:
            usleep(300);
            break;
        default: {
            int rc = accel_run(buf, (int)sizeof buf);
            if (rc < 0)
                die("accel_run", -rc);
        }
        }
        if (check(me, mine))
            __atomic_fetch_add(&bad, 1, __ATOMIC_SEQ_CST);
    }
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL; /* the k1 destructor runs after this, on exit of the fiber */
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        nworkers = atoi(argv[1]);
    if (argc > 2)
        nextra = atoi(argv[2]);
    if (nworkers < 1 || nworkers > MAXW || nextra < 0 || nextra > MAXEXTRA) {
        fprintf(stderr, "usage: rt_keys [N 1..%d] [EXTRA 0..%d]\n", MAXW, MAXEXTRA);
        return 2;
    }
    int e = pthread_key_create(&k1, dtor);
    if (!e)
        e = pthread_key_create(&k2, NULL);
    for (int i = 0; i < nextra && !e; i++)
        e = pthread_key_create(&extra[i], NULL);
    if (e)
        die("pthread_key_create", e);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < nworkers; i++) {
        pthread_t t;
        if ((e = pthread_create(&t, &a, worker, (void *)(long)i)))
            die("pthread_create", e);
    }
    for (int i = 0; i < 20000 && __atomic_load_n(&finished, __ATOMIC_SEQ_CST) < nworkers; i++)
        sleep_ms(1);
    if (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < nworkers) {
        fprintf(stderr, "rt_keys: workers did not finish within 20 s\n");
        return 2;
    }
    /* Destructors run as each worker exits, just after it counted itself. */
    for (int i = 0; i < 2000 && __atomic_load_n(&dtor_calls, __ATOMIC_SEQ_CST) < nworkers; i++)
        sleep_ms(1);
    printf("fibers=%d on_fiber=%d initial_bad=%d bad=%d dtor_calls=%d dtor_bad=%d\n", nworkers,
           on_fiber, initial_bad, bad, dtor_calls, dtor_bad);
    return 0;
}
