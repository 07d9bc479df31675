//! The model's predicted zero-edit speedup against the measured one (model.md): a
//! panel per stock wait style (their speedups differ by orders of magnitude), each a
//! scatter over the +-15% band around equality, log axes where the points span more
//! than 5x.

use super::plot::{Chart, Guide, Panel, Scale, Series, Style, XAxis, YAxis};
use super::table;

pub fn chart(md: &str) -> Result<Chart, String> {
    let t = table::find_table(md, &["wait", "measured", "predicted"])?;
    let (wait, measured, predicted) = (t.col("wait")?, t.col("measured")?, t.col("predicted")?);
    let mut groups: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in &t.rows {
        let p = (table::number(&r[measured])?, table::number(&r[predicted])?);
        match groups.iter_mut().find(|g| g.0 == r[wait]) {
            Some(g) => g.1.push(p),
            None => groups.push((r[wait].clone(), vec![p])),
        }
    }
    let panels = groups
        .into_iter()
        .map(|(w, points)| {
            let all = points.iter().flat_map(|p| [p.0, p.1]);
            let (lo, hi) = all.fold((f64::INFINITY, 0f64), |(l, h), v| (l.min(v), h.max(v)));
            let scale = if lo > 0.0 && hi / lo > 5.0 {
                Scale::Log
            } else {
                Scale::Linear
            };
            Panel {
                title: format!("stock server waiting by {w}"),
                x: XAxis::Numeric {
                    label: "measured speedup (runtime / stock)".into(),
                    scale,
                },
                y: YAxis {
                    label: "predicted speedup".into(),
                    scale,
                },
                series: vec![Series {
                    name: format!("wait={w}: one point per configuration"),
                    style: Style::Points,
                    points,
                }],
                guides: vec![Guide::RatioBand {
                    lo: 0.85,
                    hi: 1.15,
                    label: "within 15%".into(),
                }],
            }
        })
        .collect();
    Ok(Chart {
        caption: "toffload-watch's model: predicted vs measured speedup".into(),
        panels,
    })
}
