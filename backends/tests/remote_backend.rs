//! `toffload-remoted --backend cuda`: the daemon runs AES ops on a CUDA device, so a
//! GPU on another machine serves toffload's remote backend. Here the device is the
//! fake driver of tests/c/fake_cuda.c (the real kernel source compiled for the CPU):
//! the answers must be bit-identical to the emulated backend's. Without a driver the
//! daemon stops at start and says why.

mod common;
mod remote_util;

use remote_util::*;
use std::process::Command;
use toffload_accel::cuda::{check_device, CudaConfig};
use toffload_accel::{Accelerator, EmuConfig, Emulated, WaitStyle};

#[test]
fn a_cuda_backed_daemon_answers_as_the_emulated_backend() {
    let fake = common::build_fake_cuda("remoted");
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0", "--backend", "cuda"],
        &[
            ("LD_LIBRARY_PATH", fake.to_str().unwrap()),
            ("FAKE_CUDA_KERNEL_US", "50"),
        ],
    );
    let r = client(&[d.addr()], |_| {});
    let emu = Emulated::new(EmuConfig {
        lat_us: 1.0,
        ..EmuConfig::default()
    })
    .unwrap();
    for (i, &n) in [1usize, 16, 4095, 65_536, 300_000, 2 << 20]
        .iter()
        .enumerate()
    {
        let input = pattern(i as u64, n);
        let mut remote = input.clone();
        r.run(&mut remote, WaitStyle::Block).unwrap();
        let mut local = input.clone();
        emu.run(&mut local, WaitStyle::Block).unwrap();
        assert_eq!(remote, local, "size {n}");
        assert_ne!(remote, input, "size {n}: not transformed");
    }
    let s = stats(&d.addr());
    assert_eq!(s["executions"], 6);
    let _ = std::fs::remove_dir_all(&fake);
}

#[test]
fn without_a_cuda_driver_the_daemon_says_why() {
    if check_device(&CudaConfig::default()).is_ok() {
        eprintln!("SKIP: a CUDA device is here; this test needs a machine without one");
        return;
    }
    let out = Command::new(DAEMON)
        .args(["--listen", "127.0.0.1:0", "--backend", "cuda"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--backend cuda:"), "{err}");
}
