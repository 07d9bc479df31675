//! `cargo xtask bench remote`: the remote backend's benchmark (backends/benches/remote.rs)
//! -> tests/results/remote.md. Needs root (it makes network namespaces) and iproute2,
//! and the dist folder (conn_server, libtoffload.so) for the demo row, built first.
//! `cargo xtask bench remote -- --only conn-server` measures the demo row alone.

use crate::paths;
use crate::proc::{self, Result};

pub fn run(args: Vec<String>) -> Result {
    // The benchmark itself refuses, with the reason, without root or iproute2.
    let dist = crate::build::all()?;
    let out = paths::results().join("remote.md");
    // Defaults first: a later flag in `args` overrides.
    proc::run(
        proc::cargo()
            .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"))
            .args(["bench", "-p", "toffload-accel", "--bench", "remote", "--"])
            .args(["--runs", "3"])
            .arg("--out")
            .arg(&out)
            .args(&args),
    )
}
