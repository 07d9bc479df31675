//! The remote CUDA client's benchmark (`cargo xtask bench remote-cuda`, root: it makes
//! network namespaces): remoting efficiency of an unmodified thread-per-connection
//! GPU server. conn_server on the cuda backend (TOFFLOAD_BACKEND=cuda) runs directly
//! on the driver, and through backends/cuda-remote's libcuda.so.1 against a
//! toffload-remoted over loopback and over links of 100 us, 1 ms and 10 ms round trip
//! (namespaces joined by veth pairs, delayed by netem or the delay line of
//! remote_util/netns.rs), with batching on/off and the upload cache on/off, and as
//! the naive forwarder (every call waits), stock and under libtoffload.so; each row's
//! daemon's calls per frame. Every configuration once per round, rounds interleaved,
//! medians of `--runs` (default 3); writes `--out`.
//!
//! A second table follows one program (cuda_app, one thread) over the same links,
//! batched and naive: the bytes it sends on its first run against a fresh daemon and
//! on a second run (its weights cached there by content hash), frames and calls per
//! frame, and the time per synchronize (cuda_app's CUDA_APP_TIMING: a request of
//! five calls and one wait, from its first call to the wait's return).
//!
//! The daemon's GPU is the fake driver (tests/c/fake_cuda.c) unless `--real-driver`:
//! then the daemon and the direct rows use the machine's libcuda, and the client
//! compiles with the machine's NVRTC (found under /usr/local/cuda*, /usr/lib*).

#[path = "../tests/remote_util/mod.rs"]
mod remote_util;

use remote_util::conn_server::{self as cs, Load, Sample};
use remote_util::cuda::Libs;
use remote_util::netns::{self, DelayLine, Link, Net, Shape};
use remote_util::Daemon;
use std::fmt::Write as _;
use std::path::PathBuf;

const LOAD: Load = Load {
    conns: 64,
    size: 4096,
    secs: 1.5,
    warmup: 0.4,
};
/// The fake GPU's time per kernel.
const KERNEL_US: u32 = 100;
/// Heading of the table the chart reads.
pub const HEADING: &str = "## conn_server, direct vs remoted";
/// cuda_app's arguments in the one-program table: one thread, 40 requests.
const APP_RUN: [&str; 3] = ["run", "1", "40"];

/// One run of cuda_app: what the daemon received, the round trips the client waited
/// (its own count, TOFFLOAD_CUDA_REMOTE_STATS), and its time per synchronize.
#[derive(Clone, Copy, Debug, Default)]
struct AppRun {
    bytes: u64,
    frames: u64,
    calls: u64,
    round_trips: u64,
    /// The client's own count of the bytes it sent (the daemon's must agree).
    client_bytes: u64,
    sync_us: f64,
    ms: f64,
}

/// The one-program table's row: a link and a client mode, first and cached runs.
struct SyncRow {
    link: String,
    naive: bool,
    first: Vec<AppRun>,
    cached: Vec<AppRun>,
}

/// One configuration of the client: batching and upload cache, or the naive
/// forwarder (every call waits for its round trip: TOFFLOAD_CUDA_REMOTE_NAIVE=1).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Mode {
    batching: bool,
    cache: bool,
    naive: bool,
}

impl Mode {
    fn env(self) -> Vec<(String, String)> {
        vec![
            (
                "TOFFLOAD_CUDA_REMOTE_LINGER_US".into(),
                if self.batching { "200" } else { "0" }.into(),
            ),
            // On: every request's copy goes by content hash (asked first); off: only
            // the module image does.
            (
                "TOFFLOAD_CUDA_REMOTE_CACHE_MIN".into(),
                if self.cache { "4096" } else { "16777216" }.into(),
            ),
            (
                "TOFFLOAD_CUDA_REMOTE_NAIVE".into(),
                if self.naive { "1" } else { "0" }.into(),
            ),
        ]
    }
}

