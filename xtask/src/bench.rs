//! `cargo xtask bench ...`: each benchmark prints its table and writes it under
//! tests/results/ so that the numbers the README quotes are in the repository.

use crate::paths;
use crate::proc::{self, Result};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum Which {
    /// The emulated device: configured vs measured latency, lanes, host CPU per op.
    Device {
        /// Extra arguments for the benchmark binary (see its --help).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// toffload-watch's overhead: watched vs unwatched server throughput (needs root).
    Watch {
        /// Extra arguments for the benchmark binary (--runs N, --secs S).
        #[arg(last = true)]
        args: Vec<String>,
    },
}

pub fn run(which: Which) -> Result {
    match which {
        Which::Device { args } => {
            crate::setup::system_packages()?;
            let out = paths::results().join("device.md");
            proc::run(
                proc::cargo()
                    .args(["bench", "-p", "toffload-accel", "--bench", "device", "--"])
                    .arg("--out")
                    .arg(&out)
                    .args(&args),
            )
        }
        Which::Watch { args } => {
            let dist = crate::build::all()?;
            let out = paths::results().join("watch.md");
            proc::run(
                proc::cargo()
                    .args(["bench", "-p", "toffload-watch", "--bench", "watch", "--"])
                    .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"))
                    .arg("--out")
                    .arg(&out)
                    .args(&args),
            )
        }
    }
}
