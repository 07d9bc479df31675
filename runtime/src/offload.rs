//! The offload table: blocking entry points and the non-blocking triples that replace
//! them on a fiber (submit, then park until done, then release). Row 0 is the built-in
//! accel_run; TOFFLOAD_OFFLOAD adds rows, reached through the GOT (see got.rs).
//!
//! Completions: where the backend has a completion fd (accel_completion_fd), every
//! carrier's epoll watches it edge-triggered and scans its own offload waiters when it
//! fires; otherwise a carrier with offload waiters polls them at a short interval.
//! Short offloads must not lose: when a row's observed latency is below what a park and
//! resume costs, the fiber waits inline.
//!
//! Polled completions (TOFFLOAD_COMPLETIONS=poll, the default): where the backend has
//! accel_submit_polled, the built-in row submits that way and its waiters are looked
//! at by due time, by a busy carrier between fibers and by an idle one that sleeps
//! until the earliest is due. The device then never wakes for them: on a VM a device
//! wake-up (timer interrupt, two context switches, the eventfd) costs the server's
//! core tens of microseconds, several times a request's own CPU.

use crate::carrier::Carrier;
use crate::fiber::{self, Fiber};
use crate::{real, stats, time};
use libc::{c_int, c_long, c_void};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use std::sync::OnceLock;

pub type Args = [usize; 6];
type SubmitFn = unsafe extern "C" fn(usize, usize, usize, usize, usize, usize) -> c_long;
/// 1 done, 0 pending, -errno failed; 2 done, and the call's result is the blocking
/// function's own, which returns at once now (cuda_rows.c: the stream's status).
type DoneFn = unsafe extern "C" fn(c_long) -> c_int;
/// done(): complete, the result to be taken from the blocking function (the CUDA
/// rows: a synchronize returns the stream's own status, which is not an errno).
const DONE_ASK_BLOCKING: c_int = 2;
type ReleaseFn = unsafe extern "C" fn(c_long) -> c_int;
/// accel_submit_polled(buf, n, *due_ns): the built-in row's polled submit.
type SubmitPolledFn = unsafe extern "C" fn(usize, usize, *mut i64) -> c_long;
type BlockingFn = unsafe extern "C" fn(usize, usize, usize, usize, usize, usize) -> c_long;

pub const MAX_ROWS: usize = 1 + crate::config::MAX_TABLE_ROWS;

pub struct Row {
    pub name: String,
    /// The application's own blocking function (what non-fibers still call).
    pub blocking: usize,
    submit: usize,
    done: usize,
    release: usize,
    /// accel_submit_polled, on the built-in row where the backend library has it.
    submit_polled: usize,
    /// Whether submit_polled works: UNKNOWN until the first offload, NO after an
    /// EOPNOTSUPP (a backend that only signals completions).
    polled: AtomicU8,
    /// EWMA of observed latency, ns (0 = nothing observed yet).
    pub lat_ns: AtomicU64,
    /// The device's own latency as far as it shows: the least observed over the
    /// last FLOOR_EVERY operations (each observation is the device's plus how late
    /// it was looked at, plus its fiber's wait for the carrier).
    floor_ns: AtomicU64,
    /// The least observed so far in this round of FLOOR_EVERY, and the count.
    round_min: AtomicU64,
    observed: AtomicU64,
    /// A look in this round found an op pending past its first look's time: the
    /// floor is not above the device's latency (observe_floor).
    round_pending: AtomicBool,
    /// Completion eventfd, or -1 when the backend has none (then waiters are polled).
    completion_fd: AtomicI32,
}

/// Operations per round of a row's latency floor (Row::observe).
const FLOOR_EVERY: u64 = 64;

const UNKNOWN: u8 = 0;
const YES: u8 = 1;
const NO: u8 = 2;

pub struct OffloadWait {
    pub fiber: *const Fiber,
    pub row: usize,
    pub handle: c_long,
    pub submitted: u64,
    /// No completion fd: carriers must look (a polled submit, or a row without one).
    pub polled: bool,
    /// When the backend said it will be done (CLOCK_MONOTONIC ns); 0 = not known.
    pub due: u64,
    /// Set by the scan: done(handle)'s result (1 or -errno).
    pub result: *const Cell<c_int>,
}

