//! Moving a running task to a daemon that has become the better choice. Placement
//! (sched.rs) picks a daemon when the program starts; a long-lived server stays on it
//! while another client may load that GPU or another daemon become free. Every
//! TOFFLOAD_CUDA_REMOTE_MOVE_MS the mover thread probes the list again as placement
//! does, and compares what one more request would wait: here, with the queue as it
//! is (our own kernels in it), and on each other daemon with our own kernels added to
//! its queue (they would come along: our session's heartbeat says how many are
//! ours). A daemon predicted at most [`MOVE_GAIN`] of here is worth the move.
//!
//! The move happens right after the program's next synchronize, with the guardian's
//! machinery (replay.rs, guard.rs): the session's journal replayed on a connection to
//! the new daemon made beforehand, as after a loss, but planned. The receiver is
//! parked first (the send lock held, so no call of the program goes out and answers
//! stop; a short read timeout, and a ping whose answer wakes a read already blocked),
//! so the state is frozen. A journal that cannot be replayed, device memory only the
//! daemon holds (a kernel's output nothing read back: a loss makes it an error later,
//! a move would lose it) or a table of device addresses (Journal::unmovable) leaves
//! the task where it is, on its intact connection. Only once the replay can take is
//! the old connection closed. Work of other threads since their own last synchronize
//! is replayed there, as after a loss; nothing is delivered twice.

use crate::remote::{dial, lock, log, send_all, Dialed, Remote};
use crate::sched::{self, Placement};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// A daemon predicted at most this share of here's latency is worth a move (the
/// probe's noise and the replay's cost are not).
pub const MOVE_GAIN: f64 = 2.0 / 3.0;

/// How long the receiver gets to notice that it must park (its read timeout while
/// a move is under way, plus slack for the frames it is handling).
const PARK_READ: Duration = Duration::from_millis(20);

/// Where a move stands, between the mover and the receiver.
pub(crate) enum Cut {
    /// No move.
    Idle,
    /// The mover asks the receiver to park at its next read.
    Cutting,
    /// The receiver is parked: the session's state is frozen.
    Parked,
    /// The move did not happen: read the old connection on.
    Resume,
    /// Moved: the new connection's receiving side.
    Moved(TcpStream, crate::frame::FrameReader),
    /// The old connection is closed and the move failed: recover as after a loss.
    Failed(String),
}

/// What the receiver is told when its read timed out.
pub(crate) enum Parked {
    /// No move asked: a stray timeout, read on.
    NotAsked,
    Resume,
    Moved(TcpStream, crate::frame::FrameReader),
    Failed(String),
}

impl Remote {
    /// The mover's loop (a thread of its own, started only where a move is possible:
    /// several daemons, the guardian on, placement by prediction).
    pub(crate) fn mover(self: std::sync::Arc<Self>) {
        let period = Duration::from_millis(self.move_ms);
        // Moves given up in a row: each doubles the pause before the next try (the
        // program may hold device-only state for a long while).
        let mut streak = 0u32;
        loop {
            std::thread::sleep(period * (1u32 << streak.min(6)));
            if self.dead().is_some() {
                return;
            }
            let unmovable = lock(&self.st).journal.unmovable();
            if let Some(why) = unmovable {
                streak += 1;
                self.refuse(&self.addrs[self.at.load(Relaxed)], why);
                continue;
            }
            let here = self.at.load(Relaxed);
            let (ok, _) = sched::probe_all(&self.addrs, self.probe_ms);
            let own = self.own.load(Relaxed).min(u32::MAX as u64) as u32;
            let Some(m) = sched::better(&ok, here, own, MOVE_GAIN) else {
                streak = 0;
                continue;
            };
            drop(ok);
            if sched::explain() {
                log(&format!(
                    "placement: {} predicted {:.0} us against {:.0} us on {} ({own} kernels ours): \
                     moving at the next synchronize",
                    self.addrs[m.to],
                    m.there * 1e6,
                    m.here * 1e6,
                    self.addrs[here]
                ));
            }
            let d = match dial(&self.addrs[m.to], self.client_id, self.timeout.min(period)) {
                Ok(d) => d,
                Err(_) => continue,
            };
            if !self.next_sync(period) || self.at.load(Relaxed) != here || self.dead().is_some() {
                continue;
            }
            if self.move_to(here, m, d) {
                streak = 0;
            } else {
                streak += 1;
            }
        }
    }

