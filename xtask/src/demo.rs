//! `cargo xtask demo`: build, then run the story (tests/src/bin/toffload-demo.rs:
//! watch, predict, inject, measure) from the dist folder; `--table` runs the stock vs
//! runtime table instead (tests/src/bin/toffload-table.rs). Both live with the harness
//! they drive.

use crate::proc::{self, Result};
use std::process::Command;

#[derive(clap::Args)]
pub struct Args {
    /// The stock vs runtime table over a latency sweep instead of the story.
    #[arg(long)]
    table: bool,
    /// Arguments for toffload-demo, or with --table toffload-table (`-- --help`).
    #[arg(last = true)]
    args: Vec<String>,
}

pub fn run(a: &Args) -> Result {
    let dist = crate::build::all()?;
    proc::run(
        Command::new(dist.bin.join(if a.table {
            "toffload-table"
        } else {
            "toffload-demo"
        }))
        .args(&a.args)
        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist")),
    )
}
