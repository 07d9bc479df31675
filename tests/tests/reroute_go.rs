//! The Go reroute (backends/integrations/go): accelhttp, a net/http server built with
//! Debian's golang-go against libtoffload_accel.so through cgo, offering the offload
//! as `GET /serial` (accel_run under one mutex: one offload at a time), `GET /sync`
//! (accel_run straight from the handler: Go's scheduler overlaps the blocked cgo
//! calls on more OS threads, zero async code) and `GET /async` (accel_submit, the
//! goroutine waits on a channel, the completion fd in Go's netpoller).
//!
//! The program is built here with `go build` into a temporary folder, so no build step
//! is needed beyond `cargo xtask build`. A missing go skips with the reason (fails
//! under CI). `reroute_go_benchmark` measures the three forms with wrk at 50, 200
//! and 1000 us; with TOFFLOAD_REROUTE_OUT=path (what `cargo xtask bench reroute`
//! sets) it also writes its table beside that file, as reroute-go.md.
//!
//! The `guard_*` tests: `/incr` (read a counter the handlers share, offload through
//! /async's path, write it back plus one) under the conflict guard's C API, hazard
//! first, then detect and enforce (tests/src/reroute_guard.rs), and Go's own SIGSEGV
//! handling beside the guard's handler; `guard_benchmark` writes the Go section of
//! tests/results/guard.md.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use toffload_tests::harness;
use toffload_tests::reroute::{
    self, check_answers, count_lines, cpus_apart, find, medians, model_error_line,
    prediction_cells, rounds, write_result, wrk, wrong_under_clients, Client, Server,
};
use toffload_tests::reroute_guard;

/// A 2-core machine: one server test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../backends/integrations/go")
}

/// PATH with the folder of `exe` first, so that make's recipe finds the go we found.
fn path_with(exe: &Path) -> std::ffi::OsString {
    let dirs = exe.parent().map(Path::to_path_buf).into_iter();
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::join_paths(dirs.chain(std::env::split_paths(&path))).unwrap_or(path)
}

/// Builds accelhttp (once per test binary) into a temporary folder, or None after
/// skipping (fails under CI).
fn accelhttp() -> Option<PathBuf> {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = built.as_ref() {
        return Some(p.clone());
    }
    let Some(go) = find("go") else {
        harness::skip("go is not installed (Debian package golang-go; .ci/run installs it)");
        return None;
    };
    let dist = harness::dist();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("accelhttp");
    std::fs::create_dir_all(&out).expect("build folder");
    let exe = out.join("accelhttp");
    // The Makefile holds the build's flags (`cargo xtask build` runs it too).
    let o = Command::new("timeout")
        .arg("300")
        .args(["make", "-s", "-C"])
        .arg(src())
        .arg(format!("DIST={}", dist.display()))
        .arg(format!("OUT={}", exe.display()))
        .env("PATH", path_with(&go))
        .env("GOCACHE", out.join("gocache"))
        .env("GOPATH", out.join("gopath"))
        .output()
        .expect("running make (go build)");
    assert!(
        o.status.success(),
        "make (go build) failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    *built = Some(exe.clone());
    Some(exe)
}

/// accelhttp with `env`, pinned to `cpu`.
fn start(exe: &Path, env: &[(&str, String)], cpu: Option<usize>) -> Server {
    let mut c = Command::new(exe);
    c.args(["-port", "0"]);
    Server::spawn(&mut c, env, cpu, "accelhttp")
}

const FORMS: [&str; 3] = ["serial", "sync", "async"];

#[test]
fn every_form_answers_aes_ctr_bit_identically() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    let env = [
        ("TOFFLOAD_EMU_LAT_US", "200".to_string()),
        ("TOFFLOAD_WAIT", "block".to_string()),
    ];
    let s = start(&exe, &env, None);
    check_answers(s.port, &FORMS);
    let mut c = Client::connect(s.port);
    for form in ["sync", "async"] {
        let wrong = wrong_under_clients(s.port, &format!("/{form}?n=1024"), 64, 20);
        assert_eq!(wrong, 0, "wrong /{form} answers under 64 clients");
    }
    let v = c.numbers("/stats");
    println!(
        "/async: {} at most in flight, {} finished; {} threads",
        v[1], v[2], v[3]
    );
    assert!(v[2] >= 64 * 20, "only {} finished", v[2]);
    assert!(v[1] > 1, "/async never had more than one offload in flight");
    assert_eq!(v[0], 0);
}

