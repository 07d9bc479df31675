//! The watch's cost measured on the target itself. The calibration times each probe
//! in a tight loop, where its code and maps stay in cache; inside a real server, whose
//! requests run longer kernel paths between events, the same programs cost more (on
//! stock nginx serving a file, about three times the calibrated cost per request). A
//! sampled window holds both sides of the difference: the target's CPU per request
//! while traced (the probes' on-CPU time) and while untraced (/proc, untraced.rs).

use crate::metrics::Window;
use std::collections::VecDeque;

/// Windows whose measurements the median is taken over: one window's untraced rate
/// moves by a few percent, and so by a microsecond its difference.
const RECENT: usize = 5;

/// Fewer requests than this in a window's traced part give no measurement.
const MIN_REQUESTS: u64 = 50;

#[derive(Debug, Default)]
pub struct MeasuredCost {
    recent: VecDeque<f64>,
}

impl MeasuredCost {
    /// Takes the window's measurement, if it has one: `off_core` says its untraced
    /// CPU left out threads that the probes timed (Ledger::off_core_seen), which
    /// would read as cost.
    pub fn observe(&mut self, w: &Window, off_core: bool) {
        if let Some(us) = one_window(w, off_core) {
            if self.recent.len() == RECENT {
                self.recent.pop_front();
            }
            self.recent.push_back(us);
        }
    }

    /// The median of the recent windows' measurements, us per request.
    pub fn us_per_request(&self) -> Option<f64> {
        crate::inject_flow::median(&self.recent.iter().copied().collect::<Vec<_>>())
    }
}

/// Traced less untraced CPU per request (at least 0), where the window has both.
fn one_window(w: &Window, off_core: bool) -> Option<f64> {
    if off_core || w.requests < MIN_REQUESTS {
        return None;
    }
    let traced = w.on_cpu_per_request_us?;
    let untraced = w.untraced.as_ref()?.cpu_per_request_us;
    (traced.is_finite() && untraced.is_finite() && untraced > 0.0)
        .then(|| (traced - untraced).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::untraced::{Untraced, UntracedSource};

    fn window(requests: u64, traced_us: f64, untraced_us: Option<f64>) -> Window {
        let prev = crate::collector::Snapshot::zero();
        let mut cur = crate::collector::Snapshot::zero();
        cur.t = 1.0;
        let mut w = crate::metrics::window(&prev, &cur, &crate::metrics::tests::ctx());
        w.requests = requests;
        w.on_cpu_per_request_us = Some(traced_us);
        w.untraced = untraced_us.map(|u| Untraced {
            secs: 0.7,
            requests_per_sec: 1000.0,
            cpu_per_request_us: u,
            io_calls_per_request: 2.0,
            source: UntracedSource::IoCalls,
            spans: vec![[0.0, 0.7]],
        });
        w
    }

    #[test]
    fn the_median_of_the_recent_differences() {
        let mut m = MeasuredCost::default();
        assert_eq!(m.us_per_request(), None);
        m.observe(&window(1000, 16.0, Some(11.0)), false);
        assert_eq!(m.us_per_request(), Some(5.0));
        // No untraced part, too few requests, threads the untraced CPU left out: none
        // of them is a measurement.
        m.observe(&window(1000, 30.0, None), false);
        m.observe(&window(10, 30.0, Some(11.0)), false);
        m.observe(&window(1000, 30.0, Some(11.0)), true);
        assert_eq!(m.us_per_request(), Some(5.0));
        m.observe(&window(1000, 12.0, Some(11.0)), false);
        m.observe(&window(1000, 20.0, Some(11.0)), false);
        assert_eq!(m.us_per_request(), Some(5.0));
        // A window cheaper traced than untraced (noise) counts as no cost, not less.
        m.observe(&window(1000, 10.0, Some(11.0)), false);
        assert_eq!(m.us_per_request(), Some(3.0));
        // Only the last RECENT windows count.
        for _ in 0..RECENT {
            m.observe(&window(1000, 13.0, Some(11.0)), false);
        }
        assert_eq!(m.us_per_request(), Some(2.0));
    }
}
