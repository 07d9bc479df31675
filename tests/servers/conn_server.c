/*
 * conn_server: thread-per-connection, plain blocking style. Each connection
 * thread reads a --size request, burns --cpu-us of CPU, transforms the buffer
 * with the blocking accel_run() and writes it back. Under the toffload
 * runtime these threads become fibers and accel_run's wait is hidden.
 */
#include "common.h"
#include "toffload_accel.h"

#include <stdio.h>
#include <stdlib.h>

static const char PROG[] = "conn_server";

/* Set once in main before the first thread is created; read-only after. */
static struct server_opts opts;

static void serve(int fd)
{
    unsigned char *buf = malloc(opts.size);
    if (!buf) {
        fprintf(stderr, "%s: malloc(%zu) failed\n", PROG, opts.size);
        return;
    }
    /* EOF, reset or any I/O error just ends the connection: clients resetting
     * is normal, so nothing is reported. */
    while (read_full(fd, buf, opts.size) > 0) {
        cpu_work(opts.cpu_us);
        int rc = accel_run(buf, (int)opts.size);
        if (rc < 0) {
            warn_errno(PROG, "accel_run", -rc);
            break;
        }
        if (write_full(fd, buf, opts.size) < 0)
            break;
    }
    free(buf);
}

int main(int argc, char **argv)
{
    server_setup(PROG, argc, argv, &opts);
    int lfd = listen_and_announce(PROG, &opts);
    accept_loop_threads(PROG, lfd, serve); /* never returns */
}
