/*
 * hsm_server: conn_server's shape (a thread per connection), but each request's
 * offload is a vendor library's blocking call (libxhsm.so's hsm_sign), not
 * toffload's accel_run: nothing the watcher knows by name, and a wait below libc.
 * `toffload-watch --offload hsm_sign@libxhsm.so=hsm_submit:hsm_poll:hsm_free`
 * probes it and hands the row to the injected runtime.
 */
#include "common.h"

static const char PROG[] = "hsm_server";

int hsm_sign(unsigned char *buf, long n);

static int offload(unsigned char *buf, int n)
{
    return hsm_sign(buf, n);
}

int main(int argc, char **argv)
{
    thread_per_connection_main(PROG, argc, argv, offload); /* never returns */
}
