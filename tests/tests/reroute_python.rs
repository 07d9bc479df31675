//! The Python asyncio reroute (backends/integrations/python/toffload_asyncio.py):
//! Debian's stock python3 runs it over libtoffload_accel.so through ctypes, offering
//! the offload as `GET /sync` (accel_run on the event loop's thread) and `GET /async`
//! (accel_submit, the coroutine suspended on a future, the device's completion fd in
//! the loop with add_reader).
//!
//! `reroute_python_benchmark` measures both forms with wrk at 50, 200 and 1000 us;
//! with TOFFLOAD_REROUTE_OUT=path (what `cargo xtask bench reroute` sets) it also
//! writes its table beside that file, as reroute-python.md.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;
use toffload_tests::harness;
use toffload_tests::loadgen::payload;

/// A 2-core machine: one server test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const IO_TIMEOUT: Duration = Duration::from_secs(20);

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../backends/integrations/python/toffload_asyncio.py")
}

fn find(name: &str) -> Option<PathBuf> {
    ["/usr/bin", "/usr/local/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// python3, or None after skipping (fails under CI).
fn python() -> Option<PathBuf> {
    let p = find("python3");
    if p.is_none() {
        harness::skip("python3 is not installed (Debian package python3; .ci/run installs it)");
    }
    p
}

fn pin(cmd: &mut Command, cpu: Option<usize>) {
    if let Some(cpu) = cpu.filter(|_| harness::cpus() > 1) {
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
}

/// The asyncio server; killed on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(python: &Path, env: &[(&str, String)], cpu: Option<usize>) -> Server {
        let lib = harness::dist().join("lib/libtoffload_accel.so");
        assert!(
            lib.is_file(),
            "{} missing: run cargo xtask build",
            lib.display()
        );
        let mut c = Command::new(python);
        c.arg(script())
            .args(["--port", "0", "--lib"])
            .arg(&lib)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            c.env(k, v);
        }
        pin(&mut c, cpu);
        let mut child = c.spawn().expect("starting python3");
        let out = child.stdout.take().expect("stdout");
        // Its first line says the port; read it on a thread so that a server that
        // never prints cannot hang the test.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(out).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                panic!("the asyncio server printed no port within 20 s");
            }
        };
        let port = line
            .strip_prefix("port ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| {
                let _ = child.kill();
                panic!("the asyncio server said {line:?}, not `port N`")
            });
        Server { child, port }
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A keep-alive HTTP/1.1 client for the few requests the checks make.
struct Client {
    s: BufReader<TcpStream>,
}

impl Client {
    fn connect(port: u16) -> Client {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        Client {
            s: BufReader::new(s),
        }
    }

    /// Sends `raw` and reads one response: (status, body).
    fn raw(&mut self, raw: &[u8]) -> (u16, Vec<u8>) {
        self.s.get_mut().write_all(raw).expect("send");
        let mut status = String::new();
        self.s.read_line(&mut status).expect("status line");
        let code: u16 = status
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("status line {status:?}"));
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            self.s.read_line(&mut h).expect("header");
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some(v) = h.strip_prefix("Content-Length: ") {
                len = v.parse().expect("Content-Length");
            }
        }
        let mut body = vec![0u8; len];
        self.s.read_exact(&mut body).expect("body");
        (code, body)
    }

    fn get(&mut self, target: &str) -> (u16, Vec<u8>) {
        self.raw(format!("GET {target} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())
    }

    /// (in flight now, most at once, finished) of /async.
    fn stats(&mut self) -> (u64, u64, u64) {
        let (code, body) = self.get("/stats");
        assert_eq!(code, 200);
        let v: Vec<u64> = String::from_utf8_lossy(&body)
            .split_whitespace()
            .map(|x| x.parse().expect("stats number"))
            .collect();
        (v[0], v[1], v[2])
    }
}

/// The payload the server transforms for `/sync?n=N` and `/async?n=N`.
fn request(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7) as u8).collect()
}

#[test]
fn sync_and_async_answer_aes_ctr_bit_identically() {
    let _g = serial();
    let Some(py) = python() else { return };
    let s = Server::start(&py, &[("TOFFLOAD_EMU_LAT_US", "200".into())], None);
    let mut c = Client::connect(s.port);
    for n in [1usize, 16, 1000, 1024, 4097, 65536] {
        let want = payload::expected(&request(n));
        for form in ["sync", "async"] {
            let (code, body) = c.get(&format!("/{form}?n={n}"));
            assert_eq!(
                code,
                200,
                "/{form}?n={n}: {}",
                String::from_utf8_lossy(&body)
            );
            assert!(
                body == want,
                "/{form}?n={n}: not AES-128-CTR of the payload"
            );
        }
    }
    // 64 clients at once on /async: every answer right, many offloads in flight on
    // the one event loop thread.
    let want = payload::expected(&request(1024));
    let port = s.port;
    let wrong: usize = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..64)
            .map(|_| {
                let want = &want;
                sc.spawn(move || {
                    let mut c = Client::connect(port);
                    (0..20)
                        .filter(|_| c.get("/async?n=1024") != (200, want.clone()))
                        .count()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("client")).sum()
    });
    assert_eq!(wrong, 0, "wrong /async answers under 64 clients");
    let (now, most, finished) = c.stats();
    println!("/async: {most} at most in flight, {finished} finished, {now} now");
    assert!(finished >= 64 * 20, "only {finished} finished");
    assert!(most > 1, "/async never had more than one offload in flight");
    assert_eq!(now, 0);
}

