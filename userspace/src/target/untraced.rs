//! What the target does while the probes are off. Tracing costs the target CPU, and
//! on a busy server that slows it: a rate read in a traced burst is the traced
//! server's, not the one the fibers will be compared with. Between bursts the kernel
//! still keeps two counters of its own for every process at no cost to it: its read
//! and write calls (/proc/PID/io syscr + syscw) and its CPU time (/proc/PID/stat).
//! Read at every edge of a burst, the traced part gives the calls per request, and
//! the untraced part then gives the requests/s and CPU per request without the watch.

use serde::Serialize;
use std::time::Instant;

/// After a detach, the kernel takes up to ~0.2 s to release the links (loader.rs):
/// that stretch is neither traced nor clean, and counts for neither.
pub const SETTLE_SECS: f64 = 0.25;
/// Fewer requests than this in the traced part make the calls per request too rough.
const MIN_REQUESTS: u64 = 50;
/// A server whose requests make fewer read/write calls than this each (one using
/// recv/send, which syscr/syscw do not count) gives no untraced rate.
const MIN_CALLS_PER_REQUEST: f64 = 0.5;
/// Untraced time shorter than this is too short to read a rate from.
const MIN_UNTRACED_SECS: f64 = 0.1;

/// One reading of the target's kernel counters, per process of a service.
#[derive(Clone, Debug)]
pub struct Reading {
    at: Instant,
    /// The same moment as Unix seconds, for the span another count is set beside.
    unix: f64,
    /// (pid, read + write calls (syscr + syscw), utime + stime seconds).
    procs: Vec<(u32, u64, f64)>,
    /// The fiber runtime's offload count, where the target runs it: an exact count
    /// of requests that costs the target nothing.
    offloads: Option<u64>,
    /// A process has threads that cannot run where its main thread can, whose CPU
    /// `procs` leaves out (and the probes' on-CPU time does not).
    off_core: bool,
}

impl Reading {
    /// The processes' counters now; None when none of them can be read (all gone).
    pub fn take(pids: &[u32], offloads: Option<u64>) -> Option<Reading> {
        let mut off_core = false;
        let procs: Vec<(u32, u64, f64)> = pids
            .iter()
            .filter_map(|&pid| {
                let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
                let apart = off_core_cpu_secs(pid);
                off_core |= apart > 0.0;
                Some((pid, io_calls(&io)?, cpu_secs(pid)? - apart))
            })
            .collect();
        (!procs.is_empty()).then(|| Reading {
            at: Instant::now(),
            unix: crate::metrics::unix_now(),
            procs,
            offloads,
            off_core,
        })
    }

    /// The counters' growth from `from`, over the processes read both times (one
    /// that appeared or ended between them has no delta to give).
    fn since(&self, from: &Reading) -> (u64, f64) {
        let mut io = 0;
        let mut cpu = 0.0;
        for &(pid, i, c) in &self.procs {
            if let Some(&(_, i0, c0)) = from.procs.iter().find(|p| p.0 == pid) {
                io += i.saturating_sub(i0);
                cpu += (c - c0).max(0.0);
            }
        }
        (io, cpu)
    }
}

/// A process's CPU time so far, all its threads (utime + stime), seconds.
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(cpu_ticks(&stat)? as f64 / clock_ticks_per_sec())
}

/// The CPU time so far of the process's threads that cannot run where its main thread
/// can (an emulated device's or a driver's thread pinned to another core): what they
/// spend is not taken from the CPUs the server's requests run on, so it is not the
/// server's CPU per request. Threads that ended take their time out of this sum; the
/// caller's deltas are per reading, so a thread that ended between two readings only
/// makes one delta smaller.
pub fn off_core_cpu_secs(pid: u32) -> f64 {
    match affinity(pid) {
        Some(main) => cpu_secs_apart_from(pid, &main),
        None => 0.0,
    }
}

