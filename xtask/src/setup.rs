//! System prerequisites. The Rust crates need OpenSSL's headers and pkg-config, the
//! example servers a C compiler, the integrations make; a fresh machine may lack them, so we install what is
//! missing (as root), and otherwise say exactly what to install.

use crate::proc::{self, Result};
use std::process::Command;

/// (what is checked, how, the Debian package that provides it)
fn checks() -> Vec<(&'static str, bool, &'static str)> {
    vec![
        (
            "a C compiler (cc)",
            proc::succeeds("cc", &["--version"]),
            "gcc",
        ),
        (
            "a C++ compiler (c++)",
            proc::succeeds("c++", &["--version"]),
            "g++",
        ),
        (
            "make (the integrations' Makefiles, nginx's build)",
            proc::succeeds("make", &["--version"]),
            "make",
        ),
        (
            "pkg-config",
            proc::succeeds("pkg-config", &["--version"]),
            "pkg-config",
        ),
        (
            "OpenSSL headers",
            proc::succeeds("pkg-config", &["--exists", "openssl"]),
            "libssl-dev",
        ),
    ]
}

/// Installs whatever of the build prerequisites is missing.
pub fn system_packages() -> Result {
    let missing: Vec<(&str, &str)> = checks()
        .into_iter()
        .filter(|(_, ok, _)| !ok)
        .map(|(what, _, pkg)| (what, pkg))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let pkgs: Vec<&str> = missing.iter().map(|(_, p)| *p).collect();
    let what: Vec<&str> = missing.iter().map(|(w, _)| *w).collect();
    if !proc::is_root() {
        return Err(format!(
            "missing {}; install with: sudo apt-get install -y {}",
            what.join(", "),
            pkgs.join(" ")
        ));
    }
    eprintln!("xtask: installing {} ({})", pkgs.join(" "), what.join(", "));
    proc::run(Command::new("apt-get").arg("update").arg("-q"))?;
    proc::run(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&pkgs)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}
