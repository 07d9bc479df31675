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
//! The start is also pinned, for its length, to one CPU: left to migrate, an
//! idle-policy task is pulled to whichever CPU idles for a moment and preempted there
//! again. Which CPU is not simply the idlest: each idle gap the start runs in turns a
//! wake-up that the idle loop would have caught by polling into an interrupt and a
//! switch (a reschedule IPI, in a guest a VM exit), so idle cut into many short gaps
//! is dear to fill. Dearest in a load tool's gaps (its waits for replies: stretched,
//! they delay the requests it sends next, and the server's rate with them), cheap in
//! the target's own (docs/watch.md has the measurements). So the start goes where
//! filling the idle costs least (`fill_cost`): a quiet CPU first, then the target's
//! own, and on a CPU with too little idle to finish in its grace it runs nicer from
//! the start.

use crate::calibrate::{affinity, set_affinity};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The CPUs the process had before a start pinned its thread: what the calibration
/// chooses its CPUs from while the start is pinned (allowed_cpus).
static UNPINNED: Mutex<Option<Vec<usize>>> = Mutex::new(None);

/// Threads doing the start's work beside it (the loader's, btf_hidden.rs), which took
/// its policy and CPU when they were made; and the policy the watchdog moved the start
/// to, once it did. A watchdog that moved the start thread alone would leave such a
/// thread SCHED_IDLE on a host with no idle time, and the start waiting on it for good.
static HELPERS: Mutex<Helpers> = Mutex::new(Helpers {
    tids: Vec::new(),
    moved_to: None,
});

struct Helpers {
    tids: Vec<libc::pid_t>,
    moved_to: Option<Policy>,
}

/// Held by a thread that does part of the start's work: the watchdog moves it with the
/// start, and a helper made after the move takes the moved policy at once.
pub struct Helper {
    tid: libc::pid_t,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Registers the calling thread as a start helper until the guard drops.
pub fn helper() -> Helper {
    // SAFETY: gettid has no arguments.
    let tid = unsafe { libc::gettid() };
    let mut h = HELPERS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = h.moved_to {
        set_policy(tid, p);
    }
    h.tids.push(tid);
    Helper {
        tid,
        _not_send: std::marker::PhantomData,
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let mut h = HELPERS.lock().unwrap_or_else(|e| e.into_inner());
        h.tids.retain(|&t| t != self.tid);
    }
}

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
/// Less CPU than this over its grace and the start is taken as starved where it is
/// pinned (the whole start takes some tens of ms).
const STARVED_NS: u64 = 5_000_000;
/// How long the CPUs' idle time is sampled to choose the start's CPU.
const IDLE_SAMPLE: Duration = Duration::from_millis(100);
/// What one filled idle gap costs the target, in seconds, where the gap is another
/// process's (its load tool's) and where it is the target's own: fitted to stock
/// nginx under wrk and redis-server under redis-benchmark (docs/watch.md); only the
/// order of CPUs and the comparison with NICER_SHARE rest on them.
const GAP_COST_S: f64 = 20e-6;
const OWN_GAP_COST_S: f64 = 1e-6;
/// The least idle share a CPU needs for the start (some tens of ms of CPU) to finish
/// within IDLE_GRACE on it at SCHED_IDLE.
const MIN_IDLE_SHARE: f64 = 0.05;
/// What the start takes from a fully busy CPU's task once it runs STARTUP_NICER
/// (nice +10 beside nice 0: a weight of 110 against 1024).
const NICER_SHARE: f64 = 0.1;

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
    /// Lowers the calling thread for the start; `target`: the CPUs the target runs
    /// on (none known: every CPU is someone else's).
    pub fn lower(target: &[usize]) -> StartPriority {
        Self::lower_with(IDLE_GRACE, target)
    }

    /// As lower(), with the watchdog's grace given.
    pub fn lower_with(grace: Duration, target: &[usize]) -> StartPriority {
        let cpus = affinity().map(|m| cpus_in(&m)).unwrap_or_default();
        Self::lower_at(grace, cheapest_to_fill(&cpus, target, IDLE_SAMPLE))
    }

