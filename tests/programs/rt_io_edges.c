/*
 * rt_io_edges: I/O semantics a fiber must see exactly as a thread would.
 *
 * Each check runs on its own worker (a fiber under TOFFLOAD_FIBERIZE=all), one
 * after the other; the real main thread gives each RT_HANG_MS milliseconds
 * (env, default 5000) and reports a check that has not finished by then as
 * NAME=hang (and exits 3: a hung fiber may hold its carrier). Each prints
 * NAME=ok, or NAME=fail:DETAIL.
 *   nonblock_read     read on a socket the app made O_NONBLOCK: EAGAIN at once
 *   dontwait_recv     recv(MSG_DONTWAIT) on an empty socket: EAGAIN at once
 *   flags_kept        after blocking reads/writes on a pipe, F_GETFL shows no
 *                     O_NONBLOCK the app did not set
 *   rcvtimeo          SO_RCVTIMEO 100 ms on a silent socket: EAGAIN after ~100 ms
 *   sndtimeo          SO_SNDTIMEO 100 ms on a socket whose buffer is full:
 *                     EAGAIN after ~100 ms
 *   full_write        one 4 MiB write to a stream socket a slow fiber drains:
 *                     returns 4 MiB (blocking sockets write everything)
 *   pipe_full_write   the same on a pipe
 *   waitall           recv(MSG_WAITALL) of 64 KiB sent in 1 KiB pieces: 64 KiB
 *   fd_reuse          200 rounds: socketpair, a fiber blocks reading one end,
 *                     another writes 1 ms later, both ends closed; the next
 *                     round reuses the same fd numbers
 *   dup2_over         a fiber blocks reading fd X after dup2(other, X) replaced
 *                     what X was: the data written to `other`'s peer must wake it
 *   refused           connect() to a closed port: ECONNREFUSED, promptly
 *   poll_zero         poll with timeout 0 on an empty pipe: 0 at once
 *   accept4_nonblock  accept4(SOCK_NONBLOCK): the new fd reads EAGAIN at once
 *   shared_accept     4 fibers block in accept() on one listening socket; 4
 *                     clients connect: every accept returns
 *   two_readers       2 fibers block reading one socket; 2 bytes arrive one at a
 *                     time: both reads return
 *   duplex            on one socket, a fiber blocks reading while another blocks
 *                     writing into a full send buffer; the peer first drains,
 *                     then sends: both calls return
 *   poll_file         poll on {a regular file, an empty pipe}, 1 s timeout:
 *                     1 at once, POLLIN on the file (files are always ready)
 *   poll_nval         poll on a closed fd: 1 at once with POLLNVAL
 *   poll_negative     poll on {fd -1, an empty pipe}, 100 ms: 0 after ~100 ms
 *   select_file       select on {a regular file, an empty pipe}, 1 s: 1 at once
 *   epoll_timeout     epoll_wait on an empty pipe, 100 ms: 0 after ~100 ms
 *   epoll_wake        epoll_wait (2 s) on a pipe another fiber writes 5 ms later:
 *                     1 event, promptly
 *   readv_wait        readv into 2 buffers, data arriving 2 ms later: returns it
 *   recvmsg_wait      recvmsg on a stream socket, data 2 ms later: returns it
 *   recvmsg_waitall   recvmsg(MSG_WAITALL) of 64 KiB sent in 1 KiB pieces: 64 KiB
 *   peek              recv(MSG_PEEK) waits for data sent 2 ms later and leaves it:
 *                     the next read returns the same bytes
 *   accept_timeo      accept on a listening socket with SO_RCVTIMEO 100 ms and no
 *                     client: EAGAIN after ~100 ms
 *   connect_timeo     connect with SO_SNDTIMEO 200 ms to a listener whose backlog
 *                     is full (SYNs dropped): EINPROGRESS after ~200 ms (Linux)
 *   sigpipe           write and send to a socket whose peer has closed: EPIPE,
 *                     and SIGPIPE delivered (a handler counts it) for each
 *   peer_shutdown     a read parked on a socket returns 0 when the peer calls
 *                     shutdown(SHUT_WR) 2 ms later
 *   udp_wait          recvfrom on a UDP socket, a datagram sendto'd by another
 *                     fiber 2 ms later: the whole datagram and its sender
 *   writev_full       one writev of 4 MiB in 64 pieces to a stream socket a slow
 *                     fiber drains: returns 4 MiB
 *   sendmsg_full      the same with sendmsg
 *   flip_nonblock     a socket read once blocking, then O_NONBLOCK set by fcntl:
 *                     EAGAIN at once; cleared by ioctl(FIONBIO): waits for data;
 *                     set by FIONBIO: EAGAIN; cleared by fcntl: waits again
 *   flip_rcvtimeo     a socket read once with no timeout, then SO_RCVTIMEO 100 ms:
 *                     EAGAIN after ~100 ms; then the timeout removed: a read
 *                     waits 300 ms for its data
 *   dup2_nonblock     a socket read once blocking, then dup2 puts a non-blocking
 *                     socket at its number: EAGAIN at once
 *   pipelined         on a loopback TCP connection that has been waited on, two
 *                     1 KiB requests arrive in one segment; the first read of
 *                     1 KiB leaves the second queued: the next read returns it at
 *                     once (the runtime must not take a full read for an empty
 *                     socket and park: nothing more arrives to wake it)
 *   drained_eof       a read that emptied a TCP socket, then a read parked on it:
 *                     returns 0 when the peer calls shutdown(SHUT_WR) 2 ms later
 *   pingpong          200 request-response rounds of 64 bytes between two fibers
 *                     over loopback TCP, each side reading exactly 64 (the stats
 *                     show how many of those reads parked without asking)
 *   inq_cmsg          recvmsg with a control buffer on a TCP socket read before:
 *                     no control message comes back (the runtime's TCP_INQ one
 *                     must not reach the application)
 * The last line: on_fiber=K checks=N
 *   rt_io_edges [NAME]   runs only the check NAME; --list lists them
 */
