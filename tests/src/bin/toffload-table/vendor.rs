//! Waits with no due time: hsm_server's vendor call (libxhsm's hsm_sign, rerouted by a
//! TOFFLOAD_OFFLOAD row to its submit/poll/free) and gpu_server's CUDA stream
//! synchronize (the built-in CUDA rows). The runtime cannot sleep until such an op is
//! due, as it does for conn_server's polled accel_run; it looks at them by each row's
//! observed floor (runtime/src/offload.rs). Measured beside conn_server at the same
//! latency and connections, stock and runtime interleaved run by run, so that what
//! the floor costs against a known due time reads directly.

use super::{fmt_rate, interleaved, Agg, Args, Point};
use std::fmt::Write;
use toffload_tests::harness::ServerSpec;

/// The server a point runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Served {
    /// conn_server: accel_run, submitted polled with its due time under the runtime.
    Conn,
    /// hsm_server: a vendor library's blocking call, rerouted by a row.
    Hsm,
    /// gpu_server: an asynchronous kernel and cudaStreamSynchronize.
    Gpu,
}

/// hsm_server's row: the blocking call and its non-blocking triple.
const HSM_ROW: &str = "hsm_sign:hsm_submit:hsm_poll:hsm_free";

/// Connection counts measured: few (the floor alone) and the table's 64 (a round of
/// resumptions queued behind each other on the carrier).
const CONNS: [usize; 2] = [8, 64];

/// At CONNS' largest, the rate a server with no due time must reach, as a share of
/// conn_server's under the runtime at the same point.
const TARGET_SHARE: f64 = 0.9;

impl Served {
    pub fn name(self) -> &'static str {
        match self {
            Served::Conn => "conn_server",
            Served::Hsm => "hsm_server",
            Served::Gpu => "gpu_server",
        }
    }

    /// Its spec; the runtime's knobs ride along on stock runs too (unread there), as
    /// the table's other runs get the same environment both ways.
    pub fn spec(self) -> ServerSpec {
        let spec = ServerSpec::new(self.name());
        match self {
            Served::Conn => spec,
            Served::Hsm => spec.env("TOFFLOAD_OFFLOAD", HSM_ROW),
            Served::Gpu => spec.env("GPU_SERVER_SYNC", "stream"),
        }
    }
}

/// Measures `a.vendor`'s latencies; returns the report's section and adds its
/// targets to `targets`.
pub fn section(a: &Args, targets: &mut Vec<(String, bool)>) -> Result<String, String> {
    let servers = [Served::Conn, Served::Hsm, Served::Gpu];
    let mut rows: Vec<(Point, Agg, Agg)> = Vec::new();
    for &lat in &a.vendor {
        for conns in CONNS {
            let point = |server| Point {
                lat,
                wait: "block",
                lanes: conns.max(64),
                device: a.device_core,
                server,
                conns,
            };
            let points: Vec<Point> = servers.iter().map(|&v| point(v)).collect();
            rows.extend(interleaved(a, &points, |p| {
                format!("{} {lat} us, {conns} connections", p.server.name())
            })?);
        }
    }
    let mut t = String::new();
    let _ = writeln!(
        t,
        "\nWaits with no due time (blocking wait, 64 lanes, median of {} runs, stock and \
         runtime of the three servers interleaved run by run): hsm_server's vendor call \
         rerouted by TOFFLOAD_OFFLOAD={HSM_ROW}, and gpu_server's cudaStreamSynchronize \
         (the built-in CUDA rows). The runtime looks at these by each row's floor, not at \
         a due time as for conn_server's accel_run. Ceiling: connections per offload \
         latency:\n",
        a.runs
    );
    t.push_str(
        "| server | offload us | conns | stock req/s | runtime req/s | speedup | runtime p50 us | \
         runtime p99 us | runtime/ceiling | runtime / conn_server's | wrong | errors |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let conn_rt = |p: &Point| {
        rows.iter()
            .find(|(q, _, _)| q.server == Served::Conn && q.lat == p.lat && q.conns == p.conns)
            .map(|(_, _, rt)| rt.rps)
    };
    for (p, st, rt) in &rows {
        let ceiling = p.conns as f64 / (p.lat as f64 * 1e-6);
        let share = conn_rt(p).map(|c| rt.rps / c);
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {:.2}x | {} | {} | {:.2} | {} | {} | {} |",
            p.server.name(),
            p.lat,
            p.conns,
            fmt_rate(st.rps),
            fmt_rate(rt.rps),
            rt.rps / st.rps,
            fmt_rate(rt.p50),
            fmt_rate(rt.p99),
            rt.rps / ceiling,
            share.map_or("-".into(), |s| format!("{s:.2}")),
            st.wrong + rt.wrong,
            st.errors + rt.errors
        );
        if p.server != Served::Conn && p.conns == CONNS[1] {
            if let Some(s) = share {
                targets.push((
                    format!(
                        "{} at {} us, {} connections, under the runtime >= {TARGET_SHARE} of \
                         conn_server's rate: {s:.2}",
                        p.server.name(),
                        p.lat,
                        p.conns
                    ),
                    s >= TARGET_SHARE,
                ));
            }
        }
    }
    for (p, _, rt) in &rows {
        if rt.min_fibers == 0 {
            targets.push((
                format!(
                    "{} at {} us, {} connections: the runtime did not engage",
                    p.server.name(),
                    p.lat,
                    p.conns
                ),
                false,
            ));
        }
    }
    let wrong: u64 = rows.iter().map(|(_, s, r)| s.wrong + r.wrong).sum();
    targets.push((
        format!("wrong answers, waits with no due time: {wrong}"),
        wrong == 0,
    ));
    Ok(t)
}
