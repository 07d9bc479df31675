//! The cuda backend end to end through its Rust API. Each test needs a device: where
//! there is none it prints "SKIP: ..." and returns, even under TOFFLOAD_NO_SKIP=1 (CI),
//! because CI machines have no GPU by design: a missing GPU is their expected state,
//! not a broken set-up. On a GPU machine they run for real (and `cargo xtask gpu-check`
//! measures more).
//!
//! `host_side_on_the_fake_driver` runs the same tests here, in a child process whose
//! LD_LIBRARY_PATH holds the fake driver of tests/c/fake_cuda.c: everything but the CUDA
//! C kernel itself (streams, events, host callbacks, lanes, cancellation, the key
//! schedule and parameters, checked against OpenSSL) is then exercised without a GPU.

mod common;

use std::process::Command;
use std::time::Duration;
use toffload_accel::cuda::{Cuda, CudaConfig, MAX_BYTES};
use toffload_accel::emulated::aes::aes_ctr_in_place;
use toffload_accel::{AccelError, Accelerator, OpId, OpState, WaitStyle};

/// Set in the child that runs these tests on the fake driver: there a device must be
/// found, and skipping would hide a failure.
const ON_FAKE: &str = "TOFFLOAD_TEST_FAKE_CUDA";

/// A device for a GPU test, or None after printing why the test is skipped.
fn gpu(max_inflight: usize) -> Option<Cuda> {
    match Cuda::new(CudaConfig {
        max_inflight,
        ..CudaConfig::default()
    }) {
        Ok(c) => Some(c),
        Err(e) if std::env::var_os(ON_FAKE).is_some() => {
            panic!("the fake driver should have been found: {e}")
        }
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
fn host_side_on_the_fake_driver() {
    if std::env::var_os(ON_FAKE).is_some() {
        return; // the child itself
    }
    let fake = common::build_fake_cuda("gpu_tests");
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["gpu_", "--test-threads", "2"])
        .env("LD_LIBRARY_PATH", &fake)
        .env(ON_FAKE, "1")
        .env("FAKE_CUDA_KERNEL_US", "300")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "on the fake driver:\n{stdout}\n{stderr}"
    );
    assert!(!stderr.contains("SKIP"), "{stderr}");
    let ran = stdout.lines().filter(|l| l.ends_with("... ok")).count();
    assert_eq!(
        ran, 7,
        "all seven GPU tests ran on the fake driver:\n{stdout}"
    );
    let _ = std::fs::remove_dir_all(fake);
}

