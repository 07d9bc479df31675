/* A fake CUDA driver and NVRTC, for testing the cuda backend's host side on machines
 * without a GPU. Built as one shared library and loaded as libcuda.so and libnvrtc.so
 * (LD_LIBRARY_PATH). It implements exactly the functions the backend calls, with real
 * asynchrony: each stream has a worker thread that runs its queue (copies, the kernel,
 * event records, host functions) in order, after a delay per kernel, so operations are
 * really pending for a while and host functions run on a thread that is not the
 * caller's, as with the real driver.
 *
 * The kernel is aes_ctr.cu itself, compiled here as C and run on the CPU with the
 * round keys and counter block the backend passes as kernel parameters: the tests
 * check its arithmetic, the key schedule, the parameter layout and the copies end to
 * end against OpenSSL. What only a GPU can check is the kernel as CUDA runs it (NVRTC,
 * real parallel threads, __syncthreads, 16-byte loads): cargo xtask gpu-check.
 *
 * Knobs (environment): FAKE_CUDA_DEVICES=0 (no device), FAKE_CUDA_KERNEL_US (delay per
 * kernel, default 300), FAKE_CUDA_SMS=N (at most N kernels run at once, across every
 * stream and context of the process, as on a GPU that N kernels fill; default: no
 * limit), FAKE_CUDA_OOM_ABOVE=N (cuMemAlloc over N bytes fails),
 * FAKE_CUDA_NO_CUBIN=1 (the module loader rejects CUBIN images), FAKE_CUDA_WRONG=1 (the
 * kernel flips a bit), FAKE_NVRTC_FAIL=1 (compilation fails with a log),
 * FAKE_CUDA_STRICT_CTX=1 (a copy or launch on memory another context allocated fails,
 * as it faults on a GPU: contexts are separate address spaces), FAKE_CUDA_ALLOC_LOG=PATH
 * (each allocation's address and size appended to PATH, for the isolation test). */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OOM = 2,
    E_NO_DEVICE = 100,
    E_INVALID_IMAGE = 200,
    E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
};

static long env_long(const char *name, long dflt) {
    const char *v = getenv(name);
    return v && *v ? atol(v) : dflt;
}

/* ------------------------------------------- the kernel: aes_ctr.cu itself, on the CPU */

/* CUDA's keywords and built-ins, enough for aes_ctr.cu (which is written in the subset
 * that is also C). Threads run one after another with blockDim.x = 1: each then fills
 * the whole T-table itself (the fill loop strides by blockDim.x), so the kernel's
 * __syncthreads has nothing to order, and the grid-stride loop strides by gridDim.x. */
#define KERNEL_EXPORT
#define __global__
#define __device__
#define __constant__
#define __shared__ static
typedef struct {
    unsigned x, y, z;
} fake_dim3;
static fake_dim3 threadIdx, blockIdx, blockDim, gridDim;
static void __syncthreads(void) {}
/* `__device__ inline` functions: C99 inline needs static for a definition here. */
#define inline static inline
#include "aes_ctr.cu"
#undef inline

void fake_cuda_run_kernel(uint8_t *data, uint64_t len, const struct AesParams *p, unsigned threads);

/* Runs the kernel over `threads` simulated threads (at most 64: the grid-stride loop is
 * exercised, and the per-thread table fill stays cheap). One at a time: the static
 * grid variables are shared, and each stream's worker would otherwise race on them. */
static pthread_mutex_t kernel_lock = PTHREAD_MUTEX_INITIALIZER;
void fake_cuda_run_kernel(uint8_t *data, uint64_t len, const struct AesParams *p, unsigned threads) {
    pthread_mutex_lock(&kernel_lock);
    gridDim.x = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    blockDim.x = 1;
    threadIdx.x = 0;
    for (unsigned b = 0; b < gridDim.x; b++) {
        blockIdx.x = b;
        aes128_ctr(data, len, *p);
    }
    pthread_mutex_unlock(&kernel_lock);
}

/* What a launch runs; exported above for tests that call the kernel directly. */
static void fake_kernel(uint8_t *data, uint64_t len, const struct AesParams *p, unsigned threads) {
    fake_cuda_run_kernel(data, len, p, threads);
    if (getenv("FAKE_CUDA_WRONG") && len) data[0] ^= 1;
}

/* ---------------------------------------------------------------- streams, events */

struct event {
    pthread_mutex_t m;
    pthread_cond_t c;
    unsigned long recorded, completed;
    int timing;
    /* When the last record completed (CLOCK_MONOTONIC), for cuEventElapsedTime. */
    struct timespec at;
};

