//! Where things live. The dist folder, target/toffload, is the layout the tests and
//! benchmarks use: bin/ (servers, load generator), lib/ (shared libraries), include/.

use std::path::PathBuf;

pub fn root() -> PathBuf {
    // xtask/ is one level below the workspace root.
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

pub fn target() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

pub fn release() -> PathBuf {
    target().join("release")
}

pub fn dist() -> PathBuf {
    target().join("toffload")
}

pub fn results() -> PathBuf {
    root().join("tests").join("results")
}
