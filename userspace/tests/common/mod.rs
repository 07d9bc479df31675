//! Shared by the watcher's integration suites: serialisation (every test measures
//! on a 2-core machine), the skip rule, and a watcher child followed until attached.
#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::Duration;
use toffload_tests::harness;

/// Fields of a /proc stat file, numbered as proc(5) numbers them.
pub const STAT_NICE: usize = 19;
pub const STAT_POLICY: usize = 41;

/// Field `n` of a /proc stat file (`/proc/PID/stat`, `/proc/PID/task/TID/stat`),
/// counted past the command name, which may hold spaces.
pub fn stat_field(path: &str, n: usize) -> Option<i64> {
    let stat = std::fs::read_to_string(path).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(n.checked_sub(3)?)?
        .parse()
        .ok()
}

/// One at a time: every test measures something on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// False (after harness::skip, which fails under CI) when not root or unbuilt.
pub fn ready() -> bool {
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        harness::skip("toffload-watch tests need root (BPF)");
        return false;
    }
    if let Err(e) = harness::bin("toffload-watch") {
        harness::skip(&e);
        return false;
    }
    true
}

/// The value of `field` (e.g. `prog_id`, `prog_type`) in the fdinfo of each of a
/// process's descriptors that has it: a watcher's loaded BPF programs.
pub fn fdinfo_values(pid: u32, field: &str) -> Vec<u32> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fdinfo")).expect("the process's fdinfo");
    let key = format!("{field}:");
    dir.flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix(key.as_str()))
                .and_then(|v| v.trim().parse().ok())
        })
        .collect()
}

pub fn watch_cmd() -> Command {
    Command::new(harness::bin("toffload-watch").expect("built"))
}

/// A running watcher whose stderr is followed until it says it is attached.
pub struct Watcher {
    pub child: Child,
    pub stderr: mpsc::Receiver<String>,
}

impl Watcher {
    pub fn start(mut cmd: Command) -> Watcher {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start toffload-watch");
        let err = child.stderr.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("watch: {line}");
                let _ = tx.send(line);
            }
        });
        let w = Watcher { child, stderr: rx };
        w.wait_attached();
        w
    }

    pub fn wait_attached(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            match self.stderr.recv_timeout(Duration::from_millis(200)) {
                Ok(l) if l.contains("attached to pid") => return,
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(_) => panic!("toffload-watch ended before attaching"),
            }
        }
        panic!("toffload-watch did not attach within 30 s");
    }

    /// Waits for the exit; (status code, JSON lines by key, stderr lines).
    pub fn finish(mut self) -> (i32, Vec<(String, Value)>, Vec<String>) {
        let mut out = String::new();
        self.child
            .stdout
            .take()
            .expect("piped")
            .read_to_string(&mut out)
            .expect("read stdout");
        let status = self.child.wait().expect("wait");
        let err: Vec<String> = self.stderr.try_iter().collect();
        (status.code().unwrap_or(-1), json_lines(&out), err)
    }
}

/// The JSON lines of a watch as (type, object), each line's envelope checked on the
/// way (`envelope`).
pub fn json_lines(out: &str) -> Vec<(String, Value)> {
    out.lines()
        .filter(|l| l.starts_with("{\""))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| envelope(&v))
        .collect()
}

/// The keys every line has beside its type's object (docs/json-schema.md).
const ENVELOPE: [&str; 2] = ["ts", "schema"];

/// A line's type and object, after checking its envelope: a wall-clock `ts` (Unix
/// seconds) on every line, `schema` (report::SCHEMA) on the header and only there,
/// and exactly one other key.
pub fn envelope(line: &Value) -> (String, Value) {
    let o = line
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {line}"));
    let ts = o
        .get("ts")
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("no ts: {line}"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    // Written by this test's watcher: within the last hour, not in the future.
    assert!(
        ts <= now + 1.0 && ts > now - 3600.0,
        "ts {ts} is not now ({now}): {line}"
    );
    let types: Vec<&String> = o
        .keys()
        .filter(|k| !ENVELOPE.contains(&k.as_str()))
        .collect();
    assert_eq!(types.len(), 1, "one type key per line: {line}");
    let ty = types[0].clone();
    match (ty.as_str(), o.get("schema")) {
        ("header", Some(n)) => assert_eq!(
            n.as_u64(),
            Some(u64::from(toffload_watch::report::SCHEMA)),
            "{line}"
        ),
        ("header", None) => panic!("header without schema: {line}"),
        (_, Some(_)) => panic!("schema outside the header: {line}"),
        (_, None) => {}
    }
    (ty.clone(), o[&ty].clone())
}

pub fn get<'a>(lines: &'a [(String, Value)], key: &str) -> &'a Value {
    &lines
        .iter()
        .rev()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key:?} line in {lines:?}"))
        .1
}

/// The key paths of a JSON value: `a.b` for objects, `a[]` for array elements (the
/// union over them), so that a field renamed or dropped by a refactor shows.
pub fn key_paths(v: &Value, at: &str, out: &mut std::collections::BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                out.insert(p.clone());
                key_paths(x, &p, out);
            }
        }
        Value::Array(a) => {
            for x in a {
                key_paths(x, &format!("{at}[]"), out);
            }
        }
        _ => {}
    }
}

/// Checks the keys of the JSON lines against the pinned list (tests/json_keys.txt:
/// `TYPE PATH` per line), so that a refactor cannot rename or drop a field of the
/// watcher's JSON by accident. Keys below an array or an optional part are checked
/// only where this run had something there; a field added on purpose is added to the
/// list
/// (TOFFLOAD_PIN_JSON_KEYS=write rewrites it from this run).
pub fn check_json_keys(lines: &[(String, Value)]) {
    use std::collections::BTreeSet;
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/json_keys.txt");
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for (ty, v) in lines {
        let mut paths = BTreeSet::new();
        key_paths(v, "", &mut paths);
        seen.extend(paths.into_iter().map(|p| format!("{ty} {p}")));
    }
    if std::env::var("TOFFLOAD_PIN_JSON_KEYS").as_deref() == Ok("write") {
        let header: String = std::fs::read_to_string(&file)
            .unwrap_or_default()
            .lines()
            .take_while(|l| l.starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect();
        let text: String = header + &seen.iter().map(|l| format!("{l}\n")).collect::<String>();
        std::fs::write(&file, text).expect("write json_keys.txt");
        return;
    }
    let pinned: BTreeSet<String> = std::fs::read_to_string(&file)
        .expect("tests/json_keys.txt")
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    let new: Vec<&String> = seen.difference(&pinned).collect();
    assert!(
        new.is_empty(),
        "JSON keys not in tests/json_keys.txt (renamed? add them if on purpose): {new:#?}"
    );
    // A pinned key must be there, unless its parent never held anything in this run
    // (an empty array, or an optional part that was null in every line).
    let missing: Vec<&String> = pinned
        .difference(&seen)
        .filter(|p| {
            let cut = p.rfind('.').max(p.rfind("[]").map(|i| i + 2));
            match cut {
                None => true,
                Some(i) => {
                    let parent = p[..i].trim_end_matches('.');
                    seen.iter().any(|s| {
                        s.strip_prefix(parent)
                            .is_some_and(|r| r.starts_with('.') || r.starts_with('['))
                    })
                }
            }
        })
        .collect();
    assert!(
        missing.is_empty(),
        "JSON keys gone from the output (renamed or dropped?): {missing:#?}"
    );
}
