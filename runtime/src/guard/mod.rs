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
//! - sampled detect (TOFFLOAD_GUARD_SAMPLE, sample.rs): detect watches for a share of
//!   the time only. In an off phase every guarded range is open (one ioctl or mprotect
//!   per range) and the switch hooks return after one load; going on protects them all
//!   again and starts a new epoch: a park window counts only if it opened in the epoch
//!   it closes in, so a window part of which went unwatched is never checked. The
//!   carriers flip the phase between fibers (Carrier::turn, through `tick`), never in
//!   the middle of a fiber's run: with uffd-async the writes a scan finds then still
//!   belong to the fiber that ran since the last scan, and no scan runs while pages
//!   are open (an open page reads as written). With uffd the pages are opened without
//!   waking a writer blocked in a fault, so that the handler thread still attributes
//!   its write to the fiber that made it.
//! - enforce: page ownership (own.rs). A handler that touches a guarded page owns it
//!   until its response is written; another handler touching it waits. Handlers that
//!   touch different pages (or none) keep overlapping. Ownership needs to see first
//!   reads, which write-protection cannot: enforce makes pages inaccessible (mprotect
//!   PROT_NONE) and relaxes pages that handlers only ever read.

pub mod ledger;
mod own;
pub mod regions;
pub mod sample;
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

/// How detect sees writes.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mech {
    /// Not armed (or enforce, which has its own mechanism).
    Unarmed = 0,
    /// userfaultfd write-protect, faults served by the handler thread.
    Uffd = 1,
    /// mprotect + SIGSEGV.
    Mprotect = 2,
    /// userfaultfd asynchronous write-protect + PAGEMAP_SCAN.
    UffdAsync = 3,
}

impl Mech {
    fn load(a: &AtomicU8) -> Mech {
        match a.load(Relaxed) {
            1 => Mech::Uffd,
            2 => Mech::Mprotect,
            3 => Mech::UffdAsync,
            _ => Mech::Unarmed,
        }
    }
}

/// Every piece of the guard's process-wide state, in one place, so that a fork child
/// starts from a fresh one whole (after_fork_child) rather than field by field.
struct State {
    mech: AtomicU8,
    uffd: AtomicI32,
    /// /proc/self/pagemap (uffd-async).
    pagemap: AtomicI32,
    /// uffd-async: the spans to scan (the registered ranges, touching ones merged).
    spans: SpinLock<Vec<Range>>,
    armed: AtomicBool,
    /// Guarded ranges (whole pages).
    ranges: SpinLock<Vec<Range>>,
    ledger: SpinLock<Option<Ledger>>,
    /// Pages whose write protection was lifted since the last re-arm (detect).
    dirty: SpinLock<Vec<usize>>,
    dirty_n: AtomicUsize,
    /// Regions announced through toffload_guard_region() before the guard was armed.
    pending: SpinLock<Vec<Range>>,
    /// Ranges registered with the uffd (either uffd mechanism), for the sampled on/off.
    wp_ranges: SpinLock<Vec<Range>>,
    /// Ranges whose writes the mprotect fallback watches (detect).
    mprotect_ranges: SpinLock<Vec<Range>>,
    /// The sampled detect's phase (sample::phase_word): bit 0 on. Exact detect (and
    /// enforce) stays in epoch 0, on, for good.
    phase: AtomicU64,
    /// When a carrier should next look at the phase (CLOCK_MONOTONIC ns): never unless
    /// sampled.
    next_tick: AtomicU64,
    /// The sampled detect's cycle and its start.
    duty: SpinLock<Option<(sample::Duty, u64)>>,
    /// One carrier flips the phase at a time.
    flipping: AtomicBool,
    /// Watched time so far, ns, up to on_since (the start of the current on phase, or 0).
    watched_ns: AtomicU64,
    on_since: AtomicU64,
}

