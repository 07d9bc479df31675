/*
 * kcount K: exactly K raw futex calls, K voluntary context switches and K offloads,
 * each from the main thread, for toffload-watch's counting test. The futex calls are
 * FUTEX_WAKE on a private word nobody waits on (one syscall each, no switch); the
 * switches are 20 us sleeps (each puts the thread to sleep once); the offloads are
 * accel_run with TOFFLOAD_WAIT=spin (no futex, no sleep). Prints "DONE" at the end.
 * Built by `cargo xtask build` (with the servers' common.c, unused here).
 */
#include "toffload_accel.h"

#include <linux/futex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static uint32_t word;

int main(int argc, char **argv)
{
    if (argc != 2 || atoi(argv[1]) <= 0) {
        fprintf(stderr, "usage: kcount K\n");
        return 2;
    }
    int k = atoi(argv[1]);
    /* Per-phase cost on stderr: what watching adds per event shows as the
     * difference between a watched and an unwatched run. */
    double t0 = now_ns();
    for (int i = 0; i < k; i++)
        syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    double t1 = now_ns();
    struct timespec ts = {0, 20 * 1000};
    for (int i = 0; i < k; i++)
        nanosleep(&ts, NULL);
    double t2 = now_ns();
    unsigned char buf[64] = {0};
    for (int i = 0; i < k; i++) {
        int r = accel_run(buf, sizeof buf);
        if (r != 0) {
            fprintf(stderr, "kcount: accel_run: %d\n", r);
            return 1;
        }
    }
    double t3 = now_ns();
    fprintf(stderr, "kcount: ns per futex %.0f, per sleep %.0f, per offload %.0f\n",
            (t1 - t0) / k, (t2 - t1) / k, (t3 - t2) / k);
    printf("DONE\n");
    return 0;
}
