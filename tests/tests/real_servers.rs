//! Debian's real servers under LD_PRELOAD=libtoffload.so, each driven by its own
//! benchmark tool or a client written here, every answer checked.
//!
//! - nginx, redis-server, memcached are event loops: nothing to fiberize. Under the
//!   runtime they must load safely: same correct answers, nothing extra on stdout or
//!   stderr, and the runtime never engages (TOFFLOAD_STATS fibers_created == 0).
//! - stunnel4 is thread per connection: under the runtime its connection threads become
//!   fibers (fibers_created > 0) and it serves TLS to conn_server correctly.
//!
//! Every check runs stock first (no preload), so that a failure under the runtime is
//! told apart from a broken setup. A missing server binary skips (fails under CI).

use openssl::asn1::Asn1Time;
use openssl::hash::MessageDigest;
use openssl::pkey::PKey;
use openssl::rsa::Rsa;
use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use openssl::x509::extension::{BasicConstraints, SubjectAlternativeName};
use openssl::x509::{X509NameBuilder, X509};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::loadgen::{payload, rng::Rng};

/// A 2-core machine: one server test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

// ---- helpers ---------------------------------------------------------------------

/// An executable from PATH or the sbin folders (nginx lives in /usr/sbin, which a
/// non-root PATH may lack).
fn find_exe(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The executables a test needs, or None after skipping (which fails under CI) with
/// the Debian package to install.
fn need(exes: &[(&str, &str)]) -> Option<Vec<PathBuf>> {
    let mut v = Vec::new();
    for (exe, pkg) in exes {
        match find_exe(exe) {
            Some(p) => v.push(p),
            None => {
                harness::skip(&format!(
                    "{exe} is not installed (Debian package {pkg}; .ci/run installs it)"
                ));
                return None;
            }
        }
    }
    Some(v)
}

fn runtime_lib() -> PathBuf {
    let p = harness::dist().join("lib/libtoffload.so");
    assert!(
        p.exists(),
        "{} is missing: run `cargo xtask build`",
        p.display()
    );
    p
}

/// A fresh folder, world-readable (nginx's workers run as nobody), removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "toffload-real-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temp dir");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
    fn join(&self, s: &str) -> PathBuf {
        self.0.join(s)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write(p: &Path, data: impl AsRef<[u8]>) {
    std::fs::write(p, data).unwrap_or_else(|e| panic!("writing {}: {e}", p.display()));
}

fn read_lossy(p: &Path) -> String {
    std::fs::read(p)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// A port that was free a moment ago (the caller retries if it is taken meanwhile).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding an ephemeral port")
        .port()
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Stock,
    Runtime,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Stock => "stock",
            Mode::Runtime => "under libtoffload.so",
        }
    }
}

/// A started real server: stdout and stderr go to files in its folder; killed on drop.
struct Proc {
    name: String,
    child: Option<Child>,
    stdout: PathBuf,
    stderr: PathBuf,
    stats: Option<PathBuf>,
}

/// What a stopped server left behind.
struct Stopped {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    stats: Option<serde_json::Value>,
}

