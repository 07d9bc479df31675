//! toffload-watch: the CLI over the library. Exit codes: see error.rs and the README.

use clap::{Args, Parser, Subcommand};
use std::process::ExitCode;
use std::time::Duration;
use toffload_watch::error::WatchError;
use toffload_watch::inject_flow::InjectRequest;
use toffload_watch::kernel::start_priority::StartPriority;
use toffload_watch::report::Final;
use toffload_watch::serve::config::parse_duration;
use toffload_watch::session::{self, Options};
use toffload_watch::sink::{Format, Report};
use toffload_watch::{dashboard, inject, service, spawn, target};

#[derive(Parser)]
#[command(
    name = "toffload-watch",
    version = toffload_cli::VERSION,
    about = "Watch a server with eBPF: offload stalls, futexes, context switches, syscalls, and whether overlapping its offload wait can work",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    /// A process to watch, with every process below it (a pre-forking server's
    /// master: its workers, and those it forks later). Repeatable.
    #[arg(short = 'p', long)]
    pid: Vec<u32>,
    /// Watch every process of a cgroup (v2), e.g. system.slice/nginx.service or a
    /// full path under /sys/fs/cgroup.
    #[arg(long, value_name = "PATH")]
    cgroup: Option<std::path::PathBuf>,
    /// Watch a systemd unit's processes, found by name in the cgroup tree (nginx is
    /// nginx.service; systemd itself is not asked).
    #[arg(long, value_name = "NAME", conflicts_with = "cgroup")]
    unit: Option<String>,
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Args, Clone)]
struct Common {
    /// Report window as bcc's tools take it: seconds (2, 0.5) or a duration (500ms);
    /// not with --interval.
    #[arg(value_name = "INTERVAL", value_parser = parse_duration, conflicts_with = "interval")]
    interval_pos: Option<Duration>,
    /// Windows to report, then the final report and exit; not with --duration.
    #[arg(value_name = "COUNT", value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "duration")]
    count: Option<u32>,
    /// Report window, e.g. 1s, 500ms (a bare number is seconds; default 1s).
    #[arg(short = 'i', long, value_parser = parse_duration)]
    interval: Option<Duration>,
    /// Stop after this long (default: until the process exits or Ctrl-C).
    #[arg(short = 'd', long, value_parser = parse_duration)]
    duration: Option<Duration>,
    /// One JSON object per line instead of text (docs/json-schema.md).
    #[arg(short = 'j', long)]
    json: bool,
    /// Start each text line with the local time, HH:MM:SS (JSON lines always carry
    /// their `ts`).
    #[arg(short = 'T', long, conflicts_with = "tui")]
    timestamp: bool,
    /// Percent of each interval to trace (1-100), fixed. Below 100 the programs are
    /// detached for the rest, which cuts the overhead in proportion; rates are per
    /// traced second. 100: trace everything (exact counts). Default: follow
    /// --overhead-budget.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=100))]
    sample: Option<u8>,
    /// Keep the watch's own cost under this percent of the target's CPU: the cost of
    /// each traced event is measured at start, and when a window's events cost more
    /// (the target's, and the syscalls of the host's other processes, which the hooks
    /// slow too), less of each interval is traced. The default is half a percent because that
    /// measured cost is a floor (a busy server's cold caches add to it, and each burst
    /// has fixed costs): the benchmark measures about twice it.
    #[arg(long, default_value_t = 0.5, value_parser = parse_budget, conflicts_with = "sample")]
    overhead_budget: f64,
    /// Show the live dashboard instead of text (keys: ? help, i inject, p pause, q quit).
    #[arg(long, conflicts_with = "json")]
    tui: bool,
    /// Once the verdict is in, restart the target under the bundled fiber runtime (same
    /// command line, environment, directory and user) and keep watching the new pid.
    #[arg(long)]
    inject: bool,
    /// With --inject: print exactly what would be done, change nothing.
    #[arg(long, requires = "inject")]
    dry_run: bool,
    /// With --inject (or key i): inject even when the verdict says it will not work.
    #[arg(long)]
    force: bool,
    /// With --inject: windows with requests to watch before deciding.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    inject_after: u32,
    /// Probe this function as the offload besides the known ones (accel_run, the CUDA
    /// synchronize calls): SYMBOL[@LIBRARY][=SUBMIT:DONE:RELEASE]. With its
    /// non-blocking triple, --inject hands the row to the runtime
    /// (TOFFLOAD_OFFLOAD), which hides the wait; without, the wait is measured and
    /// --inject refuses. Repeatable.
    #[arg(long, value_name = "SPEC")]
    offload: Vec<toffload_watch::offload_spec::OffloadSpec>,
    /// Measure what each traced event costs even where an earlier start in this boot
    /// measured it (kept in /run/toffload; the measurement takes a few tens of ms of
    /// CPU beside the target).
    #[arg(long)]
    recalibrate: bool,
    /// With --inject: how long the injected server must keep serving (alive, listening,
    /// its runtime active, requests served where the original served some) before the
    /// injection stands; if it does not, the original command is started again (exit
    /// 12). 0 turns the window off.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_health)]
    inject_health: Duration,
    /// Extra environment for the relaunched process only, e.g. TOFFLOAD_GUARD=detect
    /// (repeatable).
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_env)]
    inject_env: Vec<(String, String)>,
}

