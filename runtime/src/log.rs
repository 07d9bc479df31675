//! The runtime lives inside other people's processes: it prints nothing unless
//! TOFFLOAD_LOG asks, and then only on stderr, with raw writes that cannot recurse into
//! our own interposers. A malformed knob is the one exception (reported once, since the
//! user explicitly set something we cannot honour).

use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

pub const OFF: u8 = 0;
pub const ERROR: u8 = 1;
pub const INFO: u8 = 2;
pub const DEBUG: u8 = 3;

static LEVEL: AtomicU8 = AtomicU8::new(OFF);

pub fn set_level(l: u8) {
    LEVEL.store(l, Relaxed);
}

#[inline]
pub fn enabled(l: u8) -> bool {
    LEVEL.load(Relaxed) >= l
}

/// Writes one line "toffload[pid]: msg" on stderr, whatever the level.
pub fn line(msg: std::fmt::Arguments<'_>) {
    let mut s = String::with_capacity(128);
    use std::fmt::Write;
    // SAFETY: getpid cannot fail.
    let _ = writeln!(s, "toffload[{}]: {}", unsafe { libc::getpid() }, msg);
    crate::real::raw_write(2, s.as_bytes());
}

#[macro_export]
macro_rules! log_at {
    ($lvl:expr, $($t:tt)*) => {
        if $crate::log::enabled($lvl) {
            $crate::log::line(format_args!($($t)*));
        }
    };
}

/// A libc symbol is missing: nothing sensible can be done in this process.
#[cold]
pub fn fatal(sym: &[u8]) -> ! {
    let name = String::from_utf8_lossy(&sym[..sym.len().saturating_sub(1)]).into_owned();
    line(format_args!(
        "cannot resolve libc's {name}; the runtime cannot run in this process"
    ));
    // SAFETY: abort is always safe to call.
    unsafe { libc::abort() }
}
