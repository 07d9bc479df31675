//! What a chart shows, apart from how it is drawn: panels of series over axes. Each
//! benchmark's module builds one from its results file; render.rs draws it.

/// How an axis maps values to positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    Linear,
    /// Decades equally spaced; values must be positive.
    Log,
}

impl Scale {
    /// The value in the space the axis is linear in.
    pub fn to_axis(self, v: f64) -> f64 {
        match self {
            Scale::Linear => v,
            Scale::Log => v.log10(),
        }
    }

    pub fn value_at(self, a: f64) -> f64 {
        match self {
            Scale::Linear => a,
            Scale::Log => 10f64.powf(a),
        }
    }

    /// True where the value can be placed on this axis.
    pub fn fits(self, v: f64) -> bool {
        v.is_finite() && (self == Scale::Linear || v > 0.0)
    }
}

/// The x axis: numbers, or one slot per named category (0, 1, 2, ...).
#[derive(Clone, Debug, PartialEq)]
pub enum XAxis {
    Numeric { label: String, scale: Scale },
    Categories { label: String, names: Vec<String> },
}

impl XAxis {
    pub fn scale(&self) -> Scale {
        match self {
            XAxis::Numeric { scale, .. } => *scale,
            XAxis::Categories { .. } => Scale::Linear,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct YAxis {
    pub label: String,
    pub scale: Scale,
}

/// How a series is drawn; every series marks its data points with circles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// Circles joined by a line, in x order.
    Line,
    /// Circles only.
    Points,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    pub style: Style,
    /// The data points, (x, y) in data units (x: the category's index).
    pub points: Vec<(f64, f64)>,
}

/// What a panel draws besides its series.
#[derive(Clone, Debug, PartialEq)]
pub enum Guide {
    /// A horizontal line across the panel.
    HLine { y: f64, label: String },
    /// The band between y = lo * x and y = hi * x, and the line y = x.
    RatioBand { lo: f64, hi: f64, label: String },
    /// The line y = x.
    Diagonal { label: String },
    /// A marker (a cross) on a point of series `series`, labelled.
    Mark {
        series: usize,
        at: (f64, f64),
        label: String,
    },
    /// A triangle where a target lies, in the colour of series `series`.
    Target {
        series: usize,
        at: (f64, f64),
        label: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    pub title: String,
    pub x: XAxis,
    pub y: YAxis,
    pub series: Vec<Series>,
    pub guides: Vec<Guide>,
}

/// A chart: one or more panels side by side under a caption.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    pub caption: String,
    pub panels: Vec<Panel>,
}

impl Panel {
    /// The data range the panel spans on x and y, in axis space, with a margin.
    pub fn ranges(&self) -> ((f64, f64), (f64, f64)) {
        let (xs, ys) = (self.x.scale(), self.y.scale);
        let mut x: Vec<f64> = Vec::new();
        let mut y: Vec<f64> = Vec::new();
        for s in &self.series {
            for &(a, b) in &s.points {
                if xs.fits(a) && ys.fits(b) {
                    x.push(xs.to_axis(a));
                    y.push(ys.to_axis(b));
                }
            }
        }
        for g in &self.guides {
            match g {
                Guide::HLine { y: v, .. } if ys.fits(*v) => y.push(ys.to_axis(*v)),
                Guide::Target { at, .. } | Guide::Mark { at, .. }
                    if xs.fits(at.0) && ys.fits(at.1) =>
                {
                    x.push(xs.to_axis(at.0));
                    y.push(ys.to_axis(at.1));
                }
                _ => {}
            }
        }
        if let XAxis::Categories { names, .. } = &self.x {
            x.push(-0.5);
            x.push(names.len() as f64 - 0.5);
        }
        if self
            .guides
            .iter()
            .any(|g| matches!(g, Guide::RatioBand { .. }))
        {
            // Predicted against measured: one range on both axes, so that equality
            // is the diagonal.
            x.extend_from_slice(&y);
            y.clone_from(&x);
        }
        (padded(&x, &self.x), padded_y(&y))
    }
}

fn bounds(v: &[f64]) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if lo.is_finite() && hi.is_finite() {
        (lo, hi)
    } else {
        (0.0, 1.0)
    }
}

fn padded(v: &[f64], x: &XAxis) -> (f64, f64) {
    let (lo, hi) = bounds(v);
    match x {
        XAxis::Categories { .. } => (lo, hi),
        XAxis::Numeric { .. } => pad(lo, hi),
    }
}

fn padded_y(v: &[f64]) -> (f64, f64) {
    let (lo, hi) = bounds(v);
    let (lo, hi) = pad(lo, hi);
    // Headroom above the data for the legend in the upper left.
    (lo, hi + (hi - lo) * 0.45)
}

fn pad(lo: f64, hi: f64) -> (f64, f64) {
    let span = if hi > lo { hi - lo } else { 1.0 };
    (lo - span * 0.06, hi + span * 0.06)
}

/// Tick positions in axis space: decades (and 2, 5 between where few decades show)
/// on a log axis, round steps on a linear one.
pub fn ticks(scale: Scale, (lo, hi): (f64, f64)) -> Vec<f64> {
    match scale {
        Scale::Log => {
            let mut t = Vec::new();
            let few = hi - lo < 2.5;
            let mut d = lo.floor() as i32;
            while f64::from(d) <= hi {
                for m in [1.0f64, 2.0, 5.0] {
                    let a = f64::from(d) + m.log10();
                    if (m == 1.0 || few) && a >= lo && a <= hi {
                        t.push(a);
                    }
                }
                d += 1;
            }
            t
        }
        Scale::Linear => {
            let raw = (hi - lo) / 6.0;
            let mag = 10f64.powf(raw.log10().floor());
            let step = [1.0, 2.0, 2.5, 5.0, 10.0]
                .iter()
                .map(|m| m * mag)
                .find(|s| *s >= raw)
                .unwrap_or(10.0 * mag);
            let mut t = Vec::new();
            let mut v = (lo / step).ceil() * step;
            while v <= hi + step * 1e-9 {
                t.push(v);
                v += step;
            }
            t
        }
    }
}

/// A tick label: compact, readable back as the same number (K, M suffixes).
pub fn tick_label(v: f64) -> String {
    let a = v.abs();
    let (x, suffix) = if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e3 {
        (v / 1e3, "K")
    } else {
        (v, "")
    };
    let s = if (x - x.round()).abs() < 1e-6 * x.abs().max(1.0) {
        format!("{}", x.round())
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.3}")
    };
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    };
    format!("{s}{suffix}")
}

