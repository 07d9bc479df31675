//! pthread_create and friends. Which threads become fibers is decided here
//! (TOFFLOAD_FIBERIZE); a fiber's pthread_t is its Fiber, so join, detach, exit,
//! getattr_np, kill and the name functions recognise it through the registry of live
//! fibers. pthread_self stays the carrier's real thread: glibc internals depend on it.

#![allow(clippy::missing_safety_doc)] // C callers' pointers, taken as they come

use crate::carrier;
use crate::config::Fiberize;
use crate::fiber::{self, Fiber, Joiner, Yield};
use crate::spinlock::SpinLock;
use crate::waitq::{futex_wait, futex_wake};
use crate::{keys, real, stats};
use libc::{c_int, c_void, pthread_attr_t, pthread_t};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

extern "C" {
    fn pthread_attr_getdetachstate(attr: *const pthread_attr_t, state: *mut c_int) -> c_int;
}

/// Handles of fibers not yet freed (finished-but-unjoined ones included).
static FIBERS: SpinLock<Option<HashSet<usize>>> = SpinLock::new(None);
/// Set by the first successful accept of the process (TOFFLOAD_FIBERIZE=after-accept).
pub static ACCEPTED: AtomicBool = AtomicBool::new(false);
/// Base address of objects whose threads must stay real (the offload backends).
static BACKEND_BASES: SpinLock<Vec<usize>> = SpinLock::new(Vec::new());
static BACKENDS_KNOWN: AtomicUsize = AtomicUsize::new(0);

pub fn is_fiber(h: pthread_t) -> bool {
    FIBERS
        .lock()
        .as_ref()
        .is_some_and(|s| s.contains(&(h as usize)))
}

/// A handle of a fiber that has ended and been freed: runtime memory, not a live fiber.
/// glibc must never see it (joining or detaching it there crashes or hangs in glibc's
/// stack cache: stunnel joins its client threads at exit while some of them detach
/// themselves and end); the caller gets ESRCH, as for any finished thread.
pub fn is_stale_fiber(h: pthread_t) -> bool {
    cfg!(feature = "preload") && crate::alloc::owns(h as usize) && !is_fiber(h)
}

fn object_of(addr: usize) -> Option<(usize, String)> {
    // SAFETY: dladdr only reads the link maps.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(addr as *const c_void, &mut info) == 0 {
            return None;
        }
        let name = if info.dli_fname.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned()
        };
        Some((info.dli_fbase as usize, name))
    }
}

/// Threads created by an offload backend (the emulated device's thread, a GPU driver's
/// helpers) are part of the device, not of the application: they stay real.
fn from_backend(caller: usize) -> bool {
    if BACKENDS_KNOWN.load(Acquire) == 0 {
        let mut bases = Vec::new();
        for r in crate::offload::rows() {
            if let Some((b, _)) = object_of(r.blocking) {
                bases.push(b);
            }
        }
        *BACKEND_BASES.lock() = bases;
        BACKENDS_KNOWN.store(1, Release);
    }
    let Some((base, name)) = object_of(caller) else {
        return false;
    };
    let file = name.rsplit('/').next().unwrap_or("");
    BACKEND_BASES.lock().contains(&base)
        || ["libcuda", "libcudart", "libnvidia", "libtoffload_accel"]
            .iter()
            .any(|p| file.starts_with(p))
}

fn should_fiberize(caller: usize) -> bool {
    let cfg = crate::settings();
    let on = match cfg.fiberize {
        Fiberize::Off => false,
        Fiberize::All => true,
        Fiberize::AfterAccept => ACCEPTED.load(Acquire),
    };
    on && !from_backend(caller)
}

