//! /metrics: each target's last completed window in the Prometheus text format
//! (OpenMetrics, as prometheus-client encodes it), labelled target="NAME". A fresh
//! registry per scrape: a target whose window is gone (it exited) or whose verdict
//! changed leaves no stale series behind.

use super::state::{Phase, TargetState};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// The content type of what `render` returns.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;
type GaugeF = Family<Labels, Gauge<f64, AtomicU64>>;
type CounterU = Family<Labels, Counter<u64>>;

/// The service's own use of the host, read at the scrape.
#[derive(Clone, Copy, Debug, Default)]
pub struct Own {
    pub cpu_secs: f64,
    pub rss_bytes: f64,
}

impl Own {
    /// This process's CPU time (utime + stime) and resident set, from /proc/self.
    pub fn read() -> Own {
        let cpu_secs = crate::untraced::cpu_secs(std::process::id()).unwrap_or(0.0);
        // SAFETY: sysconf with a valid name has no other effect.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
        let rss_bytes = std::fs::read_to_string("/proc/self/statm")
            .ok()
            .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
            .map_or(0.0, |pages| pages * page);
        Own {
            cpu_secs,
            rss_bytes,
        }
    }
}

/// Registers and returns a family of gauges.
fn gauge(r: &mut Registry, name: &str, help: &str) -> GaugeF {
    let f = GaugeF::default();
    r.register(name, help, f.clone());
    f
}

/// Registers and returns a family of counters (encoded with the `_total` suffix).
fn counter(r: &mut Registry, name: &str, help: &str) -> CounterU {
    let f = CounterU::default();
    r.register(name, help, f.clone());
    f
}

fn labels(target: &str, extra: &[(&str, &str)]) -> Labels {
    std::iter::once(("target".to_string(), target.to_string()))
        .chain(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())))
        .collect()
}

/// Every family /metrics has, registered in the order they print.
struct Families {
    up: GaugeF,
    pid: GaugeF,
    attaches: CounterU,
    exits: CounterU,
    ts: GaugeF,
    wall: GaugeF,
    traced: GaugeF,
    requests: GaugeF,
    rps: GaugeF,
    traced_rps: GaugeF,
    stall: GaugeF,
    stall_mean: GaugeF,
    spin: GaugeF,
    futex: GaugeF,
    switches: GaugeF,
    cpu_per_req: GaugeF,
    threads: GaugeF,
    verdict: GaugeF,
    speedup: GaugeF,
    overhead: GaugeF,
    budget: GaugeF,
    rt_fibers: GaugeF,
    rt_carriers: GaugeF,
    rt_offloads: CounterU,
    rt_parked: CounterU,
    rt_guard_faults: CounterU,
    rt_guard_conflicts: CounterU,
    rt_request_latency: GaugeF,
    rt_offload_wait: GaugeF,
    own_cpu: Counter<f64, AtomicU64>,
    own_rss: Gauge<f64, AtomicU64>,
}

