//! CUDA API remoting: an unmodified driver-API program (tests/c/cuda_app.c, and
//! abi_test through the cuda backend) run with backends/cuda-remote's libcuda.so.1
//! first on its library path, against a toffload-remoted whose GPU is the fake driver
//! of tests/c/fake_cuda.c. It must answer as the same program run directly on the
//! fake driver, with fewer frames and far fewer waits than calls, uploads sent once,
//! unsupported calls refused by name, and a lost daemon turned into a CUDA error.

mod common;
mod remote_util;

use remote_util::cuda::{client_counts, paused, text, wait_with_deadline};
use remote_util::*;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The shared fake driver, client folder and cuda_app (remote_util/cuda.rs), with
/// this suite's ways of running them.
struct Libs(cuda::Libs);

impl std::ops::Deref for Libs {
    type Target = cuda::Libs;
    fn deref(&self) -> &cuda::Libs {
        &self.0
    }
}

impl Libs {
    fn new(tag: &str) -> Libs {
        Libs(cuda::Libs::new(&format!("rc_{tag}")))
    }

    fn daemon(&self) -> Daemon {
        Daemon::start(
            &["--listen", "127.0.0.1:0"],
            &[
                ("LD_LIBRARY_PATH", self.fake.to_str().unwrap()),
                ("FAKE_CUDA_KERNEL_US", "50"),
            ],
        )
    }

    /// The app run directly on the fake driver.
    fn direct(&self, args: &[&str]) -> Output {
        Command::new(&self.app)
            .args(args)
            .env("LD_LIBRARY_PATH", &self.fake)
            .env("FAKE_CUDA_KERNEL_US", "50")
            .output()
            .unwrap()
    }

    /// `bin` with the client library as its driver, on the daemon at `addr`. Of
    /// several, the first listed: these tests kill daemons in list order (placement by
    /// prediction is remote_cuda_sched's).
    fn remote_cmd(&self, bin: &Path, addr: &str) -> Command {
        let mut c = Command::new(bin);
        c.env("LD_LIBRARY_PATH", &self.client)
            .env("TOFFLOAD_CUDA_REMOTE", addr)
            .env("TOFFLOAD_CUDA_REMOTE_PLACEMENT", "first");
        c
    }
}