    /// As lower_with(), on a chosen CPU (none: left unpinned, SCHED_IDLE).
    fn lower_at(grace: Duration, place: Option<Placement>) -> StartPriority {
        // SAFETY: gettid has no arguments.
        let tid = unsafe { libc::gettid() };
        let was = nice_of(tid);
        let done = Arc::new((Mutex::new(false), Condvar::new()));
        let nicer = was.map(|n| (n + STARTUP_NICER).clamp(-20, 19));
        let mask = affinity();
        let mut idle_enough = true;
        if let (Some(m), Some(c)) = (&mask, place) {
            *UNPINNED.lock().unwrap_or_else(|e| e.into_inner()) = Some(cpus_in(m));
            crate::calibrate::pin(c.cpu);
            idle_enough = c.idle_enough;
        }
        // Where even the cheapest CPU has too little idle for the start, SCHED_IDLE
        // would only starve it for the grace: nicer at once.
        let idle = idle_enough && set_policy(tid, Policy::Idle);
        let pinned = mask.is_some() && place.is_some();
        let watched = (idle || pinned) && {
            let d = done.clone();
            std::thread::Builder::new()
                .name("start-watchdog".into())
                .spawn(move || {
                    // A new thread takes its creator's policy and CPUs: an idle-policy
                    // watchdog pinned beside a starved start would wait as long as
                    // the start. It takes back the watcher's own first.
                    if let Some(m) = &mask {
                        set_affinity(0, m);
                    }
                    set_policy(0, Policy::Other(was.unwrap_or(0)));
                    let ran = run_ns(tid);
                    let (lock, cv) = &*d;
                    let Ok(g) = lock.lock() else { return };
                    let Ok((g, _)) = cv.wait_timeout_while(g, grace, |done| !*done) else {
                        return;
                    };
                    if *g {
                        return;
                    }
                    // The start thread and its helpers, moved together; a helper
                    // registered from here on takes the move itself (helper()).
                    let threads = {
                        let mut h = HELPERS.lock().unwrap_or_else(|e| e.into_inner());
                        h.moved_to = nicer.map(Policy::Other);
                        std::iter::once(tid)
                            .chain(h.tids.iter().copied())
                            .collect::<Vec<_>>()
                    };
                    if let Some(n) = nicer {
                        for &t in &threads {
                            set_policy(t, Policy::Other(n));
                        }
                    }
                    // Starved through its grace, unpinned too: its CPU may be one
                    // that a real-time poller holds, where no nice value gets time
                    // (the cpuidle counters cannot tell a poller's CPU from a busy
                    // server's). A start that ran, and only waited or paused, stays.
                    // The helpers' CPU counts whole (they were made during the start).
                    let helpers_ns: u64 = threads[1..].iter().filter_map(|&t| run_ns(t)).sum();
                    let starved = match (ran, run_ns(tid)) {
                        (Some(a), Some(b)) => b.saturating_sub(a) + helpers_ns < STARVED_NS,
                        _ => true,
                    };
                    if let (true, true, Some(m)) = (pinned, starved, &mask) {
                        for &t in &threads {
                            set_affinity(t, m);
                        }
                    }
                })
                .is_ok()
        };
        // Without a watchdog, no SCHED_IDLE: it could starve.
        if !(idle && watched) {
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
            // This thread's own (Drop runs on the thread that lowered itself: the
            // guard is not Send).
            set_affinity(0, m);
        }
        *UNPINNED.lock().unwrap_or_else(|e| e.into_inner()) = None;
        HELPERS.lock().unwrap_or_else(|e| e.into_inner()).moved_to = None;
        cv.notify_all();
    }
}

/// Held while the calibration's loops run: the calling thread (which asks the child
/// for each loop) runs at the loops' priority, then goes back to what it was, unless
/// the start's watchdog moved it meanwhile. At the start's own priority every ask
/// waited for the CPU, and stretched the loops, and the tracing that the host pays
/// for while they run, over several times their length.
pub struct Raised {
    tid: libc::pid_t,
    was: Option<Policy>,
    to: Policy,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Raised {
    pub fn to(nice: i32) -> Raised {
        // SAFETY: gettid has no arguments.
        let tid = unsafe { libc::gettid() };
        let was = policy_of(tid);
        let to = Policy::Other(nice);
        if was.is_some() && was != Some(to) {
            set_policy(tid, to);
        }
        Raised {
            tid,
            was,
            to,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for Raised {
    fn drop(&mut self) {
        if let Some(was) = self.was {
            if policy_of(self.tid) == Some(self.to) {
                set_policy(self.tid, was);
            }
        }
    }
}

/// The CPU time a thread of this process has run, ns (its schedstat's first field).
fn run_ns(tid: libc::pid_t) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn cpus_in(set: &libc::cpu_set_t) -> Vec<usize> {
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: c is below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, set) })
        .collect()
}

/// Idle entries and idle time of one CPU so far (cpuidle's counters, summed over its
/// idle states).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct IdleCount {
    entries: u64,
    idle_us: u64,
}

fn idle_count(cpu: usize) -> Option<IdleCount> {
    let dir = format!("/sys/devices/system/cpu/cpu{cpu}/cpuidle");
    let mut c = IdleCount::default();
    let mut any = false;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        if !e.file_name().to_string_lossy().starts_with("state") {
            continue;
        }
        let read = |f: &str| -> Option<u64> {
            std::fs::read_to_string(e.path().join(f))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        c.entries += read("usage")?;
        c.idle_us += read("time")?;
        any = true;
    }
    any.then_some(c)
}

