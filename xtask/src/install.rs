//! `cargo xtask install [--prefix /usr/local] [--destdir D]`: builds, then installs
//! what manifest.rs lists, each file with its mode, under D+PREFIX (a staged install
//! when D is given), and prints each path. Man pages and completions come from the
//! built binaries themselves (`--generate`), so their clap definitions stay the single
//! source. The units are checked with `systemd-analyze verify` where it exists. As a
//! user without write access to the prefix, the copying (and only that) re-runs as
//! root through sudo, as cargo is not on root's PATH in a per-user rustup install.

use crate::manifest::{self, Entry, Source};
use crate::paths;
use crate::proc::{self, Result};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(clap::Args)]
pub struct Args {
    /// Where the files go: PREFIX/bin, PREFIX/lib, PREFIX/include, PREFIX/share, and
    /// the units in PREFIX/lib/systemd/system.
    #[arg(long, default_value = "/usr/local")]
    prefix: PathBuf,
    /// Stage the install under this folder (DESTDIR/PREFIX/...), as a package build
    /// does; the installed files still name PREFIX.
    #[arg(long, value_name = "DIR")]
    destdir: Option<PathBuf>,
    /// Install what target/toffload holds without building it first.
    #[arg(long)]
    no_build: bool,
}

/// One file put in place.
#[derive(Debug)]
pub struct Installed {
    pub entry: Entry,
    /// Where it is now (under DESTDIR when one was given).
    pub path: PathBuf,
}

/// Why an install stopped; `denied` when for want of permission.
#[derive(Debug)]
pub struct Failure {
    pub msg: String,
    pub denied: bool,
}

pub fn run(a: &Args) -> Result {
    if !a.prefix.is_absolute() {
        return Err(format!(
            "--prefix {}: must be an absolute path",
            a.prefix.display()
        ));
    }
    if !a.no_build {
        crate::build::all()?;
    }
    let dist = paths::dist();
    let done = match install(&dist, &a.prefix, a.destdir.as_deref()) {
        Ok(done) => done,
        Err(f) if f.denied && !proc::is_root() => {
            eprintln!("xtask: {}; installing as root (sudo)", f.msg);
            return rerun_as_root(a);
        }
        Err(f) => return Err(f.msg),
    };
    for i in &done {
        println!("installed {:o} {}", i.entry.mode, i.path.display());
    }
    println!(
        "xtask: {} files under {}",
        done.len(),
        staged_root(&a.prefix, a.destdir.as_deref()).display()
    );
    match verify_units(&done, &a.prefix, a.destdir.as_deref())? {
        Verified::Checked(n) => println!("xtask: systemd-analyze verify: {n} units ok"),
        Verified::Skipped(why) => println!("xtask: units not verified: {why}"),
    }
    Ok(())
}

