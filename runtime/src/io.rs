//! Fiber-aware I/O. On a fiber, a call that would block parks the fiber until its fd is
//! ready, and the carrier runs the others meanwhile; the application still sees
//! blocking semantics. Sockets are tried with MSG_DONTWAIT (one syscall on the fast
//! path, no change to the fd's flags, which the application may share or inspect);
//! other pollable fds (pipes, eventfds, ttys) wait for readiness first. Regular files,
//! fds 0-2 and fds the application itself made non-blocking pass straight through.

#![allow(clippy::missing_safety_doc)] // C callers' pointers, taken as they come

use crate::fiber::{self, Fiber};
use crate::{drain, fd_facts, latency, real, stats, time};
use libc::{c_int, c_void, iovec, msghdr, sockaddr, socklen_t};
use std::sync::atomic::Ordering::Relaxed;

const IN: u32 = libc::EPOLLIN as u32 | libc::EPOLLRDHUP as u32;
const OUT: u32 = libc::EPOLLOUT as u32;

fn would_block(r: isize) -> bool {
    r < 0 && matches!(real::errno(), libc::EAGAIN)
}

fn app_nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL has no side effects.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Parks `f` until `fd` reports one of `events`, or `deadline`. Err(errno) when epoll
/// cannot watch the fd. Ok(true) = deadline passed.
///
/// The fd stays in the carrier's epoll after the wait (edge-triggered, so a fiber
/// always tries the call before it parks), and fd_facts remembers it, so the next
/// wait needs no epoll_ctl. A remembered registration could be stale after a close
/// the runtime never saw, and a read that parks without asking (drain.rs) trusts that
/// no edge was missed; such a wait re-registers once after RECHECK_NS and looks
/// whether the fd is ready already (ready_now).
pub fn wait_fd(f: &Fiber, fd: c_int, events: u32, deadline: Option<u64>) -> Result<bool, c_int> {
    let c = f.carrier();
    let remembered = fd_facts::registered(fd, c.index);
    stats::COUNTERS.io_parks.fetch_add(1, Relaxed);
    if remembered && deadline.is_none() {
        // The common wait. No timer of its own: the carrier's recheck sweep wakes it
        // once RECHECK_NS passed since the last poll (no clock read here either).
        c.watch_fd(f, fd, events, false, c.polled_at() + RECHECK_NS)?;
        f.rechecked.set(false);
        fiber::park(f);
        c.unwatch_fd(f, fd);
        if !f.rechecked.replace(false) {
            return Ok(false);
        }
        c.watch_fd(f, fd, events, true, 0)?;
        if !ready_now(fd, events) {
            fiber::park(f);
        }
        c.unwatch_fd(f, fd);
        return Ok(false);
    }
    c.watch_fd(f, fd, events, !remembered, 0)?;
    if !remembered {
        fd_facts::set_registered(fd, c.index);
    }
    let check = time::now_ns() + RECHECK_NS;
    let timed_out = if remembered && deadline.is_none_or(|d| d > check) {
        if fiber::park_until(f, Some(check)) {
            if let Err(e) = c.register_fd(fd) {
                c.unwatch_fd(f, fd);
                return Err(e);
            }
            !ready_now(fd, events) && fiber::park_until(f, deadline)
        } else {
            false
        }
    } else {
        fiber::park_until(f, deadline)
    };
    c.unwatch_fd(f, fd);
    Ok(timed_out)
}

/// How long a wait trusts a remembered epoll registration before it checks it.
const RECHECK_NS: u64 = 50_000_000;

/// A wait's recheck, after its fd was (re-)registered: whether the fd is ready
/// already. A stale registration re-added reports readiness by itself, but an edge
/// that came before the wait began is not reported again: the caller then tries its
/// call instead of parking for good (a missed edge costs RECHECK_NS, never a hang).
fn ready_now(fd: c_int, events: u32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: if events & OUT != 0 {
            libc::POLLOUT
        } else {
            libc::POLLIN | libc::POLLRDHUP
        },
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    unsafe { (real::poll())(&mut p, 1, 0) != 0 }
}

/// SO_RCVTIMEO / SO_SNDTIMEO of a socket, as a deadline from now (None: no timeout).
fn sock_deadline(fd: c_int, events: u32) -> Option<u64> {
    let us = fd_facts::timeout_us(fd, events & OUT != 0);
    (us > 0).then(|| time::now_ns() + us * 1000)
}

