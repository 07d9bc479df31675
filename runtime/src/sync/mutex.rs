//! pthread_mutex_* for fibers: trylock, and park in LOCK_WAITERS when busy; unlock
//! wakes one parked fiber. Recursive and error-checking mutexes record their owner
//! by thread id, and all fibers of a carrier share its thread id, so for those we keep
//! the owning fiber ourselves: otherwise a second fiber would "recursively" acquire a
//! mutex that another fiber holds.

#![allow(clippy::missing_safety_doc)] // C callers' pointers, taken as they come

use super::{LOCK_WAITERS, RECHECK_NS};
use crate::fiber::{self, Fiber};
use crate::spinlock::SpinLock;
use crate::waitq::Slot;
use crate::{real, time};
use libc::{c_int, pthread_mutex_t};
use std::collections::HashMap;

const KIND_RECURSIVE: c_int = 1;
const KIND_ERRORCHECK: c_int = 2;

/// Owner fiber (and depth) of recursive / error-checking mutexes held by fibers.
static OWNERS: SpinLock<Option<HashMap<usize, usize>>> = SpinLock::new(None);

// glibc x86_64 struct __pthread_mutex_s: int __lock; unsigned __count; int __owner;
// unsigned __nusers; int __kind; ...
fn owner_tid(m: *mut pthread_mutex_t) -> c_int {
    // SAFETY: every pthread_mutex_t is at least 40 bytes; we only read.
    unsafe { std::ptr::read_volatile((m as *const c_int).add(2)) }
}

fn kind(m: *mut pthread_mutex_t) -> c_int {
    // SAFETY: as above.
    unsafe { std::ptr::read_volatile((m as *const c_int).add(4)) & 3 }
}

fn tracked(m: *mut pthread_mutex_t) -> bool {
    matches!(kind(m), KIND_RECURSIVE | KIND_ERRORCHECK)
}

fn lock_word(m: *mut pthread_mutex_t) -> c_int {
    // SAFETY: as owner_tid.
    unsafe { std::ptr::read_volatile(m as *const c_int) }
}

/// One attempt to take `m` for fiber `f`: 0, EBUSY, or another error.
fn try_acquire(m: *mut pthread_mutex_t, f: &Fiber) -> c_int {
    // Look before trying: a failed trylock is still a locked write to the mutex's
    // page, which the conflict guard would count as a modification by a waiter.
    if lock_word(m) != 0 && !tracked(m) {
        return libc::EBUSY;
    }
    if !tracked(m) {
        // SAFETY: the application's mutex.
        return unsafe { (real::pthread_mutex_trylock())(m) };
    }
    let me = f as *const Fiber as usize;
    if owner_tid(m) == f.carrier().tid.load(std::sync::atomic::Ordering::Relaxed) {
        let owners = OWNERS.lock();
        let owner = owners.as_ref().and_then(|o| o.get(&(m as usize)).copied());
        drop(owners);
        return match owner {
            Some(o) if o == me && kind(m) == KIND_RECURSIVE => {
                // SAFETY: ours; glibc bumps the count.
                unsafe { (real::pthread_mutex_trylock())(m) }
            }
            Some(o) if o == me => libc::EDEADLK,
            _ => libc::EBUSY,
        };
    }
    // SAFETY: the application's mutex.
    let r = unsafe { (real::pthread_mutex_trylock())(m) };
    if r == 0 {
        OWNERS
            .lock()
            .get_or_insert_with(HashMap::new)
            .insert(m as usize, me);
    }
    r
}

/// lock / timedlock for a fiber. `deadline` in monotonic ns.
pub unsafe fn lock(m: *mut pthread_mutex_t, f: &Fiber, deadline: Option<u64>) -> c_int {
    // No barging past fibers already queued: without this, a fiber that unlocks and
    // locks again in one run (as a handler loop does) takes the mutex back before the
    // waiter it woke gets to run, and waiters starve (p99 of 100 ms seen).
    let mut first = !LOCK_WAITERS.has(m as usize);
    loop {
        let r = if first {
            try_acquire(m, f)
        } else {
            libc::EBUSY
        };
        first = true;
        if r != libc::EBUSY {
            return r;
        }
        let slot = Slot::fiber(f);
        LOCK_WAITERS.push(m as usize, &slot);
        let r = try_acquire(m, f);
        if r != libc::EBUSY {
            if !LOCK_WAITERS.remove(m as usize, &slot) {
                // We were handed a wake-up we no longer need: pass it on.
                LOCK_WAITERS.wake_one(m as usize);
            }
            return r;
        }
        let recheck = time::now_ns() + RECHECK_NS;
        let until = deadline.map_or(recheck, |d| d.min(recheck));
        fiber::park_until(f, Some(until));
        if !LOCK_WAITERS.remove(m as usize, &slot) && deadline.is_some_and(|d| time::now_ns() >= d)
        {
            // Woken and timed out at once: let another waiter have the wake-up.
            LOCK_WAITERS.wake_one(m as usize);
        }
        if deadline.is_some_and(|d| time::now_ns() >= d) {
            let r = try_acquire(m, f);
            return if r == libc::EBUSY { libc::ETIMEDOUT } else { r };
        }
    }
}

pub unsafe fn trylock(m: *mut pthread_mutex_t, f: &Fiber) -> c_int {
    try_acquire(m, f)
}

/// unlock from a fiber.
pub unsafe fn unlock_fiber(m: *mut pthread_mutex_t, f: &Fiber) -> c_int {
    if tracked(m) {
        let me = f as *const Fiber as usize;
        let mut owners = OWNERS.lock();
        let owner = owners.as_ref().and_then(|o| o.get(&(m as usize)).copied());
        if owner != Some(me) {
            return libc::EPERM;
        }
        // SAFETY: we own it.
        let r = unsafe { (real::pthread_mutex_unlock())(m) };
        if r == 0 && owner_tid(m) != f.carrier().tid.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some(o) = owners.as_mut() {
                o.remove(&(m as usize));
            }
        }
        drop(owners);
        wake_waiter(m, r);
        return r;
    }
    // SAFETY: the application's mutex.
    let r = unsafe { (real::pthread_mutex_unlock())(m) };
    wake_waiter(m, r);
    r
}

/// unlock from a real thread (once fibers exist, a fiber may be parked on it).
pub unsafe fn unlock_thread(m: *mut pthread_mutex_t) -> c_int {
    // SAFETY: the application's mutex.
    let r = unsafe { (real::pthread_mutex_unlock())(m) };
    wake_waiter(m, r);
    r
}

#[inline]
fn wake_waiter(m: *mut pthread_mutex_t, r: c_int) {
    if r == 0 && LOCK_WAITERS.anyone_waiting() {
        LOCK_WAITERS.wake_one(m as usize);
    }
}

/// # Safety
/// Only in a forked child.
pub unsafe fn after_fork_child() {
    // SAFETY: in a forked child (our contract) no other thread can hold it.
    unsafe { OWNERS.force_unlock() };
}
