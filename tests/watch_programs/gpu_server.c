/*
 * gpu_server: a thread per connection, each request a GPU server's shape: a stream,
 * an asynchronous kernel on it, a synchronize, the result back (libfakecuda.so: the
 * emulated device behind the CUDA names). GPU_SERVER_SYNC picks the wait:
 *   stream (default)  cudaStreamSynchronize      cu-stream  cuStreamSynchronize
 *   event             cudaEventSynchronize       cu-event   cuEventSynchronize
 * The watcher probes each; under the runtime each is rerouted to its query
 * (runtime/csrc/cuda_rows.c).
 */
#include "common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct fake_stream *cudaStream_t;
typedef struct fake_event *cudaEvent_t;
int cudaStreamCreate(cudaStream_t *s);
int cudaStreamDestroy(cudaStream_t s);
int cudaStreamSynchronize(cudaStream_t s);
int cuStreamSynchronize(cudaStream_t s);
int cudaEventCreate(cudaEvent_t *e);
int cudaEventRecord(cudaEvent_t e, cudaStream_t s);
int cudaEventSynchronize(cudaEvent_t e);
int cuEventSynchronize(cudaEvent_t e);
int cudaEventDestroy(cudaEvent_t e);
int fake_launch(cudaStream_t s, unsigned char *buf, int n);

static const char PROG[] = "gpu_server";

enum sync_kind { SYNC_STREAM, SYNC_EVENT, SYNC_CU_STREAM, SYNC_CU_EVENT };
static enum sync_kind sync_kind;

static int wait_for(cudaStream_t s)
{
    if (sync_kind == SYNC_STREAM)
        return cudaStreamSynchronize(s);
    if (sync_kind == SYNC_CU_STREAM)
        return cuStreamSynchronize(s);
    cudaEvent_t e;
    if (cudaEventCreate(&e) != 0)
        return -1;
    int rc = cudaEventRecord(e, s);
    if (rc == 0)
        rc = sync_kind == SYNC_EVENT ? cudaEventSynchronize(e) : cuEventSynchronize(e);
    cudaEventDestroy(e);
    return rc;
}

static int offload(unsigned char *buf, int n)
{
    cudaStream_t s;
    if (cudaStreamCreate(&s) != 0)
        return -1;
    int rc = fake_launch(s, buf, n);
    if (rc == 0)
        rc = wait_for(s);
    cudaStreamDestroy(s);
    return rc == 0 ? 0 : -1;
}

int main(int argc, char **argv)
{
    const char *k = getenv("GPU_SERVER_SYNC");
    if (!k || !strcmp(k, "stream"))
        sync_kind = SYNC_STREAM;
    else if (!strcmp(k, "event"))
        sync_kind = SYNC_EVENT;
    else if (!strcmp(k, "cu-stream"))
        sync_kind = SYNC_CU_STREAM;
    else if (!strcmp(k, "cu-event"))
        sync_kind = SYNC_CU_EVENT;
    else {
        fprintf(stderr, "%s: GPU_SERVER_SYNC=%s: expected stream, event, cu-stream or cu-event\n",
                PROG, k);
        return 2;
    }
    thread_per_connection_main(PROG, argc, argv, offload); /* never returns */
}