enum kind { COPY, KERNEL, RECORD, HOSTFN, WAIT };
struct cmd {
    enum kind kind;
    void *dst;
    const void *src;
    size_t n;
    struct AesParams params;
    unsigned threads;
    struct event *ev;
    unsigned long seq;
    void (*fn)(void *);
    void *user;
    struct cmd *next;
};

struct stream {
    pthread_mutex_t m;
    pthread_cond_t c;
    struct cmd *head, *tail;
    int busy, stop;
    pthread_t thread;
};

/* FAKE_CUDA_SMS: the kernels running now, under `gpu_m`. */
static pthread_mutex_t gpu_m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gpu_c = PTHREAD_COND_INITIALIZER;
static long gpu_running;

static void gpu_enter(long sms) {
    if (sms <= 0) return;
    pthread_mutex_lock(&gpu_m);
    while (gpu_running >= sms) pthread_cond_wait(&gpu_c, &gpu_m);
    gpu_running++;
    pthread_mutex_unlock(&gpu_m);
}

static void gpu_leave(long sms) {
    if (sms <= 0) return;
    pthread_mutex_lock(&gpu_m);
    gpu_running--;
    pthread_cond_signal(&gpu_c);
    pthread_mutex_unlock(&gpu_m);
}

static void *stream_worker(void *arg) {
    struct stream *s = arg;
    long kernel_us = env_long("FAKE_CUDA_KERNEL_US", 300);
    long sms = env_long("FAKE_CUDA_SMS", 0);
    pthread_mutex_lock(&s->m);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->c, &s->m);
        if (!s->head) break;
        struct cmd *c = s->head;
        s->head = c->next;
        if (!s->head) s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->m);
        switch (c->kind) {
        case COPY:
            memcpy(c->dst, c->src, c->n);
            break;
        case KERNEL:
            gpu_enter(sms);
            if (kernel_us) usleep((useconds_t)kernel_us);
            fake_kernel(c->dst, c->n, &c->params, c->threads);
            gpu_leave(sms);
            break;
        case RECORD:
            pthread_mutex_lock(&c->ev->m);
            if (c->ev->completed < c->seq) {
                c->ev->completed = c->seq;
                clock_gettime(CLOCK_MONOTONIC, &c->ev->at);
            }
            pthread_cond_broadcast(&c->ev->c);
            pthread_mutex_unlock(&c->ev->m);
            break;
        case WAIT: /* the event's record as of cuStreamWaitEvent */
            pthread_mutex_lock(&c->ev->m);
            while (c->ev->completed < c->seq) pthread_cond_wait(&c->ev->c, &c->ev->m);
            pthread_mutex_unlock(&c->ev->m);
            break;
        case HOSTFN:
            c->fn(c->user);
            break;
        }
        free(c);
        pthread_mutex_lock(&s->m);
        s->busy = 0;
        pthread_cond_broadcast(&s->c);
    }
    pthread_mutex_unlock(&s->m);
    return NULL;
}

static CUresult enqueue(void *stream, struct cmd *c) {
    struct stream *s = stream;
    if (!s) return E_INVALID_VALUE; /* the backend never uses the legacy stream */
    c->next = NULL;
    pthread_mutex_lock(&s->m);
    if (s->tail)
        s->tail->next = c;
    else
        s->head = c;
    s->tail = c;
    pthread_cond_broadcast(&s->c);
    pthread_mutex_unlock(&s->m);
    return OK;
}

static struct cmd *new_cmd(enum kind k) {
    struct cmd *c = calloc(1, sizeof *c);
    if (c) c->kind = k;
    return c;
}

/* ---------------------------------------------------------------- the driver API */

static int context_token;
/* The calling thread's context (the primary one until set). */
static __thread void *current_ctx = &context_token;

/* Allocations and their contexts, for FAKE_CUDA_STRICT_CTX. */
struct alloc {
    uintptr_t base;
    size_t n;
    void *ctx;
    struct alloc *next;
};
static struct alloc *allocs;
static pthread_mutex_t allocs_lock = PTHREAD_MUTEX_INITIALIZER;

/* May the calling thread's context touch [p, p+n)? (Memory this driver did not
 * allocate, the host's, is not checked.) */
static int ctx_may(uintptr_t p, size_t n) {
    if (!getenv("FAKE_CUDA_STRICT_CTX")) return 1;
    int ok = 1;
    pthread_mutex_lock(&allocs_lock);
    for (struct alloc *a = allocs; a; a = a->next)
        if (p >= a->base && p < a->base + a->n) {
            ok = a->ctx == current_ctx && p + n <= a->base + a->n;
            break;
        }
    pthread_mutex_unlock(&allocs_lock);
    return ok;
}