/// The same install, without building again, as root.
fn rerun_as_root(a: &Args) -> Result {
    let exe = std::env::current_exe().map_err(|e| format!("finding xtask itself: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.args(["install", "--no-build", "--prefix"])
        .arg(&a.prefix);
    if let Some(d) = &a.destdir {
        cmd.arg("--destdir").arg(d);
    }
    proc::run(&mut proc::as_root(&cmd)?)
}

/// PREFIX, or DESTDIR/PREFIX.
pub fn staged_root(prefix: &Path, destdir: Option<&Path>) -> PathBuf {
    match destdir {
        Some(d) => d.join(prefix.strip_prefix("/").unwrap_or(prefix)),
        None => prefix.to_path_buf(),
    }
}

/// Installs every manifest entry from `dist` (a built target/toffload).
pub fn install(
    dist: &Path,
    prefix: &Path,
    destdir: Option<&Path>,
) -> std::result::Result<Vec<Installed>, Failure> {
    let root = staged_root(prefix, destdir);
    let mut done = Vec::new();
    for entry in manifest::entries() {
        let bytes =
            contents(&entry.source, dist, prefix).map_err(|msg| Failure { msg, denied: false })?;
        let path = root.join(&entry.dest);
        put(&path, &bytes, entry.mode).map_err(|e| Failure {
            msg: format!("installing {}: {e}", path.display()),
            denied: e.kind() == ErrorKind::PermissionDenied,
        })?;
        done.push(Installed { entry, path });
    }
    Ok(done)
}

/// The bytes an entry installs.
fn contents(src: &Source, dist: &Path, prefix: &Path) -> Result<Vec<u8>> {
    match src {
        Source::Dist(rel) => {
            let p = dist.join(rel);
            std::fs::read(&p).map_err(|e| {
                format!(
                    "reading {}: {e} (build it first: cargo xtask build)",
                    p.display()
                )
            })
        }
        Source::Generated { bin, what } => generated(&dist.join("bin").join(bin), what),
        Source::Unit(name) => {
            let p = paths::root().join(format!("xtask/packaging/systemd/{name}.in"));
            let t =
                std::fs::read_to_string(&p).map_err(|e| format!("reading {}: {e}", p.display()))?;
            // The templates' only placeholder (manifest.rs's tests hold them to it).
            let unit = t.replace("@bindir@", &prefix.join("bin").to_string_lossy());
            Ok(unit.into_bytes())
        }
    }
}

/// What `BIN --generate WHAT` prints; an error when it fails or prints nothing.
fn generated(bin: &Path, what: &str) -> Result<Vec<u8>> {
    let out = Command::new(bin)
        .args(["--generate", what])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    if !out.status.success() || out.stdout.is_empty() {
        return Err(format!(
            "{} --generate {what} failed ({}): {}",
            bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(out.stdout)
}

/// Writes through a temporary name in the same folder, sets the mode, renames: a
/// running binary being replaced keeps its old file ("text file busy" otherwise), and
/// nothing is ever seen half written or with the wrong mode.
fn put(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = path.parent().expect("a destination has a folder");
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().expect("a file name").to_string_lossy();
    let tmp = dir.join(format!(".{name}.xtask-tmp"));
    std::fs::write(&tmp, bytes)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, path)
}

pub enum Verified {
    Checked(usize),
    Skipped(String),
}

/// `systemd-analyze verify` on the installed units. Staged, they name PREFIX/bin,
/// where nothing is yet: they are checked as copies that name the staged binaries
/// instead (verify checks that ExecStart is executable) and with the staged man pages
/// (it looks up Documentation=), so the check covers the files this install wrote.
pub fn verify_units(done: &[Installed], prefix: &Path, destdir: Option<&Path>) -> Result<Verified> {
    let units: Vec<&Installed> = done
        .iter()
        .filter(|i| matches!(i.entry.source, Source::Unit(_)))
        .collect();
    if !proc::succeeds("systemd-analyze", &["--version"]) {
        return Ok(Verified::Skipped(
            "systemd-analyze is not installed (Debian: apt-get install systemd)".into(),
        ));
    }
    // A folder per call: the tests verify in parallel threads of one process.
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "toffload-verify-{}-{}",
        std::process::id(),
        CALLS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let bindir = prefix.join("bin").to_string_lossy().into_owned();
    let staged_bindir = staged_root(prefix, destdir).join("bin");
    let mut files = Vec::new();
    for u in &units {
        let text = std::fs::read_to_string(&u.path)
            .map_err(|e| format!("reading {}: {e}", u.path.display()))?;
        let copy = dir.join(u.path.file_name().expect("unit name"));
        let text = text.replace(
            &format!("{bindir}/"),
            &format!("{}/", staged_bindir.display()),
        );
        std::fs::write(&copy, text).map_err(|e| format!("writing {}: {e}", copy.display()))?;
        files.push(copy);
    }
    // verify also runs `man` on each Documentation=man: page: on the pages this
    // install wrote (MANPATH), or not at all where man is missing (--man=no).
    let mut cmd = Command::new("systemd-analyze");
    cmd.arg("verify").current_dir(&dir);
    if proc::succeeds("man", &["--version"]) {
        cmd.env("MANPATH", staged_root(prefix, destdir).join("share/man"));
    } else {
        eprintln!("xtask: no man here: the units' man pages are not looked up");
        cmd.arg("--man=no");
    }
    let out = cmd.args(&files).output();
    let _ = std::fs::remove_dir_all(&dir);
    let out = out.map_err(|e| format!("cannot run systemd-analyze: {e}"))?;
    // verify exits 0 on some complaints (an unknown key is a warning): any line about
    // our units is a failure too.
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let ours: Vec<&str> = said
        .lines()
        .filter(|l| manifest::UNITS.iter().any(|u| l.contains(u)))
        .collect();
    if !out.status.success() || !ours.is_empty() {
        return Err(format!(
            "systemd-analyze verify failed ({}):\n{}",
            out.status,
            said.trim()
        ));
    }
    Ok(Verified::Checked(units.len()))
}
