//! The client side: `Remote`, an `Accelerator` whose ops run on `toffload-remoted`
//! daemons. Submit copies the op's bytes, takes a slot and hands the op to one I/O
//! thread per `Remote`, which owns every connection: it places each op on a daemon,
//! coalesces small ops into frames, streams results back into the callers' buffers
//! and signals the completion eventfd. Until its result arrives an op stays in its
//! daemon's `inflight` table; when a connection breaks the thread reconnects with
//! exponential backoff and sends again everything without a result, under the same
//! sequence numbers, which the daemon uses to run each op once.

use super::chunk;
use super::config::{Placement, RemoteConfig};
use super::conn::{self, Conn, EventFd, Stream};
use super::frame::{
    self, Load, Msg, Op, OpKind, Payload, Piece, MAX_OPS_PER_FRAME, MAX_OP_BYTES,
    STATUS_MISSING_CHUNK, VERSION,
};
use crate::slots::{Slots, CANCELLED, DONE, FAILED, PENDING, RUNNING, WAITER};
use crate::{AccelError, Accelerator, OpId, OpState};
use openssl::ssl::SslConnector;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A frame is sent once this many bytes of ops wait, without waiting out the delay.
const COALESCE_BYTES: usize = 64 << 10;
/// Ops per frame at most (below the protocol's bound).
const OPS_PER_FRAME: usize = 1024;
/// Payload bytes per frame at most (a larger op goes alone).
const FRAME_BYTES: usize = 1 << 20;
/// New frames are built only while less than this is waiting in the socket's buffer.
const OUT_HIGH_WATER: usize = 512 << 10;
const BACKOFF_MIN: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// With ops outstanding and nothing heard for this long, ping; for PING_DEAD, drop.
const PING_AFTER: Duration = Duration::from_millis(500);
const PING_DEAD: Duration = Duration::from_secs(3);
/// Acks not piggybacked on ops go out alone after this long (or at ACK_BATCH).
const ACK_DELAY: Duration = Duration::from_millis(2);
const ACK_BATCH: usize = 2048;
/// Chunk hashes remembered as held by one daemon.
const KNOWN_CHUNKS_MAX: usize = 1 << 20;

#[derive(Clone, Copy, Default)]
struct OpRec {
    buf: usize,
    len: usize,
}

/// Counters, for tests and benchmarks.
#[derive(Debug, Default)]
pub struct ClientStats {
    pub submitted: AtomicU64,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub timed_out: AtomicU64,
    pub frames_sent: AtomicU64,
    pub ops_sent: AtomicU64,
    pub resent: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub payload_bytes: AtomicU64,
    pub chunk_refs: AtomicU64,
    pub chunk_ref_bytes: AtomicU64,
    pub missing_chunks: AtomicU64,
    pub connects: AtomicU64,
    pub connect_failures: AtomicU64,
    pub disconnects: AtomicU64,
    pub duplicate_results: AtomicU64,
    /// Refusals from a daemon (a hello or a frame), reason in `last_refusal`.
    pub refusals: AtomicU64,
    /// Ops a daemon answered ENOBUFS: past its per-client bounds (not run).
    pub over_limit: AtomicU64,
}

/// A snapshot of [`ClientStats`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientCounters {
    pub submitted: u64,
    pub completed: u64,
    pub failed: u64,
    pub timed_out: u64,
    pub frames_sent: u64,
    pub ops_sent: u64,
    pub resent: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub payload_bytes: u64,
    pub chunk_refs: u64,
    pub chunk_ref_bytes: u64,
    pub missing_chunks: u64,
    pub connects: u64,
    pub connect_failures: u64,
    pub disconnects: u64,
    pub duplicate_results: u64,
    pub refusals: u64,
    pub over_limit: u64,
    /// Ops placed on each endpoint.
    pub per_endpoint: Vec<u64>,
}

struct Submission {
    index: u32,
    generation: u32,
    kind: OpKind,
    data: Vec<u8>,
    submitted: Instant,
}

struct Shared {
    cfg: RemoteConfig,
    slots: Slots<OpRec>,
    /// errno of a FAILED slot.
    errs: Box<[AtomicI32]>,
    queue: Mutex<Vec<Submission>>,
    io_sleeping: AtomicBool,
    wake: EventFd,
    done: EventFd,
    bytes_in_flight: AtomicUsize,
    stop: AtomicBool,
    client_id: u64,
    stats: ClientStats,
    placed: Box<[AtomicU64]>,
    tls: Option<SslConnector>,
    /// The last reason a daemon gave for refusing us (`host:port: reason`).
    last_refusal: Mutex<Option<String>>,
}

/// The remote backend.
pub struct Remote {
    sh: Arc<Shared>,
    io: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn ioerr(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// A daemon's `Refused` frame (at hello or later): its reason, kept for the caller.
#[derive(Debug)]
struct Refusal(String);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "daemon refused: {}", self.0)
    }
}

impl std::error::Error for Refusal {}

fn refused(reason: &str) -> io::Error {
    io::Error::other(Refusal(reason.to_string()))
}

