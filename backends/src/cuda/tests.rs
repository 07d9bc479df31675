//! The cuda backend's unit tests that need no device: knobs and the error path. The
//! tests that need one are in tests/cuda_gpu.rs (and run there on a fake driver too).

use super::*;
use crate::config::env;
use std::time::{Duration, Instant};

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
