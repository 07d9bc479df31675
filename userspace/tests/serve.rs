//! `toffload-watch serve` end to end, as root: two example servers named in a config
//! file, each under the load generator; /metrics scraped and parsed with a Prometheus
//! text-format parser (prometheus-parse), each target's requests/s checked against
//! the load generator's own count over the same seconds; one server killed and
//! started again (new pid, same name) and followed. Also: a bad config's exit, and
//! peers that hold a connection (silent, or an endless header) not holding a scrape.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::load::{self, Config};

mod common;
use common::{ready, serial, watch_cmd};

/// A running `toffload-watch serve`, its stderr followed.
struct Serve {
    child: Child,
    port: u16,
    _stderr: mpsc::Receiver<String>,
}

impl Serve {
    /// `config`: the targets, and any setting besides the listen address and the
    /// interval (1 s).
    fn start(config: &str, dir: &TempDir) -> Serve {
        let port = harness::free_port().expect("a free port");
        let path = dir.0.join("serve.toml");
        std::fs::write(
            &path,
            format!("listen = \"127.0.0.1:{port}\"\ninterval = \"1s\"\n{config}"),
        )
        .expect("write the config");
        let mut child = watch_cmd()
            .arg("serve")
            .arg("--config")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start toffload-watch serve");
        let err = child.stderr.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("serve: {line}");
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(l) if l.contains("serving http://") => break,
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(_) => panic!("serve ended before serving"),
            }
            assert!(Instant::now() < deadline, "serve did not start within 30 s");
        }
        Serve {
            child,
            port,
            _stderr: rx,
        }
    }

    fn get(&self, path: &str) -> (u16, String) {
        http_get(self.port, path, Duration::from_secs(5)).expect("an answer")
    }

    fn metrics(&self) -> Vec<prometheus_parse::Sample> {
        let (code, body) = self.get("/metrics");
        assert_eq!(code, 200, "{body}");
        let lines = body.lines().map(|l| Ok(l.to_string()));
        prometheus_parse::Scrape::parse(lines)
            .expect("parses as Prometheus text")
            .samples
    }

    fn status(&self) -> serde_json::Value {
        let (code, body) = self.get("/status");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).expect("JSON")
    }

    /// The target's entry in /status.
    fn target(&self, name: &str) -> serde_json::Value {
        self.status()["targets"]
            .as_array()
            .expect("targets")
            .iter()
            .find(|t| t["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no target {name} in /status"))
    }

    /// Waits until the target is up on `pid` with a completed window.
    fn wait_up(&self, name: &str, pid: u32, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let t = self.target(name);
            if t["state"] == "up" && t["pid"] == pid && !t["last_window"].is_null() {
                return;
            }
            assert!(Instant::now() < deadline, "{name} not up on pid {pid}: {t}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// SIGTERM, then the exit code (killed after 15 s).
    fn stop(mut self) -> i32 {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return s.code().unwrap_or(-1);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("serve did not stop within 15 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A GET over a fresh connection: (status code, body), or why not.
fn http_get(port: u16, path: &str, limit: Duration) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(limit)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(limit))
        .map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no head")?;
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("no status code")?;
    Ok((code, body.to_string()))
}

fn value(s: &prometheus_parse::Sample) -> f64 {
    match s.value {
        prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Untyped(v) => v,
        _ => f64::NAN,
    }
}

/// The value of `metric` for `target` (extra labels must match too).
fn sample(samples: &[prometheus_parse::Sample], metric: &str, target: &str) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.metric == metric && s.labels.get("target") == Some(target))
        .map(value)
}

/// Requests/s offered to each server: well under what either serves on two busy CPUs.
const LOAD_RATE: f64 = 500.0;

struct TempDir(PathBuf);

