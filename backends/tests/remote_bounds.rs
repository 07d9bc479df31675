//! toffload-remoted's resource bounds against hostile clients: the chunk-reference
//! amplification frame (hazard first: with the bounds raised out of the way the
//! daemon dies under a memory limit), ops past a client's in-flight bound, and a
//! slowloris/connection flood while a well-behaved client keeps being served.

mod remote_util;

use remote_util::raw::{rss_and_vsz, Got, Raw};
use remote_util::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};
use toffload_accel::remote::chunk::{sha256, MAX_CHUNK};
use toffload_accel::remote::frame::{Op, OpKind, Payload, Piece, MAX_FRAME, MAX_OP_BYTES};
use toffload_accel::remote::tls::read_client_psk;
use toffload_accel::{Accelerator, WaitStyle};

/// Limits the daemon's address space to what it uses now plus `headroom`.
fn limit_memory(pid: u32, headroom: u64) -> u64 {
    let (_, vsz) = rss_and_vsz(pid);
    let limit = vsz + headroom;
    let st = Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--as={limit}"))
        .status()
        .expect("prlimit (util-linux)");
    assert!(st.success(), "prlimit failed");
    limit
}

/// The attack: one chunk sent once, then one frame of ops that each reference it
/// 16 MiB worth. Returns (wire bytes of the frame, bytes it asks to be assembled).
fn amplification(addr: &str) -> (Raw, usize, u64) {
    let mut a = Raw::hello(addr, None, 0xbad).unwrap();
    let chunk = pattern(1, MAX_CHUNK);
    let h = sha256(&chunk);
    a.submit(
        0,
        &[],
        &[Op {
            seq: 0,
            kind: OpKind::AesCtr,
            payload: Payload::Chunked {
                total: chunk.len() as u32,
                pieces: vec![Piece::Literal(&chunk)],
            },
        }],
    )
    .unwrap();
    assert_eq!(a.results(1, Duration::from_secs(10))[0].1, 0);
    let per_op = MAX_OP_BYTES / MAX_CHUNK;
    let refs = vec![
        Piece::Ref {
            hash: h,
            len: MAX_CHUNK as u32
        };
        per_op
    ];
    let ops: Vec<Op<'_>> = (1..=1024)
        .map(|seq| Op {
            seq,
            kind: OpKind::AesCtr,
            payload: Payload::Chunked {
                total: MAX_OP_BYTES as u32,
                pieces: refs.clone(),
            },
        })
        .collect();
    let mut wire = Vec::new();
    toffload_accel::remote::frame::encode_submit(0, &[0], &ops, &mut wire);
    assert!(wire.len() <= MAX_FRAME);
    let asked: u64 = ops.iter().map(|o| o.payload.len() as u64).sum();
    a.write(&wire).unwrap();
    (a, wire.len(), asked)
}

