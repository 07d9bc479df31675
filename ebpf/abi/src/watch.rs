//! The kernel side's maps as the watcher reads them: sizes, counter indices, the
//! per-thread record and the futex call site. Integer types are the kernel side's
//! (u32 for map indices and sizes).

/// x86_64 syscall number of futex.
pub const NR_FUTEX: u64 = 202;
/// Syscalls numbered below this get per-syscall counts and histograms.
pub const NR_MAX: u64 = 512;
/// Buckets of a per-syscall log2 histogram (2^63 ns is far beyond any syscall).
pub const SYS_BUCKETS: u64 = 64;
/// Buckets of the fine (log-linear) histograms: stall, wake-up, done, outside.
pub const FINE_BUCKETS: u32 = 1024;
/// Entries of the COUNTERS map (the indices below, with room to grow).
pub const N_COUNTERS: u32 = 32;
/// Rows of FINE_HISTS, each FINE_BUCKETS fine buckets: the offload's stall, the
/// stall without its wake-up delay, wake-up delays, and a request's on-CPU time
/// outside the offload.
pub const H_STALL: u32 = 0;
pub const H_DONE: u32 = 1;
pub const H_WAKE: u32 = 2;
pub const H_OUTSIDE: u32 = 3;
pub const N_FINE_HISTS: u32 = 4;
/// Buckets of SPIN_HIST: stalls by their on-CPU share in tenths, 0 to 10.
pub const SPIN_BUCKETS: u32 = 11;

// Counter indices (COUNTERS).
pub const C_ON_NS: u32 = 0;
pub const C_OFF_NS: u32 = 1;
pub const C_VOL: u32 = 2;
pub const C_INVOL: u32 = 3;
pub const C_WAKEUPS: u32 = 4;
pub const C_WAKE_NS: u32 = 5;
pub const C_THREADS_CREATED: u32 = 6;
pub const C_THREADS_EXITED: u32 = 7;
pub const C_OFFLOAD_CALLS: u32 = 8;
pub const C_OFFLOAD_NS: u32 = 9;
pub const C_OFFLOAD_OFF_NS: u32 = 10;
pub const C_FUTEX_IN_OFFLOAD: u32 = 11;
pub const C_FUTEX_NOSTACK: u32 = 12;
pub const C_FUTEX_TOTAL: u32 = 13;
pub const C_THREADS_MISSED: u32 = 15;
pub const C_OFFLOAD_WAKE_NS: u32 = 16;
/// Futex calls seen, for the kernel's one-in-64 stack sampling.
pub const C_FUTEX_SEEN: u32 = 17;
/// Voluntary switches (sleeps) during offload calls: a blocking wait sleeps, a spin
/// never does, however long the scheduler keeps it off the CPU.
pub const C_OFFLOAD_SLEEPS: u32 = 18;
/// On-CPU time inside offload calls and outside them, split at the probes: the CPU a
/// request costs besides its wait, measured within the window (a stall's on-CPU
/// total, taken at its end, may have begun windows earlier).
pub const C_ON_IN_NS: u32 = 19;
pub const C_ON_OUT_NS: u32 = 20;
/// Syscalls outside offload calls that slept (a read waiting for the next request),
/// and their on-CPU time: what such a sleep costs the thread (the call, the switch
/// out, the switch back in), which fibers replace with a yield.
pub const C_SLEPT_SYSCALLS: u32 = 21;
pub const C_SLEPT_SYSCALL_ON_NS: u32 = 22;
/// The same inside offload calls (a blocking wait's futex): the sleep's own cost,
/// without the submit around it, which fibers pay too.
pub const C_SLEPT_IN_SYSCALLS: u32 = 23;
pub const C_SLEPT_IN_SYSCALL_ON_NS: u32 = 24;
/// The time those sleeps outside the offload waited before their wake-up: for a
/// connection thread's read, the time the next request took to come (the client's
/// share of the loop, Z), without the wake-up delay (the server's own).
pub const C_SLEPT_SYSCALL_BLOCKED_NS: u32 = 25;
/// Wake-ups a watched thread made of a task outside the watch (a client, a peer
/// process) that last ran on another CPU, and of those the ones whose CPU was idle:
/// each of these the waker paid for by waking that CPU (an IPI, in a VM an exit),
/// which a server answering a busy client does not pay.
pub const C_PEER_WAKES: u32 = 26;
pub const C_PEER_IDLE_WAKES: u32 = 27;
/// Syscalls of processes outside the watch while tracing: the syscall hooks run for
/// every task on the host, so each of these pays the hooks' entry and filter too,
/// a cost the watch owes its neighbours (a local load tool, a sidecar) as well as
/// the target.
pub const C_HOST_SYSCALLS: u32 = 28;
/// Entries of CPU_IDLE (CPUs whose idle state is tracked).
pub const MAX_CPUS: u32 = 1024;

