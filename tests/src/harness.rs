//! Starting and stopping the example servers for tests, benchmarks and the demo.
//! Binaries come from the dist folder that `cargo xtask build` fills (target/toffload,
//! or $TOFFLOAD_DIST).

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The dist folder.
pub fn dist() -> PathBuf {
    std::env::var_os("TOFFLOAD_DIST")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/toffload"))
}

/// A binary from dist/bin, or a message saying how to build it.
pub fn bin(name: &str) -> Result<PathBuf, String> {
    let p = dist().join("bin").join(name);
    if p.exists() {
        Ok(p)
    } else {
        Err(format!(
            "{} is missing: run `cargo xtask build` (or `cargo xtask test`, which builds first)",
            p.display()
        ))
    }
}

/// True where skipping is not allowed (CI sets TOFFLOAD_NO_SKIP=1 through xtask).
pub fn no_skip() -> bool {
    std::env::var("TOFFLOAD_NO_SKIP").is_ok_and(|v| v == "1")
}

/// Skips a test with a printed reason, or fails it where skipping is not allowed.
pub fn skip(reason: &str) {
    if no_skip() {
        panic!("cannot skip under CI: {reason}");
    }
    eprintln!("SKIP: {reason}");
}

/// Restricts the calling thread (and what it spawns later) to one CPU.
pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; affects only this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// CPUs online on the machine. Not available_parallelism(): that is the calling
/// thread's affinity, and the benches pin themselves to core 1 before they start the
/// servers they mean to pin to core 0, which then read as "one CPU" and were left
/// beside the load generator.
pub fn cpus() -> usize {
    // SAFETY: no arguments.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 {
        n as usize
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// What to start.
#[derive(Clone, Debug, Default)]
pub struct ServerSpec {
    pub name: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cpu: Option<usize>,
}

impl ServerSpec {
    pub fn new(name: &str) -> Self {
        ServerSpec {
            name: name.into(),
            ..Default::default()
        }
    }
    pub fn arg(mut self, a: impl Into<String>) -> Self {
        self.args.push(a.into());
        self
    }
    pub fn env(mut self, k: &str, v: impl Into<String>) -> Self {
        self.env.push((k.into(), v.into()));
        self
    }
    pub fn cpu(mut self, cpu: Option<usize>) -> Self {
        self.cpu = cpu;
        self
    }
}

/// A running example server; killed on drop.
pub struct Server {
    child: Child,
    pub port: u16,
    stdout: Option<BufReader<ChildStdout>>,
}

impl Server {
    /// Starts the server on an ephemeral port and waits for its `READY port=N` line.
    pub fn start(spec: &ServerSpec) -> Result<Server, String> {
        let mut cmd = Command::new(bin(&spec.name)?);
        cmd.args(["--port", "0"])
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(cpu) = spec.cpu {
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(cpu, &mut set);
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
                    Ok(())
                });
            }
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", spec.name))?;
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut line = String::new();
            let r = stdout.read_line(&mut line);
            let _ = tx.send((r.map(|_| line), stdout));
        });
        let (line, stdout) = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok((Ok(line), stdout)) => (line, stdout),
            Ok((Err(e), _)) => return Err(fail(child, &spec.name, &e.to_string())),
            Err(_) => return Err(fail(child, &spec.name, "no READY line within 20 s")),
        };
        let _ = reader.join();
        let port = line
            .trim()
            .strip_prefix("READY port=")
            .and_then(|p| p.parse().ok());
        match port {
            Some(port) => Ok(Server {
                child,
                port,
                stdout: Some(stdout),
            }),
            None => Err(fail(
                child,
                &spec.name,
                &format!("expected `READY port=N`, got {line:?}"),
            )),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU time the server has used so far, all its threads (utime + stime), seconds.
    pub fn cpu_secs(&self) -> Option<f64> {
        stat_cpu_secs(&std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?)
    }

    /// CPU time used so far by the server's threads named `comm` (the runtime's
    /// `toffload-poll`), seconds; 0 when there are none.
    pub fn threads_cpu_secs(&self, comm: &str) -> f64 {
        let dir = format!("/proc/{}/task", self.pid());
        let Ok(tasks) = std::fs::read_dir(&dir) else {
            return 0.0;
        };
        tasks
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
            .filter(|stat| {
                stat.split_once(" (")
                    .is_some_and(|(_, r)| r.starts_with(&format!("{comm})")))
            })
            .filter_map(|stat| stat_cpu_secs(&stat))
            .sum()
    }

    /// True while the process runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, wait for exit, and return what it printed on stdout after READY.
    pub fn terminate(mut self) -> Result<String, String> {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let mut out = String::new();
        if let Some(mut s) = self.stdout.take() {
            let _ = s.read_to_string(&mut out);
        }
        let status = self.child.wait().map_err(|e| e.to_string())?;
        if status.success() {
            Ok(out)
        } else {
            Err(format!("exited with {status}; stdout: {out}"))
        }
    }
}

