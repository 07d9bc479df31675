//! What the watch costs the watched process, measured rather than guessed. At start a
//! child (this binary again) runs three loops: a cheap syscall, a pipe ping-pong
//! between two threads on one CPU (each hand-off a sleep, a wake-up and a switch), and
//! calls to a function of its own; a second copy of the eBPF object, filtered on the
//! child, is attached and detached around them. The difference per event is what one
//! syscall, one switch and one probed offload cost when watched: the programs' own
//! run time plus what attaching adds around them (the syscall slow path, the uprobe
//! traps), on this machine and kernel, and never less than the programs' own run time
//! as the kernel counts it (program_stats.rs). A window's counts times these costs is the
//! watcher's share of the target's CPU; the session keeps it within a budget by
//! tracing only part of each interval (see session.rs).

use crate::{loader, program_stats};
use serde::Serialize;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// The env var that turns this binary into the calibration child.
pub const CHILD_ENV: &str = "TOFFLOAD_WATCH_PROBE_CHILD";
/// The CPU the parent gives the child for its loops.
const CPU_ENV: &str = "TOFFLOAD_WATCH_PROBE_CPU";
/// The nice value the parent gives the child's loops.
const NICE_ENV: &str = "TOFFLOAD_WATCH_PROBE_NICE";
/// The CPU whose wake-up from idle the child times (none: one CPU).
const PEER_ENV: &str = "TOFFLOAD_WATCH_PROBE_PEER";
/// Tests only: the CPU of the first attempt (e.g. one a real-time poller holds), to
/// show that an attempt starved there moves on instead of hanging the start.
pub const FIRST_CPU_ENV: &str = "TOFFLOAD_WATCH_CALIB_FIRST_CPU";

/// Nanoseconds the watch adds per event of each kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct ProbeCost {
    pub syscall_ns: f64,
    /// A context switch with the wake-up that preceded it.
    pub switch_ns: f64,
    /// An offload call seen by the entry and return probes.
    pub offload_ns: f64,
    /// One hand-off of the ping-pong untraced: a context switch with its wake-up and
    /// pipe calls, the switch cost X of the model (calibrate.rs measures the same on
    /// the watcher's own thread when this cannot run).
    pub handoff_ns: f64,
    /// What waking a task asleep on another, idle CPU costs the waker, untraced
    /// (idle_wake.rs); 0 where there is no other CPU or it was not measured.
    #[serde(default)]
    pub idle_wake_ns: f64,
    /// A syscall of a process outside the watch while the hooks are attached: the
    /// kernel's traced syscall path and the programs' filter.
    #[serde(default)]
    pub host_syscall_ns: f64,
}

/// Event counts of a traced stretch.
#[derive(Clone, Copy, Debug, Default)]
pub struct Events {
    pub syscalls: u64,
    pub switches: u64,
    pub offloads: u64,
}

impl ProbeCost {
    /// The watch's per-event costs times `k` (the untraced hand-off and wake-up, which
    /// are not the watch's, left as they are).
    pub fn scaled(&self, k: f64) -> ProbeCost {
        ProbeCost {
            syscall_ns: self.syscall_ns * k,
            switch_ns: self.switch_ns * k,
            offload_ns: self.offload_ns * k,
            host_syscall_ns: self.host_syscall_ns * k,
            ..*self
        }
    }

    /// Nanoseconds the programs added to the process over `e`.
    pub fn added_ns(&self, e: &Events) -> f64 {
        e.syscalls as f64 * self.syscall_ns
            + e.switches as f64 * self.switch_ns
            + e.offloads as f64 * self.offload_ns
    }
}

// The probe point the child calls and the calibration probes. Written out so that it
// starts as a compiled function does (push rbp): the kernel emulates a push under an
// uprobe, while most other first instructions are single-stepped out of line, which
// in a VM costs several times more and would overstate what an offload probe costs.
std::arch::global_asm!(
    ".pushsection .text.toffload_watch_probe_point,\"ax\",@progbits",
    ".globl toffload_watch_probe_point",
    ".type toffload_watch_probe_point,@function",
    "toffload_watch_probe_point:",
    "push rbp",
    "mov rbp, rsp",
    "lea rax, [rdi + 1]",
    "pop rbp",
    "ret",
    ".size toffload_watch_probe_point, . - toffload_watch_probe_point",
    ".popsection",
);