/// aes_ctr.cu itself, compiled as C into the fake driver and called directly: its
/// arithmetic against OpenSSL for any key, counter block (carries across 64 and 128
/// bits included, which the device's own counter never reaches) and thread count.
#[test]
fn kernel_source_on_the_cpu_matches_openssl() {
    use openssl::symm::{encrypt, Cipher};
    use toffload_accel::cuda::kernel::AesParams;
    type RunKernel = unsafe extern "C" fn(*mut u8, u64, *const AesParams, u32);
    if std::env::var_os(ON_FAKE).is_some() {
        return; // the child of host_side_on_the_fake_driver: done in the parent
    }
    let fake = common::build_fake_cuda("kernel");
    let path = std::ffi::CString::new(fake.join("libfakecuda.so").to_str().unwrap()).unwrap();
    // SAFETY: loading our own test library and a symbol of the type it defines.
    let run: RunKernel = unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        assert!(!h.is_null(), "dlopen the fake driver");
        let f = libc::dlsym(h, c"fake_cuda_run_kernel".as_ptr());
        assert!(!f.is_null());
        std::mem::transmute::<*mut libc::c_void, RunKernel>(f)
    };
    let key: [u8; 16] = *b"toffload-key-128";
    let mut near64 = [0u8; 16];
    near64[8..].copy_from_slice(&[0xff; 8]);
    near64[15] = 0xfd;
    for iv in [toffload_accel::emulated::aes::IV, [0xff; 16], near64] {
        let p = AesParams::new(&key, &iv);
        for n in [0usize, 1, 16, 17, 100, 4096 + 5] {
            for threads in [1u32, 7, 64] {
                let input = pattern(n, n + threads as usize);
                let want = encrypt(Cipher::aes_128_ctr(), &key, Some(&iv), &input).unwrap();
                let mut got = input.clone();
                // SAFETY: buffer of n bytes; params by pointer, copied by the callee.
                unsafe { run(got.as_mut_ptr(), n as u64, &p, threads) };
                assert!(got == want, "iv {iv:02x?} size {n} threads {threads}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(fake);
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
        dev.run(&mut got, WaitStyle::Spin).unwrap();
        assert!(
            got == want,
            "size {n}: GPU result differs from the emulated device"
        );
        // Blocking wait, and CTR's involution back to the input.
        dev.run(&mut got, WaitStyle::Block).unwrap();
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
        // SAFETY: each buffer stays alive and untouched until its op is released below.
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
    // SAFETY: buf stays alive; the op is released (cancelled) next, and buf only read
    // after.
    let id = unsafe { dev.submit(buf.as_mut_ptr(), buf.len()) }.unwrap();
    dev.release(id).unwrap();
    assert_eq!(dev.done(id), Err(AccelError::BadHandle));
    // The cancelled op's slot comes back once the stream is past it (its callback
    // signals the fd): then all 8 slots are usable and a 9th is EAGAIN.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut p = libc::pollfd {
            fd: dev.completion_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; reading 8 bytes from the eventfd resets it.
        unsafe {
            libc::poll(&mut p, 1, 100);
            let mut v = 0u64;
            libc::read(p.fd, &mut v as *mut u64 as *mut libc::c_void, 8);
        }
        let mut small: Vec<[u8; 16]> = vec![[0; 16]; 9];
        let ids: Vec<_> = small
            .iter_mut()
            // SAFETY: each buffer stays alive and untouched until its op is released below.
            .map(|b| unsafe { dev.submit(b.as_mut_ptr(), 16) })
            .collect();
        let all = ids[..8].iter().all(|r| r.is_ok());
        if all {
            assert_eq!(ids[8], Err(AccelError::TooManyInFlight { max: 8 }));
        }
        for id in ids.iter().flatten() {
            dev.wait(*id).unwrap();
            dev.release(*id).unwrap();
        }
        if all {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cancelled op's slot never came back: {ids:?}"
        );
    }
    // The device is done with the cancelled op (its slot was reused), and only a
    // poll copies results out: the buffer must still be the input.
    assert!(buf == input, "buffer written after release");
}

#[test]
fn gpu_completed_ops_free_their_slot_at_release() {
    // Released after completion, a slot is free at once, even if the stream's callback
    // for it has not run yet: the in-flight limit counts what is really in flight.
    let Some(dev) = gpu(4) else { return };
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|i| pattern(4096, i)).collect();
    for round in 0..50 {
        let ids: Vec<OpId> = bufs
            .iter_mut()
            // SAFETY: each buffer stays alive and untouched until its op is released below.
            .map(|b| unsafe { dev.submit(b.as_mut_ptr(), b.len()) })
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        for id in &ids {
            dev.wait(*id).unwrap();
        }
        for id in ids {
            dev.release(id).unwrap();
        }
    }
}

/// A lane's op released mid-flight: its slot comes back exactly once, whatever the
/// order of the release and the stream's callback.
fn wait_for_all_slots(dev: &Cuda, n: usize) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut small: Vec<[u8; 16]> = vec![[0; 16]; n + 1];
        let ids: Vec<_> = small
            .iter_mut()
            // SAFETY: each buffer stays alive and untouched until its op is released below.
            .map(|b| unsafe { dev.submit(b.as_mut_ptr(), 16) })
            .collect();
        let all = ids[..n].iter().all(|r| r.is_ok());
        let over = ids[n] == Err(AccelError::TooManyInFlight { max: n });
        for id in ids.iter().flatten() {
            dev.wait(*id).unwrap();
            dev.release(*id).unwrap();
        }
        if all {
            return over;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "slots never came back"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn gpu_cancel_storm_leaks_no_slot() {
    let Some(dev) = gpu(8) else { return };
    let mut bufs: Vec<Vec<u8>> = (0..8).map(|i| pattern(1 + i * 5000, i)).collect();
    let mut live: Vec<Option<OpId>> = vec![None; 8];
    for step in 0..400usize {
        let i = step % 8;
        if let Some(id) = live[i].take() {
            // Half released while (probably) pending, half after completion.
            if step % 3 == 0 {
                dev.wait(id).unwrap();
            }
            dev.release(id).unwrap();
        }
        // SAFETY: bufs[i] stays alive; its previous op was released above, this one is
        // later.
        match unsafe { dev.submit(bufs[i].as_mut_ptr(), bufs[i].len()) } {
            Ok(id) => live[i] = Some(id),
            // Cancelled ops not yet past their stream still hold their slot.
            Err(AccelError::TooManyInFlight { .. }) => {}
            Err(e) => panic!("step {step}: {e}"),
        }
    }
    for id in live.into_iter().flatten() {
        dev.release(id).unwrap();
    }
    assert!(wait_for_all_slots(&dev, 8), "a 9th op was accepted");
}

#[test]
fn gpu_bad_inputs() {
    let Some(dev) = gpu(8) else { return };
    assert_eq!(
        // SAFETY: a null buffer is rejected before use.
        unsafe { dev.submit(std::ptr::null_mut(), 16) },
        Err(AccelError::NullBuffer)
    );
    let mut b = [0u8; 16];
    assert!(matches!(
        // SAFETY: rejected on its length before the buffer is used.
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
                        WaitStyle::Spin
                    } else {
                        WaitStyle::Block
                    };
                    dev.run(&mut got, style).unwrap();
                    assert!(got == want, "thread {t} op {i} size {n}");
                }
            });
        }
    });
    assert!(dev.completed() >= 800);
}