#define _GNU_SOURCE
#include "common.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

static int on_fiber, done;
static char result[256];

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        snprintf(result, sizeof result, "fail:" __VA_ARGS__);                                      \
        return;                                                                                    \
    } while (0)

static void spawn_detached(void *(*fn)(void *), void *arg)
{
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    if (pthread_create(&t, &a, fn, arg)) {
        fprintf(stderr, "rt_io_edges: pthread_create failed\n");
        exit(2);
    }
    pthread_attr_destroy(&a);
}

/* ---- helpers run by other fibers ---- */

struct delayed_write {
    int fd;
    int delay_us;
    size_t n;
};

static void *delayed_writer(void *p)
{
    struct delayed_write *d = p;
    usleep((useconds_t)d->delay_us);
    char buf[1024];
    memset(buf, 'w', sizeof buf);
    size_t left = d->n;
    while (left > 0) {
        size_t k = left < sizeof buf ? left : sizeof buf;
        ssize_t w = write(d->fd, buf, k);
        if (w <= 0)
            break;
        left -= (size_t)w;
        if (d->delay_us)
            usleep(200);
    }
    free(d);
    return NULL;
}

static void after(int fd, int delay_us, size_t n)
{
    struct delayed_write *d = malloc(sizeof *d);
    d->fd = fd;
    d->delay_us = delay_us;
    d->n = n;
    spawn_detached(delayed_writer, d);
}

struct drain {
    int fd;
    size_t n;
    int slow;
    size_t got;
    int finished;
};