extern "C" {
    /// Returns x + 1 (see the assembly above).
    fn toffload_watch_probe_point(x: u64) -> u64;
}

fn probe_point_addr() -> u64 {
    toffload_watch_probe_point as *const () as usize as u64
}

/// Runs the child's loop when this process is the calibration child; returns
/// otherwise. Call first thing in main().
pub fn child_main_if_requested() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let code = child_loop().map_or(1, |()| 0);
    std::process::exit(code);
}

/// Commands: b'a' -> the probe point's address; b's'/b'p'/b'o' + u32 n -> ns taken by
/// n syscalls / ping-pong rounds / probed calls; b'w' + u32 n -> n times what waking
/// an idle other CPU costs the waker, ns (0 with one CPU); EOF ends it.
fn child_loop() -> std::io::Result<()> {
    let mut input = std::io::stdin().lock();
    let mut out = std::io::stdout().lock();
    // One CPU for both ping-pong threads: every hand-off is then a real switch. The
    // parent names the CPU (one it was just running on); without it, this one's.
    // SAFETY: no arguments.
    let here = unsafe { libc::sched_getcpu() }.max(0) as usize;
    let cpu = std::env::var(CPU_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(here);
    // The idle wake-up's peer: the parent's choice, from the CPUs it had before its
    // start pinned it to one (which this process inherits: left to choose from its
    // own mask it found no other CPU, and the cost read 0), else another of ours.
    let peer = std::env::var(PEER_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .or_else(|| crate::idle_wake::other_cpu(cpu));
    crate::calibrate::pin(cpu);
    // No real-time policy: a SCHED_FIFO child sat runnable forever behind a
    // real-time busy poller on its CPU (an accelerator's or a NIC's), and could not
    // even die when killed. A raised nice value instead (the parent's choice, set
    // here, before the ping-pong thread inherits it), and the parent's deadline moves
    // it to another CPU when this one gives it too little time.
    if let Some(nice) = std::env::var(NICE_ENV)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    {
        // The parent's start runs SCHED_IDLE (start_priority.rs), which a fork
        // inherits and a nice value alone does not lift: timed loops that any waking
        // thread preempts would measure the host, not the probes.
        use crate::start_priority::{set_policy, Policy};
        if !set_policy(0, Policy::Other(nice)) {
            // SAFETY: setpriority on the calling thread; failing (no CAP_SYS_NICE)
            // leaves the inherited value, which only makes the loops likelier to be
            // disturbed.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
        }
    }
    loop {
        let mut cmd = [0u8; 1];
        if input.read_exact(&mut cmd).is_err() {
            return Ok(());
        }
        let reply: u64 = match cmd[0] {
            b'a' => probe_point_addr(),
            b'w' => {
                let mut n = [0u8; 4];
                input.read_exact(&mut n)?;
                let n = u32::from_le_bytes(n);
                let ns = peer
                    .and_then(|peer| crate::idle_wake::idle_wake_ns(peer, n))
                    .unwrap_or(0.0);
                (ns * f64::from(n)) as u64
            }
            c @ (b's' | b'p' | b'o') => {
                let mut n = [0u8; 4];
                input.read_exact(&mut n)?;
                let n = u32::from_le_bytes(n);
                let t0 = Instant::now();
                match c {
                    b's' => {
                        for _ in 0..n {
                            // SAFETY: getppid has no arguments and cannot fail.
                            unsafe { libc::syscall(libc::SYS_getppid) };
                        }
                    }
                    b'p' => {
                        if crate::calibrate::ping_pong(cpu, n).is_none() {
                            return Err(std::io::Error::other("ping-pong failed"));
                        }
                    }
                    _ => {
                        let mut x = 1u64;
                        for _ in 0..n {
                            // SAFETY: the assembly above: reads rdi, returns in rax.
                            x = unsafe { toffload_watch_probe_point(x) };
                        }
                        std::hint::black_box(x);
                    }
                }
                t0.elapsed().as_nanos() as u64
            }
            _ => return Ok(()),
        };
        out.write_all(&reply.to_le_bytes())?;
        out.flush()?;
    }
}

struct ChildProc {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
}

impl ChildProc {
    fn start(cpu: usize, nice: i32) -> Result<ChildProc, String> {
        let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
        let mut child = Command::new(exe)
            .env(CHILD_ENV, "1")
            .env(CPU_ENV, cpu.to_string())
            .env(NICE_ENV, nice.to_string())
            .env(
                PEER_ENV,
                crate::start_priority::allowed_cpus()
                    .into_iter()
                    .find(|&c| c != cpu)
                    .map_or(String::new(), |c| c.to_string()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting the calibration child: {e}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err("the calibration child has no pipes".into());
        };
        Ok(ChildProc {
            child,
            stdin,
            stdout,
        })
    }

    /// One command and its answer, which must come before `deadline`.
    fn ask(&mut self, cmd: u8, n: Option<u32>, deadline: Instant) -> Result<u64, String> {
        let mut msg = vec![cmd];
        if let Some(n) = n {
            msg.extend_from_slice(&n.to_le_bytes());
        }
        self.stdin
            .write_all(&msg)
            .and_then(|()| self.stdin.flush())
            .map_err(|e| format!("the calibration child stopped answering: {e}"))?;
        // The 8 answer bytes arrive in one write; wait for them with the deadline.
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: self.stdout.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(60_000) as i32) };
        if ready <= 0 {
            return Err("the child got too little CPU to finish in time".into());
        }
        let mut r = [0u8; 8];
        self.stdout
            .read_exact(&mut r)
            .map_err(|e| format!("the calibration child stopped answering: {e}"))?;
        Ok(u64::from_le_bytes(r))
    }
}

impl Drop for ChildProc {
    /// Kills the child and reaps it, without waiting on it: a child starved of CPU
    /// takes as long to die as it took to run, so past a short grace it is reaped by
    /// a thread of its own and the start goes on.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let grace = Instant::now() + Duration::from_millis(50);
        while Instant::now() < grace {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let pid = self.child.id() as libc::pid_t;
        std::thread::spawn(move || {
            let mut status = 0;
            // SAFETY: reaps our own child; the Child handle is dropped and never waits.
            unsafe { libc::waitpid(pid, &mut status, 0) };
        });
    }
}

/// The file offset of a virtual address in `pid`'s mappings, with the file.
fn file_offset(pid: u32, addr: u64) -> Option<(String, u64)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (range, _perms, off) = (f.next()?, f.next()?, f.next()?);
        let path = f.nth(2)?;
        let (lo, hi) = range.split_once('-')?;
        let (lo, hi) = (
            u64::from_str_radix(lo, 16).ok()?,
            u64::from_str_radix(hi, 16).ok()?,
        );
        let off = u64::from_str_radix(off, 16).ok()?;
        (lo <= addr && addr < hi && path.starts_with('/'))
            .then(|| (path.to_string(), addr - lo + off))
    })
}

