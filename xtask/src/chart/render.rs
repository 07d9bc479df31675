//! Drawing a Chart as SVG with plotters (its SVG backend and built-in text layout: no
//! system fonts or libraries). Both axes are drawn in axis space (log10 of the value
//! on a log axis) with ticks placed by plot::ticks and labelled with the values.

use super::plot::{self, Chart, Guide, Panel, Scale, Style, XAxis};
use plotters::coord::Shift;
use plotters::prelude::*;

const PANEL_W: u32 = 640;
const HEIGHT: u32 = 480;

/// Series colours, in series order (the SVG test finds a series by its colour).
pub const PALETTE: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];

pub fn color(series: usize) -> RGBColor {
    PALETTE[series % PALETTE.len()]
}

/// The colour as the SVG writes it.
#[cfg(test)]
pub fn svg_color(series: usize) -> String {
    let RGBColor(r, g, b) = color(series);
    format!("#{r:02X}{g:02X}{b:02X}")
}

/// An axis in axis space with its ticks where plot::ticks put them (plotters' own
/// ranges pick their own ticks, and its key-point wrapper cannot take a formatter).
#[derive(Clone)]
struct Ticked {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
}

impl plotters::coord::ranged1d::Ranged for Ticked {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let share = (v - self.lo) / (self.hi - self.lo);
        limit.0 + (f64::from(limit.1 - limit.0) * share + 1e-3).floor() as i32
    }

    fn key_points<H: plotters::coord::ranged1d::KeyPointHint>(&self, hint: H) -> Vec<f64> {
        // Bold lines at the ticks, no light lines between.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("drawing the chart: {e}")
}

