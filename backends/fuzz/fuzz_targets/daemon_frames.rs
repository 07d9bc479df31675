//! The daemon's handler fed a sequence of frames from one client: the input is cut
//! into frame bodies at u16 lengths; each sequence goes to one in-process daemon (no
//! socket) as one connection. Nothing may panic, and after each sequence every
//! client's counters must agree with its entries and stay within the bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};
use toffload_accel::cuda::CudaConfig;
use toffload_accel::remote::daemon::{Daemon, DaemonConfig};
use toffload_accel::EmuConfig;

fn daemon() -> &'static Arc<Daemon> {
    static D: OnceLock<Arc<Daemon>> = OnceLock::new();
    D.get_or_init(|| {
        // Small bounds, so that a run reaches them.
        let args: Vec<String> = [
            "--client-ops",
            "64",
            "--client-inflight-mb",
            "16",
            "--held-mb",
            "16",
            "--frame-assembly-mb",
            "17",
            "--cache-mb",
            "8",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let emu = EmuConfig {
            lat_us: 1.0,
            ..EmuConfig::default()
        };
        let cfg = DaemonConfig::parse(&args, emu, CudaConfig::default()).expect("config");
        Daemon::start(cfg).expect("daemon")
    })
}

fuzz_target!(|data: &[u8]| {
    let d = daemon();
    // Client id from the first byte: a few clients share the daemon across runs.
    let client = data.first().map_or(0, |b| *b as u64 % 4);
    let mut bodies = Vec::new();
    let mut rest = data.get(1..).unwrap_or(&[]);
    while rest.len() >= 2 {
        let n = (u16::from_le_bytes([rest[0], rest[1]]) as usize).min(rest.len() - 2);
        bodies.push(&rest[2..2 + n]);
        rest = &rest[2 + n..];
    }
    let _ = d.feed(client, &bodies);
    if let Err(e) = d.check() {
        panic!("{e}");
    }
});
