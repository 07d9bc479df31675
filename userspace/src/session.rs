//! A watch from start to end: checks, load and attach, the calibration, then one
//! window per interval until the duration passes, the process exits or the user
//! interrupts; then the final report over the whole watch.

use crate::calibrate;
use crate::collector::{Collector, Snapshot};
use crate::error::WatchError;
use crate::futex::Layout;
use crate::loader::{self, Probes};
use crate::metrics::{self, Context};
use crate::report::{self, Final, Header, ThreadRow};
use crate::target::{self, AddressSpace};
use aya::Ebpf;
use std::io::Write;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct Options {
    pub interval: Duration,
    pub duration: Option<Duration>,
    pub json: bool,
    /// Share of each interval the programs are attached (1.0: always). Between bursts
    /// the watched process runs untraced; rates are per traced second.
    pub sample: f64,
}

/// Loaded, attached and filtering on `pid`; not yet reading.
pub struct Attached {
    pub bpf: Ebpf,
    pub pid: u32,
    pub probes: Probes,
    pub missing: Vec<String>,
    pub links: Vec<loader::Link>,
    /// Scheduler hooks as raw tracepoints (else classic ones).
    pub raw_sched: bool,
}

/// Privileges, tracefs, load, tracepoints, and the pid into the filter. Uprobes
/// follow (attach_uprobes) once the files to probe are known.
pub fn attach(pid: u32) -> Result<Attached, WatchError> {
    loader::check_privileges()?;
    if !target::exists(pid) {
        return Err(WatchError::NoSuchPid(pid));
    }
    loader::ensure_tracefs()?;
    let loader::Loaded { mut bpf, raw_sched } = loader::load(pid)?;
    loader::set_epoch(&mut bpf, Some(1))?;
    let (missing, links) = loader::attach_tracepoints(&mut bpf, raw_sched)?;
    Ok(Attached {
        bpf,
        pid,
        probes: Probes::default(),
        missing,
        links,
        raw_sched,
    })
}

impl Attached {
    pub fn probe_files(&mut self, files: &[String]) -> Result<(), WatchError> {
        loader::attach_uprobes(
            &mut self.bpf,
            self.pid,
            files,
            &mut self.probes,
            &mut self.links,
        )
    }
}

