//! Shared by the integration tests: where the build put things, and the fake CUDA
//! driver (tests/c/fake_cuda.c) built into a folder to put on LD_LIBRARY_PATH.

#![allow(dead_code)] // each test binary uses part of it

use std::path::{Path, PathBuf};
use std::process::Command;

/// target/<profile>/ — where cargo put libtoffload_accel.so for this test run.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// Builds the fake driver as one library and links it as libcuda.so and libnvrtc.so
/// (the first names the backend and cudarc try) in a fresh folder, returned.
pub fn build_fake_cuda(tag: &str) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("toffload_fake_cuda_{}_{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let lib = dir.join("libfakecuda.so");
    let status = Command::new("cc")
        .args([
            "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread",
        ])
        // The fake runs the real kernel source: it #includes src/cuda/aes_ctr.cu.
        .arg("-I")
        .arg(manifest.join("src/cuda"))
        .arg(manifest.join("tests/c/fake_cuda.c"))
        .arg("-o")
        .arg(&lib)
        .status()
        .expect("running cc");
    assert!(status.success(), "compiling fake_cuda.c failed");
    for name in ["libcuda.so", "libnvrtc.so"] {
        std::os::unix::fs::symlink("libfakecuda.so", dir.join(name)).unwrap();
    }
    dir
}

/// Compiles tests/c/`source` against include/ and libtoffload_accel.so (found at run
/// time by rpath) into `out`.
pub fn build_c_test(source: &str, out: &Path) {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = profile_dir();
    assert!(
        lib_dir.join("libtoffload_accel.so").exists(),
        "libtoffload_accel.so not in {}",
        lib_dir.display()
    );
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(manifest.join("include"))
        .arg(manifest.join("tests/c").join(source))
        .arg("-L")
        .arg(&lib_dir)
        .arg("-ltoffload_accel")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(out)
        .status()
        .expect("running cc");
    assert!(status.success(), "compiling {source} failed");
}
