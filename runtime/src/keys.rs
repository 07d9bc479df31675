//! pthread keys per fiber. Keys themselves are glibc's (created through the real
//! pthread_key_create, so real threads are untouched); on a fiber, values live in the
//! fiber, in a vector indexed by key with no fixed cap, and the destructors recorded at
//! key creation run when the fiber ends. Per-fiber keys are also what keeps OpenSSL's
//! per-thread state (its error queue, its DRBGs) per fiber: OpenSSL keeps it behind
//! pthread_getspecific.

#![allow(clippy::missing_safety_doc)] // C callers' pointers, taken as they come

use crate::fiber::Fiber;
use crate::real;
use crate::spinlock::SpinLock;
use libc::{c_int, c_void, pthread_key_t};

type Dtor = unsafe extern "C" fn(*mut c_void);

static DTORS: SpinLock<Vec<Option<Dtor>>> = SpinLock::new(Vec::new());

/// glibc's PTHREAD_DESTRUCTOR_ITERATIONS.
const ROUNDS: usize = 4;

pub unsafe fn create(key: *mut pthread_key_t, dtor: Option<Dtor>) -> c_int {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { (real::pthread_key_create())(key, dtor) };
    if r == 0 {
        // SAFETY: glibc wrote the key.
        let k = unsafe { *key } as usize;
        loop {
            let mut d = DTORS.lock();
            if d.len() > k {
                d[k] = dtor;
                break;
            }
            // Grow outside the lock: allocating may call back into pthread_key_create.
            let mut bigger = Vec::with_capacity((k + 1).max(2 * d.len()));
            drop(d);
            bigger.resize(k + 1, None);
            let mut d = DTORS.lock();
            if d.len() < bigger.len() {
                bigger[..d.len()].copy_from_slice(&d);
                std::mem::swap(&mut *d, &mut bigger);
            }
            drop(d);
            drop(bigger);
        }
    }
    r
}

pub unsafe fn delete(key: pthread_key_t) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { (real::pthread_key_delete())(key) };
    if r == 0 {
        if let Some(d) = DTORS.lock().get_mut(key as usize) {
            *d = None;
        }
    }
    r
}

pub fn get(f: &Fiber, key: pthread_key_t) -> *mut c_void {
    // SAFETY: the fiber's own key vector, touched only by the running fiber.
    let keys = unsafe { &*f.keys.get() };
    keys.get(key as usize)
        .copied()
        .unwrap_or(std::ptr::null_mut())
}

pub unsafe fn set(f: &Fiber, key: pthread_key_t, v: *const c_void) -> c_int {
    if key as usize >= (1 << 20) {
        return libc::EINVAL;
    }
    // SAFETY: as in get.
    let keys = unsafe { &mut *f.keys.get() };
    let k = key as usize;
    if keys.len() <= k {
        keys.resize(k + 1, std::ptr::null_mut());
    }
    keys[k] = v as *mut c_void;
    0
}

/// Runs the destructors of the fiber's non-null values, POSIX style: up to four rounds
/// while destructors keep setting values.
pub fn run_destructors(f: &Fiber) {
    for _ in 0..ROUNDS {
        let mut ran = false;
        // SAFETY: as in get; re-borrowed each time since destructors may set keys.
        let n = unsafe { (*f.keys.get()).len() };
        for k in 0..n {
            // SAFETY: as in get; k < n and destructors only add keys, never remove.
            let v = unsafe {
                let keys = &mut *f.keys.get();
                std::mem::replace(&mut keys[k], std::ptr::null_mut())
            };
            if v.is_null() {
                continue;
            }
            let d = DTORS.lock().get(k).copied().flatten();
            if let Some(d) = d {
                ran = true;
                // SAFETY: the application's destructor with its own value.
                unsafe { d(v) };
            }
        }
        if !ran {
            break;
        }
    }
    // SAFETY: as in get.
    unsafe { (*f.keys.get()).clear() };
}

/// # Safety
/// Only in a forked child.
pub unsafe fn after_fork_child() {
    // SAFETY: in a forked child (our contract) no other thread can hold it.
    unsafe { DTORS.force_unlock() };
}
