//! The runtime's own memory allocator. Rust code inside libtoffload.so must not call
//! the host program's malloc: that may be jemalloc or tcmalloc, which call
//! pthread_key_create and pthread_mutex_lock (ours) while we hold one of our locks
//! (redis-server deadlocked exactly so). This allocator takes memory straight from mmap:
//! power-of-two size classes from 16 B to 64 KiB with a free list each (a spinlock
//! that never allocates), carved from 1 MiB chunks; larger blocks are their own
//! mappings. No general-purpose crate was usable here: they either sit on malloc or
//! need a lock type that itself goes through pthread.

use crate::spinlock::SpinLock;
use std::alloc::{GlobalAlloc, Layout};

const MIN_SHIFT: usize = 4; // 16 B
const MAX_SHIFT: usize = 16; // 64 KiB
const CLASSES: usize = MAX_SHIFT - MIN_SHIFT + 1;
const CHUNK: usize = 1 << 20;
/// Chunks handed out so far (append-only, never freed): lets `owns` say whether an
/// address is runtime memory without allocating.
const MAX_CHUNKS: usize = 1 << 14;
static CHUNKS: [std::sync::atomic::AtomicUsize; MAX_CHUNKS] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; MAX_CHUNKS];
static NCHUNKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// True if `addr` lies in a chunk of this allocator (so it is runtime memory: never a
/// glibc thread descriptor).
pub fn owns(addr: usize) -> bool {
    use std::sync::atomic::Ordering::Acquire;
    let n = NCHUNKS.load(Acquire).min(MAX_CHUNKS);
    CHUNKS[..n].iter().any(|c| {
        let b = c.load(Acquire);
        b != 0 && addr >= b && addr < b + CHUNK
    })
}

struct Class {
    /// Singly linked free blocks (the link is stored in the block).
    free: usize,
    /// The unused tail of the current chunk: [bump, end).
    bump: usize,
    end: usize,
}

pub struct Allocator {
    classes: [SpinLock<Class>; CLASSES],
}

impl Allocator {
    pub const fn new() -> Self {
        Allocator {
            classes: [const {
                SpinLock::new(Class {
                    free: 0,
                    bump: 0,
                    end: 0,
                })
            }; CLASSES],
        }
    }

    /// Fork child: a vanished thread may have held a class lock.
    ///
    /// # Safety
    /// Only in a forked child.
    pub unsafe fn after_fork_child(&self) {
        for c in &self.classes {
            // SAFETY: in a forked child (our contract) no other thread can hold it.
            unsafe { c.force_unlock() };
        }
    }
}

impl Default for Allocator {
    fn default() -> Self {
        Self::new()
    }
}

fn class_of(l: &Layout) -> Option<usize> {
    let size = l.size().max(l.align()).max(1 << MIN_SHIFT);
    let shift = size.next_power_of_two().trailing_zeros() as usize;
    (shift <= MAX_SHIFT).then(|| shift - MIN_SHIFT)
}

fn map(len: usize) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p as *mut u8
    }
}

fn page_round(n: usize) -> usize {
    (n + 4095) & !4095
}

// SAFETY: blocks of a class are 2^k bytes aligned to 2^k (chunks are page aligned and
// carved in class-size steps; classes above a page would not be: those get alignment
// from the page-aligned chunk only up to 4 KiB, so larger alignments take the mmap path).
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        match class_of(&l) {
            Some(c) if l.align() <= 4096 => {
                let size = 1usize << (c + MIN_SHIFT);
                let mut g = self.classes[c].lock();
                if g.free != 0 {
                    let b = g.free;
                    // SAFETY: a free block of this class holds the next free one in its
                    // first word (dealloc wrote it); the class lock is held.
                    g.free = unsafe { *(b as *const usize) };
                    return b as *mut u8;
                }
                if g.bump + size > g.end {
                    let p = map(CHUNK);
                    if p.is_null() {
                        return p;
                    }
                    let i = NCHUNKS.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                    if i < MAX_CHUNKS {
                        CHUNKS[i].store(p as usize, std::sync::atomic::Ordering::Release);
                    }
                    g.bump = p as usize;
                    g.end = p as usize + CHUNK;
                }
                let b = g.bump;
                g.bump += size;
                b as *mut u8
            }
            _ => map(page_round(l.size().max(1))),
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        match class_of(&l) {
            Some(c) if l.align() <= 4096 => {
                let mut g = self.classes[c].lock();
                // SAFETY: p is a block of this class (GlobalAlloc's contract: same layout),
                // at least a word, no longer the caller's; the class lock is held.
                unsafe { *(p as *mut usize) = g.free };
                g.free = p as usize;
            }
            _ => {
                // SAFETY: alloc mapped exactly this many pages at p for this layout.
                unsafe { libc::munmap(p as *mut libc::c_void, page_round(l.size().max(1))) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_aligned_distinct_and_reused() {
        let a = Allocator::new();
        // SAFETY: non-zero layouts; each block is freed once, with its own layout.
        unsafe {
            let l = Layout::from_size_align(24, 8).unwrap();
            let x = a.alloc(l);
            let y = a.alloc(l);
            assert!(!x.is_null() && !y.is_null() && x != y);
            assert_eq!(x as usize % 32, 0);
            a.dealloc(x, l);
            assert_eq!(a.alloc(l), x, "the freed block comes back first");
            let big = Layout::from_size_align(1 << 20, 8).unwrap();
            let z = a.alloc(big);
            *z.add((1 << 20) - 1) = 7;
            a.dealloc(z, big);
            let al = Layout::from_size_align(64, 64).unwrap();
            let w = a.alloc(al);
            assert_eq!(w as usize % 64, 0);
        }
    }
}
