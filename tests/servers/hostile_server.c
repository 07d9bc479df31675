/*
 * hostile_server: like conn_server, but every request does an unlocked
 * read-modify-write of a global counter across the offload:
 *
 *     long v = st->counter; rc = accel_run(buf, size); st->counter = v + 1;
 *
 * (st = &shared_state[i]: one counter of SHARED_PAGES, each on its own page.)
 *
 * With real threads, or with fibers that do not migrate the window, updates
 * can be lost; `total` (atomic) counts what should have been counted. With
 * LOCKED=1 a global mutex is held across every request's offload (a coarse
 * lock: it cannot know which requests touch the counter), so nothing may be
 * lost. SHARED_EVERY=N makes only the requests whose first byte is a multiple
 * of N touch a counter (about 1/N of random requests: the contention knob);
 * default 1, every request. SHARED_PAGES=K (1..16, default 1) spreads the
 * counters over K pages: a request that touches shared state updates counter
 * buf[1] % K, each counter (with its own `total`) on a page of its own. The
 * coarse lock stays one global mutex: a program that cannot know which
 * counter a request touches takes one lock. On SIGTERM/SIGINT it prints
 *     shared=<S> total=<T> lost=<T-S>
 * on stdout and exits 0.
 */
#include "common.h"
#include "toffload_accel.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char PROG[] = "hostile_server";

/* Deliberately plain, non-static data in the executable's .bss: the test is
 * about what happens to such data across an offload. accel_run is an external
 * call that could read or write it, so the compiler must load the counter
 * before the call and store it after. On a page of its own: the conflict guard
 * works per page, and sharing one with read-mostly data (opts) would make it
 * serialize handlers that only read that. */
struct shared_state {
    long counter; /* the unlocked read-modify-write */
    long total;   /* successful counted offloads; only touched atomically */
    char rest_of_the_page[4096 - 2 * sizeof(long)];
};
#define MAX_SHARED_PAGES 16
struct shared_state shared_state[MAX_SHARED_PAGES] __attribute__((aligned(4096)));

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* Set once in main before the first thread is created; read-only after. */
static struct server_opts opts;
static int locked;
static unsigned shared_every = 1;
static unsigned shared_pages = 1;

static void must(int e, const char *what)
{
    if (e) {
        warn_errno(PROG, what, e);
        exit(1);
    }
}

/* The hazard: read the counter, wait for the offload, write it back. */
static int counted_offload(unsigned char *buf, int n)
{
    if (locked)
        must(pthread_mutex_lock(&lock), "pthread_mutex_lock");
    int rc;
    if (n > 0 && buf[0] % shared_every != 0) {
        rc = accel_run(buf, n); /* this request touches no shared state */
    } else {
        struct shared_state *st = &shared_state[n > 1 ? buf[1] % shared_pages : 0];
        long v = st->counter;
        rc = accel_run(buf, n);
        if (rc == 0) {
            /* total first: a report that reads shared, then total, never sees
             * more updates than were counted (lost >= 0 even mid-flight). */
            __atomic_fetch_add(&st->total, 1, __ATOMIC_SEQ_CST);
            st->counter = v + 1;
        }
    }
    if (locked)
        must(pthread_mutex_unlock(&lock), "pthread_mutex_unlock");
    return rc;
}

static void serve(int fd)
{
    serve_requests(PROG, fd, &opts, counted_offload);
}

/* Dedicated thread: printf is not async-signal-safe, so the signals are
 * blocked everywhere and collected here with sigwait. */
static void *signal_thread(void *p)
{
    const sigset_t *set = p;
    int sig, e;
    while ((e = sigwait(set, &sig)) != 0)
        if (e != EINTR)
            must(e, "sigwait");

    /* Quiescence first: a request the load generator left in flight at its end
     * (its reply no longer awaited) may sit between its total and its counter
     * when they are read, which reads as one update lost though none was. The
     * device answers within milliseconds; the pages are not touched meanwhile (a
     * real thread's first touch makes the guard give them up, and the requests
     * still in flight would then race for real). */
    struct timespec settle = {0, 200 * 1000 * 1000};
    nanosleep(&settle, NULL);

    long s;
    int have_lock = 0;
    if (locked) {
        /* Bounded wait: a runtime that deadlocked a lock holder must not
         * also stop us from reporting. */
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_sec += 2;
        have_lock = pthread_mutex_timedlock(&lock, &dl) == 0;
    }
    /* Every counter first, then every total: lost >= 0 even mid-flight. */
    s = 0;
    for (unsigned i = 0; i < shared_pages; i++)
        s += __atomic_load_n(&shared_state[i].counter, __ATOMIC_SEQ_CST);
    /* Read under the lock too, so a locked run reports a consistent pair. */
    long t = 0;
    for (unsigned i = 0; i < shared_pages; i++)
        t += __atomic_load_n(&shared_state[i].total, __ATOMIC_SEQ_CST);
    if (have_lock)
        must(pthread_mutex_unlock(&lock), "pthread_mutex_unlock");
    if (printf("shared=%ld total=%ld lost=%ld\n", s, t, t - s) < 0 || fflush(stdout) == EOF)
        exit(1);
    exit(0);
}

int main(int argc, char **argv)
{
    server_setup(PROG, argc, argv, &opts);
    const char *l = getenv("LOCKED");
    locked = l && strcmp(l, "1") == 0;
    const char *e = getenv("SHARED_EVERY");
    if (e && *e) {
        char *end;
        unsigned long v = strtoul(e, &end, 10);
        if (*end || v < 1 || v > 256) {
            fprintf(stderr, "%s: SHARED_EVERY=%s: expected an integer 1..256\n", PROG, e);
            return 2;
        }
        shared_every = (unsigned)v;
    }
    const char *k = getenv("SHARED_PAGES");
    if (k && *k) {
        char *end;
        unsigned long v = strtoul(k, &end, 10);
        if (*end || v < 1 || v > MAX_SHARED_PAGES) {
            fprintf(stderr, "%s: SHARED_PAGES=%s: expected an integer 1..%d\n", PROG, k,
                    MAX_SHARED_PAGES);
            return 2;
        }
        shared_pages = (unsigned)v;
    }

    /* Block before any thread exists so every thread inherits the mask and
     * only signal_thread ever receives SIGTERM/SIGINT. */
    static sigset_t set;
    if (sigemptyset(&set) < 0 || sigaddset(&set, SIGTERM) < 0 || sigaddset(&set, SIGINT) < 0) {
        warn_errno(PROG, "sigset", errno);
        return 1;
    }
    must(pthread_sigmask(SIG_BLOCK, &set, NULL), "pthread_sigmask");
    /* Created before the first accept, so a fiber runtime leaves it a real
     * thread. */
    pthread_t t;
    must(pthread_create(&t, NULL, signal_thread, &set), "pthread_create");
    must(pthread_detach(t), "pthread_detach");

    int lfd = listen_and_announce(PROG, &opts);
    accept_loop_threads(PROG, lfd, serve); /* never returns */
}
