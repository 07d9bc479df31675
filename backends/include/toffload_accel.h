/*
 * toffload accelerator API (libtoffload_accel.so).
 *
 * The runtime never learns what the work is: an operation transforms a buffer in
 * place and completes later. Both backends (TOFFLOAD_BACKEND=emulated, the default,
 * and cuda, on an NVIDIA GPU) apply the same AES-128-CTR,
 * key 000102030405060708090a0b0c0d0e0f, initial counter block
 * f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff, the counter restarting for every operation,
 * so that out = in XOR keystream(len) and any client can verify a result.
 *
 * Every call returns a negative errno on failure and never crashes or hangs on bad
 * input. The buffer passed to accel_submit must stay valid until the operation is
 * done or released; after accel_release returns, the device no longer touches it.
 *
 * accel_release and accel_run return int (0 or -errno). Callers that declare them
 * void, as the original API does, stay ABI compatible: they just ignore the value.
 */
#ifndef TOFFLOAD_ACCEL_H
#define TOFFLOAD_ACCEL_H

#ifdef __cplusplus
extern "C" {
#endif

/* Start an operation on buf[0..n). Never blocks. Handle >= 0, or:
 * -EFAULT null buf (with n > 0), -EINVAL n < 0 or the device is misconfigured,
 * -EMSGSIZE n above the device's maximum, -EAGAIN too many operations in flight;
 * cuda: -ENODEV no driver or no device (every call, reported once at load),
 * -ENOMEM device or pinned memory exhausted, -EIO a driver or kernel failure. */
long accel_submit(unsigned char *buf, int n);

/* 1 done, 0 pending, -EBADF unknown or released handle, -EIO the operation failed. */
int accel_done(long id);

/* Free the handle. A pending operation is cancelled: its buffer is left as it was
 * or fully transformed, never half. 0, or -EBADF for an unknown handle or a
 * second release. */
int accel_release(long id);

/* Blocking: submit, wait (TOFFLOAD_WAIT=spin busy-polls, block sleeps), release.
 * 0, or the -errno of the failing step. */
int accel_run(unsigned char *buf, int n);

/* An eventfd (non-blocking, close-on-exec) that becomes readable whenever an
 * operation completes; read it to reset. -EINVAL if the device is unusable. */
int accel_completion_fd(void);

#ifdef __cplusplus
}
#endif
#endif