static void *drainer(void *p)
{
    struct drain *d = p;
    char buf[65536];
    while (d->got < d->n) {
        if (d->slow)
            usleep(1000);
        ssize_t r = read(d->fd, buf, sizeof buf);
        if (r <= 0)
            break;
        d->got += (size_t)r;
    }
    __atomic_store_n(&d->finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

/* ---- checks ---- */

static void nonblock_read(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    fcntl(sv[0], F_SETFL, fcntl(sv[0], F_GETFL) | O_NONBLOCK);
    char c;
    double t0 = now_ms();
    ssize_t r = read(sv[0], &c, 1);
    int e = errno;
    double ms = now_ms() - t0;
    close(sv[0]);
    close(sv[1]);
    if (r != -1 || e != EAGAIN)
        FAIL("read=%zd_errno=%d", r, e);
    if (ms > 50)
        FAIL("took_%.0fms", ms);
}

static void dontwait_recv(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    char c;
    double t0 = now_ms();
    ssize_t r = recv(sv[0], &c, 1, MSG_DONTWAIT);
    int e = errno;
    double ms = now_ms() - t0;
    close(sv[0]);
    close(sv[1]);
    if (r != -1 || e != EAGAIN)
        FAIL("recv=%zd_errno=%d", r, e);
    if (ms > 50)
        FAIL("took_%.0fms", ms);
}

static void flags_kept(void)
{
    int p[2];
    if (pipe(p))
        FAIL("pipe");
    after(p[1], 2000, 10);
    char buf[16];
    ssize_t r = read(p[0], buf, sizeof buf);
    if (r <= 0)
        FAIL("read=%zd", r);
    int f0 = fcntl(p[0], F_GETFL), f1 = fcntl(p[1], F_GETFL);
    close(p[0]);
    close(p[1]);
    if ((f0 & O_NONBLOCK) || (f1 & O_NONBLOCK))
        FAIL("O_NONBLOCK_visible_r=%d_w=%d", !!(f0 & O_NONBLOCK), !!(f1 & O_NONBLOCK));
}

static void rcvtimeo(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    struct timeval tv = {0, 100 * 1000};
    setsockopt(sv[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char c;
    double t0 = now_ms();
    ssize_t r = read(sv[0], &c, 1);
    int e = errno;
    double ms = now_ms() - t0;
    close(sv[0]);
    close(sv[1]);
    if (r != -1 || (e != EAGAIN && e != EWOULDBLOCK))
        FAIL("read=%zd_errno=%d", r, e);
    if (ms < 95 || ms > 1000)
        FAIL("took_%.0fms", ms);
}

static void sndtimeo(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    /* Fill the send buffer without blocking, then block with a timeout. */
    int fl = fcntl(sv[1], F_GETFL);
    fcntl(sv[1], F_SETFL, fl | O_NONBLOCK);
    char buf[4096];
    memset(buf, 'f', sizeof buf);
    while (write(sv[1], buf, sizeof buf) > 0)
        ;
    fcntl(sv[1], F_SETFL, fl);
    struct timeval tv = {0, 100 * 1000};
    setsockopt(sv[1], SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    double t0 = now_ms();
    ssize_t w = write(sv[1], buf, sizeof buf);
    int e = errno;
    double ms = now_ms() - t0;
    close(sv[0]);
    close(sv[1]);
    if (w != -1 || (e != EAGAIN && e != EWOULDBLOCK))
        FAIL("write=%zd_errno=%d", w, e);
    if (ms < 95 || ms > 1000)
        FAIL("took_%.0fms", ms);
}

static void full_write_on(int rfd, int wfd)
{
    size_t n = 4 << 20;
    char *buf = malloc(n);
    memset(buf, 'x', n);
    struct drain *d = calloc(1, sizeof *d);
    d->fd = rfd;
    d->n = n;
    d->slow = 1;
    spawn_detached(drainer, d);
    ssize_t w = write(wfd, buf, n);
    int e = errno;
    /* Wait for the drainer only if the write claims to be complete (after a
     * short write it would wait for bytes that never come). */
    for (int i = 0; i < 5000 && w == (ssize_t)n && !__atomic_load_n(&d->finished, __ATOMIC_SEQ_CST);
         i++)
        usleep(1000);
    size_t got = d->got;
    int fin = d->finished;
    close(rfd);
    close(wfd);
    free(buf);
    if (fin)
        free(d); /* else leak: the drainer may still use it */
    if (w != (ssize_t)n)
        FAIL("write=%zd_of_%zu_errno=%d", w, n, e);
    if (got != n)
        FAIL("drained_%zu", got);
}

static void full_write(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    full_write_on(sv[0], sv[1]);
}

static void pipe_full_write(void)
{
    int p[2];
    if (pipe(p))
        FAIL("pipe");
    full_write_on(p[0], p[1]);
}

static void waitall(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    after(sv[1], 1000, 65536);
    static char buf[65536];
    ssize_t r = recv(sv[0], buf, sizeof buf, MSG_WAITALL);
    int e = errno;
    close(sv[0]);
    close(sv[1]);
    if (r != (ssize_t)sizeof buf)
        FAIL("recv=%zd_errno=%d", r, e);
}

static void fd_reuse(void)
{
    for (int i = 0; i < 200; i++) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
            FAIL("socketpair_round_%d", i);
        after(sv[1], 1000, 1);
        char c;
        ssize_t r = read(sv[0], &c, 1);
        usleep(300); /* let the writer finish before closing */
        close(sv[0]);
        close(sv[1]);
        if (r != 1)
            FAIL("round_%d_read=%zd_errno=%d", i, r, errno);
    }
}

static void dup2_over(void)
{
    int a[2], b[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, a) || socketpair(AF_UNIX, SOCK_STREAM, 0, b))
        FAIL("socketpair");
    /* First make the runtime wait on a[0] once, so it knows that fd. */
    after(a[1], 1000, 1);
    char c;
    if (read(a[0], &c, 1) != 1)
        FAIL("first_read");
    /* Now fd a[0] becomes a copy of b[0]; data arrives on b's peer. */
    if (dup2(b[0], a[0]) < 0)
        FAIL("dup2");
    after(b[1], 2000, 1);
    ssize_t r = read(a[0], &c, 1);
    int e = errno;
    close(a[0]);
    close(a[1]);
    close(b[0]);
    close(b[1]);
    if (r != 1)
        FAIL("read=%zd_errno=%d", r, e);
}

static void refused(void)
{
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t len = sizeof sa;
    /* Bind, learn the port, close: nobody listens there now. */
    if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) ||
        getsockname(l, (struct sockaddr *)&sa, &len))
        FAIL("bind");
    close(l);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    double t0 = now_ms();
    int r = connect(s, (struct sockaddr *)&sa, sizeof sa);
    int e = errno;
    double ms = now_ms() - t0;
    close(s);
    if (r != -1 || e != ECONNREFUSED)
        FAIL("connect=%d_errno=%d", r, e);
    if (ms > 1000)
        FAIL("took_%.0fms", ms);
}

static void poll_zero(void)
{
    int p[2];
    if (pipe(p))
        FAIL("pipe");
    struct pollfd pf = {.fd = p[0], .events = POLLIN};
    double t0 = now_ms();
    int r = poll(&pf, 1, 0);
    double ms = now_ms() - t0;
    close(p[0]);
    close(p[1]);
    if (r != 0)
        FAIL("poll=%d", r);
    if (ms > 50)
        FAIL("took_%.0fms", ms);
}

static void accept4_nonblock(void)
{
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t len = sizeof sa;
    if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) || listen(l, 8) ||
        getsockname(l, (struct sockaddr *)&sa, &len))
        FAIL("listen");
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, (struct sockaddr *)&sa, sizeof sa))
        FAIL("connect_errno=%d", errno);
    int s = accept4(l, NULL, NULL, SOCK_NONBLOCK);
    if (s < 0)
        FAIL("accept4_errno=%d", errno);
    char ch;
    double t0 = now_ms();
    ssize_t r = read(s, &ch, 1);
    int e = errno;
    double ms = now_ms() - t0;
    close(s);
    close(c);
    close(l);
    if (r != -1 || e != EAGAIN)
        FAIL("read=%zd_errno=%d", r, e);
    if (ms > 50)
        FAIL("took_%.0fms", ms);
}

struct waiter {
    int fd;
    int kind; /* 0 accept, 1 read 1 byte, 2 write 64 KiB */
    long rc;
    int finished;
};

