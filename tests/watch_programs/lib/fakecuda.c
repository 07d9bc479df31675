/*
 * libfakecuda.so: the part of the CUDA runtime and driver APIs a GPU server's wait
 * goes through, on toffload's emulated device, for machines without a GPU: streams,
 * events recorded on them, an asynchronous "kernel" (fake_launch: the emulated
 * device's AES-CTR, checkable by the load generator), the queries, and
 * synchronize calls that wait below libc (raw nanosleep between polls, as a
 * driver's wait is an ioctl or a spin the interposer never sees). The driver API's
 * cuStream and cuEvent calls are the same objects under their own names, as in
 * CUDA. Errors are sticky per stream like CUDA's: FAKECUDA_FAIL=1 makes every
 * operation end in cudaErrorIllegalAddress (700). Operations are submitted polled
 * where the backend can (a query reads the completion the device wrote, as a GPU's
 * does; no host thread wakes per operation).
 */
#define _GNU_SOURCE
#include "toffload_accel.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define cudaSuccess 0
#define cudaErrorNotReady 600
#define cudaErrorIllegalAddress 700

struct fake_stream {
    long op;    /* the device operation in flight, or -1 */
    int status; /* what the last operation ended with */
};
typedef struct fake_stream *cudaStream_t;

int cudaStreamCreate(cudaStream_t *s)
{
    struct fake_stream *f = malloc(sizeof *f);
    if (!f)
        return 2; /* cudaErrorMemoryAllocation */
    f->op = -1;
    f->status = cudaSuccess;
    *s = f;
    return cudaSuccess;
}

int cudaStreamDestroy(cudaStream_t s)
{
    if (s && s->op >= 0)
        accel_release(s->op);
    free(s);
    return cudaSuccess;
}

/* Set once the backend has answered -EOPNOTSUPP (cuda, remote): signalled from then. */
static atomic_int signalled_only;

static long submit(unsigned char *buf, int n)
{
    if (!atomic_load_explicit(&signalled_only, memory_order_relaxed)) {
        long op = accel_submit_polled(buf, n, NULL);
        if (op != -EOPNOTSUPP)
            return op;
        atomic_store_explicit(&signalled_only, 1, memory_order_relaxed);
    }
    return accel_submit(buf, n);
}

/* Queues the device's transform of buf[0..n) on the stream. */
int fake_launch(cudaStream_t s, unsigned char *buf, int n)
{
    long op = submit(buf, n);
    if (op < 0)
        return cudaErrorIllegalAddress;
    s->op = op;
    s->status = cudaSuccess;
    return cudaSuccess;
}

int cudaStreamQuery(cudaStream_t s)
{
    if (s->op >= 0) {
        int d = accel_done(s->op);
        if (d == 0)
            return cudaErrorNotReady;
        accel_release(s->op);
        s->op = -1;
        const char *fail = getenv("FAKECUDA_FAIL");
        s->status = d < 0 || (fail && fail[0] == '1') ? cudaErrorIllegalAddress : cudaSuccess;
    }
    return s->status;
}

int cudaStreamSynchronize(cudaStream_t s)
{
    const struct timespec slice = {0, 20 * 1000};
    int r;
    while ((r = cudaStreamQuery(s)) == cudaErrorNotReady)
        syscall(SYS_nanosleep, &slice, NULL);
    return r;
}

/* An event is the point of its stream it was recorded at; the fake stream runs one
 * operation at a time, so the event is complete when that operation is. */
struct fake_event {
    cudaStream_t stream;
};
typedef struct fake_event *cudaEvent_t;

int cudaEventCreate(cudaEvent_t *e)
{
    struct fake_event *f = malloc(sizeof *f);
    if (!f)
        return 2;
    f->stream = NULL;
    *e = f;
    return cudaSuccess;
}

int cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    e->stream = s;
    return cudaSuccess;
}

int cudaEventQuery(cudaEvent_t e)
{
    return e->stream ? cudaStreamQuery(e->stream) : cudaSuccess;
}

int cudaEventSynchronize(cudaEvent_t e)
{
    const struct timespec slice = {0, 20 * 1000};
    int r;
    while ((r = cudaEventQuery(e)) == cudaErrorNotReady)
        syscall(SYS_nanosleep, &slice, NULL);
    return r;
}

int cudaEventDestroy(cudaEvent_t e)
{
    free(e);
    return cudaSuccess;
}

/* The driver API (CUresult has the same codes for these). */
int cuStreamQuery(cudaStream_t s) { return cudaStreamQuery(s); }
int cuStreamSynchronize(cudaStream_t s) { return cudaStreamSynchronize(s); }
int cuEventQuery(cudaEvent_t e) { return cudaEventQuery(e); }
int cuEventSynchronize(cudaEvent_t e) { return cudaEventSynchronize(e); }