impl Remote {
    /// Starts the I/O thread; connections are made in the background (ops submitted
    /// before a daemon answers wait for it, up to their deadline).
    pub fn new(cfg: RemoteConfig) -> io::Result<Remote> {
        if cfg.endpoints.is_empty() {
            return Err(ioerr(
                "TOFFLOAD_BACKEND=remote needs TOFFLOAD_REMOTE=host:port[,host:port...]",
            ));
        }
        let tls = match (&cfg.tls, &cfg.psk) {
            (Some(_), Some(_)) => return Err(ioerr(
                "TOFFLOAD_REMOTE_PSK and the TOFFLOAD_REMOTE_TLS_* certificates exclude each other",
            )),
            (Some(f), None) => Some(super::tls::connector(f).map_err(ioerr)?),
            (None, Some(p)) => Some(
                super::tls::read_client_psk(p)
                    .and_then(super::tls::psk_connector)
                    .map_err(|e| ioerr(format!("TOFFLOAD_REMOTE_PSK: {e}")))?,
            ),
            (None, None) => None,
        };
        let n = cfg.endpoints.len();
        let sh = Arc::new(Shared {
            slots: Slots::new(cfg.window),
            errs: (0..cfg.window).map(|_| AtomicI32::new(0)).collect(),
            queue: Mutex::new(Vec::with_capacity(1024)),
            io_sleeping: AtomicBool::new(false),
            wake: EventFd::new()?,
            done: EventFd::new()?,
            bytes_in_flight: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            client_id: conn::random_u64()?,
            stats: ClientStats::default(),
            placed: (0..n).map(|_| AtomicU64::new(0)).collect(),
            tls,
            last_refusal: Mutex::new(None),
            cfg,
        });
        let io_sh = Arc::clone(&sh);
        let h = std::thread::Builder::new()
            .name(toffload_abi::threads::REMOTE_IO.into())
            .spawn(move || Io::new(io_sh).run())?;
        Ok(Remote {
            sh,
            io: Mutex::new(Some(h)),
        })
    }

    pub fn config(&self) -> &RemoteConfig {
        &self.sh.cfg
    }

    pub fn client_id(&self) -> u64 {
        self.sh.client_id
    }

    /// Why a daemon last refused us, as `host:port: reason` (a client id owned by
    /// another identity, a frame past its bounds, a protocol version), if one has.
    pub fn last_refusal(&self) -> Option<String> {
        self.sh
            .last_refusal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn counters(&self) -> ClientCounters {
        let s = &self.sh.stats;
        let l = |a: &AtomicU64| a.load(Relaxed);
        ClientCounters {
            submitted: l(&s.submitted),
            completed: l(&s.completed),
            failed: l(&s.failed),
            timed_out: l(&s.timed_out),
            frames_sent: l(&s.frames_sent),
            ops_sent: l(&s.ops_sent),
            resent: l(&s.resent),
            bytes_sent: l(&s.bytes_sent),
            bytes_received: l(&s.bytes_received),
            payload_bytes: l(&s.payload_bytes),
            chunk_refs: l(&s.chunk_refs),
            chunk_ref_bytes: l(&s.chunk_ref_bytes),
            missing_chunks: l(&s.missing_chunks),
            connects: l(&s.connects),
            connect_failures: l(&s.connect_failures),
            disconnects: l(&s.disconnects),
            duplicate_results: l(&s.duplicate_results),
            refusals: l(&s.refusals),
            over_limit: l(&s.over_limit),
            per_endpoint: self.sh.placed.iter().map(l).collect(),
        }
    }

    /// Submits an op of `kind` on `buf[0..len)`: AES-128-CTR transforms it in place;
    /// RSA signing needs `len >= 256` and writes the signature over `buf[0..256)`.
    ///
    /// # Safety
    /// As [`Accelerator::submit`].
    pub unsafe fn submit_op(
        &self,
        kind: OpKind,
        buf: *mut u8,
        len: usize,
    ) -> Result<OpId, AccelError> {
        if buf.is_null() && len > 0 {
            return Err(AccelError::NullBuffer);
        }
        if len > MAX_OP_BYTES {
            return Err(AccelError::TooLarge {
                len,
                max: MAX_OP_BYTES,
            });
        }
        if kind == OpKind::RsaSign && len < 256 {
            return Err(AccelError::BadLength);
        }
        let sh = &*self.sh;
        // Bytes window: reserve first, give back on failure.
        let before = sh.bytes_in_flight.fetch_add(len, AcqRel);
        if before > 0 && before + len > sh.cfg.window_bytes {
            sh.bytes_in_flight.fetch_sub(len, AcqRel);
            return Err(AccelError::TooManyInFlight { max: sh.cfg.window });
        }
        let claimed = match sh.slots.allocate(OpRec {
            buf: buf as usize,
            len,
        }) {
            Ok(c) => c,
            Err(e) => {
                sh.bytes_in_flight.fetch_sub(len, AcqRel);
                return Err(e);
            }
        };
        let id = Slots::handle(&claimed);
        let data = if len == 0 {
            Vec::new()
        } else {
            // SAFETY: caller contract: buf[0..len) valid.
            unsafe { std::slice::from_raw_parts(buf, len) }.to_vec()
        };
        sh.stats.submitted.fetch_add(1, Relaxed);
        let sub = Submission {
            index: claimed.index,
            generation: claimed.generation,
            kind,
            data,
            submitted: Instant::now(),
        };
        sh.queue.lock().unwrap_or_else(|p| p.into_inner()).push(sub);
        if sh.io_sleeping.load(SeqCst) {
            sh.wake.signal();
        }
        Ok(OpId(id))
    }

    fn stop(&self) {
        self.sh.stop.store(true, SeqCst);
        self.sh.wake.signal();
        if let Some(h) = self.io.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        self.stop();
    }
}

fn errno_error(errno: i32) -> AccelError {
    match errno {
        libc::ETIMEDOUT => AccelError::TimedOut,
        libc::ENOBUFS => AccelError::OverLimit,
        libc::EMSGSIZE => AccelError::TooLarge {
            len: 0,
            max: MAX_OP_BYTES,
        },
        _ => AccelError::DeviceFault,
    }
}

impl Accelerator for Remote {
    unsafe fn submit(&self, buf: *mut u8, len: usize) -> Result<OpId, AccelError> {
        // SAFETY: forwarded.
        unsafe { self.submit_op(self.sh.cfg.op, buf, len) }
    }

