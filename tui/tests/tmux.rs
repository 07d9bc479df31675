//! The synthetic dashboard in a real terminal: tmux runs it in a detached 80x24
//! session, send-keys types, capture-pane reads the screen. Checks what only a real
//! terminal shows: every title fits, the numbers move, the dialogs, a resize, and
//! that quitting or panicking gives the shell a cooked terminal on its main screen.
//!
//! Skipped (with a message) where tmux is not installed, unless TOFFLOAD_NO_SKIP=1
//! (CI), where that is a failure. Each test has its own tmux server (-L socket),
//! killed at the end even when the test fails; every wait gives up after 10 s.

use std::time::Duration;

use toffload_tests::tmux::{self, drawn_at_width, have_tmux, requests_value, Session, Tmux};
use toffload_tui::{CONFIRM_TITLE, FOOTER_KEYS, HELP_TITLE, PANEL_TITLES};

const BIN: &str = env!("CARGO_BIN_EXE_toffload-tui-synthetic");
const WAIT: Duration = Duration::from_secs(10);
const PROMPT: &str = "tui$ ";

/// The synthetic dashboard's session: every wait reads the history too (where a
/// panic message may scroll to).
const SESSION: Session = Session {
    name: "toffload-tui",
    prompt: PROMPT,
    env: &[],
    history: true,
    wait: WAIT,
    titles: PANEL_TITLES,
    cursor: false,
};

/// None when the test is to be skipped.
fn start(test: &str) -> Option<Tmux> {
    have_tmux().then(|| Tmux::start(&SESSION, test))
}

fn run_dashboard(t: &Tmux, flags: &str) {
    t.type_line(&format!("{BIN} --interval-ms 300 {flags}; echo EXIT-$?"));
    t.wait_for("every panel title", WAIT, all_titles);
}

fn all_titles(s: &str) -> bool {
    tmux::all_titles(s, PANEL_TITLES, FOOTER_KEYS)
}

#[test]
fn every_title_at_80x24_and_the_numbers_move() {
    let Some(t) = start("titles") else {
        return;
    };
    run_dashboard(&t, "");
    assert_eq!(t.display("#{window_width}x#{window_height}"), "80x24");
    let first = t.wait_for("a requests/s value", WAIT, |s| requests_value(s).is_some());
    let first = requests_value(&first).unwrap();
    t.wait_for("the requests/s value to change", WAIT, |s| {
        requests_value(s).is_some_and(|v| v != first)
    });
    t.key("q");
    t.assert_terminal_restored(0);
}

#[test]
fn help_opens_with_question_mark_and_escape_closes_it() {
    let Some(t) = start("help") else {
        return;
    };
    run_dashboard(&t, "");
    assert!(!t.capture().contains(HELP_TITLE));
    t.key("?");
    t.wait_for("the help", WAIT, |s| s.contains(HELP_TITLE));
    t.key("Escape");
    t.wait_for("the help to close", WAIT, |s| {
        !s.contains(HELP_TITLE) && all_titles(s)
    });
    t.key("q");
    t.assert_terminal_restored(0);
}

#[test]
fn inject_asks_first_and_y_injects() {
    let Some(t) = start("inject") else {
        return;
    };
    run_dashboard(&t, "--pid 4242");
    t.key("i");
    t.wait_for("the confirm dialog", WAIT, |s| {
        s.contains("Inject the fiber runtime into pid 4242? y/n") && s.contains(CONFIRM_TITLE)
    });
    t.key("n");
    t.wait_for("the dialog to close", WAIT, |s| !s.contains("y/n"));
    assert!(!t.capture().contains("injected (synthetic)"));
    t.key("i");
    t.wait_for("the confirm dialog", WAIT, |s| s.contains("y/n"));
    t.key("y");
    t.wait_for("the injection", WAIT, |s| {
        s.contains("injected (synthetic)") && !s.contains("y/n")
    });
    t.key("q");
    t.assert_terminal_restored(0);
}

#[test]
fn resize_to_120x40_keeps_every_title() {
    let Some(t) = start("resize") else {
        return;
    };
    run_dashboard(&t, "");
    t.resize(120, 40);
    let s = t.wait_for("the 120x40 layout", WAIT, |s| {
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
    t.wait_for("the 80x24 layout", WAIT, |s| {
        all_titles(s) && drawn_at_width(s, 80)
    });
    t.key("q");
    t.assert_terminal_restored(0);
}

#[test]
fn ctrl_c_quits() {
    let Some(t) = start("ctrlc") else {
        return;
    };
    run_dashboard(&t, "");
    t.key("C-c");
    t.assert_terminal_restored(0);
}

#[test]
fn exit_after_restores_the_terminal() {
    let Some(t) = start("exit") else {
        return;
    };
    run_dashboard(&t, "--exit-after 1.5");
    t.assert_terminal_restored(0);
}

#[test]
fn a_panic_restores_the_terminal() {
    let Some(t) = start("panic") else {
        return;
    };
    run_dashboard(&t, "--panic-after 1");
    // The previous hook (the default one) still ran, after the restore: its message
    // is on the shell's screen.
    t.wait_for("the panic message", WAIT, |s| {
        s.contains("synthetic panic (--panic-after)")
    });
    t.assert_terminal_restored(101);
}
