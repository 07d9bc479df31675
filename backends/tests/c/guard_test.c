/*
 * The guard's C API as an event loop uses it: two requests (tokens) interleaved by
 * hand on one thread, each a read-modify-write of one counter across its "offload".
 * Run once per TOFFLOAD_GUARD mode (the first argument names the mode expected):
 * off loses the first request's update, detect reports it, enforce sends the second
 * request back to its sigsetjmp point until the first has ended, and loses nothing.
 */
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "toffload_accel.h"

static int failures;

static void check(int ok, const char *what) {
    printf("%s %s\n", ok ? "ok" : "FAIL", what);
    failures += !ok;
}

static volatile unsigned long long *counter;

/* The second request: begin, read, (park, resume), write back, end. 1 when it was
 * sent back instead. */
static int second(void) {
    sigjmp_buf env;
    if (sigsetjmp(env, 0))
        return 1;
    toffload_guard_begin(2, &env);
    unsigned long long v = *counter;
    toffload_guard_park(2);
    toffload_guard_resume(2);
    *counter = v + 1;
    toffload_guard_end(2);
    return 0;
}

int main(int argc, char **argv) {
    const char *want = argc > 1 ? argv[1] : "off";
    static const char *const names[] = {"off", "detect", "enforce"};
    int mode = toffload_guard_mode();
    if (!strcmp(want, "invalid")) {
        check(mode == -EINVAL, "a malformed TOFFLOAD_GUARD: mode -EINVAL");
        char page[16];
        check(toffload_guard_register(page, sizeof page) == -EINVAL, "register refused");
        printf("%d failures\n", failures);
        return failures != 0;
    }
    check(mode >= 0 && mode <= 2 && !strcmp(names[mode], want), "the mode is TOFFLOAD_GUARD's");
    void *mem = mmap(NULL, 2 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    counter = mem;
    check(toffload_guard_register(NULL, 8) == -EINVAL, "register NULL: -EINVAL");
    check(toffload_guard_register(mem, 0) == -EINVAL, "register 0 bytes: -EINVAL");
    check(toffload_guard_register(mem, 4096) == 0, "register a page");
    if (mode != 0) {
        check(toffload_guard_register((char *)mem + 100, 8) == -EEXIST, "register it again: -EEXIST");
        check(toffload_guard_park(99) == -ENOENT, "park an unknown token: -ENOENT");
    }
    check(toffload_guard_begin(0, NULL) == -EINVAL, "token 0: -EINVAL");

    /* The first request reads, parks at its offload ... */
    sigjmp_buf env;
    if (sigsetjmp(env, 0)) {
        check(0, "the first request was sent back");
        return 1;
    }
    toffload_guard_begin(1, &env);
    unsigned long long v1 = *counter;
    toffload_guard_park(1);
    /* ... the second runs whole meanwhile (or is sent back) ... */
    int sent_back = second();
    /* ... the first resumes and writes back what it read plus one. */
    toffload_guard_resume(1);
    *counter = v1 + 1;
    int freed = toffload_guard_end(1);
    if (sent_back && second())
        check(0, "the second request was sent back after the first ended");

    struct toffload_guard_stats s;
    check(toffload_guard_stats(&s) == 0 && s.mode == mode, "stats");
    printf("uffd_async %d, counter %llu, sent back %d, pages %llu, faults %llu, conflicts %llu, deferred %llu, released %llu\n",
           s.uffd_async, *counter, sent_back, s.pages, s.faults, s.conflicts, s.deferred, s.released);
    switch (mode) {
    case 0:
        check(*counter == 1 && s.faults == 0, "off: an update lost, nothing seen");
        break;
    case 1:
        check(*counter == 1 && s.conflicts == 1 && !sent_back, "detect: the lost update is a conflict");
        break;
    case 2:
        check(*counter == 2 && sent_back && s.deferred == 1 && s.released == 0 && freed == 1,
              "enforce: the second waited, nothing lost");
        break;
    }
    /* A fault that is not the guard's keeps its meaning. */
    pid_t pid = fork();
    if (pid == 0) {
        *(volatile int *)((char *)mem + 4096 + 64) = 0; /* fine: unguarded, writable */
        mprotect((char *)mem + 4096, 4096, PROT_NONE);
        *(volatile int *)((char *)mem + 4096 + 64) = 1;
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
    check(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV, "a bad access elsewhere still dies of SIGSEGV");
    printf("%d failures\n", failures);
    return failures != 0;
}
