//! pthread_once on fibers. glibc's waits for an init routine running elsewhere on a
//! futex: if that routine parks (it takes a contended mutex, does I/O), a second fiber
//! of the same carrier blocks the carrier and the routine never finishes. Ours speaks
//! glibc's encoding of the control word (bit 0 in progress, bit 1 done), so real
//! threads in glibc's pthread_once and fibers in ours agree; a fiber that finds the
//! routine running parks until it is done (woken by us, or by re-checking when a real
//! thread runs it).

#![allow(clippy::missing_safety_doc)] // C callers' pointers, taken as they come

use super::LOCK_WAITERS;
use crate::fiber::{self, Fiber};
use crate::time;
use crate::waitq::{futex_wake, Slot};
use libc::c_int;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering::*};

const IN_PROGRESS: i32 = 1;
const DONE: i32 = 2;
/// A routine run by a real thread cannot wake us: look again this often.
const RECHECK_NS: u64 = 1_000_000;

pub unsafe fn once(ctl: *mut c_int, init: unsafe extern "C" fn(), f: &Fiber) -> c_int {
    // SAFETY: ctl is the caller's pthread_once_t, an aligned int that glibc and other
    // threads access atomically too, live for the whole call.
    let word = unsafe { AtomicI32::from_ptr(ctl) };
    loop {
        let v = word.load(Acquire);
        if v & DONE != 0 {
            return 0;
        }
        if v & IN_PROGRESS == 0 {
            // Keep the fork-generation bits glibc keeps above the two flags.
            if word
                .compare_exchange(v, (v & !3) | IN_PROGRESS, Acquire, Acquire)
                .is_ok()
            {
                // SAFETY: the caller's init routine, run once, as pthread_once(3) does.
                unsafe { init() };
                word.store(DONE, Release);
                // Real threads wait in glibc on the word itself; fibers in our queue.
                // SAFETY: the same word, seen as the u32 a futex takes.
                futex_wake(unsafe { AtomicU32::from_ptr(ctl as *mut u32) });
                LOCK_WAITERS.wake_all(ctl as usize);
                return 0;
            }
            continue;
        }
        let slot = Slot::fiber(f);
        LOCK_WAITERS.push(ctl as usize, &slot);
        if word.load(Acquire) & IN_PROGRESS != 0 {
            fiber::park_until(f, Some(time::now_ns() + RECHECK_NS));
        }
        LOCK_WAITERS.remove(ctl as usize, &slot);
    }
}
