//! A watch from start to end: checks, load and attach, the calibration, then one
//! window per interval until the duration passes or the windows asked for are out,
//! the process exits or the user interrupts; then the final report over the whole
//! watch. With --inject (or the dashboard's key i) the watched server is restarted
//! under the fiber runtime part way through, and the watch follows the new pid.

use crate::calibrate;
use crate::calibration_cache;
use crate::collector::{Collector, Snapshot};
use crate::cuda_rows;
use crate::error::WatchError;
use crate::futex::Layout;
use crate::inject;
use crate::inject::health::{Check, Health, Observed, Sick};
use crate::inject_flow::{InjectAction, InjectEvent, InjectRequest, Tracker};
use crate::loader::{self, Probes};
use crate::metrics::{self, Context, Window};
use crate::model;
use crate::probe_cost::{self, ProbeCost};
use crate::report::{Ended, Final, Header, ThreadRow};
use crate::runtime_counters;
use crate::sink::{Event, Sink, UserCmd};
use crate::steal;
use crate::target::{self, AddressSpace};
use crate::untraced::{self, Stretch};
use crate::watch_priority::{Phase, WatchPriority};
use aya::Ebpf;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct Options {
    pub interval: Duration,
    pub duration: Option<Duration>,
    /// End after this many windows (bcc's positional COUNT); the final report follows.
    pub windows: Option<u32>,
    pub json: bool,
    /// Text lines start with the local HH:MM:SS (-T); JSON lines always carry `ts`.
    pub timestamp: bool,
    /// Share of each interval the programs are attached (1.0: always). Between bursts
    /// the watched process runs untraced; rates are per traced second. With a budget
    /// this is where the watch starts, and the share then follows the budget.
    pub sample: f64,
    /// Keep the watch's measured cost, averaged over each interval, under this share
    /// of the target's CPU by tracing less of each interval (None: trace `sample`).
    pub overhead_budget: Option<f64>,
    /// --inject: restart the target under the runtime once the verdict is in.
    pub inject: Option<InjectRequest>,
    /// Options for an injection the dashboard asks for (key i).
    pub interactive_inject: inject::Options,
    /// The user's offload symbols (--offload).
    pub offloads: Vec<crate::offload_spec::OffloadSpec>,
}

/// Loaded, attached and filtering on `pid`; not yet reading.
pub struct Attached {
    pub bpf: Ebpf,
    pub pid: u32,
    /// The service's other processes at attach.
    pub also: Vec<u32>,
    pub probes: Probes,
    pub missing: Vec<String>,
    pub links: Vec<loader::Link>,
    /// Scheduler hooks as raw tracepoints (else classic ones).
    pub raw_sched: bool,
    /// The hot programs (syscalls, switches, wake-ups) are attached: from the start
    /// for a held command, else once the session begins.
    pub hot: bool,
}

/// Privileges, tracefs, load, tracepoints, and the pid into the filter. Uprobes
/// follow (attach_uprobes) once the files to probe are known. `from_now`: trace from
/// here (a command held before its exec, whose first instructions must be seen);
/// otherwise only fork and exit are attached, and the hot programs are attached and
/// turned on when the session starts reading (Tracked::new):
/// the start's remaining work (symbols, uprobes, /proc) takes a few hundred ms on a
/// busy host, and traced in full that long, stock redis-server lost a third of its
/// requests for half a second.
/// `also`: the service's other processes (service.rs), watched beside `pid`.
/// `named`: the user's offload symbols, probed besides the known ones.
pub fn attach(
    pid: u32,
    also: &[u32],
    named: &[crate::offload_spec::OffloadSpec],
    from_now: bool,
) -> Result<Attached, WatchError> {
    loader::check_privileges()?;
    if !target::exists(pid) {
        return Err(WatchError::NoSuchPid(pid));
    }
    loader::ensure_tracefs()?;
    let loader::Loaded { mut bpf, raw_sched } = loader::load(pid)?;
    let also: Vec<u32> = also.iter().copied().filter(|&p| p != pid).collect();
    loader::watch_also(&mut bpf, &also)?;
    loader::set_epoch(&mut bpf, from_now.then_some(1))?;
    // A held command's first instructions are traced; otherwise the hot programs wait
    // for the session (Tracked::new).
    let hooks = if from_now {
        loader::Hooks::All
    } else {
        loader::Hooks::Kept
    };
    let (missing, links) = loader::attach_tracepoints(&mut bpf, raw_sched, hooks)?;
    Ok(Attached {
        bpf,
        pid,
        also,
        probes: Probes {
            named: named.to_vec(),
            ..Probes::default()
        },
        missing,
        links,
        raw_sched,
        hot: from_now,
    })
}

impl Attached {
    /// Probes the offload entry points in `files`, which process `pid` maps or will.
    pub fn probe_files(&mut self, pid: u32, files: &[String]) -> Result<(), WatchError> {
        loader::attach_uprobes(
            &mut self.bpf,
            pid,
            files,
            &mut self.probes,
            &mut self.links,
            true,
        )
    }
}

/// Why zero-edit overlap cannot hide these offloads (None: there are none).
fn unroutable_stop(names: &[String]) -> Option<String> {
    (!names.is_empty()).then(|| {
        format!(
            "the offload {} is measured but cannot be rerouted: the runtime needs its \
             non-blocking triple (--offload {}=SUBMIT:DONE:RELEASE)",
            names.join(", "),
            names[0]
        )
    })
}

/// The probed offload symbols the runtime cannot reroute: the user's without a
/// non-blocking triple, and the known GPU waits with no built-in row (a device-wide
/// synchronize or a synchronous copy: no handle to poll). Their wait is measured; an
/// injected runtime would block a carrier in it.
fn unroutable(p: &Probes) -> Vec<String> {
    let probed = |sym: &str| p.probes(sym);
    let named = p
        .named
        .iter()
        .filter(|n| n.triple.is_none() && probed(&n.symbol))
        .map(|n| n.symbol.clone());
    let gpu = target::OFFLOAD_SYMBOLS
        .iter()
        .filter(|s| **s != "accel_run" && !cuda_rows::rerouted(s) && probed(s))
        .filter(|s| {
            !p.named
                .iter()
                .any(|n| n.symbol == **s && n.triple.is_some())
        })
        .map(|s| s.to_string());
    let mut v: Vec<String> = named.chain(gpu).collect();
    v.sort();
    v.dedup();
    v
}

/// Tests only: "1" counts the runtime's counters over wall time (a deliberately
/// wrong rate source for the demo's cross-check).
pub const MIXED_CLOCK_ENV: &str = "TOFFLOAD_WATCH_TEST_MIXED_CLOCK";

/// One watched process: its programs, collector and the state windows are cut from.
struct Tracked {
    a: Attached,
    collector: Collector,
    header: Header,
    layout: Layout,
    baseline: Snapshot,
    prev: Snapshot,
    ctx: Context,
    maps_len: usize,
    counters_at: Option<u64>,
    /// The runtime's counters counted over the traced seconds only.
    rt_view: runtime_counters::TracedView,
    /// Tests only (MIXED_CLOCK_ENV): the runtime's counters over wall time, divided
    /// by traced seconds as the kernel's are, and no untraced rate: the wrong rate
    /// the demo's cross-check must catch.
    mixed_clock: bool,
    facts: model::inputs::TargetFacts,
    /// The hypervisor's steal on the target's cores, per window.
    steal: steal::Meter,
    /// Sampling: attached now, since when, traced time so far, the epoch.
    on: bool,
    on_since: Duration,
    traced: Duration,
    epoch: u64,
    /// Whether the target still runs (a pidfd).
    life: target::Liveness,
    /// The target's own counters at each edge of a burst: its rate without the watch.
    ledger: untraced::Ledger,
    /// Until when the links released by the last detach are settling (untraced.rs).
    settling_until: Option<Duration>,
    /// The watched processes: the root first, then those of the service still alive
    /// (those forked since join when their threads show in the kernel's table).
    procs: Vec<u32>,
    /// Each process's most connections seen (processes::Reader), and when they were
    /// last read.
    known: crate::processes::Reader,
    connections_read: Duration,
    /// The CPU of the last burst's attach and detach (the budget's fixed part).
    burst: crate::burst_cost::BurstCost,
    /// The watch's cost per request as measured on the target (measured_cost.rs).
    measured: crate::measured_cost::MeasuredCost,
}

