//! The guard's C API (toffload_accel.h) as a C program on one thread sees it:
//! tests/c/guard_test.c interleaves two read-modify-writes across a park by hand,
//! under each TOFFLOAD_GUARD mode (hazard first: off loses an update).

mod common;

use common::profile_dir;
use std::path::Path;
use std::process::Command;

#[test]
fn two_interleaved_requests_under_each_mode() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = profile_dir();
    let bin = std::env::temp_dir().join(format!("toffload_guard_test_{}", std::process::id()));
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(manifest.join("include"))
        .arg(manifest.join("tests/c/guard_test.c"))
        .arg("-L")
        .arg(&lib_dir)
        .arg("-ltoffload_accel")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(&bin)
        .status()
        .expect("running cc");
    assert!(status.success(), "compiling guard_test.c failed");
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
