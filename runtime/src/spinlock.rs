//! A small lock for the runtime's shared tables. Not std's Mutex: after fork() the
//! child must be able to take over a lock that a vanished thread held (force_unlock),
//! and the critical sections are a few dozen instructions, never a blocking call.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering::*};

pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: access to `value` is serialized by `locked`.
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: T is Send, and the lock word is an atomic.
unsafe impl<T: Send> Send for SpinLock<T> {}

pub struct Guard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> SpinLock<T> {
    pub const fn new(v: T) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(v),
        }
    }

    #[inline]
    pub fn lock(&self) -> Guard<'_, T> {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Acquire, Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // The holder may be preempted on our core: give it the CPU. A raw
                // syscall, since sched_yield itself is interposed.
                // SAFETY: no arguments.
                unsafe { libc::syscall(libc::SYS_sched_yield) };
            }
        }
        Guard { lock: self }
    }

    /// In a forked child only: the holder may be a thread that no longer exists.
    ///
    /// # Safety
    /// No other thread may be using the lock (true in a child right after fork).
    pub unsafe fn force_unlock(&self) {
        self.locked.store(false, Release);
    }
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: we hold the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: we hold the lock.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        self.lock.locked.store(false, Release);
    }
}
