//! One frame: the panels where the layout puts them, then the open dialog on top.

use ratatui::Frame;

use crate::history::History;
use crate::input::{Overlay, UiState};
use crate::layout;
use crate::model::State;
use crate::overlay;
use crate::panels::{charts, footer, injection, prediction, processes, syscalls, target, verdict};
use ratatui::layout::{Constraint, Layout};

pub fn render(f: &mut Frame, s: &State, h: &History, ui: &UiState) {
    let a = layout::areas(f.area(), s);
    target::render(f, a.header, &s.target, s.paused || ui.paused);
    verdict::render(f, a.verdict, s.verdict.as_ref());
    charts::render(f, &a.charts, h);
    prediction::render(f, a.prediction, s.prediction.as_ref());
    // A service of several processes shares the syscalls' place with its processes.
    match h.latest().filter(|w| w.processes.len() > 1) {
        Some(w) => {
            let [top, bottom] =
                Layout::vertical([Constraint::Percentage(50), Constraint::Percentage(50)])
                    .areas(a.syscalls);
            processes::render(f, top, &w.processes);
            syscalls::render(f, bottom, Some(w.syscalls.as_slice()));
        }
        None => syscalls::render(f, a.syscalls, h.latest().map(|w| w.syscalls.as_slice())),
    }
    injection::render(f, a.injection, s.injection.as_ref(), s.guard.as_ref());
    footer::render(f, a.footer, &s.status);
    match ui.overlay {
        Overlay::None => {}
        Overlay::Help => overlay::help(f, f.area()),
        Overlay::ConfirmInject => overlay::confirm_inject(f, f.area(), s.target.pid, warning(s)),
    }
}

/// Why the user might not want to inject: the model's stop sign first, then a
/// verdict that says the server cannot be fiberized.
fn warning(s: &State) -> Option<&str> {
    if let Some(stop) = s.prediction.as_ref().and_then(|p| p.stop.as_deref()) {
        return Some(stop);
    }
    match &s.verdict {
        Some(v) if !v.fiberizable => Some("the verdict says not fiberizable"),
        _ => None,
    }
}
