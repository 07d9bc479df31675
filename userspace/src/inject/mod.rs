//! Injection: restart a watched server under the bundled fiber runtime, as it was
//! started (command line, environment, working directory, user, limits, cgroup,
//! umask, OOM adjustment), wait until it serves on the same ports again, and hand its
//! new pid back to the watch. A server of a systemd unit is restarted through its
//! unit instead (systemd.rs). A target whose credentials a relaunch cannot reproduce
//! is refused before anything is touched (credentials.rs). When the relaunch fails
//! (it exits, does not listen, or its runtime disables itself), or later fails its
//! health window (health.rs), the original command is started again the same way and
//! the failure is reported.

pub mod bundle;
pub mod credentials;
pub mod flow;
pub mod health;
pub mod launch;
pub mod process;
pub mod resources;
pub mod systemd;

use process::{Launch, Listen};
use serde::Serialize;
use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::Duration;

/// How to inject.
#[derive(Clone, Debug)]
pub struct Options {
    /// Print the plan, change nothing.
    pub dry_run: bool,
    /// Inject even when the verdict says it will not work.
    pub force: bool,
    /// Extra environment for the relaunched process only (runtime knobs such as
    /// TOFFLOAD_GUARD=detect).
    pub env: Vec<(String, String)>,
    /// How long the injected server must keep serving before the injection stands
    /// (zero: not watched; it stands once ready).
    pub health: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            dry_run: false,
            force: false,
            env: Vec::new(),
            health: health::DEFAULT_WINDOW,
        }
    }
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
    /// A relaunch, or a restart through its systemd unit.
    pub route: systemd::Route,
    pub health: Duration,
}

/// Why there is no plan. Both change nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanError {
    /// The target cannot be read or relaunched (gone, already injected, no runtime).
    Cannot(String),
    /// Its credentials (or its unit) cannot be reproduced by a relaunch.
    Unreproducible(String),
}

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanError::Cannot(why) => write!(f, "cannot inject: {why}"),
            PlanError::Unreproducible(why) => {
                write!(f, "cannot reproduce the target's credentials: {why}")
            }
        }
    }
}

pub fn plan(pid: u32, opts: &Options) -> Result<Plan, PlanError> {
    plan_inner(pid, opts, systemd::running())
}

fn plan_inner(pid: u32, opts: &Options, systemd_running: bool) -> Result<Plan, PlanError> {
    let original = Launch::read(pid).map_err(PlanError::Cannot)?;
    let runtime = bundle::path().map_err(PlanError::Cannot)?;
    let ports = process::listening(pid);
    credentials::check_pid(pid, &original.exe, &ports)
        .map_err(PlanError::Cannot)?
        .map_err(|u| PlanError::Unreproducible(u.to_string()))?;
    let mut injected = original.clone();
    // Ours first: the runtime must interpose before anything else preloaded.
    let preload = match original.getenv("LD_PRELOAD") {
        Some(p) if p.split([' ', ':']).any(|x| x.contains("libtoffload")) => {
            return Err(PlanError::Cannot(format!(
                "pid {pid} already runs with LD_PRELOAD={p}"
            )));
        }
        Some(p) if !p.trim().is_empty() => format!("{}:{p}", runtime.display()),
        _ => runtime.display().to_string(),
    };
    injected.setenv("LD_PRELOAD", preload);
    for (k, v) in &opts.env {
        injected.setenv(k, v.clone());
    }
    let route = systemd::route(
        original.res.cgroup_path.as_deref(),
        systemd_running,
        &added_env(&original, &injected),
    );
    match &route {
        systemd::Route::Refuse(why) => return Err(PlanError::Unreproducible(why.clone())),
        // A relaunch is our child: it can take only what we can give (a unit's
        // limits are systemd's to apply).
        systemd::Route::Relaunch if original.env_overwritten => {
            return Err(PlanError::Cannot(format!(
                "pid {pid} wrote over its environment block (a server that sets its \
                 process title, as redis-server and nginx do): the environment it was \
                 started with cannot be read back, and a relaunch without it would lose \
                 it; start it under LD_PRELOAD yourself, or run it as a systemd unit, \
                 which toffload injects through"
            )));
        }
        systemd::Route::Relaunch => {
            let mine = resources::rlimits(std::process::id()).map_err(PlanError::Cannot)?;
            let my_oom = std::fs::read_to_string("/proc/self/oom_score_adj")
                .ok()
                .and_then(|s| s.trim().parse().ok());
            original
                .res
                .settable(&mine, my_oom, credentials::own_cap_sys_resource())
                .map_err(PlanError::Unreproducible)?;
        }
        systemd::Route::ViaUnit(_) => {}
    }
    Ok(Plan {
        old_pid: pid,
        original,
        injected,
        runtime,
        ports,
        route,
        health: opts.health,
    })
}

