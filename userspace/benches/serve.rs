//! `cargo xtask bench serve`: a bounded soak of `toffload-watch serve` over three
//! example servers, each under steady open-loop load, for --minutes (default 30).
//! Every --every seconds it records the service's resident memory and CPU share and
//! scrapes /metrics (parsed with prometheus-parse: how many targets are up, how long
//! the scrape took). Writes the summary and the series to --out
//! (tests/results/serve.md). Needs root and the dist folder.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::load::{self, Config};

/// The three targets: (name, server, extra arguments, offered requests/s).
const TARGETS: &[(&str, &str, &[&str], f64)] = &[
    ("soak-conn", "conn_server", &[], 500.0),
    ("soak-evloop", "evloop_server", &[], 500.0),
    ("soak-cpu", "conn_server", &["--cpu-us", "50"], 250.0),
];

/// The soak's full length, as the issue asks for.
const DEFAULT_MINUTES: f64 = 30.0;

struct Sample {
    t_s: f64,
    rss_mib: f64,
    cpu_pct: f64,
    up: usize,
    scrape_ms: Option<f64>,
}

fn usage() -> ! {
    eprintln!("usage: serve [--minutes N] [--every SECS] [--out FILE]");
    std::process::exit(2)
}

/// utime + stime of a process, seconds.
fn cpu_secs(pid: u32) -> f64 {
    toffload_watch::untraced::cpu_secs(pid).unwrap_or(0.0)
}

fn rss_mib(pid: u32) -> f64 {
    // SAFETY: sysconf with a valid name has no other effect.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
    std::fs::read_to_string(format!("/proc/{pid}/statm"))
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |p| p * page / (1024.0 * 1024.0))
}

/// A scrape of /metrics: the targets up, and how long it took.
fn scrape(port: u16) -> Option<(usize, f64)> {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: soak\r\n\r\n")
        .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let body = raw.split_once("\r\n\r\n")?.1;
    let parsed = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).ok()?;
    let up = parsed
        .samples
        .iter()
        .filter(|s| s.metric == "toffload_target_up")
        .filter(|s| matches!(s.value, prometheus_parse::Value::Gauge(v) if v == 1.0))
        .count();
    Some((up, ms))
}

/// The host's 1-minute load average: the soak shares its 2 CPUs with whatever else runs.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

