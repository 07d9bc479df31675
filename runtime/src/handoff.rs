//! Blocked-carrier handoff. A fiber that blocks in a call the runtime does not see (a
//! raw `syscall(SYS_futex)`, `io_uring_enter`, a driver ioctl) blocks its carrier
//! thread, and with it every other fiber of that carrier, possibly the one that would
//! end the wait. Here, as Go's sysmon does for goroutines in system calls, a monitor
//! thread notices a carrier that has stayed in application code past
//! TOFFLOAD_HANDOFF_US, its thread asleep in the kernel, while it has work (runnable
//! fibers, ready events, due timers) and hands the carrier (its run queue, epoll, timers, fibers) to a spare thread.
//!
//! Threads ("workers") and carriers are apart: a worker runs at most one carrier. Each
//! worker has a phase word, written only by itself with plain stores: `app` (odd, with
//! a sequence number) while a fiber runs application code, `runtime` (even) anywhere
//! else. The monitor steals only from `app`: it announces the steal, runs a process-wide
//! barrier (membarrier), and commits only if the phase is still the `app` it observed;
//! a fiber entering the runtime stores `runtime` and then reads the announcement (the
//! asymmetric Dekker: the fast path has no fence instruction). The blocked thread, when
//! its call returns and its fiber next enters the runtime, sees the committed steal,
//! hands its fiber to the carrier's queue (where the spare picks it up) and becomes a
//! spare itself. So a process has at most TOFFLOAD_CARRIERS + min(live fibers,
//! TOFFLOAD_HANDOFF_MAX_SPARES) threads running fibers: no more than the stock server's
//! thread per connection, and with a cap of at least the fibers that can wait below
//! libc at once, never too few for a carrier with work.
//!
//! The monitor sleeps on a futex while every carrier sleeps: an idle server costs no
//! CPU. While some carrier is awake it looks every half threshold.

use crate::carrier::Carrier;
use crate::fiber::{Fiber, Yield, PARKED, RUNNING};
use crate::spinlock::SpinLock;
use crate::waitq::{futex_wait, futex_wake};
use crate::{real, stats, time};
use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::Ordering::*;
use std::sync::atomic::{
    compiler_fence, AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize,
};

/// A worker's steal word.
const NONE: u32 = 0;
/// The monitor announced a steal and has not decided yet.
const PENDING: u32 = 1;
/// The carrier belongs to another worker now.
const COMMITTED: u32 = 2;

/// One runtime thread that runs fibers: a carrier's first thread or a spare.
pub struct Worker {
    tid: AtomicI32,
    carrier: AtomicPtr<Carrier>,
    /// The fiber this thread runs, if any (its own use only).
    current: Cell<*const Fiber>,
    /// Odd: application code since the last runtime exit; even: runtime.
    phase: AtomicU64,
    seq: Cell<u64>,
    steal: AtomicU32,
    /// The monitor's: the phase it last saw and when.
    seen: AtomicU64,
    seen_at: AtomicU64,
    /// A carrier given to this worker while it waits as a spare.
    assigned: AtomicPtr<Carrier>,
    wake: AtomicU32,
    /// The signal mask the thread started with (restored after a handoff that
    /// happened inside an application's signal handler).
    mask: UnsafeCell<libc::sigset_t>,
    /// This thread's blocks of the application's TLS (tls.rs).
    pub tls: crate::tls::Blocks,
    /// The thread's own values of those blocks while one of its fibers runs.
    pub own_tls: UnsafeCell<crate::tls::Area>,
}

// SAFETY: `current`, `seq`, `mask` and `own_tls` are touched only by the worker's own
// thread; the rest are atomics or never change.
unsafe impl Sync for Worker {}
// SAFETY: as above; built by its own thread.
unsafe impl Send for Worker {}

thread_local! {
    static WORKER: Cell<*const Worker> = const { Cell::new(std::ptr::null()) };
}

