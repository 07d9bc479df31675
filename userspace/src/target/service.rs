//! What a watch covers: a service, not one pid. An operator has a master's pid (from
//! a pid file or `systemctl status`), a cgroup or a unit name; the requests are
//! served by its children (nginx and apache workers, PostgreSQL backends). This
//! resolves those into the processes to watch at attach; the kernel adds the ones
//! they fork later (ebpf WATCHED).

use crate::error::WatchError;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The most processes a watch starts with: the kernel's WATCHED table holds 16384,
/// and those forked later need room too.
pub const MAX_PROCESSES: usize = 8192;

/// Where the cgroup v2 tree is mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// What the user named.
#[derive(Clone, Debug, Default)]
pub struct Spec {
    pub pids: Vec<u32>,
    pub cgroup: Option<PathBuf>,
    pub unit: Option<String>,
}

/// The processes to watch: `root` is the one reports are about first (the given pid,
/// or the top of the cgroup), `all` includes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Set {
    pub root: u32,
    pub all: Vec<u32>,
}

/// Every process's parent, from /proc.
fn parents() -> HashMap<u32, u32> {
    let mut m = HashMap::new();
    let Ok(d) = std::fs::read_dir("/proc") else {
        return m;
    };
    for e in d.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(ppid) = std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .and_then(|s| ppid_of(&s))
        {
            m.insert(pid, ppid);
        }
    }
    m
}

/// The parent pid in a /proc/PID/stat line (field 4, after the parenthesised comm,
/// which may itself hold spaces and parentheses).
pub fn ppid_of(stat: &str) -> Option<u32> {
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// `pid` and every process below it.
pub fn tree(pid: u32) -> Vec<u32> {
    tree_in(pid, &parents())
}

fn tree_in(pid: u32, parents: &HashMap<u32, u32>) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for (&c, &p) in parents {
        children.entry(p).or_default().push(c);
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        if let Some(cs) = children.get(&out[i]) {
            for &c in cs {
                if !out.contains(&c) {
                    out.push(c);
                }
            }
        }
        i += 1;
    }
    out
}

/// The children of these processes: /proc/PID/task/TID/children (every thread's)
/// where the kernel has it (CONFIG_PROC_CHILDREN), else a scan of /proc's parents.
pub fn children(pids: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    for &p in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            match std::fs::read_to_string(t.path().join("children")) {
                Ok(s) => out.extend(s.split_whitespace().filter_map(|c| c.parse::<u32>().ok())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return parents()
                        .into_iter()
                        .filter(|(_, pp)| pids.contains(pp))
                        .map(|(c, _)| c)
                        .collect();
                }
                Err(_) => {}
            }
        }
    }
    out
}

/// A cgroup path as given: absolute under the cgroup mount, or relative to it; on a
/// hybrid or v1 host (the unified tree at unified/, systemd's at systemd/, the
/// controllers beside them) relative to the first of those that has it.
pub fn cgroup_dir(path: &Path) -> PathBuf {
    cgroup_dir_in(Path::new(CGROUP_ROOT), path)
}

fn cgroup_dir_in(root: &Path, path: &Path) -> PathBuf {
    if path.starts_with(root) {
        return path.to_path_buf();
    }
    let rel = path.strip_prefix("/").unwrap_or(path);
    let direct = root.join(rel);
    if direct.join("cgroup.procs").is_file() {
        return direct;
    }
    let mut subs: Vec<PathBuf> = std::fs::read_dir(root)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    // The unified tree first, then systemd's, then the controllers in name order.
    subs.sort_by_key(|p| {
        let n = p
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("")
            .to_string();
        (n != "unified", n != "systemd", n)
    });
    subs.into_iter()
        .map(|s| s.join(rel))
        .find(|d| d.join("cgroup.procs").is_file())
        .unwrap_or(direct)
}

