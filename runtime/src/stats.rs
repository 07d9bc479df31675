//! The runtime's counters. TOFFLOAD_STATS=PATH keeps a one-line JSON copy of them in
//! PATH ("%p" in it becomes the pid): written at load, by a carrier at most every 50 ms
//! while they change, and at exit. Tests and the watcher read it to see whether the
//! runtime engaged and what it did.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};

pub static FIBERS_CREATED: AtomicUsize = AtomicUsize::new(0);
pub static FIBERS_LIVE: AtomicUsize = AtomicUsize::new(0);
pub static CARRIERS: AtomicUsize = AtomicUsize::new(0);
pub static PARKS: AtomicUsize = AtomicUsize::new(0);
pub static OFFLOADS: AtomicUsize = AtomicUsize::new(0);
pub static OFFLOADS_PARKED: AtomicUsize = AtomicUsize::new(0);
pub static OFFLOADS_INLINE: AtomicUsize = AtomicUsize::new(0);
pub static IO_PARKS: AtomicUsize = AtomicUsize::new(0);

const EVERY_NS: u64 = 50_000_000;
static LAST_FLUSH: AtomicU64 = AtomicU64::new(0);
static LAST_SUM: AtomicUsize = AtomicUsize::new(usize::MAX);

fn sum() -> usize {
    [
        &FIBERS_CREATED,
        &FIBERS_LIVE,
        &CARRIERS,
        &PARKS,
        &OFFLOADS,
        &IO_PARKS,
        &crate::guard::FAULTS,
        &crate::guard::SERIALIZED,
    ]
    .iter()
    .map(|c| c.load(Relaxed))
    .fold(0usize, |a, b| a.wrapping_add(b))
}

pub fn json() -> String {
    format!(
        "{{\"pid\":{},\"engaged\":{},\"carriers\":{},\"fibers_created\":{},\"fibers_live\":{},\"parks\":{},\"offloads\":{},\"offloads_parked\":{},\"offloads_inline\":{},\"io_parks\":{},\"park_cost_ns\":{},\"guard\":\"{}\",\"guard_pages\":{},\"guard_faults\":{},\"guard_conflicts\":{},\"guard_serialized\":{},\"guard_released\":{}}}\n",
        // SAFETY: getpid cannot fail.
        unsafe { libc::getpid() },
        crate::engaged(),
        CARRIERS.load(Relaxed),
        FIBERS_CREATED.load(Relaxed),
        FIBERS_LIVE.load(Relaxed),
        PARKS.load(Relaxed),
        OFFLOADS.load(Relaxed),
        OFFLOADS_PARKED.load(Relaxed),
        OFFLOADS_INLINE.load(Relaxed),
        IO_PARKS.load(Relaxed),
        crate::offload::PARK_COST_NS.load(Relaxed),
        crate::guard::mechanism(),
        crate::guard::GUARDED_PAGES.load(Relaxed),
        crate::guard::FAULTS.load(Relaxed),
        crate::guard::CONFLICTS.load(Relaxed),
        crate::guard::SERIALIZED.load(Relaxed),
        crate::guard::RELEASED.load(Relaxed),
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
