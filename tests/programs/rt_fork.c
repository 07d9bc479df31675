/*
 * rt_fork: fork() with fibers alive, from a real thread and from a fiber.
 *
 * The parent runs 4 background workers (fibers under TOFFLOAD_FIBERIZE=all)
 * that sleep 300 ms and then each write their process id into a shared pipe.
 * 50 ms in, while they are parked, it forks twice:
 *   main: from the real main thread;
 *   fiber: from a worker thread (a fiber).
 * Each child: 8 new workers each sleep 100 ms and offload, and are joined
 * (on fibers again, their sleeps must overlap: ~100 ms, not 800); then the
 * child waits 400 ms, long enough for any copy of the parent's background
 * workers to wake up in it, and exits 0 if everything checked out. As with
 * real threads, only the forking thread exists in the child: a background
 * worker that wakes up in the child (and writes the child's pid) is a ghost.
 * The parent gives each child 3 s (then SIGKILL), and counts the pipe's pids.
 *   prints: main_child=EXIT main_ms=X main_on_fiber=K fiber_child=EXIT
 *           fiber_ms=Y fiber_on_fiber=K parent_writes=4 ghost_writes=G
 * EXIT: the child's exit status (0 good, 1 a check failed, -9 killed after 3 s).
 */
#define _GNU_SOURCE
#include "common.h"
#include "toffload_accel.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

static int pfd[2];
static int bg_done;

static void die(const char *what, int e)
{
    fprintf(stderr, "rt_fork: %s: %s\n", what, strerror(e));
    exit(2);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

static void *background(void *p)
{
    (void)p;
    usleep(300 * 1000);
    pid_t me = getpid();
    if (write(pfd[1], &me, sizeof me) != (ssize_t)sizeof me)
        die("write(pipe)", errno);
    __atomic_fetch_add(&bg_done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static int child_on_fiber;

static void *child_worker(void *p)
{
    unsigned char buf[64] = {0};
    if (fiber_id() > 0)
        __atomic_fetch_add(&child_on_fiber, 1, __ATOMIC_SEQ_CST);
    usleep(100 * 1000);
    if (accel_run(buf, (int)sizeof buf) < 0)
        return NULL;
    return p;
}

/* The child's work; reports on the result pipe and exits. */
static void child_main(int rfd)
{
    enum { N = 8 };
    double t0 = now_ms();
    pthread_t t[N];
    int ok = 1;
    for (long i = 0; i < N; i++)
        if (pthread_create(&t[i], NULL, child_worker, (void *)(i + 1)))
            ok = 0;
    for (long i = 0; i < N && ok; i++) {
        void *v = NULL;
        ok = pthread_join(t[i], &v) == 0 && v == (void *)(i + 1);
    }
    double ms = now_ms() - t0;
    char line[128];
    int n = snprintf(line, sizeof line, "%.1f %d\n", ms, child_on_fiber);
    if (write(rfd, line, (size_t)n) != n)
        ok = 0;
    sleep_ms(400); /* a ghost background worker would wake up now */
    _exit(ok ? 0 : 1);
}

struct forked {
    pid_t pid;
    int rfd; /* read end of the child's result pipe */
};

static struct forked do_fork(void)
{
    int r[2];
    if (pipe(r) < 0)
        die("pipe", errno);
    pid_t pid = fork();
    if (pid < 0)
        die("fork", errno);
    if (pid == 0) {
        close(r[0]);
        child_main(r[1]);
    }
    close(r[1]);
    return (struct forked){pid, r[0]};
}

/* Waits up to 3 s for the child (its work takes ~0.5 s); returns its exit
 * status, -signal, or -9 after killing it. */
static int reap(pid_t pid)
{
    for (int i = 0; i < 3000; i++) {
        int st;
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
        sleep_ms(1);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -9;
}

static void report(const char *name, struct forked f)
{
    int st = reap(f.pid);
    char buf[128] = {0};
    ssize_t n = read(f.rfd, buf, sizeof buf - 1);
    close(f.rfd);
    double ms = -1;
    int on = -1;
    if (n > 0)
        sscanf(buf, "%lf %d", &ms, &on);
    printf("%s_child=%d %s_ms=%.1f %s_on_fiber=%d\n", name, st, name, ms, name, on);
    fflush(stdout);
}

static struct forked from_fiber;
static int forked_from_fiber;

static void *forker(void *p)
{
    (void)p;
    sleep_ms(50);
    from_fiber = do_fork();
    __atomic_store_n(&forked_from_fiber, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(void)
{
    if (pipe2(pfd, O_CLOEXEC) < 0)
        die("pipe", errno);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < 4; i++) {
        pthread_t t;
        int e = pthread_create(&t, &a, background, NULL);
        if (e)
            die("pthread_create", e);
    }
    pthread_t ft;
    int e = pthread_create(&ft, &a, forker, NULL);
    if (e)
        die("pthread_create", e);
    sleep_ms(50);
    struct forked from_main = do_fork();
    for (int i = 0; i < 5000 && !__atomic_load_n(&forked_from_fiber, __ATOMIC_SEQ_CST); i++)
        sleep_ms(1);
    if (!__atomic_load_n(&forked_from_fiber, __ATOMIC_SEQ_CST))
        die("the forking fiber did not fork", ETIMEDOUT);
    report("main", from_main);
    report("fiber", from_fiber);

    for (int i = 0; i < 5000 && __atomic_load_n(&bg_done, __ATOMIC_SEQ_CST) < 4; i++)
        sleep_ms(1);
    close(pfd[1]);
    int parent_writes = 0, ghost_writes = 0;
    pid_t who;
    pid_t me = getpid();
    /* Children have exited: every writer is gone, so this read ends. */
    while (read(pfd[0], &who, sizeof who) == (ssize_t)sizeof who) {
        if (who == me)
            parent_writes++;
        else
            ghost_writes++;
    }
    printf("parent_writes=%d ghost_writes=%d\n", parent_writes, ghost_writes);
    return 0;
}