impl Tracked {
    fn new(mut a: Attached, calib: &Calibration, started: Instant) -> Result<Tracked, WatchError> {
        let pid = a.pid;
        let procs: Vec<u32> = std::iter::once(pid).chain(a.also.iter().copied()).collect();
        let maps = target::maps(pid);
        a.probe_files(pid, &loader::mapped_files(&maps))?;
        // The other processes too (a worker that loaded an offload library the
        // master never did; each probe is filtered on its process).
        for p in a.also.clone() {
            a.probe_files(p, &loader::mapped_files(&target::maps(p)))?;
        }
        // A process left unprobed (probes.skipped) was not looked in: not "not found".
        for n in &a.probes.named {
            if !a.probes.probes(&n.symbol) && a.probes.skipped.is_empty() {
                a.probes.failed.push(format!(
                    "--offload {}: not found in the files the target maps{}",
                    n.symbol,
                    n.library
                        .as_deref()
                        .map(|l| format!(" (looked in {l} only)"))
                        .unwrap_or_default()
                ));
            }
        }
        let mut collector = Collector::new(&mut a.bpf)?;
        let mut header = Header {
            pid,
            also: a.also.clone(),
            comm: target::comm(pid),
            exe: target::exe(pid)
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
            runtime: target::runtime(pid),
            probes: a.probes.clone(),
            missing: a.missing.clone(),
            sched_hooks: loader::SchedHooks::of(a.raw_sched),
            context_switch_us: calib.switch_us,
            probe_cost: calib.probe_cost,
            probe_cost_source: calib.probe_cost_source,
        };
        let layout = Layout::new(
            AddressSpace::from_maps(&maps),
            a.probes.offload_modules.clone(),
        );
        // Where libtoffload.so keeps its counters in the target, once it is mapped.
        let counters_at = runtime_counters::locate(pid);
        let mut first = collector.snapshot(0.0, &procs, &layout);
        let mut known = crate::processes::Reader::default();
        first.procs = known.read(&procs, true);
        first.wall = started.elapsed().as_secs_f64();
        first.unix = metrics::unix_now();
        first.runtime = counters_at.and_then(|at| runtime_counters::read(pid, at));
        first.runtime_latency = counters_at.and_then(|at| runtime_counters::read_latency(pid, at));
        // The baseline: whatever ran between attach and now counts from zero, so that a
        // short-lived target (run mode) loses nothing.
        let baseline = Snapshot {
            t: 0.0,
            wall: first.wall,
            unix: first.unix,
            threads: first.threads.clone(),
            ..Snapshot::zero()
        };
        let ctx = Context {
            runtime: header.runtime.clone(),
            offload_probed: !a.probes.offload.is_empty(),
            root: pid,
            unroutable: unroutable(&a.probes),
        };
        let facts = model::inputs::TargetFacts::read(pid);
        let first_offloads = first.runtime.map(|c| c.offloads);
        if !a.hot {
            let (missing, links) =
                loader::attach_tracepoints(&mut a.bpf, a.raw_sched, loader::Hooks::Hot)?;
            header.missing.extend(missing);
            a.links.extend(links);
            a.hot = true;
        }
        // Idle until here unless the command's start was traced (attach).
        loader::set_epoch(&mut a.bpf, Some(1))?;
        Ok(Tracked {
            steal: steal::Meter::new(facts.cpus.clone()),
            facts,
            a,
            collector,
            header,
            layout,
            baseline,
            prev: first,
            ctx,
            maps_len: maps.len(),
            counters_at,
            rt_view: runtime_counters::TracedView::default(),
            mixed_clock: std::env::var_os(MIXED_CLOCK_ENV).is_some_and(|v| v == "1"),
            on: true,
            on_since: started.elapsed(),
            traced: Duration::ZERO,
            epoch: 1,
            life: target::Liveness::new(pid),
            ledger: {
                let mut l = untraced::Ledger::default();
                l.edge(&procs, Stretch::Neither, first_offloads);
                l
            },
            settling_until: None,
            procs,
            known,
            connections_read: started.elapsed(),
            burst: Default::default(),
            measured: Default::default(),
        })
    }

    fn pid(&self) -> u32 {
        self.a.pid
    }

    /// Reads the processes' connections every CONNECTIONS_EVERY between windows: a
    /// window's end alone may fall between a prefork child's connections, or after a
    /// load ended.
    fn sample_connections(&mut self, started: Instant) {
        if started.elapsed() >= self.connections_read + CONNECTIONS_EVERY {
            self.connections_read = started.elapsed();
            // Children forked since the last look join the list now (the kernel
            // watches them already; the windows would add them at their end).
            for c in crate::service::children(&self.procs) {
                if !self.procs.contains(&c) {
                    self.procs.push(c);
                    self.probe_joined(c);
                }
            }
            self.known.read(&self.procs, false);
        }
    }

    /// The service's processes now: those still alive, and the processes whose
    /// threads the kernel's table holds (forked since, and watched from their first
    /// instruction). The root stays first, alive or not.
    fn update_procs(&mut self, s: &Snapshot) {
        let root = self.pid();
        let mut procs = vec![root];
        let known = self.procs.iter().copied();
        let seen = s.threads.values().map(|t| t.tgid);
        for p in known.chain(seen) {
            if !procs.contains(&p) && target::exists(p) {
                procs.push(p);
            }
        }
        let joined: Vec<u32> = procs
            .iter()
            .copied()
            .filter(|p| !self.procs.contains(p))
            .collect();
        self.procs = procs;
        for p in joined {
            self.probe_joined(p);
        }
    }

    /// Probes a process that joined the service since the start (its probes are its
    /// own: attach_uprobes).
    fn probe_joined(&mut self, pid: u32) {
        // Between bursts only recorded: the next resume attaches every target.
        let files = loader::mapped_files(&target::maps(pid));
        let (a, on) = (&mut self.a, self.on);
        if let Err(e) =
            loader::attach_uprobes(&mut a.bpf, pid, &files, &mut a.probes, &mut a.links, on)
        {
            eprintln!("toffload-watch: {e}");
        }
        self.ctx.offload_probed = !self.a.probes.offload.is_empty();
        self.ctx.unroutable = unroutable(&self.a.probes);
    }

    fn traced_now(&self, started: Instant) -> Duration {
        self.traced
            + if self.on {
                started.elapsed().saturating_sub(self.on_since)
            } else {
                Duration::ZERO
            }
    }

    /// Keeps the layout (mappings, new offload libraries) current while the process
    /// lives, since a process that has exited has no mappings left to read.
    fn refresh_maps(&mut self) {
        if !self.on {
            return;
        }
        let maps = target::maps(self.pid());
        if !maps.is_empty() && maps.len() != self.maps_len {
            self.maps_len = maps.len();
            if let Err(e) = self.a.probe_files(self.pid(), &loader::mapped_files(&maps)) {
                eprintln!("toffload-watch: {e}");
            }
            self.ctx.offload_probed = !self.a.probes.offload.is_empty();
            self.ctx.unroutable = unroutable(&self.a.probes);
            self.counters_at = runtime_counters::locate(self.pid());
            self.layout = Layout::new(
                AddressSpace::from_maps(&maps),
                self.a.probes.offload_modules.clone(),
            );
        }
    }

    /// The runtime's counters as they are now.
    fn runtime_now(&self) -> Option<runtime_counters::RuntimeCounters> {
        self.counters_at
            .and_then(|at| runtime_counters::read(self.pid(), at))
    }