/// Runs the non-blocking attempt `op` until it does not return EAGAIN, parking on
/// `events` in between, with the socket's own timeout (SO_RCVTIMEO / SO_SNDTIMEO)
/// honoured: EAGAIN when it passes, as the kernel would say. `blocking` is the plain
/// libc call, for fds we cannot wait on.
fn retry(
    f: &Fiber,
    fd: c_int,
    events: u32,
    op: impl FnMut() -> isize,
    blocking: impl FnOnce() -> isize,
) -> isize {
    retry_after(f, fd, events, None, op, blocking)
}

/// retry() when the caller has already made the first attempt (`first`, with errno
/// still its): a read that probed the fd for ENOTSOCK must not ask the socket twice
/// before it parks (one syscall of the ~6 a waiting read costs).
fn retry_after(
    f: &Fiber,
    fd: c_int,
    events: u32,
    mut first: Option<isize>,
    mut op: impl FnMut() -> isize,
    blocking: impl FnOnce() -> isize,
) -> isize {
    let mut deadline = None;
    let mut polled_at = None;
    loop {
        let r = first.take().unwrap_or_else(&mut op);
        if !would_block(r) {
            if let (Some(t), true) = (polled_at, r > 0 && events & IN != 0) {
                latency::request_began(fd, t);
            }
            return r;
        }
        if fd_facts::nonblocking(fd) {
            return r;
        }
        let d = *deadline.get_or_insert_with(|| sock_deadline(fd, events));
        match wait_fd(f, fd, events, d) {
            Ok(true) => {
                real::set_errno(libc::EAGAIN);
                return -1;
            }
            // Woken by the carrier's poll: when it saw the fd ready.
            Ok(false) => polled_at = Some(f.carrier().polled_at()),
            Err(_) => return blocking(),
        }
    }
}

/// A blocking write to a pipe (or another pollable non-socket) on a fiber: everything
/// is written, as a blocking pipe would, but the waits park the fiber. O_NONBLOCK is
/// set for the duration (there is no per-call flag for write) and restored.
unsafe fn nonsocket_write(
    f: &Fiber,
    fd: c_int,
    call: impl Fn(usize) -> isize,
    total: usize,
) -> isize {
    // SAFETY: F_GETFL takes no pointer.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 || fl & libc::O_NONBLOCK != 0 {
        return call(0);
    }
    // SAFETY: F_SETFL takes an integer; the old flags are restored on every way out.
    unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) };
    let mut put = 0usize;
    let r = loop {
        let r = call(put);
        if r >= 0 {
            put += r as usize;
            if put >= total {
                break put as isize;
            }
            continue;
        }
        if !would_block(r) {
            break if put > 0 { put as isize } else { r };
        }
        if wait_fd(f, fd, OUT, None).is_err() {
            // Cannot watch it: finish the blocking way.
            // SAFETY: F_SETFL takes an integer: the application's own flags back.
            unsafe { libc::fcntl(fd, libc::F_SETFL, fl) };
            let r = call(put);
            return if r < 0 && put > 0 {
                put as isize
            } else {
                r.max(0) + put as isize
            };
        }
    };
    let e = real::errno();
    // SAFETY: F_SETFL takes an integer: the application's own flags back.
    unsafe { libc::fcntl(fd, libc::F_SETFL, fl) };
    real::set_errno(e);
    r
}