    fn done(&self, id: OpId) -> Result<OpState, AccelError> {
        let c = self.sh.slots.lookup(id.0)?;
        let state = c.slot.state.load(Acquire) & !WAITER;
        if self.sh.slots.generation_of(c.index) != c.generation {
            return Err(AccelError::BadHandle);
        }
        match state {
            PENDING | RUNNING => Ok(OpState::Pending),
            DONE => Ok(OpState::Done),
            FAILED => Err(errno_error(self.sh.errs[c.index as usize].load(Acquire))),
            _ => Err(AccelError::BadHandle),
        }
    }

    fn wait(&self, id: OpId) -> Result<(), AccelError> {
        let c = self.sh.slots.lookup(id.0)?;
        match c.slot.wait_terminal() {
            DONE => Ok(()),
            FAILED => Err(errno_error(self.sh.errs[c.index as usize].load(Acquire))),
            _ => Err(AccelError::BadHandle),
        }
    }

    fn release(&self, id: OpId) -> Result<(), AccelError> {
        // A cancelled op's slot is freed by the I/O thread when its result (or its
        // deadline) comes, and its buffer is never touched.
        let sh = &*self.sh;
        sh.slots.release(id.0, |op| {
            sh.bytes_in_flight.fetch_sub(op.len, AcqRel);
        })
    }

    fn completion_fd(&self) -> RawFd {
        self.sh.done.fd()
    }
}

// ---------------------------------------------------------------------------------
// The I/O thread.

struct Pending {
    index: u32,
    generation: u32,
    kind: OpKind,
    data: Vec<u8>,
    /// Chunk boundaries and hashes, for ops sent by reference.
    chunks: Option<Vec<(usize, usize, [u8; 32])>>,
    /// The daemon said it lacked a chunk: send the bytes.
    raw: bool,
    sent_at: Option<Instant>,
    sends: u32,
}

struct Endpoint {
    addr: String,
    conn: Option<Conn>,
    connecting: bool,
    retry_at: Instant,
    backoff: Duration,
    inflight: BTreeMap<u64, Pending>,
    /// Seqs to send on the current connection, in order (entries no longer in
    /// `inflight` are skipped).
    unsent: VecDeque<u64>,
    unsent_bytes: usize,
    /// When the oldest op in `unsent` was queued.
    unsent_since: Option<Instant>,
    acks: Vec<u64>,
    acks_since: Option<Instant>,
    last_rx: Instant,
    ping_sent: bool,
    load: Load,
    /// Measured bytes/s of this link (results' request + response bytes over busy time).
    bw: f64,
    busy_since: Option<Instant>,
    busy_bytes: u64,
    known: HashSet<[u8; 32]>,
    failures: u32,
}

struct Connected {
    ep: usize,
    result: io::Result<(Conn, Load, Vec<[u8; 32]>)>,
}

struct Io {
    sh: Arc<Shared>,
    eps: Vec<Endpoint>,
    next_seq: u64,
    /// (deadline, seq, endpoint), in deadline order (one deadline length for all).
    deadlines: VecDeque<(Instant, u64, usize)>,
    connected: Arc<Mutex<Vec<Connected>>>,
    rr: usize,
    completions: u32,
}

impl Io {
    fn new(sh: Arc<Shared>) -> Io {
        let now = Instant::now();
        let eps = sh
            .cfg
            .endpoints
            .iter()
            .map(|a| Endpoint {
                addr: a.clone(),
                conn: None,
                connecting: false,
                retry_at: now,
                backoff: BACKOFF_MIN,
                inflight: BTreeMap::new(),
                unsent: VecDeque::new(),
                unsent_bytes: 0,
                unsent_since: None,
                acks: Vec::new(),
                acks_since: None,
                last_rx: now,
                ping_sent: false,
                load: Load::default(),
                bw: 125e6,
                busy_since: None,
                busy_bytes: 0,
                known: HashSet::new(),
                failures: 0,
            })
            .collect();
        Io {
            sh,
            eps,
            next_seq: 1,
            deadlines: VecDeque::new(),
            connected: Arc::new(Mutex::new(Vec::new())),
            rr: 0,
            completions: 0,
        }
    }