fn main() {
    let mut minutes = DEFAULT_MINUTES;
    let mut every = 5.0;
    let mut out = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--minutes" => {
                minutes = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| usage())
            }
            "--every" => {
                every = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| usage())
            }
            "--out" => out = args.next(),
            // cargo bench passes --bench.
            "--bench" => {}
            _ => usage(),
        }
    }
    if !(minutes > 0.0 && every > 0.0) {
        usage();
    }
    let dir = std::env::temp_dir().join(format!("toffload-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut servers = Vec::new();
    let mut config = String::new();
    for (name, bin, extra, _) in TARGETS {
        // A link per target: its name is the process's comm, matched by `process`.
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(harness::bin(bin).expect("built"), &link).expect("link");
        let mut spec = ServerSpec::new(&link.to_string_lossy());
        for a in *extra {
            spec = spec.arg(*a);
        }
        servers.push(Server::start(&spec).expect("server"));
        config.push_str(&format!(
            "[[target]]\nname = \"{name}\"\nprocess = \"{name}\"\n"
        ));
    }
    let port = harness::free_port().expect("port");
    let cfg_path = dir.join("serve.toml");
    std::fs::write(
        &cfg_path,
        format!("listen = \"127.0.0.1:{port}\"\ninterval = \"1s\"\n{config}"),
    )
    .expect("config");
    let mut serve = Command::new(harness::bin("toffload-watch").expect("built"))
        .args(["serve", "--config"])
        .arg(&cfg_path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start serve");
    let err = serve.stderr.take().expect("piped");
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("serve: {l}");
        }
    });
    let pid = serve.id();
    let ready_by = Instant::now() + Duration::from_secs(60);
    while scrape(port).map(|s| s.0) != Some(TARGETS.len()) {
        assert!(
            Instant::now() < ready_by,
            "the targets were not all up within 60 s"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // Steady load on each, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let loads: Vec<_> = servers
        .iter()
        .zip(TARGETS)
        .map(|(s, (_, _, _, rate))| {
            let mut c = Config::new(s.port);
            c.conns = 4;
            c.rate = Some(*rate);
            c.warmup = Duration::from_millis(200);
            c.duration = Duration::from_secs_f64(minutes * 60.0 + 60.0);
            c.stop = Some(stop.clone());
            std::thread::spawn(move || load::run(&c))
        })
        .collect();
    let started = Instant::now();
    let load_before = loadavg();
    let mut samples = Vec::new();
    let (mut cpu_prev, mut t_prev) = (cpu_secs(pid), Instant::now());
    while started.elapsed().as_secs_f64() < minutes * 60.0 {
        std::thread::sleep(Duration::from_secs_f64(every));
        let (cpu, now) = (cpu_secs(pid), Instant::now());
        let cpu_pct = 100.0 * (cpu - cpu_prev) / now.duration_since(t_prev).as_secs_f64();
        (cpu_prev, t_prev) = (cpu, now);
        let s = scrape(port);
        samples.push(Sample {
            t_s: started.elapsed().as_secs_f64(),
            rss_mib: rss_mib(pid),
            cpu_pct,
            up: s.map_or(0, |s| s.0),
            scrape_ms: s.map(|s| s.1),
        });
    }
    let load_after = loadavg();
    stop.store(true, Ordering::Relaxed);
    let reports: Vec<Result<load::Report, String>> = loads
        .into_iter()
        .map(|h| h.join().expect("load").map_err(|e| e.to_string()))
        .collect();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let stop_by = Instant::now() + Duration::from_secs(15);
    let code = loop {
        if let Ok(Some(s)) = serve.try_wait() {
            break s.code();
        }
        if Instant::now() > stop_by {
            let _ = serve.kill();
            let _ = serve.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(servers);
    let _ = std::fs::remove_dir_all(&dir);

    let host = format!(
        "{} CPUs, load average (1 min) {load_before} at the start and {load_after} at the end",
        harness::cpus()
    );
    let md = report(minutes, every, &host, &samples, &reports, code);
    print!("{md}");
    if let Some(p) = out {
        std::fs::write(&p, &md).expect("write --out");
        eprintln!("wrote {p}");
    }
}

fn report(
    minutes: f64,
    every: f64,
    host: &str,
    samples: &[Sample],
    reports: &[Result<load::Report, String>],
    code: Option<i32>,
) -> String {
    let mut md = String::from("# toffload-watch serve: bounded soak\n\n");
    if minutes < DEFAULT_MINUTES {
        md.push_str(&format!(
            "**A short run: {minutes} minutes, not the full {DEFAULT_MINUTES} minutes** \
             (`cargo xtask bench serve` runs the full soak; `--minutes N` shortens it).\n\n"
        ));
    }
    md.push_str(&format!(
        "`toffload-watch serve` over three example servers named by process, each under \
         open-loop load from the load generator; the service's resident memory and CPU \
         share sampled every {every} s, /metrics scraped and parsed at each sample. \
         Host: {host}.\n\n"
    ));
    let first = samples.first().map_or(0.0, |s| s.rss_mib);
    let last = samples.last().map_or(0.0, |s| s.rss_mib);
    let max = samples.iter().map(|s| s.rss_mib).fold(0.0, f64::max);
    let n = samples.len().max(1) as f64;
    let cpu_mean = samples.iter().map(|s| s.cpu_pct).sum::<f64>() / n;
    let cpu_max = samples.iter().map(|s| s.cpu_pct).fold(0.0, f64::max);
    let ok = samples.iter().filter(|s| s.scrape_ms.is_some()).count();
    let all_up = samples.iter().filter(|s| s.up == TARGETS.len()).count();
    let mut ms: Vec<f64> = samples.iter().filter_map(|s| s.scrape_ms).collect();
    ms.sort_by(f64::total_cmp);
    let ms_max = ms.last().copied().unwrap_or(f64::NAN);
    md.push_str("| minutes | samples | RSS first MiB | RSS last MiB | RSS max MiB | CPU mean % | CPU max % | scrapes ok | all 3 up | scrape max ms | exit |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
    md.push_str(&format!(
        "| {minutes} | {} | {first:.1} | {last:.1} | {max:.1} | {cpu_mean:.2} | {cpu_max:.2} | {ok}/{} | {all_up}/{} | {ms_max:.1} | {} |\n\n",
        samples.len(),
        samples.len(),
        samples.len(),
        code.map_or("killed".to_string(), |c| c.to_string())
    ));
    md.push_str("Load per target (the load generator's own count):\n\n| target | offered req/s | answered req/s | errors |\n|---|---|---|---|\n");
    for ((name, _, _, rate), r) in TARGETS.iter().zip(reports) {
        match r {
            Ok(r) => md.push_str(&format!(
                "| {name} | {rate:.0} | {:.0} | {} |\n",
                r.requests_per_sec, r.errors
            )),
            Err(e) => md.push_str(&format!("| {name} | {rate:.0} | - | {e} |\n")),
        }
    }
    md.push_str(
        "\nSamples:\n\n| t s | RSS MiB | CPU % | targets up | scrape ms |\n|---|---|---|---|---|\n",
    );
    for s in samples {
        md.push_str(&format!(
            "| {:.0} | {:.2} | {:.2} | {} | {} |\n",
            s.t_s,
            s.rss_mib,
            s.cpu_pct,
            s.up,
            s.scrape_ms.map_or("-".to_string(), |m| format!("{m:.1}"))
        ));
    }
    md
}