impl TempDir {
    /// `tag`: the test's own, since the suite's tests run side by side in one process.
    fn new(tag: &str) -> TempDir {
        let d =
            std::env::temp_dir().join(format!("toffload-serve-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        TempDir(d)
    }

    /// A link named `name` to a dist binary: started through it, the process's comm
    /// is `name`, which no other test's server has (suites may run side by side).
    fn alias(&self, bin: &str, name: &str) -> String {
        let link = self.0.join(name);
        std::os::unix::fs::symlink(harness::bin(bin).expect("built"), &link).expect("symlink");
        link.to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Load on `port` from a thread: 8 connections, open loop at LOAD_RATE, `secs` long.
/// Open loop, so that the rate is steady: on this shared 2-CPU host a closed loop's
/// rate swings by half from one 0.1 s to the next, and a window's edges, stamped a
/// few ms after its counters are read when the host is busy, then shift its count
/// against the load's by more than the 15% checked.
fn load_on(port: u16, secs: f64) -> std::thread::JoinHandle<load::Report> {
    std::thread::spawn(move || {
        let mut cfg = Config::new(port);
        cfg.conns = 8;
        cfg.rate = Some(LOAD_RATE);
        cfg.duration = Duration::from_secs_f64(secs);
        cfg.warmup = Duration::from_millis(200);
        load::run(&cfg).expect("load run")
    })
}

/// One window of one target as scraped: its span (Unix times) and the requests the
/// service says were served in it.
#[derive(Clone, Copy, Debug)]
struct Seen {
    from: f64,
    to: f64,
    requests: f64,
}

fn seen(samples: &[prometheus_parse::Sample], name: &str) -> Option<Seen> {
    let requests = sample(samples, "toffload_window_requests", name)?;
    let to = sample(samples, "toffload_window_timestamp_seconds", name)?;
    let wall = sample(samples, "toffload_window_seconds", name)?;
    assert!(sample(samples, "toffload_requests_per_second", name).is_some());
    Some(Seen {
        from: to - wall,
        to,
        requests,
    })
}

/// The windows' requests summed against the load generator's own count over the same
/// seconds, (watched, load's) per second; summed, so that a request counted on the
/// other side of an inner edge than the load counted it (an edge is stamped a few ms
/// after its counters are read, more on a busy host) still counts once.
fn agreement(windows: &[Seen], name: &str, r: &load::Report) -> Result<(f64, f64), String> {
    let inside: Vec<&Seen> = windows
        .iter()
        .filter(|w| r.rate_between(w.from, w.to).is_some())
        .collect();
    if inside.len() < 2 {
        return Err(format!(
            "{name}: {} whole windows inside the load",
            inside.len()
        ));
    }
    let secs: f64 = inside.iter().map(|w| w.to - w.from).sum();
    let watched = inside.iter().map(|w| w.requests).sum::<f64>() / secs;
    let truth = inside
        .iter()
        .map(|w| r.rate_between(w.from, w.to).unwrap_or(0.0) * (w.to - w.from))
        .sum::<f64>()
        / secs;
    if (watched - truth).abs() <= 0.15 * truth {
        Ok((watched, truth))
    } else {
        Err(format!(
            "{name}: scraped {watched:.0}/s, load generator {truth:.0}/s over {} windows",
            inside.len()
        ))
    }
}

/// Loads both servers for 6 s, scrapes every 250 ms from 1.5 s in (each window once),
/// checks each target against its load and the last scrape's families.
fn check_under_load(serve: &Serve, targets: &[(&str, u16)]) {
    let loads: Vec<_> = targets.iter().map(|&(_, p)| load_on(p, 6.0)).collect();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    let mut windows: Vec<Vec<Seen>> = vec![Vec::new(); targets.len()];
    let mut samples = Vec::new();
    while t0.elapsed() < Duration::from_millis(6000) {
        samples = serve.metrics();
        for (i, &(name, _)) in targets.iter().enumerate() {
            if let Some(w) = seen(&samples, name) {
                if windows[i].last().is_none_or(|l| l.to != w.to) {
                    windows[i].push(w);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let reports: Vec<load::Report> = loads
        .into_iter()
        .map(|h| h.join().expect("load thread"))
        .collect();
    for ((&(name, _), r), seen) in targets.iter().zip(&reports).zip(&windows) {
        assert_eq!(r.wrong, 0, "{name}: wrong answers");
        assert_eq!(sample(&samples, "toffload_target_up", name), Some(1.0));
        let (rps, truth) = agreement(seen, name, r).unwrap_or_else(|e| panic!("{e}"));
        println!("{name}: scraped {rps:.0} req/s, load generator {truth:.0} req/s");
        // The verdict is one labelled series with value 1.
        let verdicts: Vec<_> = samples
            .iter()
            .filter(|s| s.metric == "toffload_verdict" && s.labels.get("target") == Some(name))
            .collect();
        assert_eq!(verdicts.len(), 1, "{verdicts:?}");
        assert_eq!(value(verdicts[0]), 1.0);
        assert!(verdicts[0].labels.get("verdict").is_some());
        for m in [
            "toffload_context_switches_per_second",
            "toffload_futex_waits_per_request",
            "toffload_watcher_overhead_share",
            "toffload_offload_stall_seconds",
        ] {
            assert!(sample(&samples, m, name).is_some(), "{name}: no {m}");
        }
    }
}

#[test]
fn serve_follows_two_servers_and_a_restart() {
    let _s = serial();
    if !ready() {
        return;
    }
    let dir = TempDir::new("follow");
    let (a_name, b_name) = (
        format!("tsc{}", std::process::id()),
        format!("tse{}", std::process::id()),
    );
    let a_bin = dir.alias("conn_server", &a_name);
    let b_bin = dir.alias("evloop_server", &b_name);
    let a = Server::start(&ServerSpec::new(&a_bin)).expect("conn_server");
    let b = Server::start(&ServerSpec::new(&b_bin)).expect("evloop_server");
    // Every event traced (a budget of 100%): the windows' counts are then exact, and
    // what is checked is the service (targets, windows, exposition, following), not
    // the sampled estimate, whose bursts miss the requests in flight at their edges
    // (untraced.rs; its own tests are the watch suite's).
    let serve = Serve::start(
        &format!(
            "overhead_budget = 100\n\
             [[target]]\nname = \"conn\"\nprocess = \"{a_name}\"\n\
             [[target]]\nname = \"evloop\"\nprocess = \"{b_name}\"\n"
        ),
        &dir,
    );
    serve.wait_up("conn", a.pid(), Duration::from_secs(30));
    serve.wait_up("evloop", b.pid(), Duration::from_secs(30));
    check_under_load(&serve, &[("conn", a.port), ("evloop", b.port)]);

    // Killed: down, and searched for.
    let old = a.pid();
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    while serve.target("conn")["state"] == "up" {
        assert!(Instant::now() < deadline, "conn still up after its exit");
        std::thread::sleep(Duration::from_millis(100));
    }
    let samples = serve.metrics();
    assert_eq!(sample(&samples, "toffload_target_up", "conn"), Some(0.0));
    assert_eq!(sample(&samples, "toffload_target_up", "evloop"), Some(1.0));

    // Started again: a new pid under the same name, followed.
    let a = Server::start(&ServerSpec::new(&a_bin)).expect("conn_server again");
    assert_ne!(a.pid(), old);
    serve.wait_up("conn", a.pid(), Duration::from_secs(30));
    let t = serve.target("conn");
    assert_eq!(t["pid"], a.pid());
    assert!(
        t["attaches"].as_u64() >= Some(2) && t["exits"].as_u64() >= Some(1),
        "{t}"
    );
    check_under_load(&serve, &[("conn", a.port), ("evloop", b.port)]);
    let samples = serve.metrics();
    assert_eq!(
        sample(&samples, "toffload_target_pid", "conn"),
        Some(f64::from(a.pid()))
    );
    assert!(sample(&samples, "toffload_target_attaches_total", "conn") >= Some(2.0));
    assert_eq!(serve.stop(), 0);
}

#[test]
fn a_bad_config_exits_2_naming_the_mistake() {
    let Ok(bin) = harness::bin("toffload-watch") else {
        harness::skip("toffload-watch is not built");
        return;
    };
    let dir = TempDir::new("config");
    let cases = [
        (
            "intervall = \"1s\"\n[[target]]\npid = 1\n",
            "unknown field `intervall`",
        ),
        (
            "[[target]]\nname = \"x\"\n",
            "give one of unit, cgroup, process or pid",
        ),
        (
            "listen = \"nowhere\"\n[[target]]\npid = 1\n",
            "not an address:port",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let p = dir.0.join(format!("bad{i}.toml"));
        std::fs::write(&p, text).expect("write");
        let out = Command::new(&bin)
            .arg("serve")
            .arg("--config")
            .arg(&p)
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text:?}: {err}");
        assert!(
            err.contains("bad configuration") && err.contains(want),
            "{text:?}: {err}"
        );
    }
    let out = Command::new(&bin)
        .args(["serve", "--config"])
        .arg(dir.0.join("missing.toml"))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.toml"));
}

#[test]
fn a_hostile_peer_does_not_hold_a_scrape() {
    let _s = serial();
    if !ready() {
        return;
    }
    let dir = TempDir::new("hostile");
    // A target that is not running: the service serves while it searches.
    let serve = Serve::start("[[target]]\nprocess = \"no-such-server-x\"\n", &dir);
    let port = serve.port;
    // One peer says nothing; another sends a header that never ends.
    let silent = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let mut flood = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    flood
        .set_write_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let _ = flood.write_all(b"GET /metrics HTTP/1.1\r\nX-Junk: ");
    let junk = vec![b'a'; 16 * 1024];
    let _ = flood.write_all(&junk);
    // Meanwhile a scrape is answered at once.
    let t0 = Instant::now();
    let (code, body) = http_get(port, "/metrics", Duration::from_secs(2)).expect("scrape");
    assert_eq!(code, 200);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(
        body.contains("toffload_target_up{target=\"no-such-server-x\"} 0"),
        "{body}"
    );
    // The flood is refused, the silent peer timed out, unknown paths are 404.
    let mut answer = String::new();
    flood
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = flood.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
    let mut silent = silent;
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut answer = String::new();
    let _ = silent.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert_eq!(serve.get("/nope").0, 404);
    let st = serve.target("no-such-server-x");
    assert_eq!(st["state"], "searching", "{st}");
    assert_eq!(serve.stop(), 0);
}

/// A cgroup standing in for a systemd unit's (NAME.service in the cgroup tree, where
/// `unit` looks); removed on drop once empty.
struct UnitCgroup(PathBuf);

impl UnitCgroup {
    fn new(unit: &str) -> UnitCgroup {
        let root = std::path::Path::new("/sys/fs/cgroup");
        let base = if root.join("cgroup.procs").is_file() {
            root.to_path_buf()
        } else {
            root.join("unified")
        };
        let dir = base.join(format!("{unit}.service"));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        UnitCgroup(dir)
    }

    /// Moves a process (all its threads) into the unit, as systemd starts it there.
    fn adopt(&self, pid: u32) {
        std::fs::write(self.0.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|e| panic!("moving {pid} into {}: {e}", self.0.display()));
    }
}

impl Drop for UnitCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A target named by unit: found in its cgroup, searched for while the unit is empty,
/// and followed when the unit's server is started again.
#[test]
fn a_unit_target_is_followed_across_a_restart() {
    let _s = serial();
    if !ready() {
        return;
    }
    let dir = TempDir::new("unit");
    let unit = format!("toffload-serve-test-{}", std::process::id());
    let cg = UnitCgroup::new(&unit);
    let a = Server::start(&ServerSpec::new("conn_server")).expect("conn_server");
    cg.adopt(a.pid());
    let serve = Serve::start(
        &format!("[[target]]\nname = \"web\"\nunit = \"{unit}\"\n"),
        &dir,
    );
    serve.wait_up("web", a.pid(), Duration::from_secs(30));
    let old = a.pid();
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // Searched for at least once since the exit: the unit is empty.
        let t = serve.target("web");
        let why = t["why"].as_str().unwrap_or_default();
        if t["state"] == "searching" && why.contains("no processes") {
            break;
        }
        assert!(Instant::now() < deadline, "web still {t} after its exit");
        std::thread::sleep(Duration::from_millis(100));
    }
    let a = Server::start(&ServerSpec::new("conn_server")).expect("conn_server again");
    assert_ne!(a.pid(), old);
    cg.adopt(a.pid());
    serve.wait_up("web", a.pid(), Duration::from_secs(30));
    let samples = serve.metrics();
    assert_eq!(sample(&samples, "toffload_target_up", "web"), Some(1.0));
    assert_eq!(
        sample(&samples, "toffload_target_pid", "web"),
        Some(f64::from(a.pid()))
    );
    assert_eq!(serve.stop(), 0);
    drop(a);
}
