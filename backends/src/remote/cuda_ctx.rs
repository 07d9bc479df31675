//! The CUDA context a remoted session runs in: one context per client identity
//! (TOFFLOAD_REMOTED_CUDA_CONTEXT=identity, the default), created on the daemon's
//! device when the identity's first session needs it and destroyed with its last,
//! so that sessions of different identities run in different device address spaces
//! (a raw device address one of them learns is nothing in the other's); or the
//! device's primary context for every session (`primary`, as before; it is shared
//! with the daemon's own cuda backend).
//!
//! No grace period: a client that reconnects replays its state into a fresh context
//! (the client's guardian, backends/cuda-remote/src/replay.rs); its uploads are in
//! the identity's chunk cache, so what it sends again is small.

use super::cache::Part;
use crate::cuda::driver::{self, Context};
use crate::knobs;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};

const NO_DEVICE: i32 = 100;
const INVALID_HANDLE: i32 = 400;
const NOT_SUPPORTED: i32 = 801;

/// A context created for one identity, destroyed when its last session ends.
pub struct IdentCtx {
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext may be made current on any thread; the handle is never mutated.
unsafe impl Send for IdentCtx {}
// SAFETY: as above; the driver's context calls are thread-safe.
unsafe impl Sync for IdentCtx {}

impl Drop for IdentCtx {
    fn drop(&mut self) {
        type F = unsafe extern "C" fn(sys::CUcontext) -> i32;
        if let Some(p) = driver::driver_sym("cuCtxDestroy_v2") {
            // SAFETY: the driver's cuCtxDestroy_v2 has this C signature; the context
            // was created by `create`, and every session using it has ended.
            unsafe { std::mem::transmute::<usize, F>(p)(self.ctx) };
        }
    }
}

impl IdentCtx {
    fn create(dev: sys::CUdevice) -> Result<IdentCtx, i32> {
        // cuCtxCreate_v2 (every driver since CUDA 3.2 exports it, CUDA 13's too, for
        // older programs); v4 with no parameters where it is missing.
        type V2 = unsafe extern "C" fn(*mut sys::CUcontext, u32, sys::CUdevice) -> i32;
        type V4 = unsafe extern "C" fn(
            *mut sys::CUcontext,
            *mut std::ffi::c_void,
            u32,
            sys::CUdevice,
        ) -> i32;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        let r = if let Some(p) = driver::driver_sym("cuCtxCreate_v2") {
            // SAFETY: the driver's cuCtxCreate_v2 has this C signature; out-pointer valid.
            unsafe { std::mem::transmute::<usize, V2>(p)(&mut ctx, 0, dev) }
        } else if let Some(p) = driver::driver_sym("cuCtxCreate_v4") {
            // SAFETY: as above; null parameters are allowed.
            unsafe { std::mem::transmute::<usize, V4>(p)(&mut ctx, std::ptr::null_mut(), 0, dev) }
        } else {
            NOT_SUPPORTED
        };
        if r != 0 {
            return Err(r);
        }
        Ok(IdentCtx { ctx })
    }
}

/// The daemon's identity contexts (the live ones; a dead weak entry is pruned).
fn registry() -> &'static Mutex<HashMap<Part, Weak<IdentCtx>>> {
    static R: OnceLock<Mutex<HashMap<Part, Weak<IdentCtx>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Contexts created so far (the daemon's stats; tests).
pub static CREATED: AtomicU64 = AtomicU64::new(0);

/// Per identity (true) or the primary context (false), from the knob, read once.
fn per_identity() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(
        || match std::env::var(knobs::REMOTED_CUDA_CONTEXT.var).as_deref() {
            Ok("primary") => false,
            Ok("identity") | Ok("") | Err(_) => true,
            Ok(v) => {
                tracing::warn!(
                    "{}={v}: expected {}; using identity",
                    knobs::REMOTED_CUDA_CONTEXT.var,
                    knobs::REMOTED_CUDA_CONTEXT.form
                );
                true
            }
        },
    )
}

/// A session's context.
pub enum SessionCtx {
    Primary(Context),
    Identity(Arc<IdentCtx>),
}

impl SessionCtx {
    /// The context for a session of identity `part` on device 0.
    pub fn open(part: &Part) -> Result<SessionCtx, i32> {
        let (dev, _) = driver::init(0).map_err(|_| NO_DEVICE)?;
        if !per_identity() {
            return Context::retain(dev)
                .map(SessionCtx::Primary)
                .map_err(|_| NO_DEVICE);
        }
        let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = reg.get(part).and_then(Weak::upgrade) {
            return Ok(SessionCtx::Identity(c));
        }
        reg.retain(|_, w| w.strong_count() > 0);
        let c = Arc::new(IdentCtx::create(dev)?);
        CREATED.fetch_add(1, Relaxed);
        reg.insert(*part, Arc::downgrade(&c));
        Ok(SessionCtx::Identity(c))
    }

    pub fn make_current(&self) -> Result<(), i32> {
        match self {
            SessionCtx::Primary(c) => c.make_current().map_err(|_| INVALID_HANDLE),
            // Set on every batch, and the primary context's per-thread cache told
            // (the cuda backend may run on this thread too).
            SessionCtx::Identity(c) => {
                // SAFETY: a live context handle.
                let r = unsafe { sys::cuCtxSetCurrent(c.ctx) };
                driver::forget_current();
                if r != sys::CUresult::CUDA_SUCCESS {
                    return Err(r as i32);
                }
                Ok(())
            }
        }
    }
}