/// Watches until the end; writes windows and the final report to `out`, and returns
/// the final report.
pub async fn run(
    mut a: Attached,
    opts: &Options,
    out: &mut dyn Write,
) -> Result<Final, WatchError> {
    let pid = a.pid;
    // Installed first (before "attached" is announced) and once, so that a signal
    // arriving at any point, even between two polls, ends the watch with a report.
    let signal = |kind| {
        tokio::signal::unix::signal(kind)
            .map_err(|e| WatchError::Other(format!("installing a signal handler: {e}")))
    };
    let mut sigint = signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut sigterm = signal(tokio::signal::unix::SignalKind::terminate())?;
    let maps = target::maps(pid);
    a.probe_files(&loader::mapped_files(&maps))?;
    let mut collector = Collector::new(&mut a.bpf)?;
    let header = Header {
        pid,
        comm: target::comm(pid),
        exe: target::exe(pid)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default(),
        runtime: target::runtime(pid),
        probes: a.probes.clone(),
        missing: a.missing.clone(),
        context_switch_us: calibrate::context_switch_us(2000),
    };
    emit(out, opts.json, "header", &header, || {
        report::header_text(&header)
    })?;
    // Tests and scripts wait for this line before loading the target.
    eprintln!("toffload-watch: attached to pid {pid}");

    let start = Instant::now();
    let mut layout = Layout::new(
        AddressSpace::from_maps(&maps),
        a.probes.offload_modules.clone(),
    );
    let first = collector.snapshot(0.0, &[pid], &layout);
    // The baseline: whatever ran between attach and now counts from zero, so that a
    // short-lived target (run mode) loses nothing.
    let baseline = Snapshot {
        t: 0.0,
        threads: first.threads.clone(),
        ..Snapshot::zero()
    };
    let mut prev = first;
    let mut ctx = Context {
        runtime: header.runtime.clone(),
        offload_probed: !a.probes.offload.is_empty(),
    };
    // A short poll: notices the exit quickly, and keeps the layout (mappings, new
    // offload libraries) current while the process lives, since a process that has
    // exited has no mappings left to read.
    let poll = Duration::from_millis(20);
    let mut next_window = opts.interval;
    let mut maps_len = maps.len();
    // Where libtoffload.so keeps its counters in the target, once it is mapped.
    let mut counters_at = crate::runtime_counters::locate(pid);
    // Sampling: attached for the first `sample` share of each interval. The clock
    // the windows use counts traced time only.
    let sampled = opts.sample < 1.0;
    let burst = opts.interval.mul_f64(opts.sample.clamp(0.01, 1.0));
    let (mut on, mut on_since, mut traced) = (true, start.elapsed(), Duration::ZERO);
    let mut epoch = 1u64;
    let traced_now = |on: bool, on_since: Duration, traced: Duration| {
        traced
            + if on {
                start.elapsed().saturating_sub(on_since)
            } else {
                Duration::ZERO
            }
    };
    let ended;
    loop {
        let elapsed = start.elapsed();
        if sampled && on && elapsed >= next_window.saturating_sub(opts.interval) + burst {
            loader::set_epoch(&mut a.bpf, None)?;
            loader::detach(&mut a.bpf, &mut a.links);
            traced += elapsed.saturating_sub(on_since);
            on = false;
        }
        if let Some(d) = opts.duration {
            if elapsed >= d {
                ended = "duration";
                break;
            }
        }
        if !target::alive(pid) {
            ended = "process exited";
            break;
        }
        let maps = if on { target::maps(pid) } else { Vec::new() };
        if !maps.is_empty() && maps.len() != maps_len {
            maps_len = maps.len();
            if let Err(e) = a.probe_files(&loader::mapped_files(&maps)) {
                eprintln!("toffload-watch: {e}");
            }
            ctx.offload_probed = !a.probes.offload.is_empty();
            counters_at = crate::runtime_counters::locate(pid);
            layout = Layout::new(
                AddressSpace::from_maps(&maps),
                a.probes.offload_modules.clone(),
            );
        }
        if elapsed >= next_window {
            next_window += opts.interval;
            let t = traced_now(on, on_since, traced);
            let cur = collector.snapshot(t.as_secs_f64(), &[pid], &layout);
            let mut w = metrics::window(&prev, &cur, &ctx);
            w.runtime_counters = counters_at.and_then(|at| crate::runtime_counters::read(pid, at));
            emit(out, opts.json, "window", &w, || {
                report::window_text(&w, "window")
            })?;
            prev = cur;
            if !on {
                epoch += 1;
                let (_, links) = loader::attach_tracepoints(&mut a.bpf, a.raw_sched)?;
                a.links.extend(links);
                loader::reattach_uprobes(&mut a.bpf, pid, &a.probes, &mut a.links)?;
                // After the tracepoints, so an offload is never timed without them.
                loader::set_epoch(&mut a.bpf, Some(epoch))?;
                on = true;
                on_since = start.elapsed();
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = sigint.recv() => { ended = "interrupted"; break; }
            _ = sigterm.recv() => { ended = "terminated"; break; }
        }
    }
    // A last read, so that what happened since the last window (or up to the exit)
    // counts.
    let t = traced_now(on, on_since, traced);
    let mut last = collector.snapshot(t.as_secs_f64(), &[pid], &layout);
    if last.live_threads == 0 {
        last.live_threads = prev.live_threads;
    }
    let mut total = metrics::window(&baseline, &last, &ctx);
    total.runtime_counters = counters_at.and_then(|at| crate::runtime_counters::read(pid, at));
    let mut threads: Vec<ThreadRow> = last
        .threads
        .iter()
        .map(|(&tid, t)| ThreadRow::from(tid, t))
        .collect();
    threads.sort_by_key(|t| (t.tid != pid, std::cmp::Reverse(t.voluntary + t.involuntary)));
    threads.truncate(20);
    let futex_stacks = last
        .futex_stacks
        .iter()
        .map(|(calls, frames)| report::StackRow {
            calls: *calls,
            frames: report::symbolize(&layout.space, frames),
        })
        .collect();
    let fin = Final {
        ended: ended.to_string(),
        total,
        threads,
        futex_stacks,
    };
    if ended == "process exited" {
        eprintln!("toffload-watch: pid {pid} exited; final report follows");
    }
    emit(out, opts.json, "final", &fin, || report::final_text(&fin))?;
    Ok(fin)
}

fn emit<T: serde::Serialize>(
    out: &mut dyn Write,
    json: bool,
    key: &str,
    v: &T,
    text: impl FnOnce() -> String,
) -> Result<(), WatchError> {
    let s = if json {
        report::json_line(key, v) + "\n"
    } else {
        text()
    };
    out.write_all(s.as_bytes())
        .and_then(|_| out.flush())
        .map_err(|e| WatchError::Other(format!("writing the report: {e}")))
}
