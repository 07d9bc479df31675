//! The kernel side's layouts, mirrored from ebpf/src/main.rs: map names, counter
//! indices, the per-thread record and the histogram geometry. Change both together.

/// x86_64 futex syscall number.
pub const NR_FUTEX: usize = 202;
/// Syscalls below this number have per-syscall counts and histograms.
pub const NR_MAX: usize = 512;
/// Buckets per syscall histogram (log2 of nanoseconds).
pub const SYS_BUCKETS: usize = 64;
/// Buckets of the fine (log-linear) histograms: stall and wake-up latency.
pub const FINE_BUCKETS: usize = 1024;
pub const N_COUNTERS: usize = 32;

pub const C_ON_NS: usize = 0;
pub const C_OFF_NS: usize = 1;
pub const C_VOL: usize = 2;
pub const C_INVOL: usize = 3;
pub const C_WAKEUPS: usize = 4;
pub const C_WAKE_NS: usize = 5;
pub const C_THREADS_CREATED: usize = 6;
pub const C_THREADS_EXITED: usize = 7;
pub const C_OFFLOAD_CALLS: usize = 8;
pub const C_OFFLOAD_NS: usize = 9;
pub const C_OFFLOAD_OFF_NS: usize = 10;
pub const C_FUTEX_IN_OFFLOAD: usize = 11;
pub const C_FUTEX_NOSTACK: usize = 12;
pub const C_FUTEX_TOTAL: usize = 13;
pub const C_THREADS_MISSED: usize = 15;
pub const C_OFFLOAD_WAKE_NS: usize = 16;
/// Voluntary switches during offload calls (a blocking wait's sleeps).
pub const C_OFFLOAD_SLEEPS: usize = 18;
/// On-CPU time inside and outside offload calls (split at the probes).
pub const C_ON_IN_NS: usize = 19;
pub const C_ON_OUT_NS: usize = 20;
/// Syscalls outside offload calls that slept, and their on-CPU time.
pub const C_SLEPT_SYSCALLS: usize = 21;
pub const C_SLEPT_SYSCALL_ON_NS: usize = 22;
/// The same inside offload calls.
pub const C_SLEPT_IN_SYSCALLS: usize = 23;
pub const C_SLEPT_IN_SYSCALL_ON_NS: usize = 24;
/// The time the sleeps outside offload calls waited until their wake-up.
pub const C_SLEPT_SYSCALL_BLOCKED_NS: usize = 25;

pub const F_EXITED: u32 = 1;

/// ebpf/src/main.rs `ThreadInfo`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadInfo {
    pub tgid: u32,
    pub flags: u32,
    pub on_since: u64,
    pub off_since: u64,
    pub wake_ts: u64,
    pub on_ns: u64,
    pub off_ns: u64,
    pub vol: u64,
    pub invol: u64,
    pub offload_depth: u64,
    pub offload_start: u64,
    pub offload_off0: u64,
    pub sys_nr: u64,
    pub sys_ts: u64,
    pub offload_calls: u64,
    pub futex_calls: u64,
    pub offload_wake_ns: u64,
    pub epoch: u64,
    pub out_ns: u64,
    pub sys_on0: u64,
    pub sys_vol0: u64,
    pub sys_blocked: u64,
    pub reads: u64,
    pub mux_waits: u64,
    pub stall_ns: u64,
}

// SAFETY: repr(C), only integers, no padding (4 + 4 + 23 * 8 bytes).
unsafe impl aya::Pod for ThreadInfo {}

/// ebpf/src/main.rs `Site`: a futex syscall's user address and the word at the
/// user stack pointer (the caller, when the address is in libc's syscall()).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Site {
    pub ip: u64,
    pub caller: u64,
}

// SAFETY: repr(C), two u64s.
unsafe impl aya::Pod for Site {}

/// Lower bound and width of a fine bucket (the inverse of the kernel's fine_bucket).
pub fn fine_bounds(idx: usize) -> (f64, f64) {
    if idx < 16 {
        return (idx as f64, 1.0);
    }
    let m = idx / 16 + 3;
    let sub = (idx % 16) as u64;
    let width = 1u64 << (m - 4);
    (((1u64 << m) + sub * width) as f64, width as f64)
}

/// The kernel's fine_bucket, for tests and synthetic histograms.
pub fn fine_bucket(v: u64) -> usize {
    if v < 16 {
        return v as usize;
    }
    let m = 63 - v.leading_zeros() as usize;
    ((m - 3) * 16 + ((v >> (m - 4)) & 15) as usize).min(FINE_BUCKETS - 1)
}

/// Lower bound and width of a syscall histogram bucket (log2).
pub fn log2_bounds(idx: usize) -> (f64, f64) {
    if idx == 0 {
        (0.0, 1.0)
    } else {
        let lo = (1u64 << idx.min(63)) as f64;
        (lo, lo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_info_has_the_kernel_size() {
        assert_eq!(std::mem::size_of::<ThreadInfo>(), 8 + 23 * 8);
    }

    #[test]
    fn fine_buckets_invert() {
        for v in [
            0u64,
            5,
            15,
            16,
            17,
            31,
            32,
            100,
            1000,
            200_000,
            1_000_000,
            1 << 40,
        ] {
            let (lo, w) = fine_bounds(fine_bucket(v));
            assert!(
                lo <= v as f64 && (v as f64) < lo + w,
                "{v}: [{lo}, {})",
                lo + w
            );
            assert!(
                w <= (v as f64 / 16.0).max(1.0),
                "{v}: bucket too wide ({w})"
            );
        }
        // Contiguous: every bucket starts where the previous ended.
        for i in 1..900 {
            let (lo0, w0) = fine_bounds(i - 1);
            let (lo1, _) = fine_bounds(i);
            assert_eq!(lo0 + w0, lo1, "bucket {i}");
        }
    }
}
