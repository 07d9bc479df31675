//! `cargo xtask demo`: the whole story on the bundled default. A stock conn_server on
//! the emulated device serves 64 connections; toffload-watch attaches, gives its
//! verdict and prediction, injects the fiber runtime (restarting the server under
//! libtoffload.so with the same command line), and measures before and after; the
//! story ends with the measured speedup next to the predicted one. Needs root (BPF).
//! `--tui` shows the same in the dashboard.

use clap::Parser;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;
use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::load::{self, Config};

#[derive(Parser)]
#[command(
    name = "toffload-story",
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
    /// Show the dashboard (press i to inject, q to quit) instead of the text story.
    #[arg(long)]
    tui: bool,
}

fn main() {
    let a = Args::parse();
    match story(&a) {
        Ok(()) => {}
        Err(e) => {
            eprintln!("toffload-story: {e}");
            std::process::exit(1);
        }
    }
}

fn story(a: &Args) -> Result<(), String> {
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        return Err("the story attaches eBPF probes: run it as root (sudo)".into());
    }
    // The injected server's parent (the watcher) exits before we do: reap it here.
    harness::become_subreaper();
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
    let total = a.secs as f64 + 4.0;
    let conns = a.conns;
    let bg = std::thread::spawn(move || {
        let mut c = Config::new(port);
        c.conns = conns;
        c.duration = Duration::from_secs_f64(total);
        c.warmup = Duration::from_millis(200);
        load::run(&c)
    });
    std::thread::sleep(Duration::from_millis(500));
    println!("   pid {old}, port {port}, under load\n== 2. toffload-watch --pid {old} --inject");
    let mut cmd = Command::new(&watch);
    cmd.args(["--interval", "1s", "--inject", "--inject-after"])
        .arg(a.before.to_string())
        .arg("--duration")
        .arg(format!("{}s", a.secs))
        .arg("--pid")
        .arg(old.to_string());
    let (fin, injected) = if a.tui {
        let st = cmd
            .arg("--tui")
            .status()
            .map_err(|e| format!("starting toffload-watch: {e}"))?;
        println!("   toffload-watch: {st}");
        (None, None)
    } else {
        run_json(cmd.arg("--json"))?
    };
    let during = bg
        .join()
        .map_err(|_| "the load thread panicked")?
        .map_err(|e| e.to_string())?;
    println!(
        "== 3. load through it all: {:.0} req/s, {} wrong answers, {} errors {:?} (connections \
         broken by the restart reconnect)",
        during.requests_per_sec, during.wrong, during.errors, during.errors_by_kind
    );
    if let Some(f) = &fin {
        let st = &f["injection"];
        if st.is_object() {
            let pct = st["prediction_error"]
                .as_f64()
                .map(|e| format!("{:+.0}%", e * 100.0));
            println!(
                "== 4. before {:.0} req/s -> after {:.0} req/s: measured {:.2}x, predicted {:.2}x, \
                 prediction error {}",
                st["before_rps"].as_f64().unwrap_or(0.0),
                st["after_rps"].as_f64().unwrap_or(0.0),
                st["measured_speedup"].as_f64().unwrap_or(0.0),
                st["predicted_speedup"].as_f64().unwrap_or(0.0),
                pct.unwrap_or_else(|| "-".into())
            );
        }
    }
    // The server now running on the port (the injected one, or the original when the
    // injection was refused) is ours to stop.
    let pid = injected.unwrap_or(old);
    drop(server);
    if pid != old && !harness::end_adopted(pid, Duration::from_secs(5)) {
        eprintln!("toffload-story: the injected server {pid} did not end");
    }
    if during.wrong > 0 {
        return Err(format!("{} wrong answers", during.wrong));
    }
    if !a.tui && injected.is_none() {
        return Err("the server was not injected (see the watcher's message above)".into());
    }
    Ok(())
}

/// Runs the watcher with --json and tells the story from its lines; returns the final
/// report and the injected pid.
fn run_json(cmd: &mut Command) -> Result<(Option<Value>, Option<u32>), String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting toffload-watch: {e}"))?;
    let out = BufReader::new(child.stdout.take().expect("piped"));
    let (mut fin, mut injected) = (None, None);
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
            println!(
                "   window: {:>8.0} req/s ({}), verdict {}{pred}",
                w["requests_per_sec"].as_f64().unwrap_or(0.0),
                w["request_source"].as_str().unwrap_or(""),
                w["verdict"]["kind"].as_str().unwrap_or("-"),
            );
        } else if let Some(i) = v.get("inject") {
            println!(
                "   inject [{}]: {}",
                i["action"].as_str().unwrap_or("-"),
                i["message"].as_str().unwrap_or("")
            );
            if i["action"] == "injected" {
                injected = i["new_pid"].as_u64().map(|p| p as u32);
            }
        } else if let Some(f) = v.get("final") {
            fin = Some(f.clone());
        }
    }
    let st = child.wait().map_err(|e| e.to_string())?;
    println!("   toffload-watch: {st}");
    Ok((fin, injected))
}
