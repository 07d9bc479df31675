//! Fuzzing in `cargo xtask test`: each cargo-fuzz target of backends/fuzz (the remote
//! daemon's frame decoding, journal replay, and its handler fed frame sequences) runs
//! for a bounded time, starting from the corpus committed in backends/fuzz/corpus.
//! What a run discovers goes to a scratch corpus under target/, so the committed one
//! only changes by hand. A crash fails the test run and names the input libFuzzer
//! saved under backends/fuzz/artifacts.

use crate::paths;
use crate::proc::{self, Result};
use std::process::Command;

pub const TARGETS: &[&str] = &["frame_decode", "journal_replay", "daemon_frames"];

/// Seconds per target: TOFFLOAD_FUZZ_SECS, else 60 under CI and 10 otherwise.
fn seconds(ci: bool) -> Result<u64> {
    match std::env::var("TOFFLOAD_FUZZ_SECS") {
        Ok(v) => v
            .parse()
            .ok()
            .filter(|s| (1..=3600).contains(s))
            .ok_or(format!(
                "TOFFLOAD_FUZZ_SECS={v:?}: expected 1 to 3600 seconds"
            )),
        Err(_) => Ok(if ci { 60 } else { 10 }),
    }
}

fn cargo_nightly() -> Command {
    let mut c = Command::new("cargo");
    // As for the eBPF build: the workspace's cargo must not pin the toolchain.
    c.env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO")
        .current_dir(paths::root().join("backends"))
        .arg("+nightly");
    c
}

/// Runs every target. Without cargo-fuzz: a skip, said, or under CI a failure.
pub fn run(ci: bool) -> Result {
    let secs = seconds(ci)?;
    let have = cargo_nightly()
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        let why = "cargo-fuzz with a nightly toolchain is not installed \
                   (`cargo install cargo-fuzz`; .ci/run does it)";
        if ci {
            return Err(format!("fuzzing: {why}"));
        }
        println!("SKIP fuzzing: {why}");
        return Ok(());
    }
    for t in TARGETS {
        let scratch = paths::target().join("fuzz-corpus").join(t);
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).map_err(|e| format!("{}: {e}", scratch.display()))?;
        let committed = paths::root().join("backends/fuzz/corpus").join(t);
        let mut cmd = cargo_nightly();
        cmd.args(["fuzz", "run", t])
            .arg(&scratch)
            .arg(&committed)
            .arg("--")
            // The committed corpus is run first, then new inputs until the time is up.
            .arg(format!("-max_total_time={secs}"))
            .arg("-rss_limit_mb=4096")
            .arg("-print_final_stats=1");
        proc::run(&mut cmd).map_err(|e| format!("fuzz target {t}: {e}"))?;
        println!("fuzz target {t}: {secs} s, no crash");
    }
    Ok(())
}