/// The daemon's counters once every client connection has closed (a program that
/// exited may still have frames in the daemon's hands).
fn settled_stats(addr: &str) -> std::collections::HashMap<String, u64> {
    let t0 = Instant::now();
    loop {
        let s = stats(addr);
        // The stats query's own connection is one.
        if s["connections_open"] <= 1 || t0.elapsed() > Duration::from_secs(10) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_driver_api_program_answers_through_the_daemon_as_on_the_driver() {
    let libs = Libs::new("same");
    let (threads, reqs) = (4usize, 25usize);
    let args = ["run", &threads.to_string(), &reqs.to_string()];
    let direct = libs.direct(&args);
    assert!(direct.status.success(), "{}", text(&direct.stderr));
    let d = libs.daemon();
    let remote = libs
        .remote_cmd(&libs.app, &d.addr())
        .args(args)
        .output()
        .unwrap();
    assert!(
        remote.status.success(),
        "{}{}",
        text(&remote.stdout),
        text(&remote.stderr)
    );
    print!("{}", text(&remote.stdout));
    assert_eq!(text(&remote.stdout), text(&direct.stdout), "bit-identical");
    assert!(remote.stderr.is_empty(), "{}", text(&remote.stderr));

    // Waits and frames: per request the app makes 6 calls (copy in, launch, copy
    // out, event, host function, synchronize) plus a query on every other; only the
    // synchronize waits, and the calls before it share frames.
    let s = settled_stats(&d.addr());
    let requests = (threads * reqs) as u64;
    let (calls, frames, syncs) = (s["cuda_calls"], s["cuda_frames"], s["cuda_syncs"]);
    println!(
        "{requests} requests: {calls} calls in {frames} frames, {syncs} synchronizing round trips"
    );
    assert!(calls >= 6 * requests, "{calls}");
    assert_eq!(syncs, requests + 1, "one per request, one for the weights");
    assert!(
        frames * 2 < calls,
        "calls are batched: {calls} calls in {frames} frames"
    );
    assert!(
        syncs * 5 < calls,
        "round trips per request < calls per request"
    );
    assert_eq!(s["cuda_failed"], 0);
    // First run: the module image and the weights' 16 pieces sent and cached.
    assert_eq!(s["cuda_upload_hits"], 0);
    let first_misses = s["cuda_upload_misses"];
    assert_eq!(first_misses, 17);

    // The same program again: its uploads are cache hits, not resent.
    let again = libs
        .remote_cmd(&libs.app, &d.addr())
        .args(args)
        .output()
        .unwrap();
    assert_eq!(text(&again.stdout), text(&direct.stdout));
    let s2 = settled_stats(&d.addr());
    println!(
        "second run: {} upload hits, {} bytes not resent",
        s2["cuda_upload_hits"], s2["cuda_upload_bytes_saved"]
    );
    assert_eq!(s2["cuda_upload_hits"], 17);
    assert_eq!(s2["cuda_upload_misses"], first_misses, "nothing sent again");
    assert!(s2["cuda_upload_bytes_saved"] >= 1 << 20);
    // Bytes sent per run: the first carries the 1 MiB of weights and the module, the
    // second refers to them by hash (the requests' 4 KiB copies are sent both times).
    let (first_b, again_b) = (s["cuda_bytes"], s2["cuda_bytes"] - s["cuda_bytes"]);
    println!("bytes sent: first run {first_b}, second run {again_b}");
    assert!(first_b > (1 << 20) + requests * 4096, "{first_b}");
    assert!(
        again_b + (1 << 20) - (64 << 10) < first_b,
        "the weights were not resent: {again_b} against {first_b}"
    );
    // Every copy offered by content hash (the requests' 4 KiB inputs too, the same
    // on every run), against a fresh daemon: the second run sends a few percent of the
    // first's bytes (calls and hashes).
    // The client counts what it sent on its side (TOFFLOAD_CUDA_REMOTE_STATS): the
    // daemon's counts agree.
    let d2 = libs.daemon();
    let mut seen = (0u64, 0u64);
    let mut hashed = || {
        let o = libs
            .remote_cmd(&libs.app, &d2.addr())
            .args(args)
            .env("TOFFLOAD_CUDA_REMOTE_CACHE_MIN", "4096")
            .env("TOFFLOAD_CUDA_REMOTE_STATS", "1")
            .output()
            .unwrap();
        let err = text(&o.stderr);
        assert_eq!(text(&o.stdout), text(&direct.stdout), "{err}");
        let c = client_counts(&err).unwrap_or_else(|| panic!("no counts line: {err}"));
        let s = settled_stats(&d2.addr());
        let (frames, bytes) = (s["cuda_frames"] - seen.0, s["cuda_bytes"] - seen.1);
        seen = (s["cuda_frames"], s["cuda_bytes"]);
        println!("the client: {c:?}; the daemon: {frames} frames, {bytes} bytes");
        assert_eq!((c.frames, c.bytes), (frames, bytes), "{c:?}");
        assert!(
            c.round_trips >= requests && c.round_trips < c.calls / 2,
            "round trips: {c:?}"
        );
        bytes
    };
    let b1 = hashed();
    let b2 = hashed();
    println!(
        "every copy by hash: first run {b1} bytes, second {b2} ({:.1}%)",
        b2 as f64 * 100.0 / b1 as f64
    );
    assert!(b2 * 100 <= b1 * 5, "{b2} of {b1}");

    // The hazard batching removes: with no linger every call is a frame of its own.
    let unbatched = libs
        .remote_cmd(&libs.app, &d.addr())
        .args(args)
        .env("TOFFLOAD_CUDA_REMOTE_LINGER_US", "0")
        .output()
        .unwrap();
    assert_eq!(text(&unbatched.stdout), text(&direct.stdout));
    let s3 = settled_stats(&d.addr());
    let (c, f) = (
        s3["cuda_calls"] - s2["cuda_calls"],
        s3["cuda_frames"] - s2["cuda_frames"],
    );
    println!("without batching: {c} calls in {f} frames");
    assert_eq!(c, f, "one frame per call");

    // The naive forwarder (the benchmark's baseline): every call that returns
    // nothing waits for a probe's answer behind it, so the daemon sees about twice
    // the calls, each in its own frame, and the program is still bit-identical.
    let naive = libs
        .remote_cmd(&libs.app, &d.addr())
        .args(args)
        .env("TOFFLOAD_CUDA_REMOTE_NAIVE", "1")
        .output()
        .unwrap();
    assert_eq!(text(&naive.stdout), text(&direct.stdout));
    assert!(naive.stderr.is_empty(), "{}", text(&naive.stderr));
    let s4 = settled_stats(&d.addr());
    let (nc, nf) = (
        s4["cuda_calls"] - s3["cuda_calls"],
        s4["cuda_frames"] - s3["cuda_frames"],
    );
    println!("naive: {nc} calls (probes included) in {nf} frames");
    assert_eq!(nc, nf, "one frame per call");
    assert!(
        nc >= c + 4 * requests,
        "a probe behind each call: {nc} vs {c}"
    );
}

/// The cuda backend (cudarc, its own driver probing, pinned memory, host functions
/// writing its completion fd, blocking-sync events) is itself an unmodified driver
/// API program: the C ABI checks pass through the daemon as they do on the driver.
#[test]
fn the_cuda_backend_runs_remoted() {
    let libs = Libs::new("abi");
    let lib_dir = common::profile_dir();
    assert!(lib_dir.join("libtoffload_accel.so").exists());
    let bin = libs.fake.join("abi_test");
    common::build_c_test("abi_test.c", &bin);
    let d = libs.daemon();
    let out = libs
        .remote_cmd(&bin, &d.addr())
        .arg("normal")
        .env("TOFFLOAD_BACKEND", "cuda")
        .env("TOFFLOAD_CUDA_MAX_INFLIGHT", "4")
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    print!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("0 failures"),
        "{stdout}{}",
        text(&out.stderr)
    );
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok ")).count(), 17);
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
}

/// The client asks before it sends by reference: an upload it believes the daemon
/// holds, evicted from a 1 MiB cache meanwhile, is sent again, not lost.
#[test]
fn an_evicted_upload_is_sent_again() {
    let libs = Libs::new("evict");
    let direct = libs.direct(&["reupload"]);
    assert!(direct.status.success(), "{}", text(&direct.stderr));
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0", "--cache-mb", "1"],
        &[("LD_LIBRARY_PATH", libs.fake.to_str().unwrap())],
    );
    let out = libs
        .remote_cmd(&libs.app, &d.addr())
        .arg("reupload")
        .output()
        .unwrap();
    assert_eq!(
        text(&out.stdout),
        text(&direct.stdout),
        "{}",
        text(&out.stderr)
    );
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    let s = settled_stats(&d.addr());
    println!(
        "upload hits {}, sent {}, failed {}",
        s["cuda_upload_hits"], s["cuda_upload_misses"], s["cuda_failed"]
    );
    assert_eq!(s["cuda_failed"], 0);
    // Module, weights and the other data sent once (1 + 16 + 32); the second
    // upload of the weights: some pieces evicted and sent again, the rest by
    // reference, each of the 16 one way or the other.
    let resent = s["cuda_upload_misses"] - (1 + 16 + 32);
    assert!(resent > 0, "the cache evicted nothing: {s:?}");
    assert_eq!(resent + s["cuda_upload_hits"], 16, "{s:?}");
}

