//! Loading the embedded object and attaching its programs: the privilege check,
//! mounting tracefs when it is missing, tracepoints (degrading, with the lost metric
//! named, when the kernel lacks one) and the uprobes on the target's offload entry
//! points.

use crate::error::WatchError;
use crate::target::{self, Mapping};
use aya::programs::raw_trace_point::RawTracePointLinkId;
use aya::programs::trace_point::TracePointLinkId;
use aya::programs::uprobe::UProbeLinkId;
use aya::programs::{RawTracePoint, TracePoint, UProbe};
use aya::Ebpf;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// The embedded object; empty when built without it (see build.rs).
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/toffload.bpf.o"));

/// Test hook: "category:name" of a tracepoint to attach under a name the kernel
/// lacks, which exercises the degrade path with a real attach failure.
pub const HIDE_TRACEPOINT_ENV: &str = "TOFFLOAD_WATCH_HIDE_TRACEPOINT";

/// `0`: the scheduler hooks as classic tracepoints even where raw ones can be used.
pub const RAW_SCHED_ENV: &str = "TOFFLOAD_WATCH_RAW_SCHED";

/// Which form the scheduler hooks took (the header's `sched_hooks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SchedHooks {
    /// Raw tracepoints: released at once after a burst.
    Raw,
    /// Classic tracepoints (perf events): where BTF lacks the layout, or asked for.
    Classic,
}

impl SchedHooks {
    pub fn of(raw_sched: bool) -> SchedHooks {
        if raw_sched {
            SchedHooks::Raw
        } else {
            SchedHooks::Classic
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            SchedHooks::Raw => "raw tracepoints",
            SchedHooks::Classic => "classic tracepoints",
        }
    }
}

/// Raw tracepoints (program = tracepoint name): cheaper on the syscall path.
const RAW_TRACEPOINTS: &[(&str, &str)] = &[
    ("sys_enter", "syscall counts and futex origin"),
    ("sys_exit", "syscall latency"),
];

/// The scheduler hooks as raw tracepoints (program, tracepoint, metric): used when the
/// kernel's BTF gives task_struct's pid and cpu offsets, else the classic ones below.
const RAW_SCHED: &[(&str, &str, &str)] = &[
    (
        "raw_sched_switch",
        "sched_switch",
        "on/off-CPU time, context switches, spin share",
    ),
    (
        "raw_sched_waking",
        "sched_waking",
        "wake-up latency and idle peer wake-ups",
    ),
    (
        "raw_sched_wakeup_new",
        "sched_wakeup_new",
        "wake-up latency of new threads",
    ),
    (
        "raw_sched_process_fork",
        "sched_process_fork",
        "threads created",
    ),
    (
        "raw_sched_process_exit",
        "sched_process_exit",
        "thread exits",
    ),
];

/// (program, category, tracepoint, the metric it feeds).
const TRACEPOINTS: &[(&str, &str, &str, &str)] = &[
    (
        "sched_switch",
        "sched",
        "sched_switch",
        "on/off-CPU time, context switches, spin share",
    ),
    (
        "sched_waking",
        "sched",
        "sched_waking",
        "wake-up latency and idle peer wake-ups",
    ),
    (
        "sched_wakeup_new",
        "sched",
        "sched_wakeup_new",
        "wake-up latency of new threads",
    ),
    (
        "sched_process_fork",
        "sched",
        "sched_process_fork",
        "threads created",
    ),
    (
        "sched_process_exit",
        "sched",
        "sched_process_exit",
        "thread exits",
    ),
];

/// CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF bits of CapEff.
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Whether this process may load tracing programs.
pub fn check_privileges() -> Result<(), WatchError> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| WatchError::Other(format!("reading /proc/self/status: {e}")))?;
    let cap = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    privileges_ok(cap).map_err(WatchError::NotRoot)
}

