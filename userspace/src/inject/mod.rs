//! Injection: restart a watched server under the bundled fiber runtime, as it was
//! started (command line, environment, working directory, user), wait until it serves
//! on the same ports again, and hand its new pid back to the watch. When the relaunch
//! fails (it exits, does not listen, or its runtime disables itself) the original
//! command is started again the same way and the failure is reported.

pub mod bundle;
pub mod launch;
pub mod process;

use process::{Launch, Listen};
use serde::Serialize;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

/// How to inject.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Print the plan, change nothing.
    pub dry_run: bool,
    /// Inject even when the verdict says it will not work.
    pub force: bool,
    /// Extra environment for the relaunched process only (runtime knobs such as
    /// TOFFLOAD_GUARD=detect).
    pub env: Vec<(String, String)>,
}

/// Everything the injection will do, decided before anything is touched.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub old_pid: u32,
    /// The original command, for the relaunch under the runtime and for recovery.
    pub original: Launch,
    /// The same, with the runtime preloaded and the extra knobs.
    pub injected: Launch,
    pub runtime: PathBuf,
    /// Ports the server listens on now, which the relaunch must listen on again.
    pub ports: BTreeSet<Listen>,
}

pub fn plan(pid: u32, opts: &Options) -> Result<Plan, String> {
    let original = Launch::read(pid)?;
    let runtime = bundle::path()?;
    let mut injected = original.clone();
    // Ours first: the runtime must interpose before anything else preloaded.
    let preload = match original.getenv("LD_PRELOAD") {
        Some(p) if p.split([' ', ':']).any(|x| x.contains("libtoffload")) => {
            return Err(format!("pid {pid} already runs with LD_PRELOAD={p}"));
        }
        Some(p) if !p.trim().is_empty() => format!("{}:{p}", runtime.display()),
        _ => runtime.display().to_string(),
    };
    injected.setenv("LD_PRELOAD", preload);
    for (k, v) in &opts.env {
        injected.setenv(k, v.clone());
    }
    Ok(Plan {
        old_pid: pid,
        original,
        injected,
        runtime,
        ports: process::listening(pid),
    })
}

fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

impl Plan {
    /// What --dry-run prints: every step, exactly.
    pub fn describe(&self) -> String {
        let l = &self.injected;
        let added: Vec<String> = l
            .env
            .iter()
            .filter(|kv| !self.original.env.contains(kv))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let ports: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("{}{}", p.port, if p.v6 { " (v6)" } else { "" }))
            .collect();
        format!(
            "inject plan for pid {}:\n  1. write the bundled runtime to {} (if not there)\n  \
             2. take pid {}'s stdin/stdout/stderr (pidfd_getfd)\n  3. stop pid {}: SIGTERM, \
             SIGKILL after 5 s\n  4. start, in a new session, as uid {} gid {} groups {:?}, in {}:\n       \
             {} (exe {})\n     with its environment ({} variables) plus: {}\n  5. wait until it \
             listens on {} and its runtime reports itself active (at most {:.0} s)\n  6. if it \
             does not: stop it and start the original command the same way, without the \
             runtime\n",
            self.old_pid,
            self.runtime.display(),
            self.old_pid,
            self.old_pid,
            l.uid,
            l.gid,
            l.groups,
            l.cwd.display(),
            shell_words(&l.argv),
            l.exe.display(),
            self.original.env.len(),
            added.join(" "),
            if ports.is_empty() {
                "(no TCP port now: waits 1 s alive)".to_string()
            } else {
                format!("port {}", ports.join(", "))
            },
            READY_LIMIT.as_secs_f64(),
        )
    }
}

/// How long the relaunched server may take to listen again.
pub const READY_LIMIT: Duration = Duration::from_secs(15);

/// The relaunched process (ours until the watcher exits; it outlives the watcher).
pub struct Relaunched {
    pub child: std::process::Child,
    pub pid: u32,
}

#[derive(Debug)]
pub enum Failure {
    /// Nothing was changed (the old process still runs).
    NotStarted(String),
    /// The relaunch failed; the original command runs again as `restored`.
    Restored { why: String, restored: Relaunched },
    /// The relaunch failed and so did the recovery: the server is down.
    Down { why: String, recovery: String },
}

impl std::fmt::Debug for Relaunched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {}", self.pid)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::NotStarted(why) => write!(f, "injection not started: {why}"),
            Failure::Restored { why, restored } => write!(
                f,
                "injection failed: {why}; the original command runs again as pid {}",
                restored.pid
            ),
            Failure::Down { why, recovery } => write!(
                f,
                "injection failed: {why}; restarting the original command failed too: \
                 {recovery}. The server is DOWN"
            ),
        }
    }
}

/// Starts `l` and waits until it serves (its runtime active when `runtime`); a start
/// that does not get there is stopped and reaped.
fn start_serving(
    l: &Launch,
    stdio: &[Option<std::os::fd::OwnedFd>; 3],
    ports: &BTreeSet<Listen>,
    runtime: bool,
) -> Result<Relaunched, String> {
    let mut child = launch::spawn(l, stdio)?;
    let ready = launch::Ready {
        ports,
        runtime,
        limit: READY_LIMIT,
    };
    match launch::wait_ready(&mut child, &ready) {
        Ok(()) => {
            let pid = child.id();
            Ok(Relaunched { child, pid })
        }
        Err(e) => {
            launch::kill(&mut child);
            Err(e)
        }
    }
}

/// Runs the plan.
pub fn execute(p: &Plan) -> Result<Relaunched, Failure> {
    bundle::install().map_err(Failure::NotStarted)?;
    if !process::running(p.old_pid) {
        return Err(Failure::NotStarted(format!("pid {} is gone", p.old_pid)));
    }
    let stdio = launch::take_stdio(p.old_pid);
    launch::stop(p.old_pid, Duration::from_secs(5)).map_err(Failure::NotStarted)?;
    let why = match start_serving(&p.injected, &stdio, &p.ports, true) {
        Ok(r) => return Ok(r),
        Err(why) => why,
    };
    // Recovery: the original command, exactly as it was.
    Err(match start_serving(&p.original, &stdio, &p.ports, false) {
        Ok(restored) => Failure::Restored { why, restored },
        Err(recovery) => Failure::Down { why, recovery },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(
            shell_words(&["a".into(), "b c".into(), "it's".into(), "--x=1".into()]),
            "a 'b c' 'it'\\''s' --x=1"
        );
    }
}
