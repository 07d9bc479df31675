//! The terminal's state: raw mode + alternate screen + hidden cursor while the
//! dashboard runs, and the user's shell back in cooked mode whatever way it ends:
//! leave(), Drop, or a panic on any thread (the panic hook restores first, then runs
//! the hook that was there before, so the message lands on the normal screen).

use std::io::{self, Write};
use std::panic::{self, PanicHookInfo};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ratatui::crossterm::cursor::{Hide, MoveTo, Show};
use ratatui::crossterm::execute;
use ratatui::crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, Clear, ClearType, EnterAlternateScreen, LeaveAlternateScreen,
};

/// Whether the terminal is in the dashboard's mode. Process-wide because the
/// terminal is: one dashboard at a time, and the panic hook (any thread) must know
/// whether there is anything to undo.
static ACTIVE: AtomicBool = AtomicBool::new(false);

type Hook = Box<dyn Fn(&PanicHookInfo<'_>) + Sync + Send + 'static>;

/// While alive, the terminal is in the dashboard's mode and our panic hook is set.
pub struct Session {
    /// The hook that was installed before ours: ours chains to it, and leave() puts
    /// it back.
    prev_hook: Option<Arc<Hook>>,
}

pub fn is_active() -> bool {
    ACTIVE.load(Ordering::SeqCst)
}

impl Session {
    pub fn enter() -> io::Result<Session> {
        if ACTIVE.swap(true, Ordering::SeqCst) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "a dashboard already owns the terminal",
            ));
        }
        // The hook goes in before the terminal changes, so that a panic from here on
        // is covered.
        let prev: Arc<Hook> = Arc::new(panic::take_hook());
        let chained = Arc::clone(&prev);
        panic::set_hook(Box::new(move |info| {
            let _ = restore();
            chained(info);
        }));
        let mut session = Session {
            prev_hook: Some(prev),
        };
        let setup = (|| {
            enable_raw_mode()?;
            execute!(io::stdout(), EnterAlternateScreen, Hide)
        })();
        if let Err(e) = setup {
            let _ = session.end();
            return Err(e);
        }
        Ok(session)
    }

    /// Restores the terminal and the previous panic hook. Idempotent.
    pub fn end(&mut self) -> io::Result<()> {
        let r = restore();
        // take_hook/set_hook panic when called while panicking (an unwinding Drop):
        // then the terminal is restored and our hook stays, which only restores again.
        if let Some(prev) = self.prev_hook.take() {
            if !std::thread::panicking() {
                let _ours = panic::take_hook();
                panic::set_hook(Box::new(move |info| prev(info)));
            }
        }
        r
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.end();
    }
}

/// Cooked mode, main screen, cursor shown: the inverse of enter, done once.
fn restore() -> io::Result<()> {
    if !ACTIVE.swap(false, Ordering::SeqCst) {
        return Ok(());
    }
    // All three are attempted even if one fails: a half-restored terminal is the
    // worst outcome.
    let raw = disable_raw_mode();
    let mut out = io::stdout();
    // Blank the alternate screen and park the cursor at its top before leaving it:
    // tmux, when the window was resized meanwhile, shrinks the alternate grid back to
    // the old size on leaving, pushing the rows above the cursor into the history the
    // shell's screen then shows; blank rows under the cursor are dropped instead.
    let screen = execute!(
        out,
        Clear(ClearType::All),
        MoveTo(0, 0),
        LeaveAlternateScreen,
        Show
    );
    let _ = out.flush();
    raw.and(screen)
}
