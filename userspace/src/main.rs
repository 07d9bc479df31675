//! toffload-watch: the CLI over the library. Exit codes: see error.rs and the README.

use clap::{Args, Parser, Subcommand};
use std::process::ExitCode;
use std::time::Duration;
use toffload_watch::error::WatchError;
use toffload_watch::session::{self, Options};
use toffload_watch::{spawn, target};

#[derive(Parser)]
#[command(
    name = "toffload-watch",
    about = "Watch a server with eBPF: offload stalls, futexes, context switches, syscalls, and whether overlapping its offload wait can work",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    /// The process to watch.
    #[arg(long)]
    pid: Option<u32>,
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Args, Clone)]
struct Common {
    /// Report window, e.g. 1s, 500ms.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    interval: Duration,
    /// Stop after this long (default: until the process exits or Ctrl-C).
    #[arg(long, value_parser = parse_duration)]
    duration: Option<Duration>,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
    /// Percent of each interval to trace (1-100). Below 100 the programs are detached
    /// for the rest, which cuts the overhead in proportion; rates are per traced second.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u8).range(1..=100))]
    sample: u8,
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
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 500ms, 1s, 2m)"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("{s:?}: a duration must be positive"));
    }
    Ok(Duration::from_secs_f64(v * mult))
}

fn options(c: &Common) -> Options {
    Options {
        interval: c.interval,
        duration: c.duration,
        json: c.json,
        sample: f64::from(c.sample) / 100.0,
    }
}

async fn watch_pid(pid: u32, opts: Options) -> Result<(), WatchError> {
    let a = session::attach(pid)?;
    session::run(a, &opts, &mut std::io::stdout()).await?;
    Ok(())
}

async fn watch_command(argv: Vec<String>, opts: Options) -> Result<(), WatchError> {
    // Check before starting anything, so that a refused watch leaves no process.
    toffload_watch::loader::check_privileges()?;
    let mut held = spawn::start(&argv)?;
    let mut a = session::attach(held.pid())?;
    a.probe_files(&target::planned_files(&held.exe.to_string_lossy()))?;
    held.release();
    // Until the exec is done, /proc shows the watcher's own fork.
    let t0 = std::time::Instant::now();
    while target::exe(held.pid()).as_deref() != Some(held.exe.as_path())
        && target::alive(held.pid())
        && t0.elapsed() < Duration::from_secs(2)
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let r = session::run(a, &opts, &mut std::io::stdout()).await;
    if r.is_err() || target::alive(held.pid()) {
        held.kill();
    }
    eprintln!("toffload-watch: {} {}", argv[0], held.wait());
    r.map(|_| ())
}

fn main() -> ExitCode {
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
    let result = match (cli.cmd, cli.pid) {
        (Some(Cmd::Run { common, command }), _) => {
            rt.block_on(watch_command(command, options(&common)))
        }
        (None, Some(pid)) => rt.block_on(watch_pid(pid, options(&cli.common))),
        (None, None) => {
            eprintln!("toffload-watch: give --pid N, or `run -- CMD ARGS...` (see --help)");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("toffload-watch: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
