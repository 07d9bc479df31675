//! `cargo xtask demo`: the whole story on the bundled default. A stock conn_server on
//! the emulated device serves 64 connections; toffload-watch attaches, gives its
//! verdict and prediction, injects the fiber runtime (restarting the server under
//! libtoffload.so with the same command line), and measures before and after; the
//! story ends with the measured speedup next to the predicted one. Needs root (BPF).
//! `--tui` shows the same in the dashboard.
//!
//! Every rate the watcher prints is cross-checked with the load generator's own
//! count over the same seconds (its 0.1 s timeline against the Unix seconds each rate
//! is over: a sampled window's untraced stretches, else the window): a mismatch beyond
//! 15% ends the story with an error, not a result.
//! `--runs N --out FILE` (`cargo xtask bench demo`) tells it N times and writes the
//! table of rates, predictions and errors.

use clap::Parser;
use serde_json::Value;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use toffload_tests::harness::{self, median, Server, ServerSpec};
use toffload_tests::load::{self, Config, Report};

#[derive(Parser)]
#[command(
    name = "toffload-demo",
    version = toffload_cli::VERSION,
    about = "watch -> predict -> inject -> measure, on conn_server and the emulated device"
)]
struct Args {
    /// Offload latency, microseconds.
    #[arg(long, default_value_t = 200)]
    latency_us: u32,
    /// Stock wait style of accel_run: block or spin.
    #[arg(long, default_value = "block")]
    wait: String,
    #[arg(long, default_value_t = 64)]
    conns: usize,
    /// Windows (1 s) watched before injecting.
    #[arg(long, default_value_t = 3)]
    before: u32,
    /// Seconds watched in all.
    #[arg(long, default_value_t = 10)]
    secs: u32,
    /// Percent of each interval the watcher traces after the injection (its
    /// --sample); default: its overhead budget.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=100))]
    sample: Option<u8>,
    /// Show the dashboard (press i to inject, q to quit) instead of the text story.
    #[arg(long, conflicts_with_all = ["runs", "out"])]
    tui: bool,
    /// Tell the story this many times (a fresh server each time).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=50))]
    runs: u32,
    /// Write the runs' table here (markdown).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Tests only: the watcher counts the runtime's counters over wall time (a wrong
    /// rate source), which the cross-check must report as an error.
    #[arg(long, hide = true)]
    test_mixed_clock: bool,
}

/// Watcher and load generator may differ by this much over the same seconds.
const AGREE: f64 = 0.15;

fn main() {
    toffload_cli::generate_if_requested::<Args>();
    let a = Args::parse();
    if let Err(e) = preflight() {
        eprintln!("toffload-demo: {e}");
        std::process::exit(1);
    }
    let mut rows = Vec::new();
    let mut failed = 0;
    for run in 1..=a.runs {
        if a.runs > 1 {
            println!("######## run {run} of {}", a.runs);
        }
        match story(&a) {
            Ok(o) => rows.push(Ok(o)),
            Err(e) => {
                eprintln!("toffload-demo: {e}");
                failed += 1;
                rows.push(Err(e));
            }
        }
    }
    if let Some(out) = &a.out {
        let table = table(&a, &rows);
        print!("\n{table}");
        if let Err(e) = std::fs::write(out, &table) {
            eprintln!("toffload-demo: writing {}: {e}", out.display());
            std::process::exit(1);
        }
        println!("(written to {})", out.display());
    }
    if failed > 0 {
        std::process::exit(1);
    }
}

fn preflight() -> Result<(), String> {
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        return Err("the story attaches eBPF probes: run it as root (sudo)".into());
    }
    // The injected server's parent (the watcher) exits before we do: reap it here.
    harness::become_subreaper();
    Ok(())
}

/// One telling's numbers: each rate as the watcher and the load generator saw it.
struct Outcome {
    /// The load generator's rate before the watcher attached.
    stock: f64,
    before_watch: f64,
    before_load: f64,
    after_watch: f64,
    after_load: f64,
    predicted: Option<f64>,
    /// The load generator's after / before: the independent speedup.
    measured: f64,
    /// predicted / measured - 1.
    error: Option<f64>,
    wrong: u64,
}