#[test]
fn an_amplification_frame_is_refused_and_the_daemon_keeps_serving() {
    const HEADROOM: u64 = 1 << 30;
    // The hazard: bounds raised to their maximum (what the daemon did before it had
    // them). Under a memory limit the daemon dies assembling the frame.
    {
        let mut d = Daemon::start(
            &[
                "--listen",
                "127.0.0.1:0",
                "--frame-assembly-mb",
                "65536",
                "--client-inflight-mb",
                "65536",
            ],
            &[],
        );
        let limit = limit_memory(d.child.id(), HEADROOM);
        let (_a, wire, asked) = amplification(&d.addr());
        eprintln!(
            "amplification frame: {wire} bytes on the wire ask for {asked} bytes ({}x); \
             address space limit {limit}",
            asked / wire as u64
        );
        assert!(asked > 1000 * wire as u64 && asked > 4 * limit);
        let t0 = Instant::now();
        let status = loop {
            if let Some(st) = d.child.try_wait().unwrap() {
                break st;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the unbounded daemon survived the frame"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        eprintln!("unbounded daemon: {status} after {:?}", t0.elapsed());
        assert!(!status.success());
    }
    // The bounds (defaults): the frame is refused with the reason, before anything
    // is assembled; other clients are served; memory stays put.
    let mut d = Daemon::start(&["--listen", "127.0.0.1:0"], &[]);
    let pid = d.child.id();
    limit_memory(pid, HEADROOM);
    let good = client(&[d.addr()], |_| {});
    let mut buf = pattern(2, 100_000);
    good.run(&mut buf, WaitStyle::Block).unwrap();
    let (rss0, _) = rss_and_vsz(pid);
    let (mut a, _, _) = amplification(&d.addr());
    let reason = loop {
        match a
            .next(Duration::from_secs(10))
            .expect("a reply to the frame")
        {
            Got::Refused(r) => break r,
            Got::Results(_) => continue,
            g => panic!("{g:?}"),
        }
    };
    assert!(reason.contains("--frame-assembly-mb"), "{reason}");
    // Its connection is closed after the refusal.
    let mut b = [0u8; 1];
    assert!(matches!(a.c.stream.read(&mut b), Ok(0) | Err(_)));
    for i in 0..50 {
        let mut buf = pattern(3 + i, 200_000);
        good.run(&mut buf, WaitStyle::Block).unwrap();
    }
    assert_eq!(d.child.try_wait().unwrap(), None, "the daemon died");
    let (rss1, _) = rss_and_vsz(pid);
    eprintln!("bounded daemon: RSS {rss0} before the frame, {rss1} after");
    assert!(rss1 < rss0 + (64 << 20), "RSS grew {rss0} -> {rss1}");
    let s = stats(&d.addr());
    assert_eq!(s["frames_refused"], 1);
    assert_eq!(s["executed_twice"], 0);
}

/// Ops past a client's in-flight bound are answered ENOBUFS at once, without
/// running; the ones within it run.
#[test]
fn ops_past_the_in_flight_bound_are_refused_with_enobufs() {
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0", "--client-ops", "4"],
        // Slow ops, so that the first ones are still running when the rest arrive.
        &[("TOFFLOAD_EMU_LAT_US", "300000")],
    );
    let mut a = Raw::hello(&d.addr(), None, 0x1001).unwrap();
    let data = pattern(9, 64);
    let ops: Vec<Op<'_>> = (0..10)
        .map(|seq| Op {
            seq,
            kind: OpKind::AesCtr,
            payload: Payload::Raw(&data),
        })
        .collect();
    a.submit(0, &[], &ops).unwrap();
    let got = a.results(10, Duration::from_secs(10));
    let refused: Vec<u64> = got
        .iter()
        .filter(|r| r.1 == -libc::ENOBUFS)
        .map(|r| r.0)
        .collect();
    let ran: Vec<u64> = got.iter().filter(|r| r.1 == 0).map(|r| r.0).collect();
    assert_eq!(refused, (4..10).collect::<Vec<_>>(), "{got:?}");
    assert_eq!(ran.len(), 4, "{got:?}");
    // Refused ops did not run: resent now (the first four finished), they do.
    let ops2: Vec<Op<'_>> = ops[4..8].to_vec();
    a.submit(0, &ran, &ops2).unwrap();
    let got = a.results(4, Duration::from_secs(10));
    assert!(got.iter().all(|r| r.1 == 0), "{got:?}");
    let s = stats(&d.addr());
    assert_eq!(s["ops_over_limit"], 6);
    assert_eq!(s["executions"], 8);
}

/// 250 connections trickle a TLS handshake a byte at a time and 250 send nothing;
/// each is closed at the handshake deadline, and meanwhile a well-behaved client's
/// ops keep completing within the latency bound.
#[test]
fn slowloris_connections_are_cut_and_a_good_client_keeps_its_latency() {
    const BAD: usize = 500;
    const DEADLINE_MS: u64 = 2000;
    const LATENCY_BOUND: Duration = Duration::from_millis(500);
    let dir = TempDir::new("slow");
    let keys = dir.path().join("daemon.psk");
    let key = "00112233445566778899aabbccddeeff";
    write_secret(&keys, format!("good {key}\n"));
    let mine = dir.path().join("good.psk");
    write_secret(&mine, format!("good {key}\n"));
    let d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-psk",
            keys.to_str().unwrap(),
            "--handshake-ms",
            &DEADLINE_MS.to_string(),
            // All from 127.0.0.1 here: the per-peer bound is the next test's.
            "--max-conns-per-peer",
            "1000",
        ],
        &[],
    );
    let good = client(&[d.addr()], |c| c.psk = Some(mine.clone()));
    let mut buf = pattern(1, 4096);
    good.run(&mut buf, WaitStyle::Block).unwrap();
    let t0 = Instant::now();
    // In batches, so that the listen backlog (128) never overflows: an overflowing
    // connection is accepted only when the kernel retries it, a second or more later.
    let mut bad: Vec<(TcpStream, Duration, Option<Duration>)> = Vec::new();
    for i in 0..BAD {
        let s = TcpStream::connect(d.addr()).unwrap();
        s.set_nonblocking(true).unwrap();
        bad.push((s, t0.elapsed(), None));
        if i % 50 == 49 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // A ClientHello's record header, then bytes, one per 200 ms per connection.
    let hello: Vec<u8> = [0x16, 0x03, 0x01, 0x02, 0x00]
        .into_iter()
        .chain(std::iter::repeat(0x01))
        .take(512)
        .collect();
    let trickler = std::thread::spawn(move || {
        let mut sent = 0;
        while bad.iter().any(|b| b.2.is_none()) && t0.elapsed() < Duration::from_secs(20) {
            for (i, (s, opened, closed)) in bad.iter_mut().enumerate() {
                if closed.is_some() {
                    continue;
                }
                let mut b = [0u8; 64];
                let gone = match s.read(&mut b) {
                    Ok(0) => true,
                    Ok(_) => false,
                    Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                };
                let gone = gone || (i % 2 == 0 && s.write(&hello[sent..sent + 1]).is_err());
                if gone {
                    *closed = Some(t0.elapsed() - *opened);
                }
            }
            sent = (sent + 1).min(hello.len() - 1);
            std::thread::sleep(Duration::from_millis(200));
        }
        bad.into_iter().map(|b| b.2).collect::<Vec<_>>()
    });
    let mut lat = Vec::new();
    while t0.elapsed() < Duration::from_millis(DEADLINE_MS + 1500) {
        let mut buf = pattern(lat.len() as u64, 4096);
        let t = Instant::now();
        good.run(&mut buf, WaitStyle::Block).unwrap();
        lat.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(5));
    }
    let closed = trickler.join().unwrap();
    lat.sort();
    let p50 = lat[lat.len() / 2];
    let max = *lat.last().unwrap();
    // How long each lived, from its connect.
    let last_close = closed
        .iter()
        .map(|c| c.expect("a bad connection was never closed"))
        .max();
    eprintln!(
        "{BAD} bad connections: the longest lived {last_close:?} (deadline {DEADLINE_MS} ms); \
         good client: {} ops, p50 {p50:?}, max {max:?}",
        lat.len()
    );
    assert!(last_close.unwrap() < Duration::from_millis(DEADLINE_MS + 1000));
    assert!(max < LATENCY_BOUND, "max latency {max:?}");
    let s = stats_tls(
        &d.addr(),
        &toffload_accel::remote::tls::psk_connector(read_client_psk(&mine).unwrap()).unwrap(),
    );
    assert!(
        s["handshake_timeouts"] + s["refused"] >= BAD as u64,
        "{s:?}"
    );
    assert!(s["connections_open"] <= 2, "{s:?}");
}

