//! The model's prediction: what overlapping the wait would buy, what caps it, what it
//! was computed from, and what it would take.

use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Wrap};
use ratatui::Frame;

use crate::format;
use crate::model::PredictionView;

pub const TITLE: &str = "Prediction";

/// The panel's text, one entry per logical line (each may wrap). Built once and used
/// both for sizing and drawing so the two never disagree.
fn text(p: Option<&PredictionView>) -> Vec<Line<'static>> {
    let Some(p) = p else {
        return vec![Line::from(super::dim("no prediction yet"))];
    };
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let speed_color = match p.speedup {
        Some(s) if s >= 1.05 => Color::Green,
        Some(s) if s < 0.95 => Color::Red,
        _ => Color::Reset,
    };
    let mut out = vec![Line::from(vec![
        super::dim("speedup "),
        Span::styled(
            format::opt(p.speedup, format::speedup),
            bold.fg(speed_color),
        ),
        super::dim("  -> "),
        Span::styled(format::opt(p.predicted_rps, format::rate), bold),
        super::dim(" req/s"),
    ])];
    if !p.binding.is_empty() {
        out.push(Line::from(vec![
            super::dim("binding: "),
            Span::raw(p.binding.clone()),
        ]));
    }
    if let Some(stop) = &p.stop {
        let red = Style::default()
            .fg(Color::White)
            .bg(Color::Red)
            .add_modifier(Modifier::BOLD);
        out.push(Line::from(vec![
            Span::styled(" STOP ", red),
            Span::styled(format!(" {stop}"), Style::default().fg(Color::Red)),
        ]));
    }
    // The recipe before the inputs: when the panel is short, the inputs (details)
    // are what gets cut.
    if let Some(r) = &p.recipe {
        out.push(Line::from(vec![
            super::dim("recipe: "),
            Span::styled(r.clone(), Style::default().fg(Color::Cyan)),
        ]));
    }
    for (k, v) in &p.inputs {
        out.push(Line::from(vec![
            super::dim(format!("{k}: ")),
            Span::raw(v.clone()),
        ]));
    }
    out
}

/// Inner lines wanted at `width`.
pub fn lines(p: Option<&PredictionView>, width: u16) -> u16 {
    text(p)
        .iter()
        .map(|l| {
            let s: String = l.spans.iter().map(|s| s.content.as_ref()).collect();
            super::wrapped_lines(&s, width)
        })
        .sum()
}

pub fn render(f: &mut Frame, area: Rect, p: Option<&PredictionView>) {
    f.render_widget(
        Paragraph::new(text(p))
            .block(super::block(TITLE))
            .wrap(Wrap { trim: true }),
        area,
    );
}
