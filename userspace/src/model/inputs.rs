//! The model's inputs from what the watcher measured: one window of the stock server,
//! the context-switch cost calibrated at start, and what /proc says of the target
//! (the cores it may use, the runtime knobs and device it was started with).

use super::Inputs;
use crate::metrics::Window;
use crate::probe_cost::ProbeCost;
use std::collections::HashMap;

/// What the model needs about the target besides a window.
#[derive(Clone, Debug, Default)]
pub struct TargetFacts {
    /// Cores in the process's affinity mask.
    pub cores: usize,
    /// Its environment (as it was started: /proc/PID/environ).
    pub env: HashMap<String, String>,
    /// libtoffload_accel.so is mapped: the device knobs in `env` apply.
    pub accel_mapped: bool,
}

impl TargetFacts {
    pub fn read(pid: u32) -> TargetFacts {
        TargetFacts {
            cores: affinity_cores(pid).unwrap_or_else(online_cores),
            env: environ(pid),
            accel_mapped: std::fs::read_to_string(format!("/proc/{pid}/maps"))
                .is_ok_and(|m| m.contains("libtoffload_accel.so")),
        }
    }

    /// Carriers the runtime will start: TOFFLOAD_CARRIERS (default 1).
    pub fn carriers(&self) -> usize {
        self.env
            .get("TOFFLOAD_CARRIERS")
            .and_then(|v| v.trim().parse().ok())
            .filter(|&n: &usize| n >= 1)
            .unwrap_or(1)
    }

    /// The emulated device's ceiling, lanes / latency, when the target runs on it
    /// with the knobs it was started with (defaults: 64 lanes, 100 us).
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
        let backend = self.env.get("TOFFLOAD_BACKEND").map(|s| s.trim());
        if !self.accel_mapped || !matches!(backend, None | Some("") | Some("emulated")) {
            return None;
        }
        let num = |k: &str, d: f64| {
            self.env
                .get(k)
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(d)
        };
        let lat = num("TOFFLOAD_EMU_LAT_US", 100.0);
        let lanes = num("TOFFLOAD_EMU_LANES", 64.0);
        (lat > 0.0 && lanes >= 1.0).then_some((lat, lanes))
    }
}

/// The target's cores this busy (on-CPU share) are saturated.
const SATURATED: f64 = 0.9;
/// A measured latency this many times the device's configured one is stretched.
const STRETCHED: f64 = 1.5;

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
    // On a saturated core the device's own completions wait for the CPU too (the
    // emulated device's thread is one of the process's), and every stall stretches
    // far past the device's latency. Where the device's configuration is known and
    // the core is saturated, a latency well above it is the CPU's doing, not the
    // device's: the configuration is L then.
    let cores = facts.cores.max(1) as f64;
    let busy = w.on_cpu_ms / 1e3 / w.secs.max(1e-9) / cores;
    let latency = match facts.device_latency_us() {
        Some(spec) if busy >= SATURATED && measured > STRETCHED * spec => spec,
        _ => measured,
    };
    // A spun stall is waste that fibers do not spend; a blocked stall's on-CPU part
    // is the submit and the blocking itself, whose switches the model takes out
    // (blocking_switches_per_request x X) and the runtime's park replaces: it stays
    // in c, or that switch would be taken out twice.
    let cpu = if spin {
        w.cpu_per_request_us?
    } else {
        w.on_cpu_per_request_us?
    };
    Some(Inputs {
        stock_rps: w.requests_per_sec,
        latency_us: latency,
        cpu_per_request_us: cpu,
        spin,
        connections: w.offload_threads.max(1) as f64,
        cores,
        carriers: (facts.carriers() as f64).min(cores),
        switch_us: switch_us.unwrap_or(0.0),
        blocking_switches_per_request: w.blocking_switches_per_request.unwrap_or(0.0),
        preemptions_per_request: w.preemptions_per_request.unwrap_or(0.0),
        sleep_cost_us: if spin {
            None
        } else {
            w.sleep_cost_us.map(|us| {
                let calls = w.offload.calls as f64;
                let sleeps = w.offload.sleeps_per_call.unwrap_or(0.0) * calls;
                sleep_cost_unwatched(us, calls, sleeps, cost)
            })
        },
        device_rps: facts.device_rps(),
        watch_us_per_request: w.watcher.and_then(|c| c.us_per_request).unwrap_or(0.0),
    })
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

fn affinity_cores(pid: u32) -> Option<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    cpu_list_len(list.trim())
}

/// "0-3,8,10-11" -> 7.
pub fn cpu_list_len(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => b.trim().parse::<usize>().ok()? + 1 - a.trim().parse::<usize>().ok()?,
            None => {
                part.trim().parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

fn online_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The target's environment; empty when unreadable.
pub fn environ(pid: u32) -> HashMap<String, String> {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|b| parse_environ(&b))
        .unwrap_or_default()
}

pub fn parse_environ(b: &[u8]) -> HashMap<String, String> {
    b.split(|&c| c == 0)
        .filter_map(|kv| {
            let s = String::from_utf8_lossy(kv);
            let (k, v) = s.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sleeps_cost_leaves_the_watchs_own_out() {
        let c = ProbeCost {
            syscall_ns: 200.0,
            switch_ns: 800.0,
            offload_ns: 2000.0,
            handoff_ns: 2000.0,
        };
        // 100 calls, 80 slept: per sleep-or-call unit, 80 x 1 us + 100 x 1 us over 100.
        assert!((sleep_cost_unwatched(5.0, 100.0, 80.0, Some(&c)) - 3.2).abs() < 1e-9);
        // Never below zero; unchanged when the cost is unknown.
        assert_eq!(sleep_cost_unwatched(0.5, 100.0, 80.0, Some(&c)), 0.0);
        assert_eq!(sleep_cost_unwatched(5.0, 100.0, 80.0, None), 5.0);
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(cpu_list_len("0"), Some(1));
        assert_eq!(cpu_list_len("0-3,8,10-11"), Some(7));
        assert_eq!(cpu_list_len("x"), None);
        assert_eq!(cpu_list_len(""), None);
    }

    #[test]
    fn device_ceiling_from_the_emulated_knobs() {
        let mut f = TargetFacts {
            cores: 1,
            accel_mapped: true,
            env: parse_environ(b"TOFFLOAD_EMU_LAT_US=500\0TOFFLOAD_EMU_LANES=4\0PATH=/bin\0"),
        };
        assert_eq!(f.device_rps(), Some(8000.0));
        assert_eq!(f.carriers(), 1);
        f.env.insert("TOFFLOAD_BACKEND".into(), "cuda".into());
        assert_eq!(f.device_rps(), None);
        f.env.insert("TOFFLOAD_CARRIERS".into(), "3".into());
        assert_eq!(f.carriers(), 3);
    }
}
