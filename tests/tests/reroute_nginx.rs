//! The nginx reroute (backends/integrations/nginx): ngx_http_toffload_module.so, a
//! dynamic module for Debian's stock nginx (built here by build.sh from the sources
//! and configure flags of the nginx-dev package), offering the offload as
//! `toffload_accel sync` (accel_run in the content handler) and `toffload_accel async`
//! (accel_submit, the request suspended with NGX_DONE, the device's completion fd a
//! connection in the worker's event loop).
//!
//! `reroute_nginx_benchmark` measures both forms with wrk at 50, 200 and 1000 us;
//! with TOFFLOAD_REROUTE_OUT=path (what `cargo xtask bench reroute` sets) it also
//! writes its table beside that file, as reroute-nginx.md. A missing nginx or
//! nginx-dev skips with the reason (fails under CI).
//!
//! The `guard_*` tests: `toffload_accel incr` (read a counter of the worker's, offload,
//! write it back plus one) under the conflict guard's C API, hazard first (unguarded
//! loses updates), then detect and enforce (tests/src/reroute_guard.rs);
//! `guard_benchmark` writes the nginx section of tests/results/guard.md.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use toffload_tests::harness;
use toffload_tests::reroute::{
    self, check_answers, count_lines, cpus_apart, find, medians, model_error_line, pin,
    prediction_cells, rounds, write_result, wrk, wrong_under_clients, Client,
};
use toffload_tests::reroute_guard;

/// A 2-core machine: one server test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../backends/integrations/nginx")
}

