//! `cargo xtask test`: build everything, then run every test of the workspace against
//! the freshly built dist folder. Under CI (CI=true) tests that would skip for want of
//! root, BPF or a server fail instead (TOFFLOAD_NO_SKIP=1).

use crate::proc::{self, Result};

pub fn run(extra: &[String]) -> Result {
    let dist = crate::build::all()?;
    let mut cmd = proc::cargo();
    cmd.args(["test", "--release", "--workspace"])
        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"));
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        cmd.env("TOFFLOAD_NO_SKIP", "1");
    }
    if !extra.is_empty() {
        cmd.arg("--").args(extra);
    }
    proc::run(&mut cmd)
}