impl Proc {
    /// Starts `cmd` (given the port to listen on) until it accepts TCP connections on
    /// that port; a new port and another try if it exits first (the port was taken).
    fn start(
        name: &str,
        dir: &TempDir,
        mode: Mode,
        mut cmd: impl FnMut(u16) -> Command,
    ) -> Result<(Proc, u16), String> {
        let mut last = String::new();
        for attempt in 0..3 {
            let port = free_port();
            let stdout = dir.join(&format!("{name}.{attempt}.stdout"));
            let stderr = dir.join(&format!("{name}.{attempt}.stderr"));
            let stats = dir.join(&format!("{name}.{attempt}.stats.json"));
            let mut c = cmd(port);
            c.stdin(Stdio::null())
                .stdout(std::fs::File::create(&stdout).map_err(|e| e.to_string())?)
                .stderr(std::fs::File::create(&stderr).map_err(|e| e.to_string())?);
            if mode == Mode::Runtime {
                c.env("LD_PRELOAD", runtime_lib())
                    .env("TOFFLOAD_STATS", &stats);
            } else {
                c.env_remove("LD_PRELOAD");
            }
            let child = c
                .spawn()
                .map_err(|e| format!("starting {name} ({:?}): {e}", c.get_program()))?;
            let mut p = Proc {
                name: name.into(),
                child: Some(child),
                stdout,
                stderr,
                stats: (mode == Mode::Runtime).then_some(stats),
            };
            let t0 = Instant::now();
            loop {
                if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Ok((p, port));
                }
                let exited = p.child.as_mut().expect("child").try_wait();
                if let Ok(Some(st)) = exited {
                    last = format!(
                        "{name} exited ({st}) before listening on {port}; stderr:\n{}\nstdout:\n{}",
                        read_lossy(&p.stderr),
                        read_lossy(&p.stdout)
                    );
                    p.child = None;
                    break;
                }
                if t0.elapsed() > Duration::from_secs(20) {
                    return Err(format!(
                        "{name} not listening on {port} after 20 s; stderr:\n{}",
                        read_lossy(&p.stderr)
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Err(last)
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Still running? Err with its output if it died.
    fn check_alive(&mut self) -> Result<(), String> {
        match self.child.as_mut().expect("running").try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(st)) => Err(format!(
                "{} died ({st}); stderr:\n{}",
                self.name,
                read_lossy(&self.stderr)
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    /// SIGTERM, wait (10 s, then SIGKILL), collect what it left.
    fn stop(mut self) -> Stopped {
        let mut child = self.child.take().expect("running");
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        let mut hung = String::new();
        let status = loop {
            if let Ok(Some(st)) = child.try_wait() {
                break st;
            }
            if t0.elapsed() > Duration::from_secs(10) {
                hung = threads_of(child.id());
                let _ = child.kill();
                break child.wait().expect("wait");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // Children of the server (nginx's worker) may write the stats file as they exit.
        std::thread::sleep(Duration::from_millis(100));
        let stats = self.stats.as_ref().and_then(|p| {
            std::fs::read_to_string(p)
                .ok()
                .and_then(|s| serde_json::from_str(s.trim()).ok())
        });
        let mut stderr = read_lossy(&self.stderr);
        if !hung.is_empty() {
            stderr.push_str(&format!(
                "\n(still running 10 s after SIGTERM; its threads: tid state wchan syscall)\n{hung}"
            ));
        }
        Stopped {
            status,
            stdout: read_lossy(&self.stdout),
            stderr,
            stats,
        }
    }
}

/// Each thread of a process: tid, state, kernel wait channel and current syscall
/// (what a process that ignores SIGTERM is stuck in).
fn threads_of(pid: u32) -> String {
    let mut out = String::new();
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in rd.flatten() {
        let p = t.path();
        let get = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let stat = get("stat");
        let state = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .unwrap_or("?")
            .to_string();
        let syscall = get("syscall");
        out.push_str(&format!(
            "{} {} {} {} {}\n",
            t.file_name().to_string_lossy(),
            get("comm").trim(),
            state,
            get("wchan").trim(),
            syscall.split_whitespace().next().unwrap_or("?")
        ));
    }
    out
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn stat_u64(stats: &serde_json::Value, key: &str) -> Option<u64> {
    stats.get(key).and_then(|v| v.as_u64())
}

/// Under the runtime: the stats file exists, the runtime says nothing on stderr
/// (TOFFLOAD_LOG is unset) and the server printed nothing more on stdout than stock.
fn runtime_checks(what: &str, s: &Stopped, stock_stdout: &str) -> Result<u64, String> {
    let stats = s.stats.as_ref().ok_or_else(|| {
        format!("{what}: TOFFLOAD_STATS file missing or not one JSON line (the runtime must write it at exit)")
    })?;
    println!("{what}: TOFFLOAD_STATS {stats}");
    if let Some(line) = s
        .stderr
        .lines()
        .find(|l| l.starts_with("toffload") || l.contains("toffload:"))
    {
        return Err(format!(
            "{what}: the runtime wrote on stderr with TOFFLOAD_LOG unset: {line:?}"
        ));
    }
    if s.stdout != stock_stdout {
        return Err(format!(
            "{what}: stdout differs from the stock run: {:?} vs {:?}",
            s.stdout, stock_stdout
        ));
    }
    stat_u64(stats, "fibers_created").ok_or_else(|| format!("{what}: no fibers_created in {stats}"))
}

/// Stock, then under the runtime; returns fibers_created of the runtime run.
fn stock_then_runtime(what: &str, check: impl Fn(Mode) -> Result<Stopped, String>) -> u64 {
    let stock = check(Mode::Stock)
        .unwrap_or_else(|e| panic!("{what} stock (no runtime), setup is broken: {e}"));
    println!("{what} stock: ok");
    let rt =
        check(Mode::Runtime).unwrap_or_else(|e| panic!("{what} {}: {e}", Mode::Runtime.name()));
    let fibers = runtime_checks(what, &rt, &stock.stdout).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "{what} {}: ok, fibers_created={fibers}",
        Mode::Runtime.name()
    );
    fibers
}

fn run_tool(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running {:?}: {e}", cmd.get_program()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!(
            "{:?} failed ({}):\n{}\n{}",
            cmd.get_program(),
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(stdout)
}

fn exited_cleanly(what: &str, s: &Stopped) -> Result<(), String> {
    if s.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} did not exit cleanly on SIGTERM ({}); stderr:\n{}",
            s.status, s.stderr
        ))
    }
}

// ---- nginx -----------------------------------------------------------------------

/// "Label:   value" from ab's report.
fn ab_field<'a>(out: &'a str, label: &str) -> Option<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(label))
        .map(|v| v.trim_start_matches(':').trim())
}

fn ab_check(ab: &Path, url: &str, n: u32, keepalive: bool, want_len: usize) -> Result<(), String> {
    let mut cmd = Command::new(ab);
    cmd.args(["-q", "-n", &n.to_string(), "-c", "16", "-s", "10"]);
    if keepalive {
        cmd.arg("-k");
    }
    let out = run_tool(cmd.arg(url))?;
    let num =
        |label: &str| ab_field(&out, label).and_then(|v| v.split(' ').next()?.parse::<u64>().ok());
    let complete = num("Complete requests");
    let failed = num("Failed requests");
    let non2xx = num("Non-2xx responses").unwrap_or(0);
    let len = num("Document Length");
    if complete != Some(n as u64)
        || failed != Some(0)
        || non2xx != 0
        || len != Some(want_len as u64)
    {
        return Err(format!(
            "ab {url} (keepalive {keepalive}): complete {complete:?} of {n}, failed {failed:?}, \
             non-2xx {non2xx}, length {len:?} (want {want_len}):\n{out}"
        ));
    }
    println!(
        "  ab -n {n} -c 16{} {url}: {} req/s",
        if keepalive { " -k" } else { "" },
        ab_field(&out, "Requests per second")
            .and_then(|v| v.split(' ').next())
            .unwrap_or("?")
    );
    Ok(())
}

/// One HTTP/1.0 GET: (status line, body).
fn http_get(port: u16, path: &str) -> Result<(String, Vec<u8>), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).map_err(|e| e.to_string())?;
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let status = head.lines().next().unwrap_or("").to_string();
    Ok((status, buf[split + 4..].to_vec()))
}

