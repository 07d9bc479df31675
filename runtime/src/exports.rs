//! The interposed C symbols. Each one asks "am I on a fiber, and is this mitigation
//! on?" and either does the fiber-aware thing or passes straight through to libc, so a
//! process where the runtime never engages behaves exactly as without it.
//! pthread_create and the versioned condition-variable symbols are defined in
//! csrc/shim.c (they need the caller's return address and .symver), which calls the
//! `__toffload_*` functions below.

#![allow(clippy::missing_safety_doc)]

use crate::fiber::{self, Fiber};
use crate::sync::cond::{self, Abi};
use crate::sync::{mutex, rwlock};
use crate::{fd_facts, io, keys, offload, real, thread, time};
use libc::{
    c_char, c_int, c_long, c_uint, c_void, clockid_t, iovec, msghdr, nfds_t, pollfd,
    pthread_attr_t, pthread_key_t, pthread_mutex_t, pthread_rwlock_t, pthread_t, sockaddr,
    socklen_t, timespec,
};

#[inline]
fn on_fiber_io<'a>() -> Option<&'a Fiber> {
    fiber::current().filter(|_| !crate::settings().disabled.io)
}

#[inline]
fn on_fiber_sync<'a>() -> Option<&'a Fiber> {
    fiber::current().filter(|_| !crate::settings().disabled.sync)
}

