//! The dashboard driven by synthetic windows, no watcher and no root needed: for
//! trying the layout and for the tmux tests (tui/tests/tmux.rs), which also use
//! --panic-after to check that a panic gives the shell its terminal back.
//!
//!     toffload-tui-synthetic [--pid N] [--interval-ms MS] [--exit-after SECS]
//!                            [--panic-after SECS]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use toffload_tui::{synthetic, Command, Dashboard};

struct Args {
    pid: u32,
    interval: Duration,
    exit_after: Option<Duration>,
    panic_after: Option<Duration>,
}

const USAGE: &str = "usage: toffload-tui-synthetic [--pid N] [--interval-ms MS] \
                     [--exit-after SECS] [--panic-after SECS]";

fn parse() -> Result<Args, String> {
    let mut a = Args {
        pid: 4242,
        interval: Duration::from_secs(1),
        exit_after: None,
        panic_after: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Err(USAGE.into());
        }
        let value = it.next().ok_or(format!("{flag} needs a value\n{USAGE}"))?;
        let secs = || {
            value
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(Duration::from_secs_f64)
                .ok_or(format!("{flag}: not a number of seconds: {value}"))
        };
        match flag.as_str() {
            "--pid" => a.pid = value.parse().map_err(|_| format!("--pid: {value}"))?,
            "--interval-ms" => {
                let ms: u64 = value
                    .parse()
                    .map_err(|_| format!("--interval-ms: {value}"))?;
                a.interval = Duration::from_millis(ms.max(10));
            }
            "--exit-after" => a.exit_after = Some(secs()?),
            "--panic-after" => a.panic_after = Some(secs()?),
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("toffload-tui-synthetic: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> std::io::Result<()> {
    let mut dash = Dashboard::enter()?;
    let mut state = synthetic::state(args.pid);
    let start = Instant::now();
    let mut next = start;
    let mut i = 0u64;
    let mut last_rps = 0.0;
    loop {
        let now = Instant::now();
        if args.panic_after.is_some_and(|p| now - start >= p) {
            panic!("synthetic panic (--panic-after)");
        }
        if args.exit_after.is_some_and(|e| now - start >= e) {
            break;
        }
        if now >= next {
            let w = synthetic::window(i);
            last_rps = w.requests_per_sec;
            dash.push_window(w);
            i += 1;
            next += args.interval;
            state.status = format!("synthetic data, window {i}");
        }
        dash.draw(&state)?;
        // Wake for the next window or the next deadline, whichever comes first.
        let mut until = next;
        for d in [args.exit_after, args.panic_after].into_iter().flatten() {
            until = until.min(start + d);
        }
        match dash.poll(until.saturating_duration_since(Instant::now()))? {
            Some(Command::Quit) => break,
            Some(Command::Inject) => {
                let (inj, guard) = synthetic::injected(args.pid, last_rps);
                state.injection = Some(inj);
                state.guard = Some(guard);
                state.status = "injected (synthetic)".into();
            }
            Some(Command::Pause(p)) => state.paused = p,
            None => {}
        }
    }
    dash.leave()
}
