//! Where a watch's output goes: text or JSON lines on a writer, or the dashboard
//! (dashboard.rs). The session produces events; a sink renders them and may hand back
//! what the user asked for (the dashboard's keys).

use crate::error::WatchError;
use crate::inject_flow::InjectEvent;
use crate::metrics::Window;
use crate::report::{self, Final, Header, LineType};
use crate::wall_clock;
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

/// How a Report renders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Text blocks; with `timestamp` (-T) each line starts with the local HH:MM:SS.
    Text { timestamp: bool },
    /// One JSON object per line, each with its wall-clock `ts` (docs/json-schema.md).
    Json,
}

/// Text blocks or one JSON object per line.
pub struct Report<'w> {
    pub out: &'w mut dyn Write,
    pub format: Format,
}

impl Sink for Report<'_> {
    fn emit(&mut self, e: Event) -> Result<(), WatchError> {
        let now = wall_clock::unix_now();
        let s = match self.format {
            Format::Json => {
                let line = match e {
                    Event::Header(h) => report::json_line(LineType::Header, h, now),
                    Event::Window(w) => report::json_line(LineType::Window, w, now),
                    Event::Inject(i) => report::json_line(LineType::Inject, i, now),
                    Event::Final(f) => report::json_line(LineType::Final, f, now),
                };
                line + "\n"
            }
            Format::Text { timestamp } => {
                let text = match e {
                    Event::Header(h) => report::header_text(h),
                    Event::Window(w) => report::window_text(w, "window"),
                    Event::Inject(i) => report::inject_text(i),
                    Event::Final(f) => report::final_text(f),
                };
                if timestamp {
                    wall_clock::prefix_lines(&text, &wall_clock::hms_local(now))
                } else {
                    text
                }
            }
        };
        self.out
            .write_all(s.as_bytes())
            .and_then(|_| self.out.flush())
            .map_err(|e| WatchError::Other(format!("writing the report: {e}")))
    }
}
