//! conn_server (tests/servers, the demo's unmodified thread-per-connection server)
//! with TOFFLOAD_BACKEND=remote against a toffload-remoted across a shaped link, stock
//! and under the fiber runtime (LD_PRELOAD=libtoffload.so), measured by the load
//! generator; the same with the local emulated device as the reference. Server pinned
//! to core 0, load generator to core 1, as in the demo. Binaries come from the dist
//! folder (`cargo xtask build`).

use super::netns::{daemon_on, in_ns, DelayLine, Net, Shape};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use toffload_accel::{Accelerator, WaitStyle};
use toffload_tests::harness::{self, ServerSpec};
use toffload_tests::load::{self, Config};
use toffload_tests::preload::RtServer;

/// The link of the demo row: 1 Gbit/s, 0.25 ms each way (0.5 ms round trip).
pub const LINK: Shape = Shape {
    mbit: 1000,
    delay_us: 250,
    jitter_us: 0,
};
/// The daemon's device: 20 us per op, 64 lanes (the link is the latency).
pub const DAEMON_LAT_US: u32 = 20;

/// What the runs need from dist, or why they cannot run.
pub fn dist_ready() -> Result<PathBuf, String> {
    harness::bin("conn_server")?;
    let lib = harness::dist().join("lib/libtoffload.so");
    if lib.exists() {
        Ok(lib)
    } else {
        Err(format!(
            "{} is missing: run `cargo xtask build`",
            lib.display()
        ))
    }
}

/// A daemon on the far side of a shaped link, the client namespace to run in, and
/// the address the client dials.
pub struct RemoteSide {
    pub net: Net,
    _daemon: (super::Daemon, Option<DelayLine>),
    pub addr: String,
    pub how: &'static str,
}

pub fn remote_side(tag: &str) -> Result<RemoteSide, String> {
    let net = Net::new(tag, &[LINK])?;
    let lat = DAEMON_LAT_US.to_string();
    let (d, dl, addr) = daemon_on(
        &net.links[0],
        &[],
        &[("TOFFLOAD_EMU_LAT_US", &lat), ("TOFFLOAD_EMU_LANES", "64")],
    );
    let how = net.links[0].how;
    Ok(RemoteSide {
        net,
        _daemon: (d, dl),
        addr,
        how,
    })
}

impl RemoteSide {
    /// The remote op's round trip as one caller sees it (median of `n` serial
    /// accel_run calls of `size` bytes from the client namespace), microseconds.
    pub fn serial_round_trip_us(&self, size: usize, n: usize) -> f64 {
        let addr = self.addr.clone();
        in_ns(&self.net.client_ns, move || {
            let r = super::client(&[addr], |c| c.deadline_ms = 10_000);
            let mut v = Vec::with_capacity(n);
            let mut b = super::pattern(0, size);
            r.run(&mut b, WaitStyle::Block).expect("first op");
            for i in 0..n {
                let mut b = super::pattern(i as u64, size);
                let t = Instant::now();
                r.run(&mut b, WaitStyle::Block).expect("serial op");
                v.push(t.elapsed().as_secs_f64() * 1e6);
                assert!(b == super::aes(super::pattern(i as u64, size)));
            }
            harness::median(v)
        })
    }

    /// The server's environment for this daemon.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("TOFFLOAD_BACKEND".into(), "remote".into()),
            ("TOFFLOAD_REMOTE".into(), self.addr.clone()),
        ]
    }
}

/// One measured run.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub rps: f64,
    pub p50_us: f64,
    pub wrong: u64,
    pub errors: u64,
    /// Under the runtime: fibers it created (0 = it did not engage).
    pub fibers: Option<u64>,
}

/// How each run is loaded.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    pub conns: usize,
    pub size: usize,
    pub secs: f64,
    pub warmup: f64,
}

pub const DEMO_LOAD: Load = Load {
    conns: 64,
    size: 1024,
    secs: 1.5,
    warmup: 0.4,
};

/// Runs `f` on a thread pinned to `cpu` (where there are 2 cpus), inside `ns` if any.
fn pinned<T: Send + 'static>(
    ns: Option<&str>,
    cpu: usize,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let g = move || {
        if harness::cpus() >= 2 {
            harness::pin_current_thread(cpu).expect("pinning");
        }
        f()
    };
    match ns {
        Some(ns) => in_ns(ns, g),
        None => std::thread::spawn(g).join().expect("pinned thread"),
    }
}

