//! Running commands: echo them, fail with the command named.

use std::process::Command;

pub type Result<T = ()> = std::result::Result<T, String>;

pub fn run(cmd: &mut Command) -> Result {
    eprintln!("+ {}", describe(cmd));
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run {}: {e}", describe(cmd)))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{} failed ({status})", describe(cmd)))
    }
}

pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

pub fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(crate::paths::root());
    c
}

/// True when `prog` runs and exits 0.
pub fn succeeds(prog: &str, args: &[&str]) -> bool {
    Command::new(prog)
        .args(args)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Whether we run as root (`id -u`: xtask links no libc crate).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// `cmd` to run as root: a copy of it when we are root, else the same under sudo.
/// sudo resets the environment, so what `cmd` sets, and our own TOFFLOAD_* knobs, CI
/// and CARGO_TARGET_DIR, go through `env` explicitly.
pub fn as_root(cmd: &Command) -> Result<Command> {
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("TOFFLOAD_") || k == "CI" || k == "CARGO_TARGET_DIR")
        .collect();
    for (k, v) in cmd.get_envs() {
        let k = k.to_string_lossy().into_owned();
        vars.retain(|(x, _)| *x != k);
        if let Some(v) = v {
            vars.push((k, v.to_string_lossy().into_owned()));
        }
    }
    let root = is_root();
    if !root && !succeeds("sudo", &["--version"]) {
        return Err(format!(
            "{} needs root and there is no sudo: run it as root",
            describe(cmd)
        ));
    }
    let mut c = if root {
        Command::new(cmd.get_program())
    } else {
        let mut c = Command::new("sudo");
        c.arg("--").arg("env");
        for (k, v) in &vars {
            c.arg(format!("{k}={v}"));
        }
        c.arg(cmd.get_program());
        c
    };
    c.args(cmd.get_args());
    if root {
        c.envs(vars);
    }
    if let Some(d) = cmd.get_current_dir() {
        c.current_dir(d);
    }
    Ok(c)
}
