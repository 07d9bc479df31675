//! `cargo xtask demo`: build, then run the story (tests/src/bin/toffload-story.rs:
//! watch, predict, inject, measure) from the dist folder; `--table` runs the stock vs
//! runtime table instead (tests/src/bin/toffload-demo.rs). Both live with the harness
//! they drive.

use crate::proc::{self, Result};
use std::process::Command;

#[derive(clap::Args)]
pub struct Args {
    /// The stock vs runtime table over a latency sweep instead of the story.
    #[arg(long)]
    table: bool,
    /// Arguments for toffload-story, or with --table toffload-demo (`-- --help`).
    #[arg(last = true)]
    args: Vec<String>,
}

pub fn run(a: &Args) -> Result {
    let dist = crate::build::all()?;
    proc::run(
        Command::new(dist.bin.join(if a.table {
            "toffload-demo"
        } else {
            "toffload-story"
        }))
        .args(&a.args)
        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist")),
    )
}
