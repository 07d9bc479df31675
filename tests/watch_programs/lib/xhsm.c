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
 * load generator can check every answer.
 */
#define _GNU_SOURCE
#include "toffload_accel.h"

#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

long hsm_submit(unsigned char *buf, long n)
{
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
