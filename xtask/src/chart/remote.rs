//! conn_server with the remote backend beside the local emulated one (remote.md): stock
//! and runtime req/s per backend and wait style.

use super::plot::{Chart, Panel, Scale, Series, Style, XAxis, YAxis};
use super::table;

pub fn chart(md: &str) -> Result<Chart, String> {
    let t = table::find_table(md, &["backend", "wait", "stock req/s", "runtime req/s"])?;
    let (backend, wait) = (t.col("backend")?, t.col("wait")?);
    let names = t
        .rows
        .iter()
        .map(|r| {
            let b = r[backend].split(" (").next().unwrap_or("");
            format!("{b}, {}", r[wait])
        })
        .collect();
    let series = [("stock", "stock req/s"), ("runtime", "runtime req/s")]
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
        caption: "conn_server with the remote backend".into(),
        panels: vec![Panel {
            title: "stock vs under the runtime, per backend and wait style".into(),
            x: XAxis::Categories {
                label: "backend, stock wait".into(),
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
