//! The conflict guard (TOFFLOAD_GUARD). Overlapping an offload removes the
//! run-to-completion atomicity a handler silently relied on: an unlocked
//! read-modify-write of shared data across the offload can lose updates. The guard
//! finds that pattern (detect) and prevents it (enforce) without changing the program.
//!
//! - detect: guarded pages are write-protected (userfaultfd, or mprotect + SIGSEGV where
//!   uffd-wp cannot be had); every first write to a page after a fiber switch is seen,
//!   attributed to the running fiber, and checked against the conflict rule (ledger.rs).
//!   Protection is re-armed when a fiber that wrote switches out, so the next fiber's
//!   first write is seen too. With asynchronous write-protect (uffd-async, the default
//!   where the kernel has it and there is one carrier) the kernel resolves the write
//!   faults itself, and the pages a fiber wrote are found by one PAGEMAP_SCAN when it
//!   switches out (or parks at its offload, before its window opens) and protected
//!   again: the same writes, seen per run of a fiber instead of per fault, with no
//!   handler-thread round trip.
//! - enforce: page ownership (own.rs). A handler that touches a guarded page owns it
//!   until its response is written; another handler touching it waits. Handlers that
//!   touch different pages (or none) keep overlapping. Ownership needs to see first
//!   reads, which write-protection cannot: enforce makes pages inaccessible (mprotect
//!   PROT_NONE) and relaxes pages that handlers only ever read.

pub mod ledger;
mod own;
pub mod regions;
mod trampoline;
pub mod uffd;

use crate::config::{GuardMech, GuardMode};
use crate::fiber::Fiber;
use crate::spinlock::SpinLock;
use ledger::Ledger;
use libc::c_int;
use regions::{Range, PAGE};
use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};

/// How writes are seen in detect mode: 0 not armed, 1 userfaultfd, 2 mprotect,
/// 3 userfaultfd async write-protect + PAGEMAP_SCAN.
static MECH: AtomicU8 = AtomicU8::new(0);
const MECH_UFFD: u8 = 1;
const MECH_MPROTECT: u8 = 2;
const MECH_UFFD_ASYNC: u8 = 3;
static UFFD: AtomicI32 = AtomicI32::new(-1);
/// /proc/self/pagemap (uffd-async).
static PAGEMAP: AtomicI32 = AtomicI32::new(-1);
/// uffd-async: the spans to scan (the registered ranges, touching ones merged).
static SPANS: SpinLock<Vec<Range>> = SpinLock::new(Vec::new());
static ARMED: AtomicBool = AtomicBool::new(false);

/// Guarded ranges (whole pages).
static RANGES: SpinLock<Vec<Range>> = SpinLock::new(Vec::new());
static LEDGER: SpinLock<Option<Ledger>> = SpinLock::new(None);
/// Pages whose write protection was lifted since the last re-arm (detect).
static DIRTY: SpinLock<Vec<usize>> = SpinLock::new(Vec::new());
static DIRTY_N: AtomicUsize = AtomicUsize::new(0);
/// Regions announced through toffload_guard_region() before the guard was armed.
static PENDING: SpinLock<Vec<Range>> = SpinLock::new(Vec::new());

/// A fiber's guard state.
#[derive(Default)]
pub struct FiberGuard {
    win_start: AtomicU64,
    win_end: AtomicU64,
    win_open: AtomicBool,
    /// Enforce: pages this fiber owns, with whether it may write them.
    pub(crate) owned: UnsafeCell<Vec<(usize, bool)>>,
    /// Enforce: the page the fiber waits for (set by the fault handler).
    pub(crate) wait_page: Cell<usize>,
    /// uffd-async: its writes were collected as it parked at its offload; the
    /// switch-out that follows has nothing of it to collect.
    collected: Cell<bool>,
}

impl FiberGuard {
    fn window(&self) -> Option<ledger::Window> {
        self.win_open
            .load(Acquire)
            .then(|| (self.win_start.load(Acquire), self.win_end.load(Acquire)))
    }
}