// Short loops, several times: each loop fits in a scheduler slice, so that on a busy
// machine some of them run undisturbed, and the least time per event is theirs. Eight
// of each, not more: the whole measurement is CPU the target does not get.
const SYSCALLS: u32 = 500;
const ROUNDS: u32 = 100;
const CALLS: u32 = 300;
/// Writes each way of the idle wake-up's measurement (the unread way queues them all
/// in one socket's buffer).
const WAKES: u32 = 100;
/// Loops of each kind, detached and attached.
const LOOPS: usize = 8;
/// One attempt's limit (about a second and a half where it gets a CPU, most of it
/// the pauses, which are left out where the limit is near).
const ATTEMPT: Duration = Duration::from_millis(2000);
/// Each untraced group of loops is followed by a pause this many times its own
/// length, at most MAX_PAUSE, while the attempt's deadline is more than PAUSE_MARGIN
/// away. The traced groups run back to back: the tracepoints stay attached through a
/// pause, and every process's syscalls and switches run the programs' filter
/// meanwhile, the target's and its load tool's included; a paused traced stretch cost
/// a loaded server more in its quarter-second than the same loops run at once.
const PAUSE_SHARE: f64 = 16.0;
/// The pause before the traced loops and after them: each loaded quarter-second then
/// holds at most one of the untraced loops, the traced ones and the watch's own load,
/// each of which alone costs a fully loaded server some tenths of its rate there.
const PHASE_GAP: Duration = Duration::from_millis(250);
const MAX_PAUSE: Duration = Duration::from_millis(60);
const PAUSE_MARGIN: Duration = Duration::from_millis(400);
/// The whole measurement's limit, every attempt included.
pub const DEADLINE: Duration = Duration::from_secs(4);