static WORKERS: SpinLock<Vec<usize>> = SpinLock::new(Vec::new());
/// Spares waiting for a carrier.
static IDLE: SpinLock<Vec<usize>> = SpinLock::new(Vec::new());
static SPARES: AtomicUsize = AtomicUsize::new(0);
static MONITOR: AtomicBool = AtomicBool::new(false);
/// 1 while the monitor sleeps without a deadline (every carrier asleep).
static DEEP: AtomicU32 = AtomicU32::new(0);

/// This thread's worker. Never inlined: a fiber may move to another thread inside a
/// runtime call, and the thread-local's address must be computed afresh after that.
#[inline(never)]
pub fn worker() -> Option<&'static Worker> {
    let p = WORKER.with(|w| w.get());
    // SAFETY: workers are leaked, never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

impl Worker {
    /// The calling thread becomes a worker (once).
    pub fn register() -> &'static Worker {
        if let Some(w) = worker() {
            return w;
        }
        // SAFETY: an all-zero sigset_t is a valid value to overwrite.
        let mask = unsafe { std::mem::zeroed() };
        let w: &'static Worker = Box::leak(Box::new(Worker {
            tid: AtomicI32::new(real::gettid()),
            carrier: AtomicPtr::new(std::ptr::null_mut()),
            current: Cell::new(std::ptr::null()),
            phase: AtomicU64::new(0),
            seq: Cell::new(0),
            steal: AtomicU32::new(NONE),
            seen: AtomicU64::new(0),
            seen_at: AtomicU64::new(0),
            assigned: AtomicPtr::new(std::ptr::null_mut()),
            wake: AtomicU32::new(0),
            mask: UnsafeCell::new(mask),
            tls: crate::tls::blocks(),
            own_tls: UnsafeCell::new(crate::tls::new_area()),
        }));
        // SAFETY: reading our own mask into our own cell.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, std::ptr::null(), w.mask.get()) };
        WORKER.with(|c| c.set(w));
        WORKERS.lock().push(w as *const Worker as usize);
        w
    }

    pub fn carrier(&self) -> Option<&'static Carrier> {
        let p = self.carrier.load(Acquire);
        // SAFETY: carriers are leaked, never freed.
        (!p.is_null()).then(|| unsafe { &*p })
    }

    /// Takes `c` over: from now on this thread runs it.
    pub fn adopt(&self, c: &'static Carrier) {
        c.tid.store(real::gettid(), SeqCst);
        // SAFETY: pthread_self has no preconditions.
        c.pthread.set(unsafe { libc::pthread_self() });
        self.carrier
            .store(c as *const Carrier as *mut Carrier, Release);
    }

    #[inline]
    pub fn current(&self) -> *const Fiber {
        self.current.get()
    }

    #[inline]
    pub fn set_current(&self, f: *const Fiber) {
        self.current.set(f);
    }

    #[inline]
    pub fn in_app_code(&self) -> bool {
        self.phase.load(Relaxed) & 1 == 1
    }

    /// A fiber goes back to application code.
    #[inline]
    pub fn leave(&self) {
        let s = self.seq.get() + 1;
        self.seq.set(s);
        self.phase.store(s << 1 | 1, Relaxed);
    }

    /// The scheduler: runtime code, whatever a fiber left behind.
    #[inline]
    pub fn in_runtime(&self) {
        self.phase.store(self.seq.get() << 1, Relaxed);
    }

    /// Spare: waits until the monitor gives this thread a carrier.
    pub fn wait_for_carrier(&self) -> &'static Carrier {
        IDLE.lock().push(self as *const Worker as usize);
        loop {
            let p = self.assigned.swap(std::ptr::null_mut(), Acquire);
            if !p.is_null() {
                // SAFETY: carriers are leaked, never freed.
                let c: &'static Carrier = unsafe { &*p };
                self.adopt(c);
                return c;
            }
            // A deadline only so that no wait in the runtime is unbounded.
            futex_wait(&self.wake, 0, Some(time::now_ns() + 10_000_000_000));
            self.wake.store(0, Relaxed);
        }
    }
}