pub fn mode() -> GuardMode {
    crate::settings().guard
}

#[inline]
fn on() -> bool {
    ARMED.load(Relaxed)
}

pub fn in_guarded(addr: usize) -> bool {
    RANGES.lock().iter().any(|r| r.contains(addr))
}

/// A marker the watcher can put a uprobe on: one call per conflict found.
#[no_mangle]
#[inline(never)]
pub extern "C" fn toffload_guard_conflict(page: usize, fiber: u64) {
    // Distinct bodies: identical ones would be folded into one address.
    // SAFETY: a plain volatile store to our own static (volatile: never optimised out).
    unsafe { std::ptr::write_volatile(LAST_CONFLICT.as_ptr(), page ^ fiber as usize) };
}

static LAST_CONFLICT: AtomicUsize = AtomicUsize::new(0);
static LAST_SERIALIZED: AtomicUsize = AtomicUsize::new(0);

/// A marker for each handler made to wait for a page another handler owns.
#[no_mangle]
#[inline(never)]
pub extern "C" fn toffload_guard_serialized(page: usize, fiber: u64) {
    // SAFETY: as in toffload_guard_conflict.
    unsafe {
        std::ptr::write_volatile(LAST_SERIALIZED.as_ptr(), page.wrapping_add(fiber as usize))
    };
}

/// Records a write of `page` by `f` (None: a real thread) and applies the rule.
fn record_write(page: usize, f: Option<&Fiber>) {
    crate::stats::COUNTERS.guard_faults.fetch_add(1, Relaxed);
    let (writer, window) = f.map_or((0, None), |f| (f.id, f.guard.window()));
    let conflict = LEDGER
        .lock()
        .get_or_insert_with(Ledger::default)
        .write(page, writer, window);
    if conflict {
        crate::stats::COUNTERS.guard_conflicts.fetch_add(1, Relaxed);
        toffload_guard_conflict(page, writer);
        crate::log_at!(
            crate::log::DEBUG,
            "guard: conflict on page {page:#x} by fiber {writer}"
        );
    }
}

/// uffd-async: collects the pages written since the last scan (by `f`: with one
/// carrier, nothing else ran since) and records them with `f`'s window as it is now.
fn collect(f: &Fiber) {
    let pm = PAGEMAP.load(Relaxed);
    let fd = UFFD.load(Relaxed);
    let window = f.guard.window();
    let spans = SPANS.lock();
    let mut ledger = None;
    let mut seen = 0usize;
    for s in spans.iter() {
        uffd::scan_written(pm, fd, s.start, s.end, |page| {
            seen += 1;
            let l = ledger.get_or_insert_with(|| LEDGER.lock());
            if l.get_or_insert_with(Ledger::default)
                .write(page, f.id, window)
            {
                crate::stats::COUNTERS.guard_conflicts.fetch_add(1, Relaxed);
                toffload_guard_conflict(page, f.id);
                crate::log_at!(
                    crate::log::DEBUG,
                    "guard: conflict on page {page:#x} by fiber {}",
                    f.id
                );
            }
        });
    }
    if seen != 0 {
        crate::stats::COUNTERS.guard_faults.fetch_add(seen, Relaxed);
    }
}

#[inline]
fn is_async() -> bool {
    MECH.load(Relaxed) == MECH_UFFD_ASYNC
}

fn clock() -> u64 {
    LEDGER.lock().as_ref().map_or(0, |l| l.clock())
}

/// The uffd handler thread's view of a fault: which fiber was running on that thread.
fn on_uffd_write(page: usize, tid: i32) {
    let fiber = crate::carrier::all()
        .into_iter()
        .find(|c| c.tid.load(Relaxed) == tid)
        .and_then(|c| {
            // SAFETY: the carrier is blocked in this very fault; `current` is stable.
            let p = unsafe { std::ptr::read_volatile(c.current.as_ptr()) };
            (!p.is_null()).then(|| unsafe { &*p })
        });
    record_write(page, fiber);
    DIRTY.lock().push(page);
    DIRTY_N.fetch_add(1, Relaxed);
}

