//! The device thread. Submitters book a lane and push the completion time onto a
//! heap, arming a timerfd when theirs is the earliest; the device thread sleeps in
//! read(timerfd), transforms whatever is due, and signals the eventfd. No spinning.
//!
//! Polled operations (`schedule_polled`) take no timer and no signal: whoever polls
//! one at or after its due time completes it (`complete_if_due`). On a VM each
//! wake-up of the device thread costs the server's core tens of microseconds (a
//! timer reprogram and an interrupt each exit to the hypervisor, plus two context
//! switches), which a poller that looks between requests does not pay.

use super::aes::CtrEngine;
use super::lanes::Lanes;
use super::{DeviceStats, EmuConfig};
use crate::slots::{Slots, CANCELLED, PENDING, RUNNING, WAITER};
use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex};

/// The timer's lateness is learnt and the timer armed that much early, but never
/// more than this (a wake-up later than that is the machine's noise, not a bias).
const MAX_EARLY_NS: u64 = 30_000;

/// Completions due within this share of the latency (at most COALESCE_MAX_NS) of the
/// one that woke the device are delivered with it, as interrupt coalescing does: on
/// this kind of VM a wake-up costs ~17 us of CPU, far more than the work.
const COALESCE_SHARE: u64 = 50; // 1/50 = 2%
const COALESCE_MAX_NS: u64 = 10_000;

struct Sched {
    lanes: Lanes,
    /// (completion time ns, slot index, generation)
    due: BinaryHeap<Reverse<(u64, u32, u32)>>,
    /// Completion time the timer is armed for; 0 = not armed.
    armed: u64,
    /// How early the timer is armed (EWMA of observed wake-up lateness), ns.
    early_ns: u64,
    /// Polled ops by due time: kept only so that a cancelled one is freed (the
    /// timer never fires for them); pruned by every submitter and wake-up.
    polled: BinaryHeap<Reverse<(u64, u32, u32)>>,
}