/// The decision behind check_privileges, on a CapEff mask.
pub fn privileges_ok(cap_eff: u64) -> Result<(), String> {
    let has = |b: u32| cap_eff & (1u64 << b) != 0;
    if has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON)) {
        Ok(())
    } else {
        // SAFETY: no arguments.
        let euid = unsafe { libc::geteuid() };
        Err(format!(
            "running as uid {euid} with effective capabilities {cap_eff:#x}"
        ))
    }
}

/// Mounts tracefs at /sys/kernel/tracing unless a tracefs is reachable already
/// (aya reads tracepoint ids from it).
pub fn ensure_tracefs() -> Result<(), WatchError> {
    for p in [
        "/sys/kernel/tracing/events",
        "/sys/kernel/debug/tracing/events",
    ] {
        if Path::new(p).exists() {
            return Ok(());
        }
    }
    let (src, dst, fs) = (c"nodev", c"/sys/kernel/tracing", c"tracefs");
    // SAFETY: valid C strings; mount(2) only.
    let r = unsafe { libc::mount(src.as_ptr(), dst.as_ptr(), fs.as_ptr(), 0, std::ptr::null()) };
    if r != 0 {
        return Err(WatchError::BpfUnavailable(format!(
            "tracefs is not mounted and mounting it at /sys/kernel/tracing failed: {}",
            std::io::Error::last_os_error()
        )));
    }
    eprintln!("toffload-watch: mounted tracefs at /sys/kernel/tracing");
    Ok(())
}

/// The offload probes, the return probe first (attach_offload_probes says why).
const OFFLOAD_PROGRAMS: [&str; 2] = ["offload_exit", "offload_enter"];

/// The programs that run for each event the calibration times (probe_cost.rs): a
/// syscall, a switch with the wake-up before it, an offload call.
pub fn programs_per_event(raw_sched: bool) -> [Vec<&'static str>; 3] {
    let sched = |tp: &str| -> Option<&'static str> {
        if raw_sched {
            RAW_SCHED.iter().find(|r| r.1 == tp).map(|r| r.0)
        } else {
            TRACEPOINTS.iter().find(|r| r.2 == tp).map(|r| r.0)
        }
    };
    [
        RAW_TRACEPOINTS.iter().map(|r| r.0).collect(),
        ["sched_switch", "sched_waking"]
            .into_iter()
            .filter_map(sched)
            .collect(),
        OFFLOAD_PROGRAMS.to_vec(),
    ]
}

/// The loaded programs; `raw_sched` when the scheduler hooks are raw tracepoints.
pub struct Loaded {
    pub bpf: Ebpf,
    pub raw_sched: bool,
}

/// Loads the embedded object, filtering on `pid`.
pub fn load(pid: u32) -> Result<Loaded, WatchError> {
    load_from(OBJECT, pid)
}

/// Adds processes to the kernel's filter (a service's other processes); those they
/// fork join by themselves.
pub fn watch_also(bpf: &mut Ebpf, pids: &[u32]) -> Result<(), WatchError> {
    let mut m: aya::maps::HashMap<_, u32, u8> = aya::maps::HashMap::try_from(
        bpf.map_mut("WATCHED")
            .ok_or_else(|| WatchError::BpfUnavailable("the object lacks map WATCHED".into()))?,
    )
    .map_err(|e| WatchError::BpfUnavailable(format!("map WATCHED: {e}")))?;
    for &p in pids {
        m.insert(p, 1, 0)
            .map_err(|e| WatchError::BpfUnavailable(format!("watching pid {p}: {e}")))?;
    }
    Ok(())
}