CUresult cuInit(unsigned flags) {
    (void)flags;
    return OK;
}
CUresult cuDriverGetVersion(int *v) {
    *v = 13000;
    return OK;
}
CUresult cuDeviceGetCount(int *n) {
    *n = (int)env_long("FAKE_CUDA_DEVICES", 1);
    return OK;
}
CUresult cuDeviceGet(int *dev, int ordinal) {
    if (ordinal >= env_long("FAKE_CUDA_DEVICES", 1)) return E_NO_DEVICE;
    *dev = ordinal;
    return OK;
}
CUresult cuDeviceGetName(char *name, int len, int dev) {
    (void)dev;
    strncpy(name, "Fake CUDA device (tests/c/fake_cuda.c)", (size_t)len - 1);
    name[len - 1] = 0;
    return OK;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
    (void)dev;
    *v = attr == 75 ? 9 : 0; /* compute capability 9.0 */
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    (void)dev;
    *ctx = &context_token;
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
    (void)dev;
    return OK;
}
CUresult cuCtxSetCurrent(void *ctx) {
    if (!ctx) return E_INVALID_VALUE;
    current_ctx = ctx;
    return OK;
}
/* A context of its own (made current, as the driver's is). */
CUresult cuCtxCreate_v2(void **ctx, unsigned flags, int dev) {
    (void)flags, (void)dev;
    *ctx = malloc(1);
    if (!*ctx) return E_OOM;
    current_ctx = *ctx;
    return OK;
}
CUresult cuCtxDestroy_v2(void *ctx) {
    if (!ctx || ctx == &context_token) return E_INVALID_VALUE;
    if (current_ctx == ctx) current_ctx = &context_token;
    free(ctx);
    return OK;
}

CUresult cuStreamCreate(void **out, unsigned flags) {
    (void)flags;
    struct stream *s = calloc(1, sizeof *s);
    if (!s) return E_OOM;
    pthread_mutex_init(&s->m, NULL);
    pthread_cond_init(&s->c, NULL);
    if (pthread_create(&s->thread, NULL, stream_worker, s)) return E_OOM;
    *out = s;
    return OK;
}
CUresult cuStreamSynchronize(void *stream) {
    struct stream *s = stream;
    pthread_mutex_lock(&s->m);
    while (s->head || s->busy) pthread_cond_wait(&s->c, &s->m);
    pthread_mutex_unlock(&s->m);
    return OK;
}
CUresult cuStreamQuery(void *stream) {
    struct stream *s = stream;
    pthread_mutex_lock(&s->m);
    int idle = !s->head && !s->busy;
    pthread_mutex_unlock(&s->m);
    return idle ? OK : E_NOT_READY;
}
CUresult cuStreamDestroy_v2(void *stream) {
    struct stream *s = stream;
    cuStreamSynchronize(s);
    pthread_mutex_lock(&s->m);
    s->stop = 1;
    pthread_cond_broadcast(&s->c);
    pthread_mutex_unlock(&s->m);
    pthread_join(s->thread, NULL);
    free(s);
    return OK;
}

CUresult cuEventCreate(void **out, unsigned flags) {
    struct event *e = calloc(1, sizeof *e);
    if (!e) return E_OOM;
    e->timing = !(flags & 2); /* CU_EVENT_DISABLE_TIMING */
    pthread_mutex_init(&e->m, NULL);
    pthread_cond_init(&e->c, NULL);
    *out = e;
    return OK;
}
CUresult cuEventDestroy_v2(void *ev) {
    free(ev);
    return OK;
}
CUresult cuEventRecord(void *ev, void *stream) {
    struct event *e = ev;
    struct cmd *c = new_cmd(RECORD);
    if (!c) return E_OOM;
    pthread_mutex_lock(&e->m);
    c->ev = e;
    c->seq = ++e->recorded;
    pthread_mutex_unlock(&e->m);
    return enqueue(stream, c);
}
CUresult cuEventQuery(void *ev) {
    struct event *e = ev;
    pthread_mutex_lock(&e->m);
    int done = e->completed >= e->recorded;
    pthread_mutex_unlock(&e->m);
    return done ? OK : E_NOT_READY;
}
CUresult cuEventSynchronize(void *ev) {
    struct event *e = ev;
    pthread_mutex_lock(&e->m);
    while (e->completed < e->recorded) pthread_cond_wait(&e->c, &e->m);
    pthread_mutex_unlock(&e->m);
    return OK;
}

