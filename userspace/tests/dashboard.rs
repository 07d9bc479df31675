//! `toffload-watch --pid N --tui` in a real terminal, over a real watched server, as
//! root: conn_server on the emulated device (200 us, blocking wait) under the load
//! generator, the watcher's dashboard in a detached 80x24 tmux session; send-keys
//! types, capture-pane reads the screen. Checks what the synthetic driver's tmux tests
//! (tui/tests/tmux.rs) cannot: the real watcher's numbers reach the panels and move,
//! its keys (help, pause, the inject dialog cancelled) act on it, a resize, a clean
//! quit that leaves a cooked terminal and the server serving; and a panic inside the
//! real watcher's dashboard (the TOFFLOAD_TUI_TEST_PANIC=1 hook) giving the terminal
//! back, with the panic message on stderr and a nonzero exit.
//!
//! Skipped with a message when not root, the watcher is not built, BPF is refused or
//! tmux is missing; under CI (TOFFLOAD_NO_SKIP=1, set by `cargo xtask test` when
//! CI=true) each of those fails instead. Each test has its own tmux server (-L
//! socket), killed at the end even when the test fails; every wait is bounded.

mod common;
use common::{ready, serial};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::sleep;
use std::time::{Duration, Instant};

use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::load::{self, Config};
use toffload_tests::tmux::{
    self, drawn_at_width, exit_code, have_tmux, requests_value, Session, Tmux,
};
use toffload_tui::{CONFIRM_TITLE, FOOTER_KEYS, HELP_TITLE, PANEL_TITLES};
use toffload_watch::dashboard::{TEST_PANIC_ENV, TEST_PANIC_MESSAGE};

const PROMPT: &str = "dash$ ";
/// Screen changes the dashboard makes by itself (a key's redraw, a new window).
const WAIT: Duration = Duration::from_secs(15);
/// The watcher's start: BPF load and attach, the context-switch calibration.
const START: Duration = Duration::from_secs(45);
/// The watcher's window: short, so that the numbers move between two captures.
const INTERVAL_MS: u64 = 300;

/// The watcher's session: waits read the visible screen only. RUST_BACKTRACE=0: a
/// backtrace would push the panic message off the captured screen.
const SESSION: Session = Session {
    name: "toffload-dash",
    prompt: PROMPT,
    env: &["TERM=xterm-256color", "RUST_BACKTRACE=0"],
    history: false,
    wait: WAIT,
    titles: PANEL_TITLES,
    cursor: true,
};

/// Types the watcher's command line on `pid` into the pane's shell, its exit
/// status echoed as EXIT-<code>; stderr to the terminal (as a user runs it) or
/// to a file.
fn type_watch(t: &Tmux, env: &str, pid: u32, stderr: Option<&Path>) {
    let watch = harness::bin("toffload-watch").expect("built");
    let redirect = stderr.map_or(String::new(), |p| format!(" 2>{}", p.display()));
    t.type_line(&format!(
        "{env}{} --pid {pid} --tui --interval {INTERVAL_MS}ms{redirect}; echo EXIT-$?",
        watch.display(),
    ));
}

/// Starts the watcher's dashboard (stderr on the terminal) and waits until every
/// panel is drawn. False (after harness::skip, which fails under CI) when the
/// watcher could not load its BPF programs.
fn run_dashboard(t: &Tmux, pid: u32) -> bool {
    type_watch(t, "", pid, None);
    let s = t.wait_for("every panel title (or the watcher's exit)", START, |s| {
        all_titles(s) || exit_code(s).is_some()
    });
    match exit_code(&s) {
        None => true,
        Some(4) => {
            harness::skip(&format!("BPF unavailable (toffload-watch exit 4):\n{s}"));
            false
        }
        Some(code) => panic!("toffload-watch exited {code} before drawing:\n{s}"),
    }
}

fn all_titles(s: &str) -> bool {
    tmux::all_titles(s, PANEL_TITLES, FOOTER_KEYS)
}

