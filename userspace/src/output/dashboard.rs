//! `--tui`: the watch rendered by the ratatui dashboard (the toffload-tui crate). This
//! file only translates the watcher's reports into the dashboard's view model and the
//! dashboard's keys into session commands.

use crate::error::WatchError;
use crate::metrics::Window;
use crate::report::Header;
use crate::sink::{Event, Sink, UserCmd};
use std::time::Duration;
use toffload_abi::runtime::GuardMode;
use toffload_tui as tui;

pub struct DashboardSink {
    d: Option<tui::Dashboard>,
    state: tui::State,
    switch_us: Option<f64>,
    /// TOFFLOAD_TUI_TEST_PANIC=1: panic once the first window is on screen, so that
    /// the tmux test (userspace/tests/dashboard.rs) can check the real watcher gives
    /// the terminal back after a panic. A test hook, not a feature.
    test_panic: bool,
}

/// The test hook's variable; only the exact value `1` arms it.
pub const TEST_PANIC_ENV: &str = "TOFFLOAD_TUI_TEST_PANIC";
/// What the armed hook panics with (the test looks for it on stderr).
pub const TEST_PANIC_MESSAGE: &str = "TOFFLOAD_TUI_TEST_PANIC: panicking after the first window";

impl DashboardSink {
    pub fn enter() -> std::io::Result<DashboardSink> {
        Ok(DashboardSink {
            d: Some(tui::Dashboard::enter()?),
            state: tui::State {
                status: "attaching...".into(),
                ..Default::default()
            },
            switch_us: None,
            test_panic: std::env::var(TEST_PANIC_ENV).is_ok_and(|v| v == "1"),
        })
    }

    /// Restores the terminal (also done on drop and on panic by the dashboard).
    pub fn leave(&mut self) {
        if let Some(d) = self.d.take() {
            let _ = d.leave();
        }
    }

    fn redraw(&mut self) -> Result<(), WatchError> {
        if let Some(d) = self.d.as_mut() {
            d.draw(&self.state)
                .map_err(|e| WatchError::Other(format!("drawing the dashboard: {e}")))?;
        }
        Ok(())
    }

    fn header(&mut self, h: &Header) {
        self.switch_us = h.context_switch_us;
        self.state.target = tui::Target {
            pid: h.pid,
            command: if h.exe.is_empty() {
                h.comm.clone()
            } else {
                h.exe.clone()
            },
            runtime: h.runtime.kind.label().to_string(),
            threads: self.state.target.threads,
        };
        self.state.status = format!("watching pid {}", h.pid);
    }

    fn window(&mut self, w: &Window) {
        self.state.target.threads = w.threads;
        self.state.verdict = Some(tui::VerdictView {
            label: w.verdict.label.to_string(),
            fiberizable: w.verdict.kind == crate::classifier::Kind::Fiberizable,
            because: w.verdict.because.clone(),
        });
        if let Some(a) = &w.model {
            self.state.prediction = Some(prediction(a));
        }
        if let Some(st) = &w.injection {
            self.state.injection = Some(tui::InjectionView {
                // The panel shows measured and predicted speedups itself.
                state: "injected".into(),
                old_pid: Some(st.old_pid),
                new_pid: Some(st.new_pid),
                before_rps: Some(st.before_rps),
                after_rps: st.after_rps,
                predicted_speedup: st.predicted_speedup,
            });
        }
        self.state.guard = w.runtime_counters.as_ref().and_then(|r| {
            (r.guard != GuardMode::Off).then(|| tui::GuardView {
                mode: r.guard.name().to_string(),
                faults: r.guard_faults,
                conflicts: r.guard_conflicts,
                serialized: r.guard_serialized,
            })
        });
        if let Some(d) = self.d.as_mut() {
            d.push_window(view(w, self.switch_us));
        }
    }
}

fn prediction(a: &crate::model::Assessment) -> tui::PredictionView {
    match &a.zero_edit {
        Some(p) => tui::PredictionView {
            speedup: Some(p.speedup),
            predicted_rps: Some(p.fiber_rps),
            binding: p.binding.label().to_string(),
            stop: a.stop.clone(),
            inputs: p.lines(),
            recipe: a.recipe_text.clone(),
        },
        None => tui::PredictionView {
            speedup: a.zero_edit_speedup,
            predicted_rps: None,
            binding: "-".into(),
            stop: a.stop.clone(),
            inputs: Vec::new(),
            recipe: a.recipe_text.clone(),
        },
    }
}

