//! The names toffload's backends give their threads inside a target, which the
//! watcher reads back from /proc/TID/comm: those threads' CPU is the backend's work
//! per offload (the emulated device's AES and its completions, the remote client's
//! socket I/O), which a rerouted loop on the same cores keeps paying, unlike the
//! per-second work of other helper threads. At most 15 bytes each (the kernel's
//! TASK_COMM_LEN).

/// The emulated device's engine thread.
pub const EMULATED_ENGINE: &str = "toffload-emu";
/// The remote backend's I/O thread.
pub const REMOTE_IO: &str = "toffload-remote";
/// Every backend thread name above.
pub const BACKEND: [&str; 2] = [EMULATED_ENGINE, REMOTE_IO];

/// True when `comm` (as /proc gives it, a trailing newline allowed) names a backend
/// thread.
pub fn is_backend(comm: &str) -> bool {
    BACKEND.contains(&comm.trim_end())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_the_kernels_comm_and_read_back() {
        for n in BACKEND {
            assert!(n.len() <= 15, "{n} is cut to 15 bytes in comm");
            assert!(is_backend(&format!("{n}\n")));
        }
        assert!(!is_backend("redis-server\n"));
        assert!(!is_backend("toffload-rconn"));
    }
}
