//! Where a bench puts the emulated device's thread (`--device-core`). The device
//! stands in for an accelerator, whose work and completions cost the host's server
//! core nothing; its thread, though, wakes once per completion batch, and each wake
//! costs a vCPU of this kind ~15 us. On the server's core that cost lands on the
//! server, and more of it under the fiber runtime, which keeps the device's queue short
//! (a completion per wake against dozens for 64 blocked threads, whose crowded core
//! delays the device's wakes until many are due). On the load generator's core it does
//! not, as with a real device, but there the load generator delays the device's
//! wake-ups, which a latency-bound stock server feels (20 us, 64 connections: 32,850
//! req/s against 82,885). Neither core is a real device's; the model bench takes the
//! load generator's (its CPU-bound points were the device's cost, not the model's),
//! the stock vs runtime table the server's (every committed table's).

use crate::harness::{self, Server, ServerSpec};

/// The emulated device's thread name.
pub const DEVICE_THREAD: &str = toffload_abi::threads::EMULATED_ENGINE;

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum DeviceCore {
    /// Core 1, beside the load generator (with fewer than 2 CPUs: unpinned).
    Load,
    /// The server's own core.
    Server,
}

impl DeviceCore {
    /// `spec` (a server pinned to core 0) with the device's thread placed.
    pub fn place(self, spec: ServerSpec) -> ServerSpec {
        match self {
            DeviceCore::Load if harness::cpus() >= 2 => spec.env("TOFFLOAD_EMU_CPU", "1"),
            _ => spec,
        }
    }

    /// The CPU seconds so far of `server`'s device thread where it is off the server's
    /// core (to take out of the server's CPU), else 0.
    pub fn off_core_cpu_secs(self, server: &Server) -> f64 {
        match self {
            DeviceCore::Load if harness::cpus() >= 2 => server.threads_cpu_secs(DEVICE_THREAD),
            _ => 0.0,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            DeviceCore::Load => "the emulated device's thread on core 1 (the load generator's)",
            DeviceCore::Server => "the emulated device's thread on core 0 (the server's)",
        }
    }
}
