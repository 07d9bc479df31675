//! Embeds the eBPF object that `cargo xtask build-ebpf` built, when there is one. A
//! missing object is not a build error: the binary then embeds nothing and says at run
//! time how to build it, so that a plain `cargo build` of the workspace always works.

use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let src = std::env::var_os("TOFFLOAD_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
            target.join("bpf/bpfel-unknown-none/release/toffload")
        });
    println!("cargo::rerun-if-env-changed=TOFFLOAD_EBPF_OBJECT");
    println!("cargo::rerun-if-changed={}", src.display());
    let dst = out.join("toffload.bpf.o");
    match std::fs::read(&src) {
        Ok(bytes) => std::fs::write(&dst, bytes).expect("writing the embedded object"),
        Err(_) => {
            println!(
                "cargo::warning=no eBPF object at {}: toffload-watch is built without it \
                 (run `cargo xtask build-ebpf`, then rebuild)",
                src.display()
            );
            std::fs::write(&dst, []).expect("writing the empty placeholder");
        }
    }
}