extern "C" fn uffd_thread(_: *mut libc::c_void) -> *mut libc::c_void {
    uffd::serve(UFFD.load(Acquire), on_uffd_write)
}

fn protect_all(ranges: &[Range], prot: c_int) {
    for r in ranges {
        // SAFETY: pages of the program's own data that we guard.
        unsafe { libc::mprotect(r.start as *mut _, r.end - r.start, prot) };
    }
}

/// Sets the guard up, once, when the first fiber is created (start-up writes are not
/// handlers' and are not watched).
pub fn arm() {
    let cfg = crate::settings();
    if cfg.guard == GuardMode::Off || ARMED.swap(true, AcqRel) {
        return;
    }
    let (mut ranges, got) = regions::executable_data();
    match regions::resolve(&cfg.guard_regions) {
        Ok(extra) => ranges.extend(extra),
        Err(e) => crate::log::line(format_args!(
            "TOFFLOAD_GUARD_REGIONS: {e}; guarding the rest"
        )),
    }
    ranges.extend(PENDING.lock().drain(..));
    // The page holding .got.plt is read by every PLT call and written by lazy binding:
    // neither is a handler's shared state.
    let ranges = split_out(ranges, &got);
    let pages: usize = ranges.iter().map(|r| (r.end - r.start) / PAGE).sum();
    crate::stats::COUNTERS.guard_pages.store(pages, Relaxed);
    let m = if cfg.guard == GuardMode::Enforce {
        2
    } else {
        1
    };
    crate::stats::COUNTERS.guard_mode.store(m, Relaxed);
    *RANGES.lock() = ranges.clone();
    crate::signals::install();
    match cfg.guard {
        GuardMode::Enforce => {
            own::arm(&ranges);
            crate::log_at!(
                crate::log::INFO,
                "guard: enforce on {pages} pages (page ownership, mprotect)"
            );
        }
        GuardMode::Detect => {
            let (mech, mprotect_ranges) = arm_detect(cfg, &ranges);
            MECH.store(mech, Release);
            if !mprotect_ranges.is_empty() {
                if mech != MECH_MPROTECT {
                    crate::log_at!(
                        crate::log::INFO,
                        "guard: uffd-wp refused {} ranges; mprotect there",
                        mprotect_ranges.len()
                    );
                }
                MPROTECT_RANGES
                    .lock()
                    .extend(mprotect_ranges.iter().copied());
                protect_all(&mprotect_ranges, libc::PROT_READ);
            }
            crate::log_at!(
                crate::log::INFO,
                "guard: detect on {pages} pages ({})",
                mechanism()
            );
        }
        GuardMode::Off => {}
    }
}

/// Registers `ranges` with the uffd `fd` and write-protects them: the ranges it refused.
fn register_all(fd: c_int, ranges: &[Range]) -> Vec<Range> {
    ranges
        .iter()
        .filter(|r| !(uffd::watch(fd, **r) && uffd::protect(fd, r.start, r.end - r.start, true)))
        .copied()
        .collect()
}

