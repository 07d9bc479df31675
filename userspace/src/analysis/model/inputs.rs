//! The model's inputs from what the watcher measured: one window of the stock server,
//! the context-switch cost calibrated at start, and what /proc says of the target
//! (the cores it may use, the runtime knobs and device it was started with).

use super::Inputs;
use crate::metrics::{OutsideCpu, WatcherCost, Window};
use crate::probe_cost::{CostSource, ProbeCost};
use std::collections::HashMap;

/// What the model needs about the target besides a window.
#[derive(Clone, Debug, Default)]
pub struct TargetFacts {
    /// Cores in the process's affinity mask, and which.
    pub cores: usize,
    pub cpus: Vec<usize>,
    /// Its environment as it was started (/proc/PID/environ); None when unreadable or
    /// overwritten: servers that retitle themselves (redis-server, nginx) write their
    /// title over that memory, and an absent knob no longer means its default there.
    pub env: Option<HashMap<String, String>>,
    /// libtoffload_accel.so is mapped: the device knobs in `env` apply.
    pub accel_mapped: bool,
}

impl TargetFacts {
    pub fn read(pid: u32) -> TargetFacts {
        let cpus = affinity_cpus(pid).unwrap_or_else(|| (0..online_cores()).collect::<Vec<_>>());
        TargetFacts {
            cores: cpus.len().max(1),
            cpus,
            env: crate::target::environ::read(pid)
                .ok()
                .flatten()
                .map(|v| v.into_iter().collect()),
            accel_mapped: std::fs::read_to_string(format!("/proc/{pid}/maps"))
                .is_ok_and(|m| m.contains("libtoffload_accel.so")),
        }
    }

    /// Carriers the runtime will start: TOFFLOAD_CARRIERS (default 1).
    pub fn carriers(&self) -> usize {
        self.env
            .as_ref()
            .and_then(|e| e.get("TOFFLOAD_CARRIERS"))
            .and_then(|v| v.trim().parse().ok())
            .filter(|&n: &usize| n >= 1)
            .unwrap_or(1)
    }

    /// The emulated device's ceiling, lanes / latency, when the target runs on it
    /// with the knobs it was started with (defaults: 64 lanes, 100 us), and they can
    /// be read.
    pub fn device_rps(&self) -> Option<f64> {
        let (lat, lanes) = self.emulated()?;
        Some(lanes * 1e6 / lat)
    }

    /// The emulated device's configured latency, us (same conditions).
    pub fn device_latency_us(&self) -> Option<f64> {
        self.emulated().map(|(lat, _)| lat)
    }

    /// (latency us, lanes) of the emulated device the target runs on, if it does.
    fn emulated(&self) -> Option<(f64, f64)> {
        let env = self.env.as_ref()?;
        let backend = env.get("TOFFLOAD_BACKEND").map(|s| s.trim());
        if !self.accel_mapped || !matches!(backend, None | Some("") | Some("emulated")) {
            return None;
        }
        let num = |k: &str, d: f64| {
            env.get(k)
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(d)
        };
        let lat = num("TOFFLOAD_EMU_LAT_US", 100.0);
        let lanes = num("TOFFLOAD_EMU_LANES", 64.0);
        (lat > 0.0 && lanes >= 1.0).then_some((lat, lanes))
    }
}

/// A measured latency this many times the device's configured one is stretched (the
/// engine's completions were seen 1.3-1.9x late at 1 ms, 64 connections).
const STRETCHED: f64 = 1.1;
/// Steal beyond this share is taken as this share: a window the host starved that
/// badly says little of the server.
const MAX_STEAL: f64 = 0.5;
/// Requests whose outside CPU was timed whole before its warm quartile is read.
const WARM_MIN_REQUESTS: u64 = 20;

