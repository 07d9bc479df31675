//! The verdict: can the fiber runtime overlap this server's waits, and the evidence.

use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Wrap};
use ratatui::Frame;

use crate::model::VerdictView;

pub const TITLE: &str = "Verdict";

fn headline(v: &VerdictView) -> String {
    let what = if v.fiberizable {
        "fiberizable"
    } else {
        "not fiberizable"
    };
    format!("{} ({what})", v.label)
}

/// Inner lines wanted at `width`: the headline, then "because" wrapped.
pub fn lines(v: Option<&VerdictView>, width: u16) -> u16 {
    match v {
        None => 1,
        Some(v) => {
            super::wrapped_lines(&headline(v), width)
                + super::wrapped_lines(&format!("because {}", v.because), width)
        }
    }
}

pub fn render(f: &mut Frame, area: Rect, v: Option<&VerdictView>) {
    let block = super::block(TITLE);
    let text: Vec<Line> = match v {
        None => vec![Line::from(super::dim("measuring..."))],
        Some(v) => {
            let color = if v.fiberizable {
                Color::Green
            } else {
                Color::Yellow
            };
            vec![
                Line::from(Span::styled(
                    headline(v),
                    Style::default().fg(color).add_modifier(Modifier::BOLD),
                )),
                Line::from(vec![super::dim("because "), Span::raw(v.because.clone())]),
            ]
        }
    };
    f.render_widget(
        Paragraph::new(text).block(block).wrap(Wrap { trim: true }),
        area,
    );
}
