//! The serve soak (serve.md): the service's resident memory and CPU share over the
//! run, from its samples table. A leak shows as a rising RSS line.

use super::plot::{Chart, Guide, Panel, Scale, Series, Style, XAxis, YAxis};
use super::table;

pub fn chart(md: &str) -> Result<Chart, String> {
    let t = table::find_table(md, &["t s", "RSS MiB", "CPU %"])?;
    let (ts, rss, cpu) = (t.col("t s")?, t.col("RSS MiB")?, t.col("CPU %")?);
    let mut mem = Vec::new();
    let mut share = Vec::new();
    for r in &t.rows {
        let min = table::number(&r[ts])? / 60.0;
        mem.push((min, table::number(&r[rss])?));
        share.push((min, table::number(&r[cpu])?));
    }
    let x = || XAxis::Numeric {
        label: "minutes into the soak".into(),
        scale: Scale::Linear,
    };
    Ok(Chart {
        caption: "toffload-watch serve: three targets under load".into(),
        panels: vec![
            Panel {
                title: "resident memory".into(),
                x: x(),
                y: YAxis {
                    label: "RSS, MiB".into(),
                    scale: Scale::Linear,
                },
                series: vec![Series {
                    name: "toffload-watch serve".into(),
                    style: Style::Line,
                    points: mem,
                }],
                // From zero, so that growth shows in proportion (a flat RSS would
                // otherwise fill the panel with its last decimal's noise).
                guides: vec![Guide::HLine {
                    y: 0.0,
                    label: "0 MiB".into(),
                }],
            },
            Panel {
                title: "CPU share".into(),
                x: x(),
                y: YAxis {
                    label: "% of one CPU".into(),
                    scale: Scale::Linear,
                },
                series: vec![Series {
                    name: "toffload-watch serve".into(),
                    style: Style::Line,
                    points: share,
                }],
                guides: vec![Guide::HLine {
                    y: 0.0,
                    label: "0%".into(),
                }],
            },
        ],
    })
}
