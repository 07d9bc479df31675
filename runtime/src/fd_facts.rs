//! What the runtime has learnt about each socket fd, so that a read that waits does
//! not ask the kernel again on every wait: whether the application made it
//! non-blocking (F_GETFL), its SO_RCVTIMEO / SO_SNDTIMEO, which carrier's epoll
//! already watches it, and whether its last read left it empty (drain.rs). Each fact is learnt on first use and forgotten by the calls
//! that change it, all interposed: fcntl/fcntl64 (F_SETFL, F_DUPFD), ioctl
//! (FIONBIO), setsockopt (the timeouts), close, dup/dup2/dup3, socket, socketpair,
//! accept/accept4; a fork starts a new epoch (the child's carriers have new epolls).
//!
//! A close the runtime does not see (glibc's own, as in fclose, or a raw syscall)
//! followed by a new fd of the same number from a creator it does not see could
//! leave a stale fact. Two guards: the facts are used only on the socket path (pipes
//! and other fds ask every time), and a wait that relies on a remembered epoll
//! registration re-registers once after a short while, so a stale registration
//! costs that delay, never a hang.

use libc::c_int;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};

/// Fds above this are not remembered (asked every time, as before).
pub(crate) const MAX_FD: usize = 1 << 16;

/// Per fd: bits 0-1 the O_NONBLOCK fact, bits 2-3 the TCP_INQ state, bit 4 drained
/// (the last read left it empty, no event since), bits 8-15 the carrier (index + 1)
/// whose epoll watches it, bits 32-63 the epoch of that registration.
static WORD: [AtomicU64; MAX_FD] = [const { AtomicU64::new(0) }; MAX_FD];
/// Per fd: SO_RCVTIMEO and SO_SNDTIMEO in microseconds, plus one (0: not known).
static RCVTIMEO: [AtomicU64; MAX_FD] = [const { AtomicU64::new(0) }; MAX_FD];
static SNDTIMEO: [AtomicU64; MAX_FD] = [const { AtomicU64::new(0) }; MAX_FD];
/// Bumped in a forked child: every remembered registration is then stale.
static EPOCH: AtomicU32 = AtomicU32::new(1);
/// False only under TOFFLOAD_TEST_DISABLE=fdfacts: the interposed calls then leave
/// the facts alone, to show what a stale fact does. Read in close() and the like,
/// which may run in a signal handler or before the settings exist, so not a setting.
static INVALIDATE: AtomicBool = AtomicBool::new(true);

/// At load: whether the interposed calls forget what they change.
pub fn set_invalidate(on: bool) {
    INVALIDATE.store(on, Relaxed);
}

fn invalidating() -> bool {
    INVALIDATE.load(Relaxed)
}

const NB_MASK: u64 = 0b11;
const NB_BLOCKING: u64 = 1;
const NB_NONBLOCKING: u64 = 2;
const INQ_SHIFT: u32 = 2;
const INQ_MASK: u64 = 0b11 << INQ_SHIFT;
const DRAINED: u64 = 1 << 4;
const REG_SHIFT: u32 = 8;
const REG_MASK: u64 = 0xff << REG_SHIFT;

pub(crate) fn slot(fd: c_int) -> Option<usize> {
    let i = usize::try_from(fd).ok()?;
    (i < MAX_FD).then_some(i)
}

fn update(i: usize, f: impl Fn(u64) -> u64) {
    let _ = WORD[i].fetch_update(AcqRel, Acquire, |w| Some(f(w)));
}

/// Whether the application made `fd` non-blocking (remembered; F_GETFL once).
pub fn nonblocking(fd: c_int) -> bool {
    let Some(i) = slot(fd) else {
        return get_fl_nonblocking(fd);
    };
    match WORD[i].load(Acquire) & NB_MASK {
        NB_BLOCKING => false,
        NB_NONBLOCKING => true,
        _ => {
            let nb = get_fl_nonblocking(fd);
            set_nonblocking(fd, nb);
            nb
        }
    }
}

