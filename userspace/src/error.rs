//! The watcher's failures and their exit codes (documented in the README).

use std::fmt;

/// Exit codes: 0 success (also when the watched process exits: a final report is
/// printed), 1 any other failure, 2 bad command line (clap), and these.
pub const EXIT_NOT_ROOT: u8 = 3;
pub const EXIT_BPF_UNAVAILABLE: u8 = 4;
/// The pid, cgroup or unit to watch does not exist (or holds no process).
pub const EXIT_NO_SUCH_PID: u8 = 5;
pub const EXIT_NO_OBJECT: u8 = 6;
pub const EXIT_SPAWN: u8 = 7;
/// --inject: the verdict (or the target) ruled injection out; nothing was changed.
pub const EXIT_INJECT_REFUSED: u8 = 8;
/// --inject: the relaunch under the runtime failed; the original command runs again.
pub const EXIT_INJECT_FAILED: u8 = 9;
/// --inject: the relaunch failed (or the injected server failed its health window) and
/// so did restarting the original: the server is down.
pub const EXIT_SERVER_DOWN: u8 = 10;
/// `serve`: the configuration is wrong (the file or its flags); the same code as a
/// bad command line, since it is one spelt in a file.
pub const EXIT_BAD_CONFIG: u8 = 2;
/// --inject: refused because a relaunch could not reproduce the target's credentials
/// (real or saved ids differ from the effective ones; a privileged port held by a
/// non-root process) or its systemd unit (a user manager's); nothing was changed.
pub const EXIT_INJECT_UNREPRODUCIBLE: u8 = 11;
/// --inject: the injected server crashed, exited or stopped serving in its health
/// window; it was rolled back and the original command runs again.
pub const EXIT_INJECT_ROLLED_BACK: u8 = 12;
/// --inject: the injected server stood its health window, then exited during the
/// watch (not rolled back: only the health window is).
pub const EXIT_INJECTED_EXITED: u8 = 13;

/// The exit code for how an injection ended (None: not asked, or it went well), given
/// how the watch ended: a server that was injected and then exited is never a 0.
pub fn inject_exit_code(
    outcome: Option<crate::inject_flow::InjectAction>,
    ended: crate::report::Ended,
) -> Option<u8> {
    use crate::inject_flow::InjectAction;
    match outcome? {
        InjectAction::Refused => Some(EXIT_INJECT_REFUSED),
        InjectAction::Unreproducible => Some(EXIT_INJECT_UNREPRODUCIBLE),
        InjectAction::Failed => Some(EXIT_INJECT_FAILED),
        InjectAction::Down => Some(EXIT_SERVER_DOWN),
        InjectAction::RolledBack => Some(EXIT_INJECT_ROLLED_BACK),
        InjectAction::Injected | InjectAction::Healthy
            if ended == crate::report::Ended::ProcessExited =>
        {
            Some(EXIT_INJECTED_EXITED)
        }
        InjectAction::Plan | InjectAction::Injected | InjectAction::Healthy => None,
    }
}

#[derive(Debug)]
pub enum WatchError {
    /// Lacking root (CAP_BPF + CAP_PERFMON, or CAP_SYS_ADMIN).
    NotRoot(String),
    /// The kernel refused to load or attach the programs.
    BpfUnavailable(String),
    NoSuchPid(u32),
    /// A cgroup or unit that is not there, or names nothing to watch.
    BadTarget(String),
    /// This binary was built without the eBPF object.
    NoObject,
    /// `run -- CMD` could not start CMD.
    Spawn(String),
    /// `serve`: a configuration that cannot be used (what is wrong, and where).
    BadConfig(String),
    Other(String),
}

impl WatchError {
    pub fn exit_code(&self) -> u8 {
        match self {
            WatchError::NotRoot(_) => EXIT_NOT_ROOT,
            WatchError::BpfUnavailable(_) => EXIT_BPF_UNAVAILABLE,
            WatchError::NoSuchPid(_) | WatchError::BadTarget(_) => EXIT_NO_SUCH_PID,
            WatchError::NoObject => EXIT_NO_OBJECT,
            WatchError::Spawn(_) => EXIT_SPAWN,
            WatchError::BadConfig(_) => EXIT_BAD_CONFIG,
            WatchError::Other(_) => 1,
        }
    }
}

impl fmt::Display for WatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WatchError::NotRoot(why) => write!(
                f,
                "not root: {why}. Run it with sudo (it needs CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN)"
            ),
            WatchError::BpfUnavailable(why) => write!(f, "BPF unavailable: {why}"),
            WatchError::NoSuchPid(pid) => write!(f, "no such pid: {pid}"),
            WatchError::BadTarget(why) => write!(f, "no such target: {why}"),
            WatchError::NoObject => write!(
                f,
                "this toffload-watch was built without its eBPF object. Build it with \
                 `cargo xtask build-ebpf`, then rebuild toffload-watch (`cargo xtask build` \
                 does both)"
            ),
            WatchError::Spawn(why) => write!(f, "cannot start the command: {why}"),
            WatchError::BadConfig(why) => write!(f, "bad configuration: {why}"),
            WatchError::Other(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for WatchError {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inject_flow::InjectAction as A;
    use crate::report::Ended as E;

    #[test]
    fn inject_codes() {
        assert_eq!(inject_exit_code(None, E::ProcessExited), None);
        assert_eq!(inject_exit_code(Some(A::Healthy), E::Duration), None);
        assert_eq!(inject_exit_code(Some(A::Plan), E::ProcessExited), None);
        assert_eq!(
            inject_exit_code(Some(A::Healthy), E::ProcessExited),
            Some(EXIT_INJECTED_EXITED)
        );
        assert_eq!(
            inject_exit_code(Some(A::Injected), E::ProcessExited),
            Some(EXIT_INJECTED_EXITED)
        );
        assert_eq!(
            inject_exit_code(Some(A::RolledBack), E::Duration),
            Some(EXIT_INJECT_ROLLED_BACK)
        );
        assert_eq!(
            inject_exit_code(Some(A::Unreproducible), E::InjectionRefused),
            Some(EXIT_INJECT_UNREPRODUCIBLE)
        );
        // Every code distinct.
        let mut all = vec![
            EXIT_NOT_ROOT,
            EXIT_BPF_UNAVAILABLE,
            EXIT_NO_SUCH_PID,
            EXIT_NO_OBJECT,
            EXIT_SPAWN,
            EXIT_INJECT_REFUSED,
            EXIT_INJECT_FAILED,
            EXIT_SERVER_DOWN,
            EXIT_INJECT_UNREPRODUCIBLE,
            EXIT_INJECT_ROLLED_BACK,
            EXIT_INJECTED_EXITED,
        ];
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
    }
}
