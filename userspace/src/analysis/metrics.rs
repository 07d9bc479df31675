//! One window's metrics: the difference of two snapshots, turned into rates,
//! percentiles and per-request figures, plus the verdict on them.

use crate::abi;
use crate::classifier::{self, Evidence, Verdict};
use crate::collector::Snapshot;
use crate::futex::Origins;
use crate::processes;
use crate::syscalls;
use crate::target::Runtime;
use serde::Serialize;
use toffload_abi::runtime::RuntimeState;

/// What does not change between windows.
#[derive(Clone, Debug)]
pub struct Context {
    pub runtime: Runtime,
    /// An offload entry point is probed: requests are offload calls.
    pub offload_probed: bool,
    /// The process the watch is about first (processes.rs Role::Main).
    pub root: u32,
    /// The user's offload symbols probed without a non-blocking triple.
    pub unroutable: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Offload {
    pub calls: u64,
    pub stall_p50_us: Option<f64>,
    pub stall_p99_us: Option<f64>,
    pub stall_mean_us: Option<f64>,
    /// Share of the stall time the waiting thread was on CPU (spinning).
    pub spin_share: Option<f64>,
    /// Share of stalls spent at least 90% on CPU (spun), and at most 10% (blocked).
    pub stalls_mostly_spinning: Option<f64>,
    pub stalls_mostly_blocked: Option<f64>,
    /// The stall without its wake-up-to-run delay: when the completion reached the
    /// thread (the device's latency as the thread sees it).
    pub latency_p50_us: Option<f64>,
    pub latency_p99_us: Option<f64>,
    /// Share of the stall spent runnable but not yet running after the wake-up.
    pub wake_share: Option<f64>,
    /// The stall's histogram regrouped by powers of two: (upper bound us, count).
    pub stall_hist_us: Vec<(f64, u64)>,
    /// The fastest stalls (1st percentile): a spinning wait that other threads keep
    /// off the CPU stalls far longer than the device takes; its quickest stalls, those
    /// that kept the CPU, show the device's own latency.
    pub stall_p1_us: Option<f64>,
    /// Sleeps (voluntary switches) per offload call: about one for a blocking wait,
    /// none for a spinning one, however long it is preempted.
    pub sleeps_per_call: Option<f64>,
    /// On-CPU time of a syscall that slept inside an offload call (a blocking wait's
    /// futex), us each: the sleep's own cost, the call, the switch out and back in,
    /// without the submit around it.
    pub slept_syscall_us: Option<f64>,
}

/// The distribution of a request's on-CPU time outside the offload, us. Its low end
/// is the request run on warm caches; a thread that comes back to a core other
/// threads have used pays more, and the mean shows both.
#[derive(Clone, Debug, Serialize)]
pub struct OutsideCpu {
    pub requests: u64,
    pub mean_us: f64,
    pub p10_us: f64,
    pub p25_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
}

impl OutsideCpu {
    fn from(h: &crate::hist::Hist) -> Option<OutsideCpu> {
        let q = |p: f64| h.quantile(p).map(|ns| ns / 1e3);
        Some(OutsideCpu {
            requests: h.total(),
            mean_us: h.mean()? / 1e3,
            p10_us: q(0.10)?,
            p25_us: q(0.25)?,
            p50_us: q(0.50)?,
            p90_us: q(0.90)?,
        })
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct PerRequest<T> {
    pub libc: T,
    pub raw: T,
    pub offload: T,
    pub unknown: T,
}

#[derive(Clone, Debug, Serialize)]
pub struct Switches {
    pub voluntary: u64,
    pub involuntary: u64,
    pub voluntary_per_sec: f64,
    pub involuntary_per_sec: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct SyscallRow {
    pub name: String,
    pub calls: u64,
    pub per_sec: f64,
    pub mean_us: f64,
    pub p99_us: Option<f64>,
}

/// What a window counts as a request (in JSON the words shown).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum RequestSource {
    /// The injected runtime's offloads (its uprobes no longer fire).
    #[serde(rename = "runtime offloads")]
    RuntimeOffloads,
    /// Calls of the probed offload function.
    #[serde(rename = "offload calls")]
    OffloadCalls,
    /// Reads on sockets (no offload probed).
    #[serde(rename = "socket reads")]
    SocketReads,
}

impl std::fmt::Display for RequestSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RequestSource::RuntimeOffloads => "runtime offloads",
            RequestSource::OffloadCalls => "offload calls",
            RequestSource::SocketReads => "socket reads",
        })
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Window {
    /// Traced seconds since the watch began at the window's start, and the traced
    /// seconds in it: every count and rate below is over these (the runtime's
    /// counters too), whatever share of the interval was traced.
    pub start_s: f64,
    pub secs: f64,
    /// The wall-clock seconds the window spans, and the Unix time at its end: where
    /// another count (a load generator's, a server's own) over the same seconds is
    /// read from.
    pub wall_secs: f64,
    pub ts: f64,
    pub requests: u64,
    pub requests_per_sec: f64,
    /// "offload calls" or "socket reads".
    pub request_source: RequestSource,
    pub offload: Offload,
    /// On-CPU time per request, excluding the on-CPU part of the offload stall.
    pub cpu_per_request_us: Option<f64>,
    /// All the on-CPU time per request, the stall's included: for a blocking wait
    /// that part is the submit and the blocking itself (futex calls, the switch out
    /// and back), which the model needs whole.
    pub on_cpu_per_request_us: Option<f64>,
    pub on_cpu_ms: f64,
    /// On-CPU time of the target's threads that made no offload call in the window
    /// (a device's engine, an acceptor): a cost per second, not per request.
    pub helper_on_cpu_ms: f64,
    /// The part of it spent by a toffload backend's own threads (the emulated
    /// device's engine, the remote client's I/O): work per offload, not per second.
    pub backend_on_cpu_ms: f64,
    /// Those threads' syscalls and context switches, and the offload threads'
    /// syscalls: the events the watch's cost to each is counted from.
    pub backend_syscalls: u64,
    pub backend_switches: u64,
    pub offload_thread_syscalls: u64,
    /// Each request's on-CPU time outside the offload, from one offload's return to
    /// the thread's next call, as a distribution (None before any was closed).
    pub outside_cpu: Option<OutsideCpu>,
    /// On-CPU time of a syscall that slept outside the offload (a read waiting for
    /// the next request), us per such call: the call, the switch out and back in.
    pub slept_syscall_us: Option<f64>,
    pub slept_syscalls_per_request: Option<f64>,
    /// Per request, how long its thread's syscalls outside the offload slept before
    /// their wake-up (the read waiting for the next request), us: the time the request
    /// spent outside the server (the client, the network; Z), the server's own
    /// wake-up delay left out.
    pub outside_wait_us: Option<f64>,
    /// Per request, wake-ups the target made of tasks outside it (its clients, when
    /// local) that last ran on another CPU, and those that found that CPU idle.
    pub peer_wakes_per_request: Option<f64>,
    pub peer_idle_wakes_per_request: Option<f64>,
    /// Share of the target's cores' time the hypervisor gave other guests in the
    /// window (steal.rs; set by the session).
    pub steal_share: Option<f64>,
    pub futex: Origins,
    pub futex_per_request: Option<PerRequest<f64>>,
    pub switches: Switches,
    pub wakeups: u64,
    pub wakeup_p50_us: Option<f64>,
    pub wakeup_p99_us: Option<f64>,
    pub syscalls_top: Vec<SyscallRow>,
    /// All syscalls of the window (the uretprobe trampoline's, which are the
    /// watcher's own, left out here as in the profile).
    pub syscalls: u64,
    /// Syscalls of every other process on the host while tracing (the hooks' cost to
    /// them is part of the watch's: WatcherCost::host_share).
    pub host_syscalls: u64,
    pub threads: usize,
    pub threads_created: u64,
    pub accepts: u64,
    pub threads_per_accept: Option<f64>,
    /// Threads that made offload calls in the window: the connections served at once.
    pub offload_threads: usize,
    /// Voluntary context switches per request of those threads: what blocking costs
    /// them (the model takes it out of the fibers' per-request CPU).
    pub blocking_switches_per_request: Option<f64>,
    /// Involuntary switches per offload call of those threads (preempted by each
    /// other: fibers on one carrier are not).
    pub preemptions_per_request: Option<f64>,
    /// On-CPU time inside the offload calls per sleep in them, us: for a blocking
    /// wait, what one sleep and wake-up costs this server (its futex calls, the
    /// switch out and back, with its threads' cold caches), the submit included.
    pub sleep_cost_us: Option<f64>,
    pub io_uring_enters: u64,
    pub io_uring_setups: u64,
    pub mux_waits: u64,
    /// The service's processes, one row each (processes.rs).
    pub processes: Vec<processes::ProcessRow>,
    /// Threads the kernel's thread table had no room for (their scheduler numbers
    /// are missing; non-zero only past 16384 live threads).
    pub threads_missed: u64,
    pub verdict: Verdict,
    /// The fiber runtime's own counters, when the target runs under libtoffload.so
    /// (fibers, offloads, the conflict guard's faults, conflicts and waits).
    pub runtime_counters: Option<crate::runtime_counters::RuntimeCounters>,
    /// The runtime's request latency and offload wait percentiles over the window
    /// (its wall time, traced or not), when its counters carry latency histograms.
    pub runtime_latency: Option<crate::runtime_counters::LatencySummary>,
    /// The model's prediction from this window (stock servers; see model/).
    pub model: Option<crate::model::Assessment>,
    /// After an injection: before/after throughput next to the prediction.
    pub injection: Option<crate::inject_flow::InjectionStatus>,
    /// What watching cost the target in this window, and how much of it was traced.
    pub watcher: Option<WatcherCost>,
    /// The target while the probes were off (sampled windows): its rate and CPU per
    /// request without the watch's cost (untraced.rs).
    pub untraced: Option<crate::untraced::Untraced>,
}

/// The watch's own cost (probe_cost.rs).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct WatcherCost {
    /// Microseconds the programs added to each request while tracing: the larger of
    /// the calibrated and the measured cost (`basis` says which).
    pub us_per_request: Option<f64>,
    /// Their share of the target's on-CPU time while tracing (at us_per_request).
    pub share_traced: f64,
    /// The cost per request the calibration predicts: its per-event costs times the
    /// window's events. Measured in a tight loop, it can fall short of what the same
    /// programs cost inside a real server (colder caches, longer kernel paths).
    pub calibrated_us_per_request: Option<f64>,
    /// The cost per request measured on the target itself: its CPU per request while
    /// traced (the probes' on-CPU time) less its CPU per request while untraced (/proc,
    /// the same window), the median of the last few windows that had both (None: none
    /// had, e.g. an unsampled watch).
    pub measured_us_per_request: Option<f64>,
    /// Which of the two us_per_request and share_traced are.
    pub basis: CostBasis,
    /// What the syscall hooks cost the host's other processes while tracing (their
    /// syscalls pay the hooks' entry and filter), as a share of the target's on-CPU
    /// time: the budget pays it beside share_traced.
    pub host_share: f64,
    /// The last burst's attach and detach (the watcher's CPU for them) as a share of
    /// the target's CPU over an interval: what each sampled interval pays besides the
    /// events (0 before any burst).
    pub burst_share: f64,
    /// Share of the next interval that will be traced.
    pub duty: f64,
    /// The budget the duty keeps the average share under (None: fixed --sample).
    pub budget: Option<f64>,
}