/// The per-event costs the model takes the watch's own share out with. Measured or
/// cached ones as they are; the defaults that stand in for a calibration cut short
/// are a guess at the upper end, and taken out of a request's CPU they left too
/// little of it (one model-bench point's c read 2.5 us, its prediction +105%): where
/// the window measured the watch's cost per request on the target itself, they are
/// scaled so that the window's events at those costs come to it.
pub fn model_costs(
    source: CostSource,
    cost: Option<&ProbeCost>,
    watcher: Option<&WatcherCost>,
) -> Option<ProbeCost> {
    let c = *cost?;
    let k = match (source, watcher) {
        (CostSource::Default, Some(w)) => {
            match (w.measured_us_per_request, w.calibrated_us_per_request) {
                (Some(m), Some(cal)) if cal > 0.0 && m >= 0.0 => m / cal,
                _ => 1.0,
            }
        }
        _ => 1.0,
    };
    Some(c.scaled(k))
}

/// The inputs from one stock window; None when the window cannot feed the model (no
/// offload seen, or no CPU figure).
pub fn from_window(
    w: &Window,
    switch_us: Option<f64>,
    cost: Option<&ProbeCost>,
    facts: &TargetFacts,
) -> Option<Inputs> {
    if w.offload.calls == 0 || w.requests == 0 {
        return None;
    }
    // A wait that does not sleep spins (preempted or not); one that sleeps blocks.
    // Older kernels' windows without the sleep count fall back to the on-CPU share.
    let spin = match w.offload.sleeps_per_call {
        Some(s) => s < 0.5,
        None => w.offload.spin_share.unwrap_or(0.0) > 0.5,
    };
    // L, the device's latency: a blocked stall less its wake-up delay; a spun stall
    // at its fastest, since spinners crowding a core stretch the rest far past what
    // the device takes (and the fibers do not spin).
    let measured = if spin {
        w.offload.stall_p1_us.or(w.offload.stall_p50_us)?
    } else {
        w.offload.latency_p50_us.or(w.offload.stall_p50_us)?
    };
    // The emulated device's completions come from a thread of the target's own: on a
    // core its 64 threads crowd, that thread waits for the CPU, and stalls stretch past
    // the device's latency even when the core is not saturated on average (the
    // requests come in waves). The fibers' one carrier does not crowd it. Where the
    // device's configuration is known, a latency above it is the CPU's doing, or the
    // queue for too few lanes, which the model puts back from D: the configuration is
    // L then.
    let cores = facts.cores.max(1) as f64;
    let latency = match facts.device_latency_us() {
        Some(spec) if measured > STRETCHED * spec => spec,
        _ => measured,
    };
    // A spun stall is waste that fibers do not spend; a blocked stall's on-CPU part
    // is the submit and the blocking itself, whose switches the model takes out
    // (blocking_switches_per_request x X) and the runtime's park replaces: it stays
    // in c, or that switch would be taken out twice.
    // A spinning server's helper threads (the device's engine, the acceptor) take
    // their share of a core its spinners crowd: a cost per second that, spread over
    // the few requests the spinners finish, would read as tens of us per request.
    // Under fibers the same cost spreads over a hundred times the requests.
    let connections = w.offload_threads.max(1) as f64;
    let helpers_us = w.helper_on_cpu_ms * 1e3 / w.requests as f64;
    let (cpu, cpu_warm_quartile) = if spin {
        let mean = (w.cpu_per_request_us? - helpers_us).max(0.0);
        spin_cpu_us(w.outside_cpu.as_ref(), mean, connections, cores)
    } else {
        (w.on_cpu_per_request_us?, false)
    };
    Some(Inputs {
        stock_rps: w.requests_per_sec,
        latency_us: latency,
        cpu_per_request_us: cpu,
        cpu_warm_quartile,
        spin,
        connections,
        client_connections: Some(w.processes.iter().map(|p| p.connections).sum::<usize>())
            .filter(|&n| n > 0)
            .map(|n| n as f64),
        cores,
        cpu_available: 1.0 - w.steal_share.unwrap_or(0.0).clamp(0.0, MAX_STEAL),
        carriers: (facts.carriers() as f64).min(cores),
        switch_us: switch_us.unwrap_or(0.0),
        blocking_switches_per_request: w.blocking_switches_per_request.unwrap_or(0.0),
        preemptions_per_request: w.preemptions_per_request.unwrap_or(0.0),
        // A spinner sleeps only outside the offload, waiting for its next request:
        // that syscall's on-CPU time is its sleep's cost (9-17 us on a core 64
        // spinners crowd, 6-10x the calibrated switch).
        sleep_cost_us: if spin {
            w.slept_syscall_us
                .map(|us| slept_syscall_unwatched(us, cost))
        } else {
            w.sleep_cost_us.map(|us| {
                let calls = w.offload.calls as f64;
                let sleeps = w.offload.sleeps_per_call.unwrap_or(0.0) * calls;
                sleep_cost_unwatched(us, calls, sleeps, cost)
            })
        },
        sleeps_per_call: if spin {
            0.0
        } else {
            w.offload.sleeps_per_call.unwrap_or(0.0)
        },
        outside_cpu_warm_us: outside_cpu_warm_us(spin, w, cost),
        device_rps: facts.device_rps(),
        watch_us_per_request: if spin {
            cost.map(|c| watch_outside_us(c, w.blocking_switches_per_request.unwrap_or(0.0)))
        } else {
            None
        }
        .or(w.watcher.and_then(|c| c.us_per_request))
        .unwrap_or(0.0),
        stock_rps_untraced: w.untraced.as_ref().map(|u| u.requests_per_sec),
        cpu_untraced_us: w.untraced.as_ref().map(|u| u.cpu_per_request_us),
        outside_wait_us: w.outside_wait_us.map(|z| {
            // The CPU outside the stall, per request where the histogram timed it.
            let cpu = w
                .outside_cpu
                .as_ref()
                .map(|o| o.mean_us)
                .or(w.on_cpu_per_request_us)
                .unwrap_or(0.0);
            let stall = w.offload.stall_mean_us.unwrap_or(0.0);
            outside_wait_us(z, connections, w.requests_per_sec, stall, cpu)
        }),
        reroute_cpu_us: reroute_cpu_us(
            spin,
            cpu,
            w.on_cpu_per_request_us,
            helpers_us,
            w.outside_cpu.as_ref(),
            loop_watch_us(w, spin, cost),
        ),
        backend_cpu_us: backend_cpu_us(w, cost),
        peer_idle_wakes_per_request: w.peer_idle_wakes_per_request.unwrap_or(0.0),
        idle_wake_us: cost.map_or(0.0, |c| c.idle_wake_ns / 1e3),
    })
}

