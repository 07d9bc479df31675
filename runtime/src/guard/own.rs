//! Enforcement by page ownership. Guarded pages are inaccessible (PROT_NONE) unless the
//! running fiber owns them. A fiber's first access to a page (read or write: the fault
//! says which) makes it the owner until its handler ends (it writes to or reads from a
//! socket, or exits); another fiber that touches an owned page is made to wait, from
//! inside the fault, by redirecting it through a trampoline that parks it and then
//! re-executes the access (trampoline.rs). Only handlers that touch the same pages are
//! serialized; the others keep overlapping.
//!
//! Pages that handlers only ever read (configuration, tables) would serialize handlers
//! for nothing: after DEMOTE_AFTER handlers used a page without writing it, it becomes
//! readable by all (PROT_READ); a later write to it faults, and the page goes back to
//! ownership. A page touched by a real thread cannot be owned (the thread cannot park):
//! it is released from the guard for good, and counted.

use super::regions::{Range, PAGE};
use crate::fiber::{self, Fiber};
use crate::spinlock::SpinLock;
use crate::waitq::{Slot, WaitQueues};
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;

const DEMOTE_AFTER: u32 = 64;
/// A wait longer than this means a cycle (two handlers owning pages the other wants):
/// the page is released from the guard rather than hang the program.
const GIVE_UP_NS: u64 = 1_000_000_000;

#[derive(Default, Clone, Copy)]
struct Page {
    owner: usize,
    written: bool,
    shared: bool,
    released: bool,
    read_only_uses: u32,
}

static PAGES: SpinLock<Option<HashMap<usize, Page>>> = SpinLock::new(None);
static WAITERS: WaitQueues = WaitQueues::new();

fn prot(p: usize, prot: libc::c_int) {
    // SAFETY: one of the guarded pages.
    unsafe { libc::mprotect(p as *mut _, PAGE, prot) };
}

pub fn arm(ranges: &[Range]) {
    super::trampoline::init();
    let mut g = PAGES.lock();
    let map = g.get_or_insert_with(HashMap::new);
    for r in ranges {
        let mut p = r.start;
        while p < r.end {
            map.insert(p, Page::default());
            p += PAGE;
        }
        // SAFETY: the program's own data pages.
        unsafe { libc::mprotect(r.start as *mut _, r.end - r.start, libc::PROT_NONE) };
    }
}

/// SIGSEGV on a guarded page in enforce mode.
///
/// # Safety
/// From the SIGSEGV handler, with the kernel's ucontext.
pub unsafe fn on_fault(page: usize, ctx: *mut libc::c_void) -> bool {
    let uc = ctx as *mut libc::ucontext_t;
    // x86 page-fault error code: bit 1 = write access.
    let write = (*uc).uc_mcontext.gregs[libc::REG_ERR as usize] & 2 != 0;
    crate::stats::COUNTERS.guard_faults.fetch_add(1, Relaxed);
    let mut g = PAGES.lock();
    let Some(st) = g.as_mut().and_then(|m| m.get_mut(&page)) else {
        return false;
    };
    let Some(f) = fiber::current() else {
        // A real thread: it cannot wait for a fiber's handler. Stop guarding the page.
        if !st.released {
            st.released = true;
            crate::stats::COUNTERS.guard_released.fetch_add(1, Relaxed);
        }
        prot(page, libc::PROT_READ | libc::PROT_WRITE);
        return true;
    };
    if st.released {
        prot(page, libc::PROT_READ | libc::PROT_WRITE);
        return true;
    }
    let me = f as *const Fiber as usize;
    if st.shared {
        // A write to a page handlers had only read so far: back to ownership.
        st.shared = false;
    }
    if st.owner == 0 || st.owner == me {
        st.owner = me;
        st.written |= write;
        // SAFETY: the running fiber's own list.
        let owned = &mut *f.guard.owned.get();
        match owned.iter_mut().find(|(p, _)| *p == page) {
            Some(e) => e.1 |= write,
            None => owned.push((page, write)),
        }
        prot(
            page,
            if write {
                libc::PROT_READ | libc::PROT_WRITE
            } else {
                libc::PROT_READ
            },
        );
        return true;
    }
    drop(g);
    // Owned by another handler: wait for it, then retry the access.
    crate::stats::COUNTERS
        .guard_serialized
        .fetch_add(1, Relaxed);
    super::toffload_guard_serialized(page, f.id);
    f.guard.wait_page.set(page);
    super::trampoline::redirect(uc);
    true
}

