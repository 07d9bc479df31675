//! A target that belongs to a systemd service is injected through its unit, not by a
//! relaunch from the watcher: a relaunched copy would run outside the unit
//! (`systemctl` would no longer reach it, and `Restart=` would start a second copy).
//! Through the unit: a drop-in adds the runtime to the unit's environment, and a
//! restart starts it; the rollback removes the drop-in and restarts again.
//!
//! The decision (`route`) and the drop-in's text are pure, so that they are tested
//! where systemd does not run; `apply` and `revert` are the effects.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where drop-ins go: /run, so that one left behind by a crash of the watcher is gone
/// at the next boot (the bundled runtime it names lives in /run too).
pub const DROPIN_ROOT: &str = "/run/systemd/system";
pub const DROPIN_NAME: &str = "toffload.conf";

/// How an injection reaches the target.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Route {
    /// Stop it and start its command line again (not a systemd service).
    Relaunch,
    /// Through its systemd unit.
    ViaUnit(UnitPlan),
    /// Neither can be done faithfully.
    Refuse(String),
}

/// An injection through a unit: the drop-in to write and what it says.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct UnitPlan {
    pub unit: String,
    pub dropin_path: PathBuf,
    pub dropin_text: String,
}

/// The service a cgroup v2 path belongs to, and whether it is a user manager's
/// (…/user@UID.service/…): the innermost `*.service` component, since a service
/// may delegate sub-cgroups of its own.
fn service_of(cgroup: &str) -> Option<(&str, bool)> {
    let parts: Vec<&str> = cgroup.split('/').filter(|p| !p.is_empty()).collect();
    let at = parts.iter().rposition(|p| p.ends_with(".service"))?;
    let user = parts[..at].iter().any(|p| is_user_manager(p));
    Some((parts[at], user || is_user_manager(parts[at])))
}

