//! Remote CUDA's remoting efficiency (remote-cuda-bench.md): conn_server's req/s on
//! the cuda backend, direct and remoted per link, batching and upload cache or the
//! naive forwarder, stock and under the runtime.

use super::plot::{Chart, Panel, Scale, Series, Style, XAxis, YAxis};
use super::table;

pub fn chart(md: &str) -> Result<Chart, String> {
    let t = table::find_table(
        md,
        &[
            "link",
            "batching",
            "upload cache",
            "stock req/s",
            "runtime req/s",
        ],
    )?;
    let (link, batch, cache) = (t.col("link")?, t.col("batching")?, t.col("upload cache")?);
    let names = t
        .rows
        .iter()
        .map(|r| {
            let l = r[link].split(" (").next().unwrap_or("");
            if r[batch].is_empty() {
                return l.to_string();
            }
            if r[batch].starts_with("naive") {
                return format!("{l}: naive");
            }
            let b = if r[batch] == "on" {
                "batch"
            } else {
                "no batch"
            };
            let c = if r[cache] == "on" {
                "cache"
            } else {
                "no cache"
            };
            format!("{l}: {b}, {c}")
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
        caption: "conn_server on the cuda backend, direct vs remoted".into(),
        panels: vec![Panel {
            title: "stock vs under the runtime, per link, batching and upload cache".into(),
            x: XAxis::Categories {
                label: "link: client settings".into(),
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
