//! The C ABI (`include/toffload_accel.h`). One process-wide device, chosen by
//! TOFFLOAD_BACKEND; knobs are checked when the library loads, so a malformed one is
//! reported at start-up, and every call then fails with -EINVAL rather than guessing.
//! The device itself starts on first use and again in a forked child, whose copy of
//! the device thread does not exist. With TOFFLOAD_BACKEND=cuda the device starts at
//! load, so a machine without a GPU is reported at start-up and every call then fails
//! with -ENODEV (a CUDA context does not survive fork: a forked child that uses the
//! cuda backend starts again, and gets the driver's error, reported once).

use crate::config::{self, BackendKind, WaitStyle};
use crate::cuda::{Cuda, CudaConfig};
use crate::remote::{Remote, RemoteConfig};
use crate::{AccelError, Accelerator, EmuConfig, Emulated, OpId, OpState};
use std::ffi::{c_int, c_long};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU8, Ordering::*};

const UNINIT: u8 = 0;
const STARTING: u8 = 1;
const READY: u8 = 2;
const UNUSABLE: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static DEVICE: AtomicPtr<Box<dyn Accelerator>> = AtomicPtr::new(std::ptr::null_mut());
static WAIT_BLOCK: AtomicU8 = AtomicU8::new(0);
/// What every call returns once the backend is unusable (EINVAL: a malformed knob).
static UNUSABLE_ERRNO: AtomicI32 = AtomicI32::new(libc::EINVAL);

struct Settings {
    backend: BackendKind,
    wait: WaitStyle,
    emu: EmuConfig,
    cuda: CudaConfig,
    remote: RemoteConfig,
}

fn settings() -> Result<Settings, config::ConfigError> {
    let get = &config::from_env;
    let s = Settings {
        backend: config::backend(get)?,
        wait: config::wait_style(get)?,
        emu: EmuConfig::from_env()?,
        cuda: CudaConfig::from_env()?,
        remote: RemoteConfig::from_env()?,
    };
    if s.backend == BackendKind::Remote && s.remote.endpoints.is_empty() {
        return Err(config::ConfigError {
            var: crate::knobs::REMOTE.var,
            value: String::new(),
            expected: "host:port[,host:port...] (required with TOFFLOAD_BACKEND=remote)",
        });
    }
    Ok(s)
}

fn unusable(why: &dyn std::fmt::Display, errno: i32) {
    let name = match errno {
        libc::ENODEV => "ENODEV",
        libc::ENOMEM => "ENOMEM",
        libc::EIO => "EIO",
        _ => "EINVAL",
    };
    UNUSABLE_ERRNO.store(errno, Release);
    // stderr only: the library lives inside other people's servers.
    eprintln!("toffload_accel: {why}; every accelerator call will fail with {name}");
    STATE.store(UNUSABLE, Release);
}

fn unusable_error() -> AccelError {
    match UNUSABLE_ERRNO.load(Acquire) {
        libc::ENODEV => AccelError::NoDevice,
        libc::ENOMEM => AccelError::OutOfMemory,
        libc::EIO => AccelError::DeviceFault,
        _ => AccelError::Unusable,
    }
}

/// Runs at load: validates the knobs, and re-arms initialisation in forked children.
extern "C" fn on_load() {
    match settings() {
        Err(e) => unusable(&e, libc::EINVAL),
        // The cuda device starts now, not on first use: a machine without a GPU is
        // reported at start-up, and the driver's helper threads are created before
        // the server's first accept (under the fiber runtime, threads created after it
        // become fibers, and a driver thread must not).
        Ok(s) if s.backend == BackendKind::Cuda => {
            if STATE
                .compare_exchange(UNINIT, STARTING, AcqRel, Acquire)
                .is_ok()
            {
                start();
            }
        }
        Ok(_) => {}
    }
    extern "C" fn in_child() {
        // The parent's device thread is gone; its table is leaked, and the child
        // starts a device of its own on first use.
        DEVICE.store(std::ptr::null_mut(), Release);
        if STATE.load(Acquire) != UNUSABLE {
            STATE.store(UNINIT, Release);
        }
    }
    // SAFETY: registering a plain extern "C" handler.
    unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
}

#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;

