//! The cuda backend: AES-128-CTR on an NVIDIA GPU, bit-identical to the emulated
//! device, through cudarc with the driver and NVRTC loaded at run time (the crate
//! builds and tests on machines without CUDA).
//!
//! Each submit copies the caller's bytes into its lane's pinned buffer, queues
//! H2D copy, kernel, D2H copy, an event and a host callback on a stream from the pool,
//! and returns. `done` is cuEventQuery; the first poll that sees the event complete
//! copies the pinned result into the caller's buffer (on the polling thread), then
//! reports done. `wait` sleeps in cuEventSynchronize (blocking-sync events). The
//! completion fd is written by the host callback (notify.rs), so nothing spins.
//!
//! driver.rs finds the driver and the device, kernel.rs compiles aes_ctr.cu,
//! pool.rs holds lanes and streams, notify.rs the completion fd.

pub mod driver;
pub mod kernel;
mod notify;
mod pool;

use crate::config::{self, knob, ConfigError};
use crate::knobs;
use crate::slots::{Claimed, Slots, CANCELLED, DONE, FAILED, PENDING, RUNNING, WAITER};
use crate::{AccelError, Accelerator, OpId, OpState};
use cudarc::driver::sys;
pub use driver::{CuError, DeviceInfo};
use kernel::{AesParams, Kernel};
use pool::{Lane, Streams, OWNER_CANCELLED, OWNER_GPU_DONE};
use std::ffi::c_void;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::sync::Arc;

/// The largest operation accepted, as the emulated device's (64 MiB).
pub const MAX_BYTES: usize = crate::emulated::MAX_BYTES;

/// The backend's knobs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    /// Device ordinal (TOFFLOAD_CUDA_DEVICE, default 0).
    pub device: i32,
    /// Streams in the pool (TOFFLOAD_CUDA_STREAMS, default 16).
    pub streams: usize,
    /// Operations in flight before submit fails with EAGAIN; one lane (pinned and
    /// device buffers, grown on demand) each (TOFFLOAD_CUDA_MAX_INFLIGHT, default 1024).
    pub max_inflight: usize,
    /// Largest operation accepted, bytes.
    pub max_bytes: usize,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            device: 0,
            streams: 16,
            max_inflight: 1024,
            max_bytes: MAX_BYTES,
        }
    }
}

impl CudaConfig {
    /// Reads the TOFFLOAD_CUDA_* knobs through `get`.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let d = CudaConfig::default();
        let device = knob(get, &knobs::CUDA_DEVICE, |s| {
            config::parse_range(s, 0, 1023)
        })?
        .map_or(d.device, |v| v as i32);
        let streams = knob(get, &knobs::CUDA_STREAMS, |s| {
            config::parse_range(s, 1, 1024)
        })?
        .map_or(d.streams, |v| v as usize);
        let max_inflight = knob(get, &knobs::CUDA_MAX_INFLIGHT, |s| {
            config::parse_range(s, 1, 65536)
        })?
        .map_or(d.max_inflight, |v| v as usize);
        Ok(CudaConfig {
            device,
            streams,
            max_inflight,
            max_bytes: d.max_bytes,
        })
    }

    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(&config::from_env)
    }
}

/// Loads the driver and checks the configured device, without creating a context or
/// compiling anything: a cheap "is there a GPU here" for tests and the GPU check.
pub fn check_device(cfg: &CudaConfig) -> Result<DeviceInfo, CuError> {
    driver::init(cfg.device).map(|(_, info)| info)
}

struct Inner {
    cfg: CudaConfig,
    info: DeviceInfo,
    // Field order is drop order: CUDA objects before the context that owns them.
    kernel: Kernel,
    streams: Streams,
    lanes: Box<[Lane]>,
    ctx: driver::Context,
    slots: Slots<(usize, usize)>,
    notifier: notify::Notifier,
    params: AesParams,
    completed: AtomicU64,
    /// CuError kinds already logged: each cause gets one line, not one per call.
    logged: AtomicU32,
}

impl Inner {
    fn log_once(&self, e: &CuError) {
        let bit = 1 << e.kind();
        if self.logged.fetch_or(bit, Relaxed) & bit == 0 {
            eprintln!("toffload_accel: cuda: {e}");
        }
    }

    /// The stream reached op (index, generation)'s callback: mark the GPU done with
    /// the lane (freeing the slot if the op was released while pending), then signal,
    /// so that a caller woken by the fd finds the slot free.
    fn gpu_finished(&self, index: u32, generation: u32) {
        self.mark(index, generation, OWNER_GPU_DONE);
        self.notifier.signal();
    }

