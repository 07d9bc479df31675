//! Builds the shipped pieces into the dist folder (target/toffload): the accelerator
//! library, the load generator and demo, the C example servers, which are built
//! from source every time and never committed as binaries, and the integrations
//! (integrations.rs).

use crate::paths;
use crate::proc::{self, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const SERVERS: &[&str] = &[
    "conn_server",
    "evloop_server",
    "hostile_server",
    "safe_server",
];
/// Test programs (tests/programs/NAME.c, one file each, plus common.c of the servers,
/// or NAME.cpp alone): the runtime's correctness suite and benchmarks run them under
/// LD_PRELOAD.
fn programs() -> Result<Vec<String>> {
    let mut v = c_sources("tests/programs")?;
    v.extend(sources("tests/programs", "cpp")?);
    Ok(v)
}

/// The C programs (one file each) in a folder under the root, by name.
fn c_sources(rel: &str) -> Result<Vec<String>> {
    sources(rel, "c")
}

/// The source files with extension `ext` in a folder under the root, by name.
fn sources(rel: &str, ext: &str) -> Result<Vec<String>> {
    let dir = paths::root().join(rel);
    let mut v = Vec::new();
    if !dir.exists() {
        return Ok(v);
    }
    let rd = fs::read_dir(&dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    for e in rd {
        let p = e.map_err(|e| e.to_string())?.path();
        if p.extension().is_some_and(|x| x == ext) {
            v.push(p.file_stem().expect("stem").to_string_lossy().into_owned());
        }
    }
    v.sort();
    Ok(v)
}
pub const RUST_BINS: &[&str] = &[
    "toffload-load",
    "toffload-table",
    "toffload-demo",
    "toffload-model-bench",
    "toffload-guard-bench",
    "toffload-openloop",
    "toffload-watch",
    "toffload-remoted",
];

pub struct Dist {
    pub bin: PathBuf,
}

pub fn all() -> Result<Dist> {
    crate::setup::system_packages()?;
    // First, so that toffload-watch below embeds a fresh object.
    crate::ebpf::build()?;
    // The runtime's staticlib, with its interposers (feature preload), built on its
    // own so that the workspace's test build never links them into a test binary; and
    // linked before toffload-watch is built, which bundles libtoffload.so.
    proc::run(proc::cargo().args([
        "build",
        "--release",
        "-p",
        "toffload-runtime",
        "--features",
        "preload",
        "--lib",
    ]))?;
    let dist = paths::dist();
    let (bin, lib, include) = (dist.join("bin"), dist.join("lib"), dist.join("include"));
    for d in [&bin, &lib, &include] {
        fs::create_dir_all(d).map_err(|e| format!("creating {}: {e}", d.display()))?;
    }
    let release = paths::release();
    link_runtime(&release, &lib)?;
    proc::run(proc::cargo().args([
        "build",
        "--release",
        "-p",
        "toffload-accel",
        "-p",
        "toffload-tests",
        "-p",
        "toffload-watch",
        "-p",
        "toffload-cuda-remote",
        "--lib",
        "--bins",
    ]))?;
    install(&release.join("libtoffload_accel.so"), &lib)?;
    install_cuda_remote(&release, &lib)?;
    install(
        &paths::root().join("backends/include/toffload_accel.h"),
        &include,
    )?;
    for b in RUST_BINS {
        install(&release.join(b), &bin)?;
    }
    for s in SERVERS {
        compile_server(s, &bin, &lib, &include)?;
    }
    for p in programs()? {
        compile_program(&p, &bin, &lib, &include)?;
    }
    // Test libraries first (a vendor's offload library for hsm_server), into lib/.
    for l in c_sources("tests/watch_programs/lib")? {
        compile_test_lib(&l, &lib, &include)?;
    }
    for p in c_sources("tests/watch_programs")? {
        compile_c(
            &paths::root().join("tests/watch_programs"),
            &p,
            &bin,
            &lib,
            &include,
        )?;
    }
    crate::integrations::build(&dist)?;
    eprintln!("xtask: built into {}", dist.display());
    Ok(Dist { bin })
}

/// The remote CUDA client as lib/cuda-remote/libcuda.so.1 (and libcuda.so): a folder
/// of its own, which only a program told to (LD_LIBRARY_PATH) loads as its driver.
fn install_cuda_remote(release: &Path, lib: &Path) -> Result {
    let dir = lib.join("cuda-remote");
    fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let tmp = dir.join(".libcuda.so.1.tmp");
    fs::copy(release.join("libtoffload_cuda_remote.so"), &tmp)
        .map_err(|e| format!("copying libtoffload_cuda_remote.so: {e}"))?;
    fs::rename(&tmp, dir.join("libcuda.so.1"))
        .map_err(|e| format!("installing libcuda.so.1: {e}"))?;
    let link = dir.join("libcuda.so");
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink("libcuda.so.1", &link)
        .map_err(|e| format!("linking {}: {e}", link.display()))
}

/// Copies through a temporary name and renames, so that a running server that has
/// the old file mapped is not disturbed ("text file busy").
fn install(src: &Path, dir: &Path) -> Result {
    let name = src.file_name().expect("file name");
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    fs::copy(src, &tmp).map_err(|e| format!("copying {}: {e}", src.display()))?;
    fs::rename(&tmp, dir.join(name)).map_err(|e| format!("installing {}: {e}", src.display()))
}

/// libtoffload.so = the runtime's staticlib + csrc/*.c, linked by gcc with
/// runtime/toffload.map, which exports the condition-variable functions at both of
/// glibc's versions (rustc's cdylib would override any version script of ours).
fn link_runtime(release: &Path, lib: &Path) -> Result {
    let rt = paths::root().join("runtime");
    let tmp = lib.join(".libtoffload.so.tmp");
    let mut cmd = Command::new("cc");
    cmd.args([
        "-shared", "-fPIC", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-o",
    ])
    .arg(&tmp);
    let csrc = rt.join("csrc");
    if let Ok(rd) = fs::read_dir(&csrc) {
        let mut files: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "c"))
            .collect();
        files.sort();
        cmd.args(files);
    }
    cmd.arg("-Wl,--whole-archive")
        .arg(release.join("libtoffload_rt.a"))
        .arg("-Wl,--no-whole-archive")
        .arg(format!(
            "-Wl,--version-script={}",
            rt.join("toffload.map").display()
        ))
        .args(["-Wl,-z,nodelete", "-ldl", "-lpthread", "-lgcc_s"]);
    proc::run(&mut cmd)?;
    fs::rename(&tmp, lib.join("libtoffload.so"))
        .map_err(|e| format!("installing libtoffload.so: {e}"))
}