fn parse_rate(v: &str) -> f64 {
    let v = v.replace(',', "");
    match v.strip_suffix('M') {
        Some(m) => m.parse::<f64>().map_or(f64::NAN, |x| x * 1e6),
        None => v.parse().unwrap_or(f64::NAN),
    }
}

/// The header's PAUSED marker, at the end of its line (capture-pane trims the
/// trailing blank).
fn paused(screen: &str) -> bool {
    target_line(screen).is_some_and(|l| l.trim_end().ends_with(" PAUSED"))
}

/// The header line: " Target  pid N  /path/to/exe  runtime ...".
fn target_line(screen: &str) -> Option<&str> {
    screen.lines().find(|l| l.contains(" Target "))
}

/// A unique scratch folder for the watcher's stderr.
fn scratch(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("toffload-dash-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch folder");
    d
}

/// conn_server on the emulated device, 200 us, blocking wait; pinned to core 0 when
/// there are two (the load generator takes core 1), as the other suites do.
fn conn_server() -> Server {
    Server::start(
        &ServerSpec::new("conn_server")
            .env("TOFFLOAD_EMU_LAT_US", "200")
            .env("TOFFLOAD_WAIT", "block")
            .cpu((harness::cpus() >= 2).then_some(0)),
    )
    .expect("conn_server starts")
}

/// The load generator, one run without gaps until stopped (also when dropped, as a
/// failing test unwinds); what it saw. Rounds with reconnects between them left idle
/// gaps, and a sampled window that fell in one rightly read 0 requests/s.
struct Load {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<(u64, u64, u64)>>,
}

