/*
 * rt_timeouts: timeouts are honoured on fibers, and other fibers keep running
 * while one waits.
 *
 * Each check runs in a fiber (TOFFLOAD_FIBERIZE=all) while a ticker fiber counts
 * 1 ms sleeps; nobody ever signals or writes, so every call must time out:
 *   tw: pthread_cond_timedwait, CLOCK_REALTIME deadline 200 ms ahead
 *   cw: pthread_cond_clockwait, CLOCK_MONOTONIC deadline 100 ms ahead
 *   poll: poll() on an empty pipe, 200 ms
 *   ppoll: ppoll() on an empty pipe, 100 ms
 *   sel: select() on an empty pipe, 100 ms
 * For each it prints NAME_rc=R NAME_ms=ELAPSED NAME_ticks=TICKS (the ticker's
 * count during the call), and at the end on_fiber=K checks=5.
 */
#define _GNU_SOURCE
#include "common.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <time.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
static int ticks, stop_ticks, finished, on_fiber;
static int pfd[2];

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_timeouts: %s: %s\n", what, strerror(e));
    exit(2);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void deadline(clockid_t clk, int ms, struct timespec *ts)
{
    clock_gettime(clk, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
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

static void *ticker(void *p)
{
    (void)p;
    while (!__atomic_load_n(&stop_ticks, __ATOMIC_SEQ_CST)) {
        usleep(1000);
        __atomic_fetch_add(&ticks, 1, __ATOMIC_SEQ_CST);
        sched_yield(); /* lets others run even where usleep blocks the carrier */
    }
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void report(const char *name, int rc, double t0, int ticks0)
{
    double ms = now_ms() - t0;
    int dt = __atomic_load_n(&ticks, __ATOMIC_SEQ_CST) - ticks0;
    printf("%s_rc=%d %s_ms=%.1f %s_ticks=%d\n", name, rc, name, ms, name, dt);
    fflush(stdout);
}

static void *checker(void *p)
{
    (void)p;
    if (fiber_id() > 0)
        __atomic_store_n(&on_fiber, 1, __ATOMIC_SEQ_CST);
    /* Let the ticker start. */
    usleep(20 * 1000);
    struct timespec dl;
    double t0;
    int k0, rc;

    pthread_mutex_lock(&m);
    deadline(CLOCK_REALTIME, 200, &dl);
    k0 = __atomic_load_n(&ticks, __ATOMIC_SEQ_CST);
    t0 = now_ms();
    rc = pthread_cond_timedwait(&c, &m, &dl);
    pthread_mutex_unlock(&m);
    report("tw", rc, t0, k0);

    pthread_mutex_lock(&m);
    deadline(CLOCK_MONOTONIC, 100, &dl);
    k0 = __atomic_load_n(&ticks, __ATOMIC_SEQ_CST);
    t0 = now_ms();
    rc = pthread_cond_clockwait(&c, &m, CLOCK_MONOTONIC, &dl);
    pthread_mutex_unlock(&m);
    report("cw", rc, t0, k0);

    struct pollfd pf = {.fd = pfd[0], .events = POLLIN};
    k0 = __atomic_load_n(&ticks, __ATOMIC_SEQ_CST);
    t0 = now_ms();
    rc = poll(&pf, 1, 200);
    report("poll", rc, t0, k0);

    struct timespec rel = {0, 100 * 1000 * 1000};
    k0 = __atomic_load_n(&ticks, __ATOMIC_SEQ_CST);
    t0 = now_ms();
    rc = ppoll(&pf, 1, &rel, NULL);
    report("ppoll", rc, t0, k0);

    fd_set rs;
    FD_ZERO(&rs);
    FD_SET(pfd[0], &rs);
    struct timeval tv = {0, 100 * 1000};
    k0 = __atomic_load_n(&ticks, __ATOMIC_SEQ_CST);
    t0 = now_ms();
    rc = select(pfd[0] + 1, &rs, NULL, NULL, &tv);
    report("sel", rc, t0, k0);

    __atomic_store_n(&stop_ticks, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(void)
{
    if (pipe(pfd) < 0)
        die("pipe", errno);
    spawn(ticker, NULL);
    spawn(checker, NULL);
    for (int i = 0; i < 20000 && __atomic_load_n(&finished, __ATOMIC_SEQ_CST) < 2; i++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < 2) {
        fprintf(stderr, "rt_timeouts: did not finish within 20 s\n");
        return 2;
    }
    printf("on_fiber=%d checks=5\n", on_fiber);
    return 0;
}
