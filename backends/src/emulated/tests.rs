use super::aes::aes_ctr_in_place;
use super::*;
use crate::WaitStyle;
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn dev(lat_us: f64, lanes: usize, max_inflight: usize) -> Emulated {
    Emulated::new(EmuConfig {
        lat_us,
        lanes,
        max_inflight,
        ..EmuConfig::default()
    })
    .unwrap()
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + 3) as u8).collect()
}

#[test]
fn run_transforms_in_place_both_wait_styles() {
    let d = dev(50.0, 4, 64);
    for style in [WaitStyle::Spin, WaitStyle::Block] {
        for n in [1usize, 1024, 1 << 20] {
            let mut buf = pattern(n);
            let mut want = buf.clone();
            aes_ctr_in_place(&mut want);
            d.run(&mut buf, style).unwrap();
            assert_eq!(buf, want, "{style:?} {n}");
        }
    }
    assert_eq!(d.stats().completed, 6);
}

#[test]
fn never_completes_before_its_latency() {
    let d = dev(20_000.0, 4, 64);
    let mut buf = pattern(64);
    let t = Instant::now();
    // SAFETY: buf outlives the op, which is waited for and released below.
    let id = unsafe { d.submit(buf.as_mut_ptr(), buf.len()) }.unwrap();
    assert_eq!(d.done(id).unwrap(), OpState::Pending);
    d.wait(id).unwrap();
    // The device may deliver up to its learnt timer lateness (<= 30 us) plus its
    // coalescing window (<= 10 us) early.
    assert!(t.elapsed() >= Duration::from_micros(20_000 - 40));
    assert_eq!(d.done(id).unwrap(), OpState::Done);
    d.release(id).unwrap();
}

#[test]
fn ops_beyond_lanes_queue_in_order() {
    let d = dev(10_000.0, 1, 64);
    let mut bufs: Vec<Vec<u8>> = (0..3).map(|_| pattern(16)).collect();
    let t = Instant::now();
    let ids: Vec<OpId> = bufs
        .iter_mut()
        // SAFETY: each b outlives its op (released below) and is not touched meanwhile.
        .map(|b| unsafe { d.submit(b.as_mut_ptr(), b.len()) }.unwrap())
        .collect();
    d.wait(ids[0]).unwrap();
    // One lane: the third op has two service times still ahead of it.
    assert_eq!(d.done(ids[2]).unwrap(), OpState::Pending);
    d.wait(ids[2]).unwrap();
    assert_eq!(d.done(ids[1]).unwrap(), OpState::Done);
    assert!(t.elapsed() >= Duration::from_micros(30_000 - 40));
    for id in ids {
        d.release(id).unwrap();
    }
}

#[test]
fn bad_inputs_are_errors_not_crashes() {
    let d = dev(100.0, 4, 2);
    assert_eq!(
        // SAFETY: a null buffer is rejected before use.
        unsafe { d.submit(std::ptr::null_mut(), 16) },
        Err(AccelError::NullBuffer)
    );
    let mut big = vec![0u8; 1];
    assert!(matches!(
        // SAFETY: rejected on its length before the buffer is used.
        unsafe { d.submit(big.as_mut_ptr(), MAX_BYTES + 1) },
        Err(AccelError::TooLarge { .. })
    ));
    assert_eq!(d.done(OpId(12345)), Err(AccelError::BadHandle));
    assert_eq!(d.done(OpId(-1)), Err(AccelError::BadHandle));
    assert_eq!(d.release(OpId(1 << 40)), Err(AccelError::BadHandle));

    let mut a = pattern(8);
    let mut b = pattern(8);
    let mut c = pattern(8);
    // SAFETY: a outlives its op, released below.
    let ia = unsafe { d.submit(a.as_mut_ptr(), 8) }.unwrap();
    // SAFETY: b outlives its op, released below.
    let ib = unsafe { d.submit(b.as_mut_ptr(), 8) }.unwrap();
    assert_eq!(
        // SAFETY: refused (table full): c is not used.
        unsafe { d.submit(c.as_mut_ptr(), 8) },
        Err(AccelError::TooManyInFlight { max: 2 })
    );
    d.wait(ia).unwrap();
    d.release(ia).unwrap();
    assert_eq!(d.release(ia), Err(AccelError::BadHandle), "double release");
    assert_eq!(d.done(ia), Err(AccelError::BadHandle), "stale handle");
    // The freed slot is reused under a new generation; the old handle stays dead.
    // SAFETY: c outlives its op, released below.
    let ic = unsafe { d.submit(c.as_mut_ptr(), 8) }.unwrap();
    assert_ne!(ic, ia);
    assert_eq!(d.done(ia), Err(AccelError::BadHandle));
    d.wait(ib).unwrap();
    d.wait(ic).unwrap();
    d.release(ib).unwrap();
    d.release(ic).unwrap();
    // Zero-length ops with a null buffer are legal no-ops.
    // SAFETY: a null buffer with length 0 is never touched.
    let iz = unsafe { d.submit(std::ptr::null_mut(), 0) }.unwrap();
    d.wait(iz).unwrap();
    d.release(iz).unwrap();
}