fn story(a: &Args) -> Result<Outcome, String> {
    let watch = harness::bin("toffload-watch")?;
    let two = harness::cpus() >= 2;
    let port = harness::free_port()?;
    println!(
        "== 1. stock conn_server: {} connections, {} us offload ({} wait), emulated AES device",
        a.conns, a.latency_us, a.wait
    );
    let server = Server::start(
        &ServerSpec::new("conn_server")
            .arg("--port")
            .arg(port.to_string())
            .env("TOFFLOAD_EMU_LAT_US", a.latency_us.to_string())
            .env("TOFFLOAD_WAIT", &a.wait)
            .cpu(two.then_some(0)),
    )?;
    let old = server.pid();
    if two {
        harness::pin_current_thread(1).map_err(|e| format!("pinning to core 1: {e}"))?;
    }
    // Load without gaps until the watcher is done (its start takes a variable time).
    let stop = Arc::new(AtomicBool::new(false));
    let conns = a.conns;
    let bg = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut c = Config::new(port);
            c.conns = conns;
            c.duration = Duration::from_secs(600);
            c.warmup = Duration::from_millis(200);
            c.stop = Some(stop);
            load::run(&c)
        })
    };
    // Two seconds unwatched first: the stock rate the speedup is measured against
    // (the watcher traces every event until it decides, which slows the server).
    std::thread::sleep(Duration::from_millis(500));
    let unwatched_from = unix_now();
    std::thread::sleep(Duration::from_secs(2));
    let unwatched = (unwatched_from, unix_now());
    println!("   pid {old}, port {port}, under load\n== 2. toffload-watch --pid {old} --inject");
    let mut cmd = Command::new(&watch);
    cmd.args(["--interval", "1s", "--inject", "--inject-after"])
        .arg(a.before.to_string())
        .arg("--duration")
        .arg(format!("{}s", a.secs))
        .arg("--pid")
        .arg(old.to_string());
    if let Some(p) = a.sample {
        cmd.arg("--sample").arg(p.to_string());
    }
    if a.test_mixed_clock {
        cmd.env("TOFFLOAD_WATCH_TEST_MIXED_CLOCK", "1");
    }
    let told = if a.tui {
        let st = cmd
            .arg("--tui")
            .status()
            .map_err(|e| format!("starting toffload-watch: {e}"))?;
        println!("   toffload-watch: {st}");
        Ok(Told::default())
    } else {
        run_json(cmd.arg("--json"))
    };
    stop.store(true, Ordering::Relaxed);
    let during = bg
        .join()
        .map_err(|_| "the load thread panicked")?
        .map_err(|e| e.to_string());
    // The server now running on the port (the injected one, or the original when the
    // injection was refused) is ours to stop, whatever happened.
    let injected = told.as_ref().ok().and_then(|t| t.injected);
    let pid = told.as_ref().ok().and_then(|t| t.on_port).unwrap_or(old);
    drop(server);
    if pid != old && !harness::end_adopted(pid, Duration::from_secs(5)) {
        eprintln!("toffload-demo: the injected server {pid} did not end");
    }
    let (told, during) = (told?, during?);
    println!(
        "== 3. load through it all: {:.0} req/s, {} wrong answers, {} errors {:?} (connections \
         broken by the restart reconnect)",
        during.requests_per_sec, during.wrong, during.errors, during.errors_by_kind
    );
    if during.wrong > 0 {
        return Err(format!("{} wrong answers", during.wrong));
    }
    if a.tui {
        return Ok(Outcome {
            stock: f64::NAN,
            before_watch: f64::NAN,
            before_load: f64::NAN,
            after_watch: f64::NAN,
            after_load: f64::NAN,
            predicted: None,
            measured: f64::NAN,
            error: None,
            wrong: during.wrong,
        });
    }
    println!("   window by window, the watcher next to the load generator over the same seconds:");
    for w in &told.windows {
        // Over the seconds of the rate the story uses: the untraced stretches' where
        // there are some (the window's own rate is per traced second).
        let spans = w
            .untraced
            .as_ref()
            .map_or(vec![[w.ts - w.wall_secs, w.ts]], |u| u.1.clone());
        let load = during
            .rate_over(&spans)
            .map_or("-".to_string(), |r| format!("{r:.0}"));
        let untraced = w
            .untraced
            .as_ref()
            .map_or(String::new(), |u| format!(", {:.0} untraced", u.0));
        println!(
            "   {:>8.0} req/s watched ({:.0}% traced{untraced}), {load:>8} counted  ({})",
            w.rps,
            100.0 * w.secs / w.wall_secs.max(1e-9),
            w.verdict,
        );
    }
    let Some(fin) = &told.fin else {
        return Err("the watcher gave no final report".into());
    };
    if injected.is_none() {
        return Err("the server was not injected (see the watcher's message above)".into());
    }
    let st = &fin["injection"];
    let before_watch = st["before_rps"].as_f64().unwrap_or(f64::NAN);
    let after_watch = st["after_rps"]
        .as_f64()
        .ok_or("no window after the injection had requests")?;
    let before_load = cross_check("before", before_watch, &st["before_spans"], &during)?;
    let after_load = cross_check("after", after_watch, &st["after_spans"], &during)?;
    let predicted = st["predicted_speedup"].as_f64();
    let stock = during
        .rate_between(unwatched.0, unwatched.1)
        .ok_or("the load generator's count does not cover the unwatched seconds")?;
    let measured = after_load / stock;
    let error = predicted.map(|p| p / measured - 1.0);
    println!(
        "== 4. stock {stock:.0} req/s unwatched, {before_load:.0} while traced in full (the \
         watcher: {before_watch:.0}) -> under the runtime {after_load:.0} req/s (the watcher: \
         {after_watch:.0}): measured {measured:.2}x, predicted {}, prediction error {}",
        predicted.map_or("-".into(), |p| format!("{p:.2}x")),
        error.map_or("-".into(), |e| format!("{:+.0}%", e * 100.0))
    );
    Ok(Outcome {
        stock,
        before_watch,
        before_load,
        after_watch,
        after_load,
        predicted,
        measured,
        error,
        wrong: during.wrong,
    })
}

