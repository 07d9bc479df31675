//! The priority the watcher's start (loading the programs through the verifier,
//! attaching, the calibration's own copy of both) runs at: SCHED_IDLE, so that an
//! observer takes only CPU time that the server and its clients leave idle, and is
//! preempted the moment either of them wakes. At a nicer SCHED_OTHER priority
//! (+10) the same start still cost a pinned redis-server 15-25% of its requests for
//! the 0.7 s it took: a waking task waits for a nice task's slice to end, an idle
//! one's it does not. On a host with no idle time SCHED_IDLE would starve the start,
//! so a watchdog moves the thread to that nicer priority after IDLE_GRACE: the start
//! is then only as polite as before, never stuck.
//!
//! The start is also pinned, for its length, to the CPU that was idlest just before:
//! left to migrate, an idle-policy task is pulled to whichever CPU idles for a moment
//! and preempted there again, and cost a pinned redis-server 11% of its rate where
//! the same burner pinned to the server's own (partly idle) CPU cost it 2%.

use crate::calibrate::affinity;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The CPUs the process had before a start pinned its thread: what the calibration
/// chooses its CPUs from while the start is pinned (allowed_cpus).
static UNPINNED: Mutex<Option<Vec<usize>>> = Mutex::new(None);

/// The CPUs this thread may run on, those before the start's pin while a start holds
/// one.
pub fn allowed_cpus() -> Vec<usize> {
    if let Some(v) = UNPINNED.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        return v;
    }
    affinity().map(|m| cpus_in(&m)).unwrap_or_default()
}

/// How long the start may wait for idle CPU time before it runs at STARTUP_NICER.
pub const IDLE_GRACE: Duration = Duration::from_millis(1500);
/// How much nicer than the watcher's own priority the start runs after IDLE_GRACE
/// (or where SCHED_IDLE is refused).
pub const STARTUP_NICER: i32 = 10;
/// How long the CPUs' idle time is sampled to choose the start's CPU.
const IDLE_SAMPLE: Duration = Duration::from_millis(100);

/// Held for the start; dropping it puts the thread back at its own priority and on
/// its own CPUs. Not Send: it restores the mask of the thread that made it.
pub struct StartPriority {
    tid: libc::pid_t,
    /// The thread's nice value before the start.
    was: Option<i32>,
    /// Set when the start is over; the watchdog then leaves the thread alone.
    done: Arc<(Mutex<bool>, Condvar)>,
    /// The thread's CPU mask before the start pinned it.
    mask: Option<libc::cpu_set_t>,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// A thread's scheduling policy, as the start and the calibration child set it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// SCHED_IDLE.
    Idle,
    /// SCHED_OTHER at the given nice value.
    Other(i32),
}

impl StartPriority {
    /// Lowers the calling thread for the start.
    pub fn lower() -> StartPriority {
        Self::lower_with(IDLE_GRACE)
    }

    /// As lower(), with the watchdog's grace given.
    pub fn lower_with(grace: Duration) -> StartPriority {
        // SAFETY: gettid has no arguments.
        let tid = unsafe { libc::gettid() };
        let was = nice_of(tid);
        let done = Arc::new((Mutex::new(false), Condvar::new()));
        let nicer = was.map(|n| (n + STARTUP_NICER).clamp(-20, 19));
        let mask = affinity();
        if let Some(m) = &mask {
            let cpus = cpus_in(m);
            if let Some(cpu) = idlest(&cpus, IDLE_SAMPLE) {
                *UNPINNED.lock().unwrap_or_else(|e| e.into_inner()) = Some(cpus);
                crate::calibrate::pin(cpu);
            }
        }
        let lowered = set_policy(tid, Policy::Idle) && {
            let d = done.clone();
            std::thread::Builder::new()
                .name("start-watchdog".into())
                .spawn(move || {
                    // A new thread takes its creator's policy and CPUs: an idle-policy
                    // watchdog pinned beside a starved start would wait as long as
                    // the start. It takes back the watcher's own first.
                    if let Some(m) = &mask {
                        // SAFETY: this thread's own mask.
                        unsafe {
                            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), m)
                        };
                    }
                    set_policy(0, Policy::Other(was.unwrap_or(0)));
                    let (lock, cv) = &*d;
                    let Ok(g) = lock.lock() else { return };
                    let Ok((g, _)) = cv.wait_timeout_while(g, grace, |done| !*done) else {
                        return;
                    };
                    if !*g {
                        if let Some(n) = nicer {
                            set_policy(tid, Policy::Other(n));
                        }
                    }
                })
                .is_ok()
        };
        // Without a watchdog, no SCHED_IDLE: it could starve.
        if !lowered {
            if let Some(n) = nicer {
                set_policy(tid, Policy::Other(n));
            }
        }
        StartPriority {
            tid,
            was,
            done,
            mask,
            _not_send: std::marker::PhantomData,
        }
    }

    /// The nice value the thread had before the start.
    pub fn base(&self) -> i32 {
        self.was.unwrap_or(0)
    }
}

