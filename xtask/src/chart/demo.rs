//! The demo told several times (demo.md): each run's predicted speedup against the
//! measured one, over the +-15% band.

use super::plot::{Chart, Guide, Panel, Scale, Series, Style, XAxis, YAxis};
use super::table;

pub fn chart(md: &str) -> Result<Chart, String> {
    let t = table::find_table(md, &["run", "predicted", "measured"])?;
    let (predicted, measured) = (t.col("predicted")?, t.col("measured")?);
    let points = t
        .rows
        .iter()
        .map(|r| Ok((table::number(&r[measured])?, table::number(&r[predicted])?)))
        .collect::<Result<_, String>>()?;
    Ok(Chart {
        caption: "The demo: predicted vs measured speedup, run by run".into(),
        panels: vec![Panel {
            title: "conn_server, 200 us, blocking wait, watched then injected".into(),
            x: XAxis::Numeric {
                label: "measured speedup (after / stock)".into(),
                scale: Scale::Linear,
            },
            y: YAxis {
                label: "predicted speedup".into(),
                scale: Scale::Linear,
            },
            series: vec![Series {
                name: "one point per run".into(),
                style: Style::Points,
                points,
            }],
            guides: vec![Guide::RatioBand {
                lo: 0.85,
                hi: 1.15,
                label: "within 15%".into(),
            }],
        }],
    })
}
