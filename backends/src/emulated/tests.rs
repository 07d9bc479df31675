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

#[test]
fn many_threads_many_ops_all_correct() {
    let d = std::sync::Arc::new(dev(30.0, 16, 256));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || {
                for i in 0..300 {
                    let mut buf = pattern(100 + t * 10 + i % 7);
                    let mut want = buf.clone();
                    aes_ctr_in_place(&mut want);
                    let style = if i % 2 == 0 {
                        WaitStyle::Spin
                    } else {
                        WaitStyle::Block
                    };
                    d.run(&mut buf, style).unwrap();
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
