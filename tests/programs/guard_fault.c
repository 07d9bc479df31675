/*
 * guard_fault: faults under the conflict guard. A fiber (TOFFLOAD_FIBERIZE=all)
 * writes the guarded page (so the guard is armed and handling faults), then:
 *   null      dereferences a null pointer: the process must die of SIGSEGV;
 *   handler   installs its own SIGSEGV handler with sigaction, then dereferences a
 *             bad pointer: the handler must run ("caught" on stdout, exit 42);
 *   signal    the same with signal().
 * Prints "fiber=<id>" first, so the test can check the code ran on a fiber.
 */
#include <stdint.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>

extern long toffload_fiber_id(void) __attribute__((weak));

#define PAGE 4096
struct page {
    long v;
    char rest[PAGE - sizeof(long)];
};
struct page guarded __attribute__((aligned(PAGE)));

static const char *mode;

static void on_segv(int sig)
{
    (void)sig;
    static const char msg[] = "caught\n";
    if (write(1, msg, sizeof msg - 1) < 0)
        _exit(3);
    _exit(42);
}

static void *body(void *arg)
{
    (void)arg;
    printf("fiber=%ld\n", toffload_fiber_id ? toffload_fiber_id() : 0L);
    fflush(stdout);
    guarded.v++; /* a guarded write: the guard handles this fault itself */
    usleep(1000);
    guarded.v++;
    if (strcmp(mode, "handler") == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_segv;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, NULL);
    } else if (strcmp(mode, "signal") == 0) {
        signal(SIGSEGV, on_segv);
    }
    /* Through a volatile integer, so the compiler cannot see the bad address. */
    volatile uintptr_t addr = strcmp(mode, "null") == 0 ? 0 : 16;
    *(volatile long *)addr = 1;
    printf("survived a bad pointer\n");
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: guard_fault null|handler|signal\n");
        return 2;
    }
    mode = argv[1];
    pthread_t t;
    if (pthread_create(&t, NULL, body, NULL) != 0)
        return 1;
    pthread_join(t, NULL);
    return 0;
}
