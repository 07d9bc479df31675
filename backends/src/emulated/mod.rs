//! The emulated device: real AES-128-CTR, with the latency, parallelism and bandwidth
//! of a real accelerator, and no host CPU burnt while it is "busy": completions are
//! driven by a timerfd on one device thread, never by a spinning one.

pub mod aes;
mod engine;
mod lanes;

use crate::config::{self, knob, ConfigError};
use crate::knobs;
use crate::slots::{Slots, DONE, FAILED, PENDING, RUNNING, WAITER};
use crate::{AccelError, Accelerator, OpId, OpState};
use engine::Engine;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;

/// The device's knobs.
#[derive(Clone, Debug, PartialEq)]
pub struct EmuConfig {
    /// Service time of one operation, microseconds (TOFFLOAD_EMU_LAT_US, default 100).
    pub lat_us: f64,
    /// Operations in service at once; beyond that they queue (TOFFLOAD_EMU_LANES, default 64).
    pub lanes: usize,
    /// Extra per-byte cost as a bandwidth in MB/s; 0 = none (TOFFLOAD_EMU_MBPS, default 0).
    pub mbps: f64,
    /// Operations in flight before submit fails with EAGAIN (TOFFLOAD_EMU_MAX_INFLIGHT, default 4096).
    pub max_inflight: usize,
    /// Largest operation accepted, bytes.
    pub max_bytes: usize,
    /// Core the device thread is pinned to, if any (TOFFLOAD_EMU_CPU).
    pub cpu: Option<usize>,
}

/// The largest operation the emulated device accepts (64 MiB).
pub const MAX_BYTES: usize = 64 << 20;

impl Default for EmuConfig {
    fn default() -> Self {
        EmuConfig {
            lat_us: 100.0,
            lanes: 64,
            mbps: 0.0,
            max_inflight: 4096,
            max_bytes: MAX_BYTES,
            cpu: None,
        }
    }
}

impl EmuConfig {
    /// Reads the TOFFLOAD_EMU_* knobs through `get`.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let d = EmuConfig::default();
        let lat_us = knob(get, &knobs::EMU_LAT_US, config::parse_nonneg_f64)?.unwrap_or(d.lat_us);
        let lanes = knob(get, &knobs::EMU_LANES, |s| config::parse_range(s, 1, 65536))?
            .map_or(d.lanes, |v| v as usize);
        let mbps = knob(get, &knobs::EMU_MBPS, config::parse_nonneg_f64)?.unwrap_or(d.mbps);
        let max_inflight = knob(get, &knobs::EMU_MAX_INFLIGHT, |s| {
            config::parse_range(s, 1, crate::slots::MAX_SLOTS as u64)
        })?
        .map_or(d.max_inflight, |v| v as usize);
        let cpu =
            knob(get, &knobs::EMU_CPU, |s| config::parse_range(s, 0, 4095))?.map(|v| v as usize);
        Ok(EmuConfig {
            lat_us,
            lanes,
            mbps,
            max_inflight,
            max_bytes: d.max_bytes,
            cpu,
        })
    }

    /// Reads the knobs from the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(&config::from_env)
    }

    /// Service time for an operation of `len` bytes, ns.
    pub(crate) fn service_ns(&self, len: usize) -> u64 {
        let mut us = self.lat_us;
        if self.mbps > 0.0 {
            // bytes / (MB/s) = microseconds
            us += len as f64 / self.mbps;
        }
        (us * 1000.0).round() as u64
    }
}

/// What the device has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Operations completed (cancelled ones excluded).
    pub completed: u64,
    /// CPU time the device thread has used, ns.
    pub device_cpu_ns: u64,
    /// Times the device thread woke up.
    pub wakeups: u64,
}

/// The emulated accelerator.
pub struct Emulated {
    engine: Arc<Engine>,
}

