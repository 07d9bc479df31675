//! toffload-watch end to end, as root: measurements against known truth (the
//! emulated device's configured latency, a program making exactly K of each event),
//! verdicts on the bundled servers, and every error path with its exit code.
//! Binaries come from the dist folder (`cargo xtask build`).

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;
use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::load::{self, Config};

mod common;
use common::{get, json_lines, ready, serial, stat_field, watch_cmd, Watcher, STAT_POLICY};

fn watch_pid(pid: u32, secs: f64) -> Watcher {
    let mut c = watch_cmd();
    c.args(["--json", "--interval", "10s", "--duration"])
        .arg(format!("{secs}s"))
        .arg("--pid")
        .arg(pid.to_string());
    Watcher::start(c)
}

/// conn_server waiting `lat_us` on each offload, blocking.
fn blocking_conn_server(lat_us: u32) -> Server {
    Server::start(
        &ServerSpec::new("conn_server")
            .env("TOFFLOAD_EMU_LAT_US", lat_us.to_string())
            .env("TOFFLOAD_WAIT", "block"),
    )
    .expect("conn_server")
}

fn drive(server: &Server, conns: usize, secs: f64) -> load::Report {
    let mut cfg = Config::new(server.port);
    cfg.conns = conns;
    cfg.duration = Duration::from_secs_f64(secs);
    cfg.warmup = Duration::from_millis(100);
    let r = load::run(&cfg).expect("load run");
    assert_eq!(r.wrong, 0, "wrong answers");
    r
}

