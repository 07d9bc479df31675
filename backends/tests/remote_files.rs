//! toffload-remoted's files and start-up: modes of what it creates, plaintext only on
//! loopback, its command line, and a journal damaged in the middle.

mod remote_util;

use remote_util::raw::Raw;
use remote_util::{netns, *};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use toffload_accel::remote::frame::{Op, OpKind, Payload};
use toffload_accel::{Accelerator, WaitStyle};

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .mode()
        & 0o777
}

/// What a fresh daemon writes (its key, journal, cached chunks, stats) is its own:
/// 0600 files in 0700 folders, whatever the umask (which makes 0644 of a plain write).
#[test]
fn a_fresh_daemon_creates_its_files_0600() {
    let dir = TempDir::new("modes");
    let state = dir.path().join("state");
    let cache = dir.path().join("cache");
    let stats_file = dir.path().join("stats.txt");
    // The umask's default, for comparison: what the daemon wrote before.
    let plain = dir.path().join("plain");
    std::fs::write(&plain, b"x").unwrap();
    eprintln!("a plain write here is {:04o}", mode(&plain));
    let d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            state.to_str().unwrap(),
            "--cache-dir",
            cache.to_str().unwrap(),
            "--stats-file",
            stats_file.to_str().unwrap(),
        ],
        &[],
    );
    let r = client(&[d.addr()], |_| {});
    let mut buf = pattern(1, 256 << 10);
    r.run(&mut buf, WaitStyle::Block).unwrap();
    let t0 = Instant::now();
    while !stats_file.exists() {
        assert!(t0.elapsed() < Duration::from_secs(5), "no stats file");
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = std::fs::read_to_string(&stats_file).unwrap();
    assert!(text.lines().any(|l| l.starts_with("executions ")), "{text}");
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&state.join("rsa.pem")), 0o600);
    assert_eq!(mode(&state.join("journal")), 0o600);
    assert_eq!(mode(&stats_file), 0o600);
    assert_eq!(mode(&cache), 0o700);
    let mut chunks = 0;
    for part in std::fs::read_dir(&cache).unwrap() {
        let part = part.unwrap().path();
        assert_eq!(mode(&part), 0o700, "{}", part.display());
        for f in std::fs::read_dir(&part).unwrap() {
            let f = f.unwrap().path();
            assert_eq!(mode(&f), 0o600, "{}", f.display());
            chunks += 1;
        }
    }
    assert!(chunks > 0, "no chunk was cached on disk");
}

/// A link planted where the journal goes is refused, not followed.
#[test]
fn a_planted_link_is_not_followed() {
    let dir = TempDir::new("link");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    std::os::unix::fs::symlink(&victim, state.join("journal")).unwrap();
    let out = Command::new(DAEMON)
        .args(["--listen", "127.0.0.1:0", "--state-dir"])
        .arg(&state)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("symbolic links"), "{err}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
}

#[test]
fn plaintext_beyond_loopback_needs_the_flag_and_is_warned_about() {
    let out = Command::new(DAEMON)
        .args(["--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a loopback address") && err.contains("--insecure-plaintext"),
        "{err}"
    );
    let dir = TempDir::new("plain");
    let log = dir.path().join("log");
    let d = Daemon::start_logged(
        &["--listen", "0.0.0.0:0", "--insecure-plaintext"],
        &[],
        &log,
    );
    let r = client(&[d.addr()], |_| {});
    let mut buf = pattern(1, 100);
    r.run(&mut buf, WaitStyle::Block).unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let warn = text.lines().find(|l| l.contains("PLAINTEXT")).expect(&text);
    assert!(warn.contains("WARN") && warn.contains("0.0.0.0"), "{warn}");
}

#[test]
fn help_version_and_usage_errors() {
    let run = |args: &[&str]| Command::new(DAEMON).args(args).output().unwrap();
    let help = run(&["--help"]);
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--frame-assembly-mb",
        "--client-ops",
        "--client-inflight-mb",
        "--held-mb",
        "--held-age-s",
        "--max-conns",
        "--max-conns-per-peer",
        "--out-queue-mb",
        "--handshake-ms",
        "--idle-s",
        "--insecure-plaintext",
        "--stats-file",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}");
    }
    let v = run(&["--version"]);
    assert!(v.status.success());
    assert_eq!(
        String::from_utf8_lossy(&v.stdout).trim(),
        // The version and git revision every binary shares (cli/).
        format!("toffload-remoted {}", toffload_cli::VERSION)
    );
    for bad in [
        &["--bogus"][..],
        &["--client-ops", "0"],
        &["--sign-threads", "x"],
        &["--tls-cert", "/c"],
    ] {
        let out = run(bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(!out.stderr.is_empty());
    }
}

/// Finds `needle` in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .expect("record not found")
}

