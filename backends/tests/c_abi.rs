//! The C ABI as a C program sees it: compile tests/c/abi_test.c against the header
//! and the freshly built libtoffload_accel.so, run it, read its verdicts.

use std::path::{Path, PathBuf};
use std::process::Command;

/// target/<profile>/ — where cargo put libtoffload_accel.so for this test run.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn build_abi_test(tag: &str) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = profile_dir();
    assert!(
        lib_dir.join("libtoffload_accel.so").exists(),
        "libtoffload_accel.so not in {}",
        lib_dir.display()
    );
    let out = std::env::temp_dir().join(format!("toffload_abi_test_{}_{tag}", std::process::id()));
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(manifest.join("include"))
        .arg(manifest.join("tests/c/abi_test.c"))
        .arg("-L")
        .arg(&lib_dir)
        .arg("-ltoffload_accel")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(&out)
        .status()
        .expect("running cc");
    assert!(status.success(), "compiling abi_test.c failed");
    out
}

#[test]
fn c_program_exercises_the_abi() {
    let bin = build_abi_test("normal");
    let out = Command::new(&bin)
        .arg("normal")
        .env("TOFFLOAD_EMU_MAX_INFLIGHT", "4")
        .env("TOFFLOAD_EMU_LAT_US", "200")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    assert!(out.status.success(), "abi_test failed:\n{stdout}");
    assert!(stdout.contains("0 failures"));
    assert!(stdout.lines().filter(|l| l.starts_with("ok ")).count() >= 17);
    for mode in ["spin", "block"] {
        let out = Command::new(&bin)
            .env("TOFFLOAD_WAIT", mode)
            .env("TOFFLOAD_EMU_MAX_INFLIGHT", "4")
            .output()
            .unwrap();
        assert!(out.status.success(), "TOFFLOAD_WAIT={mode}");
    }
    let _ = std::fs::remove_file(bin);
}

#[test]
fn malformed_knob_is_reported_at_load_and_calls_fail() {
    let bin = build_abi_test("badknob");
    for (var, value) in [
        ("TOFFLOAD_EMU_LAT_US", "abc"),
        ("TOFFLOAD_WAIT", "sleepy"),
        ("TOFFLOAD_BACKEND", "quantum"),
        ("TOFFLOAD_CUDA_STREAMS", "0"),
    ] {
        let out = Command::new(&bin)
            .arg("badknob")
            .env(var, value)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{var}={value}: {stdout}");
        assert!(
            stderr.contains(var) && stderr.contains("expected"),
            "{var}: message should name the variable and the accepted form: {stderr}"
        );
        // Reported once, at load, not once per call.
        assert_eq!(stderr.matches(var).count(), 1, "{stderr}");
    }
    let _ = std::fs::remove_file(bin);
}

/// TOFFLOAD_BACKEND=cuda through the C ABI. Without a GPU (this machine, CI): one
/// message at load naming the missing driver, then -ENODEV from every call, promptly.
/// With one: the same C checks as the emulated device passes (a GPU test: on machines
/// without a GPU this is the no-GPU half, which is the expected state of CI).
#[test]
fn cuda_backend_through_the_c_abi() {
    use toffload_accel::cuda::{check_device, CudaConfig};
    let bin = build_abi_test("cuda");
    let gpu = check_device(&CudaConfig::default());
    let t = std::time::Instant::now();
    let mode = if gpu.is_ok() { "normal" } else { "nodevice" };
    let out = Command::new(&bin)
        .arg(mode)
        .env("TOFFLOAD_BACKEND", "cuda")
        .env("TOFFLOAD_CUDA_MAX_INFLIGHT", "4")
        .output()
        .unwrap();
    let elapsed = t.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    eprint!("{stderr}");
    assert!(
        out.status.success(),
        "abi_test {mode} under cuda:\n{stdout}\n{stderr}"
    );
    match gpu {
        Ok(info) => eprintln!("ran the C ABI checks on {}", info.name),
        Err(e) => {
            let lines: Vec<&str> = stderr.lines().collect();
            assert_eq!(lines.len(), 1, "exactly one message: {stderr}");
            assert!(lines[0].contains("TOFFLOAD_BACKEND=cuda"), "{stderr}");
            assert!(lines[0].contains("ENODEV"), "{stderr}");
            if matches!(e, toffload_accel::cuda::CuError::Missing(_)) {
                assert!(lines[0].contains("libcuda"), "names the driver: {stderr}");
            }
            assert!(elapsed.as_secs() < 10, "took {elapsed:?}");
        }
    }
    let _ = std::fs::remove_file(bin);
}