fn parse_budget(s: &str) -> Result<f64, String> {
    match s.trim().trim_end_matches('%').parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 100.0 => Ok(v),
        _ => Err(format!("{s:?} is not a percent in (0, 100]")),
    }
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !k.contains(char::is_whitespace) => {
            Ok((k.to_string(), v.to_string()))
        }
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Start CMD and watch it from its first instruction.
    Run {
        #[command(flatten)]
        common: Common,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Run as a service: watch the targets of a config file (or flags) across their
    /// restarts and serve /metrics (Prometheus) and /status (JSON).
    Serve(toffload_watch::serve::Args),
}

/// The report window when neither --interval nor INTERVAL is given.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

/// A duration, or 0 (no health window).
fn parse_health(s: &str) -> Result<Duration, String> {
    if s.trim().trim_end_matches('s') == "0" {
        return Ok(Duration::ZERO);
    }
    parse_duration(s)
}

fn options(c: &Common) -> Options {
    let mut env = c.inject_env.clone();
    let rows: Vec<String> = c.offload.iter().filter_map(|o| o.runtime_row()).collect();
    if !rows.is_empty() {
        let rows = rows.join(",");
        match env.iter_mut().find(|(k, _)| k == "TOFFLOAD_OFFLOAD") {
            Some((_, v)) => *v = format!("{v},{rows}"),
            None => env.push(("TOFFLOAD_OFFLOAD".into(), rows)),
        }
    }
    let io = inject::Options {
        dry_run: c.dry_run,
        force: c.force,
        env,
        health: c.inject_health,
    };
    Options {
        interval: c.interval.or(c.interval_pos).unwrap_or(DEFAULT_INTERVAL),
        duration: c.duration,
        windows: c.count,
        json: c.json,
        timestamp: c.timestamp,
        sample: c.sample.map_or(1.0, |p| f64::from(p) / 100.0),
        overhead_budget: c.sample.is_none().then_some(c.overhead_budget / 100.0),
        inject: c.inject.then(|| InjectRequest {
            opts: io.clone(),
            after_windows: c.inject_after as usize,
        }),
        interactive_inject: io,
        offloads: c.offload.clone(),
    }
}

/// Runs the session through the dashboard or the text/JSON report.
async fn watch(
    a: session::Attached,
    calib: &session::Calibration,
    opts: &Options,
    tui: bool,
) -> Result<Final, WatchError> {
    if tui {
        let mut d = dashboard::DashboardSink::enter()
            .map_err(|e| WatchError::Other(format!("starting the dashboard: {e}")))?;
        let r = session::run(a, calib, opts, &mut d).await;
        d.leave();
        r
    } else {
        let mut out = std::io::stdout();
        let mut sink = Report {
            out: &mut out,
            format: if opts.json {
                Format::Json
            } else {
                Format::Text {
                    timestamp: opts.timestamp,
                }
            },
        };
        session::run(a, calib, opts, &mut sink).await
    }
}

/// How much less nice than the watcher the calibration child's loops run (a few tens
/// of ms of CPU).
const CALIBRATION_RAISED: i32 = -10;