const MODES: [Mode; 5] = [
    Mode {
        batching: true,
        cache: false,
        naive: false,
    },
    Mode {
        batching: false,
        cache: false,
        naive: false,
    },
    Mode {
        batching: true,
        cache: true,
        naive: false,
    },
    Mode {
        batching: false,
        cache: true,
        naive: false,
    },
    Mode {
        batching: false,
        cache: false,
        naive: true,
    },
];

/// Where a row's server runs and what it reaches.
struct Row {
    link: String,
    mode: Option<Mode>,
    ns: Option<String>,
    env: Vec<(String, String)>,
    /// The row's daemon, as (namespace, port) for its counters (None: direct).
    daemon: Option<(Option<String>, u16)>,
    stock: Vec<Sample>,
    runtime: Vec<Sample>,
    /// The daemon's CUDA calls and frames over the row's runs.
    calls: u64,
    frames: u64,
}

/// (CUDA calls, frames) the daemon has counted so far.
fn daemon_counts(d: &(Option<String>, u16)) -> (u64, u64) {
    let s = daemon_stats(d);
    (s["cuda_calls"], s["cuda_frames"])
}

fn nvrtc_dir() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for root in ["/usr/local", "/opt"] {
        if let Ok(rd) = std::fs::read_dir(root) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with("cuda") {
                    dirs.push(e.path().join("lib64"));
                    dirs.push(e.path().join("targets/x86_64-linux/lib"));
                }
            }
        }
    }
    dirs.push("/usr/lib/x86_64-linux-gnu".into());
    dirs.into_iter().find(|d| {
        std::fs::read_dir(d).is_ok_and(|rd| {
            rd.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("libnvrtc.so"))
        })
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut out: Option<String> = None;
    let mut runs = 3;
    let mut real = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = it.next().cloned(),
            "--runs" => runs = it.next().and_then(|v| v.parse().ok()).expect("--runs N"),
            "--real-driver" => real = true,
            "--bench" => {}
            "--help" | "-h" => {
                println!(
                    "remote-cuda bench: [--runs N] [--out FILE.md] [--real-driver] \
                     (root: network namespaces)"
                );
                return;
            }
            other => panic!("unknown argument {other:?}"),
        }
    }
    if let Err(why) = netns::can_run() {
        eprintln!("remote-cuda bench: {why}");
        std::process::exit(1);
    }
    let runtime_lib = cs::dist_ready().unwrap_or_else(|e| panic!("{e}"));
    let load0 = loadavg();
    let libs = Libs::new("bench");
    // The daemon's and the direct rows' driver; the client's NVRTC.
    let (driver_env, driver): (Vec<(String, String)>, String) = if real {
        let nv = nvrtc_dir().expect("--real-driver: no libnvrtc.so under /usr/local/cuda*");
        let client_nvrtc = libs.client.join("libnvrtc.so");
        let _ = std::fs::remove_file(&client_nvrtc);
        let lib = std::fs::read_dir(&nv)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("libnvrtc.so.")
            })
            .min()
            .expect("libnvrtc.so.N");
        std::os::unix::fs::symlink(&lib, &client_nvrtc).unwrap();
        (
            vec![("LD_LIBRARY_PATH".into(), nv.display().to_string())],
            "the machine's CUDA driver".into(),
        )
    } else {
        (
            libs.gpu_env(KERNEL_US),
            format!(
                "the fake driver (tests/c/fake_cuda.c, {KERNEL_US} us per kernel), which \
                 computes on the CPU: its daemon is pinned to the server's core, as the fake \
                 driver is in the direct rows"
            ),
        )
    };
    let denv: Vec<(&str, &str)> = driver_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    // The fake GPU computes on the CPU: its daemon shares the server's core, as the
    // fake driver does in the direct rows (the load has the other core).
    let pin: Vec<&str> = if !real && toffload_tests::harness::cpus() >= 2 {
        vec!["taskset", "-c", "0"]
    } else {
        Vec::new()
    };
    // Loopback: a daemon beside the server. Links: one daemon per shaped link.
    let local = Daemon::start_in(&pin, &["--listen", "127.0.0.1:0"], &denv);
    let shapes = [
        Shape {
            mbit: 10_000,
            delay_us: 50,
            jitter_us: 0,
        },
        Shape {
            mbit: 10_000,
            delay_us: 500,
            jitter_us: 0,
        },
        Shape {
            mbit: 10_000,
            delay_us: 5000,
            jitter_us: 0,
        },
    ];
    let net = Net::new("rcb", &shapes).expect("namespaces");
    let how = net.links[0].how;
    let far: Vec<_> = net
        .links
        .iter()
        .map(|l| daemon_across(l, &pin, &denv))
        .collect();
    let backend = |list: &str, m: Mode| {
        let mut e = vec![
            ("TOFFLOAD_BACKEND".to_string(), "cuda".to_string()),
            ("LD_LIBRARY_PATH".into(), libs.client.display().to_string()),
            ("TOFFLOAD_CUDA_REMOTE".into(), list.to_string()),
        ];
        e.extend(m.env());
        e
    };
    let mut rows = vec![Row {
        link: "none (direct on the driver)".into(),
        mode: None,
        ns: None,
        env: {
            let mut e = vec![("TOFFLOAD_BACKEND".to_string(), "cuda".to_string())];
            e.extend(driver_env.iter().cloned());
            e
        },
        daemon: None,
        stock: Vec::new(),
        runtime: Vec::new(),
        calls: 0,
        frames: 0,
    }];
    type LinkRow = (String, Option<String>, String, (Option<String>, u16));
    let links: Vec<LinkRow> = std::iter::once((
        "loopback".to_string(),
        None,
        local.addr(),
        (None, local.port),
    ))
    .chain(
        far.iter()
            .zip(&shapes)
            .zip(&net.links)
            .map(|(((d, _, addr), s), l)| {
                (
                    format!("{} us RTT", 2 * s.delay_us),
                    Some(net.client_ns.clone()),
                    addr.clone(),
                    (Some(l.ns.clone()), d.port),
                )
            }),
    )
    .collect();
    for (link, ns, addr, daemon) in &links {
        for m in MODES {
            rows.push(Row {
                link: link.clone(),
                mode: Some(m),
                ns: ns.clone(),
                env: backend(addr, m),
                daemon: Some(daemon.clone()),
                stock: Vec::new(),
                runtime: Vec::new(),
                calls: 0,
                frames: 0,
            });
        }
    }
    // Rounds interleaved: a noisy neighbour hits every configuration alike.
    for round in 0..runs {
        for r in rows.iter_mut() {
            for rt in [None, Some(runtime_lib.as_path())] {
                let before = r.daemon.as_ref().map(daemon_counts);
                let s = cs::run(r.ns.as_deref(), &r.env, "block", rt, LOAD)
                    .unwrap_or_else(|e| panic!("{} {:?}: {e}", r.link, r.mode));
                if let (Some(d), Some((c0, f0))) = (&r.daemon, before) {
                    let (c1, f1) = daemon_counts(d);
                    r.calls += c1.saturating_sub(c0);
                    r.frames += f1.saturating_sub(f0);
                }
                println!(
                    "round {round}: {} {:?} {}: {:.0} req/s, p50 {:.0} us, wrong {}, errors {}",
                    r.link,
                    r.mode,
                    if rt.is_some() { "runtime" } else { "stock" },
                    s.rps,
                    s.p50_us,
                    s.wrong,
                    s.errors
                );
                if rt.is_some() {
                    r.runtime.push(s);
                } else {
                    r.stock.push(s);
                }
            }
        }
    }
    // One program, first and cached runs, against a fresh daemon each round.
    let mut sync_rows: Vec<SyncRow> = Vec::new();
    for (link, _, _, _) in &links {
        for naive in [false, true] {
            sync_rows.push(SyncRow {
                link: link.clone(),
                naive,
                first: Vec::new(),
                cached: Vec::new(),
            });
        }
    }
    for round in 0..runs {
        for r in sync_rows.iter_mut() {
            let k = links.iter().position(|l| l.0 == r.link).expect("a link");
            let (first, cached) = if k == 0 {
                let d = Daemon::start_in(&pin, &["--listen", "127.0.0.1:0"], &denv);
                let at = (None, d.port);
                app_pair(&libs, None, &d.addr(), &at, r.naive)
            } else {
                let l = &net.links[k - 1];
                let (d, _dl, addr) = daemon_across(l, &pin, &denv);
                let at = (Some(l.ns.clone()), d.port);
                app_pair(&libs, Some(&net.client_ns), &addr, &at, r.naive)
            };
            println!(
                "round {round}: one program, {} {}: first {first:?}, cached {cached:?}",
                r.link,
                if r.naive { "naive" } else { "batched" }
            );
            r.first.push(first);
            r.cached.push(cached);
        }
    }
    let counters = format!(
        "{}. Host: {} CPUs, load average {} at the start and {} at the end (the \
         machine is shared: ratios side by side count, not absolute rates)",
        local_stats(&local),
        toffload_tests::harness::cpus(),
        load0,
        loadavg()
    );
    let mut md = report(&rows, runs, &driver, how, &counters, real);
    md += &report_sync(&sync_rows, runs);
    print!("{md}");
    if let Some(o) = out {
        std::fs::write(&o, md).expect("writing results");
        println!("wrote {o}");
    }
    drop(far);
}