impl WatcherCost {
    /// What the budget charges for a traced second, as a share of the target's CPU:
    /// its own cost, and the neighbours' up to as much again (session::watch_cost).
    pub fn charged_share(share_traced: f64, host_share: f64) -> f64 {
        share_traced + host_share.min(share_traced)
    }

    /// What the next interval costs at this duty, the burst's attach and detach
    /// included: the sum the duty is set to keep under the budget.
    pub fn interval_share(&self) -> f64 {
        Self::charged_share(self.share_traced, self.host_share) * self.duty + self.burst_share
    }
}

/// Where the watch's cost per request comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CostBasis {
    /// The calibration's per-event costs (nothing measured, or the measurement lower).
    Calibrated,
    /// The target's traced less untraced CPU per request, above the calibration's.
    Measured,
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn nr(name: &str) -> usize {
    syscalls::number(name).unwrap_or(usize::MAX)
}

fn calls(s: &Snapshot, p: &Snapshot, names: &[&str]) -> u64 {
    names
        .iter()
        .map(|n| s.calls(nr(n)).saturating_sub(p.calls(nr(n))))
        .sum()
}

const SOCKET_READS: &[&str] = &["read", "readv", "recvfrom", "recvmsg", "recvmmsg"];
const ACCEPTS: &[&str] = &["accept", "accept4"];
const MUX_WAITS: &[&str] = &[
    "epoll_wait",
    "epoll_pwait",
    "epoll_pwait2",
    "poll",
    "ppoll",
    "select",
    "pselect6",
];