/// Non-sockets: wait for readiness first (there is no per-call non-blocking flag).
fn nonsocket(f: &Fiber, fd: c_int, events: u32, call: impl Fn() -> isize) -> isize {
    if app_nonblocking(fd) {
        return call();
    }
    loop {
        let mut p = libc::pollfd {
            fd,
            events: if events & OUT != 0 {
                libc::POLLOUT
            } else {
                libc::POLLIN
            },
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let n = unsafe { (real::poll())(&mut p, 1, 0) };
        if n != 0 {
            return call();
        }
        if wait_fd(f, fd, events, None).is_err() {
            return call();
        }
    }
}

fn skip(fd: c_int) -> bool {
    fd <= 2
}

pub unsafe fn read(f: &Fiber, fd: c_int, buf: *mut c_void, n: usize) -> isize {
    if skip(fd) {
        // SAFETY: caller's arguments.
        return unsafe { (real::read())(fd, buf, n) };
    }
    crate::guard::handler_end(f);
    // SAFETY: the caller's buf of n bytes.
    let plain = || unsafe { (real::read())(fd, buf, n) };
    // SAFETY: the caller's buf of n bytes.
    unsafe { stream_read(f, fd, buf, n, plain) }
}

/// A blocking read of up to `n` bytes on a fiber: asked with MSG_DONTWAIT, parked
/// between attempts. Where the last read left the TCP socket empty (drain.rs), it
/// parks without asking first. `plain` is the application's own call, for a file
/// that is no socket, or one epoll cannot watch.
///
/// # Safety
/// `buf` is writable for `n` bytes.
unsafe fn stream_read(
    f: &Fiber,
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    plain: impl Fn() -> isize,
) -> isize {
    let r = if drain::parks_first(fd, f.carrier().index) {
        stats::READS_UNASKED.fetch_add(1, Relaxed);
        real::set_errno(libc::EAGAIN);
        -1
    } else {
        // SAFETY: the caller's buf of n bytes; MSG_DONTWAIT only makes it return early.
        let r = unsafe { drain::recv(fd, buf, n) };
        if r < 0 && real::errno() == libc::ENOTSOCK {
            return nonsocket(f, fd, IN, plain);
        }
        if !would_block(r) {
            return r;
        }
        r
    };
    retry_after(
        f,
        fd,
        IN,
        Some(r),
        // SAFETY: the caller's buf of n bytes.
        || unsafe { drain::recv(fd, buf, n) },
        plain,
    )
}

pub unsafe fn recvfrom(
    f: &Fiber,
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> isize {
    crate::guard::handler_end(f);
    // SAFETY: the caller's buf (n bytes), addr and alen, forwarded.
    let call = |fl: c_int| unsafe { (real::recvfrom())(fd, buf, n, fl, addr, alen) };
    if flags & libc::MSG_DONTWAIT != 0 {
        return call(flags);
    }
    if flags & libc::MSG_WAITALL != 0 {
        // MSG_WAITALL with MSG_DONTWAIT returns what is there: keep collecting.
        let mut got = 0usize;
        while got < n {
            // SAFETY: got < n: inside the caller's buf.
            let b = unsafe { (buf as *mut u8).add(got) } as *mut c_void;
            let r = retry(
                f,
                fd,
                IN,
                // SAFETY: b has n - got bytes left of the caller's buf.
                || unsafe {
                    (real::recvfrom())(fd, b, n - got, flags | libc::MSG_DONTWAIT, addr, alen)
                },
                // SAFETY: b has n - got bytes left of the caller's buf.
                || unsafe { (real::recvfrom())(fd, b, n - got, flags, addr, alen) },
            );
            if r <= 0 {
                return if got > 0 { got as isize } else { r };
            }
            got += r as usize;
        }
        return got as isize;
    }
    if flags == 0 && addr.is_null() {
        // A plain recv: the same as read.
        // SAFETY: the caller's buf of n bytes.
        return unsafe { stream_read(f, fd, buf, n, || call(0)) };
    }
    retry(
        f,
        fd,
        IN,
        || call(flags | libc::MSG_DONTWAIT),
        || call(flags),
    )
}

/// Blocking stream semantics: write everything (or fail having written nothing).
pub unsafe fn sendto(
    f: &Fiber,
    fd: c_int,
    buf: *const c_void,
    n: usize,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> isize {
    crate::guard::handler_end(f);
    latency::responding(fd);
    if flags & libc::MSG_DONTWAIT != 0 {
        // SAFETY: the caller's buf (n bytes) and addr (alen bytes), forwarded.
        return unsafe { (real::sendto())(fd, buf, n, flags, addr, alen) };
    }
    let mut put = 0usize;
    loop {
        // SAFETY: put < n (the loop returns once put >= n), or put = n = 0: the end.
        let b = unsafe { (buf as *const u8).add(put) } as *const c_void;
        let r = retry(
            f,
            fd,
            OUT,
            // SAFETY: b has n - put bytes left of the caller's buf; addr is the caller's.
            || unsafe { (real::sendto())(fd, b, n - put, flags | libc::MSG_DONTWAIT, addr, alen) },
            // SAFETY: b has n - put bytes left of the caller's buf; addr is the caller's.
            || unsafe { (real::sendto())(fd, b, n - put, flags, addr, alen) },
        );
        if r < 0 {
            return if put > 0 { put as isize } else { r };
        }
        put += r as usize;
        if put >= n {
            return put as isize;
        }
    }
}

pub unsafe fn write(f: &Fiber, fd: c_int, buf: *const c_void, n: usize) -> isize {
    if skip(fd) {
        // SAFETY: caller's arguments.
        return unsafe { (real::write())(fd, buf, n) };
    }
    crate::guard::handler_end(f);
    latency::responding(fd);
    // SAFETY: the caller's buf of n bytes.
    let r = unsafe { (real::send())(fd, buf, n, libc::MSG_DONTWAIT) };
    if r < 0 && real::errno() == libc::ENOTSOCK {
        // SAFETY: nonsocket_write passes off < n: the rest of the caller's buf.
        let call = |off| unsafe {
            (real::write())(fd, (buf as *const u8).add(off) as *const c_void, n - off)
        };
        // SAFETY: F_GETFL/F_SETFL on the caller's fd only.
        return unsafe { nonsocket_write(f, fd, call, n) };
    }
    if r >= 0 && r as usize == n || (r < 0 && !would_block(r)) {
        return r;
    }
    let done = r.max(0) as usize;
    // SAFETY: done < n (r < n here): the rest of the caller's buf; no address.
    let rest = unsafe {
        sendto(
            f,
            fd,
            (buf as *const u8).add(done) as *const c_void,
            n - done,
            0,
            std::ptr::null(),
            0,
        )
    };
    if rest < 0 {
        if done > 0 {
            done as isize
        } else {
            rest
        }
    } else {
        (done + rest as usize) as isize
    }
}

pub unsafe fn recvmsg(f: &Fiber, fd: c_int, msg: *mut msghdr, flags: c_int) -> isize {
    crate::guard::handler_end(f);
    // SAFETY: m is the caller's msghdr, or a copy of it over the rest of its iovecs.
    let call = |m: *mut msghdr, fl: c_int| unsafe { (real::recvmsg())(fd, m, fl) };
    if flags & libc::MSG_DONTWAIT != 0 {
        return call(msg, flags);
    }
    if flags & libc::MSG_WAITALL == 0 {
        return retry(
            f,
            fd,
            IN,
            || call(msg, flags | libc::MSG_DONTWAIT),
            || call(msg, flags),
        );
    }
    // MSG_WAITALL: keep receiving into what is left of the iovecs.
    // SAFETY: the caller's msghdr, whose msg_iov holds msg_iovlen iovecs.
    let iov: Vec<iovec> =
        unsafe { std::slice::from_raw_parts((*msg).msg_iov, (*msg).msg_iovlen) }.to_vec();
    let total: usize = iov.iter().map(|x| x.iov_len).sum();
    let mut got = 0usize;
    while got < total {
        let rest = advance(&iov, got);
        // SAFETY: the caller's msghdr, readable.
        let mut m = unsafe { *msg };
        m.msg_iov = rest.as_ptr() as *mut iovec;
        m.msg_iovlen = rest.len();
        let mp: *mut msghdr = &mut m;
        let r = retry(
            f,
            fd,
            IN,
            || call(mp, flags | libc::MSG_DONTWAIT),
            || call(mp, flags),
        );
        if got == 0 {
            // The control data and flags are the first call's.
            // SAFETY: the caller's msghdr, which recvmsg(2) may write.
            unsafe {
                (*msg).msg_controllen = m.msg_controllen;
                (*msg).msg_flags = m.msg_flags;
                (*msg).msg_namelen = m.msg_namelen;
            }
        }
        if r <= 0 {
            return if got > 0 { got as isize } else { r };
        }
        got += r as usize;
    }
    got as isize
}

/// Blocking stream semantics: everything is sent (datagrams go whole or not at all).
pub unsafe fn sendmsg(f: &Fiber, fd: c_int, msg: *const msghdr, flags: c_int) -> isize {
    crate::guard::handler_end(f);
    latency::responding(fd);
    // SAFETY: m is the caller's msghdr, or a copy of it over the rest of its iovecs.
    let call = |m: *const msghdr, fl: c_int| unsafe { (real::sendmsg())(fd, m, fl) };
    if flags & libc::MSG_DONTWAIT != 0 {
        return call(msg, flags);
    }
    // SAFETY: the caller's msghdr, whose msg_iov holds msg_iovlen iovecs.
    let iov: Vec<iovec> =
        unsafe { std::slice::from_raw_parts((*msg).msg_iov, (*msg).msg_iovlen) }.to_vec();
    let total: usize = iov.iter().map(|x| x.iov_len).sum();
    let mut put = 0usize;
    loop {
        let rest = advance(&iov, put);
        // SAFETY: the caller's msghdr, readable.
        let mut m = unsafe { *msg };
        m.msg_iov = rest.as_ptr() as *mut iovec;
        m.msg_iovlen = rest.len();
        if put > 0 {
            // Ancillary data goes with the first piece only.
            m.msg_control = std::ptr::null_mut();
            m.msg_controllen = 0;
        }
        let r = retry(
            f,
            fd,
            OUT,
            || call(&m, flags | libc::MSG_DONTWAIT),
            || call(&m, flags),
        );
        if r < 0 {
            return if put > 0 { put as isize } else { r };
        }
        put += r as usize;
        if put >= total || r == 0 {
            return put as isize;
        }
    }
}

fn iov_msg(iov: *const iovec, cnt: c_int) -> msghdr {
    // SAFETY: an all-zero msghdr is valid.
    let mut m: msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = iov as *mut iovec;
    m.msg_iovlen = cnt.max(0) as usize;
    m
}

pub unsafe fn readv(f: &Fiber, fd: c_int, iov: *const iovec, cnt: c_int) -> isize {
    if skip(fd) {
        // SAFETY: caller's arguments.
        return unsafe { (real::readv())(fd, iov, cnt) };
    }
    crate::guard::handler_end(f);
    let mut m = iov_msg(iov, cnt);
    // SAFETY: m points at the caller's cnt iovecs.
    let r = unsafe { (real::recvmsg())(fd, &mut m, libc::MSG_DONTWAIT) };
    if r < 0 && real::errno() == libc::ENOTSOCK {
        // SAFETY: the caller's cnt iovecs.
        return nonsocket(f, fd, IN, || unsafe { (real::readv())(fd, iov, cnt) });
    }
    if !would_block(r) {
        return r;
    }
    let mp: *mut msghdr = &mut m;
    retry_after(
        f,
        fd,
        IN,
        Some(r),
        // SAFETY: mp is m, alive until retry_after returns, over the caller's iovecs.
        || unsafe { (real::recvmsg())(fd, mp, libc::MSG_DONTWAIT) },
        // SAFETY: the caller's cnt iovecs.
        || unsafe { (real::readv())(fd, iov, cnt) },
    )
}

pub unsafe fn writev(f: &Fiber, fd: c_int, iov: *const iovec, cnt: c_int) -> isize {
    if skip(fd) || cnt <= 0 {
        // SAFETY: caller's arguments.
        return unsafe { (real::writev())(fd, iov, cnt) };
    }
    crate::guard::handler_end(f);
    latency::responding(fd);
    // SAFETY: caller's iovec array of `cnt` entries.
    let v: Vec<iovec> = unsafe { std::slice::from_raw_parts(iov, cnt as usize) }.to_vec();
    let total: usize = v.iter().map(|x| x.iov_len).sum();
    let m = iov_msg(v.as_ptr(), cnt);
    // SAFETY: a valid msghdr over the caller's buffers.
    let r = unsafe { (real::sendmsg())(fd, &m, libc::MSG_DONTWAIT) };
    if r < 0 && real::errno() == libc::ENOTSOCK {
        let call = |off| {
            let rest = advance(&v, off);
            // SAFETY: rest lies inside the caller's buffers.
            unsafe { (real::writev())(fd, rest.as_ptr(), rest.len() as c_int) }
        };
        // SAFETY: F_GETFL/F_SETFL on the caller's fd only.
        return unsafe { nonsocket_write(f, fd, call, total) };
    }
    if (r >= 0 && r as usize == total) || (r < 0 && !would_block(r)) {
        return r;
    }
    // Partial: advance over what went and keep writing the rest.
    let mut put = r.max(0) as usize;
    let mut rest = advance(&v, put);
    loop {
        let m = iov_msg(rest.as_ptr(), rest.len() as c_int);
        // SAFETY: m is over rest, which lies inside the caller's buffers.
        let r = unsafe { sendmsg(f, fd, &m, 0) };
        if r < 0 {
            return if put > 0 { put as isize } else { r };
        }
        put += r as usize;
        if put >= total {
            return put as isize;
        }
        rest = advance(&rest, r as usize);
    }
}

/// The iovecs left after `n` bytes were written.
fn advance(v: &[iovec], mut n: usize) -> Vec<iovec> {
    let mut out = Vec::with_capacity(v.len());
    for x in v {
        if n >= x.iov_len {
            n -= x.iov_len;
            continue;
        }
        out.push(iovec {
            // SAFETY: within the caller's buffer.
            iov_base: unsafe { (x.iov_base as *mut u8).add(n) } as *mut c_void,
            iov_len: x.iov_len - n,
        });
        n = 0;
    }
    out
}

pub unsafe fn accept4(
    f: &Fiber,
    fd: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
    flags: c_int,
) -> c_int {
    // SAFETY: the caller's addr and alen (or nulls), forwarded.
    let call = || unsafe { (real::accept4())(fd, addr, alen, flags) };
    if fd_facts::nonblocking(fd) {
        return call();
    }
    // Ready first (accept has no per-call non-blocking flag), with SO_RCVTIMEO.
    let deadline = sock_deadline(fd, IN);
    loop {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one local pollfd.
        if unsafe { (real::poll())(&mut p, 1, 0) } != 0 {
            return call();
        }
        match wait_fd(f, fd, IN, deadline) {
            Ok(true) => {
                real::set_errno(libc::EAGAIN);
                return -1;
            }
            Ok(false) => {}
            Err(_) => return call(),
        }
    }
}

pub unsafe fn connect(f: &Fiber, fd: c_int, addr: *const sockaddr, alen: socklen_t) -> c_int {
    // SAFETY: F_GETFL takes no pointer.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 || fl & libc::O_NONBLOCK != 0 {
        // SAFETY: the caller's addr of alen bytes.
        return unsafe { (real::connect())(fd, addr, alen) };
    }
    // SAFETY: F_SETFL takes an integer; the old flags are restored below.
    unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) };
    // SAFETY: the caller's addr of alen bytes.
    let mut r = unsafe { (real::connect())(fd, addr, alen) };
    let mut err = real::errno();
    if r < 0 && err == libc::EINPROGRESS {
        match wait_fd(f, fd, OUT, sock_deadline(fd, OUT)) {
            // SO_SNDTIMEO passed: Linux says EINPROGRESS (the attempt goes on).
            Ok(true) => {
                r = -1;
                err = libc::EINPROGRESS;
            }
            Ok(false) => {
                let mut so: c_int = 0;
                let mut len = std::mem::size_of::<c_int>() as socklen_t;
                // SAFETY: so and len are locals of the size len says.
                unsafe {
                    libc::getsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_ERROR,
                        &mut so as *mut c_int as *mut c_void,
                        &mut len,
                    )
                };
                r = if so == 0 { 0 } else { -1 };
                err = so;
            }
            Err(_) => {
                // Cannot watch it: wait the blocking way.
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one local pollfd.
                unsafe { (real::poll())(&mut p, 1, -1) };
                r = 0;
            }
        }
    }
    // SAFETY: F_SETFL takes an integer: the application's own flags back.
    unsafe { libc::fcntl(fd, libc::F_SETFL, fl) };
    if r < 0 {
        real::set_errno(err);
    }
    r
}