/// ThreadInfo flags: the thread exited (its record stays for the final numbers).
pub const F_EXITED: u32 = 1;
/// An outside part is being timed: the thread's last offload returned while tracing,
/// and `out_ns` sums its on-CPU time since.
pub const F_OUT_OPEN: u32 = 2;

/// Per-thread state (THREADS, keyed by tid). Written only from the thread's own
/// context or by the scheduler tracepoints that serialize on it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadInfo {
    pub tgid: u32,
    pub flags: u32,
    /// When the thread last went on CPU (0: off CPU or unknown).
    pub on_since: u64,
    /// When it last went off CPU (0: unknown).
    pub off_since: u64,
    /// When it was last woken (0: no wake-up pending).
    pub wake_ts: u64,
    pub on_ns: u64,
    pub off_ns: u64,
    pub vol: u64,
    pub invol: u64,
    /// Offload nesting depth, its start time and off_ns when it started.
    pub offload_depth: u64,
    pub offload_start: u64,
    pub offload_off0: u64,
    /// The syscall in progress and when it began.
    pub sys_nr: u64,
    pub sys_ts: u64,
    pub offload_calls: u64,
    pub futex_calls: u64,
    /// Wake-up-to-run delay accumulated during the current offload (the scheduler's
    /// share of a blocking stall).
    pub offload_wake_ns: u64,
    /// The attach epoch the timestamps above belong to (see the kernel's CONFIG).
    pub epoch: u64,
    /// On-CPU time since the last offload returned (see F_OUT_OPEN).
    pub out_ns: u64,
    /// The thread's on-CPU clock and voluntary switches when its syscall began.
    pub sys_on0: u64,
    pub sys_vol0: u64,
    /// Switch-out-to-wake-up time in the current syscall, outside offload calls.
    pub sys_blocked: u64,
    /// Read-family syscalls (read, readv, recvfrom, recvmsg, recvmmsg) and
    /// multiplexing waits (epoll, poll, select): per thread, so that a service's
    /// processes and threads can be told apart by who serves and how.
    pub reads: u64,
    pub mux_waits: u64,
    /// The offload calls' stalls summed (a process's mean stall).
    pub stall_ns: u64,
    /// Syscalls entered (the watch's cost to this thread is counted per event).
    pub syscalls: u64,
}

/// A futex call site (FUTEX_SITES' key): the user address of the syscall instruction
/// (top frame), and the word at the user stack pointer, which is the return address
/// into the caller when the instruction is in libc's syscall() (a leaf that pushes
/// nothing).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Site {
    pub ip: u64,
    pub caller: u64,
}

// SAFETY: repr(C), only integers, no padding (4 + 4 + 24 * 8 bytes, checked below).
#[cfg(feature = "user")]
unsafe impl aya::Pod for ThreadInfo {}

// SAFETY: repr(C), two u64s.
#[cfg(feature = "user")]
unsafe impl aya::Pod for Site {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_have_no_padding() {
        assert_eq!(core::mem::size_of::<ThreadInfo>(), 8 + 24 * 8);
        assert_eq!(core::mem::size_of::<Site>(), 16);
    }
}