static void *wait_call(void *p)
{
    struct waiter *w = p;
    static char big[65536];
    char c;
    if (w->kind == 0)
        w->rc = accept(w->fd, NULL, NULL);
    else if (w->kind == 1)
        w->rc = read(w->fd, &c, 1);
    else
        w->rc = write(w->fd, big, sizeof big);
    __atomic_store_n(&w->finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

/* Starts n waiters of `kind` on fd; returns them (static storage, 8 at most). */
static struct waiter *start_waiters(int fd, int kind, int n)
{
    static struct waiter ws[8];
    for (int i = 0; i < n; i++) {
        ws[i] = (struct waiter){.fd = fd, .kind = kind, .rc = -2};
        spawn_detached(wait_call, &ws[i]);
    }
    usleep(20 * 1000); /* let them block */
    return ws;
}

static int finished_count(struct waiter *ws, int n, int timeout_ms)
{
    int k = 0;
    for (int t = 0; t <= timeout_ms; t++) {
        k = 0;
        for (int i = 0; i < n; i++)
            k += __atomic_load_n(&ws[i].finished, __ATOMIC_SEQ_CST);
        if (k == n)
            break;
        usleep(1000);
    }
    return k;
}

static void shared_accept(void)
{
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t len = sizeof sa;
    if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) || listen(l, 8) ||
        getsockname(l, (struct sockaddr *)&sa, &len))
        FAIL("listen");
    struct waiter *ws = start_waiters(l, 0, 4);
    int c[4];
    for (int i = 0; i < 4; i++) {
        c[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(c[i], (struct sockaddr *)&sa, sizeof sa))
            FAIL("connect_errno=%d", errno);
        usleep(2000);
    }
    int k = finished_count(ws, 4, 1000);
    for (int i = 0; i < 4; i++) {
        close(c[i]);
        if (ws[i].finished && ws[i].rc >= 0)
            close((int)ws[i].rc);
    }
    if (k != 4)
        FAIL("%d_of_4_accepts_returned", k);
    close(l);
}

static void two_readers(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    struct waiter *ws = start_waiters(sv[0], 1, 2);
    for (int i = 0; i < 2; i++) {
        if (write(sv[1], "x", 1) != 1)
            FAIL("write");
        usleep(5000);
    }
    int k = finished_count(ws, 2, 1000);
    if (k != 2)
        FAIL("%d_of_2_reads_returned", k);
    close(sv[0]);
    close(sv[1]);
}

static void duplex(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    /* Fill sv[0]'s send buffer. */
    int fl = fcntl(sv[0], F_GETFL);
    fcntl(sv[0], F_SETFL, fl | O_NONBLOCK);
    char buf[65536];
    memset(buf, 'd', sizeof buf);
    while (write(sv[0], buf, 4096) > 0)
        ;
    fcntl(sv[0], F_SETFL, fl);
    struct waiter *r = start_waiters(sv[0], 1, 1);
    static struct waiter w;
    w = (struct waiter){.fd = sv[0], .kind = 2, .rc = -2};
    spawn_detached(wait_call, &w);
    usleep(20 * 1000);
    /* Drain what sv[0] wrote (so the writer can finish), then send one byte. */
    fcntl(sv[1], F_SETFL, fcntl(sv[1], F_GETFL) | O_NONBLOCK);
    for (int t = 0; t < 1000 && !__atomic_load_n(&w.finished, __ATOMIC_SEQ_CST); t++) {
        while (read(sv[1], buf, sizeof buf) > 0)
            ;
        usleep(1000);
    }
    if (write(sv[1], "y", 1) != 1)
        FAIL("write");
    int rk = finished_count(r, 1, 1000);
    int wk = __atomic_load_n(&w.finished, __ATOMIC_SEQ_CST);
    if (!rk || !wk)
        FAIL("reader_returned=%d_writer_returned=%d", rk, wk);
    close(sv[0]);
    close(sv[1]);
}

static void poll_file(void)
{
    int p[2];
    if (pipe(p))
        FAIL("pipe");
    int f = open("/proc/self/exe", O_RDONLY);
    if (f < 0)
        FAIL("open");
    struct pollfd pf[2] = {{.fd = f, .events = POLLIN}, {.fd = p[0], .events = POLLIN}};
    double t0 = now_ms();
    int r = poll(pf, 2, 1000);
    double ms = now_ms() - t0;
    close(f);
    close(p[0]);
    close(p[1]);
    if (r != 1 || !(pf[0].revents & POLLIN) || pf[1].revents)
        FAIL("poll=%d_revents=%x,%x", r, pf[0].revents, pf[1].revents);
    if (ms > 50)
        FAIL("took_%.0fms", ms);
}

static void poll_nval(void)
{
    int p[2];
    if (pipe(p))
        FAIL("pipe");
    close(p[0]);
    close(p[1]);
    struct pollfd pf = {.fd = p[0], .events = POLLIN};
    double t0 = now_ms();
    int r = poll(&pf, 1, 1000);
    double ms = now_ms() - t0;
    if (r != 1 || pf.revents != POLLNVAL)
        FAIL("poll=%d_revents=%x", r, pf.revents);
    if (ms > 50)
        FAIL("took_%.0fms", ms);
}

static void poll_negative(void)
{
    int p[2];
    if (pipe(p))
        FAIL("pipe");
    struct pollfd pf[2] = {{.fd = -1, .events = POLLIN}, {.fd = p[0], .events = POLLIN}};
    double t0 = now_ms();
    int r = poll(pf, 2, 100);
    double ms = now_ms() - t0;
    close(p[0]);
    close(p[1]);
    if (r != 0 || pf[0].revents || pf[1].revents)
        FAIL("poll=%d_revents=%x,%x", r, pf[0].revents, pf[1].revents);
    if (ms < 95 || ms > 1000)
        FAIL("took_%.0fms", ms);
}

