//! The demo (`cargo xtask demo`): the bundled conn_server on the emulated device under
//! load, server and load generator pinned to different cores, for a sweep of offload
//! latencies and both wait styles. Until the fiber runtime lands, this is the stock
//! baseline: what the wait costs a thread-per-connection server, next to the ceiling
//! that overlapping the wait could reach.

use clap::Parser;
use std::time::Duration;
use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::load::{self, Config};

#[derive(Parser)]
#[command(
    name = "toffload-demo",
    about = "conn_server on the emulated device, measured"
)]
struct Args {
    /// Offload latencies to sweep, microseconds.
    #[arg(long, value_delimiter = ',', default_value = "20,50,100,200,500,1000")]
    latencies: Vec<u32>,
    /// Client connections.
    #[arg(long, default_value_t = 64)]
    conns: usize,
    /// Request size, bytes.
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Measured seconds per point.
    #[arg(long, default_value_t = 2.0)]
    secs: f64,
    /// Write the table to this file as well.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

struct Row {
    lat: u32,
    wait: &'static str,
    lanes: usize,
    rps: f64,
    p50: f64,
    p99: f64,
    wrong: u64,
    errors: u64,
}

fn point(a: &Args, lat: u32, wait: &'static str, lanes: usize) -> Result<Row, String> {
    let two_cores = harness::cpus() >= 2;
    let spec = ServerSpec::new("conn_server")
        .arg("--size")
        .arg(a.size.to_string())
        .env("TOFFLOAD_EMU_LAT_US", lat.to_string())
        .env("TOFFLOAD_EMU_LANES", lanes.to_string())
        .env("TOFFLOAD_WAIT", wait)
        .cpu(two_cores.then_some(0));
    let server = Server::start(&spec)?;
    let mut cfg = Config::new(server.port);
    cfg.conns = a.conns;
    cfg.size = a.size;
    cfg.duration = Duration::from_secs_f64(a.secs);
    cfg.warmup = Duration::from_millis(500);
    let r = load::run(&cfg).map_err(|e| e.to_string())?;
    Ok(Row {
        lat,
        wait,
        lanes,
        rps: r.requests_per_sec,
        p50: r.p50_us,
        p99: r.p99_us,
        wrong: r.wrong,
        errors: r.errors,
    })
}

fn main() {
    let a = Args::parse();
    if harness::cpus() >= 2 {
        // The load generator on core 1, the server on core 0.
        if let Err(e) = harness::pin_current_thread(1) {
            eprintln!("toffload-demo: cannot pin the load generator: {e}");
        }
    } else {
        eprintln!("toffload-demo: one CPU only: server and load generator share it");
    }
    let mut rows = Vec::new();
    let plan: Vec<(u32, &'static str, usize)> = a
        .latencies
        .iter()
        .flat_map(|&l| [(l, "spin", a.conns.max(64)), (l, "block", a.conns.max(64))])
        .chain(a.latencies.iter().map(|&l| (l, "block", 4)))
        .collect();
    for (lat, wait, lanes) in plan {
        eprint!("  {lat} us, wait={wait}, lanes={lanes} ... ");
        match point(&a, lat, wait, lanes) {
            Ok(r) => {
                eprintln!("{:.0} req/s", r.rps);
                rows.push(r);
            }
            Err(e) => {
                eprintln!("failed");
                eprintln!("toffload-demo: {e}");
                std::process::exit(1);
            }
        }
    }
    let mut t = format!(
        "conn_server, stock (no runtime yet), {} connections, {} B requests, {:.1} s per point\n\n",
        a.conns, a.size, a.secs
    );
    t.push_str("| offload us | wait | lanes | stock req/s | p50 us | p99 us | overlap ceiling req/s | wrong | errors |\n");
    t.push_str("|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in &rows {
        // What overlapping every wait could reach: min(conns, lanes) ops per latency.
        let ceiling = a.conns.min(r.lanes) as f64 / (r.lat as f64 * 1e-6);
        t.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} |\n",
            r.lat, r.wait, r.lanes, r.rps, r.p50, r.p99, ceiling, r.wrong, r.errors
        ));
    }
    println!("{t}");
    if let Some(out) = &a.out {
        if let Err(e) = std::fs::write(out, &t) {
            eprintln!("toffload-demo: writing {}: {e}", out.display());
            std::process::exit(1);
        }
    }
    if rows.iter().any(|r| r.wrong > 0 || r.errors > 0) {
        eprintln!("toffload-demo: wrong answers or errors (see table)");
        std::process::exit(1);
    }
}
