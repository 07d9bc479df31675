/*
 * The one piece of the Python integration's guard path that cannot be Python: the
 * read that enforce may send back. The guard jumps back to a sigsetjmp point in a
 * frame that is still live, which must be C (a jump over the interpreter's frames
 * would corrupt it). Built next to the script:
 *
 *   cc -shared -fPIC -O2 -I$DIST/include toffload_guard_helper.c -o toffload_guard_helper.so
 *
 * Not linked with libtoffload_accel.so: its calls resolve to the copy the script
 * loaded (RTLD_GLOBAL). A second copy, found by another search path, would keep a
 * guard state of its own and guard nothing.
 */
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>

#include "toffload_accel.h"

/* Begins `token` and adds up n words of p, `stride` words apart (n = 1: one counter).
 * 0 with the sum in *out; 1 when enforce sent the token back (a parked token owns
 * the page: retry after an end); or a negative errno from toffload_guard_begin. */
int toffload_py_begin_read(uint64_t token, const volatile uint64_t *p, size_t n, size_t stride, uint64_t *out) {
    sigjmp_buf env;
    if (sigsetjmp(env, 0))
        return 1;
    int rc = toffload_guard_begin(token, &env);
    if (rc < 0)
        return rc;
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++)
        s += p[i * stride];
    *out = s;
    return 0;
}
