//! The demo (`cargo xtask demo`): the same unmodified conn_server binary, stock and
//! under the fiber runtime (LD_PRELOAD=libtoffload.so), on the emulated device, server
//! pinned to core 0 and load generator to core 1, for a sweep of offload latencies and
//! both of accel_run's wait styles (the runtime replaces that wait entirely), plus a
//! row set with 4 device lanes where the device's ceiling (lanes / latency) binds.
//!
//! With `--runs N` every point is measured N times and the table shows medians;
//! `--switch` adds the fiber park + resume cost (bench_switch), `--idle` the idle CPU
//! of a preloaded server; `cargo xtask bench runtime` runs all of it into
//! tests/results/runtime.md. Exits 1 on any wrong answer or error, or when the
//! runtime did not engage (TOFFLOAD_STATS fibers_created == 0).

use clap::Parser;
use std::fmt::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use toffload_tests::device_core::DeviceCore;
use toffload_tests::harness::{self, median, Server, ServerSpec};
use toffload_tests::load::{self, Config};

#[path = "toffload-table/handoff.rs"]
mod handoff;
#[path = "toffload-table/placement.rs"]
mod placement;
#[path = "toffload-table/syscalls.rs"]
mod syscalls;
#[path = "toffload-table/vendor.rs"]
mod vendor;

