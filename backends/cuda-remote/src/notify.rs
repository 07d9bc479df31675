//! Waking the program's threads when the daemon answers, through pthread's condition
//! variable rather than std's.
//!
//! Why by hand: std's Condvar waits with the futex system call directly, below libc.
//! Under libtoffload.so the program's connection threads are fibers sharing a
//! carrier thread; a fiber waiting in a raw futex holds the carrier, so every other
//! fiber on it stops until the daemon answers (or the runtime's blocked-carrier
//! handoff moves them after milliseconds). pthread_cond_timedwait is what the
//! runtime interposes: there a fiber parks and its carrier runs the others. Outside
//! the runtime it is the plain pthread wait. No crate offers a condition variable
//! that goes through libc's symbols.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

/// A generation count: waiters read it (under the lock of the state they check),
/// wait until it moves, then check their state again.
pub struct Notifier {
    mutex: UnsafeCell<libc::pthread_mutex_t>,
    cond: UnsafeCell<libc::pthread_cond_t>,
    gen: AtomicU64,
}

// SAFETY: the pthread objects are only used through pthread calls, which synchronize;
// they never move (the Notifier lives in an Arc'd Remote).
unsafe impl Sync for Notifier {}
// SAFETY: as above.
unsafe impl Send for Notifier {}

impl Notifier {
    pub fn new() -> Notifier {
        let n = Notifier {
            mutex: UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER),
            cond: UnsafeCell::new(libc::PTHREAD_COND_INITIALIZER),
            gen: AtomicU64::new(0),
        };
        // SAFETY: a fresh condattr, initialized before use and destroyed after; the
        // cond is not yet shared. CLOCK_MONOTONIC: a wall-clock step must not stretch
        // or cut a deadline.
        unsafe {
            let mut attr: libc::pthread_condattr_t = std::mem::zeroed();
            libc::pthread_condattr_init(&mut attr);
            libc::pthread_condattr_setclock(&mut attr, libc::CLOCK_MONOTONIC);
            libc::pthread_cond_init(n.cond.get(), &attr);
            libc::pthread_condattr_destroy(&mut attr);
        }
        n
    }

    /// The generation now: read it under the lock of the state the waiter checks,
    /// so that a change made after the check moves it.
    pub fn generation(&self) -> u64 {
        self.gen.load(Acquire)
    }

    /// Wakes every waiter (after the state they wait on changed).
    pub fn notify_all(&self) {
        // SAFETY: initialized in new(); locked and unlocked by this thread.
        unsafe {
            libc::pthread_mutex_lock(self.mutex.get());
            self.gen.fetch_add(1, Release);
            libc::pthread_cond_broadcast(self.cond.get());
            libc::pthread_mutex_unlock(self.mutex.get());
        }
    }

    /// Waits until the generation is no longer `seen` or `deadline` passes.
    pub fn wait(&self, seen: u64, deadline: Instant) {
        // SAFETY: as in notify_all; the timespec is CLOCK_MONOTONIC's, as the cond's.
        unsafe {
            libc::pthread_mutex_lock(self.mutex.get());
            while self.gen.load(Acquire) == seen {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let mut now: libc::timespec = std::mem::zeroed();
                libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now);
                let at = Duration::new(now.tv_sec as u64, now.tv_nsec as u32) + left;
                let ts = libc::timespec {
                    tv_sec: at.as_secs() as libc::time_t,
                    tv_nsec: at.subsec_nanos() as libc::c_long,
                };
                libc::pthread_cond_timedwait(self.cond.get(), self.mutex.get(), &ts);
            }
            libc::pthread_mutex_unlock(self.mutex.get());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_notify_wakes_a_waiter_and_a_deadline_ends_a_wait() {
        let n = Arc::new(Notifier::new());
        let g = n.generation();
        let m = Arc::clone(&n);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            m.notify_all();
        });
        let t0 = Instant::now();
        n.wait(g, Instant::now() + Duration::from_secs(10));
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_ne!(n.generation(), g);
        t.join().unwrap();
        // Nobody notifies: the deadline ends it.
        let t0 = Instant::now();
        n.wait(n.generation(), Instant::now() + Duration::from_millis(100));
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(95) && took < Duration::from_secs(5),
            "{took:?}"
        );
    }
}
