//! Latency under offered load (`cargo xtask bench openloop`): the unmodified
//! conn_server on the emulated device, stock (accel_run blocking or spinning) and
//! under the fiber runtime, driven open loop (Poisson arrivals, latency counted from
//! each scheduled arrival) at offered loads swept upward until each configuration
//! knees. Server on core 0, load generator on core 1.
//!
//! The sweep: geometric steps (x `--step`) from `--start`, all configurations in turn
//! at each step (so the machine's drift falls on all alike), until a configuration
//! knees at two steps in a row; then `--fine` steps between its last holding load and
//! its knee, then halving that bracket to `--resolution`, then its half-knee load
//! when no point lies there yet. Last, each
//! configuration closed loop, with the server's CPU per answer: what bounds its knee
//! where its core is full. Writes a markdown report and a CSV
//! (one row per measured point) for the chart. Exits 1 on a wrong answer below a knee
//! or when the runtime did not engage.

use clap::Parser;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::hiccups::{self, Hiccups};
use toffload_tests::load::{self, Config};
use toffload_tests::openloop::{self, Point, Verdict};

#[derive(Parser)]
#[command(
    name = "toffload-openloop",
    version = toffload_cli::VERSION,
    about = "conn_server stock and under libtoffload.so: latency vs open-loop offered load",
    args_override_self = true
)]
struct Args {
    /// Offload latencies, microseconds.
    #[arg(long, value_delimiter = ',', default_value = "20,200")]
    latencies: Vec<u32>,
    /// Emulated device lanes.
    #[arg(long, default_value_t = 64)]
    lanes: usize,
    /// Client connections (conn_server runs a thread, or fiber, per connection).
    #[arg(long, default_value_t = 64)]
    conns: usize,
    /// Request size, bytes.
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Load generator threads, each with its share of the connections and the rate
    /// (all on the load's core: more help only where one thread is the limit).
    #[arg(long, default_value_t = 1)]
    load_threads: usize,
    /// First offered load, requests/s.
    #[arg(long, default_value_t = 500.0)]
    start: f64,
    /// First offered load of the spinning stock server, which knees far lower: its
    /// spinning threads share one core with the device's completions.
    #[arg(long, default_value_t = 50.0)]
    spin_start: f64,
    /// Highest offered load tried.
    #[arg(long, default_value_t = 1_000_000.0)]
    max: f64,
    /// Ratio between coarse steps.
    #[arg(long, default_value_t = 2.0)]
    step: f64,
    /// Extra steps between a configuration's last holding load and its knee.
    #[arg(long, default_value_t = 3)]
    fine: usize,
    /// After the fine steps, the knee's bracket is halved (one load at a time,
    /// configurations in turn) until the knee is at most this many times the last
    /// load that holds: the ratio of two knees is then known to a few percent, not
    /// to a fine step.
    #[arg(long, default_value_t = 1.05)]
    resolution: f64,
    /// Measured seconds per run of a point (longer at low loads: see --min-samples).
    #[arg(long, default_value_t = 0.8)]
    secs: f64,
    /// Fewest answers a run measures (it lasts up to 4 s to get them).
    #[arg(long, default_value_t = 2000)]
    min_samples: u64,
    /// Unmeasured warm-up per run, seconds.
    #[arg(long, default_value_t = 0.3)]
    warmup: f64,
    /// Runs per point; the tables show medians.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Nice value for the load generator and the servers it starts (root can go
    /// below 0): on a machine shared with other work, a lower value keeps that work
    /// from setting the tail latencies measured here.
    #[arg(long, default_value_t = -10, allow_hyphen_values = true)]
    nice: i32,
    /// Write the markdown report here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write one CSV row per measured point here.
    #[arg(long)]
    csv: Option<PathBuf>,
}

