//! Reconnection without loss: a proxy that resets connections at random points, and a
//! daemon killed (-9) and restarted mid-run. The hazard first (dedup off: resent ops
//! run twice), then the mitigation (every op runs once, every answer arrives once and
//! is right).

mod remote_util;

use remote_util::*;
use std::time::{Duration, Instant};

#[test]
fn without_dedup_resets_make_the_daemon_run_ops_twice() {
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0", "--test-disable-dedup"],
        &[("TOFFLOAD_EMU_LAT_US", "100")],
    );
    let proxy = FaultProxy::start(d.addr(), 60_000, 40, 7);
    let r = client(&[proxy.addr()], |c| c.deadline_ms = 20_000);
    let n = 20_000;
    let (ok, failed, wrong) = aes_workload(&r, n, 64, 4, 512, Duration::from_secs(50), |_| {});
    let s = stats(&d.addr());
    let c = r.counters();
    println!(
        "dedup off: {} resets, executions {} for {n} ops, executed twice {}, duplicate results dropped by the client {}",
        proxy.resets.load(std::sync::atomic::Ordering::Relaxed),
        s["executions"],
        s["executed_twice"],
        c.duplicate_results
    );
    assert_eq!((ok, failed, wrong), (n, 0, 0));
    assert!(proxy.resets.load(std::sync::atomic::Ordering::Relaxed) >= 10);
    assert!(s["executed_twice"] > 0, "the hazard did not show");
    assert!(s["executions"] > n);
}

#[test]
fn resets_and_a_daemon_restart_lose_and_duplicate_nothing() {
    let state = TempDir::new("faults_state");
    let mut d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            state.path().to_str().unwrap(),
        ],
        &[("TOFFLOAD_EMU_LAT_US", "100")],
    );
    // 40 resets in the first half, 40 more after the restart.
    let proxy = FaultProxy::start(d.addr(), 200_000, 40, 11);
    let r = client(&[proxy.addr()], |c| c.deadline_ms = 30_000);
    let n: u64 = 100_000;
    let t0 = Instant::now();
    let mut restarted = false;
    let mut restart_at = 0;
    let mut resets_at_restart = 0;
    let (ok, failed, wrong) = aes_workload(&r, n, 64, 4, 512, Duration::from_secs(55), |done| {
        if !restarted && done >= n / 2 {
            restarted = true;
            restart_at = done;
            resets_at_restart = proxy.resets.load(std::sync::atomic::Ordering::Relaxed);
            proxy
                .max_resets
                .fetch_add(40, std::sync::atomic::Ordering::Relaxed);
            d.restart();
        }
    });
    let dt = t0.elapsed();
    assert!(restarted);
    let s = stats(&d.addr());
    let c = r.counters();
    let resets = proxy.resets.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "{n} ops in {dt:?}: {resets} proxy resets ({resets_at_restart} before the restart), daemon killed and restarted at {restart_at}; \
         executions (journal, both lives) {}, executed twice {}, duplicates suppressed {}, \
         results resent {}, duplicate results dropped by the client {}, client reconnects {}",
        s["executions_total"],
        s["executed_twice"],
        s["duplicates_suppressed"],
        s["results_resent"],
        c.duplicate_results,
        c.connects
    );
    assert_eq!(ok, n, "lost or failed ops: {failed}");
    assert_eq!(failed, 0);
    assert_eq!(wrong, 0);
    assert_eq!(c.completed, n);
    // Each op executed exactly once, across both lives of the daemon.
    assert_eq!(s["executions_total"], n);
    assert_eq!(s["executed_twice"], 0);
    // The faults happened and the mechanisms were used.
    assert!(resets >= 20, "{resets} resets");
    assert!(
        resets_at_restart >= 5 && resets > resets_at_restart + 5,
        "resets before the restart {resets_at_restart}, in all {resets}"
    );
    assert!(c.connects >= resets, "{} connects", c.connects);
    assert!(s["duplicates_suppressed"] + s["results_resent"] > 0);
}

#[test]
fn an_absent_daemon_fails_ops_at_the_deadline_and_later_ops_succeed() {
    let mut d = Daemon::start(
        &["--listen", "127.0.0.1:0"],
        &[("TOFFLOAD_EMU_LAT_US", "100")],
    );
    let addr = d.addr();
    let r = client(std::slice::from_ref(&addr), |c| c.deadline_ms = 400);
    let (ok, _, _) = aes_workload(&r, 100, 64, 1, 16, Duration::from_secs(10), |_| {});
    assert_eq!(ok, 100);
    d.kill();
    let (ok, failed, _) = aes_workload(&r, 50, 64, 1, 16, Duration::from_secs(10), |_| {});
    assert_eq!((ok, failed), (0, 50));
    assert_eq!(r.counters().timed_out, 50);
    d.restart();
    // The client reconnects on its own (backoff at most 1 s + jitter); ops submitted
    // once it has are served.
    let t0 = Instant::now();
    while r.counters().connects < 2 {
        assert!(t0.elapsed() < Duration::from_secs(5), "no reconnection");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (ok, failed, wrong) = aes_workload(&r, 100, 64, 1, 16, Duration::from_secs(10), |_| {});
    assert_eq!((ok, failed, wrong), (100, 0, 0));
}
