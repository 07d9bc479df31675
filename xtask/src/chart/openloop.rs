//! Latency against offered load (openloop.csv): one panel per offload latency, p50
//! and p99 of every configuration on log axes, each configuration's knee marked.

use super::plot::{Chart, Guide, Panel, Scale, Series, Style, XAxis, YAxis};
use super::table::{self, Table};

/// The configurations (mode column) in the order the bench writes them.
fn modes(t: &Table) -> Result<Vec<String>, String> {
    let mut v: Vec<String> = Vec::new();
    for m in t.column("mode")? {
        if !v.iter().any(|x| x == m) {
            v.push(m.to_string());
        }
    }
    Ok(v)
}

pub fn chart(csv: &str) -> Result<Chart, String> {
    let t = table::csv(csv)?;
    let (mode, lat, offered, knee) = (
        t.col("mode")?,
        t.col("offload_us")?,
        t.col("offered")?,
        t.col("knee")?,
    );
    let (p50, p99) = (t.col("p50_us")?, t.col("p99_us")?);
    let mut lats: Vec<f64> = Vec::new();
    for r in &t.rows {
        let l = table::number(&r[lat])?;
        if !lats.contains(&l) {
            lats.push(l);
        }
    }
    lats.sort_by(f64::total_cmp);
    let modes = modes(&t)?;
    let mut panels = Vec::new();
    for l in lats {
        let mut series = Vec::new();
        let mut guides = Vec::new();
        for m in &modes {
            let rows: Vec<&Vec<String>> = t
                .rows
                .iter()
                .filter(|r| &r[mode] == m && table::number(&r[lat]).ok() == Some(l))
                .collect();
            let pts = |col: usize| -> Result<Vec<(f64, f64)>, String> {
                rows.iter()
                    .map(|r| Ok((table::number(&r[offered])?, table::number(&r[col])?)))
                    .collect()
            };
            let p99_series = series.len() + 1;
            series.push(Series {
                name: format!("{m} p50"),
                style: Style::Line,
                points: pts(p50)?,
            });
            series.push(Series {
                name: format!("{m} p99"),
                style: Style::Line,
                points: pts(p99)?,
            });
            for r in rows.iter().filter(|r| r[knee] == "1") {
                let x = table::number(&r[offered])?;
                guides.push(Guide::Mark {
                    series: p99_series,
                    at: (x, table::number(&r[p99])?),
                    label: format!("knee {}", super::plot::tick_label(x)),
                });
            }
        }
        panels.push(Panel {
            title: format!("{l} us offloads"),
            x: XAxis::Numeric {
                label: "offered load (req/s, Poisson)".into(),
                scale: Scale::Log,
            },
            y: YAxis {
                label: "latency from arrival (us)".into(),
                scale: Scale::Log,
            },
            series,
            guides,
        });
    }
    Ok(Chart {
        caption: "conn_server: latency vs open-loop offered load (crosses: knees)".into(),
        panels,
    })
}