/// The CPU time of `pid`'s threads (but its main thread) that cannot run on any CPU of
/// `main`.
fn cpu_secs_apart_from(pid: u32, main: &libc::cpu_set_t) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    let mut ticks = 0u64;
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if tid == pid {
            continue;
        }
        let disjoint = affinity(tid).is_some_and(|a| !intersect(&a, main));
        if disjoint {
            ticks += std::fs::read_to_string(t.path().join("stat"))
                .ok()
                .and_then(|s| cpu_ticks(&s))
                .unwrap_or(0);
        }
    }
    ticks as f64 / clock_ticks_per_sec()
}

/// Whether two CPU sets share a CPU (word by word: a set is 1024 bits).
fn intersect(a: &libc::cpu_set_t, b: &libc::cpu_set_t) -> bool {
    const WORDS: usize = std::mem::size_of::<libc::cpu_set_t>() / 8;
    // SAFETY: cpu_set_t is a plain bit array of WORDS u64s, any bit pattern valid.
    let (a, b) = unsafe {
        (
            &*(a as *const libc::cpu_set_t as *const [u64; WORDS]),
            &*(b as *const libc::cpu_set_t as *const [u64; WORDS]),
        )
    };
    a.iter().zip(b).any(|(x, y)| x & y != 0)
}

fn affinity(tid: u32) -> Option<libc::cpu_set_t> {
    // SAFETY: an all-zero cpu_set_t is valid; the kernel writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer and size.
    let rc = unsafe {
        libc::sched_getaffinity(tid as libc::pid_t, std::mem::size_of_val(&set), &mut set)
    };
    (rc == 0).then_some(set)
}

/// syscr + syscw of a /proc/PID/io text.
pub fn io_calls(io: &str) -> Option<u64> {
    let field = |k: &str| {
        io.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Some(field("syscr:")? + field("syscw:")?)
}

/// utime + stime (clock ticks) of a /proc/PID/stat text; the command name may hold
/// spaces and parentheses, so fields are counted from its closing one.
pub fn cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3, utime 14 and stime 15.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn clock_ticks_per_sec() -> f64 {
    // SAFETY: no arguments.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Counter deltas of one kind of stretch (traced or untraced).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Part {
    pub secs: f64,
    pub io_calls: u64,
    pub cpu_s: f64,
    /// Stretches booked (bursts, for the traced part).
    pub stretches: u32,
    /// The runtime's offloads over the stretches, None unless every edge had them.
    pub offloads: Option<u64>,
    /// The stretches' Unix seconds [start, end], those that meet merged.
    pub spans: Vec<[f64; 2]>,
}

impl Part {
    fn add(&mut self, from: &Reading, to: &Reading) {
        let offloads = match (from.offloads, to.offloads) {
            (Some(a), Some(b)) if self.stretches == 0 || self.offloads.is_some() => {
                Some(self.offloads.unwrap_or(0) + b.saturating_sub(a))
            }
            _ => None,
        };
        let (io, cpu) = to.since(from);
        self.stretches += 1;
        self.secs += to.at.saturating_duration_since(from.at).as_secs_f64();
        self.io_calls += io;
        self.cpu_s += cpu;
        self.offloads = offloads;
        // One edge's reading ends a stretch and starts the next: equal times meet.
        match self.spans.last_mut() {
            Some(last) if last[1] == from.unix => last[1] = to.unix,
            _ => self.spans.push([from.unix, to.unix]),
        }
    }
}

/// Where an untraced rate comes from.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum UntracedSource {
    /// The fiber runtime's own offload count (exact).
    RuntimeCounters,
    /// The read and write calls, at the traced part's calls per request.
    IoCalls,
}