#[test]
fn bad_input_and_backend_errors_are_http_errors() {
    let _g = serial();
    let Some(py) = python() else { return };
    let mut s = Server::start(&py, &[("TOFFLOAD_EMU_LAT_US", "50".into())], None);
    let mut c = Client::connect(s.port);
    for (target, code) in [
        ("/async?n=0", 400),
        ("/async?n=abc", 400),
        ("/sync?n=-5", 400),
        ("/async?n=2097152", 400),
        ("/nowhere", 404),
    ] {
        let (got, body) = c.get(target);
        assert_eq!(got, code, "{target}: {}", String::from_utf8_lossy(&body));
    }
    // Not GET: an error, and the connection closes; the server serves the next.
    let mut bad = Client::connect(s.port);
    assert_eq!(bad.raw(b"POST /async HTTP/1.1\r\n\r\n").0, 400);
    // A header flood is cut off at 100 lines.
    let mut flood = Client::connect(s.port);
    let mut req = b"GET /async HTTP/1.1\r\n".to_vec();
    for i in 0..200 {
        req.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
    }
    req.extend_from_slice(b"\r\n");
    assert_eq!(flood.raw(&req).0, 431);
    assert_eq!(c.get("/async?n=16").0, 200);
    assert!(s.alive());
    drop(s);

    // A malformed device knob: every offload fails with -EINVAL, as an HTTP error.
    let mut s = Server::start(&py, &[("TOFFLOAD_EMU_LANES", "0".into())], None);
    let mut c = Client::connect(s.port);
    for form in ["sync", "async"] {
        let (code, body) = c.get(&format!("/{form}?n=64"));
        let text = String::from_utf8_lossy(&body);
        assert_eq!(code, 500, "/{form} with TOFFLOAD_EMU_LANES=0: {text}");
        assert!(text.contains("Invalid argument"), "{text}");
    }
    assert!(s.alive(), "the server died of a device error");
}

// ---- the measurement ---------------------------------------------------------------

struct Run {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// wrk's latency field (`512.00us`, `1.23ms`, `2.01s`) in ms.
fn wrk_ms(s: &str) -> f64 {
    let (num, mult) = if let Some(n) = s.strip_suffix("us") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1e3)
    } else {
        panic!("wrk latency {s:?}")
    };
    num.parse::<f64>().expect("wrk number") * mult
}

/// One wrk run (pinned to `cpu`) of `target`.
fn wrk(exe: &Path, port: u16, target: &str, conns: usize, cpu: Option<usize>) -> Run {
    let mut c = Command::new("timeout");
    c.arg("60")
        .arg(exe)
        .args(["-t1", &format!("-c{conns}"), "-d2s", "--latency"])
        .arg(format!("http://127.0.0.1:{port}{target}"))
        .stdin(Stdio::null());
    pin(&mut c, cpu);
    let o = c.output().expect("running wrk");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "wrk {target} failed ({}):\n{out}",
        o.status
    );
    assert!(
        !out.contains("Non-2xx"),
        "wrk {target} got error responses:\n{out}"
    );
    let field = |key: &str| -> &str {
        out.lines()
            .map(str::trim)
            .find_map(|l| l.strip_prefix(key))
            .map(str::trim)
            .unwrap_or_else(|| panic!("wrk printed no {key:?}:\n{out}"))
    };
    Run {
        rps: field("Requests/sec:").parse().expect("Requests/sec"),
        p50_ms: wrk_ms(field("50%")),
        p99_ms: wrk_ms(field("99%")),
    }
}