/// The share of stalls whose on-CPU tenth is in `range`.
fn share_of(tenths: &[u64], range: std::ops::RangeInclusive<usize>) -> Option<f64> {
    let total: u64 = tenths.iter().sum();
    (total > 0).then(|| tenths[range].iter().sum::<u64>() as f64 / total as f64)
}

/// The runtime's own account of the window, when it is loaded and active.
fn fiber_runtime(prev: &Snapshot, cur: &Snapshot, secs: f64) -> Option<classifier::FiberRuntime> {
    let c = cur.runtime.filter(|c| c.state == RuntimeState::Active)?;
    let d = match prev.runtime {
        Some(p) => c.events_minus(&p),
        None => c,
    };
    Some(classifier::FiberRuntime {
        fibers_live: c.fibers_live,
        carriers: c.carriers,
        offloads_per_sec: d.offloads as f64 / secs,
        parked_per_sec: d.offloads_parked as f64 / secs,
        io_parks_per_sec: d.io_parks as f64 / secs,
    })
}

/// The two snapshots a window is the difference of, and the traced seconds between.
struct Delta<'a> {
    prev: &'a Snapshot,
    cur: &'a Snapshot,
    secs: f64,
}

impl Delta<'_> {
    /// Counter `i` (a C_* index of toffload-abi) over the window.
    fn d(&self, i: u32) -> u64 {
        self.cur.counter(i).saturating_sub(self.prev.counter(i))
    }

    /// Calls of the named syscalls over the window.
    fn calls(&self, names: &[&str]) -> u64 {
        calls(self.cur, self.prev, names)
    }
}

