//! The demo (toffload-demo) end to end, as root: its rates agree with the load
//! generator's own count over the same seconds, and a deliberately wrong rate source
//! (the watcher's test switch that counts the runtime's counters over wall time and
//! divides by traced seconds, the bug this check was made for) is reported as an
//! error, not as a result.

use std::process::Command;
use toffload_tests::harness;

fn ready() -> bool {
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        harness::skip("the story attaches eBPF probes: needs root");
        return false;
    }
    for b in ["toffload-demo", "toffload-watch", "conn_server"] {
        if let Err(e) = harness::bin(b) {
            harness::skip(&e);
            return false;
        }
    }
    true
}

/// (exit code, stdout, stderr) of a short story, 5% of each interval traced after
/// the injection.
fn story(extra: &[&str]) -> (i32, String, String) {
    let out = Command::new(harness::bin("toffload-demo").expect("built"))
        .args(["--secs", "7", "--before", "2", "--sample", "5"])
        .args(extra)
        .output()
        .expect("run toffload-demo");
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    eprintln!("{o}\n{e}");
    (out.status.code().unwrap_or(-1), o, e)
}

// One test, so that the two stories never run side by side on a 2-core machine.
#[test]
fn the_story_cross_checks_its_rates_and_reports_a_wrong_source() {
    if !ready() {
        return;
    }
    // The hazard: the old rate source gives an after-rate many times the real one.
    let (code, _, err) = story(&["--test-mixed-clock"]);
    assert_eq!(code, 1, "a wrong rate source must fail the story: {err}");
    assert!(
        err.contains("mismatch: after the injection"),
        "not reported as a mismatch: {err}"
    );
    // The real source agrees with the load generator within 15%, up to three tries
    // (a window the host disturbed can still disagree; a wrong source fails all).
    let mut tries = Vec::new();
    for _ in 0..3 {
        let (code, out, err) = story(&[]);
        if code == 0 {
            assert!(out.contains("== 4. stock"), "{out}");
            assert!(out.contains("under_runtime"), "{out}");
            tries.clear();
            break;
        }
        tries.push(err);
    }
    assert!(tries.is_empty(), "the story failed 3 times: {tries:?}");
}