static ROWS: OnceLock<Vec<Row>> = OnceLock::new();
/// Park + resume cost, ns, measured when the first carrier runs a fiber.
pub static PARK_COST_NS: AtomicU64 = AtomicU64::new(0);
/// Offloads in flight on polled rows (no completion fd), across carriers.
static POLLED_INFLIGHT: AtomicUsize = AtomicUsize::new(0);
/// Parked offloads submitted polled (in the stats JSON only: the exported counter
/// block's layout stays as toffload-watch reads it).
pub static OFFLOADS_POLLED: AtomicUsize = AtomicUsize::new(0);

fn sym(handle: *mut c_void, name: &str) -> usize {
    let Ok(c) = std::ffi::CString::new(name) else {
        return 0;
    };
    // SAFETY: valid C string and pseudo-handle.
    unsafe { libc::dlsym(handle, c.as_ptr()) as usize }
}

/// The rows, resolved on first use. Row 0's blocking function is the next accel_run
/// after ours (RTLD_NEXT); the triples and extra rows come from the global scope.
pub fn rows() -> &'static [Row] {
    ROWS.get_or_init(|| {
        let cfg = crate::settings();
        let mut rows = Vec::new();
        for (i, r) in cfg.offload.iter().enumerate() {
            let blocking = if i == 0 {
                sym(libc::RTLD_NEXT, &r.blocking)
            } else {
                sym(libc::RTLD_DEFAULT, &r.blocking)
            };
            let row = Row::new(
                r.blocking.clone(),
                blocking,
                [
                    sym(libc::RTLD_DEFAULT, &r.submit),
                    sym(libc::RTLD_DEFAULT, &r.done),
                    sym(libc::RTLD_DEFAULT, &r.release),
                ],
                if i == 0 && cfg.completions == crate::config::Completions::Poll {
                    sym(libc::RTLD_DEFAULT, "accel_submit_polled")
                } else {
                    0
                },
            );
            if i > 0
                && !r.optional
                && (row.blocking == 0 || row.submit == 0 || row.done == 0 || row.release == 0)
            {
                crate::log_at!(
                    crate::log::ERROR,
                    "offload row {}:{}:{}:{}: a symbol is missing; the row is ignored",
                    r.blocking,
                    r.submit,
                    r.done,
                    r.release
                );
            }
            rows.push(row);
        }
        rows
    })
}

impl Row {
    /// `triple`: submit, done, release.
    fn new(name: String, blocking: usize, triple: [usize; 3], submit_polled: usize) -> Row {
        Row {
            name,
            blocking,
            submit: triple[0],
            done: triple[1],
            release: triple[2],
            submit_polled,
            polled: AtomicU8::new(UNKNOWN),
            lat_ns: AtomicU64::new(0),
            floor_ns: AtomicU64::new(0),
            round_min: AtomicU64::new(u64::MAX),
            observed: AtomicU64::new(0),
            round_pending: AtomicBool::new(false),
            completion_fd: AtomicI32::new(-2),
        }
    }

    fn usable(&self) -> bool {
        self.blocking != 0 && self.submit != 0 && self.done != 0 && self.release != 0
    }

    fn completion_fd(&self, idx: usize) -> c_int {
        let fd = self.completion_fd.load(Acquire);
        if fd != -2 {
            return fd;
        }
        let mut fd = -1;
        if idx == 0 {
            let f = sym(libc::RTLD_DEFAULT, "accel_completion_fd");
            if f != 0 {
                // SAFETY: int accel_completion_fd(void).
                let g: unsafe extern "C" fn() -> c_int = unsafe { std::mem::transmute(f) };
                // SAFETY: it takes no arguments.
                let r = unsafe { g() };
                fd = if r >= 0 { r } else { -1 };
            }
        }
        self.completion_fd.store(fd, Release);
        fd
    }

    /// The fiber's whole wait, submit to resumption: what decides waiting inline.
    fn observe(&self, ns: u64) {
        let old = self.lat_ns.load(Relaxed);
        let new = if old == 0 { ns } else { (old * 7 + ns) / 8 };
        self.lat_ns.store(new.max(1), Relaxed);
    }

