//! `cargo xtask bench guard`: what the conflict guard costs and what it buys, on
//! hostile_server under the runtime (server pinned to core 0, load generator to core 1,
//! median of several runs, every ratio measured side by side in one run):
//! - enforce vs the coarse lock (LOCKED=1) at high contention (every request touches the
//!   shared counter) and low (1 in 8, SHARED_EVERY=8), with lost updates;
//! - detect's overhead over unguarded, for both write-tracking mechanisms;
//! - the cost of one guard fault per mechanism (guard_faultcost, minus its unguarded
//!   baseline).

use clap::Parser;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;
use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::load::{self, Config};

#[derive(Parser)]
#[command(
    name = "toffload-guard-bench",
    about = "The conflict guard's costs and gains"
)]
struct Args {
    /// Runs per point (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 1.5)]
    secs: f64,
    /// Client connections.
    #[arg(long, default_value_t = 16)]
    conns: usize,
    /// Write the table here too.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn libtoffload() -> String {
    harness::dist()
        .join("lib/libtoffload.so")
        .display()
        .to_string()
}

/// One run: (req/s, lost updates).
fn hostile(a: &Args, lat: u32, env: &[(&str, &str)]) -> Result<(f64, u64), String> {
    let mut spec = ServerSpec::new("hostile_server")
        .env("LD_PRELOAD", libtoffload())
        .env("TOFFLOAD_EMU_LAT_US", lat.to_string())
        .cpu(Some(0));
    for (k, v) in env {
        spec = spec.env(k, *v);
    }
    let s = Server::start(&spec)?;
    let mut cfg = Config::new(s.port);
    cfg.conns = a.conns;
    cfg.duration = Duration::from_secs_f64(a.secs);
    cfg.warmup = Duration::from_millis(300);
    let r = load::run(&cfg).map_err(|e| e.to_string())?;
    if r.wrong > 0 || r.errors > 0 {
        return Err(format!("wrong {} errors {}", r.wrong, r.errors));
    }
    let out = s.terminate()?;
    let lost = out
        .split_whitespace()
        .find_map(|w| w.strip_prefix("lost="))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no lost= in {out:?}"))?;
    Ok((r.requests_per_sec, lost))
}

fn point(a: &Args, lat: u32, env: &[(&str, &str)]) -> Result<(f64, u64), String> {
    let mut rps = Vec::new();
    let mut lost = 0;
    for _ in 0..a.runs {
        let (r, l) = hostile(a, lat, env)?;
        rps.push(r);
        lost += l;
    }
    Ok((median(rps), lost))
}

fn fault_cost(env: &[(&str, &str)]) -> Result<f64, String> {
    let mut v = Vec::new();
    for _ in 0..3 {
        let out = Command::new("taskset")
            .args(["-c", "0"])
            .arg(harness::bin("guard_faultcost")?)
            .arg("20000")
            .env("LD_PRELOAD", libtoffload())
            .env("TOFFLOAD_FIBERIZE", "all")
            .envs(env.iter().copied())
            .output()
            .map_err(|e| e.to_string())?;
        let s = String::from_utf8_lossy(&out.stdout);
        let ns: f64 = s
            .trim()
            .strip_prefix("ns=")
            .and_then(|x| x.parse().ok())
            .ok_or_else(|| format!("guard_faultcost said {s:?}"))?;
        v.push(ns);
    }
    Ok(median(v))
}

fn main() {
    let a = Args::parse();
    if let Err(e) = run(&a) {
        eprintln!("toffload-guard-bench: {e}");
        std::process::exit(1);
    }
}

