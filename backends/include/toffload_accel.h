/*
 * toffload accelerator API (libtoffload_accel.so).
 *
 * The runtime never learns what the work is: an operation transforms a buffer in
 * place and completes later. Both backends (TOFFLOAD_BACKEND=emulated, the default,
 * and cuda, on an NVIDIA GPU) apply the same AES-128-CTR,
 * key 000102030405060708090a0b0c0d0e0f, initial counter block
 * f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff, the counter restarting for every operation,
 * so that out = in XOR keystream(len) and any client can verify a result.
 *
 * Every call returns a negative errno on failure and never crashes or hangs on bad
 * input. The buffer passed to accel_submit must stay valid until the operation is
 * done or released; after accel_release returns, the device no longer touches it.
 *
 * accel_release and accel_run return int (0 or -errno). Callers that declare them
 * void, as the original API does, stay ABI compatible: they just ignore the value.
 */
#ifndef TOFFLOAD_ACCEL_H
#define TOFFLOAD_ACCEL_H

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Start an operation on buf[0..n). Never blocks. Handle >= 0, or:
 * -EFAULT null buf (with n > 0), -EINVAL n < 0 or the device is misconfigured,
 * -EMSGSIZE n above the device's maximum, -EAGAIN too many operations in flight;
 * cuda: -ENODEV no driver or no device (every call, reported once at load),
 * -ENOMEM device or pinned memory exhausted, -EIO a driver or kernel failure. */
long accel_submit(unsigned char *buf, int n);

/* 1 done, 0 pending, -EBADF unknown or released handle, -EIO the operation failed. */
int accel_done(long id);

/* As accel_submit, for a caller that polls: the device raises no completion signal
 * (accel_completion_fd) for this operation and spends no wake-up on it; accel_done
 * at or after its due time finds it done. *due_ns (if not null) gets that time,
 * CLOCK_MONOTONIC nanoseconds, so that a poller with nothing else to do can sleep
 * until then. accel_wait-style blocking (accel_run) is unaffected. -EOPNOTSUPP where
 * the backend only signals completions (cuda, remote): use accel_submit. */
long accel_submit_polled(unsigned char *buf, int n, int64_t *due_ns);

/* Free the handle. A pending operation is cancelled: its buffer is left as it was
 * or fully transformed, never half. 0, or -EBADF for an unknown handle or a
 * second release. */
int accel_release(long id);

/* Blocking: submit, wait (TOFFLOAD_WAIT=spin busy-polls, block sleeps), release.
 * 0, or the -errno of the failing step. */
int accel_run(unsigned char *buf, int n);

/* An eventfd (non-blocking, close-on-exec) that becomes readable whenever an
 * operation completes; read it to reset. -EINVAL if the device is unusable. */
int accel_completion_fd(void);

/* ---- the conflict guard, for code that suspends requests without fibers ---------
 *
 * Overlapping offloads breaks the atomicity a handler relied on: a read-modify-write
 * of shared memory across its offload loses updates when another request writes the
 * same memory meanwhile. An integration that suspends a request around its offload
 * (an event loop's deferred response, e.g. RedisModule_BlockClient) names the request
 * with a token (any nonzero value, unique among live requests) and tells the guard
 * where the token runs; the guard watches the memory registered with it, with the
 * fiber runtime's conflict rule and mechanisms (docs/safety.md). The mode is
 * TOFFLOAD_GUARD, the runtime's knob, read once per process:
 *   off      every call below is a no-op that returns 0 (the default);
 *   detect   registered pages are write-protected (userfaultfd asynchronous
 *            write-protect and a PAGEMAP_SCAN per switch where the kernel has them,
 *            Linux 6.7+, else mprotect); a token that writes a page after
 *            it resumed, which another token wrote while it was parked, is a conflict
 *            (counted; the write happens);
 *   enforce  page ownership: a token's first access to a registered page makes it the
 *            owner until toffload_guard_end; another token that touches the page
 *            before then is sent back to its sigsetjmp point (see begin) so that the
 *            integration can defer it. Tokens that touch different pages overlap.
 * Faults are served by a SIGSEGV handler installed at the first registration; other
 * faults go to the handler that was there before. One thread runs tokens (an event
 * loop); accesses from other threads, or outside any token, are no token's (enforce
 * gives such a page up for good, counted in `released`).
 *
 *   sigjmp_buf env;
 *   if (sigsetjmp(env, 0)) { defer(req); return; }   busy: retry after an end
 *   toffload_guard_begin(req->token, &env);
 *   req->old = counters[i];                           first access: may jump back
 *   accel_submit(...); toffload_guard_park(req->token);
 *   ... completion ...
 *   toffload_guard_resume(req->token); counters[i] = req->old + 1;
 *   toffload_guard_end(req->token); reply(req); retry deferred requests
 *
 * The code between begin and park must be restartable: a jump back comes before it
 * has taken anything, as if it had never begun (the token is forgotten). Every call
 * returns a negative errno on failure: -EINVAL for a malformed TOFFLOAD_GUARD, a zero
 * token or an empty range, -ENOENT for a token that is not live. */

/* 0 off, 1 detect, 2 enforce; -EINVAL when TOFFLOAD_GUARD is malformed. */
int toffload_guard_mode(void);

/* Guard the whole pages covering ptr[0..len): page-aligned memory of the caller's
 * own (e.g. mmap'ed) is best, since everything else on those pages is guarded too;
 * never pages the allocator itself writes (its fault handler allocates).
 * -EEXIST when it overlaps a range already registered. */
int toffload_guard_register(void *ptr, size_t len);

/* The request `token` starts running on this thread. `retry`: where enforce sends it
 * back (sigsetjmp returns nonzero) when it touches a page a parked token owns; NULL:
 * such a page is given up instead. */
int toffload_guard_begin(uint64_t token, sigjmp_buf *retry);

/* It suspends at its offload (its park window opens; enforce: its pages become
 * inaccessible until it resumes). */
int toffload_guard_park(uint64_t token);

/* It runs again after its offload (the window closes; its later writes are checked). */
int toffload_guard_resume(uint64_t token);

/* It is over (its response is out): enforce frees its pages. The number of pages
 * freed (requests deferred for them can retry), or -errno. */
int toffload_guard_end(uint64_t token);

struct toffload_guard_stats {
    int mode;                     /* as toffload_guard_mode() */
    int uffd_async;               /* detect: 1 when userfaultfd async write-protect
                                     watches (Linux 6.7+), 0 mprotect */
    unsigned long long pages;     /* registered */
    unsigned long long faults;    /* accesses the guard saw */
    unsigned long long conflicts; /* detect: conflicting writes */
    unsigned long long deferred;  /* enforce: tokens sent back to wait */
    unsigned long long released;  /* enforce: pages given up (guarantee broken) */
};

int toffload_guard_stats(struct toffload_guard_stats *out);

#ifdef __cplusplus
}
#endif
#endif
