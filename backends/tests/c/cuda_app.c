/* A GPU server's shape on the CUDA driver API, for the remote CUDA client's tests: it
 * loads a module, uploads its "weights", then serves requests on T threads, each
 * request on the thread's stream: an input upload, a kernel, the result back, an
 * event, a host function, a synchronize. It prints what the device answered (a hash
 * of every result), so two runs on two drivers can be compared byte for byte.
 *
 * It links against libcuda.so.1 and knows nothing of remoting: run directly on the
 * fake driver (tests/c/fake_cuda.c) or with backends/cuda-remote's library first on
 * the path, it must print the same.
 *
 * Usage: cuda_app run THREADS REQUESTS | reupload | loop | unsupported
 *        | replay | unreplayable   (pause between two synchronizations: see pause())
 *        | events [nowait]         (cuStreamWaitEvent and cuEventElapsedTime)
 *        | victim | poke ADDR      (two identities: see victim_mode) 
 * CUDA_APP_PROGRESS=1: `run` prints a line per request as `loop` does.
 * CUDA_APP_SHARED_STREAM=1: `run`'s threads share one stream.
 * CUDA_APP_SCRATCH=1: `run` first has a kernel write a scratch buffer that nothing
 * reads back until the end (its hash printed last): device state that exists only on
 * the daemon for the whole run.
 * CUDA_APP_TIMING=1: `run` prints on stderr the median time of its requests that end
 * in one synchronize (every other one: copy in, launch, copy out, event, host
 * function, then the wait), from the first call to the wait's return:
 * "sync_us P50 of N". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext, *CUstream, *CUevent, *CUmodule, *CUfunction;
typedef unsigned long long CUdeviceptr;

CUresult cuInit(unsigned);
CUresult cuDriverGetVersion(int *);
CUresult cuDeviceGetCount(int *);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDeviceGetName(char *, int, CUdevice);
CUresult cuDeviceGetAttribute(int *, int, CUdevice);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemHostAlloc(void **, size_t, unsigned);
CUresult cuMemFreeHost(void *);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, CUstream);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuModuleUnload(CUmodule);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuLaunchHostFunc(CUstream, void (*)(void *), void *);
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuEventCreate(CUevent *, unsigned);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventQuery(CUevent);
CUresult cuEventSynchronize(CUevent);
CUresult cuEventDestroy_v2(CUevent);
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned);
CUresult cuEventElapsedTime(float *, CUevent, CUevent);
CUresult cuStreamQuery(CUstream);

#define CK(call)                                                                         \
    do {                                                                                 \
        CUresult rc_ = (call);                                                           \
        if (rc_ != 0) {                                                                  \
            printf("error: %s returned CUDA error %d\n", #call, rc_);                   \
            fflush(stdout);                                                              \
            exit(3);                                                                     \
        }                                                                                \
    } while (0)

struct params {
    unsigned rk[44];
    unsigned iv[4];
};

static CUfunction fn;
static CUdeviceptr weights;
static const size_t WEIGHTS = 1 << 20, REQ = 4096;
static int requests_per_thread, progress, timing;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t fnv(const unsigned char *b, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static void launch(CUdeviceptr d, unsigned long long n, unsigned seed, CUstream s) {
    struct params p;
    for (int i = 0; i < 44; i++) p.rk[i] = seed * 2654435761u + (unsigned)i * 40503u;
    for (int i = 0; i < 4; i++) p.iv[i] = seed + (unsigned)i;
    void *args[] = {&d, &n, &p};
    CK(cuLaunchKernel(fn, 2, 1, 1, 4, 1, 1, 0, s, args, NULL));
}

static void count_host_fn(void *arg) { __atomic_add_fetch((int *)arg, 1, __ATOMIC_SEQ_CST); }

struct worker {
    int index;
    uint64_t hash;
    int host_fns;
    /* CUDA_APP_TIMING: the one-synchronize requests' times, us. */
    double *sync_us;
    int timed;
};

/* CUDA_APP_SHARED_STREAM=1: every thread queues on this one stream (tasks
 * multiplexed on a stream; each one's synchronize waits for all queued before). */
static CUstream shared_stream;