#[test]
fn release_of_pending_op_cancels_it() {
    let d = dev(5_000.0, 4, 8);
    let mut buf = pattern(256);
    let orig = buf.clone();
    // SAFETY: buf outlives the op: released (cancelled) next, then only read.
    let id = unsafe { d.submit(buf.as_mut_ptr(), buf.len()) }.unwrap();
    d.release(id).unwrap();
    // Let its completion time pass: the device must leave the buffer alone and
    // recycle the slot.
    std::thread::sleep(Duration::from_millis(15));
    assert_eq!(buf, orig);
    assert_eq!(d.stats().completed, 0);
    // All 8 slots come back. The device's thread recycles the cancelled one when it
    // next runs, which on a crowded machine (CI runs the suites side by side) can be
    // later than the 15 ms above: a full table is retried for up to 2 s, never taken
    // as success.
    let mut others: Vec<Vec<u8>> = (0..8).map(|_| pattern(4)).collect();
    let deadline = Instant::now() + Duration::from_secs(2);
    let ids: Vec<OpId> = others
        .iter_mut()
        .map(|b| loop {
            // SAFETY: each b outlives its op, released below.
            match unsafe { d.submit(b.as_mut_ptr(), 4) } {
                Err(crate::AccelError::TooManyInFlight { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                r => break r.unwrap(),
            }
        })
        .collect();
    for id in ids {
        d.wait(id).unwrap();
        d.release(id).unwrap();
    }
}

#[test]
fn completion_fd_becomes_readable() {
    let d = dev(1_000.0, 4, 8);
    let fd = d.completion_fd();
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    assert_eq!(
        // SAFETY: a local pollfd.
        unsafe { libc::poll(&mut pfd, 1, 0) },
        0,
        "nothing completed yet"
    );
    let mut buf = pattern(32);
    // SAFETY: buf outlives the op, released below.
    let id = unsafe { d.submit(buf.as_mut_ptr(), 32) }.unwrap();
    // SAFETY: a local pollfd.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 5_000) }, 1);
    assert_eq!(d.done(id).unwrap(), OpState::Done);
    let mut v = 0u64;
    assert_eq!(
        // SAFETY: 8 bytes into a local u64.
        unsafe { libc::read(fd, &mut v as *mut u64 as *mut _, 8) },
        8
    );
    assert!(v >= 1);
    d.release(id).unwrap();
}

/// 8 threads x 300 ops of assorted sizes, each op run by `op(device, buf, i)`; every
/// result checked against AES-CTR, and every op counted by the device.
fn many_threads(op: fn(&Emulated, &mut [u8], usize)) {
    let d = std::sync::Arc::new(dev(30.0, 16, 256));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || {
                for i in 0..300 {
                    let mut buf = pattern(100 + t * 10 + i % 7);
                    let mut want = buf.clone();
                    aes_ctr_in_place(&mut want);
                    op(&d, &mut buf, i);
                    assert_eq!(buf, want);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(d.stats().completed, 2400);
}

#[test]
fn many_threads_many_ops_all_correct() {
    many_threads(|d, buf, i| {
        let style = if i % 2 == 0 {
            WaitStyle::Spin
        } else {
            WaitStyle::Block
        };
        d.run(buf, style).unwrap();
    });
}

#[test]
fn knobs_parse_and_name_the_variable() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        let m: HashMap<&str, &str> = pairs.iter().copied().collect();
        move |k: &str| m.get(k).map(|v| v.to_string())
    };
    let c = EmuConfig::from_lookup(&env(&[
        ("TOFFLOAD_EMU_LAT_US", "250"),
        ("TOFFLOAD_EMU_LANES", "4"),
        ("TOFFLOAD_EMU_MBPS", "1000"),
    ]))
    .unwrap();
    assert_eq!((c.lat_us, c.lanes, c.mbps), (250.0, 4, 1000.0));
    // 1 MB at 1000 MB/s is 1000 us on top of the latency.
    assert_eq!(c.service_ns(1_000_000), 1_250_000);
    for (var, bad) in [
        ("TOFFLOAD_EMU_LAT_US", "abc"),
        ("TOFFLOAD_EMU_LANES", "0"),
        ("TOFFLOAD_EMU_MBPS", "-5"),
        ("TOFFLOAD_EMU_MAX_INFLIGHT", "lots"),
    ] {
        let get = move |k: &str| (k == var).then(|| bad.to_string());
        let e = EmuConfig::from_lookup(&get).unwrap_err();
        assert_eq!(e.var, var);
        assert!(e.to_string().contains(var) && e.to_string().contains("expected"));
    }
}

/// Submits `buf` polled; returns the handle and its due time.
fn submit_polled(d: &Emulated, buf: &mut [u8]) -> (OpId, u64) {
    // SAFETY: every caller keeps `buf` alive and untouched until it releases the op.
    unsafe { d.submit_polled(buf.as_mut_ptr(), buf.len()) }.unwrap()
}

#[test]
fn a_polled_op_is_done_for_its_poller_at_its_due_time_without_a_wake_up() {
    let d = dev(2_000.0, 4, 64);
    let mut buf = pattern(1000);
    let mut want = buf.clone();
    aes_ctr_in_place(&mut want);
    let t0 = engine::now_ns();
    let (id, due) = submit_polled(&d, &mut buf);
    // Due one service time after submission, by the same clock.
    assert!(
        due >= t0 + 2_000_000 && due <= engine::now_ns() + 2_000_000,
        "{due} {t0}"
    );
    assert_eq!(d.done(id).unwrap(), OpState::Pending);
    let polls = std::iter::repeat_with(|| d.done(id).unwrap())
        .take_while(|s| *s == OpState::Pending)
        .count();
    assert!(engine::now_ns() >= due, "found done before its due time");
    assert!(polls > 0);
    assert_eq!(buf, want);
    assert_eq!(d.stats().completed, 1);
    // The poll did the device's work: its thread never woke, and no signal was sent.
    assert_eq!(d.stats().wakeups, 0);
    let mut pfd = libc::pollfd {
        fd: d.completion_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: a local pollfd.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 0);
    d.release(id).unwrap();
    assert_eq!(d.done(id), Err(AccelError::BadHandle));
}

#[test]
fn the_signalled_path_is_what_a_polled_op_saves() {
    // The same op submitted the ordinary way wakes the device thread and signals.
    let d = dev(1_000.0, 4, 64);
    let mut buf = pattern(64);
    // SAFETY: buf outlives the op, released below.
    let id = unsafe { d.submit(buf.as_mut_ptr(), buf.len()) }.unwrap();
    d.wait(id).unwrap();
    d.release(id).unwrap();
    assert!(d.stats().wakeups >= 1);
}

#[test]
fn wait_on_a_polled_op_sleeps_until_due_and_completes_it() {
    let d = dev(10_000.0, 4, 64);
    let mut buf = pattern(333);
    let mut want = buf.clone();
    aes_ctr_in_place(&mut want);
    let (id, due) = submit_polled(&d, &mut buf);
    d.wait(id).unwrap();
    assert!(engine::now_ns() >= due);
    assert_eq!(d.done(id).unwrap(), OpState::Done);
    assert_eq!(buf, want);
    assert_eq!(d.stats().wakeups, 0);
    d.release(id).unwrap();
}

#[test]
fn a_cancelled_polled_op_is_untouched_and_its_slot_comes_back() {
    let d = dev(2_000.0, 4, 2);
    let mut buf = pattern(128);
    let orig = buf.clone();
    let (id, due) = submit_polled(&d, &mut buf);
    d.release(id).unwrap();
    while engine::now_ns() < due {
        std::thread::yield_now();
    }
    assert_eq!(buf, orig);
    assert_eq!(d.stats().completed, 0);
    // The next submissions free it (no device thread runs for polled ops): both
    // slots are usable again.
    let mut a = pattern(8);
    let mut b = pattern(8);
    let (ia, _) = submit_polled(&d, &mut a);
    let (ib, _) = submit_polled(&d, &mut b);
    for id in [ia, ib] {
        d.wait(id).unwrap();
        d.release(id).unwrap();
    }
    assert_eq!(d.stats().completed, 2);
}

#[test]
fn polled_and_signalled_ops_from_many_threads_all_correct() {
    many_threads(|d, buf, i| {
        if i % 3 == 0 {
            d.run(buf, WaitStyle::Block).unwrap();
            return;
        }
        let (id, _) = submit_polled(d, buf);
        if i % 3 == 1 {
            while d.done(id).unwrap() == OpState::Pending {
                std::hint::spin_loop();
            }
        } else {
            d.wait(id).unwrap();
        }
        d.release(id).unwrap();
    });
}
