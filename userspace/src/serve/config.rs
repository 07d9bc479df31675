//! What `toffload-watch serve` watches and where it listens: a TOML file, flags, or
//! both (flags add targets and override the file's settings). Everything is checked
//! before anything is attached, so that a typo ends the service at start with the
//! file's line, not hours later.

use crate::error::WatchError;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where /metrics is served unless told otherwise: loopback only, since the numbers
/// describe the host's servers (9464: the port OpenTelemetry's Prometheus exporters
/// use, free of the node exporter's 9100).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9464";
/// The default window, as for a plain watch.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// Percent of each target's CPU the watch may cost, as for a plain watch.
pub const DEFAULT_BUDGET_PERCENT: f64 = 0.5;

/// `toffload-watch serve`'s flags.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Args {
    /// The TOML file naming the targets (see docs/watch.md, "serve").
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address for /metrics and /status (default 127.0.0.1:9464; the file's `listen`).
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<String>,
    /// Report window, e.g. 1s, 500ms (the file's `interval`; default 1s). A target
    /// that went away is searched for again this often.
    #[arg(long, value_name = "DURATION")]
    pub interval: Option<String>,
    /// Percent of each target's CPU the watch may cost (the file's `overhead_budget`;
    /// default 0.5).
    #[arg(long, value_name = "PERCENT")]
    pub overhead_budget: Option<f64>,
    /// A systemd unit to watch (its cgroup; target name: the unit). Repeatable.
    #[arg(long, value_name = "NAME")]
    pub unit: Vec<String>,
    /// A cgroup (v2) to watch (target name: the path). Repeatable.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Vec<String>,
    /// Processes whose name (comm) or executable's file name is NAME, with their
    /// children (target name: NAME). Repeatable.
    #[arg(long, value_name = "NAME")]
    pub process: Vec<String>,
    /// A process and its children (target name: the pid; not searched again once it
    /// exits, since a pid names one process). Repeatable.
    #[arg(long, value_name = "PID")]
    pub pid: Vec<u32>,
}

/// How a target is found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    Unit(String),
    Cgroup(PathBuf),
    Process(String),
    Pid(u32),
}

impl Selector {
    /// The selector's kind, as /status says it.
    pub fn kind(&self) -> &'static str {
        match self {
            Selector::Unit(_) => "unit",
            Selector::Cgroup(_) => "cgroup",
            Selector::Process(_) => "process",
            Selector::Pid(_) => "pid",
        }
    }

    pub fn value(&self) -> String {
        match self {
            Selector::Unit(u) => u.clone(),
            Selector::Cgroup(c) => c.display().to_string(),
            Selector::Process(p) => p.clone(),
            Selector::Pid(p) => p.to_string(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The `target` label of every metric of it.
    pub name: String,
    pub selector: Selector,
}

/// The service's whole configuration, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub listen: SocketAddr,
    pub interval: Duration,
    /// A share (0.005 for 0.5%).
    pub overhead_budget: f64,
    pub targets: Vec<Target>,
}

/// The file as written; unknown keys are errors (a misspelt `intervall` must not be
/// silently ignored).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct File {
    listen: Option<String>,
    interval: Option<String>,
    overhead_budget: Option<f64>,
    #[serde(default)]
    target: Vec<FileTarget>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTarget {
    name: Option<String>,
    unit: Option<String>,
    cgroup: Option<String>,
    process: Option<String>,
    pid: Option<u32>,
}

fn bad(why: impl Into<String>) -> WatchError {
    WatchError::BadConfig(why.into())
}

/// A duration as the watch's --interval takes it: 500ms, 1s, 2m, 1h (a bare number:
/// seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1.0)
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(Duration::from_secs_f64(v * mult)),
        _ => Err(format!(
            "{s:?} is not a positive duration (e.g. 500ms, 1s, 2m)"
        )),
    }
}

fn budget(p: f64) -> Result<f64, WatchError> {
    if p.is_finite() && p > 0.0 && p <= 100.0 {
        Ok(p / 100.0)
    } else {
        Err(bad(format!(
            "overhead_budget {p} is not a percent in (0, 100]"
        )))
    }
}

