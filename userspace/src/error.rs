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
/// --inject: the relaunch failed and so did restarting the original: the server is down.
pub const EXIT_SERVER_DOWN: u8 = 10;
/// `serve`: the configuration is wrong (the file or its flags); the same code as a
/// bad command line, since it is one spelt in a file.
pub const EXIT_BAD_CONFIG: u8 = 2;

/// The exit code for how an injection ended (None: not asked, or it went well).
pub fn inject_exit_code(outcome: Option<crate::inject_flow::InjectAction>) -> Option<u8> {
    use crate::inject_flow::InjectAction;
    match outcome? {
        InjectAction::Refused => Some(EXIT_INJECT_REFUSED),
        InjectAction::Failed => Some(EXIT_INJECT_FAILED),
        InjectAction::Down => Some(EXIT_SERVER_DOWN),
        InjectAction::Plan | InjectAction::Injected => None,
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
