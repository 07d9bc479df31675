//! The model: from one stock window's measurements, the throughput a zero-edit fiber
//! runtime would reach, the ceiling that binds it, and where overlap will not pay.
//!
//! ../shared/DESIGN.md gives the starting formulas:
//!
//!   T_fiber = min( C / c_f, D, N / (L + c_f) )      c_f = fiber per-request CPU
//!
//! with the speedup taken against the measured stock rate. The one term the watcher
//! cannot read off the stock server is c_f, the per-request CPU under fibers. It is
//! the stock per-request CPU (already without the spin) less what the connection
//! threads spend on blocking (their voluntary context switches per request times the
//! measured switch cost) plus what the runtime adds per request (a park and resume per
//! yield, the non-blocking retry of each socket call and the carrier's share of its
//! epoll wait); or, for a blocking wait where the requests' own work outside the
//! offload reads far lower than that, the work (fiber_cpu). Every input is shown with
//! the prediction, so a wrong number can be traced to the measurement that produced it.

pub mod inputs;
pub mod recipes;

use serde::Serialize;

/// Fiber park + resume, microseconds: `cargo xtask bench runtime` (bench_switch)
/// measured 52 ns on this kind of machine.
pub const FIBER_SWITCH_US: f64 = 0.052;
/// What the runtime adds per yield besides the switch: the non-blocking attempt that
/// said "not yet" (a recv's EAGAIN, accel_done's 0), a waiting read's fcntl
/// (O_NONBLOCK of the application's own?), getsockopt (SO_RCVTIMEO) and epoll_ctl, and
/// the carrier's share of its epoll_pwait2. Not fitted: `cargo xtask bench model` sets
/// the runtime's CPU per request as measured ("runtime c") beside the c_f it gives.
pub const RUNTIME_PER_YIELD_US: f64 = 1.2;
/// Yields per request of a thread-per-connection server: one at the offload, one at
/// the read that waits for the next request.
pub const YIELDS_PER_REQUEST: f64 = 2.0;
/// Overlap must beat the fiber's own CPU by this factor to be worth it (the paper's
/// Prediction 2: L clearly above c + k*s).
pub const OVERLAP_PAYS: f64 = 1.5;
/// Below this predicted speedup the model says "no gain".
pub const NO_GAIN: f64 = 1.10;
/// The least a request spends outside the server's CPU work in a loop whose CPUs idle
/// between requests: the answer wakes the client's thread on its CPU, the next request
/// the carrier on the server's, each CPU halted in between. A spinning stock loop
/// never idles, so its window cannot show it (Z is not fitted there), yet the fibers'
/// loop pays it on every request. tests/programs/bench_wake.c, two CPUs idle between
/// rounds: 50 us at the median on this kind of machine (41-51 us at the 10th
/// percentile), against 10 us for the same hand-off on one CPU.
pub const CROSS_CPU_ROUND_TRIP_US: f64 = 50.0;