/// Called by the trampoline, on the fiber's stack: park until the page is free.
pub fn wait_for_page(f: &Fiber) {
    let page = f.guard.wait_page.replace(0);
    let me = f as *const Fiber as usize;
    let deadline = crate::time::now_ns() + GIVE_UP_NS;
    loop {
        let slot = Slot::fiber(f);
        {
            let mut g = PAGES.lock();
            let Some(st) = g.as_mut().and_then(|m| m.get_mut(&page)) else {
                return;
            };
            if st.owner == 0 || st.owner == me || st.released {
                return;
            }
            WAITERS.push(page, &slot);
        }
        let timed_out = fiber::park_until(f, Some(deadline));
        WAITERS.remove(page, &slot);
        if timed_out {
            let mut g = PAGES.lock();
            if let Some(st) = g.as_mut().and_then(|m| m.get_mut(&page)) {
                if st.owner != 0 && st.owner != me && !st.released {
                    st.released = true;
                    crate::stats::COUNTERS.guard_released.fetch_add(1, Relaxed);
                    crate::log::line(format_args!(
                        "guard: page {page:#x} waited for over 1 s (handlers owning pages each other wants?); no longer guarded"
                    ));
                    prot(page, libc::PROT_READ | libc::PROT_WRITE);
                }
            }
            return;
        }
    }
}

/// # Safety
/// Only on the fiber's own carrier thread, with no other borrow of the list alive.
#[allow(clippy::mut_from_ref)]
unsafe fn owned(f: &Fiber) -> &mut Vec<(usize, bool)> {
    &mut *f.guard.owned.get()
}

/// The fiber stops running: its pages become inaccessible to whoever runs next.
pub fn switch_out(f: &Fiber) {
    // SAFETY: on the carrier thread, between runs of `f`.
    for &(p, _) in unsafe { owned(f) }.iter() {
        prot(p, libc::PROT_NONE);
    }
}

/// The fiber runs again: give it back its pages.
pub fn switch_in(f: &Fiber) {
    let g = PAGES.lock();
    // SAFETY: on the carrier thread, before `f` runs.
    for &(p, w) in unsafe { owned(f) }.iter() {
        let released = g
            .as_ref()
            .and_then(|m| m.get(&p))
            .is_some_and(|s| s.released);
        prot(
            p,
            if w || released {
                libc::PROT_READ | libc::PROT_WRITE
            } else {
                libc::PROT_READ
            },
        );
    }
}

/// The fiber's handler is over: release its pages and wake whoever waits for them.
pub fn release_all(f: &Fiber) {
    // SAFETY: on the carrier thread, from the fiber itself.
    let list = unsafe { owned(f) };
    if list.is_empty() {
        return;
    }
    let pages: Vec<(usize, bool)> = std::mem::take(list);
    {
        let mut g = PAGES.lock();
        let Some(m) = g.as_mut() else { return };
        for &(p, _) in &pages {
            let Some(st) = m.get_mut(&p) else { continue };
            st.owner = 0;
            if st.released {
                continue;
            }
            if !st.written {
                st.read_only_uses += 1;
                if st.read_only_uses >= DEMOTE_AFTER {
                    st.shared = true;
                }
            }
            prot(
                p,
                if st.shared {
                    libc::PROT_READ
                } else {
                    libc::PROT_NONE
                },
            );
        }
    }
    for &(p, _) in &pages {
        WAITERS.wake_all(p);
    }
}

/// # Safety
/// Only in a forked child.
pub unsafe fn after_fork_child() {
    PAGES.force_unlock();
    *PAGES.lock() = None;
    WAITERS.reset_in_child();
}