/// What running the start on a CPU would cost the target, as a share of its time,
/// from that CPU's idle entries and idle time over `secs`: each entry is a gap the
/// start would fill (OWN_GAP_COST_S each where the CPU is the target's, GAP_COST_S
/// elsewhere); where there is too little idle for the start to finish in its grace,
/// it runs nicer there and takes NICER_SHARE.
fn fill_cost(d: IdleCount, secs: f64, own: bool) -> f64 {
    let per_gap = if own { OWN_GAP_COST_S } else { GAP_COST_S };
    let gaps = d.entries as f64 / secs * per_gap;
    if idle_share(d, secs) < MIN_IDLE_SHARE {
        gaps.max(NICER_SHARE)
    } else {
        gaps
    }
}

/// The start's CPU, and whether it has the idle time to run the start at SCHED_IDLE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Placement {
    cpu: usize,
    idle_enough: bool,
}

/// The CPU of `cpus` where the start costs least (fill_cost over `sample`); the
/// idlest by /proc/stat where cpuidle has no counters. None with fewer than two to
/// choose from or nothing to read.
fn cheapest_to_fill(cpus: &[usize], target: &[usize], sample: Duration) -> Option<Placement> {
    if cpus.len() < 2 {
        return None;
    }
    let read = || {
        cpus.iter()
            .map(|&c| idle_count(c))
            .collect::<Option<Vec<_>>>()
    };
    let Some(a) = read() else {
        return idlest(cpus, sample).map(|cpu| Placement {
            cpu,
            idle_enough: true,
        });
    };
    let t = std::time::Instant::now();
    std::thread::sleep(sample);
    let b = read()?;
    let secs = t.elapsed().as_secs_f64();
    let deltas: Vec<IdleCount> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| IdleCount {
            entries: y.entries.saturating_sub(x.entries),
            idle_us: y.idle_us.saturating_sub(x.idle_us),
        })
        .collect();
    let own: Vec<bool> = cpus.iter().map(|c| target.contains(c)).collect();
    let i = cheapest(&deltas, &own, secs)?;
    Some(Placement {
        cpu: cpus[i],
        idle_enough: idle_share(deltas[i], secs) >= MIN_IDLE_SHARE,
    })
}

fn idle_share(d: IdleCount, secs: f64) -> f64 {
    d.idle_us as f64 / 1e6 / secs
}

/// The index of the least fill_cost (`own`: whether each CPU is the target's), the
/// idler of equals first, then the last, as the idlest by /proc/stat chose before.
fn cheapest(deltas: &[IdleCount], own: &[bool], secs: f64) -> Option<usize> {
    (0..deltas.len()).min_by(|&i, &j| {
        fill_cost(deltas[i], secs, own[i])
            .total_cmp(&fill_cost(deltas[j], secs, own[j]))
            .then(deltas[j].idle_us.cmp(&deltas[i].idle_us))
            .then(j.cmp(&i))
    })
}