impl Drop for StartPriority {
    fn drop(&mut self) {
        let (lock, cv) = &*self.done;
        // Under the lock, so that a watchdog past its grace cannot lower the thread
        // again after this puts it back.
        let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
        *g = true;
        if let Some(n) = self.was {
            set_policy(self.tid, Policy::Other(n));
        }
        if let Some(m) = &self.mask {
            // SAFETY: restoring this thread's own mask (Drop runs on the thread that
            // lowered itself: the guard is not Send).
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), m) };
        }
        *UNPINNED.lock().unwrap_or_else(|e| e.into_inner()) = None;
        cv.notify_all();
    }
}

fn cpus_in(set: &libc::cpu_set_t) -> Vec<usize> {
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: c is below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, set) })
        .collect()
}

/// The CPU of `cpus` with the most idle time over `sample` (/proc/stat); None with
/// fewer than two to choose from or where the file cannot be read.
fn idlest(cpus: &[usize], sample: Duration) -> Option<usize> {
    if cpus.len() < 2 {
        return None;
    }
    let read = || -> Option<Vec<u64>> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        cpus.iter()
            .map(|&c| crate::steal::parse(&stat, &[c]).map(|t| t.idle))
            .collect()
    };
    let a = read()?;
    std::thread::sleep(sample);
    let b = read()?;
    let (i, _) = a
        .iter()
        .zip(&b)
        .map(|(x, y)| y.saturating_sub(*x))
        .enumerate()
        .max_by_key(|&(_, d)| d)?;
    Some(cpus[i])
}

/// The calling thread's (or `tid`'s) policy now.
pub fn policy_of(tid: libc::pid_t) -> Option<Policy> {
    // SAFETY: sched_getscheduler on a thread id; -1 on error.
    let p = unsafe { libc::sched_getscheduler(tid) };
    match p {
        libc::SCHED_IDLE => Some(Policy::Idle),
        libc::SCHED_OTHER => nice_of(tid).map(Policy::Other),
        _ => None,
    }
}

fn nice_of(tid: libc::pid_t) -> Option<i32> {
    // SAFETY: getpriority on one thread; errno cleared first since -1 is a valid
    // priority.
    unsafe {
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        (*libc::__errno_location() == 0).then_some(n)
    }
}

/// Puts `tid` (a thread of this process) under `p`; false where the kernel refused.
pub fn set_policy(tid: libc::pid_t, p: Policy) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler and setpriority on a thread of our own, with a valid
    // sched_param.
    unsafe {
        match p {
            Policy::Idle => libc::sched_setscheduler(tid, libc::SCHED_IDLE, &param) == 0,
            Policy::Other(n) => {
                libc::sched_setscheduler(tid, libc::SCHED_OTHER, &param) == 0
                    && libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, n) == 0
            }
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

    #[test]
    fn the_start_runs_idle_and_is_put_back() {
        std::thread::spawn(|| {
            let before = policy_of(me()).expect("policy");
            let mask = cpus_in(&affinity().expect("mask"));
            let p = StartPriority::lower_with(Duration::from_secs(30));
            assert_eq!(policy_of(me()), Some(Policy::Idle));
            let during = cpus_in(&affinity().expect("mask"));
            if mask.len() > 1 {
                assert_eq!(during.len(), 1, "pinned to one CPU: {during:?}");
                assert!(mask.contains(&during[0]));
            }
            // What the calibration chooses from is still every CPU it had.
            assert_eq!(allowed_cpus(), mask);
            drop(p);
            assert_eq!(cpus_in(&affinity().expect("mask")), mask);
            // SAFETY: no arguments.
            if unsafe { libc::geteuid() } == 0 {
                assert_eq!(policy_of(me()), Some(before));
            }
        })
        .join()
        .expect("thread");
    }

    #[test]
    fn past_its_grace_the_start_runs_nicer_not_idle() {
        std::thread::spawn(|| {
            let Some(Policy::Other(n)) = policy_of(me()) else {
                panic!("a test thread runs SCHED_OTHER")
            };
            let p = StartPriority::lower_with(Duration::from_millis(50));
            let t = std::time::Instant::now();
            while policy_of(me()) == Some(Policy::Idle) {
                assert!(t.elapsed() < Duration::from_secs(10), "still idle");
                std::thread::sleep(Duration::from_millis(10));
            }
            let nicer = (n + STARTUP_NICER).clamp(-20, 19);
            assert_eq!(policy_of(me()), Some(Policy::Other(nicer)));
            drop(p);
            // Raising a thread back needs CAP_SYS_NICE; without it the thread stays
            // nicer, which is all an unprivileged watcher could do anyway.
            let back = policy_of(me());
            assert!(
                back == Some(Policy::Other(n)) || back == Some(Policy::Other(nicer)),
                "{back:?}"
            );
        })
        .join()
        .expect("thread");
    }
}
