//! toffload-watch as a library: attach eBPF programs to a running server, collect
//! per-window metrics (offload stalls, futex origins, context switches, wake-up
//! latency, syscalls, threads), and classify the server against the interposition
//! envelope. The binary (main.rs) is a thin CLI over `session`.

pub mod abi;
pub mod btf;
pub mod calibrate;
pub mod calibration_cache;
pub mod classifier;
pub mod collector;
/// The GPU waits the injected runtime hides: the runtime's own table.
#[path = "../../runtime/src/cuda_rows.rs"]
pub mod cuda_rows;
pub mod dashboard;
pub mod error;
pub mod futex;
pub mod hist;
pub mod inject;
pub mod inject_flow;
pub mod loader;
pub mod metrics;
pub mod model;
pub mod offload_spec;
pub mod probe_cost;
pub mod processes;
pub mod report;
pub mod runtime_counters;
pub mod serve;
pub mod service;
pub mod session;
pub mod sink;
pub mod spawn;
pub mod steal;
pub mod symbols;
pub mod syscalls;
pub mod target;
pub mod untraced;
pub mod wall_clock;
