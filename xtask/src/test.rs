//! `cargo xtask test`: build everything, then run every test of the workspace against
//! the freshly built dist folder, then the fuzz targets for a bounded time each
//! (fuzz.rs). Under CI (CI=true) tests that would skip for want of root, BPF, a server
//! or cargo-fuzz fail instead (TOFFLOAD_NO_SKIP=1).

use crate::proc::{self, Result};
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

pub fn run(extra: &[String]) -> Result {
    let dist = crate::build::all()?;
    let mut cmd = proc::cargo();
    // --no-fail-fast: one failing suite must not hide the others' results.
    cmd.args(["test", "--release", "--workspace", "--no-fail-fast"])
        .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"));
    let ci = under_ci();
    if ci {
        cmd.env("TOFFLOAD_NO_SKIP", "1");
    }
    if !extra.is_empty() {
        cmd.arg("--").args(extra);
    }
    eprintln!("+ {}", proc::describe(&cmd));
    // Pass cargo's output through, adding up its per-binary results so the run ends
    // with one total (cargo's own last line is often an empty doc-test binary).
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run cargo test: {e}"))?;
    let (mut passed, mut failed) = (0u64, 0u64);
    let out = std::io::stdout();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line.map_err(|e| e.to_string())?;
        if let Some((p, f)) = parse_result(&line) {
            passed += p;
            failed += f;
        }
        let _ = writeln!(out.lock(), "{line}");
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    println!("tests: {passed} passed, {failed} failed");
    if !(status.success() && failed == 0) {
        return Err(format!("cargo test failed ({status})"));
    }
    // Fuzzing only with extra arguments absent: those pick some tests, not all.
    if extra.is_empty() {
        crate::fuzz::run(ci)?;
    }
    Ok(())
}

/// CI=true (or 1): what would skip fails instead.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// "test result: ok. 14 passed; 0 failed; ..." -> (14, 0)
fn parse_result(line: &str) -> Option<(u64, u64)> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let num = |word: &str| -> Option<u64> {
        rest.split(';')
            .find_map(|part| part.trim().strip_suffix(word))
            .and_then(|n| n.trim().rsplit(' ').next()?.parse().ok())
    };
    Some((num("passed")?, num("failed")?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_cargo_result_lines() {
        assert_eq!(
            super::parse_result(
                "test result: ok. 14 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.75s"
            ),
            Some((14, 0))
        );
        assert_eq!(
            super::parse_result("test result: FAILED. 1 passed; 2 failed; 0 ignored"),
            Some((1, 2))
        );
        assert_eq!(super::parse_result("running 3 tests"), None);
    }
}
