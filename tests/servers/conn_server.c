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


int main(int argc, char **argv)
{
    thread_per_connection_main(PROG, argc, argv, accel_run); /* never returns */
}
