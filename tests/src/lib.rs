//! toffload's test support: the load generator library behind `toffload-load`, and the
//! harness that starts and stops the example servers for the integration suites, the
//! benchmarks and the demo.

pub mod harness;
pub mod loadgen;
pub mod preload;
/// The load generator (short name).
pub use loadgen as load;
