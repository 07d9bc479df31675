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
    let root = is_root();
    if !root && !succeeds("sudo", &["--version"]) {
        return Err(format!(
            "{} needs root and there is no sudo: run it as root",
            describe(cmd)
        ));
    }
    let carried = std::env::vars()
        .filter(|(k, _)| k.starts_with("TOFFLOAD_") || k == "CI" || k == "CARGO_TARGET_DIR");
    Ok(wrap(cmd, root, carried))
}

/// as_root's command, given whether we are root and the variables to carry.
fn wrap(cmd: &Command, root: bool, carried: impl Iterator<Item = (String, String)>) -> Command {
    let mut vars: Vec<(String, String)> = carried.collect();
    for (k, v) in cmd.get_envs() {
        let k = k.to_string_lossy().into_owned();
        vars.retain(|(x, _)| *x != k);
        if let Some(v) = v {
            vars.push((k, v.to_string_lossy().into_owned()));
        }
    }
    let mut c = if root {
        let mut c = Command::new(cmd.get_program());
        c.envs(vars);
        c
    } else {
        let mut c = Command::new("sudo");
        c.arg("--").arg("env");
        c.args(vars.iter().map(|(k, v)| format!("{k}={v}")));
        c.arg(cmd.get_program());
        c
    };
    c.args(cmd.get_args());
    if let Some(d) = cmd.get_current_dir() {
        c.current_dir(d);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(c: &Command) -> Vec<String> {
        c.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    fn carried() -> impl Iterator<Item = (String, String)> {
        [
            ("TOFFLOAD_EMU_LAT_US".to_string(), "50".to_string()),
            ("TOFFLOAD_DIST".into(), "/old".into()),
        ]
        .into_iter()
    }

    #[test]
    fn as_a_user_the_command_goes_through_sudo_with_its_environment() {
        let mut cmd = Command::new("/x/toffload-demo");
        cmd.args(["--runs", "2"]).env("TOFFLOAD_DIST", "/dist");
        let c = wrap(&cmd, false, carried());
        assert_eq!(c.get_program(), "sudo");
        assert_eq!(
            args(&c),
            [
                "--",
                "env",
                "TOFFLOAD_EMU_LAT_US=50",
                "TOFFLOAD_DIST=/dist",
                "/x/toffload-demo",
                "--runs",
                "2"
            ]
        );
    }

    #[test]
    fn as_root_the_command_runs_itself() {
        let mut cmd = Command::new("/x/toffload-demo");
        cmd.arg("--tui")
            .env("TOFFLOAD_DIST", "/dist")
            .current_dir("/tmp");
        let c = wrap(&cmd, true, carried());
        assert_eq!(c.get_program(), "/x/toffload-demo");
        assert_eq!(args(&c), ["--tui"]);
        let envs: Vec<(String, String)> = c
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.expect("set").to_string_lossy().into_owned(),
                )
            })
            .collect();
        assert!(
            envs.contains(&("TOFFLOAD_DIST".into(), "/dist".into())),
            "{envs:?}"
        );
        assert!(
            envs.contains(&("TOFFLOAD_EMU_LAT_US".into(), "50".into())),
            "{envs:?}"
        );
        assert_eq!(c.get_current_dir(), Some(std::path::Path::new("/tmp")));
    }
}
