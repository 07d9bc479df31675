//! Stopping a process and starting its replacement: same executable, argv,
//! environment, working directory and credentials, its own session (a Ctrl-C at the
//! watcher's terminal must not reach the server), and the old process's standard
//! input, output and error (taken with pidfd_getfd before it is stopped, so its logs
//! keep going where they went).

use super::process::{self, Launch, Listen};
use std::collections::BTreeSet;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use toffload_abi::runtime::RuntimeState;

fn pidfd_open(pid: u32) -> Result<OwnedFd, String> {
    // SAFETY: plain syscall; the result is a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(format!(
            "pidfd_open({pid}): {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Duplicates the target's descriptors 0, 1, 2 into ours (/dev/null for any that
/// cannot be taken).
pub fn take_stdio(pid: u32) -> [Option<OwnedFd>; 3] {
    let Ok(pfd) = pidfd_open(pid) else {
        return [None, None, None];
    };
    use std::os::fd::AsRawFd;
    [0, 1, 2].map(|n| {
        // SAFETY: plain syscall on a pidfd we hold.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pfd.as_raw_fd(), n, 0) };
        // SAFETY: a fresh descriptor we own.
        (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
    })
}

fn dup(fd: &Option<OwnedFd>) -> Stdio {
    match fd.as_ref().and_then(|f| f.try_clone().ok()) {
        Some(f) => Stdio::from(f),
        None => Stdio::null(),
    }
}

/// SIGTERM, then SIGKILL after `grace`; returns once the process has exited (a zombie
/// of its parent counts: it serves nothing).
pub fn stop(pid: u32, grace: Duration) -> Result<(), String> {
    // SAFETY: plain signal.
    if unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) } != 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ESRCH) {
            Ok(())
        } else {
            Err(format!("kill({pid}, SIGTERM): {e}"))
        };
    }
    if wait_gone(pid, grace) {
        return Ok(());
    }
    // SAFETY: plain signal.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    if wait_gone(pid, Duration::from_secs(5)) {
        Ok(())
    } else {
        Err(format!("pid {pid} did not exit after SIGKILL"))
    }
}

fn wait_gone(pid: u32, limit: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if !process::running(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    !process::running(pid)
}

/// Starts `l` in its own session with the given stdio. `strict`: its cgroup must be
/// joined (an injection); otherwise (the original, restarted after a failure) a cgroup
/// that cannot be joined is not worth a server left down.
pub fn spawn(l: &Launch, stdio: &[Option<OwnedFd>; 3], strict: bool) -> Result<Child, String> {
    let mut cmd = Command::new(&l.exe);
    cmd.arg0(&l.argv[0])
        .args(&l.argv[1..])
        .env_clear()
        .envs(l.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&l.cwd)
        .stdin(dup(&stdio[0]))
        .stdout(dup(&stdio[1]))
        .stderr(dup(&stdio[2]));
    let (uid, gid, nice) = (l.uid, l.gid, l.nice);
    let groups: Vec<libc::gid_t> = l.groups.clone();
    // Built before the fork: only the syscall runs in the child.
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut cpus: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in &l.cpus {
        // SAFETY: c < CPU_SETSIZE (it came from CPU_ISSET over that range).
        unsafe { libc::CPU_SET(c, &mut cpus) };
    }
    let pin = !l.cpus.is_empty();
    let res = l.res.prepare()?;
    // SAFETY: geteuid takes nothing and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    // SAFETY: only async-signal-safe syscalls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Cgroup, limits, umask and OOM adjustment while still root (raising a
            // hard limit, joining a cgroup and lowering the adjustment need it), and
            // the cgroup before the CPUs: joining a cpuset resets the affinity.
            if root {
                res.apply(strict)?;
            }
            // The server's own priority and CPUs, not the watcher's.
            libc::setpriority(libc::PRIO_PROCESS, 0, nice);
            if pin && libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &cpus) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if root
                && (libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setresgid(gid, gid, gid) != 0
                    || libc::setresuid(uid, uid, uid) != 0)
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
        .map_err(|e| format!("starting {}: {e}", l.exe.display()))
}

/// What "serving again" waits for.
pub struct Ready<'a> {
    pub ports: &'a BTreeSet<Listen>,
    /// The preloaded runtime must report itself active.
    pub runtime: bool,
    pub limit: Duration,
}

/// Waits until `pid` listens on every port (and its runtime is active); an exit (as
/// `exited` reports it), a disabled runtime or the time limit is an error that says
/// which.
pub fn wait_ready(
    pid: u32,
    exited: &mut dyn FnMut() -> Option<String>,
    r: &Ready,
) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        if let Some(st) = exited() {
            return Err(format!("the relaunched command exited at once ({st})"));
        }
        let have = process::listening(pid);
        let listening = r.ports.is_subset(&have)
            && (!r.ports.is_empty() || t0.elapsed() > Duration::from_secs(1));
        if listening {
            if !r.runtime {
                return Ok(());
            }
            match crate::runtime_counters::locate(pid)
                .and_then(|at| crate::runtime_counters::read(pid, at))
                .map(|c| c.state)
            {
                Some(RuntimeState::Active) => return Ok(()),
                Some(RuntimeState::Disabled) => {
                    return Err(
                        "the preloaded runtime disabled itself (a malformed TOFFLOAD_* \
                                knob or TOFFLOAD_FIBERIZE=off: the server's stderr names it)"
                            .into(),
                    )
                }
                None => {
                    return Err(
                        "libtoffload.so is not mapped in the relaunched process (was \
                                LD_PRELOAD ignored, e.g. a setuid binary?)"
                            .into(),
                    )
                }
                Some(RuntimeState::Loading) => {}
            }
        }
        if t0.elapsed() > r.limit {
            let want: Vec<u16> = r.ports.iter().map(|l| l.port).collect();
            return Err(format!(
                "not serving after {:.0} s: listening on {:?}, expected {:?}",
                r.limit.as_secs_f64(),
                have.iter().map(|l| l.port).collect::<Vec<_>>(),
                want
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How a child of ours ended, if it has (reaping it).
pub fn child_exited(child: &mut Child) -> Option<String> {
    match child.try_wait() {
        Ok(Some(st)) => Some(st.to_string()),
        Ok(None) => None,
        Err(e) => Some(format!("wait: {e}")),
    }
}

/// Whether a process that is not our child has ended.
pub fn pid_exited(pid: u32) -> Option<String> {
    (!process::running(pid)).then(|| "exited".to_string())
}

/// Ends a child we started and reaps it.
pub fn kill(child: &mut Child) {
    let _ = stop(child.id(), Duration::from_secs(2));
    let _ = child.kill();
    let _ = child.wait();
}