    /// Sets `flag` on the lane of op (index, generation); frees the slot if the other
    /// flag was already set. A stale op (the slot since reused) changes nothing.
    fn mark(&self, index: u32, generation: u32, flag: u64) {
        let owner = &self.lanes[index as usize].owner;
        let mut cur = owner.load(Acquire);
        while cur >> 2 == generation as u64 {
            match owner.compare_exchange_weak(cur, cur | flag, AcqRel, Acquire) {
                Ok(_) => {
                    if cur & (OWNER_CANCELLED | OWNER_GPU_DONE) & !flag != 0 {
                        self.slots.free(index);
                    }
                    return;
                }
                Err(now) => cur = now,
            }
        }
    }
}

/// The cuda accelerator.
pub struct Cuda {
    inner: Arc<Inner>,
}

fn to_accel(e: &CuError) -> AccelError {
    match e {
        CuError::OutOfMemory(_) => AccelError::OutOfMemory,
        CuError::Missing(_) | CuError::NoDevice(_) => AccelError::NoDevice,
        CuError::Kernel(_) | CuError::Driver(_) | CuError::Hung(_) => AccelError::DeviceFault,
    }
}

impl Cuda {
    /// Loads the driver, opens the device, compiles the kernel. Errors name the cause
    /// (no driver, no device, NVRTC missing or failing, out of memory).
    pub fn new(cfg: CudaConfig) -> Result<Cuda, CuError> {
        let (dev, info) = driver::init(cfg.device)?;
        let ctx = driver::Context::retain(dev)?;
        let kernel = kernel::build(info.cc)?;
        // SAFETY: context current (retain made it so on this thread).
        let streams = unsafe { Streams::new(cfg.streams)? };
        let notifier = notify::Notifier::new()
            .map_err(|e| CuError::Driver(format!("creating the completion eventfd: {e}")))?;
        let lanes = (0..cfg.max_inflight).map(|_| Lane::empty()).collect();
        let dev = Cuda {
            inner: Arc::new(Inner {
                slots: Slots::new(cfg.max_inflight),
                cfg,
                info,
                kernel,
                streams,
                lanes,
                ctx,
                notifier,
                params: AesParams::device(),
                completed: AtomicU64::new(0),
                logged: AtomicU32::new(0),
            }),
        };
        match dev.self_test() {
            Ok(()) => Ok(dev),
            Err(e @ CuError::Hung(_)) => {
                // Dropping would synchronise with a device that does not finish.
                std::mem::forget(dev);
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// One known-answer operation through the whole path (copies, kernel, event,
    /// callback), at start: a kernel that compiles but computes wrong answers is
    /// reported here rather than in the first client's data, and the driver's helper
    /// threads exist before the server accepts its first connection (the fiber
    /// runtime turns threads created after that into fibers). Polls with a deadline:
    /// never a hang, even in a library constructor.
    fn self_test(&self) -> Result<(), CuError> {
        // SP 800-38A's first plaintext block under the device key and counter.
        const PLAIN: [u8; 16] = [
            0x6b, 0xc1, 0xbe, 0xe2, 0x2e, 0x40, 0x9f, 0x96, 0xe9, 0x3d, 0x7e, 0x11, 0x73, 0x93,
            0x17, 0x2a,
        ];
        const CIPHER: [u8; 16] = [
            0x0d, 0x66, 0x79, 0x0a, 0x1a, 0x12, 0xae, 0xde, 0x7e, 0x6c, 0xa0, 0x16, 0x40, 0x85,
            0xba, 0x87,
        ];
        let mut buf = PLAIN;
        let c = self
            .inner
            .slots
            .allocate_as((buf.as_mut_ptr() as usize, 16), RUNNING)
            .map_err(|e| CuError::Driver(format!("self-test: {e}")))?;
        if let Err(e) = self.enqueue(c.index, c.generation, buf.as_ptr(), 16) {
            self.inner.slots.free(c.index);
            return Err(e);
        }
        c.slot.state.store(PENDING, Release);
        let id = OpId(Slots::handle(&c));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let state = loop {
            match self.done(id) {
                Ok(OpState::Pending) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_micros(200))
                }
                other => break other,
            }
        };
        let _ = self.release(id);
        match state {
            Ok(OpState::Done) if buf == CIPHER => Ok(()),
            Ok(OpState::Done) => Err(CuError::Kernel(format!(
                "the AES kernel's self-test gave {buf:02x?}, expected {CIPHER:02x?}"
            ))),
            Ok(OpState::Pending) => Err(CuError::Hung(
                "the self-test operation did not complete within 20 s".into(),
            )),
            Err(e) => Err(CuError::Kernel(format!(
                "the AES kernel's self-test failed: {e}"
            ))),
        }
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    pub fn config(&self) -> &CudaConfig {
        &self.inner.cfg
    }

    /// Operations completed so far.
    pub fn completed(&self) -> u64 {
        self.inner.completed.load(Acquire)
    }

    /// Queues op `index` (its slot RUNNING, owned by us): copy in, H2D, kernel, D2H,
    /// event, callback. On error nothing of it is left in flight.
    fn enqueue(
        &self,
        index: u32,
        generation: u32,
        buf: *const u8,
        len: usize,
    ) -> Result<(), CuError> {
        let inner = &self.inner;
        inner.ctx.make_current()?;
        let lane = &inner.lanes[index as usize];
        // SAFETY: we own the slot, and its previous op drained (the slot was free).
        let res = unsafe { lane.ensure(len)? };
        if len > 0 {
            // SAFETY: caller's buffer valid for len bytes; the lane holds >= len.
            unsafe { std::ptr::copy_nonoverlapping(buf, res.host, len) };
        }
        let stream = inner.streams.pick();
        let queued = (|| -> Result<(), CuError> {
            // SAFETY: context current; buffers sized above; stream live.
            unsafe {
                if len > 0 {
                    driver::check(
                        sys::cuMemcpyHtoDAsync_v2(res.dev, res.host as *const c_void, len, stream),
                        "queueing the copy to the device",
                    )?;
                    let mut data = res.dev;
                    let mut n = len as u64;
                    let mut p = inner.params;
                    let mut args = [
                        &mut data as *mut _ as *mut c_void,
                        &mut n as *mut _ as *mut c_void,
                        &mut p as *mut _ as *mut c_void,
                    ];
                    driver::check(
                        sys::cuLaunchKernel(
                            inner.kernel.func,
                            kernel::grid_for(len),
                            1,
                            1,
                            kernel::THREADS,
                            1,
                            1,
                            0,
                            stream,
                            args.as_mut_ptr(),
                            std::ptr::null_mut(),
                        ),
                        "launching the AES kernel",
                    )
                    .map_err(|e| match e {
                        CuError::Driver(m) => CuError::Kernel(m),
                        other => other,
                    })?;
                    driver::check(
                        sys::cuMemcpyDtoHAsync_v2(res.host as *mut c_void, res.dev, len, stream),
                        "queueing the copy from the device",
                    )?;
                }
                driver::check(
                    sys::cuEventRecord(res.event, stream),
                    "recording the completion event",
                )?;
                lane.owner.store((generation as u64) << 2, Release);
                let me = Arc::clone(inner);
                notify::after(stream, Box::new(move || me.gpu_finished(index, generation)))
            }
        })();
        if queued.is_err() {
            // Whatever was queued must finish before the lane can be reused.
            // SAFETY: live stream, context current.
            unsafe { sys::cuStreamSynchronize(stream) };
        }
        queued
    }

    /// Polls a published op: on completion, copies the result out (once) and marks it DONE.
    fn poll(&self, c: &Claimed<'_, (usize, usize)>) -> Result<OpState, AccelError> {
        let inner = &self.inner;
        loop {
            let s = c.slot.state.load(Acquire);
            let out = match s & !WAITER {
                RUNNING => Ok(OpState::Pending),
                DONE => Ok(OpState::Done),
                FAILED => Err(AccelError::DeviceFault),
                PENDING => {
                    let lane = &inner.lanes[c.index as usize];
                    if let Err(e) = inner.ctx.make_current() {
                        inner.log_once(&e);
                        return Err(to_accel(&e));
                    }
                    // SAFETY: event created before the op was published.
                    let r = unsafe { sys::cuEventQuery(lane.res().event) };
                    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
                        Ok(OpState::Pending)
                    } else if !c.slot.start() {
                        continue; // someone else claimed, or released, it meanwhile
                    } else if let Err(e) = driver::check(r, "running the AES operation") {
                        inner.log_once(&e);
                        c.slot.finish(false);
                        Err(AccelError::DeviceFault)
                    } else {
                        let (buf, len) = c.slot.op();
                        if len > 0 {
                            // SAFETY: the op's buffer stays valid until released, and
                            // release waits while we are RUNNING; the D2H copy is
                            // complete (event passed).
                            unsafe {
                                std::ptr::copy_nonoverlapping(lane.res().host, buf as *mut u8, len)
                            };
                        }
                        inner.completed.fetch_add(1, Release);
                        c.slot.finish(true);
                        Ok(OpState::Done)
                    }
                }
                _ => Err(AccelError::BadHandle),
            };
            // The slot may have been released and reused since the lookup.
            if inner.slots.generation_of(c.index) != c.generation {
                return Err(AccelError::BadHandle);
            }
            return out;
        }
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        let inner = &self.inner;
        if inner.ctx.make_current().is_err() {
            return;
        }
        // Drain every stream: copies, kernels and callbacks (which hold Arcs of
        // `inner` and must not be the last to drop it: its Drop calls CUDA).
        for &s in inner.streams.all() {
            // SAFETY: live streams, context current.
            unsafe { sys::cuStreamSynchronize(s) };
        }
        for lane in inner.lanes.iter() {
            // SAFETY: streams drained: nothing in flight.
            unsafe { lane.destroy() };
        }
        // SAFETY: module loaded in Cuda::new; nothing uses it any more.
        unsafe { sys::cuModuleUnload(inner.kernel.module) };
    }
}

impl Accelerator for Cuda {
    unsafe fn submit(&self, buf: *mut u8, len: usize) -> Result<OpId, AccelError> {
        if buf.is_null() && len > 0 {
            return Err(AccelError::NullBuffer);
        }
        let max = self.inner.cfg.max_bytes;
        if len > max {
            return Err(AccelError::TooLarge { len, max });
        }
        // RUNNING until queued: a poll of a guessed handle must not query the lane's
        // previous event.
        let c = self.inner.slots.allocate_as((buf as usize, len), RUNNING)?;
        let id = Slots::handle(&c);
        if let Err(e) = self.enqueue(c.index, c.generation, buf, len) {
            self.inner.log_once(&e);
            self.inner.slots.free(c.index);
            return Err(to_accel(&e));
        }
        if c.slot.state.swap(PENDING, AcqRel) & WAITER != 0 {
            crate::futex::wake_all(&c.slot.state);
        }
        Ok(OpId(id))
    }

