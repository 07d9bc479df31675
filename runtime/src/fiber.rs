//! A fiber: one application thread's stack and state, run by a carrier. Everything here
//! except `state` and the join record is touched only by the fiber's own carrier.
//!
//! The struct starts with a zeroed block the size of glibc's `struct pthread`: the
//! handle an application gets from pthread_create points at it, so a libc function we
//! do not interpose (pthread_setschedparam, ...) that is handed a fiber handle reads a
//! thread id of 0 and fails with ESRCH instead of dereferencing garbage.

use crate::carrier::Carrier;
use crate::spinlock::SpinLock;
use crate::stack::FiberStack;
use corosensei::{Coroutine, CoroutineResult, Yielder};
use libc::{c_int, c_void};
use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

pub const RUNNING: u32 = 0;
pub const PARKED: u32 = 1;
pub const NOTIFIED: u32 = 2;

/// Why a fiber handed its carrier back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Yield {
    /// Waiting for a wake-up.
    Park,
    /// Runnable again at once (sched_yield).
    Requeue,
    /// pthread_exit: abandon the stack.
    Exit,
    /// Its carrier was handed off while it blocked: queue it there (handoff.rs).
    Migrate,
}

pub type Co = Coroutine<(), Yield, (), FiberStack>;
pub type StartFn = extern "C" fn(*mut c_void) -> *mut c_void;

const FAKE_PTHREAD: usize = 4096;

/// Who waits in pthread_join.
#[derive(Clone, Copy)]
pub enum Joiner {
    None,
    Fiber(*const Fiber),
    /// A real thread sleeping on `Fiber::exited`.
    Thread,
}

pub struct JoinState {
    pub exited: bool,
    pub detached: bool,
    pub joiner: Joiner,
}

#[repr(C)]
pub struct Fiber {
    fake_pthread: [u8; FAKE_PTHREAD],
    pub id: u64,
    pub state: AtomicU32,
    pub carrier: Cell<*const Carrier>,
    co: UnsafeCell<Option<Co>>,
    yielder: Cell<*const Yielder<(), Yield>>,
    pub errno: Cell<c_int>,
    pub keys: UnsafeCell<Vec<*mut c_void>>,
    start: StartFn,
    arg: *mut c_void,
    pub retval: Cell<*mut c_void>,
    pub join: SpinLock<JoinState>,
    /// Futex word for real-thread joiners: 1 once the fiber has finished.
    pub exited: AtomicU32,
    /// Usable stack range and guard, for pthread_getattr_np and the overflow message.
    pub stack_lo: usize,
    pub stack_hi: usize,
    pub guard_lo: usize,
    /// Set by the scheduler when this fiber's deadline passed.
    pub timer_fired: Cell<bool>,
    pub timer_key: Cell<Option<(u64, u64)>>,
    /// Set by the carrier's recheck sweep when it woke this fiber's fd wait.
    pub rechecked: Cell<bool>,
    pub name: UnsafeCell<[u8; 16]>,
    pub guard: crate::guard::FiberGuard,
    /// Nesting of interposed calls (handoff::Scope): 0 in application code.
    pub runtime_depth: Cell<u32>,
    /// The application's TLS while the fiber is switched out (tls.rs).
    pub tls: UnsafeCell<crate::tls::Area>,
    /// Its C++ thread_local destructors (thread_dtors.rs).
    pub tls_dtors: UnsafeCell<Vec<crate::thread_dtors::Entry>>,
}

// SAFETY: cross-thread access is limited to `state`, `join` (locked), `exited` and
// `carrier` reads; everything else is touched by the owning carrier only.
unsafe impl Sync for Fiber {}
// SAFETY: a fiber is built on the creating thread and then run by its carrier's; its
// coroutine holds the C start routine and argument, which pthread_create already lets
// run on another thread.
unsafe impl Send for Fiber {}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Fiber {
    /// Allocates a fiber that will run `start(arg)` on a fresh stack of `stack` bytes.
    pub fn new(
        start: StartFn,
        arg: *mut c_void,
        stack: usize,
        detached: bool,
    ) -> Option<*mut Fiber> {
        let st = FiberStack::new(stack)?;
        let (lo, hi) = st.usable();
        let guard_lo = st.guard().0;
        let f = Box::into_raw(Box::new(Fiber {
            fake_pthread: [0; FAKE_PTHREAD],
            id: NEXT_ID.fetch_add(1, Relaxed),
            state: AtomicU32::new(RUNNING),
            carrier: Cell::new(std::ptr::null()),
            co: UnsafeCell::new(None),
            yielder: Cell::new(std::ptr::null()),
            errno: Cell::new(0),
            keys: UnsafeCell::new(Vec::new()),
            start,
            arg,
            retval: Cell::new(std::ptr::null_mut()),
            join: SpinLock::new(JoinState {
                exited: false,
                detached,
                joiner: Joiner::None,
            }),
            exited: AtomicU32::new(0),
            stack_lo: lo,
            stack_hi: hi,
            guard_lo,
            timer_fired: Cell::new(false),
            timer_key: Cell::new(None),
            rechecked: Cell::new(false),
            name: UnsafeCell::new([0; 16]),
            guard: Default::default(),
            runtime_depth: Cell::new(0),
            tls: UnsafeCell::new(crate::tls::new_area()),
            tls_dtors: UnsafeCell::new(Vec::new()),
        }));
        let fp = f as usize;
        let co = Co::with_stack(st, move |y: &Yielder<(), Yield>, ()| {
            // SAFETY: the fiber outlives its coroutine (freed only after it finished).
            let f = unsafe { &*(fp as *const Fiber) };
            f.yielder.set(y as *const _);
            if let Some(w) = crate::handoff::worker() {
                w.leave();
            }
            let ret = (f.start)(f.arg);
            // The runtime's from here on (its thread-exit work calls destructors).
            if let Some(w) = crate::handoff::worker() {
                crate::handoff::enter(w);
            }
            f.runtime_depth.set(1);
            crate::thread::on_fiber_return(f, ret);
        });
        // SAFETY: freshly allocated, not shared yet.
        unsafe { *(*f).co.get() = Some(co) };
        Some(f)
    }

