//! The injection inside a watch: which windows count as "before", when the decision is
//! taken and on what verdict, and the measured "after" next to the prediction.

use crate::classifier::Kind;
use crate::metrics::Window;
use crate::model::Assessment;
use serde::Serialize;

/// `--inject`: what to do and after how many windows with requests.
#[derive(Clone, Debug)]
pub struct InjectRequest {
    pub opts: crate::inject::Options,
    pub after_windows: usize,
}

/// What an injection step did (in JSON its snake_case name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InjectAction {
    /// A dry run: the plan, nothing changed.
    Plan,
    /// Not done: the verdict or a precondition said no.
    Refused,
    /// Not done: a relaunch could not reproduce the target's credentials (or its
    /// systemd unit). Nothing was changed.
    Unreproducible,
    /// Relaunched under the runtime and serving; its health window runs.
    Injected,
    /// The injected server served through its health window: the injection stands.
    Healthy,
    /// The injected server failed its health window (crashed, exited, stopped
    /// listening or serving) and the original command runs again.
    RolledBack,
    /// The relaunch failed and the original was restored.
    Failed,
    /// The relaunch (or the injected server) failed and the original could not be
    /// restored.
    Down,
}

impl InjectAction {
    pub fn as_str(self) -> &'static str {
        match self {
            InjectAction::Plan => "plan",
            InjectAction::Refused => "refused",
            InjectAction::Unreproducible => "unreproducible",
            InjectAction::Injected => "injected",
            InjectAction::Healthy => "healthy",
            InjectAction::RolledBack => "rolled_back",
            InjectAction::Failed => "failed",
            InjectAction::Down => "down",
        }
    }
}

impl std::fmt::Display for InjectAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One injection step, as reported (JSON key "inject").
#[derive(Clone, Debug, Serialize)]
pub struct InjectEvent {
    pub action: InjectAction,
    pub old_pid: u32,
    pub new_pid: Option<u32>,
    pub verdict: String,
    pub message: String,
    pub before_rps: Option<f64>,
    pub predicted_speedup: Option<f64>,
    pub predicted_rps: Option<f64>,
    /// The dry run's plan, every step.
    pub plan: Option<String>,
}

/// Before/after, carried in every window after the injection and in the final report.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct InjectionStatus {
    pub old_pid: u32,
    pub new_pid: u32,
    pub before_rps: f64,
    pub predicted_speedup: Option<f64>,
    pub predicted_rps: Option<f64>,
    /// Median requests/s of the windows after the first one under the runtime (each
    /// window's untraced rate where it has one: see served_rps).
    pub after_rps: Option<f64>,
    pub measured_speedup: Option<f64>,
    /// predicted / measured - 1.
    pub prediction_error: Option<f64>,
    pub after_windows: usize,
    /// Per window that before_rps and after_rps are the medians of, the Unix times
    /// [start, end] its rate is over (served_spans), so that another count over the
    /// same seconds can be set beside them.
    pub before_spans: Vec<Vec<[f64; 2]>>,
    pub after_spans: Vec<Vec<[f64; 2]>>,
}

/// The seconds served_rps(w) is a rate over: the untraced stretches', else the window.
pub fn served_spans(w: &Window) -> Vec<[f64; 2]> {
    w.untraced
        .as_ref()
        .map_or(vec![[w.ts - w.wall_secs, w.ts]], |u| u.spans.clone())
}

/// The window's rate without the watch where its untraced part gives one (a sampled
/// window: most of its seconds ran untraced), else the traced rate.
pub fn served_rps(w: &Window) -> f64 {
    w.untraced
        .as_ref()
        .map_or(w.requests_per_sec, |u| u.requests_per_sec)
}

pub fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    })
}

/// Stock windows (and their predictions) kept for the decision.
const KEEP: usize = 5;

/// One stock window, as the decision and the prediction use it.
struct Stock {
    rps: f64,
    spans: Vec<[f64; 2]>,
    model: Option<Assessment>,
}

/// Follows a watch's windows around an injection.
#[derive(Default)]
pub struct Tracker {
    /// The recent stock windows with requests (at most KEEP).
    before: Vec<Stock>,
    verdict: Option<(Kind, String)>,
    after: Vec<f64>,
    seen_after: usize,
    pub status: Option<InjectionStatus>,
    /// Rolled back: the windows are the original's again, not "after".
    rolled_back: bool,
}

impl Tracker {
    /// A window of the stock server. Idle windows say nothing about the verdict.
    pub fn stock(&mut self, w: &Window) {
        if w.requests == 0 || w.verdict.kind == Kind::Undecided {
            return;
        }
        self.before.push(Stock {
            rps: served_rps(w),
            spans: served_spans(w),
            model: w.model.clone(),
        });
        // Keep the recent past: a server warming up is not what is injected.
        if self.before.len() > KEEP {
            self.before.remove(0);
        }
        self.verdict = Some((
            w.verdict.kind,
            format!("{} -- {}", w.verdict.label, w.verdict.because),
        ));
    }

