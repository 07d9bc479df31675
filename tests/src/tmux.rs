//! A program in a real terminal, for the dashboards' tests: tmux runs a bare bash in
//! a detached 80x24 session on a private server (-L socket), send-keys types,
//! capture-pane reads the screen. The server is killed when the [`Tmux`] is dropped,
//! also when the test fails; every wait is bounded.
//!
//! [`have_tmux`] is the skip rule: where tmux is not installed the test is skipped
//! with a message ([`harness::skip`]), or fails under CI (TOFFLOAD_NO_SKIP=1).

use std::process::{Command, Output};
use std::thread::sleep;
use std::time::{Duration, Instant};

use crate::harness;

/// Whether tmux runs here; false after [`harness::skip`] (which fails under CI).
pub fn have_tmux() -> bool {
    let ok = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        harness::skip("tmux is not installed (apt-get install tmux; .ci/run installs it)");
    }
    ok
}

/// How a test's session is set up, and what its checks read.
#[derive(Clone, Copy, Debug)]
pub struct Session<'a> {
    /// Names the tmux server, with this process's id and the test's name.
    pub name: &'a str,
    /// The shell's PS1. capture-pane drops trailing blanks: a shell waiting for a
    /// line shows it trimmed.
    pub prompt: &'a str,
    /// The shell's environment besides PS1 ("NAME=value").
    pub env: &'a [&'a str],
    /// Whether [`Tmux::wait_for`] polls the history too ([`Tmux::capture`]) or the
    /// visible screen alone ([`Tmux::screen`]).
    pub history: bool,
    /// The longest wait for the shell: its prompt, its answer to stty, the
    /// program's exit in [`Tmux::assert_terminal_restored`].
    pub wait: Duration,
    /// The dashboard's panel titles: none may be left on the shell's screen.
    pub titles: &'a [&'a str],
    /// Whether [`Tmux::assert_terminal_restored`] checks that the cursor is shown.
    pub cursor: bool,
}

/// A private tmux server with one 80x24 window running a bare bash.
pub struct Tmux {
    socket: String,
    /// The socket file, removed at the end: kill-server leaves it behind.
    socket_path: Option<String>,
    history: bool,
    wait: Duration,
    titles: Vec<String>,
    cursor: bool,
}

