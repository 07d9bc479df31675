//! The daemon's state under its one lock. Per client id: the identity that owns it,
//! every op between its arrival and the client's acknowledgement of its result,
//! tombstones of acknowledged ones until the client's watermark passes them (a resent
//! op that is running or done is not run again, which is what makes each op run
//! once), and what the client holds against the daemon's bounds.

use super::conn::EventFd;
use super::journal::{Journal, Rec};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub enum Entry {
    /// Accepted, not finished: `bytes` count against the client's in-flight bound.
    Running {
        bytes: usize,
    },
    /// Finished; held until acknowledged (or past the held bounds).
    Done {
        status: i32,
        data: Arc<[u8]>,
        at: Instant,
    },
    Acked,
    /// Dropped unacknowledged past the held bounds: not run again; a resend is
    /// answered ETIMEDOUT.
    Expired,
}

/// A result to send: (seq, status, bytes).
pub type Outgoing = (u64, i32, Arc<[u8]>);

/// What a connection's thread has to send.
pub struct ConnOut {
    pub id: u64,
    pub results: Mutex<Vec<Outgoing>>,
    pub closed: AtomicBool,
    pub wake: EventFd,
    /// Encoded CUDA notes (cuda_wire.rs) to send, one per entry.
    pub cuda: Mutex<Vec<Vec<u8>>>,
}

pub struct Client {
    /// The identity that opened this client id (None: replayed from a journal that
    /// did not record it; the first identity to say hello takes it).
    pub owner: Option<String>,
    pub entries: BTreeMap<u64, Entry>,
    pub watermark: u64,
    pub conn: Option<Arc<ConnOut>>,
    pub inflight_ops: usize,
    pub inflight_bytes: usize,
    pub held_bytes: usize,
}

impl Client {
    pub fn new(owner: Option<String>) -> Client {
        Client {
            owner,
            entries: BTreeMap::new(),
            watermark: 0,
            conn: None,
            inflight_ops: 0,
            inflight_bytes: 0,
            held_bytes: 0,
        }
    }

    fn account(&mut self, e: &Entry, add: bool) {
        let (ops, bytes, held) = match e {
            Entry::Running { bytes } => (1, *bytes, 0),
            Entry::Done { data, .. } => (0, 0, data.len()),
            Entry::Acked | Entry::Expired => (0, 0, 0),
        };
        if add {
            self.inflight_ops += ops;
            self.inflight_bytes += bytes;
            self.held_bytes += held;
        } else {
            self.inflight_ops -= ops;
            self.inflight_bytes -= bytes;
            self.held_bytes -= held;
        }
    }

    /// Sets the entry of `seq`, keeping the counters right.
    pub fn put(&mut self, seq: u64, e: Entry) {
        self.account(&e, true);
        if let Some(old) = self.entries.insert(seq, e) {
            self.account(&old, false);
        }
    }

    pub fn remove(&mut self, seq: u64) {
        if let Some(old) = self.entries.remove(&seq) {
            self.account(&old, false);
        }
    }

    /// Every seq below `wm` is finished for the client: forgotten, except ops still
    /// running (their bytes are still held by an executor; `complete` drops them).
    pub fn raise_watermark(&mut self, wm: u64) {
        if wm <= self.watermark {
            return;
        }
        let keep = self.entries.split_off(&wm);
        let below = std::mem::replace(&mut self.entries, keep);
        for (seq, e) in below {
            if matches!(e, Entry::Running { .. }) {
                self.entries.insert(seq, e);
            } else {
                self.account(&e, false);
            }
        }
        self.watermark = wm;
    }

    /// Drops held results older than `max_age` (None: no age bound), then the oldest
    /// until at most `max_bytes` are held. Returns how many were dropped.
    pub fn expire(&mut self, max_bytes: usize, max_age: Option<(Instant, Duration)>) -> u64 {
        let mut dropped = Vec::new();
        let mut held = self.held_bytes;
        for (&seq, e) in &self.entries {
            if let Entry::Done { data, at, .. } = e {
                let old = max_age.is_some_and(|(now, age)| now.duration_since(*at) > age);
                if old || held > max_bytes {
                    held -= data.len();
                    dropped.push(seq);
                }
            }
        }
        for &seq in &dropped {
            self.put(seq, Entry::Expired);
        }
        dropped.len() as u64
    }

    /// Nothing left to remember.
    pub fn is_idle(&self) -> bool {
        self.conn.is_none() && self.entries.is_empty() && self.watermark == 0
    }
}