/// The calibration, its child's loops raised: its ping-pong measures the switch cost
/// X the model takes off the stock CPU, and beside a busy load generator at the same
/// priority it read 2-3x the switch (the demo's predictions went from 1.3-1.4x to
/// 2.3-4.4x for a measured 1.4-1.6x). The rest of it (loading a copy of the programs
/// through the verifier) runs at the start's lower priority: raised with it, it cost
/// stock nginx and redis-server three quarters of their requests for a quarter second.
fn calibrate(start: &StartPriority, pid: Option<u32>, fresh: bool) -> session::Calibration {
    let avoid = pid.map(target::cpus).unwrap_or_default();
    session::Calibration::measure(
        (start.base() + CALIBRATION_RAISED).clamp(-20, 19),
        &avoid,
        fresh,
    )
}

async fn watch_service(
    spec: service::Spec,
    opts: Options,
    tui: bool,
    fresh: bool,
) -> Result<Final, WatchError> {
    toffload_watch::loader::check_privileges()?;
    let set = service::resolve(&spec)?;
    let nicer = StartPriority::lower(&target::cpus(set.root));
    let calib = calibrate(&nicer, Some(set.root), fresh);
    // Resolved again after the calibration: a worker may have been forked meanwhile.
    let set = service::resolve(&spec)?;
    let a = session::attach(set.root, &set.all, &opts.offloads, false)?;
    drop(nicer);
    watch(a, &calib, &opts, tui).await
}

async fn watch_command(
    argv: Vec<String>,
    opts: Options,
    tui: bool,
    fresh: bool,
) -> Result<Final, WatchError> {
    // Check before starting anything, so that a refused watch leaves no process.
    toffload_watch::loader::check_privileges()?;
    // Forked (and held before its exec) first, so that it does not inherit the
    // start-up's nicer priority.
    let mut held = spawn::start(&argv)?;
    // Just forked, the command has no CPUs of its own yet (it has the watcher's).
    let nicer = StartPriority::lower(&[]);
    let calib = calibrate(&nicer, None, fresh);
    let mut a = session::attach(held.pid(), &[], &opts.offloads, true)?;
    for prog in spawn::programs(&argv) {
        a.probe_files(held.pid(), &target::planned_files(&prog.to_string_lossy()))?;
    }
    drop(nicer);
    held.release();
    // Until the exec is done, /proc shows the watcher's own fork.
    let t0 = std::time::Instant::now();
    while target::exe(held.pid()).as_deref() != Some(held.exe.as_path())
        && target::alive(held.pid())
        && t0.elapsed() < Duration::from_secs(2)
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let r = watch(a, &calib, &opts, tui).await;
    // The command is ours to end, unless it was replaced by an injection (the
    // relaunched server outlives the watch like any injected server).
    let replaced = r.as_ref().is_ok_and(|f| f.injection.is_some());
    if !replaced && (r.is_err() || target::alive(held.pid())) {
        held.kill();
    }
    eprintln!("toffload-watch: {} {}", argv[0], held.wait());
    r
}

fn main() -> ExitCode {
    // This binary is also the child that measures what tracing costs (probe_cost.rs).
    toffload_watch::probe_cost::child_main_if_requested();
    toffload_cli::generate_if_requested::<Cli>();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("toffload-watch: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let spec = service::Spec {
        pids: cli.pid,
        cgroup: cli.cgroup,
        unit: cli.unit,
    };
    let named = !spec.pids.is_empty() || spec.cgroup.is_some() || spec.unit.is_some();
    let result = match (cli.cmd, named) {
        (Some(Cmd::Run { common, command }), _) => rt.block_on(watch_command(
            command,
            options(&common),
            common.tui,
            common.recalibrate,
        )),
        // The service has its own threads and runtimes (serve/mod.rs).
        (Some(Cmd::Serve(args)), _) => {
            return match toffload_watch::serve::run(&args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("toffload-watch: {e}");
                    ExitCode::from(e.exit_code())
                }
            }
        }
        (None, true) => rt.block_on(watch_service(
            spec,
            options(&cli.common),
            cli.common.tui,
            cli.common.recalibrate,
        )),
        (None, false) => {
            eprintln!(
                "toffload-watch: give --pid N, --cgroup PATH, --unit NAME, or `run -- CMD ARGS...` \
                 (see --help)"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(fin) => match toffload_watch::error::inject_exit_code(fin.inject_outcome, fin.ended) {
            Some(code) => ExitCode::from(code),
            None => ExitCode::SUCCESS,
        },
        Err(e) => {
            eprintln!("toffload-watch: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
