//! The runtime's speedup over the stock server against offload latency (runtime.md):
//! one line per wait style and lane count, the targets as triangles.

use super::plot::{Chart, Guide, Panel, Scale, Series, Style, XAxis, YAxis};
use super::table;

/// `- [PASS] speedup vs spin at 200 us >= 5x: 449.41x` -> ("spin", 200, 5).
fn target(line: &str) -> Option<(String, f64, f64)> {
    let rest = line.split_once("speedup vs ")?.1;
    let (wait, rest) = rest.split_once(" at ")?;
    let (lat, rest) = rest.split_once(" us >= ")?;
    let (goal, _) = rest.split_once('x')?;
    Some((wait.to_string(), lat.parse().ok()?, goal.parse().ok()?))
}

pub fn chart(md: &str) -> Result<Chart, String> {
    let t = table::find_table(md, &["offload us", "wait", "lanes", "speedup"])?;
    let (lat, wait, lanes, speedup) = (
        t.col("offload us")?,
        t.col("wait")?,
        t.col("lanes")?,
        t.col("speedup")?,
    );
    let mut series: Vec<Series> = Vec::new();
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in &t.rows {
        let key = (r[wait].clone(), r[lanes].clone());
        let i = match keys.iter().position(|k| *k == key) {
            Some(i) => i,
            None => {
                keys.push(key.clone());
                series.push(Series {
                    name: format!("vs stock {}, {} lanes", key.0, key.1),
                    style: Style::Line,
                    points: Vec::new(),
                });
                keys.len() - 1
            }
        };
        series[i]
            .points
            .push((table::number(&r[lat])?, table::number(&r[speedup])?));
    }
    // A target is about the wait style at the most lanes (the main row set).
    let most_lanes = |w: &str| {
        keys.iter()
            .enumerate()
            .filter(|(_, k)| k.0 == w)
            .max_by_key(|(_, k)| k.1.parse::<u64>().unwrap_or(0))
            .map(|(i, _)| i)
    };
    let guides = md
        .lines()
        .filter_map(target)
        .filter_map(|(w, l, g)| {
            Some(Guide::Target {
                series: most_lanes(&w)?,
                at: (l, g),
                label: format!(">= {g}x"),
            })
        })
        .collect();
    Ok(Chart {
        caption: "conn_server under libtoffload.so: speedup over stock".into(),
        panels: vec![Panel {
            title: "runtime req/s over stock req/s, emulated device".into(),
            x: XAxis::Numeric {
                label: "offload latency (us)".into(),
                scale: Scale::Log,
            },
            y: YAxis {
                label: "speedup (x)".into(),
                scale: Scale::Log,
            },
            series,
            guides,
        }],
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn target_lines_read_back() {
        assert_eq!(
            super::target("- [FAIL] speedup vs block at 200 us >= 1.5x: 1.27x"),
            Some(("block".into(), 200.0, 1.5))
        );
        assert_eq!(super::target("- [PASS] wrong answers: 0"), None);
    }
}
