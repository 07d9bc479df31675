//! `toffload-watch run -- CMD ARGS...`: the command is forked and held before exec
//! until its pid is in the kernel filter and its offload entry points are probed (by
//! the files its dynamic loader will map, and those of the programs a wrapper in
//! front of it will exec: `programs`), so nothing it does is missed. A bare
//! fork + execv: std's Command::spawn waits for the exec, which a held child never
//! reaches.

use crate::error::WatchError;
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// A started command, held before exec until `release`.
pub struct Held {
    pid: i32,
    pub exe: PathBuf,
    gate: i32,
    reaped: bool,
}

/// The program's path: as given when it has a slash, else found on PATH.
pub fn resolve(prog: &str) -> Result<PathBuf, WatchError> {
    if prog.contains('/') {
        let p = PathBuf::from(prog);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(WatchError::Spawn(format!("{prog}: no such file")))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| is_executable(p))
        .ok_or_else(|| WatchError::Spawn(format!("{prog}: not found on PATH")))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The programs a command line may run: the command itself and every later word
/// that names an executable file (as given with a slash, else on PATH). A wrapper
/// (taskset, env, nice, numactl, chrt, timeout, stdbuf...) execs the program it
/// names, and that program's offload calls begin before the watch next reads the
/// process's mappings; naming a program that is never run only scans its files.
/// A program started through a shell string (`sh -c "..."`) is not seen here; the
/// mappings bring it in at the next read.
pub fn programs(argv: &[String]) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = Vec::new();
    for (i, word) in argv.iter().enumerate() {
        let found = if i == 0 {
            resolve(word).ok()
        } else if word.starts_with('-') || word.contains('=') {
            None
        } else {
            resolve(word).ok().filter(|p| is_executable(p) && is_elf(p))
        };
        if let Some(p) = found {
            let p = std::fs::canonicalize(&p).unwrap_or(p);
            if !v.contains(&p) {
                v.push(p);
            }
        }
    }
    v
}

/// A later word is taken for a program only when its file is an ELF object: an
/// executable data file or script named as an argument is not run by a wrapper.
fn is_elf(p: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == *b"\x7fELF"
}

pub fn start(argv: &[String]) -> Result<Held, WatchError> {
    let prog = argv
        .first()
        .ok_or_else(|| WatchError::Spawn("no command given".into()))?;
    let exe = resolve(prog)?;
    let cstr = |s: &str| {
        CString::new(s).map_err(|_| WatchError::Spawn(format!("{s:?} contains a NUL byte")))
    };
    let c_exe = cstr(&exe.to_string_lossy())?;
    let c_args: Vec<CString> = argv.iter().map(|a| cstr(a)).collect::<Result<_, _>>()?;
    let mut c_argv: Vec<*const libc::c_char> = c_args.iter().map(|a| a.as_ptr()).collect();
    c_argv.push(std::ptr::null());
    let mut fds = [0i32; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(WatchError::Spawn(format!(
            "pipe: {}",
            std::io::Error::last_os_error()
        )));
    }
    let (r, w) = (fds[0], fds[1]);
    // SAFETY: the child only makes async-signal-safe calls (close, read, execv,
    // write, _exit) on memory prepared before the fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let e = std::io::Error::last_os_error();
        // SAFETY: our own descriptors.
        unsafe {
            libc::close(r);
            libc::close(w);
        }
        return Err(WatchError::Spawn(format!("fork: {e}")));
    }
    if pid == 0 {
        // SAFETY: see above.
        unsafe {
            libc::close(w);
            let mut b = 0u8;
            // Blocks until the watcher writes (go) or exits (EOF).
            loop {
                let n = libc::read(r, (&mut b as *mut u8).cast(), 1);
                if n == 1 {
                    break;
                }
                if n == 0 || *libc::__errno_location() != libc::EINTR {
                    libc::_exit(127);
                }
            }
            libc::execv(c_exe.as_ptr(), c_argv.as_ptr());
            let msg = b"toffload-watch: exec failed\n";
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::_exit(127);
        }
    }
    // SAFETY: our read end; the child has its own copy.
    unsafe { libc::close(r) };
    Ok(Held {
        pid,
        exe: std::fs::canonicalize(&exe).unwrap_or(exe),
        gate: w,
        reaped: false,
    })
}

impl Held {
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// Lets the command exec.
    pub fn release(&mut self) {
        if self.gate >= 0 {
            // SAFETY: our write end; one byte.
            unsafe {
                libc::write(self.gate, b"g".as_ptr().cast(), 1);
                libc::close(self.gate);
            }
            self.gate = -1;
        }
    }

    pub fn kill(&self) {
        if !self.reaped {
            // SAFETY: signalling our own unreaped child.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
    }

    /// Waits for the command; its wait status as text.
    pub fn wait(&mut self) -> String {
        if self.reaped {
            return "already reaped".into();
        }
        let mut st = 0;
        // SAFETY: our own child.
        let r = unsafe { libc::waitpid(self.pid, &mut st, 0) };
        self.reaped = true;
        if r < 0 {
            return format!("wait failed: {}", std::io::Error::last_os_error());
        }
        if libc::WIFEXITED(st) {
            format!("exited with status {}", libc::WEXITSTATUS(st))
        } else if libc::WIFSIGNALED(st) {
            format!("killed by signal {}", libc::WTERMSIG(st))
        } else {
            format!("wait status {st}")
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.gate >= 0 {
            // Never released: the watch failed; the command must not run unwatched.
            self.kill();
            // SAFETY: our write end.
            unsafe { libc::close(self.gate) };
        }
        if !self.reaped {
            let _ = self.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn a_wrappers_program_is_planned_with_it() {
        let sh = std::fs::canonicalize(resolve("sh").unwrap()).unwrap();
        let cat = std::fs::canonicalize(resolve("cat").unwrap()).unwrap();
        let env = std::fs::canonicalize(resolve("env").unwrap()).unwrap();
        // Flags, assignments, numbers and files that are no ELF objects (executable
        // or not) are no programs.
        let v = programs(&words("env -i A=1 sh 0 /etc/hostname cat -c"));
        assert_eq!(v, vec![env, sh, cat.clone()]);
        // Named twice, planned once.
        assert_eq!(programs(&words("cat cat")), vec![cat]);
        assert!(programs(&words("no-such-program-here")).is_empty());
    }
}
