//! The blocked-carrier handoff under load: rawfutex_server --hold-lock holds a raw-futex
//! lock (below libc, where the runtime cannot park) across each offload, so under the
//! runtime every wait on that lock strands its carrier until the handoff moves the
//! carrier's other fibers to a spare. Stock and under the runtime, with the runtime's
//! handoffs per second (TOFFLOAD_STATS).

use super::{read_stats, runtime_lib, stats_path, Args};
use std::time::Duration;
use toffload_tests::harness::{self, median, Server, ServerSpec};
use toffload_tests::load::{self, Config};

/// Connections and offload latency of the case (the handoff suite's).
pub const CONNS: usize = 8;
pub const LAT_US: u32 = 200;

pub struct HandoffRow {
    pub what: &'static str,
    pub rps: f64,
    pub p99: f64,
    /// Median over the runs (None: stock, no runtime).
    pub handoffs_per_s: Option<f64>,
    pub wrong: u64,
    pub errors: u64,
}

/// The configurations: stock, the runtime with the default threshold, and with a
/// threshold of one offload (what a server known to wait below libc would be given).
#[derive(Clone, Copy)]
enum Mode {
    Stock,
    /// Under the runtime; the handoff threshold if not the default.
    Runtime(Option<u32>),
}

const MODES: [(&str, Mode); 3] = [
    ("stock", Mode::Stock),
    (
        "runtime (1 carrier), default TOFFLOAD_HANDOFF_US",
        Mode::Runtime(None),
    ),
    (
        "runtime (1 carrier), TOFFLOAD_HANDOFF_US=200",
        Mode::Runtime(Some(200)),
    ),
];

/// One run of one mode.
struct Run {
    rps: f64,
    p99: f64,
    handoffs_per_s: Option<f64>,
    wrong: u64,
    errors: u64,
}

fn spec(
    runtime: Option<(&std::path::Path, &std::path::Path)>,
    handoff_us: Option<u32>,
) -> ServerSpec {
    let mut s = ServerSpec::new("rawfutex_server")
        .arg("--hold-lock")
        .env("TOFFLOAD_EMU_LAT_US", LAT_US.to_string())
        .env("TOFFLOAD_WAIT", "block")
        .cpu((harness::cpus() >= 2).then_some(0));
    if let Some((lib, stats)) = runtime {
        s = s
            .env("LD_PRELOAD", lib.display().to_string())
            .env("TOFFLOAD_CARRIERS", "1")
            .env("TOFFLOAD_STATS", stats.display().to_string());
        if let Some(us) = handoff_us {
            s = s.env("TOFFLOAD_HANDOFF_US", us.to_string());
        }
    }
    s
}

fn run_once(a: &Args, mode: Mode) -> Result<Run, String> {
    let (runtime, handoff_us) = match mode {
        Mode::Stock => (false, None),
        Mode::Runtime(us) => (true, us),
    };
    let lib = if runtime { Some(runtime_lib()?) } else { None };
    let stats = stats_path("handoff");
    let mut server = Server::start(&spec(
        lib.as_deref().map(|l| (l, stats.as_path())),
        handoff_us,
    ))?;
    let mut cfg = Config::new(server.port);
    cfg.conns = CONNS;
    cfg.size = a.size;
    cfg.duration = Duration::from_secs_f64(a.secs);
    cfg.warmup = Duration::from_secs_f64(a.warmup);
    cfg.timeout = Duration::from_secs(2);
    let r = load::run(&cfg).map_err(|e| e.to_string())?;
    if !server.alive() {
        return Err(format!(
            "rawfutex_server --hold-lock died: {:?}",
            server.terminate()
        ));
    }
    let per_s = if runtime {
        std::thread::sleep(Duration::from_millis(120));
        let s = read_stats(&stats);
        let _ = std::fs::remove_file(&stats);
        // The server does nothing before or after the load, so its handoffs all fall in
        // the warm-up and measured seconds.
        Some(s?.handoffs as f64 / (a.warmup + a.secs))
    } else {
        None
    };
    Ok(Run {
        rps: r.requests_per_sec,
        p99: r.p99_us,
        handoffs_per_s: per_s,
        wrong: r.wrong,
        errors: r.errors,
    })
}

/// The modes' runs interleaved, `a.runs` each; medians.
pub fn measure(a: &Args) -> Result<Vec<HandoffRow>, String> {
    let mut runs: [Vec<Run>; 3] = Default::default();
    for _ in 0..a.runs {
        for (i, (_, mode)) in MODES.into_iter().enumerate() {
            let r = run_once(a, mode)?;
            eprint!(" {:.0}", r.rps);
            runs[i].push(r);
        }
    }
    eprintln!();
    Ok(MODES
        .into_iter()
        .zip(runs)
        .map(|((what, _), v)| HandoffRow {
            what,
            rps: median(v.iter().map(|x| x.rps).collect()),
            p99: median(v.iter().map(|x| x.p99).collect()),
            handoffs_per_s: {
                let h: Vec<f64> = v.iter().filter_map(|x| x.handoffs_per_s).collect();
                (!h.is_empty()).then(|| median(h))
            },
            wrong: v.iter().map(|x| x.wrong).sum(),
            errors: v.iter().map(|x| x.errors).sum(),
        })
        .collect())
}