#[test]
fn an_unsupported_call_fails_by_name() {
    let libs = Libs::new("unsup");
    let d = libs.daemon();
    let out = libs
        .remote_cmd(&libs.app, &d.addr())
        .arg("unsupported")
        .output()
        .unwrap();
    assert!(out.status.success());
    // CUDA_ERROR_NOT_SUPPORTED, twice; one line on stderr naming it.
    assert_eq!(
        text(&out.stdout),
        "cuMemsetD8_v2 -> 801\ncuMemsetD8_v2 -> 801\n"
    );
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("cuMemsetD8_v2") && err.contains("CUDA_ERROR_NOT_SUPPORTED"),
        "{err}"
    );

    // No daemon named: cuInit fails (CUDA_ERROR_NO_DEVICE) and one line says why.
    let out = Command::new(&libs.app)
        .arg("run")
        .env("LD_LIBRARY_PATH", &libs.client)
        .env_remove("TOFFLOAD_CUDA_REMOTE")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stdout).contains("CUDA error 100"),
        "{}",
        text(&out.stdout)
    );
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("TOFFLOAD_CUDA_REMOTE is not set"), "{err}");
}

/// Starts the app's endless loop on the daemon and waits for it to be mid-run.
fn looping(libs: &Libs, d: &Daemon, env: &[(&str, &str)]) -> std::process::Child {
    let mut c = libs
        .remote_cmd(&libs.app, &d.addr())
        .arg("loop")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
    let mut n = 0;
    for l in lines.by_ref() {
        if l.unwrap().starts_with("progress") {
            n += 1;
            if n == 20 {
                break;
            }
        }
    }
    assert_eq!(n, 20, "the loop did not get going");
    // Keep draining stdout so the app never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    c
}

