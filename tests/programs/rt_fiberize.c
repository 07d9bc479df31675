/*
 * rt_fiberize: which threads become fibers (TOFFLOAD_FIBERIZE).
 *
 * Thread A is created at start-up, before any accept; it connects to our own
 * listening socket. The main thread then accepts that connection with
 * accept4() (not accept()) and creates thread B. Each thread reports whether
 * it runs on a fiber, and B also echoes one byte over the accepted
 * connection (a read that parks under the runtime), then joins A (under the
 * default, a fiber joining a real thread) and checks A's return value.
 *   prints: before=0|1 after=0|1 echo_ok=0|1 join_ok=0|1
 * Expected: after-accept (the default): before=0 after=1; all: 1 1; off: 0 0.
 */
#define _GNU_SOURCE
#include "common.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

static struct sockaddr_in addr;
static int before = -1, after = -1, echo_ok;
static int conn_fd = -1, join_ok;
static pthread_t a;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_fiberize: %s: %s\n", what, strerror(e));
    exit(2);
}

static void *thread_a(void *p)
{
    (void)p;
    before = fiber_id() > 0;
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (struct sockaddr *)&addr, sizeof addr))
        die("connect", errno);
    char ch;
    if (write(c, "e", 1) != 1 || read(c, &ch, 1) != 1)
        die("echo (client)", errno);
    echo_ok = ch == 'e';
    close(c);
    usleep(20 * 1000); /* B is joining by now */
    return (void *)0x1234;
}

static void *thread_b(void *p)
{
    (void)p;
    after = fiber_id() > 0;
    char ch;
    if (read(conn_fd, &ch, 1) != 1 || write(conn_fd, &ch, 1) != 1)
        die("echo (server)", errno);
    void *v = NULL;
    int e = pthread_join(a, &v);
    join_ok = e == 0 && v == (void *)0x1234;
    return NULL;
}

int main(void)
{
    int l = socket(AF_INET, SOCK_STREAM, 0);
    addr.sin_family = AF_INET;
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    socklen_t len = sizeof addr;
    if (l < 0 || bind(l, (struct sockaddr *)&addr, sizeof addr) || listen(l, 8) ||
        getsockname(l, (struct sockaddr *)&addr, &len))
        die("listen", errno);
    pthread_t b;
    int e = pthread_create(&a, NULL, thread_a, NULL);
    if (e)
        die("pthread_create", e);
    conn_fd = accept4(l, NULL, NULL, SOCK_CLOEXEC);
    if (conn_fd < 0)
        die("accept4", errno);
    if ((e = pthread_create(&b, NULL, thread_b, NULL)))
        die("pthread_create", e);
    pthread_join(b, NULL);
    printf("before=%d after=%d echo_ok=%d join_ok=%d\n", before, after, echo_ok, join_ok);
    return 0;
}