fn nginx_check(nginx: &Path, ab: &Path, mode: Mode) -> Result<Stopped, String> {
    let dir = TempDir::new("nginx");
    let www = dir.join("www");
    std::fs::create_dir_all(&www).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&www, std::fs::Permissions::from_mode(0o755)).ok();
    let mut rng = Rng::new(0x6e67);
    let blob: Vec<u8> = (0..100_000).map(|_| rng.next_u64() as u8).collect();
    let index = b"<html><body>toffload: nginx under LD_PRELOAD</body></html>\n".to_vec();
    write(&www.join("blob.bin"), &blob);
    write(&www.join("index.html"), &index);
    for f in ["blob.bin", "index.html"] {
        std::fs::set_permissions(www.join(f), std::fs::Permissions::from_mode(0o644)).ok();
    }
    let d = dir.path().display().to_string();
    let (mut p, port) = Proc::start("nginx", &dir, mode, |port| {
        let conf = format!(
            "daemon off;\nmaster_process on;\nworker_processes 1;\npid {d}/nginx.pid;\n\
             error_log {d}/error.log notice;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n  access_log off;\n  default_type application/octet-stream;\n\
               client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
               fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n\
               scgi_temp_path {d}/scgi;\n\
               server {{\n    listen 127.0.0.1:{port};\n    root {d}/www;\n  }}\n}}\n"
        );
        write(&dir.join("nginx.conf"), conf);
        let mut c = Command::new(nginx);
        c.arg("-p")
            .arg(dir.path())
            .arg("-e")
            .arg(dir.join("early.log"))
            .arg("-c")
            .arg(dir.join("nginx.conf"));
        c
    })?;
    for (path, want) in [("/index.html", &index), ("/blob.bin", &blob)] {
        let (status, body) = http_get(port, path)?;
        if !status.contains(" 200 ") || &body != want {
            return Err(format!(
                "GET {path}: {status:?}, {} body bytes (want 200 and {} bytes, equal)",
                body.len(),
                want.len()
            ));
        }
    }
    let (status, _) = http_get(port, "/missing")?;
    if !status.contains(" 404 ") {
        return Err(format!("GET /missing: {status:?}, want 404"));
    }
    let base = format!("http://127.0.0.1:{port}");
    ab_check(ab, &format!("{base}/index.html"), 5000, false, index.len())?;
    ab_check(ab, &format!("{base}/index.html"), 10000, true, index.len())?;
    ab_check(ab, &format!("{base}/blob.bin"), 2000, true, blob.len())?;
    p.check_alive()?;
    let s = p.stop();
    exited_cleanly("nginx", &s)?;
    let log = read_lossy(&dir.join("error.log"));
    if let Some(l) = log
        .lines()
        .find(|l| l.contains("[alert]") || l.contains("[emerg]") || l.contains("[crit]"))
    {
        return Err(format!("nginx error.log: {l}"));
    }
    Ok(s)
}

