//! `cargo xtask install` from a user's shell: xtask itself, run as an unprivileged
//! user (nobody, through setpriv) on a prefix that user cannot write, must re-run the
//! install as root through sudo (a stand-in that records its command line), carrying
//! the TOFFLOAD_* environment, instead of failing or asking for `sudo cargo`. Needs
//! root (to become another user) and a built target/toffload (TOFFLOAD_DIST); skips
//! with the reason otherwise, which under CI (TOFFLOAD_NO_SKIP=1 or CI=true) is a
//! failure.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn skip(reason: &str) {
    let ci = std::env::var("TOFFLOAD_NO_SKIP").is_ok_and(|v| v == "1")
        || std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    assert!(!ci, "cannot skip under CI: {reason}");
    eprintln!("SKIP: {reason}");
}

fn uid() -> String {
    let out = Command::new("id").arg("-u").output().expect("id");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Runs `args` as nobody with only PATH (our fake sudo first) and `extra` set.
fn as_nobody(path: &Path, extra: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--",
        "env",
        "-i",
    ])
    .arg(format!("PATH={}:/usr/bin:/bin", path.display()))
    .arg("HOME=/");
    for (k, v) in extra {
        c.arg(format!("{k}={v}"));
    }
    c.args(args).output().expect("setpriv")
}

/// A copy of `src` at `dst` with `mode`.
fn copy(src: &Path, dst: &Path, mode: u32) {
    std::fs::create_dir_all(dst.parent().expect("a folder")).expect("mkdir");
    std::fs::copy(src, dst).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    std::fs::set_permissions(dst, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

#[test]
fn install_as_a_user_reruns_itself_through_sudo() {
    if uid() != "0" {
        skip("becoming an unprivileged user takes root");
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        skip("no setpriv (util-linux)");
        return;
    }
    // The built toffload-watch: the installer reads it (the manifest's first file)
    // before its first write, which is the one refused.
    let dist = std::env::var_os("TOFFLOAD_DIST")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CARGO_TARGET_DIR").map(|t| PathBuf::from(t).join("toffload")))
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/toffload"));
    let watch = dist.join("bin/toffload-watch");
    if !watch.is_file() {
        skip(&format!(
            "{} is missing: run `cargo xtask build`",
            watch.display()
        ));
        return;
    }
    // Copies in a folder nobody can reach (the checkout may be under a home that
    // nobody cannot enter): xtask itself, and the dist file as CARGO_TARGET_DIR's.
    let tmp = std::env::temp_dir().join(format!("toffload-as-user-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let xtask = tmp.join("xtask");
    copy(Path::new(env!("CARGO_BIN_EXE_xtask")), &xtask, 0o755);
    copy(
        &watch,
        &tmp.join("target/toffload/bin/toffload-watch"),
        0o755,
    );
    let bin = tmp.join("bin");
    // Writable by nobody: the stand-in records its arguments here.
    let rec = tmp.join("rec");
    std::fs::create_dir_all(&rec).expect("tmp");
    std::fs::set_permissions(&rec, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let record = rec.join("sudo-args");
    std::fs::create_dir_all(&bin).expect("tmp");
    let sudo = bin.join("sudo");
    std::fs::write(
        &sudo,
        format!(
            "#!/bin/sh\n[ \"$1\" = --version ] && exit 0\nprintf '%s\\n' \"$@\" > {}\n",
            record.display()
        ),
    )
    .expect("fake sudo");
    std::fs::set_permissions(&sudo, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let prefix = format!("/usr/local/toffload-as-user-test-{}", std::process::id());
    let target = tmp.join("target").to_string_lossy().into_owned();
    let xtask = xtask.to_string_lossy().into_owned();
    let out = as_nobody(
        &bin,
        &[("TOFFLOAD_LOG", "debug"), ("CARGO_TARGET_DIR", &target)],
        &[&xtask, "install", "--no-build", "--prefix", &prefix],
    );
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    let recorded = std::fs::read_to_string(&record).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&tmp);
    assert!(out.status.success(), "xtask install as nobody: {said}");
    assert!(said.contains("installing as root (sudo)"), "{said}");
    assert!(!Path::new(&prefix).exists(), "nobody created {prefix}");
    let args: Vec<&str> = recorded.lines().collect();
    assert_eq!(args.get(..2), Some(&["--", "env"][..]), "{recorded}");
    assert!(args.contains(&"TOFFLOAD_LOG=debug"), "{recorded}");
    assert!(
        args.contains(&format!("CARGO_TARGET_DIR={target}").as_str()),
        "{recorded}"
    );
    assert!(
        args.ends_with(&[&xtask, "install", "--no-build", "--prefix", &prefix]),
        "{recorded}"
    );
}
