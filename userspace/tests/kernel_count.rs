//! The watch's own cost against the kernel's count of it. The budget rests on what the
//! calibration says one traced syscall and one traced switch cost the target
//! (`header.probe_cost`); the kernel can count the programs' part of that itself
//! (BPF_ENABLE_STATS: each program's run time and runs). A calibration that read less
//! than the programs' own run time would let the watch spend more than its budget.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use toffload_tests::harness;

mod common;
use common::{get, ready, serial, watch_cmd, Watcher};

/// Run time (ns) and runs of the watcher's programs by name, read by the kernel.
fn program_counts(watcher_pid: u32) -> Counts {
    let mine = common::fdinfo_values(watcher_pid, "prog_id");
    let mut by_name = std::collections::BTreeMap::new();
    for info in aya::programs::loaded_programs().flatten() {
        if !mine.contains(&info.id()) {
            continue;
        }
        let name = info.name_as_str().unwrap_or("?").to_string();
        let e = by_name.entry(name).or_insert((0, 0));
        e.0 += info.run_time().as_nanos() as u64;
        e.1 += info.run_count();
    }
    by_name
}

/// Two threads of this process pinned to CPU 0 passing a byte over two pipes until
/// `stop`: each hand-off a write, a read that slept, a wake-up and a switch.
fn ping_pong(stop: Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    let pipe = || {
        let mut fds = [0; 2];
        // SAFETY: fds has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        fds
    };
    let (ab, ba) = (pipe(), pipe());
    let player = move |rx: i32, tx: i32, first: bool, stop: Arc<AtomicBool>| {
        std::thread::spawn(move || {
            harness::pin_current_thread(0).expect("pin");
            let mut b = [0u8; 1];
            if first {
                // SAFETY: writing one byte from a live buffer to our own pipe.
                unsafe { libc::write(tx, b.as_ptr().cast(), 1) };
            }
            while !stop.load(Ordering::Relaxed) {
                // SAFETY: one byte into / out of a live buffer, our own pipes.
                if unsafe { libc::read(rx, b.as_mut_ptr().cast(), 1) } != 1 {
                    break;
                }
                // SAFETY: as above.
                unsafe { libc::write(tx, b.as_ptr().cast(), 1) };
            }
            // The other player may be waiting for this byte: one more ends its read.
            // SAFETY: as above; then each player closes the two ends only it used (a
            // write to a closed pipe returns EPIPE: Rust ignores SIGPIPE).
            unsafe {
                libc::write(tx, b.as_ptr().cast(), 1);
                libc::close(rx);
                libc::close(tx);
            }
        })
    };
    vec![
        player(ba[0], ab[1], true, stop.clone()),
        player(ab[0], ba[1], false, stop),
    ]
}

type Counts = std::collections::BTreeMap<String, (u64, u64)>;

/// The programs' counts over 1 s of `work`, run on threads of this process (the
/// watched target) until told to stop.
fn over_a_second(
    watcher: u32,
    work: impl FnOnce(Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>>,
) -> (Counts, Counts) {
    let stop = Arc::new(AtomicBool::new(false));
    let threads = work(stop.clone());
    std::thread::sleep(Duration::from_millis(100));
    let a = program_counts(watcher);
    std::thread::sleep(Duration::from_secs(1));
    let b = program_counts(watcher);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("a loop of the target's");
    }
    (a, b)
}

/// A thread of this process on CPU 0 calling getppid until `stop`: the calibration's
/// syscall.
fn syscalls(stop: Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    vec![std::thread::spawn(move || {
        harness::pin_current_thread(0).expect("pin");
        while !stop.load(Ordering::Relaxed) {
            // SAFETY: getppid has no arguments and cannot fail.
            unsafe { libc::syscall(libc::SYS_getppid) };
        }
    })]
}

/// The programs' run time per event by the kernel's count between two readings: the
/// sum of each program's mean run.
fn per_event(a: &Counts, b: &Counts, names: &[&str]) -> f64 {
    names
        .iter()
        .map(|n| {
            let (x, y) = (a.get(*n).copied().unwrap_or((0, 0)), b[*n]);
            assert!(y.1 > x.1, "{n} did not run: {a:?} {b:?}");
            (y.0 - x.0) as f64 / (y.1 - x.1) as f64
        })
        .sum()
}

/// Before the floor under it, the calibration's switch cost (the difference of two
/// timed ping-pongs) read 0 in some starts on this VM, where the kernel counted a few
/// hundred ns of the programs' own run time per switch: a budget that costs switches
/// at nothing. Here a watch of this process, calibrated afresh with the kernel counting,
/// against the kernel's count of the same programs on this process's own loops: the
/// calibration's syscall (getppid) and switch (a pipe ping-pong on one CPU). The two
/// are read at different moments of a noisy host, so a fifth below is allowed.
#[test]
fn the_calibrated_costs_cover_the_kernels_count_of_the_programs() {
    let _s = serial();
    if !ready() {
        return;
    }
    // Held for the test: the kernel counts while any such descriptor is open.
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("BPF_ENABLE_STATS");
    let mut c = watch_cmd();
    c.args(["--json", "--recalibrate", "--sample", "100"])
        .args(["--interval", "10s", "--duration", "4s", "--pid"])
        .arg(std::process::id().to_string());
    let w = Watcher::start(c);
    let watcher = w.child.id();
    let (a, b) = over_a_second(watcher, syscalls);
    let (c2, d) = over_a_second(watcher, ping_pong);
    let (code, lines, err) = w.finish();
    assert_eq!(code, 0, "{err:?}");
    let cost = &get(&lines, "header")["probe_cost"];
    let f = |k: &str| cost[k].as_f64().unwrap_or_else(|| panic!("{k}: {cost}"));
    let raw = d.contains_key("raw_sched_switc");
    let (sw, wk) = if raw {
        ("raw_sched_switc", "raw_sched_wakin")
    } else {
        ("sched_switch", "sched_waking")
    };
    let syscall = per_event(&a, &b, &["sys_enter", "sys_exit"]);
    let switch = per_event(&c2, &d, &[sw, wk]);
    println!(
        "the kernel's count: {syscall:.0} ns a syscall, {switch:.0} ns a switch with its \
         wake-up; calibrated: {cost}"
    );
    assert!(
        f("syscall_ns") >= 0.8 * syscall,
        "{cost} against {syscall:.0} ns"
    );
    assert!(
        f("switch_ns") >= 0.8 * switch,
        "{cost} against {switch:.0} ns"
    );
}
