/*
 * kwake K FIFO: K rounds of one offload (accel_run, TOFFLOAD_WAIT=spin) and a
 * one-byte write to FIFO, then a 300 us sleep, for toffload-watch's test of the
 * wake-ups a server makes of its clients: each write wakes the FIFO's reader (a
 * process outside the watch, on another CPU), which has had the sleep to go idle.
 * Prints "DONE". Built by `cargo xtask build`.
 */
#include "toffload_accel.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 3 || atoi(argv[1]) <= 0) {
        fprintf(stderr, "usage: kwake K FIFO\n");
        return 2;
    }
    int k = atoi(argv[1]);
    int fd = open(argv[2], O_WRONLY);
    if (fd < 0) {
        perror("kwake: open");
        return 1;
    }
    unsigned char buf[64] = {0};
    struct timespec ts = {0, 300 * 1000};
    for (int i = 0; i < k; i++) {
        int r = accel_run(buf, sizeof buf);
        if (r != 0) {
            fprintf(stderr, "kwake: accel_run: %d\n", r);
            return 1;
        }
        if (write(fd, "x", 1) != 1) {
            perror("kwake: write");
            return 1;
        }
        nanosleep(&ts, NULL);
    }
    close(fd);
    printf("DONE\n");
    return 0;
}
