//! Placement: which daemon of TOFFLOAD_CUDA_REMOTE's list runs this program's CUDA
//! work. The unit placed (the "task") is the program's CUDA context: the one
//! connection of the library, with every allocation, module and stream on it, which
//! must live on one GPU. A thread-per-connection GPU server is one task; N processes
//! started against the same list are N tasks, each placed when it starts.
//!
//! Each daemon is probed at once, in parallel, within TOFFLOAD_CUDA_REMOTE_PROBE_MS:
//! connect and hello, a heartbeat subscription (the daemon answers with a heartbeat
//! at once: its GPU's kernel queue and recent time per kernel), two pings (the round
//! trip) and a padded probe (the bandwidth). The predictor is the latency of one
//! reference request on that daemon: its round trip plus [`REF_BYTES`] at the
//! measured bandwidth, plus the kernel time times the kernels queued ahead and ours.
//! The daemon of least predicted latency keeps its connection (and its heartbeat
//! subscription, so that the view stays current); the others are closed. A daemon
//! that has not answered by the deadline (down, stopped, unreachable) is skipped.

use crate::frame::{self, FrameReader, Msg};
use crate::knobs;
use crate::remote::{log, send_all, CuResult, NO_DEVICE};
use crate::wire::{self, Beat, Call, Note};
use std::collections::HashSet;
use std::io::ErrorKind;
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// At most this many daemons in the list.
pub const MAX_DAEMONS: usize = 16;
/// The bytes of the predictor's reference request (and of the bandwidth probe).
pub const REF_BYTES: usize = 64 << 10;
/// The heartbeat period asked of the chosen daemon.
pub(crate) const BEAT_PERIOD_MS: u32 = 1000;

/// How the daemon is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Least predicted latency.
    Predicted,
    /// The first in list order that answered the probe.
    First,
}

/// What the probe learnt of one daemon.
#[derive(Clone, Copy, Debug)]
pub struct View {
    pub rtt: Duration,
    /// Bytes per second, client to daemon.
    pub bw: f64,
    pub beat: Beat,
}

/// A connection past its Welcome.
pub struct Conn {
    pub addr: String,
    pub sock: TcpStream,
    pub rd: FrameReader,
    /// The upload hashes the daemon's Welcome listed.
    pub held: HashSet<[u8; 32]>,
}

type Fail = (CuResult, String);

/// Predicted latency of the reference request, seconds. `prior`: the time per kernel
/// of a daemon that has run none yet (the least any candidate reported).
pub fn predict(v: &View, prior_ns: u64) -> f64 {
    let kernel = if v.beat.kernel_ns > 0 {
        v.beat.kernel_ns
    } else {
        prior_ns
    } as f64
        * 1e-9;
    let net = v.rtt.as_secs_f64() + REF_BYTES as f64 / v.bw.max(1e6);
    net + kernel * (1.0 + v.beat.queue as f64)
}

pub(crate) fn placement() -> Placement {
    match std::env::var(knobs::CUDA_REMOTE_PLACEMENT.var).as_deref() {
        Ok("") | Ok("predicted") | Err(_) => Placement::Predicted,
        Ok("first") => Placement::First,
        Ok(v) => {
            log(&format!(
                "{}={v}: expected {}; using predicted",
                knobs::CUDA_REMOTE_PLACEMENT.var,
                knobs::CUDA_REMOTE_PLACEMENT.form
            ));
            Placement::Predicted
        }
    }
}

pub(crate) fn explain() -> bool {
    match std::env::var(knobs::CUDA_REMOTE_PLACEMENT_LOG.var).as_deref() {
        Ok("1") => true,
        Ok("") | Ok("0") | Err(_) => false,
        Ok(v) => {
            log(&format!(
                "{}={v}: expected {}; not logging",
                knobs::CUDA_REMOTE_PLACEMENT_LOG.var,
                knobs::CUDA_REMOTE_PLACEMENT_LOG.form
            ));
            false
        }
    }
}

/// The daemons of the list (`host:port[,host:port...]`).
pub fn parse_list(list: &str) -> Result<Vec<String>, String> {
    let v: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    if v.is_empty() {
        return Err(format!(
            "{} is not set: no daemon to run CUDA calls on",
            knobs::CUDA_REMOTE.var
        ));
    }
    if v.len() > MAX_DAEMONS {
        return Err(format!(
            "{} names {} daemons; at most {MAX_DAEMONS}",
            knobs::CUDA_REMOTE.var,
            v.len()
        ));
    }
    Ok(v)
}