fn get_fl_nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL has no side effects.
    let fl = unsafe { (crate::real::fcntl())(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// The application set (or cleared) O_NONBLOCK on `fd`.
pub fn set_nonblocking(fd: c_int, nb: bool) {
    if let Some(i) = slot(fd) {
        let v = if nb { NB_NONBLOCKING } else { NB_BLOCKING };
        update(i, |w| (w & !NB_MASK) | v);
    }
}

/// The socket's SO_RCVTIMEO (`out` false) or SO_SNDTIMEO, in microseconds; 0 for
/// none. Remembered; getsockopt once.
pub fn timeout_us(fd: c_int, out: bool) -> u64 {
    let cell = slot(fd).map(|i| if out { &SNDTIMEO[i] } else { &RCVTIMEO[i] });
    if let Some(v) = cell.map(|c| c.load(Acquire)).filter(|v| *v != 0) {
        return v - 1;
    }
    let us = get_timeout_us(fd, out);
    if let Some(c) = cell {
        c.store(us + 1, Release);
    }
    us
}

fn get_timeout_us(fd: c_int, out: bool) -> u64 {
    let opt = if out {
        libc::SO_SNDTIMEO
    } else {
        libc::SO_RCVTIMEO
    };
    let mut tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let mut len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: a valid out-buffer for a timeval option.
    let r = unsafe {
        (crate::real::getsockopt())(
            fd,
            libc::SOL_SOCKET,
            opt,
            &mut tv as *mut libc::timeval as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 || tv.tv_sec < 0 || tv.tv_usec < 0 {
        return 0;
    }
    tv.tv_sec as u64 * 1_000_000 + tv.tv_usec as u64
}

/// A setsockopt on `fd` changed (or may have changed) its timeouts.
pub fn forget_timeouts(fd: c_int) {
    if let Some(i) = slot(fd) {
        RCVTIMEO[i].store(0, Release);
        SNDTIMEO[i].store(0, Release);
    }
}

/// True when carrier `carrier`'s epoll is known to watch `fd` (this epoch).
pub fn registered(fd: c_int, carrier: usize) -> bool {
    let Some(i) = slot(fd) else { return false };
    let w = WORD[i].load(Acquire);
    (w & REG_MASK) >> REG_SHIFT == carrier as u64 + 1 && (w >> 32) as u32 == EPOCH.load(Acquire)
}

/// Carrier `carrier`'s epoll now watches `fd`.
pub fn set_registered(fd: c_int, carrier: usize) {
    let Some(i) = slot(fd) else { return };
    if carrier >= 0xff {
        return;
    }
    let epoch = EPOCH.load(Acquire) as u64;
    update(i, |w| {
        (w & (NB_MASK | INQ_MASK)) | ((carrier as u64 + 1) << REG_SHIFT) | (epoch << 32)
    });
}

/// Whether TCP_INQ is on for a socket (drain.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inq {
    /// Not tried yet.
    Unknown,
    /// On: its reads learn whether they left it empty.
    On,
    /// Not a TCP socket, turned off for the application's control messages, or
    /// TOFFLOAD_TCP_INQ=off.
    Off,
}

/// `fd`'s TCP_INQ state; Off for fds that are not remembered.
pub fn inq(fd: c_int) -> Inq {
    let Some(i) = slot(fd) else { return Inq::Off };
    match (WORD[i].load(Acquire) & INQ_MASK) >> INQ_SHIFT {
        0 => Inq::Unknown,
        1 => Inq::On,
        _ => Inq::Off,
    }
}

pub fn set_inq(fd: c_int, state: Inq) {
    if let Some(i) = slot(fd) {
        let v = match state {
            Inq::Unknown => 0,
            Inq::On => 1,
            Inq::Off => 2,
        } << INQ_SHIFT;
        update(i, |w| (w & !(INQ_MASK | DRAINED)) | v);
    }
}

/// Whether `fd`'s last read left it empty, with no event for it since.
pub fn drained(fd: c_int) -> bool {
    slot(fd).is_some_and(|i| WORD[i].load(Acquire) & DRAINED != 0)
}

/// `fd`'s last read left it empty.
pub fn set_drained(fd: c_int) {
    if let Some(i) = slot(fd) {
        WORD[i].fetch_or(DRAINED, AcqRel);
    }
}

/// An event came for `fd`: it may hold data again.
#[inline]
pub fn clear_drained(fd: c_int) {
    if let Some(i) = slot(fd) {
        if WORD[i].load(Relaxed) & DRAINED != 0 {
            WORD[i].fetch_and(!DRAINED, AcqRel);
        }
    }
}

/// `fd` was closed, or is a new file: nothing about it is known.
pub fn forget(fd: c_int) {
    // An open request is dropped whatever the test switch says (it is not a fact
    // the switch is about).
    crate::latency::forget(fd);
    if !invalidating() {
        return;
    }
    if let Some(i) = slot(fd) {
        WORD[i].store(0, Release);
        RCVTIMEO[i].store(0, Release);
        SNDTIMEO[i].store(0, Release);
    }
}

/// In a forked child: the carriers' epolls are new, so no registration holds.
pub fn new_epoch() {
    EPOCH.fetch_add(1, AcqRel);
}

/// After the interposed fcntl returned `ret`.
pub fn after_fcntl(fd: c_int, cmd: c_int, arg: usize, ret: c_int) {
    if ret < 0 || !invalidating() {
        return;
    }
    match cmd {
        libc::F_SETFL => set_nonblocking(fd, arg as c_int & libc::O_NONBLOCK != 0),
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => forget(ret),
        _ => {}
    }
}

/// After the interposed ioctl returned `ret`.
///
/// # Safety
/// `arg` is the caller's third argument, an `int *` for FIONBIO.
pub unsafe fn after_ioctl(fd: c_int, req: u64, arg: usize, ret: c_int) {
    if ret == 0 && req == libc::FIONBIO && arg != 0 && invalidating() {
        // SAFETY: FIONBIO's argument is an int the kernel just read.
        set_nonblocking(fd, unsafe { *(arg as *const c_int) } != 0);
    }
}

/// After the interposed setsockopt returned `ret`.
pub fn after_setsockopt(fd: c_int, level: c_int, opt: c_int, ret: c_int) {
    // SO_RCVTIMEO_NEW / SO_SNDTIMEO_NEW (66, 67) as well as the classic ones.
    if ret == 0
        && invalidating()
        && level == libc::SOL_SOCKET
        && matches!(opt, libc::SO_RCVTIMEO | libc::SO_SNDTIMEO | 66 | 67)
    {
        forget_timeouts(fd);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_are_learnt_then_forgotten() {
        let (a, b) = {
            let mut sv = [0; 2];
            assert_eq!(
                // SAFETY: a valid out-array of two fds.
                unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, sv.as_mut_ptr()) },
                0
            );
            (sv[0], sv[1])
        };
        forget(a);
        assert!(!nonblocking(a));
        // Learnt: a change the runtime did not see is not noticed...
        // SAFETY: plain fcntl on our own socket.
        unsafe { libc::fcntl(a, libc::F_SETFL, libc::O_NONBLOCK) };
        assert!(!nonblocking(a));
        // ...and one it saw is.
        after_fcntl(a, libc::F_SETFL, libc::O_NONBLOCK as usize, 0);
        assert!(nonblocking(a));
        forget(a);
        assert!(nonblocking(a), "asked again after forget");

        assert_eq!(timeout_us(a, false), 0);
        let tv = libc::timeval {
            tv_sec: 1,
            tv_usec: 500,
        };
        // SAFETY: a valid timeval option.
        unsafe {
            libc::setsockopt(
                a,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const libc::timeval as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        assert_eq!(timeout_us(a, false), 0, "remembered");
        after_setsockopt(a, libc::SOL_SOCKET, libc::SO_RCVTIMEO, 0);
        // The kernel keeps it in jiffies: 1.0005 s reads back rounded up to a tick.
        let us = timeout_us(a, false);
        assert!((1_000_500..1_011_000).contains(&us), "{us}");
        assert_eq!(timeout_us(a, true), 0);

        assert!(!registered(a, 0));
        set_registered(a, 0);
        assert!(registered(a, 0) && !registered(a, 1));
        assert!(nonblocking(a), "the registration keeps the flag fact");
        new_epoch();
        assert!(!registered(a, 0), "a fork's child has new epolls");
        set_registered(a, 3);
        forget(a);
        assert!(!registered(a, 3));
        // SAFETY: our own fds.
        unsafe {
            libc::close(a);
            libc::close(b);
        }
    }
}
