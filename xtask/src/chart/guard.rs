//! The conflict guard (guard.md): throughput with enforce, with one coarse lock and
//! unguarded (wrong), per offload latency and sharing pattern.

use super::plot::{Chart, Panel, Scale, Series, Style, XAxis, YAxis};
use super::table;

/// A short name for the table's sharing pattern.
fn pattern(cell: &str) -> &'static str {
    if cell.contains("4 counters") {
        "4 counters"
    } else if cell.contains("SHARED_EVERY") {
        "1 in 8 share"
    } else {
        "1 counter"
    }
}

pub fn chart(md: &str) -> Result<Chart, String> {
    let shared = "requests updating shared state";
    let (lock, enforce, unguarded) = (
        "coarse lock req/s",
        "enforce req/s",
        "unguarded req/s (lost)",
    );
    let t = table::find_table(md, &["offload us", shared, lock, enforce, unguarded])?;
    let (lat, pat) = (t.col("offload us")?, t.col(shared)?);
    let names = t
        .rows
        .iter()
        .map(|r| format!("{} us, {}", r[lat], pattern(&r[pat])))
        .collect();
    let series = [
        ("coarse lock", lock),
        ("enforce", enforce),
        ("unguarded (loses updates)", unguarded),
    ]
    .into_iter()
    .map(|(name, col)| {
        let points = t
            .column(col)?
            .iter()
            .enumerate()
            .map(|(i, c)| Ok((i as f64, table::number(c)?)))
            .collect::<Result<_, String>>()?;
        Ok(Series {
            name: name.into(),
            style: Style::Points,
            points,
        })
    })
    .collect::<Result<_, String>>()?;
    Ok(Chart {
        caption: "Conflict guard: enforce vs a coarse lock vs unguarded".into(),
        panels: vec![Panel {
            title: "hostile_server under libtoffload.so".into(),
            x: XAxis::Categories {
                label: "offload latency, requests sharing state".into(),
                names,
            },
            y: YAxis {
                label: "req/s".into(),
                scale: Scale::Log,
            },
            series,
            guides: Vec::new(),
        }],
    })
}