/// How conn_server runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Stock, accel_run sleeping in the kernel until the device completes.
    Block,
    /// Stock, accel_run polling the device.
    Spin,
    /// Under libtoffload.so: accel_run parks the fiber, and the carrier polls for the
    /// completion (the default, TOFFLOAD_COMPLETIONS=poll).
    Runtime,
    /// The same with the device's completion signal (TOFFLOAD_COMPLETIONS=signal):
    /// what polling saves.
    RuntimeSignalled,
}

impl Mode {
    const ALL: [Mode; 4] = [
        Mode::Block,
        Mode::Spin,
        Mode::Runtime,
        Mode::RuntimeSignalled,
    ];

    fn label(self) -> &'static str {
        match self {
            Mode::Block => "stock block",
            Mode::Spin => "stock spin",
            Mode::Runtime => "runtime",
            Mode::RuntimeSignalled => "runtime signalled",
        }
    }

    fn wait(self) -> &'static str {
        match self {
            Mode::Spin => "spin",
            // The runtime replaces the wait, so its setting does not matter there.
            Mode::Block | Mode::Runtime | Mode::RuntimeSignalled => "block",
        }
    }

    /// TOFFLOAD_COMPLETIONS under the runtime; None for the stock server.
    fn completions(self) -> Option<&'static str> {
        match self {
            Mode::Runtime => Some("poll"),
            Mode::RuntimeSignalled => Some("signal"),
            Mode::Block | Mode::Spin => None,
        }
    }
}

/// Where a configuration's sweep stands.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Stepping up coarsely: the next load to try, and how many points in a row
    /// were knees (a sweep stops after KNEES_IN_A_ROW: one alone may be a disturbed
    /// point, see openloop::knee).
    Coarse(f64, u32),
    /// Knee bracketed; fine steps and the half-knee point still to measure.
    Refine,
    Done,
}

const KNEES_IN_A_ROW: u32 = 2;
/// Rounds of halving at most: bounds the bench however its points fall.
const MAX_BISECTIONS: usize = 6;

struct Sweep {
    mode: Mode,
    lat: u32,
    points: Vec<Point>,
    phase: Phase,
    /// Points the runtime ran without creating a fiber (must stay 0).
    unengaged: usize,
}

impl Sweep {
    fn name(&self) -> String {
        format!("{} {} us", self.mode.label(), self.lat)
    }
}

fn runtime_lib() -> Result<PathBuf, String> {
    let p = harness::dist().join("lib/libtoffload.so");
    if p.exists() {
        Ok(p)
    } else {
        Err(format!(
            "{} is missing: run `cargo xtask build`",
            p.display()
        ))
    }
}