/// A daemon gone mid-run, guardian off: the program's next wait fails with a CUDA error at once
/// (the connection closed) instead of hanging; a daemon that stops answering fails
/// it by TOFFLOAD_CUDA_REMOTE_TIMEOUT_MS.
#[test]
fn a_lost_daemon_is_a_cuda_error_not_a_hang() {
    let libs = Libs::new("lost");
    let mut d = libs.daemon();
    // Without the guardian (with it, the client would try to reconnect first: see
    // what_cannot_be_replayed_is_a_clear_error for where that ends).
    let c = looping(&libs, &d, &[("TOFFLOAD_CUDA_REMOTE_REPLAY_MB", "0")]);
    d.kill();
    let out = wait_with_deadline(c, Duration::from_secs(10));
    let err = text(&out.stderr);
    println!("killed: {err}");
    assert_eq!(
        out.status.code(),
        Some(3),
        "the app reports the error and exits"
    );
    assert!(err.contains("lost the daemon"), "{err}");

    let d = libs.daemon();
    let c = looping(&libs, &d, &[("TOFFLOAD_CUDA_REMOTE_TIMEOUT_MS", "500")]);
    // SAFETY: signalling our own child by its pid.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGSTOP) };
    let t0 = Instant::now();
    let out = wait_with_deadline(c, Duration::from_secs(10));
    // SAFETY: as above.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGCONT) };
    println!("stopped: failed after {:?}", t0.elapsed());
    assert_eq!(out.status.code(), Some(3));
}

/// The app in a `replay`/`unreplayable` mode: runs to its pause between two
/// synchronizations, `at_pause` runs (kills a daemon), then it continues.
fn paused_run(
    libs: &Libs,
    addrs: &str,
    mode: &str,
    env: &[(&str, &str)],
    at_pause: impl FnOnce(),
) -> Output {
    let c = libs
        .remote_cmd(&libs.app, addrs)
        .arg(mode)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    paused(c, at_pause)
}

