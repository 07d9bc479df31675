//! The terminal's state: raw mode + alternate screen + hidden cursor while the
//! dashboard runs, and the user's shell back in cooked mode whatever way it ends:
//! leave(), Drop, or a panic on any thread (the panic hook restores first, then runs
//! the hook that was there before, so the message lands on the normal screen).
//!
//! When stderr is the dashboard's terminal, what the process writes there meanwhile
//! (the watcher's "attached" line, a warning) is held in memory and written out after
//! the restore: on the dashboard's screen, in raw mode, a line would scroll the whole
//! screen by one row under ratatui's feet, and its diffing redraw would never repair
//! it.

use std::io::{self, Write};
use std::os::fd::RawFd;
use std::panic::{self, PanicHookInfo};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
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

/// While stderr is held: the terminal's stderr (a dup of the original fd 2), and the
/// in-memory file that fd 2 points to meanwhile. -1: not held. Atomics, so that the
/// panic hook never waits on a lock.
static SAVED_STDERR: AtomicI32 = AtomicI32::new(-1);
static HELD_STDERR: AtomicI32 = AtomicI32::new(-1);

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
            hold_stderr();
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
    release_stderr();
    raw.and(screen)
}

/// The terminal (device number) behind `fd`, if it is one.
fn tty_of(fd: RawFd) -> Option<libc::dev_t> {
    // SAFETY: fstat into a zeroed struct; isatty on any fd.
    unsafe {
        if libc::isatty(fd) != 1 {
            return None;
        }
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(fd, &mut st) == 0).then_some(st.st_rdev)
    }
}

/// Points fd 2 at an in-memory file when it is the same terminal as stdout. Best
/// effort: if any step fails, stderr stays where it was.
fn hold_stderr() {
    match (tty_of(1), tty_of(2)) {
        (Some(out), Some(err)) if out == err => {}
        _ => return,
    }
    // SAFETY: plain fd syscalls on fds this function owns, and fd 2.
    unsafe {
        let held = libc::memfd_create(c"toffload-tui-stderr".as_ptr(), libc::MFD_CLOEXEC);
        if held < 0 {
            return;
        }
        let saved = libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 3);
        if saved < 0 {
            libc::close(held);
            return;
        }
        if libc::dup2(held, 2) < 0 {
            libc::close(held);
            libc::close(saved);
            return;
        }
        SAVED_STDERR.store(saved, Ordering::SeqCst);
        HELD_STDERR.store(held, Ordering::SeqCst);
    }
}

/// Puts the terminal back on fd 2 and writes there what was held. Done once.
fn release_stderr() {
    let saved = SAVED_STDERR.swap(-1, Ordering::SeqCst);
    if saved < 0 {
        return;
    }
    let held = HELD_STDERR.swap(-1, Ordering::SeqCst);
    // SAFETY: the two fds were stored by hold_stderr and are closed only here.
    unsafe {
        libc::dup2(saved, 2);
        libc::close(saved);
        if held < 0 {
            return;
        }
        libc::lseek(held, 0, libc::SEEK_SET);
        let mut buf = [0u8; 4096];
        loop {
            let n = libc::read(held, buf.as_mut_ptr().cast(), buf.len());
            if n <= 0 {
                break;
            }
            let mut off = 0usize;
            while off < n as usize {
                let w = libc::write(2, buf[off..].as_ptr().cast(), n as usize - off);
                if w <= 0 {
                    break;
                }
                off += w as usize;
            }
            if off < n as usize {
                break;
            }
        }
        libc::close(held);
    }
}