pub(super) struct Engine {
    pub cfg: EmuConfig,
    pub slots: Slots,
    /// Per slot: when its op is done (CLOCK_MONOTONIC ns), and whether it is polled.
    due: Box<[AtomicU64]>,
    polled: Box<[AtomicBool]>,
    sched: Mutex<Sched>,
    timer: OwnedFd,
    event: OwnedFd,
    stop: AtomicBool,
    completed: AtomicU64,
    /// The device thread's CPU clock (pthread_getcpuclockid), once it runs.
    cpu_clock: AtomicU64,
    wakeups: AtomicU64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

pub(super) fn now_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// `ns` as a timespec.
pub(super) fn timespec(ns: u64) -> libc::timespec {
    libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

impl Engine {
    pub fn start(cfg: EmuConfig) -> io::Result<Arc<Engine>> {
        // SAFETY: plain fd-creating syscalls; results checked.
        let timer = unsafe {
            OwnedFd::from_raw_fd(cvt(libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_CLOEXEC,
            ))?)
        };
        // SAFETY: as above.
        let event = unsafe {
            OwnedFd::from_raw_fd(cvt(libc::eventfd(
                0,
                libc::EFD_NONBLOCK | libc::EFD_CLOEXEC,
            ))?)
        };
        let engine = Arc::new(Engine {
            slots: Slots::new(cfg.max_inflight),
            due: (0..cfg.max_inflight).map(|_| AtomicU64::new(0)).collect(),
            polled: (0..cfg.max_inflight)
                .map(|_| AtomicBool::new(false))
                .collect(),
            sched: Mutex::new(Sched {
                lanes: Lanes::new(cfg.lanes),
                due: BinaryHeap::with_capacity(cfg.max_inflight),
                armed: 0,
                early_ns: 0,
                polled: BinaryHeap::new(),
            }),
            cfg,
            timer,
            event,
            stop: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            cpu_clock: AtomicU64::new(u64::MAX),
            wakeups: AtomicU64::new(0),
            thread: Mutex::new(None),
        });
        let worker = Arc::clone(&engine);
        let handle = std::thread::Builder::new()
            .name(toffload_abi::threads::EMULATED_ENGINE.into())
            .stack_size(256 << 10)
            .spawn(move || worker.device_loop())?;
        *engine.thread.lock().unwrap() = Some(handle);
        Ok(engine)
    }

    pub fn event_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    pub fn stats(&self) -> DeviceStats {
        DeviceStats {
            completed: self.completed.load(Acquire),
            device_cpu_ns: match self.cpu_clock.load(Acquire) {
                u64::MAX => 0,
                clock => clock_ns(clock as libc::clockid_t),
            },
            wakeups: self.wakeups.load(Relaxed),
        }
    }

    /// Books a lane for the op in slot `index` and makes sure the timer fires in time.
    pub fn schedule(&self, index: u32, generation: u32, service_ns: u64) {
        let mut s = self.sched.lock().unwrap_or_else(|p| p.into_inner());
        let finish = s.lanes.book(now_ns(), service_ns);
        self.due[index as usize].store(finish, Relaxed);
        self.polled[index as usize].store(false, Relaxed);
        s.due.push(Reverse((finish, index, generation)));
        if s.armed == 0 || finish < s.armed {
            self.arm(&mut s, finish);
        }
    }

    /// Books a lane for a polled op; returns when it is done. No timer is armed.
    pub fn schedule_polled(&self, index: u32, generation: u32, service_ns: u64) -> u64 {
        let mut s = self.sched.lock().unwrap_or_else(|p| p.into_inner());
        let now = now_ns();
        let finish = s.lanes.book(now, service_ns);
        self.due[index as usize].store(finish, Relaxed);
        self.polled[index as usize].store(true, Relaxed);
        s.polled.push(Reverse((finish, index, generation)));
        self.prune_polled(&mut s, now);
        finish
    }

    /// When the op in slot `index` is done, and whether it is polled. Read only for a
    /// live handle: written before the submitter returned it.
    pub fn due_of(&self, index: u32) -> (u64, bool) {
        (
            self.due[index as usize].load(Relaxed),
            self.polled[index as usize].load(Relaxed),
        )
    }

    /// Drops polled ops that are no longer pending from the heap, freeing the
    /// cancelled ones; stops at the first still pending (its poller will come).
    fn prune_polled(&self, s: &mut Sched, now: u64) {
        while let Some(&Reverse((finish, index, generation))) = s.polled.peek() {
            if self.slots.generation_of(index) == generation {
                match self.slots.get(index).state.load(Acquire) & !WAITER {
                    CANCELLED if finish <= now => self.slots.free(index),
                    CANCELLED | PENDING | RUNNING => return,
                    _ => {}
                }
            }
            s.polled.pop();
        }
    }

    /// Polled completion: an op past its due time is done for whoever looks, who
    /// does its transform. False while it is not due (or another thread has it).
    pub fn complete_if_due(&self, index: u32, generation: u32) -> bool {
        if self.due[index as usize].load(Relaxed) > now_ns() {
            return false;
        }
        thread_local! {
            static AES: RefCell<Option<CtrEngine>> = const { RefCell::new(None) };
        }
        AES.with(|aes| {
            let mut aes = aes.borrow_mut();
            if aes.is_none() {
                *aes = CtrEngine::new().ok();
            }
            self.complete(index, generation, aes.as_mut())
        })
    }

    fn arm(&self, s: &mut Sched, finish: u64) {
        s.armed = finish;
        let at = finish.saturating_sub(s.early_ns).max(1);
        let spec = libc::itimerspec {
            it_interval: timespec(0),
            it_value: timespec(at),
        };
        // SAFETY: valid fd and spec. Cannot fail for a valid absolute time.
        unsafe {
            libc::timerfd_settime(
                self.timer.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
    }

    pub fn stop(&self) {
        self.stop.store(true, Release);
        {
            let mut s = self.sched.lock().unwrap_or_else(|p| p.into_inner());
            self.arm(&mut s, 1);
        }
        if let Some(h) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
    }

    fn device_loop(&self) {
        // SAFETY: prctl/sched_setaffinity on the calling thread only.
        unsafe {
            // A 1 ns timer slack: the default 50 us would be the device's error bar.
            libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
            if let Some(cpu) = self.cfg.cpu {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
        }
        let mut clock: libc::clockid_t = 0;
        // SAFETY: our own thread handle; out-pointer valid.
        if unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) } == 0 {
            self.cpu_clock.store(clock as u32 as u64, Release);
        }
        let mut aes = CtrEngine::new().ok();
        let mut batch: Vec<(u32, u32)> = Vec::with_capacity(self.cfg.lanes.min(4096));
        loop {
            let mut expirations = 0u64;
            // SAFETY: reading 8 bytes into a u64 from our own timerfd.
            let n = unsafe {
                libc::read(
                    self.timer.as_raw_fd(),
                    &mut expirations as *mut u64 as *mut libc::c_void,
                    8,
                )
            };
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            if self.stop.load(Acquire) {
                return;
            }
            self.wakeups.fetch_add(1, Relaxed);
            self.collect_due(&mut batch);
            for &(index, generation) in &batch {
                self.complete(index, generation, aes.as_mut());
            }
            if !batch.is_empty() {
                let one = 1u64;
                // SAFETY: 8-byte write to our eventfd; EAGAIN (counter full) is harmless.
                unsafe {
                    libc::write(
                        self.event.as_raw_fd(),
                        &one as *const u64 as *const libc::c_void,
                        8,
                    )
                };
            }
        }
    }

    /// Takes every op due by now (within the learnt lateness) and re-arms the timer.
    fn collect_due(&self, batch: &mut Vec<(u32, u32)>) {
        batch.clear();
        let mut s = self.sched.lock().unwrap_or_else(|p| p.into_inner());
        let now = now_ns();
        if s.armed != 0 {
            let target = s.armed.saturating_sub(s.early_ns);
            if now >= target {
                let late = (now - target).min(MAX_EARLY_NS);
                s.early_ns = (s.early_ns * 7 + late) / 8;
            }
        }
        self.prune_polled(&mut s, now);
        let coalesce = (self.cfg.service_ns(0) / COALESCE_SHARE).min(COALESCE_MAX_NS);
        let horizon = now + s.early_ns + coalesce;
        while let Some(&Reverse((finish, index, generation))) = s.due.peek() {
            if finish > horizon {
                break;
            }
            s.due.pop();
            batch.push((index, generation));
        }
        match s.due.peek() {
            Some(&Reverse((next, _, _))) => self.arm(&mut s, next),
            None => s.armed = 0,
        }
    }

    /// Transforms the op in slot `index` if it is still that generation's and
    /// pending; true if this call completed it.
    fn complete(&self, index: u32, generation: u32, aes: Option<&mut CtrEngine>) -> bool {
        if self.slots.generation_of(index) != generation {
            return false;
        }
        let slot = self.slots.get(index);
        if !slot.start() {
            if slot.state.load(Acquire) & !WAITER == CANCELLED
                && !self.polled[index as usize].load(Relaxed)
            {
                self.slots.free(index);
            }
            return false;
        }
        // Released and reused between the check and start(): that op is not ours.
        if self.slots.generation_of(index) != generation {
            slot.unstart();
            return false;
        }
        let (buf, len) = slot.op();
        let ok = match aes {
            Some(aes) if len > 0 => {
                // SAFETY: the submitter guaranteed buf..buf+len valid until done or
                // released; release waits while we are RUNNING.
                let data = unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, len) };
                aes.apply(data).is_ok()
            }
            Some(_) => true,
            None => false,
        };
        // Count before publishing, so a caller that saw its op done sees it counted.
        self.completed.fetch_add(1, Release);
        slot.finish(ok);
        true
    }
}
