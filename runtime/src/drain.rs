//! Knowing that a TCP socket is empty without asking it again.
//!
//! A request-response connection on a fiber reads its request, answers, and reads
//! again: that read finds nothing (the peer is still reading the answer), says
//! EAGAIN, and the fiber parks. One syscall in three of such a server is that EAGAIN.
//!
//! TCP_INQ (Linux 4.18) makes each recvmsg report, in a control message, how many
//! bytes it left queued. A read that left none marks the socket drained (fd_facts),
//! and the next blocking read on it parks at once instead of asking. That is safe
//! because the socket is in this carrier's epoll, edge-triggered: any byte that
//! arrives after the read raises an event, and the carrier clears the mark on every
//! event for the fd, waiter or not (carrier::on_fd_event), on the same thread that
//! reads, so the mark can never outlive data it did not see. A read that filled its
//! buffer exactly and left bytes queued (a pipelined request) is not marked.
//!
//! The option belongs to the socket, so the application would see the TCP_CM_INQ
//! message in its own recvmsg with a control buffer: the interposed recvmsg turns it
//! off for good on that socket first. Not covered, so TOFFLOAD_TCP_INQ=off is for
//! them: a socket handed on to an exec'd program that reads control messages on it,
//! and control messages read with recvmmsg or io_uring (neither is interposed).

use crate::{fd_facts, real};
use libc::{c_int, c_void};

/// The TCP_INQ socket option and its control message type (linux/tcp.h; libc does
/// not export them).
const TCP_INQ: c_int = 36;
const TCP_CM_INQ: c_int = TCP_INQ;

/// Whether TCP_INQ is in use at all (TOFFLOAD_TCP_INQ).
fn enabled() -> bool {
    crate::settings().tcp_inq
}

/// A read of `fd` on carrier `carrier` may park without asking: the last read left the
/// socket empty, no event came since, this carrier's epoll watches it, and the
/// application did not make it non-blocking (that read must ask, and say EAGAIN).
pub fn parks_first(fd: c_int, carrier: usize) -> bool {
    fd_facts::drained(fd) && fd_facts::registered(fd, carrier) && !fd_facts::nonblocking(fd)
}

/// recv(fd, buf, n, MSG_DONTWAIT) that also learns whether it left the socket empty.
///
/// # Safety
/// `buf` is writable for `n` bytes.
pub unsafe fn recv(fd: c_int, buf: *mut c_void, n: usize) -> isize {
    match fd_facts::inq(fd) {
        fd_facts::Inq::On => {}
        fd_facts::Inq::Off => {
            // SAFETY: the caller's buf of n bytes.
            return unsafe { (real::recv())(fd, buf, n, libc::MSG_DONTWAIT) };
        }
        fd_facts::Inq::Unknown => {
            // SAFETY: the caller's buf of n bytes.
            let r = unsafe { (real::recv())(fd, buf, n, libc::MSG_DONTWAIT) };
            if r >= 0 || real::errno() == libc::EAGAIN {
                let e = real::errno();
                turn_on(fd);
                real::set_errno(e);
            }
            return r;
        }
    }
    let mut iov = libc::iovec {
        iov_base: buf,
        iov_len: n,
    };
    // Room for one cmsg with an int: CMSG_SPACE(4) is 24 on 64-bit Linux.
    let mut control = [0u64; 4];
    // SAFETY: msghdr is plain data; all-zero is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut c_void;
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: msg points at the caller's buffer and our control array, both live.
    let r = unsafe { (real::recvmsg())(fd, &mut msg, libc::MSG_DONTWAIT) };
    if r > 0 && left_empty(&msg) {
        fd_facts::set_drained(fd);
    }
    r
}

/// True when the TCP_CM_INQ message of `msg` says nothing is left queued (and, under
/// TOFFLOAD_TEST_DISABLE=inq, for any read: the hazard of trusting a full read).
fn left_empty(msg: &libc::msghdr) -> bool {
    if crate::settings().disabled.inq {
        return true;
    }
    // SAFETY: msg is a msghdr the kernel just filled; the CMSG walk stays inside
    // msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_TCP && (*c).cmsg_type == TCP_CM_INQ {
                let inq = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const c_int);
                return inq == 0;
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    false
}

/// Asks for TCP_INQ on `fd`, once: On where it is a TCP socket, Off otherwise.
fn turn_on(fd: c_int) {
    if !enabled() {
        fd_facts::set_inq(fd, fd_facts::Inq::Off);
        return;
    }
    let state = if set_option(fd, 1) == 0 {
        fd_facts::Inq::On
    } else {
        fd_facts::Inq::Off
    };
    fd_facts::set_inq(fd, state);
}

/// setsockopt(fd, SOL_TCP, TCP_INQ, on): 0 or -1 with errno.
fn set_option(fd: c_int, on: c_int) -> c_int {
    // SAFETY: an int option, read by the kernel.
    unsafe {
        (real::setsockopt())(
            fd,
            libc::SOL_TCP,
            TCP_INQ,
            &on as *const c_int as *const c_void,
            std::mem::size_of::<c_int>() as libc::socklen_t,
        )
    }
}

/// Before the application's own recvmsg on `fd`: with a control buffer, it must not
/// receive our TCP_CM_INQ message, so the option goes off for good on this socket
/// (unless TOFFLOAD_TEST_DISABLE=inqguard, to show that hazard).
///
/// # Safety
/// `msg` is null or the caller's readable msghdr.
pub unsafe fn before_app_recvmsg(fd: c_int, msg: *const libc::msghdr) {
    // SAFETY: the caller's msghdr, readable by recvmsg(2)'s contract.
    if msg.is_null() || unsafe { (*msg).msg_controllen } == 0 {
        return;
    }
    match fd_facts::inq(fd) {
        fd_facts::Inq::Off => {}
        fd_facts::Inq::Unknown => fd_facts::set_inq(fd, fd_facts::Inq::Off),
        fd_facts::Inq::On => {
            if crate::settings().disabled.inqguard {
                return;
            }
            let e = real::errno();
            set_option(fd, 0);
            real::set_errno(e);
            fd_facts::set_inq(fd, fd_facts::Inq::Off);
        }
    }
}
