//! The watch bench on stock Debian servers under their own load tools: redis-server
//! under redis-benchmark, nginx under wrk. Throughput is the server's own count
//! (redis' total_commands_processed, nginx's stub_status requests), polled every
//! quarter second, so that the dip at attach and detach shows as well as the mean.
//!
//! One run: the load starts; after 1 s the watcher (if any) starts and attaches;
//! MEASURE seconds later it is interrupted (detach); the load runs 1 s more. The rate
//! is over the attached stretch; the worst quarter second is over the whole run from
//! the watcher's start to the load's end.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use toffload_tests::harness::{self, which};

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Redis,
    Nginx,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Redis => "redis-server (redis-benchmark -c 50 -t get)",
            Kind::Nginx => "nginx (wrk -t1 -c32)",
        }
    }

    fn tools(self) -> &'static [&'static str] {
        match self {
            Kind::Redis => &["redis-server", "redis-benchmark"],
            Kind::Nginx => &["nginx", "wrk"],
        }
    }
}

/// Why the servers cannot run here, if they cannot.
pub fn missing(kind: Kind) -> Option<String> {
    let m: Vec<&str> = kind
        .tools()
        .iter()
        .copied()
        .filter(|t| which(t).is_none())
        .collect();
    (!m.is_empty()).then(|| format!("not installed: {}", m.join(", ")))
}

/// A process killed (and reaped) on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pinned(cpu: Option<usize>, prog: &Path) -> Command {
    match cpu {
        Some(c) => {
            let mut t = Command::new("taskset");
            t.args(["-c", &c.to_string()]).arg(prog);
            t
        }
        None => Command::new(prog),
    }
}