/// The guardian. The app uploads, launches, reads back, then uploads and launches
/// again (buffers a kernel wrote since the last synchronize, never read back) and
/// pauses; the daemon is killed there. Without the guardian
/// (TOFFLOAD_CUDA_REMOTE_REPLAY_MB=0) its next wait fails; with it the client
/// reconnects to the next daemon listed, or to the same one restarted, replays the
/// session (the launches since the last synchronize recompute the buffers), and the
/// app prints what it prints on the driver, byte for byte.
#[test]
fn a_daemon_lost_between_synchronizations_is_replayed() {
    let libs = Libs::new("replay");
    let direct = libs.direct(&["replay"]);
    assert!(direct.status.success(), "{}", text(&direct.stderr));
    let mut d1 = libs.daemon();
    let d2 = libs.daemon();
    let both = format!("{},{}", d1.addr(), d2.addr());

    // The hazard: no guardian, the lost daemon is the program's error.
    let off = paused_run(
        &libs,
        &both,
        "replay",
        &[("TOFFLOAD_CUDA_REMOTE_REPLAY_MB", "0")],
        || d1.kill(),
    );
    println!("guardian off: {}{}", text(&off.stdout), text(&off.stderr));
    assert_eq!(off.status.code(), Some(3), "the app fails");
    assert!(text(&off.stdout).contains("CUDA error 46"));
    assert_ne!(text(&off.stdout), text(&direct.stdout));

    // The guardian: the second daemon listed takes over.
    d1.restart();
    let on = paused_run(&libs, &both, "replay", &[], || d1.kill());
    let err = text(&on.stderr);
    println!("guardian on: {}{err}", text(&on.stdout));
    assert!(on.status.success(), "{}{err}", text(&on.stdout));
    assert_eq!(text(&on.stdout), text(&direct.stdout), "byte-identical");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("reconnected to {}", d2.addr())) && err.contains("replayed"),
        "{err}"
    );

    // The same daemon, restarted on its port while the client retries.
    d1.restart();
    let again = paused_run(&libs, &d1.addr(), "replay", &[], || {
        d1.kill();
        std::thread::sleep(Duration::from_millis(300));
        d1.restart();
    });
    println!("restarted: {}", text(&again.stderr));
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert_eq!(text(&again.stdout), text(&direct.stdout));
}

/// A multi-threaded server (4 threads x 400 requests, each thread its own stream or
/// all on one, host functions, events) whose daemon is killed mid-run at no chosen point, then the daemon it moved to:
/// with the guardian it completes with the driver's results and every host function
/// run exactly once.
#[test]
fn a_busy_program_completes_through_replay() {
    let libs = Libs::new("busy");
    busy(&libs, &[]);
    // Tasks multiplexed on one stream: its queued work, everyone's, replays in order.
    busy(&libs, &[("CUDA_APP_SHARED_STREAM", "1")]);
}

fn busy(libs: &Libs, env: &[(&str, &str)]) {
    let args = ["run", "4", "400"];
    let direct = Command::new(&libs.app)
        .args(args)
        .env("LD_LIBRARY_PATH", &libs.fake)
        .env("FAKE_CUDA_KERNEL_US", "50")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(direct.status.success(), "{}", text(&direct.stderr));
    let last = |o: &[u8]| {
        text(o)
            .lines()
            .filter(|l| l.starts_with("requests "))
            .map(String::from)
            .next_back()
    };
    let expected = last(&direct.stdout).expect("result line");
    for guard in ["0", "256"] {
        let mut d1 = libs.daemon();
        let mut d2 = libs.daemon();
        let mut c = libs
            .remote_cmd(&libs.app, &format!("{},{}", d1.addr(), d2.addr()))
            .args(args)
            .env("CUDA_APP_PROGRESS", "1")
            .env("TOFFLOAD_CUDA_REMOTE_REPLAY_MB", guard)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(c.stdout.take().unwrap());
        let mut n = 0;
        let mut all = String::new();
        while n < 40 {
            let mut l = String::new();
            assert!(out.read_line(&mut l).unwrap() > 0, "{all}");
            n += l.starts_with("progress") as usize;
            all += &l;
        }
        d1.kill();
        // The client's stderr, line by line as it comes.
        let (tx, lines) = std::sync::mpsc::channel::<String>();
        let mut err_pipe = BufReader::new(c.stderr.take().unwrap());
        let errs = std::thread::spawn(move || {
            let mut all = String::new();
            let mut l = String::new();
            while err_pipe.read_line(&mut l).unwrap_or(0) > 0 {
                let _ = tx.send(l.clone());
                all += &l;
                l.clear();
            }
            all
        });
        if guard != "0" {
            // Once the client says it moved to the second daemon: the second
            // killed, the first back on its port while the client retries; it
            // replays onto the first.
            let moved = lines
                .recv_timeout(Duration::from_secs(20))
                .expect("a replay");
            assert!(moved.contains(&d2.addr()), "{moved}");
            d2.kill();
            d1.restart();
        }
        let rest = std::thread::spawn(move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut out, &mut s).unwrap();
            s
        });
        let o = wait_with_deadline(c, Duration::from_secs(30));
        all += &rest.join().unwrap();
        let err = errs.join().unwrap();
        println!(
            "{env:?} guardian {guard} MiB: {:?} {err}",
            last(all.as_bytes())
        );
        if guard == "0" {
            assert_eq!(o.status.code(), Some(3), "{all}");
        } else {
            assert!(o.status.success(), "{all}{err}");
            assert_eq!(last(all.as_bytes()).as_deref(), Some(expected.as_str()));
            assert_eq!(err.matches("replayed the session").count(), 2, "{err}");
        }
    }
}

