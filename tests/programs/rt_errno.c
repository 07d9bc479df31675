/*
 * rt_errno: errno stays per fiber across yields.
 *
 * N worker threads (fibers under TOFFLOAD_FIBERIZE=all) each set errno to a
 * value unique to (worker, round), then yield: sched_yield(), usleep() or an
 * offload (accel_run), and check what errno holds afterwards. After
 * sched_yield/usleep (which succeed and so leave errno alone) it must be
 * exactly theirs; after accel_run it must at least never be another worker's
 * value (a library call may change errno even when it succeeds).
 *
 *   rt_errno [N] [ROUNDS]     prints
 *   fibers=N on_fiber=K checks=C bad=B foreign=F
 * bad: checks where errno was not the worker's own value (sched_yield/usleep);
 * foreign: checks where errno held another worker's value (any yield).
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

static int nworkers = 16, rounds = 30;
static int started, finished, on_fiber, checks, bad, foreign;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_errno: %s: %s\n", what, strerror(e));
    exit(2);
}

static int marker(int worker, int round) { return 1000 + worker * 1000 + round; }

static int owner_of(int v)
{
    if (v < 1000 || v >= 1000 + nworkers * 1000)
        return -1;
    return (v - 1000) / 1000;
}

static void *worker(void *p)
{
    int me = (int)(long)p;
    unsigned char buf[64];
    memset(buf, me, sizeof buf);
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    /* Start together, so that the workers really interleave. */
    __atomic_fetch_add(&started, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&started, __ATOMIC_SEQ_CST) < nworkers)
        sched_yield();
    for (int r = 0; r < rounds; r++) {
        int mine = marker(me, r);
        int strict = 1;
        errno = mine;
        switch (r % 3) {
        case 0:
            sched_yield();
            break;
        case 1:
            usleep(200);
            break;
        default: {
            int rc = accel_run(buf, (int)sizeof buf);
            if (rc < 0)
                die("accel_run", -rc);
            strict = 0;
            break;
        }
        }
        int seen = errno;
        __atomic_fetch_add(&checks, 1, __ATOMIC_SEQ_CST);
        if (strict && seen != mine)
            __atomic_fetch_add(&bad, 1, __ATOMIC_SEQ_CST);
        int o = owner_of(seen);
        if (o >= 0 && o != me)
            __atomic_fetch_add(&foreign, 1, __ATOMIC_SEQ_CST);
    }
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        nworkers = atoi(argv[1]);
    if (argc > 2)
        rounds = atoi(argv[2]);
    if (nworkers < 1 || nworkers > 1000 || rounds < 1 || rounds > 1000) {
        fprintf(stderr, "usage: rt_errno [N 1..1000] [ROUNDS 1..1000]\n");
        return 2;
    }
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < nworkers; i++) {
        pthread_t t;
        int e = pthread_create(&t, &a, worker, (void *)(long)i);
        if (e)
            die("pthread_create", e);
    }
    /* Poll from the (real) main thread: no dependence on pthread_join. */
    for (int i = 0; i < 20000 && __atomic_load_n(&finished, __ATOMIC_SEQ_CST) < nworkers; i++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < nworkers) {
        fprintf(stderr, "rt_errno: workers did not finish within 20 s\n");
        return 2;
    }
    printf("fibers=%d on_fiber=%d checks=%d bad=%d foreign=%d\n", nworkers, on_fiber, checks, bad,
           foreign);
    return 0;
}