fn device() -> Result<&'static dyn Accelerator, AccelError> {
    loop {
        match STATE.load(Acquire) {
            READY => {
                // SAFETY: set before READY was published, and never freed.
                return Ok(unsafe { &**DEVICE.load(Acquire) });
            }
            UNUSABLE => return Err(unusable_error()),
            UNINIT => {
                if STATE
                    .compare_exchange(UNINIT, STARTING, AcqRel, Acquire)
                    .is_ok()
                {
                    start();
                }
            }
            _ => std::thread::yield_now(),
        }
    }
}

fn start() {
    let s = match settings() {
        Ok(s) => s,
        Err(e) => return unusable(&e, libc::EINVAL),
    };
    WAIT_BLOCK.store((s.wait == WaitStyle::Block) as u8, Relaxed);
    let dev: Box<dyn Accelerator> = match s.backend {
        BackendKind::Emulated => match Emulated::new(s.emu) {
            Ok(d) => Box::new(d),
            Err(e) => {
                return unusable(
                    &format_args!("cannot start the emulated device: {e}"),
                    libc::EINVAL,
                )
            }
        },
        BackendKind::Cuda => match Cuda::new(s.cuda) {
            Ok(d) => Box::new(d),
            Err(e) => return unusable(&format_args!("TOFFLOAD_BACKEND=cuda: {e}"), e.errno()),
        },
        BackendKind::Remote => match Remote::new(s.remote) {
            Ok(d) => Box::new(d),
            Err(e) => return unusable(&format_args!("TOFFLOAD_BACKEND=remote: {e}"), libc::EINVAL),
        },
    };
    DEVICE.store(Box::into_raw(Box::new(dev)), Release);
    STATE.store(READY, Release);
}

/// Runs `f` and maps errors (and, defensively, panics) to a negative errno.
fn guarded<T>(f: impl FnOnce() -> Result<T, AccelError>, ok: impl FnOnce(T) -> i64) -> i64 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => ok(v),
        Ok(Err(e)) => -(e.errno() as i64),
        Err(_) => -(libc::EIO as i64),
    }
}

fn length(n: c_int) -> Result<usize, AccelError> {
    usize::try_from(n).map_err(|_| AccelError::BadLength)
}

/// # Safety
/// `buf[0..n)` must stay valid until the operation is done or released.
#[no_mangle]
pub unsafe extern "C" fn accel_submit(buf: *mut u8, n: c_int) -> c_long {
    guarded(
        || {
            let len = length(n)?;
            // SAFETY: forwarded caller contract.
            unsafe { device()?.submit(buf, len) }
        },
        |id| id.0,
    ) as c_long
}

/// # Safety
/// As accel_submit; `due_ns` is null or points to a writable i64.
#[no_mangle]
pub unsafe extern "C" fn accel_submit_polled(buf: *mut u8, n: c_int, due_ns: *mut i64) -> c_long {
    guarded(
        || {
            let len = length(n)?;
            // SAFETY: forwarded caller contract.
            let (id, due) = unsafe { device()?.submit_polled(buf, len)? };
            if !due_ns.is_null() {
                // SAFETY: caller contract: null or writable.
                unsafe { *due_ns = due.min(i64::MAX as u64) as i64 };
            }
            Ok(id)
        },
        |id| id.0,
    ) as c_long
}

#[no_mangle]
pub extern "C" fn accel_done(id: c_long) -> c_int {
    guarded(|| device()?.done(OpId(id)), |s| (s == OpState::Done) as i64) as c_int
}

#[no_mangle]
pub extern "C" fn accel_release(id: c_long) -> c_int {
    guarded(|| device()?.release(OpId(id)), |_| 0) as c_int
}

/// # Safety
/// `buf[0..n)` must be valid for the duration of the call.
#[no_mangle]
pub unsafe extern "C" fn accel_run(buf: *mut u8, n: c_int) -> c_int {
    guarded(
        || {
            let len = length(n)?;
            if buf.is_null() && len > 0 {
                return Err(AccelError::NullBuffer);
            }
            let dev = device()?;
            let slice = if len == 0 {
                &mut [][..]
            } else {
                // SAFETY: caller contract.
                unsafe { std::slice::from_raw_parts_mut(buf, len) }
            };
            let style = if WAIT_BLOCK.load(Relaxed) == 1 {
                WaitStyle::Block
            } else {
                WaitStyle::Spin
            };
            dev.run(slice, style)
        },
        |_| 0,
    ) as c_int
}

#[no_mangle]
pub extern "C" fn accel_completion_fd() -> c_int {
    guarded(|| Ok(device()?.completion_fd()), |fd| fd as i64) as c_int
}
