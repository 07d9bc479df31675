//! The live charts over the history (requests/s, stall p50/p99, futex/request,
//! context switches/s, wakeup latency) and the latest window's stall histogram.
//!
//! Every chart cell is: title, one line of the latest values (coloured like the
//! series they name, which doubles as the legend), then the chart. Axis labels only
//! appear when the cell is big enough for them not to eat the plot.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Bar, BarChart, Chart, Dataset, GraphType, Paragraph};
use ratatui::Frame;

use crate::format;
use crate::history::History;
use crate::layout::ChartAreas;
use crate::model::WindowView;

pub const REQUESTS: &str = "Requests/s";
pub const STALL: &str = "Stall p50/p99";
pub const STALL_HIST: &str = "Stall histogram";
pub const FUTEX: &str = "Futex/req";
pub const SWITCHES: &str = "Switches/s";
pub const WAKEUP: &str = "Wakeup p50/p99";
pub const LATENCY: &str = "Latency (runtime) p50/p99/p99.9";

const P50: Color = Color::Cyan;
const P99: Color = Color::Magenta;
const P999: Color = Color::Red;

/// One line of a chart.
struct Series {
    color: Color,
    points: Vec<(f64, f64)>,
}

/// What one line chart shows; `values` and `extra` are about the latest window.
struct LineChart<'a> {
    title: &'a str,
    values: Line<'static>,
    extra: Option<Line<'static>>,
    series: Vec<Series>,
    y_label: fn(f64) -> String,
}

fn colored(s: String, c: Color) -> Span<'static> {
    Span::styled(s, Style::default().fg(c))
}

pub fn render(f: &mut Frame, a: &ChartAreas, h: &History) {
    let latest = h.latest();
    let t = h.t_bounds();
    let on = |f: fn(&WindowView) -> Option<f64>| latest.and_then(f);
    let waiting = || Line::from(super::dim("waiting for data"));
    let values = |spans: Vec<Span<'static>>| {
        if latest.is_some() {
            Line::from(spans)
        } else {
            waiting()
        }
    };

    let requests = LineChart {
        title: REQUESTS,
        values: values(vec![
            colored(
                format::rate(latest.map_or(0.0, |w| w.requests_per_sec)),
                Color::Green,
            ),
            Span::raw(" "),
            super::dim(latest.map_or(String::new(), |w| w.request_source.clone())),
        ]),
        extra: latest.map(|w| {
            Line::from(vec![
                super::dim("cpu/request "),
                Span::raw(format::opt(w.cpu_per_request_us, format::us)),
            ])
        }),
        series: vec![Series {
            color: Color::Green,
            points: h.series(|w| Some(w.requests_per_sec)),
        }],
        y_label: format::rate_short,
    };
    draw_line_chart(f, a.requests, &requests, t);

    let stall = LineChart {
        title: STALL,
        values: values(vec![
            colored(
                format!("p50 {}", format::opt(on(|w| w.stall_p50_us), format::us)),
                P50,
            ),
            Span::raw(" "),
            colored(
                format!("p99 {}", format::opt(on(|w| w.stall_p99_us), format::us)),
                P99,
            ),
        ]),
        extra: latest.map(|w| {
            Line::from(vec![
                super::dim("spinning "),
                Span::raw(format::opt(w.spin_share.map(|s| s * 100.0), |p| {
                    format!("{p:.0}%")
                })),
                super::dim(" of the stall"),
            ])
        }),
        series: vec![
            Series {
                color: P50,
                points: h.series(|w| w.stall_p50_us),
            },
            Series {
                color: P99,
                points: h.series(|w| w.stall_p99_us),
            },
        ],
        y_label: format::us,
    };
    draw_line_chart(f, a.stall, &stall, t);

    let futex = LineChart {
        title: FUTEX,
        values: values(vec![
            colored(
                format::opt(on(|w| w.futex_per_request), format::rate),
                Color::Blue,
            ),
            super::dim(" raw "),
            colored(
                format::opt(on(|w| w.raw_futex_per_request), format::rate),
                Color::Red,
            ),
        ]),
        extra: None,
        series: vec![
            Series {
                color: Color::Blue,
                points: h.series(|w| w.futex_per_request),
            },
            Series {
                color: Color::Red,
                points: h.series(|w| w.raw_futex_per_request),
            },
        ],
        y_label: format::rate_short,
    };
    draw_line_chart(f, a.futex, &futex, t);

    let switches = LineChart {
        title: SWITCHES,
        values: values(vec![
            colored(
                format!(
                    "vol {}",
                    format::rate_short(latest.map_or(0.0, |w| w.voluntary_per_sec))
                ),
                Color::Green,
            ),
            Span::raw(" "),
            colored(
                format!(
                    "inv {}",
                    format::rate_short(latest.map_or(0.0, |w| w.involuntary_per_sec))
                ),
                Color::Yellow,
            ),
        ]),
        extra: latest.map(|w| {
            Line::from(vec![
                super::dim("cost per switch "),
                Span::raw(format::opt(w.context_switch_us, format::us)),
            ])
        }),
        series: vec![
            Series {
                color: Color::Green,
                points: h.series(|w| Some(w.voluntary_per_sec)),
            },
            Series {
                color: Color::Yellow,
                points: h.series(|w| Some(w.involuntary_per_sec)),
            },
        ],
        y_label: format::rate_short,
    };
    draw_line_chart(f, a.switches, &switches, t);

    let wakeup = LineChart {
        title: WAKEUP,
        values: values(vec![
            colored(
                format!("p50 {}", format::opt(on(|w| w.wakeup_p50_us), format::us)),
                P50,
            ),
            Span::raw(" "),
            colored(
                format!("p99 {}", format::opt(on(|w| w.wakeup_p99_us), format::us)),
                P99,
            ),
        ]),
        extra: None,
        series: vec![
            Series {
                color: P50,
                points: h.series(|w| w.wakeup_p50_us),
            },
            Series {
                color: P99,
                points: h.series(|w| w.wakeup_p99_us),
            },
        ],
        y_label: format::us,
    };
    draw_line_chart(f, a.wakeup, &wakeup, t);

    draw_line_chart(f, a.latency, &latency_chart(h), t);

    draw_histogram(f, a.stall_hist, latest.map(|w| w.stall_hist.as_slice()));
}

