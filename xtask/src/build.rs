//! Builds the shipped pieces into the dist folder (target/toffload): the accelerator
//! library, the load generator and demo, and the C example servers, which are built
//! from source every time and never committed as binaries.

use crate::paths;
use crate::proc::{self, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const SERVERS: &[&str] = &["conn_server", "evloop_server", "hostile_server"];
const RUST_BINS: &[&str] = &["toffload-load", "toffload-demo"];

pub struct Dist {
    pub bin: PathBuf,
}

pub fn all() -> Result<Dist> {
    crate::setup::system_packages()?;
    proc::run(proc::cargo().args([
        "build",
        "--release",
        "-p",
        "toffload-accel",
        "-p",
        "toffload-tests",
        "--lib",
        "--bins",
    ]))?;
    let dist = paths::dist();
    let (bin, lib, include) = (dist.join("bin"), dist.join("lib"), dist.join("include"));
    for d in [&bin, &lib, &include] {
        fs::create_dir_all(d).map_err(|e| format!("creating {}: {e}", d.display()))?;
    }
    let release = paths::release();
    install(&release.join("libtoffload_accel.so"), &lib)?;
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
    eprintln!("xtask: built into {}", dist.display());
    Ok(Dist { bin })
}

/// Copies through a temporary name and renames, so that a running server that has
/// the old file mapped is not disturbed ("text file busy").
fn install(src: &Path, dir: &Path) -> Result {
    let name = src.file_name().expect("file name");
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    fs::copy(src, &tmp).map_err(|e| format!("copying {}: {e}", src.display()))?;
    fs::rename(&tmp, dir.join(name)).map_err(|e| format!("installing {}: {e}", src.display()))
}

fn compile_server(name: &str, bin: &Path, lib: &Path, include: &Path) -> Result {
    let src = paths::root().join("tests/servers");
    let tmp = bin.join(format!(".{name}.tmp"));
    proc::run(
        Command::new("cc")
            .args(["-O2", "-g", "-Wall", "-Wextra", "-Werror", "-pthread", "-I"])
            .arg(include)
            .arg(src.join(format!("{name}.c")))
            .arg(src.join("common.c"))
            .arg("-L")
            .arg(lib)
            .arg("-ltoffload_accel")
            // The servers find the library next to them: dist/bin/../lib.
            .arg("-Wl,-rpath,$ORIGIN/../lib")
            .arg("-o")
            .arg(&tmp),
    )?;
    fs::rename(&tmp, bin.join(name)).map_err(|e| format!("installing {name}: {e}"))
}