static void select_file(void)
{
    int p[2];
    if (pipe(p))
        FAIL("pipe");
    int f = open("/proc/self/exe", O_RDONLY);
    if (f < 0)
        FAIL("open");
    fd_set rs;
    FD_ZERO(&rs);
    FD_SET(f, &rs);
    FD_SET(p[0], &rs);
    int mx = f > p[0] ? f : p[0];
    struct timeval tv = {1, 0};
    double t0 = now_ms();
    int r = select(mx + 1, &rs, NULL, NULL, &tv);
    double ms = now_ms() - t0;
    int file_set = FD_ISSET(f, &rs), pipe_set = FD_ISSET(p[0], &rs);
    close(f);
    close(p[0]);
    close(p[1]);
    if (r != 1 || !file_set || pipe_set)
        FAIL("select=%d_file=%d_pipe=%d", r, !!file_set, !!pipe_set);
    if (ms > 50)
        FAIL("took_%.0fms", ms);
}

static void epoll_timeout(void)
{
    int p[2];
    if (pipe(p))
        FAIL("pipe");
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = p[0]};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, p[0], &ev))
        FAIL("epoll_errno=%d", errno);
    double t0 = now_ms();
    int r = epoll_wait(ep, &ev, 1, 100);
    double ms = now_ms() - t0;
    close(ep);
    close(p[0]);
    close(p[1]);
    if (r != 0)
        FAIL("epoll_wait=%d", r);
    if (ms < 95 || ms > 1000)
        FAIL("took_%.0fms", ms);
}

static void epoll_wake(void)
{
    int p[2];
    if (pipe(p))
        FAIL("pipe");
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = p[0]};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, p[0], &ev))
        FAIL("epoll_errno=%d", errno);
    after(p[1], 5000, 1);
    double t0 = now_ms();
    int r = epoll_wait(ep, &ev, 1, 2000);
    double ms = now_ms() - t0;
    usleep(1000); /* let the writer finish */
    close(ep);
    close(p[0]);
    close(p[1]);
    if (r != 1 || ev.data.fd != p[0])
        FAIL("epoll_wait=%d", r);
    if (ms > 1000)
        FAIL("took_%.0fms", ms);
}

static void readv_wait(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    after(sv[1], 2000, 10);
    char a[4], b[16];
    struct iovec iov[2] = {{a, sizeof a}, {b, sizeof b}};
    ssize_t r = readv(sv[0], iov, 2);
    int e = errno;
    usleep(1000);
    close(sv[0]);
    close(sv[1]);
    if (r != 10)
        FAIL("readv=%zd_errno=%d", r, e);
}

static void recvmsg_wait(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    after(sv[1], 2000, 10);
    char a[32];
    struct iovec iov = {a, sizeof a};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    ssize_t r = recvmsg(sv[0], &mh, 0);
    int e = errno;
    usleep(1000);
    close(sv[0]);
    close(sv[1]);
    if (r != 10)
        FAIL("recvmsg=%zd_errno=%d", r, e);
}

static void recvmsg_waitall(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    after(sv[1], 1000, 65536);
    static char buf[65536];
    struct iovec iov = {buf, sizeof buf};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    ssize_t r = recvmsg(sv[0], &mh, MSG_WAITALL);
    int e = errno;
    usleep(20 * 1000); /* let the writer finish */
    close(sv[0]);
    close(sv[1]);
    if (r != (ssize_t)sizeof buf)
        FAIL("recvmsg=%zd_errno=%d", r, e);
}

static void peek(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    after(sv[1], 2000, 5);
    char a[8] = {0}, b[8] = {0};
    ssize_t r1 = recv(sv[0], a, sizeof a, MSG_PEEK);
    usleep(1000);
    ssize_t r2 = read(sv[0], b, sizeof b);
    close(sv[0]);
    close(sv[1]);
    if (r1 != 5 || r2 != 5 || memcmp(a, b, 5) != 0)
        FAIL("peek=%zd_read=%zd", r1, r2);
}

static void accept_timeo(void)
{
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) || listen(l, 8))
        FAIL("listen");
    struct timeval tv = {0, 100 * 1000};
    setsockopt(l, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    double t0 = now_ms();
    int r = accept(l, NULL, NULL);
    int e = errno;
    double ms = now_ms() - t0;
    close(l);
    if (r >= 0)
        close(r);
    if (r != -1 || e != EAGAIN)
        FAIL("accept=%d_errno=%d", r, e);
    if (ms < 95 || ms > 1000)
        FAIL("took_%.0fms", ms);
}

static void connect_timeo(void)
{
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t len = sizeof sa;
    if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) || listen(l, 0) ||
        getsockname(l, (struct sockaddr *)&sa, &len))
        FAIL("listen");
    int fill[4];
    for (int i = 0; i < 4; i++) {
        fill[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        connect(fill[i], (struct sockaddr *)&sa, sizeof sa);
    }
    usleep(10 * 1000);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    struct timeval tv = {0, 200 * 1000};
    setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    double t0 = now_ms();
    int r = connect(c, (struct sockaddr *)&sa, sizeof sa);
    int e = errno;
    double ms = now_ms() - t0;
    close(c);
    for (int i = 0; i < 4; i++)
        close(fill[i]);
    close(l);
    if (r != -1 || e != EINPROGRESS)
        FAIL("connect=%d_errno=%d", r, e);
    if (ms < 190 || ms > 1500)
        FAIL("took_%.0fms", ms);
}