/// A blocking request's warm quartile of CPU outside its offload, without the watch's
/// probes there: the work it does whichever way it waits, on the requests that the
/// threads' sleeps' interrupts and cold caches missed. None for a spinning wait (its
/// c is this already) or with too few requests timed whole.
fn outside_cpu_warm_us(spin: bool, w: &Window, cost: Option<&ProbeCost>) -> Option<f64> {
    let o = w
        .outside_cpu
        .as_ref()
        .filter(|o| o.requests >= WARM_MIN_REQUESTS)?;
    if spin {
        return None;
    }
    let watch = cost.map_or(0.0, |c| {
        watch_outside_us(c, w.slept_syscalls_per_request.unwrap_or(0.0))
    });
    Some((o.p25_us - watch).max(0.0))
}

/// The loop's CPU per request as a reroute pays it, without the watch's own cost to
/// the loop (`watch_us`, per request). Threads that made no offload call spend per
/// second, not per request (Go's idle Ms spinning for work and its sysmon: 19-87 us
/// per request of a one-at-a-time Go handler at 50-1000 us, 80-160 ms a second), and
/// a busy rerouted loop leaves them no idle time to spin in (a backend's own threads,
/// which work per offload, come back in recipes.rs). A spinning loop's CPU outside the
/// offload is taken at its mean: besides the median request's own work it holds what
/// the loop does once per round for all the requests of the round (redis writes every
/// reply of a round at its end), which the rerouted loop does as well. The mean's
/// other excess over the median was the watch's (redis-server at 50 us: 3.4 us
/// median, 9.5 mean, of which 6 us the watch's by its own count).
fn reroute_cpu_us(
    spin: bool,
    cpu: f64,
    on_cpu: Option<f64>,
    helpers_us: f64,
    outside: Option<&OutsideCpu>,
    watch_us: f64,
) -> Option<f64> {
    let taken = if spin {
        match outside {
            Some(o) if o.requests >= WARM_MIN_REQUESTS => o.mean_us.min(cpu),
            _ => cpu,
        }
    } else {
        on_cpu? - helpers_us
    };
    Some((taken - watch_us).max(0.0))
}

