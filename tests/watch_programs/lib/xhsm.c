/*
 * libxhsm.so: a vendor's offload library as toffload finds it in the field (an
 * HSM's signing call, an inference client's request): a blocking entry point whose
 * wait is below libc, where no interposer sees it, and a non-blocking twin.
 *
 *   hsm_sign(buf, n)   blocking: the operation, waited for in the kernel with raw
 *                      nanosleep syscalls until the device is done
 *   hsm_submit(buf, n) -> handle >= 0 or -errno; hsm_poll(h) -> 1 done, 0 pending,
 *   -errno; hsm_free(h) -> 0 or -errno
 *
 * The device is toffload's emulated one (AES-CTR, TOFFLOAD_EMU_LAT_US), so the
 * load generator can check every answer. Its operations are submitted polled, as a
 * real HSM's are: the poll reads a completion the device wrote, and no thread of the
 * host's wakes per operation (the emulated device's completion thread, signalled,
 * would take CPU beside the load generator that no HSM takes).
 */
#define _GNU_SOURCE
#include "toffload_accel.h"

#include <errno.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Set once the backend has answered -EOPNOTSUPP (cuda, remote): signalled from then. */
static atomic_int signalled_only;

long hsm_submit(unsigned char *buf, long n)
{
    if (!atomic_load_explicit(&signalled_only, memory_order_relaxed)) {
        long h = accel_submit_polled(buf, (int)n, NULL);
        if (h != -EOPNOTSUPP)
            return h;
        atomic_store_explicit(&signalled_only, 1, memory_order_relaxed);
    }
    return accel_submit(buf, (int)n);
}

int hsm_poll(long h)
{
    return accel_done(h);
}

int hsm_free(long h)
{
    return accel_release(h);
}

int hsm_sign(unsigned char *buf, long n)
{
    long h = hsm_submit(buf, n);
    if (h < 0)
        return (int)h;
    /* The vendor's driver sleeps in the kernel between polls of its device. */
    const struct timespec slice = {0, 20 * 1000};
    int d;
    while ((d = hsm_poll(h)) == 0)
        syscall(SYS_nanosleep, &slice, NULL);
    hsm_free(h);
    return d < 0 ? d : 0;
}
