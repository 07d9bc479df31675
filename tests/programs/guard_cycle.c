/*
 * guard_cycle: two handlers (fibers under TOFFLOAD_FIBERIZE=all) that each own a
 * guarded page the other then touches, the one ownership cycle enforce cannot
 * serialize: A writes page 1, sleeps, writes page 2; B writes page 2, sleeps
 * longer, writes page 1. Under TOFFLOAD_GUARD=enforce, A waits for page 2 (B owns
 * it) and B's touch of page 1 closes the cycle: the guard must find it, give one
 * page up and report it, never deadlock. Prints "done p1=N p2=M" (both 2) and
 * "fibers=K" (the workers that ran on fibers).
 */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

extern long toffload_fiber_id(void) __attribute__((weak));

#define PAGE 4096
struct page {
    volatile long v;
    char rest[PAGE - sizeof(long)];
};
struct page page1 __attribute__((aligned(PAGE)));
struct page page2 __attribute__((aligned(PAGE)));

/* Whether this worker is a fiber, as its return value: a counter in the program's
 * data would be one more guarded page both handlers touch first. */
static void *on_fiber(void)
{
    return (void *)(long)(toffload_fiber_id && toffload_fiber_id() > 0);
}

static void *a(void *arg)
{
    (void)arg;
    page1.v++;
    usleep(20 * 1000);
    page2.v++;
    return on_fiber();
}

static void *b(void *arg)
{
    (void)arg;
    usleep(5 * 1000);
    page2.v++;
    usleep(40 * 1000);
    page1.v++;
    return on_fiber();
}

int main(void)
{
    pthread_t ta, tb;
    if (pthread_create(&ta, NULL, a, NULL) || pthread_create(&tb, NULL, b, NULL)) {
        fprintf(stderr, "guard_cycle: pthread_create failed\n");
        return 2;
    }
    void *fa, *fb;
    pthread_join(ta, &fa);
    pthread_join(tb, &fb);
    printf("done p1=%ld p2=%ld\nfibers=%ld\n", page1.v, page2.v, (long)fa + (long)fb);
    return 0;
}