#[test]
fn bad_input_and_backend_errors_are_http_errors() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    let mut s = start(&exe, &[("TOFFLOAD_EMU_LAT_US", "50".into())], None);
    let mut c = Client::connect(s.port);
    for (target, code) in [
        ("/async?n=0", 400),
        ("/sync?n=abc", 400),
        ("/serial?n=-5", 400),
        ("/async?n=2097152", 400),
        ("/nowhere", 404),
    ] {
        let (got, body) = c.get(target);
        assert_eq!(got, code, "{target}: {}", String::from_utf8_lossy(&body));
    }
    let mut bad = Client::connect(s.port);
    assert_eq!(
        bad.raw(b"POST /async HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
            .0,
        400
    );
    assert_eq!(c.get("/async?n=16").0, 200);
    assert!(s.alive());
    drop(s);

    // A malformed device knob: every offload fails with -EINVAL, as an HTTP error.
    let mut s = start(&exe, &[("TOFFLOAD_EMU_LANES", "0".into())], None);
    let mut c = Client::connect(s.port);
    for form in FORMS {
        let (code, body) = c.get(&format!("/{form}?n=64"));
        let text = String::from_utf8_lossy(&body).to_lowercase();
        assert_eq!(code, 500, "/{form} with TOFFLOAD_EMU_LANES=0: {text}");
        assert!(text.contains("invalid argument"), "{text}");
    }
    assert!(s.alive(), "the server died of a device error");
}

