/*
 * rt_tls: the program's own __thread variables are per fiber (TOFFLOAD_FIBER_TLS).
 *
 * A session pointer in thread-local storage, as mariadbd keeps `current_thd`: N
 * workers (fibers under TOFFLOAD_FIBERIZE=all) each check that their __thread
 * variables start from the program's initial values (not the creator's, not another
 * worker's), point `current` at their own session and tag a __thread buffer, then
 * give the carrier away ROUNDS times (sched_yield, usleep, and a raw futex wait the
 * runtime does not see, which blocks the carrier long enough for the handoff to move
 * the others to a spare thread), checking after each that everything is still theirs.
 *   prints: fibers=N on_fiber=K initial_bad=I bad=B moved=M stale=S
 *   rt_tls [N]
 * initial_bad: workers whose variables did not start from the initial image; bad:
 * checks that found another worker's value; moved: checks made on another thread
 * than the previous one (the fiber was moved by the handoff); stale: checks after a
 * move where an address of the buffer taken before it (the old thread's) no longer
 * read the worker's tag: compiled code keeps the thread pointer across calls, and a
 * __thread address is the running thread's (reported, not a failure).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id(void) { return toffload_fiber_id ? toffload_fiber_id() : 0; }

enum { MAXW = 256, ROUNDS = 12 };

struct session {
    int owner;
};

static __thread struct session *current; /* .tbss: starts NULL */
static __thread int magic = 42;          /* .tdata: starts 42 */
static __thread char tag[48];

static int nworkers = 16;
static int started, finished, on_fiber, initial_bad, bad, moved, stale;
static struct session sessions[MAXW];
static int never; /* futex word nobody wakes */

/* The buffer's address on the thread that runs the caller now: not inlined, so that
 * the thread pointer is read afresh (a caller may keep it across calls). */
__attribute__((noinline)) static char *tag_here(void)
{
    char *t = tag;
    __asm__ volatile("" : "+r"(t));
    return t;
}

static int mine(int me)
{
    char want[sizeof tag];
    snprintf(want, sizeof want, "worker-%d", me);
    return current == &sessions[me] && magic == 1000 + me && strcmp(tag_here(), want) == 0;
}

/* Blocks this thread in the kernel for `us`, unseen by the runtime. */
static void raw_wait(long us)
{
    struct timespec ts = {0, us * 1000};
    syscall(SYS_futex, &never, FUTEX_WAIT_PRIVATE, 0, &ts, NULL, 0);
}

static void *worker(void *p)
{
    int me = (int)(long)p;
    if (fiber_id() > 0)
        __atomic_fetch_add(&on_fiber, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&started, 1, __ATOMIC_SEQ_CST);
    /* Start checks after earlier workers set their values: with shared storage a
     * later worker then sees them. */
    while (__atomic_load_n(&started, __ATOMIC_SEQ_CST) < nworkers)
        sched_yield();
    usleep(300 * (unsigned)me);
    if (current != NULL || magic != 42 || tag[0] != 0)
        __atomic_fetch_add(&initial_bad, 1, __ATOMIC_SEQ_CST);
    sessions[me].owner = me;
    current = &sessions[me];
    magic = 1000 + me;
    snprintf(tag, sizeof tag, "worker-%d", me);
    long tid = syscall(SYS_gettid);
    char *before = tag_here();
    for (int r = 0; r < ROUNDS; r++) {
        switch (r % 3) {
        case 0:
            sched_yield();
            break;
        case 1:
            usleep(200);
            break;
        default:
            raw_wait(3000);
            sched_yield(); /* the runtime entry where a moved fiber follows its carrier */
        }
        if (!mine(me))
            __atomic_fetch_add(&bad, 1, __ATOMIC_SEQ_CST);
        long now = syscall(SYS_gettid);
        if (now != tid) {
            __atomic_fetch_add(&moved, 1, __ATOMIC_SEQ_CST);
            if (strcmp(before, tag_here()) != 0)
                __atomic_fetch_add(&stale, 1, __ATOMIC_SEQ_CST);
            before = tag_here();
        }
        tid = now;
    }
    __atomic_fetch_add(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        nworkers = atoi(argv[1]);
    if (nworkers < 1 || nworkers > MAXW) {
        fprintf(stderr, "usage: rt_tls [N 1..%d]\n", MAXW);
        return 2;
    }
    /* The creator's own values must not leak into its workers. */
    magic = 7;
    snprintf(tag, sizeof tag, "main");
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < nworkers; i++) {
        pthread_t t;
        int e = pthread_create(&t, &a, worker, (void *)(long)i);
        if (e) {
            fprintf(stderr, "rt_tls: pthread_create: %s\n", strerror(e));
            return 2;
        }
    }
    struct timespec ms = {0, 1000000};
    for (int i = 0; i < 20000 && __atomic_load_n(&finished, __ATOMIC_SEQ_CST) < nworkers; i++)
        nanosleep(&ms, NULL);
    if (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < nworkers) {
        fprintf(stderr, "rt_tls: workers did not finish within 20 s\n");
        return 2;
    }
    if (magic != 7 || strcmp(tag, "main") != 0)
        bad++;
    printf("fibers=%d on_fiber=%d initial_bad=%d bad=%d moved=%d stale=%d\n", nworkers,
           on_fiber, initial_bad, bad, moved, stale);
    return 0;
}