fn is_user_manager(p: &str) -> bool {
    p.strip_prefix("user@")
        .and_then(|r| r.strip_suffix(".service"))
        .is_some_and(|uid| !uid.is_empty() && uid.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether systemd is the running init (sd_booted(3)'s test).
pub fn running() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

/// The decision: given the target's cgroup v2 path, whether systemd runs, and the
/// variables the injection adds, how to inject.
pub fn route(cgroup: Option<&str>, systemd_running: bool, added_env: &[(String, String)]) -> Route {
    // Without a running systemd a `.service` in the path was named by someone else
    // (a container's host): nothing here could restart it.
    let Some((unit, user)) = cgroup.filter(|_| systemd_running).and_then(service_of) else {
        return Route::Relaunch;
    };
    if user {
        return Route::Refuse(format!(
            "it runs in {unit} of a user's systemd manager (cgroup {}): injecting through \
             a user unit is not supported, and a relaunch would move it out of the unit",
            cgroup.unwrap_or_default()
        ));
    }
    Route::ViaUnit(UnitPlan {
        unit: unit.to_string(),
        dropin_path: Path::new(DROPIN_ROOT)
            .join(format!("{unit}.d"))
            .join(DROPIN_NAME),
        dropin_text: dropin_text(added_env),
    })
}

/// One `Environment=` value, quoted as systemd.syntax(7) reads it: in double quotes,
/// with backslash, quote and control characters escaped, and `%` doubled (unit files
/// expand specifiers in Environment=).
fn quote(kv: &str) -> String {
    let mut s = String::with_capacity(kv.len() + 2);
    s.push('"');
    for c in kv.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '%' => s.push_str("%%"),
            '\n' => s.push_str("\\n"),
            '\t' => s.push_str("\\t"),
            c if c.is_control() => s.push_str(&format!("\\x{:02x}", c as u32)),
            c => s.push(c),
        }
    }
    s.push('"');
    s
}

/// The drop-in: the variables the injection adds (LD_PRELOAD first), one per line.
pub fn dropin_text(added_env: &[(String, String)]) -> String {
    let mut t = String::from(
        "# Written by toffload-watch --inject: runs the service under the toffload fiber\n\
         # runtime. Removing this file (and `systemctl daemon-reload`, `systemctl restart`)\n\
         # undoes it; it is in /run, so a reboot does too.\n[Service]\n",
    );
    for (k, v) in added_env {
        t.push_str(&format!("Environment={}\n", quote(&format!("{k}={v}"))));
    }
    t
}

fn systemctl(args: &[&str]) -> Result<String, String> {
    let out = Command::new("systemctl")
        .args(args)
        .output()
        .map_err(|e| format!("systemctl {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "systemctl {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The unit's main process.
pub fn main_pid(unit: &str) -> Result<u32, String> {
    let v = systemctl(&["show", "--property=MainPID", "--value", unit])?;
    match v.parse::<u32>() {
        Ok(0) | Err(_) => Err(format!("{unit} has no main process (MainPID={v})")),
        Ok(pid) => Ok(pid),
    }
}

/// Writes the drop-in and restarts the unit under it.
pub fn apply(u: &UnitPlan) -> Result<(), String> {
    let dir = u.dropin_path.parent().expect("a directory");
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    std::fs::write(&u.dropin_path, &u.dropin_text)
        .map_err(|e| format!("writing {}: {e}", u.dropin_path.display()))?;
    systemctl(&["daemon-reload"])?;
    systemctl(&["restart", &u.unit]).map(|_| ())
}

/// Removes the drop-in and restarts the unit as it was.
pub fn revert(u: &UnitPlan) -> Result<(), String> {
    match std::fs::remove_file(&u.dropin_path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("removing {}: {e}", u.dropin_path.display())),
    }
    // Only ours: a directory holding the admin's own drop-ins stays.
    if let Some(d) = u.dropin_path.parent() {
        let _ = std::fs::remove_dir(d);
    }
    systemctl(&["daemon-reload"])?;
    systemctl(&["restart", &u.unit]).map(|_| ())
}

/// What `systemd-analyze verify` said of a drop-in.
#[derive(Debug, PartialEq, Eq)]
pub enum Verified {
    Clean,
    /// systemd-analyze is not installed.
    Unavailable(String),
}

/// Checks a drop-in with `systemd-analyze verify` on a scratch copy of the unit (a
/// plain ExecStart=/bin/true service of the same name under `scratch`): an error, or
/// any complaint naming the drop-in, is an Err.
pub fn verify(u: &UnitPlan, scratch: &Path) -> Result<Verified, String> {
    let unit_file = scratch.join(&u.unit);
    let dir = scratch.join(format!("{}.d", u.unit));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::write(
        &unit_file,
        "[Unit]\nDescription=scratch copy\n[Service]\nExecStart=/bin/true\n",
    )
    .map_err(|e| format!("{}: {e}", unit_file.display()))?;
    std::fs::write(dir.join(DROPIN_NAME), &u.dropin_text)
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    // The trailing ':' keeps the built-in search path after ours.
    let out = match Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit_file)
        .env("SYSTEMD_UNIT_PATH", format!("{}:", scratch.display()))
        .output()
    {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Verified::Unavailable(
                "systemd-analyze is not installed".into(),
            ))
        }
        Err(e) => return Err(format!("systemd-analyze: {e}")),
    };
    let err = String::from_utf8_lossy(&out.stderr);
    let complaints: Vec<&str> = err.lines().filter(|l| l.contains(DROPIN_NAME)).collect();
    if !out.status.success() || !complaints.is_empty() {
        return Err(format!(
            "systemd-analyze verify {}: {}: {}",
            unit_file.display(),
            out.status,
            err.trim()
        ));
    }
    Ok(Verified::Clean)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(kv: &[(&str, &str)]) -> Vec<(String, String)> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn units_from_cgroups() {
        assert_eq!(
            service_of("/system.slice/nginx.service"),
            Some(("nginx.service", false))
        );
        // A delegated sub-cgroup of the service.
        assert_eq!(
            service_of("/system.slice/app.service/workers"),
            Some(("app.service", false))
        );
        assert_eq!(
            service_of("/system.slice/system-getty.slice/getty@tty1.service"),
            Some(("getty@tty1.service", false))
        );
        assert_eq!(
            service_of("/user.slice/user-1000.slice/user@1000.service/app.slice/x.service"),
            Some(("x.service", true))
        );
        assert_eq!(
            service_of("/user.slice/user-1000.slice/session-3.scope"),
            None
        );
        assert_eq!(service_of("/"), None);
        assert_eq!(service_of("/docker/abc"), None);
    }

    #[test]
    fn routes() {
        let e = env(&[("LD_PRELOAD", "/run/toffload/0123/libtoffload.so")]);
        let svc = Some("/system.slice/nginx.service");
        // systemd does not run: whatever the path says, a relaunch.
        assert_eq!(route(svc, false, &e), Route::Relaunch);
        assert_eq!(route(None, true, &e), Route::Relaunch);
        assert_eq!(
            route(Some("/user.slice/user-0.slice/session-1.scope"), true, &e),
            Route::Relaunch
        );
        let Route::ViaUnit(u) = route(svc, true, &e) else {
            panic!("not through the unit");
        };
        assert_eq!(u.unit, "nginx.service");
        assert_eq!(
            u.dropin_path,
            PathBuf::from("/run/systemd/system/nginx.service.d/toffload.conf")
        );
        assert!(u.dropin_text.contains(
            "\n[Service]\nEnvironment=\"LD_PRELOAD=/run/toffload/0123/libtoffload.so\"\n"
        ));
        assert!(matches!(
            route(Some("/user.slice/user-1000.slice/user@1000.service/app.slice/x.service"), true, &e),
            Route::Refuse(why) if why.contains("user's systemd manager")
        ));
    }

    #[test]
    fn dropin_quotes_what_systemd_would_misread() {
        let t = dropin_text(&env(&[
            ("LD_PRELOAD", "/run/toffload/a/libtoffload.so:/opt/x y.so"),
            ("TOFFLOAD_GUARD", "detect"),
            ("ODD", "100%\"q\"\\n"),
        ]));
        let lines: Vec<&str> = t.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            lines,
            [
                "[Service]",
                "Environment=\"LD_PRELOAD=/run/toffload/a/libtoffload.so:/opt/x y.so\"",
                "Environment=\"TOFFLOAD_GUARD=detect\"",
                "Environment=\"ODD=100%%\\\"q\\\"\\\\n\"",
            ]
        );
    }

    /// The drop-in as systemd reads it: `systemd-analyze verify` on a scratch copy of
    /// the unit, where it is installed.
    #[test]
    fn systemd_analyze_accepts_the_dropin() {
        let Route::ViaUnit(u) = route(
            Some("/system.slice/toffload-verify.service"),
            true,
            &env(&[
                ("LD_PRELOAD", "/run/toffload/0123/libtoffload.so"),
                ("TOFFLOAD_GUARD", "detect"),
                ("ODD", "50% \"quoted\" back\\slash"),
            ]),
        ) else {
            panic!("not through the unit");
        };
        let scratch = std::env::temp_dir().join(format!("toffload-verify-{}", std::process::id()));
        let r = verify(&u, &scratch);
        let _ = std::fs::remove_dir_all(&scratch);
        match r {
            Ok(Verified::Clean) => {}
            Ok(Verified::Unavailable(why)) => {
                eprintln!("skipped: systemd-analyze verify of the drop-in: {why}")
            }
            Err(e) => panic!("{e}\n{}", u.dropin_text),
        }
        // And a broken one is caught: the check can fail.
        let mut bad = u.clone();
        bad.dropin_text
            .push_str("Environment=\"A=\\q\"\nNoSuchKey=1\n");
        let scratch =
            std::env::temp_dir().join(format!("toffload-verify-bad-{}", std::process::id()));
        let r = verify(&bad, &scratch);
        let _ = std::fs::remove_dir_all(&scratch);
        if !matches!(r, Ok(Verified::Unavailable(_))) {
            assert!(r.is_err(), "a bad drop-in passed: {r:?}");
        }
    }
}