/// What a replay cannot rebuild is a clear error (one line, CUDA_ERROR_DEVICE_
/// UNAVAILABLE), never a wrong answer or a hang: a buffer a kernel wrote before the
/// last synchronize and nothing read back; a log past its bound; no daemon left.
#[test]
fn what_cannot_be_replayed_is_a_clear_error() {
    let libs = Libs::new("noreplay");
    let mut d1 = libs.daemon();
    let d2 = libs.daemon();
    let both = format!("{},{}", d1.addr(), d2.addr());
    let o = paused_run(&libs, &both, "unreplayable", &[], || d1.kill());
    let err = text(&o.stderr);
    println!("lost contents: {}{err}", text(&o.stdout));
    assert_eq!(o.status.code(), Some(3));
    assert!(
        text(&o.stdout).contains("CUDA error 46"),
        "{}",
        text(&o.stdout)
    );
    assert!(err.contains("written by a kernel before"), "{err}");
    // Either the replay went through and the read failed (two lines), or the read
    // was in the log already and the replay could not be (one line).
    assert!(
        err.contains("replayed the session") || err.contains("cannot replay"),
        "{err}"
    );
    assert_eq!(
        err.lines()
            .filter(|l| l.contains("written by a kernel"))
            .count(),
        1,
        "{err}"
    );

    d1.restart();
    let o = paused_run(
        &libs,
        &both,
        "replay",
        &[("TOFFLOAD_CUDA_REMOTE_REPLAY_MB", "1")],
        || d1.kill(),
    );
    let err = text(&o.stderr);
    println!("log overflow: {err}");
    assert_eq!(o.status.code(), Some(3));
    assert!(err.contains("did not fit the replay log"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");

    // Every daemon gone: the bounded reconnect ends in the error.
    d1.restart();
    let mut d2 = d2;
    let t0 = Instant::now();
    let o = paused_run(
        &libs,
        &both,
        "replay",
        &[("TOFFLOAD_CUDA_REMOTE_RECONNECT_MS", "500")],
        || {
            d1.kill();
            d2.kill();
        },
    );
    let err = text(&o.stderr);
    println!("no daemon: after {:?}: {err}", t0.elapsed());
    assert_eq!(o.status.code(), Some(3));
    assert!(err.contains("answered within"), "{err}");
}

/// cuStreamWaitEvent and cuEventElapsedTime run on the daemon's driver: a copy on
/// stream B that waits for an event recorded after a 200 ms kernel on stream A reads the
/// kernel's output (without the wait it reads the buffer before the kernel is
/// done); the kernel's time is measured between two events; an event created with
/// CU_EVENT_DISABLE_TIMING has none (CUDA_ERROR_INVALID_HANDLE).
#[test]
fn stream_waits_and_event_times_are_the_drivers() {
    let libs = Libs::new("events");
    // A kernel long enough that the copy on B, not waiting, runs while it does on a
    // loaded host.
    let slow = [("FAKE_CUDA_KERNEL_US", "200000")];
    let direct = Command::new(&libs.app)
        .arg("events")
        .env("LD_LIBRARY_PATH", &libs.fake)
        .envs(slow)
        .output()
        .unwrap();
    assert!(direct.status.success(), "{}", text(&direct.stdout));
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0"],
        &[("LD_LIBRARY_PATH", libs.fake.to_str().unwrap()), slow[0]],
    );
    let run = |extra: &[&str]| {
        let o = libs
            .remote_cmd(&libs.app, &d.addr())
            .arg("events")
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}{}", text(&o.stdout), text(&o.stderr));
        assert!(o.stderr.is_empty(), "{}", text(&o.stderr));
        text(&o.stdout)
    };
    let read_line = |s: &str| {
        s.lines()
            .find(|l| l.starts_with("read on B"))
            .map(String::from)
            .unwrap()
    };
    let nowait = run(&["nowait"]);
    let waited = run(&[]);
    print!("{waited}");
    assert_ne!(
        read_line(&nowait),
        read_line(&waited),
        "without the wait, B reads before the kernel is done"
    );
    assert_eq!(waited, text(&direct.stdout), "as on the driver");
    assert!(waited.contains("elapsed at least 150 ms: 1"), "{waited}");
    assert!(waited.contains("untimed event: 400"), "{waited}");
}