/// The load generator's rate over the watcher's windows (`spans`: per window, the
/// Unix [start, end] pairs its rate is over), median of the windows as the watcher's
/// is; an error when the two differ by more than AGREE.
fn cross_check(what: &str, watched: f64, spans: &Value, load: &Report) -> Result<f64, String> {
    let windows: Vec<Vec<[f64; 2]>> = spans
        .as_array()
        .map(|v| v.iter().filter_map(spans_of).collect())
        .unwrap_or_default();
    let rates: Vec<f64> = windows.iter().filter_map(|w| load.rate_over(w)).collect();
    if windows.is_empty() || rates.len() < windows.len() {
        return Err(format!(
            "{what}: the load generator's count does not cover the watcher's windows \
             ({} of {} windows)",
            rates.len(),
            windows.len()
        ));
    }
    let counted = median(rates);
    let off = watched / counted - 1.0;
    if off.abs() > AGREE || !off.is_finite() {
        return Err(format!(
            "mismatch: {what} the injection the watcher reports {watched:.0} req/s, the load \
             generator counted {counted:.0} req/s over the same seconds ({:+.0}%, more than \
             {:.0}%)",
            off * 100.0,
            AGREE * 100.0
        ));
    }
    Ok(counted)
}

/// A window's untraced rate and the Unix seconds it is over.
fn untraced_of(u: &Value) -> Option<(f64, Vec<[f64; 2]>)> {
    Some((u["requests_per_sec"].as_f64()?, spans_of(&u["spans"])?))
}

/// A JSON list of Unix [start, end] pairs.
fn spans_of(v: &Value) -> Option<Vec<[f64; 2]>> {
    v.as_array()?
        .iter()
        .map(|s| Some([s[0].as_f64()?, s[1].as_f64()?]))
        .collect()
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One window line of the watcher, as far as the story needs it.
struct WindowLine {
    rps: f64,
    /// The untraced part's rate and its stretches' Unix spans, where the window has
    /// one.
    untraced: Option<(f64, Vec<[f64; 2]>)>,
    secs: f64,
    wall_secs: f64,
    ts: f64,
    verdict: String,
}

#[derive(Default)]
struct Told {
    windows: Vec<WindowLine>,
    fin: Option<Value>,
    /// The injected pid, while the injection stands.
    injected: Option<u32>,
    /// The pid serving the port when it is not the original's (injected, or the
    /// original command started again after a failure or a rollback).
    on_port: Option<u32>,
}

/// Runs the watcher with --json and tells the story from its lines.
fn run_json(cmd: &mut Command) -> Result<Told, String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting toffload-watch: {e}"))?;
    let out = BufReader::new(child.stdout.take().expect("piped"));
    let mut told = Told::default();
    for line in out.lines().map_while(Result::ok) {
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if let Some(w) = v.get("window") {
            let model = &w["model"];
            let pred = model["zero_edit"]["speedup"]
                .as_f64()
                .map(|s| {
                    format!(
                        "; predicted {s:.2}x bound by {}",
                        model["zero_edit"]["binding"].as_str().unwrap_or("-")
                    )
                })
                .unwrap_or_default();
            let num = |k: &str| w[k].as_f64().unwrap_or(0.0);
            let verdict = w["verdict"]["kind"].as_str().unwrap_or("-").to_string();
            println!(
                "   window: {:>8.0} req/s ({}), verdict {verdict}{pred}",
                num("requests_per_sec"),
                w["request_source"].as_str().unwrap_or(""),
            );
            told.windows.push(WindowLine {
                rps: num("requests_per_sec"),
                untraced: untraced_of(&w["untraced"]),
                secs: num("secs"),
                wall_secs: num("wall_secs"),
                ts: num("ts"),
                verdict,
            });
        } else if let Some(i) = v.get("inject") {
            println!(
                "   inject [{}]: {}",
                i["action"].as_str().unwrap_or("-"),
                i["message"].as_str().unwrap_or("")
            );
            let new_pid = i["new_pid"].as_u64().map(|p| p as u32);
            if new_pid.is_some() {
                told.on_port = new_pid;
            }
            match i["action"].as_str() {
                Some("injected") => told.injected = new_pid,
                // Rolled back (its health window failed): the original runs again.
                Some("rolled_back" | "failed" | "down") => told.injected = None,
                _ => {}
            }
        } else if let Some(f) = v.get("final") {
            told.fin = Some(f.clone());
        }
    }
    let st = child.wait().map_err(|e| e.to_string())?;
    println!("   toffload-watch: {st}");
    Ok(told)
}

