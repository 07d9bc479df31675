//! The charts checked by reading the SVG back, not by pixels: per panel, the axes'
//! titles and tick labels (which must place their values consistently), one legend
//! entry and one colour of circles per series, and every circle read back through the
//! ticks equal to a data point of the results file.

use super::plot::{self, Chart, XAxis};
use super::render;
use super::{table, Bench};

struct Text {
    x: f64,
    y: f64,
    anchor: String,
    rotated: bool,
    body: String,
}

struct Svg {
    width: f64,
    texts: Vec<Text>,
    /// (cx, cy, fill)
    circles: Vec<(f64, f64, String)>,
}

fn parse(svg: &str) -> Svg {
    let doc = roxmltree::Document::parse(svg).expect("the SVG is XML");
    let root = doc.root_element();
    let num = |n: roxmltree::Node, a: &str| n.attribute(a).and_then(|v| v.parse::<f64>().ok());
    let width = num(root, "width").expect("svg width");
    let mut texts = Vec::new();
    let mut circles = Vec::new();
    for n in root.descendants().filter(|n| n.is_element()) {
        match n.tag_name().name() {
            "text" => texts.push(Text {
                x: num(n, "x").unwrap_or(f64::NAN),
                y: num(n, "y").unwrap_or(f64::NAN),
                anchor: n.attribute("text-anchor").unwrap_or("").to_string(),
                rotated: n.attribute("transform").is_some(),
                body: n.text().unwrap_or("").trim().to_string(),
            }),
            "circle" => circles.push((
                num(n, "cx").expect("cx"),
                num(n, "cy").expect("cy"),
                n.attribute("fill").unwrap_or("").to_string(),
            )),
            _ => {}
        }
    }
    Svg {
        width,
        texts,
        circles,
    }
}

/// pixel = a + b * axis value, fitted by least squares over the ticks; the fit must
/// be exact to a pixel (the labels say where their values are).
fn fit(pairs: &[(f64, f64)]) -> (f64, f64) {
    assert!(pairs.len() >= 2, "fewer than 2 tick labels: {pairs:?}");
    let n = pairs.len() as f64;
    let (sv, sp) = pairs
        .iter()
        .fold((0.0, 0.0), |(a, b), &(v, p)| (a + v, b + p));
    let (mv, mp) = (sv / n, sp / n);
    let cov: f64 = pairs.iter().map(|&(v, p)| (v - mv) * (p - mp)).sum();
    let var: f64 = pairs.iter().map(|&(v, _)| (v - mv).powi(2)).sum();
    let b = cov / var;
    let a = mp - b * mv;
    for &(v, p) in pairs {
        assert!(
            (a + b * v - p).abs() <= 1.5,
            "tick at {p} off the axis fit: {pairs:?}"
        );
    }
    (a, b)
}

fn check_panel(svg: &Svg, chart: &Chart, i: usize) {
    let panel = &chart.panels[i];
    let w = svg.width / chart.panels.len() as f64;
    let inside = |x: f64| x >= w * i as f64 && x < w * (i + 1) as f64;
    let texts: Vec<&Text> = svg.texts.iter().filter(|t| inside(t.x)).collect();
    let has = |s: &str| texts.iter().any(|t| t.body == s);
    let (x_label, y_label) = match &panel.x {
        XAxis::Numeric { label, .. } | XAxis::Categories { label, .. } => {
            (label.as_str(), panel.y.label.as_str())
        }
    };
    assert!(
        has(x_label) && has(y_label),
        "axis titles of {:?}",
        panel.title
    );
    assert!(has(&panel.title), "panel title {:?}", panel.title);
    // Tick labels: x's centred below the plot, y's right-aligned left of it.
    let x_ticks: Vec<(f64, f64)> = match &panel.x {
        XAxis::Numeric { scale, .. } => texts
            .iter()
            .filter(|t| t.anchor == "middle" && !t.rotated)
            .filter_map(|t| Some((scale.to_axis(plot::parse_tick(&t.body)?), t.x)))
            .collect(),
        XAxis::Categories { names, .. } => names
            .iter()
            .enumerate()
            .map(|(k, n)| {
                let t = texts
                    .iter()
                    .find(|t| &t.body == n)
                    .unwrap_or_else(|| panic!("category {n:?} not labelled"));
                (k as f64, t.x)
            })
            .collect(),
    };
    let y_ticks: Vec<(f64, f64)> = texts
        .iter()
        .filter(|t| t.anchor == "end")
        .filter_map(|t| Some((panel.y.scale.to_axis(plot::parse_tick(&t.body)?), t.y)))
        .collect();
    let (xa, xb) = fit(&x_ticks);
    let (ya, yb) = fit(&y_ticks);
    assert!(xb > 0.0 && yb < 0.0, "x grows rightwards, y upwards");
    let xs = panel.x.scale();
    let mut colours = std::collections::BTreeSet::new();
    for (k, s) in panel.series.iter().enumerate() {
        assert!(has(&s.name), "legend entry {:?}", s.name);
        let fill = render::svg_color(k);
        let mut circles: Vec<(f64, f64)> = svg
            .circles
            .iter()
            .filter(|c| inside(c.0) && c.2 == fill)
            .map(|c| (c.0, c.1))
            .collect();
        let want: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|p| xs.fits(p.0) && panel.y.scale.fits(p.1))
            .map(|&(x, y)| (xa + xb * xs.to_axis(x), ya + yb * panel.y.scale.to_axis(y)))
            .collect();
        assert_eq!(circles.len(), want.len(), "{}: circles vs points", s.name);
        for p in want {
            let d = |c: &(f64, f64)| (c.0 - p.0).hypot(c.1 - p.1);
            let j = (0..circles.len())
                .filter(|&j| d(&circles[j]) <= 2.0)
                .min_by(|&a, &b| d(&circles[a]).total_cmp(&d(&circles[b])))
                .unwrap_or_else(|| panic!("{}: no circle at {p:?}", s.name));
            circles.swap_remove(j);
        }
        if !s.points.is_empty() {
            colours.insert(fill);
        }
    }
    let drawn: std::collections::BTreeSet<String> = svg
        .circles
        .iter()
        .filter(|c| inside(c.0))
        .map(|c| c.2.clone())
        .collect();
    assert_eq!(drawn, colours, "one colour of circles per series");
}

