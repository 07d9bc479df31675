//! Rendering: a text block per window, or one JSON object per line
//! ({"ts": ..., "schema": N, "header": ...}, {"ts": ..., "window": ...},
//! {"ts": ..., "inject": ...}, {"ts": ..., "final": ...}; docs/json-schema.md).

use crate::abi::ThreadInfo;
use crate::loader::Probes;
use crate::metrics::Window;
use crate::target::Runtime;
use serde::Serialize;
use std::fmt::Write as _;

#[derive(Clone, Debug, Serialize)]
pub struct Header {
    pub pid: u32,
    /// The service's other processes at attach (its tree, its cgroup); those forked
    /// later join the windows' process rows.
    pub also: Vec<u32>,
    pub comm: String,
    pub exe: String,
    pub runtime: Runtime,
    pub probes: Probes,
    /// Metrics lost to tracepoints the kernel lacks.
    pub missing: Vec<String>,
    /// Raw or classic scheduler tracepoints (loader.rs).
    pub sched_hooks: crate::loader::SchedHooks,
    /// Measured at start (pipe ping-pong on one CPU).
    pub context_switch_us: Option<f64>,
    /// What each traced event costs the target, measured at start (probe_cost.rs).
    pub probe_cost: Option<crate::probe_cost::ProbeCost>,
    /// Whether probe_cost was measured or is the default (calibration cut short).
    pub probe_cost_source: crate::probe_cost::CostSource,
}

#[derive(Clone, Debug, Serialize)]
pub struct ThreadRow {
    pub tid: u32,
    pub voluntary: u64,
    pub involuntary: u64,
    pub on_cpu_ms: f64,
    pub off_cpu_ms: f64,
    pub offload_calls: u64,
    pub futex_calls: u64,
    pub exited: bool,
}

