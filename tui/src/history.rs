//! The past windows the charts draw: a bounded ring, oldest first.

use std::collections::VecDeque;

use crate::model::WindowView;

/// How many windows the charts keep: two minutes of one-second windows, which is
/// wider than any chart gets in columns (a braille chart draws two points per column).
pub const DEFAULT_CAPACITY: usize = 120;

#[derive(Debug, Clone)]
pub struct History {
    windows: VecDeque<WindowView>,
    capacity: usize,
}

impl Default for History {
    fn default() -> Self {
        Self::with_capacity(DEFAULT_CAPACITY)
    }
}

impl History {
    pub fn with_capacity(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            windows: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    /// Appends a window, dropping the oldest one past the capacity.
    pub fn push(&mut self, w: WindowView) {
        if self.windows.len() == self.capacity {
            self.windows.pop_front();
        }
        self.windows.push_back(w);
    }

    pub fn len(&self) -> usize {
        self.windows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// The newest window: what the values lines, the histogram and the syscall table show.
    pub fn latest(&self) -> Option<&WindowView> {
        self.windows.back()
    }

    /// (t_s, value) for every window where `f` has a value. Windows without one are
    /// skipped rather than drawn as zero: "not measured" is not "none".
    pub fn series(&self, f: impl Fn(&WindowView) -> Option<f64>) -> Vec<(f64, f64)> {
        self.windows
            .iter()
            .filter_map(|w| f(w).filter(|v| v.is_finite()).map(|v| (w.t_s, v)))
            .collect()
    }

    /// The time span covered, for the charts' x axis; never empty so that a single
    /// window still gets a usable axis.
    pub fn t_bounds(&self) -> [f64; 2] {
        match (self.windows.front(), self.windows.back()) {
            (Some(a), Some(b)) if b.t_s > a.t_s => [a.t_s, b.t_s],
            (Some(a), _) => [a.t_s - 1.0, a.t_s],
            _ => [0.0, 1.0],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(t: f64, rps: f64) -> WindowView {
        WindowView {
            t_s: t,
            requests_per_sec: rps,
            ..Default::default()
        }
    }

    #[test]
    fn keeps_the_newest_up_to_capacity() {
        let mut h = History::with_capacity(3);
        for i in 0..5 {
            h.push(w(i as f64, i as f64 * 10.0));
        }
        assert_eq!(h.len(), 3);
        assert_eq!(h.latest().unwrap().t_s, 4.0);
        assert_eq!(
            h.series(|w| Some(w.requests_per_sec)),
            vec![(2.0, 20.0), (3.0, 30.0), (4.0, 40.0)]
        );
        assert_eq!(h.t_bounds(), [2.0, 4.0]);
    }

    #[test]
    fn missing_values_are_skipped_not_zero() {
        let mut h = History::default();
        h.push(WindowView {
            t_s: 1.0,
            stall_p50_us: Some(5.0),
            ..Default::default()
        });
        h.push(w(2.0, 0.0));
        assert_eq!(h.series(|w| w.stall_p50_us), vec![(1.0, 5.0)]);
        assert_eq!(History::default().t_bounds(), [0.0, 1.0]);
        assert_eq!(h.t_bounds(), [1.0, 2.0]);
    }
}