fn run(a: &Args) -> Result<(), String> {
    if harness::cpus() >= 2 {
        harness::pin_current_thread(1).map_err(|e| format!("pinning: {e}"))?;
    }
    let mut t = format!(
        "hostile_server under libtoffload.so, {} connections, 1 KiB requests, median of {} runs of {:.1} s; server on core 0, load on core 1.\n\n",
        a.conns, a.runs, a.secs
    );
    t.push_str("### Enforce vs a coarse lock\n\n");
    t.push_str("| offload us | shared requests | coarse lock req/s | enforce req/s | enforce / lock | target | lost (lock, enforce) | unguarded req/s (lost) |\n|---:|---|---:|---:|---:|---|---|---|\n");
    for lat in [200u32, 1000] {
        for (every, label) in [
            ("1", "all (high contention)"),
            ("8", "1 in 8 (low contention)"),
        ] {
            eprintln!("  enforce vs lock: {lat} us, SHARED_EVERY={every}");
            let lock = point(a, lat, &[("LOCKED", "1"), ("SHARED_EVERY", every)])?;
            let enf = point(
                a,
                lat,
                &[("TOFFLOAD_GUARD", "enforce"), ("SHARED_EVERY", every)],
            )?;
            let off = point(
                a,
                lat,
                &[("TOFFLOAD_GUARD", "off"), ("SHARED_EVERY", every)],
            )?;
            let ratio = enf.0 / lock.0;
            t.push_str(&format!(
                "| {lat} | {label} | {:.0} | {:.0} | {:.2}x | >= 1.7x: {} | {}, {} | {:.0} ({}) |\n",
                lock.0,
                enf.0,
                ratio,
                if ratio >= 1.7 { "met" } else { "not met" },
                lock.1,
                enf.1,
                off.0,
                off.1
            ));
        }
    }
    t.push_str("\n### Detect: overhead over unguarded\n\n");
    t.push_str("| offload us | unguarded req/s | detect (uffd) req/s | overhead | detect (mprotect) req/s | overhead | target |\n|---:|---:|---:|---:|---:|---:|---|\n");
    for lat in [200u32, 1000] {
        eprintln!("  detect overhead: {lat} us");
        let off = point(a, lat, &[("TOFFLOAD_GUARD", "off")])?;
        let uffd = point(
            a,
            lat,
            &[
                ("TOFFLOAD_GUARD", "detect"),
                ("TOFFLOAD_GUARD_MECH", "uffd"),
            ],
        )?;
        let mp = point(
            a,
            lat,
            &[
                ("TOFFLOAD_GUARD", "detect"),
                ("TOFFLOAD_GUARD_MECH", "mprotect"),
            ],
        )?;
        let ou = 1.0 - uffd.0 / off.0;
        let om = 1.0 - mp.0 / off.0;
        t.push_str(&format!(
            "| {lat} | {:.0} | {:.0} | {:.1}% | {:.0} | {:.1}% | <= 10%: uffd {}, mprotect {} |\n",
            off.0,
            uffd.0,
            ou * 100.0,
            mp.0,
            om * 100.0,
            if ou <= 0.10 { "met" } else { "not met" },
            if om <= 0.10 { "met" } else { "not met" },
        ));
    }
    eprintln!("  fault cost");
    let base = fault_cost(&[("TOFFLOAD_GUARD", "off")])?;
    let uffd = fault_cost(&[
        ("TOFFLOAD_GUARD", "detect"),
        ("TOFFLOAD_GUARD_MECH", "uffd"),
    ])?;
    let mp = fault_cost(&[
        ("TOFFLOAD_GUARD", "detect"),
        ("TOFFLOAD_GUARD_MECH", "mprotect"),
    ])?;
    let enf = fault_cost(&[("TOFFLOAD_GUARD", "enforce")])?;
    t.push_str(
        "\n### Cost of one guard fault (guard_faultcost on core 0, minus its unguarded loop)\n\n",
    );
    t.push_str("| mechanism | us per fault |\n|---|---:|\n");
    t.push_str(&format!(
        "| detect, userfaultfd write-protect (handler thread) | {:.1} |\n",
        (uffd - base) / 1000.0
    ));
    t.push_str(&format!(
        "| detect, mprotect + SIGSEGV | {:.1} |\n",
        (mp - base) / 1000.0
    ));
    t.push_str(&format!(
        "| enforce, ownership fault (mprotect + SIGSEGV) | {:.1} |\n",
        (enf - base) / 1000.0
    ));
    t.push_str(&format!(
        "\n(unguarded loop: {:.1} us per iteration: a 1-byte socketpair round trip and a yield)\n",
        base / 1000.0
    ));
    println!("{t}");
    if let Some(out) = &a.out {
        std::fs::write(out, &t).map_err(|e| format!("writing {}: {e}", out.display()))?;
    }
    Ok(())
}