fn poll_events(ev: libc::c_short) -> u32 {
    let mut e = 0;
    if ev & (libc::POLLIN | libc::POLLPRI | libc::POLLRDHUP) != 0 {
        e |= IN;
    }
    if ev & libc::POLLOUT != 0 {
        e |= OUT;
    }
    e
}

/// poll/ppoll on a fiber: a zero-timeout poll, and if nothing is ready, park on every
/// fd (and the deadline) and look again.
pub unsafe fn poll(
    f: &Fiber,
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    deadline: Option<u64>,
) -> c_int {
    loop {
        // SAFETY: caller's array.
        let r = unsafe { (real::poll())(fds, n, 0) };
        if r != 0 {
            return r;
        }
        if deadline.is_some_and(|d| time::now_ns() >= d) {
            return 0;
        }
        let c = f.carrier();
        let mut watched = Vec::new();
        for i in 0..n as usize {
            // SAFETY: within the caller's array.
            let p = unsafe { &*fds.add(i) };
            if p.fd >= 0 && c.watch_fd(f, p.fd, poll_events(p.events), true, 0).is_ok() {
                watched.push(p.fd);
            }
        }
        if watched.is_empty() && deadline.is_none() {
            // Nothing we can wait on: block as the application asked.
            // SAFETY: caller's array.
            return unsafe { (real::poll())(fds, n, -1) };
        }
        stats::COUNTERS.io_parks.fetch_add(1, Relaxed);
        fiber::park_until(f, deadline);
        for fd in watched {
            c.unwatch_fd(f, fd);
        }
    }
}