    pub fn windows_seen(&self) -> usize {
        self.before.len()
    }

    pub fn verdict_text(&self) -> String {
        self.verdict
            .as_ref()
            .map(|v| v.1.clone())
            .unwrap_or_else(|| "undecided (no requests seen yet)".into())
    }

    /// Ok when injecting makes sense (or is forced), else why not.
    pub fn decide(&self, force: bool) -> Result<(), String> {
        match &self.verdict {
            None if force => Ok(()),
            None => Err("no requests seen yet: the verdict is undecided".into()),
            Some((Kind::Fiberizable, _)) => Ok(()),
            Some(_) if force => Ok(()),
            Some((_, why)) => Err(format!("the verdict is {why}")),
        }
    }

    pub fn before_rps(&self) -> Option<f64> {
        median(&self.before.iter().map(|b| b.rps).collect::<Vec<_>>())
    }

    /// The prediction: the median over the recent windows of each window's own, so
    /// that one window a noisy host disturbed (steal, another job's burst) does not
    /// decide it.
    pub fn predicted(&self) -> (Option<f64>, Option<f64>) {
        let models = || self.before.iter().filter_map(|b| b.model.as_ref());
        let speedups: Vec<f64> = models().filter_map(|a| a.zero_edit_speedup).collect();
        let rps: Vec<f64> = models()
            .filter_map(|a| a.zero_edit.as_ref().map(|p| p.fiber_rps))
            .collect();
        (median(&speedups), median(&rps))
    }

    /// The injection happened: from now on windows are "after".
    pub fn injected(&mut self, old_pid: u32, new_pid: u32) {
        let (predicted_speedup, predicted_rps) = self.predicted();
        self.status = Some(InjectionStatus {
            old_pid,
            new_pid,
            before_rps: self.before_rps().unwrap_or(0.0),
            predicted_speedup,
            predicted_rps,
            after_rps: None,
            measured_speedup: None,
            prediction_error: None,
            after_windows: 0,
            before_spans: self.before.iter().map(|b| b.spans.clone()).collect(),
            after_spans: Vec::new(),
        });
    }

    /// The injection was rolled back: what was measured of it stays in the status,
    /// and later windows are not counted as its.
    pub fn rolled_back(&mut self) {
        self.rolled_back = true;
    }

    /// A window of the injected server; the first is its warm-up and does not count.
    pub fn after(&mut self, w: &Window) -> Option<InjectionStatus> {
        if self.rolled_back {
            return None;
        }
        let st = self.status.as_mut()?;
        self.seen_after += 1;
        if self.seen_after > 1 && w.requests > 0 {
            self.after.push(served_rps(w));
            st.after_spans.push(served_spans(w));
        }
        st.after_windows = self.after.len();
        st.after_rps = median(&self.after);
        st.measured_speedup = st
            .after_rps
            .filter(|_| st.before_rps > 0.0)
            .map(|a| a / st.before_rps);
        st.prediction_error = match (st.predicted_speedup, st.measured_speedup) {
            (Some(p), Some(m)) if m > 0.0 => Some(p / m - 1.0),
            _ => None,
        };
        Some(st.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
    }

    /// The seconds beside a window's rate are those the rate is over: its untraced
    /// stretch where the rate is the untraced one, so that a count over them (a load
    /// generator's) compares like with like when the rate moves within the window.
    #[test]
    fn the_span_is_the_served_rates_own() {
        use crate::untraced::{Untraced, UntracedSource};
        let prev = crate::collector::Snapshot::zero();
        let mut cur = crate::collector::Snapshot::zero();
        cur.t = 1.0;
        let mut w = crate::metrics::window(&prev, &cur, &crate::metrics::tests::ctx());
        w.ts = 1000.0;
        w.wall_secs = 1.0;
        w.requests_per_sec = 500.0;
        assert_eq!(served_rps(&w), 500.0);
        assert_eq!(served_spans(&w), [[999.0, 1000.0]]);
        w.untraced = Some(Untraced {
            secs: 0.6,
            requests_per_sec: 800.0,
            cpu_per_request_us: 10.0,
            io_calls_per_request: 2.0,
            source: UntracedSource::IoCalls,
            spans: vec![[999.0, 999.1], [999.4, 1000.0]],
        });
        assert_eq!(served_rps(&w), 800.0);
        assert_eq!(served_spans(&w), [[999.0, 999.1], [999.4, 1000.0]]);
    }
}
