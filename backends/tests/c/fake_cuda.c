/* A fake CUDA driver and NVRTC, for testing the cuda backend's host side on machines
 * without a GPU. Built as one shared library and loaded as libcuda.so and libnvrtc.so
 * (LD_LIBRARY_PATH). It implements exactly the functions the backend calls, with real
 * asynchrony: each stream has a worker thread that runs its queue (copies, the kernel,
 * event records, host functions) in order, after a delay per kernel, so operations are
 * really pending for a while and host functions run on a thread that is not the
 * caller's, as with the real driver.
 *
 * The "kernel" is AES-128-CTR written here independently of aes_ctr.cu and of the Rust
 * model: it takes the round keys and counter block the backend passes as kernel
 * parameters, so the key schedule, the parameter layout and the copies are checked
 * end to end against OpenSSL by the tests. What it cannot check is the CUDA C kernel
 * itself: that runs only on a GPU (cargo xtask gpu-check).
 *
 * Knobs (environment): FAKE_CUDA_DEVICES=0 (no device), FAKE_CUDA_KERNEL_US (delay per
 * kernel, default 300), FAKE_CUDA_OOM_ABOVE=N (cuMemAlloc over N bytes fails),
 * FAKE_CUDA_NO_CUBIN=1 (the module loader rejects CUBIN images), FAKE_CUDA_WRONG=1 (the
 * kernel flips a bit), FAKE_NVRTC_FAIL=1 (compilation fails with a log). */
#include <pthread.h>
#include <stdint.h>
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
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
};

static long env_long(const char *name, long dflt) {
    const char *v = getenv(name);
    return v && *v ? atol(v) : dflt;
}

/* ---------------------------------------------------------------- AES, by the book */

static uint8_t SBOX[256];

static uint8_t xt(uint8_t b) { return (uint8_t)((b << 1) ^ ((b & 0x80) ? 0x1b : 0)); }

static uint8_t gmul(uint8_t a, uint8_t b) {
    uint8_t p = 0;
    while (b) {
        if (b & 1) p ^= a;
        a = xt(a);
        b >>= 1;
    }
    return p;
}

static void init_sbox(void) {
    for (int i = 0; i < 256; i++) {
        uint8_t inv = 0;
        for (int j = 1; j < 256 && i; j++)
            if (gmul((uint8_t)i, (uint8_t)j) == 1) inv = (uint8_t)j;
        uint8_t r = inv, x = inv;
        for (int k = 0; k < 4; k++) {
            x = (uint8_t)((x << 1) | (x >> 7));
            r ^= x;
        }
        SBOX[i] = r ^ 0x63;
    }
}

/* state as 16 bytes, column-major; round keys as big-endian words */
static void add_key(uint8_t s[16], const uint32_t *rk) {
    for (int c = 0; c < 4; c++)
        for (int r = 0; r < 4; r++) s[4 * c + r] ^= (uint8_t)(rk[c] >> (24 - 8 * r));
}

static void aes_block(const uint32_t rk[44], const uint8_t in[16], uint8_t out[16]) {
    uint8_t s[16], t[16];
    memcpy(s, in, 16);
    add_key(s, rk);
    for (int round = 1; round <= 10; round++) {
        for (int i = 0; i < 16; i++) s[i] = SBOX[s[i]];
        for (int c = 0; c < 4; c++)
            for (int r = 0; r < 4; r++) t[4 * c + r] = s[4 * ((c + r) % 4) + r];
        if (round < 10) {
            for (int c = 0; c < 4; c++) {
                uint8_t *a = &t[4 * c];
                uint8_t a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
                /* 2a = xt(a), 3a = xt(a) ^ a */
                a[0] = xt(a0) ^ xt(a1) ^ a1 ^ a2 ^ a3;
                a[1] = a0 ^ xt(a1) ^ xt(a2) ^ a2 ^ a3;
                a[2] = a0 ^ a1 ^ xt(a2) ^ xt(a3) ^ a3;
                a[3] = xt(a0) ^ a0 ^ a1 ^ a2 ^ xt(a3);
            }
        }
        memcpy(s, t, 16);
        add_key(s, rk + 4 * round);
    }
    memcpy(out, s, 16);
}

