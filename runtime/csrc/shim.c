/*
 * The interposers that Rust cannot express: pthread_create needs its caller's return
 * address (threads created by an offload backend stay real), and the condition-variable
 * functions must be exported at both of glibc's versions (.symver), each passing its
 * ABI on so that the real function we fall back to is the matching one.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <time.h>

int __toffload_pthread_create(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *,
                              const void *caller);
int __toffload_cond_init(int abi, void *c, const void *attr);
int __toffload_cond_destroy(int abi, void *c);
int __toffload_cond_signal(int abi, void *c);
int __toffload_cond_broadcast(int abi, void *c);
int __toffload_cond_wait(int abi, void *c, pthread_mutex_t *m);
int __toffload_cond_timedwait(int abi, void *c, pthread_mutex_t *m, const struct timespec *ts);

int pthread_create(pthread_t *restrict t, const pthread_attr_t *restrict a, void *(*start)(void *),
                   void *restrict arg)
{
    return __toffload_pthread_create(t, a, start, arg, __builtin_return_address(0));
}

#define COND_ABI(ver, tag, dflt)                                                                  \
    int __toffload_cv_init_##tag(void *c, const void *a) { return __toffload_cond_init(ver, c, a); } \
    int __toffload_cv_destroy_##tag(void *c) { return __toffload_cond_destroy(ver, c); }          \
    int __toffload_cv_signal_##tag(void *c) { return __toffload_cond_signal(ver, c); }            \
    int __toffload_cv_broadcast_##tag(void *c) { return __toffload_cond_broadcast(ver, c); }      \
    int __toffload_cv_wait_##tag(void *c, pthread_mutex_t *m) { return __toffload_cond_wait(ver, c, m); } \
    int __toffload_cv_timedwait_##tag(void *c, pthread_mutex_t *m, const struct timespec *ts)     \
    {                                                                                             \
        return __toffload_cond_timedwait(ver, c, m, ts);                                          \
    }                                                                                             \
    __asm__(".symver __toffload_cv_init_" #tag ", pthread_cond_init" dflt);                      \
    __asm__(".symver __toffload_cv_destroy_" #tag ", pthread_cond_destroy" dflt);                \
    __asm__(".symver __toffload_cv_signal_" #tag ", pthread_cond_signal" dflt);                  \
    __asm__(".symver __toffload_cv_broadcast_" #tag ", pthread_cond_broadcast" dflt);            \
    __asm__(".symver __toffload_cv_wait_" #tag ", pthread_cond_wait" dflt);                      \
    __asm__(".symver __toffload_cv_timedwait_" #tag ", pthread_cond_timedwait" dflt);

/* Prototypes keep -Wmissing-prototypes quiet; they are internal. */
COND_ABI(225, 225, "@GLIBC_2.2.5")
COND_ABI(232, 232, "@@GLIBC_2.3.2")

/* fcntl, fcntl64 and ioctl are variadic; each takes at most one integer or pointer
 * argument, read here as glibc itself reads it, and handed to the runtime, which
 * calls the real function and updates what it remembers of the fd (fd_facts.rs).
 * fcntl64 is glibc 2.28's name for binaries built with 64-bit off_t; on x86-64 it is
 * the same call. <fcntl.h> and <sys/ioctl.h> are not included: their declarations
 * may redirect fcntl to fcntl64. */
int __toffload_fcntl(int fd, int cmd, unsigned long arg);
int __toffload_ioctl(int fd, unsigned long req, unsigned long arg);
int fcntl(int fd, int cmd, ...);
int fcntl64(int fd, int cmd, ...);
int ioctl(int fd, unsigned long req, ...);

int fcntl(int fd, int cmd, ...)
{
    va_list ap;
    va_start(ap, cmd);
    unsigned long arg = va_arg(ap, unsigned long);
    va_end(ap);
    return __toffload_fcntl(fd, cmd, arg);
}

int fcntl64(int fd, int cmd, ...)
{
    va_list ap;
    va_start(ap, cmd);
    unsigned long arg = va_arg(ap, unsigned long);
    va_end(ap);
    return __toffload_fcntl(fd, cmd, arg);
}

int ioctl(int fd, unsigned long req, ...)
{
    va_list ap;
    va_start(ap, req);
    unsigned long arg = va_arg(ap, unsigned long);
    va_end(ap);
    return __toffload_ioctl(fd, req, arg);
}