/// Stall p50 as reported for conn_server, one connection, against the configured
/// offload latency. Server (with its device thread) and load on different CPUs, as
/// in the benchmarks, so that the load generator does not queue behind the server.
#[test]
fn stall_p50_matches_configured_latency() {
    let _s = serial();
    if !ready() {
        return;
    }
    // The server on the idlest CPU, the load generator on another: on a shared
    // machine a spinning waiter whose CPU another job also wants really stalls longer.
    let (server_cpu, load_cpu) = match idlest_cpus() {
        Some((a, b)) => (Some(a), Some(b)),
        None => (None, None),
    };
    if let Some(c) = load_cpu {
        harness::pin_current_thread(c).expect("pin the load generator");
    }
    // Up to three tries per configuration: this machine is shared, and a spinning
    // waiter whose CPU another job takes really does stall longer (the load
    // generator's own latency shows it too). A watcher that mis-measures fails all
    // three.
    // The configured latency is the truth only while the vCPUs stay awake (an idle,
    // halted vCPU's timer wake-up added ~25 us to each 200 us offload, seen by the
    // client too: +13% on an idle host, +5% with these).
    let _awake = harness::IdleSpinners::start();
    let mut failures = Vec::new();
    for wait in ["block", "spin"] {
        for lat in [200u32, 1000] {
            let mut tries = Vec::new();
            for _ in 0..3 {
                match stall_try(wait, lat, server_cpu) {
                    Ok(()) => {
                        tries.clear();
                        break;
                    }
                    Err(e) => tries.push(e),
                }
            }
            if !tries.is_empty() {
                failures.push(format!("{wait} {lat}: {tries:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

/// The two idlest CPUs over 300 ms (/proc/stat), idlest first; None on one CPU.
fn idlest_cpus() -> Option<(usize, usize)> {
    fn idle() -> Vec<(usize, u64)> {
        std::fs::read_to_string("/proc/stat")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let cpu = f.next()?.strip_prefix("cpu")?.parse().ok()?;
                // user nice system idle iowait ...: idle is the 4th field.
                Some((cpu, f.nth(3)?.parse().ok()?))
            })
            .collect()
    }
    let a = idle();
    std::thread::sleep(Duration::from_millis(300));
    let b = idle();
    let mut d: Vec<(u64, usize)> = b
        .iter()
        .filter_map(|&(c, i)| Some((i - a.iter().find(|x| x.0 == c)?.1, c)))
        .collect();
    d.sort_by(|x, y| y.cmp(x));
    (d.len() >= 2).then(|| (d[0].1, d[1].1))
}

/// One measurement: Err says what was off.
fn stall_try(wait: &str, lat: u32, server_cpu: Option<usize>) -> Result<(), String> {
    let server = Server::start(
        &ServerSpec::new("conn_server")
            .env("TOFFLOAD_EMU_LAT_US", lat.to_string())
            .env("TOFFLOAD_WAIT", wait)
            .cpu(server_cpu),
    )
    .expect("conn_server");
    let w = watch_pid(server.pid(), 3.5);
    let r = drive(&server, 1, 2.5);
    let (code, lines, _) = w.finish();
    assert_eq!(code, 0);
    let total = &get(&lines, "final")["total"];
    let num = |k: &str| total["offload"][k].as_f64().unwrap_or(f64::NAN);
    let (p50, spin, done) = (
        num("stall_p50_us"),
        num("spin_share"),
        num("latency_p50_us"),
    );
    let (spun, blocked) = (num("stalls_mostly_spinning"), num("stalls_mostly_blocked"));
    let err = (p50 - lat as f64) / lat as f64;
    let line = format!(
        "conn_server {wait} {lat} us: stall p50 {p50:.1} us ({:+.1}%), to completion \
         {done:.1} us, spin share {spin:.2}, {} calls; client p50 {:.1} us",
        err * 100.0,
        total["offload"]["calls"],
        r.p50_us
    );
    println!("{line}");
    if err.abs() > 0.10 {
        return Err(format!("outside 10%: {line}"));
    }
    // The wait style shows in the spin share: a spinning thread is on CPU for most of
    // its stall (less when the scheduler preempts it for the device thread sharing
    // its CPU), a blocked one for little of it.
    if wait == "spin" && !(spin > 0.6 && spun > 0.5) {
        return Err(format!(
            "spin wait, spin share {spin}, {spun} of stalls spun: {line}"
        ));
    }
    if wait == "block" && !(spin < 0.3 && blocked > 0.5) {
        return Err(format!(
            "blocking wait, spin share {spin}, {blocked} blocked: {line}"
        ));
    }
    Ok(())
}

/// A program making exactly K raw futex calls, K context switches and K offloads;
/// with the raw scheduler tracepoints (the default, where BTF gives the layout) and
/// the classic ones.
#[test]
fn counts_k_futex_switches_offloads() {
    let _s = serial();
    if !ready() {
        return;
    }
    count_k(false);
    count_k(true);
}

fn count_k(raw_sched: bool) {
    const K: f64 = 2000.0;
    let mut c = watch_cmd();
    // --sample 100: exact counts need every event traced, whatever the budget says.
    c.args(["run", "--json", "--sample", "100", "--"])
        .arg(harness::bin("kcount").expect("kcount built"))
        .arg((K as u32).to_string())
        .env("TOFFLOAD_WAIT", "spin")
        .env("TOFFLOAD_EMU_LAT_US", "20");
    if !raw_sched {
        c.env("TOFFLOAD_WATCH_RAW_SCHED", "0");
    }
    let w = Watcher::start(c);
    let (code, lines, err) = w.finish();
    assert_eq!(code, 0, "{err:?}");
    let header = get(&lines, "header");
    let fin = get(&lines, "final");
    assert_eq!(fin["ended"], "process exited");
    // Raw by default wherever the kernel's BTF gives the layout (this VM's does).
    let btf = std::path::Path::new("/sys/kernel/btf/vmlinux").exists();
    let want = if raw_sched && btf { "raw" } else { "classic" };
    assert_eq!(header["sched_hooks"], want, "{header}");
    let pid = header["pid"].as_u64().expect("pid");
    let main = fin["threads"]
        .as_array()
        .expect("threads")
        .iter()
        .find(|t| t["tid"].as_u64() == Some(pid))
        .expect("main thread reported");
    let total = &fin["total"];
    let raw = total["futex"]["raw"].as_f64().unwrap();
    let vol = main["voluntary"].as_f64().unwrap();
    let offloads = total["offload"]["calls"].as_f64().unwrap();
    println!(
        "K={K} (raw sched {raw_sched}): raw futex {raw}, main-thread voluntary \
         switches {vol}, offloads {offloads}"
    );
    for (what, v) in [
        ("raw futex", raw),
        ("switches", vol),
        ("offloads", offloads),
    ] {
        assert!(
            (v - K).abs() <= 0.02 * K,
            "{what}: {v}, expected {K} within 2%"
        );
    }
}

/// A watched program that writes to a reader on another CPU after each request: every
/// write wakes a task outside the watch, so the peer wake-ups per write must be one
/// (the program's own count of writes); the reader's CPU idle between writes, each of
/// them an idle wake-up; the same CPU kept busy (a nice-19 spinner on every CPU),
/// none.
#[test]
fn idle_peer_wakes_follow_the_clients_cpu() {
    let _s = serial();
    if !ready() {
        return;
    }
    if harness::cpus() < 2 {
        harness::skip("one CPU: no peer CPU to wake");
        return;
    }
    const K: u64 = 400;
    let dir = std::env::temp_dir().join(format!("toffload-kwake-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let fifo = dir.join("fifo");
    let path = std::ffi::CString::new(fifo.to_str().expect("utf-8 path")).unwrap();
    // SAFETY: a valid C string; creates a FIFO in our own folder.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0, "mkfifo");
    for busy in [false, true] {
        // The reader on CPU 1, the watched writer on CPU 0.
        let mut reader = Command::new("taskset")
            .args(["-c", "1", "cat"])
            .arg(&fifo)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("starting the reader");
        let spinners = busy.then(harness::IdleSpinners::start);
        let mut c = watch_cmd();
        c.args([
            "run", "--json", "--sample", "100", "--", "taskset", "-c", "0",
        ])
        .arg(harness::bin("kwake").expect("kwake built"))
        .arg(K.to_string())
        .arg(&fifo)
        .env("TOFFLOAD_WAIT", "spin")
        .env("TOFFLOAD_EMU_LAT_US", "20");
        let (code, lines, err) = Watcher::start(c).finish();
        drop(spinners);
        // A watch that failed never started the writer, and the reader would wait
        // for it for good.
        if matches!(reader.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(200));
            let _ = reader.kill();
        }
        let _ = reader.wait();
        assert_eq!(code, 0, "{err:?}");
        let total = &get(&lines, "final")["total"];
        // The watched command is the wrapper (taskset); kwake's offload entry point
        // is probed before the wrapper runs (spawn::programs), so every call counts.
        // Probed at the next read of the maps instead, a run this short lost up to
        // 98% of them, or all, when the request count fell back to reads.
        let requests = total["requests"].as_f64().expect("requests");
        assert_eq!(total["request_source"], "offload calls", "{total}");
        assert_eq!(requests, K as f64, "offload calls counted of {K}");
        // One request a write, so the per-request rates are per write.
        let per_write = |key: &str| total[key].as_f64().expect(key);
        let peer = per_write("peer_wakes_per_request");
        let idle = per_write("peer_idle_wakes_per_request");
        println!(
            "reader's CPU busy {busy}: {peer:.2} peer wake-ups per write, {idle:.2} idle \
             ({requests} requests counted)"
        );
        // One a write, and some of other tasks outside the watch that a wake-up in
        // interrupt context on the writer's CPU is counted against it for (seen:
        // 0.95-1.22 in most runs, 1.45 once on a host just done compiling); fewer
        // where the reader had not gone back to sleep when the next write came
        // (0.89 once in a full suite on a disturbed host); a counter that counted
        // each write twice would read 2, one that missed them 0.
        assert!(
            (0.8..=1.6).contains(&peer),
            "{peer} peer wake-ups per request"
        );
        if busy {
            assert!(idle <= 0.1, "{idle} idle wake-ups of a busy CPU");
        } else {
            assert!(idle >= 0.8, "{idle} idle wake-ups of an idle CPU");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A program whose every request spends a known BUSY us of its own CPU outside the
/// offload, then sleeps once: the outside-CPU distribution must sit at BUSY (plus
/// the sleep's few us), and each sleep must count as a slept syscall. Without the
/// busy loop the same distribution sits near zero, so the test cannot pass on a
/// histogram that does not follow the program.
#[test]
fn outside_cpu_and_slept_syscalls_follow_the_program() {
    let _s = serial();
    if !ready() {
        return;
    }
    const K: u64 = 400;
    // A spinning wait sleeps only outside the offload; a blocking one (200 us, long
    // enough that every wait sleeps) also inside it, in its futex.
    for (busy, wait) in [(0.0, "spin"), (200.0, "spin"), (0.0, "block")] {
        let mut c = watch_cmd();
        c.args(["run", "--json", "--sample", "100", "--"])
            .arg(harness::bin("kmix").expect("kmix built"))
            .arg(K.to_string())
            .arg(format!("{busy}"))
            .env("TOFFLOAD_WAIT", wait)
            .env(
                "TOFFLOAD_EMU_LAT_US",
                if wait == "spin" { "20" } else { "200" },
            );
        let (code, lines, err) = Watcher::start(c).finish();
        assert_eq!(code, 0, "{err:?}");
        let total = &get(&lines, "final")["total"];
        let o = &total["outside_cpu"];
        let (n, p10, p50, p90) = (
            o["requests"].as_u64().expect("outside_cpu.requests"),
            o["p10_us"].as_f64().unwrap(),
            o["p50_us"].as_f64().unwrap(),
            o["p90_us"].as_f64().unwrap(),
        );
        let slept = total["slept_syscalls_per_request"].as_f64().expect("slept");
        let slept_us = total["slept_syscall_us"].as_f64().expect("slept us");
        println!(
            "busy {busy} us: {n} outside parts, p10 {p10:.1} p50 {p50:.1} p90 {p90:.1} us; \
             {slept:.2} slept syscalls per request at {slept_us:.1} us"
        );
        // K offloads close K - 1 outside parts (the last one never ends in a call).
        // Within 1%: one run in some dozens counted 396 of 399 (the kernel skips a
        // program that would nest in another on the same CPU; not confirmed as the
        // cause), which a rate reported per second does not notice.
        assert!(
            (n as i64 - (K as i64 - 1)).abs() <= K as i64 / 100,
            "{n} outside parts"
        );
        assert!(p10 <= p50 && p50 <= p90, "{o}");
        // The busy loop, plus the sleep's on-CPU share and the probes' few us.
        assert!(
            p50 >= busy && p50 < busy + 60.0,
            "p50 {p50} for busy {busy}"
        );
        // Every nanosleep sleeps once and follows an offload.
        assert!(
            (0.9..=1.1).contains(&slept),
            "{slept} slept syscalls per request"
        );
        assert!(
            slept_us > 0.0 && slept_us < 100.0,
            "{slept_us} us per slept syscall"
        );
        // Each request's time asleep outside the offload: the 20 us nanosleep (with
        // its timer slack, 50 us by default), never the blocking wait's futex inside
        // the offload. Counted too, that futex put 220 us more a request in it, and
        // with the stall the sum came near twice the loop's cycle; the check is made
        // on the blocking wait, the only one with a futex inside. The three are means
        // over different populations (offload calls, requests, traced seconds), so a
        // busy host puts them apart by up to a quarter (CI: 168 against a 162 us cycle,
        // 295 against 267; a spinning run read 73 + 64 against 109, its stall mean
        // stretched by preemptions).
        let z = total["outside_wait_us"].as_f64().expect("outside_wait_us");
        let stall = total["offload"]["stall_mean_us"]
            .as_f64()
            .expect("stall mean");
        let cycle = total["secs"].as_f64().unwrap() * 1e6 / total["requests"].as_f64().unwrap();
        println!("  asleep outside {z:.1} us per request; stall {stall:.1}, cycle {cycle:.1} us");
        // Up to 200, or 0.3 of the cycle on a host slowed for a while: its wake-ups
        // come late, and every part of the cycle with them (full suites read 153,
        // 167 and 201 us, the last two in cycles of 881 and 1261 us, their stalls
        // 476 and 722 us against 114-243 us alone). The blocking wait's futex
        // counted in would add some 220 more, which the sum below catches too.
        let ceiling = 200f64.max(0.3 * cycle);
        assert!(
            (15.0..ceiling).contains(&z),
            "{z} us asleep outside for a 20 us nanosleep (cycle {cycle} us)"
        );
        if wait != "spin" {
            assert!(
                z + stall <= cycle * 1.25,
                "asleep outside {z} + stall {stall} exceed the cycle {cycle} us"
            );
        }
        let inside = total["offload"]["slept_syscall_us"].as_f64();
        let sleeps = total["offload"]["sleeps_per_call"].as_f64().unwrap();
        println!("  {wait}: {sleeps:.2} sleeps per offload call, {inside:?} us each");
        if wait == "spin" {
            assert_eq!(inside, None, "a spin has no sleep inside the offload");
        } else {
            assert!((0.9..=1.1).contains(&sleeps), "{sleeps} sleeps per call");
            let inside = inside.expect("the futex's sleeps");
            assert!(
                inside > 0.0 && inside < 100.0,
                "{inside} us per sleep inside"
            );
        }
    }
}

fn verdict_of(spec: ServerSpec, conns: usize) -> (String, String) {
    let server = Server::start(&spec).expect("server");
    let w = watch_pid(server.pid(), 3.0);
    drive(&server, conns, 2.0);
    let (code, lines, _) = w.finish();
    assert_eq!(code, 0);
    let v = &get(&lines, "final")["total"]["verdict"];
    println!("{}: {} -- {}", spec.name, v["kind"], v["because"]);
    (
        v["kind"].as_str().unwrap_or_default().to_string(),
        v["because"].as_str().unwrap_or_default().to_string(),
    )
}

#[test]
fn verdict_conn_server_fiberizable() {
    let _s = serial();
    if !ready() {
        return;
    }
    let (kind, because) = verdict_of(
        ServerSpec::new("conn_server")
            .env("TOFFLOAD_EMU_LAT_US", "200")
            .env("TOFFLOAD_WAIT", "block"),
        8,
    );
    assert_eq!(kind, "fiberizable", "{because}");
    assert!(
        because.contains("threads per accepted connection"),
        "{because}"
    );
}

#[test]
fn verdict_evloop_server_event_loop() {
    let _s = serial();
    if !ready() {
        return;
    }
    let (kind, because) = verdict_of(
        ServerSpec::new("evloop_server").env("TOFFLOAD_EMU_LAT_US", "200"),
        8,
    );
    assert_eq!(kind, "event_loop", "{because}");
}

#[test]
fn verdict_rawfutex_server_below_libc() {
    let _s = serial();
    if !ready() {
        return;
    }
    let (kind, because) = verdict_of(
        ServerSpec::new("rawfutex_server")
            .env("TOFFLOAD_EMU_LAT_US", "200")
            .env("TOFFLOAD_WAIT", "block"),
        8,
    );
    assert_eq!(kind, "below_libc_wall", "{because}");
    assert!(
        because.contains("raw futex syscalls per request"),
        "{because}"
    );
}

fn run_plain(args: &[&str]) -> (i32, String) {
    let out = watch_cmd().args(args).output().expect("run toffload-watch");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_flags_exit_2() {
    if harness::bin("toffload-watch").is_err() {
        harness::skip("toffload-watch not built");
        return;
    }
    for args in [
        &["--bogus"][..],
        &["--pid", "1", "--interval", "soon"],
        &["--pid", "notanumber"],
        &["--pid", "1", "--overhead-budget", "0"],
        &["--pid", "1", "--overhead-budget", "lots"],
        &["--pid", "1", "--overhead-budget", "5", "--sample", "50"],
        &["--pid", "1", "--sample", "0"],
        &[],
        &["run"],
    ] {
        let (code, err) = run_plain(args);
        assert_eq!(code, 2, "{args:?}: {err}");
    }
}

#[test]
fn no_such_pid_exits_5() {
    let _s = serial();
    if !ready() {
        return;
    }
    let (code, err) = run_plain(&["--pid", "999999999", "--duration", "1s"]);
    assert_eq!(code, 5, "{err}");
    assert!(err.contains("no such pid: 999999999"), "{err}");
}

#[test]
fn not_root_exits_3() {
    let _s = serial();
    if !ready() {
        return;
    }
    let mut c = watch_cmd();
    c.args(["--pid", "1", "--duration", "1s"]);
    // SAFETY: setgid/setuid only, between fork and exec: drops root for the child.
    unsafe {
        c.pre_exec(|| {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = c.output().expect("run as nobody");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("not root") && err.contains("sudo"), "{err}");
}

/// bpf(2) refused by a seccomp filter: the kernel-side programs cannot load.
#[test]
fn bpf_unavailable_exits_4() {
    let _s = serial();
    if !ready() {
        return;
    }
    let mut c = watch_cmd();
    c.args(["--pid", &std::process::id().to_string(), "--duration", "1s"]);
    // SAFETY: prctl only, between fork and exec; the filter lives on this stack.
    unsafe {
        c.pre_exec(|| {
            let mut filter = [
                libc::sock_filter {
                    code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
                    jt: 0,
                    jf: 0,
                    k: 0,
                },
                libc::sock_filter {
                    code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
                    jt: 0,
                    jf: 1,
                    k: libc::SYS_bpf as u32,
                },
                libc::sock_filter {
                    code: (libc::BPF_RET | libc::BPF_K) as u16,
                    jt: 0,
                    jf: 0,
                    k: libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
                },
                libc::sock_filter {
                    code: (libc::BPF_RET | libc::BPF_K) as u16,
                    jt: 0,
                    jf: 0,
                    k: libc::SECCOMP_RET_ALLOW,
                },
            ];
            let prog = libc::sock_fprog {
                len: filter.len() as u16,
                filter: filter.as_mut_ptr(),
            };
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    &prog as *const _ as usize,
                    0,
                    0,
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = c.output().expect("run under seccomp");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("BPF unavailable"), "{err}");
}

/// The watched process exits in the middle: a final report and a clean exit.
#[test]
fn pid_exits_mid_watch() {
    let _s = serial();
    if !ready() {
        return;
    }
    let mut target = Command::new("sleep").arg("1.5").spawn().expect("sleep");
    let w = watch_pid(target.id(), 30.0);
    let t0 = std::time::Instant::now();
    let (code, lines, err) = w.finish();
    let _ = target.wait();
    assert_eq!(code, 0, "{err:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "did not notice the exit"
    );
    assert_eq!(get(&lines, "final")["ended"], "process exited");
    assert!(
        err.iter()
            .any(|l| l.contains("exited; final report follows")),
        "{err:?}"
    );
}

/// A tracepoint the kernel lacks: the watch goes on and names the lost metric.
#[test]
fn missing_tracepoint_degrades() {
    let _s = serial();
    if !ready() {
        return;
    }
    let server = Server::start(&ServerSpec::new("conn_server").env("TOFFLOAD_EMU_LAT_US", "100"))
        .expect("conn_server");
    let mut c = watch_cmd();
    c.args(["--json", "--duration", "2s", "--pid"])
        .arg(server.pid().to_string())
        .env("TOFFLOAD_WATCH_HIDE_TRACEPOINT", "sched:sched_waking");
    let w = Watcher::start(c);
    drive(&server, 2, 1.0);
    let (code, lines, _) = w.finish();
    assert_eq!(code, 0);
    let missing = get(&lines, "header")["missing"]
        .as_array()
        .expect("missing")
        .clone();
    assert_eq!(missing.len(), 1, "{missing:?}");
    assert!(
        missing[0].as_str().unwrap().contains("wake-up latency"),
        "{missing:?}"
    );
    // The rest still measures.
    let total = &get(&lines, "final")["total"];
    assert!(total["offload"]["calls"].as_u64().unwrap() > 0);
}

#[test]
fn run_mode_unknown_command_exits_7() {
    let _s = serial();
    if !ready() {
        return;
    }
    let (code, err) = run_plain(&["run", "--", "/nonexistent/toffload-no-such-cmd"]);
    assert_eq!(code, 7, "{err}");
    assert!(err.contains("cannot start the command"), "{err}");
}

/// --sample 30: traced 30% of each second; rates are per traced second, so they
/// still match the load, and the stall distribution is unchanged.
#[test]
fn sampled_watch_keeps_rates_and_stall() {
    let _s = serial();
    if !ready() {
        return;
    }
    let server = blocking_conn_server(1000);
    let mut c = watch_cmd();
    c.args([
        "--json",
        "--interval",
        "1s",
        "--sample",
        "30",
        "--duration",
        "4.5s",
        "--pid",
    ])
    .arg(server.pid().to_string());
    let w = Watcher::start(c);
    let r = drive(&server, 4, 4.0);
    let (code, lines, _) = w.finish();
    assert_eq!(code, 0);
    let total = &get(&lines, "final")["total"];
    let secs = total["secs"].as_f64().unwrap();
    // The device's latency as the thread sees it (the stall less its wake-up delay,
    // which a busy CI machine stretches whether or not the watch samples).
    let p50 = total["offload"]["latency_p50_us"].as_f64().unwrap();
    // Windows wholly inside the load (not the first, nor those at its end).
    let mut mid: Vec<f64> = lines
        .iter()
        .filter(|(k, _)| k == "window")
        .map(|(_, w)| w["requests_per_sec"].as_f64().unwrap())
        .skip(1)
        .take(2)
        .collect();
    assert_eq!(mid.len(), 2, "{lines:?}");
    mid.sort_by(f64::total_cmp);
    let rps = (mid[0] + mid[1]) / 2.0;
    println!(
        "sampled: traced {secs:.2} s, {rps:.0} req/s (load generator {:.0}), stall p50 {p50:.1} us \
         (client p50 {:.1} us)",
        r.requests_per_sec,
        r.p50_us
    );
    assert!(
        (1.0..=1.8).contains(&secs),
        "traced {secs} s of 4.5 s at 30%"
    );
    assert!(
        (rps / r.requests_per_sec - 1.0).abs() < 0.25,
        "{rps} vs {}",
        r.requests_per_sec
    );
    // Never under the device's latency; never past the whole round trip the load
    // generator saw (a host that wakes the device's thread late stretches both: a
    // fixed band round 1000 us failed CI at 1194 us).
    assert!(
        p50 > 900.0 && p50 < 1.15 * r.p50_us,
        "latency p50 {p50} us; client p50 {} us",
        r.p50_us
    );
}

/// The default watch keeps its own cost within the overhead budget: the cost per
/// event is measured at start, a server whose traced events cost more than the budget
/// is traced for only part of each interval (the traced time shrinks to match), and
/// the rates and the stall it reports still match the load. --sample 100 traces all.
#[test]
fn overhead_budget_traces_part_of_each_interval() {
    let _s = serial();
    if !ready() {
        return;
    }
    for (flags, budgeted) in [(&[][..], true), (&["--sample", "100"][..], false)] {
        let server = blocking_conn_server(200);
        let mut c = watch_cmd();
        c.args(["--json", "--interval", "1s", "--duration", "6.5s"])
            .args(flags)
            .arg("--pid")
            .arg(server.pid().to_string());
        let w = Watcher::start(c);
        let r = drive(&server, 16, 6.0);
        let (code, lines, err) = w.finish();
        assert_eq!(code, 0, "{err:?}");
        let cost = &get(&lines, "header")["probe_cost"];
        let (sys, sw, off) = (
            cost["syscall_ns"].as_f64().expect("syscall cost measured"),
            cost["switch_ns"].as_f64().expect("switch cost"),
            cost["offload_ns"].as_f64().expect("offload cost"),
        );
        println!("cost per event: syscall {sys:.0} ns, switch {sw:.0} ns, offload {off:.0} ns");
        // Tracing a syscall or an offload is never free, and no event costs a
        // millisecond. (A switch's cost is a difference of two ping-pong timings
        // less four syscalls': on a busy machine it can come out as zero.)
        for v in [sys, off] {
            assert!(v > 0.0 && v < 1e6, "{cost}");
        }
        assert!((0.0..1e6).contains(&sw), "{cost}");
        let windows: Vec<&serde_json::Value> = lines
            .iter()
            .filter(|(k, _)| k == "window")
            .map(|(_, w)| w)
            .collect();
        // Windows wholly inside the load.
        let mid = &windows[1..5.min(windows.len())];
        assert_eq!(mid.len(), 4, "{lines:?}");
        for w in mid {
            let wc = &w["watcher"];
            let share = wc["share_traced"].as_f64().unwrap();
            let duty = wc["duty"].as_f64().unwrap();
            let secs = w["secs"].as_f64().unwrap();
            let rps = w["requests_per_sec"].as_f64().unwrap();
            println!(
                "budgeted {budgeted}: traced {secs:.2} s, cost {:.1}% of CPU while tracing, next                  duty {duty:.2}, {rps:.0} req/s (load generator {:.0})",
                share * 100.0,
                r.requests_per_sec
            );
            // 16 connections of 200 us offloads keep the server busy enough that
            // tracing every event costs well over 1% of its CPU (4-8% in most runs;
            // 3.2% once in a full suite, the host slowing the server's own work),
            // four times the budget and more.
            assert!(share > 0.02, "{wc}");
            if budgeted {
                assert!((0.02..0.4).contains(&duty), "{wc}");
                assert!(secs < 0.7, "traced {secs} s of a 1 s interval: {wc}");
                assert!(wc["budget"].as_f64() == Some(0.005), "{wc}");
            } else {
                assert_eq!(duty, 1.0, "{wc}");
                assert!(secs > 0.9, "{secs}");
                assert!(wc["budget"].is_null(), "{wc}");
            }
        }
        // Rates are per traced second: they match the load generator's (the median
        // of the four windows: a burst of a tenth of a second sees a noisy machine's
        // swings that a second averages out; the mean of two read 0.55 of the load
        // generator's once, one burst caught in a stall).
        let rps = harness::median(
            mid.iter()
                .map(|w| w["requests_per_sec"].as_f64().unwrap())
                .collect(),
        );
        assert!(
            (rps / r.requests_per_sec - 1.0).abs() < 0.3,
            "{rps} vs {}",
            r.requests_per_sec
        );
        // Between the bursts the server's own counters give its rate without the
        // watch (untraced.rs): a read and a write per request, at the load's rate. A
        // window traced in full has no untraced part.
        if budgeted {
            let mut untraced = 0.0;
            for w in mid {
                let u = &w["untraced"];
                println!("untraced: {u}");
                let k = u["io_calls_per_request"].as_f64().expect("untraced part");
                assert!((1.5..4.0).contains(&k), "{u}");
                assert!(u["secs"].as_f64().unwrap() >= 0.1, "{u}");
                assert!(u["cpu_per_request_us"].as_f64().unwrap() > 0.0, "{u}");
                // Its stretches lie within the window's seconds, in order, and add up
                // to its own.
                let (ts, wall) = (w["ts"].as_f64().unwrap(), w["wall_secs"].as_f64().unwrap());
                let spans: Vec<(f64, f64)> = u["spans"]
                    .as_array()
                    .expect("untraced spans")
                    .iter()
                    .map(|s| (s[0].as_f64().unwrap(), s[1].as_f64().unwrap()))
                    .collect();
                assert!(!spans.is_empty(), "{u}");
                assert!(spans[0].0 >= ts - wall - 0.05, "{u} in {ts} - {wall}");
                assert!(spans[spans.len() - 1].1 <= ts + 0.01, "{u} in {ts}");
                assert!(spans.windows(2).all(|p| p[0].1 < p[1].0), "{u}");
                let sum: f64 = spans.iter().map(|(a, b)| b - a).sum();
                assert!((sum - u["secs"].as_f64().unwrap()).abs() < 0.01, "{u}");
                untraced += u["requests_per_sec"].as_f64().unwrap() / mid.len() as f64;
            }
            assert!(
                (untraced / r.requests_per_sec - 1.0).abs() < 0.3,
                "untraced {untraced} vs {}",
                r.requests_per_sec
            );
        } else {
            assert!(mid.iter().all(|w| w["untraced"].is_null()), "{mid:?}");
        }
        let p50 = get(&lines, "final")["total"]["offload"]["stall_p50_us"]
            .as_f64()
            .unwrap();
        assert!(p50 > 180.0 && p50 < 600.0, "stall p50 {p50}");
    }
}

/// The syscall hooks run for every process: a neighbour making K syscalls while a
/// target is watched (this test's thread, outside the watch, beside a shell spinning
/// on a builtin, which makes none) is counted (`host_syscalls` >= K with every event
/// traced, none of them the target's) and priced (`watcher.host_share`). The budget
/// pays that part up to the target's own cost (a load tool's share of the target's
/// traffic), not beyond: this light target, whose own cost is far under the budget,
/// stays traced in full though its neighbour's cost alone is over it (charged in
/// full, it fell to the 2% floor, where serve's test counted a quarter too few
/// requests of a light server).
#[test]
fn the_hosts_syscalls_cost_the_budget() {
    let _s = serial();
    if !ready() {
        return;
    }
    const K: u64 = 400_000;
    for sampled in [true, false] {
        // Target and neighbour share CPU 0: the scheduler switches between them, and
        // the target's CPU is measured at its switches (a spinner alone on a CPU is
        // never switched out, and its CPU would read 0).
        let mut target = Command::new("taskset")
            .args(["-c", "0", "sh", "-c", "while :; do :; done"])
            .spawn()
            .expect("sh");
        let mut c = watch_cmd();
        c.args(["--json", "--interval", "1s", "--duration", "1.5s"]);
        if sampled {
            c.args(["--sample", "100"]);
        }
        c.arg("--pid").arg(target.id().to_string());
        let w = Watcher::start(c);
        std::thread::spawn(|| {
            harness::pin_current_thread(0).expect("pinning the neighbour");
            for _ in 0..K {
                // SAFETY: getppid has no arguments and cannot fail.
                unsafe { libc::syscall(libc::SYS_getppid) };
            }
        })
        .join()
        .expect("the neighbour's loop");
        let (code, lines, err) = w.finish();
        let _ = target.kill();
        let _ = target.wait();
        assert_eq!(code, 0, "{err:?}");
        let cost = &get(&lines, "header")["probe_cost"];
        let host_ns = cost["host_syscall_ns"]
            .as_f64()
            .expect("host syscall cost measured");
        // A neighbour's syscall runs the hooks' entry and filter, a watched one all of
        // it and more: a neighbour's timing above that is the host's noise (a loop
        // timed at the start's SCHED_IDLE once read 1055 ns against 265).
        let own_ns = cost["syscall_ns"].as_f64().expect("syscall cost");
        assert!(host_ns > 0.0 && host_ns < 1.5 * own_ns, "{cost}");
        let w = &get(&lines, "window");
        let wc = &w["watcher"];
        let f =
            |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k}: {v}"));
        let (host, own, secs) = (f(w, "host_syscalls"), f(w, "syscalls"), f(w, "secs"));
        let (share, host_share, burst, duty) = (
            f(wc, "share_traced"),
            f(wc, "host_share"),
            f(wc, "burst_share"),
            f(wc, "duty"),
        );
        println!(
            "every event {sampled}: traced {secs:.3} s, {host} host syscalls ({host_ns:.0} ns \
             each), {own} of the target's; cost {:.2}% own, {:.2}% host; next duty {duty:.3}",
            share * 100.0,
            host_share * 100.0
        );
        assert!(own < 100.0, "{w}");
        assert!(f(w, "on_cpu_ms") > 0.0, "{w}");
        // The host's share: its syscalls at the calibrated cost, over the target's CPU.
        let want = (host * host_ns / (f(w, "on_cpu_ms") * 1e6)).min(1.0);
        assert!(
            (host_share / want - 1.0).abs() < 1e-6,
            "{host_share} vs {want}"
        );
        assert!(host_share > 0.005, "{wc}");
        if sampled {
            assert!(host >= K as f64, "{w}");
        } else {
            assert!(share < 0.0025 && burst == 0.0, "{wc}");
        }
        assert_eq!(duty, 1.0, "{wc}");
    }
}

/// A thread that keeps its CPU through a burst (a syscall loop alone on a CPU, never
/// switched out) counts its time in each burst: its stretch opens at its first
/// syscall in the burst (its switch-in came before it) and closes when the burst ends
/// (its switch-out comes after). Counted at switches only, it read 0 CPU after the
/// first burst; now one CPU over the traced seconds, in 20 ms bursts (--sample 2).
#[test]
fn a_busy_threads_cpu_counts_from_the_bursts_start() {
    let _s = serial();
    if !ready() {
        return;
    }
    if harness::which("python3").is_none() {
        harness::skip("python3 is not installed: no syscall loop to watch");
        return;
    }
    let cpu = (harness::cpus() - 1).to_string();
    let mut spin = Command::new("taskset")
        .args([
            "-c",
            &cpu,
            "python3",
            "-c",
            "import os\nwhile True: os.getppid()",
        ])
        .spawn()
        .expect("python3");
    std::thread::sleep(Duration::from_millis(300));
    let mut c = watch_cmd();
    c.args([
        "--json",
        "--sample",
        "2",
        "--interval",
        "1s",
        "--duration",
        "4.5s",
    ])
    .arg("--pid")
    .arg(spin.id().to_string());
    let (code, lines, err) = Watcher::start(c).finish();
    let _ = spin.kill();
    let _ = spin.wait();
    assert_eq!(code, 0, "{err:?}");
    let shares: Vec<f64> = lines
        .iter()
        .filter(|(k, _)| k == "window")
        .skip(1)
        .map(|(_, w)| w["on_cpu_ms"].as_f64().unwrap() / 1e3 / w["secs"].as_f64().unwrap())
        .collect();
    println!("CPU over traced seconds, windows 2 on: {shares:.2?}");
    assert!(shares.len() >= 2, "{lines:?}");
    for s in shares {
        assert!((0.85..1.1).contains(&s), "{s:.2} of a CPU the loop keeps");
    }
}

/// Per-request CPU above the offload: behind the wall.
#[test]
fn verdict_cpu_heavy_conn_server_behind() {
    let _s = serial();
    if !ready() {
        return;
    }
    let (kind, because) = verdict_of(
        ServerSpec::new("conn_server")
            .arg("--cpu-us")
            .arg("600")
            .env("TOFFLOAD_EMU_LAT_US", "100")
            .env("TOFFLOAD_WAIT", "block"),
        2,
    );
    assert_eq!(kind, "behind_wall", "{because}");
}

/// A statically linked program: nothing for LD_PRELOAD to hook.
#[test]
fn verdict_static_binary_not_dynamic() {
    let _s = serial();
    if !ready() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("toffload-watch-static-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let src = dir.join("spin.c");
    std::fs::write(
        &src,
        "#include <unistd.h>\nint main(void) { for (int i = 0; i < 50; i++) usleep(20000); return 0; }\n",
    )
    .expect("source");
    let exe = dir.join("spin");
    let cc = Command::new("cc")
        .arg("-static")
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("cc");
    if !cc.status.success() {
        harness::skip(&format!(
            "cc -static failed (libc6-dev's libc.a missing?): {}",
            String::from_utf8_lossy(&cc.stderr)
        ));
        return;
    }
    let mut c = watch_cmd();
    c.args(["run", "--json", "--"]).arg(&exe);
    let (code, lines, err) = Watcher::start(c).finish();
    assert_eq!(code, 0, "{err:?}");
    assert_eq!(get(&lines, "header")["runtime"]["kind"], "static");
    let v = &get(&lines, "final")["total"]["verdict"];
    assert_eq!(v["kind"], "not_dynamic", "{v}");
}

/// A process the target forks after attach is watched from then on: it shows in the
/// windows' process rows (its reads counted) within one window of the fork.
#[test]
fn a_process_forked_after_attach_is_picked_up() {
    let _s = serial();
    if !ready() {
        return;
    }
    // The shell forks dd (1-byte reads from /dev/zero, for 2 s) when told to.
    let mut target = Command::new("sh")
        .args([
            "-c",
            "read go; timeout 2 dd if=/dev/zero of=/dev/null bs=1 2>/dev/null & wait",
        ])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("sh");
    let mut c = watch_cmd();
    c.args([
        "--json",
        "--sample",
        "100",
        "--interval",
        "500ms",
        "--duration",
        "3s",
        "--pid",
    ])
    .arg(target.id().to_string());
    let w = Watcher::start(c);
    std::thread::sleep(Duration::from_millis(300));
    let forked_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    use std::io::Write;
    target
        .stdin
        .take()
        .unwrap()
        .write_all(b"go\n")
        .expect("tell sh to fork");
    let (code, lines, err) = w.finish();
    let _ = target.kill();
    let _ = target.wait();
    assert_eq!(code, 0, "{err:?}");
    let windows: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|(k, _)| k == "window")
        .map(|(_, v)| v)
        .collect();
    let dd_in = |w: &serde_json::Value| {
        w["processes"].as_array().is_some_and(|ps| {
            ps.iter().any(|p| {
                p["comm"] == "dd"
                    && p["role"] == "child"
                    && p["reads_per_sec"].as_f64().unwrap_or(0.0) > 1000.0
            })
        })
    };
    // The first window that ends a full interval after the fork must have it.
    let due = windows
        .iter()
        .position(|w| w["ts"].as_f64().unwrap_or(0.0) >= forked_at + 0.5)
        .unwrap_or_else(|| panic!("no window ends after the fork: {windows:?}"));
    for (i, w) in windows.iter().enumerate() {
        println!(
            "window {i}: ts {:.2} (fork {forked_at:.2}) processes {}",
            w["ts"], w["processes"]
        );
    }
    assert!(
        windows[..=due].iter().any(|w| dd_in(w)),
        "dd (forked at {forked_at:.2}) not in the windows up to {due}"
    );
    // Before the fork there was no dd to see.
    assert!(!dd_in(windows[0]) || windows[0]["ts"].as_f64().unwrap() > forked_at);
}

/// A cgroup made for the test (in the unified tree: the whole tree on a v2 host,
/// unified/ on a hybrid one), holding one sleeping child; removed on drop.
struct TestCgroup {
    dir: std::path::PathBuf,
    child: std::process::Child,
}

impl TestCgroup {
    fn new(name: &str) -> TestCgroup {
        let root = std::path::Path::new("/sys/fs/cgroup");
        let base = if root.join("cgroup.procs").is_file() {
            root.to_path_buf()
        } else {
            root.join("unified")
        };
        let dir = base.join(name);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let child = Command::new("sleep").arg("30").spawn().expect("sleep");
        std::fs::write(dir.join("cgroup.procs"), child.id().to_string())
            .unwrap_or_else(|e| panic!("moving a child into {}: {e}", dir.display()));
        TestCgroup { dir, child }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Empty once the child is reaped.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// --cgroup and --unit name what to watch by where it runs; a name that is not there
/// is exit 5 with what was looked for.
#[test]
fn cgroups_and_units_name_the_processes() {
    let _s = serial();
    if !ready() {
        return;
    }
    let me = std::process::id();
    let cg = TestCgroup::new(&format!("toffload-test-{me}"));
    let unit = TestCgroup::new(&format!("toffload-unit-{me}.service"));
    for (flag, value, pid) in [
        ("--cgroup", format!("toffload-test-{me}"), cg.child.id()),
        ("--cgroup", cg.dir.display().to_string(), cg.child.id()),
        ("--unit", format!("toffload-unit-{me}"), unit.child.id()),
    ] {
        let mut c = watch_cmd();
        c.args([
            "--json",
            "--interval",
            "300ms",
            "--duration",
            "300ms",
            flag,
            &value,
        ]);
        let (code, lines, err) = Watcher::start(c).finish();
        assert_eq!(code, 0, "{flag} {value}: {err:?}");
        assert_eq!(get(&lines, "header")["pid"], pid, "{flag} {value}");
    }
    let (code, err) = run_plain(&["--unit", "toffload-no-such-unit", "--duration", "1s"]);
    assert_eq!(code, 5, "{err}");
    assert!(err.contains("toffload-no-such-unit.service"), "{err}");
    let (code, err) = run_plain(&["--cgroup", "toffload-no-such-cgroup", "--duration", "1s"]);
    assert_eq!(code, 5, "{err}");
    assert!(err.contains("is not a cgroup"), "{err}");
}

/// The calibration is measured once per boot (and build): a later start reuses it,
/// --recalibrate measures afresh, and a tampered file is not trusted.
#[test]
fn a_later_start_reuses_this_boots_calibration() {
    let _s = serial();
    if !ready() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("toffload-calib-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut target = Command::new("sleep").arg("60").spawn().expect("sleep");
    let header = |extra: &[&str]| {
        let mut cmd = watch_cmd();
        cmd.env("TOFFLOAD_WATCH_CACHE_DIR", &dir)
            .args(["--json", "--interval", "300ms", "--duration", "300ms"])
            .args(extra)
            .args(["--pid", &target.id().to_string()]);
        let (code, lines, err) = Watcher::start(cmd).finish();
        assert_eq!(code, 0, "{err:?}");
        get(&lines, "header").clone()
    };
    let first = header(&[]);
    assert_eq!(first["probe_cost_source"], "measured", "{first}");
    assert!(dir.join("calibration.json").is_file());
    let second = header(&[]);
    assert_eq!(second["probe_cost_source"], "cached", "{second}");
    assert_eq!(second["probe_cost"], first["probe_cost"]);
    assert_eq!(second["context_switch_us"], first["context_switch_us"]);
    let third = header(&["--recalibrate"]);
    assert_eq!(third["probe_cost_source"], "measured", "{third}");
    // A file anyone may write is someone else's choice of cost: measured again.
    std::fs::set_permissions(
        dir.join("calibration.json"),
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    let fourth = header(&[]);
    assert_eq!(fourth["probe_cost_source"], "measured", "{fourth}");
    let _ = target.kill();
    let _ = target.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The start runs pinned to one CPU (start_priority.rs), and the calibration child
/// inherits that pin: choosing the CPU to wake from its own mask, it found none and
/// read what waking an idle CPU costs as 0 (the recipe model then kept nginx's idle
/// client wake-ups, ~6 us a request, in its CPU). It is given a peer from the CPUs
/// the watcher had before the pin.
#[test]
fn the_calibration_wakes_another_cpu_though_its_start_is_pinned() {
    let _s = serial();
    if !ready() {
        return;
    }
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        println!("skipped: one CPU, no other to wake");
        return;
    }
    let dir = std::env::temp_dir().join(format!("toffload-calib-peer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut target = Command::new("sleep").arg("60").spawn().expect("sleep");
    let mut cmd = watch_cmd();
    cmd.env("TOFFLOAD_WATCH_CACHE_DIR", &dir)
        .args(["--json", "--interval", "300ms", "--duration", "300ms"])
        .args(["--pid", &target.id().to_string()]);
    let (code, lines, err) = Watcher::start(cmd).finish();
    let _ = target.kill();
    let _ = target.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, 0, "{err:?}");
    let h = get(&lines, "header");
    assert_eq!(h["probe_cost_source"], "measured", "{h}");
    let ns = h["probe_cost"]["idle_wake_ns"]
        .as_f64()
        .expect("idle_wake_ns");
    println!("waking another CPU cost the calibration child {ns:.0} ns");
    assert!(ns > 0.0 && ns < 1e6, "{h}");
}

/// Ctrl-C (SIGINT) and SIGTERM end the watch with a final report and exit 0.
#[test]
fn signals_end_with_a_final_report() {
    let _s = serial();
    if !ready() {
        return;
    }
    for (sig, ended) in [(libc::SIGINT, "interrupted"), (libc::SIGTERM, "terminated")] {
        let mut target = Command::new("sleep").arg("30").spawn().expect("sleep");
        let w = watch_pid(target.id(), 60.0);
        // SAFETY: signalling our own child.
        unsafe { libc::kill(w.child.id() as i32, sig) };
        let (code, lines, err) = w.finish();
        let _ = target.kill();
        let _ = target.wait();
        assert_eq!(code, 0, "{err:?}");
        assert_eq!(get(&lines, "final")["ended"], ended);
    }
}

/// Pins the calling thread to `cpu`.
fn pin_to(cpu: usize) {
    // SAFETY: an all-zero cpu_set_t is valid; cpu is below CPU_SETSIZE; pins this
    // thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set);
    }
}

/// Between bursts the watch runs SCHED_IDLE, at its own priority while attached and
/// until the settling after a burst ends (watch_priority.rs, session.rs `phase`); and
/// pinned to a CPU that a busy loop of higher priority
/// holds, where an idle-policy thread waits seconds for each wake-up, it closes its
/// windows on time after the first (whose late wake-up ends the idle policy).
#[test]
fn the_watch_runs_idle_between_bursts_and_never_starves() {
    let _s = serial();
    if !ready() {
        return;
    }
    let server = blocking_conn_server(200);
    // 50 ms bursts a second: the watch's thread is seen at both policies.
    let mut c = watch_cmd();
    c.args([
        "--json",
        "--interval",
        "1s",
        "--duration",
        "4.5s",
        "--sample",
        "5",
    ])
    .arg("--pid")
    .arg(server.pid().to_string());
    let w = Watcher::start(c);
    let pid = w.child.id();
    let mut seen = std::collections::BTreeMap::new();
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_secs(3) {
        if let Some(p) = stat_field(&format!("/proc/{pid}/task/{pid}/stat"), STAT_POLICY) {
            *seen.entry(p).or_insert(0) += 1;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let (code, _, err) = w.finish();
    assert_eq!(code, 0, "{err:?}");
    println!("the watch's thread by policy (samples): {seen:?}");
    assert!(
        seen.contains_key(&i64::from(libc::SCHED_IDLE)),
        "never idle: {seen:?}"
    );
    assert!(
        seen.contains_key(&i64::from(libc::SCHED_OTHER)),
        "never its own: {seen:?}"
    );
    // Idle most of the time: the bursts are 5% of it, their settling (0.25 s, whose
    // end is read at its own priority, so that the untraced stretch starts on time
    // beside a full server and load tool) 25%.
    let (idle, own) = (
        seen[&i64::from(libc::SCHED_IDLE)],
        seen[&i64::from(libc::SCHED_OTHER)],
    );
    assert!(idle > own, "{seen:?}");
    assert!(own * 100 >= 15 * (idle + own), "settled idle: {seen:?}");

    // Pinned beside a busy loop at nice -15 on the same CPU (a weight of 29,154
    // against SCHED_IDLE's 3: at that, windows closed 3.5 s late).
    let cpu = harness::cpus().max(1) - 1;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let st = stop.clone();
    let busy = std::thread::spawn(move || {
        pin_to(cpu);
        // SAFETY: setpriority on this thread (0: the caller).
        unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -15) };
        while !st.load(std::sync::atomic::Ordering::Relaxed) {
            std::hint::spin_loop();
        }
    });
    let mut c = Command::new("taskset");
    c.args(["-c", &cpu.to_string()])
        .arg(harness::bin("toffload-watch").expect("built"))
        .args([
            "--json",
            "--interval",
            "1s",
            "--duration",
            "10.5s",
            "--sample",
            "5",
        ])
        .arg("--pid")
        .arg(server.pid().to_string());
    let w = Watcher::start(c);
    let (code, lines, err) = w.finish();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    busy.join().expect("busy loop");
    assert_eq!(code, 0, "{err:?}");
    let ts: Vec<f64> = lines
        .iter()
        .filter(|(k, _)| k == "window")
        .filter_map(|(_, w)| w["ts"].as_f64())
        .collect();
    let gaps: Vec<f64> = ts.windows(2).map(|p| p[1] - p[0]).collect();
    println!("window closes {gaps:.3?} s apart beside the busy loop");
    // The first windows may come late and then together: the wake-up that ends the
    // idle policy, and the windows it owed, closed quickly one after another until the
    // watch is back on its schedule. From then on none is late, and the last ones
    // close each on its second.
    let late = |g: &f64| *g >= 1.3;
    let from = gaps.iter().rposition(late).map_or(0, |i| i + 1);
    assert!(gaps.len() - from >= 4, "windows {gaps:?} s apart");
    assert!(
        gaps[gaps.len() - 3..]
            .iter()
            .all(|g| (0.7..1.3).contains(g)),
        "windows {gaps:?} s apart"
    );
}

/// tracefs not mounted (as at boot here): the watcher mounts it. Run in a private
/// mount namespace with tracefs unmounted there, so nothing else on the machine sees it.
#[test]
fn mounts_tracefs_when_missing() {
    let _s = serial();
    if !ready() {
        return;
    }
    let mut target = Command::new("sleep").arg("30").spawn().expect("sleep");
    let mut c = watch_cmd();
    c.args(["--json", "--duration", "1s", "--pid"])
        .arg(target.id().to_string());
    // SAFETY: unshare/mount/umount2 only (no allocation), between fork and exec.
    unsafe {
        c.pre_exec(|| {
            toffload_watch::btf_hidden::private_mount_namespace()?;
            // debugfs too where it is mounted: its tracing directory mounts
            // tracefs again when looked at.
            for p in [
                c"/sys/kernel/debug/tracing",
                c"/sys/kernel/debug",
                c"/sys/kernel/tracing",
            ] {
                libc::umount2(p.as_ptr(), libc::MNT_DETACH);
            }
            Ok(())
        });
    }
    let out = c.output().expect("run in a private mount namespace");
    let _ = target.kill();
    let _ = target.wait();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("mounted tracefs"), "{err}");
    let lines = json_lines(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(get(&lines, "final")["ended"], "duration");
}

/// The fiber runtime's counters, read from the target's memory: present under
/// libtoffload.so (with the conflict guard's conflicts), absent without it.
#[test]
fn runtime_and_guard_counters_are_reported() {
    let _s = serial();
    if !ready() {
        return;
    }
    let lib = harness::dist().join("lib/libtoffload.so");
    let stock = Server::start(&ServerSpec::new("hostile_server").env("TOFFLOAD_EMU_LAT_US", "200"))
        .expect("server");
    let w = watch_pid(stock.pid(), 2.0);
    drive(&stock, 8, 1.0);
    let (code, lines, _) = w.finish();
    assert_eq!(code, 0);
    assert!(
        get(&lines, "final")["total"]["runtime_counters"].is_null(),
        "counters reported for a process without the runtime"
    );
    drop(stock);

    let rt = Server::start(
        &ServerSpec::new("hostile_server")
            .env("TOFFLOAD_EMU_LAT_US", "200")
            .env("TOFFLOAD_GUARD", "detect")
            .env("LD_PRELOAD", lib.display().to_string()),
    )
    .expect("server");
    let w = watch_pid(rt.pid(), 2.5);
    drive(&rt, 16, 1.5);
    let (code, lines, _) = w.finish();
    assert_eq!(code, 0);
    let c = &get(&lines, "final")["total"]["runtime_counters"];
    println!("runtime counters: {c}");
    assert!(c["fibers_created"].as_u64().unwrap_or(0) >= 16, "{c}");
    assert!(c["offloads"].as_u64().unwrap_or(0) > 0, "{c}");
    assert_eq!(c["guard"], "detect", "{c}");
    assert!(c["guard_conflicts"].as_u64().unwrap_or(0) > 0, "{c}");
    // Sampled by default (TOFFLOAD_GUARD_SAMPLE): the block's version 3 words.
    assert_eq!(c["guard_sample"], 25, "{c}");
    assert!(c["guard_watched_ms"].as_u64().unwrap_or(0) > 0, "{c}");
}

/// The runtime's own request latency against an independent count, the load
/// generator's: conn_server on the emulated device (200 us), closed loop. None for a
/// stock server (its counters carry none: the dashboard's N/A). Under the runtime the
/// request latency runs from the carrier seeing the request to the response's
/// write, inside the client's round trip, and holds the offload's wait: so its p50
/// is at most the client's p50 and at least the offload wait's p50, which is at
/// least the configured latency.
#[test]
fn runtime_latency_tracks_the_load_generator() {
    let _s = serial();
    if !ready() {
        return;
    }
    let spec = || {
        ServerSpec::new("conn_server")
            .arg("--cpu-us")
            .arg("5")
            .env("TOFFLOAD_EMU_LAT_US", "200")
    };
    let stock = Server::start(&spec()).expect("server");
    let w = watch_pid(stock.pid(), 2.0);
    drive(&stock, 8, 1.0);
    let (code, lines, _) = w.finish();
    assert_eq!(code, 0);
    assert!(
        get(&lines, "final")["total"]["runtime_latency"].is_null(),
        "latency reported for a process without the runtime"
    );
    drop(stock);

    let lib = harness::dist().join("lib/libtoffload.so");
    let rt = Server::start(&spec().env("LD_PRELOAD", lib.display().to_string())).expect("server");
    // Connections opened before the watch: the requests, not the accepts, are timed.
    let w = watch_pid(rt.pid(), 3.0);
    let r = drive(&rt, 16, 2.0);
    let (code, lines, _) = w.finish();
    assert_eq!(code, 0);
    let l = &get(&lines, "final")["total"]["runtime_latency"];
    println!(
        "load generator: {:.0} req/s, p50 {:.0} us, p99 {:.0} us; runtime: {l}",
        r.requests_per_sec, r.p50_us, r.p99_us
    );
    let f = |h: &str, k: &str| l[h][k].as_f64().unwrap_or_else(|| panic!("{h}.{k}: {l}"));
    // Every request the generator completed was timed (and a few in its warm-up).
    assert!(f("request", "count") >= r.completed as f64 * 0.8, "{l}");
    let (req, wait) = (f("request", "p50_us"), f("offload_wait", "p50_us"));
    assert!(
        req <= r.p50_us,
        "runtime p50 {req} us > client p50 {} us",
        r.p50_us
    );
    assert!(
        req >= wait,
        "request p50 {req} us < offload wait p50 {wait} us"
    );
    assert!(
        wait >= 190.0,
        "offload wait p50 {wait} us below the configured 200 us"
    );
    assert!(f("request", "p99_us") >= req && f("request", "p999_us") >= f("request", "p99_us"));
}

/// An offload probe reaches only the process it watches. A return probe takes over the
/// return address of each call it sees, and fibers return out of order (one parks
/// inside the call, another enters it on the same thread), which the kernel answers
/// with SIGILL. A: hsm_server under the fiber runtime, its hsm_sign rerouted, so 64
/// fibers park inside its `offload` function. B: stock hsm_server, the same binary,
/// watched with `--offload offload`. The hazard first: with the probes on every
/// process that maps the file (a test switch, as they once were), watching B kills A.
/// Then, filtered on B, A serves on with every answer right while B's offloads are
/// measured; and watching A itself leaves it unprobed, saying why.
#[test]
fn offload_probes_never_reach_a_process_on_the_fiber_runtime() {
    let _s = serial();
    if !ready() {
        return;
    }
    let rt = harness::dist().join("lib/libtoffload.so");
    let (cpu_a, cpu_b) = if harness::cpus() >= 2 {
        (Some(0), Some(1))
    } else {
        (None, None)
    };
    let start_a = || {
        Server::start(
            &ServerSpec::new("hsm_server")
                .env("TOFFLOAD_EMU_LAT_US", "200")
                .env("LD_PRELOAD", rt.display().to_string())
                .env("TOFFLOAD_OFFLOAD", "hsm_sign:hsm_submit:hsm_poll:hsm_free")
                .cpu(cpu_a),
        )
        .expect("hsm_server under the runtime")
    };
    let start_b = || {
        Server::start(
            &ServerSpec::new("hsm_server")
                .env("TOFFLOAD_EMU_LAT_US", "200")
                .cpu(cpu_b),
        )
        .expect("stock hsm_server")
    };
    let watch_b = |b: &Server, unfiltered: bool| {
        let mut c = watch_cmd();
        c.args(["--json", "--interval", "1s", "--duration", "4s"])
            .args(["--offload", "offload@hsm_server", "--pid"])
            .arg(b.pid().to_string())
            .env(
                "TOFFLOAD_TEST_UPROBES_UNFILTERED",
                if unfiltered { "1" } else { "0" },
            );
        Watcher::start(c)
    };
    // Load on both while B is watched; A's report.
    let load_both = |a: &Server, b: &Server| {
        let bport = b.port;
        let bg = std::thread::spawn(move || {
            let mut c = Config::new(bport);
            c.conns = 4;
            c.duration = Duration::from_millis(2500);
            c.warmup = Duration::from_millis(100);
            load::run(&c)
        });
        let mut c = Config::new(a.port);
        c.conns = 64;
        c.duration = Duration::from_millis(2500);
        c.warmup = Duration::from_millis(100);
        let ra = load::run(&c);
        (ra, bg.join().expect("load thread"))
    };

    // 1. The hazard: unfiltered, A dies (up to three tries: it takes two fibers
    // interleaving inside the probed call at the wrong moment).
    let mut killed = None;
    for attempt in 1..=3 {
        let (mut a, b) = (start_a(), start_b());
        let w = watch_b(&b, true);
        std::thread::sleep(Duration::from_millis(500));
        let _ = load_both(&a, &b);
        let _ = w.finish();
        std::thread::sleep(Duration::from_millis(200));
        if !a.alive() {
            killed = Some(attempt);
            break;
        }
    }
    println!("unfiltered: A died in watch {killed:?} of at most 3");
    assert!(
        killed.is_some(),
        "the hazard did not show: A survived three unfiltered watches of B"
    );

    // 2. Filtered on B: A is never touched, B is measured.
    let (mut a, b) = (start_a(), start_b());
    let w = watch_b(&b, false);
    std::thread::sleep(Duration::from_millis(500));
    let (ra, rb) = load_both(&a, &b);
    let (code, lines, err) = w.finish();
    assert_eq!(code, 0, "{err:?}");
    let (ra, rb) = (ra.expect("load on A"), rb.expect("load on B"));
    println!(
        "filtered: A {:.0} req/s ({} wrong, {} errors), B {:.0} req/s",
        ra.requests_per_sec, ra.wrong, ra.errors, rb.requests_per_sec
    );
    assert!(a.alive(), "A died while B was watched");
    assert_eq!((ra.wrong, rb.wrong), (0, 0), "wrong answers");
    assert!(ra.completed > 0 && rb.completed > 0);
    let header = get(&lines, "header");
    assert!(
        header["probes"]["offload"]
            .to_string()
            .contains("offload in "),
        "B's offload not probed: {header}"
    );
    let calls = &get(&lines, "final")["total"]["offload"]["calls"];
    assert!(
        calls.as_f64().unwrap_or(0.0) > 0.0,
        "no offload of B's measured: {calls}"
    );
    drop(b);

    // 3. Watching A itself: unprobed, with the reason, and A lives.
    let mut c = watch_cmd();
    c.args(["--json", "--interval", "1s", "--duration", "3s"])
        .args(["--offload", "offload@hsm_server", "--pid"])
        .arg(a.pid().to_string());
    let w = Watcher::start(c);
    let mut cfg = Config::new(a.port);
    cfg.conns = 64;
    cfg.duration = Duration::from_secs(2);
    let r = load::run(&cfg).expect("load on A");
    let (code, lines, err) = w.finish();
    assert_eq!(code, 0, "{err:?}");
    let header = get(&lines, "header");
    assert_eq!(
        header["probes"]["offload"],
        serde_json::json!([]),
        "{header}"
    );
    assert!(
        header["probes"]["skipped"]
            .to_string()
            .contains(&format!("pid {}: runs toffload's fiber runtime", a.pid())),
        "{header}"
    );
    assert_eq!(
        header["probes"]["failed"],
        serde_json::json!([]),
        "not looked in, so not \"not found\": {header}"
    );
    assert!(a.alive(), "A died while watched");
    assert_eq!(r.wrong, 0);
}

/// The watcher's loaded programs by BPF program type (from its fds' fdinfo).
fn loaded_programs(watcher_pid: u32) -> std::collections::BTreeMap<u32, usize> {
    let mut by_type = std::collections::BTreeMap::new();
    for ty in common::fdinfo_values(watcher_pid, "prog_type") {
        *by_type.entry(ty).or_insert(0) += 1;
    }
    by_type
}

/// The offload probes (uprobes: BPF_PROG_TYPE_KPROBE) go through the verifier only
/// where one is attached: a target without an offload symbol (a plain `sleep`) is
/// watched with the tracepoint programs alone, conn_server (accel_run) with both
/// offload probes loaded, and its offloads counted.
#[test]
fn the_offload_probes_are_loaded_only_where_they_attach() {
    const UPROBE: u32 = 2;
    const RAW_TRACEPOINT: u32 = 17;
    let _s = serial();
    if !ready() {
        return;
    }
    let mut plain = Command::new("sleep").arg("30").spawn().expect("sleep");
    let w = watch_pid(plain.id(), 2.0);
    let progs = loaded_programs(w.child.id());
    let (code, lines, _) = w.finish();
    let _ = plain.kill();
    let _ = plain.wait();
    println!("watching sleep: programs by type {progs:?}");
    assert_eq!(code, 0);
    assert!(
        progs.get(&RAW_TRACEPOINT).is_some_and(|&n| n > 0),
        "no tracepoint program loaded: {progs:?}"
    );
    assert_eq!(
        progs.get(&UPROBE),
        None,
        "offload probes loaded for a target without one"
    );
    assert_eq!(
        get(&lines, "header")["probes"]["offload"]
            .as_array()
            .map(Vec::len),
        Some(0)
    );

    let server = blocking_conn_server(50);
    let w = watch_pid(server.pid(), 2.5);
    drive(&server, 4, 1.0);
    let progs = loaded_programs(w.child.id());
    let (code, lines, _) = w.finish();
    println!("watching conn_server: programs by type {progs:?}");
    assert_eq!(code, 0);
    assert_eq!(progs.get(&UPROBE), Some(&2), "{progs:?}");
    let calls = get(&lines, "final")["total"]["offload"]["calls"].as_u64();
    assert!(
        calls.is_some_and(|c| c > 0),
        "no offload counted: {calls:?}"
    );
}
