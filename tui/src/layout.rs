//! Where each panel goes. Sized for 80x24 first (every panel title visible there),
//! then handing extra room to the charts and the text panels as the terminal grows.
//!
//! Two columns: left the verdict over a grid of six charts, right the prediction,
//! the syscall table and the injection. Text panels get the lines their content
//! wants (within limits), the charts and the syscall table take what is left.

use ratatui::layout::{Constraint, Layout, Rect};

use crate::model::State;
use crate::panels::{injection, prediction, verdict};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChartAreas {
    pub requests: Rect,
    pub stall: Rect,
    pub stall_hist: Rect,
    pub futex: Rect,
    pub switches: Rect,
    pub wakeup: Rect,
    /// The runtime's request latency over time: a row of its own under the grid.
    pub latency: Rect,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Areas {
    pub header: Rect,
    pub verdict: Rect,
    pub charts: ChartAreas,
    pub prediction: Rect,
    pub syscalls: Rect,
    pub injection: Rect,
    pub footer: Rect,
}

/// The right column's width at 80 columns: room for "syscall  /s  mean".
const RIGHT_MIN: u16 = 32;
/// Borders.
const FRAME: u16 = 2;
/// The syscall table's floor: a header and one row.
const SYSCALLS_MIN: u16 = 2 + FRAME;

pub fn areas(area: Rect, s: &State) -> Areas {
    let [header, body, footer] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(area);

    // 60/40 when wide; below 100 columns the right column keeps its 32.
    let left_w = if body.width >= 100 {
        body.width * 3 / 5
    } else {
        (body.width * 3 / 5).max(body.width.saturating_sub(RIGHT_MIN))
    };
    let [left, right] =
        Layout::horizontal([Constraint::Length(left_w), Constraint::Min(0)]).areas(body);

    // Left: the verdict gets its wrapped text, up to a quarter of the height (at least
    // three lines of text so "because" shows), the charts the rest.
    let want = verdict::lines(s.verdict.as_ref(), left.width.saturating_sub(FRAME)) + FRAME;
    let verdict_h = want.clamp(4, (body.height / 4).max(5)).min(left.height);
    let [verdict, charts] =
        Layout::vertical([Constraint::Length(verdict_h), Constraint::Min(0)]).areas(left);

    // Right: injection first (short, and its numbers matter most once injected), then
    // the prediction, then the syscall table takes what remains.
    let inner_w = right.width.saturating_sub(FRAME);
    let inj_want = injection::lines(s.injection.as_ref(), s.guard.as_ref(), inner_w) + FRAME;
    let pred_want = prediction::lines(s.prediction.as_ref(), inner_w) + FRAME;
    let pred_max = if right.height < 30 {
        8
    } else {
        right.height * 45 / 100
    };
    let room = right.height.saturating_sub(SYSCALLS_MIN);
    // The prediction keeps at least 4 rows (its speedup line) beside the injection.
    let inj_h = inj_want.min(room.saturating_sub(4));
    let pred_h = pred_want
        .clamp(4, pred_max.max(4))
        .min(room.saturating_sub(inj_h));
    let [prediction, syscalls, injection] = Layout::vertical([
        Constraint::Length(pred_h),
        Constraint::Min(0),
        Constraint::Length(inj_h),
    ])
    .areas(right);

    Areas {
        header,
        verdict,
        charts: chart_grid(charts),
        prediction,
        syscalls,
        injection,
        footer,
    }
}

/// Six cells, 3x2 when the left column is wide, else 2x3, and the latency chart as
/// one more row across them. Related charts sit side by side: stall p50/p99 next to
/// the stall histogram, switches next to wakeups.
fn chart_grid(area: Rect) -> ChartAreas {
    let cols: u16 = if area.width >= 90 { 3 } else { 2 };
    let rows = 6 / cols;
    let all = rows + 1;
    let row_areas =
        Layout::vertical((0..all).map(|_| Constraint::Ratio(1, all.into()))).split(area);
    let latency = row_areas[usize::from(rows)];
    let cell = |r: u16, c: u16| {
        Layout::horizontal((0..cols).map(|_| Constraint::Ratio(1, cols.into())))
            .split(row_areas[usize::from(r)])[usize::from(c)]
    };
    if cols == 3 {
        ChartAreas {
            requests: cell(0, 0),
            stall: cell(0, 1),
            stall_hist: cell(0, 2),
            futex: cell(1, 0),
            switches: cell(1, 1),
            wakeup: cell(1, 2),
            latency,
        }
    } else {
        ChartAreas {
            requests: cell(0, 0),
            futex: cell(0, 1),
            stall: cell(1, 0),
            stall_hist: cell(1, 1),
            switches: cell(2, 0),
            wakeup: cell(2, 1),
            latency,
        }
    }
}
