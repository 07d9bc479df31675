/*
 * rt_tls_dtor: C++ thread_local destructors run when each thread (fiber) ends.
 *
 * A connection's session as a C++ server keeps it: a thread_local object that owns a
 * heap buffer and frees it in its destructor. N workers (fibers under
 * TOFFLOAD_FIBERIZE=all) each use their session, then give the carrier away ROUNDS
 * times (sched_yield, usleep, and a raw futex wait the runtime does not see, which
 * blocks the carrier long enough for the handoff to move the others to a spare
 * thread), checking after each that the session is still theirs. main joins them all
 * and counts the destructors that ran by then: glibc runs a thread's before its join
 * returns.
 *   prints: workers=N on_fiber=K constructed=C destroyed=D wrong=W moved=M
 *   rt_tls_dtor [N]
 * wrong: a destructor that saw another worker's session, ran twice for one worker or
 * ran outside its worker (its thread_local id not the session's owner), or a check
 * that found another worker's session; moved: checks made on another thread than the
 * previous one.
 */
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

extern "C" long toffload_fiber_id(void) __attribute__((weak));
static long fiber_id() { return toffload_fiber_id ? toffload_fiber_id() : 0; }

enum { MAXW = 256, ROUNDS = 8, BUF = 4096 };

static std::atomic<int> constructed, destroyed, wrong, on_fiber, moved;
static std::atomic<int> destroyed_for[MAXW];
static int never; /* futex word nobody wakes */

static thread_local int me = -1;

struct Session {
    int owner = -1;
    char *buf;
    Session() : buf(static_cast<char *>(malloc(BUF))) { constructed++; }
    ~Session()
    {
        if (owner < 0 || owner >= MAXW || me != owner || buf[0] != 'a' + owner % 26 ||
            destroyed_for[owner]++ != 0)
            wrong++;
        free(buf);
        destroyed++;
    }
};

static thread_local Session session;

/* Blocks this thread in the kernel for `us`, unseen by the runtime. */
static void raw_wait(long us)
{
    struct timespec ts = {0, us * 1000};
    syscall(SYS_futex, &never, FUTEX_WAIT_PRIVATE, 0, &ts, nullptr, 0);
}

static void *worker(void *p)
{
    int id = static_cast<int>(reinterpret_cast<long>(p));
    if (fiber_id() > 0)
        on_fiber++;
    me = id;
    session.owner = id;
    memset(session.buf, 'a' + id % 26, BUF);
    long tid = syscall(SYS_gettid);
    for (int r = 0; r < ROUNDS; r++) {
        switch (r % 3) {
        case 0: sched_yield(); break;
        case 1: usleep(300); break;
        default: raw_wait(3000); break;
        }
        long now = syscall(SYS_gettid);
        if (now != tid)
            moved++;
        tid = now;
        if (session.owner != id || me != id || session.buf[BUF - 1] != 'a' + id % 26)
            wrong++;
    }
    return nullptr;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 16;
    if (n < 1 || n > MAXW) {
        fprintf(stderr, "rt_tls_dtor: 1..%d workers\n", MAXW);
        return 2;
    }
    pthread_t t[MAXW];
    for (int i = 0; i < n; i++)
        if (pthread_create(&t[i], nullptr, worker, reinterpret_cast<void *>(static_cast<long>(i))) != 0) {
            perror("pthread_create");
            return 1;
        }
    for (int i = 0; i < n; i++)
        pthread_join(t[i], nullptr);
    printf("workers=%d on_fiber=%d constructed=%d destroyed=%d wrong=%d moved=%d\n", n,
           on_fiber.load(), constructed.load(), destroyed.load(), wrong.load(), moved.load());
    return 0;
}