/// `v` per request (None without requests).
fn per_request(v: f64, requests: u64) -> Option<f64> {
    (requests > 0).then(|| v / requests as f64)
}

/// What the window counts: its requests, and the calls the verdict weighs.
struct Counts {
    requests: u64,
    request_source: RequestSource,
    offload_calls: u64,
    runtime_offloads: u64,
    accepts: u64,
    threads_created: u64,
    io_uring_enters: u64,
    mux_waits: u64,
}

fn counts(d: &Delta, ctx: &Context) -> Counts {
    let (prev, cur) = (d.prev, d.cur);
    let offload_calls = d.d(abi::C_OFFLOAD_CALLS);
    // Under libtoffload.so the offloads go through the runtime, which the uprobes do
    // not time: its own counters count them (from zero when `prev` had none).
    let runtime_offloads = cur
        .runtime
        .map(|c| {
            c.offloads
                .saturating_sub(prev.runtime.map_or(0, |p| p.offloads))
        })
        .unwrap_or(0);
    let (requests, request_source) = if offload_calls == 0 && runtime_offloads > 0 {
        (runtime_offloads, RequestSource::RuntimeOffloads)
    } else if ctx.offload_probed {
        (offload_calls, RequestSource::OffloadCalls)
    } else {
        (d.calls(SOCKET_READS), RequestSource::SocketReads)
    };
    Counts {
        requests,
        request_source,
        offload_calls,
        runtime_offloads,
        accepts: d.calls(ACCEPTS),
        threads_created: d.d(abi::C_THREADS_CREATED),
        io_uring_enters: d.calls(&["io_uring_enter"]),
        mux_waits: d.calls(MUX_WAITS),
    }
}

/// The stalls' on-CPU (spinning) part, ns.
fn spin_ns(d: &Delta) -> u64 {
    let stall_ns = d.d(abi::C_OFFLOAD_NS);
    stall_ns - d.d(abi::C_OFFLOAD_OFF_NS).min(stall_ns)
}

