//! The header line: which process, on what runtime, and whether the charts are frozen.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use crate::model::Target;

/// One line, not a bordered box: at 80x24 every row counts, and the header is read at
/// a glance. "Target" still leads it, as the panel's title.
pub fn render(f: &mut Frame, area: Rect, t: &Target, paused: bool) {
    let title = Style::default()
        .fg(Color::Black)
        .bg(Color::Cyan)
        .add_modifier(Modifier::BOLD);
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let line = Line::from(vec![
        Span::styled(" Target ", title),
        Span::raw(" pid "),
        Span::styled(t.pid.to_string(), bold),
        Span::raw("  "),
        Span::styled(t.command.clone(), bold),
        super::dim("  runtime "),
        Span::raw(t.runtime.clone()),
        super::dim("  threads "),
        Span::raw(t.threads.to_string()),
    ]);
    let marker = " PAUSED ";
    let [left, right] = Layout::horizontal([
        Constraint::Min(0),
        Constraint::Length(if paused { marker.len() as u16 } else { 0 }),
    ])
    .areas(area);
    f.render_widget(Paragraph::new(line), left);
    if paused {
        let style = Style::default()
            .fg(Color::Black)
            .bg(Color::Yellow)
            .add_modifier(Modifier::BOLD);
        f.render_widget(Paragraph::new(Span::styled(marker, style)), right);
    }
}
