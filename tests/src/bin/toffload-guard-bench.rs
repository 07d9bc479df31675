//! `cargo xtask bench guard`: what the conflict guard costs and what it buys, on
//! hostile_server under the runtime (server pinned to core 0, load generator to core 1,
//! median of several runs; the configurations compared in a row run interleaved, run
//! after run, so that they see the same machine):
//! - enforce vs the coarse lock (LOCKED=1), with lost updates: at the one-hot-word
//!   bound (every request read-modify-writes one counter: any correct scheme serializes
//!   every request there), at high contention (every request updates one of 4 counters,
//!   each on its own page: SHARED_PAGES=4) and at low (SHARED_EVERY=8: only the
//!   requests whose first byte is a multiple of 8 update the one counter, about a fifth
//!   of the load generator's; the table gives the measured share);
//! - detect's overhead over unguarded, for each write-tracking mechanism, exact
//!   (TOFFLOAD_GUARD_SAMPLE=100: every window watched) and sampled at the default
//!   share (the target is judged on the default), with every request writing the
//!   shared counter and with SHARED_EVERY=8, with the writes seen per request and the
//!   server's CPU time per request;
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
    version = toffload_cli::VERSION,
    about = "The conflict guard's costs and gains"
)]
struct Args {
    /// Runs per point (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Runs per point of the detect overhead table (closer margins: more runs).
    #[arg(long, default_value_t = 5)]
    detect_runs: usize,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 1.5)]
    secs: f64,
    /// Client connections.
    #[arg(long, default_value_t = 16)]
    conns: usize,
    /// Write the table here too. With --only, only the parts run are replaced in it.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run only these parts (enforce, detect, faults; comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [Part::Enforce, Part::Detect, Part::Faults])]
    only: Vec<Part>,
    /// Offload latencies of the detect table, us.
    #[arg(long, value_delimiter = ',', default_values_t = [200u32, 1000])]
    lats: Vec<u32>,
    /// SHARED_EVERY values of the detect table.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 8])]
    every: Vec<u32>,
    /// Mechanisms of the detect table.
    #[arg(long, value_delimiter = ',', default_values_t = ["uffd-async".to_string(), "uffd".to_string(), "mprotect".to_string()])]
    mechs: Vec<String>,
    /// TOFFLOAD_GUARD_SAMPLE of the sampled detect rows (the runtime's default).
    #[arg(long, default_value_t = DEFAULT_SAMPLE)]
    sample: u8,
}

/// TOFFLOAD_GUARD_SAMPLE's default (runtime/src/config.rs).
const DEFAULT_SAMPLE: u8 = 25;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum, Debug)]
enum Part {
    Enforce,
    Detect,
    Faults,
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Part::Enforce => "enforce",
            Part::Detect => "detect",
            Part::Faults => "faults",
        })
    }
}

/// The sections of a results file: (heading, text), the text before the first
/// heading under "".
fn sections(t: &str) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = vec![(String::new(), String::new())];
    for line in t.split_inclusive('\n') {
        if line.starts_with("### ") {
            v.push((line.trim_end().to_string(), String::new()));
        }
        v.last_mut().expect("one").1.push_str(line);
    }
    v
}