struct AesParams {
    uint32_t rk[44];
    uint32_t iv[4];
};

static void fake_kernel(uint8_t *data, uint64_t len, const struct AesParams *p) {
    uint8_t ctr[16], ks[16];
    for (uint64_t b = 0; b * 16 < len; b++) {
        for (int i = 0; i < 4; i++) {
            ctr[4 * i] = (uint8_t)(p->iv[i] >> 24);
            ctr[4 * i + 1] = (uint8_t)(p->iv[i] >> 16);
            ctr[4 * i + 2] = (uint8_t)(p->iv[i] >> 8);
            ctr[4 * i + 3] = (uint8_t)p->iv[i];
        }
        /* ctr += b, big-endian, carrying across all 16 bytes */
        uint64_t add = b;
        for (int i = 15; i >= 0 && add; i--) {
            uint64_t v = ctr[i] + (add & 0xff);
            ctr[i] = (uint8_t)v;
            add = (add >> 8) + (v >> 8);
        }
        aes_block(p->rk, ctr, ks);
        for (uint64_t j = 0; j < 16 && b * 16 + j < len; j++) data[b * 16 + j] ^= ks[j];
    }
    if (getenv("FAKE_CUDA_WRONG") && len) data[0] ^= 1;
}

/* ---------------------------------------------------------------- streams, events */

struct event {
    pthread_mutex_t m;
    pthread_cond_t c;
    unsigned long recorded, completed;
};

enum kind { COPY, KERNEL, RECORD, HOSTFN };
struct cmd {
    enum kind kind;
    void *dst;
    const void *src;
    size_t n;
    struct AesParams params;
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

static void *stream_worker(void *arg) {
    struct stream *s = arg;
    long kernel_us = env_long("FAKE_CUDA_KERNEL_US", 300);
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
            if (kernel_us) usleep((useconds_t)kernel_us);
            fake_kernel(c->dst, c->n, &c->params);
            break;
        case RECORD:
            pthread_mutex_lock(&c->ev->m);
            if (c->ev->completed < c->seq) c->ev->completed = c->seq;
            pthread_cond_broadcast(&c->ev->c);
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

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int context_token;

CUresult cuInit(unsigned flags) {
    (void)flags;
    pthread_once(&once, init_sbox);
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
CUresult cuCtxSetCurrent(void *ctx) { return ctx == &context_token ? OK : E_INVALID_VALUE; }

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
    (void)flags;
    struct event *e = calloc(1, sizeof *e);
    if (!e) return E_OOM;
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

CUresult cuMemAlloc_v2(unsigned long long *dptr, size_t n) {
    long above = env_long("FAKE_CUDA_OOM_ABOVE", -1);
    if (above >= 0 && (long)n > above) return E_OOM;
    void *p = malloc(n);
    if (!p) return E_OOM;
    *dptr = (unsigned long long)(uintptr_t)p;
    return OK;
}
CUresult cuMemFree_v2(unsigned long long dptr) {
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
    struct cmd *c = new_cmd(COPY);
    if (!c) return E_OOM;
    c->dst = (void *)(uintptr_t)dst;
    c->src = src;
    c->n = n;
    return enqueue(stream, c);
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, unsigned long long src, size_t n, void *stream) {
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
    struct cmd *c = new_cmd(KERNEL);
    if (!c) return E_OOM;
    /* Parameters are copied at launch, as the real driver does. */
    c->dst = (void *)(uintptr_t) * (unsigned long long *)params[0];
    c->n = (size_t) * (unsigned long long *)params[1];
    memcpy(&c->params, params[2], sizeof c->params);
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