static volatile sig_atomic_t sigpipes;
static void on_sigpipe(int sig)
{
    (void)sig;
    sigpipes++;
}

static void sigpipe(void)
{
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigpipe;
    sigaction(SIGPIPE, &sa, &old);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    close(sv[1]);
    sigpipes = 0;
    ssize_t w1 = write(sv[0], "x", 1);
    int e1 = errno;
    ssize_t w2 = send(sv[0], "x", 1, 0);
    int e2 = errno;
    int n = sigpipes;
    close(sv[0]);
    sigaction(SIGPIPE, &old, NULL);
    if (w1 != -1 || e1 != EPIPE || w2 != -1 || e2 != EPIPE)
        FAIL("write=%zd_errno=%d_send=%zd_errno=%d", w1, e1, w2, e2);
    if (n != 2)
        FAIL("%d_SIGPIPEs_of_2", n);
}

static void *shutdown_later(void *p)
{
    usleep(2000);
    shutdown((int)(long)p, SHUT_WR);
    return NULL;
}

static void peer_shutdown(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    spawn_detached(shutdown_later, (void *)(long)sv[1]);
    char c;
    ssize_t r = read(sv[0], &c, 1);
    int e = errno;
    usleep(1000);
    close(sv[0]);
    close(sv[1]);
    if (r != 0)
        FAIL("read=%zd_errno=%d", r, e);
}

struct dgram {
    int fd;
    struct sockaddr_in to;
};

static void *udp_sender(void *p)
{
    struct dgram *d = p;
    usleep(2000);
    char msg[1000];
    memset(msg, 'u', sizeof msg);
    sendto(d->fd, msg, sizeof msg, 0, (struct sockaddr *)&d->to, sizeof d->to);
    return NULL;
}

static void udp_wait(void)
{
    int r0 = socket(AF_INET, SOCK_DGRAM, 0), s0 = socket(AF_INET, SOCK_DGRAM, 0);
    static struct dgram d;
    struct sockaddr_in sa = {.sin_family = AF_INET}, me = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    me = sa;
    socklen_t len = sizeof sa, mlen = sizeof me;
    if (r0 < 0 || s0 < 0 || bind(r0, (struct sockaddr *)&sa, sizeof sa) ||
        getsockname(r0, (struct sockaddr *)&sa, &len) || bind(s0, (struct sockaddr *)&me, sizeof me) ||
        getsockname(s0, (struct sockaddr *)&me, &mlen))
        FAIL("udp_setup_errno=%d", errno);
    d.fd = s0;
    d.to = sa;
    spawn_detached(udp_sender, &d);
    char buf[2000];
    struct sockaddr_in from;
    socklen_t flen = sizeof from;
    ssize_t r = recvfrom(r0, buf, sizeof buf, 0, (struct sockaddr *)&from, &flen);
    int e = errno;
    usleep(1000);
    close(r0);
    close(s0);
    if (r != 1000)
        FAIL("recvfrom=%zd_errno=%d", r, e);
    if (from.sin_port != me.sin_port)
        FAIL("wrong_sender_port");
}

static void gather_write(int use_sendmsg)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    enum { PIECES = 64, PIECE = 65536 };
    char *buf = malloc((size_t)PIECES * PIECE);
    memset(buf, 'g', (size_t)PIECES * PIECE);
    struct iovec iov[PIECES];
    for (int i = 0; i < PIECES; i++)
        iov[i] = (struct iovec){buf + (size_t)i * PIECE, PIECE};
    struct drain *d = calloc(1, sizeof *d);
    d->fd = sv[0];
    d->n = (size_t)PIECES * PIECE;
    d->slow = 1;
    spawn_detached(drainer, d);
    ssize_t w;
    if (use_sendmsg) {
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = PIECES};
        w = sendmsg(sv[1], &mh, 0);
    } else {
        w = writev(sv[1], iov, PIECES);
    }
    int e = errno;
    for (int i = 0; i < 5000 && w == (ssize_t)PIECES * PIECE &&
                    !__atomic_load_n(&d->finished, __ATOMIC_SEQ_CST);
         i++)
        usleep(1000);
    size_t got = d->got;
    int fin = d->finished;
    close(sv[0]);
    close(sv[1]);
    free(buf);
    if (fin)
        free(d);
    if (w != (ssize_t)PIECES * PIECE)
        FAIL("wrote_%zd_of_%d_errno=%d", w, PIECES * PIECE, e);
    if (got != (size_t)PIECES * PIECE)
        FAIL("drained_%zu", got);
}

static void writev_full(void) { gather_write(0); }
static void sendmsg_full(void) { gather_write(1); }

/* A read that must return EAGAIN without waiting. */
static int reads_eagain_at_once(int fd, char *why, size_t n)
{
    char c;
    double t0 = now_ms();
    ssize_t r = read(fd, &c, 1);
    int e = errno;
    double ms = now_ms() - t0;
    if (r != -1 || e != EAGAIN) {
        snprintf(why, n, "read=%zd_errno=%d", r, e);
        return 0;
    }
    if (ms > 50) {
        snprintf(why, n, "eagain_after_%.0fms", ms);
        return 0;
    }
    return 1;
}

