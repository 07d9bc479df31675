//! The Python asyncio reroute (backends/integrations/python/toffload_asyncio.py):
//! Debian's stock python3 runs it over libtoffload_accel.so through ctypes, offering
//! the offload as `GET /sync` (accel_run on the event loop's thread) and `GET /async`
//! (accel_submit, the coroutine suspended on a future, the device's completion fd in
//! the loop with add_reader).
//!
//! `reroute_python_benchmark` measures both forms with wrk at 50, 200 and 1000 us;
//! with TOFFLOAD_REROUTE_OUT=path (what `cargo xtask bench reroute` sets) it also
//! writes its table beside that file, as reroute-python.md.
//!
//! The `guard_*` tests: `/incr` (read a counter, offload, write it back plus one)
//! under the conflict guard's C API (its sigsetjmp point in toffload_guard_helper.c,
//! built here with cc), hazard first, then detect and enforce
//! (tests/src/reroute_guard.rs); `guard_benchmark` writes the Python section of
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

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../backends/integrations/python/toffload_asyncio.py")
}

/// python3, or None after skipping (fails under CI).
fn python() -> Option<PathBuf> {
    let p = find("python3");
    if p.is_none() {
        harness::skip("python3 is not installed (Debian package python3; .ci/run installs it)");
    }
    p
}

/// The asyncio server with `env`, pinned to `cpu`.
fn start(python: &Path, env: &[(&str, String)], cpu: Option<usize>) -> Server {
    let lib = harness::dist().join("lib/libtoffload_accel.so");
    assert!(
        lib.is_file(),
        "{} missing: run cargo xtask build",
        lib.display()
    );
    let mut c = Command::new(python);
    c.arg(script()).args(["--port", "0", "--lib"]).arg(&lib);
    Server::spawn(&mut c, env, cpu, "the asyncio server")
}