fn compile_server(name: &str, bin: &Path, lib: &Path, include: &Path) -> Result {
    compile_c(
        &paths::root().join("tests/servers"),
        name,
        bin,
        lib,
        include,
    )
}

fn compile_program(name: &str, bin: &Path, lib: &Path, include: &Path) -> Result {
    let cpp = paths::root().join(format!("tests/programs/{name}.cpp"));
    if cpp.exists() {
        return compile_cpp(&cpp, name, bin);
    }
    compile_c(
        &paths::root().join("tests/programs"),
        name,
        bin,
        lib,
        include,
    )
}

/// A C++ test program (the runtime's handling of C++ thread_local objects): the
/// servers' common.c is C, and the C++ driver would compile it as C++, so it is left
/// out; these programs do not use it.
fn compile_cpp(src: &Path, name: &str, bin: &Path) -> Result {
    let tmp = bin.join(format!(".{name}.tmp"));
    proc::run(
        Command::new("c++")
            .args(["-O2", "-g", "-Wall", "-Wextra", "-Werror", "-pthread"])
            .arg(src)
            .arg("-o")
            .arg(&tmp),
    )?;
    fs::rename(&tmp, bin.join(name)).map_err(|e| format!("installing {name}: {e}"))
}

/// tests/watch_programs/lib/NAME.c -> lib/libNAME.so, on the emulated device.
fn compile_test_lib(name: &str, lib: &Path, include: &Path) -> Result {
    let src = paths::root().join("tests/watch_programs/lib");
    let so = format!("lib{name}.so");
    let tmp = lib.join(format!(".{so}.tmp"));
    proc::run(
        Command::new("cc")
            .args([
                "-shared", "-fPIC", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-I",
            ])
            .arg(include)
            .arg(src.join(format!("{name}.c")))
            .arg("-L")
            .arg(lib)
            .arg("-ltoffload_accel")
            .arg("-Wl,-rpath,$ORIGIN")
            .arg("-o")
            .arg(&tmp),
    )?;
    fs::rename(&tmp, lib.join(&so)).map_err(|e| format!("installing {so}: {e}"))
}

fn compile_c(src: &Path, name: &str, bin: &Path, lib: &Path, include: &Path) -> Result {
    let common = paths::root().join("tests/servers");
    let tmp = bin.join(format!(".{name}.tmp"));
    proc::run(
        Command::new("cc")
            .args(["-O2", "-g", "-Wall", "-Wextra", "-Werror", "-pthread"])
            // The watcher's futex stacks are walked by frame pointers (as every eBPF
            // stack is): without them only the innermost frame shows, and its tests
            // check that the stacks reach the test programs' own functions.
            .args(
                src.ends_with("watch_programs")
                    .then_some("-fno-omit-frame-pointer"),
            )
            .arg("-I")
            .arg(include)
            .arg("-I")
            .arg(&common)
            .arg(src.join(format!("{name}.c")))
            .arg(common.join("common.c"))
            .arg("-L")
            .arg(lib)
            .arg("-ltoffload_accel")
            // Some test programs use libcrypto (OpenSSL error queue) or dlsym, one
            // the test vendor libraries (compile_test_lib).
            .args(["-Wl,--as-needed", "-lcrypto", "-ldl"])
            // --as-needed keeps it only where it is called (hsm_server).
            .args(
                src.ends_with("watch_programs")
                    .then_some(["-lxhsm", "-lfakecuda"])
                    .into_iter()
                    .flatten(),
            )
            // The servers find the library next to them: dist/bin/../lib.
            .arg("-Wl,-rpath,$ORIGIN/../lib")
            .arg("-o")
            .arg(&tmp),
    )?;
    fs::rename(&tmp, bin.join(name)).map_err(|e| format!("installing {name}: {e}"))
}