#[test]
fn nginx_serves_static_files_and_runtime_stays_out() {
    let Some(exes) = need(&[("nginx", "nginx"), ("ab", "apache2-utils")]) else {
        return;
    };
    let _s = serial();
    let fibers = stock_then_runtime("nginx", |m| nginx_check(&exes[0], &exes[1], m));
    assert_eq!(
        fibers, 0,
        "nginx: an event loop, the runtime must not engage"
    );
}

// ---- redis -----------------------------------------------------------------------

fn redis_check(server: &Path, bench: &Path, cli: &Path, mode: Mode) -> Result<Stopped, String> {
    let dir = TempDir::new("redis");
    let (mut p, port) = Proc::start("redis", &dir, mode, |port| {
        let conf = format!(
            "port {port}\nbind 127.0.0.1\ndaemonize no\nsave \"\"\nappendonly no\n\
             dir {d}\nlogfile {d}/redis.log\nprotected-mode no\n",
            d = dir.path().display()
        );
        write(&dir.join("redis.conf"), conf);
        let mut c = Command::new(server);
        c.arg(dir.join("redis.conf"));
        c
    })?;
    let ps = port.to_string();
    // Correctness: 2,000 keys set and read back through redis-cli, then their count.
    let n = 2000;
    let mut rng = Rng::new(0x7265);
    let vals: Vec<String> = (0..n)
        .map(|i| format!("v{i}-{:016x}", rng.next_u64()))
        .collect();
    let mut script = String::new();
    for (i, v) in vals.iter().enumerate() {
        script.push_str(&format!("SET toffload:{i} {v}\n"));
    }
    for i in 0..n {
        script.push_str(&format!("GET toffload:{i}\n"));
    }
    script.push_str("GET toffload:absent\nDBSIZE\n");
    let script_path = dir.join("cmds.txt");
    write(&script_path, &script);
    let o = Command::new(cli)
        .args(["-h", "127.0.0.1", "-p", &ps])
        .stdin(std::fs::File::open(&script_path).map_err(|e| e.to_string())?)
        .output()
        .map_err(|e| e.to_string())?;
    if !o.status.success() {
        return Err(format!(
            "redis-cli failed: {}",
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = text.lines().collect();
    let mut want: Vec<&str> = vec!["OK"; n];
    want.extend(vals.iter().map(|v| v.as_str()));
    want.push("");
    want.push("2000");
    if lines != want {
        let first = lines.iter().zip(&want).position(|(a, b)| a != b);
        return Err(format!(
            "redis-cli answers: {} lines (want {}), first difference at {first:?}: {:?} vs {:?}",
            lines.len(),
            want.len(),
            first.map(|i| lines[i]),
            first.map(|i| want[i])
        ));
    }
    println!("  redis-cli: {n} SET + {n} GET + DBSIZE correct");
    // The server's own benchmark.
    let out = run_tool(Command::new(bench).args([
        "-h",
        "127.0.0.1",
        "-p",
        &ps,
        "-t",
        "set,get",
        "-n",
        "20000",
        "-c",
        "32",
        "-q",
    ]))?;
    for op in ["SET", "GET"] {
        let line = out
            .split(['\r', '\n'])
            .find(|l| l.starts_with(&format!("{op}: ")) && l.contains("requests per second"))
            .ok_or_else(|| format!("redis-benchmark printed no {op} result:\n{out}"))?;
        println!("  redis-benchmark {line}");
    }
    // Still the same data after the benchmark (it writes only its own keys).
    let o = Command::new(cli)
        .args(["-h", "127.0.0.1", "-p", &ps, "GET", "toffload:1999"])
        .output()
        .map_err(|e| e.to_string())?;
    if String::from_utf8_lossy(&o.stdout).trim() != vals[1999] {
        return Err("GET toffload:1999 after redis-benchmark: wrong value".into());
    }
    p.check_alive()?;
    let s = p.stop();
    exited_cleanly("redis-server", &s)?;
    Ok(s)
}

#[test]
fn redis_benchmark_and_cli_answers_runtime_stays_out() {
    let Some(exes) = need(&[
        ("redis-server", "redis-server"),
        ("redis-benchmark", "redis-tools"),
        ("redis-cli", "redis-tools"),
    ]) else {
        return;
    };
    let _s = serial();
    let fibers = stock_then_runtime("redis-server", |m| {
        redis_check(&exes[0], &exes[1], &exes[2], m)
    });
    assert_eq!(
        fibers, 0,
        "redis-server: an event loop, the runtime must not engage"
    );
}

// ---- memcached -------------------------------------------------------------------

/// A memcached text-protocol connection.
struct Mc {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Mc {
    fn connect(port: u16) -> Result<Mc, String> {
        let s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok();
        s.set_nodelay(true).ok();
        Ok(Mc {
            w: s.try_clone().map_err(|e| e.to_string())?,
            r: BufReader::new(s),
        })
    }
    fn line(&mut self) -> Result<String, String> {
        let mut l = String::new();
        self.r
            .read_line(&mut l)
            .map_err(|e| format!("reading: {e}"))?;
        if l.is_empty() {
            return Err("connection closed".into());
        }
        Ok(l.trim_end_matches("\r\n").to_string())
    }
    fn set(&mut self, key: &str, flags: u32, val: &[u8]) -> Result<(), String> {
        let mut m = format!("set {key} {flags} 0 {}\r\n", val.len()).into_bytes();
        m.extend_from_slice(val);
        m.extend_from_slice(b"\r\n");
        self.w.write_all(&m).map_err(|e| e.to_string())?;
        match self.line()?.as_str() {
            "STORED" => Ok(()),
            other => Err(format!("set {key}: {other:?}")),
        }
    }
    /// get/gets of several keys: (key, flags, value) for the hits, in order.
    fn get(&mut self, keys: &[String]) -> Result<Vec<(String, u32, Vec<u8>)>, String> {
        self.w
            .write_all(format!("get {}\r\n", keys.join(" ")).as_bytes())
            .map_err(|e| e.to_string())?;
        let mut v = Vec::new();
        loop {
            let l = self.line()?;
            if l == "END" {
                return Ok(v);
            }
            let f: Vec<&str> = l.split(' ').collect();
            let [val_kw, key, flags, len] = f[..] else {
                return Err(format!("get: unexpected {l:?}"));
            };
            if val_kw != "VALUE" {
                return Err(format!("get: unexpected {l:?}"));
            }
            let len: usize = len.parse().map_err(|_| format!("bad length in {l:?}"))?;
            let mut data = vec![0u8; len + 2];
            self.r.read_exact(&mut data).map_err(|e| e.to_string())?;
            if &data[len..] != b"\r\n" {
                return Err(format!("get {key}: data not followed by CRLF"));
            }
            data.truncate(len);
            v.push((key.to_string(), flags.parse().unwrap_or(u32::MAX), data));
        }
    }
    fn cmd(&mut self, c: &str) -> Result<String, String> {
        self.w
            .write_all(format!("{c}\r\n").as_bytes())
            .map_err(|e| e.to_string())?;
        self.line()
    }
}

fn mc_value(t: usize, i: usize) -> Vec<u8> {
    let mut rng = Rng::new(((t as u64) << 32) | i as u64);
    let len = 1 + (rng.next_u64() % 5000) as usize;
    // Any bytes, CR and LF included: the length frames the data.
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

fn memcached_check(memcached: &Path, mode: Mode) -> Result<Stopped, String> {
    let dir = TempDir::new("memcached");
    let (mut p, port) = Proc::start("memcached", &dir, mode, |port| {
        let mut c = Command::new(memcached);
        c.args([
            "-l",
            "127.0.0.1",
            "-U",
            "0",
            "-t",
            "4",
            "-m",
            "64",
            "-c",
            "1024",
        ])
        .arg("-p")
        .arg(port.to_string());
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            c.args(["-u", "root"]);
        }
        c
    })?;
    let (threads, keys) = (8, 400);
    // Each thread sets its keys on one connection and reads them back on another,
    // with multi-key gets; then every thread reads a neighbour's keys.
    let work = |t: usize, phase: u8| -> Result<u64, String> {
        let key = |t: usize, i: usize| format!("toffload:{t}:{i}");
        let mut checked = 0;
        if phase == 0 {
            let mut a = Mc::connect(port)?;
            let mut b = Mc::connect(port)?;
            for i in 0..keys {
                a.set(&key(t, i), (t * 1000 + i) as u32, &mc_value(t, i))?;
            }
            for chunk in (0..keys).collect::<Vec<_>>().chunks(20) {
                let ks: Vec<String> = chunk.iter().map(|&i| key(t, i)).collect();
                let got = b.get(&ks)?;
                if got.len() != ks.len() {
                    return Err(format!("get of {} keys: {} hits", ks.len(), got.len()));
                }
                for ((k, flags, v), &i) in got.iter().zip(chunk) {
                    if *k != key(t, i) || *flags != (t * 1000 + i) as u32 || *v != mc_value(t, i) {
                        return Err(format!("get {}: wrong key, flags or value", key(t, i)));
                    }
                    checked += 1;
                }
            }
        } else {
            let o = (t + 1) % threads;
            let mut c = Mc::connect(port)?;
            for i in (0..keys).step_by(3) {
                let got = c.get(&[key(o, i)])?;
                if got.len() != 1 || got[0].2 != mc_value(o, i) {
                    return Err(format!("cross-connection get {}: wrong", key(o, i)));
                }
                checked += 1;
            }
            let k = format!("toffload:ctr:{t}");
            c.set(&k, 0, b"41")?;
            if c.cmd(&format!("incr {k} 1"))? != "42" {
                return Err(format!("incr {k}: not 42"));
            }
            if c.cmd(&format!("delete {k}"))? != "DELETED"
                || !c.get(std::slice::from_ref(&k))?.is_empty()
            {
                return Err(format!("delete {k}: still there"));
            }
        }
        Ok(checked)
    };
    let mut total = 0;
    for phase in [0u8, 1] {
        let results: Vec<Result<u64, String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| s.spawn(move || work(t, phase)))
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("client thread panicked".into()))
                })
                .collect()
        });
        for r in results {
            total += r?;
        }
    }
    let st = Mc::connect(port)?.cmd("version")?;
    println!(
        "  memcached {st}: {total} values verified over {} connections",
        threads * 3
    );
    p.check_alive()?;
    let s = p.stop();
    exited_cleanly("memcached", &s)?;
    Ok(s)
}

