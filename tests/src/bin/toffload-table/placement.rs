//! The emulated device's thread on either core. On the server's core (the table's
//! default) the device's own work, each completion's AES and wake-ups, is charged to
//! the server's core, which a real accelerator's work never is; on the load
//! generator's core it is not, but there the load generator delays the device's
//! wake-ups (device_core.rs). The same points measured both ways, interleaved run by
//! run, so that the speedup is read beside what the placement alone moves.

use super::{fmt_rate, interleaved, Agg, Args, Point};
use std::fmt::Write;
use toffload_tests::device_core::DeviceCore;

/// The target for the speedup over the blocking server at this latency,
/// with the device's work off the server's core.
const TARGET_LAT_US: u32 = 200;
const TARGET: f64 = 1.45;

const PLACEMENTS: [DeviceCore; 2] = [DeviceCore::Server, DeviceCore::Load];

/// Measures `a.placement`'s latencies both ways; returns the report's section and
/// adds its target to `targets`.
pub fn section(a: &Args, targets: &mut Vec<(String, bool)>) -> Result<String, String> {
    let lanes = a.conns.max(64);
    let mut rows: Vec<(Point, Agg, Agg)> = Vec::new();
    for &lat in &a.placement {
        let point = |device| Point {
            lat,
            wait: "block",
            lanes,
            device,
            server: super::vendor::Served::Conn,
            conns: a.conns,
        };
        let points: Vec<Point> = PLACEMENTS.iter().map(|&d| point(d)).collect();
        rows.extend(interleaved(a, &points, |p| {
            format!("placement {lat} us, {}", p.device.label())
        })?);
    }
    let mut t = String::new();
    let _ = writeln!(
        t,
        "\nThe emulated device's thread on either core (blocking wait, {lanes} lanes, \
         {} connections, median of {} runs, the two placements interleaved run by run). \
         On the server's core, as in the table above, the device's own work (each \
         completion's AES-CTR, its timer and wake-ups) is charged to the server's core, \
         which a real accelerator's work is not; on the load generator's core it is not, \
         but there the load generator delays the device's wake-ups:\n",
        a.conns, a.runs
    );
    t.push_str(
        "| offload us | device thread on | stock req/s | runtime req/s | speedup | runtime p99 us | wrong | errors |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for (p, st, rt) in &rows {
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {:.2}x | {} | {} | {} |",
            p.lat,
            match p.device {
                DeviceCore::Server => "core 0 (the server's)",
                DeviceCore::Load => "core 1 (the load generator's)",
            },
            fmt_rate(st.rps),
            fmt_rate(rt.rps),
            rt.rps / st.rps,
            fmt_rate(rt.p99),
            st.wrong + rt.wrong,
            st.errors + rt.errors
        );
    }
    if let Some((_, st, rt)) = rows
        .iter()
        .find(|(p, _, _)| p.lat == TARGET_LAT_US && p.device == DeviceCore::Load)
    {
        let s = rt.rps / st.rps;
        targets.push((
            format!(
                "speedup vs block at {TARGET_LAT_US} us, the device's thread off the \
                 server's core, >= {TARGET}x: {s:.2}x"
            ),
            s >= TARGET,
        ));
    }
    let wrong: u64 = rows.iter().map(|(_, s, r)| s.wrong + r.wrong).sum();
    targets.push((
        format!("wrong answers, device placement runs: {wrong}"),
        wrong == 0,
    ));
    Ok(t)
}
