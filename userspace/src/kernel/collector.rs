//! Reads the kernel's maps into a cumulative Snapshot: counters and histograms summed
//! over CPUs, per-thread records, futex origins. Windows are differences of two.

use super::percpu::PerCpuRows;
use crate::abi::{self, ThreadInfo};
use crate::error::WatchError;
use crate::futex::{self, Layout, Origins};
use crate::hist::Hist;
use aya::maps::{HashMap, MapData, PerCpuHashMap, StackTraceMap};
use aya::Ebpf;
use std::collections::{BTreeMap, BTreeSet};

/// Everything measured since the watch began (the maps only grow).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Seconds traced since the watch began (the clock every count here runs on).
    pub t: f64,
    /// Wall-clock seconds since the watch began, and the Unix time, when read.
    pub wall: f64,
    pub unix: f64,
    pub counters: Vec<u64>,
    /// [nr * 2] calls, [nr * 2 + 1] total ns.
    pub syscalls: Vec<u64>,
    /// log2 histograms of the syscalls that have been called.
    pub sys_hists: BTreeMap<usize, Hist>,
    pub stall: Hist,
    /// Stall minus its wake-up delay.
    pub done: Hist,
    /// Each request's on-CPU time outside the offload (FINE_HISTS row H_OUTSIDE).
    pub outside: Hist,
    /// Stalls by on-CPU share in tenths (11 buckets).
    pub spin_tenths: Vec<u64>,
    pub wake: Hist,
    pub futex: Origins,
    /// Every thread seen (exited ones keep their last numbers).
    pub threads: BTreeMap<u32, ThreadInfo>,
    /// Those of them that are a toffload backend's own (toffload_abi::threads).
    pub backend_threads: BTreeSet<u32>,
    /// Threads alive now (/proc/PID/task).
    pub live_threads: usize,
    /// The busiest futex call stacks: (calls, user frames).
    pub futex_stacks: Vec<(u64, Vec<u64>)>,
    /// The fiber runtime's counters, read from the target's memory at the same time
    /// (None when it does not run libtoffload.so).
    pub runtime: Option<crate::runtime_counters::RuntimeCounters>,
    /// Its latency histograms, read with them (None without the runtime, or from one
    /// that measures none).
    pub runtime_latency: Option<crate::runtime_counters::RuntimeLatency>,
    /// The watched processes as /proc shows them (the session reads it).
    pub procs: BTreeMap<u32, crate::processes::ProcInfo>,
}

impl Snapshot {
    /// Counter `i` (a C_* index of toffload-abi).
    pub fn counter(&self, i: u32) -> u64 {
        self.counters.get(i as usize).copied().unwrap_or(0)
    }

    pub fn calls(&self, nr: usize) -> u64 {
        self.syscalls.get(nr * 2).copied().unwrap_or(0)
    }

    pub fn sys_ns(&self, nr: usize) -> u64 {
        self.syscalls.get(nr * 2 + 1).copied().unwrap_or(0)
    }

    /// An empty snapshot of the right shape (the baseline of a fresh watch).
    pub fn zero() -> Snapshot {
        Snapshot {
            counters: vec![0; abi::N_COUNTERS as usize],
            syscalls: vec![0; abi::NR_MAX as usize * 2],
            stall: Hist::fine(vec![0; abi::FINE_BUCKETS as usize]),
            done: Hist::fine(vec![0; abi::FINE_BUCKETS as usize]),
            outside: Hist::fine(vec![0; abi::FINE_BUCKETS as usize]),
            spin_tenths: vec![0; abi::SPIN_BUCKETS as usize],
            wake: Hist::fine(vec![0; abi::FINE_BUCKETS as usize]),
            ..Default::default()
        }
    }
}

