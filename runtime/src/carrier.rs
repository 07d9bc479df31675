//! Carriers: the real threads that run fibers. Each has a run queue (fibers runnable
//! now), an injection queue (wake-ups from other threads), an epoll instance for I/O
//! and offload completions, and a deadline map. A carrier with nothing runnable sleeps
//! in epoll_pwait2 until I/O, a completion, a deadline or a wake-up from another thread;
//! it never scans every fiber and never busy-polls.

use crate::fiber::{Fiber, Yield, NOTIFIED, PARKED, RUNNING};
use crate::offload::OffloadWait;
use crate::spinlock::SpinLock;
use crate::{handoff, real, stats, time};
use libc::c_int;
use rustc_hash::FxHashMap;
use std::cell::{Cell, UnsafeCell};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering::*};

/// epoll data of the carrier's own wake-up eventfd; offload completion fds use
/// COMPLETION_TAG | row; anything else is an application fd.
const WAKE_TAG: u64 = u64::MAX;
pub const COMPLETION_TAG: u64 = 1 << 62;
/// Poll I/O at least this often while fibers keep the run queue busy.
const POLL_EVERY_NS: u64 = 20_000;

/// A carrier never spins through a wait longer than this (TOFFLOAD_SPIN_WAITS), however
/// late its timed sleeps come back: past it the CPU spent spinning outweighs the wait.
const SPIN_MAX_NS: u64 = 100_000;

/// What a timed sleep costs this carrier: how far past its deadline a sleep that
/// nothing cut short came back (an average over the last few, in ns).
///
/// Why: on a virtual machine a timed sleep arms the guest's timer (an exit to the
/// host), halts the vCPU (another) and waits for the host to run it again; a sleep of
/// a few tens of us can come back later than its own length and cost more CPU than
/// spinning through it (docs/architecture.md, "Short waits spin"). On bare metal it
/// comes back within a few us, and the carrier spins only through waits that short.
#[derive(Default)]
struct SleepCost {
    overshoot_ns: Cell<u64>,
}

impl SleepCost {
    /// A timed sleep of `asked` ns that timed out after `took`.
    fn timed_out(&self, asked: u64, took: u64) {
        let o = self.overshoot_ns.get();
        let sample = took.saturating_sub(asked).min(4 * SPIN_MAX_NS);
        self.overshoot_ns.set(o - o / 8 + sample / 8);
    }

    /// Whether to spin through a wait of `wait` ns rather than sleep.
    fn spin_through(&self, wait: u64) -> bool {
        wait <= self.overshoot_ns.get().min(SPIN_MAX_NS)
    }
}

/// How often, at most, the carrier looks for waits due a recheck (io::wait_fd).
const RECHECK_SWEEP_NS: u64 = 25_000_000;

pub struct FdWaiter {
    pub fiber: *const Fiber,
    pub events: u32,
    /// For a wait that trusts a remembered epoll registration: from when the carrier
    /// wakes it to check that registration (0: never).
    pub recheck_at: u64,
}

pub struct Carrier {
    pub index: usize,
    pub tid: AtomicI32,
    pub pthread: Cell<libc::pthread_t>,
    /// Read by the handoff monitor (poll for ready events), hence atomic.
    epfd: AtomicI32,
    wakefd: Cell<c_int>,
    sleeping: AtomicBool,
    inject: SpinLock<Vec<*const Fiber>>,
    inject_len: AtomicUsize,
    runq: UnsafeCell<VecDeque<*const Fiber>>,
    /// runq's length and the first deadline, mirrored for the handoff monitor.
    runq_len: AtomicUsize,
    next_deadline: AtomicU64,
    timers: UnsafeCell<BTreeMap<(u64, u64), *const Fiber>>,
    timer_seq: Cell<u64>,
    /// Fibers waiting on each fd. Fx-hashed (fds are small integers, and SipHash
    /// showed in the per-request profile), and an fd's entry stays when its last waiter
    /// leaves, so that a wait does not allocate.
    fdwait: UnsafeCell<FxHashMap<c_int, Vec<FdWaiter>>>,
    /// Waiters in fdwait with a recheck time, and when the sweep may next look.
    rechecks: Cell<usize>,
    next_sweep: Cell<u64>,
    pub offloads: UnsafeCell<Vec<OffloadWait>>,
    /// Rows whose completion fd this carrier's epoll watches (bit per row).
    completion_watched: Cell<u32>,
    completion_seen: Cell<bool>,
    last_poll: Cell<u64>,
    sleep_cost: SleepCost,
    pub live: AtomicUsize,
    pub idle_poll: crate::idle_poll::Poll,
}