/// Connects to the daemon the list's placement picks (the only one, for a list of
/// one: no probe).
pub fn place(list: &str, timeout: Duration, probe_ms: u64) -> Result<Conn, Fail> {
    let addrs = parse_list(list).map_err(|e| (NO_DEVICE, e))?;
    if addrs.len() == 1 {
        return dial(&addrs[0], Instant::now() + timeout);
    }
    let (mut ok, why) = probe_all(&addrs, probe_ms);
    if ok.is_empty() {
        return Err((
            NO_DEVICE,
            format!("no daemon of the list answered: {}", why.join("; ")),
        ));
    }
    for w in &why {
        log(&format!("placement skips {w}"));
    }
    let ranked = rank(&ok, placement());
    if explain() {
        explain_views(&ok, ranked[0]);
    }
    Ok(ok.swap_remove(ranked[0]).1)
}

/// The order in which a session that lost its daemon tries the list again: by
/// placement (each daemon probed anew, within `probe_ms`), the ones that answered
/// first in order of predicted latency, then the rest in list order. With
/// `TOFFLOAD_CUDA_REMOTE_PLACEMENT=first`, or one daemon, plain list order from
/// `first`.
pub fn reconnect_order(addrs: &[String], first: usize, probe_ms: u64) -> Vec<usize> {
    let n = addrs.len();
    let listed: Vec<usize> = (0..n).map(|k| (first + k) % n).collect();
    if n == 1 || placement() == Placement::First {
        return listed;
    }
    let (ok, _) = probe_all(addrs, probe_ms);
    let ranked = rank(&ok, Placement::Predicted);
    if explain() && !ok.is_empty() {
        explain_views(&ok, ranked[0]);
    }
    let mut order: Vec<usize> = ranked.iter().map(|&k| ok[k].0).collect();
    let rest: Vec<usize> = listed.into_iter().filter(|i| !order.contains(i)).collect();
    order.extend(rest);
    order
}

/// Every daemon of `addrs` probed in parallel within `probe_ms`: those that answered
/// (list index, connection, view) in list order, and why the others did not.
pub(crate) fn probe_all(
    addrs: &[String],
    probe_ms: u64,
) -> (Vec<(usize, Conn, View)>, Vec<String>) {
    let deadline = Instant::now() + Duration::from_millis(probe_ms);
    let (tx, rx) = mpsc::channel();
    for (i, a) in addrs.iter().enumerate() {
        let (txc, a) = (tx.clone(), a.clone());
        let spawned = std::thread::Builder::new()
            .name("cuda-remote-probe".into())
            .spawn(move || {
                let _ = txc.send((i, probe(&a, deadline)));
            });
        if let Err(e) = spawned {
            let _ = tx.send((i, Err((NO_DEVICE, format!("probe thread: {e}")))));
        }
    }
    drop(tx);
    let mut got: Vec<Option<Result<(Conn, View), Fail>>> = addrs.iter().map(|_| None).collect();
    // Every probe ends by the deadline (its socket's timeouts are bounded by it); a
    // little slack for the thread to report.
    let end = deadline + Duration::from_millis(50);
    while got.iter().any(Option::is_none) {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((i, r)) => got[i] = Some(r),
            Err(_) => break,
        }
    }
    let mut why = Vec::new();
    let mut ok = Vec::new();
    for (i, g) in got.into_iter().enumerate() {
        match g {
            Some(Ok((c, v))) => ok.push((i, c, v)),
            Some(Err((_, e))) => why.push(e),
            None => why.push(format!(
                "daemon {}: no answer within {probe_ms} ms",
                addrs[i]
            )),
        }
    }
    (ok, why)
}

/// Indices into `ok` (non-empty), best first: by predicted latency (a daemon with no
/// kernel history taken at the least time per kernel another reported), or list
/// order.
fn rank(ok: &[(usize, Conn, View)], how: Placement) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..ok.len()).collect();
    if how == Placement::Predicted {
        let prior = prior_ns(ok);
        idx.sort_by(|&a, &b| predict(&ok[a].2, prior).total_cmp(&predict(&ok[b].2, prior)));
    }
    idx
}

