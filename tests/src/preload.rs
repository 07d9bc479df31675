//! Running programs under the fiber runtime (libtoffload.so, LD_PRELOAD) for the
//! runtime's correctness suite: every child bounded by a timeout and killed with its
//! whole process group when it runs past it, stdout and stderr captured, `key=value`
//! fields parsed from stdout, the runtime's TOFFLOAD_STATS file read back, and small
//! C libraries compiled on the fly (naive interposers, extra offload rows).

use crate::harness::{self, ServerSpec};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// dist/lib/libtoffload.so, or why it cannot be used.
pub fn libtoffload() -> Result<PathBuf, String> {
    let p = harness::dist().join("lib").join("libtoffload.so");
    if p.exists() {
        Ok(p)
    } else {
        Err(format!(
            "{} is missing: run `cargo xtask build`",
            p.display()
        ))
    }
}

/// True when the runtime and the named programs are built; otherwise skips (an error
/// under CI) and returns false.
pub fn ready(programs: &[&str]) -> bool {
    if let Err(e) = libtoffload() {
        harness::skip(&e);
        return false;
    }
    for p in programs {
        if let Err(e) = harness::bin(p) {
            harness::skip(&e);
            return false;
        }
    }
    true
}

/// Variables of the runtime, the device and the test programs that must never leak
/// from the environment of `cargo test` into a child: each run states its own.
fn inherited_noise(key: &str) -> bool {
    key == "LD_PRELOAD"
        || (key.starts_with("TOFFLOAD_") && key != "TOFFLOAD_DIST" && key != "TOFFLOAD_NO_SKIP")
}

/// One program run: what to start, with which environment and preloads, for how long.
#[derive(Clone, Debug)]
pub struct Run {
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(String, String)>,
    preload: Vec<PathBuf>,
    timeout: Duration,
}

impl Run {
    /// A program from dist/bin (`cargo xtask build` puts tests/programs/*.c there).
    pub fn bin(name: &str) -> Result<Run, String> {
        Ok(Run::path(harness::bin(name)?))
    }

    /// Any executable (e.g. /bin/ls).
    pub fn path(p: impl Into<PathBuf>) -> Run {
        Run {
            program: p.into(),
            args: Vec::new(),
            env: Vec::new(),
            preload: Vec::new(),
            timeout: Duration::from_secs(20),
        }
    }

    pub fn arg(mut self, a: impl Into<OsString>) -> Run {
        self.args.push(a.into());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, a: I) -> Run {
        self.args.extend(a.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, k: &str, v: impl Into<String>) -> Run {
        self.env.push((k.into(), v.into()));
        self
    }

    /// Adds a library to LD_PRELOAD (in order).
    pub fn preload(mut self, lib: impl Into<PathBuf>) -> Run {
        self.preload.push(lib.into());
        self
    }

    /// Preloads libtoffload.so (panics if it is missing: check [`libtoffload`] first).
    pub fn runtime(self) -> Run {
        let lib = libtoffload().unwrap_or_else(|e| panic!("{e}"));
        self.preload(lib)
    }

    pub fn timeout(mut self, d: Duration) -> Run {
        self.timeout = d;
        self
    }

    /// What this run is, for messages: `ENV=.. program args`.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        if !self.preload.is_empty() {
            s.push_str(&format!("LD_PRELOAD={} ", self.preload_value()));
        }
        for (k, v) in &self.env {
            s.push_str(&format!("{k}={v} "));
        }
        s.push_str(&self.program.display().to_string());
        for a in &self.args {
            s.push(' ');
            s.push_str(&a.to_string_lossy());
        }
        s
    }

    fn preload_value(&self) -> String {
        self.preload
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    }

    /// Runs it to the end or to the timeout (then SIGKILL to its process group).
    pub fn run(&self) -> Outcome {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args);
        for (k, _) in std::env::vars_os() {
            if inherited_noise(&k.to_string_lossy()) {
                cmd.env_remove(&k);
            }
        }
        if !self.preload.is_empty() {
            cmd.env("LD_PRELOAD", self.preload_value());
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let what = self.describe();
        let t0 = Instant::now();
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let pid = child.id() as i32;
        let reader = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = r.read_to_end(&mut v);
                String::from_utf8_lossy(&v).into_owned()
            })
        };
        let out = reader(Box::new(child.stdout.take().expect("piped")));
        let err = reader(Box::new(child.stderr.take().expect("piped")));
        let mut timed_out = false;
        loop {
            if exited_unreaped(pid) {
                break;
            }
            if t0.elapsed() >= self.timeout {
                timed_out = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let elapsed = t0.elapsed();
        // The group id stays valid while the child is unreaped: kill what is left
        // (everything on a timeout; stray grandchildren otherwise).
        // SAFETY: signalling a process group we created.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        let status = child.wait().expect("wait");
        let stdout = out.join().unwrap_or_default();
        let stderr = err.join().unwrap_or_default();
        Outcome {
            what,
            status,
            timed_out,
            stdout,
            stderr,
            elapsed,
        }
    }
}