// SAFETY: the UnsafeCell/Cell fields are used only by the thread running the carrier
// (its first thread, or the spare it was handed to: handoff.rs hands it over only while
// the old thread runs application code, and that thread never touches it again), and
// by the fork child handler, when no other thread exists; cross-thread fields are
// atomics or locked.
unsafe impl Sync for Carrier {}
// SAFETY: nothing in a carrier is tied to the thread that built it (fds, atomics, cells
// of plain data); it is built on the spawning thread, then run by its own.
unsafe impl Send for Carrier {}

/// The carrier running on this thread, if this is a carrier thread. Called from a
/// fiber's application code, it is a runtime entry: if the carrier was handed to a
/// spare meanwhile, the fiber moves there first (handoff.rs).
#[inline]
pub fn this<'a>() -> Option<&'a Carrier> {
    let mut w = handoff::worker()?;
    if w.in_app_code() {
        w = handoff::enter(w);
    }
    w.carrier()
}

/// Every carrier started in this process, in start order.
static CARRIERS: SpinLock<Vec<usize>> = SpinLock::new(Vec::new());
static NEXT: AtomicUsize = AtomicUsize::new(0);

fn new_fds() -> Option<(c_int, c_int)> {
    // SAFETY: plain fd-creating syscalls.
    unsafe {
        let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        if ep < 0 {
            return None;
        }
        let wake = libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC);
        if wake < 0 {
            libc::close(ep);
            return None;
        }
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: WAKE_TAG,
        };
        libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, wake, &mut ev);
        Some((ep, wake))
    }
}