    /// The kernel's numbers and the runtime's counters, read together, both over
    /// the traced seconds.
    fn snapshot(&mut self, started: Instant) -> Snapshot {
        let t = self.traced_now(started);
        let mut s = self
            .collector
            .snapshot(t.as_secs_f64(), &self.procs, &self.layout);
        self.update_procs(&s);
        s.procs = self.known.read(&self.procs, true);
        s.runtime = self.runtime_now().map(|now| {
            if self.mixed_clock {
                now
            } else {
                self.rt_view.view(now)
            }
        });
        // Percentiles need no traced clock: the window's whole wall time counts.
        s.runtime_latency = self
            .counters_at
            .and_then(|at| runtime_counters::read_latency(self.pid(), at));
        s.wall = started.elapsed().as_secs_f64();
        s.unix = metrics::unix_now();
        s
    }

    /// The window so far, without closing it (the budget's early look).
    fn peek(&mut self, started: Instant) -> Window {
        let cur = self.snapshot(started);
        metrics::window(&self.prev, &cur, &self.ctx)
    }

    /// The window since the last one, with the watch's cost (`duty` and `budget` as
    /// in watch_cost) and the model, which takes that cost out of what it measured.
    fn window(
        &mut self,
        started: Instant,
        budget: Option<f64>,
        duty: f64,
        interval: Duration,
    ) -> Window {
        let cur = self.snapshot(started);
        let mut w = metrics::window(&self.prev, &cur, &self.ctx);
        self.prev = cur;
        self.ledger_edge(self.stretch());
        let off_core = self.ledger.off_core_seen();
        w.untraced = self.ledger.close(w.requests, w.offload.stall_mean_us);
        if self.mixed_clock {
            // The old rate source whole: the traced rate alone, on the mixed clock.
            w.untraced = None;
        }
        w.steal_share = self.steal.share();
        self.measured.observe(&w, off_core);
        w.watcher = watch_cost(
            &w,
            self.header.probe_cost.as_ref(),
            budget,
            duty,
            self.burst_fixed(interval),
            self.measured.us_per_request(),
        );
        w.model = self.assess(&w);
        w
    }

    /// The last burst's attach and detach CPU, per interval.
    fn burst_fixed(&self, interval: Duration) -> BurstFixed {
        BurstFixed {
            ns: self.burst.ns() as f64,
            interval,
        }
    }

    /// The model runs on stock servers only: under the runtime its inputs are gone.
    fn assess(&self, w: &Window) -> Option<model::Assessment> {
        if w.runtime_counters.is_some() || w.requests == 0 {
            return None;
        }
        let cost = model::inputs::model_costs(
            self.header.probe_cost_source,
            self.header.probe_cost.as_ref(),
            w.watcher.as_ref(),
        );
        let inputs = model::inputs::from_window(
            w,
            self.header.context_switch_us,
            cost.as_ref(),
            &self.facts,
        );
        let mut a = model::assess(
            w.verdict.kind,
            inputs.as_ref(),
            &self.header.comm,
            Some(self.header.runtime.kind),
        );
        if let Some(why) = unroutable_stop(&self.ctx.unroutable) {
            a.stop.get_or_insert(why);
        }
        Some(a)
    }

    /// Sampling: detach for the rest of the interval once a burst has been traced
    /// (counted from when tracing resumed, which attaching delays past the window's
    /// start).
    fn maybe_pause(&mut self, started: Instant, burst: Duration) -> Result<(), WatchError> {
        let elapsed = started.elapsed();
        if self.on && elapsed >= self.on_since + burst {
            let sink = self.burst.detach_sink();
            crate::burst_cost::booked(&sink, || loader::set_epoch(&mut self.a.bpf, None))?;
            // Right after the programs stop counting, so the /proc counters' traced
            // stretch spans the same requests (the untraced rate's calls per request).
            self.ledger_edge(Stretch::Traced);
            // Reading the thread table is part of what a burst costs.
            crate::burst_cost::booked(&sink, || self.collector.close_open_stretches(self.epoch));
            self.rt_view.paused(self.runtime_now());
            crate::burst_cost::booked(&sink, || {
                loader::detach_burst(&mut self.a.bpf, &mut self.a.links, &sink)
            });
            self.traced += elapsed.saturating_sub(self.on_since);
            self.on = false;
            self.settling_until =
                Some(started.elapsed() + Duration::from_secs_f64(untraced::SETTLE_SECS));
        }
        Ok(())
    }

    /// Books the stretch since the ledger's last edge as `was`.
    fn ledger_edge(&mut self, was: Stretch) {
        let offloads = self.runtime_now().map(|c| c.offloads);
        self.ledger.edge(&self.procs, was, offloads);
    }

    /// What the stretch since the ledger's last edge has been.
    fn stretch(&self) -> Stretch {
        match (self.on, self.settling_until) {
            (true, _) => Stretch::Traced,
            (false, Some(_)) => Stretch::Neither,
            (false, None) => Stretch::Untraced,
        }
    }

    /// Ends the settling after a detach: from here the target runs untraced.
    fn settle(&mut self, started: Instant) {
        if self
            .settling_until
            .is_some_and(|t| !self.on && started.elapsed() >= t)
        {
            self.ledger_edge(Stretch::Neither);
            self.settling_until = None;
        }
    }

    fn resume(&mut self, started: Instant) -> Result<(), WatchError> {
        if self.on {
            return Ok(());
        }
        self.ledger_edge(self.stretch());
        self.settling_until = None;
        self.epoch += 1;
        let epoch = self.epoch;
        let (a, burst) = (&mut self.a, &self.burst);
        burst.attach(|| -> Result<(), WatchError> {
            let (_, links) =
                loader::attach_tracepoints(&mut a.bpf, a.raw_sched, loader::Hooks::Hot)?;
            a.links.extend(links);
            loader::reattach_uprobes(&mut a.bpf, &mut a.probes, &mut a.links)?;
            Ok(())
        })?;
        // Attaching counts for neither part. The traced stretch starts at this reading
        // and the programs count from right after it: read after them, the /proc
        // counters missed the calls of the reading's own time, which in a 10 ms burst
        // put the untraced rate of redis-server 6-11% above its own count.
        self.ledger_edge(Stretch::Neither);
        // After the tracepoints, so an offload is never timed without them.
        loader::set_epoch(&mut self.a.bpf, Some(epoch))?;
        self.rt_view.resumed(self.runtime_now());
        self.on = true;
        self.on_since = started.elapsed();
        Ok(())
    }

    fn final_report(&mut self, started: Instant, ended: Ended) -> Final {
        // A last read, so that what happened since the last window (or up to the exit)
        // counts.
        let mut last = self.snapshot(started);
        if last.live_threads == 0 {
            last.live_threads = self.prev.live_threads;
        }
        let mut total = metrics::window(&self.baseline, &last, &self.ctx);
        total.watcher = watch_cost(
            &total,
            self.header.probe_cost.as_ref(),
            None,
            1.0,
            BurstFixed::NONE,
            self.measured.us_per_request(),
        );
        total.model = self.assess(&total);
        let mut threads: Vec<ThreadRow> = last
            .threads
            .iter()
            .map(|(&tid, t)| ThreadRow::from(tid, t))
            .collect();
        let pid = self.pid();
        threads.sort_by_key(|t| (t.tid != pid, std::cmp::Reverse(t.voluntary + t.involuntary)));
        threads.truncate(20);
        let namer = crate::symbols::Namer::new(pid);
        let futex_stacks = last
            .futex_stacks
            .iter()
            .map(|(calls, frames)| crate::report::StackRow {
                calls: *calls,
                frames: namer.frame_names(&self.layout.space, frames),
            })
            .collect();
        Final {
            ended,
            total,
            threads,
            futex_stacks,
            injection: None,
            inject_outcome: None,
        }
    }
}

/// Where an injection stands in this watch.
#[derive(Default)]
struct InjectState {
    tracker: Tracker,
    outcome: Option<InjectAction>,
    /// The injection that is up and its plan: what a rollback needs, until its health
    /// window has passed (then it moves to `child`).
    up: Option<(inject::Plan, inject::Injected)>,
    health: Option<Health>,
    /// When the injected server's sockets and runtime were last looked at.
    probed: Option<Instant>,
    /// The relaunched process (kept so that it is reaped if it dies during the watch).
    child: Option<inject::Relaunched>,
}

