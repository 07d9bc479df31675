//! The dashboard rendered into ratatui's TestBackend: every panel title fits at
//! 80x24 and at 200x50, the pushed window's numbers are on screen, the dialogs open
//! and close.

use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ratatui::Terminal;
use toffload_tui::{
    synthetic, Command, Screen, State, WindowView, CONFIRM_TITLE, FOOTER_KEYS, HELP_TITLE,
    PANEL_TITLES,
};

/// The screen as text, one line per row.
fn draw(screen: &Screen, s: &State, w: u16, h: u16) -> String {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| screen.render(f, s)).unwrap();
    let buf = t.backend().buffer();
    let mut out = String::new();
    for y in 0..buf.area.height {
        for x in 0..buf.area.width {
            out.push_str(buf[(x, y)].symbol());
        }
        out.push('\n');
    }
    out
}

fn key(c: char) -> KeyEvent {
    KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE)
}

fn screen_with(n: u64) -> Screen {
    let mut screen = Screen::new();
    for i in 0..n {
        screen.push_window(synthetic::window(i));
    }
    screen
}

fn assert_titles(text: &str, size: &str) {
    for t in PANEL_TITLES {
        assert!(text.contains(t), "{size}: no {t:?} in\n{text}");
    }
    assert!(text.contains(FOOTER_KEYS), "{size}: no footer in\n{text}");
}

/// A service of several processes: its processes panel shows beside the syscalls.
#[test]
fn a_service_shows_its_processes() {
    let mut screen = Screen::new();
    let mut w = synthetic::window(0);
    w.processes = vec![
        toffload_tui::ProcessView {
            pid: 100,
            comm: "nginx".into(),
            role: "main".into(),
            model: "idle".into(),
            ..Default::default()
        },
        toffload_tui::ProcessView {
            pid: 101,
            comm: "nginx".into(),
            role: "child".into(),
            model: "event loop".into(),
            reads_per_sec: 12_000.0,
            threads: 1,
            connections: 16,
        },
    ];
    screen.push_window(w);
    let text = draw(&screen, &synthetic::state(100), 200, 50);
    assert!(text.contains("Processes"), "{text}");
    assert!(
        text.contains("nginx*"),
        "the main process is marked: {text}"
    );
    assert!(text.contains("event loop"), "{text}");
    assert!(text.contains("Syscalls"), "{text}");
    // One process: no processes panel.
    let one = screen_with(3);
    assert!(!draw(&one, &synthetic::state(100), 200, 50).contains("Processes"));
}

#[test]
fn every_title_at_80x24_and_200x50() {
    let screen = screen_with(30);
    let mut s = synthetic::state(4242);
    for (w, h) in [(80, 24), (200, 50), (120, 40), (100, 30)] {
        assert_titles(&draw(&screen, &s, w, h), &format!("{w}x{h}"));
    }
    // Still all there with the longest right column: injected, guard on, a stop sign.
    let (inj, guard) = synthetic::injected(4242, 20_000.0);
    s.injection = Some(inj);
    s.guard = Some(guard);
    s.prediction.as_mut().unwrap().stop = Some("raw futexes below libc".into());
    for (w, h) in [(80, 24), (200, 50)] {
        let text = draw(&screen, &s, w, h);
        assert_titles(&text, &format!("{w}x{h} injected"));
        assert!(text.contains("STOP"), "{w}x{h}: no stop sign in\n{text}");
        assert!(text.contains("faults"), "{w}x{h}: no guard in\n{text}");
    }
}

#[test]
fn empty_state_renders_everywhere() {
    // Before the first window and the first verdict; and tiny terminals must not panic.
    let screen = Screen::new();
    let s = State::default();
    assert_titles(&draw(&screen, &s, 80, 24), "empty 80x24");
    for (w, h) in [(1, 1), (10, 5), (40, 12), (79, 23), (300, 100)] {
        draw(&screen, &s, w, h);
        draw(&screen_with(3), &synthetic::state(1), w, h);
    }
}

#[test]
fn numbers_of_the_latest_window_appear() {
    let mut screen = screen_with(5);
    screen.push_window(WindowView {
        t_s: 5.0,
        requests_per_sec: 12_345.0,
        request_source: "socket reads".into(),
        stall_p50_us: Some(321.0),
        stall_p99_us: Some(987.0),
        voluntary_per_sec: 4_321.0,
        ..synthetic::window(5)
    });
    let s = synthetic::state(77);
    for (w, h) in [(80, 24), (200, 50)] {
        let text = draw(&screen, &s, w, h);
        for want in ["12,345", "p50 321us", "p99 987us", "vol 4,321", "pid 77"] {
            assert!(text.contains(want), "{w}x{h}: no {want:?} in\n{text}");
        }
    }
    // The syscall table shows the newest window's top call at the top.
    let text = draw(&screen, &s, 200, 50);
    let futex_row = text
        .find("futex  ")
        .or_else(|| text.find("futex "))
        .unwrap();
    assert!(futex_row < text.find("recvfrom").unwrap(), "{text}");
}