impl Carrier {
    fn alloc(index: usize) -> Option<&'static Carrier> {
        let (ep, wake) = new_fds()?;
        Some(Box::leak(Box::new(Carrier {
            index,
            tid: AtomicI32::new(0),
            pthread: Cell::new(0),
            epfd: AtomicI32::new(ep),
            wakefd: Cell::new(wake),
            sleeping: AtomicBool::new(false),
            inject: SpinLock::new(Vec::new()),
            inject_len: AtomicUsize::new(0),
            runq: UnsafeCell::new(VecDeque::new()),
            runq_len: AtomicUsize::new(0),
            next_deadline: AtomicU64::new(u64::MAX),
            timers: UnsafeCell::new(BTreeMap::new()),
            timer_seq: Cell::new(0),
            fdwait: UnsafeCell::new(FxHashMap::default()),
            rechecks: Cell::new(0),
            next_sweep: Cell::new(0),
            offloads: UnsafeCell::new(Vec::new()),
            completion_watched: Cell::new(0),
            completion_seen: Cell::new(false),
            last_poll: Cell::new(0),
            sleep_cost: SleepCost::default(),
            live: AtomicUsize::new(0),
            idle_poll: Default::default(),
        })))
    }

    /// Queues a runnable fiber on this carrier (from any thread).
    pub fn enqueue(&self, f: &Fiber) {
        if this().is_some_and(|c| std::ptr::eq(c, self)) {
            self.push_local(f);
            return;
        }
        self.inject.lock().push(f);
        self.inject_len.fetch_add(1, SeqCst);
        if self.sleeping.swap(false, SeqCst) {
            let one: u64 = 1;
            // Raw syscall: `write` is interposed, and this may run on a fiber.
            // SAFETY: writing 8 bytes to our eventfd.
            unsafe {
                libc::syscall(
                    libc::SYS_write,
                    self.wakefd.get(),
                    &one as *const u64,
                    8usize,
                )
            };
        }
    }

    /// Queues on our own run queue (this carrier's thread only).
    fn push_local(&self, f: *const Fiber) {
        // SAFETY: carrier-local, and we are its thread.
        let q = unsafe { &mut *self.runq.get() };
        q.push_back(f);
        self.runq_len.store(q.len(), Relaxed);
    }

    fn pop_local(&self) -> Option<*const Fiber> {
        // SAFETY: carrier-local, and we are its thread.
        let q = unsafe { &mut *self.runq.get() };
        let f = q.pop_front();
        self.runq_len.store(q.len(), Relaxed);
        f
    }

    fn note_deadline(&self) {
        // SAFETY: carrier-local.
        let first = unsafe { (*self.timers.get()).keys().next().map_or(u64::MAX, |k| k.0) };
        self.next_deadline
            .store(first.min(self.sweep_due().unwrap_or(u64::MAX)), Relaxed);
    }

    /// When the recheck sweep is next due; None without waits to recheck.
    fn sweep_due(&self) -> Option<u64> {
        (self.rechecks.get() > 0).then(|| self.next_sweep.get())
    }

    /// True while the carrier sleeps in epoll (the handoff monitor's test).
    pub fn is_sleeping(&self) -> bool {
        self.sleeping.load(SeqCst)
    }

    /// The handoff monitor, from its own thread: does this carrier have something to
    /// run (queued fibers, ready events or completions, a due deadline, or offloads
    /// that are polled rather than signalled)?
    pub fn has_work(&self, now: u64) -> bool {
        if self.inject_len.load(Relaxed) != 0
            || self.runq_len.load(Relaxed) != 0
            || self.next_deadline.load(Relaxed) <= now
            || (self.live.load(Relaxed) > 1 && crate::offload::polled_inflight())
        {
            return true;
        }
        let mut p = libc::pollfd {
            fd: self.epfd.load(Relaxed),
            events: libc::POLLIN,
            revents: 0,
        };
        // An epoll fd polls readable while it has ready events; poll() reports without
        // taking them. Raw: poll is interposed.
        // SAFETY: one valid pollfd.
        unsafe { libc::syscall(libc::SYS_poll, &mut p as *mut libc::pollfd, 1, 0) == 1 }
    }

    // ---- timers ----------------------------------------------------------

    pub fn add_timer(&self, f: &Fiber, deadline: u64) {
        let seq = self.timer_seq.get() + 1;
        self.timer_seq.set(seq);
        // SAFETY: carrier-local.
        unsafe { (*self.timers.get()).insert((deadline, seq), f) };
        f.timer_key.set(Some((deadline, seq)));
        self.note_deadline();
    }

    pub fn cancel_timer(&self, f: &Fiber) {
        if let Some(k) = f.timer_key.take() {
            // SAFETY: carrier-local.
            unsafe { (*self.timers.get()).remove(&k) };
            self.note_deadline();
        }
    }

    fn fire_timers(&self, now: u64) {
        // SAFETY: carrier-local.
        let timers = unsafe { &mut *self.timers.get() };
        while let Some((&(d, seq), &f)) = timers.iter().next() {
            if d > now {
                break;
            }
            timers.remove(&(d, seq));
            // SAFETY: a fiber with a timer is parked in park_until, alive.
            let f = unsafe { &*f };
            f.timer_key.set(None);
            f.timer_fired.set(true);
            crate::fiber::wake(f);
        }
        self.note_deadline();
    }

    // ---- I/O ---------------------------------------------------------------

    /// Registers `fd` with this carrier's epoll (edge-triggered, both directions) and
    /// the running fiber as waiting for `events`, to be woken for a recheck from
    /// `recheck_at` (0: never). Err(errno) when epoll cannot watch it (a regular file:
    /// the caller then does the blocking call).
    pub fn watch_fd(
        &self,
        f: &Fiber,
        fd: c_int,
        events: u32,
        add: bool,
        recheck_at: u64,
    ) -> Result<(), c_int> {
        if add {
            self.register_fd(fd)?;
        }
        if recheck_at != 0 {
            // The deadline the monitor sees moves only when the first recheck comes.
            let first = self.rechecks.get() == 0;
            self.rechecks.set(self.rechecks.get() + 1);
            if first {
                self.next_sweep.set(recheck_at);
                self.note_deadline();
            }
        }
        // SAFETY: carrier-local.
        unsafe {
            (*self.fdwait.get()).entry(fd).or_default().push(FdWaiter {
                fiber: f,
                events,
                recheck_at,
            })
        };
        Ok(())
    }

    /// Adds `fd` to this carrier's epoll (already there is fine). Ok(true) when it was
    /// not there.
    pub fn register_fd(&self, fd: c_int) -> Result<bool, c_int> {
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32,
            u64: fd as u64,
        };
        // SAFETY: valid epoll fd and event.
        if unsafe { libc::epoll_ctl(self.epfd.load(Relaxed), libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0
        {
            let e = real::errno();
            return if e == libc::EEXIST { Ok(false) } else { Err(e) };
        }
        Ok(true)
    }

    /// Removes the running fiber's waits on `fd`.
    pub fn unwatch_fd(&self, f: &Fiber, fd: c_int) {
        // SAFETY: carrier-local.
        let map = unsafe { &mut *self.fdwait.get() };
        let mut dropped = 0;
        if let Some(v) = map.get_mut(&fd) {
            v.retain(|w| {
                let mine = std::ptr::eq(w.fiber, f);
                dropped += (mine && w.recheck_at != 0) as usize;
                !mine
            });
        }
        self.forget_rechecks(dropped);
    }

    fn forget_rechecks(&self, n: usize) {
        if n > 0 {
            self.rechecks.set(self.rechecks.get() - n);
            // sweep_due changes only when the last recheck goes.
            if self.rechecks.get() == 0 {
                self.note_deadline();
            }
        }
    }

    fn on_fd_event(&self, fd: c_int, events: u32) {
        // Before anything: a read that trusts the mark must see it cleared (drain.rs).
        crate::fd_facts::clear_drained(fd);
        // SAFETY: carrier-local.
        let map = unsafe { &mut *self.fdwait.get() };
        let Some(v) = map.get_mut(&fd) else { return };
        let errish = (libc::EPOLLERR | libc::EPOLLHUP) as u32;
        let mut dropped = 0;
        v.retain(|w| {
            if w.events & events != 0 || events & errish != 0 {
                dropped += (w.recheck_at != 0) as usize;
                // SAFETY: a waiting fiber is alive until it unregisters.
                crate::fiber::wake(unsafe { &*w.fiber });
                false
            } else {
                true
            }
        });
        self.forget_rechecks(dropped);
    }

    /// Wakes the waits whose recheck time passed (io::wait_fd then makes sure the
    /// epoll watches their fd). One pass over the waiters at most every
    /// RECHECK_SWEEP_NS, and none while no wait asks for a recheck: one BTreeMap timer
    /// per wait cost more than the rest of the wait's bookkeeping.
    fn sweep_rechecks(&self, now: u64) {
        if self.sweep_due().is_none_or(|d| d > now) {
            return;
        }
        self.next_sweep.set(now + RECHECK_SWEEP_NS);
        // SAFETY: carrier-local.
        let map = unsafe { &mut *self.fdwait.get() };
        let mut dropped = 0;
        for v in map.values_mut() {
            v.retain(|w| {
                if w.recheck_at == 0 || w.recheck_at > now {
                    return true;
                }
                dropped += 1;
                // SAFETY: a waiting fiber is alive until it unregisters.
                let f = unsafe { &*w.fiber };
                f.rechecked.set(true);
                crate::fiber::wake(f);
                false
            });
        }
        self.forget_rechecks(dropped);
        self.note_deadline();
    }

    /// Makes sure this carrier's epoll watches `fd`, the completion fd of `row`.
    pub fn watch_completion(&self, row: usize, fd: c_int) {
        let bit = 1u32 << row;
        if self.completion_watched.get() & bit != 0 {
            return;
        }
        let mut ev = libc::epoll_event {
            // Edge-triggered and never read: every completion batch the device signals
            // is a new edge, so each carrier sees every one without stealing the count
            // from the others.
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: COMPLETION_TAG | row as u64,
        };
        // SAFETY: valid fds.
        let r =
            unsafe { libc::epoll_ctl(self.epfd.load(Relaxed), libc::EPOLL_CTL_ADD, fd, &mut ev) };
        if r == 0 || real::errno() == libc::EEXIST {
            self.completion_watched
                .set(self.completion_watched.get() | bit);
        }
    }

    // ---- the scheduler loop -----------------------------------------------

    fn drain_inject(&self) {
        if self.inject_len.load(SeqCst) == 0 {
            return;
        }
        let mut q = self.inject.lock();
        self.inject_len.store(0, SeqCst);
        // SAFETY: carrier-local.
        let runq = unsafe { &mut *self.runq.get() };
        runq.extend(q.drain(..));
        self.runq_len.store(runq.len(), Relaxed);
    }

    /// Runs `f` until it yields; false when this thread lost the carrier meanwhile
    /// (handed off while it was blocked): then it must not touch it any more.
    fn run(&'static self, w: &'static handoff::Worker, f: &Fiber) -> bool {
        let cfg = crate::settings();
        w.set_current(f);
        if !cfg.disabled.errno {
            real::set_errno(f.errno.get());
        }
        crate::guard::switch_in(f);
        let keep_own = !cfg.disabled.carriertls;
        // SAFETY: w is this thread's worker, its own area and f's are touched only by
        // this thread while f runs here.
        unsafe {
            let own = keep_own.then(|| &mut *w.own_tls.get());
            crate::tls::switch_in(&w.tls, own, &*f.tls.get())
        };
        let r = f.resume();
        // On this thread still: a fiber that moved (handoff) yielded back here first.
        // SAFETY: as above.
        unsafe {
            let own = keep_own.then(|| &*w.own_tls.get());
            crate::tls::switch_out(&w.tls, own, &mut *f.tls.get())
        };
        crate::guard::switch_out(f);
        if !cfg.disabled.errno {
            f.errno.set(real::errno());
        }
        w.set_current(std::ptr::null());
        if handoff::lost_carrier(w) {
            // Handed off while the fiber ran (it yields with Migrate when it noticed):
            // the carrier is another thread's now.
            handoff::release(w, self, f, r);
            return false;
        }
        // After a fork from inside the fiber, this carrier was reset in place: still us.
        match r {
            Some(Yield::Park) => {
                if f.state
                    .compare_exchange(RUNNING, PARKED, AcqRel, Acquire)
                    .is_err()
                {
                    debug_assert_eq!(f.state.load(Acquire), NOTIFIED);
                    f.state.store(RUNNING, Release);
                    self.push_local(f);
                }
            }
            Some(Yield::Requeue | Yield::Migrate) => {
                if f.state.load(Acquire) == NOTIFIED {
                    f.state.store(RUNNING, Release);
                }
                self.push_local(f);
            }
            Some(Yield::Exit) | None => {
                f.release_stack();
                self.live.fetch_sub(1, Relaxed);
                stats::COUNTERS.fibers_live.fetch_sub(1, Relaxed);
                crate::thread::on_fiber_finished(f);
            }
        }
        true
    }

    /// One turn: run what is runnable, then poll I/O, completions and deadlines (without
    /// sleeping when work remains).
    fn turn(&'static self, w: &'static handoff::Worker) {
        self.drain_inject();
        // SAFETY: carrier-local.
        let n = unsafe { (*self.runq.get()).len() };
        for _ in 0..n {
            let Some(f) = self.pop_local() else {
                break;
            };
            // SAFETY: queued fibers are alive.
            if !self.run(w, unsafe { &*f }) {
                return;
            }
        }
        // SAFETY: carrier-local.
        let busy = unsafe { !(*self.runq.get()).is_empty() };
        let now = time::now_ns();
        // Between fibers: where the sampled guard may turn on or off.
        crate::guard::tick(now);
        let idle = if busy { None } else { self.idle_timeout(now) };
        // A wait shorter than a timed sleep's overshoot: spin through it, as if busy.
        let spin = idle.is_some_and(|t| {
            crate::settings().spin_waits && t > 0 && self.sleep_cost.spin_through(t)
        });
        if (busy || spin) && now.saturating_sub(self.last_poll.get()) < POLL_EVERY_NS {
            // Polled offloads that are due resume now, not at the next full poll.
            crate::offload::scan_due(self, now);
            return;
        }
        let timeout = if busy || spin { Some(0) } else { idle };
        self.poll(timeout);
        let now = time::now_ns();
        self.last_poll.set(now);
        self.fire_timers(now);
        self.sweep_rechecks(now);
        crate::offload::scan(self, self.completion_seen.replace(false));
        stats::maybe_flush(now);
    }

    /// When the last poll returned (monotonic ns): for a fiber woken by an fd event,
    /// when its fd was seen ready.
    pub fn polled_at(&self) -> u64 {
        self.last_poll.get()
    }

    /// How long an idle carrier may sleep: until the next deadline, a polled offload's
    /// expected completion, or the next stats flush; None = until woken.
    fn idle_timeout(&self, now: u64) -> Option<u64> {
        // SAFETY: carrier-local.
        let timers = unsafe { &*self.timers.get() };
        let mut t = timers.keys().next().map(|&(d, _)| d.saturating_sub(now));
        let mut min = |x: Option<u64>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        min(crate::offload::poll_interval(self, now));
        min(stats::flush_due(now));
        min(self.sweep_due().map(|d| d.saturating_sub(now)));
        t
    }

    fn poll(&self, timeout_ns: Option<u64>) {
        let sleeping = timeout_ns != Some(0);
        if sleeping {
            self.sleeping.store(true, SeqCst);
            if self.inject_len.load(SeqCst) != 0 {
                self.sleeping.store(false, SeqCst);
                return;
            }
            // SAFETY: carriers are leaked, never freed.
            let me: &'static Carrier = unsafe { &*(self as *const Carrier) };
            self.idle_poll.before_sleep(me);
        }
        let mut evs: [libc::epoll_event; 128] = [libc::epoll_event { events: 0, u64: 0 }; 128];
        let ts = timeout_ns.map(|ns| libc::timespec {
            tv_sec: (ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (ns % 1_000_000_000) as libc::c_long,
        });
        let tsp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // epoll_pwait2: nanosecond timeouts (epoll_wait's are milliseconds, far too
        // coarse for 20 us offloads and usleep(100)).
        let asleep_at = if sleeping { time::now_ns() } else { 0 };
        // SAFETY: valid buffer and timespec.
        let n = unsafe {
            libc::syscall(
                libc::SYS_epoll_pwait2,
                self.epfd.load(Relaxed),
                evs.as_mut_ptr(),
                evs.len() as c_int,
                tsp,
                std::ptr::null::<libc::sigset_t>(),
                0usize,
            )
        };
        if sleeping {
            self.sleeping.store(false, SeqCst);
            handoff::carrier_woke();
            if let (0, Some(asked)) = (n, timeout_ns) {
                self.sleep_cost
                    .timed_out(asked, time::now_ns().saturating_sub(asleep_at));
            }
        }
        for ev in evs.iter().take(n.max(0) as usize) {
            let (data, events) = (ev.u64, ev.events);
            if data == WAKE_TAG {
                continue;
            } else if data & COMPLETION_TAG != 0 && data != WAKE_TAG {
                self.completion_seen.set(true);
            } else {
                self.on_fd_event(data as c_int, events);
            }
        }
    }

    /// Fork child, when the forking thread was this carrier: forget the parent's other
    /// fibers and make fresh epoll/eventfd, in place (our own frames hold `&self`).
    ///
    /// # Safety
    /// Only in a forked child, on this carrier's thread.
    pub unsafe fn reset_in_child(&self, keep: Option<&Fiber>) {
        // SAFETY: in a forked child (our contract) this is the only thread, so no one
        // holds the lock and the carrier-local lists have no other user.
        unsafe {
            self.inject.force_unlock();
        }
        self.inject.lock().clear();
        self.inject_len.store(0, SeqCst);
        // SAFETY: as above.
        unsafe {
            (*self.runq.get()).clear();
            self.runq_len.store(0, Relaxed);
            self.next_deadline.store(u64::MAX, Relaxed);
            (*self.timers.get()).clear();
            (*self.fdwait.get()).clear();
            self.rechecks.set(0);
            (*self.offloads.get()).clear();
        }
        // Not closed: the parent still uses them; ours are fresh.
        if let Some((ep, wake)) = new_fds() {
            self.epfd.store(ep, Relaxed);
            self.wakefd.set(wake);
        }
        self.completion_watched.set(0);
        self.idle_poll.reset_in_child();
        self.tid.store(real::gettid(), SeqCst);
        self.live.store(keep.is_some() as usize, SeqCst);
        if let Some(f) = keep {
            f.timer_key.set(None);
            f.rechecked.set(false);
        }
    }
}

/// A worker thread: runs its carrier (a carrier's first thread, or a spare given a
/// stolen one); without one, waits as a spare (handoff.rs).
extern "C" fn carrier_main(arg: *mut libc::c_void) -> *mut libc::c_void {
    let w = handoff::Worker::register();
    if !arg.is_null() {
        // SAFETY: `arg` is a leaked &'static Carrier.
        w.adopt(unsafe { &*(arg as *const Carrier) });
    }
    crate::stack::install_altstack();
    // A carrier's timed sleeps end at an offload's due time or a fiber's deadline;
    // the default 50 us of slack would be added to each.
    // SAFETY: prctl on the calling thread only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    calibrate();
    // Decided here, on the carrier's own stack: under auto it reads sysfs, which an
    // offload on a fiber should not be the first to do.
    crate::idle_poll::enabled();
    crate::log_at!(
        crate::log::INFO,
        "worker for carrier {:?} started (tid {})",
        w.carrier().map(|c| c.index),
        real::gettid()
    );
    loop {
        // Re-read: a fork from a fiber resets the carrier in place, never moves it; a
        // handoff takes it away.
        match w.carrier() {
            Some(c) => c.turn(w),
            None => {
                w.wait_for_carrier();
            }
        }
    }
}

/// Starts a worker thread for `c`, or a spare (None). False if no thread could start.
pub fn spawn_worker(c: Option<&'static Carrier>) -> bool {
    let arg = c.map_or(std::ptr::null_mut(), |c| {
        c as *const Carrier as *mut libc::c_void
    });
    let mut t: libc::pthread_t = 0;
    // SAFETY: real pthread_create with a static carrier (or null) as argument.
    let r = unsafe { (real::pthread_create())(&mut t, std::ptr::null(), carrier_main, arg) };
    if r != 0 {
        crate::log_at!(crate::log::ERROR, "cannot start a worker thread: errno {r}");
    }
    r == 0
}

/// Measures a park + resume (two stack switches and the bookkeeping around them) once,
/// for the offload path's inline-wait rule.
fn calibrate() {
    use crate::offload::PARK_COST_NS;
    if PARK_COST_NS.load(Relaxed) != 0 {
        return;
    }
    let Some(st) = crate::stack::FiberStack::new(64 << 10) else {
        return;
    };
    const N: u64 = 2000;
    let mut co = corosensei::Coroutine::with_stack(st, |y: &corosensei::Yielder<(), ()>, ()| {
        for _ in 0..N {
            y.suspend(());
        }
    });
    let t0 = time::now_ns();
    for _ in 0..N {
        co.resume(());
        std::hint::black_box(real::errno());
    }
    let per = (time::now_ns() - t0) / N;
    co.resume(());
    co.into_stack().recycle();
    PARK_COST_NS.store(per.max(1), Relaxed);
}

/// Starts carriers up to the configured count; returns false if none could start.
fn ensure_started() -> bool {
    let want = crate::settings().carriers;
    let mut list = CARRIERS.lock();
    while list.len() < want {
        let Some(c) = Carrier::alloc(list.len()) else {
            break;
        };
        crate::signals::install();
        let mut t: libc::pthread_t = 0;
        // SAFETY: real pthread_create with a static carrier as argument.
        let r = unsafe {
            (real::pthread_create())(
                &mut t,
                std::ptr::null(),
                carrier_main,
                c as *const Carrier as *mut libc::c_void,
            )
        };
        if r != 0 {
            crate::log_at!(
                crate::log::ERROR,
                "cannot start a carrier thread: errno {r}"
            );
            break;
        }
        c.pthread.set(t);
        list.push(c as *const Carrier as usize);
    }
    stats::COUNTERS.carriers.store(list.len(), Relaxed);
    drop(list);
    handoff::start_monitor();
    crate::stats::COUNTERS.carriers.load(Relaxed) > 0
}

/// Picks the carrier for a new fiber: the creating fiber's own carrier (keeps a
/// connection's helpers together), else round robin.
pub fn pick() -> Option<&'static Carrier> {
    if let Some(c) = this() {
        // A forked child keeps its carrier but not the monitor thread.
        handoff::start_monitor();
        // SAFETY: carriers are 'static.
        return Some(unsafe { &*(c as *const Carrier) });
    }
    if !ensure_started() {
        return None;
    }
    let list = CARRIERS.lock();
    let i = NEXT.fetch_add(1, Relaxed) % list.len();
    // SAFETY: carriers are leaked, never freed.
    Some(unsafe { &*(list[i] as *const Carrier) })
}