static void *serve(void *arg) {
    struct worker *w = arg;
    CUstream s = shared_stream;
    CUevent e;
    CUdeviceptr d;
    unsigned char *in, *out;
    if (!s) CK(cuStreamCreate(&s, 1));
    CK(cuEventCreate(&e, 0));
    CK(cuMemAlloc_v2(&d, REQ));
    CK(cuMemHostAlloc((void **)&in, REQ, 0));
    CK(cuMemHostAlloc((void **)&out, REQ, 0));
    for (int r = 0; r < requests_per_thread; r++) {
        unsigned seed = (unsigned)(w->index * 100003 + r);
        for (size_t i = 0; i < REQ; i++) in[i] = (unsigned char)(i * 7 + seed);
        double t0 = now_us();
        CK(cuMemcpyHtoDAsync_v2(d, in, REQ, s));
        launch(d, REQ, seed, s);
        CK(cuMemcpyDtoHAsync_v2(out, d, REQ, s));
        CK(cuEventRecord(e, s));
        CK(cuLaunchHostFunc(s, count_host_fn, &w->host_fns));
        if (r % 2) {
            CK(cuStreamSynchronize(s));
            if (w->sync_us) w->sync_us[w->timed++] = now_us() - t0;
        } else {
            CK(cuEventSynchronize(e));
            CK(cuEventQuery(e));
            CK(cuStreamSynchronize(s));
        }
        w->hash ^= fnv(out, REQ) + (uint64_t)seed;
        if (progress) {
            printf("progress %d %d\n", w->index, r);
            fflush(stdout);
        }
    }
    CK(cuMemFree_v2(d));
    CK(cuMemFreeHost(in));
    CK(cuMemFreeHost(out));
    CK(cuEventDestroy_v2(e));
    if (s != shared_stream) CK(cuStreamDestroy_v2(s));
    return NULL;
}

/* Between two synchronizations: polls the stream until it is idle (queries, which
 * do not synchronize: the work is done but the program has not waited for it), says
 * so on stdout and waits for a line on stdin (the test kills the daemon meanwhile). */
