//! Placement of remote CUDA tasks across several daemons (backends/cuda-remote's
//! sched.rs): a task is a program's CUDA context (its one connection), placed when
//! it starts by the latency predicted from each daemon's probe (round trip,
//! bandwidth) and heartbeat (GPU kernel queue, time per kernel). Daemons on the fake
//! driver in network namespaces behind delay lines (remote_util/netns.rs); which
//! daemon ran a task is its `cuda_sessions` counter. Needs root for the namespaces
//! (skips with the reason otherwise; fails under TOFFLOAD_NO_SKIP=1).

mod remote_util;

use remote_util::cuda::{paused, text, Libs};
use remote_util::netns::{self, daemon_on, in_ns, stats_in, Net, Shape};
use remote_util::Daemon;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn ready() -> bool {
    match netns::can_run() {
        Ok(()) => true,
        Err(why) => {
            netns::skip_or_fail(&why);
            false
        }
    }
}

/// A near daemon (50 us each way) and a far one (1.5 ms each way).
const NEAR: Shape = Shape {
    mbit: 1000,
    delay_us: 50,
    jitter_us: 0,
};
const FAR: Shape = Shape {
    mbit: 1000,
    delay_us: 1500,
    jitter_us: 0,
};
/// The fake GPU's time per kernel on both daemons.
const KERNEL_US: u32 = 2000;
const ARGS: [&str; 3] = ["run", "2", "5"];

/// The app from the client namespace (it inherits the thread's namespace).
fn run_in(ns: &str, mut c: Command) -> (Output, Duration) {
    in_ns(ns, move || {
        let t0 = Instant::now();
        let out = c.output().unwrap();
        (out, t0.elapsed())
    })
}

fn sessions(d: &Daemon, ns: &str) -> u64 {
    stats_in(ns, d.port)["cuda_sessions"]
}