    /// How long an op without a due time took until a look found it done (submit to
    /// that look, not to its fiber's resumption), for the floor its waiters are looked
    /// at by (poll_interval).
    fn observe_floor(&self, ns: u64) {
        // A windowed minimum, not one that creeps up. And to the look, not to the
        // resumption: a fiber woken with many others waits its turn on the carrier,
        // and under many connections every resumption of a round could sit that far
        // above the device; the floor then held there, and with it the first look
        // of every op, so each op waited about a device latency more than it needed.
        // Rounds race between carriers harmlessly: a floor a round old is as good.
        let least = self.round_min.fetch_min(ns, Relaxed).min(ns);
        if self.floor_ns.load(Relaxed) == 0 {
            self.floor_ns.store(ns.max(1), Relaxed);
        }
        if self.observed.fetch_add(1, Relaxed) % FLOOR_EVERY == FLOOR_EVERY - 1 {
            self.round_min.store(u64::MAX, Relaxed);
            // A round whose every op was done at its first look says only that the
            // device is at least that quick: the floor may sit far above it (one stall
            // of the carrier, and every op of the round was found done late). Lowered
            // a sixteenth a round, a floor forty times the device's took some sixty
            // rounds of waits that long to come down; halved, a handful. One halving
            // too far costs a round of looks every sixteenth of the lower floor, and
            // its ops, pending at their first look, set the floor back.
            let floor = if self.round_pending.swap(false, Relaxed) {
                least
            } else {
                least / 2
            };
            self.floor_ns.store(floor.max(1), Relaxed);
        }
    }

    /// A look found an op submitted at `submitted` still pending at `now`: where that
    /// is past its first look's time, the floor is not too high.
    fn note_pending(&self, now: u64, submitted: u64) {
        // Every scan asks each pending waiter: once marked, the round's line is left
        // unwritten (carriers share it).
        if self.round_pending.load(Relaxed) {
            return;
        }
        let floor = self.floor_ns.load(Relaxed);
        if now.saturating_sub(submitted) >= floor - floor / 16 {
            self.round_pending.store(true, Relaxed);
        }
    }
}

/// Forgets cached completion fds (fork child: the device restarts with new ones).
pub fn after_fork_child() {
    if let Some(rows) = ROWS.get() {
        for r in rows {
            r.completion_fd.store(-2, Release);
        }
    }
    POLLED_INFLIGHT.store(0, Relaxed);
}

/// Calls the blocking function of `row` as the application asked, on a real thread.
///
/// # Safety
/// `args` are the caller's arguments for the row's blocking function.
pub unsafe fn call_blocking(row: usize, a: Args) -> c_long {
    let r = &rows()[row];
    if r.blocking == 0 {
        return -(libc::ENOSYS as c_long);
    }
    // SAFETY: a row's blocking function takes six word-sized arguments (the offload
    // table's C ABI), and `a` are the application's own for it.
    unsafe {
        let f: BlockingFn = std::mem::transmute(r.blocking);
        f(a[0], a[1], a[2], a[3], a[4], a[5])
    }
}