/// The offload calls' stalls: their distribution, and how they spun or slept.
fn offload(d: &Delta) -> Offload {
    let (prev, cur) = (d.prev, d.cur);
    let offload_calls = d.d(abi::C_OFFLOAD_CALLS);
    let stall = cur.stall.minus(&prev.stall);
    let tenths: Vec<u64> = (0..11)
        .map(|i| {
            let c = cur.spin_tenths.get(i).copied().unwrap_or(0);
            c.saturating_sub(prev.spin_tenths.get(i).copied().unwrap_or(0))
        })
        .collect();
    let done = cur.done.minus(&prev.done);
    let stall_ns = d.d(abi::C_OFFLOAD_NS);
    let spin_ns = spin_ns(d);
    Offload {
        calls: offload_calls,
        stall_p50_us: stall.quantile(0.5).map(|v| v / 1e3),
        stall_p99_us: stall.quantile(0.99).map(|v| v / 1e3),
        stall_mean_us: (offload_calls > 0).then(|| stall_ns as f64 / offload_calls as f64 / 1e3),
        spin_share: (stall_ns > 0).then(|| spin_ns as f64 / stall_ns as f64),
        stalls_mostly_spinning: share_of(&tenths, 9..=10),
        stalls_mostly_blocked: share_of(&tenths, 0..=1),
        latency_p50_us: done.quantile(0.5).map(|v| v / 1e3),
        latency_p99_us: done.quantile(0.99).map(|v| v / 1e3),
        wake_share: (stall_ns > 0)
            .then(|| d.d(abi::C_OFFLOAD_WAKE_NS).min(stall_ns) as f64 / stall_ns as f64),
        stall_hist_us: stall
            .log2_buckets()
            .into_iter()
            .map(|(ns, c)| (ns / 1e3, c))
            .collect(),
        stall_p1_us: stall.quantile(0.01).map(|v| v / 1e3),
        sleeps_per_call: (offload_calls > 0)
            .then(|| d.d(abi::C_OFFLOAD_SLEEPS) as f64 / offload_calls as f64),
        slept_syscall_us: (d.d(abi::C_SLEPT_IN_SYSCALLS) > 0).then(|| {
            d.d(abi::C_SLEPT_IN_SYSCALL_ON_NS) as f64 / d.d(abi::C_SLEPT_IN_SYSCALLS) as f64 / 1e3
        }),
    }
}

/// The threads of the window split by whether they waited on the offload.
#[derive(Default)]
struct ThreadSplit {
    /// Threads that made offload calls, and their voluntary and involuntary switches.
    offload_threads: usize,
    vol: u64,
    invol: u64,
    /// On-CPU time of the others (helpers), ns.
    helper_on_ns: u64,
    /// The helpers' that are a toffload backend's threads, ns, with their syscalls
    /// and switches.
    backend_on_ns: u64,
    backend_syscalls: u64,
    backend_switches: u64,
    /// Syscalls of the threads that made offload calls.
    offload_syscalls: u64,
}

fn thread_split(d: &Delta) -> ThreadSplit {
    let mut s = ThreadSplit::default();
    for (tid, t) in &d.cur.threads {
        let before = d.prev.threads.get(tid);
        let calls = t
            .offload_calls
            .saturating_sub(before.map_or(0, |b| b.offload_calls));
        let syscalls = t.syscalls.saturating_sub(before.map_or(0, |b| b.syscalls));
        if calls > 0 {
            s.offload_threads += 1;
            s.offload_syscalls += syscalls;
            s.vol += t.vol.saturating_sub(before.map_or(0, |b| b.vol));
            s.invol += t.invol.saturating_sub(before.map_or(0, |b| b.invol));
        } else {
            let on = t.on_ns.saturating_sub(before.map_or(0, |b| b.on_ns));
            s.helper_on_ns += on;
            if d.cur.backend_threads.contains(tid) {
                s.backend_on_ns += on;
                s.backend_syscalls += syscalls;
                s.backend_switches +=
                    (t.vol + t.invol).saturating_sub(before.map_or(0, |b| b.vol + b.invol));
            }
        }
    }
    s
}

fn futex_per_request(futex: &Origins, requests: u64) -> Option<PerRequest<f64>> {
    (requests > 0).then(|| {
        let r = requests as f64;
        PerRequest {
            libc: futex.libc as f64 / r,
            raw: futex.raw as f64 / r,
            offload: futex.offload as f64 / r,
            unknown: futex.unknown as f64 / r,
        }
    })
}

