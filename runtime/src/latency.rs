//! The latencies the runtime can measure honestly, counted in the exported block's
//! histograms (toffload-abi's LatencyHist, read by toffload-watch):
//!
//! - **Request latency**, per accepted connection: from when the carrier's poll found
//!   the connection readable, for a read on a fiber that had waited for it and then
//!   returned bytes (the request's first bytes), to the start of the next write on
//!   that fd (the response's first byte handed to the kernel). The start is the time
//!   the carrier read right after that poll, so it costs no clock read of its own;
//!   the end costs one.
//!
//!   It is the server's own time, the offload's wait and the run queue included. It
//!   is not what a client sees: the network both ways, the time the bytes sat in the
//!   socket before the carrier's poll (a busy carrier polls every 20 us), and the
//!   response's transmission are outside it. Requests whose bytes were already there
//!   when the server came to read (pipelined, or queued behind the previous one) are
//!   not counted; several requests before one write count as one, from the first.
//!   Connections the process opened itself, and writes from real threads, are not
//!   counted.
//! - **Offload wait**: from the first submit to the fiber going on with the result,
//!   parked or waiting inline (offload.rs reads both clocks already).

use crate::stats::COUNTERS;
use crate::time;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use toffload_abi::runtime::record_latency;

/// Per fd: 0 not an accepted connection (or forgotten), IDLE accepted with no
/// request open, anything else the monotonic ns its open request began.
static SINCE: [AtomicU64; crate::fd_facts::MAX_FD] =
    [const { AtomicU64::new(0) }; crate::fd_facts::MAX_FD];
const IDLE: u64 = 1;

fn cell(fd: libc::c_int) -> Option<&'static AtomicU64> {
    crate::fd_facts::slot(fd).map(|i| &SINCE[i])
}

/// `fd` came from accept: its requests are timed.
pub fn accepted(fd: libc::c_int) {
    if let Some(c) = cell(fd) {
        c.store(IDLE, Relaxed);
    }
}

/// `fd` was closed or is a new file.
pub fn forget(fd: libc::c_int) {
    if let Some(c) = cell(fd) {
        c.store(0, Relaxed);
    }
}

/// A read on `fd` that waited returned bytes; the carrier's poll saw it readable at
/// `polled_at`. Opens a request unless one is open (its first bytes came earlier).
pub fn request_began(fd: libc::c_int, polled_at: u64) {
    if let Some(c) = cell(fd) {
        if c.load(Relaxed) == IDLE {
            c.store(polled_at.max(IDLE + 1), Relaxed);
        }
    }
}

/// A fiber is about to write on `fd`: closes the open request, if any. Only the fd's
/// own fiber touches an open request, so a load and a store are enough.
pub fn responding(fd: libc::c_int) {
    let Some(c) = cell(fd) else { return };
    let since = c.load(Relaxed);
    if since > IDLE {
        c.store(IDLE, Relaxed);
        record_latency(
            &COUNTERS.request_latency,
            time::now_ns().saturating_sub(since),
        );
    }
}

/// An offload waited `ns` from submit until its fiber went on.
pub fn offload_waited(ns: u64) {
    record_latency(&COUNTERS.offload_wait, ns);
}

#[cfg(test)]
mod tests {
    use super::*;
    use toffload_abi::runtime::latency_bucket;

    /// Counts between 3 and 4 ms.
    fn near_3ms() -> u64 {
        COUNTERS.request_latency[latency_bucket(3_000_000)..=latency_bucket(4_000_000)]
            .iter()
            .map(|b| b.load(Relaxed))
            .sum()
    }

    /// Only an accepted fd's request is timed, from its first waited read to the next
    /// write, once; a closed fd's open request is dropped.
    #[test]
    fn a_request_runs_from_its_first_waited_read_to_the_next_write() {
        let fd = 4000;
        let before = COUNTERS
            .request_latency
            .iter()
            .map(|b| b.load(Relaxed))
            .sum::<u64>();
        let total = || {
            COUNTERS
                .request_latency
                .iter()
                .map(|b| b.load(Relaxed))
                .sum::<u64>()
                - before
        };
        forget(fd);
        request_began(fd, time::now_ns());
        responding(fd);
        assert_eq!(total(), 0, "not accepted: not timed");
        accepted(fd);
        let t = time::now_ns() - 3_000_000;
        request_began(fd, t);
        request_began(fd, t + 2_000_000);
        let b = near_3ms();
        responding(fd);
        assert_eq!(total(), 1);
        assert_eq!(near_3ms(), b + 1, "from the first read");
        responding(fd);
        assert_eq!(total(), 1, "one request, one count");
        request_began(fd, time::now_ns());
        forget(fd);
        responding(fd);
        assert_eq!(total(), 1, "closed: dropped");
    }
}
