//! /status: the targets as JSON, for a person or a script asking what the service
//! watches now (which pids, since which attach, the last window in brief).

use super::exposition::verdict_name;
use super::state::{Phase, TargetState};
use serde::Serialize;

/// The document's version: bumped when a field changes meaning or goes.
pub const SCHEMA: u32 = 1;

#[derive(Serialize)]
struct Status<'a> {
    schema: u32,
    listen: String,
    interval_s: f64,
    overhead_budget: f64,
    targets: Vec<Target<'a>>,
}

#[derive(Serialize)]
struct Target<'a> {
    name: &'a str,
    selector: Selector,
    state: &'static str,
    /// Why it is not watched (searching), or the last error.
    why: Option<&'a str>,
    pid: Option<u32>,
    pids: Vec<u32>,
    comm: &'a str,
    exe: &'a str,
    attaches: u64,
    exits: u64,
    windows: u64,
    last_window: Option<LastWindow>,
}

#[derive(Serialize)]
struct Selector {
    kind: &'static str,
    value: String,
}

#[derive(Serialize)]
struct LastWindow {
    ts: f64,
    wall_secs: f64,
    requests: u64,
    requests_per_sec: f64,
    request_source: String,
    stall_p50_us: Option<f64>,
    stall_p99_us: Option<f64>,
    spin_share: Option<f64>,
    verdict: String,
    predicted_speedup: Option<f64>,
}

/// The status document.
pub fn render(
    targets: &[TargetState],
    listen: std::net::SocketAddr,
    interval: std::time::Duration,
    budget: f64,
) -> String {
    let targets = targets.iter().map(target).collect();
    let s = Status {
        schema: SCHEMA,
        listen: listen.to_string(),
        interval_s: interval.as_secs_f64(),
        overhead_budget: budget,
        targets,
    };
    serde_json::to_string_pretty(&s)
        .unwrap_or_else(|e| format!("{{\"error\": {:?}}}", e.to_string()))
}

fn target(t: &TargetState) -> Target<'_> {
    let (pid, pids, why) = match &t.phase {
        Phase::Up { pid, pids } => (Some(*pid), pids.clone(), t.last_error.as_deref()),
        Phase::Attaching { pid } => (Some(*pid), vec![*pid], None),
        Phase::Searching { why } => (None, Vec::new(), Some(why.as_str())),
    };
    let up = matches!(t.phase, Phase::Up { .. });
    Target {
        name: &t.target.name,
        selector: Selector {
            kind: t.target.selector.kind(),
            value: t.target.selector.value(),
        },
        state: t.phase.name(),
        why,
        pid,
        pids,
        comm: &t.comm,
        exe: &t.exe,
        attaches: t.attaches,
        exits: t.exits,
        windows: t.windows,
        last_window: t.window.as_ref().filter(|_| up).map(|w| LastWindow {
            ts: w.ts,
            wall_secs: w.wall_secs,
            requests: w.requests,
            requests_per_sec: w.requests_per_sec,
            request_source: w.request_source.to_string(),
            stall_p50_us: w.offload.stall_p50_us,
            stall_p99_us: w.offload.stall_p99_us,
            spin_share: w.offload.spin_share,
            verdict: verdict_name(w),
            predicted_speedup: w.model.as_ref().and_then(|m| m.zero_edit_speedup),
        }),
    }
}
