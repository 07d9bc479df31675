//! A watched service's processes: who serves and how (a master idle, its workers
//! event loops), busiest first after the main one, as many as fit.

use ratatui::layout::{Constraint, Flex, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Row, Table};
use ratatui::Frame;

use crate::format;
use crate::model::ProcessView;

pub const TITLE: &str = "Processes";

pub fn render(f: &mut Frame, area: Rect, procs: &[ProcessView]) {
    let block = super::block(TITLE);
    let inner = block.inner(area);
    f.render_widget(block, area);
    let room = usize::from(inner.height.saturating_sub(1));
    let right = |s: String| Cell::from(Line::from(s).right_aligned());
    let rows = procs.iter().take(room).map(|p| {
        Row::new(vec![
            right(p.pid.to_string()),
            Cell::from(if p.role == "main" {
                format!("{}*", p.comm)
            } else {
                p.comm.clone()
            }),
            Cell::from(p.model.clone()),
            right(format::rate_short(p.reads_per_sec)),
            right(p.connections.to_string()),
        ])
    });
    let header = Row::new(vec![
        right("pid".into()),
        Cell::from("comm"),
        Cell::from("serves as"),
        right("reads/s".into()),
        right("conns".into()),
    ])
    .style(Style::default().add_modifier(Modifier::BOLD));
    let widths = [
        Constraint::Length(7),
        Constraint::Min(6),
        Constraint::Length(12),
        Constraint::Length(8),
        Constraint::Length(5),
    ];
    let table = Table::new(rows, widths)
        .header(header)
        .column_spacing(1)
        .flex(Flex::Start);
    f.render_widget(table, inner);
}
