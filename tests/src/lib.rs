//! toffload's test support: the load generator library behind `toffload-load`, the
//! harness that starts and stops the example servers for the integration suites, the
//! benchmarks and the demo, and the tmux driver of the dashboards' terminal tests.

pub mod device_core;
pub mod harness;
pub mod hiccups;
pub mod loadgen;
pub mod openloop;
pub mod preload;
pub mod reroute;
pub mod reroute_guard;
pub mod tmux;
/// The load generator (short name).
pub use loadgen as load;
