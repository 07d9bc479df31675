//! The fiber runtime travels inside the watcher (build.rs embeds libtoffload.so), so
//! the user never names a path. Injection writes it once to a root-owned directory
//! every user can read, in a directory named by its content hash (the file keeps the
//! name libtoffload.so, by which the watcher recognises the runtime in a target's
//! mappings): a server still running an older copy keeps it, and an unchanged copy is
//! reused.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

static RUNTIME: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libtoffload.so"));

/// Where the copies live (TOFFLOAD_RUNTIME_DIR overrides, for tests and non-root use).
pub fn dir() -> PathBuf {
    std::env::var_os("TOFFLOAD_RUNTIME_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/toffload"))
}

pub fn embedded() -> Option<&'static [u8]> {
    (!RUNTIME.is_empty()).then_some(RUNTIME)
}

/// FNV-1a, 64 bits: a name, not a defence (the directory is root's).
fn hash(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &c| {
        (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The path the runtime will have, without writing it (for --dry-run).
pub fn path() -> Result<PathBuf, String> {
    let bytes = embedded().ok_or_else(missing)?;
    Ok(dir()
        .join(format!("{:016x}", hash(bytes)))
        .join("libtoffload.so"))
}

fn missing() -> String {
    "this toffload-watch was built without the fiber runtime (libtoffload.so): run \
     `cargo xtask build`, which links the runtime before it builds the watcher"
        .to_string()
}

/// Writes the runtime (if not already there) and returns its path.
pub fn install() -> Result<PathBuf, String> {
    let bytes = embedded().ok_or_else(missing)?;
    let dst = path()?;
    if std::fs::read(&dst).is_ok_and(|b| b == bytes) {
        return Ok(dst);
    }
    let d = dst.parent().expect("a directory");
    std::fs::create_dir_all(d).map_err(|e| format!("creating {}: {e}", d.display()))?;
    for p in [d, &dir()] {
        let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755));
    }
    write_atomically(&dst, bytes)?;
    Ok(dst)
}

fn write_atomically(dst: &Path, bytes: &[u8]) -> Result<(), String> {
    let tmp = dst.with_file_name(format!(".libtoffload.so.tmp{}", std::process::id()));
    let r = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.set_permissions(std::fs::Permissions::from_mode(0o755))?;
        f.sync_all()?;
        std::fs::rename(&tmp, dst)
    })();
    r.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("writing {}: {e}", dst.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable_and_content_dependent() {
        assert_eq!(hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_ne!(hash(b"a"), hash(b"b"));
    }
}