/// The fiber the worker thread `tid` runs, for the uffd handler thread while that
/// thread is blocked in a fault (so its `current` is stable).
pub fn fiber_of_thread<'a>(tid: i32) -> Option<&'a Fiber> {
    let w = workers().into_iter().find(|w| w.tid.load(Relaxed) == tid)?;
    // SAFETY: the worker is blocked in this very fault; `current` is stable.
    let p = unsafe { std::ptr::read_volatile(w.current.as_ptr()) };
    // SAFETY: a worker's current fiber is alive while it runs on it.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// Runtime entry from a fiber's application code, on `w`: mark it, and if the carrier
/// was taken meanwhile, move the fiber to it. Returns the worker the caller is on now.
#[inline]
pub fn enter(w: &'static Worker) -> &'static Worker {
    w.in_runtime();
    // The monitor's membarrier orders this store before the load below.
    compiler_fence(SeqCst);
    if w.steal.load(Acquire) == NONE {
        return w;
    }
    stolen(w)
}

/// Until the monitor has decided a steal it announced: a membarrier and a load, so
/// microseconds, unless the monitor is preempted meanwhile (then yield to it).
fn wait_decided(w: &Worker) {
    let mut spins = 0u32;
    while w.steal.load(Acquire) == PENDING {
        spins += 1;
        if spins < 1000 {
            std::hint::spin_loop();
        } else {
            // SAFETY: no arguments; raw, since sched_yield is interposed.
            unsafe { libc::syscall(libc::SYS_sched_yield) };
        }
    }
}

#[cold]
#[inline(never)]
fn stolen(w: &'static Worker) -> &'static Worker {
    wait_decided(w);
    if w.steal.load(Acquire) != COMMITTED {
        return w;
    }
    let f = w.current.get();
    debug_assert!(!f.is_null());
    // SAFETY: a worker in application code runs a fiber, alive while it runs.
    let f = unsafe { &*f };
    // Back to our scheduler frames (Carrier::run), which queue the fiber on its
    // carrier, now run by another thread, and resumes there.
    f.suspend(Yield::Migrate);
    worker().expect("a fiber runs on a worker")
}

/// The scheduler, after a fiber yielded: back in runtime code; true if the carrier was
/// handed to another thread meanwhile.
#[inline]
pub fn lost_carrier(w: &Worker) -> bool {
    w.in_runtime();
    compiler_fence(SeqCst);
    if w.steal.load(Acquire) == NONE {
        return false;
    }
    wait_decided(w);
    w.steal.load(Acquire) == COMMITTED
}

/// The old thread of a stolen carrier, after its fiber `f` yielded with `r` (Migrate
/// when it noticed the steal at a runtime entry): forget the carrier and leave the
/// fiber where its new thread finds it, touching only what is safe from any thread.
pub fn release(w: &'static Worker, c: &'static Carrier, f: &Fiber, r: Option<Yield>) {
    w.carrier.store(std::ptr::null_mut(), Release);
    w.steal.store(NONE, Release);
    // If the wait that blocked us was inside a signal handler, its mask stays with
    // the fiber's frames, not with this thread.
    // SAFETY: our own mask, saved at start.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, w.mask.get(), std::ptr::null_mut()) };
    match r {
        Some(Yield::Park) => {
            if f.state
                .compare_exchange(RUNNING, PARKED, AcqRel, Acquire)
                .is_err()
            {
                f.state.store(RUNNING, Release);
                c.enqueue(f);
            }
        }
        Some(Yield::Requeue | Yield::Migrate) => {
            f.state.store(RUNNING, Release);
            c.enqueue(f);
        }
        Some(Yield::Exit) | None => {
            f.release_stack();
            c.live.fetch_sub(1, Relaxed);
            stats::COUNTERS.fibers_live.fetch_sub(1, Relaxed);
            crate::thread::on_fiber_finished(f);
        }
    }
}

/// Marks the runtime scope of an interposed call from a fiber (the outermost one):
/// entered on creation, back to application code on drop.
pub struct Scope(bool);

#[inline]
pub fn scope() -> Scope {
    let Some(w) = worker() else {
        return Scope(false);
    };
    let f = w.current.get();
    if f.is_null() {
        return Scope(false);
    }
    // SAFETY: the running fiber is alive.
    let depth = unsafe { &(*f).runtime_depth };
    let d = depth.get();
    depth.set(d + 1);
    if d == 0 {
        enter(w);
    }
    Scope(true)
}

impl Drop for Scope {
    #[inline]
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        // Perhaps another thread than at entry: look again.
        let Some(w) = worker() else { return };
        let f = w.current.get();
        if f.is_null() {
            return;
        }
        // SAFETY: the running fiber is alive.
        let depth = unsafe { &(*f).runtime_depth };
        let d = depth.get().saturating_sub(1);
        depth.set(d);
        if d == 0 {
            w.leave();
        }
    }
}

// ---- the monitor ---------------------------------------------------------------------

fn enabled() -> bool {
    let cfg = crate::settings();
    !cfg.disabled.handoff && cfg.handoff_max_spares > 0
}

/// Starts the monitor once carriers exist (no-op when handoff is off or membarrier is
/// missing: then a blocked carrier stays blocked, as without handoff).
pub fn start_monitor() {
    if MONITOR.load(Relaxed) || !enabled() || MONITOR.swap(true, AcqRel) {
        return;
    }
    const REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;
    // SAFETY: membarrier registration has no memory arguments.
    let r = unsafe { libc::syscall(libc::SYS_membarrier, REGISTER_PRIVATE_EXPEDITED, 0, 0) };
    if r != 0 {
        crate::log_at!(
            crate::log::INFO,
            "handoff off: membarrier unavailable (errno {})",
            real::errno()
        );
        return;
    }
    let mut t: libc::pthread_t = 0;
    // SAFETY: real pthread_create of our own thread function.
    let r = unsafe {
        (real::pthread_create())(&mut t, std::ptr::null(), monitor_main, std::ptr::null_mut())
    };
    if r != 0 {
        crate::log_at!(
            crate::log::ERROR,
            "cannot start the handoff monitor: errno {r}"
        );
    }
}

/// A carrier woke from an idle sleep: wake the monitor if it sleeps without deadline.
#[inline]
pub fn carrier_woke() {
    if DEEP.load(SeqCst) == 1 && DEEP.swap(0, SeqCst) == 1 {
        futex_wake(&DEEP);
    }
}

fn workers() -> Vec<&'static Worker> {
    WORKERS
        .lock()
        .iter()
        // SAFETY: workers are leaked, never freed.
        .map(|&p| unsafe { &*(p as *const Worker) })
        .collect()
}

extern "C" fn monitor_main(_: *mut libc::c_void) -> *mut libc::c_void {
    // SAFETY: naming our own thread (a NUL-terminated literal of <= 16 bytes).
    unsafe { libc::prctl(libc::PR_SET_NAME, c"toffload-mon".as_ptr()) };
    let threshold = crate::settings().handoff_us * 1000;
    let tick = (threshold / 2).max(50_000);
    loop {
        let now = time::now_ns();
        let mut awake = false;
        for w in workers() {
            let Some(c) = w.carrier() else { continue };
            if w.steal.load(Acquire) != NONE {
                continue;
            }
            awake |= !c.is_sleeping();
            let p = w.phase.load(Relaxed);
            if p & 1 == 0 {
                continue;
            }
            if p != w.seen.load(Relaxed) {
                w.seen.store(p, Relaxed);
                w.seen_at.store(now, Relaxed);
                continue;
            }
            if now.saturating_sub(w.seen_at.load(Relaxed)) >= threshold && c.has_work(now) {
                try_steal(w, c, p);
            }
        }
        if awake {
            sleep_ns(tick);
            continue;
        }
        // Every carrier asleep: sleep until one wakes (carrier_woke).
        DEEP.store(1, SeqCst);
        if workers()
            .iter()
            .filter_map(|w| w.carrier())
            .any(|c| !c.is_sleeping())
        {
            DEEP.store(0, SeqCst);
            continue;
        }
        futex_wait(&DEEP, 1, Some(time::now_ns() + 10_000_000_000));
        DEEP.store(0, SeqCst);
    }
}

fn sleep_ns(ns: u64) {
    let ts = libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: a valid timespec; raw, so nothing of ours interposes it.
    unsafe {
        libc::syscall(
            libc::SYS_clock_nanosleep,
            libc::CLOCK_MONOTONIC,
            0,
            &ts as *const libc::timespec,
            std::ptr::null_mut::<libc::timespec>(),
        )
    };
}

/// An idle spare to run a stolen carrier. None now when there is none; then one is
/// started (up to the knob), ready for the next look.
fn reserve_spare() -> Option<&'static Worker> {
    if let Some(p) = IDLE.lock().pop() {
        // SAFETY: workers are leaked, never freed.
        return Some(unsafe { &*(p as *const Worker) });
    }
    // Never more spares than live fibers: each thread blocked below libc holds one, so
    // that many threads always leave one free for a carrier with work (the stock
    // server had a thread per fiber), within the knob's hard cap.
    let live = stats::COUNTERS.fibers_live.load(Relaxed);
    let max = crate::settings().handoff_max_spares.min(live.max(1));
    if SPARES
        .fetch_update(AcqRel, Acquire, |n| (n < max).then_some(n + 1))
        .is_ok()
        && !crate::carrier::spawn_worker(None)
    {
        SPARES.fetch_sub(1, AcqRel);
    }
    None
}