/// How often, in its health window, the injected server's sockets and runtime are
/// looked at (its exit is seen at every poll).
const HEALTH_PROBE_EVERY: Duration = Duration::from_millis(100);

/// A short poll: notices the user's keys and an injection's progress quickly.
const POLL: Duration = Duration::from_millis(20);

/// The longest the loop sleeps with nothing due: how late the target's exit may be
/// seen. Each wake-up costs the watch's CPU, which on a loaded host is taken from the
/// target or its clients.
const MAX_POLL: Duration = Duration::from_millis(100);

/// Watches until the end; renders through `sink` and returns the final report.
/// `calib` is measured before attaching (Calibration::measure), so that a command
/// started for the watch does not run ahead of it.
pub async fn run(
    a: Attached,
    calib: &Calibration,
    opts: &Options,
    sink: &mut dyn Sink,
) -> Result<Final, WatchError> {
    // Installed first (before "attached" is announced) and once, so that a signal
    // arriving at any point, even between two polls, ends the watch with a report.
    let signal = |kind| {
        tokio::signal::unix::signal(kind)
            .map_err(|e| WatchError::Other(format!("installing a signal handler: {e}")))
    };
    let mut sigint = signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut sigterm = signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut watch = WatchSession::start(a, calib, opts, sink)?;
    let ended = loop {
        if let Step::End(why) = watch.step()? {
            break why;
        }
        watch.prio.set(watch.phase());
        let nap = watch.next_poll();
        let due = Instant::now() + nap;
        tokio::select! {
            _ = tokio::time::sleep(nap) => {
                watch.prio.woke(Instant::now().saturating_duration_since(due));
            }
            _ = sigint.recv() => break Ended::Interrupted,
            _ = sigterm.recv() => break Ended::Terminated,
        }
    };
    // The final report is waited for.
    watch.prio.set(Phase::Due);
    watch.finish(ended)
}

/// One watch under way: the watched process, the sampling and window clock, and the
/// injection, with what it runs under. One method per step of a poll.
struct WatchSession<'a> {
    tr: Tracked,
    inj: InjectState,
    opts: &'a Options,
    calib: &'a Calibration,
    sink: &'a mut dyn Sink,
    started: Instant,
    /// When the current window closes (since `started`).
    next_window: Duration,
    /// Share of each interval traced.
    duty: f64,
    /// How many of this interval's early looks (EARLY_LOOKS) were taken.
    looked: usize,
    windows_emitted: u32,
    /// The thread's priority, which follows the phase (watch_priority.rs).
    prio: WatchPriority,
}

enum Step {
    Continue,
    End(Ended),
}