/// The ten busiest syscalls, and the count of all (the uretprobe trampoline's left
/// out).
fn syscall_rows(d: &Delta) -> (Vec<SyscallRow>, u64) {
    let (prev, cur) = (d.prev, d.cur);
    let mut total = 0;
    let mut rows: Vec<SyscallRow> = (0..abi::NR_MAX as usize)
        .filter_map(|n| {
            let c = cur.calls(n).saturating_sub(prev.calls(n));
            if c == 0 || n == syscalls::URETPROBE {
                return None;
            }
            total += c;
            let ns = cur.sys_ns(n).saturating_sub(prev.sys_ns(n));
            let p99 = cur
                .sys_hists
                .get(&n)
                .and_then(|h| match prev.sys_hists.get(&n) {
                    Some(ph) => h.minus(ph).quantile(0.99),
                    None => h.quantile(0.99),
                });
            Some(SyscallRow {
                name: syscalls::name(n)
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("syscall_{n}")),
                calls: c,
                per_sec: c as f64 / d.secs,
                mean_us: ns as f64 / c as f64 / 1e3,
                p99_us: p99.map(|v| v / 1e3),
            })
        })
        .collect();
    rows.sort_by(|a, b| b.calls.cmp(&a.calls).then(a.name.cmp(&b.name)));
    rows.truncate(10);
    (rows, total)
}

/// On-CPU time per request outside the offload calls, as the kernel split it at the
/// probes; an object without the split (0 both sides) falls back to all but the
/// stalls' on-CPU part.
fn cpu_per_request_us(d: &Delta, requests: u64) -> Option<f64> {
    let (on_in, on_out) = (d.d(abi::C_ON_IN_NS), d.d(abi::C_ON_OUT_NS));
    if on_in + on_out > 0 {
        per_request(on_out as f64 / 1e3, requests)
    } else {
        per_request(
            d.d(abi::C_ON_NS).saturating_sub(spin_ns(d)) as f64 / 1e3,
            requests,
        )
    }
}

/// On-CPU time inside the offload calls per sleep in them, us: per sleep, or per call
/// where fewer calls slept than were made (a short offload often completes before the
/// thread sleeps; its futex calls and retries cost the same, and are not a sleep's).
fn sleep_cost_us(d: &Delta) -> Option<f64> {
    let on_in = d.d(abi::C_ON_IN_NS);
    let sleeps = d.d(abi::C_OFFLOAD_SLEEPS);
    (sleeps > 0 && on_in > 0)
        .then(|| on_in as f64 / sleeps.max(d.d(abi::C_OFFLOAD_CALLS)) as f64 / 1e3)
}

fn switches(d: &Delta) -> Switches {
    let (vol, invol) = (d.d(abi::C_VOL), d.d(abi::C_INVOL));
    Switches {
        voluntary: vol,
        involuntary: invol,
        voluntary_per_sec: vol as f64 / d.secs,
        involuntary_per_sec: invol as f64 / d.secs,
    }
}

/// What the classifier weighs, from the window's numbers.
fn evidence(
    d: &Delta,
    ctx: &Context,
    n: &Counts,
    offload: &Offload,
    cpu_per_request_us: Option<f64>,
    futex: &Origins,
    processes: &[processes::ProcessRow],
) -> Evidence {
    Evidence {
        shape: processes::shape(processes),
        runtime: Some(ctx.runtime.kind),
        dynamic: ctx.runtime.dynamic,
        requests: n.requests,
        offload_calls: n.offload_calls.max(n.runtime_offloads),
        // The stall without its wake-up delay: on a saturated CPU a woken thread waits
        // for a core, which is CPU contention, not the offload.
        stall_p50_us: offload.latency_p50_us.or(offload.stall_p50_us),
        cpu_per_request_us,
        raw_futex: futex.raw,
        libc_futex: futex.libc,
        io_uring_enters: n.io_uring_enters,
        accepts: n.accepts,
        threads_created: n.threads_created,
        mux_waits: n.mux_waits,
        threads: d.cur.live_threads,
        fiber_runtime: fiber_runtime(d.prev, d.cur, d.secs),
    }
}

/// The classifier's verdict, with the offloads it cannot reroute said.
fn verdict(evidence: &Evidence, ctx: &Context) -> Verdict {
    let mut v = classifier::classify(evidence);
    if !ctx.unroutable.is_empty() && v.kind == classifier::Kind::Fiberizable {
        v.because.push_str(&format!(
            "; but the offload {} is measured, not reroutable (no SUBMIT:DONE:RELEASE \
             given): injected, it would still block",
            ctx.unroutable.join(", ")
        ));
    }
    v
}

