//! toffload-watch as a library: attach eBPF programs to a running server, collect
//! per-window metrics (offload stalls, futex origins, context switches, wake-up
//! latency, syscalls, threads), and classify the server against the interposition
//! envelope. The binary (main.rs) is a thin CLI over `session`.

// The watcher by stage: the kernel side (load, attach, read the maps, what the probes
// cost), the watched target (its processes, /proc and ELF facts, the runtime's
// counters), the analysis of a window (metrics, verdict, model), the output (text,
// JSON, dashboard), the injection, and the long-running service. session.rs runs one
// watch through them. The re-exports keep each module's short path
// (`toffload_watch::metrics`).
pub mod analysis;
pub mod error;
pub mod inject;
pub mod kernel;
pub mod output;
pub mod serve;
pub mod session;
pub mod target;

/// The GPU waits the injected runtime hides: the runtime's own table.
#[path = "../../runtime/src/cuda_rows.rs"]
pub mod cuda_rows;

pub use analysis::{classifier, futex, measured_cost, metrics, model};
pub use inject::flow as inject_flow;
pub use kernel::{
    abi, btf, btf_hidden, burst_cost, calibrate, calibration_cache, collector, hist, idle_wake,
    loader, probe_cost, program_stats, start_priority, watch_priority,
};
pub use output::{dashboard, report, sink, syscalls, wall_clock};
pub use target::{
    offload_spec, processes, runtime_counters, service, spawn, steal, symbols, untraced,
};