/// How the per-event costs were had.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CostSource {
    Measured,
    /// Measured by an earlier start in this boot, with this kernel and this build
    /// (calibration_cache.rs).
    Cached,
    /// The measurement failed or ran out of time: DEFAULT_COST stands in.
    Default,
}

/// What the watch is taken to cost per event when it cannot be measured: the upper
/// end of what it measures on a 2-vCPU Firecracker VM's 6.18 kernel (syscall
/// 130-300 ns, switch 400-1500 ns, offload 1100-2000 ns, another process's syscall
/// 175-180 ns), so that a budget errs toward tracing less.
pub const DEFAULT_COST: ProbeCost = ProbeCost {
    syscall_ns: 300.0,
    switch_ns: 1500.0,
    offload_ns: 3000.0,
    handoff_ns: 0.0,
    idle_wake_ns: 0.0,
    host_syscall_ns: 200.0,
};

/// The CPUs to try, in order: `first` (tests), then those the target does not run on
/// (`avoid`), the one this thread runs on now first (it is getting CPU time there),
/// then the target's: the loops take CPU from whatever else runs where they do.
fn cpu_order(first: Option<usize>, avoid: &[usize]) -> Vec<usize> {
    // The CPUs the watcher may use, not the one its start is pinned to.
    let allowed = crate::start_priority::allowed_cpus();
    // SAFETY: no arguments.
    let here = unsafe { libc::sched_getcpu() };
    order_cpus(first, (here >= 0).then_some(here as usize), &allowed, avoid)
}

fn order_cpus(
    first: Option<usize>,
    here: Option<usize>,
    allowed: &[usize],
    avoid: &[usize],
) -> Vec<usize> {
    let mut v: Vec<usize> = first.into_iter().collect();
    let free = |c: &usize| !avoid.contains(c);
    for c in here
        .filter(|c| allowed.contains(c) && free(c))
        .into_iter()
        .chain(allowed.iter().copied().filter(free))
        .chain(allowed.iter().copied().filter(|c| !free(c)))
    {
        if !v.contains(&c) {
            v.push(c);
        }
    }
    v
}

/// Measures the per-event costs (well under a second where the child gets a CPU),
/// or says why it could not within DEADLINE: each attempt runs on one CPU, and one
/// that is starved there (a real-time poller's CPU) is cut off and tried elsewhere.
/// `nice`: the nice value of the child's loops (the parent's own is left as it is);
/// `avoid`: the target's CPUs, tried last.
pub fn measure(nice: i32, avoid: &[usize]) -> Result<ProbeCost, String> {
    let first = std::env::var(FIRST_CPU_ENV)
        .ok()
        .and_then(|v| v.parse().ok());
    let end = Instant::now() + DEADLINE;
    let mut why = Vec::new();
    for cpu in cpu_order(first, avoid) {
        let left = end.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(200) {
            break;
        }
        match attempt(cpu, nice, Instant::now() + left.min(ATTEMPT)) {
            Ok(c) => return Ok(c),
            Err(e) => why.push(format!("CPU {cpu}: {e}")),
        }
    }
    if why.is_empty() {
        why.push("no CPU to run on".into());
    }
    Err(format!(
        "calibration cut short after {:.1} s ({})",
        DEADLINE.as_secs_f64(),
        why.join("; ")
    ))
}