/// select on a fiber, through poll.
pub unsafe fn select(
    f: &Fiber,
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    deadline: Option<u64>,
) -> c_int {
    let mut pfds = Vec::new();
    for fd in 0..nfds.clamp(0, libc::FD_SETSIZE as c_int) {
        let mut ev = 0;
        // SAFETY: caller's fd_sets (null allowed).
        unsafe {
            if !r.is_null() && libc::FD_ISSET(fd, r) {
                ev |= libc::POLLIN;
            }
            if !w.is_null() && libc::FD_ISSET(fd, w) {
                ev |= libc::POLLOUT;
            }
            if !e.is_null() && libc::FD_ISSET(fd, e) {
                ev |= libc::POLLPRI;
            }
        }
        if ev != 0 {
            pfds.push(libc::pollfd {
                fd,
                events: ev,
                revents: 0,
            });
        }
    }
    // SAFETY: pfds is a local array of pfds.len() entries.
    let n = unsafe { poll(f, pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, deadline) };
    if n < 0 {
        return n;
    }
    // SAFETY: caller's fd_sets.
    unsafe {
        for s in [r, w, e] {
            if !s.is_null() {
                libc::FD_ZERO(s);
            }
        }
        let mut count = 0;
        for p in &pfds {
            if p.revents & libc::POLLNVAL != 0 {
                real::set_errno(libc::EBADF);
                return -1;
            }
            let rd = p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
            let wr = p.revents & (libc::POLLOUT | libc::POLLERR) != 0;
            let ex = p.revents & libc::POLLPRI != 0;
            if rd && !r.is_null() && p.events & libc::POLLIN != 0 {
                libc::FD_SET(p.fd, r);
                count += 1;
            }
            if wr && !w.is_null() && p.events & libc::POLLOUT != 0 {
                libc::FD_SET(p.fd, w);
                count += 1;
            }
            if ex && !e.is_null() && p.events & libc::POLLPRI != 0 {
                libc::FD_SET(p.fd, e);
                count += 1;
            }
        }
        count
    }
}

/// The sleep family on a fiber: park until the deadline.
pub fn sleep_until(f: &Fiber, deadline: u64) {
    while !fiber::park_until(f, Some(deadline)) {}
}

/// epoll_wait on a fiber (a thread-per-connection server with its own epoll set): the
/// epoll fd is itself pollable, so park on it.
pub unsafe fn epoll_wait(
    f: &Fiber,
    ep: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    deadline: Option<u64>,
) -> c_int {
    loop {
        // SAFETY: the caller's evs has room for max events.
        let r = unsafe { (real::epoll_wait())(ep, evs, max, 0) };
        if r != 0 || deadline.is_some_and(|d| time::now_ns() >= d) {
            return r;
        }
        match wait_fd(f, ep, IN, deadline) {
            Ok(_) => {}
            Err(_) => {
                let ms = deadline.map_or(-1, |d| {
                    (d.saturating_sub(time::now_ns()) / 1_000_000) as c_int
                });
                // SAFETY: the caller's evs has room for max events.
                return unsafe { (real::epoll_wait())(ep, evs, max, ms) };
            }
        }
    }
}