impl Families {
    fn register(r: &mut Registry) -> Families {
        let own_cpu = Counter::<f64, AtomicU64>::default();
        let own_rss = Gauge::<f64, AtomicU64>::default();
        let f = Families {
            up: gauge(r, "toffload_target_up", "1 while the target is watched, 0 while it is searched for"),
            pid: gauge(r, "toffload_target_pid", "The watched root process (0 while searched for)"),
            attaches: counter(r, "toffload_target_attaches", "Times the target was found and attached"),
            exits: counter(r, "toffload_target_exits", "Times the watched target went away (its root process exited)"),
            ts: gauge(r, "toffload_window_timestamp_seconds", "Unix time at the end of the window these values are from"),
            wall: gauge(r, "toffload_window_seconds", "Wall-clock seconds the window spans (it ends at toffload_window_timestamp_seconds)"),
            traced: gauge(r, "toffload_window_traced_share", "Share of the window's wall time that was traced (rates are per traced second)"),
            requests: gauge(r, "toffload_window_requests", "Requests the window counted (over its traced part)"),
            rps: gauge(r, "toffload_requests_per_second", "Requests served per second: the window's untraced part where it was sampled, else its traced part"),
            traced_rps: gauge(r, "toffload_traced_requests_per_second", "Requests per traced second (offload calls, or socket reads where no offload is probed)"),
            stall: gauge(r, "toffload_offload_stall_seconds", "Offload stall quantiles in the window"),
            stall_mean: gauge(r, "toffload_offload_stall_mean_seconds", "Mean offload stall in the window"),
            spin: gauge(r, "toffload_offload_spin_share", "Share of the offload stall time the waiting thread was on CPU"),
            futex: gauge(r, "toffload_futex_waits_per_request", "Futex calls per request, by where they came from"),
            switches: gauge(r, "toffload_context_switches_per_second", "Context switches per traced second, voluntary and involuntary"),
            cpu_per_req: gauge(r, "toffload_cpu_per_request_seconds", "On-CPU time per request, the stall's on-CPU part included"),
            threads: gauge(r, "toffload_threads", "Threads of the target's processes in the window"),
            verdict: gauge(r, "toffload_verdict", "The verdict: 1 for the window's kind"),
            speedup: gauge(r, "toffload_predicted_speedup", "The model's predicted zero-edit speedup"),
            overhead: gauge(r, "toffload_watcher_overhead_share", "The watch's cost (to the target, and through the syscall hooks to the host's other processes) as a share of the target's CPU, averaged over the window"),
            budget: gauge(r, "toffload_watcher_overhead_budget_share", "The overhead budget the tracing duty follows"),
            rt_fibers: gauge(r, "toffload_runtime_fibers_live", "Injected runtime: live fibers"),
            rt_carriers: gauge(r, "toffload_runtime_carriers", "Injected runtime: carrier threads"),
            rt_offloads: counter(r, "toffload_runtime_offloads", "Injected runtime: offloads, over traced time"),
            rt_parked: counter(r, "toffload_runtime_offloads_parked", "Injected runtime: offloads whose fiber parked"),
            rt_guard_faults: counter(r, "toffload_runtime_guard_faults", "Injected runtime: conflict guard faults"),
            rt_guard_conflicts: counter(r, "toffload_runtime_guard_conflicts", "Injected runtime: conflict guard conflicts"),
            rt_request_latency: gauge(r, "toffload_runtime_request_latency_seconds", "Injected runtime: request latency quantiles in the window, as the runtime sees it (readable to the next write)"),
            rt_offload_wait: gauge(r, "toffload_runtime_offload_wait_seconds", "Injected runtime: offload wait quantiles in the window (submit to the fiber going on)"),
            own_cpu: own_cpu.clone(),
            own_rss: own_rss.clone(),
        };
        r.register(
            "toffload_serve_cpu_seconds",
            "CPU time of the service itself",
            own_cpu,
        );
        r.register(
            "toffload_serve_resident_memory_bytes",
            "Resident memory of the service itself",
            own_rss,
        );
        f
    }
}

/// The targets' last windows and the service's own use, encoded.
pub fn render(targets: &[TargetState], own: Own) -> String {
    let mut r = Registry::default();
    let f = Families::register(&mut r);
    for t in targets {
        target(&f, t);
    }
    f.own_cpu.inc_by(own.cpu_secs);
    f.own_rss.set(own.rss_bytes);
    let mut out = String::new();
    // Writing into a String cannot fail; an encoder error would be a bug in a label.
    if let Err(e) = encode(&mut out, &r) {
        out = format!("# encoding failed: {e}\n# EOF\n");
    }
    out
}