static void pause_here(CUstream s) {
    CUresult q;
    for (int i = 0; (q = cuStreamQuery(s)) == 600 && i < 10000; i++) {
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    CK(q);
    printf("between syncs\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) { /* no one to wait for (a direct run) */
    }
}

static uint64_t read_back(CUdeviceptr d, size_t n, CUstream s) {
    unsigned char *out = malloc(n);
    CK(cuMemcpyDtoHAsync_v2(out, d, n, s));
    CK(cuStreamSynchronize(s));
    uint64_t h = fnv(out, n);
    free(out);
    return h;
}

/* `replay`: a buffer written by kernels since the last synchronize and never read
 * back (A, B), and a 2 MiB upload (C), when the daemon is lost: a replay recomputes
 * A and B and re-sends C. `unreplayable`: A was written by a kernel before the last
 * synchronize and nothing read it back: after a loss its contents are gone. */
static int replay_mode(int recompute) {
    const size_t N = 16384, BIG = 2 << 20;
    CUstream s;
    CUdeviceptr a, b, c;
    unsigned char *in = malloc(N), *inb = malloc(N), *inc = malloc(BIG);
    CK(cuStreamCreate(&s, 1));
    CK(cuMemAlloc_v2(&a, N));
    CK(cuMemAlloc_v2(&b, N));
    CK(cuMemAlloc_v2(&c, BIG));
    for (size_t i = 0; i < N; i++) in[i] = (unsigned char)(i * 5 + 3);
    CK(cuMemcpyHtoDAsync_v2(a, in, N, s));
    launch(a, N, 11, s);
    if (recompute) {
        printf("A first %016llx\n", (unsigned long long)read_back(a, N, s));
        /* Each upload from its own host buffer: an async copy may read it late. */
        for (size_t i = 0; i < BIG; i++) inc[i] = (unsigned char)(i * 3 + (i >> 16));
        CK(cuMemcpyHtoDAsync_v2(c, inc, BIG, s));
        for (size_t i = 0; i < N; i++) inb[i] = (unsigned char)(i * 9 + 1);
        CK(cuMemcpyHtoDAsync_v2(b, inb, N, s));
        launch(b, N, 12, s);
        launch(a, N, 13, s);
    } else {
        CK(cuStreamSynchronize(s));
    }
    pause_here(s);
    if (recompute) launch(b, N, 14, s);
    printf("A %016llx\n", (unsigned long long)read_back(a, N, s));
    if (recompute) {
        printf("B %016llx\n", (unsigned long long)read_back(b, N, s));
        printf("C %016llx\n", (unsigned long long)read_back(c, BIG, s));
    }
    free(in);
    free(inb);
    free(inc);
    return 0;
}

/* `events`: a kernel on stream A between two timing events, and a copy of its output
 * on stream B that waits for the second (`nowait`: does not; it then reads the
 * buffer before the kernel is done). */
static int events_mode(int wait) {
    const size_t N = 65536;
    CUstream sa, sb;
    CUevent e0, e1, untimed;
    CUdeviceptr x;
    unsigned char *buf = malloc(N), *out = malloc(N);
    CK(cuStreamCreate(&sa, 1));
    CK(cuStreamCreate(&sb, 1));
    CK(cuEventCreate(&e0, 0));
    CK(cuEventCreate(&e1, 0));
    CK(cuEventCreate(&untimed, 2)); /* CU_EVENT_DISABLE_TIMING */
    CK(cuMemAlloc_v2(&x, N));
    for (size_t i = 0; i < N; i++) buf[i] = (unsigned char)(i * 11 + 5);
    CK(cuMemcpyHtoDAsync_v2(x, buf, N, sa));
    CK(cuEventRecord(e0, sa));
    launch(x, N, 21, sa);
    CK(cuEventRecord(e1, sa));
    CK(cuEventRecord(untimed, sa));
    if (wait) CK(cuStreamWaitEvent(sb, e1, 0));
    memset(out, 0, N);
    CK(cuMemcpyDtoHAsync_v2(out, x, N, sb));
    CK(cuStreamSynchronize(sb));
    printf("read on B %016llx\n", (unsigned long long)fnv(out, N));
    CK(cuStreamSynchronize(sa));
    float ms = -1;
    CK(cuEventElapsedTime(&ms, e0, e1));
    /* The fake's kernel sleeps FAKE_CUDA_KERNEL_US (the test sets 200 ms). */
    printf("elapsed at least 150 ms: %d\n", ms >= 150.0f && ms < 10000.0f);
    printf("untimed event: %d\n", cuEventElapsedTime(&ms, e0, untimed));
    free(buf);
    free(out);
    return 0;
}

/* `victim`: a buffer of 12288 bytes (a size nothing else allocates) uploaded, then a
 * pause, then read back. `poke ADDR`: a kernel launched on the raw device address
 * ADDR (another session's buffer, as the daemon's driver knows it) for 12288 bytes:
 * it must not reach another identity's memory. */
static const size_t VICTIM = 12288;
static int victim_mode(void) {
    CUstream s;
    CUdeviceptr v;
    unsigned char *in = malloc(VICTIM);
    CK(cuStreamCreate(&s, 1));
    CK(cuMemAlloc_v2(&v, VICTIM));
    for (size_t i = 0; i < VICTIM; i++) in[i] = (unsigned char)(i * 17 + 2);
    CK(cuMemcpyHtoDAsync_v2(v, in, VICTIM, s));
    CK(cuStreamSynchronize(s));
    pause_here(s);
    printf("victim %016llx\n", (unsigned long long)read_back(v, VICTIM, s));
    free(in);
    return 0;
}
static int poke_mode(const char *addr) {
    CUstream s;
    CK(cuStreamCreate(&s, 1));
    launch((CUdeviceptr)strtoull(addr, NULL, 10), VICTIM, 99, s);
    printf("poke -> %d\n", cuStreamSynchronize(s));
    return 0;
}

static const char IMAGE[] = "FAKE-PTX .entry aes128_ctr (the fake driver's kernel)";

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "run";
    CK(cuInit(0));
    if (!strcmp(mode, "unsupported")) {
        /* Outside the remoted subset (and absent from the fake driver). */
        CUresult (*memset8)(CUdeviceptr, unsigned char, size_t) =
            (CUresult(*)(CUdeviceptr, unsigned char, size_t))dlsym(RTLD_DEFAULT, "cuMemsetD8_v2");
        if (!memset8) {
            printf("cuMemsetD8_v2 absent\n");
            return 0;
        }
        for (int i = 0; i < 2; i++) printf("cuMemsetD8_v2 -> %d\n", memset8(0, 0, 0));
        return 0;
    }
    int version, count, major, minor;
    CUdevice dev;
    char name[128];
    CUcontext ctx;
    CK(cuDriverGetVersion(&version));
    CK(cuDeviceGetCount(&count));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDeviceGetName(name, sizeof name, dev));
    CK(cuDeviceGetAttribute(&major, 75, dev));
    CK(cuDeviceGetAttribute(&minor, 76, dev));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    printf("driver %d, %d device(s), %s, cc %d.%d\n", version, count, name, major, minor);

    CUmodule mod;
    CK(cuModuleLoadData(&mod, IMAGE));
    CK(cuModuleGetFunction(&fn, mod, "aes128_ctr"));

    /* The weights: uploaded once per run, transformed in place, read back. */
    unsigned char *host;
    CUstream s0;
    CK(cuStreamCreate(&s0, 1));
    CK(cuMemHostAlloc((void **)&host, WEIGHTS, 0));
    for (size_t i = 0; i < WEIGHTS; i++) host[i] = (unsigned char)(i * 31 + (i >> 12));
    CK(cuMemAlloc_v2(&weights, WEIGHTS));
    CK(cuMemcpyHtoDAsync_v2(weights, host, WEIGHTS, s0));
    launch(weights, WEIGHTS, 7, s0);
    CK(cuMemcpyDtoHAsync_v2(host, weights, WEIGHTS, s0));
    CK(cuStreamSynchronize(s0));
    printf("weights %016llx\n", (unsigned long long)fnv(host, WEIGHTS));
    fflush(stdout);

    if (!strcmp(mode, "replay") || !strcmp(mode, "unreplayable"))
        return replay_mode(!strcmp(mode, "replay"));
    if (!strcmp(mode, "victim")) return victim_mode();
    if (!strcmp(mode, "poke") && argc > 2) return poke_mode(argv[2]);
    if (!strcmp(mode, "events")) return events_mode(!(argc > 2 && !strcmp(argv[2], "nowait")));
    if (!strcmp(mode, "reupload")) {
        /* Other data (2 MiB, which pushes the weights out of a small upload cache),
         * then the weights again: the client believes the daemon holds them. */
        unsigned char *other;
        CUdeviceptr d2;
        const size_t OTHER = 2 << 20;
        CK(cuMemHostAlloc((void **)&other, OTHER, 0));
        for (size_t i = 0; i < OTHER; i++) other[i] = (unsigned char)(i * 13 + (i >> 10) + 1);
        CK(cuMemAlloc_v2(&d2, OTHER));
        CK(cuMemcpyHtoDAsync_v2(d2, other, OTHER, s0));
        for (size_t i = 0; i < WEIGHTS; i++) host[i] = (unsigned char)(i * 31 + (i >> 12));
        CK(cuMemcpyHtoDAsync_v2(weights, host, WEIGHTS, s0));
        launch(weights, WEIGHTS, 7, s0);
        CK(cuMemcpyDtoHAsync_v2(host, weights, WEIGHTS, s0));
        CK(cuStreamSynchronize(s0));
        printf("weights again %016llx\n", (unsigned long long)fnv(host, WEIGHTS));
        return 0;
    }
    int threads = 1;
    requests_per_thread = -1;
    if (!strcmp(mode, "run")) {
        threads = argc > 2 ? atoi(argv[2]) : 2;
        requests_per_thread = argc > 3 ? atoi(argv[3]) : 20;
        progress = getenv("CUDA_APP_PROGRESS") != NULL;
        timing = getenv("CUDA_APP_TIMING") != NULL;
        if (getenv("CUDA_APP_SHARED_STREAM")) CK(cuStreamCreate(&shared_stream, 1));
    } else {
        requests_per_thread = 1 << 30; /* loop: until killed or failed */
        progress = 1;
    }
    CUdeviceptr scratch = 0;
    if (requests_per_thread != 1 << 30 && getenv("CUDA_APP_SCRATCH")) {
        unsigned char *z = calloc(REQ, 1);
        CK(cuMemAlloc_v2(&scratch, REQ));
        CK(cuMemcpyHtoDAsync_v2(scratch, z, REQ, s0));
        launch(scratch, REQ, 99, s0);
        CK(cuStreamSynchronize(s0));
        free(z);
    }
    struct worker w[64];
    pthread_t t[64];
    if (threads < 1 || threads > 64) return 2;
    for (int i = 0; i < threads; i++) {
        w[i] = (struct worker){.index = i};
        if (timing && !(w[i].sync_us = calloc((size_t)requests_per_thread, sizeof(double))))
            return 2;
        pthread_create(&t[i], NULL, serve, &w[i]);
    }
    uint64_t all = 0;
    int host_fns = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(t[i], NULL);
        all ^= w[i].hash;
        host_fns += w[i].host_fns;
    }
    /* A context-wide synchronize where the driver has one (the fake does not). */
    CUresult (*ctx_sync)(void) = (CUresult(*)(void))dlsym(RTLD_DEFAULT, "cuCtxSynchronize");
    if (ctx_sync) CK(ctx_sync());
    if (timing) {
        int n = 0;
        for (int i = 0; i < threads; i++) n += w[i].timed;
        double *all_us = calloc((size_t)n + 1, sizeof(double));
        int k = 0;
        for (int i = 0; i < threads; i++)
            for (int j = 0; j < w[i].timed; j++) all_us[k++] = w[i].sync_us[j];
        qsort(all_us, (size_t)n, sizeof(double), cmp_double);
        fprintf(stderr, "sync_us %.0f of %d\n", n ? all_us[n / 2] : 0.0, n);
        free(all_us);
    }
    printf("requests %d, host functions run %d, results %016llx\n", threads * requests_per_thread,
           host_fns, (unsigned long long)all);
    if (scratch) {
        printf("scratch %016llx\n", (unsigned long long)read_back(scratch, REQ, s0));
        CK(cuMemFree_v2(scratch));
    }
    CK(cuMemFree_v2(weights));
    CK(cuMemFreeHost(host));
    CK(cuStreamDestroy_v2(s0));
    CK(cuModuleUnload(mod));
    CK(cuDevicePrimaryCtxRelease_v2(dev));
    return 0;
}
