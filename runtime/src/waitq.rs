//! Wait queues keyed by address, for the mutex, rwlock and condition-variable
//! interposers: a fiber (or, for condition variables, a real thread) that must wait
//! registers here and parks; whoever releases the object wakes one or all waiters.
//! Sharded so that unrelated objects do not contend; a global count lets the release
//! path skip the lookup when nobody waits anywhere (the common case).

use crate::fiber::{self, Fiber};
use crate::spinlock::SpinLock;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::*};

const SHARDS: usize = 64;

/// One waiter's record; lives on the waiter's stack for the duration of the wait.
pub struct Slot {
    /// 1 once woken through the queue (futex word for real threads).
    pub signaled: AtomicU32,
    fiber: *const Fiber,
}

impl Slot {
    pub fn fiber(f: &Fiber) -> Slot {
        Slot {
            signaled: AtomicU32::new(0),
            fiber: f,
        }
    }
    pub fn thread() -> Slot {
        Slot {
            signaled: AtomicU32::new(0),
            fiber: std::ptr::null(),
        }
    }
    pub fn was_signaled(&self) -> bool {
        self.signaled.load(Acquire) != 0
    }

    /// Called with the shard locked, after the slot was removed from its queue.
    fn signal(&self) {
        self.signaled.store(1, Release);
        if self.fiber.is_null() {
            futex_wake(&self.signaled);
        } else {
            // SAFETY: a fiber is alive while its slot is queued.
            fiber::wake(unsafe { &*self.fiber });
        }
    }
}

type Shard = SpinLock<Option<HashMap<usize, VecDeque<usize>>>>;

pub struct WaitQueues {
    shards: [Shard; SHARDS],
    waiting: AtomicUsize,
}

impl Default for WaitQueues {
    fn default() -> Self {
        Self::new()
    }
}

impl WaitQueues {
    pub const fn new() -> Self {
        WaitQueues {
            shards: [const { SpinLock::new(None) }; SHARDS],
            waiting: AtomicUsize::new(0),
        }
    }

    fn shard(&self, addr: usize) -> &Shard {
        &self.shards[(addr >> 4).wrapping_mul(0x9E37_79B9) % SHARDS]
    }

    #[inline]
    pub fn anyone_waiting(&self) -> bool {
        self.waiting.load(SeqCst) != 0
    }

    pub fn push(&self, addr: usize, s: &Slot) {
        let mut g = self.shard(addr).lock();
        g.get_or_insert_with(HashMap::new)
            .entry(addr)
            .or_default()
            .push_back(s as *const Slot as usize);
        self.waiting.fetch_add(1, SeqCst);
    }

    /// True if anyone waits on `addr`.
    pub fn has(&self, addr: usize) -> bool {
        if !self.anyone_waiting() {
            return false;
        }
        let g = self.shard(addr).lock();
        g.as_ref()
            .and_then(|m| m.get(&addr))
            .is_some_and(|q| !q.is_empty())
    }

    /// Removes `s` if still queued; false when it was already taken by a waker.
    pub fn remove(&self, addr: usize, s: &Slot) -> bool {
        let mut g = self.shard(addr).lock();
        let Some(map) = g.as_mut() else { return false };
        let Some(q) = map.get_mut(&addr) else {
            return false;
        };
        let me = s as *const Slot as usize;
        let Some(i) = q.iter().position(|&x| x == me) else {
            return false;
        };
        q.remove(i);
        if q.is_empty() {
            map.remove(&addr);
        }
        self.waiting.fetch_sub(1, SeqCst);
        true
    }

    /// Wakes the oldest waiter on `addr`; false if there was none.
    pub fn wake_one(&self, addr: usize) -> bool {
        if !self.anyone_waiting() {
            return false;
        }
        let mut g = self.shard(addr).lock();
        let Some(map) = g.as_mut() else { return false };
        let Some(q) = map.get_mut(&addr) else {
            return false;
        };
        let Some(s) = q.pop_front() else {
            return false;
        };
        if q.is_empty() {
            map.remove(&addr);
        }
        self.waiting.fetch_sub(1, SeqCst);
        // SAFETY: a queued slot is alive until removed (we hold the shard lock).
        unsafe { (*(s as *const Slot)).signal() };
        true
    }

    /// Wakes every waiter on `addr`; returns how many.
    pub fn wake_all(&self, addr: usize) -> usize {
        if !self.anyone_waiting() {
            return 0;
        }
        let mut g = self.shard(addr).lock();
        let Some(map) = g.as_mut() else { return 0 };
        let Some(q) = map.remove(&addr) else { return 0 };
        self.waiting.fetch_sub(q.len(), SeqCst);
        for &s in &q {
            // SAFETY: as in wake_one.
            unsafe { (*(s as *const Slot)).signal() };
        }
        q.len()
    }

    /// Fork child: the waiters were threads and fibers of the parent.
    ///
    /// # Safety
    /// Only in a forked child.
    pub unsafe fn reset_in_child(&self) {
        for s in &self.shards {
            // SAFETY: in a forked child (our contract) no other thread can hold it.
            unsafe { s.force_unlock() };
            *s.lock() = None;
        }
        self.waiting.store(0, SeqCst);
    }
}

pub fn futex_wake(w: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            w.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        )
    };
}

/// Sleeps while `*w == val`, at most until `deadline` (monotonic ns).
pub fn futex_wait(w: &AtomicU32, val: u32, deadline: Option<u64>) {
    let ts = deadline.map(crate::time::to_timespec);
    // FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC deadline.
    // SAFETY: valid word and timespec.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            w.as_ptr(),
            libc::FUTEX_WAIT_BITSET | libc::FUTEX_PRIVATE_FLAG,
            val,
            ts.as_ref()
                .map_or(std::ptr::null(), |t| t as *const libc::timespec),
            std::ptr::null::<u32>(),
            u32::MAX,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn wake_one_is_fifo_and_remove_sees_it() {
        let q = WaitQueues::new();
        let (a, b) = (Slot::thread(), Slot::thread());
        q.push(0x1000, &a);
        q.push(0x1000, &b);
        assert!(q.anyone_waiting());
        assert!(q.wake_one(0x1000));
        assert!(a.was_signaled() && !b.was_signaled());
        // a was taken by the waker: remove says so; b is still queued.
        assert!(!q.remove(0x1000, &a));
        assert!(q.remove(0x1000, &b));
        assert!(!q.anyone_waiting());
        assert!(!q.wake_one(0x1000));
    }

    #[test]
    fn wake_all_only_that_address() {
        let q = WaitQueues::new();
        let s: Vec<Slot> = (0..5).map(|_| Slot::thread()).collect();
        for (i, x) in s.iter().enumerate() {
            q.push(if i < 3 { 0x2000 } else { 0x3000 }, x);
        }
        assert_eq!(q.wake_all(0x2000), 3);
        assert!(s[..3].iter().all(|x| x.was_signaled()));
        assert!(!s[3].was_signaled() && !s[4].was_signaled());
        assert_eq!(q.wake_all(0x3000), 2);
    }

    #[test]
    fn a_sleeping_thread_is_woken() {
        let q = Arc::new(WaitQueues::new());
        let q2 = q.clone();
        let t = std::thread::spawn(move || {
            let s = Slot::thread();
            q2.push(0x4000, &s);
            while !s.was_signaled() {
                futex_wait(&s.signaled, 0, None);
            }
        });
        while !q.anyone_waiting() {
            std::thread::yield_now();
        }
        assert!(q.wake_one(0x4000));
        t.join().unwrap();
    }
}
