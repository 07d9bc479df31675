//! Clocks and deadlines. Internally every deadline is CLOCK_MONOTONIC nanoseconds;
//! absolute timeouts on other clocks (pthread_cond_timedwait's CLOCK_REALTIME) are
//! converted once, when the wait starts.

#![allow(clippy::missing_safety_doc)] // C callers' pointers, taken as they come

use libc::{c_int, clockid_t, timespec};

fn clock_ns(clock: clockid_t) -> u64 {
    let mut ts = timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; the vDSO makes this cheap.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[inline]
pub fn now_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// A timespec as ns; None if it is invalid (EINVAL for the caller).
pub fn ts_ns(ts: &timespec) -> Option<u64> {
    if ts.tv_sec < 0 || !(0..1_000_000_000).contains(&ts.tv_nsec) {
        return None;
    }
    Some(
        (ts.tv_sec as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(ts.tv_nsec as u64),
    )
}

/// Monotonic deadline for an absolute time on `clock`. Err(EINVAL) for a bad timespec
/// or clock.
pub unsafe fn abs_deadline(clock: clockid_t, ts: *const timespec) -> Result<u64, c_int> {
    if ts.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: non-null pointer from the caller.
    let abs = ts_ns(unsafe { &*ts }).ok_or(libc::EINVAL)?;
    match clock {
        libc::CLOCK_MONOTONIC => Ok(abs),
        libc::CLOCK_REALTIME | libc::CLOCK_TAI | libc::CLOCK_BOOTTIME => {
            let now = clock_ns(clock);
            Ok(now_ns().saturating_add(abs.saturating_sub(now)))
        }
        _ => Err(libc::EINVAL),
    }
}

/// Monotonic deadline `rel` from now.
pub unsafe fn rel_deadline(ts: *const timespec) -> Result<u64, c_int> {
    if ts.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: non-null pointer from the caller.
    let rel = ts_ns(unsafe { &*ts }).ok_or(libc::EINVAL)?;
    Ok(now_ns().saturating_add(rel))
}

pub fn to_timespec(ns: u64) -> timespec {
    timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines() {
        let bad = timespec {
            tv_sec: 1,
            tv_nsec: 2_000_000_000,
        };
        // SAFETY: a local timespec.
        assert_eq!(unsafe { rel_deadline(&bad) }, Err(libc::EINVAL));
        let ten_ms = timespec {
            tv_sec: 0,
            tv_nsec: 10_000_000,
        };
        // SAFETY: a local timespec.
        let d = unsafe { rel_deadline(&ten_ms) }.unwrap();
        let now = now_ns();
        assert!(d > now && d <= now + 10_000_000);
        // An absolute realtime deadline 10 ms ahead maps about 10 ms ahead.
        let rt = clock_ns(libc::CLOCK_REALTIME) + 10_000_000;
        let abs = to_timespec(rt);
        // SAFETY: a local timespec.
        let d = unsafe { abs_deadline(libc::CLOCK_REALTIME, &abs) }.unwrap();
        let now = now_ns();
        assert!(d > now + 5_000_000 && d <= now + 10_000_000, "{}", d - now);
        // SAFETY: a local timespec.
        assert_eq!(unsafe { abs_deadline(12345, &abs) }, Err(libc::EINVAL));
    }
}
