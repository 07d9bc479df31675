//! The operation table, shared by the backends: a fixed array of slots, each with a
//! state word, a generation and the backend's per-operation record `T`. Polls and waits
//! touch only atomics; only allocation takes a lock.
//!
//! A handle is `generation << INDEX_BITS | index`, so a released or stale handle is
//! told apart from the slot's next operation.

use crate::futex;
use crate::AccelError;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU32, Ordering::*};
use std::sync::Mutex;

pub const INDEX_BITS: u32 = 24;
pub const MAX_SLOTS: usize = 1 << 20;

// State word values. WAITER is or'ed in while a thread sleeps on the word.
pub const FREE: u32 = 0;
pub const PENDING: u32 = 1;
pub const RUNNING: u32 = 2;
pub const DONE: u32 = 3;
pub const FAILED: u32 = 4;
pub const CANCELLED: u32 = 5;
pub const WAITER: u32 = 0x100;

pub struct Slot<T> {
    pub state: AtomicU32,
    generation: AtomicU32,
    /// Written by the submitter before the op is published, read by the device after.
    op: UnsafeCell<T>,
}

// SAFETY: `op` is written only by the thread that owns a FREE slot, before it
// publishes PENDING with release ordering, and read only after observing that.
unsafe impl<T: Send> Sync for Slot<T> {}

pub struct Slots<T = (usize, usize)> {
    slots: Box<[Slot<T>]>,
    free: Mutex<Vec<u32>>,
}

/// A handle decoded against the table.
pub struct Claimed<'a, T> {
    pub index: u32,
    pub generation: u32,
    pub slot: &'a Slot<T>,
}

impl<T: Copy + Default> Slots<T> {
    pub fn new(capacity: usize) -> Self {
        assert!((1..=MAX_SLOTS).contains(&capacity));
        let slots = (0..capacity)
            .map(|_| Slot {
                state: AtomicU32::new(FREE),
                generation: AtomicU32::new(0),
                op: UnsafeCell::new(T::default()),
            })
            .collect();
        Slots {
            slots,
            // Reverse order so that low indices are handed out first.
            free: Mutex::new((0..capacity as u32).rev().collect()),
        }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Takes a free slot for operation `op` and publishes it PENDING.
    pub fn allocate(&self, op: T) -> Result<Claimed<'_, T>, AccelError> {
        self.allocate_as(op, PENDING)
    }