/// A better daemon for a running task (mover.rs).
#[derive(Clone, Copy, Debug)]
pub struct Better {
    /// List index of the daemon to move to.
    pub to: usize,
    /// Predicted latency here and there, seconds.
    pub here: f64,
    pub there: f64,
}

/// Where a task running on list index `here`, with `own` of its kernels in that
/// daemon's queue, would do better: the other daemon of least predicted latency with
/// those kernels added to its queue (they would come along), if it predicts at most
/// `gain` of here. None when here did not answer the probe (a loss is the guardian's
/// business).
pub fn better(ok: &[(usize, Conn, View)], here: usize, own: u32, gain: f64) -> Option<Better> {
    let prior = prior_ns(ok);
    let (_, _, v_here) = ok.iter().find(|(i, _, _)| *i == here)?;
    let p_here = predict(v_here, prior);
    let (to, there) = ok
        .iter()
        .filter(|(i, _, _)| *i != here)
        .map(|(i, _, v)| {
            let mut v = *v;
            v.beat.queue = v.beat.queue.saturating_add(own);
            (*i, predict(&v, prior))
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))?;
    (there <= gain * p_here).then_some(Better {
        to,
        here: p_here,
        there,
    })
}

/// The time per kernel taken for a daemon with no kernel history: the least another
/// reported (0: none did).
fn prior_ns(ok: &[(usize, Conn, View)]) -> u64 {
    ok.iter()
        .map(|(_, _, v)| v.beat.kernel_ns)
        .filter(|&k| k > 0)
        .min()
        .unwrap_or(0)
}

/// TOFFLOAD_CUDA_REMOTE_PLACEMENT_LOG's lines.
fn explain_views(ok: &[(usize, Conn, View)], best: usize) {
    let prior = prior_ns(ok);
    for (k, (_, c, v)) in ok.iter().enumerate() {
        log(&format!(
            "placement: {} rtt {} us, {:.0} MB/s, queue {}, {} us per kernel: predicted {:.0} us{}",
            c.addr,
            v.rtt.as_micros(),
            v.bw / 1e6,
            v.beat.queue,
            v.beat.kernel_ns / 1000,
            predict(v, prior) * 1e6,
            if k == best { " (chosen)" } else { "" }
        ));
    }
}

/// Connect, hello, Welcome, by `deadline`.
fn dial(addr: &str, deadline: Instant) -> Result<Conn, Fail> {
    let fail = |e: std::io::Error| (NO_DEVICE, format!("daemon {addr}: {e}"));
    let left = || {
        let l = deadline.saturating_duration_since(Instant::now());
        if l.is_zero() {
            Err((NO_DEVICE, format!("daemon {addr}: no answer in time")))
        } else {
            Ok(l)
        }
    };
    let mut sock = crate::link::open(addr, deadline).map_err(|e| (NO_DEVICE, e))?;
    sock.set_write_timeout(Some(left()?)).map_err(fail)?;
    let mut id = [0u8; 8];
    openssl::rand::rand_bytes(&mut id).map_err(|e| (NO_DEVICE, e.to_string()))?;
    let mut out = Vec::new();
    frame::encode(
        &Msg::Hello {
            version: frame::VERSION,
            client_id: u64::from_le_bytes(id),
        },
        &mut out,
    );
    send_all(&sock, &out).map_err(fail)?;
    let mut rd = FrameReader::new();
    loop {
        if let Some(body) = rd
            .next_frame()
            .map_err(|e| (NO_DEVICE, format!("daemon {addr}: {e}")))?
        {
            match frame::decode(body) {
                Ok(Msg::Welcome { chunks, .. }) => {
                    let held = chunks.into_iter().collect();
                    return Ok(Conn {
                        addr: addr.to_string(),
                        sock,
                        rd,
                        held,
                    });
                }
                Ok(Msg::Refused { reason }) => {
                    return Err((NO_DEVICE, format!("daemon {addr} refused us: {reason}")))
                }
                other => return Err((NO_DEVICE, format!("daemon {addr}: unexpected {other:?}"))),
            }
        }
        sock.set_read_timeout(Some(left()?)).map_err(fail)?;
        match rd.fill(&mut sock) {
            Ok(0) => return Err((NO_DEVICE, format!("daemon {addr} closed the connection"))),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err((NO_DEVICE, format!("daemon {addr}: no answer in time")))
            }
            Err(e) => return Err(fail(e)),
        }
    }
}