impl State {
    const fn new() -> State {
        State {
            mech: AtomicU8::new(Mech::Unarmed as u8),
            uffd: AtomicI32::new(-1),
            pagemap: AtomicI32::new(-1),
            spans: SpinLock::new(Vec::new()),
            armed: AtomicBool::new(false),
            ranges: SpinLock::new(Vec::new()),
            ledger: SpinLock::new(None),
            dirty: SpinLock::new(Vec::new()),
            dirty_n: AtomicUsize::new(0),
            pending: SpinLock::new(Vec::new()),
            wp_ranges: SpinLock::new(Vec::new()),
            mprotect_ranges: SpinLock::new(Vec::new()),
            phase: AtomicU64::new(sample::phase_word(0, true)),
            next_tick: AtomicU64::new(u64::MAX),
            duty: SpinLock::new(None),
            flipping: AtomicBool::new(false),
            watched_ns: AtomicU64::new(0),
            on_since: AtomicU64::new(0),
        }
    }
}

/// The one State. In an UnsafeCell so that the fork child, the only thread of its
/// process, can put a fresh one in its place.
struct Global(UnsafeCell<State>);

// SAFETY: every field of State is an atomic or a SpinLock; the cell is written only by
// after_fork_child, when no other thread exists and no reference is held.
unsafe impl Sync for Global {}

static STATE: Global = Global(UnsafeCell::new(State::new()));

#[inline]
fn st() -> &'static State {
    // SAFETY: see Global; replaced only in a single-threaded fork child.
    unsafe { &*STATE.0.get() }
}

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
    /// Enforce: the page the fiber is parked waiting for (0: none), for the wait-for
    /// graph; written and read under own.rs's PAGES lock.
    pub(crate) waiting_for: AtomicUsize,
    /// uffd-async: its writes were collected as it parked at its offload; the
    /// switch-out that follows has nothing of it to collect.
    collected: Cell<bool>,
    /// The phase the window opened in (sample::NO_PHASE: parked unwatched).
    win_phase: AtomicU64,
}

impl FiberGuard {
    /// The park window, if it opened and closed in the current on phase: one that
    /// spans an off phase (writes went unseen in it) or ended before a new epoch
    /// began is not checked.
    fn window(&self) -> Option<ledger::Window> {
        (self.win_open.load(Acquire) && self.win_phase.load(Acquire) == st().phase.load(Acquire))
            .then(|| (self.win_start.load(Acquire), self.win_end.load(Acquire)))
    }
}

/// Whether detect watches now (always, unless sampled and in an off phase).
#[inline]
fn watching() -> bool {
    st().phase.load(Relaxed) & 1 == 1
}

pub fn mode() -> GuardMode {
    crate::settings().guard
}

#[inline]
fn on() -> bool {
    st().armed.load(Relaxed)
}