fn target(f: &Families, t: &TargetState) {
    let name = t.target.name.as_str();
    let l = labels(name, &[]);
    let (up, pid) = match &t.phase {
        Phase::Up { pid, .. } => (1.0, *pid),
        Phase::Attaching { pid } => (0.0, *pid),
        Phase::Searching { .. } => (0.0, 0),
    };
    f.up.get_or_create(&l).set(up);
    f.pid.get_or_create(&l).set(f64::from(pid));
    f.attaches.get_or_create(&l).inc_by(t.attaches);
    f.exits.get_or_create(&l).inc_by(t.exits);
    // Window values only while up: a window of a process that has gone is not served.
    let Some(w) = t.window.as_ref().filter(|_| up == 1.0) else {
        return;
    };
    f.ts.get_or_create(&l).set(w.ts);
    f.wall.get_or_create(&l).set(w.wall_secs);
    if w.wall_secs > 0.0 {
        f.traced
            .get_or_create(&l)
            .set((w.secs / w.wall_secs).min(1.0));
    }
    // The served rate: a short burst misses the requests in flight at its edges
    // (untraced.rs), so a sampled window's rate comes from its untraced part.
    f.rps
        .get_or_create(&l)
        .set(crate::inject_flow::served_rps(w));
    f.traced_rps.get_or_create(&l).set(w.requests_per_sec);
    f.requests.get_or_create(&l).set(w.requests as f64);
    let o = &w.offload;
    for (q, v) in [
        ("0.01", o.stall_p1_us),
        ("0.5", o.stall_p50_us),
        ("0.99", o.stall_p99_us),
    ] {
        if let Some(us) = v {
            f.stall
                .get_or_create(&labels(name, &[("quantile", q)]))
                .set(us / 1e6);
        }
    }
    if let Some(us) = o.stall_mean_us {
        f.stall_mean.get_or_create(&l).set(us / 1e6);
    }
    if let Some(s) = o.spin_share {
        f.spin.get_or_create(&l).set(s);
    }
    if let Some(p) = &w.futex_per_request {
        for (origin, v) in [
            ("libc", p.libc),
            ("raw", p.raw),
            ("offload", p.offload),
            ("unknown", p.unknown),
        ] {
            f.futex
                .get_or_create(&labels(name, &[("origin", origin)]))
                .set(v);
        }
    }
    for (kind, v) in [
        ("voluntary", w.switches.voluntary_per_sec),
        ("involuntary", w.switches.involuntary_per_sec),
    ] {
        f.switches
            .get_or_create(&labels(name, &[("kind", kind)]))
            .set(v);
    }
    if let Some(us) = w.on_cpu_per_request_us {
        f.cpu_per_req.get_or_create(&l).set(us / 1e6);
    }
    f.threads.get_or_create(&l).set(w.threads as f64);
    f.verdict
        .get_or_create(&labels(name, &[("verdict", &verdict_name(w))]))
        .set(1.0);
    if let Some(s) = w.model.as_ref().and_then(|m| m.zero_edit_speedup) {
        f.speedup.get_or_create(&l).set(s);
    }
    if let Some(c) = &w.watcher {
        let traced = if w.wall_secs > 0.0 {
            (w.secs / w.wall_secs).min(1.0)
        } else {
            1.0
        };
        // A sampled window also paid its burst's attach and detach.
        let fixed = if traced < 1.0 { c.burst_share } else { 0.0 };
        f.overhead
            .get_or_create(&l)
            .set((c.share_traced + c.host_share) * traced + fixed);
        if let Some(b) = c.budget {
            f.budget.get_or_create(&l).set(b);
        }
    }
    if let Some(rc) = &w.runtime_counters {
        f.rt_fibers.get_or_create(&l).set(rc.fibers_live as f64);
        f.rt_carriers.get_or_create(&l).set(rc.carriers as f64);
        f.rt_offloads.get_or_create(&l).inc_by(rc.offloads);
        f.rt_parked.get_or_create(&l).inc_by(rc.offloads_parked);
        f.rt_guard_faults.get_or_create(&l).inc_by(rc.guard_faults);
        f.rt_guard_conflicts
            .get_or_create(&l)
            .inc_by(rc.guard_conflicts);
    }
    if let Some(lat) = &w.runtime_latency {
        for (family, p) in [
            (&f.rt_request_latency, &lat.request),
            (&f.rt_offload_wait, &lat.offload_wait),
        ] {
            for (q, v) in [("0.5", p.p50_us), ("0.99", p.p99_us), ("0.999", p.p999_us)] {
                if let Some(us) = v {
                    family
                        .get_or_create(&labels(name, &[("quantile", q)]))
                        .set(us / 1e6);
                }
            }
        }
    }
}