fn stats_path() -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    std::env::temp_dir().join(format!(
        "toffload-openloop-{}-{}.json",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// fibers_created from a TOFFLOAD_STATS file (rewritten within 50 ms of a change).
fn fibers_created(p: &Path) -> u64 {
    let t0 = Instant::now();
    loop {
        let v = std::fs::read_to_string(p)
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(s.trim()).ok())
            .and_then(|v| v.get("fibers_created").and_then(|x| x.as_u64()));
        match v {
            Some(n) => return n,
            None if t0.elapsed() > Duration::from_millis(500) => return 0,
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// What one run of one point measured, beside the load generator's own state.
struct Run {
    point: Point,
    engaged: bool,
    busy_share: f64,
    capacity: f64,
}

/// conn_server in this configuration, pinned on core 0; under the runtime it writes
/// its counters to `stats`.
fn start_server(a: &Args, mode: Mode, lat: u32, stats: &Path) -> Result<Server, String> {
    let mut spec = ServerSpec::new("conn_server")
        .arg("--size")
        .arg(a.size.to_string())
        .env("TOFFLOAD_EMU_LAT_US", lat.to_string())
        .env("TOFFLOAD_EMU_LANES", a.lanes.to_string())
        .env("TOFFLOAD_WAIT", mode.wait())
        .cpu((harness::cpus() >= 2).then_some(0));
    if let Some(completions) = mode.completions() {
        spec = spec
            .env("TOFFLOAD_COMPLETIONS", completions)
            .env("LD_PRELOAD", runtime_lib()?.display().to_string())
            .env("TOFFLOAD_STATS", stats.display().to_string());
    }
    Server::start(&spec)
}

fn run_once(a: &Args, mode: Mode, lat: u32, rate: f64) -> Result<Run, String> {
    let stats = stats_path();
    let mut server = start_server(a, mode, lat, &stats)?;
    let mut cfg = Config::new(server.port);
    cfg.conns = a.conns;
    cfg.size = a.size;
    cfg.rate = Some(rate);
    let secs = a.secs.max(a.min_samples as f64 / rate).min(a.secs.max(4.0));
    cfg.duration = Duration::from_secs_f64(secs);
    cfg.warmup = Duration::from_secs_f64(a.warmup);
    // Past the knee answers are seconds late; a shorter limit only turns them into
    // errors, which the knee rule does not need.
    cfg.timeout = Duration::from_secs(5);
    let r = load::run_threads(&cfg, a.load_threads).map_err(|e| e.to_string())?;
    if !server.alive() {
        return Err(format!(
            "conn_server ({}) died at {rate:.0}/s: {:?}",
            mode.label(),
            server.terminate()
        ));
    }
    let engaged = match mode {
        Mode::Runtime | Mode::RuntimeSignalled => {
            std::thread::sleep(Duration::from_millis(120));
            let n = fibers_created(&stats);
            let _ = std::fs::remove_file(&stats);
            n > 0
        }
        Mode::Block | Mode::Spin => true,
    };
    drop(server);
    Ok(Run {
        point: Point {
            offered: rate,
            achieved: r.requests_per_sec,
            p50_us: r.p50_us,
            p99_us: r.p99_us,
            p999_us: r.p999_us,
            gen_late_p99_us: r.late_p99_us,
            errors: r.errors,
            wrong: r.wrong,
        },
        engaged,
        busy_share: r.busy_share,
        capacity: r.answers_per_busy_s,
    })
}

/// A configuration's closed-loop rate: every connection always has a request out.
/// Where the server's efficiency does not fall with concurrency (the runtime polling
/// its completions), that is about the most it can serve; spinning threads or
/// signalled wakes serve less with all 64 out than open loop with fewer.
#[derive(Clone, Copy, Debug, Default)]
struct Capacity {
    /// Answers per second (median of the runs).
    rate: f64,
    /// The server's CPU (utime + stime, all threads) per answer, microseconds: what
    /// bounds the rate where the server's core is full.
    cpu_us: f64,
}

fn capacity_once(a: &Args, mode: Mode, lat: u32) -> Result<Capacity, String> {
    let stats = stats_path();
    let mut server = start_server(a, mode, lat, &stats)?;
    let mut cfg = Config::new(server.port);
    cfg.conns = a.conns;
    cfg.size = a.size;
    cfg.duration = Duration::from_secs_f64(a.secs.max(1.0));
    cfg.warmup = Duration::from_secs_f64(a.warmup);
    let cpu0 = server.cpu_secs();
    let t0 = Instant::now();
    let r = load::run_threads(&cfg, a.load_threads).map_err(|e| e.to_string())?;
    let wall = t0.elapsed().as_secs_f64();
    let cpu1 = server.cpu_secs();
    let alive = server.alive();
    drop(server);
    let _ = std::fs::remove_file(&stats);
    if !alive {
        return Err(format!("conn_server ({}) died closed loop", mode.label()));
    }
    if r.wrong > 0 {
        return Err(format!(
            "conn_server ({}, {lat} us): {} wrong answers closed loop",
            mode.label(),
            r.wrong
        ));
    }
    // The CPU delta spans the warm-up and the connects too: over the answers of that
    // whole stretch, at the measured rate.
    let cpu_us = match (cpu0, cpu1) {
        (Some(c0), Some(c1)) if r.requests_per_sec > 0.0 => {
            (c1 - c0) * 1e6 / (r.requests_per_sec * wall)
        }
        _ => f64::NAN,
    };
    Ok(Capacity {
        rate: r.requests_per_sec,
        cpu_us,
    })
}

/// Every configuration's capacity, the configurations interleaved in each round.
fn capacities(a: &Args, sweeps: &[Sweep]) -> Result<Vec<Capacity>, String> {
    let mut runs: Vec<Vec<Capacity>> = vec![Vec::new(); sweeps.len()];
    for _ in 0..a.runs {
        for (s, out) in sweeps.iter().zip(runs.iter_mut()) {
            out.push(capacity_once(a, s.mode, s.lat)?);
        }
    }
    Ok(runs
        .into_iter()
        .zip(sweeps)
        .map(|(v, s)| {
            let c = Capacity {
                rate: harness::median(v.iter().map(|c| c.rate).collect()),
                cpu_us: harness::median(v.iter().map(|c| c.cpu_us).collect()),
            };
            eprintln!(
                "{:<22} closed loop {:>9.0}/s  server CPU {:>6.1} us per answer",
                s.name(),
                c.rate,
                c.cpu_us
            );
            c
        })
        .collect())
}

/// The load generator in the run of the sweep with the most answers per second: what
/// it can offer is read there, where its per-answer cost is that of a heavy load.
#[derive(Default)]
struct GenLoad {
    busy_share: f64,
    offered: f64,
    achieved: f64,
    /// Answers per second of its CPU time spent working.
    capacity: f64,
}

fn measure(a: &Args, s: &mut Sweep, rate: f64, gen: &mut GenLoad) -> Result<Point, String> {
    let mut runs = Vec::new();
    for _ in 0..a.runs {
        let r = run_once(a, s.mode, s.lat, rate)?;
        if !r.engaged {
            s.unengaged += 1;
        }
        if r.point.achieved > gen.achieved {
            *gen = GenLoad {
                busy_share: r.busy_share,
                offered: rate,
                achieved: r.point.achieved,
                capacity: r.capacity,
            };
        }
        runs.push(r.point);
    }
    let p = openloop::combine(&runs);
    eprintln!(
        "{:<22} offered {:>9.0}  achieved {:>9.0}  p50 {:>9.1}  p99 {:>9.1}  p99.9 {:>9.1}  err {} wrong {}",
        s.name(),
        p.offered,
        p.achieved,
        p.p50_us,
        p.p99_us,
        p.p999_us,
        p.errors,
        p.wrong
    );
    s.points.push(p);
    Ok(p)
}

/// Loads still to measure in a configuration's refinement: the fine steps below its
/// knee, then its half-knee load where no point is near.
fn refinement(a: &Args, s: &Sweep) -> Vec<f64> {
    let Some(k) = openloop::knee(&s.points) else {
        return Vec::new();
    };
    let mut todo = Vec::new();
    if let Some(good) = openloop::last_holding(&s.points, k) {
        // Only where the bracket is still coarse: refine once.
        if k / good > a.step.powf(0.5) {
            todo.extend(openloop::between(good, k, a.fine));
        }
    }
    todo
}

fn sweep(a: &Args) -> Result<(Vec<Sweep>, GenLoad), String> {
    let mut sweeps: Vec<Sweep> = Vec::new();
    for &lat in &a.latencies {
        for mode in Mode::ALL {
            sweeps.push(Sweep {
                mode,
                lat,
                points: Vec::new(),
                phase: Phase::Coarse(
                    match mode {
                        Mode::Spin => a.spin_start,
                        Mode::Block | Mode::Runtime | Mode::RuntimeSignalled => a.start,
                    },
                    0,
                ),
                unengaged: 0,
            });
        }
    }
    let mut gen = GenLoad::default();
    // Coarse: every configuration still rising, one step each per round.
    while sweeps.iter().any(|s| matches!(s.phase, Phase::Coarse(..))) {
        for s in sweeps.iter_mut() {
            let Phase::Coarse(rate, knees) = s.phase else {
                continue;
            };
            let p = measure(a, s, rate, &mut gen)?;
            let low = openloop::lowest(&s.points).expect("measured").p99_us;
            let knees = match openloop::verdict(&p, low) {
                Verdict::Knee => knees + 1,
                Verdict::Holds => 0,
            };
            let next = rate * a.step;
            s.phase = if knees >= KNEES_IN_A_ROW || (knees > 0 && next > a.max) {
                Phase::Refine
            } else if next > a.max {
                Phase::Done
            } else {
                Phase::Coarse(next, knees)
            };
        }
    }
    // Fine steps below each knee, configurations in turn.
    let mut plans: Vec<Vec<f64>> = sweeps.iter().map(|s| refinement(a, s)).collect();
    while plans.iter().any(|p| !p.is_empty()) {
        for (s, plan) in sweeps.iter_mut().zip(plans.iter_mut()) {
            if !plan.is_empty() {
                let rate = plan.remove(0);
                measure(a, s, rate, &mut gen)?;
            }
        }
    }
    // Each knee's bracket halved, configurations in turn, until within --resolution
    // (each round halves every bracket's width on a log scale: a handful of rounds).
    for _ in 0..MAX_BISECTIONS {
        let mut measured = false;
        for s in sweeps.iter_mut().filter(|s| s.phase == Phase::Refine) {
            if let Some(rate) = openloop::bisect(&s.points, a.resolution) {
                measure(a, s, rate, &mut gen)?;
                measured = true;
            }
        }
        if !measured {
            break;
        }
    }
    // The half-knee load, where the latency target is read.
    for s in sweeps.iter_mut() {
        if s.phase == Phase::Refine {
            if let Some(k) = openloop::knee(&s.points) {
                let first = openloop::lowest(&s.points).map_or(k, |p| p.offered);
                if openloop::near(&s.points, k / 2.0, 0.03).is_none() && k / 2.0 > first {
                    measure(a, s, k / 2.0, &mut gen)?;
                }
            }
            s.phase = Phase::Done;
        }
    }
    for s in sweeps.iter_mut() {
        s.points.sort_by(|x, y| x.offered.total_cmp(&y.offered));
    }
    Ok((sweeps, gen))
}

fn fmt_rate(r: Option<f64>) -> String {
    r.map_or("none".into(), |r| format!("{r:.0}"))
}

/// The half-knee point's p99 over the low-load p99.
fn half_knee_ratio(s: &Sweep) -> Option<(f64, f64)> {
    let k = openloop::knee(&s.points)?;
    let low = openloop::lowest(&s.points)?.p99_us;
    let h = openloop::near(&s.points, k / 2.0, 0.03)?;
    Some((h.p99_us, h.p99_us / low))
}

fn csv(sweeps: &[Sweep]) -> String {
    let mut t = String::from(
        "config,mode,offload_us,offered,achieved,p50_us,p99_us,p999_us,gen_late_p99_us,errors,wrong,knee\n",
    );
    for s in sweeps {
        let k = openloop::knee(&s.points);
        for p in &s.points {
            let _ = writeln!(
                t,
                "{},{},{},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{},{},{}",
                s.name(),
                s.mode.label(),
                s.lat,
                p.offered,
                p.achieved,
                p.p50_us,
                p.p99_us,
                p.p999_us,
                p.gen_late_p99_us,
                p.errors,
                p.wrong,
                u8::from(k == Some(p.offered))
            );
        }
    }
    t
}

struct Target {
    name: String,
    pass: bool,
    value: String,
}

fn targets(sweeps: &[Sweep], caps: &[Capacity]) -> Vec<Target> {
    let find = |m: Mode, lat: u32| sweeps.iter().position(|s| s.mode == m && s.lat == lat);
    let mut out = Vec::new();
    if let (Some(rt), Some(bl)) = (find(Mode::Runtime, 20), find(Mode::Block, 20)) {
        let (kr, kb) = (
            openloop::knee(&sweeps[rt].points),
            openloop::knee(&sweeps[bl].points),
        );
        let ratio = match (kr, kb) {
            (Some(r), Some(b)) => Some(r / b),
            _ => None,
        };
        // What the ratio could reach at most here: the most the runtime served in any
        // run, open or closed loop, over the stock knee (no knee lies above it).
        let most = sweeps[rt]
            .points
            .iter()
            .map(|p| p.achieved)
            .chain(caps.get(rt).map(|c| c.rate))
            .fold(0.0, f64::max);
        let bound = match (caps.get(rt), kb) {
            (Some(c), Some(b)) if most > 0.0 => format!(
                "; at most {:.2}x on this machine, where the most the runtime served is {most:.0}/s ({:.1} us of server CPU per answer closed loop)",
                most / b,
                c.cpu_us
            ),
            _ => String::new(),
        };
        out.push(Target {
            name: "runtime knee >= 3x stock block knee at 20 us".into(),
            pass: ratio.is_some_and(|r| r >= 3.0),
            value: ratio.map_or(
                format!("knees {} and {}", fmt_rate(kr), fmt_rate(kb)),
                |r| format!("{r:.2}x ({} vs {}){bound}", fmt_rate(kr), fmt_rate(kb)),
            ),
        });
    }
    for rt in sweeps.iter().filter(|s| s.mode == Mode::Runtime) {
        let h = half_knee_ratio(rt);
        out.push(Target {
            name: format!(
                "runtime p99 at half its knee <= 2x its low-load p99 ({} us)",
                rt.lat
            ),
            pass: h.is_some_and(|(_, r)| r <= 2.0),
            value: h.map_or("no knee or no half-knee point".into(), |(p, r)| {
                format!("{r:.2}x ({p:.0} us)")
            }),
        });
    }
    let wrong: u64 = sweeps
        .iter()
        .flat_map(|s| {
            let k = openloop::knee(&s.points).unwrap_or(f64::INFINITY);
            s.points
                .iter()
                .filter(move |p| p.offered < k)
                .map(|p| p.wrong)
        })
        .sum();
    out.push(Target {
        name: "wrong answers below the knees: 0".into(),
        pass: wrong == 0,
        value: wrong.to_string(),
    });
    out
}

fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// The machine's state around the sweep, for the report.
struct Conditions {
    /// 1-minute load average before and after.
    load: (f64, f64),
    /// The host's stalls of each core, measured before the sweep and after it.
    hiccups: (Vec<Hiccups>, Vec<Hiccups>),
    secs: f64,
    nice: i32,
}

fn report(
    a: &Args,
    sweeps: &[Sweep],
    caps: &[Capacity],
    gen: &GenLoad,
    cond: Conditions,
) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "conn_server (unmodified) on the emulated device ({} lanes), stock and under \
         libtoffload.so, driven open loop: Poisson arrivals over {} connections, {} B \
         requests, latency counted from each scheduled arrival. Server on core 0, load \
         generator on core 1, both at nice {}; {} s measured per run (more at low loads, \
         for at least {} answers), {} s warm-up, median of {} run(s) per point, the \
         configurations interleaved at each step. Knee: the lowest offered load from \
         which on every point has p99 above {}x its value at the lowest load, or achieved \
         below {:.0}% of offered (one such point below a load that holds again was \
         disturbed by other work, not the knee). \"runtime\" finds completions by \
         polling (TOFFLOAD_COMPLETIONS=poll, the default: accel_submit_polled, looked at \
         between fibers, the device never woken); \"runtime signalled\" waits for the \
         device's completion fd as before (TOFFLOAD_COMPLETIONS=signal); the stock \
         server's accel_run always waits for the signal (block) or spins on accel_done \
         (spin).\n",
        a.lanes,
        a.conns,
        a.size,
        cond.nice,
        a.secs,
        a.min_samples,
        a.warmup,
        a.runs,
        openloop::P99_FACTOR,
        openloop::ACHIEVED_SHARE * 100.0
    );
    t.push_str(
        "| configuration | knee req/s | low-load p50 us | low-load p99 us | p99 at half knee us | best achieved req/s | wrong | errors |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for s in sweeps {
        let low = openloop::lowest(&s.points);
        let best = s.points.iter().map(|p| p.achieved).fold(0.0, f64::max);
        let _ = writeln!(
            t,
            "| {} | {} | {:.0} | {:.0} | {} | {:.0} | {} | {} |",
            s.name(),
            fmt_rate(openloop::knee(&s.points)),
            low.map_or(f64::NAN, |p| p.p50_us),
            low.map_or(f64::NAN, |p| p.p99_us),
            half_knee_ratio(s).map_or("-".into(), |(p, _)| format!("{p:.0}")),
            best,
            s.points.iter().map(|p| p.wrong).sum::<u64>(),
            s.points.iter().map(|p| p.errors).sum::<u64>(),
        );
    }
    t.push_str(
        "\nEvery point (the knee in bold). Generator late: how late the load generator \
         itself sent its arrivals (p99, median of the runs); every latency includes it \
         whatever the server, so a p99 near it is the generator's, and a p99 far above \
         it is lost on the server's side (the server, or its core not running):\n\n",
    );
    t.push_str(
        "| configuration | offered req/s | achieved req/s | p50 us | p99 us | p99.9 us | generator late p99 us | errors | wrong |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for s in sweeps {
        let k = openloop::knee(&s.points);
        for p in &s.points {
            let b = if k == Some(p.offered) { "**" } else { "" };
            let _ = writeln!(
                t,
                "| {} | {b}{:.0}{b} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} |",
                s.name(),
                p.offered,
                p.achieved,
                p.p50_us,
                p.p99_us,
                p.p999_us,
                p.gen_late_p99_us,
                p.errors,
                p.wrong
            );
        }
    }
    let _ = writeln!(
        t,
        "\nThe load generator ({} epoll thread(s) on core 1), in the run with the most \
         answers (offered {:.0}/s, achieved {:.0}/s): busy {:.0}% of the time (sending \
         and handling answers; wall time, so time lost to other work on its core counts \
         as busy), so {:.0} answers per busy second: about what it can offer on this \
         machine. The highest knee here is {}.",
        a.load_threads,
        gen.offered,
        gen.achieved,
        gen.busy_share * 100.0,
        gen.capacity,
        fmt_rate(
            sweeps
                .iter()
                .filter_map(|s| openloop::knee(&s.points))
                .max_by(f64::total_cmp)
        )
    );
    t.push_str(
        "\nClosed loop: the same servers with every connection's next request sent as its \
         answer arrives (median of the runs, the configurations interleaved), and the \
         server's CPU (utime + stime, all its threads) per answer. Where the server's \
         core is full, the CPU per answer sets the most it can serve. A knee above the \
         closed-loop rate is a server that serves less with all 64 connections waiting \
         than open loop with fewer (spinning threads sharing one core; signalled wakes).\n\n\
         | configuration | closed-loop req/s | server CPU us per answer | knee / closed-loop |\n\
         |---|---:|---:|---:|\n",
    );
    for (s, c) in sweeps.iter().zip(caps) {
        let _ = writeln!(
            t,
            "| {} | {:.0} | {:.1} | {} |",
            s.name(),
            c.rate,
            c.cpu_us,
            openloop::knee(&s.points).map_or("-".into(), |k| format!("{:.2}", k / c.rate))
        );
    }
    t.push_str("\nTargets:\n\n");
    for tg in targets(sweeps, caps) {
        let _ = writeln!(
            t,
            "- [{}] {}: {}",
            if tg.pass { "PASS" } else { "FAIL" },
            tg.name,
            tg.value
        );
    }
    let _ = writeln!(
        t,
        "\n({:.0} s in all. The machine's 1-minute load average was {:.2} before the \
         first run and {:.2} after the last, this run's own server and load generator \
         included: well above 2 means other work shared the 2 cores and disturbed the \
         numbers.)",
        cond.secs, cond.load.0, cond.load.1
    );
    let list = |h: &[Hiccups]| {
        let v: Vec<String> = h.iter().map(|h| h.to_string()).collect();
        if v.is_empty() {
            "not measured".to_string()
        } else {
            v.join("; ")
        }
    };
    let _ = writeln!(
        t,
        "\nThe host's hiccups: a thread spinning alone on each core for {} s, before the \
         first run and after the last, counting the gaps over {} us between two reads of \
         the clock (the host running something else on that core, which the guest does \
         not see). Before: {}. After: {}. Each such gap on the server's core holds every \
         request in flight and queues the arrivals behind it; near a knee the queue \
         drains slowly, so a few gaps a second of a few milliseconds set the p99 \
         (docs/reproducing.md).",
        HICCUP_SPAN.as_secs(),
        hiccups::THRESHOLD.as_micros(),
        list(&cond.hiccups.0),
        list(&cond.hiccups.1)
    );
    t
}

/// How long the hiccup meter spins on each core, before and after the sweep.
const HICCUP_SPAN: Duration = Duration::from_secs(3);

fn host_hiccups() -> Vec<Hiccups> {
    let cores: Vec<usize> = (0..harness::cpus().min(2)).collect();
    hiccups::measure(&cores, HICCUP_SPAN)
}

/// Sets this thread's nice value, which the servers it starts inherit; returns the
/// value in force.
fn set_nice(n: i32) -> i32 {
    // SAFETY: plain syscalls on this thread (nice values are per thread on Linux).
    unsafe {
        if libc::setpriority(libc::PRIO_PROCESS, 0, n) != 0 {
            eprintln!(
                "toffload-openloop: cannot set nice {n}: {}",
                std::io::Error::last_os_error()
            );
        }
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, 0)
    }
}

fn real_main(a: &Args) -> Result<(), String> {
    if a.runs == 0
        || a.conns == 0
        || a.load_threads == 0
        || a.step <= 1.0
        || a.resolution <= 1.0
        || a.start <= 0.0
        || a.spin_start <= 0.0
    {
        return Err(
            "--runs, --conns and --load-threads must be at least 1, --step and --resolution above 1, the starts above 0".into(),
        );
    }
    if harness::cpus() >= 2 {
        if let Err(e) = harness::pin_current_thread(1) {
            eprintln!("toffload-openloop: cannot pin the load generator: {e}");
        }
    } else {
        eprintln!("toffload-openloop: one CPU only: server and load generator share it");
    }
    runtime_lib()?;
    let nice = set_nice(a.nice);
    let started = Instant::now();
    let before = loadavg();
    let hiccups_before = host_hiccups();
    let (sweeps, gen) = sweep(a)?;
    let caps = capacities(a, &sweeps)?;
    let hiccups_after = host_hiccups();
    let text = report(
        a,
        &sweeps,
        &caps,
        &gen,
        Conditions {
            load: (before, loadavg()),
            hiccups: (hiccups_before, hiccups_after),
            secs: started.elapsed().as_secs_f64(),
            nice,
        },
    );
    print!("{text}");
    if let Some(out) = &a.out {
        std::fs::write(out, &text).map_err(|e| format!("{}: {e}", out.display()))?;
    }
    if let Some(out) = &a.csv {
        std::fs::write(out, csv(&sweeps)).map_err(|e| format!("{}: {e}", out.display()))?;
    }
    if let Some(s) = sweeps.iter().find(|s| s.unengaged > 0) {
        return Err(format!(
            "{}: the runtime created no fiber in {} run(s)",
            s.name(),
            s.unengaged
        ));
    }
    if targets(&sweeps, &caps)
        .iter()
        .any(|t| t.name.starts_with("wrong") && !t.pass)
    {
        return Err("wrong answers below a knee".into());
    }
    Ok(())
}

fn main() {
    toffload_cli::generate_if_requested::<Args>();
    let a = Args::parse();
    if let Err(e) = real_main(&a) {
        eprintln!("toffload-openloop: {e}");
        std::process::exit(1);
    }
}
