//! `cargo xtask bench ...`: each benchmark prints its table and writes it under
//! tests/results/ so that the numbers the README quotes are in the repository, and
//! those with a chart draw it beside the table (chart/).

use crate::chart::{self, Bench};
use crate::paths;
use crate::proc::{self, Result};
use clap::Subcommand;
use std::process::Command;

#[derive(Subcommand)]
pub enum Which {
    /// The emulated device: configured vs measured latency, lanes, host CPU per op.
    Device {
        /// Extra arguments for the benchmark binary (see its --help).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// The conflict guard: enforce vs a coarse lock, detect's overhead, fault costs;
    /// then the Redis module's ACCEL.INCR and the nginx, Python and Go integrations'
    /// /incr through the guard's C API (the same file).
    Guard {
        /// Extra arguments for toffload-guard-bench (see its --help).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// The fiber runtime: the demo table (stock vs libtoffload.so, median of runs), the
    /// fiber park + resume cost, the idle CPU of a preloaded server, and the servers
    /// whose wait has no due time (hsm_server, gpu_server), with targets.
    Runtime {
        /// Extra arguments for toffload-table (e.g. `-- --runs 5`; see its --help).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// The model: predicted vs measured zero-edit speedup over a sweep (needs root).
    Model {
        /// Extra arguments for toffload-model-bench (--runs N, --secs S, --points N).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// toffload-watch's overhead: watched vs unwatched server throughput (needs root).
    Watch {
        /// Extra arguments for the benchmark binary (--runs N, --secs S).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// `toffload-watch serve` soaked over three loaded servers: its RSS and CPU share
    /// every few seconds (needs root) -> serve.md.
    Serve {
        /// How long, minutes (the full soak is 30).
        #[arg(long, default_value_t = 30.0)]
        minutes: f64,
        /// Extra arguments for the soak (--every SECS).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// The demo told 5 times: before/after rates beside the load generator's own
    /// count, the prediction and its error (needs root) -> demo.md.
    Demo {
        /// Extra arguments for toffload-demo (e.g. `-- --runs 3`; see its --help).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Latency under offered load: conn_server stock (block, spin) and under the
    /// runtime, open-loop Poisson load swept up to each knee -> openloop.md, .csv.
    Openloop {
        /// A shorter sweep (one 0.4 s run per point, 2 fine steps) for a first look.
        #[arg(long)]
        quick: bool,
        /// Extra arguments for toffload-openloop (e.g. `-- --runs 3`; see its --help).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// The remote backend over namespaced, shaped links (needs root) -> remote.md.
    Remote {
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Remote CUDA's remoting efficiency: conn_server on the cuda backend direct vs
    /// through the client library, over loopback and delayed links, batching and the
    /// upload cache on/off, stock and under the runtime (needs root) ->
    /// remote-cuda-bench.md.
    RemoteCuda {
        /// Extra arguments (--runs N, --real-driver on a GPU machine).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// The Redis reroute: ACCEL.SYNC vs ACCEL.ASYNC under redis-benchmark -> reroute.md.
    Reroute {
        /// `-- --rounds N`: redis-benchmark runs per form and latency (default 3).
        #[arg(last = true)]
        args: Vec<String>,
    },
}

/// Draws the chart after a run, also after one that failed its targets (the table
/// was written); the run's own failure comes first.
fn charted(b: Bench, run: Result) -> Result {
    let drawn = chart::draw(b);
    run.and(drawn)
}

pub fn run(which: Which) -> Result {
    match which {
        Which::Device { args } => {
            crate::setup::system_packages()?;
            let out = paths::results().join("device.md");
            let run = proc::run(
                proc::cargo()
                    .args(["bench", "-p", "toffload-accel", "--bench", "device", "--"])
                    .arg("--out")
                    .arg(&out)
                    .args(&args),
            );
            charted(Bench::Device, run)
        }
        Which::Guard { args } => {
            let dist = crate::build::all()?;
            let out = paths::results().join("guard.md");
            let run = proc::run(
                Command::new(dist.bin.join("toffload-guard-bench"))
                    .arg("--out")
                    .arg(&out)
                    .args(&args)
                    .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist")),
            )
            // Then the Redis module's section (the guard's C API on the rerouted path),
            // which the test appends to the file just written.
            .and_then(|()| {
                proc::run(
                    proc::cargo()
                        .args(["test", "--release", "-p", "toffload-tests"])
                        .args(["--test", "reroute_redis", "--"])
                        .args(["--exact", "guard_redis_benchmark", "--nocapture"])
                        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"))
                        .env("TOFFLOAD_GUARD_REDIS_OUT", &out)
                        .env("TOFFLOAD_GUARD_REDIS_ROUNDS", "3"),
                )
            })
            // Then the HTTP integrations' sections (nginx, Python, Go), each replacing
            // its own heading's section.
            .and_then(|()| {
                ["reroute_nginx", "reroute_python", "reroute_go"]
                    .iter()
                    .try_for_each(|suite| {
                        proc::run(
                            proc::cargo()
                                .args(["test", "--release", "-p", "toffload-tests"])
                                .args(["--test", suite, "--"])
                                .args(["--exact", "guard_benchmark", "--nocapture"])
                                .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"))
                                .env("TOFFLOAD_GUARD_OUT", &out)
                                .env("TOFFLOAD_GUARD_ROUNDS", "3"),
                        )
                    })
            });
            charted(Bench::Guard, run)
        }
        Which::Runtime { args } => {
            let dist = crate::build::all()?;
            let out = paths::results().join("runtime.md");
            // Defaults first: a later flag in `args` overrides (clap keeps the last).
            charted(
                Bench::Runtime,
                proc::run(
                    Command::new(dist.bin.join("toffload-table"))
                        .args([
                            "--runs",
                            "5",
                            "--secs",
                            "1.5",
                            "--switch",
                            "--idle",
                            "--syscalls",
                            "--handoff",
                            "--placement",
                            "20,200",
                            "--vendor",
                            "1000",
                        ])
                        .arg("--out")
                        .arg(&out)
                        .args(&args)
                        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist")),
                ),
            )
        }
        Which::Model { args } => {
            let dist = crate::build::all()?;
            charted(
                Bench::Model,
                proc::run(
                    Command::new(dist.bin.join("toffload-model-bench"))
                        .arg("--out")
                        .arg(paths::results().join("model.md"))
                        .args(&args)
                        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist")),
                ),
            )
        }
        Which::Watch { args } => {
            let dist = crate::build::all()?;
            let out = paths::results().join("watch.md");
            charted(
                Bench::Watch,
                proc::run(
                    proc::cargo()
                        .args(["bench", "-p", "toffload-watch", "--bench", "watch", "--"])
                        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"))
                        .arg("--out")
                        .arg(&out)
                        .args(&args),
                ),
            )
        }
        Which::Serve { minutes, args } => {
            let dist = crate::build::all()?;
            charted(
                Bench::Serve,
                proc::run(
                    proc::cargo()
                        .args(["bench", "-p", "toffload-watch", "--bench", "serve", "--"])
                        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"))
                        .arg("--minutes")
                        .arg(minutes.to_string())
                        .arg("--out")
                        .arg(paths::results().join("serve.md"))
                        .args(&args),
                ),
            )
        }
        Which::Demo { args } => {
            let dist = crate::build::all()?;
            // Defaults first: a later flag in `args` overrides (clap keeps the last).
            let run = proc::run(
                Command::new(dist.bin.join("toffload-demo"))
                    .args(["--runs", "5"])
                    .arg("--out")
                    .arg(paths::results().join("demo.md"))
                    .args(&args)
                    .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist")),
            );
            charted(Bench::Demo, run)
        }
        Which::Openloop { quick, args } => {
            let dist = crate::build::all()?;
            let mut cmd = Command::new(dist.bin.join("toffload-openloop"));
            if quick {
                cmd.args([
                    "--runs",
                    "1",
                    "--secs",
                    "0.4",
                    "--min-samples",
                    "600",
                    "--fine",
                    "2",
                ]);
            }
            // A later flag in `args` overrides (clap keeps the last).
            charted(
                Bench::Openloop,
                proc::run(
                    cmd.arg("--out")
                        .arg(paths::results().join("openloop.md"))
                        .arg("--csv")
                        .arg(paths::results().join("openloop.csv"))
                        .args(&args)
                        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist")),
                ),
            )
        }
        Which::Remote { args } => charted(Bench::Remote, crate::bench_remote::run(args)),
        Which::RemoteCuda { args } => {
            charted(Bench::RemoteCuda, crate::bench_remote_cuda::run(args))
        }
        Which::Reroute { args } => crate::bench_reroute::run(args),
    }
}