/* A read that waits for the byte `peer` gets `delay_us` later. */
static int reads_after_wait(int fd, int peer, int delay_us, char *why, size_t n)
{
    after(peer, delay_us, 1);
    char c;
    ssize_t r = read(fd, &c, 1);
    if (r != 1) {
        snprintf(why, n, "read=%zd_errno=%d", r, errno);
        return 0;
    }
    return 1;
}

static void flip_nonblock(void)
{
    int sv[2];
    char why[64];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    int on = 1, off = 0, ok = reads_after_wait(sv[0], sv[1], 1000, why, sizeof why);
    if (ok) {
        fcntl(sv[0], F_SETFL, fcntl(sv[0], F_GETFL) | O_NONBLOCK);
        ok = reads_eagain_at_once(sv[0], why, sizeof why);
    }
    if (ok && ioctl(sv[0], FIONBIO, &off) == 0)
        ok = reads_after_wait(sv[0], sv[1], 2000, why, sizeof why);
    if (ok && ioctl(sv[0], FIONBIO, &on) == 0)
        ok = reads_eagain_at_once(sv[0], why, sizeof why);
    if (ok) {
        fcntl(sv[0], F_SETFL, fcntl(sv[0], F_GETFL) & ~O_NONBLOCK);
        ok = reads_after_wait(sv[0], sv[1], 2000, why, sizeof why);
    }
    close(sv[0]);
    close(sv[1]);
    if (!ok)
        FAIL("%s", why);
}

static void flip_rcvtimeo(void)
{
    int sv[2];
    char why[64];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        FAIL("socketpair");
    int ok = reads_after_wait(sv[0], sv[1], 1000, why, sizeof why);
    struct timeval tv = {0, 100 * 1000};
    if (ok) {
        setsockopt(sv[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        char c;
        double t0 = now_ms();
        ssize_t r = read(sv[0], &c, 1);
        int e = errno;
        double ms = now_ms() - t0;
        if (r != -1 || e != EAGAIN)
            ok = 0, snprintf(why, sizeof why, "timed_read=%zd_errno=%d", r, e);
        else if (ms < 95 || ms > 1000)
            ok = 0, snprintf(why, sizeof why, "timed_out_after_%.0fms", ms);
    }
    if (ok) {
        tv.tv_usec = 0;
        setsockopt(sv[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        ok = reads_after_wait(sv[0], sv[1], 300 * 1000, why, sizeof why);
    }
    close(sv[0]);
    close(sv[1]);
    if (!ok)
        FAIL("%s", why);
}

static void dup2_nonblock(void)
{
    int a[2], b[2];
    char why[64];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, a) ||
        socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, b))
        FAIL("socketpair");
    int ok = reads_after_wait(a[0], a[1], 1000, why, sizeof why);
    if (ok && dup2(b[0], a[0]) < 0)
        ok = 0, snprintf(why, sizeof why, "dup2");
    if (ok)
        ok = reads_eagain_at_once(a[0], why, sizeof why);
    close(a[0]);
    close(a[1]);
    close(b[0]);
    close(b[1]);
    if (!ok)
        FAIL("%s", why);
}


/* A connected loopback TCP pair: sv[0] accepted, sv[1] the client. */
static int tcp_pair(int sv[2])
{
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t len = sizeof sa;
    if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) || listen(l, 8) ||
        getsockname(l, (struct sockaddr *)&sa, &len))
        return -1;
    sv[1] = socket(AF_INET, SOCK_STREAM, 0);
    if (sv[1] < 0 || connect(sv[1], (struct sockaddr *)&sa, sizeof sa))
        return -1;
    sv[0] = accept(l, NULL, NULL);
    close(l);
    return sv[0] < 0 ? -1 : 0;
}

/* Reads exactly n bytes (a server's read of one request). */
static ssize_t read_exact(int fd, char *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r <= 0)
            return r;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* sv[0] read once, then waited on once (a byte sent 2 ms later), as a server's
 * connection is after its first request. */
static int tcp_pair_waited(int sv[2])
{
    if (tcp_pair(sv))
        return -1;
    char c[2];
    if (write(sv[1], "a", 1) != 1 || read(sv[0], c, 1) != 1)
        return -1;
    after(sv[1], 2000, 1);
    return read(sv[0], c, 1) == 1 ? 0 : -1;
}

static void pipelined(void)
{
    int sv[2];
    if (tcp_pair_waited(sv))
        FAIL("setup_errno=%d", errno);
    static char two[2048], buf[1024];
    memset(two, 'p', sizeof two);
    if (write(sv[1], two, sizeof two) != (ssize_t)sizeof two)
        FAIL("write_errno=%d", errno);
    usleep(5000); /* both requests queued, their arrival seen */
    ssize_t r1 = read_exact(sv[0], buf, sizeof buf);
    double t0 = now_ms();
    ssize_t r2 = read_exact(sv[0], buf, sizeof buf);
    double ms = now_ms() - t0;
    close(sv[0]);
    close(sv[1]);
    if (r1 != 1024 || r2 != 1024)
        FAIL("reads=%zd,%zd", r1, r2);
    if (ms > 30)
        FAIL("second_request_after_%.0fms", ms);
}

static void drained_eof(void)
{
    int sv[2];
    if (tcp_pair_waited(sv))
        FAIL("setup_errno=%d", errno);
    char c[4];
    if (write(sv[1], "abc", 3) != 3 || read_exact(sv[0], c, 3) != 3)
        FAIL("read_errno=%d", errno);
    spawn_detached(shutdown_later, (void *)(long)sv[1]);
    double t0 = now_ms();
    ssize_t r = read(sv[0], c, 1);
    int e = errno;
    double ms = now_ms() - t0;
    usleep(1000);
    close(sv[0]);
    close(sv[1]);
    if (r != 0)
        FAIL("read=%zd_errno=%d", r, e);
    if (ms > 30)
        FAIL("eof_after_%.0fms", ms);
}

