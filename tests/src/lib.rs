//! toffload's test support: the load generator library behind `toffload-load`, and the
//! harness that starts and stops the example servers for the integration suites, the
//! benchmarks and the demo.

pub mod harness;
pub mod load;
