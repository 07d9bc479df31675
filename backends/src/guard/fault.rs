//! The guard's SIGSEGV handler: faults on registered pages are the guard's; any other
//! goes to the handler that was there before (the server's crash report, or the
//! default action).

use super::{protect, state, tid, Mode, CURRENT, CURRENT_TID, PAGE, RETRY, RW};
use std::sync::atomic::Ordering::*;
use std::sync::OnceLock;

extern "C" {
    // glibc's; not in the libc crate (it cannot be called soundly from Rust frames
    // with destructors: the guard calls it only with none alive).
    fn siglongjmp(env: *mut libc::c_void, val: libc::c_int) -> !;
}

/// The handler we replaced.
static OLD: OnceLock<Result<libc::sigaction, i32>> = OnceLock::new();

/// Installs the handler, once.
pub fn install() -> Result<(), i32> {
    OLD.get_or_init(|| {
        // SAFETY: plain sigaction calls with structures we own.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_segv as extern "C" fn(_, _, _) as usize;
            // NODEFER: a jump back to the integration out of the handler leaves
            // SIGSEGV unblocked without a sigsetjmp that saves the mask.
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGSEGV, &sa, &mut old) != 0 {
                return Err(-libc::EINVAL);
            }
            Ok(old)
        }
    })
    .as_ref()
    .map(|_| ())
    .map_err(|&e| e)
}

extern "C" fn on_segv(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel's siginfo for this SIGSEGV.
    let addr = unsafe { (*info).si_addr() } as usize;
    if handle(addr) {
        return;
    }
    chain(sig, info, ctx);
}

fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let Some(Ok(old)) = OLD.get() else { return };
    let h = old.sa_sigaction;
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        // Back to the default action; the access faults again and takes it.
        // SAFETY: a plain sigaction call.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGSEGV, &sa, std::ptr::null_mut());
        }
        return;
    }
    // SAFETY: the previous handler, called as it asked to be.
    unsafe {
        if old.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(h);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(h);
            f(sig);
        }
    }
}

/// True when the fault was the guard's (the access can be retried).
fn handle(addr: usize) -> bool {
    let Ok(m) = super::mode() else { return false };
    let page = addr & !(PAGE - 1);
    let mut g = state();
    let Some(st) = g.as_mut() else { return false };
    let Some(pg) = st.pages.get(&page).copied() else {
        return false;
    };
    st.stats.faults += 1;
    if pg.released {
        protect(page, PAGE, RW);
        return true;
    }
    let cur = if CURRENT_TID.load(Acquire) == tid() {
        CURRENT.load(Acquire)
    } else {
        0
    };
    let cur = if st.tokens.contains_key(&cur) { cur } else { 0 };
    match m {
        Mode::Off => false,
        Mode::Detect => {
            let window = st.tokens.get(&cur).and_then(|t| t.window);
            if st.ledger.write(page, cur, window) {
                st.stats.conflicts += 1;
            }
            st.dirty.push(page);
            protect(page, PAGE, RW);
            true
        }
        Mode::Enforce if cur != 0 && (pg.owner == 0 || pg.owner == cur) => {
            // The owner gets the page whole: a read-modify-write then costs one fault,
            // not a read fault and a write fault.
            st.pages.get_mut(&page).expect("present").owner = cur;
            let t = st.tokens.get_mut(&cur).expect("present");
            if !t.owned.contains(&page) {
                t.owned.push(page);
            }
            protect(page, PAGE, RW);
            true
        }
        Mode::Enforce => {
            let retry = RETRY.load(Acquire) as usize;
            if cur == 0 || retry == 0 {
                // No token, or one that cannot be sent back: the page cannot be
                // guarded without blocking the thread. Give it up, counted.
                st.pages.get_mut(&page).expect("present").released = true;
                st.stats.released += 1;
                protect(page, PAGE, RW);
                return true;
            }
            // Owned by a parked token: undo what this token took and send it back.
            let owned = std::mem::take(&mut st.tokens.get_mut(&cur).expect("present").owned);
            super::release(st, &owned);
            st.tokens.remove(&cur);
            st.stats.deferred += 1;
            CURRENT.store(0, Release);
            RETRY.store(0, Release);
            drop(owned);
            drop(g);
            // SAFETY: `retry` is the sigjmp_buf the integration passed to
            // toffload_guard_begin, in a frame still live (RETRY is cleared when the
            // token parks or ends); no value with a destructor is alive here.
            unsafe { siglongjmp(retry as *mut libc::c_void, 1) }
        }
    }
}
