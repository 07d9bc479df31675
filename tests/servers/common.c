/* Shared helpers for the example servers; see common.h. */
#define _GNU_SOURCE /* GNU strerror_r (returns char *) */
#include "common.h"

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <grp.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ---- errors ---------------------------------------------------------- */

void warn_errno(const char *prog, const char *what, int err)
{
    char b[128];
    fprintf(stderr, "%s: %s: %s\n", prog, what, strerror_r(err, b, sizeof b));
}

static void die_errno(const char *prog, const char *what)
{
    warn_errno(prog, what, errno);
    exit(1);
}

void close_fd(const char *prog, int fd)
{
    /* On Linux the fd is released even when close reports EINTR; never retry. */
    if (close(fd) < 0 && errno != EINTR)
        warn_errno(prog, "close", errno);
}

/* ---- arguments ------------------------------------------------------- */

static void usage(FILE *f, const char *prog)
{
    fprintf(f,
            "usage: %s [--addr A] [--port N] [--size BYTES] [--cpu-us U] [--shared-mutex 0|1]\n"
            "  --addr A        IPv4 address to listen on (default 127.0.0.1)\n"
            "  --port N        TCP port 0..65535, 0 = ephemeral (default 0)\n"
            "  --size BYTES    request/response size 1..%zu (default 1024)\n"
            "  --cpu-us U      CPU work per request in microseconds, >= 0,\n"
            "                  fractional allowed (default 0)\n"
            "  --shared-mutex 1  after each offload, update process-wide totals under\n"
            "                  one pthread mutex (a lock on the request path; default 0)\n"
            "Prints \"READY port=<port>\" on stdout once listening.\n"
            "With --cpu-us, the busy loop is calibrated at start (its rate goes to\n"
            "stderr); TOFFLOAD_CPU_ITERS_PER_US=R uses rate R instead, so that several\n"
            "servers do the same work per request.\n",
            prog, MAX_REQ_SIZE);
}

static void bad_arg(const char *prog, const char *flag, const char *val, const char *form)
{
    if (val)
        fprintf(stderr, "%s: invalid value '%s' for %s: expected %s\n", prog, val, flag, form);
    else
        fprintf(stderr, "%s: %s needs a value: expected %s\n", prog, flag, form);
    fprintf(stderr, "Try '%s --help'.\n", prog);
    exit(2);
}

/* Decimal unsigned integer in [lo, hi]; -1 if malformed or out of range. */
static long long parse_uint(const char *s, long long lo, long long hi)
{
    if (*s < '0' || *s > '9') /* strtoull would accept " 1" and "-1" */
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v < (unsigned long long)lo || v > (unsigned long long)hi)
        return -1;
    return (long long)v;
}

static void calibrate(void);
static double iters_per_us;

