//! The conflict guard for servers that suspend without fibers (an event loop's
//! deferred response, a thread pool's callback): the C API of toffload_accel.h's guard
//! section. The integration names each suspended request with a token and says when
//! it starts running, parks at its offload, resumes and ends; the guard watches the
//! memory the integration registered and applies the runtime's conflict rule (its
//! ledger, compiled from runtime/src/guard/ledger.rs so both paths share one rule)
//! with the runtime's mprotect mechanisms:
//!
//! - detect: registered pages are write-protected. With userfaultfd's asynchronous
//!   write-protect (Linux 6.7+; the runtime's uffd.rs) the kernel resolves the writes
//!   itself and one PAGEMAP_SCAN per token switch (begin, park, end) finds the pages
//!   written since the last one, recorded as the token's that ran; elsewhere the pages
//!   are read-only (mprotect), the first write to a page after a switch faults, is
//!   recorded as the running token's, and the page is protected again when that token
//!   parks or ends. A token that writes a page after
//!   it resumed, which another token wrote while it was parked, is a conflict.
//! - enforce: page ownership. Registered pages are inaccessible; a token's first
//!   access makes it the owner until it ends (the page opened whole: one fault per
//!   read-modify-write), and the owner's pages are inaccessible again while it is
//!   parked. A token that touches a page another (parked) token
//!   owns cannot wait on the event loop's thread: the guard releases what the token
//!   took so far and jumps back to the integration's sigsetjmp point, which defers
//!   the request until a token ends.
//!
//! One thread runs tokens at a time (an event loop); faults on other threads, or
//! outside any token, are no token's.

pub mod capi;
mod fault;
#[path = "../../../runtime/src/guard/ledger.rs"]
mod ledger;
// The runtime's userfaultfd write-protect, for detect's asynchronous mechanism.
#[allow(dead_code)]
#[path = "../../../runtime/src/guard/uffd.rs"]
mod uffd;

/// What uffd.rs calls `super::regions`.
mod regions {
    pub use super::PAGE;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Range {
        pub start: usize,
        pub end: usize,
    }
}

use ledger::{Ledger, Window};
use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering::*};
use std::sync::{Mutex, MutexGuard, OnceLock};

pub const PAGE: usize = 4096;

/// TOFFLOAD_GUARD, read once per process (the runtime's knob, same values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Mode {
    Off = 0,
    Detect = 1,
    Enforce = 2,
}

/// The mode, or Err with the malformed value.
pub fn mode() -> Result<Mode, &'static crate::ConfigError> {
    static MODE: OnceLock<Result<Mode, crate::ConfigError>> = OnceLock::new();
    MODE.get_or_init(|| mode_from(&crate::config::from_env))
        .as_ref()
        .map(|m| *m)
}

fn mode_from(get: &dyn Fn(&str) -> Option<String>) -> Result<Mode, crate::ConfigError> {
    Ok(crate::config::knob(get, &crate::knobs::GUARD, parse_mode)?.unwrap_or(Mode::Off))
}

fn parse_mode(s: &str) -> Option<Mode> {
    match s {
        "off" => Some(Mode::Off),
        "detect" => Some(Mode::Detect),
        "enforce" => Some(Mode::Enforce),
        _ => None,
    }
}

/// The guard's counters (struct toffload_guard_stats).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub mode: i32,
    /// Detect: 1 when asynchronous userfaultfd write-protect watches (0: mprotect).
    pub uffd_async: i32,
    pub pages: u64,
    pub faults: u64,
    pub conflicts: u64,
    pub deferred: u64,
    pub released: u64,
}

#[derive(Default)]
struct Token {
    /// The park window: (clock at park, clock at resume), once resumed.
    window: Option<Window>,
    parked_at: u64,
    /// Enforce: pages it owns (open to it whole while it runs).
    owned: Vec<usize>,
}

#[derive(Default, Clone, Copy)]
struct Page {
    /// Enforce: the owning token (0: none).
    owner: u64,
    /// Given up: open to all for good (an access that could not wait).
    released: bool,
}