/// conn_server with `env` (plus TOFFLOAD_WAIT=`wait`), stock or under the runtime,
/// started in `ns` (its children inherit the namespace and the core of the thread
/// that starts them), loaded for `l.secs` after `l.warmup`.
pub fn run(
    ns: Option<&str>,
    env: &[(String, String)],
    wait: &str,
    runtime: Option<&std::path::Path>,
    l: Load,
) -> Result<Sample, String> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let stats = std::env::temp_dir().join(format!(
        "toffload_rcs_{}_{}.json",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&stats);
    let mut spec = ServerSpec::new("conn_server")
        .arg("--size")
        .arg(l.size.to_string())
        .env("TOFFLOAD_WAIT", wait);
    for (k, v) in env {
        spec = spec.env(k, v.clone());
    }
    if let Some(lib) = runtime {
        spec = spec
            .env("LD_PRELOAD", lib.display().to_string())
            .env("TOFFLOAD_STATS", stats.display().to_string());
    }
    let mut server = pinned(ns, 0, move || RtServer::start(&spec))?;
    let mut cfg = Config::new(server.port);
    cfg.conns = l.conns;
    cfg.size = l.size;
    cfg.duration = Duration::from_secs_f64(l.secs);
    cfg.warmup = Duration::from_secs_f64(l.warmup);
    let r = pinned(ns, 1, move || load::run(&cfg)).map_err(|e| format!("load: {e:?}"))?;
    if !server.alive() {
        return Err(format!(
            "conn_server died under load: {}",
            server.describe()
        ));
    }
    let fibers = if runtime.is_some() {
        // The runtime rewrites its stats file at most every 50 ms.
        std::thread::sleep(Duration::from_millis(150));
        let v = toffload_tests::preload::stats(&stats);
        let _ = std::fs::remove_file(&stats);
        Some(
            v.and_then(|v| v.get("fibers_created").and_then(|x| x.as_u64()))
                .unwrap_or(0),
        )
    } else {
        None
    };
    drop(server);
    Ok(Sample {
        rps: r.requests_per_sec,
        p50_us: r.p50_us,
        wrong: r.wrong,
        errors: r.errors,
        fibers,
    })
}

/// Stock and runtime medians of `runs` runs each (alternating, so that a noisy
/// neighbour hits both), plus the total wrong answers and errors and the fewest
/// fibers any runtime run made.
#[derive(Clone, Copy, Debug)]
pub struct Pair {
    pub stock: f64,
    pub runtime: f64,
    pub stock_p50_us: f64,
    pub runtime_p50_us: f64,
    pub wrong: u64,
    pub errors: u64,
    pub min_fibers: u64,
}

impl Pair {
    pub fn speedup(&self) -> f64 {
        self.runtime / self.stock
    }
}

pub fn pair(
    ns: Option<&str>,
    env: &[(String, String)],
    wait: &str,
    lib: &std::path::Path,
    l: Load,
    runs: usize,
) -> Result<Pair, String> {
    let (mut s, mut r) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        s.push(run(ns, env, wait, None, l)?);
        r.push(run(ns, env, wait, Some(lib), l)?);
    }
    let med = |v: &[Sample], f: fn(&Sample) -> f64| harness::median(v.iter().map(f).collect());
    Ok(Pair {
        stock: med(&s, |x| x.rps),
        runtime: med(&r, |x| x.rps),
        stock_p50_us: med(&s, |x| x.p50_us),
        runtime_p50_us: med(&r, |x| x.p50_us),
        wrong: s.iter().chain(&r).map(|x| x.wrong).sum(),
        errors: s.iter().chain(&r).map(|x| x.errors).sum(),
        min_fibers: r.iter().filter_map(|x| x.fibers).min().unwrap_or(0),
    })
}

/// The local emulated device at `lat_us` (the reference row's environment).
pub fn local_env(lat_us: u32) -> Vec<(String, String)> {
    vec![
        ("TOFFLOAD_BACKEND".into(), "emulated".into()),
        ("TOFFLOAD_EMU_LAT_US".into(), lat_us.to_string()),
        ("TOFFLOAD_EMU_LANES".into(), "64".into()),
    ]
}
