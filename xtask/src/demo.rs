//! `cargo xtask demo`: build, then run the story (tests/src/bin/toffload-demo.rs:
//! watch, predict, inject, measure) from the dist folder; `--table` runs the stock vs
//! runtime table instead (tests/src/bin/toffload-table.rs). Both live with the harness
//! they drive. The story attaches eBPF probes: it runs as root, through sudo when we
//! are not, after building as the user (sudo would not find a per-user rustup cargo).

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
    let mut cmd = Command::new(dist.bin.join(if a.table {
        "toffload-table"
    } else {
        "toffload-demo"
    }));
    cmd.args(&a.args)
        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"));
    if needs_root(a) {
        cmd = proc::as_root(&cmd)?;
    }
    proc::run(&mut cmd)
}

/// The story always (BPF); the table only to count syscalls (perf), and neither just
/// to print its help or version.
fn needs_root(a: &Args) -> bool {
    let has = |f: &str| a.args.iter().any(|x| x == f);
    if ["--help", "-h", "--version", "-V"].iter().any(|f| has(f)) {
        return false;
    }
    !a.table || has("--syscalls")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(table: bool, a: &[&str]) -> Args {
        Args {
            table,
            args: a.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn root_for_the_story_and_the_syscall_count_only() {
        assert!(needs_root(&args(false, &[])));
        assert!(needs_root(&args(false, &["--tui"])));
        assert!(!needs_root(&args(false, &["--help"])));
        assert!(!needs_root(&args(true, &[])));
        assert!(needs_root(&args(true, &["--syscalls"])));
        assert!(!needs_root(&args(true, &["--syscalls", "--help"])));
    }
}