impl<'a> WatchSession<'a> {
    /// Reads the attached process's start and announces the watch.
    fn start(
        a: Attached,
        calib: &'a Calibration,
        opts: &'a Options,
        sink: &'a mut dyn Sink,
    ) -> Result<WatchSession<'a>, WatchError> {
        let started = Instant::now();
        let tr = Tracked::new(a, calib, started)?;
        sink.emit(Event::Header(&tr.header))?;
        if let Some(why) = &calib.probe_cost_error {
            let c = probe_cost::DEFAULT_COST;
            // One line: the text report's status goes to stderr, the dashboard's to its
            // status line.
            let msg = format!(
                "warning: {why}; the watch's cost per event is taken as syscall {:.0} ns, \
                 switch {:.0} ns, offload {:.0} ns",
                c.syscall_ns, c.switch_ns, c.offload_ns
            );
            sink.status(&msg);
        }
        // Tests and scripts wait for this line before loading the target.
        eprintln!("toffload-watch: attached to pid {}", tr.pid());
        Ok(WatchSession {
            tr,
            inj: InjectState::default(),
            opts,
            calib,
            sink,
            started,
            next_window: opts.interval,
            duty: opts.sample.clamp(MIN_DUTY, 1.0),
            looked: 0,
            windows_emitted: 0,
            prio: WatchPriority::new(),
        })
    }

    /// One poll: sampling, the ends, the window when due, the user's keys, and an
    /// injection when one is asked for.
    fn step(&mut self) -> Result<Step, WatchError> {
        self.early_look();
        let sampled = self.sample()?;
        if let Step::End(why) = self.check_end()? {
            return Ok(Step::End(why));
        }
        self.tr.refresh_maps();
        self.tr.sample_connections(self.started);
        let mut inject_now = None;
        if self.started.elapsed() >= self.next_window {
            if let Step::End(why) = self.window(sampled)? {
                return Ok(Step::End(why));
            }
            inject_now = self.inject_due();
        }
        match self.sink.poll() {
            Some(UserCmd::Quit) => return Ok(Step::End(Ended::Quit)),
            Some(UserCmd::Inject) => inject_now = self.inject_key().or(inject_now),
            None => {}
        }
        match inject_now {
            Some(io) => self.inject(&io),
            None => Ok(Step::Continue),
        }
    }

    /// What sets the thread's priority until the next wake-up: Due while attached (the
    /// burst's end is next, and every moment of it costs the host's syscalls) and
    /// until the settling after it ends (the reading there starts the untraced
    /// stretch the window's rate without the watch is read from: at the idle policy,
    /// beside a server and a load tool that fill their CPUs, it can wait on the run
    /// queue until the interval is over, all of it booked as settling), while a person
    /// is at the keys, and around an injection; Between otherwise.
    fn phase(&self) -> Phase {
        if self.tr.on
            || self.tr.settling_until.is_some()
            || self.sink.interactive()
            || self.deciding()
            || self.inj.health.is_some()
            || self.inj.up.is_some()
        {
            Phase::Due
        } else {
            Phase::Between
        }
    }

    /// How long the loop may sleep: until the next thing due (a burst's end, the
    /// window, an early look, a connection reading, the settling's end, the
    /// duration), at most MAX_POLL; POLL while a person is at the keys or an
    /// injection is to be decided or under way.
    fn next_poll(&self) -> Duration {
        if self.sink.interactive()
            || self.deciding()
            || self.inj.health.is_some()
            || self.inj.up.is_some()
        {
            return POLL;
        }
        let mut due = vec![
            self.next_window,
            self.tr.connections_read + CONNECTIONS_EVERY,
        ];
        if self.tr.on && self.duty < 1.0 {
            due.push(self.tr.on_since + self.opts.interval.mul_f64(self.duty));
        }
        due.extend(self.tr.settling_until);
        due.extend(self.early_look_at());
        due.extend(self.opts.duration);
        let next = due.into_iter().min().unwrap_or(MAX_POLL);
        next.saturating_sub(self.started.elapsed())
            .clamp(Duration::from_millis(1), MAX_POLL)
    }

    /// When this interval's next early look is due (EARLY_LOOKS; None: none is).
    fn early_look_at(&self) -> Option<Duration> {
        self.opts.overhead_budget?;
        if self.duty < 1.0 || !self.tr.on {
            return None;
        }
        let window_start = self.next_window.saturating_sub(self.opts.interval);
        let from = window_start.max(self.tr.on_since);
        EARLY_LOOKS
            .get(self.looked)
            .map(|&d| from + d.min(self.opts.interval / 4))
    }

    /// Under a budget, an interval traced in full is looked at EARLY_LOOKS after
    /// tracing began in it: a server whose events cost more than the budget is then
    /// traced for the budget's share of this interval already, not only from the next.
    fn early_look(&mut self) {
        let Some(budget) = self.opts.overhead_budget else {
            return;
        };
        let due = self
            .early_look_at()
            .is_some_and(|t| self.started.elapsed() >= t);
        if due {
            self.looked += 1;
            let w = self.tr.peek(self.started);
            let cost = self.calib.probe_cost.as_ref();
            let fixed = self.tr.burst_fixed(self.opts.interval);
            let measured = self.tr.measured.us_per_request();
            if let Some(c) = watch_cost(&w, cost, Some(budget), self.duty, fixed, measured) {
                self.duty = c.duty;
            }
        }
    }

    /// An --inject decision is still to be made (from whole windows).
    fn deciding(&self) -> bool {
        self.opts.inject.is_some() && self.inj.outcome.is_none()
    }

    /// Detaches for the rest of the interval once its burst is traced; whether this
    /// interval is sampled.
    fn sample(&mut self) -> Result<bool, WatchError> {
        // Until an --inject decision is made every event is traced (a few windows; the
        // budget applies after).
        if self.deciding() {
            self.duty = 1.0;
            self.looked = EARLY_LOOKS.len();
        }
        let sampled = self.duty < 1.0;
        if sampled {
            let burst = self.opts.interval.mul_f64(self.duty);
            self.tr.maybe_pause(self.started, burst)?;
        }
        self.tr.settle(self.started);
        Ok(sampled)
    }

    /// The ends other than the user's: the health window's verdict, the duration, the
    /// process's exit.
    fn check_end(&mut self) -> Result<Step, WatchError> {
        // An injection in its health window is judged before anything else: a crash
        // there is rolled back, not reported as the watched process's exit, and the
        // watch's duration waits for the verdict (a watch that ended first would leave
        // a sick server in place).
        if self.inj.health.is_some() {
            if let Step::End(why) = self.health_step()? {
                return Ok(Step::End(why));
            }
        }
        if let Some(d) = self.opts.duration {
            if self.started.elapsed() >= d && self.inj.health.is_none() {
                return Ok(Step::End(Ended::Duration));
            }
        }
        // Seen dead here while in the health window (it died since the look above):
        // that is the health window's to judge, which rolls it back.
        if self.inj.health.is_some() && !self.tr.life.alive() {
            if let Step::End(why) = self.health_step()? {
                return Ok(Step::End(why));
            }
        }
        if !self.tr.life.alive() {
            return Ok(Step::End(Ended::ProcessExited));
        }
        Ok(Step::Continue)
    }

    /// Closes the window: its cost sets the next duty, the injection's view of it,
    /// then out; resumes tracing after a sampled interval.
    fn window(&mut self, sampled: bool) -> Result<Step, WatchError> {
        self.next_window += self.opts.interval;
        self.looked = 0;
        let deciding = self.deciding();
        let mut w = self.tr.window(
            self.started,
            self.opts.overhead_budget,
            self.duty,
            self.opts.interval,
        );
        if let Some(c) = &mut w.watcher {
            if deciding {
                c.duty = 1.0;
            }
            self.duty = c.duty;
        }
        if let Some(h) = &mut self.inj.health {
            h.window(w.requests > 0 || crate::inject_flow::served_rps(&w) > 0.0);
        }
        if self.inj.tracker.status.is_some() {
            w.injection = self.inj.tracker.after(&w);
        } else {
            self.inj.tracker.stock(&w);
        }
        self.sink.emit(Event::Window(&w))?;
        self.windows_emitted += 1;
        if self.opts.windows.is_some_and(|n| self.windows_emitted >= n) {
            return Ok(Step::End(Ended::Count));
        }
        if sampled || self.duty < 1.0 {
            // Attached but not yet counting, the programs cost the host already.
            self.prio.set(Phase::Due);
            self.tr.resume(self.started)?;
        }
        Ok(Step::Continue)
    }

    /// --inject's options once its windows are in and nothing was injected yet.
    fn inject_due(&self) -> Option<inject::Options> {
        let req = self.opts.inject.as_ref()?;
        (self.inj.outcome.is_none() && self.inj.tracker.windows_seen() >= req.after_windows)
            .then(|| req.opts.clone())
    }

    /// The dashboard's key i: a plan or a refusal can be asked again (the verdict may
    /// have changed); anything else is said once.
    fn inject_key(&mut self) -> Option<inject::Options> {
        if matches!(
            self.inj.outcome,
            None | Some(InjectAction::Plan | InjectAction::Refused | InjectAction::Unreproducible)
        ) {
            return Some(self.opts.interactive_inject.clone());
        }
        self.sink.status(&format!(
            "not injecting again: this watch already did ({})",
            self.inj.outcome.map_or("-", InjectAction::as_str)
        ));
        None
    }

    /// The final report over the whole watch, with the injection's outcome.
    fn finish(mut self, ended: Ended) -> Result<Final, WatchError> {
        let mut fin = self.tr.final_report(self.started, ended);
        fin.injection = self.inj.tracker.status.clone();
        fin.inject_outcome = self.inj.outcome;
        if ended == Ended::ProcessExited {
            eprintln!(
                "toffload-watch: pid {} exited; final report follows",
                self.tr.pid()
            );
        }
        self.sink.emit(Event::Final(&fin))?;
        // A relaunched server outlives the watch: the child handle is dropped, not killed.
        drop(self.inj.child.take());
        drop(self.inj.up.take());
        Ok(fin)
    }

    fn event(&self, action: InjectAction, message: String) -> InjectEvent {
        let (predicted_speedup, predicted_rps) = self.inj.tracker.predicted();
        InjectEvent {
            action,
            old_pid: self.tr.pid(),
            new_pid: None,
            verdict: self.inj.tracker.verdict_text(),
            message,
            before_rps: self.inj.tracker.before_rps(),
            predicted_speedup,
            predicted_rps,
            plan: None,
        }
    }

    /// Moves the watch to `pid`: fresh programs filtered on it, announced with a new
    /// header after `e`.
    fn follow(&mut self, pid: u32, e: &InjectEvent) -> Result<(), WatchError> {
        let a = attach(pid, &[], &self.tr.a.probes.named, false)?;
        self.tr = Tracked::new(a, self.calib, self.started)?;
        self.sink.emit(Event::Inject(e))?;
        self.sink.emit(Event::Header(&self.tr.header))
    }

    /// Injects as `io` says (or plans, or refuses); windows restart from an injection,
    /// and the new process's cost is looked at afresh.
    fn inject(&mut self, io: &inject::Options) -> Result<Step, WatchError> {
        // A process started from an idle thread would inherit the idle policy.
        self.prio.set(Phase::Due);
        let step = self.try_inject(io)?;
        if let Step::Continue = step {
            self.next_window = self.started.elapsed() + self.opts.interval;
            self.duty = self.opts.sample.clamp(MIN_DUTY, 1.0);
            self.looked = 0;
        }
        Ok(step)
    }

    fn try_inject(&mut self, io: &inject::Options) -> Result<Step, WatchError> {
        let plan = match self.decide(io) {
            Ok(p) => p,
            Err(err) => return self.refused(err),
        };
        if io.dry_run {
            let mut e = self.event(InjectAction::Plan, "dry run: nothing was changed".into());
            e.plan = Some(plan.describe());
            self.sink.emit(Event::Inject(&e))?;
            self.inj.outcome = Some(InjectAction::Plan);
            return Ok(Step::Continue);
        }
        self.sink.status(&format!(
            "injecting the fiber runtime into pid {}...",
            self.tr.pid()
        ));
        match inject::execute(&plan) {
            Ok(up) => self.injected(plan, up),
            Err(f) => self.inject_failed(f),
        }
    }

    /// The verdict allows it (or --force), every offload can be rerouted, and the
    /// command can be restarted: the plan.
    fn decide(&self, io: &inject::Options) -> Result<inject::Plan, inject::PlanError> {
        self.inj
            .tracker
            .decide(io.force)
            .and_then(|()| match unroutable_stop(&self.tr.ctx.unroutable) {
                Some(why) if !io.force => Err(why),
                _ => Ok(()),
            })
            .map_err(|why| {
                inject::PlanError::Cannot(format!("not injecting: {why} (--force overrides)"))
            })
            .and_then(|()| inject::plan(self.tr.pid(), io))
    }

    /// No plan: said, and at the keys the user may try again; a scripted --inject
    /// ends here.
    fn refused(&mut self, err: inject::PlanError) -> Result<Step, WatchError> {
        let (action, msg) = match err {
            inject::PlanError::Cannot(msg) if msg.starts_with("not injecting") => {
                (InjectAction::Refused, msg)
            }
            e @ inject::PlanError::Cannot(_) => (InjectAction::Refused, e.to_string()),
            e @ inject::PlanError::Unreproducible(_) => {
                (InjectAction::Unreproducible, e.to_string())
            }
        };
        let e = self.event(action, msg);
        self.sink.emit(Event::Inject(&e))?;
        self.inj.outcome = Some(action);
        Ok(if self.sink.interactive() {
            Step::Continue
        } else {
            Step::End(Ended::InjectionRefused)
        })
    }

    /// Up under the runtime: the watch follows the new pid, and its health window
    /// (if any) starts.
    fn injected(&mut self, plan: inject::Plan, up: inject::Injected) -> Result<Step, WatchError> {
        let old = self.tr.pid();
        let new_pid = up.server.pid;
        self.inj.tracker.injected(old, new_pid);
        let health = if plan.health.is_zero() {
            String::new()
        } else {
            format!(
                "; its {:.0} s health window runs",
                plan.health.as_secs_f64()
            )
        };
        let mut e = self.event(
            InjectAction::Injected,
            format!(
                "pid {old} restarted under {} as pid {new_pid}; listening again{health}",
                plan.runtime.display()
            ),
        );
        e.new_pid = Some(new_pid);
        if !plan.health.is_zero() {
            // Requests are expected when the original served some.
            let busy = self.inj.tracker.before_rps().is_some_and(|r| r > 0.0);
            self.inj.health = Some(Health::new(Instant::now(), plan.health, busy));
            self.inj.probed = None;
        }
        self.inj.up = Some((plan, up));
        self.inj.outcome = Some(InjectAction::Injected);
        self.follow(new_pid, &e)?;
        Ok(Step::Continue)
    }

    /// The restart failed: the original command runs again (followed), or not at all.
    fn inject_failed(&mut self, f: inject::Failure) -> Result<Step, WatchError> {
        let (action, new_pid, msg) = match &f {
            inject::Failure::NotStarted(_) => (InjectAction::Refused, None, f.to_string()),
            inject::Failure::Restored { restored, .. } => {
                (InjectAction::Failed, Some(restored.pid), f.to_string())
            }
            inject::Failure::Down { .. } => (InjectAction::Down, None, f.to_string()),
        };
        let mut e = self.event(action, msg);
        e.new_pid = new_pid;
        self.inj.outcome = Some(action);
        if let inject::Failure::Restored { restored, .. } = f {
            let pid = restored.pid;
            self.inj.child = Some(restored);
            self.follow(pid, &e)?;
        } else {
            self.sink.emit(Event::Inject(&e))?;
        }
        Ok(match action {
            InjectAction::Down => Step::End(Ended::ServerDown),
            InjectAction::Refused if !self.sink.interactive() => Step::End(Ended::InjectionRefused),
            _ => Step::Continue,
        })
    }

    /// One look at an injection in its health window: still pending, healthy (the
    /// injection stands), or sick (rolled back to the original command).
    fn health_step(&mut self) -> Result<Step, WatchError> {
        let now = Instant::now();
        let Some(seen) = self.observe(now) else {
            return Ok(Step::Continue);
        };
        let Some(h) = &mut self.inj.health else {
            return Ok(Step::Continue);
        };
        let limit = h.limit();
        match h.check(now, &seen) {
            Check::Pending => Ok(Step::Continue),
            Check::Healthy => self.healthy(limit),
            Check::Sick(why) => self.sick(&why, limit),
        }
    }

    /// What the health window judges: the injected server's exit, and (every
    /// HEALTH_PROBE_EVERY) its reads, sockets and runtime. None: nothing is up.
    fn observe(&mut self, now: Instant) -> Option<Observed> {
        let (Some(h), Some((plan, up))) = (&mut self.inj.health, &mut self.inj.up) else {
            return None;
        };
        let mut seen = Observed {
            // A leader that has exited shows as a zombie before its last thread is gone
            // (and before it can be reaped): the watch's own liveness sees it first.
            exited: up
                .server
                .exited()
                .or_else(|| (!self.tr.life.alive()).then(|| "exited".to_string())),
            ..Observed::default()
        };
        let due = self
            .inj
            .probed
            .is_none_or(|t| now - t >= HEALTH_PROBE_EVERY);
        if seen.exited.is_none() && due {
            self.inj.probed = Some(now);
            if let Some(n) = inject::health::read_calls(up.server.pid) {
                h.reads(n);
            }
            let have = inject::process::listening(up.server.pid);
            seen.missing_ports = Some(plan.ports.difference(&have).map(|l| l.port).collect());
            seen.runtime_disabled = self
                .tr
                .runtime_now()
                .is_some_and(|c| c.state == toffload_abi::runtime::RuntimeState::Disabled);
        }
        Some(seen)
    }

    /// Served through its health window: the injection stands.
    fn healthy(&mut self, limit: Duration) -> Result<Step, WatchError> {
        let (plan, up) = self.inj.up.take().expect("an injection is up");
        let pid = up.server.pid;
        let mut e = self.event(
            InjectAction::Healthy,
            format!(
                "pid {pid} served through its {:.0} s health window: the injection stands",
                limit.as_secs_f64()
            ),
        );
        e.new_pid = Some(pid);
        e.old_pid = plan.old_pid;
        self.inj.health = None;
        self.inj.child = Some(up.server);
        self.inj.outcome = Some(InjectAction::Healthy);
        self.sink.emit(Event::Inject(&e))?;
        Ok(Step::Continue)
    }

    /// Failed its health window: rolled back to the original command, which the watch
    /// follows, or the server is down.
    fn sick(&mut self, sick: &Sick, limit: Duration) -> Result<Step, WatchError> {
        let (plan, up) = self.inj.up.take().expect("an injection is up");
        self.inj.health = None;
        self.inj.tracker.rolled_back();
        let sick_pid = up.server.pid;
        self.sink.status(&format!(
            "the injected server pid {sick_pid} failed its health window: {sick}; rolling back..."
        ));
        let why = format!(
            "the injected server (pid {sick_pid}) failed its {:.0} s health window: {sick}",
            limit.as_secs_f64()
        );
        let (action, message, new_pid) = match inject::rollback(&plan, up) {
            Ok(restored) => {
                let pid = restored.pid;
                self.inj.child = Some(restored);
                let msg = format!(
                    "{why}; rolled back: the original command runs again as pid {pid}, \
                     without the runtime"
                );
                (InjectAction::RolledBack, msg, Some(pid))
            }
            Err(recovery) => {
                let msg = format!(
                    "{why}; restarting the original command failed too: {recovery}. The \
                     server is DOWN"
                );
                (InjectAction::Down, msg, None)
            }
        };
        let mut e = self.event(action, message);
        e.old_pid = plan.old_pid;
        e.new_pid = new_pid;
        self.inj.outcome = Some(action);
        match new_pid {
            Some(pid) => {
                self.follow(pid, &e)?;
                Ok(Step::Continue)
            }
            None => {
                self.sink.emit(Event::Inject(&e))?;
                Ok(Step::End(Ended::ServerDown))
            }
        }
    }
}

