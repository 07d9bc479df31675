//! The runtime's SIGSEGV handler, shared by the fiber-stack overflow report and the
//! conflict guard, and chained to the application's own: the application's sigaction
//! and signal calls for SIGSEGV are recorded rather than applied while ours is
//! installed, and every fault that is not ours goes to the handler the application
//! asked for (or kills the process, as SIG_DFL would). A real fault still kills with
//! SIGSEGV; a program's own handler keeps its behaviour.

use crate::spinlock::SpinLock;
use libc::{c_int, c_void, sigaction as SigAction, siginfo_t};
use std::sync::atomic::{AtomicBool, Ordering::*};

static INSTALLED: AtomicBool = AtomicBool::new(false);
/// What the application wants for SIGSEGV (before us: what was there).
static APP: SpinLock<Option<SigAction>> = SpinLock::new(None);

fn real_sigaction(sig: c_int, act: *const SigAction, old: *mut SigAction) -> c_int {
    // SAFETY: forwarding to libc's own sigaction.
    unsafe { (crate::real::sigaction())(sig, act, old) }
}

/// Installs the handler once (first carrier, or the guard).
pub fn install() {
    if INSTALLED.swap(true, AcqRel) {
        return;
    }
    // SAFETY: plain sigaction calls.
    unsafe {
        let mut sa: SigAction = std::mem::zeroed();
        sa.sa_sigaction = on_fault as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
        libc::sigemptyset(&mut sa.sa_mask);
        let mut old: SigAction = std::mem::zeroed();
        real_sigaction(libc::SIGSEGV, &sa, &mut old);
        *APP.lock() = Some(old);
    }
}

pub fn installed() -> bool {
    INSTALLED.load(Acquire)
}

/// The application's sigaction(SIGSEGV, ...) while ours is installed.
///
/// # Safety
/// The caller's pointers, as for sigaction(2).
pub unsafe fn app_sigaction(act: *const SigAction, old: *mut SigAction) -> c_int {
    let mut g = APP.lock();
    if !old.is_null() {
        // SAFETY: old is the caller's writable sigaction; all-zero is SIG_DFL, no flags.
        unsafe { *old = g.unwrap_or_else(|| std::mem::zeroed()) };
    }
    if !act.is_null() {
        // SAFETY: act is the caller's readable sigaction.
        *g = Some(unsafe { *act });
    }
    0
}

extern "C" fn on_fault(sig: c_int, info: *mut siginfo_t, ctx: *mut c_void) {
    let saved = crate::real::errno();
    // SAFETY: the kernel passes a valid siginfo and ucontext for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    // SAFETY: this is the SIGSEGV handler, and ctx the kernel's ucontext.
    if unsafe { crate::guard::on_fault(addr, ctx) } {
        crate::real::set_errno(saved);
        return;
    }
    if crate::stack::report_overflow(addr) {
        die(sig);
        return;
    }
    chain(sig, info, ctx);
    crate::real::set_errno(saved);
}

/// Returning from the handler re-executes the fault under the default action.
fn die(sig: c_int) {
    // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask.
    let dfl: SigAction = unsafe { std::mem::zeroed() };
    real_sigaction(sig, &dfl, std::ptr::null_mut());
}

fn chain(sig: c_int, info: *mut siginfo_t, ctx: *mut c_void) {
    let app = *APP.lock();
    let Some(app) = app else {
        return die(sig);
    };
    let h = app.sa_sigaction;
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        // A synchronous SIGSEGV cannot be ignored: the kernel would kill anyway.
        return die(sig);
    }
    if app.sa_flags & libc::SA_RESETHAND != 0 {
        // SAFETY: zeroed = SIG_DFL.
        *APP.lock() = Some(unsafe { std::mem::zeroed() });
    }
    // SAFETY: the application's own handler, called as the kernel would have.
    unsafe {
        if app.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(c_int, *mut siginfo_t, *mut c_void) = std::mem::transmute(h);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(c_int) = std::mem::transmute(h);
            f(sig);
        }
    }
}