/// Loads an object (empty: this binary was built without one) with its in-kernel
/// filter set to `pid`.
pub fn load_from(object: &[u8], pid: u32) -> Result<Loaded, WatchError> {
    if object.is_empty() {
        return Err(WatchError::NoObject);
    }
    // Older kernels charge BPF maps to RLIMIT_MEMLOCK; newer ones ignore it.
    let lim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: a valid rlimit struct.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) };
    // The scheduler hooks are raw tracepoints where the kernel's BTF gives
    // task_struct's layout: a sampled watch detaches them after every burst, and a
    // raw link goes at once, where each classic one (a perf event) takes an RCU grace
    // period, one after the other, building a record per event until it is gone.
    // TOFFLOAD_WATCH_RAW_SCHED=0 keeps the classic ones.
    let (pid_off, cpu_off) = if std::env::var(RAW_SCHED_ENV).is_ok_and(|v| v == "0") {
        (0, 0)
    } else {
        crate::btf::task_offsets().unwrap_or((0, 0))
    };
    // The object carries no BTF relocations: aya's parse of the kernel's is skipped
    // (btf_hidden.rs).
    let (loaded, _) = crate::btf_hidden::with_btf_hidden(|| {
        // Part of the start: moved with it past its grace (start_priority.rs).
        let _helper = crate::start_priority::helper();
        aya::EbpfLoader::new()
            .set_global("WATCHED_TGID", &pid, true)
            .set_global("TASK_PID_OFF", &pid_off, true)
            .set_global("TASK_CPU_OFF", &cpu_off, true)
            .load(object)
    });
    let mut bpf =
        loaded.map_err(|e| WatchError::BpfUnavailable(format!("loading the eBPF object: {e}")))?;
    let raw_sched = pid_off != 0;
    let raw: Vec<&str> = RAW_TRACEPOINTS
        .iter()
        .map(|r| r.0)
        .chain(RAW_SCHED.iter().filter(|_| raw_sched).map(|r| r.0))
        .collect();
    for name in raw {
        let p: &mut RawTracePoint = program(&mut bpf, name)?;
        p.load()
            .map_err(|e| WatchError::BpfUnavailable(format!("loading program {name}: {e:#}")))?;
    }
    for (name, _, _, _) in TRACEPOINTS.iter().filter(|_| !raw_sched) {
        let p: &mut TracePoint = program(&mut bpf, name)?;
        p.load()
            .map_err(|e| WatchError::BpfUnavailable(format!("loading program {name}: {e:#}")))?;
    }
    // The offload probes go through the verifier when the first one is attached
    // (attach_offload_probes): a target with no offload symbol (most stock servers) is
    // spared over a third of the start's verifying, which runs on its CPU's idle time.
    for name in OFFLOAD_PROGRAMS {
        let _: &mut UProbe = program(&mut bpf, name)?;
    }
    Ok(Loaded { bpf, raw_sched })
}

fn program<'a, T>(bpf: &'a mut Ebpf, name: &str) -> Result<&'a mut T, WatchError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program>,
{
    bpf.program_mut(name)
        .ok_or_else(|| WatchError::BpfUnavailable(format!("the object lacks program {name}")))?
        .try_into()
        .map_err(|_| WatchError::BpfUnavailable(format!("program {name} has the wrong type")))
}