/// The processes in a cgroup and all its descendants.
pub fn cgroup_procs(dir: &Path) -> Result<Vec<u32>, WatchError> {
    let procs = dir.join("cgroup.procs");
    if !procs.is_file() {
        return Err(WatchError::BadTarget(format!(
            "{} is not a cgroup (no cgroup.procs there; give a path under {CGROUP_ROOT})",
            dir.display()
        )));
    }
    let mut out = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(s) = std::fs::read_to_string(d.join("cgroup.procs")) {
            out.extend(s.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
        if let Ok(rd) = std::fs::read_dir(&d) {
            stack.extend(
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    Ok(out.into_iter().collect())
}

/// A systemd unit's cgroup, found in the cgroup tree by name (NAME, or NAME.service
/// when it has no suffix): no systemd is needed to read it.
pub fn unit_dir(name: &str) -> Result<PathBuf, WatchError> {
    unit_dir_in(Path::new(CGROUP_ROOT), name)
}

fn unit_dir_in(root: &Path, name: &str) -> Result<PathBuf, WatchError> {
    if name.is_empty() || name.contains('/') {
        return Err(WatchError::BadTarget(format!(
            "{name:?} is not a unit name"
        )));
    }
    let want = if name.contains('.') {
        name.to_string()
    } else {
        format!("{name}.service")
    };
    // Breadth first, a few levels down (system.slice/NAME.service, or nested slices).
    let mut level = vec![root.to_path_buf()];
    for _ in 0..5 {
        let mut next = Vec::new();
        for d in &level {
            let Ok(rd) = std::fs::read_dir(d) else {
                continue;
            };
            for e in rd.flatten() {
                if !e.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                if e.file_name().to_str() == Some(want.as_str()) {
                    return Ok(e.path());
                }
                next.push(e.path());
            }
        }
        level = next;
    }
    Err(WatchError::BadTarget(format!(
        "no cgroup named {want} under {} (is the unit running?)",
        root.display()
    )))
}

/// Resolves what the user named into the processes to watch now.
pub fn resolve(spec: &Spec) -> Result<Set, WatchError> {
    let parents = parents();
    let mut all: Vec<u32> = Vec::new();
    let mut root = None;
    for &p in &spec.pids {
        if !crate::target::exists(p) {
            return Err(WatchError::NoSuchPid(p));
        }
        root.get_or_insert(p);
        for q in tree_in(p, &parents) {
            if !all.contains(&q) {
                all.push(q);
            }
        }
    }
    let dir = match (&spec.cgroup, &spec.unit) {
        (Some(c), _) => Some(cgroup_dir(c)),
        (None, Some(u)) => Some(unit_dir(u)?),
        (None, None) => None,
    };
    if let Some(d) = dir {
        let procs = cgroup_procs(&d)?;
        if procs.is_empty() && all.is_empty() {
            return Err(WatchError::BadTarget(format!(
                "cgroup {} has no processes",
                d.display()
            )));
        }
        // The top: a member whose parent is outside the cgroup, the oldest (lowest
        // pid) of those.
        let top = procs
            .iter()
            .copied()
            .filter(|p| parents.get(p).is_none_or(|pp| !procs.contains(pp)))
            .min();
        if root.is_none() {
            root = top;
        }
        for q in procs {
            if !all.contains(&q) {
                all.push(q);
            }
        }
    }
    let root = root.ok_or_else(|| {
        WatchError::BadTarget("nothing to watch: give --pid, --cgroup or --unit".into())
    })?;
    within(Set { root, all }, MAX_PROCESSES)
}

/// The set, or why it is too big for the kernel's table.
fn within(set: Set, limit: usize) -> Result<Set, WatchError> {
    if set.all.len() > limit {
        return Err(WatchError::BadTarget(format!(
            "{} processes to watch (pid {} and everything below it, or the cgroup), more \
             than the {limit} the kernel's table is sized for: name the service's own \
             master pid or its cgroup",
            set.all.len(),
            set.root
        )));
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ppid_survives_odd_comms() {
        assert_eq!(ppid_of("42 (a b) S 7 42 42 0"), Some(7));
        assert_eq!(ppid_of("42 (x) y) R 9 1"), Some(9));
        assert_eq!(ppid_of("garbage"), None);
    }

    #[test]
    fn a_tree_is_the_pid_and_everything_below() {
        let parents: HashMap<u32, u32> = [(2, 1), (3, 2), (4, 2), (5, 3), (6, 1), (7, 6)]
            .into_iter()
            .collect();
        let mut t = tree_in(2, &parents);
        t.sort_unstable();
        assert_eq!(t, [2, 3, 4, 5]);
        assert_eq!(tree_in(5, &parents), [5]);
    }

    #[test]
    fn this_process_and_a_child_form_a_tree() {
        let mut c = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let set = resolve(&Spec {
            pids: vec![std::process::id()],
            ..Spec::default()
        })
        .unwrap();
        let _ = c.kill();
        let _ = c.wait();
        assert_eq!(set.root, std::process::id());
        assert!(set.all.contains(&c.id()), "{set:?}");
    }

    #[test]
    fn units_are_found_by_name_in_a_cgroup_tree() {
        let root = std::env::temp_dir().join(format!("toffload-cg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let unit = root.join("system.slice/nginx.service");
        std::fs::create_dir_all(unit.join("sub")).unwrap();
        std::fs::write(unit.join("cgroup.procs"), "10\n11\n").unwrap();
        std::fs::write(unit.join("sub/cgroup.procs"), "12\n").unwrap();
        assert_eq!(unit_dir_in(&root, "nginx").unwrap(), unit);
        assert_eq!(unit_dir_in(&root, "nginx.service").unwrap(), unit);
        assert_eq!(cgroup_procs(&unit).unwrap(), [10, 11, 12]);
        let e = unit_dir_in(&root, "redis").unwrap_err().to_string();
        assert!(e.contains("redis.service"), "{e}");
        assert!(unit_dir_in(&root, "../x").is_err());
        assert!(cgroup_procs(&root.join("system.slice/none")).is_err());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_relative_cgroup_is_found_in_a_hybrid_tree() {
        let root = std::env::temp_dir().join(format!("toffload-cgh-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for sub in ["cpu/a.service", "systemd/a.service", "unified/b.service"] {
            std::fs::create_dir_all(root.join(sub)).unwrap();
            std::fs::write(root.join(sub).join("cgroup.procs"), "1\n").unwrap();
        }
        // systemd's tree before a controller's; the unified one before both.
        assert_eq!(
            cgroup_dir_in(&root, Path::new("a.service")),
            root.join("systemd/a.service")
        );
        assert_eq!(
            cgroup_dir_in(&root, Path::new("/b.service")),
            root.join("unified/b.service")
        );
        let abs = root.join("cpu/a.service");
        assert_eq!(cgroup_dir_in(&root, &abs), abs);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn children_are_read_from_proc() {
        let mut c = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let kids = children(&[std::process::id()]);
        let _ = c.kill();
        let _ = c.wait();
        assert!(kids.contains(&c.id()), "{kids:?}");
    }

    #[test]
    fn a_tree_too_big_for_the_table_is_refused() {
        let set = |n: u32| Set {
            root: 1,
            all: (1..=n).collect(),
        };
        assert!(within(set(3), 3).is_ok());
        let e = within(set(4), 3).unwrap_err().to_string();
        assert!(e.contains("4 processes") && e.contains("pid 1"), "{e}");
    }

    #[test]
    fn nothing_named_is_an_error() {
        assert!(resolve(&Spec::default()).is_err());
        assert!(matches!(
            resolve(&Spec {
                pids: vec![u32::MAX - 3],
                ..Spec::default()
            }),
            Err(WatchError::NoSuchPid(_))
        ));
    }
}