/// Picks and arms detect's mechanism: (MECH_*, the ranges left to mprotect).
fn arm_detect(cfg: &crate::config::Config, ranges: &[Range]) -> (u8, Vec<Range>) {
    if cfg.guard_mech == GuardMech::Mprotect {
        return (MECH_MPROTECT, ranges.to_vec());
    }
    let forced_async = cfg.guard_mech == GuardMech::UffdAsync;
    if matches!(cfg.guard_mech, GuardMech::Auto | GuardMech::UffdAsync) {
        // A scan sees which pages were written, not by which thread: the writes are the
        // running fiber's only while one carrier runs fibers.
        if cfg.carriers > 1 {
            if forced_async {
                crate::log::line(format_args!(
                    "TOFFLOAD_GUARD_MECH=uffd-async needs TOFFLOAD_CARRIERS=1; using uffd"
                ));
            }
        } else {
            match uffd::open_async() {
                Ok((fd, pm)) => {
                    let refused = register_all(fd, ranges);
                    if refused.len() < ranges.len() {
                        UFFD.store(fd, Release);
                        PAGEMAP.store(pm, Release);
                        *SPANS.lock() = spans(ranges.iter().filter(|r| !refused.contains(r)));
                        return (MECH_UFFD_ASYNC, refused);
                    }
                    // SAFETY: our own fds, never published.
                    unsafe {
                        libc::close(pm);
                        libc::close(fd);
                    }
                }
                Err(e) if forced_async => crate::log::line(format_args!(
                    "TOFFLOAD_GUARD_MECH=uffd-async: not available here (errno {e}); using uffd"
                )),
                Err(_) => {}
            }
        }
    }
    let Ok(fd) = uffd::open() else {
        return (MECH_MPROTECT, ranges.to_vec());
    };
    UFFD.store(fd, Release);
    let refused = register_all(fd, ranges);
    let mut t: libc::pthread_t = 0;
    // SAFETY: a real thread that only touches the runtime's own memory.
    unsafe {
        (crate::real::pthread_create())(&mut t, std::ptr::null(), uffd_thread, std::ptr::null_mut())
    };
    (MECH_UFFD, refused)
}

