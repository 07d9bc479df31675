//! `cargo xtask install` from a user's shell: xtask itself, run as an unprivileged
//! user (nobody, through setpriv) on a prefix that user cannot write, must re-run the
//! install as root through sudo (a stand-in that records its command line), carrying
//! the TOFFLOAD_* environment, instead of failing or asking for `sudo cargo`. Needs
//! root (to become another user) and a built target/toffload; skips with the reason
//! otherwise, which under CI (TOFFLOAD_NO_SKIP=1 or CI=true) is a failure.

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
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        c.arg(format!("CARGO_TARGET_DIR={}", t.to_string_lossy()));
    }
    for (k, v) in extra {
        c.arg(format!("{k}={v}"));
    }
    c.args(args).output().expect("setpriv")
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
    let xtask = env!("CARGO_BIN_EXE_xtask");
    let tmp = std::env::temp_dir().join(format!("toffload-as-user-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let bin = tmp.join("bin");
    std::fs::create_dir_all(&bin).expect("tmp");
    // Writable by nobody: the stand-in records its arguments here.
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let record = tmp.join("sudo-args");
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
    // The installer reads the built files before it writes: nobody must reach them.
    let dist = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join("toffload/bin/toffload-watch");
    let readable = as_nobody(&bin, &[], &["test", "-r", &dist.to_string_lossy()]);
    if !readable.status.success() {
        skip(&format!(
            "{} is missing or unreadable to nobody: run `cargo xtask build`",
            dist.display()
        ));
        let _ = std::fs::remove_dir_all(&tmp);
        return;
    }
    let prefix = format!("/usr/local/toffload-as-user-test-{}", std::process::id());
    let out = as_nobody(
        &bin,
        &[("TOFFLOAD_LOG", "debug")],
        &[xtask, "install", "--no-build", "--prefix", &prefix],
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
        args.ends_with(&[xtask, "install", "--no-build", "--prefix", &prefix]),
        "{recorded}"
    );
}