/* cuStreamWaitEvent: the stream's later work waits for the event's last record
 * (none recorded: no wait). */
CUresult cuStreamWaitEvent(void *stream, void *ev, unsigned flags) {
    (void)flags;
    struct event *e = ev;
    struct cmd *c = new_cmd(WAIT);
    if (!c) return E_OOM;
    c->ev = e;
    pthread_mutex_lock(&e->m);
    c->seq = e->recorded;
    pthread_mutex_unlock(&e->m);
    return enqueue(stream, c);
}
CUresult cuEventElapsedTime(float *ms, void *start, void *end) {
    struct event *a = start, *b = end;
    if (!a->timing || !b->timing) return E_INVALID_HANDLE;
    pthread_mutex_lock(&a->m);
    int da = a->recorded && a->completed >= a->recorded;
    struct timespec ta = a->at;
    pthread_mutex_unlock(&a->m);
    pthread_mutex_lock(&b->m);
    int db = b->recorded && b->completed >= b->recorded;
    struct timespec tb = b->at;
    pthread_mutex_unlock(&b->m);
    if (!da || !db) return E_NOT_READY;
    *ms = (float)((double)(tb.tv_sec - ta.tv_sec) * 1e3 + (double)(tb.tv_nsec - ta.tv_nsec) / 1e6);
    return OK;
}
CUresult cuEventElapsedTime_v2(float *ms, void *start, void *end) {
    return cuEventElapsedTime(ms, start, end);
}

CUresult cuMemAlloc_v2(unsigned long long *dptr, size_t n) {
    long above = env_long("FAKE_CUDA_OOM_ABOVE", -1);
    if (above >= 0 && (long)n > above) return E_OOM;
    void *p = malloc(n);
    if (!p) return E_OOM;
    struct alloc *a = malloc(sizeof *a);
    if (!a) {
        free(p);
        return E_OOM;
    }
    *a = (struct alloc){(uintptr_t)p, n, current_ctx, NULL};
    pthread_mutex_lock(&allocs_lock);
    a->next = allocs;
    allocs = a;
    pthread_mutex_unlock(&allocs_lock);
    const char *log = getenv("FAKE_CUDA_ALLOC_LOG");
    if (log && *log) {
        FILE *f = fopen(log, "a");
        if (f) {
            fprintf(f, "%llu %zu\n", (unsigned long long)(uintptr_t)p, n);
            fclose(f);
        }
    }
    *dptr = (unsigned long long)(uintptr_t)p;
    return OK;
}
CUresult cuMemFree_v2(unsigned long long dptr) {
    pthread_mutex_lock(&allocs_lock);
    for (struct alloc **a = &allocs; *a; a = &(*a)->next)
        if ((*a)->base == dptr) {
            struct alloc *dead = *a;
            *a = dead->next;
            free(dead);
            break;
        }
    pthread_mutex_unlock(&allocs_lock);
    free((void *)(uintptr_t)dptr);
    return OK;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
    (void)flags;
    *p = malloc(n);
    return *p ? OK : E_OOM;
}
CUresult cuMemFreeHost(void *p) {
    free(p);
    return OK;
}
CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *stream) {
    if (!ctx_may(dst, n)) return E_INVALID_VALUE;
    struct cmd *c = new_cmd(COPY);
    if (!c) return E_OOM;
    c->dst = (void *)(uintptr_t)dst;
    c->src = src;
    c->n = n;
    return enqueue(stream, c);
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, unsigned long long src, size_t n, void *stream) {
    if (!ctx_may(src, n)) return E_INVALID_VALUE;
    struct cmd *c = new_cmd(COPY);
    if (!c) return E_OOM;
    c->dst = dst;
    c->src = (const void *)(uintptr_t)src;
    c->n = n;
    return enqueue(stream, c);
}

static int function_token;

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shmem, void *stream, void **params, void **extra) {
    (void)gy, (void)gz, (void)by, (void)bz, (void)shmem, (void)extra;
    if (f != &function_token || gx == 0 || bx == 0 || !params) return E_INVALID_VALUE;
    uintptr_t data = (uintptr_t) * (unsigned long long *)params[0];
    size_t len = (size_t) * (unsigned long long *)params[1];
    if (!ctx_may(data, len)) return E_INVALID_VALUE;
    struct cmd *c = new_cmd(KERNEL);
    if (!c) return E_OOM;
    /* Parameters are copied at launch, as the real driver does. */
    c->dst = (void *)data;
    c->n = len;
    memcpy(&c->params, params[2], sizeof c->params);
    c->threads = gx * bx;
    return enqueue(stream, c);
}
CUresult cuLaunchHostFunc(void *stream, void (*fn)(void *), void *user) {
    struct cmd *c = new_cmd(HOSTFN);
    if (!c) return E_OOM;
    c->fn = fn;
    c->user = user;
    return enqueue(stream, c);
}