    fn run(mut self) {
        // SAFETY: this thread's timer slack: coalescing deadlines of tens of us must
        // not stretch by the default 50 us.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut map: Vec<usize> = Vec::new();
        let mut timeout: Option<Duration> = None;
        loop {
            if self.sh.stop.load(SeqCst) {
                return;
            }
            fds.clear();
            map.clear();
            fds.push(conn::pollfd(self.sh.wake.fd(), libc::POLLIN));
            for (i, ep) in self.eps.iter().enumerate() {
                if let Some(c) = &ep.conn {
                    let mut ev = libc::POLLIN;
                    if c.backlog() > 0 {
                        ev |= libc::POLLOUT;
                    }
                    fds.push(conn::pollfd(c.fd(), ev));
                    map.push(i);
                }
            }
            // Sleep only when nothing waits to be coalesced: while it does, submitters
            // need not wake us (the frame goes at the coalescing deadline anyway).
            let coalescing = self.eps.iter().any(|e| e.unsent_since.is_some());
            if !coalescing {
                self.sh.io_sleeping.store(true, SeqCst);
                if !self
                    .sh
                    .queue
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .is_empty()
                {
                    timeout = Some(Duration::ZERO);
                }
            }
            let _ = conn::poll(&mut fds, timeout);
            self.sh.io_sleeping.store(false, SeqCst);
            if fds[0].revents != 0 {
                self.sh.wake.drain();
            }
            let now = Instant::now();
            self.take_connected(now);
            self.take_submissions(now);
            for k in 0..map.len() {
                let rev = fds[k + 1].revents;
                if rev != 0 {
                    let i = map[k];
                    if let Err(e) = self.read_ep(i, now) {
                        self.disconnect(i, &e);
                    }
                }
            }
            self.expire(now);
            timeout = self.send_all(now);
            if self.completions > 0 {
                self.completions = 0;
                self.sh.done.signal();
            }
        }
    }

