//! toffload's accelerator API.
//!
//! An operation transforms a caller's buffer in place and completes later; callers
//! submit, poll or wait, and release. The same API is exported as a C ABI
//! (`libtoffload_accel.so`, header `include/toffload_accel.h`) because the servers that
//! toffload targets are C programs and the fiber runtime reroutes their blocking
//! `accel_run` into `accel_submit` + yield + `accel_done`.

pub mod capi;
pub mod config;
pub mod cuda;
pub mod emulated;
mod error;
mod futex;
pub mod guard;

/// What runtime/src/guard/uffd.rs (compiled into guard/ too) calls `crate::real`.
mod real {
    pub fn errno() -> libc::c_int {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }
}
pub mod knobs;
pub mod remote;
mod slots;

pub use config::{BackendKind, ConfigError, WaitStyle};
pub use emulated::{DeviceStats, EmuConfig, Emulated};
pub use error::AccelError;
pub use remote::{Remote, RemoteConfig};

use std::os::fd::RawFd;

/// A handle to one in-flight operation. Handles carry a generation, so a stale or
/// released handle is recognised instead of aliasing a newer operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpId(pub i64);

/// Where an operation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpState {
    Pending,
    Done,
}

/// An accelerator backend. Implementations must be cheap to poll from many threads.
pub trait Accelerator: Send + Sync {
    /// Starts an in-place transform of `len` bytes at `buf`. Never blocks.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and unaliased by writers until the operation is
    /// done or released.
    unsafe fn submit(&self, buf: *mut u8, len: usize) -> Result<OpId, AccelError>;

    /// Starts an operation whose caller will find it done by polling (`done`), as a
    /// real device's completion record is found: the device raises no completion
    /// signal for it (`completion_fd`) and spends no wake-up on it. Returns the handle
    /// and when the operation will be done (CLOCK_MONOTONIC ns), so that a poller
    /// that has nothing else to do sleeps until then. `wait` works on it too.
    /// Backends that only signal completions return `NotSupported`.
    ///
    /// # Safety
    /// As `submit`.
    unsafe fn submit_polled(&self, buf: *mut u8, len: usize) -> Result<(OpId, u64), AccelError> {
        let _ = (buf, len);
        Err(AccelError::NotSupported)
    }

    /// Polls an operation without blocking.
    fn done(&self, id: OpId) -> Result<OpState, AccelError>;

    /// Sleeps until the operation completes (or fails).
    fn wait(&self, id: OpId) -> Result<(), AccelError>;

    /// Frees the handle; a pending operation is cancelled and its buffer no longer
    /// touched once this returns.
    fn release(&self, id: OpId) -> Result<(), AccelError>;

    /// An eventfd that becomes readable whenever any operation completes.
    fn completion_fd(&self) -> RawFd;

    /// Blocking transform, the call applications make: submit, wait as `style` says,
    /// release.
    fn run(&self, buf: &mut [u8], style: WaitStyle) -> Result<(), AccelError> {
        // SAFETY: `buf` is borrowed mutably until we release below.
        let id = unsafe { self.submit(buf.as_mut_ptr(), buf.len())? };
        let waited = match style {
            WaitStyle::Spin => loop {
                match self.done(id) {
                    Ok(OpState::Done) => break Ok(()),
                    Ok(OpState::Pending) => std::hint::spin_loop(),
                    Err(e) => break Err(e),
                }
            },
            WaitStyle::Block => self.wait(id),
        };
        let released = self.release(id);
        waited.and(released)
    }
}
