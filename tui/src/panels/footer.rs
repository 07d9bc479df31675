//! The footer: the keys, and the watcher's one-line status on the right.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

pub const KEYS: &str = "? help  i inject  p pause  q quit";

pub fn render(f: &mut Frame, area: Rect, status: &str) {
    let key = Style::default()
        .fg(Color::Cyan)
        .add_modifier(Modifier::BOLD);
    // The keys drawn as "?" + " help" etc. so the letter stands out; the plain
    // text is still exactly KEYS.
    let mut spans = vec![Span::raw(" ")];
    for (i, part) in KEYS.split("  ").enumerate() {
        if i > 0 {
            spans.push(Span::raw("  "));
        }
        let (k, rest) = part.split_at(1);
        spans.push(Span::styled(k.to_string(), key));
        spans.push(Span::raw(rest.to_string()));
    }
    let keys_w = KEYS.len() as u16 + 1;
    let [left, right] =
        Layout::horizontal([Constraint::Length(keys_w), Constraint::Min(0)]).areas(area);
    f.render_widget(Paragraph::new(Line::from(spans)), left);
    let status = Line::from(Span::styled(
        format!("{status} "),
        Style::default().fg(Color::Yellow),
    ))
    .right_aligned();
    f.render_widget(Paragraph::new(status), right);
}