    /// The pthread_t handed to the application.
    pub fn handle(&self) -> libc::pthread_t {
        self as *const Fiber as libc::pthread_t
    }

    /// # Safety
    /// `h` must be a handle of a live fiber (checked against the registry by callers).
    pub unsafe fn from_handle<'a>(h: libc::pthread_t) -> &'a Fiber {
        // SAFETY: a live fiber's handle is its address (handle()), per our contract.
        unsafe { &*(h as *const Fiber) }
    }

    pub fn carrier(&self) -> &Carrier {
        // SAFETY: set before the fiber is first queued; carriers are never freed.
        unsafe { &*self.carrier.get() }
    }

    /// Carrier side: runs the fiber until it yields or finishes.
    pub fn resume(&self) -> Option<Yield> {
        // SAFETY: only the owning carrier resumes, one at a time.
        let co = unsafe { (*self.co.get()).as_mut().expect("live coroutine") };
        match co.resume(()) {
            CoroutineResult::Yield(y) => Some(y),
            CoroutineResult::Return(()) => None,
        }
    }

    /// Carrier side, after the fiber finished or exited: abandon its frames and give the
    /// stack back.
    pub fn release_stack(&self) {
        // SAFETY: the fiber is not running; only its carrier touches `co`.
        let co = unsafe { (*self.co.get()).take() };
        if let Some(mut co) = co {
            if !co.done() {
                // pthread_exit: like glibc without unwinding, the C frames are dropped.
                // SAFETY: nothing on a C stack needs Rust drop glue.
                unsafe { co.force_reset() };
            }
            co.into_stack().recycle();
        }
    }

    /// Fiber side: hands the carrier back.
    pub fn suspend(&self, why: Yield) {
        let y = self.yielder.get();
        debug_assert!(!y.is_null());
        // SAFETY: set when the coroutine started, valid while it runs.
        unsafe { (*y).suspend(why) };
    }

    /// Frees a finished fiber.
    ///
    /// # Safety
    /// The fiber has finished and nothing refers to it any more.
    pub unsafe fn free(f: *const Fiber) {
        // SAFETY: Fiber::new made it with Box::into_raw, and our contract says no one
        // refers to it any more.
        drop(unsafe { Box::from_raw(f as *mut Fiber) });
    }
}

/// The fiber running on this thread, if any.
#[inline]
pub fn current<'a>() -> Option<&'a Fiber> {
    let mut w = crate::handoff::worker()?;
    if w.in_app_code() {
        // A runtime entry: it may move the fiber to another thread first.
        w = crate::handoff::enter(w);
    }
    let f = w.current();
    // SAFETY: `current` is set by this thread's scheduler while the fiber runs.
    (!f.is_null()).then(|| unsafe { &*f })
}

/// Guard range and stack size of the running fiber, for the SIGSEGV handler (which
/// must not move the fiber: no runtime entry here).
pub fn current_guard() -> Option<(usize, usize, usize)> {
    let f = crate::handoff::worker()?.current();
    // SAFETY: set by this thread's scheduler while the fiber runs.
    let f = (!f.is_null()).then(|| unsafe { &*f })?;
    Some((f.guard_lo, f.stack_lo, (f.stack_hi - f.stack_lo) >> 10))
}

/// Wakes a parked fiber (from any thread). A fiber that is still running keeps a
/// notification, so that its next park returns at once: no wake-up is lost between
/// registering as a waiter and parking.
pub fn wake(f: &Fiber) {
    loop {
        match f.state.load(Acquire) {
            PARKED => {
                if f.state
                    .compare_exchange(PARKED, RUNNING, AcqRel, Acquire)
                    .is_ok()
                {
                    f.carrier().enqueue(f);
                    return;
                }
            }
            RUNNING => {
                if f.state
                    .compare_exchange(RUNNING, NOTIFIED, AcqRel, Acquire)
                    .is_ok()
                {
                    return;
                }
            }
            _ => return,
        }
    }
}

/// Parks the running fiber until woken. Callers loop on their own condition: wake-ups
/// can be spurious.
pub fn park(f: &Fiber) {
    crate::stats::COUNTERS.parks.fetch_add(1, Relaxed);
    f.suspend(Yield::Park);
}

/// Parks until woken or until `deadline` (monotonic ns); true if the deadline passed.
pub fn park_until(f: &Fiber, deadline: Option<u64>) -> bool {
    let Some(d) = deadline else {
        park(f);
        return false;
    };
    if crate::time::now_ns() >= d {
        return true;
    }
    f.timer_fired.set(false);
    f.carrier().add_timer(f, d);
    park(f);
    f.carrier().cancel_timer(f);
    f.timer_fired.get() || crate::time::now_ns() >= d
}

/// Lets the other runnable fibers of this carrier run.
pub fn yield_now(f: &Fiber) {
    f.suspend(Yield::Requeue);
}
