//! The synthetic dashboard in a real terminal: tmux runs it in a detached 80x24
//! session, send-keys types, capture-pane reads the screen. Checks what only a real
//! terminal shows: every title fits, the numbers move, the dialogs, a resize, and
//! that quitting or panicking gives the shell a cooked terminal on its main screen.
//!
//! Skipped (with a message) where tmux is not installed, unless TOFFLOAD_NO_SKIP=1
//! (CI), where that is a failure. Each test has its own tmux server (-L socket),
//! killed at the end even when the test fails; every wait gives up after 10 s.

use std::process::{Command, Output};
use std::thread::sleep;
use std::time::{Duration, Instant};

use toffload_tui::{CONFIRM_TITLE, FOOTER_KEYS, HELP_TITLE, PANEL_TITLES};

const BIN: &str = env!("CARGO_BIN_EXE_toffload-tui-synthetic");
const WAIT: Duration = Duration::from_secs(10);
const PROMPT: &str = "tui$ ";

fn have_tmux() -> bool {
    let ok = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        if std::env::var("TOFFLOAD_NO_SKIP").is_ok_and(|v| v == "1") {
            panic!("tmux is not installed and TOFFLOAD_NO_SKIP=1: install tmux");
        }
        eprintln!("skipped: tmux is not installed (apt-get install tmux)");
    }
    ok
}

/// A private tmux server with one 80x24 window running a bare bash.
struct Tmux {
    socket: String,
    /// The socket file, removed at the end: kill-server leaves it behind.
    socket_path: Option<String>,
}

impl Tmux {
    /// None when the test is to be skipped.
    fn start(test: &str) -> Option<Tmux> {
        if !have_tmux() {
            return None;
        }
        let mut t = Tmux {
            socket: format!("toffload-tui-{}-{test}", std::process::id()),
            socket_path: None,
        };
        // -f /dev/null: no user config (status line, sizes, key bindings).
        let out = t.tmux(&[
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "80",
            "-y",
            "24",
            &format!("env PS1='{PROMPT}' bash --norc --noprofile"),
        ]);
        assert!(out.status.success(), "tmux new-session: {out:?}");
        t.socket_path = Some(t.display("#{socket_path}")).filter(|p| !p.is_empty());
        // capture-pane drops trailing blanks: the prompt line reads "tui$".
        t.wait_for("the shell prompt", |s| {
            s.lines().any(|l| l == PROMPT.trim_end())
        });
        Some(t)
    }

    fn tmux(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .args(["-L", &self.socket, "-f", "/dev/null"])
            .args(args)
            .output()
            .expect("run tmux")
    }

    /// Types `text` literally, then Enter.
    fn type_line(&self, text: &str) {
        self.tmux(&["send-keys", "-t", "t", "-l", text]);
        self.key("Enter");
    }

    /// A key by tmux's name ("Escape", "Enter") or a single character.
    fn key(&self, k: &str) {
        let literal = k.chars().count() == 1;
        let args: &[&str] = if literal {
            &["send-keys", "-t", "t", "-l", k]
        } else {
            &["send-keys", "-t", "t", k]
        };
        let out = self.tmux(args);
        assert!(out.status.success(), "send-keys {k}: {out:?}");
    }