void server_setup(const char *prog, int argc, char **argv, struct server_opts *o)
{
    static const char PORT_FORM[] = "--port N, an integer 0..65535 (0 = ephemeral)";
    static const char SIZE_FORM[] = "--size BYTES, an integer 1..67108864";
    static const char CPU_FORM[] = "--cpu-us U, a number of microseconds >= 0 and <= 10000000";
    static const char ADDR_FORM[] = "--addr A, an IPv4 address such as 127.0.0.1";
    static const char MUTEX_FORM[] = "--shared-mutex 0 or 1";

    o->addr = "127.0.0.1";
    o->port = 0;
    o->size = 1024;
    o->cpu_us = 0;
    o->shared_mutex = 0;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout, prog);
            exit(0);
        }
        /* Accept both "--flag value" and "--flag=value". */
        char flag[32];
        const char *val = NULL;
        const char *eq = strchr(a, '=');
        if (strncmp(a, "--", 2) == 0 && eq && (size_t)(eq - a) < sizeof flag) {
            memcpy(flag, a, (size_t)(eq - a));
            flag[eq - a] = '\0';
            val = eq + 1;
        } else {
            snprintf(flag, sizeof flag, "%s", strlen(a) < sizeof flag ? a : "?");
        }
        const char *form;
        if (strcmp(flag, "--port") == 0)
            form = PORT_FORM;
        else if (strcmp(flag, "--size") == 0)
            form = SIZE_FORM;
        else if (strcmp(flag, "--cpu-us") == 0)
            form = CPU_FORM;
        else if (strcmp(flag, "--addr") == 0)
            form = ADDR_FORM;
        else if (strcmp(flag, "--shared-mutex") == 0)
            form = MUTEX_FORM;
        else {
            fprintf(stderr, "%s: unknown argument '%s'\n", prog, a);
            usage(stderr, prog);
            exit(2);
        }
        if (!val) {
            if (i + 1 >= argc)
                bad_arg(prog, flag, NULL, form);
            val = argv[++i];
        }

        if (form == PORT_FORM) {
            long long v = parse_uint(val, 0, 65535);
            if (v < 0)
                bad_arg(prog, flag, val, form);
            o->port = (int)v;
        } else if (form == SIZE_FORM) {
            long long v = parse_uint(val, 1, (long long)MAX_REQ_SIZE);
            if (v < 0)
                bad_arg(prog, flag, val, form);
            o->size = (size_t)v;
        } else if (form == CPU_FORM) {
            char *end;
            errno = 0;
            double v = strtod(val, &end);
            if (!*val || *end || errno || !isfinite(v) || v < 0 || v > 1e7)
                bad_arg(prog, flag, val, form);
            o->cpu_us = v;
        } else if (form == MUTEX_FORM) {
            long long v = parse_uint(val, 0, 1);
            if (v < 0)
                bad_arg(prog, flag, val, form);
            o->shared_mutex = (int)v;
        } else {
            struct in_addr ia;
            if (inet_pton(AF_INET, val, &ia) != 1)
                bad_arg(prog, flag, val, form);
            o->addr = val;
        }
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_IGN; /* a peer reset must give EPIPE, not kill us */
    if (sigemptyset(&sa.sa_mask) < 0 || sigaction(SIGPIPE, &sa, NULL) < 0)
        die_errno(prog, "sigaction(SIGPIPE)");

    /* One fd per connection: the default soft limit (often 1024) would cap
     * the servers well below the thousands of connections tests open. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0) {
        warn_errno(prog, "getrlimit(RLIMIT_NOFILE)", errno);
    } else if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? 1 << 20 : rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
            warn_errno(prog, "setrlimit(RLIMIT_NOFILE)", errno);
    }

    if (o->cpu_us > 0) {
        /* A server that calibrates on a slow moment of a shared host does less work
         * per request than the next one: a benchmark comparing servers passes one
         * rate to all. */
        const char *fixed = getenv("TOFFLOAD_CPU_ITERS_PER_US");
        if (fixed && *fixed) {
            char *end;
            errno = 0;
            double r = strtod(fixed, &end);
            if (errno || *end || !(r > 0) || r > 1e9) {
                fprintf(stderr,
                        "%s: invalid TOFFLOAD_CPU_ITERS_PER_US '%s': expected a positive "
                        "number of iterations per microsecond\n",
                        prog, fixed);
                exit(2);
            }
            iters_per_us = r;
        } else {
            calibrate();
            fprintf(stderr, "%s: cpu work calibrated: TOFFLOAD_CPU_ITERS_PER_US=%.6f\n", prog,
                    iters_per_us);
        }
    }
}

/* ---- listening socket ------------------------------------------------ */

/* ---- test knobs ------------------------------------------------------ */

static unsigned long crash_after_ms;

static void *crash_later(void *arg)
{
    (void)arg;
    struct timespec ts = {(time_t)(crash_after_ms / 1000), (long)(crash_after_ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
    fprintf(stderr, "crashing as TOFFLOAD_TEST_CRASH_UNDER_RUNTIME_MS asks\n");
    /* A crash, not an exit: killed by a signal (SIGKILL: no core file). */
    kill(getpid(), SIGKILL);
    return NULL;
}

/*
 * Knobs for the injection tests, read once the port is bound:
 *  TOFFLOAD_TEST_DROP_UID=N: drop to uid and gid N (no supplementary groups), as a
 *    server that binds a privileged port as root and then drops privileges does.
 *  TOFFLOAD_TEST_CRASH_UNDER_RUNTIME_MS=N: when running under the toffload runtime
 *    (LD_PRELOAD names libtoffload), crash N ms after listening: an injected server
 *    that fails its health window. Without the runtime the knob does nothing, so the
 *    original command, restarted by the rollback, serves.
 */
static void test_knobs(const char *prog)
{
    const char *drop = getenv("TOFFLOAD_TEST_DROP_UID");
    if (drop && *drop) {
        long long id = parse_uint(drop, 1, 0xfffffffe);
        if (id < 0)
            bad_arg(prog, "TOFFLOAD_TEST_DROP_UID", drop, "a uid 1..4294967294");
        if (setgroups(0, NULL) < 0 || setgid((gid_t)id) < 0 || setuid((uid_t)id) < 0)
            die_errno(prog, "dropping privileges (TOFFLOAD_TEST_DROP_UID)");
    }
    const char *crash = getenv("TOFFLOAD_TEST_CRASH_UNDER_RUNTIME_MS");
    const char *preload = getenv("LD_PRELOAD");
    if (crash && *crash && preload && strstr(preload, "libtoffload")) {
        long long ms = parse_uint(crash, 0, 3600000);
        if (ms < 0)
            bad_arg(prog, "TOFFLOAD_TEST_CRASH_UNDER_RUNTIME_MS", crash, "milliseconds 0..3600000");
        crash_after_ms = (unsigned long)ms;
        pthread_t t;
        int err = pthread_create(&t, NULL, crash_later, NULL);
        if (err)
            warn_errno(prog, "pthread_create", err);
        else
            pthread_detach(t);
    }
}

int listen_and_announce(const char *prog, const struct server_opts *o)
{
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)o->port);
    if (inet_pton(AF_INET, o->addr, &sa.sin_addr) != 1) {
        fprintf(stderr, "%s: bad address '%s'\n", prog, o->addr);
        exit(2);
    }

    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die_errno(prog, "socket");
    int one = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0)
        die_errno(prog, "setsockopt(SO_REUSEADDR)");
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0)
        die_errno(prog, "bind");
    if (listen(fd, 4096) < 0)
        die_errno(prog, "listen");

    socklen_t len = sizeof sa;
    if (getsockname(fd, (struct sockaddr *)&sa, &len) < 0)
        die_errno(prog, "getsockname");
    test_knobs(prog);
    /* The harness waits for exactly this line. */
    if (printf("READY port=%u\n", (unsigned)ntohs(sa.sin_port)) < 0 || fflush(stdout) == EOF)
        die_errno(prog, "stdout");
    return fd;
}