/// The injected runtime's request latency: N/A while no window carried the
/// runtime's latency counters (a stock server), a dash for a window without requests.
fn latency_chart(h: &History) -> LineChart<'static> {
    let lat = |f: fn(&crate::model::LatencyView) -> Option<f64>| {
        move |w: &WindowView| w.latency.as_ref().and_then(f)
    };
    let latest = h.latest().and_then(|w| w.latency);
    let values = match (h.latest(), latest) {
        (None, _) => Line::from(super::dim("waiting for data")),
        (Some(_), None) => Line::from(vec![
            Span::raw(NA),
            super::dim(" (no runtime latency counters)"),
        ]),
        (Some(_), Some(l)) => Line::from(vec![
            colored(format!("p50 {}", format::opt(l.p50_us, format::us)), P50),
            Span::raw(" "),
            colored(format!("p99 {}", format::opt(l.p99_us, format::us)), P99),
            Span::raw(" "),
            colored(
                format!("p99.9 {}", format::opt(l.p999_us, format::us)),
                P999,
            ),
        ]),
    };
    LineChart {
        title: LATENCY,
        values,
        extra: latest.map(|l| {
            Line::from(vec![
                super::dim("readable to response; offload wait p50 "),
                Span::raw(format::opt(l.offload_wait_p50_us, format::us)),
            ])
        }),
        series: vec![
            Series {
                color: P50,
                points: h.series(lat(|l| l.p50_us)),
            },
            Series {
                color: P99,
                points: h.series(lat(|l| l.p99_us)),
            },
            Series {
                color: P999,
                points: h.series(lat(|l| l.p999_us)),
            },
        ],
        y_label: format::us,
    }
}

/// What the latency panel says where the counters carry no latency.
pub const NA: &str = "N/A";

/// Big enough for axis labels and the extra line without squeezing the plot.
fn roomy(r: Rect) -> bool {
    r.height >= 8 && r.width >= 30
}

fn draw_line_chart(f: &mut Frame, area: Rect, c: &LineChart, t: [f64; 2]) {
    let block = super::block(c.title);
    let inner = block.inner(area);
    f.render_widget(block, area);
    if inner.height == 0 {
        return;
    }
    let big = roomy(inner);
    let head = if big && c.extra.is_some() { 2 } else { 1 };
    let [head_area, plot] =
        Layout::vertical([Constraint::Length(head), Constraint::Min(0)]).areas(inner);
    let mut head_lines = vec![c.values.clone()];
    if head == 2 {
        head_lines.extend(c.extra.clone());
    }
    f.render_widget(Paragraph::new(head_lines), head_area);
    if plot.height == 0 {
        return;
    }

    let y_max = c
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max);
    // Headroom so the newest peak is not drawn on the border; a flat zero still
    // gets a unit axis.
    let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
    let datasets = c
        .series
        .iter()
        .map(|s| {
            // A line needs two points; the first window alone is drawn as a dot.
            let kind = if s.points.len() > 1 {
                GraphType::Line
            } else {
                GraphType::Scatter
            };
            Dataset::default()
                .marker(Marker::Braille)
                .graph_type(kind)
                .style(Style::default().fg(s.color))
                .data(&s.points)
        })
        .collect();
    let mut x = Axis::default().bounds(t);
    let mut y = Axis::default().bounds([0.0, y_max]);
    if big {
        let span = (t[1] - t[0]).max(0.0);
        x = x
            .labels([format!("-{span:.0}s"), "now".to_string()])
            .style(Style::default().fg(Color::DarkGray));
        y = y
            .labels(["0".to_string(), (c.y_label)(y_max)])
            .style(Style::default().fg(Color::DarkGray));
    }
    let chart = Chart::new(datasets)
        .x_axis(x)
        .y_axis(y)
        .legend_position(None);
    f.render_widget(chart, plot);
}

