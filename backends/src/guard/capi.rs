//! The guard's C ABI (toffload_accel.h, "the conflict guard"). Every call returns 0 or
//! a negative errno and never unwinds into C.

use super::Stats;
use libc::{c_int, c_void};

fn code(r: std::thread::Result<Result<c_int, c_int>>) -> c_int {
    match r {
        Ok(Ok(v)) | Ok(Err(v)) => v,
        Err(_) => -libc::EIO,
    }
}

fn call(f: impl FnOnce() -> Result<c_int, c_int>) -> c_int {
    code(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)))
}

#[no_mangle]
pub extern "C" fn toffload_guard_mode() -> c_int {
    match super::mode() {
        Ok(m) => m as c_int,
        Err(_) => -libc::EINVAL,
    }
}

#[no_mangle]
pub extern "C" fn toffload_guard_register(ptr: *mut c_void, len: usize) -> c_int {
    call(|| super::register(ptr as usize, len).map(|()| 0))
}

#[no_mangle]
pub extern "C" fn toffload_guard_begin(token: u64, retry: *mut c_void) -> c_int {
    call(|| super::begin(token, retry as usize).map(|()| 0))
}

#[no_mangle]
pub extern "C" fn toffload_guard_park(token: u64) -> c_int {
    call(|| super::park(token).map(|()| 0))
}

#[no_mangle]
pub extern "C" fn toffload_guard_resume(token: u64) -> c_int {
    call(|| super::resume(token).map(|()| 0))
}

#[no_mangle]
pub extern "C" fn toffload_guard_end(token: u64) -> c_int {
    call(|| super::end(token).map(|n| n.min(c_int::MAX as usize) as c_int))
}

/// # Safety
/// `out` must be null or point to a writable struct toffload_guard_stats.
#[no_mangle]
pub unsafe extern "C" fn toffload_guard_stats(out: *mut Stats) -> c_int {
    if out.is_null() {
        return -libc::EFAULT;
    }
    call(|| {
        let s = super::stats();
        // SAFETY: the caller's struct (our contract).
        unsafe { out.write(s) };
        Ok(0)
    })
}
