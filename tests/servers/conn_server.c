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
    serve_requests(PROG, fd, &opts, accel_run);
}

int main(int argc, char **argv)
{
    server_setup(PROG, argc, argv, &opts);
    int lfd = listen_and_announce(PROG, &opts);
    accept_loop_threads(PROG, lfd, serve); /* never returns */
}