/// Two client identities (plaintext: the peer's address; the second client leaves
/// from 127.0.0.2 through an LD_PRELOAD shim) in one daemon, whose fake driver fails
/// a copy or launch on memory of another context, as a GPU faults. The second
/// client launches a kernel on the raw device address of the first's buffer (read
/// from the fake driver's allocation log). With all sessions in the primary context
/// (TOFFLOAD_REMOTED_CUDA_CONTEXT=primary) it overwrites the first's data; with a
/// context per identity (the default) the launch fails and the data is intact.
#[test]
fn two_identities_do_not_see_each_others_memory() {
    let libs = Libs::new("ident");
    let direct = libs.direct(&["victim"]);
    assert!(direct.status.success(), "{}", text(&direct.stderr));
    let shim = libs.fake.join("bind_src.so");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    assert!(Command::new("cc")
        .args(["-shared", "-fPIC", "-Wall", "-Werror", "-o"])
        .arg(&shim)
        .arg(manifest.join("tests/c/bind_src.c"))
        .arg("-ldl")
        .status()
        .unwrap()
        .success());
    let allocs = libs.fake.join("allocs.log");
    for mode in ["primary", "identity"] {
        let _ = std::fs::remove_file(&allocs);
        let d = Daemon::start(
            &["--listen", "127.0.0.1:0"],
            &[
                ("LD_LIBRARY_PATH", libs.fake.to_str().unwrap()),
                ("FAKE_CUDA_STRICT_CTX", "1"),
                ("FAKE_CUDA_ALLOC_LOG", allocs.to_str().unwrap()),
                ("TOFFLOAD_REMOTED_CUDA_CONTEXT", mode),
            ],
        );
        let mut poked = String::new();
        let victim = paused_run(&libs, &d.addr(), "victim", &[], || {
            let log = std::fs::read_to_string(&allocs).unwrap();
            let addr = log
                .lines()
                .find_map(|l| l.strip_suffix(" 12288"))
                .expect("the victim's buffer in the allocation log")
                .to_string();
            let o = libs
                .remote_cmd(&libs.app, &d.addr())
                .args(["poke", &addr])
                .env("LD_PRELOAD", &shim)
                .env("BIND_SRC", "127.0.0.2")
                .output()
                .unwrap();
            assert!(o.status.success(), "{}{}", text(&o.stdout), text(&o.stderr));
            poked = text(&o.stdout);
        });
        assert!(victim.status.success(), "{}", text(&victim.stderr));
        let seen = text(&victim.stdout);
        println!("{mode}: {}{}", poked.lines().last().unwrap_or(""), seen);
        if mode == "primary" {
            assert!(poked.contains("poke -> 0"), "{poked}");
            assert_ne!(seen, text(&direct.stdout), "the other identity wrote it");
        } else {
            assert!(!poked.contains("poke -> 0"), "{poked}");
            assert_eq!(seen, text(&direct.stdout), "untouched");
        }
    }
}

