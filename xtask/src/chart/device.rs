//! The emulated device (device.md): measured p50 and p99 latency against the
//! configured knob, one operation in flight and many, beside the line where they equal.

use super::plot::{Chart, Guide, Panel, Scale, Series, Style, XAxis, YAxis};
use super::table;

pub fn chart(md: &str) -> Result<Chart, String> {
    let t = table::find_table(md, &["knob us", "in flight", "p50 us", "p99 us"])?;
    let (knob, flight) = (t.col("knob us")?, t.col("in flight")?);
    let mut series: Vec<Series> = Vec::new();
    for q in ["p50 us", "p99 us"] {
        let col = t.col(q)?;
        for r in &t.rows {
            let name = format!("{}, {} in flight", &q[..3], r[flight]);
            let p = (table::number(&r[knob])?, table::number(&r[col])?);
            match series.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push(p),
                None => series.push(Series {
                    name,
                    style: Style::Line,
                    points: vec![p],
                }),
            }
        }
    }
    Ok(Chart {
        caption: "Emulated device: configured vs measured latency".into(),
        panels: vec![Panel {
            title: "64 lanes, 1024 B operations, client spinning on completion".into(),
            x: XAxis::Numeric {
                label: "configured latency, TOFFLOAD_EMU_LAT_US (us)".into(),
                scale: Scale::Log,
            },
            y: YAxis {
                label: "measured latency (us)".into(),
                scale: Scale::Log,
            },
            series,
            guides: vec![Guide::Diagonal {
                label: "measured = configured".into(),
            }],
        }],
    })
}