/// Drops empty buckets at both ends and merges neighbours until the bars fit `cols`
/// columns: a log2 histogram spans many decades, the interesting part is a few.
pub fn fit_buckets(hist: &[(f64, u64)], cols: usize) -> Vec<(f64, u64)> {
    let first = hist.iter().position(|b| b.1 > 0);
    let last = hist.iter().rposition(|b| b.1 > 0);
    let mut v: Vec<(f64, u64)> = match (first, last) {
        (Some(a), Some(b)) => hist[a..=b].to_vec(),
        _ => return Vec::new(),
    };
    let cols = cols.max(1);
    while v.len() > cols {
        v = v
            .chunks(2)
            .map(|c| (c[c.len() - 1].0, c.iter().map(|b| b.1).sum()))
            .collect();
    }
    v
}

fn draw_histogram(f: &mut Frame, area: Rect, hist: Option<&[(f64, u64)]>) {
    let block = super::block(STALL_HIST);
    let inner = block.inner(area);
    f.render_widget(block, area);
    if inner.height == 0 {
        return;
    }
    let [head, plot] = Layout::vertical([Constraint::Length(1), Constraint::Min(0)]).areas(inner);
    let all = fit_buckets(hist.unwrap_or(&[]), usize::MAX);
    let (Some(lo), Some(hi)) = (all.first(), all.last()) else {
        f.render_widget(Paragraph::new(super::dim("no stalls yet")), head);
        return;
    };
    let total: u64 = all.iter().map(|b| b.1).sum();
    let peak = all.iter().max_by_key(|b| b.1).map_or(0.0, |b| b.0);
    // The range in the values line, since narrow bars have no room for labels.
    f.render_widget(
        Paragraph::new(Line::from(vec![
            Span::raw(format!("{}..{}", format::bound(lo.0), format::bound(hi.0))),
            super::dim(" peak <="),
            Span::raw(format::bound(peak)),
            super::dim(format!(" n={}", format::rate_short(total as f64))),
        ])),
        head,
    );
    if plot.height == 0 {
        return;
    }
    // Tall cells get one labelled row per bucket (the bound on the left, the count
    // on the bar); short ones get vertical bars, merged until they fit.
    let chart = if usize::from(plot.height) >= all.len() && plot.width >= 20 {
        let gap = u16::from(usize::from(plot.height) >= 2 * all.len() - 1);
        let bars: Vec<Bar> = all
            .iter()
            .map(|&(ub, count)| {
                Bar::default()
                    .value(count)
                    .label(Line::from(format::bound(ub)))
                    .text_value(format::rate_short(count as f64))
            })
            .collect();
        BarChart::horizontal(bars).bar_width(1).bar_gap(gap)
    } else {
        let buckets = fit_buckets(&all, usize::from(plot.width));
        let n = buckets.len() as u16;
        let gap = if plot.width >= n * 3 { 1 } else { 0 };
        let width = ((plot.width + gap) / n).saturating_sub(gap).max(1);
        let bars: Vec<Bar> = buckets
            .iter()
            .map(|&(_, count)| {
                // Counts only where the bar is wide enough to carry them.
                let text = if width >= 5 {
                    format::rate_short(count as f64)
                } else {
                    String::new()
                };
                Bar::default().value(count).text_value(text)
            })
            .collect();
        BarChart::vertical(bars).bar_width(width).bar_gap(gap)
    };
    let chart = chart
        .bar_style(Style::default().fg(Color::Magenta))
        .value_style(Style::default().fg(Color::Black).bg(Color::Magenta));
    f.render_widget(chart, plot);
}

#[cfg(test)]
mod tests {
    use super::fit_buckets;

    #[test]
    fn buckets_trimmed_and_merged() {
        let h = [(1.0, 0), (2.0, 3), (4.0, 0), (8.0, 5), (16.0, 0)];
        assert_eq!(fit_buckets(&h, 10), vec![(2.0, 3), (4.0, 0), (8.0, 5)]);
        assert_eq!(fit_buckets(&h, 2), vec![(4.0, 3), (8.0, 5)]);
        assert!(fit_buckets(&[(1.0, 0)], 5).is_empty());
    }
}
