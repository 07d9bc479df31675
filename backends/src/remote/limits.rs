//! The daemon's resource bounds: every one a flag with its default here (the one
//! table; `--help` and docs/remote.md show it). Each is checked before the memory or
//! thread it guards is taken, so a client, authenticated or not, can make the daemon
//! hold at most these.

use clap::Args;
use std::time::Duration;

#[derive(Args, Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes (MiB) one Submit frame may ask the daemon to assemble, its ops' lengths
    /// summed (literal bytes and referenced chunks alike). A frame past it is refused
    /// and its connection closed. The client sends at most 1 MiB, or one op, per frame.
    #[arg(long, value_name = "MIB", default_value_t = 32, value_parser = clap::value_parser!(u64).range(17..=65536))]
    pub frame_assembly_mb: u64,
    /// Ops of one client received and not yet finished. Ops past it are answered
    /// ENOBUFS without running.
    #[arg(long, value_name = "N", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub client_ops: u64,
    /// Bytes (MiB) of one client's ops received and not yet finished. Ops past it are
    /// answered ENOBUFS without running.
    #[arg(long, value_name = "MIB", default_value_t = 512, value_parser = clap::value_parser!(u64).range(16..=65536))]
    pub client_inflight_mb: u64,
    /// Bytes (MiB) of finished results held for one client until it acknowledges
    /// them. Past it the oldest are dropped (a resend of their ops is answered
    /// ETIMEDOUT; they never run twice).
    #[arg(long, value_name = "MIB", default_value_t = 512, value_parser = clap::value_parser!(u64).range(16..=65536))]
    pub held_mb: u64,
    /// Seconds a finished result is held for a client that does not acknowledge it,
    /// after which it is dropped as above.
    #[arg(long, value_name = "S", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=7 * 86400))]
    pub held_age_s: u64,
    /// Connections open at once (each has a thread). Past it new ones are closed at
    /// accept.
    #[arg(long, value_name = "N", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub max_conns: u64,
    /// Connections open at once from one peer IP address (each process using the
    /// remote backend has one per daemon: a host of prefork workers has many).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub max_conns_per_peer: u64,
    /// Bytes (MiB) waiting to be written to one connection. A peer that does not read
    /// stops being read; past the bound its connection is closed (its results stay
    /// held for its next one).
    #[arg(long, value_name = "MIB", default_value_t = 32, value_parser = clap::value_parser!(u64).range(2..=4096))]
    pub out_queue_mb: u64,
    /// Milliseconds from accept to a finished TLS handshake and Hello, whatever the
    /// peer trickles.
    #[arg(long, value_name = "MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub handshake_ms: u64,
    /// Seconds a connection may pass with no byte read or written before it is
    /// closed (the client reconnects when it next has an op).
    #[arg(long, value_name = "S", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub idle_s: u64,
}

impl Default for Limits {
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            l: Limits,
        }
        <Only as clap::Parser>::parse_from(["limits"]).l
    }
}

impl Limits {
    pub fn frame_assembly(&self) -> usize {
        (self.frame_assembly_mb << 20) as usize
    }
    pub fn client_inflight(&self) -> usize {
        (self.client_inflight_mb << 20) as usize
    }
    pub fn held(&self) -> usize {
        (self.held_mb << 20) as usize
    }
    pub fn held_age(&self) -> Duration {
        Duration::from_secs(self.held_age_s)
    }
    pub fn out_queue(&self) -> usize {
        (self.out_queue_mb << 20) as usize
    }
    pub fn handshake(&self) -> Duration {
        Duration::from_millis(self.handshake_ms)
    }
    pub fn idle(&self) -> Duration {
        Duration::from_secs(self.idle_s)
    }
}
