//! Embeds the git revision of the tree being built (TOFFLOAD_GIT_REV, read by
//! src/lib.rs) so that every binary's --version names it. This is the one place the
//! revision is computed: every binary takes it from this crate.

use std::path::Path;
use std::process::Command;

fn main() {
    let dir = env!("CARGO_MANIFEST_DIR");
    println!("cargo::rustc-env=TOFFLOAD_GIT_REV={}", revision(dir));
    // Rerun when a commit, a checkout or a staging changes what the revision says.
    // Not on every edit of a source file: each rerun rebuilds every crate with a binary
    // (this crate is beneath them all), so an edit not yet staged after a clean build
    // still reads as clean until the next `git add` or commit.
    // Missing paths are left out: cargo would rerun on every build for them.
    let mut watched = false;
    for p in ["HEAD", "index", "packed-refs"]
        .into_iter()
        .map(String::from)
        .chain(git(dir, &["symbolic-ref", "-q", "HEAD"]))
    {
        if let Some(path) = git(
            dir,
            &["rev-parse", "--path-format=absolute", "--git-path", &p],
        ) {
            if Path::new(&path).exists() {
                println!("cargo::rerun-if-changed={path}");
                watched = true;
            }
        }
    }
    if !watched {
        // Not in a git checkout: nothing can change the answer but this script.
        println!("cargo::rerun-if-changed=build.rs");
    }
}

/// The short hash of HEAD, with "+dirty" when tracked files differ from it (as `git
/// describe --dirty`, untracked files do not count); "unknown" outside a git checkout
/// or without git.
fn revision(dir: &str) -> String {
    let Some(hash) = git(dir, &["rev-parse", "--short", "HEAD"]) else {
        return "unknown".into();
    };
    match git(dir, &["status", "--porcelain", "--untracked-files=no"]) {
        Some(s) if s.is_empty() => hash,
        Some(_) => format!("{hash}+dirty"),
        // HEAD resolved but the status did not: say so rather than claim a clean tree.
        None => format!("{hash}+unknown"),
    }
}

/// The trimmed stdout of a successful git command in `dir`.
fn git(dir: &str, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}
