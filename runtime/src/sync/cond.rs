//! Condition variables. glibc ships two ABIs (GLIBC_2.2.5, the old layout, and
//! GLIBC_2.3.2); csrc/versioned.c exports our entry points at both versions and each
//! passes its ABI here, so the real function we fall back to is always the matching one
//! (mixing them corrupts the object: the trap the paper hit with MariaDB).
//!
//! Before any fiber exists, and for process-shared condition variables, everything
//! passes through. Once the runtime is engaged, waits are ours, for real threads too:
//! glibc's pthread_cond_wait releases the mutex internally, where our unlock never sees
//! it, and a fiber parked on that mutex would never be woken. Our waiters queue by
//! address (layout-independent, so one implementation serves both ABIs); signal and
//! broadcast wake ours and then fall through to glibc for any real thread that was
//! already waiting inside it before we engaged.

#![allow(clippy::missing_safety_doc)] // C callers' pointers, taken as they come

use super::{mutex, COND_WAITERS};
use crate::fiber;
use crate::waitq::{futex_wait, Slot};
use crate::{real, time};
use libc::{c_int, c_void, clockid_t, pthread_mutex_t, timespec};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Abi {
    V2_2_5,
    V2_3_2,
}

// __wrefs (offset 36 of the 2.3.2 layout): bit 0 process-shared, bit 1 CLOCK_MONOTONIC.
fn wrefs(c: *mut c_void) -> u32 {
    // SAFETY: a 2.3.2 pthread_cond_t is 48 bytes; we only read.
    unsafe { std::ptr::read_volatile((c as *const u8).add(36) as *const u32) }
}

fn ours(abi: Abi, c: *mut c_void) -> bool {
    crate::engaged()
        && !crate::settings().disabled.sync
        && !(abi == Abi::V2_3_2 && wrefs(c) & 1 != 0)
}

fn clock_of(abi: Abi, c: *mut c_void) -> clockid_t {
    if abi == Abi::V2_3_2 && wrefs(c) & 2 != 0 {
        libc::CLOCK_MONOTONIC
    } else {
        libc::CLOCK_REALTIME
    }
}

pub unsafe fn init(abi: Abi, c: *mut c_void, attr: *const c_void) -> c_int {
    // SAFETY: forwarding the caller's arguments to the matching ABI.
    unsafe {
        match abi {
            Abi::V2_2_5 => (real::cond_init_225())(c, attr),
            Abi::V2_3_2 => (real::cond_init_232())(c, attr),
        }
    }
}

pub unsafe fn destroy(abi: Abi, c: *mut c_void) -> c_int {
    // SAFETY: as above.
    unsafe {
        match abi {
            Abi::V2_2_5 => (real::cond_destroy_225())(c),
            Abi::V2_3_2 => (real::cond_destroy_232())(c),
        }
    }
}

pub unsafe fn signal(abi: Abi, c: *mut c_void) -> c_int {
    if ours(abi, c) && COND_WAITERS.wake_one(c as usize) {
        return 0;
    }
    // SAFETY: as above.
    unsafe {
        match abi {
            Abi::V2_2_5 => (real::cond_signal_225())(c),
            Abi::V2_3_2 => (real::cond_signal_232())(c),
        }
    }
}

pub unsafe fn broadcast(abi: Abi, c: *mut c_void) -> c_int {
    if ours(abi, c) {
        COND_WAITERS.wake_all(c as usize);
    }
    // SAFETY: as above.
    unsafe {
        match abi {
            Abi::V2_2_5 => (real::cond_broadcast_225())(c),
            Abi::V2_3_2 => (real::cond_broadcast_232())(c),
        }
    }
}

/// Absolute timeout of a timed wait: the clock (None = the cond's own) and the time.
pub type Timeout = Option<(Option<clockid_t>, *const timespec)>;

pub unsafe fn wait(abi: Abi, c: *mut c_void, m: *mut pthread_mutex_t, timeout: Timeout) -> c_int {
    if !ours(abi, c) {
        return real_wait(abi, c, m, timeout);
    }
    let deadline = match timeout {
        None => None,
        Some((clock, ts)) => {
            // SAFETY: ts is the caller's timespec (non-null for a timed wait).
            match unsafe { time::abs_deadline(clock.unwrap_or_else(|| clock_of(abi, c)), ts) } {
                Ok(d) => Some(d),
                Err(e) => return e,
            }
        }
    };
    let f = fiber::current();
    let slot = match f {
        Some(f) => Slot::fiber(f),
        None => Slot::thread(),
    };
    COND_WAITERS.push(c as usize, &slot);
    // SAFETY: m is the caller's mutex, locked by it, as pthread_cond_wait requires.
    let r = unsafe {
        match f {
            Some(f) => mutex::unlock_fiber(m, f),
            None => mutex::unlock_thread(m),
        }
    };
    if r != 0 {
        COND_WAITERS.remove(c as usize, &slot);
        return r;
    }
    let mut timed_out = false;
    while !slot.was_signaled() {
        match f {
            Some(f) => {
                fiber::park_until(f, deadline);
            }
            None => futex_wait(&slot.signaled, 0, deadline),
        }
        if !slot.was_signaled() && deadline.is_some_and(|d| time::now_ns() >= d) {
            // Still queued: a real timeout. Already taken: signalled meanwhile.
            timed_out = COND_WAITERS.remove(c as usize, &slot);
            break;
        }
    }
    let r = match f {
        // SAFETY: the application's mutex.
        Some(f) => unsafe { mutex::lock(m, f, None) },
        // SAFETY: the application's mutex.
        None => unsafe { (real::pthread_mutex_lock())(m) },
    };
    if r != 0 {
        r
    } else if timed_out {
        libc::ETIMEDOUT
    } else {
        0
    }
}

fn real_wait(abi: Abi, c: *mut c_void, m: *mut pthread_mutex_t, timeout: Timeout) -> c_int {
    // SAFETY: forwarding to the matching ABI.
    unsafe {
        match (abi, timeout) {
            (Abi::V2_2_5, None) => (real::cond_wait_225())(c, m),
            (Abi::V2_3_2, None) => (real::cond_wait_232())(c, m),
            (Abi::V2_2_5, Some((_, ts))) => (real::cond_timedwait_225())(c, m, ts),
            (Abi::V2_3_2, Some((None, ts))) => (real::cond_timedwait_232())(c, m, ts),
            (Abi::V2_3_2, Some((Some(clock), ts))) => {
                (real::pthread_cond_clockwait())(c, m, clock, ts)
            }
        }
    }
}
