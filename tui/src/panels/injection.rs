//! The injection: old -> new process, req/s before and after, the measured speedup
//! against the predicted one, and (once the runtime runs) its conflict guard.

use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Wrap};
use ratatui::Frame;

use crate::format;
use crate::model::{GuardView, InjectionView};

pub const TITLE: &str = "Injection";

fn pid(p: Option<u32>) -> String {
    p.map_or_else(|| "-".into(), |p| p.to_string())
}

/// Measured speedup: after / before, when both were measured.
pub fn measured(i: &InjectionView) -> Option<f64> {
    match (i.before_rps, i.after_rps) {
        (Some(b), Some(a)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn text(i: Option<&InjectionView>, g: Option<&GuardView>, width: u16) -> Vec<Line<'static>> {
    // At 80 columns the panel is 30 wide: "predicted" would wrap the line.
    let predicted = if width < 40 {
        " (pred "
    } else {
        " (predicted "
    };
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let mut out = match i {
        None => vec![Line::from(vec![
            super::dim("not injected; "),
            Span::styled("i", bold.fg(Color::Cyan)),
            super::dim(" to inject"),
        ])],
        Some(i) => vec![
            Line::from(vec![
                super::dim("state "),
                Span::styled(i.state.clone(), bold),
            ]),
            Line::from(vec![
                super::dim("pid "),
                Span::raw(pid(i.old_pid)),
                super::dim(" -> "),
                Span::raw(pid(i.new_pid)),
            ]),
            Line::from(vec![
                super::dim("req/s "),
                Span::raw(format::opt(i.before_rps, format::rate)),
                super::dim(" -> "),
                Span::styled(format::opt(i.after_rps, format::rate), bold),
            ]),
            Line::from(vec![
                super::dim("speedup "),
                Span::styled(format::opt(measured(i), format::speedup), bold),
                super::dim(predicted),
                Span::raw(format::opt(i.predicted_speedup, format::speedup)),
                super::dim(")"),
            ]),
        ],
    };
    if let Some(g) = g {
        // Faults and conflicts are the guard catching the one hazard fibers add;
        // any at all deserves colour.
        let hot = if g.faults + g.conflicts > 0 {
            Color::Yellow
        } else {
            Color::Green
        };
        out.push(Line::from(vec![
            super::dim("guard "),
            Span::styled(g.mode.clone(), bold),
            super::dim(": "),
            Span::styled(format!("{} faults", g.faults), Style::default().fg(hot)),
            Span::raw(" "),
            Span::styled(
                format!("{} conflicts", g.conflicts),
                Style::default().fg(hot),
            ),
            Span::raw(format!(" {} serialized", g.serialized)),
        ]));
    }
    out
}

/// Inner lines wanted at `width`.
pub fn lines(i: Option<&InjectionView>, g: Option<&GuardView>, width: u16) -> u16 {
    text(i, g, width)
        .iter()
        .map(|l| {
            let s: String = l.spans.iter().map(|s| s.content.as_ref()).collect();
            super::wrapped_lines(&s, width)
        })
        .sum()
}

pub fn render(f: &mut Frame, area: Rect, i: Option<&InjectionView>, g: Option<&GuardView>) {
    f.render_widget(
        Paragraph::new(text(i, g, area.width.saturating_sub(2)))
            .block(super::block(TITLE))
            .wrap(Wrap { trim: true }),
        area,
    );
}