pub fn view(w: &Window, switch_us: Option<f64>) -> tui::WindowView {
    tui::WindowView {
        t_s: w.start_s + w.secs,
        requests_per_sec: w.requests_per_sec,
        request_source: w.request_source.to_string(),
        stall_p50_us: w.offload.stall_p50_us,
        stall_p99_us: w.offload.stall_p99_us,
        spin_share: w.offload.spin_share,
        stall_hist: w.offload.stall_hist_us.clone(),
        futex_per_request: w
            .futex_per_request
            .as_ref()
            .map(|p| p.libc + p.raw + p.offload + p.unknown),
        raw_futex_per_request: w.futex_per_request.as_ref().map(|p| p.raw),
        voluntary_per_sec: w.switches.voluntary_per_sec,
        involuntary_per_sec: w.switches.involuntary_per_sec,
        wakeup_p50_us: w.wakeup_p50_us,
        wakeup_p99_us: w.wakeup_p99_us,
        cpu_per_request_us: w.cpu_per_request_us,
        context_switch_us: switch_us,
        syscalls: w
            .syscalls_top
            .iter()
            .map(|r| tui::SyscallView {
                name: r.name.clone(),
                per_sec: r.per_sec,
                mean_us: r.mean_us,
            })
            .collect(),
        processes: w
            .processes
            .iter()
            .map(|p| tui::ProcessView {
                pid: p.pid,
                comm: p.comm.clone(),
                role: match p.role {
                    crate::processes::Role::Main => "main",
                    crate::processes::Role::Child => "child",
                }
                .into(),
                model: p.model.label().into(),
                reads_per_sec: p.reads_per_sec,
                threads: p.threads,
                connections: p.connections,
            })
            .collect(),
        latency: w.runtime_latency.as_ref().map(|l| tui::LatencyView {
            p50_us: l.request.p50_us,
            p99_us: l.request.p99_us,
            p999_us: l.request.p999_us,
            offload_wait_p50_us: l.offload_wait.p50_us,
        }),
    }
}

impl Sink for DashboardSink {
    fn emit(&mut self, e: Event) -> Result<(), WatchError> {
        match e {
            Event::Header(h) => self.header(h),
            Event::Window(w) => {
                self.window(w);
                self.redraw()?;
                if self.test_panic {
                    panic!("{TEST_PANIC_MESSAGE}");
                }
                return Ok(());
            }
            Event::Inject(i) => {
                self.state.status = format!("inject [{}]: {}", i.action, i.message);
                let v = self.state.injection.get_or_insert_with(Default::default);
                v.state = i.action.to_string();
                v.old_pid = Some(i.old_pid);
                v.new_pid = i.new_pid;
                v.before_rps = i.before_rps;
                v.predicted_speedup = i.predicted_speedup;
            }
            Event::Final(f) => {
                self.state.status = format!("watch ended: {}", f.ended);
            }
        }
        self.redraw()
    }

    fn status(&mut self, msg: &str) {
        self.state.status = msg.to_string();
        let _ = self.redraw();
    }

    fn interactive(&self) -> bool {
        true
    }

    fn poll(&mut self) -> Option<UserCmd> {
        let d = self.d.as_mut()?;
        match d.poll(Duration::ZERO) {
            Ok(Some(tui::Command::Quit)) => Some(UserCmd::Quit),
            Ok(Some(tui::Command::Inject)) => Some(UserCmd::Inject),
            Ok(Some(tui::Command::Pause(p))) => {
                self.state.paused = p;
                let _ = self.redraw();
                None
            }
            // Keys and resizes are redrawn by the dashboard itself.
            Ok(None) => None,
            // The terminal is gone: nothing more can be shown or asked.
            Err(_) => Some(UserCmd::Quit),
        }
    }
}

impl Drop for DashboardSink {
    fn drop(&mut self) {
        self.leave();
    }
}
