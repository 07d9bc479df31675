//! The host's hiccups: how often, and for how long, a core this machine calls busy does
//! not run at all.
//!
//! Why: on a shared virtual machine the host deschedules a vCPU for milliseconds at a
//! time, and the guest sees nothing of it (the task that was running seems to have run
//! on; /proc/stat's steal is in 10 ms ticks). A latency tail set by those stalls is the
//! host's, not the server's, and a benchmark has to say so with a count of its own.
//!
//! How: one thread pinned on each core spins on the monotonic clock for a while and
//! counts the gaps between two reads longer than a threshold. Nothing else should
//! run then (a benchmark measures before or after its runs): a gap is the host's.

use std::time::{Duration, Instant};

/// A gap this long between two clock reads in a spin is a stall, not a slow read.
pub const THRESHOLD: Duration = Duration::from_micros(300);

/// One core's stalls over a spin.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Hiccups {
    pub cpu: usize,
    pub secs: f64,
    /// Gaps longer than THRESHOLD.
    pub count: u64,
    /// Their total, milliseconds.
    pub total_ms: f64,
    /// The longest, milliseconds.
    pub max_ms: f64,
}

impl Hiccups {
    pub fn per_sec(&self) -> f64 {
        self.count as f64 / self.secs.max(1e-9)
    }

    /// The share of the spin the core did not run.
    pub fn lost_share(&self) -> f64 {
        self.total_ms / 1000.0 / self.secs.max(1e-9)
    }
}

impl std::fmt::Display for Hiccups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "core {}: {:.1}/s, longest {:.1} ms, {:.2}% of the time lost",
            self.cpu,
            self.per_sec(),
            self.max_ms,
            self.lost_share() * 100.0
        )
    }
}

/// Counts the gaps in a spin of `span` on the calling thread, pinned to `cpu`.
fn spin(cpu: usize, span: Duration) -> Hiccups {
    spin_with(cpu, span, || {})
}

/// spin(), calling `between` between two clock reads (a test's stand-in stall).
fn spin_with(cpu: usize, span: Duration, mut between: impl FnMut()) -> Hiccups {
    let t0 = Instant::now();
    let mut last = t0;
    let (mut count, mut total, mut max) = (0u64, Duration::ZERO, Duration::ZERO);
    loop {
        between();
        let now = Instant::now();
        let gap = now - last;
        last = now;
        if gap > THRESHOLD {
            count += 1;
            total += gap;
            max = max.max(gap);
        }
        if now - t0 >= span {
            return Hiccups {
                cpu,
                secs: (now - t0).as_secs_f64(),
                count,
                total_ms: total.as_secs_f64() * 1e3,
                max_ms: max.as_secs_f64() * 1e3,
            };
        }
    }
}

/// Spins `span` on each of `cpus` at once, one pinned thread per core. A core the
/// thread cannot be pinned to is left out.
pub fn measure(cpus: &[usize], span: Duration) -> Vec<Hiccups> {
    std::thread::scope(|s| {
        let handles: Vec<_> = cpus
            .iter()
            .map(|&cpu| {
                s.spawn(move || {
                    crate::harness::pin_current_thread(cpu).ok()?;
                    Some(spin(cpu, span))
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().ok().flatten())
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spin_counts_the_stalls_it_is_given() {
        // Two 5 ms sleeps stand in for the host; the spin must see both.
        let mut n = 0u32;
        let h = spin_with(0, Duration::from_millis(100), || {
            n += 1;
            if n == 1000 || n == 2000 {
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        assert!(h.secs >= 0.1, "{h:?}");
        assert!(h.count >= 2, "{h:?}");
        assert!(h.total_ms >= 10.0 && h.max_ms >= 5.0, "{h:?}");
    }

    #[test]
    fn the_shares_follow_the_counts() {
        let h = Hiccups {
            cpu: 1,
            secs: 2.0,
            count: 4,
            total_ms: 20.0,
            max_ms: 9.0,
        };
        assert_eq!(h.per_sec(), 2.0);
        assert!((h.lost_share() - 0.01).abs() < 1e-12);
        assert_eq!(
            h.to_string(),
            "core 1: 2.0/s, longest 9.0 ms, 1.00% of the time lost"
        );
    }
}