/// When an interval traced in full is looked at under a budget: first early, so that
/// a server whose events cost far more than the budget is traced in full for a few
/// tens of ms only (traced in full for 200 ms, stock nginx and redis-server lost a
/// quarter of a quarter second's requests at attach), then again on more events, for
/// a server that was idle at the first look.
const EARLY_LOOKS: [Duration; 2] = [Duration::from_millis(25), Duration::from_millis(200)];

/// How often the processes' connections are read between windows.
const CONNECTIONS_EVERY: Duration = Duration::from_millis(250);

/// The least share of an interval traced under a budget: below it a burst sees too
/// few requests to say anything (a target busy enough goes lower: duty_floor).
pub const MIN_DUTY: f64 = 0.02;

/// The least share of an interval a busy target's bursts may shrink to under a budget,
/// as long as each still sees BURST_REQUESTS requests: at 2% a busy server's events
/// can cost it more than the budget (stock nginx serving a file, its cost measured on
/// it: about 0.9% of its CPU, against the default 0.5%).
pub const LEAST_DUTY: f64 = 0.005;

/// The requests a burst below MIN_DUTY must still see, at the window's traced rate:
/// with fewer, the edges of each burst move the untraced rate (its calls per request)
/// by several percent.
const BURST_REQUESTS: f64 = 1000.0;

