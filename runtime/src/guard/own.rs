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
/// A page wait ends when its owner's handler ends. A cycle among page owners (each
/// waiting for a page the next owns) is found when the handler that would close it
/// faults (`cycle`), and broken there, reported. A wait that lasts this long without
/// one means the owner blocks in something the guard cannot see (a lock, a wait for
/// the waiter itself): only then is the page given up, reported as a broken
/// guarantee, rather than hang the program. A busy host's slow handler is not that
/// (a 1 s limit here released pages on a loaded machine and lost updates).
const LAST_RESORT_NS: u64 = 30_000_000_000;
/// The longest chain of owners followed (more fibers than this waiting in one chain
/// is treated as a cycle: the guard would rather release a page than loop).
const MAX_CHAIN: usize = 4096;

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
    // SAFETY: the kernel's ucontext of this fault (our contract).
    let write = unsafe { (*uc).uc_mcontext.gregs[libc::REG_ERR as usize] } & 2 != 0;
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
            crate::stats::GUARD_RELEASED_BY_THREAD.fetch_add(1, Relaxed);
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
        // SAFETY: the running fiber's own list, touched only on its carrier's thread,
        // and no other borrow of it is alive in this handler.
        let owned = unsafe { &mut *f.guard.owned.get() };
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
    // SAFETY: uc is the ucontext of this fault on the running fiber f.
    unsafe { super::trampoline::redirect(uc) };
    true
}

/// Whether `owner`'s chain of page waits leads back to `me`: `owner` waits for a page
/// owned by a fiber that waits for a page ... owned by `me`. Under the PAGES lock, where
/// every owner is a live fiber (a handler's pages are released before it ends).
fn cycle(m: &HashMap<usize, Page>, owner: usize, me: usize) -> bool {
    let mut cur = owner;
    for _ in 0..MAX_CHAIN {
        if cur == me {
            return true;
        }
        // SAFETY: `cur` owns a page, so it is a live fiber (see above).
        let f = unsafe { &*(cur as *const Fiber) };
        let want = f.guard.waiting_for.load(Relaxed);
        match m.get(&want) {
            Some(st) if want != 0 && st.owner != 0 && !st.released => cur = st.owner,
            _ => return false,
        }
    }
    true
}

/// Gives `page` up (no longer guarded), logged and counted: the guarantee is broken.
fn give_up(st: &mut Page, page: usize, why: std::fmt::Arguments) {
    if st.released {
        return;
    }
    st.released = true;
    crate::stats::COUNTERS.guard_released.fetch_add(1, Relaxed);
    crate::log::line(format_args!(
        "guard: page {page:#x} no longer guarded ({why}): updates to it may be lost"
    ));
    prot(page, libc::PROT_READ | libc::PROT_WRITE);
}

/// Called by the trampoline, on the fiber's stack: park until the page is free.
pub fn wait_for_page(f: &Fiber) {
    let page = f.guard.wait_page.replace(0);
    let me = f as *const Fiber as usize;
    let deadline = crate::time::now_ns() + LAST_RESORT_NS;
    loop {
        let slot = Slot::fiber(f);
        {
            let mut g = PAGES.lock();
            let Some(m) = g.as_mut() else {
                return;
            };
            let Some(&st) = m.get(&page) else {
                return;
            };
            if st.owner == 0 || st.owner == me || st.released {
                f.guard.waiting_for.store(0, Relaxed);
                return;
            }
            if !crate::settings().disabled.guardcycle && cycle(m, st.owner, me) {
                f.guard.waiting_for.store(0, Relaxed);
                let st = m.get_mut(&page).expect("present");
                give_up(
                    st,
                    page,
                    format_args!("handlers each own a page the other waits for"),
                );
                return;
            }
            f.guard.waiting_for.store(page, Relaxed);
            WAITERS.push(page, &slot);
        }
        let timed_out = fiber::park_until(f, Some(deadline));
        WAITERS.remove(page, &slot);
        if timed_out {
            let mut g = PAGES.lock();
            f.guard.waiting_for.store(0, Relaxed);
            if let Some(st) = g.as_mut().and_then(|m| m.get_mut(&page)) {
                if st.owner != 0 && st.owner != me {
                    give_up(
                        st,
                        page,
                        format_args!(
                            "a handler waited {} s for it: its owner blocks where the guard \
                             cannot see",
                            LAST_RESORT_NS / 1_000_000_000
                        ),
                    );
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
    // SAFETY: exclusive by our contract.
    unsafe { &mut *f.guard.owned.get() }
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
    // SAFETY: in a forked child (our contract) no other thread can hold it.
    unsafe { PAGES.force_unlock() };
    *PAGES.lock() = None;
    // SAFETY: a forked child, as above.
    unsafe { WAITERS.reset_in_child() };
}
