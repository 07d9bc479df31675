//! The calibration kept for the rest of the boot: measuring what the watch costs per
//! event runs loops that take a few tens of ms of CPU beside the target (on a 2-core
//! VM, stock nginx and redis-server lost half their requests for a quarter second to
//! it at every start). What it measures belongs to the machine, the kernel and this
//! build of the watcher (its programs are embedded), so a start reuses a measurement
//! taken under the same three, and `--recalibrate` measures afresh.
//!
//! The file is root's (the watcher runs as root) under /run, a tmpfs that a reboot
//! empties; anything unreadable, foreign or stale there is ignored and replaced.

use crate::probe_cost::ProbeCost;
use serde::{Deserialize, Serialize};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Where the measurement is kept (overridable for tests).
pub const DIR_ENV: &str = "TOFFLOAD_WATCH_CACHE_DIR";
const DEFAULT_DIR: &str = "/run/toffload";
const FILE: &str = "calibration.json";
/// A measurement older than this is taken again (a host's load and frequency settle
/// differently over a day; a fresh one is cheap next to that).
const MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// What a measurement is valid for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Key {
    pub boot_id: String,
    pub kernel: String,
    /// The watcher's executable: size and modification time (ns), which change with
    /// every build and so with the embedded programs.
    pub exe: String,
}

impl Key {
    /// This boot, kernel and executable; None where one of them cannot be read.
    pub fn current() -> Option<Key> {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
        let m = std::fs::metadata("/proc/self/exe").ok()?;
        Some(Key {
            boot_id: boot_id.trim().to_string(),
            kernel: kernel.trim().to_string(),
            exe: format!("{}:{}.{:09}", m.size(), m.mtime(), m.mtime_nsec()),
        })
    }
}

/// One kept measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub key: Key,
    /// Unix seconds when it was measured.
    pub at: u64,
    pub probe_cost: ProbeCost,
    pub switch_us: Option<f64>,
}

fn dir() -> PathBuf {
    std::env::var_os(DIR_ENV).map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The kept measurement for `key`, if there is a valid one.
pub fn load(key: &Key) -> Option<Entry> {
    load_from(&dir(), key, now_secs())
}

fn load_from(dir: &Path, key: &Key, now: u64) -> Option<Entry> {
    let path = dir.join(FILE);
    let m = std::fs::symlink_metadata(&path).ok()?;
    // Only a plain file of this user's that no one else may write: anything else in
    // a shared directory could feed the budget a cost of someone else's choosing.
    // SAFETY: no arguments.
    let uid = unsafe { libc::geteuid() };
    if !m.file_type().is_file() || m.uid() != uid || m.mode() & 0o022 != 0 {
        return None;
    }
    let e: Entry = serde_json::from_slice(&std::fs::read(&path).ok()?).ok()?;
    let fresh = now.saturating_sub(e.at) <= MAX_AGE.as_secs() && e.at <= now + 60;
    let sane = [
        e.probe_cost.syscall_ns,
        e.probe_cost.switch_ns,
        e.probe_cost.offload_ns,
        e.probe_cost.handoff_ns,
    ]
    .iter()
    .all(|v| v.is_finite() && (0.0..1e7).contains(v));
    (e.key == *key && fresh && sane).then_some(e)
}

/// Keeps a measurement; a failure to write only means the next start measures again.
pub fn store(key: &Key, probe_cost: ProbeCost, switch_us: Option<f64>) {
    let e = Entry {
        key: key.clone(),
        at: now_secs(),
        probe_cost,
        switch_us,
    };
    let _ = store_in(&dir(), &e);
}

fn store_in(dir: &Path, e: &Entry) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)?;
    // Written aside and renamed, so that a reader never sees half a file.
    let tmp = dir.join(format!(".{FILE}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&tmp)?;
    std::io::Write::write_all(&mut f, &serde_json::to_vec(e)?)?;
    drop(f);
    std::fs::rename(&tmp, dir.join(FILE))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(at: u64) -> Entry {
        Entry {
            key: Key {
                boot_id: "b".into(),
                kernel: "k".into(),
                exe: "1:2.000000003".into(),
            },
            at,
            probe_cost: ProbeCost {
                syscall_ns: 150.0,
                switch_ns: 600.0,
                offload_ns: 1500.0,
                handoff_ns: 2500.0,
                idle_wake_ns: 0.0,
                host_syscall_ns: 0.0,
            },
            switch_us: Some(2.5),
        }
    }

    #[test]
    fn kept_for_the_same_key_only_and_while_fresh() {
        let d = std::env::temp_dir().join(format!("toffload-calib-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let e = entry(1_000_000);
        assert_eq!(load_from(&d, &e.key, 1_000_000), None, "nothing kept yet");
        store_in(&d, &e).unwrap();
        assert_eq!(load_from(&d, &e.key, 1_000_010), Some(e.clone()));
        let mut other = e.key.clone();
        other.boot_id = "another boot".into();
        assert_eq!(load_from(&d, &other, 1_000_010), None, "another boot");
        let mut rebuilt = e.key.clone();
        rebuilt.exe = "1:9.000000000".into();
        assert_eq!(load_from(&d, &rebuilt, 1_000_010), None, "another build");
        let stale = 1_000_000 + MAX_AGE.as_secs() + 1;
        assert_eq!(load_from(&d, &e.key, stale), None, "too old");
        // Garbage and a file others may write are both ignored.
        std::fs::write(d.join(FILE), b"{not json").unwrap();
        assert_eq!(load_from(&d, &e.key, 1_000_010), None);
        store_in(&d, &e).unwrap();
        std::fs::set_permissions(
            d.join(FILE),
            std::os::unix::fs::PermissionsExt::from_mode(0o666),
        )
        .unwrap();
        assert_eq!(load_from(&d, &e.key, 1_000_010), None, "world-writable");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn an_absurd_cost_is_not_reused() {
        let d = std::env::temp_dir().join(format!("toffload-calib-absurd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let mut e = entry(5);
        e.probe_cost.switch_ns = -1.0;
        store_in(&d, &e).unwrap();
        assert_eq!(load_from(&d, &e.key, 6), None);
        let _ = std::fs::remove_dir_all(&d);
    }
}
