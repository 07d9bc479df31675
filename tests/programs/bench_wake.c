/*
 * bench_wake: the round trip of a hand-off between two CPUs that idle in between, what
 * a request of a loop bound by its connections pays outside the server's CPU work: the
 * client's thread woken on its CPU by the answer, the server's woken on its own by the
 * next request. Two threads pinned to two CPUs pass a byte over two pipes; before each
 * round the first sleeps GAP us so that both CPUs go idle (a vCPU halts), as the
 * loop's do between requests.
 *
 * usage: bench_wake [CPU_A CPU_B [GAP_US [ROUNDS]]]   (default 0 1 300 2000)
 * prints: rounds=N gap_us=G rtt_p10_us=.. rtt_p50_us=.. rtt_p90_us=.. rtt_mean_us=..
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static int ping[2], pong[2];
static int rounds = 2000, cpu_b = 1;

static void pin(int cpu)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    if (sched_setaffinity(0, sizeof s, &s) != 0) {
        perror("bench_wake: sched_setaffinity");
        exit(1);
    }
}

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static void *echo(void *arg)
{
    (void)arg;
    pin(cpu_b);
    char c;
    for (int i = 0; i < rounds; i++)
        if (read(ping[0], &c, 1) != 1 || write(pong[1], &c, 1) != 1)
            exit(1);
    return NULL;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int cpu_a = argc > 1 ? atoi(argv[1]) : 0;
    cpu_b = argc > 2 ? atoi(argv[2]) : 1;
    int gap = argc > 3 ? atoi(argv[3]) : 300;
    rounds = argc > 4 ? atoi(argv[4]) : 2000;
    if (rounds < 10 || gap < 0) {
        fprintf(stderr, "usage: bench_wake [CPU_A CPU_B [GAP_US [ROUNDS>=10]]]\n");
        return 2;
    }
    double *rtt = malloc(sizeof(double) * (size_t)rounds);
    pthread_t t;
    if (!rtt || pipe(ping) || pipe(pong) || pthread_create(&t, NULL, echo, NULL)) {
        perror("bench_wake");
        return 1;
    }
    pin(cpu_a);
    char c = 'x';
    double sum = 0;
    for (int i = 0; i < rounds; i++) {
        if (gap)
            usleep((useconds_t)gap);
        double t0 = now_us();
        if (write(ping[1], &c, 1) != 1 || read(pong[0], &c, 1) != 1)
            return 1;
        rtt[i] = now_us() - t0;
        sum += rtt[i];
    }
    pthread_join(t, NULL);
    qsort(rtt, (size_t)rounds, sizeof(double), cmp);
    printf("rounds=%d gap_us=%d rtt_p10_us=%.1f rtt_p50_us=%.1f rtt_p90_us=%.1f rtt_mean_us=%.1f\n",
           rounds, gap, rtt[rounds / 10], rtt[rounds / 2], rtt[rounds * 9 / 10], sum / rounds);
    return 0;
}