/// What the watch cost the threads that made offload calls, us per request, in the
/// CPU the reroute keeps from them: a blocking loop's on-CPU time holds all of their
/// syscalls, switches and offload probes, at the calibrated costs; a spinning loop's
/// kept CPU is the part outside its offloads, which holds only what lands there
/// (watch_outside_us: the preemptions, the submit's syscalls and half of each
/// offload probe's trap fall inside the spin). Taking the whole out of a spinner's
/// outside CPU took 2.5-3 us of redis-server's ~10 a command (ACCEL.SYNC at 50 us:
/// one preemption by the device's thread a command, 1.5 us traced), and the reroute
/// was forecast that much cheaper than it ran. 0 when the costs are unknown.
fn loop_watch_us(w: &Window, spin: bool, cost: Option<&ProbeCost>) -> f64 {
    let Some(c) = cost else { return 0.0 };
    if spin {
        return watch_outside_us(c, w.blocking_switches_per_request.unwrap_or(0.0));
    }
    let r = w.requests.max(1) as f64;
    let switches = (w.blocking_switches_per_request.unwrap_or(0.0)
        + w.preemptions_per_request.unwrap_or(0.0))
        * r;
    c.added_ns(&crate::probe_cost::Events {
        syscalls: w.offload_thread_syscalls,
        switches: switches.round() as u64,
        offloads: w.offload.calls,
    }) / r
        / 1e3
}

/// A toffload backend's own threads' CPU per request, us, less what the watch cost
/// them (their syscalls and switches at the calibrated costs): on the emulated device
/// at 50-1000 us, 4-7 us traced, of which ~3.7 the watch's (two switches, three
/// syscalls a request).
fn backend_cpu_us(w: &Window, cost: Option<&ProbeCost>) -> f64 {
    let watch_ns = cost.map_or(0.0, |c| {
        c.added_ns(&crate::probe_cost::Events {
            syscalls: w.backend_syscalls,
            switches: w.backend_switches,
            offloads: 0,
        })
    });
    ((w.backend_on_cpu_ms * 1e6 - watch_ns) / 1e3 / w.requests.max(1) as f64).max(0.0)
}

/// A sleep's cost without the watch's own inside the offload: each sleep's futex wait
/// and its switch and wake-up were traced, and about half of the call's entry and
/// return probes (the part of each trap on the inside of the timestamps) lands inside
/// too. Left in, it made blocking look several microseconds dearer per sleep than it
/// is, and the fibers' CPU that much cheaper.
fn sleep_cost_unwatched(
    measured_us: f64,
    calls: f64,
    sleeps: f64,
    cost: Option<&ProbeCost>,
) -> f64 {
    let Some(c) = cost else { return measured_us };
    let units = sleeps.max(calls).max(1.0);
    let watch_ns = sleeps * (c.syscall_ns + c.switch_ns) + calls * c.offload_ns / 2.0;
    (measured_us - watch_ns / units / 1e3).max(0.0)
}

