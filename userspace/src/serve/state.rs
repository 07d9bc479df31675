//! What the service knows of each target, shared between the watch threads (which
//! write it through ServeSink, the session's sink) and the HTTP server (which reads
//! it on each scrape). Only the last completed window is kept: a scrape serves that
//! window's values, never a half-counted one.

use super::config::Target;
use crate::error::WatchError;
use crate::metrics::Window;
use crate::sink::{Event, Sink, UserCmd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Where a target's watch stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Not found (yet, or since it went away); searched again each interval.
    Searching { why: String },
    /// Found; the programs are loading and attaching.
    Attaching { pid: u32 },
    /// Watched: windows come from this process (the root) and its service.
    Up { pid: u32, pids: Vec<u32> },
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Searching { .. } => "searching",
            Phase::Attaching { .. } => "attaching",
            Phase::Up { .. } => "up",
        }
    }
}

/// One target's state.
#[derive(Clone, Debug)]
pub struct TargetState {
    pub target: Target,
    pub phase: Phase,
    /// The watched root's command name and executable (from the session's header).
    pub comm: String,
    pub exe: String,
    /// The last completed window of the current attach (None until one completes).
    pub window: Option<Window>,
    /// Windows completed, attaches made, and watches ended by the target's exit, over
    /// the service's life.
    pub windows: u64,
    pub attaches: u64,
    pub exits: u64,
    /// The last error attaching or watching (cleared by the next window).
    pub last_error: Option<String>,
}

/// All targets, in configuration order.
#[derive(Clone, Default)]
pub struct Shared(Arc<Mutex<Vec<TargetState>>>);

impl Shared {
    pub fn new(targets: &[Target]) -> Shared {
        let v = targets
            .iter()
            .map(|t| TargetState {
                target: t.clone(),
                phase: Phase::Searching {
                    why: "not searched yet".into(),
                },
                comm: String::new(),
                exe: String::new(),
                window: None,
                windows: 0,
                attaches: 0,
                exits: 0,
                last_error: None,
            })
            .collect();
        Shared(Arc::new(Mutex::new(v)))
    }

    /// The states. A watch thread that panicked while holding the lock left whole
    /// values behind (every update is one assignment), so a poisoned lock is used as is.
    fn lock(&self) -> MutexGuard<'_, Vec<TargetState>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of every target's state, for one scrape.
    pub fn snapshot(&self) -> Vec<TargetState> {
        self.lock().clone()
    }

    pub fn update(&self, index: usize, f: impl FnOnce(&mut TargetState)) {
        if let Some(t) = self.lock().get_mut(index) {
            f(t);
        }
    }
}

/// The session's sink for one target: each event updates the shared state.
pub struct ServeSink {
    pub shared: Shared,
    pub index: usize,
    pub name: String,
    /// Set when the service stops: the session ends at its next poll.
    pub stop: Arc<AtomicBool>,
}

impl Sink for ServeSink {
    fn emit(&mut self, e: Event) -> Result<(), WatchError> {
        match e {
            Event::Header(h) => self.shared.update(self.index, |t| {
                t.phase = Phase::Up {
                    pid: h.pid,
                    pids: std::iter::once(h.pid)
                        .chain(h.also.iter().copied())
                        .collect(),
                };
                t.comm = h.comm.clone();
                t.exe = h.exe.clone();
                // A new process: the old one's window no longer describes it.
                t.window = None;
            }),
            Event::Window(w) => self.shared.update(self.index, |t| {
                if let Phase::Up { pid, pids } = &mut t.phase {
                    // Processes forked since the attach show in the window's rows.
                    *pids = std::iter::once(*pid)
                        .chain(w.processes.iter().map(|p| p.pid).filter(|p| p != pid))
                        .collect();
                }
                t.window = Some(w.clone());
                t.windows += 1;
                t.last_error = None;
            }),
            // The service injects nothing, and a final report over a whole attach is
            // not a window: /metrics keeps serving the last one until the next attach.
            Event::Inject(_) | Event::Final(_) => {}
        }
        Ok(())
    }

    fn status(&mut self, msg: &str) {
        eprintln!("toffload-watch: [{}] {msg}", self.name);
    }

    fn poll(&mut self) -> Option<UserCmd> {
        self.stop.load(Ordering::Relaxed).then_some(UserCmd::Quit)
    }
}