fn listen(s: &str) -> Result<SocketAddr, WatchError> {
    s.parse().map_err(|_| {
        bad(format!(
            "listen {s:?} is not an address:port (e.g. 127.0.0.1:9464, [::1]:9464)"
        ))
    })
}

fn file_target(i: usize, t: FileTarget) -> Result<Target, WatchError> {
    let mut sel = Vec::new();
    if let Some(u) = t.unit {
        sel.push(Selector::Unit(u));
    }
    if let Some(c) = t.cgroup {
        sel.push(Selector::Cgroup(PathBuf::from(c)));
    }
    if let Some(p) = t.process {
        sel.push(Selector::Process(p));
    }
    if let Some(p) = t.pid {
        sel.push(Selector::Pid(p));
    }
    let which = format!("[[target]] #{}", i + 1);
    let selector = match sel.len() {
        1 => sel.remove(0),
        0 => {
            return Err(bad(format!(
                "{which}: give one of unit, cgroup, process or pid"
            )))
        }
        _ => {
            return Err(bad(format!(
                "{which}: give only one of unit, cgroup, process or pid"
            )))
        }
    };
    Ok(Target {
        name: t.name.unwrap_or_else(|| selector.value()),
        selector,
    })
}

/// Checks one selector's value by itself (the target need not be running yet).
fn check_selector(t: &Target) -> Result<(), WatchError> {
    let which = format!("target {:?}", t.name);
    match &t.selector {
        Selector::Unit(u) if u.is_empty() || u.contains('/') => {
            Err(bad(format!("{which}: {u:?} is not a unit name")))
        }
        Selector::Process(p) if p.is_empty() || p.contains('/') => Err(bad(format!(
            "{which}: {p:?} is not a process name (a comm or an executable's file name)"
        ))),
        Selector::Cgroup(c) if c.as_os_str().is_empty() => {
            Err(bad(format!("{which}: an empty cgroup path")))
        }
        Selector::Pid(0) => Err(bad(format!("{which}: pid 0"))),
        _ => Ok(()),
    }
}

/// A target name must be a usable label value and unique: two targets under one name
/// would merge into one series.
fn check_names(targets: &[Target]) -> Result<(), WatchError> {
    let mut seen = std::collections::BTreeSet::new();
    for t in targets {
        if t.name.is_empty() || t.name.len() > 128 || t.name.chars().any(char::is_control) {
            return Err(bad(format!(
                "target name {:?}: 1 to 128 printable characters",
                t.name
            )));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(bad(format!(
                "two targets are named {:?} (give each a distinct `name`)",
                t.name
            )));
        }
    }
    Ok(())
}

/// Parses a config file's text (`origin` names it in errors).
fn parse_file(text: &str, origin: &Path) -> Result<File, WatchError> {
    toml::from_str(text).map_err(|e| bad(format!("{}: {e}", origin.display())))
}

/// The configuration from the flags and the file they name.
pub fn load(args: &Args) -> Result<Config, WatchError> {
    let file = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| bad(format!("reading {}: {e}", p.display())))?;
            parse_file(&text, p)?
        }
        None => File::default(),
    };
    build(args, file)
}