/// (nginx, the module built once per test binary), or None after skipping (fails
/// under CI).
fn module() -> Option<(PathBuf, PathBuf)> {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let Some(nginx) = find("nginx") else {
        harness::skip("nginx is not installed (Debian package nginx; .ci/run installs it)");
        return None;
    };
    if !Path::new("/usr/share/nginx/src/conf_flags").is_file() {
        harness::skip(
            "nginx-dev is not installed (its sources build the module; .ci/run installs it)",
        );
        return None;
    }
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(m) = built.as_ref() {
        return Some((nginx, m.clone()));
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nginx-module");
    let o = Command::new("timeout")
        .arg("600")
        .arg(src().join("build.sh"))
        .arg(harness::dist())
        .arg(&out)
        .output()
        .expect("running build.sh");
    assert!(
        o.status.success(),
        "building the nginx module failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let m = out.join("ngx_http_toffload_module.so");
    *built = Some(m.clone());
    Some((nginx, m))
}

/// An nginx (master + 1 worker) with the module, in its own prefix; stopped on drop.
struct Nginx {
    child: Child,
    port: u16,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn conf(module: &Path, dir: &Path, port: u16, env: &[(&str, String)], extra: &str) -> String {
    let envs: String = env.iter().map(|(k, _)| format!("env {k};\n")).collect();
    format!(
        "load_module {module};\ndaemon off;\nmaster_process on;\nworker_processes 1;\n\
         error_log stderr;\npid {dir}/nginx.pid;\n{envs}events {{ worker_connections 2048; }}\n\
         http {{\n access_log off;\n keepalive_requests 1000000;\n client_body_temp_path {dir}/body;\n\
         server {{\n  listen 127.0.0.1:{port} backlog=1024;\n  root {dir};\n\
         location = /sync {{ toffload_accel sync; }}\n  location = /async {{ toffload_accel async; }}\n\
         location = /stats {{ toffload_accel stats; }}\n\
         location = /incr {{ toffload_accel incr; }}\n  location = /incrlocked {{ toffload_accel incrlocked; }}\n\
         location = /get {{ toffload_accel get; }}\n  location = /sum {{ toffload_accel sum; }}\n\
         location = /guard {{ toffload_accel guard; }}\n{extra}\n }}\n}}\n",
        module = module.display(),
        dir = dir.display(),
    )
}

fn tmpdir(name: &str) -> TempDir {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "toffload-nginx-{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).expect("temp dir");
    TempDir(d)
}

impl Nginx {
    fn start(nginx: &Path, module: &Path, env: &[(&str, String)], cpu: Option<usize>) -> Nginx {
        let dir = tmpdir("srv");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let path = dir.0.join("nginx.conf");
        std::fs::write(&path, conf(module, &dir.0, port, env, "")).expect("nginx.conf");
        let mut c = Command::new(nginx);
        c.arg("-p").arg(&dir.0).arg("-c").arg(&path);
        c.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            c.env(k, v);
        }
        pin(&mut c, cpu);
        let mut child = c.spawn().expect("starting nginx");
        let t0 = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if t0.elapsed() > Duration::from_secs(20) || !matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                panic!("nginx did not listen on {port} within 20 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Nginx {
            child,
            port,
            _dir: dir,
        }
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGQUIT: graceful stop of master and worker.
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGQUIT) };
        let t0 = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn sync_and_async_answer_aes_ctr_bit_identically() {
    let _g = serial();
    let Some((nginx, module)) = module() else {
        return;
    };
    let s = Nginx::start(
        &nginx,
        &module,
        &[("TOFFLOAD_EMU_LAT_US", "200".into())],
        None,
    );
    check_answers(s.port, &["sync", "async"]);
    let mut c = Client::connect(s.port);
    let wrong = wrong_under_clients(s.port, "/async?n=1024", 64, 20);
    assert_eq!(wrong, 0, "wrong /async answers under 64 clients");
    let v = c.numbers("/stats");
    println!(
        "/async: {} at most in flight, {} finished, {} now",
        v[1], v[2], v[0]
    );
    assert!(v[2] >= 64 * 20, "only {} finished", v[2]);
    assert!(v[1] > 1, "/async never had more than one offload in flight");
    assert_eq!(v[0], 0);
}

#[test]
fn bad_input_and_backend_errors_are_http_errors() {
    let _g = serial();
    let Some((nginx, module)) = module() else {
        return;
    };
    let mut s = Nginx::start(
        &nginx,
        &module,
        &[("TOFFLOAD_EMU_LAT_US", "50".into())],
        None,
    );
    let mut c = Client::connect(s.port);
    for (target, code) in [
        ("/async?n=0", 400),
        ("/async?n=abc", 400),
        ("/sync?n=-5", 400),
        ("/async?n=2097152", 400),
    ] {
        let (got, _) = c.get(target);
        assert_eq!(got, code, "{target}");
        // nginx closes the connection after an error status of its own.
        c = Client::connect(s.port);
    }
    assert_eq!(
        c.raw(b"POST /async HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
            .0,
        405
    );
    let mut c = Client::connect(s.port);
    assert_eq!(c.get("/async?n=16").0, 200);
    assert!(s.alive());
    drop(s);

    // A malformed device knob: every offload fails with -EINVAL, as a 500.
    let mut s = Nginx::start(&nginx, &module, &[("TOFFLOAD_EMU_LANES", "0".into())], None);
    for form in ["sync", "async"] {
        let mut c = Client::connect(s.port);
        assert_eq!(
            c.get(&format!("/{form}?n=64")).0,
            500,
            "/{form} with TOFFLOAD_EMU_LANES=0"
        );
    }
    assert_eq!(Client::connect(s.port).numbers("/stats")[0], 0);
    assert!(s.alive(), "nginx died of a device error");
    drop(s);

    // A malformed directive: nginx refuses the configuration and says why.
    let dir = tmpdir("bad");
    let path = dir.0.join("nginx.conf");
    let text = conf(
        &module,
        &dir.0,
        1,
        &[],
        "  location = /x { toffload_accel sideways; }",
    );
    std::fs::write(&path, text).expect("nginx.conf");
    let o = Command::new(&nginx)
        .arg("-t")
        .arg("-p")
        .arg(&dir.0)
        .arg("-c")
        .arg(&path)
        .output()
        .expect("nginx -t");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "nginx accepted toffload_accel sideways"
    );
    assert!(err.contains("is not sync, async, stats, incr"), "{err}");
}

#[test]
fn reroute_nginx_benchmark() {
    let _g = serial();
    let Some((nginx, module)) = module() else {
        return;
    };
    let Some(wrk_exe) = find("wrk") else {
        harness::skip("wrk is not installed (Debian package wrk; .ci/run installs it)");
        return;
    };
    let text = std::fs::read_to_string(src().join("ngx_http_toffload_module.c")).expect("source");
    let c_lines = |name: &str| count_lines(&text.replace(" */", ""), "/*", name);
    let (reroute_all, reroute_code) = c_lines("REROUTE");
    let (sync_all, sync_code) = c_lines("SYNC");
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
        let s = Nginx::start(&nginx, &module, &env, scpu);
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
            "{lat_us} us: sync {:.0} req/s (p50 {:.2} ms, p99 {:.2} ms), async {:.0} req/s \
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
    let version = Command::new(&nginx)
        .arg("-v")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stderr)
                .trim()
                .replace("nginx version: ", "")
        })
        .unwrap_or_else(|_| "nginx".into());
    let md = format!(
        "nginx reroute: ngx_http_toffload_module.so (backends/integrations/nginx) in Debian's stock \
         {version} (master + 1 worker), driven by wrk (`-t1 -c{conns} -d2s --latency`, 1 KiB \
         payloads). Emulated device, 64 lanes, offload latency per row, TOFFLOAD_WAIT unset (spin: \
         accel_run's default). Server on core 0, wrk on core 1 (the device thread shares core 0 with \
         the worker). {rounds} round(s) per row, medians. Load average at the start: {load}\n\
         Written by `reroute_nginx_benchmark` in tests/tests/reroute_nginx.rs (`cargo xtask bench \
         reroute` runs it with 3 rounds). predicted: toffload-watch's prediction for the \
         reroute from one 3 s watch per round of the master's pid (its worker followed) under the same wrk \
         load on the sync form (the windows' `model.recipe_speedup`, median); error = predicted \
         / measured - 1.\n\n\
         Lines in ngx_http_toffload_module.c, counted from the file: the rerouted path (REROUTE \
         markers: the suspended request, the completion fd's connection and handler, the cleanup) \
         {reroute_all} lines, {reroute_code} of code; the synchronous path (SYNC markers) {sync_all} \
         lines, {sync_code} of code. Both share the request parsing, the payload and the response.\n\n\
         | offload us | sync req/s | sync p50 / p99 ms | async req/s | async p50 / p99 ms | speedup | predicted | error | most in flight (async) |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n{}\n\n\
         {}\n\n\
         Target: rerouted >= 2x sync at 1000 us: {}.\n",
        rows.join("\n"),
        model_error_line(&points),
        if speedup_1000 >= 2.0 { "met" } else { "not met" },
        load = load.trim(),
    );
    println!("\n{md}");
    write_result("reroute-nginx.md", &md);
    assert!(
        speedup_1000 > 2.0,
        "async only {speedup_1000:.2}x sync at 1000 us"
    );
}