#[derive(Default)]
pub struct Counters {
    pub executions: u64,
    pub executions_total: u64,
    pub executed_twice: u64,
    pub duplicates_suppressed: u64,
    pub results_resent: u64,
    pub ops_received: u64,
    pub missing_chunks: u64,
    pub connections: u64,
    pub refused: u64,
    pub malformed: u64,
    /// Ops answered ENOBUFS: past the client's in-flight bounds.
    pub ops_over_limit: u64,
    /// Frames refused (connection closed): past the per-frame assembly bound.
    pub frames_refused: u64,
    /// Hellos refused: the client id belongs to another identity.
    pub takeovers_refused: u64,
    /// Connections closed at accept: past the total or per-peer bound.
    pub conns_refused: u64,
    pub handshake_timeouts: u64,
    pub idle_closed: u64,
    pub out_queue_closed: u64,
    /// Held results dropped past the held bounds.
    pub results_expired: u64,
    /// Damaged journal stretches found at start (records after them recovered).
    pub journal_damaged: u64,
    pub journal_write_errors: u64,
    /// CUDA remoting: frames, calls and the calls' bytes received, synchronize points
    /// (round trips the client waited on), uploads served from the cache (and the
    /// bytes not resent), uploads sent in full, calls that failed.
    pub cuda_frames: u64,
    pub cuda_bytes: u64,
    pub cuda_calls: u64,
    pub cuda_syncs: u64,
    pub cuda_upload_hits: u64,
    pub cuda_upload_bytes_saved: u64,
    pub cuda_upload_misses: u64,
    pub cuda_failed: u64,
}

pub struct Core {
    pub clients: HashMap<u64, Client>,
    pub journal: Option<Journal>,
    /// A journal write failed: new ops are refused (EIO) until a restart.
    pub journal_failed: bool,
    pub n: Counters,
    pub seen: HashSet<(u64, u64)>,
    pub seen_order: VecDeque<(u64, u64)>,
}

impl Core {
    pub fn new() -> Core {
        Core {
            clients: HashMap::new(),
            journal: None,
            journal_failed: false,
            n: Counters::default(),
            seen: HashSet::new(),
            seen_order: VecDeque::new(),
        }
    }

    fn client(&mut self, id: u64) -> &mut Client {
        self.clients.entry(id).or_insert_with(|| Client::new(None))
    }

    pub fn replay(&mut self, recs: Vec<Rec>) {
        let now = Instant::now();
        for r in recs {
            if matches!(r, Rec::Exec { .. }) {
                self.n.executions_total += 1;
            }
            match r {
                Rec::Total { executions } => self.n.executions_total = executions,
                Rec::Exec {
                    client,
                    seq,
                    status,
                    data,
                }
                | Rec::Held {
                    client,
                    seq,
                    status,
                    data,
                } => {
                    let c = self.client(client);
                    if seq >= c.watermark {
                        c.put(
                            seq,
                            Entry::Done {
                                status,
                                data,
                                at: now,
                            },
                        );
                    }
                }
                Rec::Ack { client, seq } => {
                    let c = self.client(client);
                    if seq >= c.watermark {
                        c.put(seq, Entry::Acked);
                    }
                }
                Rec::Watermark { client, wm } => self.client(client).raise_watermark(wm),
                Rec::Owner { client, identity } => self.client(client).owner = Some(identity),
            }
        }
    }

    /// What the journal must keep (cheap: results are shared, not copied).
    pub fn snapshot(&self) -> Vec<Rec> {
        let mut v = vec![Rec::Total {
            executions: self.n.executions_total,
        }];
        for (&client, c) in &self.clients {
            if let Some(o) = &c.owner {
                v.push(Rec::Owner {
                    client,
                    identity: o.clone(),
                });
            }
            v.push(Rec::Watermark {
                client,
                wm: c.watermark,
            });
            for (&seq, e) in &c.entries {
                match e {
                    Entry::Done { status, data, .. } => v.push(Rec::Held {
                        client,
                        seq,
                        status: *status,
                        data: Arc::clone(data),
                    }),
                    // An expired result is a tombstone like an acknowledged one.
                    Entry::Acked | Entry::Expired => v.push(Rec::Ack { client, seq }),
                    // Not journaled yet: run again if resent.
                    Entry::Running { .. } => {}
                }
            }
        }
        v
    }
}

impl Default for Core {
    fn default() -> Self {
        Core::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(n: usize, at: Instant) -> Entry {
        Entry::Done {
            status: 0,
            data: vec![0; n].into(),
            at,
        }
    }

    #[test]
    fn counters_follow_entries_and_bounds_drop_the_oldest() {
        let t0 = Instant::now();
        let mut c = Client::new(None);
        c.put(1, Entry::Running { bytes: 100 });
        c.put(2, Entry::Running { bytes: 50 });
        assert_eq!((c.inflight_ops, c.inflight_bytes), (2, 150));
        c.put(1, done(100, t0));
        assert_eq!(
            (c.inflight_ops, c.inflight_bytes, c.held_bytes),
            (1, 50, 100)
        );
        // A watermark past a running op keeps it counted until it finishes.
        c.raise_watermark(3);
        assert_eq!((c.inflight_ops, c.held_bytes), (1, 0));
        c.remove(2);
        assert_eq!((c.inflight_ops, c.inflight_bytes), (0, 0));
        for s in 3..8 {
            c.put(s, done(100, t0 + Duration::from_secs(s)));
        }
        // Bytes: the oldest go until 250 are held.
        assert_eq!(c.expire(250, None), 3);
        assert_eq!(c.held_bytes, 200);
        assert!(matches!(c.entries[&3], Entry::Expired));
        // Age: at t0+21 with 14 s allowed, 6 (15 s old) goes, 7 (14 s) stays.
        assert_eq!(
            c.expire(
                1 << 20,
                Some((t0 + Duration::from_secs(21), Duration::from_secs(14)))
            ),
            1
        );
        assert_eq!(c.held_bytes, 100);
        assert!(matches!(c.entries[&7], Entry::Done { .. }));
    }
}