fn build(args: &Args, file: File) -> Result<Config, WatchError> {
    let listen = listen(
        args.listen
            .as_deref()
            .or(file.listen.as_deref())
            .unwrap_or(DEFAULT_LISTEN),
    )?;
    let interval = match args.interval.as_deref().or(file.interval.as_deref()) {
        Some(s) => parse_duration(s).map_err(|e| bad(format!("interval: {e}")))?,
        None => DEFAULT_INTERVAL,
    };
    if interval < Duration::from_millis(100) {
        return Err(bad(format!(
            "interval {interval:?}: at least 100ms (each window reads every target's maps)"
        )));
    }
    let overhead_budget = budget(
        args.overhead_budget
            .or(file.overhead_budget)
            .unwrap_or(DEFAULT_BUDGET_PERCENT),
    )?;
    let mut targets = file
        .target
        .into_iter()
        .enumerate()
        .map(|(i, t)| file_target(i, t))
        .collect::<Result<Vec<_>, _>>()?;
    let flagged = args
        .unit
        .iter()
        .map(|u| Selector::Unit(u.clone()))
        .chain(args.cgroup.iter().map(|c| Selector::Cgroup(c.into())))
        .chain(args.process.iter().map(|p| Selector::Process(p.clone())))
        .chain(args.pid.iter().map(|&p| Selector::Pid(p)));
    targets.extend(flagged.map(|selector| Target {
        name: selector.value(),
        selector,
    }));
    if targets.is_empty() {
        return Err(bad(
            "no targets: add [[target]] entries to the config, or --unit, --cgroup, \
             --process or --pid",
        ));
    }
    for t in &targets {
        check_selector(t)?;
    }
    check_names(&targets)?;
    Ok(Config {
        listen,
        interval,
        overhead_budget,
        targets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(text: &str) -> Result<Config, String> {
        let file = parse_file(text, Path::new("t.toml")).map_err(|e| e.to_string())?;
        build(&Args::default(), file).map_err(|e| e.to_string())
    }

    #[test]
    fn a_full_file_parses() {
        let c = from(
            r#"
            listen = "0.0.0.0:9999"
            interval = "500ms"
            overhead_budget = 1.5
            [[target]]
            name = "web"
            unit = "nginx"
            [[target]]
            process = "conn_server"
            [[target]]
            name = "db"
            cgroup = "system.slice/postgresql.service"
            [[target]]
            pid = 42
            "#,
        )
        .expect("valid");
        assert_eq!(c.listen, "0.0.0.0:9999".parse().unwrap());
        assert_eq!(c.interval, Duration::from_millis(500));
        assert!((c.overhead_budget - 0.015).abs() < 1e-12);
        let names: Vec<&str> = c.targets.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["web", "conn_server", "db", "42"]);
        assert_eq!(c.targets[3].selector, Selector::Pid(42));
    }

    #[test]
    fn defaults_are_loopback_one_second_half_a_percent() {
        let c = from("[[target]]\nprocess = \"x\"\n").expect("valid");
        assert_eq!(c.listen, DEFAULT_LISTEN.parse().unwrap());
        assert!(c.listen.ip().is_loopback());
        assert_eq!(c.interval, DEFAULT_INTERVAL);
        assert!((c.overhead_budget - 0.005).abs() < 1e-12);
    }

    #[test]
    fn mistakes_are_named() {
        let cases = [
            (
                "intervall = \"1s\"\n[[target]]\npid = 1",
                "unknown field `intervall`",
            ),
            ("[[target]]\nname = \"a\"", "give one of unit"),
            ("[[target]]\npid = 1\nunit = \"x\"", "only one of"),
            (
                "[[target]]\nname=\"a\"\npid = 1\n[[target]]\nname=\"a\"\npid=2",
                "two targets",
            ),
            (
                "listen = \"localhost\"\n[[target]]\npid = 1",
                "not an address:port",
            ),
            (
                "interval = \"fast\"\n[[target]]\npid = 1",
                "not a positive duration",
            ),
            ("interval = \"10ms\"\n[[target]]\npid = 1", "at least 100ms"),
            ("overhead_budget = 0\n[[target]]\npid = 1", "not a percent"),
            ("[[target]]\nprocess = \"a/b\"", "not a process name"),
            ("", "no targets"),
            ("[[target]\npid = 1", "t.toml"),
        ];
        for (text, want) in cases {
            let e = from(text).expect_err(text);
            assert!(e.contains(want), "{text:?}: {e:?} lacks {want:?}");
        }
    }

    #[test]
    fn flags_add_targets_and_override_settings() {
        let args = Args {
            listen: Some("127.0.0.1:1".into()),
            interval: Some("2s".into()),
            process: vec!["redis-server".into()],
            unit: vec!["nginx".into()],
            ..Args::default()
        };
        let file = parse_file(
            "listen = \"127.0.0.1:2\"\ninterval = \"1s\"\n[[target]]\npid = 7",
            Path::new("f"),
        )
        .expect("parses");
        let c = build(&args, file).expect("valid");
        assert_eq!(c.listen.port(), 1);
        assert_eq!(c.interval, Duration::from_secs(2));
        let names: Vec<&str> = c.targets.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["7", "nginx", "redis-server"]);
    }
}