/// A spinning request's c, the CPU it takes outside the offload. Spinners that
/// outnumber the cores run once per scheduling round (each spins a whole time
/// slice): a request comes back to caches that the other threads and the host have
/// had a round to cool, 64 x a slice, a quarter of a second. Fibers cycle through
/// the same connections in about a millisecond. The spread of each request's own
/// outside CPU shows it (64 spinners on one core: 20-25 us at its 10th percentile,
/// 35-55 us on average, a tail past 100 us); its warm quartile is what fibers pay.
/// Otherwise, or with too few requests timed whole, the window's mean (`mean_us`,
/// the helper threads' share already out). True when it is the warm quartile.
fn spin_cpu_us(
    outside: Option<&OutsideCpu>,
    mean_us: f64,
    connections: f64,
    cores: f64,
) -> (f64, bool) {
    match outside {
        Some(o) if connections > cores && o.requests >= WARM_MIN_REQUESTS => (o.p25_us, true),
        _ => (mean_us, false),
    }
}

/// Z as measured (`z`, us per request), no more than the stock loop leaves for it:
/// each connection's cycle is N / R (Little's law), of which a request spent its stall
/// in the offload (`stall_us`, wall time) and its CPU outside it in the server
/// (`cpu_us`); the rest is the most it can have spent outside. The bound holds the
/// mean to the window's own rates when a few reads slept through a stolen stretch of
/// the client's vCPU.
fn outside_wait_us(z: f64, connections: f64, rps: f64, stall_us: f64, cpu_us: f64) -> f64 {
    let rest = if rps > 0.0 {
        (connections * 1e6 / rps - stall_us - cpu_us).max(0.0)
    } else {
        f64::INFINITY
    };
    z.max(0.0).min(rest)
}

/// A slept syscall's cost without the watch's: its entry and exit probes and its
/// switch's.
fn slept_syscall_unwatched(measured_us: f64, cost: Option<&ProbeCost>) -> f64 {
    let Some(c) = cost else { return measured_us };
    (measured_us - (c.syscall_ns + c.switch_ns) / 1e3).max(0.0)
}

/// The watch's cost in a request's CPU outside its offload (a spinning request's c,
/// a blocking one's warm quartile): the request's read and write, the half of the
/// offload probes' trap that falls outside the call's timestamps, and its sleeps
/// there (waiting for the next request). The rest of the window's events (the
/// spinners' preemptions, the helper threads', a blocking wait's sleeps) land inside
/// the offload or outside the request.
fn watch_outside_us(c: &ProbeCost, sleeps_per_request: f64) -> f64 {
    (2.0 * c.syscall_ns + c.offload_ns / 2.0 + sleeps_per_request.max(0.0) * c.switch_ns) / 1e3
}

fn affinity_cpus(pid: u32) -> Option<Vec<usize>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    cpu_list(list.trim())
}

/// "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11].
pub fn cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut v = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (
                    a.trim().parse::<usize>().ok()?,
                    b.trim().parse::<usize>().ok()?,
                );
                if b < a {
                    return None;
                }
                v.extend(a..=b);
            }
            None => v.push(part.trim().parse::<usize>().ok()?),
        }
    }
    (!v.is_empty()).then_some(v)
}

