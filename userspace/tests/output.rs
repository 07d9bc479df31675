//! toffload-watch's command line in bcc's style and what it writes: the positional
//! INTERVAL COUNT, -T's clock on every text line, the JSON lines' envelope (`ts` on
//! every line, `schema` on the header: checked by common::json_lines for every test
//! that reads JSON), and futex stacks named by function. As root, like watch.rs.

use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;
use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::load::{self, Config};

mod common;
use common::{get, json_lines, ready, serial, watch_cmd, Watcher};

/// A process to watch that does nothing, ended when dropped.
struct Idle(Child);

impl Idle {
    fn start() -> Idle {
        Idle(Command::new("sleep").arg("120").spawn().expect("sleep"))
    }
    fn pid(&self) -> String {
        self.0.id().to_string()
    }
}

impl Drop for Idle {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn positional_and_flag_forms_conflict() {
    if let Err(e) = harness::bin("toffload-watch") {
        harness::skip(&e);
        return;
    }
    for (args, says) in [
        (&["-p", "1", "-i", "2s", "1"][..], "--interval"),
        (&["-p", "1", "-d", "5s", "1", "3"], "--duration"),
        (&["-p", "1", "1", "0"], "COUNT"),
        (&["-p", "1", "soon"], "not a positive duration"),
        (&["-p", "1", "-T", "--tui"], "--tui"),
        (&["run", "-i", "1", "2", "--", "true"], "--interval"),
    ] {
        let out = watch_cmd().args(args).output().expect("run toffload-watch");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn interval_and_count_as_bcc_takes_them() {
    let _s = serial();
    if !ready() {
        return;
    }
    let target = Idle::start();
    let mut c = watch_cmd();
    // bcc's form: -p PID, -j, then INTERVAL in seconds and COUNT.
    c.args(["-j", "-p", &target.pid(), "0.3", "3"]);
    let (code, lines, err) = Watcher::start(c).finish();
    assert_eq!(code, 0, "{err:?}");
    let windows: Vec<&Value> = lines
        .iter()
        .filter(|(k, _)| k == "window")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(windows.len(), 3, "{lines:?}");
    // 0.3 s windows, not the default 1 s; the median, since a loaded machine can
    // delay one window's end.
    let walls: Vec<f64> = windows
        .iter()
        .map(|w| w["wall_secs"].as_f64().expect("wall_secs"))
        .collect();
    let median = harness::median(walls.clone());
    assert!(
        (0.2..=0.7).contains(&median),
        "0.3 s windows of {walls:?} s"
    );
    assert_eq!(get(&lines, "final")["ended"], "count");
    let types: Vec<&str> = lines.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(types, ["header", "window", "window", "window", "final"]);
}

#[test]
fn json_ts_follows_the_wall_clock() {
    let _s = serial();
    if !ready() {
        return;
    }
    let target = Idle::start();
    let out = watch_cmd()
        .args(["--json", "--pid", &target.pid(), "--interval", "400ms"])
        .args(["--duration", "1300ms"])
        .output()
        .expect("run toffload-watch");
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    // Every line passes the envelope check; the stamps never go back and the windows'
    // are about an interval apart.
    let lines = json_lines(&text);
    assert!(lines.len() >= 4, "{text}");
    let ts: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| v["ts"].as_f64().expect("ts"))
        .collect();
    assert_eq!(ts.len(), lines.len());
    assert!(ts.windows(2).all(|p| p[0] <= p[1]), "{ts:?}");
    let window_ts: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("window").is_some())
        .map(|v| v["ts"].as_f64().expect("ts"))
        .collect();
    let gaps: Vec<f64> = window_ts.windows(2).map(|p| p[1] - p[0]).collect();
    assert!(!gaps.is_empty(), "{text}");
    // Never sooner than the interval allows; about an interval apart (the median: a
    // loaded machine can delay one).
    assert!(gaps.iter().all(|&g| g >= 0.2), "{gaps:?}");
    let median = harness::median(gaps.clone());
    assert!((0.3..=0.8).contains(&median), "windows {gaps:?} s apart");
}

/// HH:MM:SS as seconds of the day.
fn day_secs(hms: &str) -> Option<i64> {
    let p: Vec<i64> = hms
        .split(':')
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    (hms.len() == 8 && p.len() == 3).then(|| p[0] * 3600 + p[1] * 60 + p[2])
}

#[test]
fn timestamp_prefixes_every_text_line() {
    let _s = serial();
    if !ready() {
        return;
    }
    let target = Idle::start();
    let out = watch_cmd()
        .args(["-T", "-p", &target.pid(), "-i", "300ms", "-d", "1s"])
        .output()
        .expect("run toffload-watch");
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    let now = toffload_watch::wall_clock::hms_local(toffload_watch::wall_clock::unix_now());
    let now = day_secs(&now).expect("HH:MM:SS");
    let mut windows = 0;
    for line in text.lines() {
        let (stamp, rest) = line.split_once(' ').unwrap_or((line, ""));
        let t = day_secs(stamp).unwrap_or_else(|| panic!("no HH:MM:SS: {line:?}"));
        // Local time, written in the last minute (across midnight too).
        let age = (now - t).rem_euclid(86_400);
        assert!(age <= 60, "{line:?} is {age} s before {now}");
        windows += usize::from(rest.starts_with("[window "));
    }
    assert!(windows >= 2, "{text}");
    assert!(text.contains("[TOTAL (duration)"), "{text}");
}

/// Function names of the frames of `module` in `frames` ("name+0xoff (module)").
fn functions_in(frames: &[Value], module: &str) -> Vec<String> {
    let suffix = format!(" ({module})");
    frames
        .iter()
        .filter_map(Value::as_str)
        .filter_map(|f| f.strip_suffix(&suffix))
        .filter_map(|f| f.rsplit_once("+0x").map(|(name, _)| name.to_string()))
        .collect()
}

#[test]
fn futex_stacks_name_the_servers_functions() {
    let _s = serial();
    if !ready() {
        return;
    }
    // Raw futex calls around each offload and, with --shared-mutex, a pthread mutex on
    // the request path: both make futex stacks that pass through the server's code.
    let server = Server::start(
        &ServerSpec::new("rawfutex_server")
            .arg("--shared-mutex")
            .arg("1")
            .env("TOFFLOAD_EMU_LAT_US", "200")
            .env("TOFFLOAD_WAIT", "block"),
    )
    .expect("rawfutex_server");
    let mut c = watch_cmd();
    c.args(["-j", "-d", "3.5s", "-p", &server.pid().to_string()]);
    let w = Watcher::start(c);
    let mut cfg = Config::new(server.port);
    cfg.conns = 8;
    cfg.duration = Duration::from_secs_f64(2.5);
    cfg.warmup = Duration::from_millis(100);
    let r = load::run(&cfg).expect("load run");
    assert_eq!(r.wrong, 0, "wrong answers");
    let (code, lines, err) = w.finish();
    assert_eq!(code, 0, "{err:?}");
    let stacks = get(&lines, "final")["futex_stacks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for s in &stacks {
        println!("futex stack x{}: {}", s["calls"], s["frames"]);
    }
    assert!(!stacks.is_empty(), "no futex stacks");
    // The server's own functions, as its sources define them (not a list kept here).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let source: String = [
        "tests/watch_programs/rawfutex_server.c",
        "tests/servers/common.c",
    ]
    .iter()
    .map(|p| std::fs::read_to_string(root.join(p)).expect("server source"))
    .collect();
    let named: Vec<String> = stacks
        .iter()
        .filter_map(|s| s["frames"].as_array())
        .flat_map(|f| functions_in(f, "rawfutex_server"))
        .collect();
    let defined: Vec<&String> = named
        .iter()
        .filter(|n| source.contains(&format!("{n}(")))
        .collect();
    assert!(
        !defined.is_empty(),
        "no frame names a function of rawfutex_server's source: {named:?} in {stacks:?}"
    );
    // libc's exported functions are named too (its .dynsym); the frames the symbols do
    // not cover keep module+offset.
    let all: Vec<&str> = stacks
        .iter()
        .filter_map(|s| s["frames"].as_array())
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        all.iter().any(|f| f.ends_with(" (libc.so.6)")),
        "no libc frame named: {all:?}"
    );
}
