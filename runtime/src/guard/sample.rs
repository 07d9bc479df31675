//! Sampled detection (TOFFLOAD_GUARD_SAMPLE): detect watches for a share of the time
//! only, the way KCSAN and DataCollider sample, trading the certainty of seeing a
//! single occurrence for a cost that scales with the share. Time is cut into periods;
//! the guard is on for the first `pct`% of each and off for the rest. The pure logic
//! (which phase a moment falls in, when it ends) lives here, apart from the mechanism.
//!
//! The period is 50 ms: long against a handler's park window (an offload of 20 us to a
//! few ms), so that almost every window that starts in an on phase also ends in it
//! (only those are checked), and short enough that a run of a second crosses twenty
//! of them, spreading the watched time evenly over the run. The on phase is never
//! shorter than 5 ms (below 10% the period grows instead), so windows of a few ms
//! still fit in one.

/// The period at the default shares.
pub const PERIOD_NS: u64 = 50_000_000;
/// The shortest on phase.
pub const MIN_ON_NS: u64 = 5_000_000;

/// A duty cycle: on for `on_ns` at the start of every `period_ns`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Duty {
    pub on_ns: u64,
    pub period_ns: u64,
}

impl Duty {
    /// The cycle for a share of `pct` percent (1..=100); None for 100 (always on:
    /// exact detection, no cycle at all).
    pub fn new(pct: u8) -> Option<Duty> {
        let pct = u64::from(pct.clamp(1, 100));
        if pct == 100 {
            return None;
        }
        let on_ns = (PERIOD_NS * pct / 100).max(MIN_ON_NS);
        Some(Duty {
            on_ns,
            period_ns: on_ns * 100 / pct,
        })
    }

    /// At `t` ns from the start: (the period's index, whether the guard is on).
    pub fn phase(&self, t: u64) -> (u64, bool) {
        (t / self.period_ns, t % self.period_ns < self.on_ns)
    }

    /// When (ns from the start) the phase `t` falls in ends.
    pub fn phase_end(&self, t: u64) -> u64 {
        let (k, on) = self.phase(t);
        let start = k * self.period_ns;
        if on {
            start + self.on_ns
        } else {
            start + self.period_ns
        }
    }
}

/// The guard's phase as one word, for the fast paths: bit 0 on, the rest the epoch
/// (the on phase's number; a fiber's park window counts only inside the epoch it
/// opened in). 0 (epoch 0, off) never names an on phase: it marks "no valid window".
pub const fn phase_word(epoch: u64, on: bool) -> u64 {
    (epoch << 1) | on as u64
}

pub const NO_PHASE: u64 = 0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hundred_percent_is_no_cycle() {
        assert_eq!(Duty::new(100), None);
    }

    #[test]
    fn on_share_of_every_period() {
        let d = Duty::new(25).unwrap();
        assert_eq!((d.on_ns, d.period_ns), (12_500_000, 50_000_000));
        assert_eq!(d.phase(0), (0, true));
        assert_eq!(d.phase(12_499_999), (0, true));
        assert_eq!(d.phase(12_500_000), (0, false));
        assert_eq!(d.phase(49_999_999), (0, false));
        assert_eq!(d.phase(50_000_000), (1, true));
        assert_eq!(d.phase_end(0), 12_500_000);
        assert_eq!(d.phase_end(12_500_000), 50_000_000);
        assert_eq!(d.phase_end(60_000_000), 62_500_000);
        // Over many periods the on time is the share.
        let step = 100_000;
        let on = (0..10_000u64).filter(|i| d.phase(i * step + 7).1).count();
        assert_eq!(on, 2_500);
    }

    #[test]
    fn small_shares_stretch_the_period_not_the_share() {
        for pct in [1u8, 2, 5, 9] {
            let d = Duty::new(pct).unwrap();
            assert_eq!(d.on_ns, MIN_ON_NS, "{pct}");
            // The share is kept (to the ns the division leaves).
            let p = u64::from(pct);
            assert!(d.period_ns * p <= d.on_ns * 100, "{pct}");
            assert!(d.on_ns * 100 < (d.period_ns + 1) * p, "{pct}");
        }
        let d = Duty::new(10).unwrap();
        assert_eq!((d.on_ns, d.period_ns), (MIN_ON_NS, PERIOD_NS));
        let d = Duty::new(99).unwrap();
        assert!(d.on_ns < d.period_ns);
    }

    #[test]
    fn phase_ends_are_phase_changes() {
        for pct in [1u8, 13, 25, 50, 99] {
            let d = Duty::new(pct).unwrap();
            let mut t = 3;
            for _ in 0..20 {
                let e = d.phase_end(t);
                assert!(e > t);
                assert_eq!(d.phase(e - 1), d.phase(t), "{pct} at {t}");
                assert_ne!(d.phase(e), d.phase(t), "{pct} at {t}");
                t = e;
            }
        }
    }

    #[test]
    fn phase_words_tell_epochs_apart_and_never_name_no_phase() {
        assert_ne!(phase_word(1, true), phase_word(2, true));
        assert_ne!(phase_word(1, true), phase_word(1, false));
        assert_eq!(phase_word(0, false), NO_PHASE);
        for e in 0..4 {
            assert_ne!(phase_word(e, true), NO_PHASE);
        }
    }
}
