//! The syscall profile of the latest window: the top calls by rate.

use ratatui::layout::{Constraint, Flex, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row, Table};
use ratatui::Frame;

use crate::format;
use crate::model::SyscallView;

pub const TITLE: &str = "Syscalls";

/// Rows sorted by rate, highest first (the watcher's order is not relied on), as many
/// as fit under the header.
pub fn render(f: &mut Frame, area: Rect, calls: Option<&[SyscallView]>) {
    let block = super::block(TITLE);
    let inner = block.inner(area);
    f.render_widget(block, area);
    let calls = match calls {
        Some(c) if !c.is_empty() => c,
        _ => {
            f.render_widget(Paragraph::new(super::dim("no syscalls yet")), inner);
            return;
        }
    };
    let mut sorted: Vec<&SyscallView> = calls.iter().collect();
    sorted.sort_by(|a, b| b.per_sec.total_cmp(&a.per_sec));
    // Wide panels also get rate x mean: how many threads are inside the call at any
    // moment. A rare but slow call can cost more than a frequent fast one.
    let wide = inner.width >= 40;
    let room = usize::from(inner.height.saturating_sub(1));
    let right = |s: String| Cell::from(Line::from(s).right_aligned());
    let rows = sorted.into_iter().take(room).map(|c| {
        let mut cells = vec![
            Cell::from(c.name.clone()),
            right(format::rate_short(c.per_sec)),
            right(format::us(c.mean_us)),
        ];
        if wide {
            cells.push(right(format!("{:.2}", c.per_sec * c.mean_us / 1e6)));
        }
        Row::new(cells)
    });
    let mut header = vec![
        Cell::from("syscall"),
        right("/s".into()),
        right("mean".into()),
    ];
    let mut widths = vec![
        if wide {
            Constraint::Length(20)
        } else {
            Constraint::Min(8)
        },
        Constraint::Length(8),
        Constraint::Length(8),
    ];
    if wide {
        header.push(right("threads".into()));
        widths.push(Constraint::Length(8));
    }
    let header = Row::new(header).style(Style::default().add_modifier(Modifier::BOLD));
    let table = Table::new(rows, widths)
        .header(header)
        .column_spacing(1)
        .flex(Flex::Start);
    f.render_widget(table, inner);
}
