/*
 * bench_switch: the cost of one fiber park + resume. Two threads hand a token back
 * and forth; a thread that does not hold the token calls sched_yield(). Under
 * libtoffload.so with TOFFLOAD_FIBERIZE=all both threads are fibers on one carrier
 * and every handoff is exactly one yield: park the running fiber, resume the other.
 * Without the runtime (or pinned to one CPU) it measures the kernel's sched_yield
 * between two threads instead, which the output says.
 *
 * Each player counts its yields in a 320-byte __thread array too (about mariadbd's
 * own TLS), so that the runtime's per-fiber TLS copy (TOFFLOAD_FIBER_TLS) is part of
 * the cost; a count that differs from the player's own says TLS was shared.
 *
 * usage: bench_switch [HANDOFFS]   (default 2000000)
 * prints: handoffs=N yields=Y ns_per_switch=X fibers=F
 *   ns_per_switch: wall time / yields (one park + one resume each);
 *   fibers: 1 if both threads ran as fibers (toffload_fiber_id() > 0), else 0;
 *   tls_own: 1 if each player's __thread count matched its own yields.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

long toffload_fiber_id(void) __attribute__((weak));

static long handoffs = 2000000;
static int turn;            /* whose move: 0 or 1 */
static int go;              /* set by main once both threads exist */
static long yields[2];
static int fiber[2];
static struct timespec t_start, t_end;
static __thread long tls_yields[40];
static int tls_own[2];

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void *player(void *arg)
{
    int me = (int)(long)arg;
    fiber[me] = toffload_fiber_id && toffload_fiber_id() > 0;
    while (!__atomic_load_n(&go, __ATOMIC_ACQUIRE))
        sched_yield();
    if (me == 0)
        clock_gettime(CLOCK_MONOTONIC, &t_start);
    long y = 0;
    /* Each player takes its turn handoffs/2 times (player 0 first). */
    for (long k = 0; k < handoffs / 2; k++) {
        while (__atomic_load_n(&turn, __ATOMIC_ACQUIRE) != me) {
            sched_yield();
            y++;
            tls_yields[y & 31]++;
        }
        __atomic_store_n(&turn, 1 - me, __ATOMIC_RELEASE);
    }
    yields[me] = y;
    long t = 0;
    for (int i = 0; i < 40; i++)
        t += tls_yields[i];
    tls_own[me] = t == y;
    if (me == 1)
        clock_gettime(CLOCK_MONOTONIC, &t_end);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1) {
        char *end;
        handoffs = strtol(argv[1], &end, 10);
        if (*end || handoffs < 2) {
            fprintf(stderr, "usage: bench_switch [HANDOFFS >= 2]\n");
            return 2;
        }
    }
    pthread_t t[2];
    for (long i = 0; i < 2; i++) {
        int e = pthread_create(&t[i], NULL, player, (void *)i);
        if (e) {
            fprintf(stderr, "bench_switch: pthread_create: error %d\n", e);
            return 1;
        }
    }
    double t0 = now_ns();
    __atomic_store_n(&go, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    double wall = now_ns() - t0;
    double ns = ((double)t_end.tv_sec - (double)t_start.tv_sec) * 1e9 +
                ((double)t_end.tv_nsec - (double)t_start.tv_nsec);
    long y = yields[0] + yields[1];
    if (y == 0) {
        fprintf(stderr, "bench_switch: no yields (wall %.0f ns)\n", wall);
        return 1;
    }
    printf("handoffs=%ld yields=%ld ns_per_switch=%.1f fibers=%d tls_own=%d\n", handoffs, y,
           ns / (double)y, fiber[0] && fiber[1], tls_own[0] && tls_own[1]);
    return 0;
}
