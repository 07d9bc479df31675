//! What it takes to start a process again as it was: its command line, environment,
//! working directory, credentials, executable, CPUs and resources (resources.rs), all
//! read from /proc; and the TCP
//! ports it listens on, so that the relaunch can be seen to be serving again.

use std::collections::BTreeSet;
use std::path::PathBuf;

#[derive(Clone, Debug, serde::Serialize)]
pub struct Launch {
    /// The executable (/proc/PID/exe): what execve runs, whatever argv[0] says.
    pub exe: PathBuf,
    pub argv: Vec<String>,
    /// The environment as it was started, in order (empty when overwritten).
    pub env: Vec<(String, String)>,
    /// The process wrote over its environment block (a server that sets its process
    /// title, as redis-server and nginx do): what it was started with is unknown, so
    /// only its unit can start it again as it was.
    pub env_overwritten: bool,
    pub cwd: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// Its nice value (the relaunch runs at it, not at the watcher's).
    pub nice: i32,
    /// The CPUs it may run on (a server pinned apart from its load stays there; the
    /// relaunch would otherwise take the watcher's).
    pub cpus: Vec<usize>,
    /// Limits, cgroup, umask and OOM adjustment (the watcher's would be taken).
    pub res: super::resources::Resources,
}

/// The CPUs `pid` may run on (empty when they cannot be read).
pub fn affinity(pid: u32) -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is valid; the kernel fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(
            pid as libc::pid_t,
            std::mem::size_of::<libc::cpu_set_t>(),
            &mut set,
        ) != 0
        {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

impl Launch {
    pub fn read(pid: u32) -> Result<Launch, String> {
        let p = |f: &str| format!("/proc/{pid}/{f}");
        let exe = std::fs::read_link(p("exe")).map_err(|e| format!("{}: {e}", p("exe")))?;
        // A binary replaced under a running server shows as "path (deleted)": the
        // relaunch would start another program.
        if exe.to_string_lossy().ends_with(" (deleted)") {
            return Err(format!(
                "{} was deleted or replaced since pid {pid} started: not relaunching it",
                exe.display()
            ));
        }
        let argv =
            nul_split(&std::fs::read(p("cmdline")).map_err(|e| format!("{}: {e}", p("cmdline")))?);
        if argv.is_empty() {
            return Err(format!(
                "pid {pid} has no command line (a kernel thread or a zombie)"
            ));
        }
        let env =
            crate::target::environ::read(pid).map_err(|e| format!("{}: {e}", p("environ")))?;
        let env_overwritten = env.is_none();
        let env = env.unwrap_or_default();
        let cwd = std::fs::read_link(p("cwd")).map_err(|e| format!("{}: {e}", p("cwd")))?;
        let status =
            std::fs::read_to_string(p("status")).map_err(|e| format!("{}: {e}", p("status")))?;
        let field = |name: &str| -> Vec<u32> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| {
                    v.split_whitespace()
                        .filter_map(|x| x.parse().ok())
                        .collect()
                })
                .unwrap_or_default()
        };
        // Uid: real effective saved fs; the relaunch takes the effective ids.
        let (uids, gids) = (field("Uid:"), field("Gid:"));
        let (Some(&uid), Some(&gid)) = (uids.get(1), gids.get(1)) else {
            return Err(format!("{}: no Uid/Gid lines", p("status")));
        };
        // /proc/PID/stat field 19 (after the command in parentheses, field 3 on).
        let stat = std::fs::read_to_string(p("stat")).unwrap_or_default();
        let nice = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(16))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Ok(Launch {
            exe,
            argv,
            env,
            env_overwritten,
            cwd,
            uid,
            gid,
            groups: field("Groups:"),
            nice,
            cpus: affinity(pid),
            res: super::resources::Resources::read(pid)?,
        })
    }

    pub fn getenv(&self, key: &str) -> Option<&str> {
        self.env
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Sets (replacing) or adds a variable.
    pub fn setenv(&mut self, key: &str, val: String) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_string(), val));
    }
}

fn nul_split(b: &[u8]) -> Vec<String> {
    b.split(|&c| c == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// A listening TCP socket: address family and port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Listen {
    pub v6: bool,
    pub port: u16,
}

/// The TCP ports `pid` listens on: LISTEN rows of its network namespace's tables
/// whose socket inode is one of its descriptors.
pub fn listening(pid: u32) -> BTreeSet<Listen> {
    let inodes: BTreeSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|rd| {
            rd.filter_map(|e| {
                let l = std::fs::read_link(e.ok()?.path()).ok()?;
                let s = l.to_string_lossy();
                s.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
            })
            .collect()
        })
        .unwrap_or_default();
    let mut out = BTreeSet::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")) else {
            continue;
        };
        for (port, inode) in parse_listen_rows(&text) {
            if inodes.contains(&inode) {
                out.insert(Listen { v6, port });
            }
        }
    }
    out
}

/// (port, inode) of the LISTEN (state 0A) rows of a /proc/net/tcp table.
pub fn parse_listen_rows(text: &str) -> Vec<(u16, u64)> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 10 || f[3] != "0A" {
                return None;
            }
            let port = u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()?;
            Some((port, f[9].parse().ok()?))
        })
        .collect()
}

/// The state letter of a /proc stat text.
fn state_of(stat: &str) -> Option<char> {
    stat.rsplit_once(')')
        .and_then(|(_, r)| r.trim_start().chars().next())
}

/// Alive and not a zombie: some thread of it still runs. A leader that has exited
/// shows Z while its other threads are still tearing down, and until the last is
/// gone its files (a listening socket) are still open: a relaunch that took the Z
/// for gone failed to bind its port now and then.
pub fn running(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let live = |s: Option<char>| s.is_some_and(|c| c != 'Z' && c != 'X');
    if live(state_of(&stat)) {
        return true;
    }
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|t| std::fs::read_to_string(t.path().join("stat")).is_ok_and(|s| live(state_of(&s))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_rows() {
        let t = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0\n   1: 0100007F:C350 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 6789 1\n";
        assert_eq!(parse_listen_rows(t), vec![(8080, 12345)]);
    }

    #[test]
    fn reads_itself() {
        let me = Launch::read(std::process::id()).unwrap();
        assert_eq!(me.exe, std::env::current_exe().unwrap());
        assert_eq!(me.cwd, std::env::current_dir().unwrap());
        assert!(!me.argv.is_empty());
        // SAFETY: geteuid takes nothing and cannot fail.
        assert_eq!(me.uid, unsafe { libc::geteuid() });
        // The CPUs as /proc says them (the main thread's mask: tests run on others).
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let listed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_string();
        let ours: Vec<String> = me.cpus.iter().map(|c| c.to_string()).collect();
        assert!(!me.cpus.is_empty());
        if !listed.contains('-') {
            assert_eq!(ours.join(","), listed);
        }
        assert!(running(std::process::id()));
        assert!(!running(u32::MAX - 1));
    }

    #[test]
    fn finds_its_own_listener() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(listening(std::process::id()).contains(&Listen { v6: false, port }));
        drop(l);
        assert!(!listening(std::process::id()).contains(&Listen { v6: false, port }));
    }
}