impl ThreadRow {
    pub fn from(tid: u32, t: &ThreadInfo) -> ThreadRow {
        ThreadRow {
            tid,
            voluntary: t.vol,
            involuntary: t.invol,
            on_cpu_ms: t.on_ns as f64 / 1e6,
            off_cpu_ms: t.off_ns as f64 / 1e6,
            offload_calls: t.offload_calls,
            futex_calls: t.futex_calls,
            exited: t.flags & crate::abi::F_EXITED != 0,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Final {
    pub ended: Ended,
    pub total: Window,
    /// Busiest threads by context switches (the main thread always included).
    pub threads: Vec<ThreadRow>,
    /// The busiest futex call stacks, innermost frame first (symbols.rs).
    pub futex_stacks: Vec<StackRow>,
    /// The injection's last status, when one was made.
    pub injection: Option<crate::inject_flow::InjectionStatus>,
    /// How --inject ended; None without --inject.
    pub inject_outcome: Option<crate::inject_flow::InjectAction>,
}

/// Why a watch ended (in JSON the words shown).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Ended {
    /// --duration passed.
    #[serde(rename = "duration")]
    Duration,
    #[serde(rename = "process exited")]
    ProcessExited,
    /// The dashboard's q.
    #[serde(rename = "quit")]
    Quit,
    /// SIGINT.
    #[serde(rename = "interrupted")]
    Interrupted,
    /// SIGTERM.
    #[serde(rename = "terminated")]
    Terminated,
    /// An injection left the server down.
    #[serde(rename = "server down")]
    ServerDown,
    /// A scripted --inject was refused.
    #[serde(rename = "injection refused")]
    InjectionRefused,
    /// The windows asked for (the positional COUNT) were reported.
    #[serde(rename = "count")]
    Count,
}

impl Ended {
    pub fn as_str(self) -> &'static str {
        match self {
            Ended::Duration => "duration",
            Ended::ProcessExited => "process exited",
            Ended::Quit => "quit",
            Ended::Interrupted => "interrupted",
            Ended::Terminated => "terminated",
            Ended::ServerDown => "server down",
            Ended::InjectionRefused => "injection refused",
            Ended::Count => "count",
        }
    }
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct StackRow {
    /// Sampled calls (one futex call in 64 has its stack walked).
    pub calls: u64,
    /// `function+0xoff (module)`, else `module+0xoff`, else the bare address.
    pub frames: Vec<String>,
}

fn opt(v: Option<f64>, unit: &str) -> String {
    v.map(|x| format!("{x:.1}{unit}"))
        .unwrap_or_else(|| "-".into())
}

pub fn header_text(h: &Header) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "toffload-watch: pid {} ({}) {}", h.pid, h.comm, h.exe);
    if !h.also.is_empty() {
        let _ = writeln!(
            s,
            "  with {} more process(es) of the service: {}",
            h.also.len(),
            h.also
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    let _ = writeln!(
        s,
        "  runtime: {} ({})",
        h.runtime.kind.label(),
        h.runtime.evidence
    );
    if h.probes.offload.is_empty() && !h.probes.skipped.is_empty() {
        let _ = writeln!(s, "  offload: not probed (below)");
    } else if h.probes.offload.is_empty() {
        let _ = writeln!(
            s,
            "  offload: no offload entry point mapped; requests = socket reads"
        );
    } else {
        let _ = writeln!(s, "  offload: {}", h.probes.offload.join(", "));
    }
    for f in &h.probes.failed {
        let _ = writeln!(s, "  probe failed: {f}");
    }
    for f in &h.probes.skipped {
        let _ = writeln!(s, "  not probed: {f}");
    }
    let _ = writeln!(
        s,
        "  context switch cost: {} (measured)",
        opt(h.context_switch_us, " us")
    );
    if let Some(c) = &h.probe_cost {
        let _ = writeln!(
            s,
            "  watch cost per event: syscall {:.2} us, switch {:.2} us, offload {:.2} us ({})",
            c.syscall_ns / 1e3,
            c.switch_ns / 1e3,
            c.offload_ns / 1e3,
            match h.probe_cost_source {
                crate::probe_cost::CostSource::Measured => "measured",
                crate::probe_cost::CostSource::Cached => "measured earlier this boot",
                crate::probe_cost::CostSource::Default => "default: calibration cut short",
            }
        );
    }
    let _ = writeln!(s, "  scheduler hooks: {}", h.sched_hooks.label());
    for m in &h.missing {
        let _ = writeln!(s, "  MISSING metric: {m}");
    }
    s
}

/// A share as a whole percent ("-" when unknown).
fn pct(v: Option<f64>) -> String {
    v.map(|x| format!("{:.0}%", x * 100.0))
        .unwrap_or_else(|| "-".into())
}

/// The window's span and rate. Rates are per traced second; where part of the window
/// ran untraced, the rate without the watch follows.
fn rate_line(s: &mut String, w: &Window, title: &str) {
    let untraced = w
        .untraced
        .as_ref()
        .map(|u| {
            format!(
                "; untraced {:.0} req/s over {:.2} s ({})",
                u.requests_per_sec,
                u.secs,
                match u.source {
                    crate::untraced::UntracedSource::RuntimeCounters => "runtime's count",
                    crate::untraced::UntracedSource::IoCalls => "from read/write calls",
                }
            )
        })
        .unwrap_or_default();
    let _ = writeln!(
        s,
        "[{title} {:.1}s +{:.2}s traced of {:.2}s] {:.0} req/s ({} {}){untraced}",
        w.start_s, w.secs, w.wall_secs, w.requests_per_sec, w.requests, w.request_source
    );
}

/// The offload's stall, and how the stalls spun or blocked.
fn offload_lines(s: &mut String, w: &Window) {
    let o = &w.offload;
    let _ = writeln!(
        s,
        "  offload stall p50 {} p99 {} mean {}, spin share {}, wake-up share {} (latency to \
         completion p50 {}); CPU/request (excl. wait) {}",
        opt(o.stall_p50_us, " us"),
        opt(o.stall_p99_us, " us"),
        opt(o.stall_mean_us, " us"),
        pct(o.spin_share),
        pct(o.wake_share),
        opt(o.latency_p50_us, " us"),
        opt(w.cpu_per_request_us, " us"),
    );
    if o.calls > 0 {
        let _ = writeln!(
            s,
            "  stalls >= 90% on CPU (spun): {}, <= 10% on CPU (blocked): {}",
            pct(o.stalls_mostly_spinning),
            pct(o.stalls_mostly_blocked)
        );
    }
}

/// A request's CPU outside the offload, and its syscalls that slept there.
fn outside_line(s: &mut String, w: &Window) {
    let Some(c) = &w.outside_cpu else {
        return;
    };
    let _ = writeln!(
        s,
        "  CPU outside the offload per request: p10 {:.1} p25 {:.1} p50 {:.1} p90 {:.1} \
         us ({} requests); syscalls that slept there: {} per request at {} each, \
         asleep {} per request until woken (the time outside the server)",
        c.p10_us,
        c.p25_us,
        c.p50_us,
        c.p90_us,
        c.requests,
        w.slept_syscalls_per_request
            .map(|x| format!("{x:.2}"))
            .unwrap_or_else(|| "-".into()),
        opt(w.slept_syscall_us, " us"),
        opt(w.outside_wait_us, " us"),
    );
}

/// Futex origins, switches and wake-ups, threads and their waits.
fn scheduling_lines(s: &mut String, w: &Window) {
    let fp = w
        .futex_per_request
        .as_ref()
        .map(|p| {
            format!(
                " ({:.2} libc, {:.2} raw, {:.2} offload, {:.2} unknown per request)",
                p.libc, p.raw, p.offload, p.unknown
            )
        })
        .unwrap_or_default();
    let _ = writeln!(
        s,
        "  futex {} libc / {} raw / {} offload / {} unknown{fp}",
        w.futex.libc, w.futex.raw, w.futex.offload, w.futex.unknown
    );
    let _ = writeln!(
        s,
        "  switches {:.0}/s voluntary, {:.0}/s involuntary; wake-up latency p50 {} p99 {}",
        w.switches.voluntary_per_sec,
        w.switches.involuntary_per_sec,
        opt(w.wakeup_p50_us, " us"),
        opt(w.wakeup_p99_us, " us")
    );
    let _ = writeln!(
        s,
        "  threads {} (created {}, accepts {}, per accept {}); io_uring_enter {}; epoll/poll waits {}",
        w.threads,
        w.threads_created,
        w.accepts,
        w.threads_per_accept
            .map(|x| format!("{x:.2}"))
            .unwrap_or_else(|| "-".into()),
        w.io_uring_enters,
        w.mux_waits
    );
}

/// A service of several processes: who serves and how (one line each, busiest first
/// after the main one; a few dozen at most).
fn process_lines(s: &mut String, w: &Window) {
    if w.processes.len() <= 1 {
        return;
    }
    let _ = writeln!(s, "  processes {}:", w.processes.len());
    for p in w.processes.iter().take(12) {
        let _ = writeln!(
            s,
            "    {:>7} {:<15} {:<5} {:<22} {:>9.0} reads/s, {} threads ({} serving), {} connections, {:.0}% CPU{}",
            p.pid,
            p.comm,
            match p.role {
                crate::processes::Role::Main => "main",
                crate::processes::Role::Child => "child",
            },
            p.model.label(),
            p.reads_per_sec,
            p.threads,
            p.serving_threads,
            p.connections,
            p.cpu_share * 100.0,
            p.stall_mean_us
                .map(|s| format!(", {:.0} offloads/s, stall mean {s:.0} us", p.offloads_per_sec))
                .unwrap_or_default()
        );
    }
    if w.processes.len() > 12 {
        let _ = writeln!(s, "    ... {} more", w.processes.len() - 12);
    }
}

fn syscalls_line(s: &mut String, w: &Window) {
    let top: Vec<String> = w
        .syscalls_top
        .iter()
        .map(|r| format!("{} {:.0}/s {:.1}us", r.name, r.per_sec, r.mean_us))
        .collect();
    let _ = writeln!(s, "  syscalls: {}", top.join(", "));
}

/// The fiber runtime's counters, when the target runs under it.
fn runtime_lines(s: &mut String, w: &Window) {
    let Some(r) = &w.runtime_counters else {
        return;
    };
    let _ = writeln!(
        s,
        "  libtoffload.so: {} fibers ({} live) on {} carriers, {} offloads ({} parked, {} inline); \
         guard {}: {} conflicts, {} handlers serialized, {} faults on {} pages",
        r.fibers_created,
        r.fibers_live,
        r.carriers,
        r.offloads,
        r.offloads_parked,
        r.offloads_inline,
        r.guard.name(),
        r.guard_conflicts,
        r.guard_serialized,
        r.guard_faults,
        r.guard_pages
    );
    if r.handoffs > 0 {
        let _ = writeln!(
            s,
            "  handoffs: {} ({:.1}/s): a carrier blocked below libc handed its other fibers \
             to a spare thread",
            r.handoffs,
            r.handoffs as f64 / w.secs.max(1e-9)
        );
    }
    if r.guard_released > 0 {
        let _ = writeln!(
            s,
            "  WARNING: the guard gave up {} page(s) (an ownership cycle, a page a real \
             thread touched, or a 30 s wait): updates to them are no longer protected",
            r.guard_released
        );
    }
}

/// The runtime's own latency percentiles, when its counters carry them.
fn runtime_latency_line(s: &mut String, w: &Window) {
    if let Some(l) = &w.runtime_latency {
        let _ = writeln!(
            s,
            "  runtime latency: requests {}; offload wait {}",
            latency_text(&l.request),
            latency_text(&l.offload_wait)
        );
    }
}

/// Threads the kernel's table missed, and what the watch cost.
fn watch_lines(s: &mut String, w: &Window) {
    if w.threads_missed > 0 {
        let _ = writeln!(
            s,
            "  WARNING: {} threads did not fit the kernel's thread table; their scheduler \
             numbers are missing",
            w.threads_missed
        );
    }
    if let Some(c) = &w.watcher {
        let budget = c
            .budget
            .map(|b| format!(" (budget {:.1}%)", b * 100.0))
            .unwrap_or_default();
        let burst = if w.secs < w.wall_secs && c.burst_share > 0.0 {
            format!(", attach and detach {:.2}% a burst", c.burst_share * 100.0)
        } else {
            String::new()
        };
        let host = if c.host_share > 0.0 {
            format!(" (+{:.1}% on other processes)", c.host_share * 100.0)
        } else {
            String::new()
        };
        let basis = match (c.basis, c.calibrated_us_per_request) {
            (crate::metrics::CostBasis::Measured, Some(cal)) => {
                format!(
                    " (measured on the target, traced less untraced CPU; calibrated {cal:.1} us)"
                )
            }
            _ => String::new(),
        };
        // At the least duty (session::duty_floor) the budget may still be exceeded:
        // say so, with what the interval costs there (equal to the budget wherever the
        // duty is not floored).
        let over = match c.budget {
            Some(b) if c.duty < 1.0 && w.secs < w.wall_secs => {
                let avg = c.interval_share();
                if avg > b * 1.01 {
                    format!(
                        ", the least: {:.2}% of its CPU, over the budget",
                        avg * 100.0
                    )
                } else {
                    String::new()
                }
            }
            _ => String::new(),
        };
        let _ = writeln!(
            s,
            "  watch cost: {} per request{basis}, {:.1}% of the target's CPU while tracing{host}{burst}; \
             tracing {:.1}% of the next interval{budget}{over}",
            opt(c.us_per_request, " us"),
            c.share_traced * 100.0,
            c.duty * 100.0
        );
    }
}

pub fn window_text(w: &Window, title: &str) -> String {
    let mut s = String::new();
    rate_line(&mut s, w, title);
    offload_lines(&mut s, w);
    outside_line(&mut s, w);
    scheduling_lines(&mut s, w);
    process_lines(&mut s, w);
    syscalls_line(&mut s, w);
    runtime_lines(&mut s, w);
    runtime_latency_line(&mut s, w);
    watch_lines(&mut s, w);
    let _ = writeln!(s, "  verdict: {} -- {}", w.verdict.label, w.verdict.because);
    if let Some(a) = &w.model {
        s += &model_text(a);
    }
    if let Some(st) = &w.injection {
        s += &injection_text(st);
    }
    s
}

pub fn inject_text(i: &crate::inject_flow::InjectEvent) -> String {
    let mut s = format!("inject [{}] pid {}", i.action, i.old_pid);
    if let Some(n) = i.new_pid {
        let _ = write!(s, " -> {n}");
    }
    let _ = writeln!(s, ": {}", i.message);
    let _ = writeln!(s, "  verdict: {}", i.verdict);
    if let (Some(b), Some(p)) = (i.before_rps, i.predicted_speedup) {
        let _ = writeln!(
            s,
            "  before {b:.0} req/s; predicted {p:.2}x{}",
            i.predicted_rps
                .map(|r| format!(" ({r:.0} req/s)"))
                .unwrap_or_default()
        );
    }
    if let Some(plan) = &i.plan {
        s += plan;
    }
    s
}

pub fn model_text(a: &crate::model::Assessment) -> String {
    let mut s = String::new();
    match (&a.zero_edit, a.zero_edit_speedup) {
        (Some(p), _) => {
            let _ = writeln!(s, "  predicted (zero-edit): {}", p.summary());
            let terms: Vec<String> = p.lines().iter().map(|(k, v)| format!("{k} {v}")).collect();
            let _ = writeln!(s, "    inputs: {}", terms.join("; "));
        }
        (None, Some(x)) => {
            let _ = writeln!(s, "  predicted (zero-edit): {x:.2}x");
        }
        (None, None) => {}
    }
    if let Some(stop) = &a.stop {
        let _ = writeln!(s, "  STOP: {stop}");
    }
    if let Some(r) = &a.recipe_text {
        let _ = writeln!(s, "  minimal edit: {r}");
    }
    s
}

pub fn injection_text(st: &crate::inject_flow::InjectionStatus) -> String {
    let f = |v: Option<f64>, unit: &str| {
        v.map(|x| format!("{x:.2}{unit}"))
            .unwrap_or_else(|| "-".into())
    };
    format!(
        "  injected pid {} -> {}: before {:.0} req/s, after {} req/s ({} windows): measured {}, \
         predicted {}, prediction error {}\n",
        st.old_pid,
        st.new_pid,
        st.before_rps,
        st.after_rps
            .map(|x| format!("{x:.0}"))
            .unwrap_or_else(|| "-".into()),
        st.after_windows,
        f(st.measured_speedup, "x"),
        f(st.predicted_speedup, "x"),
        st.prediction_error
            .map(|e| format!("{:+.0}%", e * 100.0))
            .unwrap_or_else(|| "-".into()),
    )
}

pub fn final_text(f: &Final) -> String {
    let mut s = window_text(&f.total, &format!("TOTAL ({})", f.ended));
    if let Some(st) = &f.injection {
        s += &injection_text(st);
    }
    for t in &f.threads {
        let _ = writeln!(
            s,
            "  thread {}{}: {} vol / {} invol switches, on {:.1} ms, off {:.1} ms, {} offloads, {} futex",
            t.tid,
            if t.exited { " (exited)" } else { "" },
            t.voluntary,
            t.involuntary,
            t.on_cpu_ms,
            t.off_cpu_ms,
            t.offload_calls,
            t.futex_calls
        );
    }
    for st in &f.futex_stacks {
        let _ = writeln!(s, "  futex stack x{}: {}", st.calls, st.frames.join(" <- "));
    }
    s
}

/// "p50 X us, p99 Y us, p99.9 Z us (N)", or "none" for a window that counted none.
fn latency_text(p: &crate::runtime_counters::LatencyPercentiles) -> String {
    match (p.p50_us, p.p99_us, p.p999_us) {
        (Some(a), Some(b), Some(c)) => {
            format!(
                "p50 {a:.0} us, p99 {b:.0} us, p99.9 {c:.0} us ({})",
                p.count
            )
        }
        _ => "none".into(),
    }
}

/// The version of the JSON lines' layout (docs/json-schema.md), in the header line.
/// Raised whenever a line type or a key is added, renamed or removed, or a value
/// changes its unit or meaning: tests/json_keys.txt pins the keys, and the test
/// below fails until this and KEYS_FINGERPRINT are raised with it.
pub const SCHEMA: u32 = 10;

/// FNV-1a of the key lines of tests/json_keys.txt at this SCHEMA.
#[cfg(test)]
const KEYS_FINGERPRINT: u64 = 0x4c04_b3b4_d1ad_12f5;

/// The kind of a JSON line: its one key besides the envelope's (`ts`, `schema`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineType {
    Header,
    Window,
    Inject,
    Final,
}

impl LineType {
    pub fn key(self) -> &'static str {
        match self {
            LineType::Header => "header",
            LineType::Window => "window",
            LineType::Inject => "inject",
            LineType::Final => "final",
        }
    }
}