#[derive(Default)]
struct State {
    ranges: Vec<(usize, usize)>,
    pages: HashMap<usize, Page>,
    tokens: HashMap<u64, Token>,
    ledger: Ledger,
    /// Detect: pages opened for a write since the last re-protect.
    dirty: Vec<usize>,
    /// Detect: (uffd, /proc/self/pagemap) of the asynchronous mechanism, once tried.
    uffd_async: Option<Option<(libc::c_int, libc::c_int)>>,
    /// Detect: the ranges it watches (the others are mprotect's).
    async_ranges: Vec<(usize, usize)>,
    stats: Stats,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);
/// The running token (0: none) and the thread running it.
static CURRENT: AtomicU64 = AtomicU64::new(0);
static CURRENT_TID: AtomicI32 = AtomicI32::new(0);
/// Enforce: where to jump back when the running token must wait (a sigjmp_buf*).
static RETRY: AtomicU64 = AtomicU64::new(0);

fn state() -> MutexGuard<'static, Option<State>> {
    // A panic never happens while the lock is held; a poisoned lock is still sound.
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

fn tid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

fn protect(page: usize, len: usize, prot: libc::c_int) {
    // SAFETY: pages of a range the integration registered for the guard.
    unsafe { libc::mprotect(page as *mut _, len, prot) };
}

const RW: libc::c_int = libc::PROT_READ | libc::PROT_WRITE;

/// toffload_guard_register: guards the pages covering [start, start+len).
pub fn register(start: usize, len: usize) -> Result<(), i32> {
    let m = mode().map_err(|_| -libc::EINVAL)?;
    if len == 0 || start == 0 || start.checked_add(len + PAGE).is_none() {
        return Err(-libc::EINVAL);
    }
    if m == Mode::Off {
        return Ok(());
    }
    let (s, e) = (start & !(PAGE - 1), (start + len + PAGE - 1) & !(PAGE - 1));
    fault::install()?;
    let mut g = state();
    let st = g.get_or_insert_with(State::default);
    if st.ranges.iter().any(|&(a, b)| s < b && a < e) {
        return Err(-libc::EEXIST);
    }
    st.ranges.push((s, e));
    for p in (s..e).step_by(PAGE) {
        st.pages.insert(p, Page::default());
    }
    st.stats.pages += ((e - s) / PAGE) as u64;
    if m == Mode::Detect && watch_async(st, s, e) {
        return Ok(());
    }
    // Detect sees writes; enforce sees every first access.
    let prot = if m == Mode::Enforce {
        libc::PROT_NONE
    } else {
        libc::PROT_READ
    };
    // SAFETY: the caller's own mapping, which it hands to the guard.
    if unsafe { libc::mprotect(s as *mut _, e - s, prot) } != 0 {
        st.ranges.pop();
        return Err(-libc::ENOMEM);
    }
    Ok(())
}

/// Detect: watches [s, e) with asynchronous write-protect, if the kernel has it.
fn watch_async(st: &mut State, s: usize, e: usize) -> bool {
    let fds = *st.uffd_async.get_or_insert_with(|| uffd::open_async().ok());
    let Some((fd, _)) = fds else { return false };
    let r = regions::Range { start: s, end: e };
    if uffd::watch(fd, r) && uffd::protect(fd, s, e - s, true) {
        st.async_ranges.push((s, e));
        st.stats.uffd_async = 1;
        return true;
    }
    false
}

/// Detect, asynchronous: records the pages written since the last scan as `token`'s
/// (0: no token's), with its window as it is now.
fn collect(st: &mut State, token: u64) {
    let Some(Some((fd, pm))) = st.uffd_async else {
        return;
    };
    let window = st.tokens.get(&token).and_then(|t| t.window);
    let (ledger, stats) = (&mut st.ledger, &mut st.stats);
    for &(s, e) in &st.async_ranges {
        uffd::scan_written(pm, fd, s, e, |page| {
            stats.faults += 1;
            if ledger.write(page, token, window) {
                stats.conflicts += 1;
            }
        });
    }
}

fn on_mode() -> Option<Mode> {
    mode().ok().filter(|&m| m != Mode::Off)
}

