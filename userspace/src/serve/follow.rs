//! One target's life in the service, on a thread of its own: search, attach, watch
//! (the session, with its process-tree following and overhead budget) until the
//! target goes away, then search again every interval, so that a restarted server is
//! followed under its new pid. A thread per target keeps one target's start (loading
//! the programs through the verifier takes a few hundred ms) from delaying another's
//! windows.

use super::config::Target;
use super::state::{Phase, ServeSink, Shared};
use super::targets::{self, Found};
use crate::report::Ended;
use crate::session::{self, Calibration, Options};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything one target's thread needs.
pub struct Follow {
    pub index: usize,
    pub target: Target,
    pub shared: Shared,
    pub opts: Options,
    pub calib: Arc<Calibration>,
    pub stop: Arc<AtomicBool>,
}

/// How one attach ended.
enum Outcome {
    /// The target's root exited: search again.
    Gone(String),
    /// It could not be attached or watched: search again, and say why.
    Failed(String),
    /// The service is stopping.
    Stopped,
}

impl Follow {
    /// Runs until the service stops.
    pub fn run(self) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let why = format!("cannot start a runtime for this target: {e}");
                eprintln!("toffload-watch: [{}] {why}", self.target.name);
                self.set_searching(why.clone(), Some(why));
                return;
            }
        };
        rt.block_on(self.follow());
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    fn set_searching(&self, why: String, error: Option<String>) {
        self.shared.update(self.index, |t| {
            t.phase = Phase::Searching { why };
            if error.is_some() {
                t.last_error = error;
            }
        });
    }

    async fn follow(&self) {
        let mut said_absent = false;
        while !self.stopped() {
            match targets::find(&self.target.selector) {
                Found::Absent(why) => {
                    // Said once per absence, not each interval.
                    if !said_absent {
                        eprintln!("toffload-watch: [{}] searching: {why}", self.target.name);
                        said_absent = true;
                    }
                    self.set_searching(why, None);
                }
                Found::Running(set) => {
                    said_absent = false;
                    match self.watch(set).await {
                        Outcome::Stopped => return,
                        Outcome::Gone(why) => {
                            eprintln!("toffload-watch: [{}] {why}; searching", self.target.name);
                            self.set_searching(why, None);
                        }
                        Outcome::Failed(why) => {
                            eprintln!("toffload-watch: [{}] {why}", self.target.name);
                            self.set_searching(why.clone(), Some(why));
                        }
                    }
                }
            }
            self.pause(self.opts.interval).await;
        }
    }

    /// Sleeps `d`, ending early when the service stops.
    async fn pause(&self, d: Duration) {
        let until = Instant::now() + d;
        while !self.stopped() && Instant::now() < until {
            let left = until.saturating_duration_since(Instant::now());
            tokio::time::sleep(left.min(Duration::from_millis(50))).await;
        }
    }

    /// One attach: watched until the root exits or the service stops.
    async fn watch(&self, set: crate::service::Set) -> Outcome {
        let root = set.root;
        self.shared
            .update(self.index, |t| t.phase = Phase::Attaching { pid: root });
        let a = match session::attach(root, &set.all, &self.opts.offloads, false) {
            Ok(a) => a,
            Err(e) => return Outcome::Failed(format!("attaching to pid {root}: {e}")),
        };
        self.shared.update(self.index, |t| t.attaches += 1);
        let mut sink = ServeSink {
            shared: self.shared.clone(),
            index: self.index,
            name: self.target.name.clone(),
            stop: self.stop.clone(),
        };
        match session::run(a, &self.calib, &self.opts, &mut sink).await {
            Ok(fin) => match fin.ended {
                Ended::Quit | Ended::Interrupted | Ended::Terminated => Outcome::Stopped,
                Ended::ProcessExited => {
                    self.shared.update(self.index, |t| t.exits += 1);
                    Outcome::Gone(format!("pid {root} exited"))
                }
                other => {
                    Outcome::Gone(format!("the watch of pid {root} ended: {}", other.as_str()))
                }
            },
            Err(e) => Outcome::Failed(format!("watching pid {root}: {e}")),
        }
    }
}