/// Attaches every tracepoint it can; returns the metrics lost to the ones that failed.
/// An attachment, so that sampled watching can detach and re-attach.
pub enum Link {
    Raw(&'static str, RawTracePointLinkId),
    Tp(&'static str, TracePointLinkId),
    Up(&'static str, UProbeLinkId),
}

/// The programs that stay attached between bursts: fork and exit keep the kernel's
/// set of watched processes complete (a worker forked while untraced is watched when
/// tracing resumes); they fire once per task, so they cost nothing measurable.
const KEPT: &[&str] = &[
    "sched_process_fork",
    "sched_process_exit",
    "raw_sched_process_fork",
    "raw_sched_process_exit",
];

impl Link {
    fn program(&self) -> &'static str {
        match self {
            Link::Raw(p, _) | Link::Tp(p, _) | Link::Up(p, _) => p,
        }
    }
}

/// Detaches all but the KEPT programs: the end of a burst.
/// The release threads add their CPU to `cost` (burst_cost.rs).
pub fn detach_burst(bpf: &mut Ebpf, links: &mut Vec<Link>, cost: &Arc<AtomicU64>) {
    let (kept, mut rest): (Vec<Link>, Vec<Link>) =
        links.drain(..).partition(|l| KEPT.contains(&l.program()));
    detach(bpf, &mut rest, cost);
    *links = kept;
}

/// Detaches everything in `links` (a detached program costs the target nothing).
/// Call set_epoch(None) first: every program then does nothing while the rest is
/// detached. Releasing a link may wait for the kernel: an offload probe ~0.1 s (an
/// RCU tasks-trace grace period), a classic tracepoint ~80 ms, one at a time whatever
/// the threads (a raw one goes at once). So nothing here waits: each offload probe is
/// released on a thread of its own, all at once (the breakpoint leaves the target's
/// code when the last probe on it is gone, and each probed call traps until then,
/// program or not), and the tracepoints on one more thread, most frequent first. One
/// after the other on the watch's thread, they stayed attached ~0.4 s after every
/// burst.
pub fn detach(bpf: &mut Ebpf, links: &mut Vec<Link>, cost: &Arc<AtomicU64>) {
    let mut tracepoints: Vec<Box<dyn Send>> = Vec::new();
    for l in links.drain(..) {
        match l {
            Link::Up(name, id) => {
                if let Some(link) = program::<UProbe>(bpf, name)
                    .ok()
                    .and_then(|p| p.take_link(id).ok())
                {
                    release(vec![Box::new(link)], cost.clone());
                }
            }
            Link::Raw(name, id) => tracepoints.extend(
                program::<RawTracePoint>(bpf, name)
                    .ok()
                    .and_then(|p| p.take_link(id).ok())
                    .map(|l| Box::new(l) as Box<dyn Send>),
            ),
            Link::Tp(name, id) => tracepoints.extend(
                program::<TracePoint>(bpf, name)
                    .ok()
                    .and_then(|p| p.take_link(id).ok())
                    .map(|l| Box::new(l) as Box<dyn Send>),
            ),
        }
    }
    release(tracepoints, cost.clone());
}

/// Drops owned links in order on a thread of their own (dropping one detaches it),
/// adding that thread's CPU to `cost`. Should the thread not start, the refused
/// closure is dropped here, and the links with it.
fn release(links: Vec<Box<dyn Send>>, cost: Arc<AtomicU64>) {
    let _ = std::thread::Builder::new()
        .name("detach".into())
        .spawn(move || crate::burst_cost::booked(&cost, || drop(links)));
}

/// Starts a new attach epoch (thread timestamps from before are reset in the kernel)
/// with tracing on, or turns tracing off (epoch None) before a detach.
pub fn set_epoch(bpf: &mut Ebpf, epoch: Option<u64>) -> Result<(), WatchError> {
    let mut m: aya::maps::Array<_, u64> = aya::maps::Array::try_from(
        bpf.map_mut("CONFIG")
            .ok_or_else(|| WatchError::BpfUnavailable("the object lacks map CONFIG".into()))?,
    )
    .map_err(|e| WatchError::BpfUnavailable(format!("map CONFIG: {e}")))?;
    let set = |m: &mut aya::maps::Array<_, u64>, i: u32, v: u64| {
        m.set(i, v, 0)
            .map_err(|e| WatchError::BpfUnavailable(format!("setting CONFIG[{i}]: {e}")))
    };
    match epoch {
        Some(e) => {
            set(&mut m, 0, e)?;
            set(&mut m, 1, 1)
        }
        None => set(&mut m, 1, 0),
    }
}

/// Which programs attach_tracepoints attaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hooks {
    All,
    /// The KEPT ones alone (fork and exit): a watch's start, whose hot programs wait
    /// until it begins to read. Attached but idle they still cost every syscall on
    /// the host the kernel's traced path (most of what tracing it costs), and the
    /// start's own work (symbols, uprobes, /proc) takes a few hundred ms on a busy host.
    Kept,
    /// All but the KEPT ones: the start of a burst.
    Hot,
}

impl Hooks {
    fn wants(self, prog: &str) -> bool {
        match self {
            Hooks::All => true,
            Hooks::Kept => KEPT.contains(&prog),
            Hooks::Hot => !KEPT.contains(&prog),
        }
    }
}

/// Attaches every tracepoint of `which` it can: the metrics lost to those that failed,
/// and the links.
pub fn attach_tracepoints(
    bpf: &mut Ebpf,
    raw_sched: bool,
    which: Hooks,
) -> Result<(Vec<String>, Vec<Link>), WatchError> {
    let hidden = std::env::var(HIDE_TRACEPOINT_ENV).unwrap_or_default();
    let mut missing = Vec::new();
    let mut links = Vec::new();
    let mut attached = 0;
    for (tp, metric) in RAW_TRACEPOINTS.iter().filter(|r| which.wants(r.0)) {
        let name = if hidden == format!("raw_syscalls:{tp}") {
            format!("{tp}_hidden_for_test")
        } else {
            tp.to_string()
        };
        let p: &mut RawTracePoint = program(bpf, tp)?;
        match p.attach(&name) {
            Ok(id) => {
                attached += 1;
                links.push(Link::Raw(tp, id));
            }
            Err(e) => missing.push(format!("{metric} (raw tracepoint {name}: {e})")),
        }
    }
    for (prog, tp, metric) in RAW_SCHED.iter().filter(|r| raw_sched && which.wants(r.0)) {
        let name = if hidden == format!("sched:{tp}") {
            format!("{tp}_hidden_for_test")
        } else {
            tp.to_string()
        };
        let p: &mut RawTracePoint = program(bpf, prog)?;
        match p.attach(&name) {
            Ok(id) => {
                attached += 1;
                links.push(Link::Raw(prog, id));
            }
            Err(e) => missing.push(format!("{metric} (raw tracepoint {name}: {e})")),
        }
    }
    for (prog, cat, tp, metric) in TRACEPOINTS
        .iter()
        .filter(|r| !raw_sched && which.wants(r.0))
    {
        let name = if hidden == format!("{cat}:{tp}") {
            format!("{tp}_hidden_for_test")
        } else {
            tp.to_string()
        };
        let p: &mut TracePoint = program(bpf, prog)?;
        match p.attach(cat, &name) {
            Ok(id) => {
                attached += 1;
                links.push(Link::Tp(prog, id));
            }
            Err(e) => missing.push(format!("{metric} (tracepoint {cat}:{name}: {e})")),
        }
    }
    if attached == 0 {
        return Err(WatchError::BpfUnavailable(format!(
            "no tracepoint could be attached: {}",
            missing.join("; ")
        )));
    }
    Ok((missing, links))
}

/// What the uprobes found and attached to.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Probes {
    /// "symbol in path" for each offload entry point probed.
    pub offload: Vec<String>,
    /// The files those symbols are in (futexes from them are the offload's own).
    pub offload_modules: Vec<String>,
    /// Probes that failed, with why.
    pub failed: Vec<String>,
    /// Processes whose offload entry points were left unprobed on purpose, with why.
    pub skipped: Vec<String>,
    /// (pid, file) pairs already looked at.
    #[serde(skip)]
    pub scanned: Vec<(u32, String)>,
    /// Each file's offload entry points, resolved once (file, [(symbol, offset)]).
    #[serde(skip)]
    pub symbols: Vec<(String, Vec<(String, u64)>)>,
    /// Each probed entry point, per process.
    #[serde(skip)]
    pub targets: Vec<ProbeTarget>,
    /// The user's offload symbols (--offload), looked for besides the known ones.
    pub named: Vec<crate::offload_spec::OffloadSpec>,
}