    /// The visible screen plus some history (where a panic message may scroll to).
    fn capture(&self) -> String {
        let out = self.tmux(&["capture-pane", "-p", "-t", "t", "-S", "-50"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn display(&self, format: &str) -> String {
        let out = self.tmux(&["display-message", "-p", "-t", "t", format]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Polls the screen until `ok`, for at most WAIT; panics with the screen if not.
    fn wait_for(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let s = self.capture();
            if ok(&s) {
                return s;
            }
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}; the screen:\n{s}");
            }
            sleep(Duration::from_millis(50));
        }
    }

    fn run_dashboard(&self, flags: &str) {
        self.type_line(&format!("{BIN} --interval-ms 300 {flags}; echo EXIT-$?"));
        self.wait_for("every panel title", all_titles);
    }

    /// After the dashboard ended: it exited with `code`, the shell is back on its
    /// main screen, and the terminal is cooked (line editing, echo).
    fn assert_terminal_restored(&self, code: i32) {
        let exit = format!("EXIT-{code}");
        // The typed command line holds "EXIT-$?", so only the expanded one matches.
        self.wait_for(&exit, |s| s.lines().any(|l| l.trim() == exit));
        assert_eq!(
            self.display("#{alternate_on}"),
            "0",
            "still on the alternate screen"
        );
        self.type_line("stty -a; echo STTY-DONE");
        let s = self.wait_for("stty's output", |s| {
            s.lines().any(|l| l.trim() == "STTY-DONE")
        });
        let flags: Vec<&str> = s
            .split(|c: char| c.is_whitespace() || c == ';')
            .filter(|w| !w.is_empty())
            .collect();
        for want in ["icanon", "echo", "isig"] {
            assert!(
                flags.contains(&want) && !flags.contains(&format!("-{want}").as_str()),
                "terminal not cooked ({want}):\n{s}"
            );
        }
        // No dashboard left over on the shell's screen.
        for t in PANEL_TITLES {
            assert!(
                !s.contains(&format!("┌{t}")),
                "dashboard left on screen:\n{s}"
            );
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.tmux(&["kill-server"]);
        if let Some(p) = &self.socket_path {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn all_titles(s: &str) -> bool {
    PANEL_TITLES.iter().all(|t| s.contains(t)) && s.contains(FOOTER_KEYS)
}

/// Whether the screen was laid out for `width` columns: the right column's top
/// border (the Prediction panel's) closes in the last one.
fn drawn_at_width(screen: &str, width: usize) -> bool {
    screen
        .lines()
        .any(|l| l.contains("┌Prediction") && l.ends_with('┐') && l.chars().count() == width)
}

/// The first number under the "Requests/s" title: the latest window's rate.
fn requests_value(screen: &str) -> Option<String> {
    let lines: Vec<&str> = screen.lines().collect();
    let (i, col) = lines
        .iter()
        .enumerate()
        .find_map(|(i, l)| l.find("Requests/s").map(|c| (i, l[..c].chars().count())))?;
    let below: String = lines.get(i + 1)?.chars().skip(col).collect();
    below
        .split_whitespace()
        .next()
        .filter(|v| v.chars().any(|c| c.is_ascii_digit()))
        .map(str::to_string)
}

#[test]
fn every_title_at_80x24_and_the_numbers_move() {
    let Some(t) = Tmux::start("titles") else {
        return;
    };
    t.run_dashboard("");
    assert_eq!(t.display("#{window_width}x#{window_height}"), "80x24");
    let first = t.wait_for("a requests/s value", |s| requests_value(s).is_some());
    let first = requests_value(&first).unwrap();
    t.wait_for("the requests/s value to change", |s| {
        requests_value(s).is_some_and(|v| v != first)
    });
    t.key("q");
    t.assert_terminal_restored(0);
}

#[test]
fn help_opens_with_question_mark_and_escape_closes_it() {
    let Some(t) = Tmux::start("help") else {
        return;
    };
    t.run_dashboard("");
    assert!(!t.capture().contains(HELP_TITLE));
    t.key("?");
    t.wait_for("the help", |s| s.contains(HELP_TITLE));
    t.key("Escape");
    t.wait_for("the help to close", |s| {
        !s.contains(HELP_TITLE) && all_titles(s)
    });
    t.key("q");
    t.assert_terminal_restored(0);
}

#[test]
fn inject_asks_first_and_y_injects() {
    let Some(t) = Tmux::start("inject") else {
        return;
    };
    t.run_dashboard("--pid 4242");
    t.key("i");
    t.wait_for("the confirm dialog", |s| {
        s.contains("Inject the fiber runtime into pid 4242? y/n") && s.contains(CONFIRM_TITLE)
    });
    t.key("n");
    t.wait_for("the dialog to close", |s| !s.contains("y/n"));
    assert!(!t.capture().contains("injected (synthetic)"));
    t.key("i");
    t.wait_for("the confirm dialog", |s| s.contains("y/n"));
    t.key("y");
    t.wait_for("the injection", |s| {
        s.contains("injected (synthetic)") && !s.contains("y/n")
    });
    t.key("q");
    t.assert_terminal_restored(0);
}

#[test]
fn resize_to_120x40_keeps_every_title() {
    let Some(t) = Tmux::start("resize") else {
        return;
    };
    t.run_dashboard("");
    let out = t.tmux(&["resize-window", "-t", "t", "-x", "120", "-y", "40"]);
    assert!(out.status.success(), "resize-window: {out:?}");
    assert_eq!(t.display("#{window_width}x#{window_height}"), "120x40");
    let s = t.wait_for("the 120x40 layout", |s| {
        all_titles(s) && drawn_at_width(s, 120)
    });
    assert!(!s.contains("panicked"), "{s}");
    assert_eq!(
        t.display("#{alternate_on}"),
        "1",
        "the dashboard died:\n{s}"
    );
    // And back down.
    t.tmux(&["resize-window", "-t", "t", "-x", "80", "-y", "24"]);
    t.wait_for("the 80x24 layout", |s| {
        all_titles(s) && drawn_at_width(s, 80)
    });
    t.key("q");
    t.assert_terminal_restored(0);
}

#[test]
fn ctrl_c_quits() {
    let Some(t) = Tmux::start("ctrlc") else {
        return;
    };
    t.run_dashboard("");
    t.key("C-c");
    t.assert_terminal_restored(0);
}

#[test]
fn exit_after_restores_the_terminal() {
    let Some(t) = Tmux::start("exit") else {
        return;
    };
    t.run_dashboard("--exit-after 1.5");
    t.assert_terminal_restored(0);
}

#[test]
fn a_panic_restores_the_terminal() {
    let Some(t) = Tmux::start("panic") else {
        return;
    };
    t.run_dashboard("--panic-after 1");
    // The previous hook (the default one) still ran, after the restore: its message
    // is on the shell's screen.
    t.wait_for("the panic message", |s| {
        s.contains("synthetic panic (--panic-after)")
    });
    t.assert_terminal_restored(101);
}
