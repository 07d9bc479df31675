//! Finding a target's processes now: by unit or cgroup (service.rs), by process name
//! (comm or executable file name, matched in /proc) or by pid. A target that is not
//! running is not an error here: the service searches for it again each interval.

use super::config::Selector;
use crate::error::WatchError;
use crate::service::{self, Set, Spec};
use std::collections::BTreeSet;

/// What a search found.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    Running(Set),
    /// Nothing runs under that name now (why, for /status).
    Absent(String),
}

/// The processes of a target now.
pub fn find(sel: &Selector) -> Found {
    let r = match sel {
        Selector::Unit(u) => service::resolve(&Spec {
            unit: Some(u.clone()),
            ..Spec::default()
        }),
        Selector::Cgroup(c) => service::resolve(&Spec {
            cgroup: Some(c.clone()),
            ..Spec::default()
        }),
        Selector::Pid(p) => service::resolve(&Spec {
            pids: vec![*p],
            ..Spec::default()
        }),
        Selector::Process(name) => by_name(name),
    };
    match r {
        Ok(set) => Found::Running(set),
        Err(e) => Found::Absent(e.to_string()),
    }
}

/// One /proc entry, as far as matching needs it.
#[derive(Clone, Debug)]
struct Proc {
    pid: u32,
    ppid: u32,
    /// Clock ticks after boot at which it started: the oldest match is the root.
    start: u64,
    comm: String,
    exe_name: Option<String>,
}

/// The fields after the parenthesised comm of /proc/PID/stat: state, ppid, ... and
/// starttime (field 22); None for a zombie, which has nothing left to watch.
fn parse_stat(stat: &str) -> Option<(u32, u64)> {
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    if matches!(rest.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    // rest[0] is field 3 (state), so field N is rest[N - 3].
    Some((rest.get(1)?.parse().ok()?, rest.get(19)?.parse().ok()?))
}

fn procs() -> Vec<Proc> {
    let me = std::process::id();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let (ppid, start) = parse_stat(&stat)?;
            Some(Proc {
                pid,
                ppid,
                start,
                comm: crate::target::comm(pid),
                exe_name: crate::target::exe(pid)
                    .and_then(|p| Some(p.file_name()?.to_string_lossy().into_owned())),
            })
        })
        .collect()
}

/// A process is NAME when its comm is (the kernel keeps 15 bytes of it, so a longer
/// NAME matches a comm that is its first 15) or its executable's file name is.
fn matches(p: &Proc, name: &str) -> bool {
    let comm_match = name
        .get(..name.len().min(15))
        .is_some_and(|head| p.comm == head);
    comm_match || p.exe_name.as_deref() == Some(name)
}

/// The matching processes' trees: the root is the oldest match whose parent is not a
/// match (a pre-forking master, not one of its workers).
fn pick(all: &[Proc], name: &str) -> Option<(u32, Vec<u32>)> {
    let hits: Vec<&Proc> = all.iter().filter(|p| matches(p, name)).collect();
    let pids: BTreeSet<u32> = hits.iter().map(|p| p.pid).collect();
    let tops: Vec<&&Proc> = hits.iter().filter(|p| !pids.contains(&p.ppid)).collect();
    let root = tops.iter().min_by_key(|p| (p.start, p.pid))?.pid;
    Some((root, tops.iter().map(|p| p.pid).collect()))
}

fn by_name(name: &str) -> Result<Set, WatchError> {
    let Some((root, tops)) = pick(&procs(), name) else {
        return Err(WatchError::BadTarget(format!(
            "no process named {name:?} is running"
        )));
    };
    let mut all = vec![root];
    for t in tops {
        for p in service::tree(t) {
            if !all.contains(&p) {
                all.push(p);
            }
        }
    }
    if all.len() > service::MAX_PROCESSES {
        return Err(WatchError::BadTarget(format!(
            "{} processes named {name:?} with their children, more than the {} a watch \
             holds: name a unit or cgroup instead",
            all.len(),
            service::MAX_PROCESSES
        )));
    }
    Ok(Set { root, all })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: u32, ppid: u32, start: u64, comm: &str, exe: Option<&str>) -> Proc {
        Proc {
            pid,
            ppid,
            start,
            comm: comm.into(),
            exe_name: exe.map(str::to_string),
        }
    }

    #[test]
    fn stat_fields_and_zombies() {
        let line = "42 (a) b) S 7 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 12345 0 0";
        assert_eq!(parse_stat(line), Some((7, 12345)));
        assert_eq!(
            parse_stat("42 (x) Z 7 42 42 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 9"),
            None
        );
    }

    #[test]
    fn names_match_comm_or_exe() {
        let a = p(1, 0, 0, "conn_server", Some("conn_server"));
        assert!(matches(&a, "conn_server"));
        assert!(!matches(&a, "conn"));
        // A comm is cut at 15 bytes.
        let long = p(2, 0, 0, "toffload-remote", Some("toffload-remoted"));
        assert!(matches(&long, "toffload-remoted"));
        let cut = p(3, 0, 0, "a-very-long-nam", None);
        assert!(matches(&cut, "a-very-long-name-indeed"));
        // A script run by its interpreter: comm is the script, exe the interpreter.
        let script = p(4, 0, 0, "worker.py", Some("python3.12"));
        assert!(matches(&script, "worker.py") && matches(&script, "python3.12"));
    }

    #[test]
    fn the_root_is_the_oldest_master() {
        let all = [
            p(10, 1, 500, "nginx", Some("nginx")),
            p(11, 10, 510, "nginx", Some("nginx")),
            p(12, 10, 510, "nginx", Some("nginx")),
            p(20, 1, 100, "nginx", Some("nginx")),
            p(30, 1, 50, "bash", Some("bash")),
        ];
        let (root, tops) = pick(&all, "nginx").expect("found");
        assert_eq!(root, 20);
        assert_eq!(tops, [10, 20]);
        assert!(pick(&all, "redis-server").is_none());
    }
}
