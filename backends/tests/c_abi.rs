//! The C ABI as a C program sees it: compile tests/c/abi_test.c against the header
//! and the freshly built libtoffload_accel.so, run it, read its verdicts.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn build_abi_test(tag: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("toffload_abi_test_{}_{tag}", std::process::id()));
    common::build_c_test("abi_test.c", &out);
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
    assert!(stdout.lines().filter(|l| l.starts_with("ok ")).count() >= 21);
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
    let mode = if gpu.is_ok() { "normal" } else { "unusable" };
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

/// Runs abi_test `args` with TOFFLOAD_BACKEND=cuda on the fake driver (tests/c/fake_cuda.c)
/// plus `env`; returns (success, stdout, stderr).
fn on_fake(bin: &Path, fake: &Path, args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(bin)
        .args(args)
        .env("TOFFLOAD_BACKEND", "cuda")
        .env("TOFFLOAD_CUDA_MAX_INFLIGHT", "4")
        .env("LD_LIBRARY_PATH", fake)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    print!("{stdout}");
    eprint!("{stderr}");
    (out.status.success(), stdout, stderr)
}

/// The cuda backend's host side through the C ABI with no GPU: on the fake driver the
/// full C checks pass (known answer, completion fd, handles, every errno, -EAGAIN at
/// TOFFLOAD_CUDA_MAX_INFLIGHT), and each failure the driver can report becomes one
/// line on stderr naming it and the right errno from every call.
#[test]
fn cuda_backend_on_the_fake_driver() {
    let bin = build_abi_test("fake");
    let fake = common::build_fake_cuda("c_abi");

    let (ok, stdout, stderr) = on_fake(&bin, &fake, &["normal"], &[]);
    assert!(ok && stdout.contains("0 failures"), "{stdout}");
    // Every check of the emulated run but the forked child (CUDA does not survive fork).
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok ")).count(), 17);
    assert!(stderr.is_empty(), "no message when all is well: {stderr}");
    // A CUBIN the driver rejects falls back to PTX.
    let (ok, _, stderr) = on_fake(&bin, &fake, &["normal"], &[("FAKE_CUDA_NO_CUBIN", "1")]);
    assert!(ok && stderr.is_empty(), "{stderr}");
    for wait in ["spin", "block"] {
        let (ok, _, _) = on_fake(&bin, &fake, &["normal"], &[("TOFFLOAD_WAIT", wait)]);
        assert!(ok, "TOFFLOAD_WAIT={wait}");
    }

    let enodev = libc::ENODEV.to_string();
    let eio = libc::EIO.to_string();
    for (env, errno, says) in [
        (("FAKE_CUDA_DEVICES", "0"), &enodev, "reports no device"),
        (("FAKE_NVRTC_FAIL", "1"), &eio, "planted failure"),
        (("FAKE_CUDA_WRONG", "1"), &eio, "self-test"),
    ] {
        let (ok, stdout, stderr) = on_fake(&bin, &fake, &["unusable", errno], &[env]);
        assert!(ok, "{env:?}: {stdout}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{env:?}: one message: {stderr}");
        assert!(
            lines[0].contains("TOFFLOAD_BACKEND=cuda") && lines[0].contains(says),
            "{stderr}"
        );
    }

    // Out of device memory at run time: -ENOMEM, one line, small ops unaffected.
    let (ok, stdout, stderr) = on_fake(&bin, &fake, &["oom"], &[("FAKE_CUDA_OOM_ABOVE", "65536")]);
    assert!(ok, "{stdout}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "one message for repeated failures: {stderr}"
    );
    assert!(lines[0].contains("out of memory"), "{stderr}");

    // A driver without NVRTC: the kernel cannot be compiled, and the message says why.
    std::fs::remove_file(fake.join("libnvrtc.so")).unwrap();
    let (ok, stdout, stderr) = on_fake(&bin, &fake, &["unusable", &enodev], &[]);
    assert!(ok, "{stdout}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("NVRTC") && stderr.contains("libnvrtc"),
        "{stderr}"
    );

    let _ = std::fs::remove_file(bin);
    let _ = std::fs::remove_dir_all(fake);
}
