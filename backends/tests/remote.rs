//! The remote backend against a real toffload-remoted on loopback: answers
//! bit-identical to the emulated backend's, RSA signatures that verify, pipelining,
//! backpressure, deadlines, and a malformed frame that closes only its connection.

mod remote_util;

use remote_util::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use toffload_accel::remote::frame::{self, Msg};
use toffload_accel::remote::OpKind;
use toffload_accel::{AccelError, Accelerator, EmuConfig, Emulated, OpState, WaitStyle};

#[test]
fn aes_results_are_bit_identical_to_the_emulated_backend() {
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0"],
        &[("TOFFLOAD_EMU_LAT_US", "20")],
    );
    let r = client(&[d.addr()], |_| {});
    let emu = Emulated::new(EmuConfig {
        lat_us: 5.0,
        ..EmuConfig::default()
    })
    .unwrap();
    // Sizes across chunking (cache_min 64 KiB) and frame boundaries.
    for (i, &n) in [
        0usize,
        1,
        15,
        16,
        17,
        1000,
        4096,
        65_535,
        65_536,
        200_000,
        1 << 20,
        3 << 20,
    ]
    .iter()
    .enumerate()
    {
        let input = pattern(i as u64, n);
        let mut remote = input.clone();
        r.run(&mut remote, WaitStyle::Block).unwrap();
        let mut local = input.clone();
        emu.run(&mut local, WaitStyle::Block).unwrap();
        assert_eq!(remote, local, "size {n}");
        if n > 0 {
            assert_ne!(remote, input, "size {n}: not transformed");
        }
    }
    let c = r.counters();
    assert_eq!(c.failed, 0);
    assert_eq!(c.completed, 12);
}

#[test]
fn rsa_signatures_verify_with_the_daemons_key() {
    use openssl::hash::MessageDigest;
    use openssl::pkey::PKey;
    use openssl::rsa::Rsa;
    use openssl::sign::Verifier;
    let dir = TempDir::new("rsa");
    let key = PKey::from_rsa(Rsa::generate(2048).unwrap()).unwrap();
    let kp = dir.path().join("k.pem");
    std::fs::write(&kp, key.private_key_to_pem_pkcs8().unwrap()).unwrap();
    let d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--rsa-key",
            kp.to_str().unwrap(),
            "--sign-threads",
            "2",
        ],
        &[],
    );
    let r = client(&[d.addr()], |c| c.op = OpKind::RsaSign);
    let mut bufs: Vec<(Vec<u8>, Vec<u8>)> = (0..32)
        .map(|i| {
            let m = pattern(i, 300 + i as usize);
            (m.clone(), m)
        })
        .collect();
    let ids: Vec<_> = bufs
        .iter_mut()
        // SAFETY: the buffers outlive the ops (released below).
        .map(|(_, b)| unsafe { r.submit(b.as_mut_ptr(), b.len()) }.unwrap())
        .collect();
    for (id, (msg, out)) in ids.into_iter().zip(&bufs) {
        r.wait(id).unwrap();
        r.release(id).unwrap();
        let mut v = Verifier::new(MessageDigest::sha256(), &key).unwrap();
        v.update(msg).unwrap();
        assert!(v.verify(&out[..256]).unwrap(), "signature does not verify");
        assert_eq!(out[256..], msg[256..], "bytes past the signature untouched");
    }
    // Too short for a signature.
    let mut small = [0u8; 100];
    // SAFETY: valid buffer; the call fails before keeping it.
    let e = unsafe { r.submit(small.as_mut_ptr(), small.len()) }.unwrap_err();
    assert_eq!(e, AccelError::BadLength);
}

