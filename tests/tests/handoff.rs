//! The blocked-carrier handoff (runtime/src/handoff.rs): a fiber that blocks in a call
//! the runtime does not see must not freeze the other fibers of its carrier.
//!
//! Each case shows the freeze first (TOFFLOAD_TEST_DISABLE=handoff), then that the
//! handoff removes it: rawfutex_server --hold-lock (a raw-futex lock held across
//! accel_run, as InnoDB holds its mutexes across I/O) and rt_iouring (a fiber waiting
//! in io_uring_enter for a read another fiber of its carrier satisfies). One carrier
//! throughout, where the hazard is certain.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use toffload_tests::harness::{self, ServerSpec};
use toffload_tests::load::{self, Config, Report};
use toffload_tests::preload::{self, Outcome, RtServer, Run, TempDir};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn ready(programs: &[&str]) -> bool {
    preload::ready(programs)
}

/// The spares' hard cap in the server case: above what can wait on the lock at once
/// (a round's connections and the previous round's, whose fibers finish their last
/// request after the client closed), so the live fibers are the bound that acts.
const SPARES: u64 = 64;
const CONNS: usize = 8;
/// Requests the handoff run must answer, all right, none lost.
const REQUESTS: u64 = 100_000;

fn hold_lock_server(disable: &str, stats: &std::path::Path) -> RtServer {
    let spec = preload::server_under_runtime(
        ServerSpec::new("rawfutex_server")
            .arg("--hold-lock")
            .env("TOFFLOAD_EMU_LAT_US", "200")
            .env("TOFFLOAD_WAIT", "block")
            .env("TOFFLOAD_CARRIERS", "1")
            .env("TOFFLOAD_HANDOFF_US", "200")
            .env("TOFFLOAD_HANDOFF_MAX_SPARES", SPARES.to_string())
            .env("TOFFLOAD_TEST_DISABLE", disable)
            .env("TOFFLOAD_STATS", stats.display().to_string()),
    );
    RtServer::start(&spec).unwrap_or_else(|e| panic!("{e}"))
}

fn load_cfg(port: u16, secs: f64) -> Config {
    let mut cfg = Config::new(port);
    cfg.conns = CONNS;
    cfg.duration = Duration::from_secs_f64(secs);
    cfg.warmup = Duration::from_millis(200);
    cfg.timeout = Duration::from_secs(1);
    cfg
}

fn show(what: &str, r: &Report) {
    println!(
        "{what}: {:.0} req/s, completed {}, wrong {}, errors {:?}, p99 {:.0} us",
        r.requests_per_sec, r.completed, r.wrong, r.errors_by_kind, r.p99_us
    );
}

/// The most threads `pid` had, sampled every 20 ms until `stop`.
fn sample_threads(pid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let most = AtomicU64::new(0);
        while !stop.load(Relaxed) {
            if let Some(n) = preload::threads_of(pid) {
                most.fetch_max(n, Relaxed);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        most.load(Relaxed)
    })
}

fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = s.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime: fields 14 and 15, 12 and 13 after the command.
    f.get(11).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0)
}

#[test]
fn raw_futex_lock_across_offload_does_not_freeze_the_server() {
    let _s = serial();
    if !ready(&["rawfutex_server"]) {
        return;
    }
    let dir = TempDir::new("handoff");

    // Hazard: the second connection's raw FUTEX_WAIT blocks the only carrier, which
    // must run the lock holder's offload completion: nothing is answered.
    let stats = dir.join("off.json");
    let mut s = hold_lock_server("handoff", &stats);
    let r = load::run(&load_cfg(s.port, 2.0)).expect("load run");
    show("handoff disabled", &r);
    s.expect_alive("handoff disabled");
    assert!(
        r.errors > 0 && r.errors_by_kind.contains_key("timeout"),
        "expected the server to freeze (requests timing out) without handoff"
    );
    drop(s);

    // Handoff: every request answered, right, within the thread bound.
    let stats = dir.join("on.json");
    let mut s = hold_lock_server("", &stats);
    let base = preload::threads_of(s.pid()).unwrap_or(0);
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_threads(s.pid(), stop.clone());
    // Rounds of 10 s until REQUESTS are answered (each wait below libc costs about
    // one TOFFLOAD_HANDOFF_US, so this takes ~90 s here), every round checked.
    let t0 = std::time::Instant::now();
    let mut answered = 0;
    while answered < REQUESTS && t0.elapsed() < Duration::from_secs(300) {
        let r = load::run(&load_cfg(s.port, 10.0)).expect("load run");
        show("handoff", &r);
        s.expect_alive("handoff");
        assert!(r.completed > 0, "nothing completed: {}", s.describe());
        assert_eq!(r.wrong, 0, "wrong answers");
        assert_eq!(r.errors, 0, "errors {:?}", r.errors_by_kind);
        answered += r.completed;
    }
    stop.store(true, Relaxed);
    let most = sampler.join().unwrap();
    println!(
        "handoff: {answered} answered in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(
        answered >= REQUESTS,
        "{answered} answered in 300 s, fewer than {REQUESTS}"
    );
    std::thread::sleep(Duration::from_millis(150));
    let st = preload::stats(&stats).expect("stats");
    println!("stats: {st}; threads: {base} at start, at most {most} under load");
    let handoffs = st["handoffs"].as_u64().unwrap_or(0);
    assert!(handoffs > 0, "no handoff counted: {st}");
    // main, the device thread, the carrier's thread, the monitor, and the spares: never
    // more spares than live fibers (the stock server's thread per connection).
    assert!(
        most <= 4 + 2 * CONNS as u64,
        "{most} threads, more than 4 + the fibers two rounds of {CONNS} connections leave"
    );

    // Idle: the monitor sleeps with the carriers; the process spends no CPU.
    std::thread::sleep(Duration::from_millis(300));
    let t0 = cpu_ticks(s.pid());
    std::thread::sleep(Duration::from_secs(2));
    let idle = cpu_ticks(s.pid()) - t0;
    println!("idle: {idle} ticks of CPU in 2 s");
    assert!(idle <= 2, "an idle server spent {idle} ticks in 2 s");
}

fn iouring(disable: &str, limit_s: &str) -> Outcome {
    Run::bin("rt_iouring")
        .unwrap_or_else(|e| panic!("{e}"))
        .args(["20", limit_s])
        .runtime()
        .env("TOFFLOAD_FIBERIZE", "all")
        .env("TOFFLOAD_CARRIERS", "1")
        .env("TOFFLOAD_TEST_DISABLE", disable)
        .timeout(Duration::from_secs(20))
        .run()
}

#[test]
fn io_uring_wait_on_a_fiber_does_not_freeze_the_others() {
    let _s = serial();
    if !ready(&["rt_iouring"]) {
        return;
    }
    let o = iouring("handoff", "3");
    println!("handoff disabled: {}", o.report());
    if o.field("skip").is_some() {
        harness::skip("io_uring is not available here");
        return;
    }
    assert_eq!(o.num("frozen"), 1.0, "expected the freeze: {}", o.report());
    assert_eq!(o.num("done"), 0.0, "{}", o.report());

    let o = iouring("", "10");
    println!("handoff: {}", o.report());
    assert!(o.ok(), "{}", o.report());
    assert_eq!(o.num("frozen"), 0.0, "{}", o.report());
    assert_eq!(o.num("done"), 20.0, "{}", o.report());
    assert!(o.num("pings") > 0.0, "{}", o.report());
}