/// The offload on a fiber: submit, park until done, release. Returns what the blocking
/// call returns: 0, or the negative errno.
///
/// # Safety
/// As call_blocking.
pub unsafe fn offload(f: &Fiber, row: usize, a: Args) -> c_long {
    let rows = rows();
    let r = &rows[row];
    if !r.usable() {
        // SAFETY: `a` are the caller's arguments for this row (our own contract).
        return unsafe { call_blocking(row, a) };
    }
    // SAFETY: usable(): all three resolved, to the backend's functions of these types.
    let (submit, done, release) = unsafe {
        (
            std::mem::transmute::<usize, SubmitFn>(r.submit),
            std::mem::transmute::<usize, DoneFn>(r.done),
            std::mem::transmute::<usize, ReleaseFn>(r.release),
        )
    };
    stats::COUNTERS.offloads.fetch_add(1, Relaxed);
    let t0 = time::now_ns();
    let mut polled = r.submit_polled != 0 && r.polled.load(Relaxed) != NO;
    let mut due: i64 = 0;
    let h = loop {
        let h = if polled {
            // SAFETY: resolved as accel_submit_polled; row 0's arguments are
            // accel_run's (buf, n), and `due` is a local.
            unsafe {
                let f: SubmitPolledFn = std::mem::transmute(r.submit_polled);
                f(a[0], a[1], &mut due)
            }
        } else {
            // SAFETY: submit takes the blocking function's arguments, the caller's.
            unsafe { submit(a[0], a[1], a[2], a[3], a[4], a[5]) }
        };
        if polled && r.polled.load(Relaxed) == UNKNOWN {
            let works = h != -(libc::EOPNOTSUPP as c_long);
            r.polled.store(if works { YES } else { NO }, Relaxed);
        }
        if polled && h == -(libc::EOPNOTSUPP as c_long) {
            polled = false;
            continue;
        }
        if h == -(libc::EAGAIN as c_long) {
            // The device is full: let the others finish something first.
            fiber::yield_now(f);
            continue;
        }
        if h < 0 {
            return h;
        }
        break h;
    };
    let lat = r.lat_ns.load(Relaxed);
    let result = Cell::new(0);
    // Looked at by the floor while parked: the scan observes it (observe_floor).
    let mut floor_seen = false;
    if lat != 0 && lat < PARK_COST_NS.load(Relaxed).max(200) {
        // Cheaper to wait than to switch away and back.
        stats::COUNTERS.offloads_inline.fetch_add(1, Relaxed);
        loop {
            // SAFETY: h is live: submitted above and not yet released.
            result.set(unsafe { done(h) });
            if result.get() != 0 {
                break;
            }
            std::hint::spin_loop();
        }
    } else {
        stats::COUNTERS.offloads_parked.fetch_add(1, Relaxed);
        // A polled op is not done before its due time: no need to ask.
        if !(polled && due as u64 > t0) {
            // SAFETY: h is live: submitted above and not yet released.
            result.set(unsafe { done(h) });
        }
        if result.get() == 0 {
            let c = f.carrier();
            let fd = if polled { -1 } else { r.completion_fd(row) };
            if polled {
                OFFLOADS_POLLED.fetch_add(1, Relaxed);
            }
            if fd >= 0 {
                c.watch_completion(row, fd);
            } else {
                POLLED_INFLIGHT.fetch_add(1, Relaxed);
                floor_seen = !polled;
            }
            // SAFETY: carrier-local list; we are on the carrier's thread, and the scan
            // that reads it runs between fibers, not now.
            unsafe {
                (*c.offloads.get()).push(OffloadWait {
                    fiber: f,
                    row,
                    handle: h,
                    submitted: t0,
                    polled: fd < 0,
                    due: if polled { due.max(1) as u64 } else { 0 },
                    result: &result,
                })
            };
            c.idle_poll.parked_offload();
            crate::guard::offload_park(f);
            while result.get() == 0 {
                fiber::park(f);
            }
            crate::guard::offload_resume(f);
            if fd < 0 {
                POLLED_INFLIGHT.fetch_sub(1, Relaxed);
            }
        }
    }
    let waited = time::now_ns().saturating_sub(t0);
    r.observe(waited);
    let timed_by_due = polled && due > 0;
    if !(floor_seen || timed_by_due) {
        // Done at once, or waited inline: the device was that quick.
        r.observe_floor(waited);
    }
    crate::latency::offload_waited(waited);
    if result.get() == DONE_ASK_BLOCKING {
        // The operation is complete: the real call returns its exact result at once.
        // SAFETY: `a` are the caller's arguments for this row.
        let rv = unsafe { call_blocking(row, a) };
        // SAFETY: h is live, released once, here.
        unsafe { release(h) };
        return rv;
    }
    // SAFETY: h is live, released once, here.
    let rel = unsafe { release(h) };
    if result.get() < 0 {
        result.get() as c_long
    } else {
        rel.min(0) as c_long
    }
}

/// Carrier side: completes the waiters whose operation is done. Called every turn;
/// does the work only when a completion fd fired or a polled row has waiters. A
/// waiter whose due time is known is looked at only from then on.
pub fn scan(c: &Carrier, completion_seen: bool) {
    if !(completion_seen || POLLED_INFLIGHT.load(Relaxed) > 0) {
        return;
    }
    scan_where(c, time::now_ns(), |_| true);
}

/// Between fibers on a busy carrier: completes the waiters that are due by now (the
/// polled submits), without the syscalls of a full poll.
pub fn scan_due(c: &Carrier, now: u64) {
    if POLLED_INFLIGHT.load(Relaxed) == 0 {
        return;
    }
    scan_where(c, now, |w| w.due != 0);
}

/// Asks `done` of the waiters `look` picks, from their due time on (`now`).
fn scan_where(c: &Carrier, now: u64, look: impl Fn(&OffloadWait) -> bool) {
    // SAFETY: carrier-local list.
    let list = unsafe { &mut *c.offloads.get() };
    if list.is_empty() {
        return;
    }
    let rows = rows();
    let before = list.len();
    list.retain(|w| {
        if !look(w) || w.due > now {
            return true;
        }
        // SAFETY: only usable rows park waiters, and their done is this type.
        let done: DoneFn = unsafe { std::mem::transmute(rows[w.row].done) };
        // SAFETY: the handle is live until its fiber releases it, after this wake.
        let r = unsafe { done(w.handle) };
        if r == 0 {
            if w.polled && w.due == 0 {
                rows[w.row].note_pending(now, w.submitted);
            }
            return true;
        }
        if w.polled && w.due == 0 {
            rows[w.row].observe_floor(now.saturating_sub(w.submitted));
        }
        // SAFETY: `result` lives on the parked fiber's stack until it is woken.
        unsafe {
            (*w.result).set(if r == DONE_ASK_BLOCKING {
                r
            } else if r > 0 {
                1
            } else {
                r
            })
        };
        // SAFETY: the fiber is parked on this wait, so it is alive.
        fiber::wake(unsafe { &*w.fiber });
        false
    });
    c.idle_poll.completed_offloads((before - list.len()) as u32);
}

