//! C++ `thread_local` destructors of fibers (`__cxa_thread_atexit_impl`).
//!
//! libstdc++ registers the destructor of a `thread_local` object with glibc the first
//! time a thread uses it; glibc keeps the list per thread and runs it when the thread
//! exits. With per-fiber TLS copies (tls.rs) each fiber constructs its own object in its
//! carrier's block, so left to glibc every fiber would leave an entry on its carrier's
//! list: the destructor would not run when the fiber ends (a connection's resources kept
//! until the process exits), and at the carrier's exit glibc would run them all against
//! one block. A registration made on a fiber for an object inside a copied block is
//! therefore kept with the fiber, as (module, offset), so that it still names the
//! fiber's object after a handoff moved the fiber to another thread, and run on the
//! fiber when it ends, last registered first and before its pthread key destructors
//! (glibc's order). Anything else (shared TLS, an object of a library opened later, a
//! real thread) goes to glibc as before.

use crate::fiber::Fiber;
use crate::{handoff, tls};
use libc::{c_int, c_void};

pub type DtorFn = unsafe extern "C" fn(*mut c_void);

/// One registered destructor of a fiber.
pub struct Entry {
    func: DtorFn,
    /// The object: module index and offset in the fiber's TLS (tls::locate).
    module: usize,
    off: usize,
    /// The object that holds `func`, kept loaded until it ran (glibc does the same
    /// with a count on the link map, which we cannot reach): null for none.
    pin: *mut c_void,
}

/// Keeps the object containing `dso_symbol` from being unloaded by dlclose while a
/// destructor of it is pending. Objects loaded at start are never unloaded: dlopen
/// with RTLD_NOLOAD only adds a reference then.
fn pin(dso_symbol: *mut c_void) -> *mut c_void {
    if dso_symbol.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: dladdr only reads the link maps; a zeroed Dl_info is valid.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(dso_symbol, &mut info) == 0 || info.dli_fname.is_null() {
            return std::ptr::null_mut();
        }
        // The main program's name matches no loaded object: null, and it stays anyway.
        libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD)
    }
}

/// Takes the registration when it belongs to the running fiber (module doc); None
/// passes it to glibc.
///
/// # Safety
/// The caller's `__cxa_thread_atexit_impl` arguments.
pub unsafe fn register(
    f: &Fiber,
    func: DtorFn,
    obj: *mut c_void,
    dso_symbol: *mut c_void,
) -> Option<c_int> {
    let w = handoff::worker()?;
    let (module, off) = tls::locate(&w.tls, obj as usize)?;
    let pin = pin(dso_symbol);
    // SAFETY: only the running fiber touches its own list.
    unsafe { &mut *f.tls_dtors.get() }.push(Entry {
        func,
        module,
        off,
        pin,
    });
    Some(0)
}

/// Runs the ending fiber's destructors, newest first, including any registered while
/// they run.
pub fn run(f: &Fiber) {
    loop {
        // SAFETY: the fiber runs (this is its exit path); nothing else touches the list.
        let Some(e) = (unsafe { &mut *f.tls_dtors.get() }).pop() else {
            return;
        };
        // Looked up each time: a destructor that blocked may have moved the fiber.
        if let Some(obj) = handoff::worker().and_then(|w| tls::address(&w.tls, e.module, e.off)) {
            // SAFETY: the application's destructor with the object it registered, at its
            // place in this fiber's TLS on the running thread.
            unsafe { (e.func)(obj as *mut c_void) };
        }
        if !e.pin.is_null() {
            // SAFETY: the reference pin() took.
            unsafe { libc::dlclose(e.pin) };
        }
    }
}
