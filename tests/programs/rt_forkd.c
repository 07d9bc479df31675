/*
 * rt_forkd: a server that forks itself into the background after serving a
 * few connections, the way some daemons do once they are warmed up.
 *
 * Same protocol and flags as conn_server (thread per connection, created after
 * accept; each request transformed by accel_run). Once FORK_AFTER connections
 * (env, default 3) have been served and closed, the main thread fork()s: the
 * parent exits 0, the child writes its pid to the file named by
 * DAEMON_PIDFILE (env; written to NAME.tmp, then renamed) and goes on
 * accepting on the same socket. Under the runtime the child's connection
 * threads are fibers again: they need carriers in the child.
 */
#define _GNU_SOURCE
#include "common.h"
#include "toffload_accel.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

static const char PROG[] = "rt_forkd";
static struct server_opts opts;
static int closed_conns;

static void *conn(void *p)
{
    int fd = (int)(long)p;
    serve_requests(PROG, fd, &opts, accel_run);
    close_fd(PROG, fd);
    __atomic_fetch_add(&closed_conns, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void write_pidfile(const char *path)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%ld\n", (long)getpid()) < 0 || fclose(f) != 0 || rename(tmp, path) != 0) {
        warn_errno(PROG, "writing the pid file", errno);
        exit(1);
    }
}

int main(int argc, char **argv)
{
    server_setup(PROG, argc, argv, &opts);
    const char *fa = getenv("FORK_AFTER");
    int fork_after = fa && *fa ? atoi(fa) : 3;
    const char *pidfile = getenv("DAEMON_PIDFILE");
    int lfd = listen_and_announce(PROG, &opts);

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int accepted = 0, forked = 0;
    for (;;) {
        if (!forked && accepted >= fork_after) {
            /* Wait (bounded) for the first connections to end, then fork. */
            for (int i = 0;
                 i < 10000 && __atomic_load_n(&closed_conns, __ATOMIC_SEQ_CST) < accepted; i++) {
                struct timespec ts = {0, 1000 * 1000};
                nanosleep(&ts, NULL);
            }
            pid_t pid = fork();
            if (pid < 0) {
                warn_errno(PROG, "fork", errno);
                return 1;
            }
            if (pid > 0) {
                fflush(stdout);
                _exit(0);
            }
            if (pidfile)
                write_pidfile(pidfile);
            forked = 1;
        }
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0) {
            int kind = accept_error_kind(PROG, errno);
            if (kind == 0) {
                warn_errno(PROG, "accept", errno);
                return 1;
            }
            continue;
        }
        accepted++;
        set_nodelay(fd);
        pthread_t t;
        int e = pthread_create(&t, &attr, conn, (void *)(long)fd);
        if (e) {
            warn_errno(PROG, "pthread_create", e);
            close_fd(PROG, fd);
        }
    }
}