/// The number a tick label stands for (the inverse of tick_label).
#[cfg(test)]
pub fn parse_tick(s: &str) -> Option<f64> {
    let s = s.trim();
    let (num, mul) = if let Some(n) = s.strip_suffix('M') {
        (n, 1e6)
    } else if let Some(n) = s.strip_suffix('K') {
        (n, 1e3)
    } else {
        (s, 1.0)
    };
    num.parse::<f64>().ok().map(|v| v * mul)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_labels_read_back_as_their_values() {
        for v in [
            1.0, 2.0, 0.5, 20.0, 200.0, 1000.0, 2500.0, 1e5, 2e6, 0.97, 1.5,
        ] {
            let l = tick_label(v);
            let back = parse_tick(&l).unwrap();
            assert!((back / v - 1.0).abs() < 1e-2, "{v} -> {l} -> {back}");
        }
        assert_eq!(tick_label(1000.0), "1K");
        assert_eq!(tick_label(250.0), "250");
    }

    #[test]
    fn log_ticks_are_decades_in_range() {
        let t = ticks(Scale::Log, (1.9, 5.2));
        let want = [2.0, 3.0, 4.0, 5.0];
        assert_eq!(t.len(), want.len(), "{t:?}");
        for (a, b) in t.iter().zip(want) {
            assert!((a - b).abs() < 1e-9, "{t:?}");
        }
        // Narrow spans get 2 and 5 between decades.
        assert!(ticks(Scale::Log, (0.0, 1.0)).len() >= 3);
    }

    #[test]
    fn linear_ticks_are_round_and_cover_the_range() {
        let t = ticks(Scale::Linear, (0.0, 1.0));
        assert!(t.len() >= 4 && t.len() <= 11, "{t:?}");
        assert!(t.windows(2).all(|w| w[1] > w[0]));
        assert!(t[0] >= 0.0 && *t.last().unwrap() <= 1.0 + 1e-9);
    }
}
