//! `cargo xtask demo`: build, then run the demo binary (tests/src/bin/toffload-demo.rs)
//! from the dist folder; the demo itself lives with the harness it drives.

use crate::proc::{self, Result};
use std::process::Command;

#[derive(clap::Args)]
pub struct Args {
    /// Arguments for toffload-demo (see `cargo xtask demo -- --help`).
    #[arg(last = true)]
    args: Vec<String>,
}

pub fn run(a: &Args) -> Result {
    let dist = crate::build::all()?;
    proc::run(
        Command::new(dist.bin.join("toffload-demo"))
            .args(&a.args)
            .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist")),
    )
}