fn online_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_costs_are_scaled_to_the_cost_measured_on_the_target() {
        let d = crate::probe_cost::DEFAULT_COST;
        let watcher = |measured: Option<f64>| WatcherCost {
            us_per_request: Some(6.0),
            share_traced: 0.1,
            calibrated_us_per_request: Some(6.0),
            measured_us_per_request: measured,
            basis: crate::metrics::CostBasis::Calibrated,
            host_share: 0.0,
            burst_share: 0.0,
            duty: 0.02,
            budget: Some(0.005),
        };
        // The defaults said 6 us a request, the target measured 2: a third of each.
        let w = watcher(Some(2.0));
        let c = model_costs(CostSource::Default, Some(&d), Some(&w)).expect("costs");
        assert!((c.syscall_ns - d.syscall_ns / 3.0).abs() < 1e-9, "{c:?}");
        assert!((c.switch_ns - d.switch_ns / 3.0).abs() < 1e-9);
        assert!((c.offload_ns - d.offload_ns / 3.0).abs() < 1e-9);
        // Measured or cached costs stand as they are; so do defaults with nothing
        // measured yet.
        for source in [CostSource::Measured, CostSource::Cached] {
            assert_eq!(model_costs(source, Some(&d), Some(&w)), Some(d));
        }
        assert_eq!(
            model_costs(CostSource::Default, Some(&d), Some(&watcher(None))),
            Some(d)
        );
        assert_eq!(model_costs(CostSource::Default, Some(&d), None), Some(d));
        assert_eq!(model_costs(CostSource::Default, None, Some(&w)), None);
    }

    #[test]
    fn a_sleeps_cost_leaves_the_watchs_own_out() {
        let c = ProbeCost {
            syscall_ns: 200.0,
            switch_ns: 800.0,
            offload_ns: 2000.0,
            handoff_ns: 2000.0,
            idle_wake_ns: 0.0,
            host_syscall_ns: 0.0,
        };
        // 100 calls, 80 slept: per sleep-or-call unit, 80 x 1 us + 100 x 1 us over 100.
        assert!((sleep_cost_unwatched(5.0, 100.0, 80.0, Some(&c)) - 3.2).abs() < 1e-9);
        // Never below zero; unchanged when the cost is unknown.
        assert_eq!(sleep_cost_unwatched(0.5, 100.0, 80.0, Some(&c)), 0.0);
        assert_eq!(sleep_cost_unwatched(5.0, 100.0, 80.0, None), 5.0);
    }

    #[test]
    fn a_spinning_requests_c_carries_only_its_own_events() {
        let c = ProbeCost {
            syscall_ns: 200.0,
            switch_ns: 800.0,
            offload_ns: 2000.0,
            handoff_ns: 2000.0,
            idle_wake_ns: 0.0,
            host_syscall_ns: 0.0,
        };
        // 2 x 0.2 + 1.0 + 1.5 x 0.8 us.
        assert!((watch_outside_us(&c, 1.5) - 2.6).abs() < 1e-9);
    }

    fn outside(requests: u64) -> OutsideCpu {
        OutsideCpu {
            requests,
            mean_us: 45.0,
            p10_us: 20.0,
            p25_us: 24.0,
            p50_us: 30.0,
            p90_us: 100.0,
        }
    }

    #[test]
    fn a_reroute_pays_the_loops_own_cpu() {
        // A spinning loop: the mean request's outside CPU (its rounds' shared work
        // included), never above c, less the watch's.
        assert_eq!(
            reroute_cpu_us(true, 50.0, Some(1045.0), 6.0, Some(&outside(250)), 0.0),
            Some(45.0)
        );
        assert_eq!(
            reroute_cpu_us(true, 50.0, Some(1045.0), 6.0, Some(&outside(250)), 5.0),
            Some(40.0)
        );
        assert_eq!(
            reroute_cpu_us(true, 20.0, Some(1045.0), 6.0, Some(&outside(250)), 0.0),
            Some(20.0)
        );
        // Too few requests timed whole, or none: c as taken.
        assert_eq!(
            reroute_cpu_us(true, 30.0, None, 6.0, Some(&outside(5)), 0.0),
            Some(30.0)
        );
        assert_eq!(reroute_cpu_us(true, 30.0, None, 6.0, None, 0.0), Some(30.0));
        // A blocking wait: all its CPU less the threads that made no offload call,
        // and less the watch's; never below zero.
        assert_eq!(
            reroute_cpu_us(false, 160.0, Some(160.0), 90.0, Some(&outside(250)), 10.0),
            Some(60.0)
        );
        assert_eq!(
            reroute_cpu_us(false, 160.0, Some(100.0), 90.0, None, 20.0),
            Some(0.0)
        );
        assert_eq!(reroute_cpu_us(false, 0.0, None, 90.0, None, 0.0), None);
    }

    /// A window of 1,000 requests in 1 s: the offload thread (1) made 3,000 syscalls
    /// and 2,000 offload calls' worth of probes; the backend's thread (2) ran 6 ms
    /// with 3,000 syscalls and 2,000 switches.
    fn window_with_a_backend() -> Window {
        use crate::collector::Snapshot;
        let t = |on_ns, offload_calls, syscalls, vol| crate::abi::ThreadInfo {
            on_ns,
            offload_calls,
            syscalls,
            vol,
            ..Default::default()
        };
        let prev = Snapshot::zero();
        let mut cur = Snapshot::zero();
        cur.t = 1.0;
        cur.counters[crate::abi::C_OFFLOAD_CALLS as usize] = 1000;
        cur.threads.insert(1, t(50_000_000, 1000, 3000, 0));
        cur.threads.insert(2, t(6_000_000, 0, 3000, 2000));
        cur.backend_threads.insert(2);
        crate::metrics::window(&prev, &cur, &crate::metrics::tests::ctx())
    }

    /// Calibrated costs: 0.3 us a syscall, 1.4 a switch, 1.8 an offload call.
    fn probe_costs() -> ProbeCost {
        ProbeCost {
            syscall_ns: 300.0,
            switch_ns: 1400.0,
            offload_ns: 1800.0,
            handoff_ns: 2700.0,
            idle_wake_ns: 0.0,
            host_syscall_ns: 0.0,
        }
    }

    #[test]
    fn the_watchs_cost_comes_out_of_the_loop_and_the_backend() {
        let c = probe_costs();
        let w = window_with_a_backend();
        // The loop: 3 syscalls x 0.3 + 1 offload x 1.8 us a request.
        assert!((loop_watch_us(&w, false, Some(&c)) - 2.7).abs() < 1e-9);
        // Spinning, only what lands outside the offloads: a read and a write, half
        // the offload probe, its sleeps (none here; preemptions land in the spin).
        assert!((loop_watch_us(&w, true, Some(&c)) - (0.6 + 0.9)).abs() < 1e-9);
        // The backend: 6 us a request, less 3 x 0.3 + 2 x 1.4.
        assert!((backend_cpu_us(&w, Some(&c)) - 2.3).abs() < 1e-9);
        // Unknown costs: nothing taken out.
        assert_eq!(loop_watch_us(&w, false, None), 0.0);
        assert!((backend_cpu_us(&w, None) - 6.0).abs() < 1e-9);
    }

    #[test]
    fn a_blocking_requests_warm_work_leaves_the_watchs_out() {
        let c = probe_costs();
        let mut w = window_with_a_backend();
        w.outside_cpu = Some(outside(250));
        w.slept_syscalls_per_request = Some(1.0);
        // 24 us, less a read and a write (0.6), half the offload probe (0.9) and the
        // read's switch (1.4).
        let warm = outside_cpu_warm_us(false, &w, Some(&c)).unwrap();
        assert!((warm - (24.0 - 2.9)).abs() < 1e-9, "{warm}");
        // Unknown costs: as timed.
        assert_eq!(outside_cpu_warm_us(false, &w, None), Some(24.0));
        // A spinning wait's c is this already; too few requests timed whole say nothing.
        assert_eq!(outside_cpu_warm_us(true, &w, Some(&c)), None);
        w.outside_cpu = Some(outside(5));
        assert_eq!(outside_cpu_warm_us(false, &w, Some(&c)), None);
    }

    #[test]
    fn crowded_spinners_pay_their_warm_quartile() {
        // 64 spinners on one core: the warm quartile, not the mean the cold tail lifts.
        assert_eq!(
            spin_cpu_us(Some(&outside(250)), 45.0, 64.0, 1.0),
            (24.0, true)
        );
        // As many spinners as cores each keep theirs: the mean.
        assert_eq!(
            spin_cpu_us(Some(&outside(250)), 45.0, 4.0, 4.0),
            (45.0, false)
        );
        // Too few requests timed whole, or none: the mean.
        assert_eq!(
            spin_cpu_us(Some(&outside(5)), 45.0, 64.0, 1.0),
            (45.0, false)
        );
        assert_eq!(spin_cpu_us(None, 45.0, 64.0, 1.0), (45.0, false));
    }

    #[test]
    fn measured_outside_wait_stays_within_the_stock_cycle() {
        // 64 connections at 40,000/s: a 1,600 us cycle, 1,200 us of it stalled and 20
        // on CPU, so at most 380 us outside.
        assert_eq!(outside_wait_us(300.0, 64.0, 40_000.0, 1200.0, 20.0), 300.0);
        assert!((outside_wait_us(1900.0, 64.0, 40_000.0, 1200.0, 20.0) - 380.0).abs() < 1e-9);
        // A stall longer than the cycle (a window's tail) leaves nothing outside.
        assert_eq!(outside_wait_us(300.0, 64.0, 40_000.0, 1700.0, 20.0), 0.0);
        // No rate: no bound.
        assert_eq!(outside_wait_us(300.0, 64.0, 0.0, 1200.0, 20.0), 300.0);
        assert_eq!(outside_wait_us(-1.0, 64.0, 40_000.0, 1200.0, 20.0), 0.0);
    }

    #[test]
    fn a_slept_syscalls_cost_leaves_the_watchs_own_out() {
        let c = ProbeCost {
            syscall_ns: 200.0,
            switch_ns: 800.0,
            offload_ns: 2000.0,
            handoff_ns: 2000.0,
            idle_wake_ns: 0.0,
            host_syscall_ns: 0.0,
        };
        assert!((slept_syscall_unwatched(12.0, Some(&c)) - 11.0).abs() < 1e-9);
        assert_eq!(slept_syscall_unwatched(0.5, Some(&c)), 0.0);
        assert_eq!(slept_syscall_unwatched(12.0, None), 12.0);
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(cpu_list("0"), Some(vec![0]));
        assert_eq!(cpu_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(cpu_list("x"), None);
        assert_eq!(cpu_list("3-1"), None);
        assert_eq!(cpu_list(""), None);
    }

    fn env(b: &[u8]) -> Option<HashMap<String, String>> {
        crate::target::environ::parse(b).map(|v| v.into_iter().collect())
    }

    #[test]
    fn device_ceiling_from_the_emulated_knobs() {
        let mut f = TargetFacts {
            cores: 1,
            cpus: vec![0],
            accel_mapped: true,
            env: env(b"TOFFLOAD_EMU_LAT_US=500\0TOFFLOAD_EMU_LANES=4\0PATH=/bin\0"),
        };
        assert_eq!(f.device_rps(), Some(8000.0));
        assert_eq!(f.device_latency_us(), Some(500.0));
        assert_eq!(f.carriers(), 1);
        let e = f.env.as_mut().unwrap();
        e.insert("TOFFLOAD_BACKEND".into(), "cuda".into());
        e.insert("TOFFLOAD_CARRIERS".into(), "3".into());
        assert_eq!(f.device_rps(), None);
        assert_eq!(f.carriers(), 3);
        // Nothing set: the defaults, 64 lanes at 100 us.
        f.env = env(b"PATH=/bin\0");
        assert_eq!(f.device_rps(), Some(640_000.0));
        // An environment the server wrote its title over says nothing, not "defaults".
        f.env = None;
        assert_eq!(
            (f.device_rps(), f.device_latency_us(), f.carriers()),
            (None, None, 1)
        );
    }
}
