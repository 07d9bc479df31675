//! `cargo xtask bench remote-cuda`: the remote CUDA client's remoting efficiency
//! (backends/benches/remote_cuda.rs) -> tests/results/remote-cuda-bench.md and its
//! chart. conn_server on the cuda backend direct vs through the client library, over
//! loopback and delayed links, batching and the upload cache on/off, stock and under
//! libtoffload.so. Needs root (network namespaces) and the dist folder (conn_server,
//! toffload-load, libtoffload.so), built first. On a GPU machine `-- --real-driver`
//! runs the daemon and the direct rows on the real driver (tests/results/remote-cuda.md,
//! the H200 numbers of backends/cuda-remote/gpu_remote.sh, is a file of its own).

use crate::paths;
use crate::proc::{self, Result};

pub fn run(args: Vec<String>) -> Result {
    let dist = crate::build::all()?;
    let out = paths::results().join("remote-cuda-bench.md");
    // Defaults first: a later flag in `args` overrides.
    proc::run(
        proc::cargo()
            .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"))
            .args([
                "bench",
                "-p",
                "toffload-accel",
                "--bench",
                "remote_cuda",
                "--",
            ])
            .args(["--runs", "3"])
            .arg("--out")
            .arg(&out)
            .args(&args),
    )
}