#[test]
fn reroute_go_benchmark() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    let Some(wrk_exe) = find("wrk") else {
        harness::skip("wrk is not installed (Debian package wrk; .ci/run installs it)");
        return;
    };
    let text = std::fs::read_to_string(src().join("main.go")).expect("main.go");
    let (reroute_all, reroute_code) = count_lines(&text, "//", "REROUTE");
    let (sync_all, sync_code) = count_lines(&text, "//", "SYNC");
    assert!(reroute_code > 0 && sync_code > 0, "line markers missing");
    let rounds = rounds();
    let conns = 64;
    let (scpu, lcpu) = cpus_apart();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut rows = Vec::new();
    let mut points = Vec::new();
    let mut speedups_1000 = (0.0, 0.0);
    for lat_us in [50u64, 200, 1000] {
        // block: a blocking cgo call that spins would hold its thread's CPU, and
        // /sync's overlap is the scheduler's, on threads that must sleep.
        let env = vec![
            ("TOFFLOAD_EMU_LAT_US", lat_us.to_string()),
            ("TOFFLOAD_EMU_LANES", "64".to_string()),
            ("TOFFLOAD_WAIT", "block".to_string()),
        ];
        let s = start(&exe, &env, scpu);
        let predicted = reroute::predicted_reroute(s.child.id(), rounds, || {
            let secs = reroute::WATCHED_LOAD_SECS;
            reroute::wrk_for(&wrk_exe, s.port, "/serial?n=1024", conns, lcpu, secs);
        });
        let mut runs: [Vec<_>; 3] = Default::default();
        for _ in 0..rounds {
            for (i, form) in FORMS.iter().enumerate() {
                runs[i].push(wrk(
                    &wrk_exe,
                    s.port,
                    &format!("/{form}?n=1024"),
                    conns,
                    lcpu,
                ));
            }
        }
        let v = Client::connect(s.port).numbers("/stats");
        let (most, threads) = (v[1], v[3]);
        let [a, b, c] = [medians(&runs[0]), medians(&runs[1]), medians(&runs[2])];
        let (sync_x, async_x) = (b.0 / a.0, c.0 / a.0);
        if lat_us == 1000 {
            speedups_1000 = (sync_x, async_x);
        }
        println!(
            "{lat_us} us: /serial {:.0}, /sync {:.0} ({sync_x:.2}x), /async {:.0} req/s \
             ({async_x:.2}x); async at most {most} in flight; {threads} threads",
            a.0, b.0, c.0
        );
        if let Some(p) = predicted {
            points.push((p, async_x));
        }
        let cells = prediction_cells(predicted, async_x);
        rows.push(format!(
            "| {lat_us} | {:.0} | {:.2} / {:.2} | {:.0} | {:.2} / {:.2} | {sync_x:.2}x | {:.0} | {:.2} / {:.2} | {async_x:.2}x | {cells} | {most} | {threads} |",
            a.0, a.1, a.2, b.0, b.1, b.2, c.0, c.1, c.2
        ));
    }
    let version = Command::new(find("go").expect("go"))
        .arg("version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| "go".into());
    let md = format!(
        "Go reroute: backends/integrations/go (accelhttp, net/http + cgo over libtoffload_accel.so), \
         built with Debian's {version}, driven by wrk (`-t1 -c{conns} -d2s --latency`, 1 KiB \
         payloads). Emulated device, 64 lanes, TOFFLOAD_WAIT=block, offload latency per row. \
         Server on core 0, wrk on core 1 (the device thread shares core 0 with the server). \
         {rounds} round(s) per row, medians. Load average at the start: {load}\n\
         Written by `reroute_go_benchmark` in tests/tests/reroute_go.rs (`cargo xtask bench \
         reroute` runs it with 3 rounds).\n\n\
         /serial holds one mutex across accel_run (one offload at a time, the baseline); /sync \
         calls accel_run straight from the handler ({sync_all} lines, {sync_code} of code: SYNC \
         markers), which Go's scheduler overlaps by handing each blocked call's P to another OS \
         thread; /async is the reroute ({reroute_all} lines, {reroute_code} of code: REROUTE \
         markers), the completion fd in Go's netpoller. Speedups are over /serial. \"threads\" is \
         the server's OS threads after the runs. predicted: toffload-watch's prediction for \
         the reroute from one 3 s watch per round of /serial under the same wrk load (the windows' \
         `model.recipe_speedup`, median), against the /async speedup; error = predicted / \
         measured - 1.\n\n\
         | offload us | /serial req/s | p50 / p99 ms | /sync req/s | p50 / p99 ms | sync speedup | /async req/s | p50 / p99 ms | async speedup | predicted | error | most in flight (async) | threads |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n{}\n\n\
         {}\n\n\
         Target: rerouted >= 2x the one-at-a-time form at 1000 us: {} (/sync {:.2}x, /async {:.2}x).\n",
        rows.join("\n"),
        model_error_line(&points),
        if speedups_1000.1 >= 2.0 { "met" } else { "not met" },
        speedups_1000.0,
        speedups_1000.1,
        load = load.trim(),
    );
    println!("\n{md}");
    write_result("reroute-go.md", &md);
    assert!(
        speedups_1000.1 > 2.0,
        "/async only {:.2}x /serial at 1000 us",
        speedups_1000.1
    );
}

// ---- the conflict guard on the rerouted path: /incr ---------------------------------

fn guarded(mode: &str, lat_us: u64) -> Vec<(&'static str, String)> {
    vec![
        ("TOFFLOAD_GUARD", mode.to_string()),
        ("TOFFLOAD_EMU_LAT_US", lat_us.to_string()),
    ]
}

#[test]
fn guard_unguarded_incr_loses_updates() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    let s = start(&exe, &guarded("off", 100), None);
    reroute_guard::check_unguarded_loses_updates(s.port);
}

#[test]
fn guard_detect_reports_conflicts() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    let s = start(&exe, &guarded("detect", 100), None);
    reroute_guard::check_detect_reports(s.port);
}

#[test]
fn guard_enforce_keeps_every_increment() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    let mut s = start(&exe, &guarded("enforce", 50), None);
    reroute_guard::check_enforce_keeps_all(s.port, 20_000);
    assert!(s.alive());
}