#[test]
fn pause_freezes_the_history() {
    let mut screen = screen_with(3);
    assert_eq!(screen.key(key('p')), Some(Command::Pause(true)));
    screen.push_window(synthetic::window(3));
    assert_eq!(screen.history().len(), 3);
    let text = draw(&screen, &synthetic::state(1), 80, 24);
    assert!(text.contains("PAUSED"), "{text}");
    assert_eq!(screen.key(key('p')), Some(Command::Pause(false)));
    screen.push_window(synthetic::window(3));
    assert_eq!(screen.history().len(), 4);
    assert!(!draw(&screen, &synthetic::state(1), 80, 24).contains("PAUSED"));
}

#[test]
fn help_overlay_appears_and_disappears() {
    let mut screen = screen_with(3);
    let s = synthetic::state(1);
    let help_line = "inject the fiber runtime";
    assert!(!draw(&screen, &s, 80, 24).contains(help_line));
    assert_eq!(screen.key(key('?')), None);
    for (w, h) in [(80, 24), (200, 50)] {
        let text = draw(&screen, &s, w, h);
        assert!(
            text.contains(HELP_TITLE) && text.contains(help_line),
            "{text}"
        );
    }
    screen.key(KeyEvent::new(KeyCode::Esc, KeyModifiers::NONE));
    assert!(!draw(&screen, &s, 80, 24).contains(help_line));
}

#[test]
fn confirm_dialog_then_inject() {
    let mut screen = screen_with(3);
    let s = synthetic::state(4242);
    let question = "Inject the fiber runtime into pid 4242? y/n";
    assert_eq!(screen.key(key('i')), None);
    let text = draw(&screen, &s, 80, 24);
    assert!(
        text.contains(question) && text.contains(CONFIRM_TITLE),
        "{text}"
    );
    assert_eq!(screen.key(key('x')), None);
    assert_eq!(screen.key(key('n')), None);
    assert!(!draw(&screen, &s, 80, 24).contains(question));
    screen.key(key('i'));
    assert_eq!(screen.key(key('y')), Some(Command::Inject));
    assert!(!draw(&screen, &s, 80, 24).contains(question));

    // A stop sign is repeated in the dialog.
    let mut stopped = s.clone();
    stopped.prediction.as_mut().unwrap().stop = Some("io_uring below libc".into());
    screen.key(key('i'));
    let text = draw(&screen, &stopped, 80, 24);
    assert!(text.contains("Warning: io_uring below libc"), "{text}");
}

#[test]
fn print_80x24() {
    // Not an assertion: `cargo test -p toffload-tui --test render -- --nocapture
    // print_80x24` shows the layout.
    let mut s = synthetic::state(4242);
    let (inj, guard) = synthetic::injected(4242, 20_000.0);
    s.injection = Some(inj);
    s.guard = Some(guard);
    println!("{}", draw(&screen_with(40), &s, 80, 24));
    println!("{}", draw(&screen_with(40), &s, 200, 50));
}

/// The latency panel: the runtime's percentiles where its counters carry them, N/A
/// for a stock server, whose counters carry none.
#[test]
fn latency_panel_shows_numbers_or_na() {
    let s = synthetic::state(9);
    let stock = screen_with(5);
    let mut injected = Screen::new();
    for i in 0..5 {
        injected.push_window(synthetic::injected_window(i));
    }
    let mut w = synthetic::injected_window(5);
    w.latency = Some(toffload_tui::LatencyView {
        p50_us: Some(271.0),
        p99_us: Some(612.0),
        p999_us: Some(1_234.0),
        offload_wait_p50_us: Some(203.0),
    });
    injected.push_window(w);
    for (w, h) in [(80, 24), (200, 50)] {
        let text = draw(&stock, &s, w, h);
        assert!(text.contains("Latency"), "{w}x{h}: no panel in\n{text}");
        assert!(text.contains("N/A"), "{w}x{h}: stock shows N/A\n{text}");
        let text = draw(&injected, &s, w, h);
        assert!(!text.contains("N/A"), "{w}x{h}: injected\n{text}");
        for want in ["p50 271us", "p99 612us", "p99.9 1.23ms"] {
            assert!(text.contains(want), "{w}x{h}: no {want:?} in\n{text}");
        }
    }
    // Big enough for the second line: the offload wait beside it.
    assert!(draw(&injected, &s, 200, 50).contains("offload wait p50 203us"));
    // Injected but idle: the window counted no request, a dash, not N/A.
    let mut idle = Screen::new();
    idle.push_window(toffload_tui::WindowView {
        latency: Some(toffload_tui::LatencyView::default()),
        ..synthetic::window(0)
    });
    let text = draw(&idle, &s, 200, 50);
    assert!(!text.contains("N/A") && text.contains("p50 -"), "{text}");
}
