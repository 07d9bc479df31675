//! One module per panel. Each has `render(frame, area, ...)`; the ones whose height
//! depends on their content also say how many inner lines they want, so the layout
//! can give room where there is text and the rest to the charts.

pub mod charts;
pub mod footer;
pub mod injection;
pub mod prediction;
pub mod processes;
pub mod syscalls;
pub mod target;
pub mod verdict;

use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Span;
use ratatui::widgets::Block;

/// A bordered panel with its title in bold: the titles are how the user (and the
/// tmux tests) find a panel, so they are drawn the same everywhere.
pub fn block(title: &str) -> Block<'_> {
    Block::bordered()
        .title(Span::styled(
            title,
            Style::default().add_modifier(Modifier::BOLD),
        ))
        .border_style(Style::default().fg(Color::DarkGray))
}

/// Dimmed text for labels and "not yet" placeholders.
pub fn dim(s: impl Into<String>) -> Span<'static> {
    Span::styled(s.into(), Style::default().fg(Color::DarkGray))
}

/// Lines `text` takes when word-wrapped at `width`: an estimate of what
/// `Paragraph::wrap` does (its own count is behind an unstable feature), close
/// enough to size a panel.
pub fn wrapped_lines(text: &str, width: u16) -> u16 {
    let width = usize::from(width.max(1));
    let mut lines = 0u16;
    for para in text.split('\n') {
        let mut col = 0usize;
        lines = lines.saturating_add(1);
        for word in para.split_whitespace() {
            let len = word.chars().count();
            if col > 0 && col + 1 + len > width {
                lines = lines.saturating_add(1);
                col = 0;
            }
            // A word longer than the line is cut across lines.
            let len = if col == 0 && len > width {
                lines = lines.saturating_add(((len - 1) / width) as u16);
                (len - 1) % width + 1
            } else {
                len
            };
            col += if col > 0 { len + 1 } else { len };
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::wrapped_lines;

    #[test]
    fn wrap_estimate() {
        assert_eq!(wrapped_lines("", 10), 1);
        assert_eq!(wrapped_lines("abc def", 7), 1);
        assert_eq!(wrapped_lines("abc def", 6), 2);
        assert_eq!(wrapped_lines("abcdefghij", 4), 3);
        assert_eq!(wrapped_lines("a\nb", 10), 2);
    }
}