/// toffload_guard_begin: `token` starts running (a new request).
pub fn begin(token: u64, retry: usize) -> Result<(), i32> {
    if token == 0 {
        return Err(-libc::EINVAL);
    }
    let Some(_) = on_mode() else { return Ok(()) };
    let mut g = state();
    let Some(st) = g.as_mut() else { return Ok(()) };
    // Writes since the last switch were no token's.
    collect(st, 0);
    st.tokens.entry(token).or_default();
    run(token, retry);
    Ok(())
}

fn run(token: u64, retry: usize) {
    RETRY.store(retry as u64, Release);
    CURRENT_TID.store(tid(), Release);
    CURRENT.store(token, Release);
}

fn stop(st: &mut State, m: Mode) {
    CURRENT.store(0, Release);
    RETRY.store(0, Release);
    if m == Mode::Detect {
        for p in std::mem::take(&mut st.dirty) {
            if !st.pages.get(&p).is_some_and(|x| x.released) {
                protect(p, PAGE, libc::PROT_READ);
            }
        }
    }
}

/// toffload_guard_park: `token` suspends at its offload; its window opens.
pub fn park(token: u64) -> Result<(), i32> {
    let Some(m) = on_mode() else { return Ok(()) };
    let mut g = state();
    let Some(st) = g.as_mut() else { return Ok(()) };
    if !st.tokens.contains_key(&token) {
        return Err(-libc::ENOENT);
    }
    // Its writes since it began or resumed belong to the window now closing.
    collect(st, token);
    let clock = st.ledger.clock();
    let t = st.tokens.get_mut(&token).expect("present");
    t.parked_at = clock;
    t.window = None;
    if m == Mode::Enforce {
        for &p in &t.owned {
            protect(p, PAGE, libc::PROT_NONE);
        }
    }
    stop(st, m);
    Ok(())
}

/// toffload_guard_resume: `token` runs again after its offload; its window closes.
pub fn resume(token: u64) -> Result<(), i32> {
    let Some(m) = on_mode() else { return Ok(()) };
    let mut g = state();
    let Some(st) = g.as_mut() else { return Ok(()) };
    let clock = st.ledger.clock();
    let t = st.tokens.get_mut(&token).ok_or(-libc::ENOENT)?;
    t.window = Some((t.parked_at, clock));
    if m == Mode::Enforce {
        for &p in &t.owned {
            protect(p, PAGE, RW);
        }
    }
    // Resumed code has no sigsetjmp point: an access that would wait gives the page up.
    run(token, 0);
    Ok(())
}

/// toffload_guard_end: `token` is over (its response is out): its pages are free.
/// The number of pages it released (a deferred request may retry when > 0).
pub fn end(token: u64) -> Result<usize, i32> {
    let Some(m) = on_mode() else { return Ok(0) };
    let mut g = state();
    let Some(st) = g.as_mut() else { return Ok(0) };
    if !st.tokens.contains_key(&token) {
        return Err(-libc::ENOENT);
    }
    collect(st, token);
    let t = st.tokens.remove(&token).expect("present");
    let n = release(st, &t.owned);
    if CURRENT.load(Acquire) == token {
        stop(st, m);
    }
    Ok(n)
}

/// Enforce: frees `owned` (inaccessible again, no owner).
fn release(st: &mut State, owned: &[usize]) -> usize {
    for &p in owned {
        if let Some(x) = st.pages.get_mut(&p) {
            x.owner = 0;
            if !x.released {
                protect(p, PAGE, libc::PROT_NONE);
            }
        }
    }
    owned.len()
}

pub fn stats() -> Stats {
    let mut s = state().as_ref().map_or_else(Stats::default, |st| st.stats);
    s.mode = match mode() {
        Ok(m) => m as i32,
        Err(_) => -libc::EINVAL,
    };
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_like_the_runtime_knob() {
        let env = |v: Option<&'static str>| move |_: &str| v.map(String::from);
        assert_eq!(mode_from(&env(None)), Ok(Mode::Off));
        assert_eq!(mode_from(&env(Some(" detect"))), Ok(Mode::Detect));
        assert_eq!(mode_from(&env(Some("enforce"))), Ok(Mode::Enforce));
        let e = mode_from(&env(Some("on"))).unwrap_err();
        assert_eq!((e.var, e.value.as_str()), ("TOFFLOAD_GUARD", "on"));
    }
}