/// The hazard the handshake deadline closes: with it out of the way (its maximum;
/// before, each read had a 5 s timeout that every trickled byte reset), connections
/// trickling a TLS handshake are all still open long after the 2 s the next test
/// allows.
#[test]
fn without_the_deadline_a_trickled_handshake_holds_its_connection() {
    let dir = TempDir::new("slow0");
    let keys = dir.path().join("daemon.psk");
    write_secret(&keys, "good 00112233445566778899aabbccddeeff\n");
    let d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-psk",
            keys.to_str().unwrap(),
            "--handshake-ms",
            "600000",
        ],
        &[],
    );
    let mut conns: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(d.addr()).unwrap())
        .collect();
    let hello = [0x16u8, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc];
    for byte in hello.iter().chain(std::iter::repeat(&0u8)).take(16) {
        for c in &mut conns {
            c.write_all(&[*byte]).unwrap();
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    // 4 s later, every one is still open: a read finds no end of stream.
    let open = conns
        .iter()
        .filter(|c| {
            c.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
            let mut b = [0u8; 1];
            let mut r: &TcpStream = c;
            matches!(r.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        })
        .count();
    assert_eq!(open, 20);
}

/// Connections from one address past --max-conns-per-peer are closed at accept.
#[test]
fn a_connection_flood_from_one_peer_is_capped() {
    let d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--max-conns-per-peer",
            "20",
            "--handshake-ms",
            "1500",
        ],
        &[],
    );
    let conns: Vec<TcpStream> = (0..30)
        .map(|_| TcpStream::connect(d.addr()).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut closed_at_once = 0;
    for mut s in &conns {
        s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut b = [0u8; 1];
        if matches!(s.read(&mut b), Ok(0)) || s.write_all(&[0]).is_err() {
            closed_at_once += 1;
        }
    }
    assert_eq!(closed_at_once, 10);
    // Once the silent ones pass the handshake deadline, a client gets in again.
    std::thread::sleep(Duration::from_millis(1600));
    let s = stats(&d.addr());
    assert_eq!(s["connections_refused"], 10, "{s:?}");
    assert_eq!(s["handshake_timeouts"], 20, "{s:?}");
}

/// A connection silent both ways past --idle-s is closed; a result nobody
/// acknowledges is dropped past --held-age-s, and a resend of its op is answered
/// ETIMEDOUT instead of running it again.
#[test]
fn idle_connections_close_and_unacknowledged_results_expire() {
    let d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--idle-s",
            "1",
            "--held-age-s",
            "1",
        ],
        &[],
    );
    let mut a = Raw::hello(&d.addr(), None, 0x1d1e).unwrap();
    let data = pattern(4, 64);
    let op = [Op {
        seq: 0,
        kind: OpKind::AesCtr,
        payload: Payload::Raw(&data),
    }];
    a.submit(0, &[], &op).unwrap();
    assert_eq!(a.results(1, Duration::from_secs(5))[0].1, 0);
    // Silence: the daemon closes within the idle bound (+ its 1 s poll).
    let t0 = Instant::now();
    let mut b = [0u8; 1];
    a.c.stream
        .tcp()
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(matches!(a.c.stream.read(&mut b), Ok(0) | Err(_)));
    let idle = t0.elapsed();
    assert!(idle < Duration::from_millis(3500), "closed after {idle:?}");
    // The result was never acknowledged; past its age it is gone.
    std::thread::sleep(Duration::from_millis(1500));
    let mut a = Raw::hello(&d.addr(), None, 0x1d1e).unwrap();
    a.submit(0, &[], &op).unwrap();
    let got = a.results(1, Duration::from_secs(5));
    assert_eq!(got[0].1, -libc::ETIMEDOUT, "{got:?}");
    let s = stats(&d.addr());
    assert_eq!(s["results_expired"], 1, "{s:?}");
    assert_eq!(s["executions"], 1, "{s:?}");
    assert!(s["idle_closed"] >= 1, "{s:?}");
}

