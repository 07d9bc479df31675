/*
 * kmix K BUSY_US: K rounds of one offload (accel_run, TOFFLOAD_WAIT=spin), BUSY_US of
 * the thread's own CPU time, and one 20 us sleep, each from the main thread, for
 * toffload-watch's test of the request's outside CPU and of the syscalls that sleep
 * outside the offload. Each outside part (an offload's return to the next call) is
 * the busy loop plus the sleep's on-CPU share: K - 1 of them close. Prints "DONE".
 * Built by `cargo xtask build`.
 */
#include "toffload_accel.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double cpu_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv)
{
    if (argc != 3 || atoi(argv[1]) <= 0 || atoi(argv[2]) < 0) {
        fprintf(stderr, "usage: kmix K BUSY_US\n");
        return 2;
    }
    int k = atoi(argv[1]);
    double busy = atof(argv[2]);
    unsigned char buf[64] = {0};
    struct timespec ts = {0, 20 * 1000};
    for (int i = 0; i < k; i++) {
        int r = accel_run(buf, sizeof buf);
        if (r != 0) {
            fprintf(stderr, "kmix: accel_run: %d\n", r);
            return 1;
        }
        /* On-CPU time, not wall time: a preempted loop still burns BUSY_US. */
        double end = cpu_us() + busy;
        while (cpu_us() < end)
            ;
        nanosleep(&ts, NULL);
    }
    printf("DONE\n");
    return 0;
}