/// A pause of `pause`, none where the deadline is near. The loops run raised (their
/// timings are the model's) on a CPU that is likely someone's: back to back they take
/// most of one quarter-second from whatever runs there (a load tool at full CPU, and
/// with it the target's rate); paused, the same CPU is spread over several.
fn pause_before(pause: Duration, deadline: Instant) {
    if deadline.saturating_duration_since(Instant::now()) > pause + PAUSE_MARGIN {
        std::thread::sleep(pause);
    }
}

fn attempt(cpu: usize, nice: i32, deadline: Instant) -> Result<ProbeCost, String> {
    let mut child = ChildProc::start(cpu, nice)?;
    let pid = child.child.id();
    let addr = child.ask(b'a', None, deadline)?;
    let (path, offset) = file_offset(pid, addr)
        .ok_or_else(|| format!("the probe point {addr:#x} is not in a mapped file"))?;
    let loader::Loaded { mut bpf, raw_sched } =
        loader::load(pid).map_err(|e| format!("loading the programs: {e}"))?;
    // Per kind: the least time per event, untraced and traced (the least is the loop
    // the rest of the machine disturbed least). One attachment only: detaching waits
    // for the kernel's grace periods (a third of a second here), so the programs
    // are detached once, on a thread of their own, after the measurement.
    let mut best = [[f64::INFINITY; 2]; 4];
    let mut links = Vec::new();
    let _raised = crate::start_priority::Raised::to(nice);
    // Untraced, once: a median of its own (WAKES writes each way).
    let idle_wake_ns = child.ask(b'w', Some(WAKES), deadline)? as f64 / f64::from(WAKES);
    for traced in [false, true] {
        if traced {
            pause_before(PHASE_GAP, deadline);
            loader::set_epoch(&mut bpf, Some(1)).map_err(|e| e.to_string())?;
            // The offload probes first: they fire on the child alone, where the
            // tracepoints run their filter on every process's syscalls and switches
            // (the target's and its load tool's) from the moment they are attached,
            // and attaching a uprobe takes tens of ms.
            links.extend(
                loader::attach_offload_probes(&mut bpf, Some(pid as i32), &path, offset)
                    .map_err(|(prog, e)| format!("probing the calibration child ({prog}): {e}"))?,
            );
            let (_, l) = loader::attach_tracepoints(&mut bpf, raw_sched, loader::Hooks::All)
                .map_err(|e| e.to_string())?;
            links.extend(l);
        }
        let t = traced as usize;
        for _ in 0..LOOPS {
            let group = Instant::now();
            for (k, (cmd, n)) in [(b's', SYSCALLS), (b'p', ROUNDS), (b'o', CALLS)]
                .into_iter()
                .enumerate()
            {
                let ns = child.ask(cmd, Some(n), deadline)? as f64 / f64::from(n);
                best[k][t] = best[k][t].min(ns);
            }
            // A thread of the watcher's is outside the watch: its syscalls are a
            // neighbour's.
            if let Some(ns) = host_syscalls_ns(cpu, nice, SYSCALLS, deadline) {
                best[3][t] = best[3][t].min(ns);
            }
            if !traced {
                pause_before(
                    group.elapsed().mul_f64(PAUSE_SHARE).min(MAX_PAUSE),
                    deadline,
                );
            }
        }
    }
    let floor = kernel_floor(&bpf, raw_sched, &mut child, deadline);
    // Detached before the child is reaped, which may take a grace of its own.
    std::thread::spawn(move || {
        loader::detach(&mut bpf, &mut links, &Default::default());
        drop(bpf);
    });
    drop(child);
    pause_before(PHASE_GAP, deadline);
    let added = |k: usize| (best[k][1] - best[k][0]).max(0.0);
    let syscall_ns = added(0).max(floor[0]);
    // A round: two switches, two wake-ups, four syscalls (a write and a read each side).
    let switch_ns = ((added(1) - 4.0 * syscall_ns) / 2.0).max(floor[1]);
    Ok(ProbeCost {
        syscall_ns,
        switch_ns,
        offload_ns: added(2).max(floor[2]),
        handoff_ns: best[1][0] / 2.0,
        idle_wake_ns,
        // Either loop cut off by the deadline: the default, not an infinity or a 0.
        host_syscall_ns: if best[3].iter().all(|v| v.is_finite()) {
            added(3)
        } else {
            DEFAULT_COST.host_syscall_ns
        },
    })
}