/// Lines between `# NAME BEGIN` and `# NAME END`: (all, code only).
fn count_lines(src: &str, name: &str) -> (usize, usize) {
    let (begin, end) = (format!("# {name} BEGIN"), format!("# {name} END"));
    let body: Vec<&str> = src
        .lines()
        .skip_while(|l| l.trim() != begin)
        .skip(1)
        .take_while(|l| l.trim() != end)
        .collect();
    let code = body
        .iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count();
    (body.len(), code)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[test]
fn reroute_python_benchmark() {
    let _g = serial();
    let Some(py) = python() else { return };
    let Some(wrk_exe) = find("wrk") else {
        harness::skip("wrk is not installed (Debian package wrk; .ci/run installs it)");
        return;
    };
    let src = std::fs::read_to_string(script()).expect("the script");
    let (reroute_all, reroute_code) = count_lines(&src, "REROUTE");
    let (sync_all, sync_code) = count_lines(&src, "SYNC");
    assert!(reroute_code > 0 && sync_code > 0, "line markers missing");
    let rounds: usize =
        match std::env::var("TOFFLOAD_REROUTE_ROUNDS") {
            Err(_) => 1,
            Ok(v) => v.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| {
                panic!("TOFFLOAD_REROUTE_ROUNDS={v:?}: want a positive integer")
            }),
        };
    let conns = 64;
    let (scpu, lcpu) = if harness::cpus() > 1 {
        (Some(0), Some(1))
    } else {
        (None, None)
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut rows = Vec::new();
    let mut speedup_1000 = 0.0;
    for lat_us in [50u64, 200, 1000] {
        let env = vec![
            ("TOFFLOAD_EMU_LAT_US", lat_us.to_string()),
            ("TOFFLOAD_EMU_LANES", "64".to_string()),
        ];
        let s = Server::start(&py, &env, scpu);
        let (mut sync, mut rerouted) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            sync.push(wrk(&wrk_exe, s.port, "/sync?n=1024", conns, lcpu));
            rerouted.push(wrk(&wrk_exe, s.port, "/async?n=1024", conns, lcpu));
        }
        let (_, most, _) = Client::connect(s.port).stats();
        let pick = |runs: &[Run]| {
            (
                median(runs.iter().map(|r| r.rps).collect()),
                median(runs.iter().map(|r| r.p50_ms).collect()),
                median(runs.iter().map(|r| r.p99_ms).collect()),
            )
        };
        let (a, b) = (pick(&sync), pick(&rerouted));
        let speedup = b.0 / a.0;
        if lat_us == 1000 {
            speedup_1000 = speedup;
        }
        println!(
            "{lat_us} us: /sync {:.0} req/s (p50 {:.2} ms, p99 {:.2} ms), /async {:.0} req/s \
             (p50 {:.2} ms, p99 {:.2} ms), {speedup:.2}x, at most {most} in flight",
            a.0, a.1, a.2, b.0, b.1, b.2
        );
        rows.push(format!(
            "| {lat_us} | {:.0} | {:.2} / {:.2} | {:.0} | {:.2} / {:.2} | {speedup:.2}x | {most} |",
            a.0, a.1, a.2, b.0, b.1, b.2
        ));
    }
    let version = Command::new(&py)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| "python3".into());
    let md = format!(
        "Python asyncio reroute: backends/integrations/python/toffload_asyncio.py on Debian's \
         {version} (ctypes over libtoffload_accel.so, no compiled glue), driven by wrk \
         (`-t1 -c{conns} -d2s --latency`, 1 KiB payloads). Emulated device, 64 lanes, offload \
         latency per row. Server on core 0, wrk on core 1 (the device thread shares core 0 with \
         the server). {rounds} round(s) per row, medians. Load average at the start: {load}\n\
         Written by `reroute_python_benchmark` in tests/tests/reroute_python.rs \
         (`cargo xtask bench reroute` runs it with 3 rounds).\n\n\
         Lines in toffload_asyncio.py, counted from the file: the rerouted path (REROUTE markers: \
         `Accel.run`, the completion fd's reader, the wait for room) {reroute_all} lines, \
         {reroute_code} of code; the synchronous path (SYNC markers: `Accel.run_sync`) {sync_all} \
         lines, {sync_code} of code. Both share the ctypes binding and the HTTP server.\n\n\
         | offload us | /sync req/s | sync p50 / p99 ms | /async req/s | async p50 / p99 ms | speedup | most in flight (async) |\n\
         |---:|---:|---:|---:|---:|---:|---:|\n{}\n\n\
         Target: rerouted >= 2x sync at 1000 us: {}.\n",
        rows.join("\n"),
        if speedup_1000 >= 2.0 { "met" } else { "not met" },
        load = load.trim(),
    );
    println!("\n{md}");
    if let Some(out) = std::env::var_os("TOFFLOAD_REROUTE_OUT") {
        let out = Path::new(&out).with_file_name("reroute-python.md");
        std::fs::write(&out, &md).expect("writing the results file");
        println!("wrote {}", out.display());
    }
    assert!(
        speedup_1000 > 2.0,
        "/async only {speedup_1000:.2}x /sync at 1000 us"
    );
}