/// pthread_create, called from csrc/shim.c with the caller's return address.
///
/// # Safety
/// The caller's pthread_create arguments.
pub unsafe fn create(
    out: *mut pthread_t,
    attr: *const pthread_attr_t,
    start: fiber::StartFn,
    arg: *mut c_void,
    caller: usize,
) -> c_int {
    if !crate::active() || !should_fiberize(caller) {
        // SAFETY: the caller's pthread_create arguments, unchanged.
        return unsafe { (real::pthread_create())(out, attr, start, arg) };
    }
    let cfg = crate::settings();
    let mut stack = cfg.stack_kb << 10;
    let mut detached = false;
    if !attr.is_null() {
        let mut sz: usize = 0;
        // SAFETY: attr is the caller's initialized attribute object (non-null here).
        if unsafe { libc::pthread_attr_getstacksize(attr, &mut sz) } == 0 {
            stack = stack.max(sz);
        }
        let mut ds: c_int = 0;
        // SAFETY: as above; ds is a local.
        if unsafe { pthread_attr_getdetachstate(attr, &mut ds) } == 0 {
            detached = ds == libc::PTHREAD_CREATE_DETACHED;
        }
    }
    let Some(c) = carrier::pick() else {
        // No carrier could start: a real thread is still better than failing.
        // SAFETY: the caller's pthread_create arguments, unchanged.
        return unsafe { (real::pthread_create())(out, attr, start, arg) };
    };
    let Some(f) = Fiber::new(start, arg, stack, detached) else {
        return libc::EAGAIN;
    };
    // SAFETY: Fiber::new returned a fresh, live allocation that nothing else sees yet.
    let f = unsafe { &*f };
    f.carrier.set(c);
    FIBERS
        .lock()
        .get_or_insert_with(HashSet::new)
        .insert(f as *const Fiber as usize);
    if !out.is_null() {
        // SAFETY: out is the caller's pthread_t slot.
        unsafe { *out = f.handle() };
    }
    crate::engage();
    stats::COUNTERS.fibers_created.fetch_add(1, Relaxed);
    stats::COUNTERS.fibers_live.fetch_add(1, Relaxed);
    c.live.fetch_add(1, Relaxed);
    c.enqueue(f);
    0
}

/// Fiber side, when its start routine returns (or it calls pthread_exit): the thread's
/// end as glibc would run it, minus unwinding.
pub fn on_fiber_return(f: &Fiber, ret: *mut c_void) {
    crate::guard::handler_end(f);
    f.retval.set(ret);
    // glibc's order: C++ thread_local destructors, then the pthread keys'.
    crate::thread_dtors::run(f);
    keys::run_destructors(f);
}

/// Carrier side, after the fiber's stack is released: hand the result to a joiner, or
/// free a detached fiber.
pub fn on_fiber_finished(f: &Fiber) {
    let mut j = f.join.lock();
    j.exited = true;
    f.exited.store(1, Release);
    let joiner = j.joiner;
    // Detached and nobody waiting: free it now. A joiner that started waiting before
    // the fiber detached itself (stunnel joins its client threads at exit while they
    // detach themselves) must still be woken, or it sleeps forever: it frees the fiber.
    if j.detached && matches!(joiner, Joiner::None) {
        drop(j);
        forget(f);
        return;
    }
    drop(j);
    match joiner {
        Joiner::Fiber(w) => {
            // SAFETY: a joining fiber waits in join until it sees `exited`.
            fiber::wake(unsafe { &*w });
        }
        Joiner::Thread => futex_wake(&f.exited),
        Joiner::None => {}
    }
}

fn forget(f: &Fiber) {
    if let Some(s) = FIBERS.lock().as_mut() {
        s.remove(&(f as *const Fiber as usize));
    }
    // SAFETY: finished, detached or joined: nothing refers to it any more.
    unsafe { Fiber::free(f) };
}

/// The fiber a pthread_t designates: a fiber handle, or pthread_self() of a carrier
/// while it runs a fiber (the application asking about itself).
fn target(h: pthread_t) -> Option<&'static Fiber> {
    if is_fiber(h) {
        // SAFETY: registered, so alive.
        return Some(unsafe { Fiber::from_handle(h) });
    }
    let f = fiber::current()?;
    // SAFETY: pthread_self has no preconditions.
    (h == unsafe { libc::pthread_self() }).then(|| unsafe { &*(f as *const Fiber) })
}

/// pthread_join and its timed variants. None = not a fiber: pass through.
pub unsafe fn join(
    h: pthread_t,
    ret: *mut *mut c_void,
    deadline: Option<u64>,
    try_only: bool,
) -> Option<c_int> {
    if crate::settings().disabled.join || !is_fiber(h) {
        return None;
    }
    // SAFETY: registered, so alive until we free it below.
    let f = unsafe { Fiber::from_handle(h) };
    if fiber::current().is_some_and(|me| std::ptr::eq(me, f)) {
        return Some(libc::EDEADLK);
    }
    let me = fiber::current();
    {
        let mut j = f.join.lock();
        if j.detached {
            return Some(libc::EINVAL);
        }
        if !j.exited {
            if try_only {
                return Some(libc::EBUSY);
            }
            if !matches!(j.joiner, Joiner::None) {
                return Some(libc::EINVAL);
            }
            j.joiner = match me {
                Some(m) => Joiner::Fiber(m),
                None => Joiner::Thread,
            };
        }
    }
    loop {
        if f.join.lock().exited {
            break;
        }
        let timed_out = match me {
            Some(m) => fiber::park_until(m, deadline),
            None => {
                futex_wait(&f.exited, 0, deadline);
                deadline.is_some_and(|d| crate::time::now_ns() >= d)
            }
        };
        if timed_out && !f.join.lock().exited {
            f.join.lock().joiner = Joiner::None;
            return Some(libc::ETIMEDOUT);
        }
    }
    if !ret.is_null() {
        // SAFETY: caller's out-pointer.
        unsafe { *ret = f.retval.get() };
    }
    let detached = f.join.lock().detached;
    forget(f);
    // Joining a thread that detached itself meanwhile is undefined in POSIX; we say so.
    Some(if detached { libc::EINVAL } else { 0 })
}

