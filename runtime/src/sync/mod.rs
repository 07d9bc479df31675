//! Fiber-aware pthread synchronisation. A fiber that would block in a mutex, rwlock or
//! condition variable parks instead, so the carrier keeps running the other fibers
//! (among them, often, the one holding the lock across its offload). The glibc objects
//! stay the source of truth for mutual exclusion, so real threads and fibers can share
//! them; our wait queues only decide whom to wake.

pub mod cond;
pub mod mutex;
pub mod once;
pub mod rwlock;
pub mod sem;

use crate::waitq::WaitQueues;

/// Fibers waiting for a mutex or rwlock, by object address.
pub static LOCK_WAITERS: WaitQueues = WaitQueues::new();
/// Waiters (fibers and, once the runtime is engaged, real threads) of condition
/// variables, by address.
pub static COND_WAITERS: WaitQueues = WaitQueues::new();

/// A lock waiter re-tries at least this often even without a wake-up: an unlock we
/// cannot see (another process on a process-shared mutex) must not strand it.
pub const RECHECK_NS: u64 = 10_000_000;

/// Fork child: forget the parent's waiters.
///
/// # Safety
/// Only in a forked child.
pub unsafe fn after_fork_child() {
    // SAFETY: in a forked child, as our own contract requires.
    unsafe {
        LOCK_WAITERS.reset_in_child();
        COND_WAITERS.reset_in_child();
        mutex::after_fork_child();
    }
}