/* ---- blocking I/O ---------------------------------------------------- */

int read_full(int fd, void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)buf + got, n - got);
        if (r > 0) {
            got += (size_t)r;
        } else if (r == 0) {
            if (got == 0)
                return 0;
            errno = EPROTO; /* peer closed in the middle of a request */
            return -1;
        } else if (errno != EINTR) {
            return -1;
        }
    }
    return 1;
}

int write_full(int fd, const void *buf, size_t n)
{
    size_t put = 0;
    while (put < n) {
        ssize_t w = write(fd, (const char *)buf + put, n - put);
        if (w >= 0)
            put += (size_t)w;
        else if (errno != EINTR)
            return -1;
    }
    return 0;
}

int set_nodelay(int fd)
{
    int one = 1;
    return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* ---- CPU work -------------------------------------------------------- */

/* Iterations of mix() per microsecond (declared above). Written once by
 * calibrate() or from TOFFLOAD_CPU_ITERS_PER_US before any thread exists,
 * read-only afterwards. */

/* splitmix64-style mixing over a small array. Each step depends on the
 * previous one (h), so the loop is latency-bound and cannot be collapsed. */
static uint64_t mix(uint64_t iters)
{
    uint64_t a[16], h = 0x2545F4914F6CDD1Dull;
    for (unsigned i = 0; i < 16; i++)
        a[i] = (i + 1) * 0x9E3779B97F4A7C15ull;
    for (uint64_t i = 0; i < iters; i++) {
        uint64_t z = h + a[i & 15] + 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        h = z ^ (z >> 31);
        a[i & 15] ^= h;
    }
    return h;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* cannot fail for CLOCK_MONOTONIC */
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* Time `iters` iterations; the volatile store keeps the work observable. */
static double time_mix(uint64_t iters)
{
    double t0 = now_us();
    volatile uint64_t sink = mix(iters);
    (void)sink;
    return now_us() - t0;
}

static void calibrate(void)
{
    /* Grow the batch until it takes >= 2 ms, then run 4 trials of ~10 ms and
     * keep the fastest: preemption only ever makes a trial slower, so the
     * best rate is the closest to the true one (~45 ms in total). */
    uint64_t n = 1 << 12;
    double t;
    while ((t = time_mix(n)) < 2000 && n < (1ull << 40))
        n *= 2;
    n = (uint64_t)((double)n * 10000.0 / (t > 0 ? t : 1)) + 1;
    double best = 0;
    for (int i = 0; i < 4; i++) {
        double dt = time_mix(n);
        double rate = (double)n / (dt > 0 ? dt : 1);
        if (rate > best)
            best = rate;
    }
    iters_per_us = best;
}

void cpu_work(double us)
{
    if (us <= 0 || iters_per_us <= 0)
        return;
    /* Round by hand: llround would need -lm, which the build line lacks. */
    volatile uint64_t sink = mix((uint64_t)(us * iters_per_us + 0.5));
    (void)sink;
}

/* ---- thread-per-connection accept loop ------------------------------- */

int accept_error_kind(const char *prog, int err)
{
    switch (err) {
    case EINTR:
    case EAGAIN:
    case ECONNABORTED: /* client gave up while queued: normal */
    case EPROTO:       /* accept(2): treat pending network errors like EAGAIN */
    case EPERM:
    case ENETDOWN:
    case ENOPROTOOPT:
    case EHOSTDOWN:
    case ENONET:
    case EHOSTUNREACH:
    case EOPNOTSUPP:
    case ENETUNREACH:
        return 1;
    case EMFILE:
    case ENFILE:
    case ENOBUFS:
    case ENOMEM:
        warn_errno(prog, "accept", err);
        return 2;
    default:
        return 0;
    }
}

struct conn_arg {
    const char *prog;
    void (*serve)(int fd);
    int fd;
};

static void *conn_thread(void *p)
{
    struct conn_arg a = *(struct conn_arg *)p;
    free(p);
    a.serve(a.fd);
    close_fd(a.prog, a.fd);
    return NULL;
}

void accept_loop_threads(const char *prog, int lfd, void (*serve)(int fd))
{
    pthread_attr_t attr;
    int e;
    if ((e = pthread_attr_init(&attr)) || (e = pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED)) ||
        /* Handlers use little stack; 8 MiB default x thousands of threads
         * would waste address space. */
        (e = pthread_attr_setstacksize(&attr, 256 * 1024))) {
        warn_errno(prog, "pthread_attr", e);
        exit(1);
    }
    for (;;) {
        /* Plain accept(), not accept4(): the fiber runtime keys on it. */
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0) {
            int kind = accept_error_kind(prog, errno);
            if (kind == 0)
                die_errno(prog, "accept");
            if (kind == 2) {
                struct timespec ts = {0, 10 * 1000 * 1000};
                nanosleep(&ts, NULL); /* wait for fds/memory to be freed */
            }
            continue;
        }
        if (set_nodelay(fd) < 0) {
            warn_errno(prog, "setsockopt(TCP_NODELAY)", errno);
            close_fd(prog, fd);
            continue;
        }
        struct conn_arg *a = malloc(sizeof *a);
        if (!a) {
            warn_errno(prog, "malloc", ENOMEM);
            close_fd(prog, fd);
            continue;
        }
        a->prog = prog;
        a->serve = serve;
        a->fd = fd;
        pthread_t t;
        if ((e = pthread_create(&t, &attr, conn_thread, a)) != 0) {
            warn_errno(prog, "pthread_create", e);
            free(a);
            close_fd(prog, fd);
        }
    }
}