/// The CPU of `cpus` with the most idle time over `sample` (/proc/stat); None with
/// fewer than two to choose from or where the file cannot be read.
fn idlest(cpus: &[usize], sample: Duration) -> Option<usize> {
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

    /// A start's registries (UNPINNED, HELPERS) are the process's, and a start's end
    /// resets them: one test's start at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn me() -> libc::pid_t {
        // SAFETY: no arguments.
        unsafe { libc::gettid() }
    }

    #[test]
    fn the_start_runs_idle_and_is_put_back() {
        let _serial = serial();
        std::thread::spawn(|| {
            let before = policy_of(me()).expect("policy");
            let mask = cpus_in(&affinity().expect("mask"));
            let place = (mask.len() > 1).then(|| Placement {
                cpu: mask[mask.len() - 1],
                idle_enough: true,
            });
            let p = StartPriority::lower_at(Duration::from_secs(30), place);
            assert_eq!(policy_of(me()), Some(Policy::Idle));
            let during = cpus_in(&affinity().expect("mask"));
            if let Some(place) = place {
                assert_eq!(during, [place.cpu], "pinned to the chosen CPU");
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
        let _serial = serial();
        std::thread::spawn(|| {
            let Some(Policy::Other(n)) = policy_of(me()) else {
                panic!("a test thread runs SCHED_OTHER")
            };
            let p = StartPriority::lower_with(Duration::from_millis(50), &[]);
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

    /// A thread doing the start's work took its SCHED_IDLE when it was made; past the
    /// grace it is moved with the start, and one made after the move takes it too.
    #[test]
    fn the_starts_helpers_move_with_it() {
        let _serial = serial();
        std::thread::spawn(|| {
            let Some(Policy::Other(n)) = policy_of(me()) else {
                panic!("a test thread runs SCHED_OTHER")
            };
            let nicer = Policy::Other((n + STARTUP_NICER).clamp(-20, 19));
            let p = StartPriority::lower_with(Duration::from_millis(300), &[]);
            let (tx, rx) = std::sync::mpsc::channel();
            let early = std::thread::spawn(move || {
                let _h = helper();
                let made = policy_of(me());
                tx.send(()).expect("send");
                let t = std::time::Instant::now();
                while policy_of(me()) == Some(Policy::Idle) && t.elapsed() < Duration::from_secs(10)
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                (made, policy_of(me()))
            });
            rx.recv().expect("helper registered");
            let (made, moved) = early.join().expect("helper");
            assert_eq!(
                made,
                Some(Policy::Idle),
                "a helper takes the start's policy"
            );
            assert_eq!(moved, Some(nicer), "the watchdog left the helper idle");
            // Made now (from a thread still idle, as a loader started late would be).
            let late = std::thread::spawn(|| {
                set_policy(0, Policy::Idle);
                let _h = helper();
                policy_of(me())
            });
            assert_eq!(late.join().expect("late helper"), Some(nicer));
            drop(p);
            // After the start, a helper is left as it is.
            let after = std::thread::spawn(|| {
                let was = policy_of(me());
                let _h = helper();
                (was, policy_of(me()))
            });
            let (was, now) = after.join().expect("after");
            assert_eq!(was, now);
        })
        .join()
        .expect("thread");
    }

    #[test]
    fn a_cpu_without_idle_starts_nicer_at_once() {
        let _serial = serial();
        std::thread::spawn(|| {
            let Some(Policy::Other(n)) = policy_of(me()) else {
                panic!("a test thread runs SCHED_OTHER")
            };
            let mask = cpus_in(&affinity().expect("mask"));
            let place = Placement {
                cpu: mask[0],
                idle_enough: false,
            };
            let p = StartPriority::lower_at(Duration::from_secs(30), Some(place));
            // Not SCHED_IDLE for a grace first: nicer from the start.
            let nicer = (n + STARTUP_NICER).clamp(-20, 19);
            assert_eq!(policy_of(me()), Some(Policy::Other(nicer)));
            assert_eq!(cpus_in(&affinity().expect("mask")), [mask[0]]);
            drop(p);
            assert_eq!(cpus_in(&affinity().expect("mask")), mask);
        })
        .join()
        .expect("thread");
    }

    /// 0.1 s of two CPUs' idle counters (entries, idle us), the second the target's
    /// where `own`.
    fn choose(a: (u64, u64), b: (u64, u64), own: bool) -> (usize, bool) {
        let d = [a, b].map(|(entries, idle_us)| IdleCount { entries, idle_us });
        let i = cheapest(&d, &[false, own], 0.1).expect("two CPUs");
        (i, idle_share(d[i], 0.1) >= MIN_IDLE_SHARE)
    }

    #[test]
    fn the_start_goes_where_filling_the_idle_costs_least() {
        // nginx under wrk: wrk's CPU 15% idle in 1,300 short gaps, nginx's with
        // almost no idle: nginx's, run nicer (no idle to use there).
        assert_eq!(choose((1300, 15_000), (1, 1000), true), (1, false));
        // redis-server under redis-benchmark: the load tool's CPU full, the server's
        // 29% idle in 1,800 gaps: the server's own, at SCHED_IDLE.
        assert_eq!(choose((2, 400), (1800, 29_000), true), (1, true));
        // The same gaps, not the target's: dearer than running nicer on a full CPU.
        assert_eq!(choose((2, 400), (1800, 29_000), false), (0, false));
        // A quiet CPU beats the target's own gaps.
        assert_eq!(choose((5, 90_000), (1800, 29_000), true), (0, true));
        // Equal costs: the idler.
        assert_eq!(choose((10, 40_000), (10, 80_000), false), (1, true));
        assert!(!choose((0, 0), (0, 0), false).1);
        // Full CPUs alike: the last.
        let full = [IdleCount::default(); 3];
        assert_eq!(cheapest(&full, &[false; 3], 0.1), Some(2));
    }

    #[test]
    fn the_loops_asker_is_raised_and_put_back() {
        // SAFETY: no arguments.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: raising a thread and putting it back needs root");
            return;
        }
        std::thread::spawn(|| {
            assert!(set_policy(me(), Policy::Idle));
            {
                let _r = Raised::to(-5);
                assert_eq!(policy_of(me()), Some(Policy::Other(-5)));
            }
            assert_eq!(policy_of(me()), Some(Policy::Idle));
            // Moved meanwhile (the start's watchdog past its grace): left as moved.
            {
                let _r = Raised::to(-5);
                assert!(set_policy(me(), Policy::Other(10)));
            }
            assert_eq!(policy_of(me()), Some(Policy::Other(10)));
        })
        .join()
        .expect("thread");
    }
}