/// One offload entry point probed in one process.
#[derive(Clone, Debug)]
pub struct ProbeTarget {
    pub pid: u32,
    pub path: String,
    pub symbol: String,
    pub offset: u64,
}

impl Probes {
    /// Whether `symbol` is probed in some process.
    pub fn probes(&self, symbol: &str) -> bool {
        self.targets.iter().any(|t| t.symbol == symbol)
    }

    fn symbols_in(&mut self, path: &str) -> Vec<(String, u64)> {
        if let Some((_, v)) = self.symbols.iter().find(|(p, _)| p == path) {
            return v.clone();
        }
        let extra: Vec<&str> = self
            .named
            .iter()
            .filter(|n| n.applies_to(path))
            .map(|n| n.symbol.as_str())
            .collect();
        let v = target::offload_symbols_in(path, &extra);
        self.symbols.push((path.to_string(), v.clone()));
        v
    }
}

/// Probes the offload entry points in `files` (those process `pid` maps, or will),
/// skipping files probed in it before. Each probe is filtered on the process: a uretprobe takes
/// over the return address of every call it sees, and the kernel kills with SIGILL a
/// thread that returns through it out of order, which fibers do (a fiber parks inside
/// the call and another enters it on the same thread, or it resumes on another
/// thread). Unfiltered, a probe on a shared library would trap every process that
/// maps it, an injected relaunch of the target or another server that runs the fiber
/// runtime among them (an injected hsm_server died so under load). A process that
/// runs toffload's fiber runtime is not probed at all: its offloads are read from the
/// runtime's counters (runtime_counters.rs). A process forked later is probed when
/// the watch first sees it; until then the breakpoint it inherits traps once and is
/// removed from it. Not `live` (between bursts), the targets are only recorded for
/// the next reattach_uprobes.
pub fn attach_uprobes(
    bpf: &mut Ebpf,
    pid: u32,
    files: &[String],
    probes: &mut Probes,
    links: &mut Vec<Link>,
    live: bool,
) -> Result<(), WatchError> {
    // Overhead experiments: the watch without the offload probes.
    if std::env::var("TOFFLOAD_WATCH_NO_UPROBES").is_ok_and(|v| v == "1") {
        return Ok(());
    }
    if files.iter().any(|f| is_fiber_runtime(f)) && !unfiltered_for_test() {
        let why = format!(
            "pid {pid}: runs toffload's fiber runtime, whose fibers return out of order \
             (a return probe there would kill it with SIGILL); its offloads are read \
             from the runtime's counters"
        );
        if !probes.skipped.contains(&why) {
            probes.skipped.push(why);
        }
        return Ok(());
    }
    for path in files.iter().cloned() {
        if probes.scanned.iter().any(|(p, f)| *p == pid && *f == path) {
            continue;
        }
        probes.scanned.push((pid, path.clone()));
        for (sym, offset) in probes.symbols_in(&path) {
            let t = ProbeTarget {
                pid,
                path: path.clone(),
                symbol: sym,
                offset,
            };
            if live {
                if let Err(e) = attach_target(bpf, &t, links) {
                    probes.failed.push(e);
                    continue;
                }
            }
            let name = format!("{} in {}", t.symbol, t.path);
            if !probes.offload.contains(&name) {
                probes.offload.push(name);
            }
            if !probes.offload_modules.contains(&path) {
                probes.offload_modules.push(path.clone());
            }
            probes.targets.push(t);
        }
    }
    Ok(())
}

