//! The kernel side of a watch: the eBPF object's layouts (abi), the kernel's BTF, loading
//! and attaching the programs (loader, on a thread that does not parse that BTF:
//! btf_hidden), reading their maps into snapshots (collector,
//! percpu, hist), and what the probes and a context switch cost (calibrate, probe_cost with the
//! kernel's own count of its programs' run time in program_stats, the boot's
//! calibration_cache), what a burst's attach and detach cost (burst_cost), and the
//! priority the start runs at (start_priority) and the watch after it (watch_priority).

pub mod abi;
pub mod btf;
pub mod btf_hidden;
pub mod burst_cost;
pub mod calibrate;
pub mod calibration_cache;
pub mod collector;
pub mod hist;
pub mod idle_wake;
pub mod loader;
pub mod percpu;
pub mod probe_cost;
pub mod program_stats;
pub mod start_priority;
pub mod watch_priority;
