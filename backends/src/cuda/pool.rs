//! The per-operation resources, pooled: one lane per operation slot (pinned host
//! buffer, device buffer, completion event), grown on demand and kept for reuse, and a
//! fixed set of streams handed out round robin.
//!
//! A lane belongs to its slot's operation from submit until the slot is freed: at
//! release if the operation had completed (its event passed: the GPU is done with the
//! lane), else once both the caller released it and the stream has reached its host
//! callback. So the GPU never touches a lane that was reused.

use super::driver::{check, CuError};
use cudarc::driver::sys;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};

/// Smallest buffer a lane allocates: small ops then never regrow.
const MIN_CAP: usize = 4096;

pub struct LaneRes {
    pub host: *mut u8,
    pub dev: sys::CUdeviceptr,
    pub cap: usize,
    pub event: sys::CUevent,
}

/// `Lane::owner` flags, beside the op's generation (owner >> 2).
pub const OWNER_CANCELLED: u64 = 1;
pub const OWNER_GPU_DONE: u64 = 2;

pub struct Lane {
    res: UnsafeCell<LaneRes>,
    /// generation << 2 | OWNER_* of the op using the lane: the caller's release of a
    /// pending op and the stream's callback each set their flag, and whichever comes
    /// second frees the slot. The generation in the same word makes a late callback of
    /// an earlier op (whose completed op was released and the slot reused) a no-op.
    pub owner: AtomicU64,
}

// SAFETY: `res` is written only by the thread that owns the lane's slot (between
// allocation and publishing PENDING, with release ordering) and read after observing
// that publication; see Lane::res_mut.
unsafe impl Sync for Lane {}
// SAFETY: its pinned buffer, device pointer and event belong to the context, not to a
// thread: any thread with the context current may use them.
unsafe impl Send for Lane {}

impl Lane {
    pub fn empty() -> Lane {
        Lane {
            res: UnsafeCell::new(LaneRes {
                host: std::ptr::null_mut(),
                dev: 0,
                cap: 0,
                event: std::ptr::null_mut(),
            }),
            owner: AtomicU64::new(0),
        }
    }

    /// The lane's resources, for a thread that observed its op published.
    pub fn res(&self) -> &LaneRes {
        // SAFETY: see `unsafe impl Sync`.
        unsafe { &*self.res.get() }
    }

    /// Makes room for `len` bytes and creates the event on first use. Only the
    /// thread that owns the lane's slot (and whose previous op has fully drained) may
    /// call this, with the context current.
    #[allow(clippy::mut_from_ref)]
    unsafe fn res_mut(&self) -> &mut LaneRes {
        // SAFETY: the caller owns the lane's slot (our contract): no other reference.
        unsafe { &mut *self.res.get() }
    }

    /// # Safety
    /// Caller owns the lane (its slot is allocated to the caller's op, not yet published).
    pub unsafe fn ensure(&self, len: usize) -> Result<&LaneRes, CuError> {
        // SAFETY: the caller owns the lane (our contract).
        let r = unsafe { self.res_mut() };
        if r.event.is_null() {
            // Blocking sync: a waiter in cuEventSynchronize sleeps instead of spinning;
            // no timing: recording is cheaper.
            let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
                | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            check(
                // SAFETY: the context is current; r.event is ours to fill.
                unsafe { sys::cuEventCreate(&mut r.event, flags) },
                "creating an event",
            )?;
        }
        if r.cap < len {
            let cap = len.next_power_of_two().max(MIN_CAP);
            // SAFETY: the lane is ours and its previous op has drained: nothing uses them.
            unsafe { free_buffers(r) };
            let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
            check(
                // SAFETY: the context is current; host is a local out-pointer.
                unsafe { sys::cuMemHostAlloc(&mut host, cap, 0) },
                &format!("allocating {cap} bytes of pinned host memory"),
            )?;
            let mut dev: sys::CUdeviceptr = 0;
            if let Err(e) = check(
                // SAFETY: the context is current; dev is a local out-pointer.
                unsafe { sys::cuMemAlloc_v2(&mut dev, cap) },
                &format!("allocating {cap} bytes of device memory"),
            ) {
                // SAFETY: allocated just above, shared with no one.
                unsafe { sys::cuMemFreeHost(host) };
                return Err(e);
            }
            r.host = host as *mut u8;
            r.dev = dev;
            r.cap = cap;
        }
        Ok(r)
    }

    /// Frees everything. # Safety: no op in flight on this lane; context current.
    pub unsafe fn destroy(&self) {
        // SAFETY: no op in flight on this lane (our contract): no other reference.
        let r = unsafe { self.res_mut() };
        // SAFETY: no op in flight uses them; the context is current.
        unsafe { free_buffers(r) };
        if !r.event.is_null() {
            // SAFETY: our event, no op in flight records it; the context is current.
            unsafe { sys::cuEventDestroy_v2(r.event) };
            r.event = std::ptr::null_mut();
        }
    }
}

/// # Safety
/// The context is current and nothing uses the buffers any more.
unsafe fn free_buffers(r: &mut LaneRes) {
    if !r.host.is_null() {
        // SAFETY: from cuMemHostAlloc, unused (our contract), then forgotten.
        unsafe { sys::cuMemFreeHost(r.host as *mut std::ffi::c_void) };
        r.host = std::ptr::null_mut();
    }
    if r.dev != 0 {
        // SAFETY: from cuMemAlloc_v2, unused (our contract), then forgotten.
        unsafe { sys::cuMemFree_v2(r.dev) };
        r.dev = 0;
    }
    r.cap = 0;
}

/// A fixed set of non-blocking streams (they do not serialise against the legacy
/// default stream of other CUDA users in the process), handed out round robin.
pub struct Streams {
    list: Vec<sys::CUstream>,
    next: AtomicUsize,
}

// SAFETY: CUDA streams may be used from any thread with the context current.
unsafe impl Send for Streams {}
// SAFETY: as for Send; the round-robin cursor is an atomic.
unsafe impl Sync for Streams {}

impl Streams {
    /// # Safety
    /// The context must be current.
    pub unsafe fn new(n: usize) -> Result<Streams, CuError> {
        let mut s = Streams {
            list: Vec::with_capacity(n),
            next: AtomicUsize::new(0),
        };
        for _ in 0..n {
            let mut st: sys::CUstream = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            check(
                // SAFETY: the context is current (our contract); st is a local out-pointer.
                unsafe { sys::cuStreamCreate(&mut st, flags) },
                "creating a stream",
            )?;
            s.list.push(st);
        }
        Ok(s)
    }

    pub fn pick(&self) -> sys::CUstream {
        self.list[self.next.fetch_add(1, Relaxed) % self.list.len()]
    }

    pub fn all(&self) -> &[sys::CUstream] {
        &self.list
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        for &s in &self.list {
            // SAFETY: created in new; the owner synchronised them before dropping.
            unsafe { sys::cuStreamDestroy_v2(s) };
        }
    }
}