#[test]
fn memcached_text_protocol_answers_runtime_stays_out() {
    let Some(exes) = need(&[("memcached", "memcached")]) else {
        return;
    };
    let _s = serial();
    let fibers = stock_then_runtime("memcached", |m| memcached_check(&exes[0], m));
    assert_eq!(
        fibers, 0,
        "memcached: its threads start before accept, none is fiberized"
    );
}

// ---- stunnel4 --------------------------------------------------------------------

/// A self-signed certificate for localhost / 127.0.0.1: (cert PEM, key PEM).
fn self_signed() -> (Vec<u8>, Vec<u8>) {
    let key = PKey::from_rsa(Rsa::generate(2048).expect("rsa")).expect("pkey");
    let mut name = X509NameBuilder::new().expect("name");
    name.append_entry_by_text("CN", "localhost").expect("cn");
    let name = name.build();
    let mut b = X509::builder().expect("x509");
    b.set_version(2).expect("version");
    let serial = openssl::bn::BigNum::from_u32(0x70ff)
        .and_then(|n| n.to_asn1_integer())
        .expect("serial");
    b.set_serial_number(&serial).expect("serial");
    b.set_subject_name(&name).expect("subject");
    b.set_issuer_name(&name).expect("issuer");
    b.set_pubkey(&key).expect("pubkey");
    b.set_not_before(&Asn1Time::days_from_now(0).expect("time"))
        .expect("nb");
    b.set_not_after(&Asn1Time::days_from_now(2).expect("time"))
        .expect("na");
    b.append_extension(BasicConstraints::new().critical().ca().build().expect("bc"))
        .expect("bc");
    let san = SubjectAlternativeName::new()
        .dns("localhost")
        .ip("127.0.0.1")
        .build(&b.x509v3_context(None, None))
        .expect("san");
    b.append_extension(san).expect("san");
    b.sign(&key, MessageDigest::sha256()).expect("sign");
    (
        b.build().to_pem().expect("pem"),
        key.private_key_to_pem_pkcs8().expect("key pem"),
    )
}