/// True when thread `tid` sleeps in the kernel (a call that waits), false when it is
/// running or runnable (computing, or preempted on a busy host: handing its carrier
/// off would only add a thread switch).
fn waits_in_kernel(tid: i32) -> bool {
    let Ok(st) = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")) else {
        return true;
    };
    // The state follows the parenthesised command, which may contain anything.
    let state = st
        .rsplit_once(')')
        .and_then(|(_, r)| r.trim_start().chars().next());
    !matches!(state, Some('R'))
}

fn try_steal(w: &'static Worker, c: &'static Carrier, seen: u64) {
    if !waits_in_kernel(w.tid.load(Relaxed)) {
        return;
    }
    let Some(spare) = reserve_spare() else { return };
    w.steal.store(PENDING, SeqCst);
    const PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    // Every thread of the process passes a full barrier: a fiber's plain phase store
    // before it is now visible here, and its later steal load sees PENDING.
    // SAFETY: no memory arguments.
    let r = unsafe { libc::syscall(libc::SYS_membarrier, PRIVATE_EXPEDITED, 0, 0) };
    if r != 0 || w.phase.load(SeqCst) != seen {
        w.steal.store(NONE, Release);
        IDLE.lock().push(spare as *const Worker as usize);
        return;
    }
    w.steal.store(COMMITTED, Release);
    stats::COUNTERS.handoffs.fetch_add(1, Relaxed);
    spare
        .assigned
        .store(c as *const Carrier as *mut Carrier, Release);
    spare.wake.store(1, Release);
    futex_wake(&spare.wake);
}

/// Fork child: only the forking thread exists; the monitor and spares start again.
///
/// # Safety
/// Only in a forked child.
pub unsafe fn after_fork_child() {
    // SAFETY: in a forked child (our contract) no other thread can hold them.
    unsafe {
        WORKERS.force_unlock();
        IDLE.force_unlock();
    }
    let me = worker();
    let mut ws = WORKERS.lock();
    ws.clear();
    if let Some(w) = me {
        w.steal.store(NONE, SeqCst);
        w.tid.store(real::gettid(), SeqCst);
        ws.push(w as *const Worker as usize);
    }
    IDLE.lock().clear();
    SPARES.store(0, SeqCst);
    DEEP.store(0, SeqCst);
    MONITOR.store(false, SeqCst);
}
