//! `cargo xtask build-ebpf`: builds the kernel-side programs (ebpf/) with nightly for
//! bpfel-unknown-none, first installing what a fresh machine lacks: the nightly's
//! rust-src (for -Z build-std=core) and bpf-linker, built against the libLLVM that
//! ships inside the nightly itself (Debian's LLVM is too old for rustc's bitcode; see
//! ../shared/TOOLCHAIN.md). The object lands where userspace/build.rs looks for it.

use crate::paths;
use crate::proc::{self, Result};
use std::path::PathBuf;
use std::process::Command;

/// Where the object ends up (userspace/build.rs embeds it from here).
pub fn object() -> PathBuf {
    target_dir().join("bpfel-unknown-none/release/toffload")
}

fn target_dir() -> PathBuf {
    paths::target().join("bpf")
}

pub fn build() -> Result {
    ensure_nightly()?;
    ensure_rust_src()?;
    ensure_bpf_linker()?;
    eprintln!("xtask: building the eBPF programs (ebpf/, nightly, bpfel-unknown-none)");
    let mut cmd = Command::new("cargo");
    cmd.current_dir(paths::root().join("ebpf"))
        // The workspace's cargo sets these for xtask itself; they must not leak into
        // the nightly build (RUSTC would pin it to stable).
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO")
        .args([
            "+nightly",
            "build",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
            "--target-dir",
        ])
        .arg(target_dir());
    proc::run(&mut cmd)?;
    let obj = object();
    if !obj.exists() {
        return Err(format!("the eBPF build did not produce {}", obj.display()));
    }
    eprintln!("xtask: eBPF object at {}", obj.display());
    Ok(())
}

fn rustup() -> Command {
    let mut c = Command::new("rustup");
    c.env_remove("RUSTUP_TOOLCHAIN");
    c
}

fn ensure_nightly() -> Result {
    if nightly_rustc(&["-V"]).is_ok() {
        return Ok(());
    }
    eprintln!("xtask: no nightly toolchain; installing it (rustup, minimal profile)");
    proc::run(rustup().args([
        "toolchain",
        "install",
        "nightly",
        "--profile",
        "minimal",
        "--component",
        "rust-src",
    ]))
}

fn ensure_rust_src() -> Result {
    let out = rustup()
        .args(["component", "list", "--toolchain", "nightly", "--installed"])
        .output()
        .map_err(|e| format!("cannot run rustup: {e}"))?;
    if String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.starts_with("rust-src"))
    {
        return Ok(());
    }
    eprintln!("xtask: nightly lacks rust-src (needed by -Z build-std=core); adding it");
    proc::run(rustup().args(["component", "add", "rust-src", "--toolchain", "nightly"]))
}

fn nightly_rustc(args: &[&str]) -> Result<String> {
    let out = Command::new("rustc")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .arg("+nightly")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run rustc +nightly: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "rustc +nightly {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The bpf-linker xtask installs, with `--locked` (its own Cargo.lock): the version
/// checked with the nightly here (LLVM 22, feature llvm-22; it has llvm-21 to llvm-23).
/// A newer nightly whose LLVM it lacks needs a newer pin.
const BPF_LINKER_VERSION: &str = "0.13.0";

fn ensure_bpf_linker() -> Result {
    if let Ok(out) = Command::new("bpf-linker").arg("--version").output() {
        if out.status.success() {
            let found = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if found.split_whitespace().nth(1) != Some(BPF_LINKER_VERSION) {
                eprintln!(
                    "xtask: using the installed {found}; xtask installs {BPF_LINKER_VERSION} \
                     when none is (cargo uninstall bpf-linker to get that one)"
                );
            }
            return Ok(());
        }
    }
    // The LLVM major version the nightly was built with picks bpf-linker's feature.
    let vv = nightly_rustc(&["-vV"])?;
    let major = vv
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .ok_or("rustc +nightly -vV printed no LLVM version")?
        .to_string();
    let sysroot = nightly_rustc(&["--print", "sysroot"])?;
    let lib = PathBuf::from(sysroot.trim()).join("lib");
    let so = std::fs::read_dir(&lib)
        .map_err(|e| format!("reading {}: {e}", lib.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("libLLVM.so") || n.starts_with("libLLVM-"))
        .ok_or_else(|| format!("no libLLVM in {}", lib.display()))?;
    // A prefix whose lib/ holds libLLVM.so (what llvm-sys links) and the SONAME (what
    // the installed binary's rpath finds at run time).
    let home = std::env::var_os("HOME").ok_or("HOME is not set")?;
    let pfx = PathBuf::from(home).join(".cache/toffload/llvm-prefix");
    let pfx_lib = pfx.join("lib");
    std::fs::create_dir_all(&pfx_lib)
        .map_err(|e| format!("creating {}: {e}", pfx_lib.display()))?;
    for name in ["libLLVM.so", so.as_str()] {
        let link = pfx_lib.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(lib.join(&so), &link)
            .map_err(|e| format!("linking {}: {e}", link.display()))?;
    }
    eprintln!(
        "xtask: bpf-linker is missing; building {BPF_LINKER_VERSION} against the nightly's \
         own {so} (LLVM {major}; about 90 s on 2 cores)"
    );
    let mut cmd = Command::new("cargo");
    cmd.env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env("LLVM_PREFIX", &pfx)
        .args([
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--no-default-features",
            "--features",
        ])
        .arg(format!("llvm-{major}"));
    proc::run(&mut cmd)?;
    if !proc::succeeds("bpf-linker", &["--version"]) {
        return Err("bpf-linker was installed but `bpf-linker --version` fails \
                    (is ~/.cargo/bin on PATH?)"
            .into());
    }
    Ok(())
}