/// The variables the injection sets (new or changed), in the injected order.
fn added_env(original: &Launch, injected: &Launch) -> Vec<(String, String)> {
    injected
        .env
        .iter()
        .filter(|kv| !original.env.contains(kv))
        .cloned()
        .collect()
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
        let added: Vec<String> = added_env(&self.original, l)
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let ports: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("{}{}", p.port, if p.v6 { " (v6)" } else { "" }))
            .collect();
        let serving = if ports.is_empty() {
            "(no TCP port now: waits 1 s alive)".to_string()
        } else {
            format!("port {}", ports.join(", "))
        };
        let health = if self.health.is_zero() {
            "no health window (--inject-health 0)".to_string()
        } else {
            format!(
                "health window {:.0} s: it must stay alive, keep listening, keep its \
                 runtime active and serve requests (when the original did); if not, \
                 roll back",
                self.health.as_secs_f64()
            )
        };
        let head = format!(
            "inject plan for pid {}:\n  1. write the bundled runtime to {} (if not there)\n",
            self.old_pid,
            self.runtime.display(),
        );
        match &self.route {
            systemd::Route::ViaUnit(u) => format!(
                "{head}  2. pid {} belongs to the systemd unit {}: write the drop-in {}:\n{}  \
                 3. systemctl daemon-reload; systemctl restart {}\n  4. wait until its main \
                 process listens on {serving} and its runtime reports itself active (at \
                 most {:.0} s)\n  5. {health}\n  6. if it does not: remove the drop-in, \
                 systemctl daemon-reload, systemctl restart {} (without the runtime)\n",
                self.old_pid,
                u.unit,
                u.dropin_path.display(),
                u.dropin_text
                    .lines()
                    .map(|l| format!("       {l}\n"))
                    .collect::<String>(),
                u.unit,
                READY_LIMIT.as_secs_f64(),
                u.unit,
            ),
            _ => format!(
                "{head}  2. take pid {}'s stdin/stdout/stderr (pidfd_getfd)\n  3. stop pid {}: \
                 SIGTERM, SIGKILL after 5 s\n  4. start, in a new session, as uid {} gid {} \
                 groups {:?}, in {}, nice {}, CPUs {}:\n       {} (exe {})\n     with its \
                 environment ({} variables) plus: {}\n     with its {}\n  5. wait until it \
                 listens on {serving} and its runtime reports itself active (at most {:.0} \
                 s)\n  6. {health}\n  7. if it does not: stop it and start the original \
                 command the same way, without the runtime\n",
                self.old_pid,
                self.old_pid,
                l.uid,
                l.gid,
                l.groups,
                l.cwd.display(),
                l.nice,
                cpu_list(&l.cpus),
                shell_words(&l.argv),
                l.exe.display(),
                self.original.env.len(),
                added.join(" "),
                l.res.describe(),
                READY_LIMIT.as_secs_f64(),
            ),
        }
    }
}

