//! `toffload-watch serve`: the watcher as a long-running service. Targets named in a
//! TOML file or by flags (unit, cgroup, process name, pid) are each watched on a
//! thread of their own (follow.rs) and followed across restarts; the last completed
//! window of each is served as Prometheus metrics on /metrics and as JSON on /status
//! (http.rs), loopback only unless told otherwise. SIGINT or SIGTERM ends it.

pub mod config;
pub mod exposition;
pub mod follow;
pub mod http;
pub mod state;
pub mod status;
pub mod targets;

pub use config::Args;

use crate::error::WatchError;
use crate::session::{Calibration, Options};
use state::Shared;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the threads have to finish once the service stops: a session ends at its
/// next poll (20 ms), but one may be in the middle of loading its programs.
const STOP_DEADLINE: Duration = Duration::from_secs(5);

/// What the HTTP server serves.
struct Pages {
    shared: Shared,
    cfg: config::Config,
}

impl http::Site for Pages {
    fn page(&self, path: &str) -> Option<(&'static str, String)> {
        match path {
            "/metrics" => Some((
                exposition::CONTENT_TYPE,
                exposition::render(&self.shared.snapshot(), exposition::Own::read()),
            )),
            "/status" => Some((
                "application/json",
                status::render(
                    &self.shared.snapshot(),
                    self.cfg.listen,
                    self.cfg.interval,
                    self.cfg.overhead_budget,
                ),
            )),
            _ => None,
        }
    }
}

/// The calibration child's priority: as a plain watch runs it (main.rs), its loops
/// raised 10 above ours, so that the switch cost it measures is not inflated by a
/// busy host.
fn calibration_nice() -> i32 {
    // SAFETY: getpriority on the calling process; errno cleared first since -1 is a
    // valid priority.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, 0);
        if *libc::__errno_location() != 0 {
            0
        } else {
            n
        }
    };
    (nice - 10).clamp(-20, 19)
}

fn runtime() -> Result<tokio::runtime::Runtime, WatchError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| WatchError::Other(format!("cannot start a runtime: {e}")))
}

/// Runs the service until SIGINT or SIGTERM.
pub fn run(args: &Args) -> Result<(), WatchError> {
    let cfg = config::load(args)?;
    crate::loader::check_privileges()?;
    // Bound before anything is attached: a port in use is an error at start.
    let listener = std::net::TcpListener::bind(cfg.listen)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| WatchError::Other(format!("cannot listen on {}: {e}", cfg.listen)))?;
    let listen = listener.local_addr().unwrap_or(cfg.listen);
    let rt = runtime()?;
    // Installed before the threads start, so that a signal at any point after this
    // ends the service cleanly.
    let (mut sigint, mut sigterm) = rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let s = |k| {
            signal(k).map_err(|e| WatchError::Other(format!("installing a signal handler: {e}")))
        };
        Ok::<_, WatchError>((s(SignalKind::interrupt())?, s(SignalKind::terminate())?))
    })?;
    let calib = Arc::new(Calibration::measure(calibration_nice(), &[], false));
    let shared = Shared::new(&cfg.targets);
    let stop = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let site: Arc<dyn http::Site> = Arc::new(Pages {
        shared: shared.clone(),
        cfg: cfg.clone(),
    });
    let mut threads = Vec::new();
    let http_rt = runtime()?;
    threads.push(
        std::thread::Builder::new()
            .name("serve-http".into())
            .spawn(move || {
                http_rt.block_on(async move {
                    match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => http::serve(l, site, stop_rx).await,
                        Err(e) => eprintln!("toffload-watch: serving HTTP: {e}"),
                    }
                })
            })
            .map_err(|e| WatchError::Other(format!("starting the HTTP thread: {e}")))?,
    );
    eprintln!("toffload-watch: serving http://{listen}/metrics and /status");
    let opts = Options {
        interval: cfg.interval,
        duration: None,
        windows: None,
        json: false,
        timestamp: false,
        sample: 1.0,
        overhead_budget: Some(cfg.overhead_budget),
        inject: None,
        interactive_inject: crate::inject::Options::default(),
        offloads: Vec::new(),
    };
    for (index, target) in cfg.targets.iter().enumerate() {
        let f = follow::Follow {
            index,
            target: target.clone(),
            shared: shared.clone(),
            opts: opts.clone(),
            calib: calib.clone(),
            stop: stop.clone(),
        };
        let t = std::thread::Builder::new()
            .name(format!("watch-{index}"))
            .spawn(move || f.run())
            .map_err(|e| WatchError::Other(format!("starting a watch thread: {e}")))?;
        threads.push(t);
    }
    let why = rt.block_on(async {
        tokio::select! {
            _ = sigint.recv() => "interrupted",
            _ = sigterm.recv() => "terminated",
        }
    });
    eprintln!("toffload-watch: {why}; stopping");
    stop.store(true, Ordering::Relaxed);
    let _ = stop_tx.send(true);
    let until = Instant::now() + STOP_DEADLINE;
    while threads.iter().any(|t| !t.is_finished()) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    if threads.iter().any(|t| !t.is_finished()) {
        eprintln!("toffload-watch: a thread did not stop within {STOP_DEADLINE:?}; exiting anyway");
    }
    Ok(())
}