/// The target without the watch, over one window.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Untraced {
    /// Seconds of the window the probes were off (and settled).
    pub secs: f64,
    pub requests_per_sec: f64,
    /// The target's CPU time (all its threads) per request, us.
    pub cpu_per_request_us: f64,
    /// Read and write calls per request, as the traced part counted them.
    pub io_calls_per_request: f64,
    pub source: UntracedSource,
    /// Its stretches' Unix seconds [start, end] (around the burst and its settling):
    /// the seconds another count of the target's requests is to be read over.
    pub spans: Vec<[f64; 2]>,
}

/// From a window's traced part (with the requests the probes counted in it, and their
/// mean stall) and its untraced part; None when either is too thin to read a rate from.
///
/// A request is counted when its offload returns, and only if the probes saw it enter:
/// the offloads in flight when a burst starts are not counted, though their replies'
/// writes are, and those in flight when it ends not either, though their requests'
/// reads are. Each burst so misses the requests in flight (Little: rate x mean
/// stall) whose calls it counts; left in, a 40 ms burst of 8 ms stalls read 20% low.
pub fn estimate(
    traced: &Part,
    requests: u64,
    stall_mean_us: Option<f64>,
    untraced: &Part,
) -> Option<Untraced> {
    if untraced.secs < MIN_UNTRACED_SECS {
        return None;
    }
    let spans = untraced.spans.clone();
    // Under the fiber runtime its counters count the requests themselves.
    if let Some(n) = untraced.offloads.filter(|&n| n > 0) {
        let rate = n as f64 / untraced.secs;
        return Some(Untraced {
            secs: untraced.secs,
            requests_per_sec: rate,
            cpu_per_request_us: untraced.cpu_s / n as f64 * 1e6,
            io_calls_per_request: untraced.io_calls as f64 / n as f64,
            source: UntracedSource::RuntimeCounters,
            spans,
        });
    }
    if requests < MIN_REQUESTS || traced.secs <= 0.0 {
        return None;
    }
    let in_flight = requests as f64 / traced.secs * stall_mean_us.unwrap_or(0.0).max(0.0) / 1e6;
    let seen = requests as f64 + f64::from(traced.stretches.max(1)) * in_flight;
    let k = traced.io_calls as f64 / seen;
    if k < MIN_CALLS_PER_REQUEST || untraced.io_calls == 0 {
        return None;
    }
    let rate = untraced.io_calls as f64 / k / untraced.secs;
    Some(Untraced {
        secs: untraced.secs,
        requests_per_sec: rate,
        cpu_per_request_us: untraced.cpu_s / untraced.secs / rate * 1e6,
        io_calls_per_request: k,
        source: UntracedSource::IoCalls,
        spans,
    })
}

/// The edges of the bursts: each stretch between two readings goes to the traced or
/// the untraced part, or to neither (attaching, settling after a detach).
#[derive(Debug, Default)]
pub struct Ledger {
    last: Option<Reading>,
    pub traced: Part,
    pub untraced: Part,
    /// A reading since the last close found threads apart from the main thread's CPUs.
    off_core: bool,
}

/// What the stretch that ends at an edge was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stretch {
    Traced,
    Untraced,
    /// Counts for neither.
    Neither,
}

impl Ledger {
    /// Reads the counters and books the stretch since the last edge as `was`. A failed
    /// read (the target gone) books nothing and leaves the next stretch unanchored.
    pub fn edge(&mut self, pids: &[u32], was: Stretch, offloads: Option<u64>) {
        let now = Reading::take(pids, offloads);
        self.off_core |= now.as_ref().is_some_and(|r| r.off_core);
        if let (Some(from), Some(to)) = (&self.last, &now) {
            match was {
                Stretch::Traced => self.traced.add(from, to),
                Stretch::Untraced => self.untraced.add(from, to),
                Stretch::Neither => {}
            }
        }
        self.last = now;
    }

    /// The window's estimate, with the parts reset for the next window.
    pub fn close(&mut self, requests: u64, stall_mean_us: Option<f64>) -> Option<Untraced> {
        let est = estimate(&self.traced, requests, stall_mean_us, &self.untraced);
        self.traced = Part::default();
        self.untraced = Part::default();
        self.off_core = false;
        est
    }