/// True once the child has exited (left as a zombie, so its pid and group stay ours).
fn exited_unreaped(pid: i32) -> bool {
    // SAFETY: waitid with WNOWAIT only inspects our own child.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let r = libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        );
        r == 0 && info.si_pid() != 0
    }
}

/// How a run ended.
#[derive(Debug)]
pub struct Outcome {
    pub what: String,
    pub status: ExitStatus,
    /// Killed because it ran past its timeout.
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Outcome {
    /// Exited 0 by itself.
    pub fn ok(&self) -> bool {
        !self.timed_out && self.status.success()
    }

    /// The signal that ended it, if it was not killed by us.
    pub fn signal(&self) -> Option<i32> {
        if self.timed_out {
            None
        } else {
            self.status.signal()
        }
    }

    /// Every `key=value` word on stdout (a later one wins).
    pub fn fields(&self) -> BTreeMap<String, String> {
        self.stdout
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    pub fn field(&self, key: &str) -> Option<String> {
        self.fields().remove(key)
    }

    /// A numeric field; panics, showing the whole run, if it is absent.
    pub fn num(&self, key: &str) -> f64 {
        self.field(key)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no numeric {key}= in the output of {}", self.report()))
    }

    /// Everything about the run, for assertion messages.
    pub fn report(&self) -> String {
        let end = if self.timed_out {
            format!(
                "timed out after {:.2} s (killed)",
                self.elapsed.as_secs_f64()
            )
        } else {
            format!("{} after {:.2} s", self.status, self.elapsed.as_secs_f64())
        };
        format!(
            "`{}`: {end}\n--- stdout\n{}--- stderr\n{}---",
            self.what, self.stdout, self.stderr
        )
    }
}

/// A scratch directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "toffload-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("creating {}: {e}", p.display()));
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Compiles C source into a shared library `dir/NAME.so` with `cc -shared -fPIC`.
pub fn build_shared_lib(dir: &TempDir, name: &str, source: &str) -> Result<PathBuf, String> {
    let src = dir.join(&format!("{name}.c"));
    std::fs::write(&src, source).map_err(|e| e.to_string())?;
    let out = dir.join(&format!("{name}.so"));
    let o = Command::new("cc")
        .args([
            "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o",
        ])
        .arg(&out)
        .arg(&src)
        .arg("-ldl")
        .output()
        .map_err(|e| format!("cannot run cc: {e}"))?;
    if o.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "cc {name}.c failed: {}",
            String::from_utf8_lossy(&o.stderr)
        ))
    }
}

/// The runtime's counters from a TOFFLOAD_STATS file, if it wrote one.
pub fn stats(path: &Path) -> Option<serde_json::Value> {
    let s = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(s.trim()).ok()
}

/// A ServerSpec running the server under the runtime (LD_PRELOAD).
pub fn server_under_runtime(spec: ServerSpec) -> ServerSpec {
    let lib = libtoffload().unwrap_or_else(|e| panic!("{e}"));
    spec.env("LD_PRELOAD", lib.display().to_string())
}