#[test]
fn pipelining_coalesces_many_ops_per_frame() {
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0"],
        &[("TOFFLOAD_EMU_LAT_US", "200")],
    );
    let r = client(&[d.addr()], |c| c.coalesce_us = 200);
    let (ok, failed, wrong) =
        aes_workload(&r, 20_000, 64, 2, 1024, Duration::from_secs(30), |_| {});
    assert_eq!((ok, failed, wrong), (20_000, 0, 0));
    let c = r.counters();
    let per_frame = c.ops_sent as f64 / c.frames_sent as f64;
    println!(
        "{} ops in {} frames: {per_frame:.1} ops per frame",
        c.ops_sent, c.frames_sent
    );
    assert!(per_frame >= 8.0, "{per_frame:.1} ops per frame");
    let s = stats(&d.addr());
    assert_eq!(s["executions"], 20_000);
}

#[test]
fn a_full_window_returns_eagain_and_memory_stays_bounded() {
    // A slow device: ops stay in flight.
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0"],
        &[("TOFFLOAD_EMU_LAT_US", "300000")],
    );
    let r = client(&[d.addr()], |c| {
        c.window = 8;
        c.window_bytes = 1 << 20;
    });
    let mut bufs: Vec<Vec<u8>> = (0..9).map(|i| pattern(i, 1000)).collect();
    let mut ids = Vec::new();
    for b in bufs.iter_mut().take(8) {
        // SAFETY: buffers outlive the ops.
        ids.push(unsafe { r.submit(b.as_mut_ptr(), b.len()) }.unwrap());
    }
    // SAFETY: as above.
    let e = unsafe { r.submit(bufs[8].as_mut_ptr(), 1000) }.unwrap_err();
    assert_eq!(e.errno(), libc::EAGAIN, "{e}");
    for id in &ids {
        r.wait(*id).unwrap();
        r.release(*id).unwrap();
    }
    // Bytes window: one op of 600 KiB fits, a second does not.
    let mut big = [vec![1u8; 600 << 10], vec![2u8; 600 << 10]];
    // SAFETY: as above.
    let id = unsafe { r.submit(big[0].as_mut_ptr(), big[0].len()) }.unwrap();
    // SAFETY: as above.
    let e = unsafe { r.submit(big[1].as_mut_ptr(), big[1].len()) }.unwrap_err();
    assert_eq!(e.errno(), libc::EAGAIN);
    // Released while pending: the slot comes back once the result arrives, and the
    // buffer is not written.
    r.release(id).unwrap();
    let t0 = Instant::now();
    let id2 = loop {
        // SAFETY: as above.
        match unsafe { r.submit(big[1].as_mut_ptr(), big[1].len()) } {
            Ok(id) => break id,
            Err(e) => assert_eq!(e.errno(), libc::EAGAIN),
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(
        big[0].iter().all(|&b| b == 1),
        "a cancelled op's buffer was written"
    );
    r.wait(id2).unwrap();
    r.release(id2).unwrap();
}

#[test]
fn no_daemon_means_etimedout_after_the_deadline() {
    // A port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let r = client(&[format!("127.0.0.1:{port}")], |c| c.deadline_ms = 300);
    let mut b = pattern(1, 100);
    let t0 = Instant::now();
    // SAFETY: b outlives the op.
    let id = unsafe { r.submit(b.as_mut_ptr(), b.len()) }.unwrap();
    assert_eq!(r.done(id), Ok(OpState::Pending));
    let e = r.wait(id).unwrap_err();
    let dt = t0.elapsed();
    assert_eq!(e.errno(), libc::ETIMEDOUT);
    assert!(
        dt >= Duration::from_millis(290) && dt < Duration::from_secs(3),
        "{dt:?}"
    );
    assert_eq!(r.done(id).unwrap_err().errno(), libc::ETIMEDOUT);
    r.release(id).unwrap();
    assert_eq!(b, pattern(1, 100), "a timed-out op's buffer was written");
    assert!(r.counters().connect_failures >= 1);
}

fn raw_hello(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = Vec::new();
    frame::encode(
        &Msg::Hello {
            version: frame::VERSION,
            client_id: 77,
        },
        &mut out,
    );
    s.write_all(&out).unwrap();
    let mut rd = frame::FrameReader::new();
    loop {
        if let Some(b) = rd.next_frame().unwrap() {
            assert!(matches!(frame::decode(b).unwrap(), Msg::Welcome { .. }));
            break;
        }
        assert!(rd.fill(&mut s).unwrap() > 0);
    }
    s
}

#[test]
fn a_malformed_frame_closes_only_its_connection() {
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0"],
        &[("TOFFLOAD_EMU_LAT_US", "50")],
    );
    let r = client(&[d.addr()], |_| {});
    let run_some = |n: u64| {
        let (ok, failed, wrong) = aes_workload(&r, n, 100, 1, 64, Duration::from_secs(20), |_| {});
        assert_eq!((ok, failed, wrong), (n, 0, 0));
    };
    run_some(500);
    // Garbage after a valid hello: an unknown kind; an oversized length; a lying count.
    let bad: Vec<Vec<u8>> = vec![
        vec![3, 0, 0, 0, 99, 1, 2],
        (u32::MAX).to_le_bytes().to_vec(),
        {
            let mut b = vec![0u8; 4];
            b.push(4); // Submit
            b.extend_from_slice(&0u64.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
            b.extend_from_slice(&4000u32.to_le_bytes());
            let n = (b.len() - 4) as u32;
            b[..4].copy_from_slice(&n.to_le_bytes());
            b
        },
    ];
    for (k, garbage) in bad.iter().enumerate() {
        let mut s = raw_hello(&d.addr());
        s.write_all(garbage).unwrap();
        // The daemon closes this connection.
        let mut buf = [0u8; 64];
        let t0 = Instant::now();
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "case {k}: not closed"
            );
        }
        // The other client goes on, on its same connection.
        run_some(200);
    }
    let st = stats(&d.addr());
    assert_eq!(st["malformed"], 3);
    assert_eq!(r.counters().disconnects, 0);
    assert_eq!(r.counters().connects, 1);
    // A wrong protocol version is refused with a reason.
    let mut s = TcpStream::connect(d.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = Vec::new();
    frame::encode(
        &Msg::Hello {
            version: 999,
            client_id: 1,
        },
        &mut out,
    );
    s.write_all(&out).unwrap();
    let mut rd = frame::FrameReader::new();
    let msg = loop {
        if let Some(b) = rd.next_frame().unwrap() {
            break b.to_vec();
        }
        assert!(rd.fill(&mut s).unwrap() > 0);
    };
    match frame::decode(&msg).unwrap() {
        Msg::Refused { reason } => assert!(reason.contains("999"), "{reason}"),
        m => panic!("{m:?}"),
    }
}

