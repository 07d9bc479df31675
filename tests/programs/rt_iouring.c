/*
 * rt_iouring: a fiber waits in io_uring_enter (a raw syscall the runtime does not
 * interpose) for a read that another fiber of the same carrier satisfies, while
 * more fibers keep serving a ping-pong over pipes.
 *
 * Under one carrier without the blocked-carrier handoff, the waiter's
 * io_uring_enter blocks the carrier and with it the writer: the program freezes
 * (it ends itself after LIMIT_S seconds, default 10, with frozen=1 and status 3). With handoff, the
 * carrier's other fibers move to a spare thread and everything completes.
 *   rt_iouring [ROUNDS [LIMIT_S]]   prints
 *   rounds=R done=D pings=P frozen=F elapsed_ms=E
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int rounds = 20, limit_s = 10;
static atomic_int done, pings, stop;
static int data_pipe[2];

struct ring {
    int fd;
    unsigned *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int ring_setup(struct ring *r)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r->fd = (int)syscall(SYS_io_uring_setup, 4, &p);
    if (r->fd < 0)
        return -1;
    size_t sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    char *sq = mmap(NULL, sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                    IORING_OFF_SQ_RING);
    char *cq = mmap(NULL, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                    IORING_OFF_CQ_RING);
    r->sqes = mmap(NULL, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (sq == MAP_FAILED || cq == MAP_FAILED || r->sqes == MAP_FAILED)
        return -1;
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
}

/* One read of `n` bytes from `fd`, submitted and waited for in one io_uring_enter. */
static int ring_read(struct ring *r, int fd, char *buf, unsigned n)
{
    unsigned tail = *r->sq_tail, i = tail & *r->sq_mask;
    struct io_uring_sqe *e = &r->sqes[i];
    memset(e, 0, sizeof *e);
    e->opcode = IORING_OP_READ;
    e->fd = fd;
    e->addr = (unsigned long)buf;
    e->len = n;
    e->off = (unsigned long long)-1;
    r->sq_array[i] = i;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    for (;;) {
        long k = syscall(SYS_io_uring_enter, r->fd, 1, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        if (k >= 0 || errno != EINTR)
            break;
    }
    unsigned head = *r->cq_head;
    while (head == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE))
        syscall(SYS_io_uring_enter, r->fd, 0, 1, IORING_ENTER_GETEVENTS, NULL, 0);
    int res = r->cqes[head & *r->cq_mask].res;
    __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
    return res;
}

static void *waiter(void *unused)
{
    (void)unused;
    struct ring r;
    if (ring_setup(&r) != 0) {
        printf("skip=io_uring_unavailable\n");
        fflush(stdout);
        _exit(0);
    }
    char buf[8];
    for (int i = 0; i < rounds; i++) {
        if (ring_read(&r, data_pipe[0], buf, 1) != 1)
            break;
        atomic_fetch_add(&done, 1);
    }
    return NULL;
}

static void *writer(void *unused)
{
    (void)unused;
    for (int i = 0; i < rounds; i++) {
        usleep(5000); /* parks this fiber: the waiter gets in first */
        if (write(data_pipe[1], "x", 1) != 1)
            break;
    }
    return NULL;
}

/* Ping-pong over a pair of pipes: the other connections a server keeps serving. */
static void *pinger(void *arg)
{
    int *p = arg; /* p[0], p[1]: a->b; p[2], p[3]: b->a */
    char c = 'p';
    while (!atomic_load(&stop)) {
        if (write(p[1], &c, 1) != 1 || read(p[2], &c, 1) != 1)
            break;
        atomic_fetch_add(&pings, 1);
    }
    c = 'q';
    (void)!write(p[1], &c, 1);
    return NULL;
}

static void *ponger(void *arg)
{
    int *p = arg;
    char c;
    while (read(p[0], &c, 1) == 1 && c != 'q')
        if (write(p[3], &c, 1) != 1)
            break;
    return NULL;
}

static double t0;

static void on_alarm(int sig)
{
    (void)sig;
    char line[160];
    int n = snprintf(line, sizeof line, "rounds=%d done=%d pings=%d frozen=1 elapsed_ms=%.0f\n",
                     rounds, atomic_load(&done), atomic_load(&pings), now_ms() - t0);
    (void)!write(1, line, (size_t)n);
    _exit(3);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        rounds = atoi(argv[1]);
    if (argc > 2)
        limit_s = atoi(argv[2]);
    if (pipe(data_pipe) != 0)
        return 1;
    static int pp[4];
    if (pipe(pp) != 0 || pipe(pp + 2) != 0)
        return 1;
    signal(SIGALRM, on_alarm);
    alarm((unsigned)limit_s);
    t0 = now_ms();
    pthread_t t[4];
    pthread_create(&t[0], NULL, waiter, NULL);
    pthread_create(&t[1], NULL, writer, NULL);
    pthread_create(&t[2], NULL, pinger, pp);
    pthread_create(&t[3], NULL, ponger, pp);
    pthread_join(t[0], NULL);
    pthread_join(t[1], NULL);
    atomic_store(&stop, 1);
    pthread_join(t[2], NULL);
    pthread_join(t[3], NULL);
    alarm(0);
    printf("rounds=%d done=%d pings=%d frozen=0 elapsed_ms=%.0f\n", rounds, atomic_load(&done),
           atomic_load(&pings), now_ms() - t0);
    return 0;
}