/// What the model reads off a stock window.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Inputs {
    /// R: measured requests/s of the stock server.
    pub stock_rps: f64,
    /// L: offload latency (the stall less its wake-up delay), us.
    pub latency_us: f64,
    /// c: on-CPU time per request, us: without the stall when it spins (waste), with
    /// it when it blocks (the submit and the blocking, see inputs.rs).
    pub cpu_per_request_us: f64,
    /// c is the warm quartile of the requests' outside CPU: spinners crowding their
    /// cores come back to cold caches, which fibers do not (inputs.rs).
    pub cpu_warm_quartile: bool,
    /// The stock wait spins (the thread is on CPU for most of the stall).
    pub spin: bool,
    /// N: threads that made offload calls (connections served concurrently).
    pub connections: f64,
    /// Connected sockets of the target's processes: what a reroute can keep in flight
    /// (an event loop serves them all on one thread, so N is 1 there).
    pub client_connections: Option<f64>,
    /// P: cores the process may run on.
    pub cores: f64,
    /// The share of those cores' time the hypervisor left the machine while the
    /// window ran (1 - steal): the CPU the stock server's rate was measured on, and
    /// all the fibers would get.
    pub cpu_available: f64,
    /// C: carriers the runtime will start (TOFFLOAD_CARRIERS, at most P).
    pub carriers: f64,
    /// X: context-switch cost, us (measured at the watch's start).
    pub switch_us: f64,
    /// Voluntary context switches per request of the connection threads.
    pub blocking_switches_per_request: f64,
    /// Involuntary ones (the threads preempting each other), per request.
    pub preemptions_per_request: f64,
    /// What one sleep cost the server, us: X as this server pays it. A blocking wait's
    /// is the on-CPU time inside the offload per sleep; a spinning one's, the on-CPU
    /// time of a syscall that slept outside it (the read waiting for the next request).
    pub sleep_cost_us: Option<f64>,
    /// A blocking wait's offload sleeps per call (the vendor's poll-and-sleep loops
    /// sleep several times in one call).
    pub sleeps_per_call: f64,
    /// The warm quartile of each request's CPU outside its offload, without the watch's
    /// probes there, us (blocking waits with enough requests timed whole): the
    /// request's own work with its read's sleep, and none of the interrupts and cold
    /// caches its threads' sleeps bring that land in the other quartiles.
    pub outside_cpu_warm_us: Option<f64>,
    /// D: the device's throughput when the window shows it saturated, requests/s.
    pub device_rps: Option<f64>,
    /// What the watch's own probes added to each request while the window was traced
    /// (probe_cost.rs), us: in c and in R as measured, gone once the watch detaches.
    pub watch_us_per_request: f64,
    /// R while the probes were off (sampled windows, untraced.rs): the stock rate
    /// without the watch, measured rather than corrected.
    pub stock_rps_untraced: Option<f64>,
    /// All the target's CPU per request while the probes were off, us: c of a blocking
    /// wait without the watch's cost.
    pub cpu_untraced_us: Option<f64>,
    /// Z as the kernel measured it: per request, how long the connection threads'
    /// syscalls outside the offload slept until their wake-up (the read waiting for
    /// the next request), us, held to the stock cycle (inputs.rs). Shown beside the
    /// fitted Z, not used: at 64 connections it moved from 60 us to 2.4 ms between
    /// windows of the same point (the load generator's vCPU shared with the watcher
    /// and other guests), where the unwatched client's own latencies left ~0-300 us.
    pub outside_wait_us: Option<f64>,
    /// The loop's own CPU per request as a reroute pays it, us: the typical request's
    /// (the median of each request's CPU outside the offload, for a spinning wait)
    /// without the threads that made no offload call (recipes.rs). None: c stands in.
    /// Not in the JSON: event loops, which it serves, carry no zero-edit inputs there.
    #[serde(skip)]
    pub reroute_cpu_us: Option<f64>,
    /// A toffload backend's own threads' CPU per request (the emulated device's
    /// engine, the remote client's I/O), us: per offload, so a reroute keeps it
    /// (recipes.rs). Not in the JSON, as reroute_cpu_us.
    #[serde(skip)]
    pub backend_cpu_us: f64,
    /// Per request, the stock server's wake-ups of an idle peer CPU (a local
    /// client's), and what one costs the waker, us (idle_wake.rs): the stock loop
    /// pays it with each answer, a reroute that keeps its clients busy does not
    /// (recipes.rs). Not in the JSON, as reroute_cpu_us.
    #[serde(skip)]
    pub peer_idle_wakes_per_request: f64,
    #[serde(skip)]
    pub idle_wake_us: f64,
}

/// Where c_f came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FiberCpuSource {
    /// The stock CPU per request less the switches blocking cost it, plus the
    /// runtime's yields.
    StockLessBlocking,
    /// The request's own work outside its offload (the warm quartile), plus the
    /// offload's calls beyond its sleeps: where it is far lower, the sleeps cost the
    /// stock server more than the switches counted at X show.
    RequestWork,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ceiling {
    /// The carriers' CPU: C / c_f.
    Cpu,
    /// The device's throughput.
    Device,
    /// Too few connections to cover the latency: N / (L + c_f).
    Overlap,
}