/// "0-3,6" for [0, 1, 2, 3, 6] ("all" when unknown).
fn cpu_list(cpus: &[usize]) -> String {
    if cpus.is_empty() {
        return "(unknown: the watcher's)".into();
    }
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// How long the relaunched server may take to listen again.
pub const READY_LIMIT: Duration = Duration::from_secs(15);

/// The server started by an injection or a recovery. A relaunch is our child (until
/// the watcher exits; it outlives the watcher); a unit's main process is systemd's.
pub struct Relaunched {
    pub child: Option<std::process::Child>,
    pub pid: u32,
}

impl Relaunched {
    /// How it ended, if it has (a child of ours is reaped).
    pub fn exited(&mut self) -> Option<String> {
        match &mut self.child {
            Some(c) => launch::child_exited(c),
            None => launch::pid_exited(self.pid),
        }
    }

    /// Stops it (SIGTERM, then SIGKILL) and reaps it when it is ours.
    fn stop(&mut self) {
        match &mut self.child {
            Some(c) => launch::kill(c),
            None => {
                let _ = launch::stop(self.pid, Duration::from_secs(5));
            }
        }
    }
}

/// An injection that is up: what a rollback needs.
pub struct Injected {
    pub server: Relaunched,
    /// The original's stdin/stdout/stderr, for the original command again.
    stdio: [Option<OwnedFd>; 3],
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

/// Waits until `server` serves (its runtime active when `runtime`); one that does not
/// get there is stopped.
fn until_serving(
    mut server: Relaunched,
    ports: &BTreeSet<Listen>,
    runtime: bool,
) -> Result<Relaunched, String> {
    let ready = launch::Ready {
        ports,
        runtime,
        limit: READY_LIMIT,
    };
    let pid = server.pid;
    match launch::wait_ready(pid, &mut || server.exited(), &ready) {
        Ok(()) => Ok(server),
        Err(e) => {
            server.stop();
            Err(e)
        }
    }
}

/// Starts `l` and waits until it serves (its runtime active when `runtime`, which is
/// also when its cgroup must be joined: see launch::spawn).
fn start_serving(
    l: &Launch,
    stdio: &[Option<OwnedFd>; 3],
    ports: &BTreeSet<Listen>,
    runtime: bool,
) -> Result<Relaunched, String> {
    let child = launch::spawn(l, stdio, runtime)?;
    let pid = child.id();
    until_serving(
        Relaunched {
            child: Some(child),
            pid,
        },
        ports,
        runtime,
    )
}

/// Restarts `u` (the drop-in written or removed) and waits until its main process
/// serves.
fn unit_serving(
    u: &systemd::UnitPlan,
    step: fn(&systemd::UnitPlan) -> Result<(), String>,
    ports: &BTreeSet<Listen>,
    runtime: bool,
) -> Result<Relaunched, String> {
    step(u)?;
    let pid = systemd::main_pid(&u.unit)?;
    until_serving(Relaunched { child: None, pid }, ports, runtime)
}

/// Runs the plan.
pub fn execute(p: &Plan) -> Result<Injected, Failure> {
    bundle::install().map_err(Failure::NotStarted)?;
    if !process::running(p.old_pid) {
        return Err(Failure::NotStarted(format!("pid {} is gone", p.old_pid)));
    }
    let stdio = launch::take_stdio(p.old_pid);
    if let systemd::Route::ViaUnit(u) = &p.route {
        let why = match unit_serving(u, systemd::apply, &p.ports, true) {
            Ok(server) => return Ok(Injected { server, stdio }),
            Err(why) => why,
        };
        return Err(match unit_serving(u, systemd::revert, &p.ports, false) {
            Ok(restored) => Failure::Restored { why, restored },
            Err(recovery) => Failure::Down { why, recovery },
        });
    }
    launch::stop(p.old_pid, Duration::from_secs(5)).map_err(Failure::NotStarted)?;
    let why = match start_serving(&p.injected, &stdio, &p.ports, true) {
        Ok(server) => return Ok(Injected { server, stdio }),
        Err(why) => why,
    };
    // Recovery: the original command, exactly as it was.
    Err(match start_serving(&p.original, &stdio, &p.ports, false) {
        Ok(restored) => Failure::Restored { why, restored },
        Err(recovery) => Failure::Down { why, recovery },
    })
}

/// Undoes an injection that is up (it failed its health window): the injected server
/// is stopped and the original command started the way the injection started it
/// (through the unit, without the drop-in, or relaunched without the runtime). Err:
/// the original could not be started again, the server is down.
pub fn rollback(p: &Plan, mut inj: Injected) -> Result<Relaunched, String> {
    if let systemd::Route::ViaUnit(u) = &p.route {
        // The restart replaces the main process; a child of ours is not involved.
        return unit_serving(u, systemd::revert, &p.ports, false);
    }
    inj.server.stop();
    start_serving(&p.original, &inj.stdio, &p.ports, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(cpu_list(&[0, 1, 2, 3, 6]), "0-3,6");
        assert_eq!(cpu_list(&[1]), "1");
        assert_eq!(cpu_list(&[0, 2, 3]), "0,2-3");
        assert!(cpu_list(&[]).contains("unknown"));
    }

    /// The plan of this very process (no port, not a unit): a relaunch whose text
    /// names its limits, umask, OOM adjustment, cgroup and CPUs; under a running
    /// systemd and a unit's cgroup it would be a drop-in instead.
    #[test]
    fn plans_itself() {
        let me = std::process::id();
        let p = match plan_inner(me, &Options::default(), false) {
            Ok(p) => p,
            // Built without the runtime (a plain `cargo test`): nothing to plan.
            Err(PlanError::Cannot(why)) if why.contains("without the fiber runtime") => return,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(p.route, systemd::Route::Relaunch);
        let text = p.describe();
        for want in [
            "rlimits",
            "nofile=",
            "memlock=",
            "umask",
            "oom_score_adj",
            "cgroup",
            "CPUs",
            "health window 5 s",
        ] {
            assert!(text.contains(want), "{want:?} missing from:\n{text}");
        }
        let mut unit = p.clone();
        unit.route = systemd::route(
            Some("/system.slice/demo.service"),
            true,
            &added_env(&p.original, &p.injected),
        );
        let text = unit.describe();
        assert!(
            text.contains("/run/systemd/system/demo.service.d/toffload.conf")
                && text.contains("Environment=\"LD_PRELOAD=")
                && text.contains("systemctl restart demo.service"),
            "{text}"
        );
    }

    #[test]
    fn quoting() {
        assert_eq!(
            shell_words(&["a".into(), "b c".into(), "it's".into(), "--x=1".into()]),
            "a 'b c' 'it'\\''s' --x=1"
        );
    }
}