/// For an idle carrier with offloads on polled rows: how soon to look again.
/// True while offloads without a completion fd are in flight (some carrier must look
/// at them on time: the handoff monitor's test).
pub fn polled_inflight() -> bool {
    POLLED_INFLIGHT.load(Relaxed) != 0
}

pub fn poll_interval(c: &Carrier, now: u64) -> Option<u64> {
    if POLLED_INFLIGHT.load(Relaxed) == 0 {
        return None;
    }
    // SAFETY: carrier-local list.
    let list = unsafe { &*c.offloads.get() };
    let rows = rows();
    list.iter()
        .filter(|w| w.polled)
        .map(|w| {
            if w.due != 0 {
                // The backend said when: sleep until then, not a guess before it.
                return w.due.saturating_sub(now);
            }
            let row = &rows[w.row];
            let lat = row.lat_ns.load(Relaxed).max(10_000);
            let floor = row.floor_ns.load(Relaxed).clamp(10_000, lat);
            // First at 15/16 of the least latency seen lately (submit to the look
            // that found an op done), then every 1/16 of it. Not at the average: a
            // first look there only ever confirms it, and once raised (a burst of
            // queueing on a busy carrier) it stayed raised: a vendor row at 1 ms
            // settled at 8 ms a call. Not at the least seen
            // either: nothing would ever read below it. A little before it, the
            // floor falls to the device's own latency plus a sixteenth at most. At
            // half the average and every eighth after, a 1 ms GPU row was looked at
            // ~300 us late under 64 connections.
            (w.submitted + floor - floor / 16)
                .saturating_sub(now)
                .max(floor / 16)
                .max(2_000)
        })
        .min()
}

/// The interposed blocking call of `row` (accel_run, or a GOT-patched extra row).
///
/// # Safety
/// As call_blocking.
pub unsafe fn interposed(row: usize, a: Args) -> c_long {
    let _phase = crate::handoff::scope();
    let saved = real::errno();
    let r = match fiber::current() {
        // SAFETY: `a` are the caller's arguments for this row (our own contract).
        Some(f) if !crate::settings().disabled.offload => unsafe { offload(f, row, a) },
        // SAFETY: as above.
        _ => return unsafe { call_blocking(row, a) },
    };
    real::set_errno(saved);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One round of ops on a device of `device_ns` looked at by `r`'s floor: each
    /// op's first look at 15/16 of it, then every sixteenth (poll_interval).
    fn round(r: &Row, device_ns: u64) {
        for _ in 0..FLOOR_EVERY {
            let floor = r.floor_ns.load(Relaxed);
            let mut look = floor - floor / 16;
            while look < device_ns {
                r.note_pending(look, 0);
                look += (floor / 16).max(1);
            }
            r.observe_floor(look);
        }
    }

    #[test]
    fn a_floor_a_stall_raised_comes_down_in_a_few_rounds() {
        const D: u64 = 1_000_000;
        let r = Row::new(String::new(), 0, [0; 3], 0);
        r.observe_floor(D);
        for _ in 0..4 {
            round(&r, D);
        }
        let settled = r.floor_ns.load(Relaxed);
        assert!((D..D + D / 8).contains(&settled), "settled at {settled}");
        // Two rounds' ops found done 40 device latencies late (a carrier with many
        // connections stalled): one whole round saw nothing but those.
        for _ in 0..2 * FLOOR_EVERY {
            r.observe_floor(40 * D);
        }
        let mut rounds = 0;
        while r.floor_ns.load(Relaxed) > D + D / 8 {
            round(&r, D);
            rounds += 1;
            assert!(
                rounds <= 8,
                "floor {} after {rounds} rounds",
                r.floor_ns.load(Relaxed)
            );
        }
        // And it stays: no round halves it while ops are pending at the first look.
        for _ in 0..10 {
            round(&r, D);
            let f = r.floor_ns.load(Relaxed);
            assert!((D / 2..D + D / 8).contains(&f), "floor {f}");
        }
    }
}
