//! `cargo xtask install --destdir` checked against the manifest, on the binaries and
//! libraries a `cargo xtask build` left in the dist folder (TOFFLOAD_DIST, else
//! target/toffload): every file where manifest.rs says, with its mode and nothing
//! else beside it; the man pages rendered by groff (or mandoc) without a warning; the
//! completions naming each program's flags and passing the shell's syntax check; the
//! units naming the prefix and passing `systemd-analyze verify`; `--version` of the
//! installed binaries, and of every Rust binary of the dist folder, naming the
//! version and a commit of this repository. Without a
//! built dist it skips with the reason, which under CI (TOFFLOAD_NO_SKIP=1 or
//! CI=true) is a failure.

use crate::install::{self, Installed, Verified};
use crate::manifest::{self, Source};
use crate::paths;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

fn no_skip() -> bool {
    std::env::var("TOFFLOAD_NO_SKIP").is_ok_and(|v| v == "1") || crate::test::under_ci()
}

/// Prints why the test does not run, or fails it where skipping is not allowed.
fn skip(reason: &str) {
    assert!(!no_skip(), "cannot skip under CI: {reason}");
    eprintln!("SKIP: {reason}");
}

fn dist() -> PathBuf {
    std::env::var_os("TOFFLOAD_DIST")
        .map(PathBuf::from)
        .unwrap_or_else(paths::dist)
}

/// The dist folder when it holds every file the manifest takes from it.
fn built_dist() -> Option<PathBuf> {
    let d = dist();
    for e in manifest::entries() {
        if let Source::Dist(rel) = &e.source {
            if !d.join(rel).is_file() {
                skip(&format!(
                    "{} is missing: run `cargo xtask build`",
                    d.join(rel).display()
                ));
                return None;
            }
        }
    }
    Some(d)
}

/// A fresh folder for one test, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        // Tests run in parallel threads of one process: a number each.
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("toffload-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temporary folder");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every file under `dir`.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("readable").flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}

fn run(cmd: &mut Command) -> (bool, String, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn exists(prog: &str) -> bool {
    Command::new(prog).arg("--version").output().is_ok()
}

/// A flag each program's man page and completions must name (one of its own).
fn a_flag_of(bin: &str) -> &'static str {
    match bin {
        "toffload-watch" => "--overhead-budget",
        "toffload-remoted" => "--state-dir",
        "toffload-load" => "--conns",
        other => panic!("no flag known for {other}: add it here"),
    }
}

const PREFIX: &str = "/opt/toffload";

/// One staged install shared by the checks below.
fn staged() -> Option<(TempDir, Vec<Installed>)> {
    let dist = built_dist()?;
    let tmp = TempDir::new("install-test");
    let done = install::install(&dist, Path::new(PREFIX), Some(&tmp.0))
        .unwrap_or_else(|f| panic!("install: {}", f.msg));
    Some((tmp, done))
}

#[test]
fn every_manifest_file_lands_where_it_says_with_its_mode() {
    let Some((tmp, done)) = staged() else {
        return;
    };
    let root = tmp.0.join(PREFIX.trim_start_matches('/'));
    let entries = manifest::entries();
    assert_eq!(done.len(), entries.len());
    for e in &entries {
        let p = root.join(&e.dest);
        let meta = std::fs::metadata(&p).unwrap_or_else(|err| panic!("{}: {err}", p.display()));
        assert!(meta.is_file() && meta.len() > 0, "{}", p.display());
        assert_eq!(
            meta.permissions().mode() & 0o7777,
            e.mode,
            "mode of {}",
            p.display()
        );
        if let Source::Dist(rel) = &e.source {
            assert!(
                std::fs::read(&p).expect("installed")
                    == std::fs::read(dist().join(rel)).expect("built"),
                "{} differs from its source",
                p.display()
            );
        }
    }
    // Nothing else: no temporary file left, nothing outside the manifest.
    let mut all = Vec::new();
    walk(&tmp.0, &mut all);
    let mut want: Vec<PathBuf> = entries.iter().map(|e| root.join(&e.dest)).collect();
    all.sort();
    want.sort();
    assert_eq!(all, want);
}

