/*
 * evloop_server: the event-driven baseline. One thread, one epoll loop,
 * non-blocking sockets. Each full request gets cpu_work and a synchronous
 * accel_run right in the loop (so the loop stalls for the offload: that is
 * the cost the thread-per-connection + toffload design avoids), then its
 * response is written without blocking. A connection whose response does not
 * fit in the socket buffer waits for EPOLLOUT and is not read meanwhile, so
 * pipelined requests are answered in order, one at a time.
 */
#define _GNU_SOURCE /* accept4 */
#include "common.h"
#include "toffload_accel.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const char PROG[] = "evloop_server";

/* Requests served per connection per wakeup, so that one client streaming
 * pipelined requests cannot starve the others (epoll is level-triggered and
 * reports the rest next round). */
#define BATCH 16

static struct server_opts opts;
static int ep;

struct conn {
    int fd;
    int writing;        /* a response is pending; input is not read */
    size_t rd;          /* bytes of the current request received */
    size_t wr;          /* bytes of the current response sent */
    unsigned char buf[]; /* opts.size: request, transformed in place */
};

static void drop(struct conn *c)
{
    close_fd(PROG, c->fd); /* also removes it from the epoll set */
    free(c);
}

static int watch(struct conn *c, int op, unsigned events)
{
    struct epoll_event ev = {.events = events, .data.ptr = c};
    if (epoll_ctl(ep, op, c->fd, &ev) < 0) {
        warn_errno(PROG, "epoll_ctl", errno);
        return -1;
    }
    return 0;
}

/* 1 response fully sent, 0 socket full, -1 error. */
static int flush(struct conn *c)
{
    while (c->wr < opts.size) {
        ssize_t w = write(c->fd, c->buf + c->wr, opts.size - c->wr);
        if (w >= 0)
            c->wr += (size_t)w;
        else if (errno == EAGAIN || errno == EWOULDBLOCK)
            return 0;
        else if (errno != EINTR)
            return -1;
    }
    c->writing = 0;
    return 1;
}

/* Read and serve up to BATCH requests. 0 keep the connection, -1 drop it. */
static int on_readable(struct conn *c)
{
    for (int served = 0; served < BATCH;) {
        /* Read at most the rest of this request: later pipelined requests stay
         * in the socket until this one has been answered. */
        ssize_t r = read(c->fd, c->buf + c->rd, opts.size - c->rd);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
        }
        if (r == 0)
            return -1; /* EOF; every earlier response has been sent already */
        c->rd += (size_t)r;
        if (c->rd < opts.size)
            continue;

        cpu_work(opts.cpu_us);
        int rc = accel_run(c->buf, (int)opts.size);
        if (rc < 0) {
            warn_errno(PROG, "accel_run", -rc);
            return -1;
        }
        c->rd = 0;
        c->wr = 0;
        c->writing = 1;
        int f = flush(c);
        if (f < 0)
            return -1;
        if (f == 0)
            return watch(c, EPOLL_CTL_MOD, EPOLLOUT);
        served++;
    }
    return 0;
}

static int on_event(struct conn *c, unsigned events)
{
    if (events & EPOLLERR)
        return -1;
    if (!c->writing)
        return on_readable(c);
    int f = flush(c);
    if (f <= 0)
        return f;
    if (watch(c, EPOLL_CTL_MOD, EPOLLIN) < 0)
        return -1;
    return on_readable(c); /* the next request is likely already there */
}

/* Accept everything pending. Returns 1 when out of fds/memory: the caller
 * then stops watching the listener for a while instead of spinning. */
static int accept_all(int lfd)
{
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            int kind = accept_error_kind(PROG, errno);
            if (kind == 0) {
                warn_errno(PROG, "accept4", errno);
                exit(1);
            }
            if (kind == 2)
                return 1;
            continue;
        }
        if (set_nodelay(fd) < 0) {
            warn_errno(PROG, "setsockopt(TCP_NODELAY)", errno);
            close_fd(PROG, fd);
            continue;
        }
        struct conn *c = malloc(sizeof *c + opts.size);
        if (!c) {
            fprintf(stderr, "%s: malloc(%zu) failed\n", PROG, opts.size);
            close_fd(PROG, fd);
            continue;
        }
        c->fd = fd;
        c->writing = 0;
        c->rd = c->wr = 0;
        if (watch(c, EPOLL_CTL_ADD, EPOLLIN) < 0)
            drop(c);
    }
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int main(int argc, char **argv)
{
    server_setup(PROG, argc, argv, &opts);
    int lfd = listen_and_announce(PROG, &opts);
    int fl = fcntl(lfd, F_GETFL);
    if (fl < 0 || fcntl(lfd, F_SETFL, fl | O_NONBLOCK) < 0) {
        warn_errno(PROG, "fcntl", errno);
        return 1;
    }
    if ((ep = epoll_create1(EPOLL_CLOEXEC)) < 0) {
        warn_errno(PROG, "epoll_create1", errno);
        return 1;
    }
    /* The listener is the only entry with a NULL data.ptr. */
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &lev) < 0) {
        warn_errno(PROG, "epoll_ctl", errno);
        return 1;
    }

    double resume_at = -1; /* >= 0 while accepting is paused */
    struct epoll_event evs[256];
    for (;;) {
        int n = epoll_wait(ep, evs, 256, resume_at >= 0 ? 10 : -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            warn_errno(PROG, "epoll_wait", errno);
            return 1;
        }
        if (resume_at >= 0 && now_ms() >= resume_at) {
            lev.events = EPOLLIN;
            if (epoll_ctl(ep, EPOLL_CTL_MOD, lfd, &lev) < 0) {
                warn_errno(PROG, "epoll_ctl", errno);
                return 1;
            }
            resume_at = -1;
        }
        /* Each fd appears at most once per batch, so freeing a conn here
         * cannot leave a dangling pointer later in evs. */
        for (int i = 0; i < n; i++) {
            struct conn *c = evs[i].data.ptr;
            if (c) {
                if (on_event(c, evs[i].events) < 0)
                    drop(c);
            } else if (resume_at < 0 && accept_all(lfd)) {
                lev.events = 0; /* stay registered, report nothing */
                if (epoll_ctl(ep, EPOLL_CTL_MOD, lfd, &lev) < 0) {
                    warn_errno(PROG, "epoll_ctl", errno);
                    return 1;
                }
                resume_at = now_ms() + 10;
            }
        }
    }
}