// ---- the conflict guard on the rerouted path: toffload_accel incr -------------------

fn guarded(mode: &str, lat_us: u64) -> Vec<(&'static str, String)> {
    vec![
        ("TOFFLOAD_GUARD", mode.to_string()),
        ("TOFFLOAD_EMU_LAT_US", lat_us.to_string()),
    ]
}

#[test]
fn guard_unguarded_incr_loses_updates() {
    let _g = serial();
    let Some((nginx, module)) = module() else {
        return;
    };
    let s = Nginx::start(&nginx, &module, &guarded("off", 100), None);
    reroute_guard::check_unguarded_loses_updates(s.port);
}

#[test]
fn guard_detect_reports_conflicts() {
    let _g = serial();
    let Some((nginx, module)) = module() else {
        return;
    };
    let s = Nginx::start(&nginx, &module, &guarded("detect", 100), None);
    reroute_guard::check_detect_reports(s.port);
}

#[test]
fn guard_enforce_keeps_every_increment() {
    let _g = serial();
    let Some((nginx, module)) = module() else {
        return;
    };
    let mut s = Nginx::start(&nginx, &module, &guarded("enforce", 50), None);
    reroute_guard::check_enforce_keeps_all(s.port, 20_000);
    assert!(s.alive());
}

#[test]
fn guard_bad_mode_and_arguments_are_errors() {
    let _g = serial();
    let Some((nginx, module)) = module() else {
        return;
    };
    let mut s = Nginx::start(&nginx, &module, &guarded("enforce", 50), None);
    let mut c = reroute_guard::Conn::new(s.port);
    assert_eq!(c.get("/incr").0, 400, "/incr without k");
    let mut c = reroute_guard::Conn::new(s.port);
    assert_eq!(c.number("/incr?k="), 1, "an empty key is a key");
    assert_eq!(c.number("/sum"), 1);
    assert!(s.alive());
    drop(s);
    // A malformed TOFFLOAD_GUARD: nginx refuses the configuration and says why.
    let dir = tmpdir("badguard");
    let path = dir.0.join("nginx.conf");
    let env = guarded("sometimes", 50);
    std::fs::write(&path, conf(&module, &dir.0, 1, &env, "")).expect("nginx.conf");
    let o = Command::new(&nginx)
        .arg("-t")
        .arg("-p")
        .arg(&dir.0)
        .arg("-c")
        .arg(&path)
        .env("TOFFLOAD_GUARD", "sometimes")
        .output()
        .expect("nginx -t");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "nginx accepted TOFFLOAD_GUARD=sometimes"
    );
    assert!(
        err.contains("TOFFLOAD_GUARD must be off, detect or enforce"),
        "{err}"
    );
}

#[test]
fn guard_wait_has_a_deadline() {
    let _g = serial();
    let Some((nginx, module)) = module() else {
        return;
    };
    let mut s = Nginx::start(&nginx, &module, &guarded("enforce", 12_000_000), None);
    reroute_guard::check_guard_wait_has_a_deadline(s.port);
    assert!(s.alive());
}

#[test]
fn guard_clients_gone_leave_nothing_stuck() {
    let _g = serial();
    let Some((nginx, module)) = module() else {
        return;
    };
    let mut s = Nginx::start(&nginx, &module, &guarded("enforce", 50_000), None);
    reroute_guard::check_hang_ups_leave_nothing_stuck(s.port);
    assert!(s.alive());
}

/// Enforce vs the coarse lock (and unguarded, detect) for tests/results/guard.md.
#[test]
fn guard_benchmark() {
    let _g = serial();
    let Some((nginx, module)) = module() else {
        return;
    };
    reroute_guard::benchmark(
        "nginx module: toffload_accel incr through the guard's C API",
        "ngx_http_toffload_module.so in Debian's stock nginx, one worker: the counters are the \
         worker's own memory (with several workers each would have its own; the guard's page \
         protections are per process).",
        &|env, cpu| {
            let s = Nginx::start(&nginx, &module, env, cpu);
            let port = s.port;
            (Box::new(s), port)
        },
    );
}
