/* Exercises libtoffload_accel.so through its C header, as a server would.
 * Usage: abi_test [normal|badknob|unusable ERRNO|oom]. Prints one line per check; exits 1
 * on a failure. unusable: a backend that could not start (cuda without a GPU). */
#include "toffload_accel.h"
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int failures;
#define CHECK(cond, ...)                                                                 \
    do {                                                                                 \
        if (cond) {                                                                      \
            printf("ok   " __VA_ARGS__);                                                 \
        } else {                                                                         \
            printf("FAIL " __VA_ARGS__);                                                 \
            failures++;                                                                  \
        }                                                                                \
        printf("\n");                                                                    \
    } while (0)

/* SP 800-38A's first plaintext block under the device key and counter. */
static const unsigned char plain[16] = {0x6b, 0xc1, 0xbe, 0xe2, 0x2e, 0x40, 0x9f, 0x96,
                                        0xe9, 0x3d, 0x7e, 0x11, 0x73, 0x93, 0x17, 0x2a};
static const unsigned char cipher[16] = {0x0d, 0x66, 0x79, 0x0a, 0x1a, 0x12, 0xae, 0xde,
                                         0x7e, 0x6c, 0xa0, 0x16, 0x40, 0x85, 0xba, 0x87};

static int normal(void) {
    unsigned char buf[16];
    memcpy(buf, plain, 16);
    CHECK(accel_run(buf, 16) == 0 && memcmp(buf, cipher, 16) == 0, "accel_run known answer");

    memcpy(buf, plain, 16);
    long id = accel_submit(buf, 16);
    CHECK(id >= 0, "accel_submit -> handle %ld", id);
    int fd = accel_completion_fd();
    CHECK(fd >= 0, "accel_completion_fd -> %d", fd);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    CHECK(poll(&p, 1, 5000) == 1, "completion fd readable");
    uint64_t v;
    CHECK(read(fd, &v, 8) == 8 && v >= 1, "completion fd read");
    int d;
    while ((d = accel_done(id)) == 0) {
    }
    CHECK(d == 1 && memcmp(buf, cipher, 16) == 0, "accel_done -> 1 and result correct");
    CHECK(accel_release(id) == 0, "accel_release");
    CHECK(accel_release(id) == -EBADF, "double release -> -EBADF");
    CHECK(accel_done(id) == -EBADF, "released handle -> -EBADF");
    CHECK(accel_done(987654321) == -EBADF, "unknown handle -> -EBADF");
    CHECK(accel_done(-5) == -EBADF, "negative handle -> -EBADF");
    /* Polled: no completion signal; accel_done finds it done from its due time on.
     * Backends that only signal completions (cuda, remote) say -EOPNOTSUPP. */
    const char *be = getenv("TOFFLOAD_BACKEND");
    memcpy(buf, plain, 16);
    int64_t due = -1;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t t0 = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    long pid_ = accel_submit_polled(buf, 16, &due);
    if (be && strcmp(be, "cuda") == 0) {
        CHECK(pid_ == -EOPNOTSUPP, "cuda: accel_submit_polled -> -EOPNOTSUPP (%ld)", pid_);
    } else {
        CHECK(pid_ >= 0 && due > t0, "accel_submit_polled -> handle %ld, due %lld ns on", pid_,
              (long long)(due - t0));
        while ((d = accel_done(pid_)) == 0) {
        }
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t t1 = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
        CHECK(d == 1 && t1 >= due && memcmp(buf, cipher, 16) == 0,
              "polled op done at its due time, result correct");
        CHECK(accel_release(pid_) == 0, "polled op released");
        CHECK(accel_submit_polled(NULL, 16, NULL) == -EFAULT, "polled null buffer -> -EFAULT");
    }
    CHECK(accel_submit(NULL, 16) == -EFAULT, "null buffer -> -EFAULT");
    CHECK(accel_run(NULL, 16) == -EFAULT, "accel_run null buffer -> -EFAULT");
    CHECK(accel_submit(buf, -1) == -EINVAL, "negative length -> -EINVAL");
    CHECK(accel_submit(buf, (64 << 20) + 1) == -EMSGSIZE, "oversized -> -EMSGSIZE");

    /* TOFFLOAD_EMU_MAX_INFLIGHT=4 is set by the test. */
    unsigned char many[5][16];
    long ids[5];
    for (int i = 0; i < 4; i++) ids[i] = accel_submit(many[i], 16);
    ids[4] = accel_submit(many[4], 16);
    CHECK(ids[0] >= 0 && ids[3] >= 0 && ids[4] == -EAGAIN, "5th op in flight -> -EAGAIN");
    for (int i = 0; i < 4; i++) accel_release(ids[i]);

    /* A forked child has no device thread of its parent's: it must get its own. A CUDA
     * context does not survive fork, so the cuda backend is exempt. */
    const char *backend = getenv("TOFFLOAD_BACKEND");
    if (backend && strcmp(backend, "cuda") == 0) {
        printf("skip accel_run in a forked child: CUDA does not survive fork\n");
        return failures ? 1 : 0;
    }
    pid_t pid = fork();
    if (pid == 0) {
        unsigned char b[16];
        memcpy(b, plain, 16);
        _exit(accel_run(b, 16) == 0 && memcmp(b, cipher, 16) == 0 ? 0 : 3);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "accel_run in a forked child");
    return failures ? 1 : 0;
}

static int badknob(void) {
    unsigned char buf[16];
    CHECK(accel_run(buf, 16) == -EINVAL, "misconfigured: accel_run -> -EINVAL");
    CHECK(accel_submit(buf, 16) == -EINVAL, "misconfigured: accel_submit -> -EINVAL");
    CHECK(accel_completion_fd() == -EINVAL, "misconfigured: accel_completion_fd -> -EINVAL");
    return failures ? 1 : 0;
}

/* The backend could not start: every call returns -expect (ENODEV, EIO, ...). */
static int unusable(int expect) {
    unsigned char buf[16];
    CHECK(accel_run(buf, 16) == -expect, "unusable: accel_run -> -%d", expect);
    CHECK(accel_submit(buf, 16) == -expect, "unusable: accel_submit -> -%d", expect);
    CHECK(accel_done(0) == -expect, "unusable: accel_done -> -%d", expect);
    CHECK(accel_release(0) == -expect, "unusable: accel_release -> -%d", expect);
    CHECK(accel_completion_fd() == -expect, "unusable: accel_completion_fd -> -%d", expect);
    return failures ? 1 : 0;
}

/* Device memory runs out for large operations (the test's fake driver says so above
 * 64 KiB): those fail with -ENOMEM, small ones still work. */
static int oom(void) {
    static unsigned char big[1 << 20];
    unsigned char buf[16];
    CHECK(accel_run(big, sizeof big) == -ENOMEM, "1 MiB without device memory -> -ENOMEM");
    CHECK(accel_submit(big, sizeof big) == -ENOMEM, "again -> -ENOMEM");
    memcpy(buf, plain, 16);
    CHECK(accel_run(buf, 16) == 0 && memcmp(buf, cipher, 16) == 0, "a small op still works");
    return failures ? 1 : 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "normal";
    int rc = strcmp(mode, "badknob") == 0    ? badknob()
             : strcmp(mode, "unusable") == 0 ? unusable(argc > 2 ? atoi(argv[2]) : ENODEV)
             : strcmp(mode, "oom") == 0      ? oom()
                                             : normal();
    printf("%d failures\n", failures);
    return rc;
}