/// The verdict's kind as JSON spells it (snake_case: fiberizable, event_loop, ...).
pub fn verdict_name(w: &crate::metrics::Window) -> String {
    serde_json::to_value(w.verdict.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collector::Snapshot;
    use crate::metrics::{window, Context};
    use crate::serve::config::{Selector, Target};
    use crate::target::{Runtime, RuntimeKind};

    /// A window of 1000 offload calls of 200 us over 2 s.
    fn synthetic() -> crate::metrics::Window {
        let ctx = Context {
            runtime: Runtime {
                kind: RuntimeKind::GlibcDynamic,
                dynamic: true,
                evidence: String::new(),
            },
            offload_probed: true,
            root: 1,
            unroutable: Vec::new(),
        };
        let mut cur = Snapshot::zero();
        cur.t = 2.0;
        cur.wall = 2.0;
        cur.unix = 1_700_000_000.0;
        cur.counters[crate::abi::C_OFFLOAD_CALLS as usize] = 1000;
        cur.counters[crate::abi::C_OFFLOAD_NS as usize] = 1000 * 200_000;
        cur.counters[crate::abi::C_VOL as usize] = 1000;
        cur.stall.counts[crate::abi::fine_bucket(200_000) as usize] = 1000;
        cur.live_threads = 4;
        window(&Snapshot::zero(), &cur, &ctx)
    }

    fn state(name: &str, phase: Phase, w: Option<crate::metrics::Window>) -> TargetState {
        TargetState {
            target: Target {
                name: name.into(),
                selector: Selector::Process(name.into()),
            },
            phase,
            comm: name.into(),
            exe: String::new(),
            window: w,
            windows: 1,
            attaches: 2,
            exits: 1,
            last_error: None,
        }
    }

    fn parse(text: &str) -> Vec<prometheus_parse::Sample> {
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
            .expect("parses")
            .samples
    }

    fn get(s: &[prometheus_parse::Sample], metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
        s.iter()
            .find(|x| x.metric == metric && labels.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
            .map(|x| match x.value {
                prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => f64::NAN,
            })
    }

    #[test]
    fn an_up_target_has_its_window_a_searched_one_only_up_0() {
        let up = state(
            "web",
            Phase::Up {
                pid: 42,
                pids: vec![42, 43],
            },
            Some(synthetic()),
        );
        let gone = state(
            "db",
            Phase::Searching { why: "no".into() },
            Some(synthetic()),
        );
        let text = render(
            &[up, gone],
            Own {
                cpu_secs: 1.5,
                rss_bytes: 1e6,
            },
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
        let s = parse(&text);
        let web = [("target", "web")];
        assert_eq!(get(&s, "toffload_target_up", &web), Some(1.0));
        assert_eq!(get(&s, "toffload_target_pid", &web), Some(42.0));
        assert_eq!(get(&s, "toffload_target_attaches_total", &web), Some(2.0));
        assert_eq!(get(&s, "toffload_requests_per_second", &web), Some(500.0));
        assert_eq!(get(&s, "toffload_window_requests", &web), Some(1000.0));
        assert_eq!(get(&s, "toffload_window_seconds", &web), Some(2.0));
        let p50 = get(
            &s,
            "toffload_offload_stall_seconds",
            &[("target", "web"), ("quantile", "0.5")],
        )
        .expect("p50");
        assert!((p50 - 200e-6).abs() < 200e-6 * 0.07, "{p50}");
        assert_eq!(
            get(
                &s,
                "toffload_context_switches_per_second",
                &[("target", "web"), ("kind", "voluntary")]
            ),
            Some(500.0)
        );
        let v = w_verdict(&s, "web");
        assert_eq!(v.len(), 1, "{v:?}");
        // The target that is searched for has no window values.
        let db = [("target", "db")];
        assert_eq!(get(&s, "toffload_target_up", &db), Some(0.0));
        assert_eq!(get(&s, "toffload_requests_per_second", &db), None);
        assert_eq!(get(&s, "toffload_serve_cpu_seconds_total", &[]), Some(1.5));
        // A stock server's runtime measures no latency: no such series.
        assert_eq!(
            get(
                &s,
                "toffload_runtime_request_latency_seconds",
                &[("target", "web"), ("quantile", "0.5")]
            ),
            None
        );
    }

    /// An injected target's request latency and offload wait, per quantile.
    #[test]
    fn runtime_latency_quantiles_are_exported() {
        let mut w = synthetic();
        let mut req = vec![0u64; toffload_abi::runtime::LAT_BUCKETS];
        req[toffload_abi::runtime::latency_bucket(300_000)] = 100;
        let mut wait = vec![0u64; toffload_abi::runtime::LAT_BUCKETS];
        wait[toffload_abi::runtime::latency_bucket(200_000)] = 100;
        w.runtime_latency = Some(
            crate::runtime_counters::RuntimeLatency {
                request: crate::hist::Hist::fine(req),
                offload_wait: crate::hist::Hist::fine(wait),
            }
            .summary(),
        );
        let up = state(
            "web",
            Phase::Up {
                pid: 42,
                pids: vec![42],
            },
            Some(w),
        );
        let s = parse(&render(&[up], Own::default()));
        let q = |m: &str, q: &str| get(&s, m, &[("target", "web"), ("quantile", q)]);
        let p50 = q("toffload_runtime_request_latency_seconds", "0.5").expect("p50");
        assert!((p50 - 300e-6).abs() < 300e-6 * 0.07, "{p50}");
        assert!(q("toffload_runtime_request_latency_seconds", "0.999").is_some());
        let wait = q("toffload_runtime_offload_wait_seconds", "0.99").expect("p99");
        assert!((wait - 200e-6).abs() < 200e-6 * 0.07, "{wait}");
    }

    fn w_verdict(s: &[prometheus_parse::Sample], target: &str) -> Vec<String> {
        s.iter()
            .filter(|x| x.metric == "toffload_verdict" && x.labels.get("target") == Some(target))
            .filter_map(|x| x.labels.get("verdict").map(str::to_string))
            .collect()
    }
}