impl Emulated {
    pub fn new(cfg: EmuConfig) -> std::io::Result<Self> {
        Ok(Emulated {
            engine: Engine::start(cfg)?,
        })
    }

    pub fn config(&self) -> &EmuConfig {
        &self.engine.cfg
    }

    pub fn stats(&self) -> DeviceStats {
        self.engine.stats()
    }

    fn slots(&self) -> &Slots {
        &self.engine.slots
    }
}

impl Drop for Emulated {
    fn drop(&mut self) {
        self.engine.stop();
    }
}

impl Emulated {
    /// Checks an operation and takes a slot for it: (index, generation, handle,
    /// service time ns).
    fn claim(&self, buf: *mut u8, len: usize) -> Result<(u32, u32, OpId, u64), AccelError> {
        if buf.is_null() && len > 0 {
            return Err(AccelError::NullBuffer);
        }
        let max = self.engine.cfg.max_bytes;
        if len > max {
            return Err(AccelError::TooLarge { len, max });
        }
        let c = self.slots().allocate((buf as usize, len))?;
        let id = OpId(Slots::handle(&c));
        Ok((c.index, c.generation, id, self.engine.cfg.service_ns(len)))
    }
}

impl Accelerator for Emulated {
    unsafe fn submit(&self, buf: *mut u8, len: usize) -> Result<OpId, AccelError> {
        let (index, generation, id, service) = self.claim(buf, len)?;
        self.engine.schedule(index, generation, service);
        Ok(id)
    }

    unsafe fn submit_polled(&self, buf: *mut u8, len: usize) -> Result<(OpId, u64), AccelError> {
        let (index, generation, id, service) = self.claim(buf, len)?;
        Ok((id, self.engine.schedule_polled(index, generation, service)))
    }

    fn done(&self, id: OpId) -> Result<OpState, AccelError> {
        let c = self.slots().lookup(id.0)?;
        let state = c.slot.state.load(Acquire) & !WAITER;
        // The slot may have been released and reused between lookup and load.
        if self.slots().generation_of(c.index) != c.generation {
            return Err(AccelError::BadHandle);
        }
        let state = match state {
            PENDING if self.engine.due_of(c.index).1 => {
                self.engine.complete_if_due(c.index, c.generation);
                c.slot.state.load(Acquire) & !WAITER
            }
            s => s,
        };
        match state {
            PENDING | RUNNING => Ok(OpState::Pending),
            DONE => Ok(OpState::Done),
            FAILED => Err(AccelError::DeviceFault),
            _ => Err(AccelError::BadHandle),
        }
    }

    fn wait(&self, id: OpId) -> Result<(), AccelError> {
        let c = self.slots().lookup(id.0)?;
        let (due, polled) = self.engine.due_of(c.index);
        if polled {
            // No device thread will come: sleep until it is due, then complete it.
            loop {
                match self.done(id)? {
                    OpState::Done => return Ok(()),
                    OpState::Pending if engine::now_ns() < due => sleep_until(due),
                    // Another poller is transforming it.
                    OpState::Pending => std::thread::yield_now(),
                }
            }
        }
        match c.slot.wait_terminal() {
            DONE => Ok(()),
            FAILED => Err(AccelError::DeviceFault),
            _ => Err(AccelError::BadHandle),
        }
    }

    fn release(&self, id: OpId) -> Result<(), AccelError> {
        // A cancelled op's slot is freed by the device thread when it comes due.
        self.slots().release(id.0, |_| {})
    }

    fn completion_fd(&self) -> RawFd {
        self.engine.event_fd()
    }
}

/// Sleeps until CLOCK_MONOTONIC `at` ns.
fn sleep_until(at: u64) {
    let ts = engine::timespec(at);
    // SAFETY: a valid timespec; an interruption only returns early, and the caller
    // loops.
    unsafe {
        libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &ts,
            std::ptr::null_mut(),
        )
    };
}

#[cfg(test)]
mod tests;