/// The registered ranges, sorted, touching ones merged: one scan each. Never across a
/// gap: a scan reports every present page of memory not registered for async
/// write-protect as written (its pages carry no write-protect bit).
fn spans<'a>(ranges: impl Iterator<Item = &'a Range>) -> Vec<Range> {
    let mut v: Vec<Range> = ranges.copied().collect();
    v.sort_by_key(|r| r.start);
    let mut out: Vec<Range> = Vec::new();
    for r in v {
        match out.last_mut() {
            Some(l) if r.start <= l.end => l.end = l.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Ranges whose writes the mprotect fallback watches (detect).
static MPROTECT_RANGES: SpinLock<Vec<Range>> = SpinLock::new(Vec::new());

fn split_out(ranges: Vec<Range>, holes: &[usize]) -> Vec<Range> {
    let mut out = Vec::new();
    for r in ranges {
        let mut s = r.start;
        while s < r.end {
            if holes.contains(&s) {
                s += PAGE;
                continue;
            }
            let mut e = s;
            while e < r.end && !holes.contains(&e) {
                e += PAGE;
            }
            out.push(Range { start: s, end: e });
            s = e;
        }
    }
    out
}

// ---- hooks from the scheduler and the interposers ----------------------------------

/// A fiber parks at its offload: its window opens.
pub fn offload_park(f: &Fiber) {
    if on() {
        if is_async() {
            // What it wrote since it last resumed belongs to the window now closing.
            collect(f);
            f.guard.collected.set(true);
        }
        f.guard.win_open.store(false, Release);
        f.guard.win_start.store(clock(), Release);
    }
}

/// It resumed: writes from now until it next switches out are checked.
pub fn offload_resume(f: &Fiber) {
    if on() {
        f.guard.collected.set(false);
        f.guard.win_end.store(clock(), Release);
        f.guard.win_open.store(true, Release);
    }
}

/// The carrier is about to run `f`.
#[inline]
pub fn switch_in(f: &Fiber) {
    if on() && mode() == GuardMode::Enforce {
        own::switch_in(f);
    }
}

/// `f` handed the carrier back.
#[inline]
pub fn switch_out(f: &Fiber) {
    if !on() {
        return;
    }
    if is_async() && !f.guard.collected.replace(false) {
        collect(f);
    }
    f.guard.win_open.store(false, Release);
    if mode() == GuardMode::Enforce {
        own::switch_out(f);
    } else if DIRTY_N.load(Relaxed) != 0 {
        rearm();
    }
}

/// Write-protects again the pages that were opened for a write since the last time.
fn rearm() {
    let pages: Vec<usize> = std::mem::take(&mut *DIRTY.lock());
    DIRTY_N.store(0, Relaxed);
    let fd = UFFD.load(Acquire);
    let mp = MPROTECT_RANGES.lock();
    for p in pages {
        if mp.iter().any(|r| r.contains(p)) || fd < 0 {
            // SAFETY: one of our guarded pages.
            unsafe { libc::mprotect(p as *mut _, PAGE, libc::PROT_READ) };
        } else {
            uffd::protect(fd, p, PAGE, true);
        }
    }
}

/// The fiber wrote to or is about to read from a socket: its handler is over.
#[inline]
pub fn handler_end(f: &Fiber) {
    if on() && mode() == GuardMode::Enforce {
        own::release_all(f);
    }
}

/// SIGSEGV on a guarded page: true when the guard handled it.
///
/// # Safety
/// Called from the SIGSEGV handler with the kernel's context.
pub unsafe fn on_fault(addr: usize, ctx: *mut libc::c_void) -> bool {
    if !on() || !in_guarded(addr) {
        return false;
    }
    let page = addr & !(PAGE - 1);
    match mode() {
        GuardMode::Enforce => own::on_fault(page, ctx),
        GuardMode::Detect => {
            if !MPROTECT_RANGES.lock().iter().any(|r| r.contains(page)) {
                return false;
            }
            record_write(page, crate::fiber::current());
            DIRTY.lock().push(page);
            DIRTY_N.fetch_add(1, Relaxed);
            libc::mprotect(page as *mut _, PAGE, libc::PROT_READ | libc::PROT_WRITE);
            true
        }
        GuardMode::Off => false,
    }
}

/// toffload_guard_region(): cooperative code adds a range to guard.
pub fn add_region(start: usize, len: usize) -> c_int {
    if len == 0 || start.checked_add(len).is_none() {
        return -libc::EINVAL;
    }
    let r = Range::pages(start, start + len);
    if mode() == GuardMode::Off {
        return 0;
    }
    if !ARMED.load(Acquire) {
        PENDING.lock().push(r);
        return 0;
    }
    // Armed already: guard it now with the mprotect mechanism of this mode.
    RANGES.lock().push(r);
    crate::stats::COUNTERS
        .guard_pages
        .fetch_add((r.end - r.start) / PAGE, Relaxed);
    match mode() {
        GuardMode::Enforce => own::arm(&[r]),
        _ => {
            MPROTECT_RANGES.lock().push(r);
            protect_all(&[r], libc::PROT_READ);
        }
    }
    0
}

/// Fork child: the guard does not follow (uffd registrations do not, and the child's
/// fibers are new): open every page again.
pub fn after_fork_child() {
    if !ARMED.load(Acquire) {
        return;
    }
    // SAFETY: only thread of the child.
    unsafe {
        RANGES.force_unlock();
        MPROTECT_RANGES.force_unlock();
        DIRTY.force_unlock();
        LEDGER.force_unlock();
        SPANS.force_unlock();
        own::after_fork_child();
    }
    let r = RANGES.lock().clone();
    protect_all(&r, libc::PROT_READ | libc::PROT_WRITE);
    RANGES.lock().clear();
    ARMED.store(false, Release);
    // The pagemap fd reads the parent's memory: of no use here.
    let pm = PAGEMAP.swap(-1, AcqRel);
    if pm >= 0 {
        // SAFETY: our own fd.
        unsafe { libc::close(pm) };
    }
}

/// "uffd-async", "uffd", "mprotect" or "off", for the stats.
pub fn mechanism() -> &'static str {
    match (mode(), MECH.load(Relaxed)) {
        (GuardMode::Off, _) => "off",
        (GuardMode::Enforce, _) => "mprotect",
        (_, MECH_UFFD) => "uffd",
        (_, MECH_UFFD_ASYNC) => "uffd-async",
        (_, MECH_MPROTECT) => "mprotect",
        _ => "unarmed",
    }
}
