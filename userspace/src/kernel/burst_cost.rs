//! What one burst's attach and detach cost in CPU: the fixed part of sampled
//! watching, beside the per-event cost probe_cost.rs measures. The budget takes it
//! out of what an interval may spend before it sets the traced share (session.rs).
//! Measured live on the watcher's side (the thread CPU clock of the attach, and of
//! the threads that release the links), since attaching costs what the kernel's
//! attach paths cost on this host at this moment.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The calling thread's CPU time in ns (0 where the clock is unavailable).
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer to a timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The CPU of the last attach and of the last detach, the latter added up by the
/// threads that release its links as they finish.
#[derive(Clone, Debug, Default)]
pub struct BurstCost {
    attach_ns: Arc<AtomicU64>,
    detach_ns: Arc<AtomicU64>,
}

impl BurstCost {
    /// Runs `attach`, booking its CPU as the last attach's.
    pub fn attach<T>(&self, attach: impl FnOnce() -> T) -> T {
        let t0 = thread_cpu_ns();
        let r = attach();
        self.attach_ns
            .store(thread_cpu_ns().saturating_sub(t0), Ordering::Relaxed);
        r
    }

    /// A new detach: its sink, emptied, to which this thread's part and each
    /// release thread's CPU are added.
    pub fn detach_sink(&self) -> Arc<AtomicU64> {
        self.detach_ns.store(0, Ordering::Relaxed);
        self.detach_ns.clone()
    }

    /// The last attach's and detach's CPU, ns.
    pub fn ns(&self) -> u64 {
        self.attach_ns.load(Ordering::Relaxed) + self.detach_ns.load(Ordering::Relaxed)
    }
}

/// Adds the CPU the calling thread spends in `f` to `sink`.
pub fn booked<T>(sink: &AtomicU64, f: impl FnOnce() -> T) -> T {
    let t0 = thread_cpu_ns();
    let r = f();
    sink.fetch_add(thread_cpu_ns().saturating_sub(t0), Ordering::Relaxed);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(ns: u64) {
        let t0 = thread_cpu_ns();
        while thread_cpu_ns() - t0 < ns {
            std::hint::spin_loop();
        }
    }

    #[test]
    fn books_the_cpu_of_each_part_once() {
        let c = BurstCost::default();
        c.attach(|| spin(2_000_000));
        let sink = c.detach_sink();
        booked(&sink, || spin(1_000_000));
        // A release thread adds its own CPU, not this thread's.
        let s2 = sink.clone();
        std::thread::spawn(move || booked(&s2, || spin(3_000_000)))
            .join()
            .unwrap();
        let ns = c.ns();
        assert!((6_000_000..7_000_000).contains(&ns), "{ns}");
        // A new detach starts from nothing; the attach stays.
        c.detach_sink();
        assert!((2_000_000..2_500_000).contains(&c.ns()), "{}", c.ns());
    }

    #[test]
    fn sleeping_costs_nothing() {
        let c = BurstCost::default();
        c.attach(|| std::thread::sleep(std::time::Duration::from_millis(30)));
        assert!(c.ns() < 5_000_000, "{}", c.ns());
    }
}
