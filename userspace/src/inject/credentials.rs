//! Whether a relaunch can run with the target's credentials, decided before anything
//! is stopped. The relaunch starts as the target's effective uid and gid (real, saved
//! and effective alike) with no capability beyond what the executable's file
//! capabilities grant at exec: a server that started as root, bound a port and then
//! dropped privileges (or kept root only as its saved uid) cannot be started that way,
//! and the restart of the original after a failure would fail the same way, leaving
//! the server down. Such a target is refused with nothing changed.

use super::process::Listen;
use std::collections::BTreeSet;

/// CAP_NET_BIND_SERVICE's bit in the capability sets.
const CAP_NET_BIND_SERVICE: u32 = 10;
/// CAP_SYS_RESOURCE's: raising a hard limit, lowering oom_score_adj.
const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this process (the watcher) holds CAP_SYS_RESOURCE in its effective set.
pub fn own_cap_sys_resource() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| parse_status(&s))
        .is_some_and(|c| c.cap_eff & (1 << CAP_SYS_RESOURCE) != 0)
}

/// The credentials /proc/PID/status shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Creds {
    /// real, effective, saved, filesystem.
    pub uid: [u32; 4],
    pub gid: [u32; 4],
    /// CapEff.
    pub cap_eff: u64,
}

/// Why the credentials cannot be reproduced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unreproducible {
    /// The real or saved uid/gid differs from the effective one (e.g. a server that
    /// keeps root as its saved uid to take it back later).
    MixedIds { what: &'static str, ids: [u32; 4] },
    /// A non-root process listening below the unprivileged port start: it bound as
    /// root (or with a capability it no longer passes on) and dropped privileges.
    PrivilegedPort {
        port: u16,
        uid: u32,
        unprivileged_start: u16,
        /// It holds CAP_NET_BIND_SERVICE, but from its parent (ambient), not from
        /// its executable's file capabilities: an exec as its uid would not have it.
        cap_not_from_file: bool,
    },
}

impl std::fmt::Display for Unreproducible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unreproducible::MixedIds { what, ids } => write!(
                f,
                "its {what}s differ (real {}, effective {}, saved {}): a relaunch as the \
                 effective {what} would not hold the others, so the server could not do \
                 what it did (nothing was changed)",
                ids[0], ids[1], ids[2]
            ),
            Unreproducible::PrivilegedPort {
                port,
                uid,
                unprivileged_start,
                cap_not_from_file,
            } => write!(
                f,
                "it listens on port {port} (below {unprivileged_start}, \
                 net.ipv4.ip_unprivileged_port_start) as uid {uid}{}: it bound as root \
                 and dropped privileges, so a relaunch as uid {uid} could not bind it, \
                 and neither could the restart of the original (nothing was changed)",
                if *cap_not_from_file {
                    " with CAP_NET_BIND_SERVICE passed by its parent, not granted by its \
                     executable"
                } else {
                    " without CAP_NET_BIND_SERVICE"
                }
            ),
        }
    }
}

/// The Uid/Gid/CapEff lines of a /proc/PID/status text.
pub fn parse_status(status: &str) -> Option<Creds> {
    let line = |name: &str| status.lines().find_map(|l| l.strip_prefix(name));
    let ids = |name: &str| -> Option<[u32; 4]> {
        let v: Vec<u32> = line(name)?
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        v.try_into().ok()
    };
    Some(Creds {
        uid: ids("Uid:")?,
        gid: ids("Gid:")?,
        cap_eff: u64::from_str_radix(line("CapEff:")?.trim(), 16).ok()?,
    })
}

/// The decision, from what was read: Ok when a relaunch as the effective ids can do
/// what the target does. `exe_file_cap_bind`: the executable's file capabilities
/// grant CAP_NET_BIND_SERVICE (then an exec as the uid regains it).
pub fn check(
    c: &Creds,
    ports: &BTreeSet<Listen>,
    unprivileged_start: u16,
    exe_file_cap_bind: bool,
) -> Result<(), Unreproducible> {
    for (what, ids) in [("uid", c.uid), ("gid", c.gid)] {
        if ids[0] != ids[1] || ids[2] != ids[1] {
            return Err(Unreproducible::MixedIds { what, ids });
        }
    }
    let uid = c.uid[1];
    if uid == 0 {
        return Ok(());
    }
    let has_cap = c.cap_eff & (1 << CAP_NET_BIND_SERVICE) != 0;
    match ports.iter().find(|l| l.port < unprivileged_start) {
        Some(l) if !(has_cap && exe_file_cap_bind) => Err(Unreproducible::PrivilegedPort {
            port: l.port,
            uid,
            unprivileged_start,
            cap_not_from_file: has_cap,
        }),
        _ => Ok(()),
    }
}

