//! The runtime's counters. TOFFLOAD_STATS=PATH keeps a one-line JSON copy of them in
//! PATH ("%p" in it becomes the pid): written at load, by a carrier at most every 50 ms
//! while they change, and at exit. Tests and the watcher read it to see whether the
//! runtime engaged and what it did.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};

/// The counters, in one exported, C-laid-out block: a watcher (toffload-watch) reads
/// it from the target's memory (process_vm_readv at the address of the
/// `toffload_counters` symbol), so the runtime's numbers are visible without any
/// environment variable or file.
#[repr(C)]
pub struct Counters {
    /// COUNTERS_MAGIC: says the block is what the watcher expects.
    pub magic: AtomicU64,
    pub version: AtomicU64,
    pub fibers_created: AtomicUsize,
    pub fibers_live: AtomicUsize,
    pub carriers: AtomicUsize,
    pub parks: AtomicUsize,
    pub offloads: AtomicUsize,
    pub offloads_parked: AtomicUsize,
    pub offloads_inline: AtomicUsize,
    pub io_parks: AtomicUsize,
    /// 0 off, 1 detect, 2 enforce.
    pub guard_mode: AtomicUsize,
    pub guard_pages: AtomicUsize,
    pub guard_faults: AtomicUsize,
    pub guard_conflicts: AtomicUsize,
    pub guard_serialized: AtomicUsize,
    pub guard_released: AtomicUsize,
    /// 0 knobs not read yet, 1 active, 2 disabled (a malformed knob or
    /// TOFFLOAD_FIBERIZE=off): lets an injector tell a runtime that loaded but stays
    /// out of the way from one that will fiberize.
    pub state: AtomicUsize,
    /// Detect's TOFFLOAD_GUARD_SAMPLE (percent of the time watched; 100 exact, and
    /// for enforce); 0 while the guard is off or not armed. (Layout version 3.)
    pub guard_sample: AtomicUsize,
    /// Milliseconds the guard has watched since it armed (up to date within 50 ms
    /// while watching).
    pub guard_watched_ms: AtomicUsize,
}

/// "TOFFLOAD" in little-endian ASCII.
pub const COUNTERS_MAGIC: u64 = u64::from_le_bytes(*b"TOFFLOAD");

#[export_name = "toffload_counters"]
pub static COUNTERS: Counters = Counters {
    magic: AtomicU64::new(COUNTERS_MAGIC),
    version: AtomicU64::new(3),
    fibers_created: AtomicUsize::new(0),
    fibers_live: AtomicUsize::new(0),
    carriers: AtomicUsize::new(0),
    parks: AtomicUsize::new(0),
    offloads: AtomicUsize::new(0),
    offloads_parked: AtomicUsize::new(0),
    offloads_inline: AtomicUsize::new(0),
    io_parks: AtomicUsize::new(0),
    guard_mode: AtomicUsize::new(0),
    guard_pages: AtomicUsize::new(0),
    guard_faults: AtomicUsize::new(0),
    guard_conflicts: AtomicUsize::new(0),
    guard_serialized: AtomicUsize::new(0),
    guard_released: AtomicUsize::new(0),
    state: AtomicUsize::new(0),
    guard_sample: AtomicUsize::new(0),
    guard_watched_ms: AtomicUsize::new(0),
};

/// Of guard_released, the pages a real (non-fiber) thread touched: released because a
/// thread cannot be parked (a server's own thread reading the counters at exit, say),
/// rather than by a wait among handlers. In the stats JSON only: the exported block's
/// layout stays as toffload-watch reads it.
pub static GUARD_RELEASED_BY_THREAD: AtomicUsize = AtomicUsize::new(0);

const EVERY_NS: u64 = 50_000_000;
static LAST_FLUSH: AtomicU64 = AtomicU64::new(0);
static LAST_SUM: AtomicUsize = AtomicUsize::new(usize::MAX);

