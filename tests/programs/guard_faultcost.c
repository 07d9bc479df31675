/*
 * guard_faultcost: the cost of one guard fault, for `cargo xtask bench guard`.
 * One fiber (TOFFLOAD_FIBERIZE=all) repeats N times: touch a guarded page, then end
 * the "handler" the way the guard sees handlers end (a 1-byte write to a socket,
 * drained by the same loop), and yield (a switch: detect re-arms the page there).
 * Under detect that is one write fault per iteration, under enforce one ownership
 * fault. Run it with TOFFLOAD_GUARD=off for the baseline; the difference per
 * iteration is a fault's cost. Prints "ns=<per iteration>".
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
struct page {
    long v;
    char rest[PAGE - sizeof(long)];
};
struct page guarded __attribute__((aligned(PAGE)));

static long n = 20000;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static void *body(void *arg)
{
    (void)arg;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
        exit(1);
    char c = 0;
    double t0 = now();
    for (long i = 0; i < n; i++) {
        guarded.v++;
        if (write(sv[0], &c, 1) != 1 || read(sv[1], &c, 1) != 1)
            exit(1);
        sched_yield();
    }
    double t1 = now();
    printf("ns=%.1f\n", (t1 - t0) / n);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        n = atol(argv[1]);
    pthread_t t;
    if (pthread_create(&t, NULL, body, NULL) != 0)
        return 1;
    pthread_join(t, NULL);
    return 0;
}