#[test]
fn man_pages_render_and_completions_name_the_flags() {
    let Some((tmp, done)) = staged() else {
        return;
    };
    let renderer = ["groff", "mandoc"].into_iter().find(|r| exists(r));
    match renderer {
        Some(r) => eprintln!("man pages rendered with {r}"),
        None => eprintln!("neither groff nor mandoc: man pages checked as roff text only"),
    }
    let mut shells_checked = Vec::new();
    for i in &done {
        let Source::Generated { bin, what } = i.entry.source else {
            continue;
        };
        let text = std::fs::read_to_string(&i.path).expect("installed");
        let flag = a_flag_of(bin);
        match what {
            "man" => {
                assert!(
                    text.contains(&format!(".TH {bin} 1")),
                    "{}",
                    i.path.display()
                );
                let shown = match renderer {
                    Some("groff") => {
                        // -ww: every warning; -P-cbou: plain text, no overstriking.
                        let (ok, out, err) = run(Command::new("groff")
                            .args(["-man", "-Tutf8", "-ww", "-P-cbou"])
                            .arg(&i.path));
                        assert!(ok && err.is_empty(), "groff on {}: {err}", i.path.display());
                        out
                    }
                    Some(_) => {
                        let (ok, out, err) = run(Command::new("mandoc")
                            .args(["-W", "warning", "-T", "utf8"])
                            .arg(&i.path));
                        assert!(
                            ok && err.is_empty(),
                            "mandoc on {}: {err}",
                            i.path.display()
                        );
                        out
                    }
                    // Minimal roff: the flags are written with escaped hyphens.
                    None => text.replace("\\-", "-"),
                };
                assert!(shown.contains("NAME") && shown.contains(bin), "{shown}");
                assert!(
                    shown.contains(flag),
                    "{} lacks {flag}:\n{shown}",
                    i.path.display()
                );
                assert!(
                    !shown.contains("--generate"),
                    "the hidden flag shows: {}",
                    i.path.display()
                );
            }
            _ => {
                assert!(text.contains(bin), "{}", i.path.display());
                assert!(
                    text.contains(flag) || text.contains(flag.trim_start_matches('-')),
                    "{} lacks {flag}",
                    i.path.display()
                );
                if bin == "toffload-watch" {
                    assert!(
                        text.contains("run"),
                        "{} lacks the run subcommand",
                        i.path.display()
                    );
                }
                let shell = what.trim_start_matches("complete-");
                // The shell's own syntax check, where the shell is here.
                let check: &[&str] = match shell {
                    "fish" => &["--no-execute"],
                    _ => &["-n"],
                };
                if exists(shell) {
                    let (ok, _, err) = run(Command::new(shell).args(check).arg(&i.path));
                    assert!(ok, "{shell} {check:?} {}: {err}", i.path.display());
                    shells_checked.push(shell);
                }
            }
        }
    }
    shells_checked.dedup();
    eprintln!("completion syntax checked by: {shells_checked:?} (others not installed here)");
    drop(tmp);
}

#[test]
fn units_name_the_prefix_and_verify() {
    let Some((tmp, done)) = staged() else {
        return;
    };
    let unit = |name: &str| {
        let i = done
            .iter()
            .find(|i| matches!(i.entry.source, Source::Unit(_)) && i.path.ends_with(name))
            .expect("installed");
        std::fs::read_to_string(&i.path).expect("installed")
    };
    assert!(unit("toffload-watch.service").contains(&format!(
        "\nExecStart={PREFIX}/bin/toffload-watch serve --config /etc/toffload/watch.toml\n"
    )));
    assert!(unit("toffload-remoted.service").contains(&format!(
        "\nExecStart={PREFIX}/bin/toffload-remoted --listen "
    )));
    match install::verify_units(&done, Path::new(PREFIX), Some(&tmp.0))
        .unwrap_or_else(|e| panic!("{e}"))
    {
        Verified::Checked(n) => assert_eq!(n, manifest::UNITS.len()),
        Verified::Skipped(why) => skip(&format!("units not verified: {why}")),
    }
}

#[test]
fn a_broken_unit_fails_verification() {
    // The check above passing means something only if verify can fail here.
    let Some((tmp, done)) = staged() else {
        return;
    };
    let i = done
        .iter()
        .find(|i| matches!(i.entry.source, Source::Unit(_)))
        .expect("a unit");
    let text = std::fs::read_to_string(&i.path).expect("installed");
    std::fs::write(&i.path, text.replace("Type=simple", "Type=sometimes")).expect("rewritten");
    match install::verify_units(&done, Path::new(PREFIX), Some(&tmp.0)) {
        Err(e) => assert!(e.contains("sometimes"), "{e}"),
        Ok(Verified::Checked(_)) => panic!("a unit with Type=sometimes verified"),
        Ok(Verified::Skipped(why)) => skip(&format!("units not verified: {why}")),
    }
}

#[test]
fn installed_binaries_print_version_and_revision() {
    let Some((_tmp, done)) = staged() else {
        return;
    };
    for i in done.iter().filter(|i| i.entry.dest.starts_with("bin/")) {
        check_version(&i.path);
    }
}

#[test]
fn every_built_binary_prints_version_and_revision() {
    // The ones not installed too (demo, table, benches): --version is on all of them.
    let Some(dist) = built_dist() else {
        return;
    };
    for b in crate::build::RUST_BINS {
        check_version(&dist.join("bin").join(b));
    }
}

/// `BIN --version` prints "BIN VERSION (rev R)", R a commit of this repository (with
/// "+dirty" or not) or "unknown".
fn check_version(path: &Path) {
    let bin = path
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let (ok, out, err) = run(Command::new(path).arg("--version"));
    assert!(ok, "{} --version: {err}", path.display());
    let rest = out
        .trim()
        .strip_prefix(&format!("{bin} {} (rev ", env!("CARGO_PKG_VERSION")))
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{bin} --version printed {out:?}"));
    if rest == "unknown" {
        return;
    }
    let hash = rest.strip_suffix("+dirty").unwrap_or(rest);
    assert!(
        hash.len() >= 7 && hash.chars().all(|c| c.is_ascii_hexdigit()),
        "{out}"
    );
    // A commit of this repository (where the tests run from a checkout).
    let (ok, _, err) = run(Command::new("git").arg("-C").arg(paths::root()).args([
        "cat-file",
        "-e",
        &format!("{hash}^{{commit}}"),
    ]));
    assert!(ok, "{bin} --version names {hash}, not a commit here: {err}");
}
