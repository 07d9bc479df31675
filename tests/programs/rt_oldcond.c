/*
 * rt_oldcond: a binary bound to glibc's old (GLIBC_2.2.5) condition-variable ABI.
 *
 * glibc exports pthread_cond_* twice: the current ABI at GLIBC_2.3.2 and the
 * old one at GLIBC_2.2.5, whose functions use only the first word of the
 * object, as a pointer to a lazily allocated real condition variable
 * (nptl/old_pthread_cond_*.c). This program binds to the old versions with
 * .symver, gives each condition variable exactly that one word followed by
 * canaries, and uses them between real threads and fibers
 * (TOFFLOAD_FIBERIZE=all):
 *   - 4 waiter threads wait for a generation counter; the real main thread
 *     bumps it 3 times with broadcast, then once with 4 signals;
 *   - a timedwait nobody signals must time out after ~100 ms;
 *   - a zero-initialised (static) old condition variable used without init;
 *   - destroy.
 * Anything that treats the one-word object as a current-ABI pthread_cond_t
 * (48 bytes) overwrites the canaries.
 *   prints: waits_done woken=W canary_bad_so_far=C (flushed), then at the end
 *           woken=W expected=16 on_fiber=K timedwait_rc=R timedwait_ms=X static_ok=0|1 canary_bad=C
 */
#define _GNU_SOURCE
#include "common.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

/* The old ABI's object: one pointer (glibc's pthread_cond_2_0_t). */
typedef struct {
    void *cond;
} old_cond_t;

int old_cond_init(old_cond_t *c, const pthread_condattr_t *a);
int old_cond_destroy(old_cond_t *c);
int old_cond_signal(old_cond_t *c);
int old_cond_broadcast(old_cond_t *c);
int old_cond_wait(old_cond_t *c, pthread_mutex_t *m);
int old_cond_timedwait(old_cond_t *c, pthread_mutex_t *m, const struct timespec *abs);
__asm__(".symver old_cond_init, pthread_cond_init@GLIBC_2.2.5");
__asm__(".symver old_cond_destroy, pthread_cond_destroy@GLIBC_2.2.5");
__asm__(".symver old_cond_signal, pthread_cond_signal@GLIBC_2.2.5");
__asm__(".symver old_cond_broadcast, pthread_cond_broadcast@GLIBC_2.2.5");
__asm__(".symver old_cond_wait, pthread_cond_wait@GLIBC_2.2.5");
__asm__(".symver old_cond_timedwait, pthread_cond_timedwait@GLIBC_2.2.5");

#define NCANARY 12
#define CANARY 0xc0ffee11deadbeefull
struct guarded {
    old_cond_t c;
    uint64_t canary[NCANARY];
};

static struct guarded gc, gt, gs; /* gs: never initialised, zero like the old static initializer */
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static int generation, woken, waiting, on_fiber, finished;

enum { WAITERS = 4 };

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_oldcond: %s: %s\n", what, strerror(e));
    exit(2);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void arm(struct guarded *g)
{
    for (int i = 0; i < NCANARY; i++)
        g->canary[i] = CANARY;
}

static int smashed(const struct guarded *g)
{
    int n = 0;
    for (int i = 0; i < NCANARY; i++)
        n += g->canary[i] != CANARY;
    return n;
}

static void *waiter(void *p)
{
    (void)p;
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    int seen = 0;
    pthread_mutex_lock(&m);
    waiting++;
    for (int round = 0; round < 4; round++) {
        while (generation == seen) {
            int e = old_cond_wait(&gc.c, &m);
            if (e)
                die("pthread_cond_wait@GLIBC_2.2.5", e);
        }
        seen = generation;
        woken++;
        waiting++;
    }
    pthread_mutex_unlock(&m);
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

/* Waits until every waiter is back in its wait (waiting counts entries). */
static int wait_waiting(int want)
{
    for (int i = 0; i < 5000; i++) {
        pthread_mutex_lock(&m);
        int w = waiting;
        pthread_mutex_unlock(&m);
        if (w >= want)
            return 0;
        sleep_ms(1);
    }
    return -1;
}

int main(void)
{
    arm(&gc);
    arm(&gt);
    arm(&gs);
    int e = old_cond_init(&gc.c, NULL);
    if (!e)
        e = old_cond_init(&gt.c, NULL);
    if (e)
        die("pthread_cond_init@GLIBC_2.2.5", e);

    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < WAITERS; i++) {
        pthread_t t;
        if ((e = pthread_create(&t, &a, waiter, NULL)))
            die("pthread_create", e);
    }
    int expected_waiting = WAITERS;
    for (int round = 0; round < 4; round++) {
        if (wait_waiting(expected_waiting) < 0) {
            fprintf(stderr, "rt_oldcond: waiters stuck in round %d (woken=%d)\n", round, woken);
            printf("woken=%d expected=%d canary_bad=%d\n", woken, WAITERS * 4,
                   smashed(&gc) + smashed(&gt) + smashed(&gs));
            return 3;
        }
        sleep_ms(5); /* let the last one get from the count into its wait */
        pthread_mutex_lock(&m);
        generation++;
        if (round < 3) {
            e = old_cond_broadcast(&gc.c);
        } else {
            for (int i = 0; i < WAITERS && !e; i++)
                e = old_cond_signal(&gc.c);
        }
        pthread_mutex_unlock(&m);
        if (e)
            die("pthread_cond_broadcast/signal@GLIBC_2.2.5", e);
        expected_waiting += WAITERS;
    }
    for (int i = 0; i < 5000 && __atomic_load_n(&finished, __ATOMIC_SEQ_CST) < WAITERS; i++)
        sleep_ms(1);
    printf("waits_done woken=%d canary_bad_so_far=%d\n", woken,
           smashed(&gc) + smashed(&gt) + smashed(&gs));
    fflush(stdout);

    /* A timed wait nobody signals. */
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_nsec += 100 * 1000 * 1000;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&m);
    double t0 = now_ms();
    int trc = old_cond_timedwait(&gt.c, &m, &dl);
    double tms = now_ms() - t0;
    pthread_mutex_unlock(&m);

    /* The zero-initialised one: signal with nobody waiting, then a short timed wait. */
    int src = old_cond_signal(&gs.c);
    clock_gettime(CLOCK_REALTIME, &dl);
    pthread_mutex_lock(&m);
    int swait = old_cond_timedwait(&gs.c, &m, &dl); /* deadline already passed */
    pthread_mutex_unlock(&m);
    int static_ok = src == 0 && swait == ETIMEDOUT;

    e = old_cond_destroy(&gc.c);
    if (!e)
        e = old_cond_destroy(&gt.c);
    if (!e)
        e = old_cond_destroy(&gs.c);
    if (e)
        die("pthread_cond_destroy@GLIBC_2.2.5", e);

    printf("woken=%d expected=%d on_fiber=%d timedwait_rc=%d timedwait_ms=%.1f static_ok=%d "
           "canary_bad=%d\n",
           woken, WAITERS * 4, on_fiber, trc, tms, static_ok,
           smashed(&gc) + smashed(&gt) + smashed(&gs));
    return 0;
}