/// Per kind (a syscall, a switch with its wake-up, an offload call), the programs' own
/// run time as the kernel counts it over one more traced loop of each
/// (program_stats.rs): the floor under the timed differences, which the host's noise
/// can take below it. Zeros where the kernel will not count (or a loop is cut off).
fn kernel_floor(
    bpf: &aya::Ebpf,
    raw_sched: bool,
    child: &mut ChildProc,
    deadline: Instant,
) -> [f64; 3] {
    let mut floor = [0.0; 3];
    let Some(_counting) = program_stats::enable() else {
        return floor;
    };
    let loops = [(b's', SYSCALLS), (b'p', ROUNDS), (b'o', CALLS)];
    for (k, (names, (cmd, n))) in loader::programs_per_event(raw_sched)
        .iter()
        .zip(loops)
        .enumerate()
    {
        let before = program_stats::read(bpf, names);
        if child.ask(cmd, Some(n), deadline).is_err() {
            break;
        }
        floor[k] = program_stats::ns_per_event(&before, &program_stats::read(bpf, names));
    }
    floor
}

/// ns per getppid over `n` calls (the child's `s` loop) on a thread of the watcher's,
/// which is outside the watch, run as the child's loops are (on `cpu`, at `nice`):
/// the start itself runs SCHED_IDLE, where any waking thread preempts a timed loop
/// (one start beside a busy test read 1055 ns for 180). None past the deadline (the
/// thread, left behind, ends when it gets the CPU).
fn host_syscalls_ns(cpu: usize, nice: i32, n: u32, deadline: Instant) -> Option<f64> {
    use crate::start_priority::{set_policy, Policy};
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("toffload-calib".into())
        .spawn(move || {
            crate::calibrate::pin(cpu);
            if !set_policy(0, Policy::Other(nice)) {
                // SAFETY: setpriority on the calling thread (as in the child).
                unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
            }
            let t0 = Instant::now();
            for _ in 0..n {
                // SAFETY: getppid has no arguments and cannot fail.
                unsafe { libc::syscall(libc::SYS_getppid) };
            }
            let _ = tx.send(t0.elapsed().as_nanos() as f64 / f64::from(n));
        })
        .ok()?;
    rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_targets_cpus_come_last() {
        // Here (1) is the target's: the free CPUs first, then the target's.
        assert_eq!(
            order_cpus(None, Some(1), &[0, 1, 2, 3], &[1, 3]),
            [0, 2, 1, 3]
        );
        assert_eq!(order_cpus(None, Some(2), &[0, 1, 2, 3], &[1]), [2, 0, 3, 1]);
        // A test's first CPU leads whatever it is.
        assert_eq!(order_cpus(Some(1), Some(0), &[0, 1], &[1]), [1, 0]);
        // Nothing to avoid: here first.
        assert_eq!(order_cpus(None, Some(1), &[0, 1], &[]), [1, 0]);
    }

    #[test]
    fn added_cost_is_counts_times_costs() {
        let c = ProbeCost {
            syscall_ns: 100.0,
            switch_ns: 300.0,
            offload_ns: 1000.0,
            handoff_ns: 2000.0,
            idle_wake_ns: 0.0,
            host_syscall_ns: 0.0,
        };
        let e = Events {
            syscalls: 10,
            switches: 2,
            offloads: 1,
        };
        assert!((c.added_ns(&e) - 2600.0).abs() < 1e-9);
    }

    #[test]
    fn own_probe_point_is_found_in_a_mapped_file() {
        let addr = probe_point_addr();
        // SAFETY: as in the child loop.
        assert_eq!(unsafe { toffload_watch_probe_point(41) }, 42);
        let (path, off) = file_offset(std::process::id(), addr).expect("mapped");
        assert!(path.starts_with('/'), "{path}");
        assert!(off > 0 && off < std::fs::metadata(&path).unwrap().len());
    }
}
