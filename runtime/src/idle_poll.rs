//! Idle poll: keeps a carrier's vCPU out of HLT while the carrier sleeps with offloads
//! in flight.
//!
//! Why: on a virtual machine without a polling cpuidle driver, an idle vCPU executes
//! HLT, which exits to the hypervisor; the wake-up that follows (a completion, the
//! next request) has to be delivered by the host's scheduler, tens of microseconds
//! later. A fiber runtime leaves its core idle far more often than a thread per
//! connection does (one carrier sleeps where 64 threads would still be running), so it
//! pays that exit on most wake-ups.
//!
//! What: one thread per carrier, started on the carrier's first parked offload,
//! SCHED_IDLE (it runs only when nothing else on that core wants to), pinned to the
//! core its carrier last slept on, spinning only while that carrier has offloads in
//! flight and for a short linger after; otherwise parked on a futex. It never touches
//! fibers, application memory or signals (all blocked). It is named `toffload-poll` so
//! that its CPU can be kept apart from the server's.
//!
//! When: off by default; TOFFLOAD_IDLE_POLL=on, or auto, which turns it on only under a
//! hypervisor whose guest kernel does not poll before halting itself (cpuidle driver
//! `haltpoll`); on bare metal an idle core's wake-up is cheap and spinning would only
//! burn power. It pays under steal, not on a quiet host (README, "Idle poll").

use crate::carrier::Carrier;
use crate::config::IdlePoll;
use crate::time;
use crate::waitq::{futex_wait, futex_wake};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering::*};
use std::sync::OnceLock;

/// Keep spinning this long after the last offload completes: the next one usually
/// follows within a request's CPU time, and waking a parked poller costs a syscall.
const LINGER_NS: u64 = 200_000;

/// Per-carrier state, embedded in the Carrier.
#[derive(Default)]
pub struct Poll {
    /// Offloads parked on this carrier (the futex word the poller sleeps on).
    pub inflight: AtomicU32,
    /// The core the carrier last went to sleep on.
    cpu: AtomicU32,
    /// The poller sleeps on `inflight`.
    parked: AtomicBool,
    /// 0: no poller yet, 1: running, 2: could not start (never retried).
    started: AtomicU8,
}

static ENABLED: OnceLock<bool> = OnceLock::new();

/// Whether this process polls, decided once from TOFFLOAD_IDLE_POLL and the host.
pub fn enabled() -> bool {
    *ENABLED.get_or_init(|| match crate::settings().idle_poll {
        IdlePoll::On => true,
        IdlePoll::Off => false,
        IdlePoll::Auto => host_halts_idle_vcpu(),
    })
}

/// Under a hypervisor (CPUID.1:ECX bit 31) whose guest cpuidle driver is not haltpoll.
fn host_halts_idle_vcpu() -> bool {
    if !under_hypervisor() {
        return false;
    }
    let drv = std::fs::read_to_string("/sys/devices/system/cpu/cpuidle/current_driver")
        .unwrap_or_default();
    drv.trim() != "haltpoll"
}

#[cfg(target_arch = "x86_64")]
fn under_hypervisor() -> bool {
    // CPUID leaf 1 exists on every x86_64 CPU (safe since Rust 1.87).
    let r = std::arch::x86_64::__cpuid(1);
    r.ecx & (1 << 31) != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn under_hypervisor() -> bool {
    false
}

impl Poll {
    /// Carrier side: an offload parked (`+1`) or completed (`-1`).
    /// (Nothing when polling is off: two atomic RMWs are a fifth of a park.)
    pub fn parked_offload(&self) {
        if enabled() && self.inflight.fetch_add(1, SeqCst) == 0 && self.parked.swap(false, SeqCst) {
            futex_wake(&self.inflight);
        }
    }

    pub fn completed_offloads(&self, n: u32) {
        if n > 0 && enabled() {
            self.inflight.fetch_sub(n, SeqCst);
        }
    }

    /// Carrier side, before it sleeps: where it sleeps, and a poller if none yet.
    pub fn before_sleep(&self, c: &'static Carrier) {
        if self.inflight.load(Relaxed) == 0 {
            return;
        }
        // SAFETY: no arguments; vDSO/rseq-backed, no syscall on current glibc.
        let cpu = unsafe { libc::sched_getcpu() };
        if cpu >= 0 {
            self.cpu.store(cpu as u32, Relaxed);
        }
        if self.started.load(Relaxed) == 0 {
            self.start(c);
        }
    }

    fn start(&self, c: &'static Carrier) {
        // SAFETY: plain signal-mask calls and the real pthread_create with a static
        // carrier as argument. The new thread inherits the all-blocked mask, so no
        // signal meant for the application ever runs its handler on the poller.
        let ok = unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            let mut t: libc::pthread_t = 0;
            let r = (crate::real::pthread_create())(
                &mut t,
                std::ptr::null(),
                poller_main,
                c as *const Carrier as *mut libc::c_void,
            );
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
            if r == 0 {
                libc::pthread_detach(t);
            } else {
                crate::log_at!(
                    crate::log::ERROR,
                    "cannot start the idle poller of carrier {}: errno {r}; running without it",
                    c.index
                );
            }
            r == 0
        };
        self.started.store(if ok { 1 } else { 2 }, Relaxed);
    }

    /// Fork child: the parent's poller does not exist here.
    pub fn reset_in_child(&self) {
        self.inflight.store(0, SeqCst);
        self.parked.store(false, SeqCst);
        self.started.store(0, SeqCst);
    }
}

fn pin_to(cpu: u32) {
    // SAFETY: a zeroed cpu_set_t with one bit set, for this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

extern "C" fn poller_main(arg: *mut libc::c_void) -> *mut libc::c_void {
    // SAFETY: `arg` is a leaked &'static Carrier.
    let c: &'static Carrier = unsafe { &*(arg as *const Carrier) };
    let p = &c.idle_poll;
    // SAFETY: naming and scheduling this thread only.
    unsafe {
        libc::prctl(libc::PR_SET_NAME, c"toffload-poll".as_ptr());
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            // Without SCHED_IDLE it would compete with the server: give up instead.
            crate::log_at!(
                crate::log::ERROR,
                "idle poller: SCHED_IDLE refused (errno {}); not polling",
                crate::real::errno()
            );
            return std::ptr::null_mut();
        }
    }
    let mut pinned = u32::MAX;
    let mut idle_since: Option<u64> = None;
    loop {
        if p.inflight.load(SeqCst) == 0 {
            let now = time::now_ns();
            let since = *idle_since.get_or_insert(now);
            if now.saturating_sub(since) < LINGER_NS {
                spin(256);
                continue;
            }
            p.parked.store(true, SeqCst);
            if p.inflight.load(SeqCst) == 0 {
                futex_wait(&p.inflight, 0, None);
            }
            p.parked.store(false, SeqCst);
            idle_since = None;
            continue;
        }
        idle_since = None;
        let cpu = p.cpu.load(Relaxed);
        if cpu != pinned {
            // Tried once per move: a refused mask (a cpuset) leaves it where it is,
            // still SCHED_IDLE, rather than retrying the syscall in the spin.
            pin_to(cpu);
            pinned = cpu;
        }
        spin(256);
    }
}

#[inline]
fn spin(n: u32) {
    for _ in 0..n {
        // PAUSE: user-mode PAUSE does not trigger pause-loop exits.
        std::hint::spin_loop();
    }
}