    fn done(&self, id: OpId) -> Result<OpState, AccelError> {
        let c = self.inner.slots.lookup(id.0)?;
        self.poll(&c)
    }

    fn wait(&self, id: OpId) -> Result<(), AccelError> {
        loop {
            let c = self.inner.slots.lookup(id.0)?;
            if self.poll(&c)? == OpState::Done {
                return Ok(());
            }
            match c.slot.state.load(Acquire) & !WAITER {
                PENDING => {
                    let ev = self.inner.lanes[c.index as usize].res().event;
                    // SAFETY: a live event (lanes are never destroyed while the
                    // backend lives). A failure shows up in the next cuEventQuery.
                    unsafe { sys::cuEventSynchronize(ev) };
                }
                // Another thread is copying the result out.
                RUNNING => {
                    c.slot.wait_terminal();
                }
                _ => {}
            }
        }
    }

    fn release(&self, id: OpId) -> Result<(), AccelError> {
        let c = self.inner.slots.lookup(id.0)?;
        let state = &c.slot.state;
        loop {
            let s = state.load(Acquire);
            match s & !WAITER {
                // Pending: cancelled. The GPU's work lands in the lane, never in the
                // caller's buffer, and the slot is freed once the stream is past it.
                PENDING => {
                    if state
                        .compare_exchange(s, CANCELLED, AcqRel, Acquire)
                        .is_ok()
                    {
                        if s & WAITER != 0 {
                            crate::futex::wake_all(state);
                        }
                        self.inner.mark(c.index, c.generation, OWNER_CANCELLED);
                        return Ok(());
                    }
                }
                // Done or failed: the event passed, so the GPU is done with the lane
                // (its callback may still be queued; it only signals): free now.
                DONE | FAILED => {
                    if state
                        .compare_exchange(s, CANCELLED, AcqRel, Acquire)
                        .is_ok()
                    {
                        if s & WAITER != 0 {
                            crate::futex::wake_all(state);
                        }
                        self.inner.slots.free(c.index);
                        return Ok(());
                    }
                }
                // A poller is copying the result into the buffer: wait until whole.
                RUNNING => std::thread::yield_now(),
                _ => return Err(AccelError::BadHandle),
            }
            if self.inner.slots.generation_of(c.index) != c.generation {
                return Err(AccelError::BadHandle);
            }
        }
    }

    fn completion_fd(&self) -> RawFd {
        self.inner.notifier.fd()
    }
}

#[cfg(test)]
mod tests;