pub fn window(prev: &Snapshot, cur: &Snapshot, ctx: &Context) -> Window {
    let d = Delta {
        prev,
        cur,
        secs: (cur.t - prev.t).max(1e-9),
    };
    let n = counts(&d, ctx);
    let offload = offload(&d);
    let threads = thread_split(&d);
    let futex = cur.futex.minus(&prev.futex);
    let (syscalls_top, syscalls) = syscall_rows(&d);
    let cpu_per_request_us = cpu_per_request_us(&d, n.requests);
    let processes = processes::rows(&prev.threads, &cur.threads, &cur.procs, ctx.root, d.secs);
    let evidence = evidence(
        &d,
        ctx,
        &n,
        &offload,
        cpu_per_request_us,
        &futex,
        &processes,
    );
    let futex_per_request = futex_per_request(&futex, n.requests);
    let wake = cur.wake.minus(&prev.wake);
    let on_ns = d.d(abi::C_ON_NS);
    let per_req = |v: f64| per_request(v, n.requests);
    let per_call = |v: u64| (n.offload_calls > 0).then(|| v as f64 / n.offload_calls as f64);
    let slept = d.d(abi::C_SLEPT_SYSCALLS);
    Window {
        start_s: prev.t,
        secs: d.secs,
        wall_secs: cur.wall - prev.wall,
        ts: cur.unix,
        requests: n.requests,
        requests_per_sec: n.requests as f64 / d.secs,
        request_source: n.request_source,
        offload,
        cpu_per_request_us,
        on_cpu_per_request_us: per_req(on_ns as f64 / 1e3),
        on_cpu_ms: on_ns as f64 / 1e6,
        helper_on_cpu_ms: threads.helper_on_ns as f64 / 1e6,
        backend_on_cpu_ms: threads.backend_on_ns as f64 / 1e6,
        backend_syscalls: threads.backend_syscalls,
        backend_switches: threads.backend_switches,
        offload_thread_syscalls: threads.offload_syscalls,
        outside_cpu: OutsideCpu::from(&cur.outside.minus(&prev.outside)),
        slept_syscall_us: (slept > 0)
            .then(|| d.d(abi::C_SLEPT_SYSCALL_ON_NS) as f64 / slept as f64 / 1e3),
        slept_syscalls_per_request: per_req(slept as f64),
        outside_wait_us: per_req(d.d(abi::C_SLEPT_SYSCALL_BLOCKED_NS) as f64 / 1e3),
        peer_wakes_per_request: per_req(d.d(abi::C_PEER_WAKES) as f64),
        peer_idle_wakes_per_request: per_req(d.d(abi::C_PEER_IDLE_WAKES) as f64),
        steal_share: None,
        futex,
        futex_per_request,
        switches: switches(&d),
        wakeups: d.d(abi::C_WAKEUPS),
        wakeup_p50_us: wake.quantile(0.5).map(|v| v / 1e3),
        wakeup_p99_us: wake.quantile(0.99).map(|v| v / 1e3),
        syscalls_top,
        syscalls,
        host_syscalls: d.d(abi::C_HOST_SYSCALLS),
        threads: cur.live_threads,
        threads_created: n.threads_created,
        accepts: n.accepts,
        threads_per_accept: (n.accepts > 0).then(|| n.threads_created as f64 / n.accepts as f64),
        offload_threads: threads.offload_threads,
        blocking_switches_per_request: per_call(threads.vol),
        preemptions_per_request: per_call(threads.invol),
        sleep_cost_us: sleep_cost_us(&d),
        io_uring_enters: n.io_uring_enters,
        io_uring_setups: d.calls(&["io_uring_setup"]),
        mux_waits: n.mux_waits,
        processes,
        threads_missed: d.d(abi::C_THREADS_MISSED),
        verdict: verdict(&evidence, ctx),
        runtime_counters: cur.runtime,
        runtime_latency: cur.runtime_latency.as_ref().map(|c| {
            match &prev.runtime_latency {
                Some(p) => c.minus(p),
                None => c.clone(),
            }
            .summary()
        }),
        model: None,
        injection: None,
        watcher: None,
        untraced: None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::target::RuntimeKind;

    pub(crate) fn ctx() -> Context {
        Context {
            runtime: Runtime {
                kind: RuntimeKind::GlibcDynamic,
                dynamic: true,
                evidence: String::new(),
            },
            offload_probed: true,
            root: 1,
            unroutable: Vec::new(),
        }
    }

    #[test]
    fn synthetic_window() {
        let prev = Snapshot::zero();
        let mut cur = Snapshot::zero();
        cur.t = 2.0;
        cur.counters[abi::C_OFFLOAD_CALLS as usize] = 1000;
        cur.counters[abi::C_OFFLOAD_NS as usize] = 1000 * 200_000;
        cur.counters[abi::C_OFFLOAD_OFF_NS as usize] = 1000 * 150_000;
        cur.counters[abi::C_ON_NS as usize] = 1000 * (50_000 + 10_000);
        cur.counters[abi::C_VOL as usize] = 1000;
        cur.counters[abi::C_THREADS_CREATED as usize] = 8;
        cur.stall.counts[abi::fine_bucket(200_000) as usize] = 1000;
        cur.spin_tenths[2] = 750;
        cur.spin_tenths[10] = 250;
        let acc = syscalls::number("accept").unwrap();
        cur.syscalls[acc * 2] = 8;
        cur.syscalls[acc * 2 + 1] = 8_000;
        cur.live_threads = 10;
        let w = window(&prev, &cur, &ctx());
        assert_eq!(w.requests, 1000);
        assert_eq!(w.requests_per_sec, 500.0);
        let p50 = w.offload.stall_p50_us.unwrap();
        assert!((p50 - 200.0).abs() < 200.0 * 0.07, "{p50}");
        assert!((w.offload.spin_share.unwrap() - 0.25).abs() < 1e-9);
        assert_eq!(w.offload.stalls_mostly_spinning, Some(0.25));
        assert_eq!(w.offload.stalls_mostly_blocked, Some(0.0));
        // 60 us on CPU per request, 50 of them spinning in the stall.
        assert!((w.cpu_per_request_us.unwrap() - 10.0).abs() < 1e-9);
        assert_eq!(w.threads_per_accept, Some(1.0));
        assert_eq!(w.syscalls_top[0].name, "accept");
        assert!((w.syscalls_top[0].mean_us - 1.0).abs() < 1e-9);
        assert_eq!(w.switches.voluntary_per_sec, 500.0);
        assert_eq!(w.verdict.kind, crate::classifier::Kind::Fiberizable);
    }

    /// Threads that made no offload call in the window are helpers: their on-CPU time
    /// is counted apart (the model takes it out of a spinning server's c).
    #[test]
    fn helper_threads_are_counted_apart() {
        let t = |on_ns, offload_calls| abi::ThreadInfo {
            on_ns,
            offload_calls,
            ..Default::default()
        };
        let mut prev = Snapshot::zero();
        prev.threads.insert(1, t(1_000_000, 5));
        prev.threads.insert(2, t(1_000_000, 0));
        let mut cur = Snapshot::zero();
        cur.t = 1.0;
        cur.counters[abi::C_OFFLOAD_CALLS as usize] = 10;
        // Thread 1 calls the offload; 2 (old) and 3 (new) do not.
        cur.threads.insert(1, t(9_000_000, 15));
        cur.threads.insert(2, t(4_000_000, 0));
        cur.threads.insert(3, t(2_000_000, 0));
        // Thread 3 is the backend's engine: 4 syscalls and 2 switches so far.
        cur.threads.get_mut(&3).unwrap().syscalls = 4;
        cur.threads.get_mut(&3).unwrap().vol = 2;
        cur.backend_threads.insert(3);
        let w = window(&prev, &cur, &ctx());
        assert_eq!(w.offload_threads, 1);
        assert!(
            (w.helper_on_cpu_ms - 5.0).abs() < 1e-9,
            "{}",
            w.helper_on_cpu_ms
        );
        assert!(
            (w.backend_on_cpu_ms - 2.0).abs() < 1e-9,
            "{}",
            w.backend_on_cpu_ms
        );
        assert_eq!((w.backend_syscalls, w.backend_switches), (4, 2));
    }
}
