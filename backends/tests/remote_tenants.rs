//! Tenants of one toffload-remoted (TLS with pre-shared keys, identities alice and
//! bob): a client id belongs to the identity that opened it, and so do the chunks it
//! sent.

mod remote_util;

use remote_util::raw::{Got, Raw};
use remote_util::*;
use std::time::Duration;
use toffload_accel::remote::chunk::sha256;
use toffload_accel::remote::frame::{Op, OpKind, Payload, Piece, STATUS_MISSING_CHUNK};
use toffload_accel::remote::tls::{psk_connector, Psk};

const KEY_A: &str = "8f3c0a1e5b7d92c46e10f2a3b4c5d6e7";
const KEY_B: &str = "0123456789abcdef0123456789abcdef";

fn psk(identity: &str, hex: &str) -> Psk {
    Psk {
        identity: identity.into(),
        key: (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect(),
    }
}

/// A PSK daemon for alice and bob; its log goes to `dir`/log.
fn daemon(dir: &TempDir) -> Daemon {
    let keys = dir.path().join("daemon.psk");
    write_secret(&keys, format!("alice {KEY_A}\nbob {KEY_B}\n"));
    Daemon::start_logged(
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-psk",
            keys.to_str().unwrap(),
        ],
        &[],
        &dir.path().join("log"),
    )
}

fn aes(seq: u64, data: &[u8]) -> Op<'_> {
    Op {
        seq,
        kind: OpKind::AesCtr,
        payload: Payload::Raw(data),
    }
}

/// Bob says hello with alice's client id: refused (and counted); alice's connection
/// is not touched, and alice's unacknowledged result reaches alice only.
#[test]
fn a_session_cannot_be_taken_over_by_another_identity() {
    let dir = TempDir::new("takeover");
    let d = daemon(&dir);
    let (alice, bob) = (psk("alice", KEY_A), psk("bob", KEY_B));
    const ID: u64 = 0x5eed_0001;
    let mut a = Raw::hello(&d.addr(), Some(&alice), ID).unwrap();
    let data = pattern(1, 1000);
    a.submit(0, &[], &[aes(0, &data)]).unwrap();
    let first = a.results(1, Duration::from_secs(10));
    assert_eq!(first[0].1, 0);
    // Not acknowledged: held for alice. Bob claims the id.
    let e = Raw::hello(&d.addr(), Some(&bob), ID)
        .err()
        .expect("bob got in");
    assert!(e.contains("belongs to another identity"), "{e}");
    // Alice's connection still works.
    a.ping().unwrap();
    assert!(matches!(a.next(Duration::from_secs(5)).unwrap(), Got::Pong));
    // Alice again, on a new connection: her held result is sent to her.
    drop(a);
    let mut a2 = Raw::hello(&d.addr(), Some(&alice), ID).unwrap();
    let again = a2.results(1, Duration::from_secs(10));
    assert_eq!(again, first);
    // Bob with his own id is served as usual.
    let mut b = Raw::hello(&d.addr(), Some(&bob), 0x5eed_0002).unwrap();
    b.submit(0, &[], &[aes(0, &data)]).unwrap();
    assert_eq!(b.results(1, Duration::from_secs(10))[0].1, 0);
    let s = stats_tls(&d.addr(), &psk_connector(alice).unwrap());
    assert_eq!(s["takeovers_refused"], 1, "{s:?}");
    // Logged with who tried and who owns it.
    let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("client id belongs to another identity"))
        .expect(&log);
    assert!(
        line.contains("WARN")
            && line.contains("identity=psk:bob")
            && line.contains("owner=psk:alice"),
        "{line}"
    );
    assert_eq!(s["executions"], 2, "{s:?}");
}

/// Alice's chunk, cached when she sent it, is not bob's: his Welcome does not list
/// it and his reference to it is answered "missing"; alice's reference works.
#[test]
fn a_tenant_cannot_reference_or_list_another_tenants_chunks() {
    let dir = TempDir::new("tenants");
    let d = daemon(&dir);
    let (alice, bob) = (psk("alice", KEY_A), psk("bob", KEY_B));
    let chunk = pattern(7, 16 << 10);
    let h = sha256(&chunk);
    let op = |seq, piece| Op {
        seq,
        kind: OpKind::AesCtr,
        payload: Payload::Chunked {
            total: chunk.len() as u32,
            pieces: vec![piece],
        },
    };
    let mut a = Raw::hello(&d.addr(), Some(&alice), 0xa11ce).unwrap();
    a.submit(0, &[], &[op(0, Piece::Literal(&chunk))]).unwrap();
    let sent = a.results(1, Duration::from_secs(10));
    assert_eq!(sent[0].1, 0);
    // Bob: nothing listed, the reference unknown.
    let mut b = Raw::hello(&d.addr(), Some(&bob), 0xb0b).unwrap();
    assert!(!b.chunks.contains(&h), "bob's welcome lists alice's chunk");
    assert!(b.chunks.is_empty());
    let r = Piece::Ref {
        hash: h,
        len: chunk.len() as u32,
    };
    b.submit(0, &[], &[op(0, r)]).unwrap();
    let got = b.results(1, Duration::from_secs(10));
    assert_eq!(got[0].1, STATUS_MISSING_CHUNK);
    assert!(got[0].2.is_empty());
    // Alice: listed, and her reference gives the same answer as her bytes did.
    let mut a2 = Raw::hello(&d.addr(), Some(&alice), 0xa11ce2).unwrap();
    assert_eq!(a2.chunks, vec![h]);
    a2.submit(0, &[], &[op(0, r)]).unwrap();
    let got = a2.results(1, Duration::from_secs(10));
    assert_eq!(got[0].1, 0);
    assert_eq!(got[0].2, sent[0].2);
}