/// The hazard, for its test: probes on every process that maps the file, as they once
/// were (TOFFLOAD_TEST_UPROBES_UNFILTERED=1).
fn unfiltered_for_test() -> bool {
    std::env::var("TOFFLOAD_TEST_UPROBES_UNFILTERED").is_ok_and(|v| v == "1")
}

/// The entry and return probes of one target, both or neither.
fn attach_target(bpf: &mut Ebpf, t: &ProbeTarget, links: &mut Vec<Link>) -> Result<(), String> {
    let pid = (!unfiltered_for_test()).then_some(t.pid as libc::pid_t);
    let made = attach_offload_probes(bpf, pid, &t.path, t.offset).map_err(|(prog, e)| {
        format!("{prog} on {} in {} (pid {}): {e}", t.symbol, t.path, t.pid)
    })?;
    links.extend(made);
    Ok(())
}

/// The offload probes at `offset` in `path`, on `pid` (None: every process), both or
/// neither; each program goes through the verifier the first time it is attached.
/// Fails with the program that did not attach and why.
pub fn attach_offload_probes(
    bpf: &mut Ebpf,
    pid: Option<libc::pid_t>,
    path: &str,
    offset: u64,
) -> Result<Vec<Link>, (&'static str, String)> {
    // The return probe first: an entry seen before its return probe exists would
    // leave the thread's nesting depth above zero for good (a busy event loop then
    // never counts another offload).
    let mut made = Vec::new();
    for prog in OFFLOAD_PROGRAMS {
        let attached = program::<UProbe>(bpf, prog)
            .map_err(|e| e.to_string())
            .and_then(|p| {
                if p.fd().is_err() {
                    p.load()
                        .map_err(|e| format!("loading the program: {e:#}"))?;
                }
                p.attach(None, offset, path, pid).map_err(|e| e.to_string())
            });
        match attached {
            Ok(id) => made.push(Link::Up(prog, id)),
            Err(e) => {
                detach(bpf, &mut made, &Arc::new(AtomicU64::new(0)));
                return Err((prog, e));
            }
        }
    }
    Ok(made)
}

