/*
 * rawfutex_server: conn_server's shape (a thread per connection, blocking
 * accel_run), but its connection threads synchronize below libc, as InnoDB does:
 * around every offload they take and release a process-wide lock built on raw
 * syscall(SYS_futex) and signal an "event" word with FUTEX_WAKE, so glibc's pthread
 * code never sees it. toffload-watch must call it below-libc.
 *
 * --hold-lock: hold the raw lock across accel_run instead (InnoDB holds its mutexes
 * across I/O). Under the fiber runtime a second connection's raw FUTEX_WAIT then
 * blocks the carrier that must complete the holder's offload: without the runtime's
 * blocked-carrier handoff the server freezes.
 */
#include "common.h"
#include "toffload_accel.h"

#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static const char PROG[] = "rawfutex_server";

/* 0 free, 1 locked, 2 locked with waiters (Drepper's futex mutex). */
static _Atomic uint32_t lock_word;
static _Atomic uint32_t event_word;

static long futex(_Atomic uint32_t *w, int op, uint32_t v)
{
    return syscall(SYS_futex, (uint32_t *)w, op, v, NULL, NULL, 0);
}

static void raw_lock(void)
{
    uint32_t c = 0;
    if (atomic_compare_exchange_strong(&lock_word, &c, 1))
        return;
    if (c != 2)
        c = atomic_exchange(&lock_word, 2);
    while (c != 0) {
        futex(&lock_word, FUTEX_WAIT_PRIVATE, 2);
        c = atomic_exchange(&lock_word, 2);
    }
}

static void raw_unlock(void)
{
    if (atomic_fetch_sub(&lock_word, 1) != 1) {
        atomic_store(&lock_word, 0);
        futex(&lock_word, FUTEX_WAKE_PRIVATE, 1);
    }
}

static int offload(unsigned char *buf, int n)
{
    /* Like InnoDB's os_event: a broadcast per state change, whether or not anyone
     * waits, so the futex calls per request do not depend on contention. */
    for (int i = 0; i < 4; i++)
        futex(&event_word, FUTEX_WAKE_PRIVATE, INT32_MAX);
    raw_lock();
    atomic_fetch_add(&event_word, 1);
    raw_unlock();
    return accel_run(buf, n);
}

static int offload_holding(unsigned char *buf, int n)
{
    raw_lock();
    atomic_fetch_add(&event_word, 1);
    int r = accel_run(buf, n);
    raw_unlock();
    return r;
}

int main(int argc, char **argv)
{
    int (*fn)(unsigned char *, int) = offload;
    int k = 1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--hold-lock") == 0)
            fn = offload_holding;
        else
            argv[k++] = argv[i];
    }
    argv[k] = NULL;
    thread_per_connection_main(PROG, k, argv, fn); /* never returns */
}