/// A daemon reachable over `link` (as netns::daemon_on), started through `pin`.
fn daemon_across(
    link: &Link,
    pin: &[&str],
    env: &[(&str, &str)],
) -> (Daemon, Option<DelayLine>, String) {
    let mut prefix = vec!["ip", "netns", "exec", link.ns.as_str()];
    prefix.extend_from_slice(pin);
    let d = Daemon::start_in(
        &prefix,
        &["--listen", "0.0.0.0:0", "--insecure-plaintext"],
        env,
    );
    if link.how == "netem" {
        let addr = format!("{}:{}", link.daemon_ip, d.port);
        (d, None, addr)
    } else {
        let dl = DelayLine::start(
            &link.ns,
            &link.daemon_ip,
            format!("127.0.0.1:{}", d.port),
            link.shape.delay_us,
            link.shape.jitter_us,
        );
        let addr = format!("{}:{}", link.daemon_ip, dl.port);
        (d, Some(dl), addr)
    }
}

/// Every counter of the daemon at `d` (namespace, port).
fn daemon_stats(d: &(Option<String>, u16)) -> std::collections::HashMap<String, u64> {
    match &d.0 {
        Some(ns) => netns::stats_in(ns, d.1),
        None => remote_util::stats(&format!("127.0.0.1:{}", d.1)),
    }
}

