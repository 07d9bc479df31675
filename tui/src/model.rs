//! The view model: plain data the watcher fills in. The dashboard never sees the
//! watcher's own types, so that the dependency points one way only (the watcher
//! depends on this crate) and the dashboard can be driven by synthetic data in tests.

/// The process being watched: the header line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Target {
    pub pid: u32,
    pub command: String,
    /// What kind of runtime the process runs on, as the classifier names it
    /// (e.g. "glibc pthreads", "JVM", "event loop").
    pub runtime: String,
    pub threads: usize,
}

/// The fiberizability verdict.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VerdictView {
    pub label: String,
    pub fiberizable: bool,
    /// The evidence, in a sentence or two; wrapped to the panel.
    pub because: String,
}

/// One row of the syscall profile.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyscallView {
    pub name: String,
    pub per_sec: f64,
    pub mean_us: f64,
}

/// One process of a watched service (several processes: a master and workers).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProcessView {
    pub pid: u32,
    pub comm: String,
    /// "main" or "child".
    pub role: String,
    /// How it serves: "idle", "event loop", "thread pool", ...
    pub model: String,
    pub reads_per_sec: f64,
    pub threads: usize,
    pub connections: usize,
}

/// One measurement window (typically one second). `None` means "not measured in this
/// window" and is drawn as a gap or a dash, never as zero.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WindowView {
    /// Seconds since the watch started (the charts' x axis).
    pub t_s: f64,
    pub requests_per_sec: f64,
    /// Where the request count comes from (e.g. "accept", "recv"), shown next to it.
    pub request_source: String,
    pub stall_p50_us: Option<f64>,
    pub stall_p99_us: Option<f64>,
    /// Share of the stall spent on-CPU (spinning), 0..=1.
    pub spin_share: Option<f64>,
    /// stall histogram: (bucket upper bound in us, count), log2 buckets, this window
    pub stall_hist: Vec<(f64, u64)>,
    pub futex_per_request: Option<f64>,
    pub raw_futex_per_request: Option<f64>,
    pub voluntary_per_sec: f64,
    pub involuntary_per_sec: f64,
    pub wakeup_p50_us: Option<f64>,
    pub wakeup_p99_us: Option<f64>,
    pub cpu_per_request_us: Option<f64>,
    pub context_switch_us: Option<f64>,
    pub syscalls: Vec<SyscallView>,
    /// The service's processes; shown when there are several.
    pub processes: Vec<ProcessView>,
    /// The injected runtime's latencies in this window; None when its counters carry
    /// none (a stock server, an older runtime), which the panel shows as N/A.
    pub latency: Option<LatencyView>,
}

/// The injected runtime's own latency percentiles for one window, us (None: no
/// request in the window).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencyView {
    /// Request latency as the runtime sees it: from the connection seen readable to
    /// the server's next write on it.
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p999_us: Option<f64>,
    /// The offload wait's p50 (submit to the fiber going on).
    pub offload_wait_p50_us: Option<f64>,
}

/// The model's prediction for overlapping the wait.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PredictionView {
    pub speedup: Option<f64>,
    pub predicted_rps: Option<f64>,
    /// The ceiling that binds the prediction (e.g. "device lanes", "server core").
    pub binding: String,
    /// Why the runtime should not be injected, if it should not (a stop sign).
    pub stop: Option<String>,
    /// The model's inputs, as (name, formatted value).
    pub inputs: Vec<(String, String)>,
    /// What it would take (e.g. "LD_PRELOAD=libtoffload.so, no code change").
    pub recipe: Option<String>,
}

/// The runtime's conflict guard, once the runtime is injected.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GuardView {
    pub mode: String,
    pub faults: u64,
    pub conflicts: u64,
    pub serialized: u64,
}

/// The injection: before/after and the measured speedup against the prediction.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InjectionView {
    pub state: String,
    pub old_pid: Option<u32>,
    pub new_pid: Option<u32>,
    pub before_rps: Option<f64>,
    pub after_rps: Option<f64>,
    pub predicted_speedup: Option<f64>,
}

/// Everything but the per-window history, which the dashboard keeps itself
/// ([`crate::Dashboard::push_window`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct State {
    pub target: Target,
    pub verdict: Option<VerdictView>,
    pub prediction: Option<PredictionView>,
    pub injection: Option<InjectionView>,
    pub guard: Option<GuardView>,
    /// The watcher's own pause flag; the header shows PAUSED if this or the
    /// dashboard's ('p') is set.
    pub paused: bool,
    /// One line of status or messages, in the footer.
    pub status: String,
}
