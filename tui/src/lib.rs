//! toffload's dashboard: a ratatui library that `toffload-watch --tui` drives.
//!
//! The watcher owns the loop; this crate owns the terminal:
//!
//! ```no_run
//! use std::time::Duration;
//! use toffload_tui::{Command, Dashboard, State, WindowView};
//!
//! let mut dash = Dashboard::enter()?;
//! let mut state = State::default();
//! loop {
//!     // ... one measurement window later:
//!     dash.push_window(WindowView::default());
//!     dash.draw(&state)?;
//!     match dash.poll(Duration::from_secs(1))? {
//!         Some(Command::Quit) => break,
//!         Some(Command::Inject) => { /* relaunch under the runtime */ }
//!         Some(Command::Pause(p)) => state.paused = p,
//!         None => {}
//!     }
//! }
//! dash.leave()?;
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! The crate has its own plain view types ([`State`], [`WindowView`], ...) so that it
//! does not depend on the watcher: the watcher depends on it.

mod format;
mod history;
mod input;
mod layout;
mod model;
mod overlay;
mod panels;
mod render;
pub mod synthetic;
mod terminal;

use std::io::{self, IsTerminal, Stdout};
use std::time::{Duration, Instant};

use ratatui::backend::CrosstermBackend;
use ratatui::crossterm::event::{self, Event, KeyEvent};
use ratatui::{Frame, Terminal};

pub use history::{History, DEFAULT_CAPACITY};
pub use input::{handle_key, Command, Overlay, UiState};
pub use model::{
    GuardView, InjectionView, LatencyView, PredictionView, ProcessView, State, SyscallView, Target,
    VerdictView, WindowView,
};

/// The titles the panels carry, for tests that look for them on screen.
pub const PANEL_TITLES: &[&str] = &[
    "Target",
    "Verdict",
    "Requests/s",
    "Stall",
    "Futex/req",
    "Switches/s",
    "Wakeup",
    "Latency",
    "Syscalls",
    "Prediction",
    "Injection",
];
/// The help dialog's title.
pub const HELP_TITLE: &str = overlay::HELP_TITLE;
/// The inject confirmation dialog's title.
pub const CONFIRM_TITLE: &str = overlay::CONFIRM_TITLE;
/// The footer's key line.
pub const FOOTER_KEYS: &str = panels::footer::KEYS;

/// Everything the dashboard shows except the terminal: history, dialogs, pause. Pure,
/// so that it renders into any ratatui backend (tests use `TestBackend`).
#[derive(Debug, Clone, Default)]
pub struct Screen {
    history: History,
    ui: UiState,
}

impl Screen {
    pub fn new() -> Screen {
        Screen::default()
    }

    /// Appends a window to the charts' history, unless paused ('p'): paused means
    /// the picture holds still so it can be read.
    pub fn push_window(&mut self, w: WindowView) {
        if !self.ui.paused {
            self.history.push(w);
        }
    }

    /// One key; see [`handle_key`].
    pub fn key(&mut self, key: KeyEvent) -> Option<Command> {
        handle_key(&mut self.ui, key)
    }

    pub fn render(&self, f: &mut Frame, s: &State) {
        render::render(f, s, &self.history, &self.ui);
    }

    pub fn history(&self) -> &History {
        &self.history
    }

    pub fn ui(&self) -> UiState {
        self.ui
    }

    pub fn paused(&self) -> bool {
        self.ui.paused
    }

    /// For a watcher that pauses on its own (the header shows State::paused too).
    pub fn set_paused(&mut self, paused: bool) {
        self.ui.paused = paused;
    }
}

/// The dashboard on the real terminal (stdout). One at a time per process.
pub struct Dashboard {
    terminal: Terminal<CrosstermBackend<Stdout>>,
    screen: Screen,
    /// The last State drawn: poll() redraws with it when a key opens or closes a
    /// dialog or the terminal is resized, without waiting for the watcher's next draw.
    last: Option<State>,
    /// Restores the terminal when dropped: leave(), Drop and unwinding all end here.
    session: terminal::Session,
}

impl Dashboard {
    /// Raw mode, alternate screen, hidden cursor, and a panic hook that restores the
    /// terminal and then runs the previous hook. A panic on any thread, even one that
    /// is caught later (a tokio task), ends the dashboard: the terminal is restored,
    /// draw() does nothing and poll() returns Quit from then on.
    ///
    /// Fails, touching nothing, when stdout is not a terminal (the escape codes would
    /// land in a file or pipe).
    pub fn enter() -> io::Result<Dashboard> {
        if !io::stdout().is_terminal() {
            return Err(io::Error::other("the dashboard needs a terminal on stdout"));
        }
        let session = terminal::Session::enter()?;
        let terminal = Terminal::new(CrosstermBackend::new(io::stdout()))?;
        Ok(Dashboard {
            terminal,
            screen: Screen::new(),
            last: None,
            session,
        })
    }

    /// Appended to the history (the last [`DEFAULT_CAPACITY`] windows) unless paused.
    pub fn push_window(&mut self, w: WindowView) {
        self.screen.push_window(w);
    }

    pub fn draw(&mut self, s: &State) -> io::Result<()> {
        if self.last.as_ref() != Some(s) {
            self.last = Some(s.clone());
        }
        self.redraw()
    }

    /// Waits up to `timeout` for a command. Keys that only change the dashboard
    /// (help, dialogs) and resizes are handled here, with an immediate redraw, and the
    /// wait goes on; so the watcher can poll for the rest of its window and never
    /// see a stale screen (no draw() needed after poll() for those). With
    /// `Duration::ZERO` it handles what is pending and returns at once.
    pub fn poll(&mut self, timeout: Duration) -> io::Result<Option<Command>> {
        // After a panic restored the terminal (any thread), the dashboard is over.
        if !terminal::is_active() {
            return Ok(Some(Command::Quit));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if !event::poll(left)? {
                return Ok(None);
            }
            match event::read()? {
                Event::Key(k) => {
                    let before = self.screen.ui();
                    let cmd = self.screen.key(k);
                    if self.screen.ui() != before && cmd != Some(Command::Quit) {
                        self.redraw()?;
                    }
                    if cmd.is_some() {
                        return Ok(cmd);
                    }
                }
                Event::Resize(..) => {
                    self.terminal.autoresize()?;
                    self.redraw()?;
                }
                _ => {}
            }
        }
    }

    pub fn screen(&self) -> &Screen {
        &self.screen
    }

    pub fn screen_mut(&mut self) -> &mut Screen {
        &mut self.screen
    }

    /// Restores the terminal (also done by Drop if this is not called) and puts back
    /// the panic hook that was installed when the dashboard entered (a hook set in
    /// between is dropped).
    pub fn leave(mut self) -> io::Result<()> {
        let _ = self.terminal.show_cursor();
        self.session.end()
    }

    fn redraw(&mut self) -> io::Result<()> {
        // Once a panic hook has restored the terminal, drawing would paint over the
        // user's shell.
        if !terminal::is_active() {
            return Ok(());
        }
        let Some(s) = self.last.as_ref() else {
            return Ok(());
        };
        let screen = &self.screen;
        self.terminal.draw(|f| screen.render(f, s))?;
        Ok(())
    }
}