    /// Waits up to `within` for the program's next synchronize.
    fn next_sync(&self, within: Duration) -> bool {
        let seen = self.synced.load(Relaxed);
        let end = Instant::now() + within;
        while Instant::now() < end {
            if self.synced.load(Relaxed) != seen {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    fn set_cut(&self, c: Cut) {
        *lock(&self.cut) = c;
        self.cut_cv.notify_all();
    }

    /// A move given up: said once per session (with TOFFLOAD_CUDA_REMOTE_PLACEMENT_LOG).
    fn refuse(&self, from: &str, why: &str) {
        if self.refusals.fetch_add(1, Relaxed) == 0 && sched::explain() {
            log(&format!("placement: staying on {from}: {why}"));
        }
    }

    /// The move itself (module doc); whether it was not given up.
    fn move_to(&self, here: usize, m: sched::Better, d: Dialed) -> bool {
        let (from, to) = (self.addrs[here].clone(), self.addrs[m.to].clone());
        self.set_cut(Cut::Cutting);
        // The send lock from here on: no call of the program goes out, so answers
        // stop coming and the receiver's read times out. A read already blocked keeps
        // the timeout it started with: a ping's answer wakes it within a round trip.
        let mut tx = lock(&self.tx);
        let _ = tx.sock.set_read_timeout(Some(PARK_READ));
        let mut ping = Vec::new();
        crate::frame::encode(&crate::frame::Msg::Ping { token: 0 }, &mut ping);
        let _ = send_all(&tx.sock, &ping);
        let parked = {
            let deadline = Instant::now() + self.timeout;
            let mut c = lock(&self.cut);
            while !matches!(*c, Cut::Parked) && Instant::now() < deadline {
                c = self
                    .cut_cv
                    .wait_timeout(c, PARK_READ)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            let parked = matches!(*c, Cut::Parked);
            if !parked {
                *c = Cut::Idle;
            }
            parked
        };
        let _ = tx.sock.set_read_timeout(None);
        if !parked {
            return true;
        }
        // A loss replays what it can and makes the rest an error later; a move is
        // chosen, so it must lose nothing.
        let stay = {
            let st = lock(&self.st);
            match st.journal.unmovable() {
                Some(why) => Some(why.to_string()),
                None => st.journal.plan(self.cache_min).err(),
            }
        };
        if let Some(why) = stay {
            self.refuse(&from, &why);
            self.set_cut(Cut::Resume);
            return false;
        }
        let _ = tx.sock.shutdown(Shutdown::Both);
        let said = |calls| {
            format!(
                "moved from {from} to {to} at a synchronize: predicted {:.0} us there against \
                 {:.0} us here; replayed the session ({calls} calls)",
                m.there * 1e6,
                m.here * 1e6
            )
        };
        match self.replay_with(&mut tx, d, said) {
            Ok((rx, rd)) => {
                self.at.store(m.to, Relaxed);
                self.moves.fetch_add(1, Relaxed);
                self.set_cut(Cut::Moved(rx, rd));
            }
            Err(e) => self.set_cut(Cut::Failed(format!("moving to {to}: {e}"))),
        }
        true
    }

    /// The receiver's side, when its read timed out.
    pub(crate) fn park(&self) -> Parked {
        let mut c = lock(&self.cut);
        if !matches!(*c, Cut::Cutting) {
            return Parked::NotAsked;
        }
        *c = Cut::Parked;
        self.cut_cv.notify_all();
        // The mover answers within its replay's bound (the connect and read timeout).
        let deadline = Instant::now() + self.timeout * 2;
        loop {
            match std::mem::replace(&mut *c, Cut::Idle) {
                Cut::Resume => return Parked::Resume,
                Cut::Moved(s, r) => return Parked::Moved(s, r),
                Cut::Failed(why) => return Parked::Failed(why),
                other => *c = other,
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                *c = Cut::Idle;
                return Parked::Failed("the move did not finish in time".into());
            }
            c = self
                .cut_cv
                .wait_timeout(c, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Whether this session gets a mover.
    pub(crate) fn movable(&self) -> bool {
        self.move_ms > 0
            && self.addrs.len() > 1
            && self.guarded()
            && sched::placement() == Placement::Predicted
    }
}
