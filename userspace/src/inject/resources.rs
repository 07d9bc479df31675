//! The parts of a process's execution context that a relaunch would otherwise take
//! from the watcher: its resource limits (the watcher raises RLIMIT_MEMLOCK for BPF),
//! its cgroup v2 membership (memory and CPU limits, and what a manager finds in it),
//! its umask and its OOM score adjustment. Read from the target before it is stopped;
//! applied between fork and exec, before the credentials are dropped (raising a hard
//! limit, joining a cgroup and lowering the OOM adjustment need root).

use serde::Serialize;
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// One resource limit as the target had it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Rlimit {
    #[serde(skip)]
    pub resource: libc::__rlimit_resource_t,
    pub name: &'static str,
    /// RLIM_INFINITY is u64::MAX.
    pub soft: u64,
    pub hard: u64,
}

/// Every limit setrlimit(2) knows (RLIM_NLIMITS of them), by its /proc/PID/limits
/// order.
const RESOURCES: [(libc::__rlimit_resource_t, &str); 16] = [
    (libc::RLIMIT_CPU, "cpu"),
    (libc::RLIMIT_FSIZE, "fsize"),
    (libc::RLIMIT_DATA, "data"),
    (libc::RLIMIT_STACK, "stack"),
    (libc::RLIMIT_CORE, "core"),
    (libc::RLIMIT_RSS, "rss"),
    (libc::RLIMIT_NPROC, "nproc"),
    (libc::RLIMIT_NOFILE, "nofile"),
    (libc::RLIMIT_MEMLOCK, "memlock"),
    (libc::RLIMIT_AS, "as"),
    (libc::RLIMIT_LOCKS, "locks"),
    (libc::RLIMIT_SIGPENDING, "sigpending"),
    (libc::RLIMIT_MSGQUEUE, "msgqueue"),
    (libc::RLIMIT_NICE, "nice"),
    (libc::RLIMIT_RTPRIO, "rtprio"),
    (libc::RLIMIT_RTTIME, "rttime"),
];

/// What the relaunch reproduces besides command, environment and credentials.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Resources {
    pub rlimits: Vec<Rlimit>,
    /// /proc/PID/status Umask (kernels before 4.7 do not show it: then the watcher's).
    pub umask: Option<u32>,
    pub oom_score_adj: Option<i32>,
    /// The cgroup v2 directory the target is in (under the cgroup2 mount), when there
    /// is a v2 hierarchy and the target is in it.
    pub cgroup: Option<PathBuf>,
    /// Its path inside the hierarchy ("/system.slice/x.service"): how systemd units
    /// are recognised.
    pub cgroup_path: Option<String>,
}

/// The limits of `pid`: prlimit(2) on it, or, where that is not allowed (reading
/// another uid's limits takes CAP_SYS_RESOURCE, which a container may not grant),
/// /proc/PID/limits, which anyone may read.
pub fn rlimits(pid: u32) -> Result<Vec<Rlimit>, String> {
    rlimits_prlimit(pid).or_else(|e| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/limits"))
            .map_err(|e2| format!("{e}; /proc/{pid}/limits: {e2}"))?;
        parse_limits(&text).ok_or_else(|| format!("{e}; /proc/{pid}/limits: unreadable rows"))
    })
}

/// The rows of a /proc/PID/limits text, in the kernel's order (RESOURCES').
pub fn parse_limits(text: &str) -> Option<Vec<Rlimit>> {
    let rows: Vec<&str> = text.lines().skip(1).collect();
    if rows.len() < RESOURCES.len() {
        return None;
    }
    let val = |v: &str| -> Option<u64> {
        if v == "unlimited" {
            Some(libc::RLIM_INFINITY)
        } else {
            v.parse().ok()
        }
    };
    RESOURCES
        .iter()
        .zip(rows)
        .map(|(&(resource, name), row)| {
            // "Max open files  1024  4096  files": the name has spaces, the numbers
            // are the first two words from column 26 on.
            let mut w = row.get(26..)?.split_whitespace();
            Some(Rlimit {
                resource,
                name,
                soft: val(w.next()?)?,
                hard: val(w.next()?)?,
            })
        })
        .collect()
}