/// What the probe waits for.
#[derive(Default)]
struct Seen {
    pongs: u64,
    beat: Option<Beat>,
    answered: bool,
}

/// Reads frames until `done(seen)`, by `deadline`.
fn read_until(
    c: &mut Conn,
    deadline: Instant,
    seen: &mut Seen,
    done: impl Fn(&Seen) -> bool,
) -> Result<(), Fail> {
    let addr = c.addr.clone();
    let bad = |e: String| (NO_DEVICE, format!("daemon {addr}: {e}"));
    loop {
        while let Some(body) = c.rd.next_frame().map_err(|e| bad(e.to_string()))? {
            match frame::decode(body) {
                Ok(Msg::Pong { .. }) => seen.pongs += 1,
                Ok(Msg::CudaNotes { notes }) => {
                    let mut r = wire::Reader::new(notes);
                    while let Some(n) = r.note().map_err(|e| bad(e.to_string()))? {
                        match n {
                            Note::Heartbeat(b) => seen.beat = Some(b),
                            Note::Answer { .. } => seen.answered = true,
                            _ => {}
                        }
                    }
                }
                Ok(Msg::Refused { reason }) => return Err(bad(format!("refused: {reason}"))),
                other => return Err(bad(format!("unexpected {other:?}"))),
            }
        }
        if done(seen) {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(bad("no answer in time".into()));
        }
        c.sock
            .set_read_timeout(Some(left))
            .map_err(|e| bad(e.to_string()))?;
        match c.rd.fill(&mut c.sock) {
            Ok(0) => return Err(bad("closed the connection".into())),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(bad("no answer in time".into()))
            }
            Err(e) => return Err(bad(e.to_string())),
        }
    }
}

fn send(c: &Conn, msgs: &[Msg<'_>]) -> Result<(), Fail> {
    let mut out = Vec::new();
    for m in msgs {
        frame::encode(m, &mut out);
    }
    send_all(&c.sock, &out).map_err(|e| (NO_DEVICE, format!("daemon {}: {e}", c.addr)))
}

/// One daemon's probe: its connection and what it measured.
fn probe(addr: &str, deadline: Instant) -> Result<(Conn, View), Fail> {
    let mut c = dial(addr, deadline)?;
    let mut seen = Seen::default();
    let mut calls = Vec::new();
    wire::put_call(
        &Call::Watch {
            period_ms: BEAT_PERIOD_MS,
        },
        &mut calls,
    );
    send(&c, &[Msg::Cuda { calls: &calls }, Msg::Ping { token: 1 }])?;
    let t = Instant::now();
    read_until(&mut c, deadline, &mut seen, |s| s.pongs >= 1)?;
    let mut rtt = t.elapsed();
    let t = Instant::now();
    send(&c, &[Msg::Ping { token: 2 }])?;
    read_until(&mut c, deadline, &mut seen, |s| s.pongs >= 2)?;
    rtt = rtt.min(t.elapsed());
    // The padded probe twice, the quicker counting (a scheduling hiccup of either
    // host is not the link).
    let pad = vec![0u8; REF_BYTES];
    let mut calls = Vec::new();
    wire::put_call(
        &Call::Probe {
            req: u64::MAX,
            pad: &pad,
        },
        &mut calls,
    );
    let mut padded = Duration::MAX;
    for _ in 0..2 {
        seen.answered = false;
        let t = Instant::now();
        send(&c, &[Msg::Cuda { calls: &calls }])?;
        read_until(&mut c, deadline, &mut seen, |s| s.answered)?;
        padded = padded.min(t.elapsed());
    }
    read_until(&mut c, deadline, &mut seen, |s| s.beat.is_some())?;
    let moved = padded.saturating_sub(rtt).max(Duration::from_micros(1));
    let bw = REF_BYTES as f64 / moved.as_secs_f64();
    let beat = seen.beat.expect("waited for");
    Ok((c, View { rtt, bw, beat }))
}