#[test]
fn tasks_go_to_the_near_daemon_and_spread_when_it_is_loaded() {
    if !ready() {
        return;
    }
    let libs = Libs::new("place");
    let direct = libs.direct(&ARGS, KERNEL_US);
    assert!(direct.status.success(), "{}", text(&direct.stderr));
    // Listed far first: the order alone would pick it.
    let net = Net::new("cs", &[FAR, NEAR]).unwrap();
    let env = libs.gpu_env(KERNEL_US);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (far, _fdl, far_addr) = daemon_on(&net.links[0], &[], &env);
    let (near, _ndl, near_addr) = daemon_on(&net.links[1], &[], &env);
    let list = format!("{far_addr},{near_addr}");
    let (far_ns, near_ns) = (net.links[0].ns.clone(), net.links[1].ns.clone());
    let count = || (sessions(&far, &far_ns), sessions(&near, &near_ns));

    // The hazard: placed by list order, the task runs across the far link.
    let mut c = libs.remote_cmd(&libs.app, &list);
    c.args(ARGS).env("TOFFLOAD_CUDA_REMOTE_PLACEMENT", "first");
    let (out, first_t) = run_in(&net.client_ns, c);
    assert_eq!(
        text(&out.stdout),
        text(&direct.stdout),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(count(), (1, 0), "list order: the far daemon");

    // Predicted: three tasks, one after another, all on the near daemon.
    let mut times = Vec::new();
    for _ in 0..3 {
        let mut c = libs.remote_cmd(&libs.app, &list);
        c.args(ARGS);
        let (out, t) = run_in(&net.client_ns, c);
        assert_eq!(
            text(&out.stdout),
            text(&direct.stdout),
            "{}",
            text(&out.stderr)
        );
        assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
        times.push(t);
    }
    println!("by list order (far): {first_t:?}; predicted (near): {times:?}");
    assert_eq!(count(), (1, 3), "predicted: the near daemon");

    // The near daemon loaded by another program (8 threads of back-to-back
    // requests, there alone): its heartbeat shows the queue, and the next task goes
    // to the far daemon, whose round trip now costs less than the queue.
    let mut load = libs.remote_cmd(&libs.app, &near_addr);
    load.args(["run", "8", "100000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut load = in_ns(&net.client_ns, move || load.spawn().unwrap());
    let t0 = Instant::now();
    loop {
        let s = stats_in(&near_ns, near.port);
        if s["cuda_queue"] >= 4 {
            println!(
                "near daemon loaded: {} kernels queued, {} us per kernel",
                s["cuda_queue"],
                s["cuda_kernel_ns"] / 1000
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the load never showed: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The heartbeat's queue is the larger of the queue now and its recent mean (200
    // ms time constant): a load just begun shows only in moments; let it settle.
    std::thread::sleep(Duration::from_millis(800));
    let mut c = libs.remote_cmd(&libs.app, &list);
    c.args(ARGS).env("TOFFLOAD_CUDA_REMOTE_PLACEMENT_LOG", "1");
    let (out, t) = run_in(&net.client_ns, c);
    let _ = load.kill();
    let _ = load.wait();
    assert_eq!(
        text(&out.stdout),
        text(&direct.stdout),
        "{}",
        text(&out.stderr)
    );
    println!("with the near daemon loaded: {t:?}\n{}", text(&out.stderr));
    let (f, n) = count();
    assert_eq!(f, 2, "the new task spread to the far daemon");
    assert_eq!(n, 4, "the load's own session");
}

/// A daemon that refuses connections and one that accepts but never answers (stopped)
/// are skipped by the probe's deadline; the program runs on the third, as on the
/// driver. The hazard first: the stopped daemon alone holds the program for the
/// whole connect timeout, then fails it.
#[test]
fn a_dead_or_stopped_daemon_is_skipped_within_the_probe_deadline() {
    let libs = Libs::new("dead");
    let direct = libs.direct(&ARGS, 50);
    assert!(direct.status.success(), "{}", text(&direct.stderr));
    let env = libs.gpu_env(50);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let good = Daemon::start(&["--listen", "127.0.0.1:0"], &env);
    let stopped = Daemon::start(&["--listen", "127.0.0.1:0"], &env);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(stopped.child.id() as i32, libc::SIGSTOP) };
    let refused = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };

    let t0 = Instant::now();
    let out = libs
        .remote_cmd(&libs.app, &stopped.addr())
        .args(ARGS)
        .env("TOFFLOAD_CUDA_REMOTE_TIMEOUT_MS", "2000")
        .output()
        .unwrap();
    let alone = t0.elapsed();
    println!("the stopped daemon alone: failed after {alone:?}");
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("CUDA error 100"));
    assert!(alone >= Duration::from_millis(1900), "{alone:?}");

    let list = format!("{refused},{},{}", stopped.addr(), good.addr());
    let t0 = Instant::now();
    let out = libs
        .remote_cmd(&libs.app, &list)
        .args(ARGS)
        .env("TOFFLOAD_CUDA_REMOTE_PROBE_MS", "300")
        .output()
        .unwrap();
    let took = t0.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(stopped.child.id() as i32, libc::SIGCONT) };
    let err = text(&out.stderr);
    println!("refused, stopped, good: ran in {took:?}; {err}");
    assert_eq!(text(&out.stdout), text(&direct.stdout), "{err}");
    assert_eq!(err.lines().count(), 2, "one line per daemon skipped: {err}");
    assert!(
        err.contains(&refused) && err.contains(&stopped.addr()),
        "{err}"
    );
    let s = remote_util::stats(&good.addr());
    assert_eq!(s["cuda_sessions"], 1);
    // The probe's 300 ms, then the run itself (well under the 2 s the stopped
    // daemon held the program alone).
    assert!(took < alone, "{took:?}");
}

/// The app in `replay` mode from the client namespace: it runs to its pause between
/// two synchronizations, `at_pause` runs (kills a daemon), then it goes on.
fn paused_in(ns: &str, mut c: Command, at_pause: impl FnOnce()) -> Output {
    c.arg("replay")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    paused(in_ns(ns, move || c.spawn().unwrap()), at_pause)
}

/// A session that loses its daemon is placed again: the guardian probes the list
/// anew and reconnects to the least predicted latency, not to the next daemon in list
/// order. The hazard first: with placement `first`, the near daemon's session goes
/// to the far one listed next.
#[test]
fn a_lost_session_is_placed_again_by_prediction() {
    if !ready() {
        return;
    }
    let libs = Libs::new("replace");
    let direct = libs.direct(&["replay"], 50);
    assert!(direct.status.success(), "{}", text(&direct.stderr));
    const MID: Shape = Shape {
        mbit: 1000,
        delay_us: 400,
        jitter_us: 0,
    };
    let net = Net::new("cr", &[NEAR, FAR, MID]).unwrap();
    let env = libs.gpu_env(50);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (mut near, _ndl, near_addr) = daemon_on(&net.links[0], &[], &env);
    let (far, _fdl, far_addr) = daemon_on(&net.links[1], &[], &env);
    let (mid, _mdl, mid_addr) = daemon_on(&net.links[2], &[], &env);
    let list = format!("{near_addr},{far_addr},{mid_addr}");
    let (far_ns, mid_ns) = (net.links[1].ns.clone(), net.links[2].ns.clone());
    let count = || (sessions(&far, &far_ns), sessions(&mid, &mid_ns));

    let mut c = libs.remote_cmd(&libs.app, &list);
    c.env("TOFFLOAD_CUDA_REMOTE_PLACEMENT", "first");
    let first = paused_in(&net.client_ns, c, || near.kill());
    let err = text(&first.stderr);
    println!("placement first: {err}");
    assert_eq!(text(&first.stdout), text(&direct.stdout), "{err}");
    assert!(err.contains(&format!("reconnected to {far_addr}")), "{err}");
    assert_eq!(count(), (1, 0), "list order: the far daemon next");

    near.restart();
    let c = libs.remote_cmd(&libs.app, &list);
    let placed = paused_in(&net.client_ns, c, || near.kill());
    let err = text(&placed.stderr);
    println!("predicted: {err}");
    assert_eq!(text(&placed.stdout), text(&direct.stdout), "{err}");
    assert!(err.contains(&format!("reconnected to {mid_addr}")), "{err}");
    assert_eq!(count(), (1, 1), "placed again: the middle daemon");
}

/// cuda_app `run` with progress lines, from the client namespace: `at_start` runs
/// once its first request is done; then its whole output (progress lines dropped),
/// within 60 s, and how long it ran.
fn started_in(ns: &str, mut c: Command, at_start: impl FnOnce()) -> (Output, Duration) {
    use std::io::{BufRead, BufReader};
    c.env("CUDA_APP_PROGRESS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut child = in_ns(ns, move || c.spawn().unwrap());
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut l = String::new();
        assert!(
            out.read_line(&mut l).unwrap() > 0,
            "no request done: {seen}"
        );
        let first = l.starts_with("progress");
        seen += &l;
        if first {
            break;
        }
    }
    at_start();
    let rest = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut out, &mut s).unwrap();
        s
    });
    let mut o = remote_util::cuda::wait_with_deadline(child, Duration::from_secs(60));
    let took = t0.elapsed();
    let all = seen + &rest.join().unwrap();
    o.stdout = all
        .lines()
        .filter(|l| !l.starts_with("progress"))
        .map(|l| format!("{l}\n"))
        .collect::<String>()
        .into_bytes();
    (o, took)
}