/// TLS from the client library, with the remote backend's knobs: a daemon in PSK mode
/// and one with certificates both run the app, byte-identical to the driver. The
/// hazard first: a client without the key gets a CUDA error within its timeout, no
/// hang, no answer; so does one whose key is wrong.
#[test]
fn the_client_speaks_tls_with_a_key_or_a_certificate() {
    const KEY: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const OTHER: &str = "8f3c0a1e5b7d92c46e10f2a3b4c5d6e7";
    let libs = Libs::new("tls");
    let direct = libs.direct(&[]);
    assert!(direct.status.success(), "{}", text(&direct.stderr));
    let dir = TempDir::new("cudatls");
    let secret = |name: &str, body: String| {
        let p = dir.path().join(name);
        write_secret(&p, body);
        p
    };
    let keys = secret("daemon.psk", format!("gpu-1 {KEY}\n"));
    let good = secret("good.psk", format!("gpu-1 {KEY}\n"));
    let wrong = secret("wrong.psk", format!("gpu-1 {OTHER}\n"));
    let fake = [("LD_LIBRARY_PATH", libs.fake.to_str().unwrap())];
    let d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-psk",
            keys.to_str().unwrap(),
        ],
        &fake,
    );
    let run = |env: &[(&str, &str)]| {
        let t0 = Instant::now();
        let o = libs
            .remote_cmd(&libs.app, &d.addr())
            .env("TOFFLOAD_CUDA_REMOTE_TIMEOUT_MS", "3000")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (o, t0.elapsed())
    };
    for (what, env) in [
        ("no key", vec![]),
        (
            "the wrong key",
            vec![("TOFFLOAD_REMOTE_PSK", wrong.to_str().unwrap())],
        ),
    ] {
        let (o, took) = run(&env);
        println!("{what}: {:?} in {took:?}: {}", o.status, text(&o.stderr));
        assert!(!o.status.success(), "{what}: served");
        assert_ne!(text(&o.stdout), text(&direct.stdout), "{what}");
        assert!(took < Duration::from_secs(15), "{what}: {took:?}");
    }
    let (o, _) = run(&[("TOFFLOAD_REMOTE_PSK", good.to_str().unwrap())]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), text(&direct.stdout), "over TLS with a key");

    let mut pki = pki::Pki::new(dir.path(), "cuda-test");
    let server = pki.issue("daemon", &["127.0.0.1"]);
    let client = pki.issue("client", &[]);
    let d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            server.cert.to_str().unwrap(),
            "--tls-key",
            server.key.to_str().unwrap(),
            "--tls-ca",
            pki.ca.to_str().unwrap(),
        ],
        &fake,
    );
    let o = libs
        .remote_cmd(&libs.app, &d.addr())
        .env("TOFFLOAD_REMOTE_TLS_CA", &pki.ca)
        .env("TOFFLOAD_REMOTE_TLS_CERT", &client.cert)
        .env("TOFFLOAD_REMOTE_TLS_KEY", &client.key)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stdout),
        text(&direct.stdout),
        "over TLS with a certificate"
    );
    // Half the certificate knobs: a clear error, not plaintext.
    let o = libs
        .remote_cmd(&libs.app, &d.addr())
        .env("TOFFLOAD_REMOTE_TLS_CA", &pki.ca)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("all three or none")
            || text(&o.stdout).contains("all three or none"),
        "{}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
}