/// `old` with each section of `new` (by heading) replacing its namesake.
fn splice(old: &str, new: &str) -> String {
    let fresh = sections(new);
    sections(old)
        .into_iter()
        .map(|(h, body)| {
            fresh
                .iter()
                .find(|(nh, _)| !h.is_empty() && *nh == h)
                .map_or(body, |(_, nb)| {
                    let mut nb = nb.clone();
                    if !nb.ends_with("\n\n") {
                        nb.push('\n');
                    }
                    nb
                })
        })
        .collect()
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

/// One run's outcome.
#[derive(Clone, Copy, Default)]
struct Run {
    rps: f64,
    lost: u64,
    /// Counted (shared-state) requests.
    total: u64,
    /// Every request (one offload each), over the server's life.
    requests: u64,
    /// The guard's faults (writes seen, under uffd-async) per request.
    writes_per_req: f64,
    /// Server CPU time per request, us.
    cpu_us_per_req: f64,
}

/// CPU time of every thread of `pid` so far, ns (schedstat: time on a CPU).
fn cpu_ns(pid: u32) -> u64 {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn hostile(a: &Args, lat: u32, env: &[(&str, &str)], n: usize) -> Result<Run, String> {
    let stats = std::env::temp_dir().join(format!(
        "toffload-guard-bench-{}-{n}.json",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&stats);
    let mut spec = ServerSpec::new("hostile_server")
        .env("LD_PRELOAD", libtoffload())
        .env("TOFFLOAD_EMU_LAT_US", lat.to_string())
        .env("TOFFLOAD_STATS", stats.display().to_string())
        .cpu(Some(0));
    for (k, v) in env {
        spec = spec.env(k, *v);
    }
    let s = Server::start(&spec)?;
    let mut cfg = Config::new(s.port);
    cfg.conns = a.conns;
    cfg.duration = Duration::from_secs_f64(a.secs);
    cfg.warmup = Duration::from_millis(300);
    let cpu0 = cpu_ns(s.pid());
    let r = load::run(&cfg).map_err(|e| e.to_string())?;
    let cpu = cpu_ns(s.pid()).saturating_sub(cpu0);
    if r.wrong > 0 || r.errors > 0 {
        return Err(format!("wrong {} errors {}", r.wrong, r.errors));
    }
    let out = s.terminate()?;
    let field = |name: &str| -> Result<u64, String> {
        out.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("no {name} in {out:?}"))
    };
    let (lost, total) = (field("lost=")?, field("total=")?);
    let st = std::fs::read_to_string(&stats)
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(s.trim()).ok())
        .ok_or_else(|| format!("no stats in {}", stats.display()))?;
    let _ = std::fs::remove_file(&stats);
    let num = |k: &str| st.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    // Every request makes one offload: the server's requests over its whole life,
    // the span its CPU time was measured over.
    let (faults, requests) = (num("guard_faults"), num("offloads"));
    let per = |x: f64| {
        if requests > 0 {
            x / requests as f64
        } else {
            f64::NAN
        }
    };
    Ok(Run {
        rps: r.requests_per_sec,
        lost,
        total,
        requests,
        writes_per_req: per(faults as f64),
        cpu_us_per_req: per(cpu as f64 / 1000.0),
    })
}

/// Every configuration of `envs`, run after run interleaved: per configuration its
/// runs, in round order (round i of every configuration ran back to back).
fn side_by_side(
    a: &Args,
    runs: usize,
    lat: u32,
    envs: &[&[(&str, &str)]],
) -> Result<Vec<Vec<Run>>, String> {
    let mut all: Vec<Vec<Run>> = vec![Vec::new(); envs.len()];
    let mut n = 0;
    for _ in 0..runs {
        for (i, env) in envs.iter().enumerate() {
            n += 1;
            all[i].push(hostile(a, lat, env, n)?);
        }
    }
    Ok(all)
}

/// Medians of a configuration's runs; lost updates summed.
fn summary(v: &[Run]) -> Run {
    Run {
        rps: median(v.iter().map(|r| r.rps).collect()),
        lost: v.iter().map(|r| r.lost).sum(),
        total: v.iter().map(|r| r.total).sum(),
        requests: v.iter().map(|r| r.requests).sum(),
        writes_per_req: median(v.iter().map(|r| r.writes_per_req).collect()),
        cpu_us_per_req: median(v.iter().map(|r| r.cpu_us_per_req).collect()),
    }
}

/// The share of requests that updated a counter, percent.
fn share(r: &Run) -> f64 {
    100.0 * r.total as f64 / r.requests.max(1) as f64
}

/// The median over rounds of x's throughput over y's in the same round.
fn ratio(x: &[Run], y: &[Run]) -> f64 {
    median(x.iter().zip(y).map(|(x, y)| x.rps / y.rps).collect())
}

/// One guard_faultcost run: ns per iteration.
fn fault_cost_once(env: &[(&str, &str)]) -> Result<f64, String> {
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
    s.trim()
        .strip_prefix("ns=")
        .and_then(|x| x.parse().ok())
        .ok_or_else(|| format!("guard_faultcost said {s:?}"))
}

/// Every configuration of `envs`, interleaved round by round: the median of
/// `rounds` runs each, ns per iteration.
fn fault_costs(envs: &[&[(&str, &str)]], rounds: usize) -> Result<Vec<f64>, String> {
    let mut all = vec![Vec::new(); envs.len()];
    for _ in 0..rounds {
        for (i, env) in envs.iter().enumerate() {
            all[i].push(fault_cost_once(env)?);
        }
    }
    Ok(all.into_iter().map(median).collect())
}

fn main() {
    toffload_cli::generate_if_requested::<Args>();
    let a = Args::parse();
    if let Err(e) = run(&a) {
        eprintln!("toffload-guard-bench: {e}");
        std::process::exit(1);
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn run(a: &Args) -> Result<(), String> {
    if harness::cpus() >= 2 {
        harness::pin_current_thread(1).map_err(|e| format!("pinning: {e}"))?;
    }
    let mut t = format!(
        "hostile_server under libtoffload.so, {} connections, 1 KiB requests, runs of {:.1} s, {} rounds per row ({} for detect): each round runs every configuration of the row back to back; req/s and CPU are medians over rounds, ratios and overheads the median of the per-round ratios. Server on core 0, load on core 1; load average at the start {} (a 2-core VM shared with other work: its throughput varies from run to run; server CPU per request varies much less).\n\n",
        a.conns,
        a.secs,
        a.runs,
        a.detect_runs,
        loadavg()
    );
    let only = |p: Part| a.only.contains(&p);
    let partial = a.only.len() < 3;
    if only(Part::Enforce) {
        enforce(a, &mut t)?;
    }
    if only(Part::Detect) {
        detect(a, &mut t, partial)?;
    }
    if only(Part::Faults) {
        faults(&mut t)?;
    }
    println!("{t}");
    if let Some(out) = &a.out {
        let t = match std::fs::read_to_string(out) {
            Ok(old) if partial => splice(&old, &t),
            _ => t,
        };
        std::fs::write(out, &t).map_err(|e| format!("writing {}: {e}", out.display()))?;
    }
    Ok(())
}

fn enforce(a: &Args, t: &mut String) -> Result<(), String> {
    t.push_str("### Enforce vs a coarse lock\n\n");
    t.push_str("The coarse lock (`LOCKED=1`) is one global mutex held across every request's offload. Enforce serializes only the handlers that touch the same guarded page.\n\n");
    t.push_str("| offload us | requests updating shared state | coarse lock req/s | enforce req/s | enforce / lock | target | lost (lock, enforce) | unguarded req/s (lost) |\n|---:|---|---:|---:|---:|---|---|---|\n");
    let cases: [(&str, &str, &str, bool); 3] = [
        (
            "1",
            "1",
            "every request: RMW of one counter (one-hot-word bound)",
            false,
        ),
        (
            "1",
            "4",
            "every request: RMW of one of 4 counters on 4 pages (high contention)",
            true,
        ),
        (
            "8",
            "1",
            "SHARED_EVERY=8: RMW of one counter (low contention)",
            true,
        ),
    ];
    for lat in [200u32, 1000] {
        for (every, pages, label, targeted) in cases {
            eprintln!("  enforce vs lock: {lat} us, SHARED_EVERY={every} SHARED_PAGES={pages}");
            let k = [("SHARED_EVERY", every), ("SHARED_PAGES", pages)];
            let r = side_by_side(
                a,
                a.runs,
                lat,
                &[
                    &[("LOCKED", "1"), k[0], k[1]],
                    &[("TOFFLOAD_GUARD", "enforce"), k[0], k[1]],
                    &[("TOFFLOAD_GUARD", "off"), k[0], k[1]],
                ],
            )?;
            let (lock, enf, off) = (summary(&r[0]), summary(&r[1]), summary(&r[2]));
            let ratio = ratio(&r[1], &r[0]);
            let target = if targeted {
                format!(">= 1.7x: {}", if ratio >= 1.7 { "met" } else { "not met" })
            } else {
                "bound: ~1x for any correct scheme".to_string()
            };
            t.push_str(&format!(
                "| {lat} | {label}; {:.0}% of requests | {:.0} | {:.0} | {:.2}x | {target} | {}, {} | {:.0} ({}) |\n",
                share(&enf),
                lock.rps,
                enf.rps,
                ratio,
                lock.lost,
                enf.lost,
                off.rps,
                off.lost
            ));
        }
    }
    t.push_str(
        "\nOne-hot-word bound: when every request read-modify-writes the same word across its offload, those critical sections must not overlap for the result to be right, so every scheme that is correct (a lock, enforce, anything) runs one request at a time there: enforce ~= lock is the bound, not a shortfall. Enforce gains where requests touch different pages.\n\n",
    );
    Ok(())
}

fn detect(a: &Args, t: &mut String, partial: bool) -> Result<(), String> {
    t.push_str("### Detect: overhead over unguarded\n\n");
    if partial {
        t.push_str(&format!(
            "(This section from a later run than the rest: {} connections, runs of {:.1} s, {} rounds, load average at its start {}.)\n\n",
            a.conns,
            a.secs,
            a.detect_runs,
            loadavg()
        ));
    }
    t.push_str(&format!("Writes are seen per page: with every request writing the shared counter (SHARED_EVERY=1, detect's worst case), each request costs one write seen and one page re-protected; with SHARED_EVERY=8 (the requests whose first byte is a multiple of 8; the load generator's payloads make that about a fifth of them) the others cost only the scans (uffd-async) or nothing (uffd, mprotect). Each mechanism runs exact (`TOFFLOAD_GUARD_SAMPLE=100`: every park window watched) and sampled at the default `TOFFLOAD_GUARD_SAMPLE={s}` (watching {s}% of the time, in on phases of 50 ms periods): the target is judged on the default; the exact rows show what watching every window costs.\n\n", s = a.sample));
    t.push_str("| offload us | requests writing the counter | detect | req/s | overhead vs unguarded | writes seen / request | server CPU us / request | target (<= 10%, on the default) |\n|---:|---|---|---:|---:|---:|---:|---|\n");
    let sample = a.sample.to_string();
    for every in &a.every {
        let every = every.to_string();
        for &lat in &a.lats {
            eprintln!("  detect overhead: {lat} us, SHARED_EVERY={every}");
            let e = ("SHARED_EVERY", every.as_str());
            let mut envs: Vec<Vec<(&str, &str)>> = vec![vec![("TOFFLOAD_GUARD", "off"), e]];
            for m in &a.mechs {
                for s in ["100", sample.as_str()] {
                    envs.push(vec![
                        ("TOFFLOAD_GUARD", "detect"),
                        ("TOFFLOAD_GUARD_MECH", m.as_str()),
                        ("TOFFLOAD_GUARD_SAMPLE", s),
                        e,
                    ]);
                }
            }
            let refs: Vec<&[(&str, &str)]> = envs.iter().map(|v| v.as_slice()).collect();
            let r = side_by_side(a, a.detect_runs, lat, &refs)?;
            let off = summary(&r[0]);
            let label = format!("SHARED_EVERY={every}: {:.0}%", share(&off));
            t.push_str(&format!(
                "| {lat} | {label} | unguarded | {:.0} | | | {:.1} | |\n",
                off.rps, off.cpu_us_per_req
            ));
            for (i, runs) in r[1..].iter().enumerate() {
                let m = &a.mechs[i / 2];
                let exact = i % 2 == 0;
                let d = summary(runs);
                let o = 1.0 - ratio(runs, &r[0]);
                let verdict = if o <= 0.10 { "met" } else { "not met" };
                let (what, target) = if exact {
                    (format!("exact, {m}"), format!("(exact: {verdict})"))
                } else {
                    (format!("{}%, {m}", a.sample), verdict.to_string())
                };
                t.push_str(&format!(
                    "| {lat} | {label} | {what} | {:.0} | {:.1}% | {:.2} | {:.1} | {target} |\n",
                    d.rps,
                    o * 100.0,
                    d.writes_per_req,
                    d.cpu_us_per_req,
                ));
            }
        }
    }
    t.push_str(&format!(
        "\n(Load average at the end of this section: {}.)\n\n",
        loadavg()
    ));
    Ok(())
}

fn faults(t: &mut String) -> Result<(), String> {
    eprintln!("  fault cost");
    let rows: [(&str, &[(&str, &str)]); 5] = [
        ("unguarded", &[("TOFFLOAD_GUARD", "off")]),
        (
            "detect, uffd-async (kernel-resolved write fault + PAGEMAP_SCAN at the switch + re-protect)",
            &[
                ("TOFFLOAD_GUARD", "detect"),
                ("TOFFLOAD_GUARD_MECH", "uffd-async"),
                ("TOFFLOAD_GUARD_SAMPLE", "100"),
            ],
        ),
        (
            "detect, uffd (write fault served by the handler thread + re-protect)",
            &[
                ("TOFFLOAD_GUARD", "detect"),
                ("TOFFLOAD_GUARD_MECH", "uffd"),
                ("TOFFLOAD_GUARD_SAMPLE", "100"),
            ],
        ),
        (
            "detect, mprotect + SIGSEGV (+ re-protect)",
            &[
                ("TOFFLOAD_GUARD", "detect"),
                ("TOFFLOAD_GUARD_MECH", "mprotect"),
                ("TOFFLOAD_GUARD_SAMPLE", "100"),
            ],
        ),
        (
            "enforce, ownership fault (mprotect + SIGSEGV)",
            &[("TOFFLOAD_GUARD", "enforce")],
        ),
    ];
    let envs: Vec<&[(&str, &str)]> = rows.iter().map(|r| r.1).collect();
    let c = fault_costs(&envs, 7)?;
    t.push_str(
        "### Cost of one guard fault (guard_faultcost on core 0, minus its unguarded loop; median of 7, interleaved; detect exact)\n\n",
    );
    t.push_str("| mechanism | us per fault |\n|---|---:|\n");
    for (i, (label, _)) in rows.iter().enumerate().skip(1) {
        t.push_str(&format!("| {label} | {:.1} |\n", (c[i] - c[0]) / 1000.0));
    }
    t.push_str(&format!(
        "\n(unguarded loop: {:.1} us per iteration: a 1-byte socketpair round trip and a yield)\n",
        c[0] / 1000.0
    ));
    Ok(())
}