fn sum() -> usize {
    let c = &COUNTERS;
    [
        &c.fibers_created,
        &c.fibers_live,
        &c.carriers,
        &c.parks,
        &c.offloads,
        &c.io_parks,
        &c.guard_faults,
        &c.guard_serialized,
    ]
    .iter()
    .map(|c| c.load(Relaxed))
    .fold(0usize, |a, b| a.wrapping_add(b))
}

pub fn json() -> String {
    format!(
        "{{\"pid\":{},\"engaged\":{},\"carriers\":{},\"fibers_created\":{},\"fibers_live\":{},\"parks\":{},\"offloads\":{},\"offloads_parked\":{},\"offloads_inline\":{},\"io_parks\":{},\"park_cost_ns\":{},\"guard\":\"{}\",\"guard_pages\":{},\"guard_faults\":{},\"guard_conflicts\":{},\"guard_serialized\":{},\"guard_released\":{},\"guard_released_by_thread\":{},\"guard_sample\":{},\"guard_watched_ms\":{}}}\n",
        // SAFETY: getpid cannot fail.
        unsafe { libc::getpid() },
        crate::engaged(),
        COUNTERS.carriers.load(Relaxed),
        COUNTERS.fibers_created.load(Relaxed),
        COUNTERS.fibers_live.load(Relaxed),
        COUNTERS.parks.load(Relaxed),
        COUNTERS.offloads.load(Relaxed),
        COUNTERS.offloads_parked.load(Relaxed),
        COUNTERS.offloads_inline.load(Relaxed),
        COUNTERS.io_parks.load(Relaxed),
        crate::offload::PARK_COST_NS.load(Relaxed),
        crate::guard::mechanism(),
        crate::stats::COUNTERS.guard_pages.load(Relaxed),
        crate::stats::COUNTERS.guard_faults.load(Relaxed),
        crate::stats::COUNTERS.guard_conflicts.load(Relaxed),
        crate::stats::COUNTERS.guard_serialized.load(Relaxed),
        crate::stats::COUNTERS.guard_released.load(Relaxed),
        GUARD_RELEASED_BY_THREAD.load(Relaxed),
        crate::stats::COUNTERS.guard_sample.load(Relaxed),
        {
            crate::guard::update_watched();
            crate::stats::COUNTERS.guard_watched_ms.load(Relaxed)
        },
    )
}

fn path() -> Option<String> {
    let p = crate::settings().stats.as_ref()?;
    // SAFETY: getpid cannot fail.
    Some(p.replace("%p", &unsafe { libc::getpid() }.to_string()))
}

/// Writes the file now (tmp + rename, so readers never see half a line).
pub fn flush() {
    let Some(p) = path() else { return };
    let tmp = format!("{p}.tmp{}", crate::real::gettid());
    let body = json();
    let (Ok(ctmp), Ok(cp)) = (std::ffi::CString::new(tmp), std::ffi::CString::new(p)) else {
        return;
    };
    // SAFETY: plain file syscalls on our own paths; write is a raw syscall so that it
    // never goes through our own interposer.
    unsafe {
        let fd = libc::open(
            ctmp.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
            0o644,
        );
        if fd < 0 {
            return;
        }
        crate::real::raw_write(fd, body.as_bytes());
        libc::close(fd);
        libc::rename(ctmp.as_ptr(), cp.as_ptr());
    }
    LAST_SUM.store(sum(), Relaxed);
}

fn dirty() -> bool {
    crate::settings().stats.is_some() && LAST_SUM.load(Relaxed) != sum()
}

/// Called by carriers every turn.
pub fn maybe_flush(now: u64) {
    if !dirty() {
        return;
    }
    let last = LAST_FLUSH.load(Relaxed);
    if now.saturating_sub(last) >= EVERY_NS
        && LAST_FLUSH
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_ok()
    {
        flush();
    }
}

/// For an idle carrier: when the next flush is due, if counters changed.
pub fn flush_due(now: u64) -> Option<u64> {
    dirty().then(|| {
        (LAST_FLUSH.load(Relaxed) + EVERY_NS)
            .saturating_sub(now)
            .max(1_000_000)
    })
}
