//! Embeds the eBPF object that `cargo xtask build-ebpf` built, and the fiber runtime
//! libtoffload.so that `cargo xtask build` linked (what --inject preloads), when they
//! exist. A missing one is not a build error: the binary then embeds nothing and says
//! at run time how to build it, so that a plain `cargo build` of the workspace always
//! works.

use std::path::PathBuf;

fn main() {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("../target"));
    embed(
        "TOFFLOAD_EBPF_OBJECT",
        target.join("bpf/bpfel-unknown-none/release/toffload"),
        "toffload.bpf.o",
        "eBPF object",
        "cargo xtask build-ebpf",
    );
    embed(
        "TOFFLOAD_RUNTIME_SO",
        target.join("toffload/lib/libtoffload.so"),
        "libtoffload.so",
        "fiber runtime",
        "cargo xtask build",
    );
}

/// Copies `default` (or the file `var` names) into OUT_DIR as `name`, or an empty
/// placeholder when it does not exist.
fn embed(var: &str, default: PathBuf, name: &str, what: &str, how: &str) {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let src = std::env::var_os(var).map(PathBuf::from).unwrap_or(default);
    println!("cargo::rerun-if-env-changed={var}");
    println!("cargo::rerun-if-changed={}", src.display());
    let dst = out.join(name);
    match std::fs::read(&src) {
        Ok(bytes) => std::fs::write(&dst, bytes).expect("writing the embedded file"),
        Err(_) => {
            println!(
                "cargo::warning=no {what} at {}: toffload-watch is built without it \
                 (run `{how}`, then rebuild)",
                src.display()
            );
            std::fs::write(&dst, []).expect("writing the empty placeholder");
        }
    }
}

/// The package's directory as cargo gives it to this run: read at run time, not baked
/// in with env!(), because cargo reuses a compiled build script across checkouts of
/// the same workspace that share a target directory (a git worktree), and the baked
/// path would be the checkout that compiled it.
fn manifest_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
}