impl Load {
    fn start(port: u16) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            if harness::cpus() >= 2 {
                let _ = harness::pin_current_thread(1);
            }
            let mut cfg = Config::new(port);
            cfg.conns = 16;
            // Bounded even if nobody stops it.
            cfg.duration = Duration::from_secs(300);
            cfg.warmup = Duration::from_millis(50);
            cfg.stop = Some(flag);
            let r = load::run(&cfg).expect("load runs");
            (r.completed, r.wrong, r.errors)
        });
        Load {
            stop,
            thread: Some(thread),
        }
    }

    /// (completed, wrong, errors) over the run.
    fn finish(mut self) -> (u64, u64, u64) {
        self.stop.store(true, Ordering::SeqCst);
        let t = self.thread.take().expect("running");
        t.join().expect("load thread")
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Everything the dashboard does over a real watch, in one session (one watcher
/// start, the slow part): panels, moving numbers, help, pause, the inject dialog
/// cancelled, a resize and back, and a clean quit with the server still serving.
#[test]
fn dashboard_over_a_watched_conn_server() {
    let _g = serial();
    if !ready() || !have_tmux() {
        return;
    }
    let mut server = conn_server();
    let pid = server.pid();
    let bg = Load::start(server.port);
    let t = Tmux::start(&SESSION, "live");
    if !run_dashboard(&t, pid) {
        let _ = bg.finish();
        return;
    }
    assert_eq!(t.display("#{window_width}x#{window_height}"), "80x24");
    assert_eq!(
        t.display("#{alternate_on}"),
        "1",
        "not on the alternate screen"
    );

    // The target: this pid and its command; the verdict; the numbers. Waited for
    // as a whole: capture-pane can catch the terminal halfway through a frame.
    let exe = std::fs::canonicalize(harness::bin("conn_server").expect("built"))
        .expect("conn_server's path")
        .display()
        .to_string();
    let s = t.wait_for(
        "a whole frame with the verdict and a request rate",
        START,
        |s| {
            all_titles(s)
                && s.contains("(fiberizable)")
                && requests_value(s).is_some_and(|v| parse_rate(&v) > 0.0)
                && [
                    "Stall p50/p99",
                    "Stall histogram",
                    "Wakeup p50/p99",
                    "not injected",
                ]
                .iter()
                .all(|w| s.contains(w))
                && target_line(s).is_some_and(|l| l.contains(&format!(" pid {pid}  ")))
        },
    );
    let header = target_line(&s).expect("the Target line");
    let after_pid = header
        .split_once(&format!(" pid {pid}  "))
        .expect("the pid in the header")
        .1;
    // The command is the executable's path, cut at the screen's edge if long.
    assert!(
        after_pid.starts_with(&exe) || exe.starts_with(after_pid.trim_end()),
        "command {exe:?} not in the header {header:?}"
    );
    // The watcher's stderr is this terminal too: nothing it wrote there (its
    // "attached" line) is over the panels; every row is where the layout put it.
    assert!(
        !s.contains("toffload-watch:"),
        "stray output on the dashboard:\n{s}"
    );
    assert_eq!(s.lines().count(), 24, "{s}");
    assert!(
        s.lines().next().is_some_and(|l| l.starts_with(" Target ")),
        "the header is not on the first row:\n{s}"
    );
    assert!(
        s.lines()
            .nth(23)
            .is_some_and(|l| l.starts_with(&format!(" {FOOTER_KEYS}"))),
        "the footer is not on the last row:\n{s}"
    );

    // The rate moves from window to window, and stays above zero.
    let first = requests_value(&s).expect("a rate");
    let s = t.wait_for("the requests/s value to change", WAIT, |s| {
        requests_value(s).is_some_and(|v| v != first)
    });
    let second = requests_value(&s).expect("a rate");
    assert!(parse_rate(&second) > 0.0, "{second}:\n{s}");
    eprintln!("requests/s on screen: {first} then {second}");

    // Help: '?' opens it over the panels, Escape closes it.
    assert!(!s.contains(&format!("┌{HELP_TITLE}")));
    t.key("?");
    t.wait_for("the help", WAIT, |s| {
        s.contains(&format!("┌{HELP_TITLE}")) && s.contains("close this help")
    });
    t.key("Escape");
    t.wait_for("the help to close", WAIT, |s| {
        !s.contains("close this help") && all_titles(s)
    });

    // Pause: the header says so and the numbers hold still over several windows.
    t.key("p");
    let s = t.wait_for("the PAUSED marker", WAIT, paused);
    let held = requests_value(&s).expect("a rate while paused");
    let until = Instant::now() + Duration::from_millis(INTERVAL_MS * 5);
    while Instant::now() < until {
        let s = t.screen();
        assert_eq!(
            requests_value(&s).as_deref(),
            Some(held.as_str()),
            "the rate changed while paused:\n{s}"
        );
        assert!(paused(&s), "the pause ended by itself:\n{s}");
        sleep(Duration::from_millis(100));
    }
    t.key("p");
    t.wait_for("the rate to move again after the pause", WAIT, |s| {
        !paused(s) && requests_value(s).is_some_and(|v| v != held)
    });

    // The inject dialog asks first; 'n' and Escape cancel, nothing is injected.
    for cancel in ["n", "Escape"] {
        t.key("i");
        t.wait_for("the confirm dialog", WAIT, |s| {
            s.contains(&format!("┌{CONFIRM_TITLE}"))
                && s.contains(&format!("Inject the fiber runtime into pid {pid}? y/n"))
        });
        t.key(cancel);
        t.wait_for("the dialog to close", WAIT, |s| {
            !s.contains("y/n") && all_titles(s)
        });
    }
    let s = t.wait_for("the panels after the dialog", WAIT, |s| {
        all_titles(s) && s.contains("not injected")
    });
    assert!(!s.contains("inject ["), "an injection was started:\n{s}");
    assert!(server.alive(), "the server {pid} was stopped");
    assert!(target_line(&s).is_some_and(|l| l.contains(&format!(" pid {pid} "))));

    // A resize up and back down: every panel laid out again for each size.
    t.resize(120, 40);
    let s = t.wait_for("the 120x40 layout", WAIT, |s| {
        all_titles(s) && drawn_at_width(s, 120)
    });
    assert!(!s.contains("panicked"), "{s}");
    t.resize(80, 24);
    let s = t.wait_for("the 80x24 layout", WAIT, |s| {
        all_titles(s) && drawn_at_width(s, 80) && requests_value(s).is_some()
    });
    // Still live after the resizes.
    let before = requests_value(&s).expect("a rate");
    t.wait_for("the rate to move after the resizes", WAIT, |s| {
        requests_value(s).is_some_and(|v| v != before)
    });

    // 'q': exit 0, the terminal given back; the watched server kept serving.
    t.key("q");
    t.assert_terminal_restored(0);
    // What the watcher wrote to stderr meanwhile is on the shell's screen now.
    let s = t.capture();
    assert!(
        s.contains(&format!("toffload-watch: attached to pid {pid}")) && !s.contains("panicked"),
        "the watcher's stderr is not on the shell's screen:\n{s}"
    );
    assert!(server.alive(), "the server {pid} died");
    let (completed, wrong, errors) = bg.finish();
    assert!(completed > 0, "no request completed");
    assert_eq!(
        (wrong, errors),
        (0, 0),
        "wrong answers / errors under watch"
    );
    let mut cfg = Config::new(server.port);
    cfg.conns = 8;
    cfg.duration = Duration::from_millis(500);
    cfg.warmup = Duration::from_millis(50);
    let after = load::run(&cfg).expect("load after the watch");
    assert!(
        after.completed > 0 && after.wrong == 0 && after.errors == 0,
        "{after:?}"
    );
    eprintln!("served under watch: {completed} requests, after: {after:?}");
}

/// A panic inside the real watcher's dashboard (the test hook, after the first
/// window is drawn), twice: with stderr on the terminal, as a user runs it, and with
/// stderr to a file. Each time the panic hook gives the shell a cooked terminal on
/// its main screen with the cursor shown, the exit is Rust's panic exit (101), the
/// panic message is on stderr (after the restore: on the shell's screen, not under
/// the dashboard), and the watched server is untouched.
#[test]
fn a_panic_in_the_watchers_dashboard_restores_the_terminal() {
    let _g = serial();
    if !ready() || !have_tmux() {
        return;
    }
    let mut server = conn_server();
    let pid = server.pid();
    let t = Tmux::start(&SESSION, "panic");
    let env = format!("{TEST_PANIC_ENV}=1 ");

    // stderr on the terminal. The dashboard may be gone before its titles could be
    // seen (it panics after the first window): wait for the exit.
    type_watch(&t, &env, pid, None);
    let s = t.wait_for("the watcher's exit", START, |s| exit_code(s).is_some());
    if exit_code(&s) == Some(4) {
        harness::skip(&format!("BPF unavailable (toffload-watch exit 4):\n{s}"));
        return;
    }
    t.assert_terminal_restored(101);
    let s = t.capture();
    for want in [
        format!("toffload-watch: attached to pid {pid}"),
        TEST_PANIC_MESSAGE.to_string(),
    ] {
        assert!(
            s.contains(&want),
            "{want:?} not on the shell's screen:\n{s}"
        );
    }
    assert!(!s.contains(FOOTER_KEYS), "dashboard left on screen:\n{s}");
    assert!(server.alive(), "the server {pid} died with the watcher");

    // stderr to a file: the message is there, and nothing of it on the screen.
    t.type_line("clear");
    t.wait_for("a cleared screen", WAIT, |s| {
        !s.contains(TEST_PANIC_MESSAGE) && s.lines().any(|l| l == PROMPT.trim_end())
    });
    let dir = scratch("panic");
    let stderr = dir.join("stderr");
    type_watch(&t, &env, pid, Some(&stderr));
    t.assert_terminal_restored(101);
    let err = std::fs::read_to_string(&stderr).unwrap_or_default();
    assert!(
        err.contains(&format!("attached to pid {pid}")),
        "did not attach:\n{err}"
    );
    assert!(err.contains(TEST_PANIC_MESSAGE), "no panic message:\n{err}");
    assert!(
        !t.screen().contains(TEST_PANIC_MESSAGE),
        "the panic message went to the terminal, not to stderr's file"
    );
    assert!(server.alive(), "the server {pid} died with the watcher");
    let _ = std::fs::remove_dir_all(&dir);
}