impl Ceiling {
    pub fn label(self) -> &'static str {
        match self {
            Ceiling::Cpu => "CPU (carriers busy)",
            Ceiling::Device => "device throughput",
            Ceiling::Overlap => "overlap capacity (connections / latency)",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    pub inputs: Inputs,
    /// c as the model took it: without the watch's cost (measured between bursts, or
    /// less the calibrated cost), us.
    pub cpu_us: f64,
    /// X as the model took it: the calibrated switch, or a sleep's cost to this
    /// server (without the watch's) when larger, us.
    pub switch_cost_us: f64,
    /// c_f: predicted per-request CPU under fibers, us.
    pub fiber_cpu_us: f64,
    /// Which estimate gave c_f.
    pub fiber_cpu_source: FiberCpuSource,
    /// The stock CPU less blocking (see fiber_cpu), us, shown beside c_f when the
    /// request's own work gave it.
    pub fiber_cpu_stock_us: f64,
    /// The three ceilings, requests/s (device only when known).
    pub cpu_ceiling_rps: f64,
    pub device_ceiling_rps: Option<f64>,
    pub overlap_ceiling_rps: f64,
    pub fiber_rps: f64,
    pub binding: Ceiling,
    /// fiber_rps / stock_rps.
    pub speedup: f64,
    /// The stock rate without the watch: the measured one, corrected for the probes'
    /// cost (equal to it when that cost is unknown or zero).
    pub stock_rps: f64,
    /// The stock rate the formulas give (T_spin or T_block), beside the measured one:
    /// a large gap says the stock server is limited by something the model lacks.
    pub stock_model_rps: f64,
    /// Z: what each request spends outside the server (the client, the network),
    /// fitted so that the stock closed loop gives the stock rate, us; for a spinning
    /// stock loop, which cannot show it, CROSS_CPU_ROUND_TRIP_US.
    pub think_us: f64,
    /// Why overlap will not pay, when it will not.
    pub stop: Option<String>,
}

/// The runtime's per-request overhead for `k` yields.
pub fn runtime_overhead_us(yields: f64) -> f64 {
    yields * (FIBER_SWITCH_US + RUNTIME_PER_YIELD_US)
}

/// A station this busy (utilization) at the predicted rate is what binds it.
const BUSY: f64 = 0.85;

/// Requests/s of a closed loop: `n` connections, each request `c` us on one of
/// `servers` carriers, `l` us on a device of `lanes` lanes (None: every request
/// gets one) and `think` us outside the server. Exact mean value analysis for
/// one-server queues; a queue of several servers is taken as one server of service
/// time c / servers plus a delay of the rest (Seidmann's approximation).
pub fn closed_loop_rps(
    n: f64,
    c: f64,
    servers: f64,
    l: f64,
    lanes: Option<f64>,
    think: f64,
) -> f64 {
    // (service of the one-server queue, delay beside it)
    let mut queues = vec![(c / servers, c * (servers - 1.0) / servers)];
    let mut delay = think.max(0.0);
    match lanes {
        Some(m) if m < n => queues.push((l / m, l * (m - 1.0) / m)),
        _ => delay += l,
    }
    delay += queues.iter().map(|q| q.1).sum::<f64>();
    let mut q = vec![0.0; queues.len()];
    let mut x = 0.0;
    // Connections beyond a few thousand change nothing the 1e-3 precision shows.
    for k in 1..=(n.round().max(1.0) as usize).min(100_000) {
        let r: Vec<f64> = queues
            .iter()
            .zip(&q)
            .map(|(&(s, _), &qi)| s * (1.0 + qi))
            .collect();
        x = k as f64 / (delay + r.iter().sum::<f64>()).max(1e-9);
        for (qi, ri) in q.iter_mut().zip(&r) {
            *qi = x * ri;
        }
    }
    x * 1e6
}

/// The closed loop's think time Z: what each request spends outside the server (the
/// load's client, the network stack on its side), which bounds a loop that neither
/// its CPU nor its device saturates. Not measured in the server, so fitted: the Z at
/// which the stock loop (`n` connections, `c` us on `servers` cores, `l` on the
/// device) gives the stock `rate`. Zero where the stock CPU is saturated (its rate
/// then says nothing of the time outside), and the device's likewise, where the
/// stations alone would saturate the CPU, and where they already fall short of the
/// rate.
pub fn think_time_us(n: f64, c: f64, servers: f64, l: f64, lanes: Option<f64>, rate: f64) -> f64 {
    let at = |z: f64| closed_loop_rps(n, c, servers, l, lanes, z);
    // Near a station's saturation the rate hardly moves with Z, and a gap of a percent
    // would fit a Z of milliseconds; and where the stations alone would saturate the
    // CPU, a rate short of that is the stock threads' own waste (wake-ups that find the
    // core idle), not time outside the server.
    let u_cpu = rate * c / 1e6 / servers;
    let u_dev = lanes.map_or(0.0, |m| rate * l / 1e6 / m);
    let alone = at(0.0);
    if rate <= 0.0
        || u_cpu >= BUSY
        || u_dev >= BUSY
        || alone * c / 1e6 / servers >= BUSY
        || alone <= rate
    {
        return 0.0;
    }
    // The rate is below n / z for any z: the fit lies below n / rate.
    let (mut lo, mut hi) = (0.0, n * 1e6 / rate);
    for _ in 0..40 {
        let mid = (lo + hi) / 2.0;
        if at(mid) > rate {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The stock formulas, T_spin or T_block, at per-request CPU `c`.
fn stock_formula(i: &Inputs, c: f64) -> f64 {
    let per_s = |us: f64| 1e6 / us.max(1e-3);
    let (l, n, p, x) = (
        i.latency_us.max(0.0),
        i.connections.max(1.0),
        i.cores.max(1.0),
        i.switch_us.max(0.0),
    );
    if i.spin {
        p.min(n) * per_s(c + l)
    } else {
        (p * per_s(c + 2.0 * x)).min(n * per_s(l + c + x))
    }
}

/// c as measured, and as the model takes it.
struct Cpu {
    /// With the probes attached.
    watched: f64,
    /// The target's own CPU per request while the probes were off (blocking waits).
    untraced: Option<f64>,
    /// Without the watch's cost.
    c: f64,
}

/// The window was measured with the probes attached: c without their cost. Where the
/// probes were off for part of the window, the target's own counters gave c and the
/// rate without them; else c less the calibrated cost, and the stock rate as the stock
/// formulas say it moves when that cost goes (a server bound by its CPU speeds up, one
/// bound by its connections barely moves). A spinning wait's c is the part outside the
/// offload, which the untraced counters cannot split off.
fn cpu(i: &Inputs) -> Cpu {
    let watched = i.cpu_per_request_us.max(0.0);
    let untraced = i.cpu_untraced_us.filter(|&u| !i.spin && u > 0.0);
    let c = match untraced {
        Some(u) => u,
        None => (watched - i.watch_us_per_request.max(0.0)).max(0.0),
    };
    Cpu {
        watched,
        untraced,
        c,
    }
}

/// X as the model takes it for `i` (switch_cost), for the recipes' forecast.
pub(super) fn switch_cost_of(i: &Inputs) -> f64 {
    switch_cost(i, &cpu(i))
}

/// X as the model takes it. A switch costs the server what one of its sleeps in the
/// offload costs it when the window shows that (many threads' cold caches cost far
/// more than the calibration's two warm ones), else the calibrated X.
fn switch_cost(i: &Inputs, cpu: &Cpu) -> f64 {
    // A sleep's cost was read while traced, and the probes' cost lands mostly on the
    // sleeps (each is futex calls, a switch out, a wake-up and a switch in, all
    // traced). Where the untraced CPU shows what the watch really added per request
    // (up to 5x the calibration on 64 threads), that cost per sleep comes off it.
    let switches =
        (i.blocking_switches_per_request.max(0.0) + i.preemptions_per_request.max(0.0)).max(1.0);
    let sleep_cost = i.sleep_cost_us.map(|s| match cpu.untraced {
        Some(u) => (s - (cpu.watched - u).max(0.0) / switches).max(0.0),
        None => s,
    });
    i.switch_us.max(sleep_cost.unwrap_or(0.0)).max(0.0)
}

/// The request's own work replaces c less blocking only below this share of it.
/// Each estimate moves by a microsecond or two between windows of one server (the
/// warm quartile's few hundred requests, the probes' calibrated cost taken out); at
/// conn_server's points the two agree within that, and c less blocking is what the
/// fitted points were built on. Where the work reads far lower, the switches counted
/// missed most of what the sleeps cost.
const WORK_BELOW: f64 = 0.75;

/// c_f, and which estimate gave it: the stock CPU less blocking
/// (fiber_cpu_less_blocking) or, for a blocking wait, the request's own work
/// (request_work_cpu) where that is clearly lower. The first counts what blocking
/// cost as the switches times X; on a core that 64 threads' sleeps crowd, a sleep
/// costs it more than that and partly outside the sleeping call (timer and wake-up
/// interrupts landing on the other threads: docs/model.md counts them), so the first
/// estimate is high by what it misses: most, where a vendor's loop sleeps in short
/// slices. The second reads the work off the requests that such costs did not land on.
fn fiber_cpu(i: &Inputs, stock: f64) -> (f64, FiberCpuSource) {
    match request_work_cpu(i) {
        Some(work) if work < WORK_BELOW * stock => (work, FiberCpuSource::RequestWork),
        _ => (stock, FiberCpuSource::StockLessBlocking),
    }
}

/// A blocking request's CPU from its parts: its work outside the offload as its warm
/// quartile shows it (the read's sleep in it standing for the fiber's yield there),
/// and the offload call's own CPU less its sleeps at the calibrated switch (what is
/// left: the submit, the polls, a vendor's CPU work), at least the one yield that
/// replaces them. Not at the X taken for blocking, which is that whole CPU per sleep
/// where it exceeds the switch. None for a spinning wait (its c is already its
/// outside work) or without the warm quartile.
fn request_work_cpu(i: &Inputs) -> Option<f64> {
    if i.spin {
        return None;
    }
    let outside = i.outside_cpu_warm_us?;
    let sleeps = i.sleeps_per_call.max(0.0);
    let offload_cpu = i.sleep_cost_us? * sleeps.max(1.0);
    let calls = (offload_cpu - sleeps * i.switch_us.max(0.0)).max(runtime_overhead_us(1.0));
    Some(outside.max(0.0) + calls)
}

/// c_f as the stock CPU less blocking: blocking's CPU leaves with the kernel threads;
/// the runtime's own comes in. The stock CPU can never drop below the runtime's share
/// (a noisy small c). Fibers on one carrier neither sleep nor preempt each other.
fn fiber_cpu_less_blocking(i: &Inputs, c: f64, x_eff: f64) -> f64 {
    // A spinner is preempted while it spins: that switch lands inside the offload,
    // outside a spin's c; its sleeps (waiting for the next request) land in c.
    let preempted = if i.spin {
        0.0
    } else {
        i.preemptions_per_request.max(0.0)
    };
    let blocking = (i.blocking_switches_per_request.max(0.0) + preempted) * x_eff;
    let added = runtime_overhead_us(YIELDS_PER_REQUEST);
    (c - blocking).max(0.0) + added
}

/// The stock rate without the watch: measured between bursts, else the measured rate
/// moved as the stock formulas move without the watch's cost.
fn stock_rate(i: &Inputs, cpu: &Cpu, stock_model: f64) -> f64 {
    match i.stock_rps_untraced {
        Some(r) if r > 0.0 => r,
        _ if i.stock_rps > 0.0 => {
            i.stock_rps * stock_model / stock_formula(i, cpu.watched).max(1e-9)
        }
        _ => stock_model,
    }
}

/// What binds: the station nearest saturation at the `fiber` rate, or the connections
/// when neither is (the loop is mostly waiting).
fn binding(fiber: f64, fiber_wall: f64, carriers: f64, l: f64, lanes: Option<f64>) -> Ceiling {
    let u_cpu = fiber * fiber_wall / carriers / 1e6;
    let u_dev = lanes.map_or(0.0, |m| fiber * l / m / 1e6);
    if u_dev >= BUSY && u_dev >= u_cpu {
        Ceiling::Device
    } else if u_cpu >= BUSY {
        Ceiling::Cpu
    } else {
        Ceiling::Overlap
    }
}

/// Why overlap will not pay, when it will not.
fn stop(l: f64, fiber_cpu: f64, binding: Ceiling, speedup: f64, fiber: f64) -> Option<String> {
    if l < OVERLAP_PAYS * fiber_cpu {
        Some(format!(
            "offload latency {l:.1} us is not clearly above the fibers' per-request CPU \
             {fiber_cpu:.1} us: nothing idle to overlap"
        ))
    } else if binding == Ceiling::Device && speedup < NO_GAIN {
        Some(format!(
            "the device is the ceiling ({fiber:.0} req/s): more requests in flight cannot \
             finish sooner"
        ))
    } else if speedup < NO_GAIN {
        Some(format!(
            "predicted {speedup:.2}x: the stock server already reaches what fibers would"
        ))
    } else {
        None
    }
}

pub fn predict(i: &Inputs) -> Prediction {
    let cpu = cpu(i);
    let c = cpu.c;
    let l = i.latency_us.max(0.0);
    let n = i.connections.max(1.0);
    let p = i.cores.max(1.0);
    let carriers = i.carriers.clamp(1.0, p);
    let avail = i.cpu_available.clamp(0.1, 1.0);
    let x_eff = switch_cost(i, &cpu);
    let fiber_cpu_stock = fiber_cpu_less_blocking(i, c, x_eff);
    let (fiber_cpu, fiber_cpu_source) = fiber_cpu(i, fiber_cpu_stock);
    let per_s = |us: f64| 1e6 / us.max(1e-3);
    let lanes = i.device_rps.map(|d| (d * l / 1e6).max(1.0));
    let stock_model = stock_formula(i, c);
    let stock = stock_rate(i, &cpu, stock_model);
    // The time outside the server is the same for the fibers: fitted on the stock
    // loop (its threads on every core), spent by the fibers' loop too. A spinning stock
    // server's loop is its spinners', which says nothing of it: there the fibers'
    // loop pays at least the wake-ups of a loop that idles between requests, the
    // cross-CPU round trip. (The kernel's measure of it, `outside_wait_us`, is shown
    // beside it but too unsteady to use.)
    let think = if i.spin {
        CROSS_CPU_ROUND_TRIP_US
    } else {
        think_time_us(n, c / avail, p, l, lanes, stock)
    };
    // A request's CPU takes longer on cores the hypervisor shares: c / avail of
    // wall time, for the fibers as for the stock loop Z was fitted on.
    let fiber_wall = fiber_cpu / avail;
    let cpu_ceiling = carriers * per_s(fiber_wall);
    let overlap_ceiling = n * per_s(l + fiber_wall + think);
    // The ceilings are the asymptotes; near the knee, where connections just about
    // cover the latency, requests queue for the carriers and the device, and the rate
    // falls short of both. Mean value analysis of the closed loop (N connections, the
    // carriers and the device as queues) gives the rate with that queueing.
    let fiber_mva = closed_loop_rps(n, fiber_wall, carriers, l, lanes, think);
    let fiber = fiber_mva
        .min(cpu_ceiling)
        .min(overlap_ceiling)
        .min(i.device_rps.unwrap_or(f64::INFINITY));
    let binding = binding(fiber, fiber_wall, carriers, l, lanes);
    let speedup = fiber / stock.max(1e-9);
    Prediction {
        inputs: i.clone(),
        cpu_us: c,
        switch_cost_us: x_eff,
        fiber_cpu_us: fiber_cpu,
        fiber_cpu_source,
        fiber_cpu_stock_us: fiber_cpu_stock,
        cpu_ceiling_rps: cpu_ceiling,
        device_ceiling_rps: i.device_rps,
        overlap_ceiling_rps: overlap_ceiling,
        fiber_rps: fiber,
        binding,
        speedup,
        stock_rps: stock,
        stock_model_rps: stock_model,
        think_us: think,
        stop: stop(l, fiber_cpu, binding, speedup, fiber),
    }
}

impl Prediction {
    /// The inputs and intermediate terms as label/value lines, for text and the TUI.
    pub fn lines(&self) -> Vec<(String, String)> {
        let i = &self.inputs;
        let mut v = vec![
            (
                "R stock".into(),
                format!(
                    "{:.0} req/s watched, {:.0} without the watch ({})",
                    i.stock_rps,
                    self.stock_rps,
                    if i.stock_rps_untraced.is_some() {
                        "measured between bursts"
                    } else {
                        "corrected"
                    }
                ),
            ),
            ("L latency".into(), format!("{:.1} us", i.latency_us)),
            (
                "c CPU/req".into(),
                format!(
                    "{:.1} us without the watch, {:.1} traced ({} wait{})",
                    self.cpu_us,
                    i.cpu_per_request_us,
                    if i.spin { "spin" } else { "block" },
                    if i.cpu_warm_quartile {
                        ", warm quartile"
                    } else {
                        ""
                    },
                ),
            ),
            (
                "blocking".into(),
                format!(
                    "({:.2} sleeps + {:.2} preempted)/req x {:.2} us{}",
                    i.blocking_switches_per_request,
                    if i.spin {
                        0.0
                    } else {
                        i.preemptions_per_request
                    },
                    self.switch_cost_us,
                    if self.switch_cost_us > i.switch_us {
                        " (its sleeps' cost)"
                    } else {
                        ""
                    }
                ),
            ),
            (
                "c_f fiber".into(),
                match self.fiber_cpu_source {
                    FiberCpuSource::StockLessBlocking => format!("{:.1} us", self.fiber_cpu_us),
                    FiberCpuSource::RequestWork => format!(
                        "{:.1} us: the requests' own work (warm quartile outside the \
                         offload {:.1} us + the offload's calls); c less blocking gives {:.1}",
                        self.fiber_cpu_us,
                        i.outside_cpu_warm_us.unwrap_or(0.0),
                        self.fiber_cpu_stock_us
                    ),
                },
            ),
            (
                "Z outside".into(),
                format!(
                    "{:.1} us/req ({}){}",
                    self.think_us,
                    if i.spin {
                        "a spinning loop's cannot be fitted: the cross-CPU round trip"
                    } else {
                        "fitted to the stock rate"
                    },
                    i.outside_wait_us
                        .map(|z| format!("; the reads slept {z:.1} us/req (measured, not used)"))
                        .unwrap_or_default()
                ),
            ),
            (
                "N P C".into(),
                format!(
                    "{:.0} conns, {:.0} cores ({:.0}% stolen by the hypervisor), {:.0} carriers",
                    i.connections,
                    i.cores,
                    (1.0 - i.cpu_available) * 100.0,
                    i.carriers
                ),
            ),
            (
                "CPU ceil".into(),
                format!("{:.0} req/s", self.cpu_ceiling_rps),
            ),
            (
                "overlap ceil".into(),
                format!("{:.0} req/s", self.overlap_ceiling_rps),
            ),
        ];
        if let Some(d) = self.device_ceiling_rps {
            v.push(("device ceil".into(), format!("{d:.0} req/s")));
        }
        v
    }

    /// One line: "1.52x (31,000 -> 47,000 req/s), bound by CPU".
    pub fn summary(&self) -> String {
        format!(
            "{:.2}x ({:.0} -> {:.0} req/s), bound by {}",
            self.speedup,
            self.stock_rps,
            self.fiber_rps,
            self.binding.label()
        )
    }
}

/// The model's answer for one server: the zero-edit prediction where the runtime can
/// engage, else why not; and the minimal-edit recipe where one is known.
#[derive(Clone, Debug, Serialize)]
pub struct Assessment {
    /// The zero-edit prediction (fiberizable and behind-wall servers).
    pub zero_edit: Option<Prediction>,
    /// The zero-edit speedup: the prediction's, 1.0 where the runtime loads but never
    /// engages (event loops), None where it must not be injected (the walls).
    pub zero_edit_speedup: Option<f64>,
    /// Why zero-edit overlap will not pay or cannot work.
    pub stop: Option<String>,
    pub recipe: Option<recipes::Recipe>,
    pub recipe_speedup: Option<f64>,
    /// The reroute's CPU per request: what it keeps of the stock loop's (and the
    /// backend's threads'), and its completion path's, us.
    pub recipe_kept_cpu_us: Option<f64>,
    pub recipe_completion_us: Option<f64>,
    /// The recipe as one line, with this server's predicted speedup.
    pub recipe_text: Option<String>,
}

/// Why zero-edit overlap does not apply to a server of this kind, and the speedup it
/// is taken at (1.00x where the runtime loads and never engages). None: it may apply,
/// and the prediction says.
fn no_zero_edit(verdict: crate::classifier::Kind) -> Option<(Option<f64>, &'static str)> {
    use crate::classifier::Kind;
    match verdict {
        Kind::Fiberizable | Kind::BehindWall => None,
        Kind::EventLoop => Some((
            Some(1.0),
            "event loop: no thread per connection to turn into a fiber; the runtime \
                  loads safely and never engages (1.00x): the minimal-edit reroute is the path",
        )),
        Kind::ThreadPool => Some((
            Some(1.0),
            "thread pool: each thread multiplexes many connections and no thread \
                  belongs to one; the runtime would not engage (1.00x): the minimal-edit \
                  reroute is the path",
        )),
        Kind::ProcessPerConnection => Some((
            None,
            "process per connection: the OS already overlaps the connections, one \
                  process each, and a fiber runtime has no threads to interleave; the \
                  reroute in each backend (submit, then wait on the completion) is the path",
        )),
        Kind::BelowLibcWall => Some((
            None,
            "below the libc wall: the runtime will not deadlock it (a fiber blocked in a \
                  raw futex or io_uring wait hands its carrier's other fibers to a spare \
                  thread) but will not overlap those waits either: each holds a thread, as \
                  it does stock; injecting gains nothing there",
        )),
        Kind::BesideWall => Some((
            None,
            "beside the libc wall: the managed runtime keeps thread identity in \
                  native TLS, which fibers sharing a carrier would corrupt; do not inject",
        )),
        Kind::NotDynamic => Some((
            None,
            "statically linked: LD_PRELOAD cannot interpose anything",
        )),
        Kind::Undecided => Some((None, "no requests seen yet")),
        Kind::UnderRuntime => Some((
            None,
            "already under the fiber runtime: compare with the stock windows",
        )),
    }
}

/// `inputs` is None when the window had no offload call to measure.
pub fn assess(
    verdict: crate::classifier::Kind,
    inputs: Option<&Inputs>,
    command: &str,
    runtime: Option<crate::target::RuntimeKind>,
) -> Assessment {
    use crate::classifier::Kind;
    let recipe = recipes::lookup(command, runtime);
    // An event loop serves on one thread per core at most; a thread-per-connection
    // server rerouted keeps its threads.
    let forecast = recipe
        .as_ref()
        .zip(inputs.filter(|i| i.latency_us > 0.0))
        .map(|(r, i)| {
            let loops = if verdict == Kind::EventLoop {
                1.0
            } else {
                i.cores
            };
            recipes::predicted_speedup(i, loops, r.completion_us(i.switch_us))
        });
    let recipe_speedup = forecast.map(|f| f.speedup);
    let recipe_text = recipe
        .as_ref()
        .map(|r| recipes::describe(r, recipe_speedup, inputs.map(|i| i.latency_us)));
    let (zero_edit, zero_edit_speedup, stop) = match (no_zero_edit(verdict), inputs) {
        (Some((speedup, why)), _) => (None, speedup, Some(why.to_string())),
        (None, None) => (
            None,
            None,
            Some("no offload call seen: nothing to overlap".into()),
        ),
        (None, Some(inputs)) => {
            let p = predict(inputs);
            let s = p.speedup;
            let stop = p.stop.clone();
            (Some(p), Some(s), stop)
        }
    };
    Assessment {
        zero_edit,
        zero_edit_speedup,
        stop,
        recipe,
        recipe_speedup,
        recipe_kept_cpu_us: forecast.map(|f| f.kept_cpu_us),
        recipe_completion_us: forecast.map(|f| f.completion_us),
        recipe_text,
    }
}

#[cfg(test)]
mod tests;