/// A damaged record in the middle of the journal (an acknowledgement): logged and
/// counted at restart; every record after it is recovered, so no op runs again and
/// every unacknowledged result comes back (the one whose ack was lost too).
#[test]
fn a_journal_damaged_in_the_middle_keeps_the_records_after_it() {
    let dir = TempDir::new("jdamage");
    let state = dir.path().join("state");
    let log = dir.path().join("log");
    let mut d = Daemon::start_logged(
        &[
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            state.to_str().unwrap(),
        ],
        &[],
        &log,
    );
    const ID: u64 = 0x10_0000_0001;
    let data: Vec<Vec<u8>> = (0..20).map(|i| pattern(i, 1000)).collect();
    let ops = |r: std::ops::Range<u64>| -> Vec<Op<'_>> {
        r.map(|seq| Op {
            seq,
            kind: OpKind::AesCtr,
            payload: Payload::Raw(&data[seq as usize]),
        })
        .collect()
    };
    let mut a = Raw::hello(&d.addr(), None, ID).unwrap();
    a.submit(0, &[], &ops(0..10)).unwrap();
    let mut first = a.results(10, Duration::from_secs(10));
    a.submit(0, &[0, 1, 2, 3, 4], &ops(10..20)).unwrap();
    first.extend(a.results(10, Duration::from_secs(10)));
    first.sort();
    drop(a);
    // The acks are journaled with the next flush: the second batch's results.
    d.kill();
    let path = state.join("journal");
    let mut bytes = std::fs::read(&path).unwrap();
    let mut ack2 = vec![17, 0, 0, 0, 3];
    ack2.extend_from_slice(&ID.to_le_bytes());
    ack2.extend_from_slice(&2u64.to_le_bytes());
    let at = find(&bytes, &ack2);
    bytes[at + ack2.len()] ^= 0xff; // its checksum
    std::fs::write(&path, &bytes).unwrap();
    d.restart();
    let s = stats(&d.addr());
    assert_eq!(s["journal_damaged"], 1, "{s:?}");
    assert_eq!(s["executions_total"], 20, "{s:?}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.lines()
            .any(|l| l.contains("WARN") && l.contains("damaged stretch")),
        "{text}"
    );
    // Reconnect: the held results come back (2, whose ack was lost, and 5..20).
    let mut a = Raw::hello(&d.addr(), None, ID).unwrap();
    let mut held = a.results(16, Duration::from_secs(10));
    held.sort();
    let want: Vec<_> = first
        .iter()
        .filter(|r| r.0 == 2 || r.0 >= 5)
        .cloned()
        .collect();
    assert_eq!(held, want);
    // Resending everything runs nothing again.
    a.submit(0, &[], &ops(0..20)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let s = stats(&d.addr());
    assert_eq!(s["executions"], 0, "{s:?}");
    assert_eq!(s["ops_received"], 0, "{s:?}");
}

/// A tmpfs of `kib` KiB mounted at `dir` (root only), unmounted on drop.
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    fn mount(dir: &Path, kib: u32) -> Result<SmallFs, String> {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={kib}k,mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs (needs root): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(SmallFs(dir.to_path_buf()))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// The journal's disk fills up: the daemon logs it, answers new ops EIO without
/// running them, and keeps serving (results, stats) instead of aborting as before.
#[test]
fn a_full_journal_disk_refuses_new_ops_instead_of_aborting() {
    let dir = TempDir::new("jfull");
    let state = dir.path().join("state");
    let fs = match SmallFs::mount(&state, 256) {
        Ok(f) => f,
        Err(why) => return netns::skip_or_fail(&why),
    };
    let log = dir.path().join("log");
    let mut d = Daemon::start_logged(
        &[
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            state.to_str().unwrap(),
        ],
        &[],
        &log,
    );
    let mut a = Raw::hello(&d.addr(), None, 0xf011).unwrap();
    let data = pattern(5, 8 << 10);
    let mut statuses = Vec::new();
    for seq in 0..100u64 {
        a.submit(
            seq,
            &[],
            &[Op {
                seq,
                kind: OpKind::AesCtr,
                payload: Payload::Raw(&data),
            }],
        )
        .unwrap();
        let r = a.results(1, Duration::from_secs(10));
        statuses.push(r[0].1);
        if r[0].1 == -libc::EIO {
            break;
        }
    }
    let ok = statuses.iter().filter(|s| **s == 0).count();
    eprintln!(
        "{ok} ops ran before the disk filled; the next was answered {:?}",
        statuses.last()
    );
    assert_eq!(statuses.last(), Some(&-libc::EIO), "{statuses:?}");
    assert!(ok >= 10, "{statuses:?}");
    assert_eq!(d.child.try_wait().unwrap(), None, "the daemon died");
    let s = stats(&d.addr());
    assert_eq!(s["journal_failed"], 1, "{s:?}");
    assert!(s["journal_write_errors"] >= 1, "{s:?}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.lines()
            .any(|l| l.contains("ERROR") && l.contains("journal write failed")),
        "{text}"
    );
    d.kill();
    drop(fs);
}
