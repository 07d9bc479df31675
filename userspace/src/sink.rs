//! Where a watch's output goes: text or JSON lines on a writer, or the dashboard
//! (dashboard.rs). The session produces events; a sink renders them and may hand back
//! what the user asked for (the dashboard's keys).

use crate::error::WatchError;
use crate::inject_flow::InjectEvent;
use crate::metrics::Window;
use crate::report::{self, Final, Header};
use std::io::Write;

pub enum Event<'a> {
    Header(&'a Header),
    Window(&'a Window),
    Inject(&'a InjectEvent),
    Final(&'a Final),
}

/// What the user asked for from an interactive sink.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UserCmd {
    Quit,
    Inject,
}

pub trait Sink {
    fn emit(&mut self, e: Event) -> Result<(), WatchError>;
    /// A line of progress ("injecting...") for interactive sinks; text sinks use stderr.
    fn status(&mut self, msg: &str) {
        eprintln!("toffload-watch: {msg}");
    }
    /// A person is at the keys: a refused injection does not end the watch.
    fn interactive(&self) -> bool {
        false
    }
    /// Keys pressed since the last call (never blocks).
    fn poll(&mut self) -> Option<UserCmd> {
        None
    }
}

/// Text blocks or one JSON object per line.
pub struct Report<'w> {
    pub out: &'w mut dyn Write,
    pub json: bool,
}

impl Sink for Report<'_> {
    fn emit(&mut self, e: Event) -> Result<(), WatchError> {
        let s = match (e, self.json) {
            (Event::Header(h), true) => report::json_line("header", h),
            (Event::Window(w), true) => report::json_line("window", w),
            (Event::Inject(i), true) => report::json_line("inject", i),
            (Event::Final(f), true) => report::json_line("final", f),
            (Event::Header(h), false) => report::header_text(h),
            (Event::Window(w), false) => report::window_text(w, "window"),
            (Event::Inject(i), false) => report::inject_text(i),
            (Event::Final(f), false) => report::final_text(f),
        };
        let s = if self.json { s + "\n" } else { s };
        self.out
            .write_all(s.as_bytes())
            .and_then(|_| self.out.flush())
            .map_err(|e| WatchError::Other(format!("writing the report: {e}")))
    }
}