pub struct Collector {
    counters: PerCpuRows,
    syscalls: PerCpuRows,
    sys_hist: PerCpuRows,
    fine: PerCpuRows,
    spin_hist: PerCpuRows,
    threads: HashMap<MapData, u32, ThreadInfo>,
    stacks: StackTraceMap<MapData>,
    futex_stacks: PerCpuHashMap<MapData, u32, u64>,
    futex_sites: PerCpuHashMap<MapData, abi::Site, u64>,
    /// Each futex stack id's frames, fetched once.
    stack_frames: BTreeMap<u32, Vec<u64>>,
    seen_threads: BTreeMap<u32, ThreadInfo>,
    backend_threads: BTreeSet<u32>,
    sys_hists: BTreeMap<usize, Hist>,
    last_calls: Vec<u64>,
    /// On-CPU time of stretches still open when a burst ended (close_open_stretches),
    /// per thread and split at the offload probes: added to every later snapshot.
    closed: BTreeMap<u32, u64>,
    closed_in: u64,
    closed_out: u64,
}

fn take<T: TryFrom<aya::maps::Map>>(bpf: &mut Ebpf, name: &str) -> Result<T, WatchError>
where
    T::Error: std::fmt::Display,
{
    let m = bpf
        .take_map(name)
        .ok_or_else(|| WatchError::BpfUnavailable(format!("the object lacks map {name}")))?;
    T::try_from(m).map_err(|e| WatchError::BpfUnavailable(format!("map {name}: {e}")))
}

/// Per-CPU array `name`, whose values are rows of `row` u64.
fn per_cpu(bpf: &mut Ebpf, name: &str, row: usize) -> Result<PerCpuRows, WatchError> {
    let m = bpf
        .take_map(name)
        .ok_or_else(|| WatchError::BpfUnavailable(format!("the object lacks map {name}")))?;
    PerCpuRows::new(m, row).map_err(|e| WatchError::BpfUnavailable(format!("map {name}: {e}")))
}

fn sum(v: &aya::maps::PerCpuValues<u64>) -> u64 {
    v.iter().sum()
}

impl Collector {
    pub fn new(bpf: &mut Ebpf) -> Result<Collector, WatchError> {
        Ok(Collector {
            counters: per_cpu(bpf, "COUNTERS", abi::N_COUNTERS as usize)?,
            syscalls: per_cpu(bpf, "SYSCALLS", abi::NR_MAX as usize * 2)?,
            sys_hist: per_cpu(bpf, "SYS_HIST", abi::SYS_BUCKETS as usize)?,
            fine: per_cpu(bpf, "FINE_HISTS", abi::FINE_BUCKETS as usize)?,
            spin_hist: per_cpu(bpf, "SPIN_HIST", abi::SPIN_BUCKETS as usize)?,
            threads: take(bpf, "THREADS")?,
            stacks: take(bpf, "STACKS")?,
            futex_stacks: take(bpf, "FUTEX_STACKS")?,
            futex_sites: take(bpf, "FUTEX_SITES")?,
            stack_frames: BTreeMap::new(),
            seen_threads: BTreeMap::new(),
            backend_threads: BTreeSet::new(),
            sys_hists: BTreeMap::new(),
            last_calls: vec![0; abi::NR_MAX as usize],
            closed: BTreeMap::new(),
            closed_in: 0,
            closed_out: 0,
        })
    }

    /// Books the on-CPU stretches open as a burst ends, up to now: the programs add a
    /// thread's stretch at its switch-out, and a thread that keeps its CPU past the
    /// end of a burst (a busy loop, an event loop under load) is switched out while
    /// they are off, so its time since its last switch-in (or, past a burst's start,
    /// its first event) would never count. Called once tracing is off (no stretch
    /// moves meanwhile); `epoch` is the burst's (an older epoch's stretch was cut by
    /// the reset that began this one).
    pub fn close_open_stretches(&mut self, epoch: u64) {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid out-pointer; CLOCK_MONOTONIC is bpf_ktime_get_ns's clock.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let now = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
        for (tid, t) in self.threads.iter().flatten() {
            if t.epoch != epoch || t.on_since == 0 || t.flags & abi::F_EXITED != 0 {
                continue;
            }
            let d = now.saturating_sub(t.on_since);
            *self.closed.entry(tid).or_default() += d;
            if t.offload_depth > 0 {
                self.closed_in += d;
            } else {
                self.closed_out += d;
            }
        }
    }