impl Tmux {
    /// Starts the session for `test` and waits for the shell's prompt. Check
    /// [`have_tmux`] first.
    pub fn start(session: &Session, test: &str) -> Tmux {
        let mut t = Tmux {
            socket: format!("{}-{}-{test}", session.name, std::process::id()),
            socket_path: None,
            history: session.history,
            wait: session.wait,
            titles: session.titles.iter().map(|t| t.to_string()).collect(),
            cursor: session.cursor,
        };
        let prompt = session.prompt;
        let env: Vec<String> = std::iter::once(format!("PS1='{prompt}'"))
            .chain(session.env.iter().map(|e| e.to_string()))
            .collect();
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
            &format!("env {} bash --norc --noprofile", env.join(" ")),
        ]);
        assert!(out.status.success(), "tmux new-session: {out:?}");
        t.socket_path = Some(t.display("#{socket_path}")).filter(|p| !p.is_empty());
        t.wait_for("the shell prompt", t.wait, |s| {
            s.lines().any(|l| l == prompt.trim_end())
        });
        t
    }

    /// Runs tmux on this session's server.
    pub fn tmux(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .args(["-L", &self.socket, "-f", "/dev/null"])
            .args(args)
            .output()
            .expect("run tmux")
    }

    /// Types `text` literally, then Enter.
    pub fn type_line(&self, text: &str) {
        let out = self.tmux(&["send-keys", "-t", "t", "-l", text]);
        assert!(out.status.success(), "send-keys: {out:?}");
        self.key("Enter");
    }

    /// A key by tmux's name ("Escape", "Enter", "C-c") or a single character.
    pub fn key(&self, k: &str) {
        let args: &[&str] = if k.chars().count() == 1 {
            &["send-keys", "-t", "t", "-l", k]
        } else {
            &["send-keys", "-t", "t", k]
        };
        let out = self.tmux(args);
        assert!(out.status.success(), "send-keys {k}: {out:?}");
    }

    /// The visible screen plus some history (where a panic message may scroll to).
    pub fn capture(&self) -> String {
        let out = self.tmux(&["capture-pane", "-p", "-t", "t", "-S", "-50"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Only the visible screen.
    pub fn screen(&self) -> String {
        let out = self.tmux(&["capture-pane", "-p", "-t", "t"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// tmux's `format` expanded for the pane ("#{window_width}").
    pub fn display(&self, format: &str) -> String {
        let out = self.tmux(&["display-message", "-p", "-t", "t", format]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Resizes the window to `w`x`h`, and checks that it took.
    pub fn resize(&self, w: u16, h: u16) {
        let out = self.tmux(&[
            "resize-window",
            "-t",
            "t",
            "-x",
            &w.to_string(),
            "-y",
            &h.to_string(),
        ]);
        assert!(out.status.success(), "resize-window: {out:?}");
        assert_eq!(
            self.display("#{window_width}x#{window_height}"),
            format!("{w}x{h}")
        );
    }

    /// Polls the screen (with the history where the session says so) until `ok`,
    /// for at most `limit`; panics with the screen if not.
    pub fn wait_for(&self, what: &str, limit: Duration, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let s = if self.history {
                self.capture()
            } else {
                self.screen()
            };
            if ok(&s) {
                return s;
            }
            if Instant::now() > deadline {
                panic!("timed out after {limit:?} waiting for {what}; the screen:\n{s}");
            }
            sleep(Duration::from_millis(50));
        }
    }

    /// After the dashboard ended: it exited with `code` (echoed as EXIT-<code>), the
    /// shell is back on its main screen (with the cursor shown, where the session
    /// checks it), and the terminal is cooked (line editing, echo, signals).
    pub fn assert_terminal_restored(&self, code: i32) {
        let s = self.wait_for("the program's exit", self.wait, |s| exit_code(s).is_some());
        assert_eq!(exit_code(&s), Some(code), "exit code; the screen:\n{s}");
        assert_eq!(
            self.display("#{alternate_on}"),
            "0",
            "still on the alternate screen"
        );
        if self.cursor {
            assert_eq!(self.display("#{cursor_flag}"), "1", "the cursor is hidden");
        }
        // A cooked terminal echoes what is typed and hands the shell whole lines.
        self.type_line("stty -a; echo STTY-DONE");
        let s = self.wait_for("stty's output", self.wait, |s| {
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
        for t in &self.titles {
            assert!(
                !s.contains(&format!("┌{t}")),
                "dashboard left on screen:\n{s}"
            );
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        // SIGHUP to the pane's processes: a program still running ends with it.
        let _ = self.tmux(&["kill-server"]);
        if let Some(p) = &self.socket_path {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The expanded "EXIT-<code>" line (the typed command line holds "EXIT-$?").
pub fn exit_code(screen: &str) -> Option<i32> {
    screen
        .lines()
        .find_map(|l| l.trim().strip_prefix("EXIT-")?.parse().ok())
}

/// Whether every panel title and the footer's keys are on the screen.
pub fn all_titles(screen: &str, titles: &[&str], footer: &str) -> bool {
    titles.iter().all(|t| screen.contains(t)) && screen.contains(footer)
}

/// Whether the screen was laid out for `width` columns: the right column's top
/// border (the Prediction panel's) closes in the last one.
pub fn drawn_at_width(screen: &str, width: usize) -> bool {
    screen
        .lines()
        .any(|l| l.contains("┌Prediction") && l.ends_with('┐') && l.chars().count() == width)
}

/// The first number under the "Requests/s" title: the latest window's rate, as
/// drawn ("13,270").
pub fn requests_value(screen: &str) -> Option<String> {
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
