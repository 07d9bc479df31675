//! The guard's C API (toffload_accel.h) as a C program on one thread sees it:
//! tests/c/guard_test.c interleaves two read-modify-writes across a park by hand,
//! under each TOFFLOAD_GUARD mode (hazard first: off loses an update).

mod common;

use std::process::Command;

#[test]
fn two_interleaved_requests_under_each_mode() {
    let bin = std::env::temp_dir().join(format!("toffload_guard_test_{}", std::process::id()));
    common::build_c_test("guard_test.c", &bin);
    for (env, want) in [
        ("off", "off"),
        ("detect", "detect"),
        ("enforce", "enforce"),
        ("sometimes", "invalid"),
    ] {
        let out = Command::new(&bin)
            .arg(want)
            .env("TOFFLOAD_GUARD", env)
            .output()
            .expect("running guard_test");
        let stdout = String::from_utf8_lossy(&out.stdout);
        print!("TOFFLOAD_GUARD={env}:\n{stdout}");
        assert!(
            out.status.success() && stdout.contains("0 failures"),
            "TOFFLOAD_GUARD={env}: {}\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let _ = std::fs::remove_file(bin);
}