fn rlimits_prlimit(pid: u32) -> Result<Vec<Rlimit>, String> {
    RESOURCES
        .iter()
        .map(|&(resource, name)| {
            let mut old = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: no new limit is passed; the kernel fills `old`, which we own.
            let r =
                unsafe { libc::prlimit(pid as libc::pid_t, resource, std::ptr::null(), &mut old) };
            if r != 0 {
                return Err(format!(
                    "prlimit({pid}, {name}): {}",
                    std::io::Error::last_os_error()
                ));
            }
            Ok(Rlimit {
                resource,
                name,
                soft: old.rlim_cur,
                hard: old.rlim_max,
            })
        })
        .collect()
}

/// The Umask line of a /proc/PID/status text (octal).
pub fn parse_umask(status: &str) -> Option<u32> {
    let v = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
    u32::from_str_radix(v.trim(), 8).ok()
}

/// The cgroup v2 path ("0::PATH") of a /proc/PID/cgroup text.
pub fn parse_cgroup_v2(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_end_matches(" (deleted)").to_string())
}

/// Where the cgroup v2 hierarchy is mounted, from a /proc/self/mountinfo text
/// (/sys/fs/cgroup on a unified host, /sys/fs/cgroup/unified on a hybrid one).
pub fn parse_cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        (post.split_whitespace().next()? == "cgroup2")
            .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))?
    })
}

impl Resources {
    pub fn read(pid: u32) -> Result<Resources, String> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|e| format!("/proc/{pid}/status: {e}"))?;
        let oom_score_adj = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
            .ok()
            .and_then(|s| s.trim().parse().ok());
        let cgroup_path = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .ok()
            .and_then(|t| parse_cgroup_v2(&t));
        let mount = std::fs::read_to_string("/proc/self/mountinfo")
            .ok()
            .and_then(|t| parse_cgroup2_mount(&t));
        let cgroup = match (&mount, &cgroup_path) {
            (Some(m), Some(p)) => Some(m.join(p.trim_start_matches('/'))),
            _ => None,
        };
        Ok(Resources {
            rlimits: rlimits(pid)?,
            umask: parse_umask(&status),
            oom_score_adj,
            cgroup,
            cgroup_path,
        })
    }

    /// Whether a child of the watcher can take these: a hard limit above the
    /// watcher's own, or an OOM adjustment below it, takes CAP_SYS_RESOURCE (which a
    /// container may not grant). Err says which cannot, before anything is stopped.
    pub fn settable(
        &self,
        mine: &[Rlimit],
        my_oom: Option<i32>,
        cap_sys_resource: bool,
    ) -> Result<(), String> {
        if cap_sys_resource {
            return Ok(());
        }
        let mut over: Vec<String> = self
            .rlimits
            .iter()
            .filter_map(|t| {
                let m = mine.iter().find(|m| m.resource == t.resource)?;
                (t.hard > m.hard).then(|| format!("{} hard {} > {}", t.name, t.hard, m.hard))
            })
            .collect();
        if let (Some(t), Some(m)) = (self.oom_score_adj, my_oom) {
            if t < m {
                over.push(format!("oom_score_adj {t} < {m}"));
            }
        }
        if over.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "its {} cannot be given to a relaunch without CAP_SYS_RESOURCE, which \
                 this watcher lacks",
                over.join(", ")
            ))
        }
    }

    /// The plan's lines for these (--dry-run).
    pub fn describe(&self) -> String {
        let lim = |v: u64| {
            if v == libc::RLIM_INFINITY {
                "unlimited".to_string()
            } else {
                v.to_string()
            }
        };
        let limits: Vec<String> = self
            .rlimits
            .iter()
            .map(|r| format!("{}={}:{}", r.name, lim(r.soft), lim(r.hard)))
            .collect();
        format!(
            "rlimits (soft:hard) {}\n       umask {}, oom_score_adj {}, cgroup {}",
            limits.join(" "),
            self.umask
                .map_or("(unknown: the watcher's)".into(), |m| format!("{m:04o}")),
            self.oom_score_adj
                .map_or("(unknown: the watcher's)".into(), |v| v.to_string()),
            self.cgroup
                .as_ref()
                .map_or("(no cgroup v2: the watcher's)".into(), |c| c
                    .display()
                    .to_string()),
        )
    }

    /// Everything prepared for the child, so that between fork and exec only
    /// async-signal-safe syscalls run (no allocation there).
    pub fn prepare(&self) -> Result<Prepared, String> {
        let cstr = |p: &Path| {
            CString::new(p.as_os_str().as_encoded_bytes())
                .map_err(|_| format!("{}: a NUL in the path", p.display()))
        };
        Ok(Prepared {
            rlimits: self
                .rlimits
                .iter()
                .map(|r| {
                    (
                        r.resource,
                        libc::rlimit {
                            rlim_cur: r.soft,
                            rlim_max: r.hard,
                        },
                    )
                })
                .collect(),
            umask: self.umask,
            oom: self.oom_score_adj.map(|v| v.to_string().into_bytes()),
            cgroup_procs: self
                .cgroup
                .as_ref()
                .map(|c| cstr(&c.join("cgroup.procs")))
                .transpose()?,
        })
    }
}

