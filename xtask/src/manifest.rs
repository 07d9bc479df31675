//! What `cargo xtask install` installs, and where: the one table that the installer
//! (install.rs) follows and its tests check the staged tree against. Destinations are
//! relative to the prefix (/usr/local by default).

/// Where an installed file's bytes come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A file of the dist folder (target/toffload) that `cargo xtask build` made, by
    /// its path there.
    Dist(String),
    /// What the built binary dist/bin/BIN prints with `--generate WHAT` (toffload-cli):
    /// its man page or a completion script, from its own clap definition.
    Generated {
        bin: &'static str,
        what: &'static str,
    },
    /// A systemd unit template from the source tree; `@bindir@` becomes PREFIX/bin.
    Unit(&'static str),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub source: Source,
    /// Relative to the prefix.
    pub dest: String,
    pub mode: u32,
}

/// The binaries a user runs (the README's): the watcher, the remote daemon, the load
/// generator. The demo and table binaries stay in target/toffload: they drive the
/// example servers built there.
pub const BINS: &[&str] = &["toffload-watch", "toffload-remoted", "toffload-load"];

/// The LD_PRELOAD runtime and the accelerator API, in lib/ where the linker and the
/// loader look (`-ltoffload_accel`, `LD_PRELOAD=PREFIX/lib/libtoffload.so`).
pub const LIBS: &[&str] = &["libtoffload.so", "libtoffload_accel.so"];

pub const HEADERS: &[&str] = &["toffload_accel.h"];

/// The units, by the name they are installed under (xtask/packaging/systemd/NAME.in).
pub const UNITS: &[&str] = &["toffload-watch.service", "toffload-remoted.service"];

/// What each binary's `--generate` writes that is installed (toffload-cli's kinds).
const GENERATED: &[&str] = &["man", "complete-bash", "complete-zsh", "complete-fish"];

/// Where `--generate WHAT` of binary BIN lands: the folders that man, bash-completion,
/// zsh and fish search under a prefix.
fn generated_dest(what: &str, bin: &str) -> String {
    match what {
        "man" => format!("share/man/man1/{bin}.1"),
        "complete-bash" => format!("share/bash-completion/completions/{bin}"),
        "complete-zsh" => format!("share/zsh/site-functions/_{bin}"),
        "complete-fish" => format!("share/fish/vendor_completions.d/{bin}.fish"),
        other => unreachable!("no destination for --generate {other}"),
    }
}

const EXEC: u32 = 0o755;
/// Shared libraries too: they are mapped, not executed (Debian's policy).
const DATA: u32 = 0o644;

pub fn entries() -> Vec<Entry> {
    let mut v = Vec::new();
    let mut add = |source, dest: String, mode| v.push(Entry { source, dest, mode });
    for b in BINS {
        add(Source::Dist(format!("bin/{b}")), format!("bin/{b}"), EXEC);
    }
    for l in LIBS {
        add(Source::Dist(format!("lib/{l}")), format!("lib/{l}"), DATA);
    }
    for h in HEADERS {
        add(
            Source::Dist(format!("include/{h}")),
            format!("include/{h}"),
            DATA,
        );
    }
    for b in BINS {
        for what in GENERATED {
            add(
                Source::Generated { bin: b, what },
                generated_dest(what, b),
                DATA,
            );
        }
    }
    for u in UNITS {
        add(Source::Unit(u), format!("lib/systemd/system/{u}"), DATA);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn destinations_are_unique_relative_and_moded() {
        let e = entries();
        let dests: BTreeSet<&str> = e.iter().map(|e| e.dest.as_str()).collect();
        assert_eq!(dests.len(), e.len(), "a destination twice");
        for x in &e {
            assert!(!x.dest.starts_with('/') && !x.dest.contains(".."), "{x:?}");
            let exec = x.dest.starts_with("bin/");
            assert_eq!(x.mode, if exec { 0o755 } else { 0o644 }, "{x:?}");
        }
        // Every binary: itself, a man page, three completions.
        assert_eq!(
            e.len(),
            BINS.len() * 5 + LIBS.len() + HEADERS.len() + UNITS.len()
        );
    }

    #[test]
    fn unit_templates_exist_and_name_bindir() {
        for u in UNITS {
            let p = crate::paths::root().join(format!("xtask/packaging/systemd/{u}.in"));
            let t = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert!(t.contains("ExecStart=@bindir@/"), "{}", p.display());
            // The installer replaces @bindir@ and nothing else.
            assert!(!t.replace("@bindir@", "").contains('@'), "{}", p.display());
        }
    }
}
