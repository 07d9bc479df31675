//! The dialogs drawn over the panels: the help, and the confirmation before an
//! injection (which relaunches the user's server, so it is never one key away).

use ratatui::layout::{Constraint, Flex, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Clear, Paragraph, Wrap};
use ratatui::Frame;

pub const HELP_TITLE: &str = "Help";
pub const CONFIRM_TITLE: &str = "Confirm";

/// A centered rectangle of at most `w` x `h`, clipped to `area`.
fn centered(area: Rect, w: u16, h: u16) -> Rect {
    let [r] = Layout::vertical([Constraint::Length(h.min(area.height))])
        .flex(Flex::Center)
        .areas(area);
    let [r] = Layout::horizontal([Constraint::Length(w.min(area.width))])
        .flex(Flex::Center)
        .areas(r);
    r
}

fn dialog(title: &str, border: Color) -> Block<'_> {
    Block::bordered()
        .title(Span::styled(
            title,
            Style::default().add_modifier(Modifier::BOLD),
        ))
        .border_style(Style::default().fg(border))
}

const HELP: &[(&str, &str)] = &[
    ("? Esc", "close this help"),
    ("i", "inject the fiber runtime (asks y/n first)"),
    ("p", "pause/resume: freeze the charts"),
    ("q ^C", "quit (the watched process keeps running)"),
    ("", ""),
    ("Verdict", "can the runtime overlap the waits, and why"),
    ("Requests/s", "request rate, and what counts as one"),
    ("Stall", "time waiting on the offload: p50/p99, histogram"),
    ("Futex/req", "futex calls per request; raw: below libc"),
    ("Switches/s", "voluntary / involuntary context switches"),
    ("Wakeup", "wakeup-to-run latency p50/p99"),
    ("Syscalls", "top by rate; threads: how many are inside it"),
    ("Prediction", "model's speedup, ceiling, inputs, recipe"),
    ("Injection", "before/after req/s, measured vs predicted"),
];

pub fn help(f: &mut Frame, area: Rect) {
    let key = Style::default()
        .fg(Color::Cyan)
        .add_modifier(Modifier::BOLD);
    let lines: Vec<Line> = HELP
        .iter()
        .map(|(k, v)| Line::from(vec![Span::styled(format!("{k:<11}"), key), Span::raw(*v)]))
        .collect();
    let r = centered(area, 62, lines.len() as u16 + 2);
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines).block(dialog(HELP_TITLE, Color::Cyan)),
        r,
    );
}

/// The question, plus a warning when the verdict says the runtime will not help or
/// the model put up a stop sign: the user decides, but sees why not first.
pub fn confirm_inject(f: &mut Frame, area: Rect, pid: u32, warning: Option<&str>) {
    let mut lines = vec![
        Line::from(format!("Inject the fiber runtime into pid {pid}? y/n")),
        Line::from(Span::styled(
            "The server is relaunched under LD_PRELOAD.",
            Style::default().fg(Color::DarkGray),
        )),
    ];
    if let Some(w) = warning {
        lines.push(Line::from(Span::styled(
            format!("Warning: {w}"),
            Style::default().fg(Color::Yellow),
        )));
    }
    let h = lines.len() as u16 + 2 + u16::from(warning.is_some());
    let r = centered(area, 56, h);
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines)
            .block(dialog(CONFIRM_TITLE, Color::Yellow))
            .wrap(Wrap { trim: true }),
        r,
    );
}