/// Resources ready to apply in a forked child.
pub struct Prepared {
    rlimits: Vec<(libc::__rlimit_resource_t, libc::rlimit)>,
    umask: Option<u32>,
    oom: Option<Vec<u8>>,
    cgroup_procs: Option<CString>,
}

// SAFETY: plain data (the raw pointers inside CString are owned); sent to the
// pre_exec closure, which runs in the child only.
unsafe impl Send for Prepared {}
// SAFETY: as above; the child only reads it.
unsafe impl Sync for Prepared {}

/// Writes `bytes` to the file at `path`; async-signal-safe.
///
/// # Safety
/// To be called between fork and exec: only open, write and close run.
unsafe fn write_file(path: &std::ffi::CStr, bytes: &[u8]) -> std::io::Result<()> {
    // SAFETY: a NUL-terminated path we own; plain syscalls.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = libc::write(fd, bytes.as_ptr().cast(), bytes.len());
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if n < 0 {
            return Err(err);
        }
    }
    Ok(())
}

impl Prepared {
    /// Applies everything to the calling (forked) process. `strict`: anything that
    /// cannot be applied is an error (an injection must reproduce it); otherwise (the
    /// restart of the original after a failure) what cannot be applied is left as the
    /// watcher has it: a server in the watcher's cgroup or with its limits rather than
    /// no server at all.
    ///
    /// # Safety
    /// To be called between fork and exec, as root, before the credentials drop:
    /// only async-signal-safe syscalls run, and nothing allocates.
    pub unsafe fn apply(&self, strict: bool) -> std::io::Result<()> {
        // First the cgroup: the limits below are the process's own either way, and
        // writing "0" to cgroup.procs moves the writer itself.
        if let Some(procs) = &self.cgroup_procs {
            // SAFETY: between fork and exec (our caller's contract).
            let r = unsafe { write_file(procs, b"0") };
            if strict {
                r?;
            }
        }
        for (res, lim) in &self.rlimits {
            // SAFETY: plain syscall with a limit we own.
            if unsafe { libc::setrlimit(*res, lim) } != 0 && strict {
                return Err(std::io::Error::last_os_error());
            }
        }
        if let Some(m) = self.umask {
            // SAFETY: plain syscall; cannot fail.
            unsafe { libc::umask(m as libc::mode_t) };
        }
        if let Some(v) = &self.oom {
            // SAFETY: between fork and exec; a static NUL-terminated path.
            let r = unsafe { write_file(c"/proc/self/oom_score_adj", v) };
            if strict {
                r?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_texts() {
        assert_eq!(
            parse_umask("Name:\tx\nUmask:\t0027\nState:\tS\n"),
            Some(0o027)
        );
        assert_eq!(parse_umask("Name:\tx\n"), None);
        assert_eq!(
            parse_cgroup_v2("12:cpu:/\n0::/system.slice/nginx.service\n").as_deref(),
            Some("/system.slice/nginx.service")
        );
        assert_eq!(parse_cgroup_v2("4:memory:/x\n"), None);
        let mi = "24 1 0:22 / /sys rw - sysfs sysfs rw\n\
                  41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n";
        assert_eq!(
            parse_cgroup2_mount(mi),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            parse_cgroup2_mount("24 1 0:22 / /sys rw - sysfs sysfs rw\n"),
            None
        );
    }

    #[test]
    fn parses_proc_limits() {
        let t = "Limit                     Soft Limit           Hard Limit           Units     \n\
Max cpu time              unlimited            unlimited            seconds   \n\
Max file size             unlimited            unlimited            bytes     \n\
Max data size             unlimited            unlimited            bytes     \n\
Max stack size            8388608              unlimited            bytes     \n\
Max core file size        0                    unlimited            bytes     \n\
Max resident set          unlimited            unlimited            bytes     \n\
Max processes             96362                96362                processes \n\
Max open files            3000                 4000                 files     \n\
Max locked memory         8388608              8388608              bytes     \n\
Max address space         unlimited            unlimited            bytes     \n\
Max file locks            unlimited            unlimited            locks     \n\
Max pending signals       96362                96362                signals   \n\
Max msgqueue size         819200               819200               bytes     \n\
Max nice priority         0                    0                    \n\
Max realtime priority     0                    0                    \n\
Max realtime timeout      unlimited            unlimited            us        \n";
        let l = parse_limits(t).unwrap();
        let nofile = l.iter().find(|r| r.name == "nofile").unwrap();
        assert_eq!(
            (nofile.resource, nofile.soft, nofile.hard),
            (libc::RLIMIT_NOFILE, 3000, 4000)
        );
        let stack = l.iter().find(|r| r.name == "stack").unwrap();
        assert_eq!((stack.soft, stack.hard), (8388608, libc::RLIM_INFINITY));
        assert_eq!(l.iter().find(|r| r.name == "nice").unwrap().hard, 0);
        assert_eq!(parse_limits("Limit\nMax cpu time 1 2\n"), None);
        // Our own, both ways.
        let me = std::process::id();
        let text = std::fs::read_to_string("/proc/self/limits").unwrap();
        assert_eq!(parse_limits(&text).unwrap(), rlimits_prlimit(me).unwrap());
    }

    #[test]
    fn what_a_child_can_take() {
        let lim = |name: &'static str, soft, hard| Rlimit {
            resource: RESOURCES.iter().find(|r| r.1 == name).unwrap().0,
            name,
            soft,
            hard,
        };
        let mine = vec![lim("nofile", 1024, 20000), lim("memlock", 8 << 20, 8 << 20)];
        let mut t = Resources {
            rlimits: vec![lim("nofile", 4000, 4000), lim("memlock", 1 << 20, 2 << 20)],
            oom_score_adj: Some(100),
            ..Resources::default()
        };
        assert_eq!(t.settable(&mine, Some(0), false), Ok(()));
        t.rlimits[0].hard = 1 << 20;
        t.oom_score_adj = Some(-500);
        let e = t.settable(&mine, Some(0), false).unwrap_err();
        assert!(
            e.contains("nofile hard 1048576 > 20000") && e.contains("oom_score_adj -500 < 0"),
            "{e}"
        );
        assert_eq!(t.settable(&mine, Some(0), true), Ok(()));
    }

    #[test]
    fn reads_its_own() {
        let me = Resources::read(std::process::id()).unwrap();
        assert_eq!(me.rlimits.len(), RESOURCES.len());
        let mut nofile = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: the kernel fills a struct we own.
        let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut nofile) };
        assert_eq!(got, 0);
        let r = me.rlimits.iter().find(|r| r.name == "nofile").unwrap();
        assert_eq!((r.soft, r.hard), (nofile.rlim_cur, nofile.rlim_max));
        let text = me.describe();
        assert!(
            text.contains("nofile=") && text.contains("memlock="),
            "{text}"
        );
        assert!(me.prepare().is_ok());
    }
}