/// A server started for this suite: like [`harness::Server`], but it keeps the exit
/// status and the server's stderr (in a file), so that a server that dies under the
/// runtime is reported with how it died and what the runtime said. The binary runs
/// through a symlink with a name of its own (`rtsuite-server`, which contains no
/// server's name), so that other people's scripts on a shared machine that stop
/// servers by name (`pkill conn_server`) leave it alone; the binary's $ORIGIN, and
/// so its library path, is unchanged.
pub struct RtServer {
    child: std::process::Child,
    pub port: u16,
    stdout: Option<std::io::BufReader<std::process::ChildStdout>>,
    status: Option<ExitStatus>,
    dir: TempDir,
    name: String,
}

impl RtServer {
    pub fn start(spec: &ServerSpec) -> Result<RtServer, String> {
        use std::io::BufRead;
        let real = harness::bin(&spec.name)?;
        let dir = TempDir::new("srv");
        let link = dir.join("rtsuite-server");
        std::os::unix::fs::symlink(&real, &link).map_err(|e| e.to_string())?;
        let err = std::fs::File::create(dir.join("stderr")).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&link);
        for (k, _) in std::env::vars_os() {
            if inherited_noise(&k.to_string_lossy()) {
                cmd.env_remove(&k);
            }
        }
        cmd.args(["--port", "0"])
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", spec.name))?;
        let mut stdout = std::io::BufReader::new(child.stdout.take().expect("piped"));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let r = stdout.read_line(&mut line);
            let _ = tx.send((r.map(|_| line), stdout));
        });
        let mut s = RtServer {
            child,
            port: 0,
            stdout: None,
            status: None,
            dir,
            name: spec.name.clone(),
        };
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok((Ok(line), stdout)) => {
                s.stdout = Some(stdout);
                match line
                    .trim()
                    .strip_prefix("READY port=")
                    .and_then(|p| p.parse().ok())
                {
                    Some(p) => {
                        s.port = p;
                        Ok(s)
                    }
                    None => Err(format!(
                        "{}: expected `READY port=N`, got {line:?}",
                        s.describe()
                    )),
                }
            }
            Ok((Err(e), _)) => Err(format!("{}: {e}", s.describe())),
            Err(_) => Err(format!("{}: no READY line within 20 s", s.describe())),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// True while the process runs (the exit status is kept once it is gone).
    pub fn alive(&mut self) -> bool {
        if self.status.is_none() {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.status = Some(st);
            }
        }
        self.status.is_none()
    }

    /// What the server wrote on stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr")).unwrap_or_default()
    }

    /// Name, state (running, or how it ended) and stderr, for messages.
    pub fn describe(&mut self) -> String {
        let state = if self.alive() {
            "running".to_string()
        } else {
            format!("ended: {}", self.status.expect("status"))
        };
        format!(
            "{} (pid {}, {state}); stderr:\n{}",
            self.name,
            self.child.id(),
            self.stderr()
        )
    }

    /// Panics, saying how the server ended, unless it still runs.
    pub fn expect_alive(&mut self, when: &str) {
        if !self.alive() {
            panic!("{when}: the server is gone: {}", self.describe());
        }
    }

    /// SIGTERM, wait (10 s, then SIGKILL), and return its stdout after READY.
    pub fn terminate(mut self) -> Result<String, String> {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let mut stdout = self.stdout.take();
        let reader = std::thread::spawn(move || {
            let mut out = String::new();
            if let Some(s) = stdout.as_mut() {
                let _ = s.read_to_string(&mut out);
            }
            out
        });
        let t0 = Instant::now();
        while self.alive() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        if self.alive() {
            let _ = self.child.kill();
            return Err(format!(
                "no exit within 10 s of SIGTERM: {}",
                self.describe()
            ));
        }
        let out = reader.join().unwrap_or_default();
        match self.status {
            Some(st) if st.success() => Ok(out),
            _ => Err(format!("stdout: {out}; {}", self.describe())),
        }
    }
}

impl Drop for RtServer {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Number of threads of a process (from /proc/PID/status), if readable.
pub fn threads_of(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}