/// One pass of the cache workload: `ops` ops of 2 MiB, each a static part (distinct
/// per op, the same on every pass) and an 8 KiB part that changes every pass.
fn cache_pass(r: &toffload_accel::Remote, ops: u64, pass: u64) -> u64 {
    let before = r.counters().bytes_sent;
    let mut bufs: Vec<Vec<u8>> = (0..ops)
        .map(|i| {
            let mut b = pattern(1000 + i, (2 << 20) - (8 << 10));
            b.extend_from_slice(&pattern(1_000_000 * pass + i, 8 << 10));
            b
        })
        .collect();
    let want: Vec<Vec<u8>> = bufs.iter().map(|b| aes(b.clone())).collect();
    for b in bufs.iter_mut() {
        r.run(b, WaitStyle::Block).unwrap();
    }
    assert!(bufs == want, "wrong answer on pass {pass}");
    r.counters().bytes_sent - before
}

#[test]
fn a_second_pass_sends_at_most_2_percent_of_the_first() {
    let dir = TempDir::new("cache");
    let cache_dir = dir.path().join("chunks");
    let mut d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--cache-dir",
            cache_dir.to_str().unwrap(),
        ],
        &[("TOFFLOAD_EMU_LAT_US", "50")],
    );
    // The hazard: without the cache every pass sends everything.
    let plain = client(&[d.addr()], |c| c.cache_min = 0);
    let p1 = cache_pass(&plain, 16, 1);
    let p2 = cache_pass(&plain, 16, 2);
    println!("no cache: pass 1 {p1} bytes, pass 2 {p2} bytes");
    assert!(p2 as f64 > 0.95 * p1 as f64);
    drop(plain);
    let r = client(&[d.addr()], |_| {});
    let first = cache_pass(&r, 16, 1);
    let second = cache_pass(&r, 16, 2);
    let ratio = second as f64 / first as f64;
    println!(
        "cache: pass 1 {first} bytes, pass 2 {second} bytes ({:.2}%), {:?}",
        ratio * 100.0,
        r.counters()
    );
    assert!(first >= 16 * (2 << 20));
    assert!(
        ratio <= 0.02,
        "second pass {:.2}% of the first",
        ratio * 100.0
    );
    // A new client after a daemon restart learns the held chunks from the welcome
    // (disk cache) and sends references from its first op on.
    drop(r);
    d.restart();
    let r = client(&[d.addr()], |_| {});
    let third = cache_pass(&r, 16, 3);
    println!(
        "after a restart, new client: {third} bytes ({:.2}%)",
        third as f64 / first as f64 * 100.0
    );
    assert!((third as f64) <= 0.02 * first as f64);
    assert_eq!(r.counters().missing_chunks, 0);
    let s = stats(&d.addr());
    assert!(s["cache_hits"] > 0);
}

