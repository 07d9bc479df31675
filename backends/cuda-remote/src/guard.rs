//! The context consistency guardian's reconnection: after the connection to the
//! daemon is lost, the receiver thread connects to a daemon of the list, round after
//! round with a growing pause, until TOFFLOAD_CUDA_REMOTE_RECONNECT_MS: each round
//! placed again (sched.rs: every daemon probed anew, the least predicted latency
//! first; with placement `first` or one daemon, the same one first, then list order), and replays the session's journal there
//! (replay.rs), holding the send lock so that no call of the program slips in
//! between; the program's waits simply see their answers come from the new daemon.
//! A journal that cannot be replayed, or no daemon in time, fails every call from
//! then on with CUDA_ERROR_DEVICE_UNAVAILABLE and one line on stderr saying why.

use crate::frame::{self, FrameReader, Msg};
use crate::remote::{dial, lock, log, send_all, Dialed, PendKind, Remote, Tx, DEVICE_UNAVAILABLE};
use crate::wire::{self, Call};
use std::net::TcpStream;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// Why one replay did not take.
pub(crate) enum Failed {
    /// The new connection failed too: try the next daemon.
    Conn(String),
    /// The journal cannot rebuild the session: give up.
    Cannot(String),
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::Conn(e) | Failed::Cannot(e) => f.write_str(e),
        }
    }
}

/// Sends encoded calls as `Cuda` frames of up to 1 MiB of calls each.
fn send_calls(sock: &TcpStream, calls: &[Vec<u8>]) -> Result<(), Failed> {
    let mut batch = Vec::new();
    let mut out = Vec::new();
    let mut flush = |batch: &mut Vec<u8>| -> Result<(), Failed> {
        if batch.is_empty() {
            return Ok(());
        }
        out.clear();
        frame::encode(&Msg::Cuda { calls: batch }, &mut out);
        batch.clear();
        send_all(sock, &out).map_err(|e| Failed::Conn(format!("replaying: {e}")))
    };
    for c in calls {
        if batch.len() + c.len() > (1 << 20) {
            flush(&mut batch)?;
        }
        batch.extend_from_slice(c);
    }
    flush(&mut batch)
}

impl Remote {
    /// Reconnects and replays after the connection was lost (`why`); the new
    /// connection's socket and reader for the receiver, or None (every call fails).
    pub(crate) fn recover(&self, why: &str) -> Option<(TcpStream, FrameReader)> {
        let first = self.at.load(Relaxed);
        let lost_addr = self.addrs[first].clone();
        let deadline = Instant::now() + self.reconnect;
        let mut pause = Duration::from_millis(20);
        let n = self.addrs.len();
        let mut tries = 0usize;
        let mut last = String::new();
        let mut order: Vec<usize> = Vec::new();
        loop {
            if tries.is_multiple_of(n) {
                // Each pass over the list, placed again: the daemons probed anew, the
                // least predicted latency first (the lost one, if it answers at all,
                // only where it still predicts best).
                // The probes end within the reconnect bound too.
                let left_ms = deadline
                    .saturating_duration_since(Instant::now())
                    .as_millis()
                    .max(1) as u64;
                order =
                    crate::sched::reconnect_order(&self.addrs, first, self.probe_ms.min(left_ms));
            }
            let i = order[tries % n];
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.give_up(&format!(
                    "lost the daemon {lost_addr} ({why}) and none of {} answered within {:?} \
                     (last: {last})",
                    self.addrs.join(","),
                    self.reconnect
                ));
                return None;
            }
            let addr = self.addrs[i].clone();
            match dial(&addr, self.client_id, left.min(self.timeout)) {
                Ok(d) => match self.replay(d, |calls| {
                    format!(
                        "lost the daemon {lost_addr} ({why}); reconnected to {addr} and \
                         replayed the session ({calls} calls)"
                    )
                }) {
                    Ok((sock, rd)) => {
                        self.at.store(i, Relaxed);
                        return Some((sock, rd));
                    }
                    Err(Failed::Cannot(e)) => {
                        self.give_up(&format!(
                            "lost the daemon {lost_addr} ({why}) and cannot replay the session: {e}"
                        ));
                        return None;
                    }
                    Err(Failed::Conn(e)) => last = e,
                },
                Err(e) => last = e,
            }
            tries += 1;
            if tries.is_multiple_of(n) {
                std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                pause = (pause * 2).min(Duration::from_secs(1));
            }
        }
    }

    /// Every call fails from now on, one line says why.
    fn give_up(&self, why: &str) {
        let mut st = lock(&self.st);
        if st.dead.is_none() {
            st.dead = Some(DEVICE_UNAVAILABLE);
            log(&format!(
                "{why}: CUDA calls fail with CUDA_ERROR_DEVICE_UNAVAILABLE"
            ));
        }
        drop(st);
        self.wake_all();
    }

    /// The journal onto a fresh connection: the base, a synchronizing marker it
    /// waits for here (work in the log must not start before the base's uploads are
    /// in place), then the log and the queries still unanswered.
    /// `said`: the line that says it happened, given the calls replayed (logged
    /// before any call of the program can run on, so that it precedes what follows).
    fn replay(
        &self,
        d: Dialed,
        said: impl FnOnce(usize) -> String,
    ) -> Result<(TcpStream, FrameReader), Failed> {
        let mut tx = lock(&self.tx);
        self.replay_with(&mut tx, d, said)
    }

    /// replay() with the send lock already held (a planned move: mover.rs).
    pub(crate) fn replay_with(
        &self,
        tx: &mut Tx,
        d: Dialed,
        said: impl FnOnce(usize) -> String,
    ) -> Result<(TcpStream, FrameReader), Failed> {
        let Dialed {
            mut sock,
            mut rd,
            held,
        } = d;
        // What the batch held is in the journal.
        tx.batch.clear();
        let (plan, asks) = {
            let st = lock(&self.st);
            let plan = st.journal.plan(self.cache_min).map_err(Failed::Cannot)?;
            let asks: Vec<Vec<u8>> = st.asks.values().cloned().collect();
            (plan, asks)
        };
        *lock(&self.held) = held;
        send_calls(&sock, &plan.base)?;
        let seq = self.track(wire::NULL_STREAM, |_| PendKind::Mark);
        let mut m = Vec::new();
        wire::put_call(
            &Call::Marker {
                stream: wire::NULL_STREAM,
                seq,
                sync: true,
            },
            &mut m,
        );
        send_calls(&sock, &[m])?;
        let conn = |e: String| Failed::Conn(e);
        let _ = sock.set_read_timeout(Some(self.timeout));
        while !self.reported(seq) {
            self.frames(&mut rd).map_err(conn)?;
            if self.reported(seq) {
                break;
            }
            match rd.fill(&mut sock) {
                Ok(0) => return Err(conn("the daemon closed the connection".into())),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(conn(format!("replaying: {e}"))),
            }
        }
        let _ = sock.set_read_timeout(None);
        send_calls(&sock, &plan.log)?;
        send_calls(&sock, &asks)?;
        let rx = sock
            .try_clone()
            .map_err(|e| Failed::Conn(format!("replaying: {e}")))?;
        log(&said(plan.calls + 1 + asks.len()));
        lock(&self.st)
            .lost
            .extend(plan.lost.into_iter().map(|(a, n)| (a, (n, false))));
        tx.sock = sock;
        Ok((rx, rd))
    }
}