/// Attaches the probed entry points again (sampled watching). A process that has
/// exited since is dropped from the targets.
pub fn reattach_uprobes(
    bpf: &mut Ebpf,
    probes: &mut Probes,
    links: &mut Vec<Link>,
) -> Result<(), WatchError> {
    let mut kept = Vec::with_capacity(probes.targets.len());
    for t in std::mem::take(&mut probes.targets) {
        match attach_target(bpf, &t, links) {
            Ok(()) => kept.push(t),
            Err(_) if !target::exists(t.pid) => {}
            Err(e) => {
                probes.targets = kept;
                return Err(WatchError::Other(format!("re-attaching {e}")));
            }
        }
    }
    probes.targets = kept;
    Ok(())
}

/// The executable files mapped by a process.
pub fn mapped_files(maps: &[Mapping]) -> Vec<String> {
    let mut v: Vec<String> = maps
        .iter()
        .filter(|m| m.exec)
        .map(|m| m.path.clone())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// toffload's own fiber runtime: a process that maps it is not probed (attach_uprobes).
pub fn is_fiber_runtime(path: &str) -> bool {
    path.rsplit('/').next() == Some("libtoffload.so")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_with_the_fiber_runtime_is_told_apart() {
        let with = crate::target::parse_maps(
            "7f00-7f10 r-xp 00011000 fe:00 1 /x/lib/libtoffload.so\n\
             7f20-7f30 r-xp 00011000 fe:00 2 /x/lib/libtoffload_accel.so\n",
        );
        let files = mapped_files(&with);
        assert_eq!(files.len(), 2);
        assert!(files.iter().any(|f| is_fiber_runtime(f)));
        // The backend library alone is an ordinary offload library.
        let without = crate::target::parse_maps(
            "7f20-7f30 r-xp 00011000 fe:00 2 /x/lib/libtoffload_accel.so\n",
        );
        assert!(!mapped_files(&without).iter().any(|f| is_fiber_runtime(f)));
    }

    #[test]
    fn no_object_says_how_to_build_it() {
        let Err(e) = load_from(&[], 1).map(|l| l.raw_sched) else {
            panic!("an empty object must be refused");
        };
        assert_eq!(e.exit_code(), crate::error::EXIT_NO_OBJECT);
        let msg = e.to_string();
        assert!(msg.contains("built without its eBPF object"), "{msg}");
        assert!(msg.contains("cargo xtask build-ebpf"), "{msg}");
    }

    #[test]
    fn privilege_decision() {
        assert!(privileges_ok(1 << CAP_SYS_ADMIN).is_ok());
        assert!(privileges_ok((1 << CAP_BPF) | (1 << CAP_PERFMON)).is_ok());
        assert!(privileges_ok(1 << CAP_BPF).is_err());
        let e = privileges_ok(0).unwrap_err();
        assert!(e.contains("capabilities 0x0"), "{e}");
    }
}
