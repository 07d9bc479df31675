//! The daemon's frame handler in-process (no socket): random sequences of Submit
//! frames from a few clients (new and resent ops, raw and chunked, references to
//! chunks held and not, acknowledgements, watermarks, garbage) keep every client's
//! counters equal to its entries and within the bounds, and never panic. The fuzz
//! target `daemon_frames` (backends/fuzz) does the same from raw bytes.

use proptest::prelude::*;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use toffload_accel::cuda::CudaConfig;
use toffload_accel::remote::chunk::sha256;
use toffload_accel::remote::daemon::{Daemon, DaemonConfig};
use toffload_accel::remote::frame::{self, Op, OpKind, Payload, Piece};
use toffload_accel::EmuConfig;

fn daemon() -> &'static Arc<Daemon> {
    static D: OnceLock<Arc<Daemon>> = OnceLock::new();
    D.get_or_init(|| {
        let args: Vec<String> = ["--client-ops", "16", "--held-mb", "16", "--cache-mb", "1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let emu = EmuConfig {
            lat_us: 1.0,
            ..EmuConfig::default()
        };
        Daemon::start(DaemonConfig::parse(&args, emu, CudaConfig::default()).unwrap()).unwrap()
    })
}

#[derive(Clone, Debug)]
enum P {
    Lit(Vec<u8>),
    /// A reference to the literal of this seed (sent or not).
    Ref(u8),
}

fn lit(seed: u8) -> Vec<u8> {
    vec![seed; 4096 + seed as usize]
}

/// An op: (seq, chunked, pieces).
type TestOp = (u64, bool, Vec<P>);
/// A frame: (watermark, acks, ops, a corrupted byte).
type TestFrame = (u64, Vec<u64>, Vec<TestOp>, bool);

fn op_strategy() -> impl Strategy<Value = TestOp> {
    let piece = prop_oneof![
        (0u8..8).prop_map(|s| P::Lit(lit(s))),
        (0u8..8).prop_map(P::Ref),
    ];
    (0u64..40, any::<bool>(), prop::collection::vec(piece, 0..4))
}

fn frame_strategy() -> impl Strategy<Value = TestFrame> {
    (
        0u64..30,
        prop::collection::vec(0u64..40, 0..6),
        prop::collection::vec(op_strategy(), 0..24),
        prop::bool::weighted(0.1),
    )
}

fn body(wm: u64, acks: &[u64], ops: &[TestOp], garbage: bool) -> Vec<u8> {
    let raw = vec![7u8; 100];
    let mut encoded: Vec<Op<'_>> = Vec::new();
    for (seq, chunked, pieces) in ops {
        let payload = if *chunked {
            let ps: Vec<Piece<'_>> = pieces
                .iter()
                .map(|p| match p {
                    P::Lit(b) => Piece::Literal(b),
                    P::Ref(s) => Piece::Ref {
                        hash: sha256(&lit(*s)),
                        len: lit(*s).len() as u32,
                    },
                })
                .collect();
            let total = pieces
                .iter()
                .map(|p| match p {
                    P::Lit(b) => b.len(),
                    P::Ref(s) => lit(*s).len(),
                })
                .sum::<usize>() as u32;
            Payload::Chunked { total, pieces: ps }
        } else {
            Payload::Raw(&raw)
        };
        encoded.push(Op {
            seq: *seq,
            kind: if seq % 5 == 0 {
                OpKind::RsaSign
            } else {
                OpKind::AesCtr
            },
            payload,
        });
    }
    let mut out = Vec::new();
    frame::encode_submit(wm, acks, &encoded, &mut out);
    let mut b = out[4..].to_vec();
    if garbage && b.len() > 3 {
        let i = b.len() / 2;
        b[i] ^= 0x5a;
    }
    b
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]
    #[test]
    fn frame_sequences_keep_the_books_and_the_bounds(
        client in 0u64..3,
        frames in prop::collection::vec(frame_strategy(), 1..6),
    ) {
        let d = daemon();
        let bodies: Vec<Vec<u8>> = frames
            .iter()
            .map(|(wm, acks, ops, g)| body(*wm, acks, ops, *g))
            .collect();
        let refs: Vec<&[u8]> = bodies.iter().map(|b| &b[..]).collect();
        let _ = d.feed(client, &refs);
        prop_assert_eq!(d.check(), Ok(()));
    }
}

/// After the random runs, the executors drain: every op the daemon accepted finishes
/// and the books still agree (no op counted as running forever).
#[test]
fn accepted_ops_all_finish() {
    let d = daemon();
    let data = vec![1u8; 64];
    let ops: Vec<Op<'_>> = (1000..1010)
        .map(|seq| Op {
            seq,
            kind: OpKind::AesCtr,
            payload: Payload::Raw(&data),
        })
        .collect();
    let mut out = Vec::new();
    frame::encode_submit(0, &[], &ops, &mut out);
    d.feed(9, &[&out[4..]]).unwrap();
    let t0 = Instant::now();
    loop {
        let s: std::collections::HashMap<_, _> = d.stats().into_iter().collect();
        if s["queue_depth"] == 0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "ops never finished");
        std::thread::sleep(Duration::from_millis(10));
    }
    d.check().unwrap();
}
