//! The cuda backend's tests. The knob and error-path tests run everywhere; the GPU
//! tests need a device and print "SKIP: ..." and return where there is none.
//!
//! They skip even under TOFFLOAD_NO_SKIP=1 (CI): CI machines have no GPU by design,
//! so a missing GPU is the expected state there, not a broken set-up. The GPU check
//! (`cargo xtask gpu-check`) is what runs them on a GPU machine.

use super::*;
use crate::emulated::aes::aes_ctr_in_place;
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

/// A device for a GPU test, or None after printing why the test is skipped.
fn gpu(max_inflight: usize) -> Option<Cuda> {
    match Cuda::new(CudaConfig {
        max_inflight,
        ..CudaConfig::default()
    }) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("SKIP: no usable CUDA device: {e}");
            None
        }
    }
}

fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n).map(|i| (i.wrapping_mul(131) ^ seed) as u8).collect()
}

#[test]
fn knobs_parse_and_reject() {
    let c = CudaConfig::from_lookup(&env(&[])).unwrap();
    assert_eq!(c, CudaConfig::default());
    let c = CudaConfig::from_lookup(&env(&[
        ("TOFFLOAD_CUDA_DEVICE", "1"),
        ("TOFFLOAD_CUDA_STREAMS", "4"),
        ("TOFFLOAD_CUDA_MAX_INFLIGHT", "8"),
    ]))
    .unwrap();
    assert_eq!((c.device, c.streams, c.max_inflight), (1, 4, 8));
    for (var, bad) in [
        ("TOFFLOAD_CUDA_DEVICE", "-1"),
        ("TOFFLOAD_CUDA_STREAMS", "0"),
        ("TOFFLOAD_CUDA_MAX_INFLIGHT", "65537"),
    ] {
        let e = CudaConfig::from_lookup(&env(&[(var, bad)])).unwrap_err();
        assert_eq!(e.var, var);
    }
}

#[test]
fn without_a_gpu_new_fails_promptly_naming_the_cause() {
    let t = Instant::now();
    match Cuda::new(CudaConfig::default()) {
        // A GPU machine: the GPU tests below cover it.
        Ok(c) => eprintln!(
            "CUDA device present ({}): covered by the GPU tests",
            c.info().name
        ),
        Err(e) => {
            let m = e.to_string();
            assert_eq!(e.errno(), libc::ENODEV, "{m}");
            match e {
                CuError::Missing(_) => assert!(m.contains("libcuda"), "{m}"),
                CuError::NoDevice(_) => assert!(m.contains("device"), "{m}"),
                other => panic!("unexpected error without a GPU: {other}"),
            }
            // Twice: the probe is cached and still an error, never a panic.
            assert!(check_device(&CudaConfig::default()).is_err());
        }
    }
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
}

#[test]
fn gpu_matches_the_emulated_device() {
    let Some(dev) = gpu(64) else { return };
    for n in [
        0usize,
        1,
        15,
        16,
        17,
        4095,
        4096,
        4097,
        65_536 + 3,
        1 << 20,
        8 << 20,
    ] {
        let input = pattern(n, n);
        let mut want = input.clone();
        aes_ctr_in_place(&mut want);
        let mut got = input.clone();
        dev.run(&mut got, crate::WaitStyle::Spin).unwrap();
        assert!(
            got == want,
            "size {n}: GPU result differs from the emulated device"
        );
        // Blocking wait, and CTR's involution back to the input.
        dev.run(&mut got, crate::WaitStyle::Block).unwrap();
        assert!(got == input, "size {n}: round trip");
    }
}

#[test]
fn gpu_many_in_flight_signal_the_completion_fd() {
    let Some(dev) = gpu(256) else { return };
    let sizes = [16usize, 4096, 65_536, 1 << 20];
    let mut bufs: Vec<Vec<u8>> = (0..200).map(|i| pattern(sizes[i % 4], i)).collect();
    let wants: Vec<Vec<u8>> = bufs
        .iter()
        .map(|b| {
            let mut w = b.clone();
            aes_ctr_in_place(&mut w);
            w
        })
        .collect();
    let ids: Vec<OpId> = bufs
        .iter_mut()
        .map(|b| unsafe { dev.submit(b.as_mut_ptr(), b.len()) }.unwrap())
        .collect();
    let mut p = libc::pollfd {
        fd: dev.completion_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut p, 1, 10_000) }, 1, "completion fd");
    for id in &ids {
        dev.wait(*id).unwrap();
        assert_eq!(dev.done(*id).unwrap(), OpState::Done);
        dev.release(*id).unwrap();
        assert_eq!(dev.release(*id), Err(AccelError::BadHandle));
    }
    for (i, (b, w)) in bufs.iter().zip(&wants).enumerate() {
        assert!(b == w, "op {i}");
    }
}

#[test]
fn gpu_release_cancels_without_touching_the_buffer() {
    let Some(dev) = gpu(8) else { return };
    let input = pattern(8 << 20, 7);
    let mut buf = input.clone();
    let id = unsafe { dev.submit(buf.as_mut_ptr(), buf.len()) }.unwrap();
    dev.release(id).unwrap();
    // Long enough for the GPU to have finished: the buffer must still be the input,
    // since only a poll copies results out, and nobody polled.
    std::thread::sleep(Duration::from_millis(200));
    assert!(buf == input, "buffer written after release");
    assert_eq!(dev.done(id), Err(AccelError::BadHandle));
    // The cancelled op's slot comes back: all 8 slots usable, 9th is EAGAIN.
    std::thread::sleep(Duration::from_millis(50));
    let mut small: Vec<[u8; 16]> = vec![[0; 16]; 9];
    let ids: Vec<_> = small
        .iter_mut()
        .map(|b| unsafe { dev.submit(b.as_mut_ptr(), 16) })
        .collect();
    assert!(ids[..8].iter().all(|r| r.is_ok()), "{ids:?}");
    assert_eq!(ids[8], Err(AccelError::TooManyInFlight { max: 8 }));
    for id in ids.into_iter().flatten() {
        dev.release(id).unwrap();
    }
}

#[test]
fn gpu_bad_inputs() {
    let Some(dev) = gpu(8) else { return };
    assert_eq!(
        unsafe { dev.submit(std::ptr::null_mut(), 16) },
        Err(AccelError::NullBuffer)
    );
    let mut b = [0u8; 16];
    assert!(matches!(
        unsafe { dev.submit(b.as_mut_ptr(), MAX_BYTES + 1) },
        Err(AccelError::TooLarge { .. })
    ));
    assert_eq!(dev.done(OpId(-1)), Err(AccelError::BadHandle));
    assert_eq!(dev.done(OpId(987_654_321)), Err(AccelError::BadHandle));
    assert_eq!(dev.release(OpId(12345 << 24)), Err(AccelError::BadHandle));
}

#[test]
fn gpu_threads_share_the_device() {
    let Some(dev) = gpu(64) else { return };
    std::thread::scope(|s| {
        for t in 0..8 {
            let dev = &dev;
            s.spawn(move || {
                for i in 0..100 {
                    let n = 1 + (i * 977 + t * 31) % 70_000;
                    let input = pattern(n, t * 1000 + i);
                    let mut want = input.clone();
                    aes_ctr_in_place(&mut want);
                    let mut got = input;
                    let style = if i % 2 == 0 {
                        crate::WaitStyle::Spin
                    } else {
                        crate::WaitStyle::Block
                    };
                    dev.run(&mut got, style).unwrap();
                    assert!(got == want, "thread {t} op {i} size {n}");
                }
            });
        }
    });
    assert!(dev.completed() >= 800);
}
