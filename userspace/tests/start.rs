//! The watch's start on a host where one CPU is held by a real-time busy poller (an
//! accelerator's or a NIC's completion poller, common on the servers toffload is
//! for) while the other carries ordinary load. The start must attach and report
//! every time, within its deadlines, saying so where it had to cut its calibration
//! short. A file of its own: the poller slows everything on its CPU, so nothing else
//! may run beside it.

mod common;
use common::{json_lines, ready, watch_cmd};
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use toffload_tests::harness;

/// A busy loop pinned to `cpu`, SCHED_FIFO at `fifo` if given; bounded in time by
/// timeout(1), which stays an ordinary task (a real-time one beside the loop would
/// never run to end it), and ended when dropped.
struct Hog(Child);

impl Hog {
    fn start(cpu: usize, fifo: Option<u8>) -> Hog {
        let mut c = Command::new("taskset");
        c.args(["-c", &cpu.to_string(), "timeout", "120"]);
        if let Some(p) = fifo {
            c.args(["chrt", "-f", &p.to_string()]);
        }
        c.args(["sh", "-c", "while :; do :; done"]);
        Hog(c
            .stdin(Stdio::null())
            .spawn()
            .expect("taskset/chrt/timeout"))
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        // timeout(1) forwards the signal to the loop.
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

/// Runs `cmd` to its end within `limit`, killing it past that; (exit code, stdout,
/// stderr, how long it took), or None when it had to be killed.
fn run_bounded(mut cmd: Command, limit: Duration) -> Option<(i32, String, String, Duration)> {
    let t0 = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start toffload-watch");
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            let (mut out, mut err) = (String::new(), String::new());
            let _ = child.stdout.take().expect("piped").read_to_string(&mut out);
            let _ = child.stderr.take().expect("piped").read_to_string(&mut err);
            return Some((st.code().unwrap_or(-1), out, err, t0.elapsed()));
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether a real-time task pinned to `cpu` gets to run at all within `limit`.
fn rt_task_runs_on(cpu: usize, limit: Duration) -> bool {
    let mut child = Command::new("taskset")
        .args(["-c", &cpu.to_string(), "chrt", "-f", "1", "true"])
        .spawn()
        .expect("taskset");
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if child.try_wait().expect("wait").is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // It dies once it gets the CPU (when the poller ends): reaped then.
    let _ = child.kill();
    std::thread::spawn(move || child.wait());
    false
}

#[test]
fn start_beside_a_realtime_poller_attaches_every_time() {
    if !ready() {
        return;
    }
    if harness::cpus() < 2 {
        harness::skip("needs two CPUs: one for the poller, one for everything else");
        return;
    }
    // Without real-time throttling a poller would take its CPU from the kernel too.
    let rt = std::fs::read_to_string("/proc/sys/kernel/sched_rt_runtime_us").unwrap_or_default();
    if rt.trim() == "-1" {
        harness::skip("real-time throttling is off (sched_rt_runtime_us = -1): a SCHED_FIFO poller would starve the kernel on its CPU");
        return;
    }
    let mut target = Command::new("sleep")
        .arg("100")
        .spawn()
        .expect("a process to watch");
    let pid = target.id();
    let poller = Hog::start(0, Some(50));
    let load = Hog::start(1, None);
    std::thread::sleep(Duration::from_millis(300));
    // The hazard: a real-time task on the poller's CPU makes no progress at all (the
    // calibration child ran SCHED_FIFO on whatever CPU it started on, and the start
    // waited for it without a deadline).
    assert!(
        !rt_task_runs_on(0, Duration::from_secs(2)),
        "a SCHED_FIFO task ran beside the poller: the hazard is not shown on this host"
    );
    let mut cut_short = 0;
    for i in 0..4 {
        let mut cmd = watch_cmd();
        // Measured every time: a calibration kept from an earlier start would skip it.
        cmd.args([
            "--json",
            "--recalibrate",
            "--interval",
            "500ms",
            "--duration",
            "1s",
        ])
        .arg("--pid")
        .arg(pid.to_string());
        // Every other start puts its first calibration attempt on the poller's CPU.
        if i % 2 == 0 {
            cmd.env("TOFFLOAD_WATCH_CALIB_FIRST_CPU", "0");
        }
        let Some((code, out, err, took)) = run_bounded(cmd, Duration::from_secs(40)) else {
            panic!("start {i}: toffload-watch did not end within 40 s beside the poller");
        };
        eprintln!("start {i}: exit {code} in {took:?}\n{err}");
        assert_eq!(code, 0, "start {i}: {err}");
        assert!(
            err.contains(&format!("attached to pid {pid}")),
            "start {i}: {err}"
        );
        let lines = json_lines(&out);
        let header = &lines
            .iter()
            .find(|(k, _)| k == "header")
            .unwrap_or_else(|| panic!("start {i}: no header in {out}"))
            .1;
        assert!(
            lines.iter().any(|(k, _)| k == "window") && lines.iter().any(|(k, _)| k == "final"),
            "start {i}: no window or final report: {out}"
        );
        // Measured, or the default with exactly one warning line that says so.
        let warnings = err.matches("calibration cut short").count();
        match header["probe_cost_source"].as_str() {
            Some("measured") => assert_eq!(warnings, 0, "start {i}: {err}"),
            Some("default") => {
                assert_eq!(warnings, 1, "start {i}: {err}");
                cut_short += 1;
            }
            other => panic!("start {i}: probe_cost_source {other:?}"),
        }
        // Calibration (4 s at most), the switch fallback (1 s), loading, attaching
        // and the 1 s watch: well within 20 s on a CPU and a twentieth.
        assert!(took < Duration::from_secs(20), "start {i} took {took:?}");
    }
    eprintln!("{cut_short} of 4 starts used the default cost");
    drop(load);
    drop(poller);
    let _ = target.kill();
    let _ = target.wait();
}