/// cuda_app twice against the fresh daemon `at` (reached as `addr`, from namespace
/// `ns`): its first run and a second one, whose uploads the daemon holds.
fn app_pair(
    libs: &Libs,
    ns: Option<&str>,
    addr: &str,
    at: &(Option<String>, u16),
    naive: bool,
) -> (AppRun, AppRun) {
    let one = || {
        let before = daemon_stats(at);
        let mut c = libs.remote_cmd(&libs.app, addr);
        c.args(APP_RUN)
            .env("CUDA_APP_TIMING", "1")
            .env("TOFFLOAD_CUDA_REMOTE_STATS", "1")
            .env("TOFFLOAD_CUDA_REMOTE_NAIVE", if naive { "1" } else { "0" });
        let mut run = move || {
            let t0 = std::time::Instant::now();
            let o = c.output().expect("cuda_app");
            (o, t0.elapsed())
        };
        let (o, took) = match ns {
            Some(ns) => netns::in_ns(ns, run),
            None => run(),
        };
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "cuda_app: {err}");
        let sync_us = err
            .lines()
            .find_map(|l| l.strip_prefix("sync_us "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no sync_us line: {err}"));
        let counts = remote_util::cuda::client_counts(&err)
            .unwrap_or_else(|| panic!("no client counts: {err}"));
        // The frees after the last synchronize are not waited for.
        std::thread::sleep(std::time::Duration::from_millis(100));
        let after = daemon_stats(at);
        let d = |k: &str| after[k].saturating_sub(before[k]);
        AppRun {
            bytes: d("cuda_bytes"),
            frames: d("cuda_frames"),
            calls: d("cuda_calls"),
            round_trips: counts.round_trips,
            client_bytes: counts.bytes,
            sync_us,
            ms: took.as_secs_f64() * 1e3,
        }
    };
    let first = one();
    let cached = one();
    (first, cached)
}

fn report_sync(rows: &[SyncRow], runs: usize) -> String {
    let m = |v: &[AppRun], f: fn(&AppRun) -> f64| {
        toffload_tests::harness::median(v.iter().map(f).collect())
    };
    let disagree = rows
        .iter()
        .flat_map(|r| r.first.iter().chain(&r.cached))
        .filter(|a| a.bytes != a.client_bytes)
        .count();
    let agree = disagree == 0;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "\n## One program: bytes per run and time per synchronize\n\n\
         cuda_app (backends/tests/c/cuda_app.c) `{}`: module, 1 MiB of weights uploaded \
         once, then 40 requests of 4 KiB on one thread; against a fresh daemon each round, \
         run twice: first (nothing held there) and cached (the weights and the module \
         referred to by content hash, TOFFLOAD_CUDA_REMOTE_CACHE_MIN's default 64 KiB). \
         Bytes: the calls' bytes the daemon received (its cuda_bytes counter; the \
         client's own count, TOFFLOAD_CUDA_REMOTE_STATS, {}); round trips: the waits \
         the client made that found the daemon's answer not there yet (its own count); \
         calls per round trip: the daemon's calls over those (the naive forwarder's \
         probes counted as calls, one behind each call of the program); time per \
         synchronize: the median, over the run's 20 requests that end in one \
         synchronize, of the time from the request's first call to the wait's return \
         (five calls, then the wait: batched, one round trip; naive, one per call); \
         medians of {runs} rounds.\n",
        APP_RUN.join(" "),
        if agree {
            "agreed on every run".to_string()
        } else {
            format!("differed on {disagree} run(s)")
        }
    );
    let _ = writeln!(
        md,
        "| link | client | first run bytes | cached run bytes | frames per run | calls per frame | round trips per run | calls per round trip | time per synchronize us | first run ms | cached run ms |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows {
        let all: Vec<AppRun> = r.first.iter().chain(&r.cached).copied().collect();
        let (calls, frames) = (m(&all, |a| a.calls as f64), m(&all, |a| a.frames as f64));
        let trips = m(&all, |a| a.round_trips as f64);
        let _ = writeln!(
            md,
            "| {} | {} | {:.0} | {:.0} | {frames:.0} | {:.1} | {trips:.0} | {:.1} | {:.0} | {:.0} | {:.0} |",
            r.link,
            if r.naive {
                "naive (every call waits)"
            } else {
                "batched"
            },
            m(&r.first, |a| a.bytes as f64),
            m(&r.cached, |a| a.bytes as f64),
            calls / frames.max(1.0),
            calls / trips.max(1.0),
            m(&all, |a| a.sync_us),
            m(&r.first, |a| a.ms),
            m(&r.cached, |a| a.ms),
        );
    }
    md
}

