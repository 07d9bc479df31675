/*
 * Non-blocking triples for the CUDA synchronize calls on a handle, the runtime's
 * built-in offload rows (runtime/src/cuda_rows.rs names them):
 *
 *   cudaStreamSynchronize / cudaEventSynchronize   (runtime API)
 *   cuStreamSynchronize   / cuEventSynchronize     (driver API)
 *
 * The work is already queued when the application synchronizes, so submit only
 * hands the handle back; done asks the handle (cudaStreamQuery, cudaEventQuery,
 * cuStreamQuery, cuEventQuery, found at run time: the application brings the CUDA
 * library, and nothing here loads it) and answers 2 once it is anything but "not
 * ready", which tells the runtime to take the call's own result from the real
 * synchronize: it returns at once then, with the exact status (an error is the
 * application's to see, never swallowed). A query that cannot be found answers 2 at
 * once: the real, blocking call then runs, correct if not overlapped.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>

/* cudaErrorNotReady (runtime API) and CUDA_ERROR_NOT_READY (driver API). */
#define NOT_READY 600

typedef int (*query_fn)(void *handle);

static query_fn lookup(const char *name, query_fn *cache)
{
    query_fn q = __atomic_load_n(cache, __ATOMIC_ACQUIRE);
    if (!q) {
        q = (query_fn)dlsym(RTLD_DEFAULT, name);
        __atomic_store_n(cache, q, __ATOMIC_RELEASE);
    }
    return q;
}

static int done_with(query_fn q, long h)
{
    if (!q)
        return 2;
    return q((void *)(uintptr_t)h) == NOT_READY ? 0 : 2;
}

long toffload_cuda_submit(void *handle)
{
    long h = (long)(uintptr_t)handle;
    return h < 0 ? -EINVAL : h;
}

#define DONE(fn, query)                                                        \
    int fn(long h)                                                             \
    {                                                                          \
        static query_fn q;                                                     \
        return done_with(lookup(query, &q), h);                                \
    }

DONE(toffload_cudart_stream_done, "cudaStreamQuery")
DONE(toffload_cudart_event_done, "cudaEventQuery")
DONE(toffload_cu_stream_done, "cuStreamQuery")
DONE(toffload_cu_event_done, "cuEventQuery")

int toffload_cuda_release(long h)
{
    (void)h;
    return 0;
}