/// toffload_guard_helper.so, built once by its Makefile against the dist.
fn guard_helper() -> PathBuf {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = built.as_ref() {
        return p.clone();
    }
    let dist = harness::dist();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("python-guard");
    std::fs::create_dir_all(&dir).expect("build folder");
    let out = dir.join("toffload_guard_helper.so");
    // The Makefile holds the build's flags (`cargo xtask build` runs it too).
    let o = Command::new("make")
        .args(["-s", "-C"])
        .arg(script().parent().expect("its folder"))
        .arg(format!("DIST={}", dist.display()))
        .arg(format!("OUT={}", out.display()))
        .output()
        .expect("running make");
    assert!(
        o.status.success(),
        "building toffload_guard_helper.so failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    *built = Some(out.clone());
    out
}

/// The asyncio server with the guard's counters (/incr and the rest).
fn start_guarded(python: &Path, env: &[(&str, String)], cpu: Option<usize>) -> Server {
    let lib = harness::dist().join("lib/libtoffload_accel.so");
    let mut c = Command::new(python);
    c.arg(script()).args(["--port", "0", "--lib"]).arg(&lib);
    c.arg("--guard-helper").arg(guard_helper());
    Server::spawn(&mut c, env, cpu, "the asyncio server")
}

#[test]
fn sync_and_async_answer_aes_ctr_bit_identically() {
    let _g = serial();
    let Some(py) = python() else { return };
    let s = start(&py, &[("TOFFLOAD_EMU_LAT_US", "200".into())], None);
    check_answers(s.port, &["sync", "async"]);
    let mut c = Client::connect(s.port);
    let wrong = wrong_under_clients(s.port, "/async?n=1024", 64, 20);
    assert_eq!(wrong, 0, "wrong /async answers under 64 clients");
    let [now, most, finished] = c.numbers("/stats")[..] else {
        panic!("/stats")
    };
    println!("/async: {most} at most in flight, {finished} finished, {now} now");
    assert!(finished >= 64 * 20, "only {finished} finished");
    assert!(most > 1, "/async never had more than one offload in flight");
    assert_eq!(now, 0);
}

#[test]
fn bad_input_and_backend_errors_are_http_errors() {
    let _g = serial();
    let Some(py) = python() else { return };
    let mut s = start(&py, &[("TOFFLOAD_EMU_LAT_US", "50".into())], None);
    let mut c = Client::connect(s.port);
    for (target, code) in [
        ("/async?n=0", 400),
        ("/async?n=abc", 400),
        ("/sync?n=-5", 400),
        ("/async?n=2097152", 400),
        ("/nowhere", 404),
    ] {
        let (got, body) = c.get(target);
        assert_eq!(got, code, "{target}: {}", String::from_utf8_lossy(&body));
    }
    // Not GET: an error, and the connection closes; the server serves the next.
    let mut bad = Client::connect(s.port);
    assert_eq!(bad.raw(b"POST /async HTTP/1.1\r\n\r\n").0, 400);
    // A header flood is cut off at 100 lines.
    let mut flood = Client::connect(s.port);
    let mut req = b"GET /async HTTP/1.1\r\n".to_vec();
    for i in 0..200 {
        req.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
    }
    req.extend_from_slice(b"\r\n");
    assert_eq!(flood.raw(&req).0, 431);
    assert_eq!(c.get("/async?n=16").0, 200);
    assert!(s.alive());
    drop(s);

    // A malformed device knob: every offload fails with -EINVAL, as an HTTP error.
    let mut s = start(&py, &[("TOFFLOAD_EMU_LANES", "0".into())], None);
    let mut c = Client::connect(s.port);
    for form in ["sync", "async"] {
        let (code, body) = c.get(&format!("/{form}?n=64"));
        let text = String::from_utf8_lossy(&body);
        assert_eq!(code, 500, "/{form} with TOFFLOAD_EMU_LANES=0: {text}");
        assert!(text.contains("Invalid argument"), "{text}");
    }
    assert!(s.alive(), "the server died of a device error");
}

// ---- the measurement ---------------------------------------------------------------

#[test]
fn reroute_python_benchmark() {
    let _g = serial();
    let Some(py) = python() else { return };
    let Some(wrk_exe) = find("wrk") else {
        harness::skip("wrk is not installed (Debian package wrk; .ci/run installs it)");
        return;
    };
    let src = std::fs::read_to_string(script()).expect("the script");
    let (reroute_all, reroute_code) = count_lines(&src, "#", "REROUTE");
    let (sync_all, sync_code) = count_lines(&src, "#", "SYNC");
    assert!(reroute_code > 0 && sync_code > 0, "line markers missing");
    let rounds = rounds();
    let conns = 64;
    let (scpu, lcpu) = cpus_apart();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut rows = Vec::new();
    let mut points = Vec::new();
    let mut speedup_1000 = 0.0;
    for lat_us in [50u64, 200, 1000] {
        let env = vec![
            ("TOFFLOAD_EMU_LAT_US", lat_us.to_string()),
            ("TOFFLOAD_EMU_LANES", "64".to_string()),
        ];
        let s = start(&py, &env, scpu);
        let predicted = reroute::predicted_reroute(s.child.id(), rounds, || {
            let secs = reroute::WATCHED_LOAD_SECS;
            reroute::wrk_for(&wrk_exe, s.port, "/sync?n=1024", conns, lcpu, secs);
        });
        let (mut sync, mut rerouted) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            sync.push(wrk(&wrk_exe, s.port, "/sync?n=1024", conns, lcpu));
            rerouted.push(wrk(&wrk_exe, s.port, "/async?n=1024", conns, lcpu));
        }
        let most = Client::connect(s.port).numbers("/stats")[1];
        let (a, b) = (medians(&sync), medians(&rerouted));
        let speedup = b.0 / a.0;
        if lat_us == 1000 {
            speedup_1000 = speedup;
        }
        println!(
            "{lat_us} us: /sync {:.0} req/s (p50 {:.2} ms, p99 {:.2} ms), /async {:.0} req/s \
             (p50 {:.2} ms, p99 {:.2} ms), {speedup:.2}x, at most {most} in flight",
            a.0, a.1, a.2, b.0, b.1, b.2
        );
        if let Some(p) = predicted {
            points.push((p, speedup));
        }
        rows.push(format!(
            "| {lat_us} | {:.0} | {:.2} / {:.2} | {:.0} | {:.2} / {:.2} | {speedup:.2}x | {} | {most} |",
            a.0,
            a.1,
            a.2,
            b.0,
            b.1,
            b.2,
            prediction_cells(predicted, speedup)
        ));
    }
    let version = Command::new(&py)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| "python3".into());
    let md = format!(
        "Python asyncio reroute: backends/integrations/python/toffload_asyncio.py on Debian's \
         {version} (ctypes over libtoffload_accel.so, no compiled glue), driven by wrk \
         (`-t1 -c{conns} -d2s --latency`, 1 KiB payloads). Emulated device, 64 lanes, offload \
         latency per row. Server on core 0, wrk on core 1 (the device thread shares core 0 with \
         the server). {rounds} round(s) per row, medians. Load average at the start: {load}\n\
         Written by `reroute_python_benchmark` in tests/tests/reroute_python.rs \
         (`cargo xtask bench reroute` runs it with 3 rounds). \
         predicted: toffload-watch's prediction for the reroute from one 3 s watch per round of the \
         synchronous form under the same wrk load (the windows' `model.recipe_speedup`, \
         median); error = predicted / measured - 1.\n\n\
         Lines in toffload_asyncio.py, counted from the file: the rerouted path (REROUTE markers: \
         `Accel.run`, the completion fd's reader, the wait for room) {reroute_all} lines, \
         {reroute_code} of code; the synchronous path (SYNC markers: `Accel.run_sync`) {sync_all} \
         lines, {sync_code} of code. Both share the ctypes binding and the HTTP server.\n\n\
         | offload us | /sync req/s | sync p50 / p99 ms | /async req/s | async p50 / p99 ms | speedup | predicted | error | most in flight (async) |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n{}\n\n\
         {}\n\n\
         Target: rerouted >= 2x sync at 1000 us: {}.\n",
        rows.join("\n"),
        model_error_line(&points),
        if speedup_1000 >= 2.0 { "met" } else { "not met" },
        load = load.trim(),
    );
    println!("\n{md}");
    write_result("reroute-python.md", &md);
    assert!(
        speedup_1000 > 2.0,
        "/async only {speedup_1000:.2}x /sync at 1000 us"
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
    let Some(py) = python() else { return };
    let s = start_guarded(&py, &guarded("off", 100), None);
    reroute_guard::check_unguarded_loses_updates(s.port);
}