static void *echo_64(void *p)
{
    int fd = (int)(long)p;
    char b[64];
    while (read_exact(fd, b, sizeof b) == (ssize_t)sizeof b)
        if (write(fd, b, sizeof b) != (ssize_t)sizeof b)
            break;
    return NULL;
}

static void pingpong(void)
{
    int sv[2];
    if (tcp_pair(sv))
        FAIL("setup_errno=%d", errno);
    spawn_detached(echo_64, (void *)(long)sv[0]);
    char b[64], back[64];
    for (int i = 0; i < 200; i++) {
        memset(b, 'a' + i % 26, sizeof b);
        if (write(sv[1], b, sizeof b) != (ssize_t)sizeof b ||
            read_exact(sv[1], back, sizeof back) != (ssize_t)sizeof back)
            FAIL("round_%d_errno=%d", i, errno);
        if (memcmp(b, back, sizeof b))
            FAIL("round_%d_wrong_echo", i);
    }
    shutdown(sv[1], SHUT_WR);
    usleep(2000);
    close(sv[1]);
    close(sv[0]);
}

static void inq_cmsg(void)
{
    int sv[2];
    if (tcp_pair_waited(sv))
        FAIL("setup_errno=%d", errno);
    if (write(sv[1], "0123456789", 10) != 10)
        FAIL("write_errno=%d", errno);
    char buf[16];
    union {
        struct cmsghdr h;
        char b[64];
    } ctl;
    struct iovec iov = {buf, sizeof buf};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = &ctl,
                        .msg_controllen = sizeof ctl};
    ssize_t r = recvmsg(sv[0], &mh, 0);
    int e = errno;
    close(sv[0]);
    close(sv[1]);
    if (r != 10)
        FAIL("recvmsg=%zd_errno=%d", r, e);
    if (mh.msg_controllen != 0) {
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        FAIL("cmsg_level=%d_type=%d", c ? c->cmsg_level : -1, c ? c->cmsg_type : -1);
    }
}

static const struct {
    const char *name;
    void (*fn)(void);
} checks[] = {
    {"nonblock_read", nonblock_read}, {"dontwait_recv", dontwait_recv},
    {"flags_kept", flags_kept},       {"rcvtimeo", rcvtimeo},
    {"sndtimeo", sndtimeo},
    {"full_write", full_write},       {"pipe_full_write", pipe_full_write},
    {"waitall", waitall},             {"fd_reuse", fd_reuse},
    {"dup2_over", dup2_over},         {"refused", refused},
    {"poll_zero", poll_zero},         {"accept4_nonblock", accept4_nonblock},
    {"shared_accept", shared_accept}, {"two_readers", two_readers},
    {"duplex", duplex},               {"poll_file", poll_file},
    {"poll_nval", poll_nval},         {"poll_negative", poll_negative},
    {"select_file", select_file},     {"epoll_timeout", epoll_timeout},
    {"epoll_wake", epoll_wake},       {"readv_wait", readv_wait},
    {"recvmsg_wait", recvmsg_wait},   {"recvmsg_waitall", recvmsg_waitall},
    {"udp_wait", udp_wait},           {"peek", peek},
    {"accept_timeo", accept_timeo},   {"connect_timeo", connect_timeo},
    {"sigpipe", sigpipe},             {"peer_shutdown", peer_shutdown},
    {"writev_full", writev_full},     {"sendmsg_full", sendmsg_full},
    {"flip_nonblock", flip_nonblock}, {"flip_rcvtimeo", flip_rcvtimeo},
    {"dup2_nonblock", dup2_nonblock}, {"pipelined", pipelined},
    {"drained_eof", drained_eof},     {"pingpong", pingpong},
    {"inq_cmsg", inq_cmsg},
};

static void *run_check(void *p)
{
    long i = (long)p;
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    snprintf(result, sizeof result, "ok");
    checks[i].fn();
    __atomic_store_n(&done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(int argc, char **argv)
{
    int n = (int)(sizeof checks / sizeof checks[0]);
    const char *hm = getenv("RT_HANG_MS");
    int hang_ms = hm && atoi(hm) > 0 ? atoi(hm) : 5000;
    if (argc > 1 && strcmp(argv[1], "--list") == 0) {
        for (int i = 0; i < n; i++)
            printf("%s\n", checks[i].name);
        return 0;
    }
    for (long i = 0; i < n; i++) {
        if (argc > 1 && strcmp(argv[1], checks[i].name) != 0)
            continue;
        __atomic_store_n(&done, 0, __ATOMIC_SEQ_CST);
        spawn_detached(run_check, (void *)i);
        for (int k = 0; k < hang_ms && !__atomic_load_n(&done, __ATOMIC_SEQ_CST); k++) {
            struct timespec ts = {0, 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (!__atomic_load_n(&done, __ATOMIC_SEQ_CST)) {
            printf("%s=hang\n", checks[i].name);
            fflush(stdout);
            _exit(3);
        }
        printf("%s=%s\n", checks[i].name, result);
        fflush(stdout);
    }
    printf("on_fiber=%d checks=%d\n", on_fiber, n);
    return 0;
}