pub unsafe fn detach(h: pthread_t) -> Option<c_int> {
    if crate::settings().disabled.join {
        return None;
    }
    let f = target(h)?;
    let mut j = f.join.lock();
    if j.detached {
        return Some(libc::EINVAL);
    }
    if j.exited && matches!(j.joiner, Joiner::None) {
        drop(j);
        forget(f);
        return Some(0);
    }
    // Running, or finished with a joiner about to free it.
    j.detached = true;
    Some(0)
}

/// pthread_exit on a fiber: run the thread-exit work, then abandon the stack.
pub fn exit(ret: *mut c_void) -> bool {
    let Some(f) = fiber::current() else {
        return false;
    };
    on_fiber_return(f, ret);
    f.suspend(Yield::Exit);
    unreachable!("an exited fiber was resumed");
}

/// pthread_getattr_np for a fiber: its own stack, not the carrier's.
pub unsafe fn getattr(h: pthread_t, attr: *mut pthread_attr_t) -> Option<c_int> {
    let f = target(h)?;
    // SAFETY: the caller's attr; initialised before use, as glibc does.
    unsafe {
        let r = libc::pthread_attr_init(attr);
        if r != 0 {
            return Some(r);
        }
        libc::pthread_attr_setstack(attr, f.stack_lo as *mut c_void, f.stack_hi - f.stack_lo);
        libc::pthread_attr_setguardsize(attr, crate::stack::GUARD);
        let detached = f.join.lock().detached;
        libc::pthread_attr_setdetachstate(
            attr,
            if detached {
                libc::PTHREAD_CREATE_DETACHED
            } else {
                libc::PTHREAD_CREATE_JOINABLE
            },
        );
    }
    Some(0)
}

/// pthread_kill on a fiber: signal 0 probes liveness; a real signal goes to the carrier
/// thread that runs it (the closest thing a fiber has to a kernel thread).
pub unsafe fn kill(h: pthread_t, sig: c_int) -> Option<c_int> {
    if !is_fiber(h) {
        return None;
    }
    // SAFETY: registered, so alive.
    let f = unsafe { Fiber::from_handle(h) };
    if f.join.lock().exited {
        return Some(libc::ESRCH);
    }
    if sig == 0 {
        return Some(0);
    }
    // SAFETY: the carrier's real thread.
    Some(unsafe { (real::pthread_kill())(f.carrier().pthread.get(), sig) })
}

pub unsafe fn setname(h: pthread_t, name: *const libc::c_char) -> Option<c_int> {
    let f = target(h)?;
    // SAFETY: caller's NUL-terminated string.
    let s = unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes();
    if s.len() > 15 {
        return Some(libc::ERANGE);
    }
    // SAFETY: the fiber's own name buffer.
    let buf = unsafe { &mut *f.name.get() };
    *buf = [0; 16];
    buf[..s.len()].copy_from_slice(s);
    Some(0)
}

pub unsafe fn getname(h: pthread_t, out: *mut libc::c_char, len: usize) -> Option<c_int> {
    let f = target(h)?;
    // SAFETY: the fiber's name buffer.
    let buf = unsafe { &*f.name.get() };
    let n = buf.iter().position(|&b| b == 0).unwrap_or(16);
    if len < n + 1 {
        return Some(libc::ERANGE);
    }
    // SAFETY: `out` has room for len >= n + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(buf.as_ptr(), out as *mut u8, n);
        *out.add(n) = 0;
    }
    Some(0)
}

/// # Safety
/// Only in a forked child: the parent's fibers other than the running one are gone.
pub unsafe fn after_fork_child() {
    // SAFETY: in a forked child (our contract) no other thread can hold them.
    unsafe {
        FIBERS.force_unlock();
        BACKEND_BASES.force_unlock();
    }
    let keep = fiber::current().map(|f| f as *const Fiber as usize);
    let mut s = FIBERS.lock();
    if let Some(set) = s.as_mut() {
        set.retain(|&h| Some(h) == keep);
    }
    stats::COUNTERS
        .fibers_live
        .store(keep.is_some() as usize, Relaxed);
}