/// A peer that sends pings and never reads their pongs: past half of --out-queue-mb
/// waiting for it the daemon stops reading it (its writes stall, the daemon's memory
/// stays put), and the connection, silent both ways from then on, is closed at
/// --idle-s.
#[test]
fn a_peer_that_does_not_read_is_not_read_and_then_closed() {
    let mut d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--out-queue-mb",
            "2",
            "--idle-s",
            "2",
        ],
        &[],
    );
    let pid = d.child.id();
    let mut a = Raw::hello(&d.addr(), None, 0x9999).unwrap();
    let (rss0, _) = rss_and_vsz(pid);
    let mut ping = Vec::new();
    toffload_accel::remote::frame::encode(
        &toffload_accel::remote::frame::Msg::Ping { token: 1 },
        &mut ping,
    );
    let batch: Vec<u8> = ping
        .iter()
        .copied()
        .cycle()
        .take(ping.len() * 4096)
        .collect();
    a.c.stream
        .tcp()
        .set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut sent = 0usize;
    let stalled = loop {
        match a.c.stream.write(&batch) {
            Ok(n) => sent += n,
            Err(_) => break true,
        }
        if sent > 512 << 20 {
            break false;
        }
    };
    let (rss1, _) = rss_and_vsz(pid);
    eprintln!(
        "pings sent before the writes stalled: {sent} bytes (~{} pongs owed); \
         daemon RSS {rss0} -> {rss1}",
        sent / ping.len()
    );
    assert!(
        stalled,
        "the daemon read {sent} bytes of pings without stalling"
    );
    assert!(rss1 < rss0 + (32 << 20), "RSS {rss0} -> {rss1}");
    // Then closed at the idle bound (+ its 1 s poll), the daemon still serving.
    let t0 = Instant::now();
    let closed = loop {
        let s = stats(&d.addr());
        if s["idle_closed"] + s["out_queue_closed"] >= 1 {
            break t0.elapsed();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{s:?}");
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("closed {closed:?} after the stall");
    assert_eq!(d.child.try_wait().unwrap(), None);
}

/// What the client makes of the daemon's refusals: ops past the daemon's in-flight
/// bound fail with ENOBUFS (counted as over_limit), and a refused hello's reason is
/// kept for the caller (`Remote::last_refusal`).
#[test]
fn the_client_surfaces_refusals_and_their_reasons() {
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0", "--client-ops", "2"],
        &[("TOFFLOAD_EMU_LAT_US", "200000")],
    );
    let r = client(&[d.addr()], |c| c.coalesce_us = 2000);
    let mut bufs: Vec<Vec<u8>> = (0..6).map(|i| pattern(i, 100)).collect();
    let ids: Vec<_> = bufs
        .iter_mut()
        // SAFETY: the buffers outlive the ops.
        .map(|b| unsafe { r.submit(b.as_mut_ptr(), b.len()) }.unwrap())
        .collect();
    let errnos: Vec<i32> = ids
        .iter()
        .map(|id| {
            let e = r.wait(*id).err().map_or(0, |e| e.errno());
            r.release(*id).unwrap();
            e
        })
        .collect();
    assert_eq!(
        errnos.iter().filter(|e| **e == libc::ENOBUFS).count(),
        4,
        "{errnos:?}"
    );
    assert_eq!(r.counters().over_limit, 4);
    // A daemon that refuses the hello (as one does a client id of another identity).
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming().take(3) {
            let mut s = s.unwrap();
            let mut b = [0u8; 64];
            let _ = s.read(&mut b);
            let mut out = Vec::new();
            toffload_accel::remote::frame::encode(
                &toffload_accel::remote::frame::Msg::Refused {
                    reason: "client id belongs to another identity",
                },
                &mut out,
            );
            let _ = s.write_all(&out);
        }
    });
    let r = client(std::slice::from_ref(&addr), |c| c.deadline_ms = 300);
    let mut buf = pattern(1, 10);
    assert!(r.run(&mut buf, WaitStyle::Block).is_err());
    assert_eq!(
        r.last_refusal().as_deref(),
        Some(&*format!("{addr}: client id belongs to another identity"))
    );
    assert!(r.counters().refusals >= 1);
}