// ---- I/O --------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: usize) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: buf is writable for n bytes, read(2)'s contract with our caller; both paths
    // pass them on unchanged.
    unsafe {
        match on_fiber_io() {
            Some(f) => io::read(f, fd, buf, n),
            None => (real::read())(fd, buf, n),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, n: usize, buflen: usize) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: __chk_fail takes nothing and does not return; past the check, read's contract
    // is the caller's.
    unsafe {
        if n > buflen {
            extern "C" {
                fn __chk_fail() -> !;
            }
            __chk_fail();
        }
        read(fd, buf, n)
    }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: usize) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: buf is readable for n bytes, write(2)'s contract with our caller; both paths
    // pass them on unchanged.
    unsafe {
        match on_fiber_io() {
            Some(f) => io::write(f, fd, buf, n),
            None => (real::write())(fd, buf, n),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: usize, flags: c_int) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: buf is writable for n bytes, recv(2)'s contract with our caller; null
    // addr/alen ask for no address.
    unsafe {
        match on_fiber_io() {
            Some(f) => io::recvfrom(
                f,
                fd,
                buf,
                n,
                flags,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            ),
            None => (real::recv())(fd, buf, n, flags),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    buflen: usize,
    flags: c_int,
) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: __chk_fail takes nothing and does not return; past the check, recv's contract
    // is the caller's.
    unsafe {
        if n > buflen {
            extern "C" {
                fn __chk_fail() -> !;
            }
            __chk_fail();
        }
        recv(fd, buf, n, flags)
    }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: usize, flags: c_int) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: buf is readable for n bytes, send(2)'s contract with our caller; a null addr
    // means none.
    unsafe {
        match on_fiber_io() {
            Some(f) => io::sendto(f, fd, buf, n, flags, std::ptr::null(), 0),
            None => (real::send())(fd, buf, n, flags),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: buf (n bytes), addr and alen are valid or null as recvfrom(2) requires of our
    // caller; both paths pass them on unchanged.
    unsafe {
        match on_fiber_io() {
            Some(f) => io::recvfrom(f, fd, buf, n, flags, addr, alen),
            None => (real::recvfrom())(fd, buf, n, flags, addr, alen),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    buflen: usize,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: __chk_fail takes nothing and does not return; past the check, recvfrom's
    // contract is the caller's.
    unsafe {
        if n > buflen {
            extern "C" {
                fn __chk_fail() -> !;
            }
            __chk_fail();
        }
        recvfrom(fd, buf, n, flags, addr, alen)
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: usize,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: buf (n bytes) and addr (alen bytes) are valid as sendto(2) requires of our
    // caller; both paths pass them on unchanged.
    unsafe {
        match on_fiber_io() {
            Some(f) => io::sendto(f, fd, buf, n, flags, addr, alen),
            None => (real::sendto())(fd, buf, n, flags, addr, alen),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: iov holds cnt valid iovecs, readv(2)'s contract with our caller; both paths
    // pass them on unchanged.
    unsafe {
        match on_fiber_io() {
            Some(f) => io::readv(f, fd, iov, cnt),
            None => (real::readv())(fd, iov, cnt),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: iov holds cnt valid iovecs, writev(2)'s contract with our caller; both paths
    // pass them on unchanged.
    unsafe {
        match on_fiber_io() {
            Some(f) => io::writev(f, fd, iov, cnt),
            None => (real::writev())(fd, iov, cnt),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: msg and its buffers are valid as recvmsg(2) requires of our caller; both
    // paths pass them on unchanged.
    unsafe {
        crate::drain::before_app_recvmsg(fd, msg);
        match on_fiber_io() {
            Some(f) => io::recvmsg(f, fd, msg, flags),
            None => (real::recvmsg())(fd, msg, flags),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> isize {
    let _phase = crate::handoff::scope();
    // SAFETY: msg and its buffers are valid as sendmsg(2) requires of our caller; both
    // paths pass them on unchanged.
    unsafe {
        match on_fiber_io() {
            Some(f) => io::sendmsg(f, fd, msg, flags),
            None => (real::sendmsg())(fd, msg, flags),
        }
    }
}

fn accepted(r: c_int) -> c_int {
    fd_facts::forget(r);
    crate::latency::accepted(r);
    if r >= 0 && !thread::ACCEPTED.load(std::sync::atomic::Ordering::Relaxed) {
        thread::ACCEPTED.store(true, std::sync::atomic::Ordering::Release);
        crate::log_at!(
            crate::log::DEBUG,
            "first accept: later threads become fibers"
        );
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, alen: *mut socklen_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: addr and alen are valid or null as accept(2) requires of our caller; both
    // paths pass them on unchanged.
    unsafe {
        accepted(match on_fiber_io() {
            Some(f) => io::accept4(f, fd, addr, alen, 0),
            None => (real::accept())(fd, addr, alen),
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
    flags: c_int,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: addr and alen are valid or null as accept4(2) requires of our caller; both
    // paths pass them on unchanged.
    unsafe {
        accepted(match on_fiber_io() {
            Some(f) => io::accept4(f, fd, addr, alen, flags),
            None => (real::accept4())(fd, addr, alen, flags),
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, alen: socklen_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: addr is valid for alen bytes, connect(2)'s contract with our caller; both
    // paths pass them on unchanged.
    unsafe {
        match on_fiber_io() {
            Some(f) => io::connect(f, fd, addr, alen),
            None => (real::connect())(fd, addr, alen),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: fds holds n pollfds, poll(2)'s contract with our caller; both paths pass them
    // on unchanged.
    unsafe {
        match on_fiber_io() {
            Some(f) if timeout != 0 => {
                let d = (timeout > 0).then(|| time::now_ns() + timeout as u64 * 1_000_000);
                io::poll(f, fds, n, d)
            }
            _ => (real::poll())(fds, n, timeout),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    fdslen: usize,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: __chk_fail takes nothing and does not return; past the check, poll's contract
    // is the caller's.
    unsafe {
        if fdslen / std::mem::size_of::<pollfd>() < n as usize {
            extern "C" {
                fn __chk_fail() -> !;
            }
            __chk_fail();
        }
        poll(fds, n, timeout)
    }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: fds holds n pollfds and ts/mask are valid or null, ppoll(2)'s contract with
    // our caller.
    unsafe {
        let zero = !ts.is_null() && (*ts).tv_sec == 0 && (*ts).tv_nsec == 0;
        match on_fiber_io() {
            Some(f) if !zero => {
                // The signal mask is not applied on a fiber: the carrier's mask is shared.
                let d = if ts.is_null() {
                    None
                } else {
                    match time::rel_deadline(ts) {
                        Ok(d) => Some(d),
                        Err(e) => {
                            real::set_errno(e);
                            return -1;
                        }
                    }
                };
                io::poll(f, fds, n, d)
            }
            _ => (real::ppoll())(fds, n, ts, mask),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    mask: *const libc::sigset_t,
    fdslen: usize,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: __chk_fail takes nothing and does not return; past the check, ppoll's
    // contract is the caller's.
    unsafe {
        if fdslen / std::mem::size_of::<pollfd>() < n as usize {
            extern "C" {
                fn __chk_fail() -> !;
            }
            __chk_fail();
        }
        ppoll(fds, n, ts, mask)
    }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: the fd_sets and tv are valid or null, select(2)'s contract with our caller;
    // tv is dereferenced only when non-null.
    unsafe {
        let zero = !tv.is_null() && (*tv).tv_sec == 0 && (*tv).tv_usec == 0;
        match on_fiber_io() {
            Some(f) if !zero => {
                let d = if tv.is_null() {
                    None
                } else {
                    if (*tv).tv_sec < 0 || !(0..1_000_000).contains(&(*tv).tv_usec) {
                        real::set_errno(libc::EINVAL);
                        return -1;
                    }
                    Some(
                        time::now_ns()
                            + (*tv).tv_sec as u64 * 1_000_000_000
                            + (*tv).tv_usec as u64 * 1000,
                    )
                };
                let n = io::select(f, nfds, r, w, e, d);
                if let (Some(d), false) = (d, tv.is_null()) {
                    // Linux reports the time not slept.
                    let left = d.saturating_sub(time::now_ns());
                    (*tv).tv_sec = (left / 1_000_000_000) as libc::time_t;
                    (*tv).tv_usec = ((left % 1_000_000_000) / 1000) as libc::suseconds_t;
                }
                n
            }
            _ => (real::select())(nfds, r, w, e, tv),
        }
    }
}

// ---- fd facts: the calls that change what io.rs remembers of an fd ----------------
// (fcntl, fcntl64 and ioctl are variadic: their C entry points are in csrc/shim.c.)

/// Keeps errno as the real call left it across the bookkeeping.
fn keep_errno<T>(r: T, after: impl FnOnce()) -> T {
    let e = real::errno();
    after();
    real::set_errno(e);
    r
}

#[no_mangle]
pub unsafe extern "C" fn __toffload_fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: fcntl's integer-or-pointer argument, as the caller gave it to csrc/shim.c.
    let r = unsafe { (real::fcntl())(fd, cmd, arg) };
    keep_errno(r, || fd_facts::after_fcntl(fd, cmd, arg, r))
}

#[no_mangle]
pub unsafe extern "C" fn __toffload_ioctl(fd: c_int, req: libc::c_ulong, arg: usize) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: ioctl's integer-or-pointer argument, as the caller gave it to csrc/shim.c.
    let r = unsafe { (real::ioctl())(fd, req, arg) };
    // SAFETY: the caller's own argument for this request.
    keep_errno(r, || unsafe { fd_facts::after_ioctl(fd, req, arg, r) })
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: val is valid for len bytes, setsockopt(2)'s contract with our caller.
    let r = unsafe { (real::setsockopt())(fd, level, opt, val, len) };
    keep_errno(r, || fd_facts::after_setsockopt(fd, level, opt, r))
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let _phase = crate::handoff::scope();
    // Forgotten first: once closed, the number may be another thread's new fd.
    fd_facts::forget(fd);
    // SAFETY: close takes only an integer.
    unsafe { (real::close())(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: dup takes only an integer.
    let r = unsafe { (real::dup())(fd) };
    keep_errno(r, || fd_facts::forget(r))
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: dup2 takes only integers.
    let r = unsafe { (real::dup2())(old, new) };
    keep_errno(r, || fd_facts::forget(new))
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: dup3 takes only integers.
    let r = unsafe { (real::dup3())(old, new, flags) };
    keep_errno(r, || fd_facts::forget(new))
}

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: socket takes only integers.
    let r = unsafe { (real::socket())(domain, ty, proto) };
    keep_errno(r, || fd_facts::forget(r))
}

#[no_mangle]
pub unsafe extern "C" fn socketpair(
    domain: c_int,
    ty: c_int,
    proto: c_int,
    sv: *mut c_int,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: sv has room for two fds, socketpair(2)'s contract with our caller.
    let r = unsafe { (real::socketpair())(domain, ty, proto, sv) };
    if r == 0 && !sv.is_null() {
        // SAFETY: the kernel filled both.
        keep_errno(r, || unsafe {
            fd_facts::forget(*sv);
            fd_facts::forget(*sv.add(1));
        })
    } else {
        r
    }
}

// ---- sleeping -----------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn sleep(s: c_uint) -> c_uint {
    let _phase = crate::handoff::scope();
    // SAFETY: sleep takes only an integer.
    unsafe {
        match on_fiber_io() {
            Some(f) => {
                io::sleep_until(f, time::now_ns() + s as u64 * 1_000_000_000);
                0
            }
            None => (real::sleep())(s),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn usleep(us: libc::useconds_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: usleep takes only an integer.
    unsafe {
        match on_fiber_io() {
            Some(f) => {
                io::sleep_until(f, time::now_ns() + us as u64 * 1000);
                0
            }
            None => (real::usleep())(us),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn nanosleep(req: *const timespec, rem: *mut timespec) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: req is valid and rem writable or null, nanosleep(2)'s contract with our
    // caller; rem is written only when non-null.
    unsafe {
        match on_fiber_io() {
            Some(f) => match time::rel_deadline(req) {
                Ok(d) => {
                    io::sleep_until(f, d);
                    if !rem.is_null() {
                        *rem = time::to_timespec(0);
                    }
                    0
                }
                Err(e) => {
                    real::set_errno(e);
                    -1
                }
            },
            None => (real::nanosleep())(req, rem),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn clock_nanosleep(
    clock: clockid_t,
    flags: c_int,
    req: *const timespec,
    rem: *mut timespec,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: req is valid and rem writable or null, clock_nanosleep(2)'s contract with our
    // caller; rem is written only when non-null.
    unsafe {
        match on_fiber_io() {
            Some(f) => {
                let d = if flags & libc::TIMER_ABSTIME != 0 {
                    time::abs_deadline(clock, req)
                } else {
                    time::rel_deadline(req)
                };
                match d {
                    Ok(d) => {
                        io::sleep_until(f, d);
                        if !rem.is_null() && flags & libc::TIMER_ABSTIME == 0 {
                            *rem = time::to_timespec(0);
                        }
                        0
                    }
                    Err(e) => e,
                }
            }
            None => (real::clock_nanosleep())(clock, flags, req, rem),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    ep: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: evs has room for max events, epoll_wait(2)'s contract with our caller; both
    // paths pass them on unchanged.
    unsafe {
        match on_fiber_io() {
            Some(f) if timeout != 0 => {
                let d = (timeout > 0).then(|| time::now_ns() + timeout as u64 * 1_000_000);
                io::epoll_wait(f, ep, evs, max, d)
            }
            _ => (real::epoll_wait())(ep, evs, max, timeout),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    ep: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: evs has room for max events and mask is valid or null, epoll_pwait(2)'s
    // contract with our caller.
    unsafe {
        match on_fiber_io() {
            Some(f) if timeout != 0 => {
                let d = (timeout > 0).then(|| time::now_ns() + timeout as u64 * 1_000_000);
                io::epoll_wait(f, ep, evs, max, d)
            }
            _ => (real::epoll_pwait())(ep, evs, max, timeout, mask),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn sched_yield() -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: sched_yield takes no arguments.
    unsafe {
        match fiber::current() {
            Some(f) => {
                fiber::yield_now(f);
                0
            }
            None => (real::sched_yield())(),
        }
    }
}

// ---- threads ------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn __toffload_pthread_create(
    out: *mut pthread_t,
    attr: *const pthread_attr_t,
    start: fiber::StartFn,
    arg: *mut c_void,
    caller: *const c_void,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: the application's pthread_create arguments, relayed by csrc/shim.c unchanged.
    unsafe { thread::create(out, attr, start, arg, caller as usize) }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_join(t: pthread_t, ret: *mut *mut c_void) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: ret is writable or null, pthread_join(3)'s contract with our caller; t is not
    // a stale fiber handle.
    unsafe {
        if thread::is_stale_fiber(t) {
            return libc::ESRCH;
        }
        if let Some(r) = thread::join(t, ret, None, false) {
            return r;
        }
        match on_fiber_sync() {
            // A fiber joining a real thread: poll it, parking in between, rather than
            // block the carrier (and every fiber on it) inside glibc.
            Some(f) => loop {
                let r = (real::pthread_tryjoin_np())(t, ret);
                if r != libc::EBUSY {
                    return r;
                }
                fiber::park_until(f, Some(time::now_ns() + 1_000_000));
            },
            None => (real::pthread_join())(t, ret),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_tryjoin_np(t: pthread_t, ret: *mut *mut c_void) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: ret is writable or null, pthread_tryjoin_np(3)'s contract with our caller; t
    // is not a stale fiber handle.
    unsafe {
        if thread::is_stale_fiber(t) {
            return libc::ESRCH;
        }
        thread::join(t, ret, None, true).unwrap_or_else(|| (real::pthread_tryjoin_np())(t, ret))
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_timedjoin_np(
    t: pthread_t,
    ret: *mut *mut c_void,
    ts: *const timespec,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: ret is writable or null and ts valid, as pthread_timedjoin_np(3) requires of
    // our caller.
    unsafe {
        if thread::is_stale_fiber(t) {
            return libc::ESRCH;
        }
        if !thread::is_fiber(t) || crate::settings().disabled.join {
            return (real::pthread_timedjoin_np())(t, ret, ts);
        }
        match time::abs_deadline(libc::CLOCK_REALTIME, ts) {
            Ok(d) => thread::join(t, ret, Some(d), false).unwrap_or(libc::ESRCH),
            Err(e) => e,
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_clockjoin_np(
    t: pthread_t,
    ret: *mut *mut c_void,
    clock: clockid_t,
    ts: *const timespec,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: ret is writable or null and ts valid, as pthread_clockjoin_np(3) requires of
    // our caller.
    unsafe {
        if thread::is_stale_fiber(t) {
            return libc::ESRCH;
        }
        if !thread::is_fiber(t) || crate::settings().disabled.join {
            return (real::pthread_clockjoin_np())(t, ret, clock, ts);
        }
        match time::abs_deadline(clock, ts) {
            Ok(d) => thread::join(t, ret, Some(d), false).unwrap_or(libc::ESRCH),
            Err(e) => e,
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_detach(t: pthread_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: t is not a stale fiber handle; the real call takes only the handle.
    unsafe {
        if thread::is_stale_fiber(t) {
            return libc::ESRCH;
        }
        thread::detach(t).unwrap_or_else(|| (real::pthread_detach())(t))
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_exit(ret: *mut c_void) -> ! {
    let _phase = crate::handoff::scope();
    // SAFETY: ret is the caller's opaque value; thread::exit returns only on a real thread,
    // which glibc then ends.
    unsafe {
        thread::exit(ret);
        (real::pthread_exit())(ret);
        libc::abort()
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_getattr_np(t: pthread_t, attr: *mut pthread_attr_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: attr is writable, pthread_getattr_np(3)'s contract with our caller; t is not
    // a stale fiber handle.
    unsafe {
        if thread::is_stale_fiber(t) {
            return libc::ESRCH;
        }
        thread::getattr(t, attr).unwrap_or_else(|| (real::pthread_getattr_np())(t, attr))
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_kill(t: pthread_t, sig: c_int) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: t is not a stale fiber handle; the real call takes only the handle and a
    // signal number.
    unsafe {
        if thread::is_stale_fiber(t) {
            return libc::ESRCH;
        }
        thread::kill(t, sig).unwrap_or_else(|| (real::pthread_kill())(t, sig))
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_setname_np(t: pthread_t, name: *const c_char) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: name is a C string, pthread_setname_np(3)'s contract with our caller; t is
    // not a stale fiber handle.
    unsafe {
        if thread::is_stale_fiber(t) {
            return libc::ESRCH;
        }
        thread::setname(t, name).unwrap_or_else(|| (real::pthread_setname_np())(t, name))
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_getname_np(t: pthread_t, name: *mut c_char, len: usize) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: name has room for len bytes, pthread_getname_np(3)'s contract with our
    // caller; t is not a stale fiber handle.
    unsafe {
        if thread::is_stale_fiber(t) {
            return libc::ESRCH;
        }
        thread::getname(t, name, len).unwrap_or_else(|| (real::pthread_getname_np())(t, name, len))
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_cancel(t: pthread_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: t is a real thread here (fibers returned above).
    unsafe {
        if thread::is_stale_fiber(t) {
            return libc::ESRCH;
        }
        if thread::is_fiber(t) {
            // Asynchronous cancellation of a fiber would unwind a stack we are not on.
            crate::log_at!(
                crate::log::ERROR,
                "pthread_cancel on a fiber is not supported"
            );
            return libc::ENOTSUP;
        }
        (real::pthread_cancel())(t)
    }
}

// ---- mutexes ------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn pthread_mutex_lock(m: *mut pthread_mutex_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: m is an initialized mutex, pthread_mutex_lock(3)'s contract with our caller;
    // both paths pass them on unchanged.
    unsafe {
        match on_fiber_sync() {
            Some(f) => mutex::lock(m, f, None),
            None => (real::pthread_mutex_lock())(m),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_mutex_trylock(m: *mut pthread_mutex_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: m is an initialized mutex, pthread_mutex_trylock(3)'s contract with our
    // caller; both paths pass them on unchanged.
    unsafe {
        match on_fiber_sync() {
            Some(f) => mutex::trylock(m, f),
            None => (real::pthread_mutex_trylock())(m),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_mutex_timedlock(
    m: *mut pthread_mutex_t,
    ts: *const timespec,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: m is an initialized mutex and ts valid, as pthread_mutex_timedlock(3)
    // requires of our caller.
    unsafe {
        match on_fiber_sync() {
            Some(f) => match time::abs_deadline(libc::CLOCK_REALTIME, ts) {
                Ok(d) => mutex::lock(m, f, Some(d)),
                Err(e) => e,
            },
            None => (real::pthread_mutex_timedlock())(m, ts),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_mutex_clocklock(
    m: *mut pthread_mutex_t,
    clock: clockid_t,
    ts: *const timespec,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: m is an initialized mutex and ts valid, as pthread_mutex_clocklock(3)
    // requires of our caller.
    unsafe {
        match on_fiber_sync() {
            Some(f) => match time::abs_deadline(clock, ts) {
                Ok(d) => mutex::lock(m, f, Some(d)),
                Err(e) => e,
            },
            None => (real::pthread_mutex_clocklock())(m, clock, ts),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_mutex_unlock(m: *mut pthread_mutex_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: m is an initialized mutex, pthread_mutex_unlock(3)'s contract with our
    // caller; both paths pass them on unchanged.
    unsafe {
        match on_fiber_sync() {
            Some(f) => mutex::unlock_fiber(m, f),
            None if crate::engaged() => mutex::unlock_thread(m),
            None => (real::pthread_mutex_unlock())(m),
        }
    }
}

// ---- rwlocks ------------------------------------------------------------------

macro_rules! rw_lock {
    ($name:ident, $real:ident, $write:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(l: *mut pthread_rwlock_t) -> c_int {
            let _phase = crate::handoff::scope();
            // SAFETY: l is an initialized rwlock, the contract of the interposed lock with
            // our caller; both paths pass them on unchanged.
            unsafe {
                match on_fiber_sync() {
                    Some(f) => rwlock::lock(l, f, $write, None),
                    None => (real::$real())(l),
                }
            }
        }
    };
}
rw_lock!(pthread_rwlock_rdlock, pthread_rwlock_rdlock, false);
rw_lock!(pthread_rwlock_wrlock, pthread_rwlock_wrlock, true);

macro_rules! rw_timed {
    ($name:ident, $real:ident, $write:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(l: *mut pthread_rwlock_t, ts: *const timespec) -> c_int {
            let _phase = crate::handoff::scope();
            // SAFETY: l is an initialized rwlock and ts valid, as the interposed timed lock
            // requires of our caller.
            unsafe {
                match on_fiber_sync() {
                    Some(f) => match time::abs_deadline(libc::CLOCK_REALTIME, ts) {
                        Ok(d) => rwlock::lock(l, f, $write, Some(d)),
                        Err(e) => e,
                    },
                    None => (real::$real())(l, ts),
                }
            }
        }
    };
}
rw_timed!(
    pthread_rwlock_timedrdlock,
    pthread_rwlock_timedrdlock,
    false
);
rw_timed!(pthread_rwlock_timedwrlock, pthread_rwlock_timedwrlock, true);

macro_rules! rw_clock {
    ($name:ident, $real:ident, $write:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            l: *mut pthread_rwlock_t,
            clock: clockid_t,
            ts: *const timespec,
        ) -> c_int {
            let _phase = crate::handoff::scope();
            // SAFETY: l is an initialized rwlock and ts valid, as the interposed clock lock
            // requires of our caller.
            unsafe {
                match on_fiber_sync() {
                    Some(f) => match time::abs_deadline(clock, ts) {
                        Ok(d) => rwlock::lock(l, f, $write, Some(d)),
                        Err(e) => e,
                    },
                    None => (real::$real())(l, clock, ts),
                }
            }
        }
    };
}
rw_clock!(
    pthread_rwlock_clockrdlock,
    pthread_rwlock_clockrdlock,
    false
);
rw_clock!(pthread_rwlock_clockwrlock, pthread_rwlock_clockwrlock, true);

#[no_mangle]
pub unsafe extern "C" fn pthread_rwlock_unlock(l: *mut pthread_rwlock_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: l is an initialized rwlock, pthread_rwlock_unlock(3)'s contract with our
    // caller; both paths pass them on unchanged.
    unsafe {
        if crate::engaged() && !crate::settings().disabled.sync {
            rwlock::unlock(l)
        } else {
            (real::pthread_rwlock_unlock())(l)
        }
    }
}

// ---- semaphores and pthread_once ------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn sem_wait(s: *mut libc::sem_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: s is an initialized semaphore, sem_wait(3)'s contract with our caller; both
    // paths pass them on unchanged.
    unsafe {
        match on_fiber_sync() {
            Some(f) => crate::sync::sem::wait(s, f, None),
            None => (real::sem_wait())(s),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn sem_timedwait(s: *mut libc::sem_t, ts: *const timespec) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: s is an initialized semaphore and ts valid, as sem_timedwait(3) requires of
    // our caller.
    unsafe {
        match on_fiber_sync() {
            Some(f) => match time::abs_deadline(libc::CLOCK_REALTIME, ts) {
                Ok(d) => crate::sync::sem::wait(s, f, Some(d)),
                Err(e) => {
                    real::set_errno(e);
                    -1
                }
            },
            None => (real::sem_timedwait())(s, ts),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn sem_clockwait(
    s: *mut libc::sem_t,
    clock: clockid_t,
    ts: *const timespec,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: s is an initialized semaphore and ts valid, as sem_clockwait(3) requires of
    // our caller.
    unsafe {
        match on_fiber_sync() {
            Some(f) => match time::abs_deadline(clock, ts) {
                Ok(d) => crate::sync::sem::wait(s, f, Some(d)),
                Err(e) => {
                    real::set_errno(e);
                    -1
                }
            },
            None => (real::sem_clockwait())(s, clock, ts),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn sem_post(s: *mut libc::sem_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: s is an initialized semaphore, sem_post(3)'s contract with our caller; both
    // paths pass them on unchanged.
    unsafe {
        if crate::engaged() && !crate::settings().disabled.sync {
            crate::sync::sem::post(s)
        } else {
            (real::sem_post())(s)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_once(ctl: *mut c_int, init: unsafe extern "C" fn()) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: ctl is a pthread_once_t and init a routine, pthread_once(3)'s contract with
    // our caller.
    unsafe {
        match on_fiber_sync() {
            Some(f) => crate::sync::once::once(ctl, init, f),
            None => (real::pthread_once())(ctl, init),
        }
    }
}

// ---- condition variables (versioned entry points in csrc/shim.c) ----------------

fn abi(v: c_int) -> Abi {
    if v == 225 {
        Abi::V2_2_5
    } else {
        Abi::V2_3_2
    }
}

#[no_mangle]
pub unsafe extern "C" fn __toffload_cond_init(v: c_int, c: *mut c_void, a: *const c_void) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: the caller's cond and attr, relayed by csrc/shim.c with its ABI version.
    unsafe { cond::init(abi(v), c, a) }
}

#[no_mangle]
pub unsafe extern "C" fn __toffload_cond_destroy(v: c_int, c: *mut c_void) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: the caller's cond, relayed by csrc/shim.c with its ABI version.
    unsafe { cond::destroy(abi(v), c) }
}

#[no_mangle]
pub unsafe extern "C" fn __toffload_cond_signal(v: c_int, c: *mut c_void) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: the caller's cond, relayed by csrc/shim.c with its ABI version.
    unsafe { cond::signal(abi(v), c) }
}

#[no_mangle]
pub unsafe extern "C" fn __toffload_cond_broadcast(v: c_int, c: *mut c_void) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: the caller's cond, relayed by csrc/shim.c with its ABI version.
    unsafe { cond::broadcast(abi(v), c) }
}

#[no_mangle]
pub unsafe extern "C" fn __toffload_cond_wait(
    v: c_int,
    c: *mut c_void,
    m: *mut pthread_mutex_t,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: the caller's cond and locked mutex, relayed by csrc/shim.c with its ABI
    // version.
    unsafe { cond::wait(abi(v), c, m, None) }
}

#[no_mangle]
pub unsafe extern "C" fn __toffload_cond_timedwait(
    v: c_int,
    c: *mut c_void,
    m: *mut pthread_mutex_t,
    ts: *const timespec,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: the caller's cond, locked mutex and deadline, relayed by csrc/shim.c with its
    // ABI version.
    unsafe { cond::wait(abi(v), c, m, Some((None, ts))) }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_cond_clockwait(
    c: *mut c_void,
    m: *mut pthread_mutex_t,
    clock: clockid_t,
    ts: *const timespec,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: c is a cond of the 2.3.2 ABI (the only one with clockwait), m locked and ts
    // valid: the caller's contract.
    unsafe { cond::wait(Abi::V2_3_2, c, m, Some((Some(clock), ts))) }
}

// ---- keys ----------------------------------------------------------------------

/// libstdc++'s `__cxa_thread_atexit` calls this for each C++ thread_local object with a
/// destructor, the first time a thread uses it (thread_dtors.rs).
#[no_mangle]
pub unsafe extern "C" fn __cxa_thread_atexit_impl(
    func: crate::thread_dtors::DtorFn,
    obj: *mut c_void,
    dso_symbol: *mut c_void,
) -> c_int {
    let _phase = crate::handoff::scope();
    if let Some(f) = fiber::current().filter(|_| !crate::settings().disabled.tlsdtors) {
        // SAFETY: the caller's arguments, __cxa_thread_atexit_impl's contract.
        if let Some(r) = unsafe { crate::thread_dtors::register(f, func, obj, dso_symbol) } {
            return r;
        }
    }
    // SAFETY: the caller's arguments, unchanged.
    unsafe { (real::cxa_thread_atexit_impl())(func as *mut c_void, obj, dso_symbol) }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_key_create(
    k: *mut pthread_key_t,
    d: Option<unsafe extern "C" fn(*mut c_void)>,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: k is writable and d a destructor or none, pthread_key_create(3)'s contract
    // with our caller.
    unsafe { keys::create(k, d) }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_key_delete(k: pthread_key_t) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: the key goes to glibc's pthread_key_delete, which checks it.
    unsafe { keys::delete(k) }
}

#[inline]
fn on_fiber_keys<'a>() -> Option<&'a Fiber> {
    fiber::current().filter(|_| !crate::settings().disabled.keys)
}

#[no_mangle]
pub unsafe extern "C" fn pthread_getspecific(k: pthread_key_t) -> *mut c_void {
    let _phase = crate::handoff::scope();
    // SAFETY: the real call takes only the key.
    unsafe {
        match on_fiber_keys() {
            Some(f) => keys::get(f, k),
            None => (real::pthread_getspecific())(k),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_setspecific(k: pthread_key_t, v: *const c_void) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: v is the caller's opaque value, stored and never dereferenced.
    unsafe {
        match on_fiber_keys() {
            Some(f) => keys::set(f, k, v),
            None => (real::pthread_setspecific())(k, v),
        }
    }
}

// ---- the offload table's built-in row ---------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn accel_run(buf: *mut u8, n: c_int) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: buf is valid for n bytes, accel_run's contract with our caller; row 0 is
    // accel_run itself.
    unsafe { offload::interposed(0, [buf as usize, n as usize, 0, 0, 0, 0]) as c_int }
}

// ---- signals: the application's SIGSEGV handler is chained behind ours ------------

#[no_mangle]
pub unsafe extern "C" fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    let _phase = crate::handoff::scope();
    // SAFETY: act and old are valid or null, sigaction(2)'s contract with our caller; both
    // paths pass them on unchanged.
    unsafe {
        if sig == libc::SIGSEGV && crate::signals::installed() {
            return crate::signals::app_sigaction(act, old);
        }
        (real::sigaction())(sig, act, old)
    }
}

#[no_mangle]
pub unsafe extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    let _phase = crate::handoff::scope();
    // SAFETY: an all-zero sigaction is a valid empty one; act and old are locals.
    unsafe {
        // glibc's signal() calls its internal sigaction, not ours: intercept it here too.
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = handler;
        act.sa_flags = libc::SA_RESTART;
        let mut old: libc::sigaction = std::mem::zeroed();
        if sigaction(sig, &act, &mut old) < 0 {
            return libc::SIG_ERR;
        }
        old.sa_sigaction
    }
}

// ---- the conflict guard's cooperative entry point -------------------------------------

/// Adds [ptr, ptr+len) to the memory the guard watches (no-op when TOFFLOAD_GUARD=off).
/// 0, or -EINVAL.
#[no_mangle]
pub extern "C" fn toffload_guard_region(ptr: *mut c_void, len: usize) -> c_int {
    let _phase = crate::handoff::scope();
    crate::guard::add_region(ptr as usize, len)
}

// ---- introspection ------------------------------------------------------------------

/// > 0 inside a fiber (its id), 0 on a real thread.
#[no_mangle]
pub extern "C" fn toffload_fiber_id() -> c_long {
    let _phase = crate::handoff::scope();
    fiber::current().map_or(0, |f| f.id as c_long)
}
