//! The runtime's counters. TOFFLOAD_STATS=PATH keeps a one-line JSON copy of them in
//! PATH ("%p" in it becomes the pid): written at load, by a carrier at most every 50 ms
//! while they change, and at exit. Tests and the watcher read it to see whether the
//! runtime engaged and what it did.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};
use toffload_abi::runtime::Counters;

/// The counters, in one exported, C-laid-out block (toffload-abi's layout): a watcher
/// (toffload-watch) reads it from the target's memory at the address of the
/// `toffload_counters` symbol, so the runtime's numbers are visible without any
/// environment variable or file.
#[export_name = "toffload_counters"]
pub static COUNTERS: Counters = Counters::new();

/// Of guard_released, the pages a real (non-fiber) thread touched: released because a
/// thread cannot be parked (a server's own thread reading the counters at exit, say),
/// rather than by a wait among handlers. In the stats JSON only: the exported block's
/// layout stays as toffload-watch reads it.
pub static GUARD_RELEASED_BY_THREAD: AtomicUsize = AtomicUsize::new(0);

/// Blocking reads that parked without asking the socket first, because their last
/// read had left it empty (drain.rs). In the stats JSON only, as the one above.
pub static READS_UNASKED: AtomicUsize = AtomicUsize::new(0);

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
        &c.handoffs,
    ]
    .iter()
    .map(|c| c.load(Relaxed))
    .fold(0usize, |a, b| a.wrapping_add(b))
}

pub fn json() -> String {
    format!(
        "{{\"pid\":{},\"engaged\":{},\"carriers\":{},\"fibers_created\":{},\"fibers_live\":{},\"parks\":{},\"offloads\":{},\"offloads_parked\":{},\"offloads_inline\":{},\"offloads_polled\":{},\"io_parks\":{},\"park_cost_ns\":{},\"guard\":\"{}\",\"guard_pages\":{},\"guard_faults\":{},\"guard_conflicts\":{},\"guard_serialized\":{},\"guard_released\":{},\"guard_released_by_thread\":{},\"guard_sample\":{},\"guard_watched_ms\":{},\"handoffs\":{},\"reads_unasked\":{}}}\n",
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
        crate::offload::OFFLOADS_POLLED.load(Relaxed),
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
        COUNTERS.handoffs.load(Relaxed),
        READS_UNASKED.load(Relaxed),
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
