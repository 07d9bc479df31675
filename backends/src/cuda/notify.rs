//! The completion notifier: an eventfd that a host function, queued on the stream
//! behind each operation's copy back, writes when the operation completes. The CUDA
//! driver runs host functions on its own thread once the stream reaches them, so no
//! thread of ours polls or spins to learn about completions.

use super::driver::{check, CuError};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

pub struct Notifier {
    fd: OwnedFd,
}

impl Notifier {
    pub fn new() -> io::Result<Notifier> {
        // SAFETY: plain eventfd creation; result checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Notifier {
            // SAFETY: a fresh fd we own.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Makes the fd readable. EAGAIN (counter saturated) is harmless: it is readable.
    pub fn signal(&self) {
        let one = 1u64;
        // SAFETY: an 8-byte write to our own eventfd.
        unsafe { libc::write(self.fd(), &one as *const u64 as *const c_void, 8) };
    }
}

type Callback = Box<dyn FnOnce() + Send>;

unsafe extern "C" fn trampoline(user: *mut c_void) {
    // SAFETY: `user` is the Box<Callback> leaked by `after`, called exactly once.
    let f: Box<Callback> = unsafe { Box::from_raw(user as *mut Callback) };
    // Never unwind into the driver's thread.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        std::process::abort();
    }
}

/// Queues `f` on `stream`, to run once everything queued before it has completed.
/// `f` must not call CUDA (a host function may not).
///
/// # Safety
/// The context must be current and `stream` live.
pub unsafe fn after(stream: sys::CUstream, f: Callback) -> Result<(), CuError> {
    let user = Box::into_raw(Box::new(f)) as *mut c_void;
    // SAFETY: context current and stream live (our contract); trampoline takes user,
    // a leaked Box<Callback>, and the driver calls it at most once.
    let r = unsafe { sys::cuLaunchHostFunc(stream, Some(trampoline), user) };
    if let Err(e) = check(r, "queueing the completion callback (cuLaunchHostFunc)") {
        // Not queued: reclaim it without running it.
        // SAFETY: the driver refused it, so trampoline will never take user: ours again.
        drop(unsafe { Box::from_raw(user as *mut Callback) });
        return Err(e);
    }
    Ok(())
}