/// The runs' table with the benchmark's targets checked.
fn table(a: &Args, rows: &[Result<Outcome, String>]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# The demo, told {} times\n\n`cargo xtask bench demo` (toffload-demo --runs {}): \
         conn_server, {} connections, {} us offload ({} wait), emulated device; server on \
         core 0, load generator and watcher on core 1; {} stock windows of 1 s, then \
         `--inject`, {} s watched in all. Stock: the load generator's rate over 2 s before \
         the watcher attached. Each rate after it is the watcher's (median of the windows \
         it used; after the injection their untraced part's) beside the load generator's \
         own count over the same seconds. Measured: the load generator's after / stock.\n",
        rows.len(),
        rows.len(),
        a.conns,
        a.latency_us,
        a.wait,
        a.before,
        a.secs
    );
    let _ = writeln!(
        s,
        "| run | stock | before: watcher | before: load gen | after: watcher | after: load gen | \
         predicted | measured | error |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let (mut preds, mut errs, mut agree) = (Vec::new(), Vec::new(), true);
    for (i, r) in rows.iter().enumerate() {
        match r {
            Ok(o) => {
                let dev = |w: f64, l: f64| format!("{:+.1}%", (w / l - 1.0) * 100.0);
                agree &= ((o.before_watch / o.before_load - 1.0).abs() <= AGREE)
                    && ((o.after_watch / o.after_load - 1.0).abs() <= AGREE)
                    && o.wrong == 0;
                let _ = writeln!(
                    s,
                    "| {} | {:.0} | {:.0} ({}) | {:.0} | {:.0} ({}) | {:.0} | {} | {:.2}x | {} |",
                    i + 1,
                    o.stock,
                    o.before_watch,
                    dev(o.before_watch, o.before_load),
                    o.before_load,
                    o.after_watch,
                    dev(o.after_watch, o.after_load),
                    o.after_load,
                    o.predicted.map_or("-".into(), |p| format!("{p:.2}x")),
                    o.measured,
                    o.error
                        .map_or("-".into(), |e| format!("{:+.0}%", e * 100.0)),
                );
                preds.extend(o.predicted);
                errs.extend(o.error.map(f64::abs));
            }
            Err(e) => {
                agree = false;
                let _ = writeln!(
                    s,
                    "| {} | ERROR: {} | | | | | | | |",
                    i + 1,
                    e.replace('|', "/")
                );
            }
        }
    }
    let spread = if preds.is_empty() {
        f64::NAN
    } else {
        let m = median(preds.clone());
        let (lo, hi) = preds
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &p| {
                (l.min(p), h.max(p))
            });
        (hi - lo) / m
    };
    let med_err = median(errs);
    let mark = |ok: bool| if ok { "met" } else { "NOT met" };
    let _ = writeln!(
        s,
        "\nTargets: spread of the predictions (max - min) / median {:.0}% (<= 15%: {}); \
         median absolute prediction error {:.0}% (<= 20%: {}); every rate within {:.0}% of \
         the load generator's and no wrong answer: {}.",
        spread * 100.0,
        mark(spread <= 0.15),
        med_err * 100.0,
        mark(med_err <= 0.20),
        AGREE * 100.0,
        mark(agree)
    );
    s
}