/// The disk chunk cache is LRU end to end: A and B are sent (disk: A, B), A is sent
/// again (a use), the daemon restarts (memory gone; the disk order comes back from
/// the files), C is sent and the 1 MiB bound evicts. The least recently used is B,
/// so a new client's A travels as references and B has to be sent again. Written
/// first, A is what an oldest-written-first disk tier would have evicted.
#[test]
fn the_disk_cache_keeps_the_recently_used_across_a_restart() {
    let dir = TempDir::new("lru");
    let cache_dir = dir.path().join("chunks");
    let mut d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--cache-dir",
            cache_dir.to_str().unwrap(),
            "--cache-disk-mb",
            "1",
        ],
        &[("TOFFLOAD_EMU_LAT_US", "20")],
    );
    const LEN: usize = 400 << 10;
    let send = |r: &toffload_accel::Remote, seed: u64| -> u64 {
        let before = r.counters().bytes_sent;
        let mut b = pattern(seed, LEN);
        r.run(&mut b, WaitStyle::Block).unwrap();
        assert!(b == aes(pattern(seed, LEN)), "wrong answer for {seed}");
        r.counters().bytes_sent - before
    };
    let (a, b, c) = (7001, 7002, 7003);
    let r = client(&[d.addr()], |_| {});
    assert!(send(&r, a) >= LEN as u64);
    assert!(send(&r, b) >= LEN as u64);
    let again = send(&r, a);
    assert!(again <= LEN as u64 / 20, "A again: {again} bytes");
    drop(r);
    d.restart();
    let r = client(&[d.addr()], |_| {});
    assert!(send(&r, c) >= LEN as u64);
    let evictions = stats(&d.addr())["cache_disk_evictions"];
    assert!(
        evictions > 0,
        "C did not push the disk cache over its bound"
    );
    drop(r);
    // A new client learns what the disk holds now from the welcome.
    let r = client(&[d.addr()], |_| {});
    let a_bytes = send(&r, a);
    let b_bytes = send(&r, b);
    println!("after C ({evictions} chunks evicted): A {a_bytes} bytes, B {b_bytes} bytes of {LEN}");
    assert!(
        a_bytes <= LEN as u64 / 20,
        "the recently used A was evicted: {a_bytes} bytes sent"
    );
    assert!(
        b_bytes >= LEN as u64 / 4,
        "the least recently used B was kept: only {b_bytes} bytes sent"
    );
}
