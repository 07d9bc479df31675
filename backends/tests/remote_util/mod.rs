//! Shared by the remote backend's tests: a daemon child process, a fault-injecting TCP
//! proxy, certificates made at test time, network namespaces.

#![allow(dead_code)] // each test binary uses part of it

pub mod conn_server;
pub mod cuda;
pub mod netns;
pub mod pki;
pub mod raw;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use toffload_accel::remote::{Remote, RemoteConfig};

pub const DAEMON: &str = env!("CARGO_BIN_EXE_toffload-remoted");

/// A fresh scratch folder, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("toffload_remote_{}_{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a secret (a PSK file) the way its owner must: mode 0600.
pub fn write_secret(p: &Path, text: impl AsRef<[u8]>) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(p, text).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A toffload-remoted child, killed on drop.
pub struct Daemon {
    pub child: Child,
    pub port: u16,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub prefix: Vec<String>,
    /// Where its stderr (the log) goes, appended; None: the test's stderr.
    pub log: Option<PathBuf>,
}

impl Daemon {
    /// Starts the daemon with `args` (plus --port-file) and waits for its port.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Daemon {
        Self::start_in(&[], args, env)
    }

    /// As `start`, run through `prefix` (e.g. `ip netns exec NS`).
    pub fn start_in(prefix: &[&str], args: &[&str], env: &[(&str, &str)]) -> Daemon {
        Self::start_full(prefix, args, env, None)
    }

    /// As `start`, its log appended to `log`.
    pub fn start_logged(args: &[&str], env: &[(&str, &str)], log: &Path) -> Daemon {
        Self::start_full(&[], args, env, Some(log.to_path_buf()))
    }

    fn start_full(
        prefix: &[&str],
        args: &[&str],
        env: &[(&str, &str)],
        log: Option<PathBuf>,
    ) -> Daemon {
        let mut d = Daemon {
            child: Command::new("true").spawn().unwrap(),
            port: 0,
            args: args.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            prefix: prefix.iter().map(|s| s.to_string()).collect(),
            log,
        };
        let _ = d.child.wait();
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        static N: AtomicU64 = AtomicU64::new(0);
        let pf = std::env::temp_dir().join(format!(
            "toffload_remoted_port_{}_{}",
            std::process::id(),
            N.fetch_add(1, Relaxed)
        ));
        let _ = std::fs::remove_file(&pf);
        let mut cmd = if self.prefix.is_empty() {
            Command::new(DAEMON)
        } else {
            let mut c = Command::new(&self.prefix[0]);
            c.args(&self.prefix[1..]).arg(DAEMON);
            c
        };
        cmd.args(&self.args)
            .arg("--port-file")
            .arg(&pf)
            .stdout(Stdio::null())
            .stderr(match &self.log {
                Some(p) => Stdio::from(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(p)
                        .unwrap(),
                ),
                None => Stdio::inherit(),
            });
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        self.child = cmd.spawn().expect("starting toffload-remoted");
        let t0 = Instant::now();
        loop {
            if let Ok(s) = std::fs::read_to_string(&pf) {
                if let Ok(p) = s.trim().parse() {
                    self.port = p;
                    break;
                }
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("toffload-remoted exited at start: {st}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "daemon did not start"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = std::fs::remove_file(&pf);
    }

    /// kill -9, then start again on the same port with the same arguments.
    pub fn restart(&mut self) {
        self.kill();
        let port = self.port;
        // Same port: replace any --listen's port.
        let mut args = self.args.clone();
        if let Some(i) = args.iter().position(|a| a == "--listen") {
            let host = args[i + 1].rsplit_once(':').unwrap().0.to_string();
            args[i + 1] = format!("{host}:{port}");
        } else {
            args.push("--listen".into());
            args.push(format!("127.0.0.1:{port}"));
        }
        self.args = args;
        let t0 = Instant::now();
        loop {
            // The old socket may linger a moment.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.spawn()));
            if r.is_ok() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "daemon did not restart"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The daemon's counters (a short connection of its own).
pub fn stats(addr: &str) -> std::collections::HashMap<String, u64> {
    toffload_accel::remote::query_stats(addr, None)
        .expect("stats query")
        .into_iter()
        .collect()
}

pub fn stats_tls(
    addr: &str,
    c: &openssl::ssl::SslConnector,
) -> std::collections::HashMap<String, u64> {
    toffload_accel::remote::query_stats(addr, Some(c))
        .expect("stats query")
        .into_iter()
        .collect()
}

pub fn client(endpoints: &[String], tweak: impl FnOnce(&mut RemoteConfig)) -> Remote {
    let mut cfg = RemoteConfig {
        endpoints: endpoints.to_vec(),
        ..RemoteConfig::default()
    };
    tweak(&mut cfg);
    Remote::new(cfg).expect("remote client")
}

/// Deterministic bytes for op `i`.
pub fn pattern(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn aes(mut v: Vec<u8>) -> Vec<u8> {
    toffload_accel::emulated::aes::aes_ctr_in_place(&mut v);
    v
}

/// A TCP proxy that resets connections at random points: each connection gets a
/// random byte budget (both directions together, uniform in 1..=2*mean_bytes) and is
/// reset (RST, SO_LINGER 0) when it is spent, until `max_resets` have been made.
pub struct FaultProxy {
    pub port: u16,
    pub resets: Arc<AtomicU64>,
    pub conns: Arc<AtomicU64>,
    /// Resets still allowed in all (raise it to inject more later in a run).
    pub max_resets: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn rst(s: &TcpStream) {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    use std::os::fd::AsRawFd;
    // SAFETY: setsockopt with a valid linger struct on a live socket.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as u32,
        );
    }
    let _ = s.shutdown(Shutdown::Both);
}

impl FaultProxy {
    pub fn start(target: String, mean_bytes: u64, max_resets: u64, seed: u64) -> FaultProxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        l.set_nonblocking(true).unwrap();
        let resets = Arc::new(AtomicU64::new(0));
        let conns = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let max = Arc::new(AtomicU64::new(max_resets));
        let (r2, c2, s2, m2) = (resets.clone(), conns.clone(), stop.clone(), max.clone());
        let rng = Arc::new(Mutex::new(seed | 1));
        let thread = std::thread::spawn(move || {
            while !s2.load(Relaxed) {
                let (cs, _) = match l.accept() {
                    Ok(x) => x,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                };
                cs.set_nonblocking(false).unwrap();
                let ds = match TcpStream::connect(&target) {
                    Ok(s) => s,
                    Err(_) => {
                        rst(&cs);
                        continue;
                    }
                };
                c2.fetch_add(1, Relaxed);
                let _ = cs.set_nodelay(true);
                let _ = ds.set_nodelay(true);
                let budget = if r2.load(Relaxed) >= m2.load(Relaxed) {
                    u64::MAX
                } else {
                    let mut x = rng.lock().unwrap();
                    *x ^= *x << 13;
                    *x ^= *x >> 7;
                    *x ^= *x << 17;
                    1 + *x % (2 * mean_bytes)
                };
                let left = Arc::new(AtomicU64::new(budget));
                let dead = Arc::new(AtomicBool::new(false));
                for (from, to) in [(cs.try_clone().unwrap(), ds.try_clone().unwrap()), (ds, cs)] {
                    let (left, dead, resets, stop) =
                        (left.clone(), dead.clone(), r2.clone(), s2.clone());
                    std::thread::spawn(move || {
                        let mut from = from;
                        let mut to = to;
                        let _ = from.set_read_timeout(Some(Duration::from_millis(200)));
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            if dead.load(Relaxed) || stop.load(Relaxed) {
                                break;
                            }
                            let n = match from.read(&mut buf) {
                                Ok(0) => break,
                                Ok(n) => n,
                                Err(e)
                                    if e.kind() == std::io::ErrorKind::WouldBlock
                                        || e.kind() == std::io::ErrorKind::TimedOut =>
                                {
                                    continue
                                }
                                Err(_) => break,
                            };
                            let l = left.load(Relaxed);
                            let take = (n as u64).min(l);
                            if take > 0 && to.write_all(&buf[..take as usize]).is_err() {
                                break;
                            }
                            if l != u64::MAX && left.fetch_sub(take, Relaxed) <= n as u64 {
                                // Budget spent mid-stream: reset both sides.
                                if !dead.swap(true, Relaxed) {
                                    resets.fetch_add(1, Relaxed);
                                }
                                break;
                            }
                        }
                        dead.store(true, Relaxed);
                        rst(&from);
                        rst(&to);
                    });
                }
            }
        });
        FaultProxy {
            port,
            resets,
            conns,
            max_resets: max,
            stop,
            thread: Some(thread),
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs `total` AES ops of `len` bytes through `r` from `threads` threads, each
/// keeping up to `depth` in flight, checking every answer. Returns (ok, failed,
/// wrong). Bounded by `limit`.
pub fn aes_workload(
    r: &Remote,
    total: u64,
    len: usize,
    threads: u64,
    depth: usize,
    limit: Duration,
    mut progress: impl FnMut(u64),
) -> (u64, u64, u64) {
    use toffload_accel::Accelerator;
    let done = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let wrong = AtomicU64::new(0);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (done, failed, wrong) = (&done, &failed, &wrong);
            s.spawn(move || {
                let mut q: std::collections::VecDeque<(i64, u64, Vec<u8>)> = Default::default();
                let mine: Vec<u64> = (0..total).filter(|i| i % threads == t).collect();
                let mut next = 0;
                while next < mine.len() || !q.is_empty() {
                    assert!(t0.elapsed() < limit, "workload over its time bound");
                    while q.len() < depth && next < mine.len() {
                        let i = mine[next];
                        let mut buf = pattern(i, len);
                        // SAFETY: buf lives in q (its heap buffer does not move) until
                        // released below.
                        match unsafe { r.submit(buf.as_mut_ptr(), buf.len()) } {
                            Ok(id) => {
                                q.push_back((id.0, i, buf));
                                next += 1;
                            }
                            Err(toffload_accel::AccelError::TooManyInFlight { .. }) => break,
                            Err(e) => panic!("submit: {e}"),
                        }
                    }
                    let Some((id, i, buf)) = q.pop_front() else {
                        std::thread::yield_now();
                        continue;
                    };
                    let id = toffload_accel::OpId(id);
                    match r.wait(id) {
                        Ok(()) => {
                            if buf != aes(pattern(i, len)) {
                                wrong.fetch_add(1, Relaxed);
                            }
                        }
                        Err(_) => {
                            failed.fetch_add(1, Relaxed);
                        }
                    }
                    r.release(id).unwrap();
                    done.fetch_add(1, Relaxed);
                }
            });
        }
        if threads > 0 {
            let mut last = 0;
            while done.load(Relaxed) < total {
                std::thread::sleep(Duration::from_millis(20));
                let d = done.load(Relaxed);
                if d != last {
                    progress(d);
                    last = d;
                }
                if t0.elapsed() > limit {
                    break;
                }
            }
        }
    });
    (
        done.load(Relaxed) - failed.load(Relaxed),
        failed.load(Relaxed),
        wrong.load(Relaxed),
    )
}
