//! Files the daemon writes hold secrets (its RSA key) or clients' data (journal, cached
//! chunks): they are created 0600, never through a symbolic link, and a secret the
//! daemon reads (a PSK file) must not be open to other users.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Mode of every file the daemon creates.
pub const FILE_MODE: u32 = 0o600;
/// Mode of the folders it creates (state, cache, cache partitions).
pub const DIR_MODE: u32 = 0o700;

fn private() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    o
}

/// Creates `dir` and its missing parents, 0700 (an existing one keeps its mode).
pub fn create_dir(dir: &Path) -> io::Result<()> {
    DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir)
}

/// Opens `path` for reading and writing, creating it 0600; a symbolic link there is an
/// error (ELOOP), and an existing file is narrowed to 0600.
pub fn open_rw(path: &Path) -> io::Result<File> {
    let f = private()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
    Ok(f)
}

/// A new file at `path` (a stale one, e.g. from a killed write, is replaced; a link is
/// removed, never followed).
pub fn create_new(path: &Path) -> io::Result<File> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    private().write(true).create_new(true).open(path)
}

/// Writes `bytes` to `path` atomically: a 0600 temporary file renamed over it.
pub fn write_atomic(path: &Path, tmp: &Path, bytes: &[u8], sync: bool) -> io::Result<()> {
    let r = (|| {
        let mut f = create_new(tmp)?;
        f.write_all(bytes)?;
        if sync {
            f.sync_data()?;
        }
        std::fs::rename(tmp, path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    r
}

pub use super::tls_client::check_secret;

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn creates_0600_and_never_follows_a_link() {
        let dir = std::env::temp_dir().join(format!("toffload_files_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        create_dir(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, DIR_MODE);
        let p = dir.join("a");
        write_atomic(&p, &dir.join("a.tmp"), b"x", false).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, FILE_MODE);
        // A link planted where the journal goes: refused, its target untouched.
        let target = dir.join("target");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.join("journal");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = open_rw(&link).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        // A link planted as the temporary file is removed, not written through.
        std::os::unix::fs::symlink(&target, dir.join("b.tmp")).unwrap();
        write_atomic(&dir.join("b"), &dir.join("b.tmp"), b"new", false).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        // An existing file is narrowed.
        let wide = dir.join("wide");
        std::fs::write(&wide, b"").unwrap();
        std::fs::set_permissions(&wide, std::fs::Permissions::from_mode(0o644)).unwrap();
        drop(open_rw(&wide).unwrap());
        assert_eq!(std::fs::metadata(&wide).unwrap().mode() & 0o777, FILE_MODE);
        // Secrets: 0644 refused with the fix in the message, 0600 accepted.
        std::fs::set_permissions(&wide, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = check_secret(&wide, "PSK file").unwrap_err();
        assert!(e.contains("mode 0644") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&wide, std::fs::Permissions::from_mode(0o600)).unwrap();
        check_secret(&wide, "PSK file").unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