/// All carriers, for lookups by pthread_t.
pub fn all() -> Vec<&'static Carrier> {
    CARRIERS
        .lock()
        .iter()
        // SAFETY: carriers are leaked, never freed.
        .map(|&p| unsafe { &*(p as *const Carrier) })
        .collect()
}

/// Fork child: the parent's carrier threads do not exist here. If the forking thread is
/// a carrier, it stays the only one (reset in place, keeping the running fiber);
/// otherwise carriers start again on the next fiber.
///
/// # Safety
/// Only in a forked child.
pub unsafe fn after_fork_child() {
    // The child's carriers have new epolls: no remembered registration holds.
    crate::fd_facts::new_epoch();
    // SAFETY: in a forked child (our contract) no other thread can hold it.
    unsafe { CARRIERS.force_unlock() };
    let mut list = CARRIERS.lock();
    list.clear();
    if let Some(c) = this() {
        let keep = crate::fiber::current();
        // SAFETY: a forked child, and c is this thread's own carrier.
        unsafe { c.reset_in_child(keep) };
        list.push(c as *const Carrier as usize);
    }
    stats::COUNTERS.carriers.store(list.len(), Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_carrier_spins_only_through_waits_its_sleeps_overshoot() {
        let c = SleepCost::default();
        // Nothing measured yet: always sleep.
        assert!(!c.spin_through(1));
        // Sleeps of 20 us that came back after 45: the overshoot settles near 25 us.
        for _ in 0..64 {
            c.timed_out(20_000, 45_000);
        }
        let o = c.overshoot_ns.get();
        assert!((24_000..=25_000).contains(&o), "{o}");
        assert!(c.spin_through(20_000));
        assert!(!c.spin_through(30_000));
        // A host that returns sleeps milliseconds late: never spin past the cap.
        for _ in 0..64 {
            c.timed_out(20_000, 5_000_000);
        }
        assert!(c.spin_through(SPIN_MAX_NS));
        assert!(!c.spin_through(SPIN_MAX_NS + 1));
        // Sleeps on time again: the spinning stops within a few.
        for _ in 0..40 {
            c.timed_out(20_000, 21_000);
        }
        assert!(!c.spin_through(20_000));
    }
}
