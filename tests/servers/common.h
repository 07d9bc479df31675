/*
 * Shared helpers for the example servers (conn_server, evloop_server,
 * hostile_server). Every server speaks the same protocol: the client sends
 * fixed-size requests of --size bytes, the server transforms each one with
 * accel_run() and sends back the same number of bytes, in order.
 */
#ifndef TOFFLOAD_SERVERS_COMMON_H
#define TOFFLOAD_SERVERS_COMMON_H

#include <stddef.h>

#define MAX_REQ_SIZE ((size_t)64 << 20)

struct server_opts {
    const char *addr; /* IPv4 address to bind, default 127.0.0.1 */
    int port;         /* 0 = ephemeral */
    size_t size;      /* request (and response) size in bytes */
    double cpu_us;    /* CPU work per request, microseconds */
    int shared_mutex; /* 1: each request updates shared totals under one mutex */
};

/* Parse arguments (exit 2 on a bad flag, 0 after --help), ignore SIGPIPE,
 * raise RLIMIT_NOFILE to its hard limit and calibrate cpu_work (only when
 * --cpu-us > 0). Creates no threads, so callers may still set signal masks. */
void server_setup(const char *prog, int argc, char **argv, struct server_opts *o);

/* Blocking listening socket on o->addr:o->port; prints "READY port=<p>" on
 * stdout and flushes it. Exits 1 on failure. */
int listen_and_announce(const char *prog, const struct server_opts *o);

/* 1: n bytes read. 0: clean EOF before the first byte. -1: error, or EOF
 * in the middle (errno = EPROTO). Retries EINTR and short reads. */
int read_full(int fd, void *buf, size_t n);

/* 0: all n bytes written. -1: error. Retries EINTR and short writes. */
int write_full(int fd, const void *buf, size_t n);

/* Burn about `us` microseconds of CPU with a real computation. */
void cpu_work(double us);

/* setsockopt TCP_NODELAY; 0 or -1 (errno set). */
int set_nodelay(int fd);

/* Close, reporting a failure other than EINTR on stderr. */
void close_fd(const char *prog, int fd);

/* "prog: what: strerror(err)" on stderr; thread-safe. */
void warn_errno(const char *prog, const char *what, int err);

/* Classify an accept() errno: 1 retry now, 2 transient resource shortage
 * (already reported; back off before retrying), 0 fatal. */
int accept_error_kind(const char *prog, int err);

/* Main-thread accept loop: for every accepted connection, create a detached
 * thread (after accept, so a fiber runtime can tell connection threads apart)
 * that runs serve(fd) and then closes fd. Never returns. */
/* One connection's request loop: read a request, run the CPU work, offload it
 * (accel_run, or a server's wrapper around it), write the answer back. Ends on
 * EOF, any I/O error (a client reset is normal, so unreported) or a failed
 * offload (reported). Frees what it allocates; the caller closes fd. */
void serve_requests(const char *prog, int fd, const struct server_opts *o,
                    int (*offload)(unsigned char *buf, int n));

void accept_loop_threads(const char *prog, int lfd, void (*serve)(int fd));

/* A whole thread-per-connection server: setup, listen, then a thread per accepted
 * connection serving requests through `offload`. Never returns. */
void thread_per_connection_main(const char *prog, int argc, char **argv,
                                int (*offload)(unsigned char *buf, int n));

#endif