    /// Whether a reading since the last close left out threads' CPU (off_core_cpu_secs):
    /// the untraced CPU per request then covers fewer threads than the probes' does.
    pub fn off_core_seen(&self) -> bool {
        self.off_core
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_pinned_off_the_main_threads_cpus_is_not_the_servers_cpu() {
        let ours = affinity(std::process::id()).expect("own affinity");
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            // SAFETY: initialised set, index in range.
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &ours) })
            .collect();
        if cpus.len() < 2 {
            println!("skipped: needs two CPUs to pin a thread apart");
            return;
        }
        let pid = std::process::id();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (st, other) = (stop.clone(), cpus[1]);
        let spinner = std::thread::spawn(move || {
            // SAFETY: pinning the calling thread only.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(other, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set);
            }
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(300));
        // SAFETY: an all-zero set is valid.
        let mut first: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: index below CPU_SETSIZE.
        unsafe { libc::CPU_SET(cpus[0], &mut first) };
        let off = cpu_secs_apart_from(pid, &first);
        let same = off_core_cpu_secs(pid);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        spinner.join().unwrap();
        assert_eq!(same, 0.0, "every thread can run where the main thread can");
        assert!(off >= 0.15, "the spinner's CPU: {off}");
        assert!(off <= cpu_secs(pid).unwrap(), "{off}");
    }

    #[test]
    fn proc_fields() {
        let io = "rchar: 10\nwchar: 20\nsyscr: 7\nsyscw: 5\nread_bytes: 0\n";
        assert_eq!(io_calls(io), Some(12));
        assert_eq!(io_calls("rchar: 1\n"), None);
        // A name with spaces and a parenthesis does not shift the fields.
        let stat = "42 (a) b (c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0";
        assert_eq!(cpu_ticks(stat), Some(300));
        assert_eq!(cpu_ticks("42 (x) S 1"), None);
        assert!(Reading::take(&[std::process::id()], None).is_some());
        assert!(Reading::take(&[u32::MAX], None).is_none());
    }

    #[test]
    fn the_untraced_rate_from_the_calls_per_request() {
        // Traced: 1000 requests made 2000 calls. Untraced: 90,000 calls in 1.5 s at
        // 0.9 CPU-s: 30,000 req/s at 20 us each.
        let traced = Part {
            secs: 0.05,
            io_calls: 2000,
            cpu_s: 0.05,
            stretches: 1,
            offloads: None,
            spans: vec![[100.0, 100.05]],
        };
        let untraced = Part {
            secs: 1.5,
            io_calls: 90_000,
            cpu_s: 0.9,
            stretches: 1,
            offloads: None,
            spans: vec![[99.7, 100.0], [100.3, 101.5]],
        };
        let u = estimate(&traced, 1000, None, &untraced).unwrap();
        assert!((u.requests_per_sec - 30_000.0).abs() < 1e-6);
        assert!((u.cpu_per_request_us - 20.0).abs() < 1e-9);
        assert_eq!(u.io_calls_per_request, 2.0);
        // Read over the untraced stretch's seconds, not the burst's.
        assert_eq!(u.spans, [[99.7, 100.0], [100.3, 101.5]]);
        // Stalls of 12.5 ms: 20,000/s x 12.5 ms = 250 requests in flight at the burst's
        // edges, whose 500 calls the burst counted: 2000 calls for 1250 requests.
        let v = estimate(&traced, 1000, Some(12_500.0), &untraced).unwrap();
        assert!((v.io_calls_per_request - 1.6).abs() < 1e-9, "{v:?}");
        assert!((v.requests_per_sec - 37_500.0).abs() < 1e-6, "{v:?}");
        // Too few requests, too short, or a server whose requests the counters miss.
        assert_eq!(estimate(&traced, 10, None, &untraced), None);
        let short = Part {
            secs: 0.05,
            ..untraced.clone()
        };
        assert_eq!(estimate(&traced, 1000, None, &short), None);
        let recv_send = Part {
            io_calls: 100,
            ..traced.clone()
        };
        assert_eq!(estimate(&recv_send, 1000, None, &untraced), None);
    }

    /// Under the fiber runtime the untraced rate is its own count over the untraced
    /// seconds, whatever the calls per request (recv/send included).
    #[test]
    fn the_runtime_counts_the_untraced_requests_exactly() {
        let traced = Part {
            secs: 0.05,
            io_calls: 0,
            cpu_s: 0.05,
            stretches: 1,
            offloads: Some(2_000),
            spans: vec![[100.0, 100.05]],
        };
        let untraced = Part {
            secs: 0.9,
            io_calls: 0,
            cpu_s: 0.45,
            stretches: 1,
            offloads: Some(45_000),
            spans: vec![[100.3, 101.2]],
        };
        let u = estimate(&traced, 0, None, &untraced).unwrap();
        assert_eq!(u.source, UntracedSource::RuntimeCounters);
        assert!((u.requests_per_sec - 50_000.0).abs() < 1e-6, "{u:?}");
        assert!((u.cpu_per_request_us - 10.0).abs() < 1e-9, "{u:?}");
        // Booked edge by edge, a stretch with an edge unread loses the count.
        let pid = std::process::id();
        let mut l = Ledger::default();
        l.edge(&[pid], Stretch::Neither, Some(10));
        l.edge(&[pid], Stretch::Untraced, Some(110));
        l.edge(&[pid], Stretch::Untraced, Some(160));
        assert_eq!(l.untraced.offloads, Some(150));
        l.edge(&[pid], Stretch::Untraced, None);
        l.edge(&[pid], Stretch::Untraced, Some(200));
        assert_eq!(l.untraced.offloads, None);
    }

    #[test]
    fn edges_book_their_stretch() {
        let pid = std::process::id();
        let mut l = Ledger::default();
        l.edge(&[pid], Stretch::Neither, None);
        std::thread::sleep(std::time::Duration::from_millis(20));
        l.edge(&[pid], Stretch::Traced, None);
        std::thread::sleep(std::time::Duration::from_millis(30));
        l.edge(&[pid], Stretch::Neither, None);
        std::thread::sleep(std::time::Duration::from_millis(40));
        l.edge(&[pid], Stretch::Untraced, None);
        assert!(l.traced.secs >= 0.02 && l.traced.secs < 0.03 + 0.02);
        assert!(l.untraced.secs >= 0.04 && l.untraced.secs < 0.04 + 0.03);
        assert_eq!((l.traced.stretches, l.untraced.stretches), (1, 1));
        // Each part's seconds are its own stretches': the settling between them is
        // in neither.
        let (&[[ta, tb]], &[[ua, ub]]) = (&l.traced.spans[..], &l.untraced.spans[..]) else {
            panic!("{l:?}");
        };
        assert!(ta < tb && tb < ua && ua < ub, "{ta} {tb} {ua} {ub}");
        assert!((ub - ua - l.untraced.secs).abs() < 1e-3, "{ua} {ub}");
        // A stretch that meets the last one extends it; one after a gap is its own.
        l.edge(&[pid], Stretch::Untraced, None);
        assert_eq!(l.untraced.spans.len(), 1, "{l:?}");
        l.edge(&[pid], Stretch::Traced, None);
        std::thread::sleep(std::time::Duration::from_millis(10));
        l.edge(&[pid], Stretch::Untraced, None);
        assert_eq!(l.untraced.spans.len(), 2, "{l:?}");
        assert_eq!(l.untraced.spans[0][0], ua);
        // Closing resets both for the next window.
        l.close(0, None);
        assert_eq!(l.traced, Part::default());
        assert_eq!(l.untraced, Part::default());
    }
}