static int module_token;
CUresult cuModuleLoadData(void **mod, const void *image) {
    if (getenv("FAKE_CUDA_NO_CUBIN") && strncmp(image, "FAKE-CUBIN", 10) == 0)
        return E_INVALID_IMAGE;
    if (strncmp(image, "FAKE-", 5) != 0) return E_INVALID_IMAGE;
    *mod = &module_token;
    return OK;
}
CUresult cuModuleGetFunction(void **f, void *mod, const char *name) {
    if (mod != &module_token) return E_INVALID_VALUE;
    if (strcmp(name, "aes128_ctr") != 0) return E_NOT_FOUND;
    *f = &function_token;
    return OK;
}
/* The kernel's parameter layout (CUDA 12.4+), which a remoting client needs to
 * marshal arguments: data pointer, length, the parameter block. */
CUresult cuFuncGetParamInfo(void *f, size_t i, size_t *off, size_t *size) {
    static const size_t offs[] = {0, 8, 16}, sizes[] = {8, 8, sizeof(struct AesParams)};
    if (f != &function_token || i >= 3) return E_INVALID_VALUE;
    *off = offs[i];
    *size = sizes[i];
    return OK;
}
CUresult cuModuleUnload(void *mod) {
    (void)mod;
    return OK;
}
CUresult cuGetErrorName(CUresult r, const char **s) {
    switch (r) {
    case E_OOM: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case E_NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; break;
    case E_INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
    case E_NOT_READY: *s = "CUDA_ERROR_NOT_READY"; break;
    default: *s = "CUDA_ERROR_FAKE"; break;
    }
    return OK;
}
CUresult cuGetErrorString(CUresult r, const char **s) {
    (void)r;
    *s = "fake driver error";
    return OK;
}

/* ---------------------------------------------------------------- NVRTC */

struct program {
    char *src;
    int cubin;
};
static const char LOG[] = "aes_ctr.cu(1): error: planted failure (FAKE_NVRTC_FAIL)";

int nvrtcCreateProgram(struct program **p, const char *src, const char *name, int nh,
                       const char *const *h, const char *const *hn) {
    (void)name, (void)nh, (void)h, (void)hn;
    if (!strstr(src, "aes128_ctr")) return 4; /* NVRTC_ERROR_INVALID_INPUT */
    *p = calloc(1, sizeof **p);
    (*p)->src = strdup(src);
    return 0;
}
int nvrtcCompileProgram(struct program *p, int n, const char *const *opts) {
    if (getenv("FAKE_NVRTC_FAIL")) return 6; /* NVRTC_ERROR_COMPILATION */
    for (int i = 0; i < n; i++)
        if (strstr(opts[i], "=sm_")) p->cubin = 1;
    return 0;
}
static const char *image(struct program *p) { return p->cubin ? "FAKE-CUBIN" : "FAKE-PTX"; }
int nvrtcGetPTXSize(struct program *p, size_t *n) {
    *n = strlen(image(p)) + 1;
    return 0;
}
int nvrtcGetPTX(struct program *p, char *out) {
    strcpy(out, image(p));
    return 0;
}
int nvrtcGetCUBINSize(struct program *p, size_t *n) {
    if (!p->cubin) return 4;
    return nvrtcGetPTXSize(p, n);
}
int nvrtcGetCUBIN(struct program *p, char *out) {
    if (!p->cubin) return 4;
    return nvrtcGetPTX(p, out);
}
int nvrtcGetProgramLogSize(struct program *p, size_t *n) {
    (void)p;
    *n = getenv("FAKE_NVRTC_FAIL") ? sizeof LOG : 1;
    return 0;
}
int nvrtcGetProgramLog(struct program *p, char *out) {
    (void)p;
    strcpy(out, getenv("FAKE_NVRTC_FAIL") ? LOG : "");
    return 0;
}
int nvrtcDestroyProgram(struct program **p) {
    free((*p)->src);
    free(*p);
    *p = NULL;
    return 0;
}
const char *nvrtcGetErrorString(int r) {
    return r == 6 ? "NVRTC_ERROR_COMPILATION" : r == 4 ? "NVRTC_ERROR_INVALID_INPUT" : "NVRTC_FAKE";
}
int nvrtcVersion(int *major, int *minor) {
    *major = 13;
    *minor = 0;
    return 0;
}