/// A running task whose daemon becomes the worse choice moves, right after a
/// synchronize, to the better one, with its session replayed there: the program's
/// results byte-identical to the driver's. The hazard first: with moves off
/// (TOFFLOAD_CUDA_REMOTE_MOVE_MS=0), a task placed on the near daemon stays there
/// through another program's load, queued behind it to the end.
#[test]
fn a_running_task_moves_when_its_daemon_becomes_the_worse_choice() {
    if !ready() {
        return;
    }
    const RUN: [&str; 3] = ["run", "2", "250"];
    let libs = Libs::new("move");
    let direct = libs.direct(&RUN, KERNEL_US);
    assert!(direct.status.success(), "{}", text(&direct.stderr));
    let net = Net::new("cm", &[NEAR, FAR]).unwrap();
    // A GPU that one kernel fills: the load's kernels and the task's take turns.
    let mut env = libs.gpu_env(KERNEL_US);
    env.push(("FAKE_CUDA_SMS".into(), "1".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (near, _ndl, near_addr) = daemon_on(&net.links[0], &[], &env);
    let (far, _fdl, far_addr) = daemon_on(&net.links[1], &[], &env);
    let list = format!("{near_addr},{far_addr}");
    let (near_ns, far_ns) = (net.links[0].ns.clone(), net.links[1].ns.clone());
    let count = || (sessions(&near, &near_ns), sessions(&far, &far_ns));

    // Loads the near daemon once the task runs there (8 threads of back-to-back
    // requests, there alone), until dropped.
    struct Load(Option<std::process::Child>);
    impl Drop for Load {
        fn drop(&mut self) {
            if let Some(mut c) = self.0.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let load_near = |load: &mut Load| {
        let mut c = libs.remote_cmd(&libs.app, &near_addr);
        c.args(["run", "8", "100000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        load.0 = Some(in_ns(&net.client_ns, move || c.spawn().unwrap()));
        let t0 = Instant::now();
        while stats_in(&near_ns, near.port)["cuda_queue"] < 4 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the load never showed"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // The load's queue (and its recent mean) gone, so that the next task is placed
    // near again.
    let drain = || {
        let t0 = Instant::now();
        while stats_in(&near_ns, near.port)["cuda_queue"] > 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the queue never drained"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let same = |o: &Output| {
        assert!(o.status.success(), "{}", text(&o.stderr));
        assert_eq!(text(&o.stdout), text(&direct.stdout), "{}", text(&o.stderr));
    };

    let mut load = Load(None);
    let mut c = libs.remote_cmd(&libs.app, &list);
    c.args(RUN).env("TOFFLOAD_CUDA_REMOTE_MOVE_MS", "0");
    let (stayed, stayed_t) = started_in(&net.client_ns, c, || load_near(&mut load));
    drop(load);
    same(&stayed);
    println!("moves off: {stayed_t:?}; {}", text(&stayed.stderr));
    assert_eq!(
        count(),
        (2, 0),
        "placed near, and stayed there under the load"
    );
    drain();

    // Device memory only the daemon holds (a kernel's output nothing read back until
    // the end): a move would lose it (a loss makes it an error on use), so the task
    // stays, and still prints what the driver prints.
    let direct_scratch = Command::new(&libs.app)
        .args(RUN)
        .env("LD_LIBRARY_PATH", &libs.fake)
        .env("FAKE_CUDA_KERNEL_US", KERNEL_US.to_string())
        .env("CUDA_APP_SCRATCH", "1")
        .output()
        .unwrap();
    assert!(direct_scratch.status.success());
    let mut load = Load(None);
    let mut c = libs.remote_cmd(&libs.app, &list);
    c.args(RUN)
        .env("CUDA_APP_SCRATCH", "1")
        .env("TOFFLOAD_CUDA_REMOTE_MOVE_MS", "300")
        .env("TOFFLOAD_CUDA_REMOTE_PLACEMENT_LOG", "1");
    let (kept, kept_t) = started_in(&net.client_ns, c, || load_near(&mut load));
    drop(load);
    let err = text(&kept.stderr);
    println!("with device-only state: {kept_t:?}; {err}");
    assert!(kept.status.success(), "{err}");
    assert_eq!(text(&kept.stdout), text(&direct_scratch.stdout), "{err}");
    assert!(
        err.contains(&format!("staying on {near_addr}")) && err.contains("a move would lose"),
        "{err}"
    );
    assert!(!err.contains("moved from"), "{err}");
    assert_eq!(count(), (4, 0), "stayed near");

    // The load gone again: the next task is placed near once more.
    drain();

    let mut load = Load(None);
    let mut c = libs.remote_cmd(&libs.app, &list);
    c.args(RUN)
        .env("TOFFLOAD_CUDA_REMOTE_MOVE_MS", "300")
        .env("TOFFLOAD_CUDA_REMOTE_PLACEMENT_LOG", "1");
    let (moved, moved_t) = started_in(&net.client_ns, c, || load_near(&mut load));
    drop(load);
    let err = text(&moved.stderr);
    println!("moves every 300 ms: {moved_t:?}; {err}");
    same(&moved);
    assert!(
        moved_t < stayed_t,
        "moving gained nothing: {moved_t:?} against {stayed_t:?}"
    );
    assert!(
        err.contains(&format!(
            "moved from {near_addr} to {far_addr} at a synchronize"
        )),
        "{err}"
    );
    assert_eq!(count(), (6, 1), "placed near, then moved to the far daemon");

    // The load gone: the near daemon, idle again, reports what a kernel takes there
    // alone, not the loaded average its last stretches left (it would look slow
    // until it ran a kernel, so get no task to run one): the next task goes near.
    drain();
    let mut c = libs.remote_cmd(&libs.app, &list);
    c.args(RUN).env("TOFFLOAD_CUDA_REMOTE_PLACEMENT_LOG", "1");
    let (back, _) = run_in(&net.client_ns, c);
    println!("after the load: {}", text(&back.stderr));
    same(&back);
    assert_eq!(count(), (7, 1), "placed near again");
}