/// One JSON line: `{"ts":UNIX,"TYPE":{...}}`, the header's with `"schema":N`
/// between. `ts` is the wall clock when the line was written, in Unix seconds to the
/// millisecond.
pub fn json_line<T: Serialize>(ty: LineType, v: &T, ts: f64) -> String {
    let body = serde_json::to_string(v).unwrap_or_else(|_| "null".into());
    let schema = match ty {
        LineType::Header => format!("\"schema\":{SCHEMA},"),
        _ => String::new(),
    };
    format!("{{\"ts\":{ts:.3},{schema}\"{}\":{body}}}", ty.key())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The window's text keeps its lines and their order (each line is written by a
    /// helper of window_text).
    #[test]
    fn window_text_lines_in_order() {
        use crate::abi;
        use crate::collector::Snapshot;
        let prev = Snapshot::zero();
        let mut cur = Snapshot::zero();
        cur.t = 1.0;
        cur.counters[abi::C_OFFLOAD_CALLS as usize] = 100;
        cur.counters[abi::C_OFFLOAD_NS as usize] = 100 * 200_000;
        cur.counters[abi::C_THREADS_MISSED as usize] = 3;
        cur.stall.counts[abi::fine_bucket(200_000) as usize] = 100;
        cur.outside.counts[abi::fine_bucket(20_000) as usize] = 100;
        cur.runtime = Some(crate::runtime_counters::RuntimeCounters {
            guard_released: 1,
            ..Default::default()
        });
        let ctx = crate::metrics::Context {
            runtime: crate::target::Runtime {
                kind: crate::target::RuntimeKind::GlibcDynamic,
                dynamic: true,
                evidence: String::new(),
            },
            offload_probed: true,
            root: 1,
            unroutable: Vec::new(),
        };
        let mut w = crate::metrics::window(&prev, &cur, &ctx);
        w.watcher = Some(crate::metrics::WatcherCost {
            us_per_request: Some(1.0),
            share_traced: 0.01,
            calibrated_us_per_request: Some(1.0),
            measured_us_per_request: None,
            basis: crate::metrics::CostBasis::Calibrated,
            host_share: 0.004,
            burst_share: 0.001,
            duty: 1.0,
            budget: None,
        });
        let text = window_text(&w, "window");
        let starts: Vec<&str> = text
            .lines()
            .map(|l| l.trim_start().split([' ', ':']).next().unwrap_or(""))
            .collect();
        assert_eq!(
            starts,
            [
                "[window",
                "offload",
                "stalls",
                "CPU",
                "futex",
                "switches",
                "threads",
                "syscalls",
                "libtoffload.so",
                "WARNING",
                "WARNING",
                "watch",
                "verdict"
            ],
            "{text}"
        );
        assert!(text
            .starts_with("[window 0.0s +1.00s traced of 0.00s] 100 req/s (100 offload calls)\n"));
    }

    /// A cost measured above the calibration's says so, and a sampled window at the
    /// least duty whose cost still exceeds the budget says that too.
    #[test]
    fn a_measured_cost_and_a_budget_over_at_the_least_duty_are_said() {
        use crate::collector::Snapshot;
        let prev = Snapshot::zero();
        let mut cur = Snapshot::zero();
        cur.t = 0.02;
        cur.wall = 1.0;
        let mut w = crate::metrics::window(&prev, &cur, &crate::metrics::tests::ctx());
        let cost = crate::metrics::WatcherCost {
            us_per_request: Some(5.2),
            share_traced: 0.32,
            calibrated_us_per_request: Some(1.9),
            measured_us_per_request: Some(5.2),
            basis: crate::metrics::CostBasis::Measured,
            host_share: 0.07,
            burst_share: 0.001,
            duty: crate::session::MIN_DUTY,
            budget: Some(0.005),
        };
        w.watcher = Some(cost);
        let text = window_text(&w, "window");
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("watch cost"))
            .expect("a watch cost line");
        assert!(
            line.contains("5.2 us per request (measured on the target"),
            "{line}"
        );
        assert!(line.contains("calibrated 1.9 us"), "{line}");
        // (0.32 + 0.07) x 2% + 0.1% = 0.88%.
        assert!(
            line.contains("the least: 0.88% of its CPU, over the budget"),
            "{line}"
        );
        // Within the budget, or calibrated: neither is said.
        w.watcher = Some(crate::metrics::WatcherCost {
            share_traced: 0.1,
            host_share: 0.0,
            basis: crate::metrics::CostBasis::Calibrated,
            ..cost
        });
        let text = window_text(&w, "window");
        assert!(!text.contains("over the budget"), "{text}");
        assert!(!text.contains("measured on the target"), "{text}");
    }
    #[test]
    fn envelope() {
        #[derive(Serialize)]
        struct X {
            a: u32,
        }
        let h: serde_json::Value =
            serde_json::from_str(&json_line(LineType::Header, &X { a: 1 }, 1700000000.1234))
                .expect("JSON");
        assert_eq!(h["schema"], SCHEMA);
        assert_eq!(h["ts"].as_f64(), Some(1700000000.123));
        assert_eq!(h["header"]["a"], 1);
        assert_eq!(h.as_object().map(|o| o.len()), Some(3));
        let w: serde_json::Value =
            serde_json::from_str(&json_line(LineType::Window, &X { a: 2 }, 5.0)).expect("JSON");
        assert_eq!(w.as_object().map(|o| o.len()), Some(2), "{w}");
        assert_eq!(w["window"]["a"], 2);
    }

    /// Every pinned key is named in docs/json-schema.md (in backticks or after a dot,
    /// as `total.futex.libc` names futex and libc), so a key added to the pin without
    /// its line in the doc fails here.
    #[test]
    fn the_schema_doc_names_every_pinned_key() {
        let doc = include_str!("../../../docs/json-schema.md");
        let keys = include_str!("../../tests/json_keys.txt");
        let named = |leaf: &str| {
            ["`", "."].iter().any(|pre| {
                ["`", ".", "["]
                    .iter()
                    .any(|post| doc.contains(&format!("{pre}{leaf}{post}")))
            })
        };
        let missing: Vec<&str> = keys
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter(|l| {
                let path = l.split_once(' ').map_or(*l, |(_, p)| p);
                let leaf = path
                    .rsplit(['.', '[', ']'])
                    .find(|s| !s.is_empty())
                    .unwrap_or(path);
                !named(leaf)
            })
            .collect();
        assert!(
            missing.is_empty(),
            "keys not in docs/json-schema.md: {missing:?}"
        );
    }

    /// A change to the pinned keys must come with a new SCHEMA (and the doc's
    /// changelog): this fails until both constants are raised together.
    #[test]
    fn schema_follows_the_pinned_keys() {
        let keys = include_str!("../../tests/json_keys.txt");
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for line in keys
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            for b in line.bytes().chain([b'\n']) {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        assert_eq!(
            (SCHEMA, h),
            (SCHEMA, KEYS_FINGERPRINT),
            "tests/json_keys.txt changed: raise report::SCHEMA, set KEYS_FINGERPRINT to \
             {h:#x}, and say what changed in docs/json-schema.md"
        );
    }
}