/* --shared-mutex: totals every connection updates under one lock. */
static pthread_mutex_t totals_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    unsigned long requests;
    unsigned long bytes;
    unsigned char last[16];
} totals;

static void update_totals(const unsigned char *buf, size_t n)
{
    pthread_mutex_lock(&totals_mu);
    totals.requests++;
    totals.bytes += n;
    memcpy(totals.last, buf, n < sizeof totals.last ? n : sizeof totals.last);
    pthread_mutex_unlock(&totals_mu);
}

void serve_requests(const char *prog, int fd, const struct server_opts *o,
                    int (*offload)(unsigned char *buf, int n))
{
    unsigned char *buf = malloc(o->size);
    if (!buf) {
        fprintf(stderr, "%s: malloc(%zu) failed\n", prog, o->size);
        return;
    }
    while (read_full(fd, buf, o->size) > 0) {
        cpu_work(o->cpu_us);
        int rc = offload(buf, (int)o->size);
        if (rc < 0) {
            warn_errno(prog, "accel_run", -rc);
            break;
        }
        if (o->shared_mutex)
            update_totals(buf, o->size);
        if (write_full(fd, buf, o->size) < 0)
            break;
    }
    free(buf);
}

/* thread_per_connection_main's server, set once before the first thread starts. */
static const char *tpc_prog;
static struct server_opts tpc_opts;
static int (*tpc_offload)(unsigned char *buf, int n);

static void tpc_serve(int fd)
{
    serve_requests(tpc_prog, fd, &tpc_opts, tpc_offload);
}

void thread_per_connection_main(const char *prog, int argc, char **argv,
                                int (*offload)(unsigned char *buf, int n))
{
    tpc_prog = prog;
    tpc_offload = offload;
    server_setup(prog, argc, argv, &tpc_opts);
    int lfd = listen_and_announce(prog, &tpc_opts);
    accept_loop_threads(prog, lfd, tpc_serve); /* never returns */
}