#[derive(Parser)]
#[command(
    name = "toffload-table",
    version = toffload_cli::VERSION,
    about = "conn_server on the emulated device, stock and under libtoffload.so, measured",
    args_override_self = true
)]
struct Args {
    /// Offload latencies to sweep, microseconds.
    #[arg(long, value_delimiter = ',', default_value = "20,50,100,200,500,1000")]
    latencies: Vec<u32>,
    /// Client connections.
    #[arg(long, default_value_t = 64)]
    conns: usize,
    /// Request size, bytes.
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Measured seconds per run of a point.
    #[arg(long, default_value_t = 1.5)]
    secs: f64,
    /// Warm-up seconds per run (not measured; wrong answers still count).
    #[arg(long, default_value_t = 0.4)]
    warmup: f64,
    /// Runs per point; the table shows the median.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Lanes of the extra row set where the device ceiling binds (0: no such set).
    #[arg(long, default_value_t = 4)]
    small_lanes: usize,
    /// Measure the stock server only (no LD_PRELOAD).
    #[arg(long)]
    stock_only: bool,
    /// Also measure the fiber park + resume cost (bench_switch).
    #[arg(long)]
    switch: bool,
    /// Handoffs per bench_switch run.
    #[arg(long, default_value_t = 2_000_000)]
    switch_handoffs: u64,
    /// Also measure the idle CPU of a preloaded conn_server with no traffic.
    #[arg(long)]
    idle: bool,
    /// Seconds of each idle CPU measurement.
    #[arg(long, default_value_t = 5.0)]
    idle_secs: f64,
    /// Also count the runtime's syscalls per request (perf on the raw_syscalls
    /// tracepoint, the server's own threads; needs perf and root).
    #[arg(long)]
    syscalls: bool,
    /// Also measure the blocked-carrier handoff: rawfutex_server --hold-lock stock and
    /// under the runtime, with the runtime's handoffs per second.
    #[arg(long)]
    handoff: bool,
    /// Write the report (markdown) to this file as well.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Where the emulated device's thread runs (tests/src/device_core.rs): the server's
    /// core (the default here, as every committed table), where its wake-ups cost the
    /// server CPU no real device's do, or the load generator's, where the load
    /// generator delays them (the stock server at 20 us lost 60% of its rate).
    #[arg(long, value_enum, default_value_t = DeviceCore::Server)]
    device_core: DeviceCore,
    /// Offload latencies (blocking wait, 64 lanes) measured again with the emulated
    /// device's thread on the server's core and on the load generator's, the two
    /// interleaved run by run (placement.rs; empty: none).
    #[arg(long, value_delimiter = ',')]
    placement: Vec<u32>,
    /// Offload latencies at which the servers whose wait has no due time (hsm_server's
    /// vendor row, gpu_server's CUDA synchronize) are measured beside conn_server, at
    /// 8 and 64 connections (vendor.rs; empty: none).
    #[arg(long, value_delimiter = ',')]
    vendor: Vec<u32>,
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

/// A fresh path for a TOFFLOAD_STATS file.
fn stats_path(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    std::env::temp_dir().join(format!(
        "toffload-table-{}-{tag}-{}.json",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// The runtime's counters (TOFFLOAD_STATS), as far as the demo uses them.
#[derive(Clone, Copy, Default, Debug)]
struct Stats {
    fibers_created: u64,
    offloads: u64,
    offloads_inline: u64,
    handoffs: u64,
}

/// Reads the stats file (the runtime rewrites it within 50 ms of a change).
fn read_stats(p: &Path) -> Result<Stats, String> {
    let t0 = Instant::now();
    loop {
        let r = std::fs::read_to_string(p)
            .map_err(|e| e.to_string())
            .and_then(|s| {
                serde_json::from_str::<serde_json::Value>(s.trim()).map_err(|e| e.to_string())
            });
        match r {
            Ok(v) => {
                let g = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
                return Ok(Stats {
                    fibers_created: g("fibers_created"),
                    offloads: g("offloads"),
                    offloads_inline: g("offloads_inline"),
                    handoffs: g("handoffs"),
                });
            }
            Err(e) if t0.elapsed() > Duration::from_millis(500) => {
                return Err(format!("TOFFLOAD_STATS file {}: {e}", p.display()))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// One measured run of one configuration.
#[derive(Clone, Copy, Debug)]
struct Sample {
    rps: f64,
    p50: f64,
    p99: f64,
    wrong: u64,
    errors: u64,
    stats: Option<Stats>,
    /// Syscalls per request of the server's own threads (perf; None without it).
    syscalls: Option<f64>,
}

#[derive(Clone, Copy)]
struct Point {
    lat: u32,
    wait: &'static str,
    lanes: usize,
    /// Where the emulated device's thread runs.
    device: DeviceCore,
    server: vendor::Served,
    conns: usize,
}

fn server_spec(a: &Args, p: Point, runtime: Option<(&Path, &Path)>) -> ServerSpec {
    let mut spec = p
        .server
        .spec()
        .arg("--size")
        .arg(a.size.to_string())
        .env("TOFFLOAD_EMU_LAT_US", p.lat.to_string())
        .env("TOFFLOAD_EMU_LANES", p.lanes.to_string())
        .env("TOFFLOAD_WAIT", p.wait)
        .cpu((harness::cpus() >= 2).then_some(0));
    spec = p.device.place(spec);
    if let Some((lib, stats)) = runtime {
        spec = spec
            .env("LD_PRELOAD", lib.display().to_string())
            .env("TOFFLOAD_STATS", stats.display().to_string());
    }
    spec
}

/// One run of `p`, stock or under the runtime. `count`: the runtime's syscalls counted
/// by perf over the measured window, which slows what it counts (a tracepoint hit per
/// syscall), so a counted run's rate goes into no median.
fn sample(a: &Args, p: Point, runtime: bool, count: bool) -> Result<Sample, String> {
    let lib = if runtime { Some(runtime_lib()?) } else { None };
    let stats = stats_path("point");
    let spec = server_spec(a, p, lib.as_deref().map(|l| (l, stats.as_path())));
    let mut server = Server::start(&spec)?;
    let mut cfg = Config::new(server.port);
    cfg.conns = p.conns;
    cfg.size = a.size;
    cfg.duration = Duration::from_secs_f64(a.secs);
    cfg.warmup = Duration::from_secs_f64(a.warmup);
    let counting =
        (runtime && count).then(|| syscalls::count(server.pid(), cfg.warmup, cfg.duration));
    let r = load::run(&cfg).map_err(|e| e.to_string())?;
    let syscalls = counting
        .and_then(|c| c.join().ok().flatten())
        .filter(|_| r.completed > 0)
        .map(|n| n as f64 / r.completed as f64);
    if !server.alive() {
        return Err(format!(
            "{}{} died under load: {:?}; load: {r:?}",
            p.server.name(),
            if runtime { " under the runtime" } else { "" },
            server.terminate()
        ));
    }
    let st = if runtime {
        // Let the runtime's at-most-every-50-ms rewrite catch up.
        std::thread::sleep(Duration::from_millis(120));
        let s = read_stats(&stats);
        let _ = std::fs::remove_file(&stats);
        Some(s?)
    } else {
        None
    };
    drop(server);
    Ok(Sample {
        rps: r.requests_per_sec,
        p50: r.p50_us,
        p99: r.p99_us,
        wrong: r.wrong,
        errors: r.errors,
        stats: st,
        syscalls,
    })
}

/// Medians over the runs of one mode of one point.
#[derive(Clone, Copy, Default)]
struct Agg {
    rps: f64,
    p50: f64,
    p99: f64,
    wrong: u64,
    errors: u64,
    /// Fewest fibers any runtime run created (0: it did not engage at least once).
    min_fibers: u64,
    inline_share: f64,
    /// Syscalls per request, from the point's one counted run (NaN: not counted).
    syscalls: f64,
    /// Median handoffs per second over a run's warm-up and measured seconds (NaN: stock).
    handoffs_per_s: f64,
}

/// `points` measured stock and under the runtime, `a.runs` times, interleaved run by
/// run (each round takes every point once, stock then runtime); per point its stock
/// and runtime medians. `label` names a point in the progress lines.
fn interleaved(
    a: &Args,
    points: &[Point],
    label: impl Fn(&Point) -> String,
) -> Result<Vec<(Point, Agg, Agg)>, String> {
    let mut runs: Vec<(Vec<Sample>, Vec<Sample>)> = vec![Default::default(); points.len()];
    for _ in 0..a.runs {
        for (p, run) in points.iter().zip(runs.iter_mut()) {
            let s = sample(a, *p, false, false)?;
            let r = sample(a, *p, true, false)?;
            eprintln!(
                "  {}: stock {:.0} runtime {:.0} req/s",
                label(p),
                s.rps,
                r.rps
            );
            run.0.push(s);
            run.1.push(r);
        }
    }
    let secs = a.warmup + a.secs;
    Ok(points
        .iter()
        .zip(runs)
        .map(|(p, (st, rt))| (*p, aggregate(&st, secs), aggregate(&rt, secs)))
        .collect())
}

fn aggregate(s: &[Sample], secs: f64) -> Agg {
    let m = |f: fn(&Sample) -> f64| median(s.iter().map(f).collect());
    let offloads: u64 = s.iter().filter_map(|x| x.stats).map(|x| x.offloads).sum();
    let inline: u64 = s
        .iter()
        .filter_map(|x| x.stats)
        .map(|x| x.offloads_inline)
        .sum();
    Agg {
        rps: m(|x| x.rps),
        p50: m(|x| x.p50),
        p99: m(|x| x.p99),
        wrong: s.iter().map(|x| x.wrong).sum(),
        errors: s.iter().map(|x| x.errors).sum(),
        min_fibers: s
            .iter()
            .filter_map(|x| x.stats)
            .map(|x| x.fibers_created)
            .min()
            .unwrap_or(0),
        inline_share: if offloads > 0 {
            inline as f64 / offloads as f64
        } else {
            f64::NAN
        },
        // Counted in a run of its own (sample's `count`), filled in by the caller.
        syscalls: f64::NAN,
        handoffs_per_s: {
            let v: Vec<f64> = s
                .iter()
                .filter_map(|x| x.stats)
                .map(|x| x.handoffs as f64 / secs)
                .collect();
            if v.is_empty() {
                f64::NAN
            } else {
                median(v)
            }
        },
    }
}

struct Row {
    p: Point,
    stock: Agg,
    rt: Option<Agg>,
}

impl Row {
    fn speedup(&self) -> Option<f64> {
        self.rt.map(|r| r.rps / self.stock.rps)
    }
}

/// CPU time of a process so far, ns: the sum of its threads' schedstat run times, and
/// utime + stime from /proc/PID/stat (clock ticks, which include exited threads).
fn cpu_ns(pid: u32) -> Result<(u64, u64), String> {
    let mut sched = 0u64;
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).map_err(|e| e.to_string())?;
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
            sched += s
                .split_whitespace()
                .next()
                .and_then(|x| x.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| e.to_string())?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = &stat[stat.rfind(')').ok_or("bad /proc/PID/stat")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok((sched, ticks * 1_000_000_000 / hz))
}

/// Share of one core a process used over `secs` (schedstat, stat).
fn cpu_share(pid: u32, secs: f64) -> Result<(f64, f64), String> {
    let (s0, t0) = cpu_ns(pid)?;
    let w0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (s1, t1) = cpu_ns(pid)?;
    let wall = w0.elapsed().as_nanos() as f64;
    Ok(((s1 - s0) as f64 / wall, (t1 - t0) as f64 / wall))
}

struct Idle {
    what: &'static str,
    closed: (f64, f64),
    open: (f64, f64),
    fibers: Option<u64>,
}

/// conn_server after a 1 s burst of load (so carriers and fibers existed): its CPU with
/// every connection closed, then with `conns` connections open and silent.
fn idle_cpu(a: &Args, runtime: bool) -> Result<Idle, String> {
    let lib = if runtime { Some(runtime_lib()?) } else { None };
    let stats = stats_path("idle");
    let p = Point {
        lat: 100,
        wait: "block",
        lanes: a.conns.max(64),
        device: a.device_core,
        server: vendor::Served::Conn,
        conns: a.conns,
    };
    let mut server = Server::start(&server_spec(
        a,
        p,
        lib.as_deref().map(|l| (l, stats.as_path())),
    ))?;
    let mut cfg = Config::new(server.port);
    cfg.conns = a.conns;
    cfg.size = a.size;
    cfg.duration = Duration::from_secs(1);
    cfg.warmup = Duration::from_millis(200);
    let r = load::run(&cfg).map_err(|e| e.to_string())?;
    if !server.alive() {
        return Err(format!("idle: conn_server died: {:?}", server.terminate()));
    }
    if r.wrong > 0 || r.errors > 0 {
        return Err(format!(
            "idle: the burst had {} wrong answers, {} errors {:?}",
            r.wrong, r.errors, r.errors_by_kind
        ));
    }
    std::thread::sleep(Duration::from_secs(1));
    let closed = cpu_share(server.pid(), a.idle_secs)?;
    let conns: Vec<std::net::TcpStream> = (0..a.conns)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", server.port)))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("idle: connecting: {e}"))?;
    std::thread::sleep(Duration::from_millis(500));
    let open = cpu_share(server.pid(), a.idle_secs)?;
    drop(conns);
    if !server.alive() {
        return Err(format!("idle: conn_server died: {:?}", server.terminate()));
    }
    let fibers = if runtime {
        let s = read_stats(&stats);
        let _ = std::fs::remove_file(&stats);
        Some(s?.fibers_created)
    } else {
        None
    };
    Ok(Idle {
        what: if runtime { "runtime" } else { "stock" },
        closed,
        open,
        fibers,
    })
}

/// bench_switch under the runtime (TOFFLOAD_FIBERIZE=all, TOFFLOAD_FIBER_TLS=`tls`) or
/// stock (None), pinned to core 0: (ns per switch, ran as fibers).
fn switch_cost(a: &Args, tls: Option<&str>) -> Result<(f64, bool), String> {
    let mut cmd = Command::new(harness::bin("bench_switch")?);
    cmd.arg(a.switch_handoffs.to_string());
    if let Some(tls) = tls {
        cmd.env("LD_PRELOAD", runtime_lib()?)
            .env("TOFFLOAD_FIBERIZE", "all")
            .env("TOFFLOAD_FIBER_TLS", tls);
    }
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(0, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            Ok(())
        });
    }
    let out = cmd.output().map_err(|e| format!("bench_switch: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "bench_switch failed ({}): {text} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let field = |k: &str| {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .map(str::to_string)
    };
    let ns = field("ns_per_switch=")
        .and_then(|v| v.parse::<f64>().ok())
        .ok_or_else(|| format!("bench_switch printed {text:?}"))?;
    Ok((ns, field("fibers=").as_deref() == Some("1")))
}

/// The 1-minute load average (other work on the machine disturbs the numbers).
fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn fmt_rate(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else {
        format!("{x:.0}")
    }
}

fn mark(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "FAIL"
    }
}

fn main() {
    toffload_cli::generate_if_requested::<Args>();
    let a = Args::parse();
    if let Err(e) = real_main(&a) {
        eprintln!("toffload-table: {e}");
        std::process::exit(1);
    }
}

fn real_main(a: &Args) -> Result<(), String> {
    if a.runs == 0 || a.conns == 0 {
        return Err("--runs and --conns must be at least 1".into());
    }
    if harness::cpus() >= 2 {
        // The load generator on core 1, the server on core 0.
        if let Err(e) = harness::pin_current_thread(1) {
            eprintln!("toffload-table: cannot pin the load generator: {e}");
        }
    } else {
        eprintln!("toffload-table: one CPU only: server and load generator share it");
    }
    if !a.stock_only {
        runtime_lib()?;
    }
    let lanes = a.conns.max(64);
    let mut plan: Vec<Point> = Vec::new();
    for &lat in &a.latencies {
        for wait in ["spin", "block"] {
            plan.push(Point {
                lat,
                wait,
                lanes,
                device: a.device_core,
                server: vendor::Served::Conn,
                conns: a.conns,
            });
        }
    }
    if a.small_lanes > 0 {
        for &lat in &a.latencies {
            plan.push(Point {
                lat,
                wait: "block",
                lanes: a.small_lanes,
                device: a.device_core,
                server: vendor::Served::Conn,
                conns: a.conns,
            });
        }
    }
    let started = Instant::now();
    let load_before = loadavg();
    if load_before > 0.5 {
        eprintln!(
            "toffload-table: the machine is busy (1-minute load average {load_before:.2}); \
             the numbers will be disturbed"
        );
    }
    let mut rows = Vec::new();
    for p in plan {
        eprint!("  {} us, wait={}, lanes={}:", p.lat, p.wait, p.lanes);
        let (mut st, mut rt) = (Vec::new(), Vec::new());
        for _ in 0..a.runs {
            let s = sample(a, p, false, false)?;
            eprint!(" stock {:.0}", s.rps);
            st.push(s);
            if !a.stock_only {
                let r = sample(a, p, true, false)?;
                eprint!(" runtime {:.0}", r.rps);
                rt.push(r);
            }
        }
        let mut rt = (!a.stock_only).then(|| aggregate(&rt, a.warmup + a.secs));
        if let (Some(agg), true) = (rt.as_mut(), a.syscalls) {
            let c = sample(a, p, true, true)?;
            eprint!(" (counted: {:.0})", c.rps);
            agg.syscalls = c.syscalls.unwrap_or(f64::NAN);
            agg.wrong += c.wrong;
            agg.errors += c.errors;
        }
        eprintln!(" req/s");
        rows.push(Row {
            p,
            stock: aggregate(&st, a.warmup + a.secs),
            rt,
        });
    }

    let mut t = String::new();
    let _ = writeln!(
        t,
        "conn_server (unmodified), stock{}, {} connections, {} B requests, server on \
         core 0, load on core 1, {} (`--device-core`), {:.1} s measured per run, median of \
         {} run(s) per point.\n",
        if a.stock_only {
            " only (--stock-only)"
        } else {
            " vs under libtoffload.so (LD_PRELOAD, 1 carrier)"
        },
        a.conns,
        a.size,
        a.device_core.label(),
        a.secs,
        a.runs
    );
    t.push_str(
        "| offload us | wait | lanes | stock req/s | stock p50 us | runtime req/s | speedup | \
         runtime p50 us | runtime p99 us | ceiling req/s | runtime/ceiling | inline % | \
         runtime syscalls/req | handoffs/s | wrong | errors |\n",
    );
    t.push_str(
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in &rows {
        // What overlapping every wait could reach: min(conns, lanes) ops per latency.
        let ceiling = a.conns.min(r.p.lanes) as f64 / (r.p.lat as f64 * 1e-6);
        let rt = r.rt.unwrap_or(Agg {
            rps: f64::NAN,
            p50: f64::NAN,
            p99: f64::NAN,
            inline_share: f64::NAN,
            syscalls: f64::NAN,
            handoffs_per_s: f64::NAN,
            ..Agg::default()
        });
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.p.lat,
            r.p.wait,
            r.p.lanes,
            fmt_rate(r.stock.rps),
            fmt_rate(r.stock.p50),
            fmt_rate(rt.rps),
            r.speedup().map_or("-".into(), |s| format!("{s:.2}x")),
            fmt_rate(rt.p50),
            fmt_rate(rt.p99),
            fmt_rate(ceiling),
            if rt.rps.is_nan() {
                "-".into()
            } else {
                format!("{:.2}", rt.rps / ceiling)
            },
            if rt.inline_share.is_nan() {
                "-".into()
            } else {
                format!("{:.0}", rt.inline_share * 100.0)
            },
            if rt.syscalls.is_nan() {
                "-".into()
            } else {
                format!("{:.2}", rt.syscalls)
            },
            fmt_rate(rt.handoffs_per_s),
            r.stock.wrong + rt.wrong,
            r.stock.errors + rt.errors,
        );
    }
    t.push_str(
        "\nThe runtime replaces accel_run's wait (submit, park the fiber, resume on \
         completion), so TOFFLOAD_WAIT only changes the stock server; the runtime runs \
         get the same environment as the stock ones. inline %: offloads the runtime \
         waited for inline because they were shorter than a park + resume. runtime \
         syscalls/req (with --syscalls): syscalls entered by the server's own threads \
         (perf, raw_syscalls:sys_enter, per thread, the emulated device's thread \
         excluded) over the measured window, per completed request, in one more \
         runtime run per point whose rate is in no median (perf's tracepoint on every \
         syscall slows what it counts). handoffs/s: the \
         runtime's blocked-carrier handoffs (TOFFLOAD_STATS) over a run's warm-up and \
         measured seconds; conn_server never waits below libc, so any here is the \
         monitor misjudging a wait.\n",
    );

    // Targets (issue 3), marked honestly.
    let mut targets: Vec<(String, bool)> = Vec::new();
    let find = |lat: u32, wait: &str| {
        rows.iter()
            .find(|r| r.p.lat == lat && r.p.wait == wait && r.p.lanes == lanes)
    };
    if !a.stock_only {
        for (lat, wait, min) in [
            (200, "spin", 5.0),
            (1000, "spin", 10.0),
            (200, "block", 1.5),
            (20, "spin", 1.0),
            (20, "block", 1.0),
        ] {
            if let Some(s) = find(lat, wait).and_then(Row::speedup) {
                targets.push((
                    format!("speedup vs {wait} at {lat} us >= {min}x: {s:.2}x"),
                    s >= min,
                ));
            }
        }
    }
    let wrong: u64 = rows
        .iter()
        .map(|r| r.stock.wrong + r.rt.map_or(0, |x| x.wrong))
        .sum();
    let errors: u64 = rows
        .iter()
        .map(|r| r.stock.errors + r.rt.map_or(0, |x| x.errors))
        .sum();
    targets.push((format!("wrong answers: {wrong}"), wrong == 0));
    if let Some(rt) = find(200, "block").and_then(|r| r.rt) {
        if !rt.syscalls.is_nan() {
            targets.push((
                format!(
                    "runtime syscalls per request at 200 us <= 3.5: {:.2}",
                    rt.syscalls
                ),
                rt.syscalls <= 3.5,
            ));
        }
    }

    let mut extra_fail = Vec::new();
    if a.switch {
        eprint!(
            "  fiber switch (bench_switch, {} handoffs):",
            a.switch_handoffs
        );
        let mut fib = Vec::new();
        let mut shared = Vec::new();
        let mut engaged = true;
        let mut kern = Vec::new();
        for _ in 0..a.runs.max(3) {
            if !a.stock_only {
                let (ns, f) = switch_cost(a, Some("copy"))?;
                engaged &= f;
                eprint!(" runtime {ns:.0} ns");
                fib.push(ns);
                let (ns, f) = switch_cost(a, Some("shared"))?;
                engaged &= f;
                eprint!(" shared TLS {ns:.0} ns");
                shared.push(ns);
            }
            let (ns, _) = switch_cost(a, None)?;
            eprint!(" kernel {ns:.0} ns");
            kern.push(ns);
        }
        eprintln!();
        let _ = writeln!(
            t,
            "\nFiber park + resume (bench_switch: 2 threads hand a token back and forth \
             with sched_yield, pinned to one core, {} handoffs, median of {} runs; one \
             switch = park the running fiber + resume the other):\n",
            a.switch_handoffs,
            kern.len()
        );
        t.push_str(
            "| threads | ns per switch (park + resume) | ns per round trip (A to B to A) |\n|---|---:|---:|\n",
        );
        if !a.stock_only {
            let m = median(fib);
            let _ = writeln!(
                t,
                "| fibers (libtoffload.so, TOFFLOAD_FIBERIZE=all; 320 B of TLS copied per \
                 fiber) | {m:.1} | {:.1} |",
                2.0 * m
            );
            let sh = median(shared);
            let _ = writeln!(
                t,
                "| fibers, TOFFLOAD_FIBER_TLS=shared (no copy) | {sh:.1} | {:.1} |",
                2.0 * sh
            );
            if engaged {
                targets.push((
                    format!("fiber park + resume < 200 ns: {m:.1} ns"),
                    m < 200.0,
                ));
            } else {
                extra_fail.push("bench_switch's threads did not run as fibers under the runtime");
                targets.push((
                    "fiber park + resume < 200 ns: the threads were not fibers".into(),
                    false,
                ));
            }
        }
        let _ = writeln!(
            t,
            "| kernel threads (stock, sched_yield) | {:.1} | {:.1} |",
            median(kern.clone()),
            2.0 * median(kern)
        );
    }
    if !a.placement.is_empty() && !a.stock_only {
        t.push_str(&placement::section(a, &mut targets)?);
    }
    if !a.vendor.is_empty() && !a.stock_only {
        t.push_str(&vendor::section(a, &mut targets)?);
    }
    if a.handoff && !a.stock_only {
        eprint!(
            "  handoff (rawfutex_server --hold-lock, {} us, {} connections):",
            handoff::LAT_US,
            handoff::CONNS
        );
        let rows = handoff::measure(a)?;
        let _ = writeln!(
            t,
            "\nBlocked-carrier handoff: rawfutex_server --hold-lock (a raw-futex lock, below \
             libc, held across each {} us offload; {} connections, {:.1} s measured per run, \
             median of {} runs, stock and runtime interleaved). Under the runtime each wait \
             on that lock strands its carrier until the monitor hands the carrier's other \
             fibers to a spare thread; the waits are not overlapped, the server only keeps \
             serving:\n",
            handoff::LAT_US,
            handoff::CONNS,
            a.secs,
            a.runs
        );
        t.push_str(
            "| server | req/s | p99 us | handoffs/s | wrong | errors |\n|---|---:|---:|---:|---:|---:|\n",
        );
        for r in &rows {
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} | {} | {} |",
                r.what,
                fmt_rate(r.rps),
                fmt_rate(r.p99),
                r.handoffs_per_s.map_or("-".into(), fmt_rate),
                r.wrong,
                r.errors
            );
            if r.wrong > 0 {
                extra_fail.push("the hold-lock server gave wrong answers");
            }
            if r.handoffs_per_s.is_some() && (r.rps < 1.0 || r.handoffs_per_s == Some(0.0)) {
                extra_fail.push("the hold-lock server under the runtime froze or never handed off");
            }
        }
    }
    if a.idle {
        eprintln!("  idle CPU ({:.0} s per measurement) ...", a.idle_secs);
        let mut res = vec![idle_cpu(a, false)?];
        if !a.stock_only {
            res.push(idle_cpu(a, true)?);
        }
        let _ = writeln!(
            t,
            "\nIdle CPU of conn_server (100 us offloads, 64 lanes) after a 1 s burst of \
             {} connections, no traffic, {:.0} s each, share of one core \
             (threads' schedstat run time; utime+stime from /proc/PID/stat in brackets):\n",
            a.conns, a.idle_secs
        );
        t.push_str("| server | connections closed | connections open, silent |\n|---|---:|---:|\n");
        for r in &res {
            let _ = writeln!(
                t,
                "| {}{} | {:.3}% ({:.2}%) | {:.3}% ({:.2}%) |",
                r.what,
                r.fibers
                    .map_or(String::new(), |f| format!(" ({f} fibers created)")),
                r.closed.0 * 100.0,
                r.closed.1 * 100.0,
                r.open.0 * 100.0,
                r.open.1 * 100.0
            );
            if r.what == "runtime" {
                let worst = r.closed.0.max(r.open.0) * 100.0;
                targets.push((
                    format!("idle preloaded server < 1% of a core: {worst:.3}%"),
                    worst < 1.0,
                ));
                if r.fibers == Some(0) {
                    extra_fail.push("the idle server's runtime did not engage");
                }
            }
        }
    }

    t.push_str("\nTargets:\n\n");
    for (what, ok) in &targets {
        let _ = writeln!(t, "- [{}] {what}", mark(*ok));
    }
    let _ = writeln!(
        t,
        "\n({:.0} s in all. The machine's 1-minute load average was {load_before:.2} before \
         the first run and {:.2} after the last, this run's own server and load generator \
         included: well above 2 means other work shared the 2 cores and disturbed the numbers.)",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    println!("{t}");
    if let Some(out) = &a.out {
        std::fs::write(out, &t).map_err(|e| format!("writing {}: {e}", out.display()))?;
    }
    let mut fail = Vec::new();
    if wrong > 0 || errors > 0 {
        fail.push(format!(
            "{wrong} wrong answers, {errors} errors (see table)"
        ));
    }
    if !a.stock_only {
        let idle: Vec<String> = rows
            .iter()
            .filter(|r| r.rt.is_some_and(|x| x.min_fibers == 0))
            .map(|r| format!("{} us/{}/{} lanes", r.p.lat, r.p.wait, r.p.lanes))
            .collect();
        if !idle.is_empty() {
            fail.push(format!(
                "the runtime did not engage (TOFFLOAD_STATS fibers_created = 0) at: {}",
                idle.join(", ")
            ));
        }
    }
    fail.extend(extra_fail.iter().map(|s| s.to_string()));
    if fail.is_empty() {
        Ok(())
    } else {
        Err(fail.join("; "))
    }
}
