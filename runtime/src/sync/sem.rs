//! POSIX semaphores on fibers: sem_trywait, and park in LOCK_WAITERS (by address) when
//! the count is zero; sem_post, from any thread, wakes one parked fiber after glibc's
//! own post (which wakes any real thread waiting inside glibc).

#![allow(clippy::missing_safety_doc)] // C callers' pointers, taken as they come

use super::{LOCK_WAITERS, RECHECK_NS};
use crate::fiber::{self, Fiber};
use crate::waitq::Slot;
use crate::{real, time};
use libc::{c_int, sem_t};

pub unsafe fn wait(s: *mut sem_t, f: &Fiber, deadline: Option<u64>) -> c_int {
    loop {
        // SAFETY: s is the caller's initialized semaphore.
        if unsafe { (real::sem_trywait())(s) } == 0 {
            return 0;
        }
        if real::errno() != libc::EAGAIN {
            return -1;
        }
        let slot = Slot::fiber(f);
        LOCK_WAITERS.push(s as usize, &slot);
        // SAFETY: as above.
        if unsafe { (real::sem_trywait())(s) } == 0 {
            if !LOCK_WAITERS.remove(s as usize, &slot) {
                LOCK_WAITERS.wake_one(s as usize);
            }
            return 0;
        }
        let recheck = time::now_ns() + RECHECK_NS;
        fiber::park_until(f, Some(deadline.map_or(recheck, |d| d.min(recheck))));
        LOCK_WAITERS.remove(s as usize, &slot);
        if deadline.is_some_and(|d| time::now_ns() >= d) {
            // SAFETY: as above.
            if unsafe { (real::sem_trywait())(s) } == 0 {
                return 0;
            }
            real::set_errno(libc::ETIMEDOUT);
            return -1;
        }
    }
}

pub unsafe fn post(s: *mut sem_t) -> c_int {
    // SAFETY: s is the caller's initialized semaphore.
    let r = unsafe { (real::sem_post())(s) };
    if r == 0 && LOCK_WAITERS.anyone_waiting() {
        LOCK_WAITERS.wake_one(s as usize);
    }
    r
}
