//! Fiber stacks: mmap'd, lazily committed, with a guard region below so that an
//! overflow faults instead of silently corrupting a neighbour. Finished fibers give
//! their stack back to a small pool: a connection-per-fiber server would otherwise pay
//! an mmap + munmap per connection. A SIGSEGV handler on an alternate stack tells a
//! fiber stack overflow apart from any other fault and says so on stderr; every other
//! fault goes to the handler that was there before (or kills the process as it would
//! have without us).

use crate::spinlock::SpinLock;
use corosensei::stack::{Stack, StackPointer};

pub const GUARD: usize = 64 << 10;
const POOL_MAX: usize = 256;

pub struct FiberStack {
    /// Lowest address of the mapping (start of the guard).
    lo: usize,
    /// Total size of the mapping, guard included.
    len: usize,
}

// SAFETY: a stack is plain memory owned by one fiber at a time.
unsafe impl Send for FiberStack {}

static POOL: SpinLock<Vec<FiberStack>> = SpinLock::new(Vec::new());

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize
}

impl FiberStack {
    /// A stack with `usable` bytes above the guard (rounded up to pages).
    pub fn new(usable: usize) -> Option<FiberStack> {
        let pg = page();
        let usable = usable.div_ceil(pg) * pg;
        {
            let mut pool = POOL.lock();
            if let Some(i) = pool.iter().position(|s| s.len == usable + GUARD) {
                return Some(pool.swap_remove(i));
            }
        }
        let len = usable + GUARD;
        // SAFETY: fresh anonymous mapping; NORESERVE so thousands of fibers only cost
        // the pages they touch.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        // SAFETY: the guard is the bottom of our own mapping.
        if unsafe { libc::mprotect(p, GUARD, libc::PROT_NONE) } != 0 {
            // SAFETY: unmapping what we just mapped.
            unsafe { libc::munmap(p, len) };
            return None;
        }
        Some(FiberStack {
            lo: p as usize,
            len,
        })
    }

    /// Usable range [lo, hi), above the guard.
    pub fn usable(&self) -> (usize, usize) {
        (self.lo + GUARD, self.lo + self.len)
    }

    pub fn guard(&self) -> (usize, usize) {
        (self.lo, self.lo + GUARD)
    }

    /// Back to the pool, or unmapped when the pool is full.
    pub fn recycle(self) {
        let mut pool = POOL.lock();
        if pool.len() < POOL_MAX {
            pool.push(self);
        } else {
            drop(pool);
            // SAFETY: our mapping, no longer used by any fiber.
            unsafe { libc::munmap(self.lo as *mut _, self.len) };
        }
    }
}

// SAFETY: base/limit describe a valid, exclusively owned mapping; the limit includes the
// guard, as corosensei requires.
unsafe impl Stack for FiberStack {
    fn base(&self) -> StackPointer {
        StackPointer::new(self.lo + self.len).expect("non-null")
    }
    fn limit(&self) -> StackPointer {
        StackPointer::new(self.lo).expect("non-null")
    }
}

/// After fork in the child: the pool's lock may have been held by a vanished thread.
///
/// # Safety
/// Only in a forked child, before any other thread exists.
pub unsafe fn after_fork_child() {
    // SAFETY: in a forked child (our contract) no other thread can hold it.
    unsafe { POOL.force_unlock() };
}

/// Gives the calling carrier thread an alternate signal stack, so that the SIGSEGV
/// handler can run when the fault is the fiber's stack running out.
pub fn install_altstack() {
    let size = 64 << 10;
    // SAFETY: a fresh mapping handed to sigaltstack; never freed (the carrier lives as
    // long as the process).
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return;
        }
        let ss = libc::stack_t {
            ss_sp: p,
            ss_flags: 0,
            ss_size: size,
        };
        libc::sigaltstack(&ss, std::ptr::null_mut());
    }
}

/// If `addr` is in the running fiber's guard, says so on stderr and returns true.
pub fn report_overflow(addr: usize) -> bool {
    let Some((lo, hi, kb)) = crate::fiber::current_guard() else {
        return false;
    };
    if addr < lo || addr >= hi + 4096 {
        return false;
    }
    let mut buf = [0u8; 160];
    let msg = crate::fmt_buf::format(
        &mut buf,
        format_args!(
            "toffload: fiber stack overflow (fault at {addr:#x}, stack {kb} KiB): raise TOFFLOAD_STACK_KB\n"
        ),
    );
    crate::real::raw_write(2, msg);
    true
}
