//! Reads the kernel's maps into a cumulative Snapshot: counters and histograms summed
//! over CPUs, per-thread records, futex origins. Windows are differences of two.

use super::percpu::PerCpuU64;
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
    /// Each request's on-CPU time outside the offload (OUTSIDE_HIST).
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
            spin_tenths: vec![0; 11],
            wake: Hist::fine(vec![0; abi::FINE_BUCKETS as usize]),
            ..Default::default()
        }
    }
}

pub struct Collector {
    counters: PerCpuU64,
    syscalls: PerCpuU64,
    sys_hist: PerCpuU64,
    stall: PerCpuU64,
    done: PerCpuU64,
    outside: PerCpuU64,
    spin_hist: PerCpuU64,
    wake: PerCpuU64,
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

fn per_cpu(bpf: &mut Ebpf, name: &str) -> Result<PerCpuU64, WatchError> {
    let m = bpf
        .take_map(name)
        .ok_or_else(|| WatchError::BpfUnavailable(format!("the object lacks map {name}")))?;
    PerCpuU64::new(m).map_err(|e| WatchError::BpfUnavailable(format!("map {name}: {e}")))
}

fn sum(v: &aya::maps::PerCpuValues<u64>) -> u64 {
    v.iter().sum()
}

impl Collector {
    pub fn new(bpf: &mut Ebpf) -> Result<Collector, WatchError> {
        Ok(Collector {
            counters: per_cpu(bpf, "COUNTERS")?,
            syscalls: per_cpu(bpf, "SYSCALLS")?,
            sys_hist: per_cpu(bpf, "SYS_HIST")?,
            stall: per_cpu(bpf, "STALL_HIST")?,
            done: per_cpu(bpf, "DONE_HIST")?,
            outside: per_cpu(bpf, "OUTSIDE_HIST")?,
            spin_hist: per_cpu(bpf, "SPIN_HIST")?,
            wake: per_cpu(bpf, "WAKE_HIST")?,
            threads: take(bpf, "THREADS")?,
            stacks: take(bpf, "STACKS")?,
            futex_stacks: take(bpf, "FUTEX_STACKS")?,
            futex_sites: take(bpf, "FUTEX_SITES")?,
            stack_frames: BTreeMap::new(),
            seen_threads: BTreeMap::new(),
            backend_threads: BTreeSet::new(),
            sys_hists: BTreeMap::new(),
            last_calls: vec![0; abi::NR_MAX as usize],
        })
    }

    fn array(map: &PerCpuU64, n: usize) -> Vec<u64> {
        map.sums(0, n)
    }

    /// Reads everything. `pids` are the watched processes (for their live thread
    /// count: every thread in the kernel's table belongs to one of them, or to one
    /// forked since); `layout` judges futex sites.
    pub fn snapshot(&mut self, t: f64, pids: &[u32], layout: &Layout) -> Snapshot {
        let counters = Self::array(&self.counters, abi::N_COUNTERS as usize);
        let syscalls = Self::array(&self.syscalls, abi::NR_MAX as usize * 2);
        // Histograms only of syscalls called since the last read: the others are
        // unchanged, and reading all 32768 buckets every window would cost.
        for nr in 0..abi::NR_MAX as usize {
            let calls = syscalls[nr * 2];
            if calls != self.last_calls[nr] {
                self.last_calls[nr] = calls;
                let base = (nr * abi::SYS_BUCKETS as usize) as u32;
                let counts = self.sys_hist.sums(base, abi::SYS_BUCKETS as usize);
                self.sys_hists.insert(nr, Hist::log2(counts));
            }
        }
        let stall = Hist::fine(Self::array(&self.stall, abi::FINE_BUCKETS as usize));
        let done = Hist::fine(Self::array(&self.done, abi::FINE_BUCKETS as usize));
        let outside = Hist::fine(Self::array(&self.outside, abi::FINE_BUCKETS as usize));
        let spin_tenths = Self::array(&self.spin_hist, 11);
        let wake = Hist::fine(Self::array(&self.wake, abi::FINE_BUCKETS as usize));

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
            threads: self.seen_threads.clone(),
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