    /// Reads everything. `pids` are the watched processes (for their live thread
    /// count: every thread in the kernel's table belongs to one of them, or to one
    /// forked since); `layout` judges futex sites.
    pub fn snapshot(&mut self, t: f64, pids: &[u32], layout: &Layout) -> Snapshot {
        let mut counters = self.counters.sums(0, 1);
        for (i, d) in [
            (abi::C_ON_NS, self.closed_in + self.closed_out),
            (abi::C_ON_IN_NS, self.closed_in),
            (abi::C_ON_OUT_NS, self.closed_out),
        ] {
            counters[i as usize] += d;
        }
        let syscalls = self.syscalls.sums(0, 1);
        // Histograms only of syscalls called since the last read: the others are
        // unchanged, and reading all 512 rows every window would cost.
        for nr in 0..abi::NR_MAX as usize {
            let calls = syscalls[nr * 2];
            if calls != self.last_calls[nr] {
                self.last_calls[nr] = calls;
                let counts = self.sys_hist.sums(nr as u32, 1);
                self.sys_hists.insert(nr, Hist::log2(counts));
            }
        }
        let fine = self.fine.sums(0, abi::N_FINE_HISTS as usize);
        let row = |h: u32| {
            let b = abi::FINE_BUCKETS as usize;
            Hist::fine(fine[h as usize * b..(h as usize + 1) * b].to_vec())
        };
        let (stall, done, wake, outside) = (
            row(abi::H_STALL),
            row(abi::H_DONE),
            row(abi::H_WAKE),
            row(abi::H_OUTSIDE),
        );
        let spin_tenths = self.spin_hist.sums(0, 1);

        // Threads: record, then drop exited ones from the kernel map (their final
        // numbers stay here).
        let mut exited = Vec::new();
        for (tid, info) in self.threads.iter().flatten() {
            // A thread's name is read once, when first seen (a backend names its
            // threads before they run); one that exited first is not a backend's.
            if !self.seen_threads.contains_key(&tid)
                && std::fs::read_to_string(format!("/proc/{tid}/comm"))
                    .is_ok_and(|c| toffload_abi::threads::is_backend(&c))
            {
                self.backend_threads.insert(tid);
            }
            self.seen_threads.insert(tid, info);
            if info.flags & abi::F_EXITED != 0 {
                exited.push(tid);
            }
        }
        for tid in exited {
            let _ = self.threads.remove(&tid);
        }

        let sites: Vec<((u64, u64), u64)> = self
            .futex_sites
            .iter()
            .flatten()
            .map(|(k, v)| ((k.ip, k.caller), sum(&v)))
            .collect();
        let mut stacks: Vec<(u64, u32)> = self
            .futex_stacks
            .iter()
            .flatten()
            .map(|(k, v)| (sum(&v), k))
            .collect();
        stacks.sort_unstable_by(|a, b| b.cmp(a));
        let mut futex_stacks = Vec::new();
        for &(calls, id) in stacks.iter().take(5) {
            let frames = self.stack_frames.entry(id).or_insert_with(|| {
                self.stacks
                    .get(&id, 0)
                    .map(|s| s.frames().iter().map(|f| f.ip).collect())
                    .unwrap_or_default()
            });
            futex_stacks.push((calls, frames.clone()));
        }
        let futex = futex::attribute(
            layout,
            &sites,
            counters[abi::C_FUTEX_IN_OFFLOAD as usize],
            counters[abi::C_FUTEX_NOSTACK as usize],
        );
        let live_threads = pids
            .iter()
            .filter_map(|&p| crate::target::thread_count(p))
            .sum();
        Snapshot {
            t,
            // The caller's clock (session.rs) sets these.
            wall: 0.0,
            unix: 0.0,
            counters,
            syscalls,
            sys_hists: self.sys_hists.clone(),
            stall,
            done,
            outside,
            spin_tenths,
            wake,
            futex,
            threads: self
                .seen_threads
                .iter()
                .map(|(&tid, t)| {
                    let mut t = *t;
                    t.on_ns += self.closed.get(&tid).copied().unwrap_or(0);
                    (tid, t)
                })
                .collect(),
            backend_threads: self.backend_threads.clone(),
            live_threads,
            futex_stacks,
            // The kernel's side only; the session adds the runtime's counters.
            runtime: None,
            runtime_latency: None,
            procs: BTreeMap::new(),
        }
    }
}