/// The 1-minute load average.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(String::from))
        .unwrap_or_else(|| "?".into())
}

fn local_stats(d: &Daemon) -> String {
    let s = remote_util::stats(&d.addr());
    format!(
        "loopback daemon's counters over every run: {} CUDA calls in {} frames, {} \
         synchronizing round trips, {} upload hits ({} bytes not resent), {} misses, {} \
         failed calls",
        s["cuda_calls"],
        s["cuda_frames"],
        s["cuda_syncs"],
        s["cuda_upload_hits"],
        s["cuda_upload_bytes_saved"],
        s["cuda_upload_misses"],
        s["cuda_failed"]
    )
}

fn med(v: &[Sample], f: fn(&Sample) -> f64) -> f64 {
    toffload_tests::harness::median(v.iter().map(f).collect())
}

fn onoff(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

fn report(
    rows: &[Row],
    runs: usize,
    driver: &str,
    how: &str,
    counters: &str,
    real: bool,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Remote CUDA: remoting efficiency\n");
    let _ = writeln!(
        md,
        "`cargo xtask bench remote-cuda{}` (backends/benches/remote_cuda.rs), median of {runs} \
         rounds, every configuration once per round (interleaved). conn_server (tests/servers, \
         unmodified) with TOFFLOAD_BACKEND=cuda, {} connections of {} B requests from \
         toffload-load, {} s measured after {} s warm-up, server pinned to core 0 and the \
         load to core 1; stock (blocking wait) and under libtoffload.so (LD_PRELOAD). The \
         GPU: {driver}. Remoted: the client library (backends/cuda-remote) as the server's \
         libcuda, toffload-remoted on loopback beside it or across a veth link delayed \
         {how}. Batching off: TOFFLOAD_CUDA_REMOTE_LINGER_US=0 (every call its own frame); \
         naive: TOFFLOAD_CUDA_REMOTE_NAIVE=1, the naive forwarder of the same client (every \
         call that returns nothing waits for a probe's answer behind it: a round trip per \
         call); calls per frame: the row's daemon's CUDA calls over its frames, over all \
         the row's runs (the naive forwarder's probes counted as calls); \
         upload cache on: TOFFLOAD_CUDA_REMOTE_CACHE_MIN=4096 (each request's copy offered \
         by content hash first), off: 16 MiB (only the module image). Efficiency: remoted \
         req/s over direct req/s, stock against stock and runtime against runtime.\n",
        if real { " -- --real-driver" } else { "" },
        LOAD.conns,
        LOAD.size,
        LOAD.secs,
        LOAD.warmup,
    );
    let _ = writeln!(md, "{HEADING}\n");
    let _ = writeln!(
        md,
        "| link | batching | upload cache | stock req/s | runtime req/s | runtime/stock | stock p50 us | runtime p50 us | stock efficiency | runtime efficiency | calls per frame | wrong | errors |\n\
         |---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let (ds, dr) = (
        med(&rows[0].stock, |s| s.rps),
        med(&rows[0].runtime, |s| s.rps),
    );
    for r in rows {
        let (s, rt) = (med(&r.stock, |s| s.rps), med(&r.runtime, |s| s.rps));
        let (b, c) = match r.mode {
            Some(m) if m.naive => ("naive (every call waits)", onoff(m.cache)),
            Some(m) => (onoff(m.batching), onoff(m.cache)),
            None => ("", ""),
        };
        let per_frame = if r.frames > 0 {
            format!("{:.1}", r.calls as f64 / r.frames as f64)
        } else {
            String::new()
        };
        let _ = writeln!(
            md,
            "| {} | {b} | {c} | {s:.0} | {rt:.0} | {:.2}x | {:.0} | {:.0} | {:.0}% | {:.0}% | {per_frame} | {} | {} |",
            r.link,
            rt / s,
            med(&r.stock, |s| s.p50_us),
            med(&r.runtime, |s| s.p50_us),
            s / ds * 100.0,
            rt / dr * 100.0,
            r.stock.iter().chain(&r.runtime).map(|s| s.wrong).sum::<u64>(),
            r.stock.iter().chain(&r.runtime).map(|s| s.errors).sum::<u64>(),
        );
    }
    let _ = writeln!(md, "\n{counters}.");
    md
}
