//! What the reroute suites (tests/tests/reroute_*.rs) share: finding a server's
//! programs, pinning them, a small keep-alive HTTP client for the checks, wrk runs
//! and their figures, and counting an integration's lines from its markers.

use crate::harness;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const IO_TIMEOUT: Duration = Duration::from_secs(20);

/// `name` in the usual program folders.
pub fn find(name: &str) -> Option<PathBuf> {
    ["/usr/bin", "/usr/local/bin", "/usr/sbin", "/usr/lib/go/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// Runs `cmd` on `cpu` (where the machine has more than one).
pub fn pin(cmd: &mut Command, cpu: Option<usize>) {
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

/// (server CPU, load CPU): apart where there are two.
pub fn cpus_apart() -> (Option<usize>, Option<usize>) {
    if harness::cpus() > 1 {
        (Some(0), Some(1))
    } else {
        (None, None)
    }
}

/// A keep-alive HTTP/1.1 client for the few requests the checks make.
pub struct Client {
    s: BufReader<TcpStream>,
}

impl Client {
    pub fn connect(port: u16) -> Client {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        Client {
            s: BufReader::new(s),
        }
    }

    /// Sends `raw` and reads one response: (status, body).
    pub fn raw(&mut self, raw: &[u8]) -> (u16, Vec<u8>) {
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
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().expect("Content-Length");
                }
            }
        }
        let mut body = vec![0u8; len];
        self.s.read_exact(&mut body).expect("body");
        (code, body)
    }

    pub fn get(&mut self, target: &str) -> (u16, Vec<u8>) {
        self.raw(format!("GET {target} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())
    }

    /// The whitespace-separated numbers of a stats path.
    pub fn numbers(&mut self, target: &str) -> Vec<u64> {
        let (code, body) = self.get(target);
        assert_eq!(code, 200, "{target}");
        String::from_utf8_lossy(&body)
            .split_whitespace()
            .map(|x| x.parse().expect("a number"))
            .collect()
    }
}

/// Every size the HTTP integrations are checked at, each form answering AES-128-CTR
/// of the payload bit for bit.
pub fn check_answers(port: u16, forms: &[&str]) {
    let mut c = Client::connect(port);
    for n in [1usize, 16, 1000, 1024, 4097, 65536] {
        let want = crate::loadgen::payload::expected(&request(n));
        for form in forms {
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
}

/// `clients` connections at once, each sending `reps` requests for `target` (1 KiB):
/// how many answers were not AES-128-CTR of the payload.
pub fn wrong_under_clients(port: u16, target: &str, clients: usize, reps: usize) -> usize {
    let want = crate::loadgen::payload::expected(&request(1024));
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..clients)
            .map(|_| {
                let want = &want;
                sc.spawn(move || {
                    let mut c = Client::connect(port);
                    (0..reps)
                        .filter(|_| c.get(target) != (200, want.clone()))
                        .count()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("client")).sum()
    })
}

/// A server started by a reroute suite: killed and reaped on drop.
pub struct Server {
    pub child: std::process::Child,
    pub port: u16,
}

impl Server {
    /// Starts `cmd` with `env`, pinned to `cpu`, and reads the `port N` line it prints
    /// first, within 20 s (read on a thread, so a server that never prints cannot hang
    /// the test).
    pub fn spawn(
        cmd: &mut Command,
        env: &[(&str, String)],
        cpu: Option<usize>,
        what: &str,
    ) -> Server {
        for (k, v) in env {
            cmd.env(k, v);
        }
        pin(cmd, cpu);
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {what}: {e}"));
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(out).read_line(&mut line);
            let _ = tx.send(line);
        });
        let Ok(line) = rx.recv_timeout(Duration::from_secs(20)) else {
            let _ = child.kill();
            panic!("{what} printed no port within 20 s");
        };
        match line
            .strip_prefix("port ")
            .and_then(|p| p.trim().parse().ok())
        {
            Some(port) => Server { child, port },
            None => {
                let _ = child.kill();
                panic!("{what} said {line:?}, not `port N`")
            }
        }
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The payload the HTTP integrations transform for `?n=N`: byte i = i*7 mod 256.
pub fn request(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7) as u8).collect()
}

pub struct Run {
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// wrk's latency field (`512.00us`, `1.23ms`, `2.01s`) in ms.
pub fn wrk_ms(s: &str) -> f64 {
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

/// One 2 s wrk run (pinned to `cpu`) of `target` with `conns` connections; any
/// error response fails it.
pub fn wrk(exe: &Path, port: u16, target: &str, conns: usize, cpu: Option<usize>) -> Run {
    wrk_for(exe, port, target, conns, cpu, 2)
}

/// [`wrk`] for `secs` seconds.
pub fn wrk_for(
    exe: &Path,
    port: u16,
    target: &str,
    conns: usize,
    cpu: Option<usize>,
    secs: u32,
) -> Run {
    let mut c = Command::new("timeout");
    c.arg("60")
        .arg(exe)
        .args([
            "-t1",
            &format!("-c{conns}"),
            &format!("-d{secs}s"),
            "--latency",
        ])
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

/// The medians of runs: (req/s, p50 ms, p99 ms).
pub fn medians(runs: &[Run]) -> (f64, f64, f64) {
    (
        median(runs.iter().map(|r| r.rps).collect()),
        median(runs.iter().map(|r| r.p50_ms).collect()),
        median(runs.iter().map(|r| r.p99_ms).collect()),
    )
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Lines between the markers `{comment} NAME BEGIN` and `{comment} NAME END`: (all,
/// code only: not blank, not a comment line).
pub fn count_lines(src: &str, comment: &str, name: &str) -> (usize, usize) {
    let (begin, end) = (
        format!("{comment} {name} BEGIN"),
        format!("{comment} {name} END"),
    );
    let body: Vec<&str> = src
        .lines()
        .skip_while(|l| l.trim() != begin)
        .skip(1)
        .take_while(|l| l.trim() != end)
        .collect();
    let code = body
        .iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty() && !l.starts_with(comment))
        .count();
    (body.len(), code)
}

/// TOFFLOAD_REROUTE_ROUNDS, default 1.
pub fn rounds() -> usize {
    match std::env::var("TOFFLOAD_REROUTE_ROUNDS") {
        Err(_) => 1,
        Ok(v) => v
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or_else(|| panic!("TOFFLOAD_REROUTE_ROUNDS={v:?}: want a positive integer")),
    }
}

/// Writes a results table beside TOFFLOAD_REROUTE_OUT as `name`, when that is set.
pub fn write_result(name: &str, md: &str) {
    if let Some(out) = std::env::var_os("TOFFLOAD_REROUTE_OUT") {
        let out = Path::new(&out).with_file_name(name);
        std::fs::write(&out, md).expect("writing the results file");
        println!("wrote {}", out.display());
    }
}

/// How long [`predicted_reroute`] watches, seconds.
pub const WATCH_SECS: u32 = 3;

/// How long the load given to [`predicted_reroute`] must run, seconds: past the
/// watch's end, so that no window sees the load stop. A window that did counted its
/// untraced seconds after the load had ended, and its stock rate (the prediction's
/// denominator) read 6,300 req/s for a server serving 15,600.
pub const WATCHED_LOAD_SECS: u32 = WATCH_SECS + 2;

/// The model's prediction for the reroute from `watches` toffload-watches of `pid`,
/// [`WATCH_SECS`] each, while `load` runs against the synchronous form for
/// [`WATCHED_LOAD_SECS`]: the median of all their windows' (see [`watched_windows`]).
/// One watch gives two windows, whose traced parts at 50 us hold 0.1 s of requests:
/// the loop's CPU per request moved by half between them on nginx.
pub fn predicted_reroute(pid: u32, watches: usize, mut load: impl FnMut()) -> Option<f64> {
    let mut v = Vec::new();
    for _ in 0..watches.max(1) {
        v.extend(
            watched_windows(pid, &mut load)?
                .iter()
                .filter_map(|w| w["model"]["recipe_speedup"].as_f64()),
        );
    }
    if v.is_empty() {
        println!("toffload-watch gave no prediction for pid {pid}");
        return None;
    }
    Some(median(v))
}

/// The windows with requests of a [`WATCH_SECS`] toffload-watch of `pid` while `load`
/// runs. None, with the reason printed, where the watcher cannot run (not root, not
/// built); under CI (TOFFLOAD_NO_SKIP) that fails.
pub fn watched_windows(pid: u32, load: impl FnOnce()) -> Option<Vec<serde_json::Value>> {
    let secs = WATCH_SECS;
    use std::sync::mpsc;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        harness::skip("the model's prediction needs toffload-watch, which needs root");
        return None;
    }
    let exe = match harness::bin("toffload-watch") {
        Ok(e) => e,
        Err(e) => {
            harness::skip(&format!("toffload-watch: {e}"));
            return None;
        }
    };
    let mut child = Command::new(exe)
        .args(["--json", "--interval", "1s", "--duration"])
        .arg(format!("{secs}s"))
        .arg("--pid")
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting toffload-watch");
    let err = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // Load only once the probes are in.
    let t0 = std::time::Instant::now();
    let mut said = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(l) => {
                let attached = l.contains("attached to pid");
                said.push(l);
                if attached {
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) if t0.elapsed() < Duration::from_secs(30) => {}
            Err(_) => {
                let _ = child.kill();
                panic!("toffload-watch did not attach within 30 s: {said:?}");
            }
        }
    }
    load();
    let out = child.wait_with_output().expect("toffload-watch");
    assert!(out.status.success(), "toffload-watch failed: {said:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    harness::dump_watch(&format!("pid{pid}"), &text);
    Some(
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|j| j.get("window").cloned())
            .filter(|w| w["requests"].as_f64().is_some_and(|r| r > 0.0))
            .collect(),
    )
}

/// The "predicted" and "error" cells of a results row (without the outer bars).
pub fn prediction_cells(predicted: Option<f64>, measured: f64) -> String {
    match predicted {
        Some(p) => format!("{p:.2}x | {:+.0}%", (p / measured - 1.0) * 100.0),
        None => "- | -".into(),
    }
}

/// The model's median absolute error over (predicted, measured) points, as a line
/// for a results file.
pub fn model_error_line(points: &[(f64, f64)]) -> String {
    if points.is_empty() {
        return "Model: no prediction (toffload-watch did not run).".into();
    }
    let errs: Vec<f64> = points.iter().map(|(p, m)| (p / m - 1.0).abs()).collect();
    let med = median(errs.clone());
    let worst = errs.iter().cloned().fold(0.0, f64::max);
    format!(
        "Model (toffload-watch of the synchronous form, the reroute's predicted speedup; \
         the paper's Prediction 1): median absolute error {:.0}% over {} points (target <= 20%: {}), \
         worst {:.0}%.",
        med * 100.0,
        points.len(),
        if med <= 0.20 { "met" } else { "NOT met" },
        worst * 100.0
    )
}

/// Rounds a reroute bench repeats each point, from `var` (1 when unset).
pub fn rounds_from_env(var: &str) -> usize {
    match std::env::var(var) {
        Err(_) => 1,
        Ok(v) => v
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or_else(|| panic!("{var}={v:?}: want a positive integer")),
    }
}

/// (server's CPU, load tool's CPU): apart where there are two.
pub fn server_and_load_cpus() -> (Option<usize>, Option<usize>) {
    if crate::harness::cpus() > 1 {
        (Some(0), Some(1))
    } else {
        (None, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_latencies_read_in_ms() {
        assert_eq!(wrk_ms("512.00us"), 0.512);
        assert_eq!(wrk_ms("1.50ms"), 1.5);
        assert_eq!(wrk_ms("2.00s"), 2000.0);
    }

    #[test]
    fn lines_are_counted_between_markers() {
        let src = "a\n# X BEGIN\n# why\ncode()\n\nmore()\n# X END\nb\n";
        assert_eq!(count_lines(src, "#", "X"), (4, 2));
        assert_eq!(
            count_lines("// S BEGIN\nint x;\n// S END\n", "//", "S"),
            (1, 1)
        );
    }
}