fn results(name: &str) -> String {
    std::fs::read_to_string(crate::paths::results().join(name)).expect("results file")
}

#[test]
fn every_chart_reads_back_as_its_data() {
    for b in Bench::ALL {
        let chart = b.chart(&results(b.source())).unwrap();
        let svg = parse(&render::svg(&chart).unwrap());
        assert!(!chart.panels.is_empty(), "{b:?}");
        for i in 0..chart.panels.len() {
            check_panel(&svg, &chart, i);
        }
    }
}

#[test]
fn the_checked_in_charts_are_drawn_from_the_checked_in_results() {
    for b in Bench::ALL {
        let chart = b.chart(&results(b.source())).unwrap();
        assert!(
            results(b.svg_name()) == render::svg(&chart).unwrap(),
            "{} is stale: run `cargo xtask charts`",
            b.svg_name()
        );
    }
}

#[test]
fn the_openloop_chart_has_p50_and_p99_of_every_configuration_as_in_the_csv() {
    let csv = table::csv(&results("openloop.csv")).unwrap();
    let chart = Bench::Openloop.chart(&results("openloop.csv")).unwrap();
    let (lat, mode) = (csv.col("offload_us").unwrap(), csv.col("mode").unwrap());
    for panel in &chart.panels {
        let l = panel.title.split(' ').next().unwrap();
        let rows: Vec<&Vec<String>> = csv.rows.iter().filter(|r| r[lat] == l).collect();
        let mut modes: Vec<&str> = rows.iter().map(|r| r[mode].as_str()).collect();
        modes.dedup();
        assert_eq!(panel.series.len(), 2 * modes.len(), "{}", panel.title);
        for m in modes {
            for (q, col) in [("p50", "p50_us"), ("p99", "p99_us")] {
                let s = panel
                    .series
                    .iter()
                    .find(|s| s.name == format!("{m} {q}"))
                    .unwrap();
                let c = csv.col(col).unwrap();
                let off = csv.col("offered").unwrap();
                let want: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|r| r[mode] == m)
                    .map(|r| (r[off].parse().unwrap(), r[c].parse().unwrap()))
                    .collect();
                assert_eq!(s.points, want, "{m} {q}");
            }
        }
    }
    // A knee is marked wherever the CSV has one.
    let knees = csv
        .column("knee")
        .unwrap()
        .iter()
        .filter(|k| **k == "1")
        .count();
    let marks: usize = chart
        .panels
        .iter()
        .map(|p| {
            p.guides
                .iter()
                .filter(|g| matches!(g, plot::Guide::Mark { .. }))
                .count()
        })
        .sum();
    assert_eq!(marks, knees);
}

#[test]
fn a_wrong_point_fails_the_read_back() {
    // The check can fail: a chart drawn from other data does not match this one.
    let chart = Bench::Runtime.chart(&results("runtime.md")).unwrap();
    let mut moved = chart.clone();
    moved.panels[0].series[0].points[0].1 *= 3.0;
    let svg = parse(&render::svg(&moved).unwrap());
    let r = std::panic::catch_unwind(|| check_panel(&svg, &chart, 0));
    assert!(r.is_err());
}