pub fn in_guarded(addr: usize) -> bool {
    st().ranges.lock().iter().any(|r| r.contains(addr))
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
    let conflict = st()
        .ledger
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
    let pm = st().pagemap.load(Relaxed);
    let fd = st().uffd.load(Relaxed);
    let window = f.guard.window();
    let spans = st().spans.lock();
    let mut ledger = None;
    let mut seen = 0usize;
    for s in spans.iter() {
        uffd::scan_written(pm, fd, s.start, s.end, |page| {
            seen += 1;
            let l = ledger.get_or_insert_with(|| st().ledger.lock());
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
    Mech::load(&st().mech) == Mech::UffdAsync
}

fn clock() -> u64 {
    st().ledger.lock().as_ref().map_or(0, |l| l.clock())
}

/// The uffd handler thread's view of a fault: which fiber was running on that thread.
fn on_uffd_write(page: usize, tid: i32) {
    let fiber = crate::handoff::fiber_of_thread(tid);
    record_write(page, fiber);
    st().dirty.lock().push(page);
    st().dirty_n.fetch_add(1, Relaxed);
}

extern "C" fn uffd_thread(_: *mut libc::c_void) -> *mut libc::c_void {
    uffd::serve(st().uffd.load(Acquire), on_uffd_write)
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
    if cfg.guard == GuardMode::Off || st().armed.swap(true, AcqRel) {
        return;
    }
    let (mut ranges, got) = regions::executable_data();
    match regions::resolve(&cfg.guard_regions) {
        Ok(extra) => ranges.extend(extra),
        Err(e) => crate::log::line(format_args!(
            "TOFFLOAD_GUARD_REGIONS: {e}; guarding the rest"
        )),
    }
    ranges.extend(st().pending.lock().drain(..));
    // The page holding .got.plt is read by every PLT call and written by lazy binding:
    // neither is a handler's shared state.
    let ranges = split_out(ranges, &got);
    let pages: usize = ranges.iter().map(|r| (r.end - r.start) / PAGE).sum();
    crate::stats::COUNTERS.guard_pages.store(pages, Relaxed);
    let m = if cfg.guard == GuardMode::Enforce {
        toffload_abi::runtime::GuardMode::Enforce
    } else {
        toffload_abi::runtime::GuardMode::Detect
    };
    crate::stats::COUNTERS.guard_mode.store(m as usize, Relaxed);
    *st().ranges.lock() = ranges.clone();
    crate::signals::install();
    match cfg.guard {
        GuardMode::Enforce => {
            if cfg.guard_sample != crate::config::DEFAULT_GUARD_SAMPLE && cfg.guard_sample != 100 {
                crate::log_at!(
                    crate::log::INFO,
                    "guard: TOFFLOAD_GUARD_SAMPLE applies to detect only; enforce sees every access"
                );
            }
            let now = crate::time::now_ns();
            st().on_since.store(now, Relaxed);
            st().next_tick.store(now + STATS_EVERY_NS, Release);
            crate::stats::COUNTERS.guard_sample.store(100, Relaxed);
            own::arm(&ranges);
            crate::log_at!(
                crate::log::INFO,
                "guard: enforce on {pages} pages (page ownership, mprotect)"
            );
        }
        GuardMode::Detect => {
            let (mech, mprotect_ranges) = arm_detect(cfg, &ranges);
            st().mech.store(mech as u8, Release);
            if !mprotect_ranges.is_empty() {
                if mech != Mech::Mprotect {
                    crate::log_at!(
                        crate::log::INFO,
                        "guard: uffd-wp refused {} ranges; mprotect there",
                        mprotect_ranges.len()
                    );
                }
                st().mprotect_ranges
                    .lock()
                    .extend(mprotect_ranges.iter().copied());
                protect_all(&mprotect_ranges, libc::PROT_READ);
            }
            crate::log_at!(
                crate::log::INFO,
                "guard: detect on {pages} pages ({}, watching {}% of the time)",
                mechanism(),
                cfg.guard_sample
            );
            start_sampling(cfg.guard_sample);
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

/// Picks and arms detect's mechanism: (it, the ranges left to mprotect).
fn arm_detect(cfg: &crate::config::Config, ranges: &[Range]) -> (Mech, Vec<Range>) {
    if cfg.guard_mech == GuardMech::Mprotect {
        return (Mech::Mprotect, ranges.to_vec());
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
                        st().uffd.store(fd, Release);
                        st().pagemap.store(pm, Release);
                        *st().wp_ranges.lock() = ranges
                            .iter()
                            .filter(|r| !refused.contains(r))
                            .copied()
                            .collect();
                        *st().spans.lock() = spans(ranges.iter().filter(|r| !refused.contains(r)));
                        return (Mech::UffdAsync, refused);
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
        return (Mech::Mprotect, ranges.to_vec());
    };
    st().uffd.store(fd, Release);
    let refused = register_all(fd, ranges);
    *st().wp_ranges.lock() = ranges
        .iter()
        .filter(|r| !refused.contains(r))
        .copied()
        .collect();
    let mut t: libc::pthread_t = 0;
    // SAFETY: a real thread that only touches the runtime's own memory.
    unsafe {
        (crate::real::pthread_create())(&mut t, std::ptr::null(), uffd_thread, std::ptr::null_mut())
    };
    (Mech::Uffd, refused)
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
        f.guard.win_open.store(false, Release);
        let phase = st().phase.load(Acquire);
        if phase & 1 == 0 {
            // Unwatched: this window is not checked, whatever comes after.
            f.guard.win_phase.store(sample::NO_PHASE, Release);
            return;
        }
        if is_async() {
            // What it wrote since it last resumed belongs to the window now closing.
            collect(f);
            f.guard.collected.set(true);
        }
        f.guard.win_start.store(clock(), Release);
        f.guard.win_phase.store(phase, Release);
    }
}

/// It resumed: writes from now until it next switches out are checked, if the whole
/// window was watched (it parked in this very on phase).
pub fn offload_resume(f: &Fiber) {
    if on() {
        f.guard.collected.set(false);
        if f.guard.win_phase.load(Acquire) != st().phase.load(Acquire) {
            return;
        }
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
    if !watching() {
        // Sampled detect, off phase: nothing is protected, nothing to collect. (Enforce
        // and exact detect are never off.)
        f.guard.win_open.store(false, Release);
        return;
    }
    if is_async() && !f.guard.collected.replace(false) {
        collect(f);
    }
    f.guard.win_open.store(false, Release);
    if mode() == GuardMode::Enforce {
        own::switch_out(f);
    } else if st().dirty_n.load(Relaxed) != 0 {
        rearm();
    }
}

/// Write-protects again the pages that were opened for a write since the last time.
fn rearm() {
    let pages: Vec<usize> = std::mem::take(&mut *st().dirty.lock());
    st().dirty_n.store(0, Relaxed);
    let fd = st().uffd.load(Acquire);
    let mp = st().mprotect_ranges.lock();
    for p in pages {
        if mp.iter().any(|r| r.contains(p)) || fd < 0 {
            // SAFETY: one of our guarded pages.
            unsafe { libc::mprotect(p as *mut _, PAGE, libc::PROT_READ) };
        } else {
            uffd::protect(fd, p, PAGE, true);
        }
    }
}

/// Sampled detect: starts the cycle, in an on phase (the ranges were just protected).
fn start_sampling(pct: u8) {
    let now = crate::time::now_ns();
    st().on_since.store(now, Relaxed);
    crate::stats::COUNTERS
        .guard_sample
        .store(usize::from(pct), Relaxed);
    let Some(duty) = sample::Duty::new(pct) else {
        // Exact: always on; the ticks only keep the watched time up to date.
        st().next_tick.store(now + STATS_EVERY_NS, Release);
        return;
    };
    *st().duty.lock() = Some((duty, now));
    st().phase.store(sample::phase_word(1, true), Release);
    st().next_tick
        .store(now + duty.phase_end(0).min(STATS_EVERY_NS), Release);
}

/// How often the watched-time counter is brought up to date while watching.
const STATS_EVERY_NS: u64 = 50_000_000;

/// Called by every carrier once per turn, between fibers, with the time: flips the
/// sampled detect's phase when it is due (and brings the watched-time counter up to
/// date every 50 ms). One load and a compare otherwise.
#[inline]
pub fn tick(now: u64) {
    if now >= st().next_tick.load(Relaxed) {
        flip(now);
    }
}

#[cold]
fn flip(now: u64) {
    if st()
        .flipping
        .compare_exchange(false, true, Acquire, Relaxed)
        .is_err()
    {
        return; // another carrier is at it
    }
    let duty = *st().duty.lock();
    let next = match duty {
        Some((duty, t0)) => {
            flip_to(duty, t0, now);
            (t0 + duty.phase_end(now.saturating_sub(t0))).min(now + STATS_EVERY_NS)
        }
        None => now + STATS_EVERY_NS,
    };
    crate::stats::COUNTERS
        .guard_watched_ms
        .store((watched_ns(now) / 1_000_000) as usize, Relaxed);
    st().next_tick.store(next, Release);
    st().flipping.store(false, Release);
}

/// Puts the guard in the phase `duty` (started at `t0`) says `now` is in.
fn flip_to(duty: sample::Duty, t0: u64, now: u64) {
    let t = now.saturating_sub(t0);
    let (k, on) = duty.phase(t);
    let was_on = watching();
    if on && !was_on {
        // Protect first, then publish: a window can only open once every write in it
        // will be seen. Pages a scan would call written are protected again too, so
        // nothing written in the off phase reads as a write of this one.
        set_protection(true);
        st().on_since.store(now, Relaxed);
        st().phase.store(sample::phase_word(k + 1, true), Release);
    } else if !on && was_on {
        // Publish first: windows still open stop counting, nothing rearms.
        st().phase.store(sample::phase_word(k + 1, false), Release);
        let since = st().on_since.swap(0, Relaxed);
        st().watched_ns
            .fetch_add(now.saturating_sub(since), Relaxed);
        set_protection(false);
        st().dirty.lock().clear();
        st().dirty_n.store(0, Relaxed);
    }
    // An on phase that finds the guard still on (a carrier idle through the off
    // phase never opened anything) keeps its epoch: nothing went unwatched.
}

/// Time watched so far, ns.
fn watched_ns(now: u64) -> u64 {
    let since = st().on_since.load(Relaxed);
    st().watched_ns.load(Relaxed)
        + if since != 0 {
            now.saturating_sub(since)
        } else {
            0
        }
}

/// Brings the watched-time counter up to date (for the stats).
pub fn update_watched() {
    if st().armed.load(Relaxed) {
        crate::stats::COUNTERS.guard_watched_ms.store(
            (watched_ns(crate::time::now_ns()) / 1_000_000) as usize,
            Relaxed,
        );
    }
}

/// A copy of a range list, allocated outside its lock (an allocation can write a
/// page announced to the guard, whose fault handler takes these locks).
fn snapshot(l: &SpinLock<Vec<Range>>) -> Vec<Range> {
    loop {
        let n = l.lock().len();
        let mut v = Vec::with_capacity(n);
        let g = l.lock();
        if g.len() <= n {
            v.extend_from_slice(&g);
            return v;
        }
    }
}

/// Sampled detect: protects (`on`) or opens every guarded range, one call per range.
fn set_protection(on: bool) {
    let fd = st().uffd.load(Acquire);
    let wp = snapshot(&st().wp_ranges);
    if fd >= 0 {
        for r in &wp {
            // Opening does not wake a writer blocked in a fault (uffd): the handler
            // thread serves it and records its write as the writer's.
            uffd::protect_nowake(fd, r.start, r.end - r.start, on);
        }
    }
    let mp = snapshot(&st().mprotect_ranges);
    let prot = if on {
        libc::PROT_READ
    } else {
        libc::PROT_READ | libc::PROT_WRITE
    };
    protect_all(&mp, prot);
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
        // SAFETY: from the SIGSEGV handler with the kernel's context (our contract).
        GuardMode::Enforce => unsafe { own::on_fault(page, ctx) },
        GuardMode::Detect => {
            if !st().mprotect_ranges.lock().iter().any(|r| r.contains(page)) {
                return false;
            }
            record_write(page, crate::fiber::current());
            st().dirty.lock().push(page);
            st().dirty_n.fetch_add(1, Relaxed);
            // SAFETY: a page of a guarded range, which the guard itself protected.
            unsafe { libc::mprotect(page as *mut _, PAGE, libc::PROT_READ | libc::PROT_WRITE) };
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
    if !st().armed.load(Acquire) {
        st().pending.lock().push(r);
        return 0;
    }
    // Armed already: guard it now with the mprotect mechanism of this mode.
    st().ranges.lock().push(r);
    crate::stats::COUNTERS
        .guard_pages
        .fetch_add((r.end - r.start) / PAGE, Relaxed);
    match mode() {
        GuardMode::Enforce => own::arm(&[r]),
        _ => {
            st().mprotect_ranges.lock().push(r);
            protect_all(&[r], libc::PROT_READ);
        }
    }
    0
}

/// Fork child: the guard does not follow (uffd registrations do not, and the child's
/// fibers are new): open every page again and start from a fresh State.
pub fn after_fork_child() {
    if !st().armed.load(Acquire) {
        return;
    }
    // SAFETY: the only thread of the child; a lock a vanished thread held is free.
    unsafe {
        st().ranges.force_unlock();
        own::after_fork_child();
    }
    let r = st().ranges.lock().clone();
    protect_all(&r, libc::PROT_READ | libc::PROT_WRITE);
    // The uffd and pagemap fds belong to the parent's memory: of no use here.
    for fd in [st().pagemap.load(Acquire), st().uffd.load(Acquire)] {
        if fd >= 0 {
            // SAFETY: our own fds, which nothing in the child uses once replaced.
            unsafe { libc::close(fd) };
        }
    }
    // SAFETY: the only thread of the child, and no reference into the state is held
    // across this point (every user re-reads st()). The old state is forgotten, not
    // dropped: a lock in it may be held by a thread that did not survive the fork.
    unsafe { std::mem::forget(std::ptr::replace(STATE.0.get(), State::new())) };
}

/// "uffd-async", "uffd", "mprotect" or "off", for the stats.
pub fn mechanism() -> &'static str {
    match (mode(), Mech::load(&st().mech)) {
        (GuardMode::Off, _) => "off",
        (GuardMode::Enforce, _) => "mprotect",
        (_, Mech::Uffd) => "uffd",
        (_, Mech::UffdAsync) => "uffd-async",
        (_, Mech::Mprotect) => "mprotect",
        _ => "unarmed",
    }
}
