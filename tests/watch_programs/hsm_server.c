/*
 * hsm_server: conn_server's shape (a thread per connection), but each request's
 * offload is a vendor library's blocking call (libxhsm.so's hsm_sign), not
 * toffload's accel_run: nothing the watcher knows by name, and a wait below libc.
 * `toffload-watch --offload hsm_sign@libxhsm.so=hsm_submit:hsm_poll:hsm_free`
 * probes it and hands the row to the injected runtime.
 */
#include "common.h"

static const char PROG[] = "hsm_server";
static struct server_opts opts;

int hsm_sign(unsigned char *buf, long n);

static int offload(unsigned char *buf, int n)
{
    return hsm_sign(buf, n);
}

static void serve(int fd)
{
    serve_requests(PROG, fd, &opts, offload);
}

int main(int argc, char **argv)
{
    server_setup(PROG, argc, argv, &opts);
    int lfd = listen_and_announce(PROG, &opts);
    accept_loop_threads(PROG, lfd, serve); /* never returns */
}