/// net.ipv4.ip_unprivileged_port_start (1024 when it cannot be read, the kernel's
/// default). A net sysctl reads as the reader's network namespace's: a target in
/// another namespace is judged by ours (the watcher and its targets share one here).
pub fn unprivileged_port_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(1024)
}

/// Whether the file's capabilities (security.capability) include
/// CAP_NET_BIND_SERVICE in the permitted set.
pub fn file_grants_bind(exe: &std::path::Path) -> bool {
    let Ok(path) = std::ffi::CString::new(exe.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut buf = [0u8; 64];
    // SAFETY: a NUL-terminated path and a buffer we own, its length passed.
    let n = unsafe {
        libc::getxattr(
            path.as_ptr(),
            c"security.capability".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    // vfs_cap_data: magic_etc (u32), then {permitted, inheritable} low words.
    n >= 12
        && u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) & (1 << CAP_NET_BIND_SERVICE) != 0
}

/// Reads and checks `pid`.
pub fn check_pid(
    pid: u32,
    exe: &std::path::Path,
    ports: &BTreeSet<Listen>,
) -> Result<Result<(), Unreproducible>, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    let c = parse_status(&status)
        .ok_or_else(|| format!("/proc/{pid}/status: no Uid, Gid or CapEff line"))?;
    Ok(check(
        &c,
        ports,
        unprivileged_port_start(),
        file_grants_bind(exe),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(uid: [u32; 4], gid: [u32; 4], cap_eff: u64) -> Creds {
        Creds { uid, gid, cap_eff }
    }

    fn ports(p: &[u16]) -> BTreeSet<Listen> {
        p.iter().map(|&port| Listen { v6: false, port }).collect()
    }

    #[test]
    fn parses_status() {
        let s = "Name:\tnginx\nUid:\t33\t33\t0\t33\nGid:\t33\t33\t33\t33\n\
                 CapEff:\t0000000000000400\n";
        assert_eq!(
            parse_status(s),
            Some(creds([33, 33, 0, 33], [33; 4], 1 << 10))
        );
        assert_eq!(parse_status("Name:\tx\n"), None);
    }

    #[test]
    fn decisions() {
        let root = creds([0; 4], [0; 4], !0);
        assert_eq!(check(&root, &ports(&[80]), 1024, false), Ok(()));
        let user = creds([1000; 4], [1000; 4], 0);
        assert_eq!(check(&user, &ports(&[8080]), 1024, false), Ok(()));
        // Dropped privileges after binding 80: refused.
        assert_eq!(
            check(&user, &ports(&[80, 8080]), 1024, false),
            Err(Unreproducible::PrivilegedPort {
                port: 80,
                uid: 1000,
                unprivileged_start: 1024,
                cap_not_from_file: false
            })
        );
        // A lowered threshold makes 80 unprivileged.
        assert_eq!(check(&user, &ports(&[80]), 80, false), Ok(()));
        assert_eq!(check(&user, &ports(&[80]), 0, false), Ok(()));
        // The capability, granted by the executable: regained at exec.
        let capped = creds([1000; 4], [1000; 4], 1 << 10);
        assert_eq!(check(&capped, &ports(&[80]), 1024, true), Ok(()));
        // The same capability passed by its parent only: lost at our exec.
        assert!(matches!(
            check(&capped, &ports(&[80]), 1024, false),
            Err(Unreproducible::PrivilegedPort {
                cap_not_from_file: true,
                ..
            })
        ));
        // Root kept as the saved uid, or a setgid binary.
        let saved = creds([1000, 1000, 0, 1000], [1000; 4], 0);
        assert!(matches!(
            check(&saved, &ports(&[8080]), 1024, false),
            Err(Unreproducible::MixedIds { what: "uid", .. })
        ));
        let real = creds([0, 1000, 1000, 1000], [1000; 4], 0);
        assert!(check(&real, &ports(&[]), 1024, false).is_err());
        let sgid = creds([1000; 4], [1000, 50, 50, 50], 0);
        let e = check(&sgid, &ports(&[]), 1024, false).unwrap_err();
        assert!(e.to_string().contains("gids differ"), "{e}");
    }

    #[test]
    fn reads_itself() {
        let exe = std::env::current_exe().unwrap();
        let r = check_pid(std::process::id(), &exe, &BTreeSet::new()).unwrap();
        assert_eq!(r, Ok(()));
    }
}