    /// Takes a free slot for `op` and publishes it in `state` (a backend that must set
    /// the operation up before it can be polled publishes RUNNING, then PENDING).
    pub fn allocate_as(&self, op: T, state: u32) -> Result<Claimed<'_, T>, AccelError> {
        let index = self
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or(AccelError::TooManyInFlight {
                max: self.capacity(),
            })?;
        let slot = &self.slots[index as usize];
        // Generations stay in 1..2^31 so handles are positive and never 0-generation.
        let generation = slot.generation.load(Relaxed) % 0x7fff_ffff + 1;
        slot.generation.store(generation, Relaxed);
        // SAFETY: we own this FREE slot; nobody reads `op` until PENDING is published.
        unsafe { *slot.op.get() = op };
        slot.state.store(state, Release);
        Ok(Claimed {
            index,
            generation,
            slot,
        })
    }

    pub fn handle(c: &Claimed<'_, T>) -> i64 {
        ((c.generation as i64) << INDEX_BITS) | c.index as i64
    }

    /// Decodes a handle; the generation must match the slot's current one.
    pub fn lookup(&self, id: i64) -> Result<Claimed<'_, T>, AccelError> {
        if id < 0 {
            return Err(AccelError::BadHandle);
        }
        let index = (id & ((1 << INDEX_BITS) - 1)) as u32;
        let generation = (id >> INDEX_BITS) as u32;
        let slot = self
            .slots
            .get(index as usize)
            .ok_or(AccelError::BadHandle)?;
        if generation == 0 || slot.generation.load(Acquire) != generation {
            return Err(AccelError::BadHandle);
        }
        Ok(Claimed {
            index,
            generation,
            slot,
        })
    }

    /// The slot by index, for the device side.
    pub fn get(&self, index: u32) -> &Slot<T> {
        &self.slots[index as usize]
    }

    pub fn generation_of(&self, index: u32) -> u32 {
        self.slots[index as usize].generation.load(Acquire)
    }

    /// The release protocol of a backend whose completer frees cancelled slots: a
    /// pending op becomes CANCELLED (the completer frees the slot when the op comes due
    /// and never touches the buffer); a transform in progress is waited out (a few
    /// microseconds); a finished op's slot is freed after `on_free` sees its record.
    pub fn release(&self, id: i64, on_free: impl FnOnce(T)) -> Result<(), AccelError> {
        let c = self.lookup(id)?;
        let state = &c.slot.state;
        loop {
            let s = state.load(Acquire);
            match s & !WAITER {
                PENDING => {
                    if state
                        .compare_exchange(s, CANCELLED, AcqRel, Acquire)
                        .is_ok()
                    {
                        if s & WAITER != 0 {
                            futex::wake_all(state);
                        }
                        return Ok(());
                    }
                }
                RUNNING => std::thread::yield_now(),
                DONE | FAILED => {
                    if state.compare_exchange(s, FREE, AcqRel, Acquire).is_ok() {
                        on_free(c.slot.op());
                        self.free(c.index);
                        return Ok(());
                    }
                }
                _ => return Err(AccelError::BadHandle),
            }
            if self.generation_of(c.index) != c.generation {
                return Err(AccelError::BadHandle);
            }
        }
    }

    /// Returns a slot to the free list.
    pub fn free(&self, index: u32) {
        self.slots[index as usize].state.store(FREE, Release);
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(index);
    }
}

impl<T: Copy> Slot<T> {
    /// The record of a live op.
    pub fn op(&self) -> T {
        // SAFETY: see `unsafe impl Sync`.
        unsafe { *self.op.get() }
    }

    /// Device side: PENDING -> RUNNING, keeping the waiter bit. False when the op was
    /// cancelled (or is otherwise not pending).
    pub fn start(&self) -> bool {
        let mut s = self.state.load(Acquire);
        loop {
            if s & !WAITER != PENDING {
                return false;
            }
            match self
                .state
                .compare_exchange_weak(s, RUNNING | (s & WAITER), AcqRel, Acquire)
            {
                Ok(_) => return true,
                Err(now) => s = now,
            }
        }
    }

    /// Device side: RUNNING -> PENDING again, for an op taken by mistake (its slot was
    /// reused under a stale handle).
    pub fn unstart(&self) {
        let mut s = self.state.load(Acquire);
        while s & !WAITER == RUNNING {
            match self
                .state
                .compare_exchange_weak(s, PENDING | (s & WAITER), AcqRel, Acquire)
            {
                Ok(_) => return,
                Err(now) => s = now,
            }
        }
    }

    /// Device side: RUNNING -> DONE/FAILED, waking sleepers.
    pub fn finish(&self, ok: bool) {
        let old = self.state.swap(if ok { DONE } else { FAILED }, AcqRel);
        if old & WAITER != 0 {
            futex::wake_all(&self.state);
        }
    }

    /// Sleeps until the op is terminal; returns the terminal state.
    pub fn wait_terminal(&self) -> u32 {
        loop {
            let s = self.state.load(Acquire);
            match s & !WAITER {
                PENDING | RUNNING => {
                    if s & WAITER == 0
                        && self
                            .state
                            .compare_exchange(s, s | WAITER, AcqRel, Acquire)
                            .is_err()
                    {
                        continue;
                    }
                    futex::wait(&self.state, s | WAITER);
                }
                other => return other,
            }
        }
    }
}
