//! The steady watch's cost on a stock server, folded by phase within the watch's
//! interval: the server's own count every 25 ms through one long watched run, each
//! sample placed at its time since the last window line (where the next burst
//! attaches). The phases far from the burst and the window's close are the same run
//! untraced, so the loss is measured within the run, where the host's drift between
//! runs (10-20% here, for seconds at a time) is far larger than the 1% target. An
//! unwatched run folded on the same 1 s clock is the method's own noise floor. What
//! this misses: the watcher's cost that falls evenly over the interval (its polls and
//! connection readings), which the watcher CPU column of the main table holds.

use crate::real::{self, Kind};
use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use toffload_watch::inject_flow::median;

/// Bin width.
pub const BIN: f64 = 0.05;
pub const BINS: usize = 20;
/// The bins that stand for the untraced rate: after the burst and its release, before
/// the window's close.
const QUIET: std::ops::Range<usize> = 6..18;
/// Windows skipped at the start: the first interval is traced in full until the
/// budget's early look.
const SKIP_WINDOWS: usize = 2;

pub struct Folded {
    /// Each bin's rate over the quiet bins' median.
    pub rel: Vec<f64>,
    /// 1 - the mean over all bins of the rate over the quiet level.
    pub loss: f64,
    /// The loss's standard error, jackknifed over the intervals.
    pub loss_se: Option<f64>,
    /// Intervals folded.
    pub intervals: usize,
    /// Median of the windows' duty, burst share and host share (watched runs).
    pub duty: Option<f64>,
    pub burst_share: Option<f64>,
    pub host_share: Option<f64>,
    /// Median of what each window says the watch costs the target over the next
    /// interval: its share while tracing times the duty, plus a burst's attach and
    /// detach (the figure the budget holds, less the host's part).
    pub claimed: Option<f64>,
}

/// When a window line came (s since the run's start), with its duty, burst share,
/// host share and share while tracing.
type WindowLine = (f64, Option<[f64; 4]>);

/// Count and time per bin.
type Bins = [(f64, f64); BINS];

/// Each bin's rate over the quiet bins' median, and the loss from it.
fn relative(bins: &Bins) -> Option<(Vec<f64>, f64)> {
    let rates: Vec<f64> = bins
        .iter()
        .map(|&(n, t)| if t > 0.0 { n / t } else { f64::NAN })
        .collect();
    if rates.iter().any(|r| !r.is_finite()) {
        return None;
    }
    let quiet = median(&rates[QUIET])?;
    let rel: Vec<f64> = rates.iter().map(|r| r / quiet).collect();
    let loss = 1.0 - rel.iter().sum::<f64>() / BINS as f64;
    Some((rel, loss))
}

/// Folds `(time, count)` samples on `edges` (the interval's phase zeroes).
pub fn fold(samples: &[(f64, u64)], edges: &[f64]) -> Option<Folded> {
    // Kept per interval for the jackknife.
    let mut per: Vec<Bins> = vec![[(0.0, 0.0); BINS]; edges.len()];
    for w in samples.windows(2) {
        let ((ta, na), (tb, nb)) = (w[0], w[1]);
        let mid = (ta + tb) / 2.0;
        let Some(i) = edges.iter().rposition(|&e| e <= mid) else {
            continue;
        };
        let bin = ((mid - edges[i]) / BIN) as usize;
        if bin < BINS {
            per[i][bin].0 += nb.saturating_sub(na) as f64;
            per[i][bin].1 += tb - ta;
        }
    }
    let sum = |skip: Option<usize>| {
        let mut s: Bins = [(0.0, 0.0); BINS];
        for (_, iv) in per.iter().enumerate().filter(|&(i, _)| Some(i) != skip) {
            for (a, b) in s.iter_mut().zip(iv) {
                (a.0, a.1) = (a.0 + b.0, a.1 + b.1);
            }
        }
        s
    };
    let (rel, loss) = relative(&sum(None))?;
    // The jackknife over intervals: how far the loss moves as each interval is left
    // out, which the host's hiccups within the run set; no model of them needed.
    let held: Vec<f64> = (0..per.len())
        .filter(|&i| per[i].iter().any(|&(_, t)| t > 0.0))
        .filter_map(|i| relative(&sum(Some(i))).map(|r| r.1))
        .collect();
    let n = held.len() as f64;
    let mean = held.iter().sum::<f64>() / n;
    let loss_se = (held.len() > 2)
        .then(|| ((n - 1.0) / n * held.iter().map(|l| (l - mean).powi(2)).sum::<f64>()).sqrt());
    Some(Folded {
        rel,
        loss,
        loss_se,
        intervals: edges.len().saturating_sub(1),
        duty: None,
        burst_share: None,
        host_share: None,
        claimed: None,
    })
}

/// One run of `secs` s under load: watched by `watch` (its stdout the JSON lines,
/// piped) or unwatched, folded on a 1 s clock from the same moment.
pub fn run(
    kind: Kind,
    secs: f64,
    server_cpu: Option<usize>,
    watch: Option<&dyn Fn(u32) -> Child>,
) -> Option<Folded> {
    let port = toffload_tests::harness::free_port().expect("port");
    let dir = std::env::temp_dir().join(format!("toffload-wphase-{port}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let srv = real::start_server(kind, port, &dir, server_cpu);
    let load = real::start_load(kind, port, secs + 3.0);
    std::thread::sleep(Duration::from_secs(1));
    let t0 = Instant::now();
    let windows: Arc<Mutex<Vec<WindowLine>>> = Arc::default();
    let mut w = watch.map(|f| f(srv.0.id()));
    if let Some(c) = w.as_mut() {
        let out = c.stdout.take().expect("the watcher's stdout piped");
        let windows = windows.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let at = t0.elapsed().as_secs_f64();
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                if let Some(win) = v.get("window") {
                    let wc = &win["watcher"];
                    let [d, b, h, s] = ["duty", "burst_share", "host_share", "share_traced"]
                        .map(|k| wc[k].as_f64());
                    let cost = d.zip(b).zip(h).zip(s).map(|(((d, b), h), s)| [d, b, h, s]);
                    windows.lock().unwrap().push((at, cost));
                }
            }
        });
    }
    let mut samples = Vec::new();
    let mut next = Instant::now();
    while t0.elapsed().as_secs_f64() < secs {
        if let Some(n) = real::served(kind, port) {
            samples.push((t0.elapsed().as_secs_f64(), n));
        }
        next += Duration::from_millis(25);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    if let Some(mut c) = w {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
        let _ = c.wait();
    }
    drop(load);
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
    let wins = windows.lock().unwrap().clone();
    let (edges, costs): (Vec<f64>, Vec<Option<[f64; 4]>>) = if watch.is_some() {
        wins.into_iter().skip(SKIP_WINDOWS).unzip()
    } else {
        // The same clock as a watch that attached now, whose first windows are skipped.
        (
            (SKIP_WINDOWS + 1..secs as usize)
                .map(|s| s as f64)
                .collect(),
            vec![],
        )
    };
    let mut f = fold(&samples, &edges)?;
    let costs: Vec<[f64; 4]> = costs.into_iter().flatten().collect();
    let med = |i: usize| median(&costs.iter().map(|c| c[i]).collect::<Vec<_>>());
    (f.duty, f.burst_share, f.host_share) = (med(0), med(1), med(2));
    // The share a window reports applies to the next interval's duty, which the same
    // window sets: the pairs match.
    f.claimed = median(&costs.iter().map(|c| c[3] * c[0] + c[1]).collect::<Vec<_>>());
    Some(f)
}
