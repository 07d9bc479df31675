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
    }
}