    /// Connections finished by connector threads.
    fn take_connected(&mut self, now: Instant) {
        let done: Vec<Connected> =
            std::mem::take(&mut *self.connected.lock().unwrap_or_else(|p| p.into_inner()));
        for c in done {
            let ep = &mut self.eps[c.ep];
            ep.connecting = false;
            match c.result {
                Ok((conn, load, chunks)) => {
                    self.sh.stats.connects.fetch_add(1, Relaxed);
                    ep.conn = Some(conn);
                    ep.backoff = BACKOFF_MIN;
                    ep.failures = 0;
                    ep.load = load;
                    ep.last_rx = now;
                    ep.ping_sent = false;
                    ep.known.clear();
                    ep.known.extend(chunks);
                    // Everything without a result goes again, in order; acks not yet
                    // delivered too (the daemon keeps those results until acked).
                    ep.unsent = ep.inflight.keys().copied().collect();
                    ep.unsent_bytes = 0;
                    ep.unsent_since = None;
                    if !ep.unsent.is_empty() {
                        ep.unsent_since = Some(now);
                    }
                    for p in ep.inflight.values_mut() {
                        if p.sends > 0 {
                            self.sh.stats.resent.fetch_add(1, Relaxed);
                        }
                    }
                    if ep.busy_since.is_some() {
                        ep.busy_since = Some(now);
                        ep.busy_bytes = 0;
                    }
                }
                Err(e) => {
                    self.note_refusal(c.ep, &e);
                    let ep = &mut self.eps[c.ep];
                    self.sh.stats.connect_failures.fetch_add(1, Relaxed);
                    ep.failures += 1;
                    ep.retry_at = now + jitter(ep.backoff);
                    ep.backoff = (ep.backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
        for i in 0..self.eps.len() {
            let ep = &self.eps[i];
            if ep.conn.is_none() && !ep.connecting && now >= ep.retry_at {
                self.start_connect(i);
            }
        }
    }

    fn start_connect(&mut self, i: usize) {
        let ep = &mut self.eps[i];
        ep.connecting = true;
        let addr = ep.addr.clone();
        let tls = self.sh.tls.clone();
        let client_id = self.sh.client_id;
        let out = Arc::clone(&self.connected);
        let wake_sh = Arc::clone(&self.sh);
        let spawned = std::thread::Builder::new()
            .name("toffload-rconn".into())
            .stack_size(256 << 10)
            .spawn(move || {
                let result = connect(&addr, tls.as_ref(), client_id);
                out.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Connected { ep: i, result });
                wake_sh.wake.signal();
            });
        if spawned.is_err() {
            self.eps[i].connecting = false;
            self.eps[i].retry_at = Instant::now() + BACKOFF_MAX;
        }
    }

    /// Keeps a daemon's refusal reason, if `e` is one.
    fn note_refusal(&self, i: usize, e: &io::Error) {
        if let Some(Refusal(reason)) = e.get_ref().and_then(|x| x.downcast_ref::<Refusal>()) {
            self.sh.stats.refusals.fetch_add(1, Relaxed);
            *self
                .sh
                .last_refusal
                .lock()
                .unwrap_or_else(|p| p.into_inner()) =
                Some(format!("{}: {reason}", self.sh.cfg.endpoints[i]));
        }
    }

    fn disconnect(&mut self, i: usize, why: &io::Error) {
        self.note_refusal(i, why);
        let now = Instant::now();
        let ep = &mut self.eps[i];
        if ep.conn.take().is_some() {
            self.sh.stats.disconnects.fetch_add(1, Relaxed);
        }
        ep.retry_at = now + jitter(ep.backoff);
        ep.backoff = (ep.backoff * 2).min(BACKOFF_MAX);
        ep.unsent.clear();
        ep.unsent_bytes = 0;
        ep.unsent_since = None;
        ep.ping_sent = false;
    }

    /// Picks a daemon for an op of `len` bytes (chunk hashes `chunks`).
    fn place(&mut self, len: usize, chunks: Option<&[(usize, usize, [u8; 32])]>) -> usize {
        let n = self.eps.len();
        if n == 1 {
            return 0;
        }
        let now = Instant::now();
        // A daemon that is down and not about to come back is avoided while another is up.
        let up = |e: &Endpoint| e.conn.is_some() || e.failures == 0;
        let any_up = self.eps.iter().any(up);
        let usable = |e: &Endpoint| !any_up || up(e);
        match self.sh.cfg.placement {
            Placement::RoundRobin => {
                for _ in 0..n {
                    self.rr = (self.rr + 1) % n;
                    if usable(&self.eps[self.rr]) {
                        break;
                    }
                }
                self.rr
            }
            Placement::LeastLoaded => (0..n)
                .filter(|&i| usable(&self.eps[i]))
                .min_by_key(|&i| {
                    let e = &self.eps[i];
                    (e.inflight.len() as u64 + e.load.queue_depth as u64, i)
                })
                .unwrap_or(0),
            Placement::Predicted => {
                let mut best = (f64::INFINITY, 0);
                for (i, e) in self.eps.iter().enumerate() {
                    if !usable(e) {
                        continue;
                    }
                    let service = if e.load.service_ns > 0 {
                        e.load.service_ns as f64 * 1e-9
                    } else {
                        100e-6
                    };
                    let lanes = e.load.lanes.max(1) as f64;
                    // Our own ops in flight there are the queue we know best; the
                    // daemon's report adds other clients' (ours are part of it).
                    let ours = e.inflight.len() as f64;
                    let theirs = (e.load.queue_depth as f64 - ours).max(0.0);
                    let queue = (ours + theirs) / lanes * service;
                    let mut bytes = len as f64;
                    if let Some(cs) = chunks {
                        bytes = cs
                            .iter()
                            .map(|&(_, l, h)| if e.known.contains(&h) { 40.0 } else { l as f64 })
                            .sum();
                    }
                    // Request bytes plus the result coming back, plus the bytes queued
                    // ahead of ours on this link.
                    let backlog =
                        e.unsent_bytes as f64 + e.conn.as_ref().map_or(0, |c| c.backlog()) as f64;
                    let transfer = (bytes + len as f64 + backlog) / e.bw.max(1e5);
                    let mut t = queue + service + transfer;
                    if e.conn.is_none() {
                        t += e.retry_at.saturating_duration_since(now).as_secs_f64() + 0.001;
                    }
                    if t < best.0 {
                        best = (t, i);
                    }
                }
                best.1
            }
        }
    }

    fn take_submissions(&mut self, now: Instant) {
        let subs: Vec<Submission> = {
            let mut q = self.sh.queue.lock().unwrap_or_else(|p| p.into_inner());
            if q.is_empty() {
                return;
            }
            std::mem::replace(&mut *q, Vec::with_capacity(1024))
        };
        let deadline = Duration::from_millis(self.sh.cfg.deadline_ms);
        let cache_min = self.sh.cfg.cache_min;
        for s in subs {
            let seq = self.next_seq;
            self.next_seq += 1;
            let chunks = (cache_min > 0 && s.data.len() >= cache_min).then(|| {
                chunk::chunks(&s.data)
                    .into_iter()
                    .map(|(at, n)| (at, n, chunk::sha256(&s.data[at..at + n])))
                    .collect::<Vec<_>>()
            });
            let i = self.place(s.data.len(), chunks.as_deref());
            self.sh.placed[i].fetch_add(1, Relaxed);
            self.deadlines.push_back((s.submitted + deadline, seq, i));
            let ep = &mut self.eps[i];
            if ep.inflight.is_empty() && ep.busy_since.is_none() {
                ep.busy_since = Some(now);
                ep.busy_bytes = 0;
            }
            ep.unsent_bytes += s.data.len();
            ep.inflight.insert(
                seq,
                Pending {
                    index: s.index,
                    generation: s.generation,
                    kind: s.kind,
                    data: s.data,
                    chunks,
                    raw: false,
                    sent_at: None,
                    sends: 0,
                },
            );
            if ep.conn.is_some() {
                ep.unsent.push_back(seq);
                ep.unsent_since.get_or_insert(s.submitted);
            }
        }
    }

    fn read_ep(&mut self, i: usize, now: Instant) -> io::Result<()> {
        // The connection is taken out while its frames (which borrow its buffer) are
        // handled, so that handling can use the rest of the endpoint.
        let Some(mut c) = self.eps[i].conn.take() else {
            return Ok(());
        };
        let r = self.read_conn(i, &mut c, now);
        self.eps[i].conn = Some(c);
        r
    }

    fn read_conn(&mut self, i: usize, c: &mut Conn, now: Instant) -> io::Result<()> {
        // Bounded: a daemon that never stops sending must not starve our sends.
        for _ in 0..16 {
            let before = c.bytes_in;
            let got = c.read_some()?;
            self.sh
                .stats
                .bytes_received
                .fetch_add(c.bytes_in - before, Relaxed);
            if got {
                self.eps[i].last_rx = now;
                self.eps[i].ping_sent = false;
            }
            while let Some(body) = c.rd.next_frame().map_err(conn::invalid)? {
                self.handle_frame(i, body, now)?;
            }
            if !got {
                break;
            }
        }
        Ok(())
    }

    fn handle_frame(&mut self, i: usize, body: &[u8], now: Instant) -> io::Result<()> {
        match frame::decode(body).map_err(conn::invalid)? {
            Msg::Results { load, results } => {
                self.eps[i].load = load;
                for r in results {
                    self.complete(i, r.seq, r.status, r.data, now);
                }
                Ok(())
            }
            Msg::Pong { load, .. } => {
                self.eps[i].load = load;
                Ok(())
            }
            Msg::Refused { reason } => Err(refused(reason)),
            Msg::Stats { .. } => Ok(()),
            m => Err(ioerr(format!("unexpected frame from daemon: {m:?}"))),
        }
    }

    fn complete(&mut self, i: usize, seq: u64, status: i32, data: &[u8], now: Instant) {
        let sh = &*self.sh;
        let ep = &mut self.eps[i];
        if status == STATUS_MISSING_CHUNK {
            // Not run: send the bytes this time (same seq), and forget what we
            // believed the daemon held.
            sh.stats.missing_chunks.fetch_add(1, Relaxed);
            if let Some(p) = ep.inflight.get_mut(&seq) {
                p.raw = true;
                if let Some(cs) = &p.chunks {
                    for (_, _, h) in cs {
                        ep.known.remove(h);
                    }
                }
                ep.unsent_bytes += p.data.len();
                ep.unsent.push_back(seq);
                ep.unsent_since.get_or_insert(now);
            }
            return;
        }
        ep.acks.push(seq);
        ep.acks_since.get_or_insert(now);
        let Some(p) = ep.inflight.remove(&seq) else {
            // A result we already have (resent after a reconnect) or one of an op
            // that timed out: acknowledged, dropped.
            sh.stats.duplicate_results.fetch_add(1, Relaxed);
            return;
        };
        ep.busy_bytes += (p.data.len() + data.len()) as u64 + 40;
        if ep.inflight.is_empty() {
            if let Some(t0) = ep.busy_since.take() {
                let dt = now.duration_since(t0).as_secs_f64();
                if dt > 0.002 && ep.busy_bytes > 256 << 10 {
                    let bw = ep.busy_bytes as f64 / dt;
                    ep.bw = if ep.bw > 0.0 {
                        ep.bw * 0.5 + bw * 0.5
                    } else {
                        bw
                    };
                }
            }
        }
        let slot = sh.slots.get(p.index);
        if sh.slots.generation_of(p.index) != p.generation {
            return;
        }
        if !slot.start() {
            if slot.state.load(Acquire) & !WAITER == CANCELLED {
                sh.bytes_in_flight.fetch_sub(slot.op().len, AcqRel);
                sh.slots.free(p.index);
            }
            return;
        }
        let rec = slot.op();
        let ok = status == 0
            && match p.kind {
                OpKind::AesCtr => data.len() == rec.len,
                OpKind::RsaSign => data.len() == 256 && rec.len >= 256,
            };
        if ok && !data.is_empty() {
            // SAFETY: the submitter guaranteed buf[0..len) valid until done or
            // released; release waits while we are RUNNING.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), rec.buf as *mut u8, data.len()) };
        }
        if status == -libc::ENOBUFS {
            sh.stats.over_limit.fetch_add(1, Relaxed);
        }
        let errno = if ok {
            0
        } else if status < 0 {
            -status
        } else {
            libc::EIO
        };
        sh.errs[p.index as usize].store(errno, Release);
        if ok {
            sh.stats.completed.fetch_add(1, Relaxed);
        } else {
            sh.stats.failed.fetch_add(1, Relaxed);
        }
        slot.finish(ok);
        self.completions += 1;
    }

    /// Fails ops past their deadline with ETIMEDOUT.
    fn expire(&mut self, now: Instant) {
        while let Some(&(at, seq, i)) = self.deadlines.front() {
            if at > now {
                break;
            }
            self.deadlines.pop_front();
            let Some(p) = self.eps[i].inflight.remove(&seq) else {
                continue;
            };
            let sh = &*self.sh;
            sh.stats.timed_out.fetch_add(1, Relaxed);
            let slot = sh.slots.get(p.index);
            if sh.slots.generation_of(p.index) != p.generation {
                continue;
            }
            if !slot.start() {
                if slot.state.load(Acquire) & !WAITER == CANCELLED {
                    sh.bytes_in_flight.fetch_sub(slot.op().len, AcqRel);
                    sh.slots.free(p.index);
                }
                continue;
            }
            sh.errs[p.index as usize].store(libc::ETIMEDOUT, Release);
            sh.stats.failed.fetch_add(1, Relaxed);
            slot.finish(false);
            self.completions += 1;
        }
        // Once nothing is left in flight the deadline queue holds only finished ops.
        if self.eps.iter().all(|e| e.inflight.is_empty()) {
            self.deadlines.clear();
        }
    }

    /// Builds and writes frames; returns how long poll may sleep.
    fn send_all(&mut self, now: Instant) -> Option<Duration> {
        let coalesce = Duration::from_micros(self.sh.cfg.coalesce_us);
        let mut timeout: Option<Duration> = None;
        let min_t = |d: Duration, t: &mut Option<Duration>| {
            *t = Some(t.map_or(d, |x| x.min(d)));
        };
        for i in 0..self.eps.len() {
            if self.eps[i].conn.is_none() {
                let ep = &self.eps[i];
                if !ep.connecting {
                    min_t(ep.retry_at.saturating_duration_since(now), &mut timeout);
                }
                continue;
            }
            let watermark = {
                let ep = &self.eps[i];
                ep.inflight.keys().next().copied().unwrap_or(self.next_seq)
            };
            let mut err = None;
            {
                let ep = &mut self.eps[i];
                // Liveness: ping when ops wait and the daemon has been silent.
                if !ep.inflight.is_empty() && ep.unsent.is_empty() {
                    let quiet = now.duration_since(ep.last_rx);
                    if quiet >= PING_DEAD {
                        err = Some(io::Error::from(io::ErrorKind::TimedOut));
                    } else if quiet >= PING_AFTER && !ep.ping_sent {
                        ep.ping_sent = true;
                        let c = ep.conn.as_mut().expect("connected");
                        frame::encode(&Msg::Ping { token: 0 }, &mut c.out);
                    }
                    if err.is_none() {
                        min_t(
                            if quiet >= PING_AFTER {
                                PING_DEAD - quiet
                            } else {
                                PING_AFTER - quiet
                            },
                            &mut timeout,
                        );
                    }
                }
            }
            if err.is_none() {
                self.build_frames(i, now, coalesce, watermark, &mut timeout);
                let ep = &mut self.eps[i];
                let c = ep.conn.as_mut().expect("connected");
                let before = c.bytes_out;
                if let Err(e) = c.flush() {
                    err = Some(e);
                }
                let c = ep.conn.as_ref().expect("connected");
                self.sh
                    .stats
                    .bytes_sent
                    .fetch_add(c.bytes_out - before, Relaxed);
            }
            if let Some(e) = err {
                self.disconnect(i, &e);
                min_t(Duration::ZERO, &mut timeout);
            }
        }
        if let Some(&(at, _, _)) = self.deadlines.front() {
            min_t(at.saturating_duration_since(now), &mut timeout);
        }
        timeout
    }

    fn build_frames(
        &mut self,
        i: usize,
        now: Instant,
        coalesce: Duration,
        watermark: u64,
        timeout: &mut Option<Duration>,
    ) {
        let sh = &*self.sh;
        let ep = &mut self.eps[i];
        loop {
            let c = ep.conn.as_mut().expect("connected");
            if c.backlog() >= OUT_HIGH_WATER {
                return;
            }
            let ops_due = match ep.unsent_since {
                None => false,
                Some(t0) => {
                    let age = now.saturating_duration_since(t0);
                    if age >= coalesce
                        || ep.unsent_bytes >= COALESCE_BYTES
                        || ep.unsent.len() >= OPS_PER_FRAME
                    {
                        true
                    } else {
                        let left = coalesce - age;
                        *timeout = Some(timeout.map_or(left, |x| x.min(left)));
                        false
                    }
                }
            };
            let acks_due = match ep.acks_since {
                None => false,
                Some(t0) => {
                    let age = now.saturating_duration_since(t0);
                    if age >= ACK_DELAY || ep.acks.len() >= ACK_BATCH {
                        true
                    } else {
                        let left = ACK_DELAY - age;
                        *timeout = Some(timeout.map_or(left, |x| x.min(left)));
                        false
                    }
                }
            };
            if !ops_due && !acks_due {
                return;
            }
            // Collect ops for one frame.
            let mut seqs: Vec<u64> = Vec::new();
            let mut bytes = 0usize;
            if ops_due {
                while let Some(&seq) = ep.unsent.front() {
                    let Some(p) = ep.inflight.get(&seq) else {
                        ep.unsent.pop_front();
                        continue;
                    };
                    if !seqs.is_empty()
                        && (seqs.len() >= OPS_PER_FRAME || bytes + p.data.len() > FRAME_BYTES)
                    {
                        break;
                    }
                    bytes += p.data.len();
                    seqs.push(seq);
                    ep.unsent.pop_front();
                }
                ep.unsent_bytes = ep.unsent_bytes.saturating_sub(bytes);
                if ep.unsent.is_empty() {
                    ep.unsent_since = None;
                    ep.unsent_bytes = 0;
                }
            }
            let nacks = ep.acks.len().min(MAX_OPS_PER_FRAME * 4);
            let acks: Vec<u64> = ep.acks.drain(..nacks).collect();
            if ep.acks.is_empty() {
                ep.acks_since = None;
            }
            if seqs.is_empty() && acks.is_empty() {
                if ep.unsent.is_empty() {
                    ep.unsent_since = None;
                }
                return;
            }
            // Encode, borrowing the ops' bytes.
            let mut ops: Vec<Op<'_>> = Vec::with_capacity(seqs.len());
            let mut refs = 0u64;
            let mut ref_bytes = 0u64;
            let mut newly_known: Vec<[u8; 32]> = Vec::new();
            for &seq in &seqs {
                let p = ep.inflight.get(&seq).expect("checked");
                let payload = match (&p.chunks, p.raw) {
                    (Some(cs), false) => {
                        let mut pieces = Vec::with_capacity(cs.len());
                        for &(at, n, h) in cs {
                            if ep.known.contains(&h) || newly_known.contains(&h) {
                                refs += 1;
                                ref_bytes += n as u64;
                                pieces.push(Piece::Ref {
                                    hash: h,
                                    len: n as u32,
                                });
                            } else {
                                newly_known.push(h);
                                pieces.push(Piece::Literal(&p.data[at..at + n]));
                            }
                        }
                        Payload::Chunked {
                            total: p.data.len() as u32,
                            pieces,
                        }
                    }
                    _ => Payload::Raw(&p.data),
                };
                ops.push(Op {
                    seq,
                    kind: p.kind,
                    payload,
                });
            }
            let c = ep.conn.as_mut().expect("connected");
            frame::encode_submit(watermark, &acks, &ops, &mut c.out);
            drop(ops);
            if ep.known.len() + newly_known.len() > KNOWN_CHUNKS_MAX {
                ep.known.clear();
            }
            // A literal chunk is held by the daemon once it has read it (until it
            // evicts it: then it answers STATUS_MISSING_CHUNK and we send bytes).
            ep.known.extend(newly_known);
            sh.stats.frames_sent.fetch_add(1, Relaxed);
            sh.stats.ops_sent.fetch_add(seqs.len() as u64, Relaxed);
            sh.stats.payload_bytes.fetch_add(bytes as u64, Relaxed);
            sh.stats.chunk_refs.fetch_add(refs, Relaxed);
            sh.stats.chunk_ref_bytes.fetch_add(ref_bytes, Relaxed);
            for seq in &seqs {
                if let Some(p) = ep.inflight.get_mut(seq) {
                    p.sends += 1;
                    p.sent_at.get_or_insert(now);
                }
            }
        }
    }
}

fn jitter(d: Duration) -> Duration {
    // Jitter needs no secrecy: without random bytes, none.
    let r = conn::random_u64().unwrap_or(0) % 1000;
    d + d * r as u32 / 2000
}

/// Dials `addr`, does TLS if configured, says hello, reads the welcome. Blocking,
/// bounded by CONNECT_TIMEOUT; runs on a short-lived thread.
fn connect(
    addr: &str,
    tls: Option<&SslConnector>,
    client_id: u64,
) -> io::Result<(Conn, Load, Vec<[u8; 32]>)> {
    let deadline = Instant::now() + CONNECT_TIMEOUT;
    let sa = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| ioerr(format!("{addr}: no address")))?;
    let tcp = TcpStream::connect_timeout(&sa, CONNECT_TIMEOUT)?;
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(CONNECT_TIMEOUT))?;
    tcp.set_write_timeout(Some(CONNECT_TIMEOUT))?;
    let stream = match tls {
        None => Stream::Plain(tcp),
        Some(c) => {
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let s = c.connect(host, tcp).map_err(ioerr)?;
            Stream::Tls(Box::new(s))
        }
    };
    let mut conn = Conn::new(stream);
    conn.send_blocking(&Msg::Hello {
        version: VERSION,
        client_id,
    })?;
    let body = conn.recv_blocking(deadline)?;
    let (load, chunks) = match frame::decode(&body).map_err(conn::invalid)? {
        Msg::Welcome {
            version,
            load,
            chunks,
            ..
        } if version == VERSION => (load, chunks),
        Msg::Welcome { version, .. } => {
            return Err(ioerr(format!(
                "daemon speaks protocol {version}, we {VERSION}"
            )))
        }
        Msg::Refused { reason } => return Err(refused(reason)),
        m => return Err(ioerr(format!("unexpected reply to hello: {m:?}"))),
    };
    conn.stream.tcp().set_read_timeout(None)?;
    conn.stream.tcp().set_write_timeout(None)?;
    conn.stream.tcp().set_nonblocking(true)?;
    Ok((conn, load, chunks))
}

/// Asks a daemon for its counters (a separate, short connection).
pub fn query_stats(addr: &str, tls: Option<&SslConnector>) -> io::Result<Vec<(String, u64)>> {
    let (mut conn, _, _) = connect(addr, tls, conn::random_u64()?)?;
    conn.stream.tcp().set_nonblocking(false)?;
    conn.stream.tcp().set_write_timeout(Some(CONNECT_TIMEOUT))?;
    conn.send_blocking(&Msg::StatsQuery)?;
    let deadline = Instant::now() + CONNECT_TIMEOUT;
    loop {
        let body = conn.recv_blocking(deadline)?;
        if let Msg::Stats { pairs } = frame::decode(&body).map_err(conn::invalid)? {
            return Ok(pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect());
        }
    }
}
