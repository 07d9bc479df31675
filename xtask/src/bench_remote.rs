//! `cargo xtask bench remote`: the remote backend's benchmark (backends/benches/remote.rs)
//! -> tests/results/remote.md. Needs root (it makes network namespaces) and iproute2.

use crate::paths;
use crate::proc::{self, Result};

pub fn run(args: Vec<String>) -> Result {
    // The benchmark itself refuses, with the reason, without root or iproute2.
    let out = paths::results().join("remote.md");
    // Defaults first: a later flag in `args` overrides.
    proc::run(
        proc::cargo()
            .args(["bench", "-p", "toffload-accel", "--bench", "remote", "--"])
            .args(["--runs", "3"])
            .arg("--out")
            .arg(&out)
            .args(&args),
    )
}