/// TLS clients in threads, each over several connections sending conn_server
/// requests through stunnel; every answer checked against AES-CTR. Returns the count.
fn tls_clients(
    port: u16,
    ca: &Path,
    threads: usize,
    conns: usize,
    reqs: usize,
) -> Result<u64, String> {
    let mut b = SslConnector::builder(SslMethod::tls_client()).map_err(|e| e.to_string())?;
    b.set_ca_file(ca).map_err(|e| e.to_string())?;
    b.set_verify(SslVerifyMode::PEER);
    let connector = b.build();
    let one = |t: usize| -> Result<u64, String> {
        let mut rng = Rng::new(0x5754 + t as u64);
        let mut n = 0;
        for c in 0..conns {
            let tcp =
                TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
            tcp.set_read_timeout(Some(Duration::from_secs(15))).ok();
            tcp.set_write_timeout(Some(Duration::from_secs(15))).ok();
            tcp.set_nodelay(true).ok();
            let mut tls = connector
                .connect("localhost", tcp)
                .map_err(|e| format!("TLS handshake (thread {t}, connection {c}): {e}"))?;
            for r in 0..reqs {
                let req: Vec<u8> = (0..1024).map(|_| rng.next_u64() as u8).collect();
                tls.write_all(&req).map_err(|e| format!("write: {e}"))?;
                let mut ans = vec![0u8; 1024];
                tls.read_exact(&mut ans)
                    .map_err(|e| format!("thread {t} connection {c} request {r}: read: {e}"))?;
                if ans != payload::expected(&req) {
                    return Err(format!(
                        "thread {t} connection {c} request {r}: wrong answer"
                    ));
                }
                n += 1;
            }
            let _ = tls.shutdown();
            let _ = tls.get_ref().shutdown(Shutdown::Both);
        }
        Ok(n)
    };
    let results: Vec<Result<u64, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads).map(|t| s.spawn(move || one(t))).collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("client thread panicked".into()))
            })
            .collect()
    });
    let mut total = 0;
    for r in results {
        total += r?;
    }
    Ok(total)
}