#[test]
fn guard_detect_reports_conflicts() {
    let _g = serial();
    let Some(py) = python() else { return };
    let s = start_guarded(&py, &guarded("detect", 100), None);
    reroute_guard::check_detect_reports(s.port);
}

#[test]
fn guard_enforce_keeps_every_increment() {
    let _g = serial();
    let Some(py) = python() else { return };
    let mut s = start_guarded(&py, &guarded("enforce", 50), None);
    reroute_guard::check_enforce_keeps_all(s.port, 20_000);
    assert!(s.alive());
}

#[test]
fn guard_bad_mode_and_arguments_are_errors() {
    let _g = serial();
    let Some(py) = python() else { return };
    let mut s = start_guarded(&py, &guarded("enforce", 50), None);
    let mut c = reroute_guard::Conn::new(s.port);
    assert_eq!(c.get("/incr").0, 400, "/incr without k");
    assert_eq!(c.number("/incr?k="), 1, "an empty key is a key");
    assert_eq!(c.number("/sum"), 1);
    assert!(s.alive());
    drop(s);
    // Without the helper the counters are not offered.
    let plain = start(&py, &guarded("enforce", 50), None);
    assert_eq!(reroute_guard::Conn::new(plain.port).get("/incr?k=a").0, 501);
    drop(plain);
    // A malformed TOFFLOAD_GUARD: the server refuses to start and says why.
    let o = Command::new(&py)
        .arg(script())
        .args(["--port", "0", "--lib"])
        .arg(harness::dist().join("lib/libtoffload_accel.so"))
        .arg("--guard-helper")
        .arg(guard_helper())
        .env("TOFFLOAD_GUARD", "sometimes")
        .output()
        .expect("python3");
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
    let Some(py) = python() else { return };
    let mut s = start_guarded(&py, &guarded("enforce", 12_000_000), None);
    reroute_guard::check_guard_wait_has_a_deadline(s.port);
    assert!(s.alive());
}

#[test]
fn guard_clients_gone_leave_nothing_stuck() {
    let _g = serial();
    let Some(py) = python() else { return };
    let mut s = start_guarded(&py, &guarded("enforce", 50_000), None);
    reroute_guard::check_hang_ups_leave_nothing_stuck(s.port);
    assert!(s.alive());
}

/// Enforce vs the coarse lock (and unguarded, detect) for tests/results/guard.md.
#[test]
fn guard_benchmark() {
    let _g = serial();
    let Some(py) = python() else { return };
    reroute_guard::benchmark(
        "Python asyncio: /incr through the guard's C API",
        "toffload_asyncio.py in Debian's stock python3 (one event loop thread), the guard's \
         calls through ctypes, the read in toffload_guard_helper.c (the sigsetjmp point).",
        &|env, cpu| {
            let s = start_guarded(&py, env, cpu);
            let port = s.port;
            (Box::new(s), port)
        },
    );
}
