/*
 * rt_sslerr: the OpenSSL error queue stays per fiber across yields.
 *
 * N workers (fibers under TOFFLOAD_FIBERIZE=all) each clear their queue, raise
 * one error whose reason code is unique to (worker, round), yield
 * (sched_yield, usleep or accel_run), and then check that the oldest error in
 * their queue is theirs and that it is the only one. OpenSSL keeps the queue in
 * thread-local state reached through pthread_getspecific, so fibers sharing a
 * carrier share it unless the runtime gives each fiber its own keys.
 *
 *   rt_sslerr [N] [ROUNDS]     prints
 *   fibers=N on_fiber=K checks=C bad=B
 */
#define _GNU_SOURCE
#include "common.h"
#include "toffload_accel.h"

#include <errno.h>
#include <openssl/err.h>
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
static int started, finished, on_fiber, checks, bad;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_sslerr: %s: %s\n", what, strerror(e));
    exit(2);
}

static void *worker(void *p)
{
    int me = (int)(long)p;
    unsigned char buf[64];
    memset(buf, me, sizeof buf);
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&started, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&started, __ATOMIC_SEQ_CST) < nworkers)
        sched_yield();
    for (int r = 0; r < rounds; r++) {
        int reason = 1 + me * 1000 + r; /* < 2^23: fits an OpenSSL 3 reason code */
        ERR_clear_error();
        ERR_raise(ERR_LIB_USER, reason);
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
            break;
        }
        }
        unsigned long e = ERR_peek_error();
        int ok = e != 0 && ERR_GET_LIB(e) == ERR_LIB_USER && ERR_GET_REASON(e) == reason;
        int n = 0;
        while (ERR_get_error() != 0)
            n++;
        __atomic_fetch_add(&checks, 1, __ATOMIC_SEQ_CST);
        if (!ok || n != 1)
            __atomic_fetch_add(&bad, 1, __ATOMIC_SEQ_CST);
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
        fprintf(stderr, "usage: rt_sslerr [N 1..1000] [ROUNDS 1..1000]\n");
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
    for (int i = 0; i < 20000 && __atomic_load_n(&finished, __ATOMIC_SEQ_CST) < nworkers; i++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < nworkers) {
        fprintf(stderr, "rt_sslerr: workers did not finish within 20 s\n");
        return 2;
    }
    printf("fibers=%d on_fiber=%d checks=%d bad=%d\n", nworkers, on_fiber, checks, bad);
    return 0;
}
