//! What every toffload binary shares on its command line, so that the clap definition
//! of each stays the single source of its --help, man page and completions (as
//! ripgrep does it): [`VERSION`] for `#[command(version = ...)]`, and
//! [`generate_if_requested`], a hidden `--generate man|complete-bash|complete-zsh|complete-fish`
//! that prints the binary's own man page or completion script; `cargo xtask install`
//! runs the built binaries with it.

use clap::{CommandFactory, ValueEnum};
use std::ffi::OsString;
use std::io::{self, Write};

/// "0.1.0 (rev 1a2b3c4)", "0.1.0 (rev 1a2b3c4+dirty)", or "0.1.0 (rev unknown)" when
/// not built from a git checkout. The workspace's version, which every crate
/// inherits, and the revision build.rs found.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (rev ",
    env!("TOFFLOAD_GIT_REV"),
    ")"
);

/// What `--generate` writes.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum What {
    /// The man page (roff, section 1).
    Man,
    CompleteBash,
    CompleteZsh,
    CompleteFish,
}

impl What {
    pub const ALL: [What; 4] = [
        What::Man,
        What::CompleteBash,
        What::CompleteZsh,
        What::CompleteFish,
    ];

    /// The flag's value for this kind, as given on the command line.
    pub fn arg(self) -> &'static str {
        match self {
            What::Man => "man",
            What::CompleteBash => "complete-bash",
            What::CompleteZsh => "complete-zsh",
            What::CompleteFish => "complete-fish",
        }
    }
}

/// The hidden flag: when the command line is exactly `--generate WHAT` (or
/// `--generate=WHAT`), writes WHAT for `C`'s command line to stdout and exits, as
/// --help does; otherwise returns and the program parses its arguments as usual.
/// Called first in `main`, before clap, so that a program's required arguments do not
/// stand in its way (clap's `exclusive` does not lift them); it is not part of `C`,
/// so --help, the man page and the completions never show it.
pub fn generate_if_requested<C: CommandFactory>() {
    let Some(what) = requested(std::env::args_os().skip(1)) else {
        return;
    };
    let what = match what {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{}: {e}", C::command().get_name());
            std::process::exit(2);
        }
    };
    let code = match write(what, C::command(), &mut io::stdout().lock()) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("--generate {}: {e}", what.arg());
            1
        }
    };
    std::process::exit(code);
}

/// `--generate WHAT` or `--generate=WHAT` as the whole command line (without the
/// program name): what it asks for, or why WHAT is not one; None for anything else.
fn requested(mut args: impl Iterator<Item = OsString>) -> Option<Result<What, String>> {
    let first = args.next()?;
    let first = first.to_str()?;
    let value = match first.strip_prefix("--generate") {
        Some("") => args.next()?.into_string().ok()?,
        Some(v) => v.strip_prefix('=')?.to_string(),
        None => return None,
    };
    if args.next().is_some() {
        return None;
    }
    Some(What::from_str(&value, false).map_err(|_| {
        let all: Vec<&str> = What::ALL.iter().map(|w| w.arg()).collect();
        format!("--generate {value:?}: expected one of {}", all.join(", "))
    }))
}

/// Writes `what` for `cmd` to `out`.
pub fn write(what: What, mut cmd: clap::Command, out: &mut dyn Write) -> io::Result<()> {
    let name = cmd.get_name().to_string();
    let shell = match what {
        What::Man => {
            cmd.build();
            return clap_mangen::Man::new(cmd).render(out);
        }
        What::CompleteBash => clap_complete::Shell::Bash,
        What::CompleteZsh => clap_complete::Shell::Zsh,
        What::CompleteFish => clap_complete::Shell::Fish,
    };
    clap_complete::generate(shell, &mut cmd, name, out);
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// A program with a required flag, a subcommand and a hidden flag.
    #[derive(Parser)]
    #[command(name = "demo-prog", version = VERSION)]
    struct Prog {
        /// The port to use.
        #[arg(long)]
        port: u16,
        /// Internal.
        #[arg(long, hide = true)]
        secret: bool,
        #[command(subcommand)]
        cmd: Option<Sub>,
    }

    #[derive(clap::Subcommand)]
    enum Sub {
        /// Start it.
        Start,
    }

    #[test]
    fn version_names_the_revision() {
        let (ver, rev) = VERSION.split_once(" (rev ").expect("a revision");
        assert_eq!(ver, env!("CARGO_PKG_VERSION"));
        let rev = rev.strip_suffix(')').expect("closing parenthesis");
        let hash = rev.split('+').next().unwrap_or_default();
        assert!(
            rev == "unknown" || hash.len() >= 7 && hash.chars().all(|c| c.is_ascii_hexdigit()),
            "{VERSION}"
        );
        let e = Prog::try_parse_from(["demo-prog", "--version"])
            .err()
            .expect("--version exits");
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayVersion);
        assert_eq!(e.to_string(), format!("demo-prog {VERSION}\n"));
    }

    fn req(args: &[&str]) -> Option<Result<What, String>> {
        requested(args.iter().map(OsString::from))
    }

    #[test]
    fn only_a_whole_generate_command_line_is_a_request() {
        for w in What::ALL {
            assert_eq!(req(&["--generate", w.arg()]), Some(Ok(w)));
            assert_eq!(req(&[&format!("--generate={}", w.arg())]), Some(Ok(w)));
        }
        assert!(matches!(req(&["--generate", "pdf"]), Some(Err(e)) if e.contains("complete-zsh")));
        assert_eq!(req(&["--generate"]), None);
        assert_eq!(req(&["--generate", "man", "--port", "1"]), None);
        assert_eq!(req(&["--port", "1"]), None);
        assert_eq!(req(&["--generated", "man"]), None);
        assert_eq!(req(&[]), None);
        // A real run still parses as clap says.
        let p = Prog::try_parse_from(["demo-prog", "--port", "1"]).expect("parses");
        assert!(p.port == 1 && !p.secret && p.cmd.is_none());
    }

    fn generated(w: What) -> String {
        let mut v = Vec::new();
        write(w, Prog::command(), &mut v).expect("writes");
        String::from_utf8(v).expect("utf-8")
    }

    #[test]
    fn man_page_has_the_flags_and_not_the_hidden_ones() {
        let man = generated(What::Man);
        assert!(man.contains(".TH demo-prog 1"), "{man}");
        assert!(man.contains("port") && man.contains("start"), "{man}");
        assert!(man.contains(VERSION), "{man}");
        assert!(!man.contains("secret"), "{man}");
    }

    #[test]
    fn completions_name_the_flags_and_subcommands() {
        for w in [What::CompleteBash, What::CompleteZsh, What::CompleteFish] {
            let s = generated(w);
            assert!(s.contains("demo-prog"), "{w:?}: {s}");
            assert!(s.contains("port") && s.contains("start"), "{w:?}: {s}");
        }
    }
}
