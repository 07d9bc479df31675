//! toffload-watch's overhead (watch.md): watched over unwatched throughput per server,
//! at the default overhead budget and tracing every event (--sample 100).

use super::plot::{Chart, Guide, Panel, Scale, Series, Style, XAxis, YAxis};
use super::table;

pub fn chart(md: &str) -> Result<Chart, String> {
    let (watched, every) = ("watched req/s (ratio)", "--sample 100 req/s (ratio)");
    let ex = table::find_table(md, &["server", "offload us", "conns", watched, every])?;
    let (server, lat, conns) = (ex.col("server")?, ex.col("offload us")?, ex.col("conns")?);
    let mut names: Vec<String> = Vec::new();
    let mut budget = Vec::new();
    let mut all = Vec::new();
    for r in &ex.rows {
        let i = names.len() as f64;
        let short = r[server].trim_end_matches("_server");
        names.push(format!("{short} {} us x{}", r[lat], r[conns]));
        budget.push((i, table::in_parens(&r[ex.col(watched)?])?));
        all.push((i, table::in_parens(&r[ex.col(every)?])?));
    }
    // The stock servers under their own load tools: the default budget only.
    if let Ok(real) =
        table::find_table(md, &["server", watched, "worst quarter, calibrating start"])
    {
        for r in &real.rows {
            let i = names.len() as f64;
            let name = r[real.col("server")?]
                .split(" (")
                .next()
                .unwrap_or("")
                .to_string();
            names.push(name);
            budget.push((i, table::in_parens(&r[real.col(watched)?])?));
        }
    }
    Ok(Chart {
        caption: "toffload-watch: throughput watched / unwatched".into(),
        panels: vec![Panel {
            title: "by overhead budget (median of interleaved runs)".into(),
            x: XAxis::Categories {
                label: "server, offload latency, connections".into(),
                names,
            },
            y: YAxis {
                label: "watched / unwatched req/s".into(),
                scale: Scale::Linear,
            },
            series: vec![
                Series {
                    name: "default budget (0.5% of the target's CPU)".into(),
                    style: Style::Points,
                    points: budget,
                },
                Series {
                    name: "--sample 100 (every event traced)".into(),
                    style: Style::Points,
                    points: all,
                },
            ],
            guides: vec![
                Guide::HLine {
                    y: 0.97,
                    label: "0.97: example servers' target".into(),
                },
                Guide::HLine {
                    y: 0.99,
                    label: "0.99: stock servers' target".into(),
                },
            ],
        }],
    })
}