/// The guard's SIGSEGV handler replaces Go's (installed at the first registration)
/// and passes on every fault outside its pages: a nil dereference in Go code must
/// still become a recoverable panic, before and after the guard served faults.
#[test]
fn guard_leaves_gos_own_sigsegv_handling_working() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    for mode in ["detect", "enforce"] {
        let mut s = start(&exe, &guarded(mode, 50), None);
        let mut c = reroute_guard::Conn::new(s.port);
        let nil = |c: &mut reroute_guard::Conn| {
            let (code, body) = c.get("/nilderef");
            assert_eq!(code, 200, "{mode}: {body}");
            assert!(
                body.contains("recovered: runtime error: invalid memory address"),
                "{mode}: {body}"
            );
        };
        nil(&mut c);
        let run =
            reroute_guard::increments(s.port, "/incr", reroute_guard::Keys::One, 16, 2000, None);
        nil(&mut c);
        let g = reroute_guard::guard_stats(s.port);
        println!("{mode}: {run:?}, {g:?}");
        assert!(g.faults > 0, "{mode}: the guard saw no fault: {g:?}");
        assert_eq!(g.released, 0, "{mode}: {g:?}");
        assert!(s.alive(), "{mode}: accelhttp died");
    }
}

/// Why accelhttp runs each token's stretches under one mutex: the guard knows one
/// running token per process (one thread runs tokens). With the handlers calling it
/// from several threads at once (`-guard-unserialized`, an experiment), a thread's
/// access is seen as no token's and its page is given up, or a begin on one thread
/// overwrites another's running token: enforce loses updates (or, with another
/// thread's sigsetjmp point taken, the process may die). Serialized it loses none
/// (guard_enforce_keeps_every_increment).
#[test]
fn guard_unserialized_in_go_breaks_the_guarantee() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    let mut c = Command::new(&exe);
    c.args(["-port", "0", "-guard-unserialized"]);
    // Several Ps whatever the machine: handlers on several threads at once.
    let mut env = guarded("enforce", 50);
    env.push(("GOMAXPROCS", "8".to_string()));
    let mut s = Server::spawn(&mut c, &env, None, "accelhttp");
    let port = s.port;
    let run = std::panic::catch_unwind(|| {
        reroute_guard::increments(port, "/incr", reroute_guard::Keys::One, 32, 4000, None)
    });
    if !s.alive() {
        println!("unserialized: accelhttp died ({:?})", s.child.try_wait());
        return;
    }
    let run = run.expect("the increments failed while the server lived");
    let g = reroute_guard::guard_stats(port);
    println!("unserialized: {run:?}, lost {}, {g:?}", run.lost());
    assert!(
        run.lost() > 0 && g.released > 0,
        "unserialized enforce kept every increment: the mutex would not be needed"
    );
}

#[test]
fn guard_bad_mode_and_arguments_are_errors() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    let mut s = start(&exe, &guarded("enforce", 50), None);
    let mut c = reroute_guard::Conn::new(s.port);
    assert_eq!(c.get("/incr").0, 400, "/incr without k");
    assert_eq!(c.number("/incr?k="), 1, "an empty key is a key");
    assert_eq!(c.number("/sum"), 1);
    assert!(s.alive());
    drop(s);
    // A malformed TOFFLOAD_GUARD: accelhttp refuses to start and says why.
    let o = Command::new(&exe)
        .args(["-port", "0"])
        .env("TOFFLOAD_GUARD", "sometimes")
        .output()
        .expect("accelhttp");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("TOFFLOAD_GUARD must be off, detect or enforce"),
        "{err}"
    );
}

#[test]
fn guard_wait_has_a_deadline() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    let mut s = start(&exe, &guarded("enforce", 12_000_000), None);
    reroute_guard::check_guard_wait_has_a_deadline(s.port);
    assert!(s.alive());
}

#[test]
fn guard_clients_gone_leave_nothing_stuck() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    let mut s = start(&exe, &guarded("enforce", 50_000), None);
    reroute_guard::check_hang_ups_leave_nothing_stuck(s.port);
    assert!(s.alive());
}

/// Enforce vs the coarse lock (and unguarded, detect) for tests/results/guard.md.
#[test]
fn guard_benchmark() {
    let _g = serial();
    let Some(exe) = accelhttp() else { return };
    reroute_guard::benchmark(
        "Go net/http: /incr through the guard's C API",
        "accelhttp (Debian's golang-go, cgo), handlers on many OS threads: the stretches that run \
         a token (begin, read, park; resume, write back, end) run in C under one mutex, the \
         offload between them (/async's path) unlocked.",
        &|env, cpu| {
            let s = start(&exe, env, cpu);
            let port = s.port;
            (Box::new(s), port)
        },
    );
}