/// The least duty for the target of `w`: MIN_DUTY, or down to LEAST_DUTY where it
/// serves enough requests that a shorter burst still sees BURST_REQUESTS of them.
pub fn duty_floor(w: &Window, interval: Duration) -> f64 {
    if w.requests == 0 || w.secs <= 0.0 {
        return MIN_DUTY;
    }
    let per_interval = w.requests as f64 / w.secs * interval.as_secs_f64();
    (BURST_REQUESTS / per_interval).clamp(LEAST_DUTY, MIN_DUTY)
}

/// What is measured once at start.
pub struct Calibration {
    pub switch_us: Option<f64>,
    /// Measured, or DEFAULT_COST where the measurement failed or ran out of time.
    pub probe_cost: Option<ProbeCost>,
    pub probe_cost_source: probe_cost::CostSource,
    /// Why the cost per event could not be measured (said once the watch is on).
    pub probe_cost_error: Option<String>,
}

/// The switch cost's fallback measurement, on a thread of its own, has this long.
const SWITCH_DEADLINE: Duration = Duration::from_secs(1);

impl Calibration {
    /// The context-switch cost and the watch's cost per event (a fraction of a second;
    /// at most probe_cost::DEADLINE + SWITCH_DEADLINE on a host that starves it).
    /// `child_nice`: the nice value the calibration child's loops run at; `avoid`:
    /// CPUs the target runs on, tried last; `fresh`: measure even where this boot
    /// has a measurement kept (calibration_cache.rs).
    pub fn measure(child_nice: i32, avoid: &[usize], fresh: bool) -> Calibration {
        let key = calibration_cache::Key::current();
        if let Some(e) = key
            .as_ref()
            .filter(|_| !fresh)
            .and_then(calibration_cache::load)
        {
            return Calibration {
                switch_us: e.switch_us,
                probe_cost: Some(e.probe_cost),
                probe_cost_source: probe_cost::CostSource::Cached,
                probe_cost_error: None,
            };
        }
        let (probe_cost, probe_cost_source, probe_cost_error) =
            match probe_cost::measure(child_nice, avoid) {
                Ok(c) => (c, probe_cost::CostSource::Measured, None),
                Err(why) => (
                    probe_cost::DEFAULT_COST,
                    probe_cost::CostSource::Default,
                    Some(why),
                ),
            };
        // The child's untraced ping-pong is the switch cost, measured undisturbed;
        // without it, the same on a thread of ours, given a deadline: it pins itself
        // to the CPU it starts on, which may be one it gets little of.
        let switch_us = if probe_cost.handoff_ns > 0.0 {
            Some(probe_cost.handoff_ns / 1e3)
        } else {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(calibrate::context_switch_us(2000));
            });
            rx.recv_timeout(SWITCH_DEADLINE).ok().flatten()
        };
        // Only a full measurement is kept: a default stands in for one start.
        if let (Some(k), probe_cost::CostSource::Measured) = (&key, probe_cost_source) {
            calibration_cache::store(k, probe_cost, switch_us);
        }
        Calibration {
            switch_us,
            probe_cost: Some(probe_cost),
            probe_cost_source,
            probe_cost_error,
        }
    }
}

/// A burst's fixed cost: the CPU of its attach and detach (burst_cost.rs), once per
/// interval while sampled.
#[derive(Clone, Copy, Debug)]
pub struct BurstFixed {
    pub ns: f64,
    pub interval: Duration,
}

impl BurstFixed {
    pub const NONE: BurstFixed = BurstFixed {
        ns: 0.0,
        interval: Duration::from_secs(1),
    };
}

/// The window's watch cost, and the share of the next interval to trace: all of it
/// when the per-event cost (the target's and the host's other processes') is within
/// the budget (no burst, so no attach or detach),
/// else what the budget leaves after a burst's fixed cost, over the per-event cost
/// (at least duty_floor), so that the cost averaged over the interval stays near the
/// budget.
///
/// `measured`: the cost per request measured on the target (us; MeasuredCost), which
/// stands in for the calibration's where it is higher.
pub fn watch_cost(
    w: &Window,
    cost: Option<&ProbeCost>,
    budget: Option<f64>,
    duty: f64,
    fixed: BurstFixed,
    measured: Option<f64>,
) -> Option<metrics::WatcherCost> {
    let cost = cost?;
    let calibrated = cost.added_ns(&probe_cost::Events {
        syscalls: w.syscalls,
        switches: w.switches.voluntary + w.switches.involuntary,
        offloads: w.offload.calls,
    });
    let requests = w.requests as f64;
    let measured_ns = measured
        .filter(|_| w.requests > 0)
        .map(|us| us * 1e3 * requests);
    let (added, basis) = match measured_ns {
        Some(m) if m > calibrated => (m, metrics::CostBasis::Measured),
        _ => (calibrated, metrics::CostBasis::Calibrated),
    };
    let on_ns = w.on_cpu_ms * 1e6;
    let share = if on_ns > 0.0 {
        (added / on_ns).min(1.0)
    } else {
        0.0
    };
    let host_share = if on_ns > 0.0 {
        (w.host_syscalls as f64 * cost.host_syscall_ns / on_ns).min(1.0)
    } else {
        0.0
    };
    // The target's CPU over an interval, at the rate it ran at while traced.
    let interval_ns = on_ns / w.secs.max(1e-9) * fixed.interval.as_secs_f64();
    let burst_share = if interval_ns > 0.0 {
        (fixed.ns / interval_ns).min(1.0)
    } else {
        0.0
    };
    Some(metrics::WatcherCost {
        us_per_request: (w.requests > 0).then(|| added / requests / 1e3),
        share_traced: share,
        calibrated_us_per_request: (w.requests > 0).then(|| calibrated / requests / 1e3),
        measured_us_per_request: measured,
        basis,
        host_share,
        burst_share,
        // The neighbours' part is paid up to the target's own: a load tool on the host
        // makes about as many syscalls as the server it drives, so that much slows the
        // target's own traffic; beyond it is unrelated work, which charged in full
        // against a light target's CPU held it at the floor duty, where bursts too
        // short for its requests counted a quarter fewer of them (serve's test).
        duty: next_duty(
            (on_ns > 0.0).then_some(metrics::WatcherCost::charged_share(share, host_share)),
            burst_share,
            budget,
            duty,
            duty_floor(w, fixed.interval),
        ),
        budget,
    })
}

/// The share of the next interval to trace, from the cost's share of the target's CPU
/// while tracing (None: the target did not run, which says nothing about its cost)
/// and a burst's fixed share of it over the interval, at least `floor` (duty_floor).
pub fn next_duty(
    share: Option<f64>,
    fixed: f64,
    budget: Option<f64>,
    duty: f64,
    floor: f64,
) -> f64 {
    match (budget, share) {
        (Some(b), Some(s)) if s <= b => 1.0,
        (Some(b), Some(s)) => ((b - fixed) / s).clamp(floor, 1.0),
        _ => duty,
    }
}

#[cfg(test)]
mod tests {
    use super::{next_duty, unroutable, MIN_DUTY};
    use crate::loader::{ProbeTarget, Probes};
    use crate::offload_spec::OffloadSpec;

    #[test]
    fn gpu_waits_without_a_row_are_unroutable() {
        let mut p = Probes::default();
        let probe = |p: &mut Probes, s: &str| {
            p.targets.push(ProbeTarget {
                pid: 1,
                path: "libcudart.so".into(),
                symbol: s.into(),
                offset: 0,
            })
        };
        probe(&mut p, "cudaStreamSynchronize");
        probe(&mut p, "cuEventSynchronize");
        probe(&mut p, "accel_run");
        assert!(unroutable(&p).is_empty(), "{:?}", unroutable(&p));
        // No handle to poll: a device-wide synchronize and a synchronous copy.
        probe(&mut p, "cudaDeviceSynchronize");
        probe(&mut p, "cudaMemcpy");
        assert_eq!(unroutable(&p), ["cudaDeviceSynchronize", "cudaMemcpy"]);
        // The user's triple for one makes it routable; a named symbol without one
        // is not.
        p.named.push(OffloadSpec {
            symbol: "cudaMemcpy".into(),
            library: None,
            triple: Some(["s".into(), "d".into(), "r".into()]),
        });
        p.named.push(OffloadSpec {
            symbol: "hsm_sign".into(),
            library: None,
            triple: None,
        });
        probe(&mut p, "hsm_sign");
        assert_eq!(unroutable(&p), ["cudaDeviceSynchronize", "hsm_sign"]);
    }

