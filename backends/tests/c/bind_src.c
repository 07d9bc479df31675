/* LD_PRELOAD shim for the remote CUDA isolation test: every IPv4 connect() of the
 * process leaves from BIND_SRC (say 127.0.0.2), so that a plaintext daemon on
 * loopback sees it as another identity (the peer's address) than 127.0.0.1. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>

int connect(int fd, const struct sockaddr *a, socklen_t n) {
    int (*real)(int, const struct sockaddr *, socklen_t) =
        (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "connect");
    const char *src = getenv("BIND_SRC");
    if (src && a && a->sa_family == AF_INET) {
        struct sockaddr_in s = {.sin_family = AF_INET};
        if (inet_pton(AF_INET, src, &s.sin_addr) == 1) bind(fd, (struct sockaddr *)&s, sizeof s);
    }
    return real(fd, a, n);
}