pub fn svg(chart: &Chart) -> Result<String, String> {
    let n = chart.panels.len().max(1);
    // Room for category names under the axis: about 120 px each.
    let panel_w = chart
        .panels
        .iter()
        .map(|p| match &p.x {
            XAxis::Categories { names, .. } => 120 * names.len() as u32 + 100,
            XAxis::Numeric { .. } => PANEL_W,
        })
        .fold(PANEL_W, u32::max);
    let mut out = String::new();
    {
        let root =
            SVGBackend::with_string(&mut out, (panel_w * n as u32, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let root = root
            .titled(&chart.caption, ("sans-serif", 18))
            .map_err(err)?;
        for (area, panel) in root.split_evenly((1, n)).iter().zip(&chart.panels) {
            draw_panel(area, panel)?;
        }
        root.present().map_err(err)?;
    }
    Ok(out)
}

fn to_axis(panel: &Panel, (x, y): (f64, f64)) -> Option<(f64, f64)> {
    let (xs, ys) = (panel.x.scale(), panel.y.scale);
    (xs.fits(x) && ys.fits(y)).then(|| (xs.to_axis(x), ys.to_axis(y)))
}

fn draw_panel(area: &DrawingArea<SVGBackend, Shift>, panel: &Panel) -> Result<(), String> {
    let ((x0, x1), (y0, y1)) = panel.ranges();
    let (x_label, x_ticks) = match &panel.x {
        XAxis::Numeric { label, scale } => (label.clone(), plot::ticks(*scale, (x0, x1))),
        XAxis::Categories { label, names } => {
            (label.clone(), (0..names.len()).map(|i| i as f64).collect())
        }
    };
    let y_ticks = plot::ticks(panel.y.scale, (y0, y1));
    let mut c = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 15))
        .margin(14)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(
            Ticked {
                lo: x0,
                hi: x1,
                ticks: x_ticks,
            },
            Ticked {
                lo: y0,
                hi: y1,
                ticks: y_ticks,
            },
        )
        .map_err(err)?;
    let x_fmt = |v: &f64| match &panel.x {
        XAxis::Numeric { scale, .. } => plot::tick_label(scale.value_at(*v)),
        XAxis::Categories { names, .. } => names
            .get(v.round().max(0.0) as usize)
            .cloned()
            .unwrap_or_default(),
    };
    let ys = panel.y.scale;
    let y_fmt = |v: &f64| plot::tick_label(ys.value_at(*v));
    c.configure_mesh()
        .x_desc(x_label)
        .y_desc(panel.y.label.as_str())
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(err)?;

    // Bands first, so that lines and points lie on top of them.
    for g in &panel.guides {
        if let Guide::RatioBand { lo, hi, label } = g {
            let at = |k: f64, x: f64| match (panel.x.scale(), ys) {
                (Scale::Log, Scale::Log) => x + k.log10(),
                _ => k * x,
            };
            let band = vec![
                (x0, at(*lo, x0)),
                (x1, at(*lo, x1)),
                (x1, at(*hi, x1)),
                (x0, at(*hi, x0)),
            ];
            c.draw_series(std::iter::once(Polygon::new(
                band,
                BLACK.mix(0.08).filled(),
            )))
            .map_err(err)?
            .label(label.as_str())
            .legend(|(x, y)| {
                Rectangle::new([(x, y - 5), (x + 12, y + 5)], BLACK.mix(0.15).filled())
            });
            c.draw_series(LineSeries::new(
                vec![(x0, at(1.0, x0)), (x1, at(1.0, x1))],
                BLACK.stroke_width(1),
            ))
            .map_err(err)?
            .label("equal")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 12, y)], BLACK));
        }
    }
    for (i, s) in panel.series.iter().enumerate() {
        let col = color(i);
        let mut pts: Vec<(f64, f64)> = s.points.iter().filter_map(|&p| to_axis(panel, p)).collect();
        if s.style == Style::Line {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))
                .map_err(err)?;
        }
        c.draw_series(pts.iter().map(|&p| Circle::new(p, 4, col.filled())))
            .map_err(err)?
            .label(s.name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], col.filled()));
    }
    let mut target_legend = false;
    for g in &panel.guides {
        match g {
            Guide::HLine { y, label } if ys.fits(*y) => {
                let y = ys.to_axis(*y);
                c.draw_series(DashedLineSeries::new(
                    vec![(x0, y), (x1, y)],
                    6,
                    4,
                    BLACK.mix(0.6).stroke_width(1),
                ))
                .map_err(err)?;
                c.draw_series(std::iter::once(Text::new(
                    label.clone(),
                    (x0 + (x1 - x0) * 0.01, y),
                    ("sans-serif", 11),
                )))
                .map_err(err)?;
            }
            Guide::Mark { series, at, label } => {
                if let Some(p) = to_axis(panel, *at) {
                    let col = color(*series);
                    c.draw_series(std::iter::once(Cross::new(p, 7, col.stroke_width(2))))
                        .map_err(err)?;
                    // A few pixels up and right of the point, clear of its marker.
                    c.draw_series(std::iter::once(
                        EmptyElement::at(p)
                            + Text::new(
                                label.clone(),
                                (8, -14),
                                ("sans-serif", 11).into_font().color(&col),
                            ),
                    ))
                    .map_err(err)?;
                }
            }
            Guide::Target { series, at, label } => {
                if let Some(p) = to_axis(panel, *at) {
                    let col = color(*series);
                    let a = c
                        .draw_series(std::iter::once(TriangleMarker::new(
                            p,
                            7,
                            col.stroke_width(2),
                        )))
                        .map_err(err)?;
                    if !target_legend {
                        target_legend = true;
                        a.label("target (triangle)").legend(|(x, y)| {
                            TriangleMarker::new((x + 6, y), 6, BLACK.stroke_width(2))
                        });
                    }
                    // A few pixels up and right of the point, clear of its marker.
                    c.draw_series(std::iter::once(
                        EmptyElement::at(p)
                            + Text::new(
                                label.clone(),
                                (8, -14),
                                ("sans-serif", 11).into_font().color(&col),
                            ),
                    ))
                    .map_err(err)?;
                }
            }
            Guide::Diagonal { label } => {
                c.draw_series(LineSeries::new(vec![(x0, x0), (x1, x1)], BLACK.mix(0.6)))
                    .map_err(err)?
                    .label(label.as_str())
                    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 12, y)], BLACK));
            }
            Guide::HLine { .. } | Guide::RatioBand { .. } => {}
        }
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 12))
        .draw()
        .map_err(err)?;
    Ok(())
}