    #[test]
    fn the_duty_follows_the_budget() {
        // Within the budget: trace everything.
        assert_eq!(next_duty(Some(0.01), 0.0, Some(0.02), 0.1, MIN_DUTY), 1.0);
        // ... whatever a burst would cost: tracing everything needs none.
        assert_eq!(next_duty(Some(0.01), 0.05, Some(0.02), 0.1, MIN_DUTY), 1.0);
        // Ten times the budget: a tenth of each interval.
        assert!((next_duty(Some(0.2), 0.0, Some(0.02), 1.0, MIN_DUTY) - 0.1).abs() < 1e-12);
        // A burst's attach and detach take their share of the budget first.
        assert!((next_duty(Some(0.2), 0.005, Some(0.02), 1.0, MIN_DUTY) - 0.075).abs() < 1e-12);
        // Never below the floor, however costly, the fixed part included.
        assert_eq!(
            next_duty(Some(1.0), 0.0, Some(0.001), 1.0, MIN_DUTY),
            MIN_DUTY
        );
        assert_eq!(
            next_duty(Some(0.2), 0.03, Some(0.02), 1.0, MIN_DUTY),
            MIN_DUTY
        );
        // No budget (--sample): the fixed share stays.
        assert_eq!(next_duty(Some(0.5), 0.0, None, 0.3, MIN_DUTY), 0.3);
        // An idle window keeps the last duty.
        assert_eq!(next_duty(None, 0.0, Some(0.02), 0.25, MIN_DUTY), 0.25);
        // A lower floor (a busy target) lets the budget's share through.
        assert!((next_duty(Some(0.4), 0.0, Some(0.004), 1.0, 0.005) - 0.01).abs() < 1e-12);
        assert_eq!(next_duty(Some(4.0), 0.0, Some(0.004), 1.0, 0.005), 0.005);
    }

    #[test]
    fn a_busy_targets_floor_still_sees_its_requests() {
        let prev = crate::collector::Snapshot::zero();
        let mut cur = crate::collector::Snapshot::zero();
        let ctx = crate::metrics::tests::ctx();
        let s1 = std::time::Duration::from_secs(1);
        // 20 ms traced: no requests; 1000 (50k/s: 2% sees BURST_REQUESTS), 2000
        // (100k/s: 1% does), 4000 (200k/s: 0.5%), 20000 (1M/s: 0.1%, below the least).
        cur.t = 0.02;
        let w = |cur: &crate::collector::Snapshot| crate::metrics::window(&prev, cur, &ctx);
        let floor = |n: u64, interval| {
            let mut c = cur.clone();
            c.counters[crate::abi::C_OFFLOAD_CALLS as usize] = n;
            super::duty_floor(&w(&c), interval)
        };
        assert_eq!(floor(0, s1), MIN_DUTY);
        assert_eq!(floor(400, s1), MIN_DUTY);
        assert!((floor(1000, s1) - MIN_DUTY).abs() < 1e-12);
        assert!((floor(2000, s1) - 0.01).abs() < 1e-12);
        assert!((floor(4000, s1) - super::LEAST_DUTY).abs() < 1e-12);
        assert_eq!(floor(20_000, s1), super::LEAST_DUTY);
        // 100k/s over a 5 s interval: 0.2% would see BURST_REQUESTS; the least holds.
        assert_eq!(floor(2000, s1 * 5), super::LEAST_DUTY);
    }

    /// The host's other syscalls are paid from the budget beside the target's own.
    #[test]
    fn the_hosts_syscalls_cost_the_budget() {
        use crate::abi;
        use crate::collector::Snapshot;
        use crate::probe_cost::ProbeCost;
        let prev = Snapshot::zero();
        let mut cur = Snapshot::zero();
        cur.t = 1.0;
        cur.wall = 1.0;
        // 100 ms of the target's CPU, 100k of its own syscalls (getppid, nr 110) and
        // 200k of other processes'.
        cur.counters[abi::C_ON_NS as usize] = 100_000_000;
        cur.counters[abi::C_HOST_SYSCALLS as usize] = 200_000;
        cur.syscalls[110 * 2] = 100_000;
        let w = crate::metrics::window(&prev, &cur, &crate::metrics::tests::ctx());
        assert_eq!((w.syscalls, w.host_syscalls), (100_000, 200_000));
        let cost = ProbeCost {
            syscall_ns: 100.0,
            host_syscall_ns: 25.0,
            ..Default::default()
        };
        let cost_of = |w: &crate::metrics::Window, budget: f64, measured: Option<f64>| {
            super::watch_cost(
                w,
                Some(&cost),
                Some(budget),
                1.0,
                super::BurstFixed::NONE,
                measured,
            )
            .expect("a cost")
        };
        let c = cost_of(&w, 0.02, None);
        // 10 ms and 5 ms of 100 ms.
        assert!((c.share_traced - 0.10).abs() < 1e-9, "{c:?}");
        assert!((c.host_share - 0.05).abs() < 1e-9, "{c:?}");
        // 2% over 15%, where the target's own cost alone would give 20%.
        assert!((c.duty - 0.02 / 0.15).abs() < 1e-9, "{c:?}");
        // A busy host beside a light target: its part is paid up to the target's own
        // (here 1% of 100 ms: 10k syscalls), not the whole of it (200k).
        cur.syscalls[110 * 2] = 10_000;
        let w = crate::metrics::window(&prev, &cur, &crate::metrics::tests::ctx());
        let c = cost_of(&w, 0.015, None);
        assert!((c.host_share - 0.05).abs() < 1e-9, "{c:?}");
        assert!((c.duty - 0.015 / 0.02).abs() < 1e-9, "{c:?}");
        cur.syscalls[110 * 2] = 100_000;
        // Without neighbours the target's cost alone sets it.
        cur.counters[abi::C_HOST_SYSCALLS as usize] = 0;
        let w = crate::metrics::window(&prev, &cur, &crate::metrics::tests::ctx());
        let c = cost_of(&w, 0.02, None);
        assert!((c.duty - 0.2).abs() < 1e-9, "{c:?}");
        assert_eq!(c.basis, crate::metrics::CostBasis::Calibrated);
        // 1000 requests: the calibration's 10 ms are 10 us each. Measured on the target
        // at 30 us, the cost is three times that, and the duty a third.
        cur.counters[abi::C_OFFLOAD_CALLS as usize] = 1000;
        let w = crate::metrics::window(&prev, &cur, &crate::metrics::tests::ctx());
        assert_eq!(w.requests, 1000);
        let fixed = super::BurstFixed::NONE;
        let c =
            super::watch_cost(&w, Some(&cost), Some(0.02), 1.0, fixed, Some(30.0)).expect("a cost");
        assert_eq!(c.basis, crate::metrics::CostBasis::Measured);
        assert!((c.us_per_request.unwrap() - 30.0).abs() < 1e-9, "{c:?}");
        assert!(
            (c.calibrated_us_per_request.unwrap() - 10.0).abs() < 1e-9,
            "{c:?}"
        );
        assert!((c.share_traced - 0.30).abs() < 1e-9, "{c:?}");
        assert!((c.duty - 0.02 / 0.30).abs() < 1e-9, "{c:?}");
        // Measured below the calibration: the calibration stands.
        let c =
            super::watch_cost(&w, Some(&cost), Some(0.02), 1.0, fixed, Some(4.0)).expect("a cost");
        assert_eq!(c.basis, crate::metrics::CostBasis::Calibrated);
        assert_eq!(c.measured_us_per_request, Some(4.0));
        assert!((c.share_traced - 0.10).abs() < 1e-9, "{c:?}");
    }
}