pub fn start_server(kind: Kind, port: u16, dir: &Path, cpu: Option<usize>) -> Proc {
    let child = match kind {
        Kind::Redis => pinned(cpu, &which("redis-server").expect("redis-server"))
            .args(["--port", &port.to_string(), "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .spawn(),
        Kind::Nginx => {
            let d = dir.display();
            let conf = format!(
                "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\n\
                 error_log {d}/error.log;\nevents {{ worker_connections 1024; }}\n\
                 http {{\n access_log off;\n client_body_temp_path {d}/body;\n proxy_temp_path {d}/proxy;\n\
                 fastcgi_temp_path {d}/fcgi;\n uwsgi_temp_path {d}/uwsgi;\n scgi_temp_path {d}/scgi;\n\
                 server {{ listen 127.0.0.1:{port}; location = /status {{ stub_status; }}\n\
                 location / {{ return 200 \"hello\\n\"; }} }}\n}}\n"
            );
            let p = dir.join("nginx.conf");
            std::fs::write(&p, conf).expect("nginx.conf");
            pinned(cpu, &which("nginx").expect("nginx"))
                .arg("-p")
                .arg(dir)
                .arg("-c")
                .arg(&p)
                .stderr(Stdio::null())
                .spawn()
        }
    }
    .expect("start the server");
    assert!(
        harness::wait_listening(port, Duration::from_secs(10)),
        "server on {port} did not start"
    );
    Proc(child)
}

pub fn start_load(kind: Kind, port: u16, secs: f64) -> Proc {
    let child = match kind {
        // -n far beyond the run: it is killed at the end.
        Kind::Redis => Command::new("redis-benchmark")
            .args([
                "-p",
                &port.to_string(),
                "-c",
                "50",
                "-t",
                "get",
                "-n",
                "100000000",
                "-q",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn(),
        // Far beyond the run too (the watcher's start takes a variable time): killed at
        // the end, so no quarter second after it counts a load that had stopped.
        Kind::Nginx => Command::new("wrk")
            .args(["-t1", "-c32", &format!("-d{}s", secs.ceil() as u64 + 60)])
            .arg(format!("http://127.0.0.1:{port}/"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn(),
    }
    .expect("start the load tool");
    Proc(child)
}

/// The server's own count of requests served so far.
pub fn served(kind: Kind, port: u16) -> Option<u64> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut text = String::new();
    match kind {
        Kind::Redis => {
            s.write_all(b"*2\r\n$4\r\nINFO\r\n$5\r\nstats\r\n").ok()?;
            let mut buf = [0u8; 8192];
            while !text.contains("total_commands_processed:") || !text.ends_with("\r\n") {
                let n = s.read(&mut buf).ok()?;
                if n == 0 {
                    break;
                }
                text.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
            text.lines()
                .find_map(|l| l.strip_prefix("total_commands_processed:"))
                .and_then(|v| v.trim().parse().ok())
        }
        Kind::Nginx => {
            s.write_all(b"GET /status HTTP/1.0\r\nHost: x\r\n\r\n")
                .ok()?;
            s.read_to_string(&mut text).ok()?;
            // "server accepts handled requests\n N N N"
            let mut lines = text
                .lines()
                .skip_while(|l| !l.starts_with("server accepts"));
            lines.next()?;
            lines.next()?.split_whitespace().nth(2)?.parse().ok()
        }
    }
}

/// (seconds since start, count) every quarter second until told to stop.
fn poller(
    kind: Kind,
    port: u16,
    stop: Arc<AtomicBool>,
    t0: Instant,
) -> std::thread::JoinHandle<Vec<(f64, u64)>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let mut next = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            if let Some(n) = served(kind, port) {
                v.push((t0.elapsed().as_secs_f64(), n));
            }
            next += Duration::from_millis(250);
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
        }
        v
    })
}

/// The rate between two times, from the samples nearest inside them.
fn rate_between(s: &[(f64, u64)], a: f64, b: f64) -> f64 {
    let inside: Vec<&(f64, u64)> = s.iter().filter(|(t, _)| *t >= a && *t <= b).collect();
    match (inside.first(), inside.last()) {
        (Some(x), Some(y)) if y.0 > x.0 => (y.1 - x.1) as f64 / (y.0 - x.0),
        _ => f64::NAN,
    }
}

/// Quarter-second slots after the watcher's start that a run's profile keeps.
pub const START_QUARTERS: usize = 10;
/// Quarter-second slots from a quarter before the detach (SIGINT) that it keeps.
pub const EXIT_QUARTERS: usize = 5;

/// The rates of `n` quarter-second slots from `at` (slot k: the sample pair that
/// begins in [at + k/4, at + (k+1)/4)) over `base`; NaN where no pair begins there.
fn quarters(s: &[(f64, u64)], at: f64, n: usize, base: f64) -> Vec<f64> {
    (0..n)
        .map(|k| {
            let a = at + k as f64 * 0.25;
            s.windows(2)
                .find(|w| w[0].0 >= a && w[0].0 < a + 0.25)
                .map_or(f64::NAN, |w| {
                    (w[1].1 - w[0].1) as f64 / (w[1].0 - w[0].0) / base
                })
        })
        .collect()
}

/// The lowest quarter-second rate between two times.
fn worst_quarter(s: &[(f64, u64)], a: f64, b: f64) -> f64 {
    s.windows(2)
        .filter(|w| w[0].0 >= a && w[1].0 <= b)
        .map(|w| (w[1].1 - w[0].1) as f64 / (w[1].0 - w[0].0))
        .fold(f64::INFINITY, f64::min)
}

pub struct Run {
    pub rps: f64,
    pub worst_quarter: f64,
    /// The rate over the 0.75 s before the watcher's start: what the same run did
    /// unwatched, which the host's drift between runs does not move.
    pub before: f64,
    /// Each quarter second over `before` from the watcher's start (START_QUARTERS),
    /// and from a quarter before its detach (EXIT_QUARTERS): the run's profile, which
    /// the median over runs lines up (watch.rs).
    pub start_quarters: Vec<f64>,
    pub exit_quarters: Vec<f64>,
    /// Seconds from the watcher's start to its "attached" line (unwatched: the
    /// moment between two clock reads).
    pub start_secs: f64,
    pub cpu_us_per_req: f64,
    /// Shares of a core over the attached stretch: the server's, the load tool's, and
    /// the watcher's (its start included; 0 unwatched). Where the server's core has
    /// room and the load tool's does not, the watcher's CPU on the load tool's core
    /// is what a watched run loses, not the server's.
    pub server_busy: f64,
    pub load_busy: f64,
    pub watcher_busy: f64,
}

/// One run; `watch` is the watcher's command (None: unwatched, same timeline).
pub fn run(
    kind: Kind,
    secs: f64,
    server_cpu: Option<usize>,
    watch: Option<&dyn Fn(u32) -> Child>,
) -> Run {
    let port = toffload_tests::harness::free_port().expect("port");
    let dir = std::env::temp_dir().join(format!("toffload-wbench-{port}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let srv = start_server(kind, port, &dir, server_cpu);
    let pid = srv.0.id();
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let samples = poller(kind, port, stop.clone(), t0);
    let load = start_load(kind, port, secs + 3.0);
    std::thread::sleep(Duration::from_secs(1));
    let from = t0.elapsed().as_secs_f64();
    let watched = watch.is_some();
    let w = watch.map(|f| f(pid));
    let attached = t0.elapsed().as_secs_f64();
    let cpu = toffload_watch::untraced::cpu_secs;
    let load_pid = load.0.id();
    let (c0, l0) = (cpu(pid).unwrap_or(0.0), cpu(load_pid).unwrap_or(0.0));
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (c1, l1) = (cpu(pid).unwrap_or(0.0), cpu(load_pid).unwrap_or(0.0));
    let watcher_secs = w.as_ref().and_then(|w| cpu(w.id())).unwrap_or(0.0);
    let until = t0.elapsed().as_secs_f64();
    if let Some(mut w) = w {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(w.id() as i32, libc::SIGINT) };
        let _ = w.wait();
    }
    std::thread::sleep(Duration::from_secs(1));
    let end = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let s = samples.join().expect("poller");
    drop(load);
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
    let rps = rate_between(&s, attached, until);
    let before = rate_between(&s, from - 0.75, from);
    if std::env::var_os("TOFFLOAD_BENCH_TIMELINE").is_some() {
        // Quarter-second rates relative to the watcher's start, to see where a dip is.
        let q: Vec<String> = s
            .windows(2)
            .filter(|w| w[0].0 >= from - 0.5)
            .map(|w| {
                format!(
                    "{:+.2}:{:.0}k",
                    w[0].0 - from,
                    (w[1].1 - w[0].1) as f64 / (w[1].0 - w[0].0) / 1e3
                )
            })
            .collect();
        eprintln!(
            "timeline {} {}: {}",
            kind.name(),
            if watched { "watched" } else { "unwatched" },
            q.join(" ")
        );
    }
    Run {
        rps,
        worst_quarter: worst_quarter(&s, from, end),
        before,
        start_quarters: quarters(&s, from, START_QUARTERS, before),
        exit_quarters: quarters(&s, until - 0.25, EXIT_QUARTERS, before),
        start_secs: attached - from,
        cpu_us_per_req: (c1 - c0) * 1e6 / (rps * (until - attached)).max(1.0),
        server_busy: (c1 - c0) / (until - attached).max(1e-3),
        load_busy: (l1 - l0) / (until - attached).max(1e-3),
        watcher_busy: watcher_secs / (until - attached).max(1e-3),
    }
}
