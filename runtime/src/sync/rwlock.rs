//! pthread_rwlock_* for fibers: try, and park in LOCK_WAITERS when busy; any unlock
//! wakes every parked waiter on that lock (readers may all proceed; a writer that loses
//! the race parks again).

#![allow(clippy::missing_safety_doc)] // C callers' pointers, taken as they come

use super::{LOCK_WAITERS, RECHECK_NS};
use crate::fiber::{self, Fiber};
use crate::waitq::Slot;
use crate::{real, time};
use libc::{c_int, pthread_rwlock_t};

pub unsafe fn lock(
    l: *mut pthread_rwlock_t,
    f: &Fiber,
    write: bool,
    deadline: Option<u64>,
) -> c_int {
    let attempt = || {
        // SAFETY: the application's rwlock.
        unsafe {
            if write {
                (real::pthread_rwlock_trywrlock())(l)
            } else {
                (real::pthread_rwlock_tryrdlock())(l)
            }
        }
    };
    loop {
        let r = attempt();
        if r != libc::EBUSY {
            return r;
        }
        let slot = Slot::fiber(f);
        LOCK_WAITERS.push(l as usize, &slot);
        let r = attempt();
        if r != libc::EBUSY {
            LOCK_WAITERS.remove(l as usize, &slot);
            return r;
        }
        let recheck = time::now_ns() + RECHECK_NS;
        fiber::park_until(f, Some(deadline.map_or(recheck, |d| d.min(recheck))));
        LOCK_WAITERS.remove(l as usize, &slot);
        if deadline.is_some_and(|d| time::now_ns() >= d) {
            let r = attempt();
            return if r == libc::EBUSY { libc::ETIMEDOUT } else { r };
        }
    }
}

pub unsafe fn unlock(l: *mut pthread_rwlock_t) -> c_int {
    // SAFETY: the application's rwlock.
    let r = unsafe { (real::pthread_rwlock_unlock())(l) };
    if r == 0 && LOCK_WAITERS.anyone_waiting() {
        LOCK_WAITERS.wake_all(l as usize);
    }
    r
}
