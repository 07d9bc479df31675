//! The priority the watch's own thread runs at once started: SCHED_IDLE between
//! bursts, its own while a burst is attached. Between bursts the watch closes the
//! window (reads the maps, runs the model, writes the line) and polls; at its own
//! priority a wake-up preempts the server on the CPU it lands on (the idler one,
//! which beside a busy load tool is the server's), the cost the start had before it
//! ran idle (start_priority.rs). None of that has a deadline the target pays for.
//! The attach, the burst and its detach do: attached programs cost every syscall on
//! the host until the watch detaches them, so those run at the thread's own priority.
//! Beside a busy task of higher priority on its CPU an idle-policy thread waits
//! seconds for each wake-up, so a wake-up that comes LATE after it was due ends the
//! idle policy for the rest of the watch: it runs at its own priority from then on,
//! as it did before it ran idle. A person at the keys, and an injection (whose
//! relaunched server would inherit the idle policy), keep the thread's own; so does
//! a watch without CAP_SYS_NICE, which could not leave SCHED_IDLE again.

use crate::start_priority::{policy_of, set_policy, Policy};
use std::time::Duration;

/// A wake-up this late while idle: the host leaves the watch too little idle time.
pub const LATE: Duration = Duration::from_millis(100);

/// What the watch is doing, which sets the priority it runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Detached, between bursts: nothing the target pays for is due.
    Between,
    /// Attaching, attached, or detaching; or a person at the keys, or an injection.
    Due,
}

/// Held by the watch's thread: its policy follows the phase. Dropping it puts the
/// thread back. Not Send: it sets the policy of the thread that made it.
pub struct WatchPriority {
    tid: libc::pid_t,
    /// The thread's own policy (None: unreadable, or real-time: left alone).
    own: Option<Policy>,
    /// What Between runs at: Idle until a wake-up came LATE, then the thread's own.
    between: Option<Policy>,
    now: Option<Policy>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl WatchPriority {
    /// For the calling thread, at its own priority.
    pub fn new() -> WatchPriority {
        // SAFETY: gettid has no arguments.
        let tid = unsafe { libc::gettid() };
        let own = policy_of(tid).filter(|p| matches!(p, Policy::Other(_)));
        WatchPriority {
            tid,
            own,
            // Leaving SCHED_IDLE takes CAP_SYS_NICE (a watch run with CAP_BPF and
            // CAP_PERFMON alone may lack it): without, it would stay idle for good.
            between: own.map(|p| if may_raise() { Policy::Idle } else { p }),
            now: own,
            _not_send: std::marker::PhantomData,
        }
    }

    /// Runs at the phase's priority from here.
    pub fn set(&mut self, phase: Phase) {
        let want = match phase {
            Phase::Between => self.between,
            Phase::Due => self.own,
        };
        if let Some(p) = want.filter(|&p| Some(p) != self.now) {
            if set_policy(self.tid, p) {
                self.now = Some(p);
            } else if p == Policy::Idle {
                // Refused (a seccomp filter, say): Between runs at the thread's own.
                self.between = self.own;
            }
        }
    }

    /// A wake-up came `late` after it was due, the thread having slept at the
    /// current phase's priority.
    pub fn woke(&mut self, late: Duration) {
        if self.now == Some(Policy::Idle) && late >= LATE {
            self.between = self.own;
            self.set(Phase::Between);
        }
    }

    /// What Between runs at now.
    pub fn between(&self) -> Option<Policy> {
        self.between
    }
}

/// Whether this process holds CAP_SYS_NICE.
fn may_raise() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| sys_nice_in(&s))
}

/// Whether a /proc/PID/status text's effective capabilities hold CAP_SYS_NICE.
fn sys_nice_in(status: &str) -> bool {
    const CAP_SYS_NICE: u32 = 23;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_SYS_NICE) != 0)
}

impl Default for WatchPriority {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for WatchPriority {
    fn drop(&mut self) {
        if let Some(own) = self.own.filter(|&p| Some(p) != self.now) {
            set_policy(self.tid, own);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> libc::pid_t {
        // SAFETY: no arguments.
        unsafe { libc::gettid() }
    }

    /// Runs `f` on a thread of its own (whose policy the test may change) with that
    /// thread's own policy and a WatchPriority already between bursts. Raising a
    /// thread back from idle needs CAP_SYS_NICE.
    fn between_bursts(f: impl FnOnce(Policy, WatchPriority) + Send + 'static) {
        // SAFETY: no arguments.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipped: raising a thread's priority back needs root");
            return;
        }
        std::thread::spawn(|| {
            let own = policy_of(me()).expect("readable");
            let mut p = WatchPriority::new();
            p.set(Phase::Between);
            assert_eq!(policy_of(me()), Some(Policy::Idle));
            f(own, p)
        })
        .join()
        .unwrap();
    }

    #[test]
    fn without_cap_sys_nice_it_never_goes_idle() {
        assert!(sys_nice_in("Name:\tx\nCapEff:\t000001ffffffffff\n"));
        // CAP_BPF and CAP_PERFMON (bits 38, 39) alone.
        assert!(!sys_nice_in("CapEff:\t000000c000000000\n"));
        assert!(!sys_nice_in("Name:\tx\n"));
        let p = WatchPriority::new();
        let own = policy_of(me());
        if may_raise() {
            assert_eq!(p.between(), Some(Policy::Idle));
        } else {
            assert_eq!(p.between(), own);
        }
    }

    #[test]
    fn idle_between_bursts_own_when_due_and_back_on_drop() {
        between_bursts(|own, mut p| {
            p.set(Phase::Due);
            assert_eq!(policy_of(me()), Some(own));
            p.set(Phase::Between);
            drop(p);
            assert_eq!(policy_of(me()), Some(own));
        });
    }

    #[test]
    fn a_late_wake_up_ends_the_idle_policy() {
        between_bursts(|own, mut p| {
            // On time: still idle.
            p.woke(LATE / 2);
            assert_eq!(policy_of(me()), Some(Policy::Idle));
            // Late at its own priority says nothing about the idle policy.
            p.set(Phase::Due);
            p.woke(LATE * 3);
            assert_eq!(p.between(), Some(Policy::Idle));
            p.set(Phase::Between);
            p.woke(LATE * 2);
            assert_eq!(policy_of(me()), Some(own));
            // For good: the next time between bursts is not idle.
            p.set(Phase::Due);
            p.set(Phase::Between);
            assert_eq!(policy_of(me()), Some(own));
        });
    }
}
