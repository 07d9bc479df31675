/*
 * rt_mutex: a pthread mutex held across an offload.
 *
 * Phase 1 ("hold"): N workers (fibers under TOFFLOAD_FIBERIZE=all) each do
 * ROUNDS of: trylock (counting EBUSY), lock, read a shared counter, accel_run,
 * write counter+1, unlock. The holder parks in accel_run with the mutex held,
 * so every other worker finds it locked. A fiber-aware mutex parks the waiter;
 * glibc's blocks the carrier, and with the holder parked on that same carrier
 * nothing ever runs again (the test bounds that with a timeout).
 *   prints: fibers=N on_fiber=K counter=C expected=E busy=B
 * Phase 2 ("timed"): fiber H locks m2 and sleeps 200 ms holding it; fiber T
 * tries pthread_mutex_timedlock(m2, now + 50 ms) (must fail with ETIMEDOUT
 * after ~50 ms), then pthread_mutex_lock(m2) (must succeed once H unlocks);
 * a ticker fiber counts 1 ms sleeps meanwhile.
 *   prints: timedlock_rc=R timedlock_ms=X lock_ms=Y ticks=T
 * Phase 3 ("cross"): the real main thread holds m3 for 100 ms while a fiber
 * waits in pthread_mutex_lock(m3) (the ticker must keep ticking: x_ticks),
 * then the fiber holds m3 across a 100 ms sleep while the main thread waits
 * in pthread_mutex_lock(m3).
 *   prints: x_fiber_ms=A x_ticks=T x_main_ms=B
 * Exit 0 once all phases ran (the test judges the numbers).
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

static const int NWORKERS = 4, ROUNDS = 5;
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER, m2 = PTHREAD_MUTEX_INITIALIZER;
static long counter;
static int started, finished, on_fiber, busy;
static int held, stop_ticks, ticks, timedlock_rc = -1;
static double timedlock_ms, lock_ms;
static pthread_mutex_t m3 = PTHREAD_MUTEX_INITIALIZER;
static int x_state;
static double x_fiber_ms;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_mutex: %s: %s\n", what, strerror(e));
    exit(2);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
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

static int wait_for(int *n, int want, int timeout_ms)
{
    for (int i = 0; i < timeout_ms && __atomic_load_n(n, __ATOMIC_SEQ_CST) < want; i++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return __atomic_load_n(n, __ATOMIC_SEQ_CST) >= want ? 0 : -1;
}

static void *holder(void *p)
{
    (void)p;
    unsigned char buf[64] = {0};
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&started, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&started, __ATOMIC_SEQ_CST) < NWORKERS)
        sched_yield();
    for (int r = 0; r < ROUNDS; r++) {
        int e = pthread_mutex_trylock(&m);
        if (e == EBUSY) {
            __atomic_fetch_add(&busy, 1, __ATOMIC_SEQ_CST);
            e = pthread_mutex_lock(&m);
        }
        if (e)
            die("pthread_mutex_lock", e);
        long v = counter;
        int rc = accel_run(buf, (int)sizeof buf);
        if (rc < 0)
            die("accel_run", -rc);
        counter = v + 1;
        if ((e = pthread_mutex_unlock(&m)))
            die("pthread_mutex_unlock", e);
    }
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *timed_holder(void *p)
{
    (void)p;
    int e = pthread_mutex_lock(&m2);
    if (e)
        die("pthread_mutex_lock(m2)", e);
    __atomic_store_n(&held, 1, __ATOMIC_SEQ_CST);
    usleep(200 * 1000);
    if ((e = pthread_mutex_unlock(&m2)))
        die("pthread_mutex_unlock(m2)", e);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *timed_waiter(void *p)
{
    (void)p;
    while (!__atomic_load_n(&held, __ATOMIC_SEQ_CST))
        usleep(1000);
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_nsec += 50 * 1000 * 1000;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    double t0 = now_ms();
    timedlock_rc = pthread_mutex_timedlock(&m2, &dl);
    timedlock_ms = now_ms() - t0;
    if (timedlock_rc == 0)
        pthread_mutex_unlock(&m2);
    t0 = now_ms();
    int e = pthread_mutex_lock(&m2);
    lock_ms = now_ms() - t0;
    if (e)
        die("pthread_mutex_lock(m2) after timedlock", e);
    pthread_mutex_unlock(&m2);
    __atomic_store_n(&stop_ticks, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *ticker(void *p)
{
    (void)p;
    while (!__atomic_load_n(&stop_ticks, __ATOMIC_SEQ_CST)) {
        usleep(1000);
        if (__atomic_load_n(&held, __ATOMIC_SEQ_CST))
            __atomic_fetch_add(&ticks, 1, __ATOMIC_SEQ_CST);
        sched_yield(); /* lets others run even where usleep blocks the carrier */
    }
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *cross_fiber(void *p)
{
    (void)p;
    double t0 = now_ms();
    __atomic_store_n(&x_state, 1, __ATOMIC_SEQ_CST);
    int e = pthread_mutex_lock(&m3); /* the main thread holds it for ~100 ms */
    if (e)
        die("pthread_mutex_lock(m3)", e);
    x_fiber_ms = now_ms() - t0;
    __atomic_store_n(&x_state, 2, __ATOMIC_SEQ_CST);
    usleep(100 * 1000); /* hold it; the main thread waits */
    pthread_mutex_unlock(&m3);
    __atomic_store_n(&stop_ticks, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

int main(void)
{
    for (int i = 0; i < NWORKERS; i++)
        spawn(holder, NULL);
    if (wait_for(&finished, NWORKERS, 20000) < 0) {
        fprintf(stderr, "rt_mutex: phase 1 did not finish within 20 s\n");
        return 2;
    }
    printf("fibers=%d on_fiber=%d counter=%ld expected=%d busy=%d\n", NWORKERS, on_fiber, counter,
           NWORKERS * ROUNDS, busy);
    fflush(stdout);

    __atomic_store_n(&finished, 0, __ATOMIC_SEQ_CST);
    spawn(ticker, NULL);
    spawn(timed_holder, NULL);
    spawn(timed_waiter, NULL);
    if (wait_for(&finished, 3, 20000) < 0) {
        fprintf(stderr, "rt_mutex: phase 2 did not finish within 20 s\n");
        return 2;
    }
    printf("timedlock_rc=%d timedlock_ms=%.1f lock_ms=%.1f ticks=%d\n", timedlock_rc, timedlock_ms,
           lock_ms, ticks);
    fflush(stdout);

    /* Phase 3 */
    __atomic_store_n(&finished, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&stop_ticks, 0, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&m3);
    spawn(cross_fiber, NULL);
    spawn(ticker, NULL); /* counts while `held` is set, which it still is */
    wait_for(&x_state, 1, 5000);
    int k0 = __atomic_load_n(&ticks, __ATOMIC_SEQ_CST);
    sleep_ms(100);
    int x_ticks = __atomic_load_n(&ticks, __ATOMIC_SEQ_CST) - k0;
    pthread_mutex_unlock(&m3);
    wait_for(&x_state, 2, 5000);
    double t0 = now_ms();
    int e = pthread_mutex_lock(&m3); /* the fiber holds it for ~100 ms */
    double x_main_ms = now_ms() - t0;
    if (e)
        die("pthread_mutex_lock(m3) in main", e);
    pthread_mutex_unlock(&m3);
    if (wait_for(&finished, 2, 20000) < 0) {
        fprintf(stderr, "rt_mutex: phase 3 did not finish within 20 s\n");
        return 2;
    }
    printf("x_fiber_ms=%.1f x_ticks=%d x_main_ms=%.1f\n", x_fiber_ms, x_ticks, x_main_ms);
    return 0;
}