fn stunnel_check(stunnel: &Path, mode: Mode) -> Result<Stopped, String> {
    let dir = TempDir::new("stunnel");
    // The backend: conn_server, stock, on the emulated device (200 us per offload).
    let backend = Server::start(
        &ServerSpec::new("conn_server")
            .env("TOFFLOAD_EMU_LAT_US", "200")
            .env("TOFFLOAD_WAIT", "block"),
    )?;
    let (cert, key) = self_signed();
    let (cert_p, key_p) = (dir.join("cert.pem"), dir.join("key.pem"));
    write(&cert_p, &cert);
    write(&key_p, &key);
    let (mut p, port) = Proc::start("stunnel", &dir, mode, |port| {
        let conf = format!(
            "foreground = yes\npid =\ndebug = warning\noutput = {d}/stunnel.log\n\
             [toffload]\naccept = 127.0.0.1:{port}\nconnect = 127.0.0.1:{backend}\n\
             cert = {cert}\nkey = {key}\n",
            d = dir.path().display(),
            backend = backend.port,
            cert = cert_p.display(),
            key = key_p.display()
        );
        write(&dir.join("stunnel.conf"), conf);
        let mut c = Command::new(stunnel);
        c.arg(dir.join("stunnel.conf"));
        c
    })?;
    let (threads, conns, reqs) = (16, 4, 25);
    let t0 = Instant::now();
    let n = tls_clients(port, &cert_p, threads, conns, reqs)?;
    println!(
        "  stunnel: {n} TLS requests over {} connections answered correctly in {:.2} s",
        threads * conns,
        t0.elapsed().as_secs_f64()
    );
    p.check_alive()?;
    let pid = p.pid();
    let s = p.stop();
    // stunnel reports SIGTERM as "Terminated" and exits 0.
    exited_cleanly(&format!("stunnel (pid {pid})"), &s)?;
    drop(backend);
    Ok(s)
}

#[test]
fn stunnel_serves_tls_to_conn_server_with_fiberized_connections() {
    let Some(exes) = need(&[("stunnel4", "stunnel4")]) else {
        return;
    };
    if let Err(e) = harness::bin("conn_server") {
        panic!("{e}");
    }
    let _s = serial();
    let fibers = stock_then_runtime("stunnel4", |m| stunnel_check(&exes[0], m));
    assert!(
        fibers > 0,
        "stunnel4 is thread per connection: its connection threads must become fibers \
         (TOFFLOAD_STATS fibers_created = 0)"
    );
}