fn fail(mut child: Child, name: &str, why: &str) -> String {
    let _ = child.kill();
    let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
    format!("{name} did not start: {why} ({status})")
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The median (mean of the middle two for an even count); NaN when empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A TCP port free on loopback now (for a server that must keep its port across a
/// restart, which an ephemeral `--port 0` cannot).
/// A busy loop at nice 19 on every CPU for as long as it lives. It loads the host (a
/// test that must hold on a busy machine), and it keeps the vCPUs from halting when
/// idle: on these VMs a halted vCPU's timer wake-up adds ~25 us to every emulated
/// offload, so the device's configured latency is only the truth on a busy host.
pub struct IdleSpinners {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl IdleSpinners {
    pub fn start() -> IdleSpinners {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..cpus())
            .map(|cpu| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let _ = pin_current_thread(cpu);
                    // SAFETY: this thread's own nice value (per thread on Linux).
                    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        IdleSpinners { stop, threads }
    }
}

impl Drop for IdleSpinners {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A program on PATH (or in the sbin folders a root shell has), as a stock server's
/// binary is found.
/// With TOFFLOAD_BENCH_WATCH_DUMP=DIR, a bench's toffload-watch output (its JSON
/// lines) is kept as DIR/NAME.jsonl, for reading the model's inputs afterwards.
pub fn dump_watch(name: &str, text: &str) {
    let Some(dir) = std::env::var_os("TOFFLOAD_BENCH_WATCH_DUMP") else {
        return;
    };
    let file: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let path = PathBuf::from(dir).join(format!("{file}.jsonl"));
    if let Err(e) = std::fs::write(&path, text) {
        eprintln!("TOFFLOAD_BENCH_WATCH_DUMP: {}: {e}", path.display());
    }
}

pub fn which(p: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/bin".into(), "/sbin".into()])
        .map(|d| d.join(p))
        .find(|c| c.is_file())
}

/// Waits until something accepts connections on 127.0.0.1:`port`; false past `limit`.
pub fn wait_listening(port: u16, limit: Duration) -> bool {
    let t0 = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if t0.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

pub fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// Makes this process the reaper of its orphaned descendants: a server relaunched by
/// an injection outlives the watcher that started it and must not be left a zombie.
pub fn become_subreaper() {
    // SAFETY: plain prctl on ourselves.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}

/// SIGTERM to an adopted descendant, then reap it; true once it is gone within `limit`.
pub fn end_adopted(pid: u32, limit: Duration) -> bool {
    // SAFETY: plain signal.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let t0 = std::time::Instant::now();
    while t0.elapsed() < limit {
        // SAFETY: plain waitpid on a process we adopted as subreaper.
        let r = unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
        if r == pid as i32 || (r < 0 && !std::path::Path::new(&format!("/proc/{pid}")).exists()) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// An adopted descendant (a server an injection relaunched) that is ended even when
/// the test fails before its own `end`: a failed assertion must not leave it serving.
pub struct Adopted(Option<u32>);

impl Adopted {
    pub fn new(pid: u32) -> Self {
        Adopted(Some(pid))
    }

    /// SIGTERM, then reap (`end_adopted`); true once it is gone within `limit`.
    pub fn end(mut self, limit: Duration) -> bool {
        self.0.take().is_some_and(|pid| end_adopted(pid, limit))
    }
}

impl Drop for Adopted {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            if !end_adopted(pid, Duration::from_secs(5)) {
                // SAFETY: plain signal to a descendant we adopted.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                end_adopted(pid, Duration::from_secs(2));
            }
        }
    }
}

/// utime + stime of a /proc stat line, seconds.
fn stat_cpu_secs(stat: &str) -> Option<f64> {
    // Fields after the command name (which may hold spaces): utime and stime are the
    // 12th and 13th.
    let f: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: no arguments.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Some(ticks as f64 / if hz > 0 { hz as f64 } else { 100.0 })
}
