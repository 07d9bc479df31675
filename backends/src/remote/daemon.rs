//! `toffload-remoted`: executes remote ops on the local backend.
//!
//! One thread accepts (within the connection bounds); each connection has its own
//! thread (TLS handshake and hello within a deadline, then a poll loop over the socket
//! and a wake-up eventfd); executors run the ops and hand results back through
//! `Daemon::complete`; a housekeeping thread expires held results, compacts the
//! journal and writes the stats file. Its start (configuration, logging) is in
//! startup.rs, the state under the one lock in state.rs, the bounds in limits.rs.
//! Client ids are bound to the identity that opened them (identity.rs), and so is
//! the chunk cache.

use super::cache::{ChunkCache, Part};
use super::chunk::{sha256, MAX_CHUNK};
use super::cli::LocalBackend;
use super::conn::{self, Conn, EventFd, Stream};
use super::cuda_exec::{CudaSession, GpuLoad};
use super::exec::{AesExec, Device, Finished, Job, RsaExec, Sink};
use super::files;
use super::frame::{
    self, Load, Msg, OpKind, Payload, Piece, MAX_INVENTORY, STATUS_MISSING_CHUNK, VERSION,
};
use super::identity::Identity;
use super::journal::{Journal, Rec};
pub use super::startup::{main, run, DaemonConfig};
use super::state::{Client, ConnOut, Core, Entry, Outgoing};
use super::tls;
use openssl::pkey::{PKey, Private};
use openssl::rsa::Rsa;
use openssl::ssl::SslAcceptor;
use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tracing::{debug, error, info, warn};

/// Status of an op refused past its client's in-flight bounds (not run).
pub const STATUS_OVER_LIMIT: i32 = -libc::ENOBUFS;
/// Status of an op refused because the journal cannot be written (not run).
pub const STATUS_JOURNAL_FAILED: i32 = -libc::EIO;
/// Status of a resent op whose held result was dropped past the held bounds.
pub const STATUS_EXPIRED: i32 = -libc::ETIMEDOUT;

/// Connections open, in total and per peer address.
#[derive(Default)]
struct ConnCount {
    total: u64,
    per_peer: HashMap<IpAddr, u64>,
}

/// A connection's place within the bounds; given back on drop.
struct ConnSlot {
    d: Weak<Daemon>,
    ip: IpAddr,
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        if let Some(d) = self.d.upgrade() {
            let mut n = d.conns.lock().unwrap_or_else(|p| p.into_inner());
            n.total -= 1;
            if let Some(c) = n.per_peer.get_mut(&self.ip) {
                *c -= 1;
                if *c == 0 {
                    n.per_peer.remove(&self.ip);
                }
            }
        }
    }
}

/// Why a connection ended early, for the counters and the log.
enum Refusal {
    /// Nothing to count (the peer went away).
    Quiet,
    Handshake(String),
    HandshakeTimeout,
    Malformed(String),
    Version(u16),
    /// A hello from `identity` with a client id `owner` opened.
    Takeover {
        identity: String,
        owner: String,
    },
}

pub struct Daemon {
    pub(crate) cfg: DaemonConfig,
    core: Mutex<Core>,
    cache: Mutex<ChunkCache>,
    aes: Mutex<Option<Arc<AesExec>>>,
    rsa: Mutex<Option<Arc<RsaExec>>>,
    acceptor: Option<SslAcceptor>,
    conns: Mutex<ConnCount>,
    queue_depth: AtomicU64,
    service_ns: AtomicU64,
    daemon_id: u64,
    /// Ops the local device serves at once (reported to clients for placement).
    lanes: u32,
    next_conn: AtomicU64,
    /// The GPU's load over every CUDA session (their heartbeats').
    gpu: Arc<GpuLoad>,
}

fn load_key(cfg: &DaemonConfig) -> io::Result<PKey<Private>> {
    let read = |p: &PathBuf| -> io::Result<PKey<Private>> {
        let pem = std::fs::read(p)?;
        PKey::private_key_from_pem(&pem).map_err(io::Error::other)
    };
    if let Some(p) = &cfg.rsa_key {
        return read(p);
    }
    let kept = cfg.state_dir.as_ref().map(|d| d.join("rsa.pem"));
    if let Some(p) = &kept {
        if p.exists() {
            return read(p);
        }
    }
    let key =
        PKey::from_rsa(Rsa::generate(2048).map_err(io::Error::other)?).map_err(io::Error::other)?;
    if let Some(p) = &kept {
        files::create_dir(p.parent().expect("dir"))?;
        let pem = key.private_key_to_pem_pkcs8().map_err(io::Error::other)?;
        files::write_atomic(p, &p.with_extension("tmp"), &pem, true)?;
    }
    Ok(key)
}

impl Daemon {
    pub fn start(cfg: DaemonConfig) -> io::Result<Arc<Daemon>> {
        let acceptor = match (&cfg.tls, &cfg.psk) {
            (Some(_), Some(_)) => {
                return Err(io::Error::other(
                    "--tls-psk and --tls-cert/--tls-key/--tls-ca exclude each other",
                ))
            }
            (Some(f), None) => Some(tls::acceptor(f).map_err(io::Error::other)?),
            (None, Some(p)) => Some(
                tls::read_psk(p)
                    .and_then(tls::psk_acceptor)
                    .map_err(io::Error::other)?,
            ),
            (None, None) => None,
        };
        let key = load_key(&cfg)?;
        let dev = match cfg.backend {
            LocalBackend::Emulated => Device::emulated(cfg.emu.clone())?,
            LocalBackend::Cuda => Device::cuda(cfg.cuda.clone())?,
        };
        let lanes = dev.lanes as u32;
        let mut core = Core::new();
        if let Some(dir) = &cfg.state_dir {
            let (j, replay) = Journal::open(dir, cfg.fsync)?;
            for dmg in &replay.damaged {
                warn!(
                    offset = dmg.offset,
                    len = dmg.len,
                    "journal: damaged stretch skipped; the records after it were recovered"
                );
            }
            if replay.torn_tail > 0 {
                info!(bytes = replay.torn_tail, "journal: torn tail cut off");
            }
            core.n.journal_damaged = replay.damaged.len() as u64;
            core.replay(replay.recs);
            core.journal = Some(j);
        }
        let cache = ChunkCache::new(
            cfg.cache_mb << 20,
            cfg.cache_dir.clone(),
            cfg.cache_disk_mb << 20,
        )?;
        let d = Arc::new(Daemon {
            core: Mutex::new(core),
            cache: Mutex::new(cache),
            aes: Mutex::new(None),
            rsa: Mutex::new(None),
            acceptor,
            conns: Mutex::new(ConnCount::default()),
            queue_depth: AtomicU64::new(0),
            service_ns: AtomicU64::new(0),
            daemon_id: conn::random_u64()?,
            lanes,
            next_conn: AtomicU64::new(1),
            gpu: Arc::default(),
            cfg,
        });
        let weak = Arc::downgrade(&d);
        let sink: Sink = Arc::new(move |batch| {
            if let Some(d) = weak.upgrade() {
                d.complete(batch);
            }
        });
        *d.aes.lock().unwrap() = Some(AesExec::start(dev, Arc::clone(&sink))?);
        *d.rsa.lock().unwrap() = Some(RsaExec::start(key, d.cfg.sign_threads, sink)?);
        let weak = Arc::downgrade(&d);
        std::thread::Builder::new()
            .name("remoted-house".into())
            .spawn(move || housekeeping(weak))?;
        Ok(d)
    }

    /// A place for a connection from `ip`, or None past the bounds.
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<ConnSlot> {
        let l = &self.cfg.limits;
        let mut n = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        let peer = n.per_peer.get(&ip).copied().unwrap_or(0);
        if n.total >= l.max_conns || peer >= l.max_conns_per_peer {
            return None;
        }
        n.total += 1;
        *n.per_peer.entry(ip).or_insert(0) += 1;
        Some(ConnSlot {
            d: Arc::downgrade(self),
            ip,
        })
    }

    pub fn serve(self: &Arc<Self>, listener: TcpListener) -> io::Result<()> {
        loop {
            let (tcp, peer) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    warn!("accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let Some(slot) = self.admit(peer.ip()) else {
                self.lock().n.conns_refused += 1;
                debug!(%peer, "connection closed at accept: over the connection bounds");
                continue;
            };
            let d = Arc::clone(self);
            let _ = std::thread::Builder::new()
                .name("remoted-conn".into())
                .stack_size(512 << 10)
                .spawn(move || {
                    let _slot = slot;
                    d.connection(tcp, peer)
                });
        }
    }

    fn load(&self) -> Load {
        Load {
            queue_depth: self.queue_depth.load(Relaxed).min(u32::MAX as u64) as u32,
            service_ns: self.service_ns.load(Relaxed),
            lanes: self.lanes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts and logs why a connection ended before it was served.
    fn refused(&self, peer: SocketAddr, why: Refusal) {
        let mut core = self.lock();
        match why {
            Refusal::Quiet => {}
            Refusal::Handshake(e) => {
                core.n.refused += 1;
                debug!(%peer, "TLS handshake failed: {e}");
            }
            Refusal::HandshakeTimeout => {
                core.n.handshake_timeouts += 1;
                debug!(%peer, "no TLS handshake and hello within the deadline");
            }
            Refusal::Malformed(e) => {
                core.n.malformed += 1;
                info!(%peer, "malformed hello: {e}");
            }
            Refusal::Version(v) => {
                core.n.refused += 1;
                info!(%peer, version = v, "hello refused: protocol version not spoken");
            }
            Refusal::Takeover { identity, owner } => {
                core.n.refused += 1;
                core.n.takeovers_refused += 1;
                warn!(%peer, %identity, %owner, "hello refused: client id belongs to another identity");
            }
        }
    }

    /// TLS and hello, by the handshake deadline: the stream, who it is, its client id.
    fn handshake(
        &self,
        tcp: TcpStream,
        peer: SocketAddr,
    ) -> Result<(Conn, Identity, u64), Refusal> {
        let deadline = Instant::now() + self.cfg.limits.handshake();
        let _ = tcp.set_nodelay(true);
        let _ = tcp.set_write_timeout(Some(self.cfg.limits.handshake()));
        let (stream, ident) = match &self.acceptor {
            None => (Stream::Plain(tcp), Identity::Peer(peer.ip())),
            Some(a) => {
                let s = tls::accept_by(a, tcp, deadline).map_err(|e| match e {
                    tls::AcceptError::TimedOut => Refusal::HandshakeTimeout,
                    tls::AcceptError::Failed(e) => Refusal::Handshake(e),
                })?;
                let ident = Identity::of_tls(s.ssl())
                    .ok_or_else(|| Refusal::Handshake("no identity proven".into()))?;
                (Stream::Tls(Box::new(s)), ident)
            }
        };
        let mut c = Conn::new(stream);
        let body = c.recv_blocking(deadline).map_err(|e| match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Refusal::HandshakeTimeout,
            io::ErrorKind::InvalidData => Refusal::Malformed(e.to_string()),
            _ => Refusal::Quiet,
        })?;
        match frame::decode(&body) {
            Ok(Msg::Hello { version, client_id }) if version == VERSION => {
                Ok((c, ident, client_id))
            }
            Ok(Msg::Hello { version, .. }) => {
                let reason =
                    format!("protocol version {version} not spoken (this daemon: {VERSION})");
                let _ = c.send_blocking(&Msg::Refused { reason: &reason });
                Err(Refusal::Version(version))
            }
            other => {
                let _ = c.send_blocking(&Msg::Refused {
                    reason: "expected a hello",
                });
                Err(Refusal::Malformed(match other {
                    Ok(m) => format!("{m:?}"),
                    Err(e) => e.to_string(),
                }))
            }
        }
    }

    /// Binds the connection to `client_id` if `ident` owns it (or it is new), and
    /// queues every result the client has not acknowledged. Err: the owner.
    fn register(&self, client_id: u64, ident: &str, out: &Arc<ConnOut>) -> Result<(), String> {
        let mut core = self.lock();
        let core = &mut *core;
        let cl = core
            .clients
            .entry(client_id)
            .or_insert_with(|| Client::new(None));
        match &cl.owner {
            Some(o) if o != ident => return Err(o.clone()),
            Some(_) => {}
            None => {
                cl.owner = Some(ident.to_string());
                if let Some(j) = &mut core.journal {
                    j.append(&Rec::Owner {
                        client: client_id,
                        identity: ident.to_string(),
                    });
                }
            }
        }
        core.n.connections += 1;
        // The same identity again (a reconnect): the new connection takes over.
        if let Some(old) = cl.conn.replace(Arc::clone(out)) {
            old.closed.store(true, Release);
            old.wake.signal();
        }
        let mut resend = Vec::new();
        for (&seq, e) in &cl.entries {
            if let Entry::Done { status, data, .. } = e {
                resend.push((seq, *status, Arc::clone(data)));
            }
        }
        core.n.results_resent += resend.len() as u64;
        *out.results.lock().unwrap() = resend;
        Ok(())
    }

    /// One connection, from handshake to close. Whatever goes wrong closes this
    /// connection only.
    fn connection(self: Arc<Self>, tcp: TcpStream, peer: SocketAddr) {
        let (mut c, ident, client_id) = match self.handshake(tcp, peer) {
            Ok(x) => x,
            Err(why) => return self.refused(peer, why),
        };
        let Ok(wake) = EventFd::new() else {
            return;
        };
        let out = Arc::new(ConnOut {
            id: self.next_conn.fetch_add(1, Relaxed),
            results: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
            wake,
            cuda: Mutex::new(Vec::new()),
        });
        let ident_s = ident.to_string();
        if let Err(owner) = self.register(client_id, &ident_s, &out) {
            let _ = c.send_blocking(&Msg::Refused {
                reason: "client id belongs to another identity",
            });
            let identity = ident_s;
            return self.refused(peer, Refusal::Takeover { identity, owner });
        }
        debug!(%peer, identity = %ident_s, client = format_args!("{client_id:016x}"), "session");
        let part = ident.part();
        let inventory = {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            cache.inventory(&part, MAX_INVENTORY.min(1 << 18))
        };
        let ok = c
            .send_blocking(&Msg::Welcome {
                version: VERSION,
                daemon_id: self.daemon_id,
                load: self.load(),
                chunks: inventory,
            })
            .is_ok()
            && c.stream.tcp().set_nonblocking(true).is_ok();
        if ok {
            let s = Session {
                client: client_id,
                part,
                out: Arc::clone(&out),
                cuda: RefCell::new(None),
            };
            if let Err(e) = self.serve_conn(&mut c, &s, &out) {
                match e.kind() {
                    io::ErrorKind::InvalidData => {
                        self.lock().n.malformed += 1;
                        info!(%peer, identity = %ident_s, "malformed frame: {e}");
                    }
                    io::ErrorKind::QuotaExceeded => {
                        info!(%peer, identity = %ident_s, "connection closed: {e}");
                    }
                    _ => debug!(%peer, "connection ended: {e}"),
                }
                // A refusal may wait in the output buffer: a last bounded try.
                let _ = c.stream.tcp().set_nonblocking(false);
                let _ = c
                    .stream
                    .tcp()
                    .set_write_timeout(Some(Duration::from_secs(1)));
                let _ = c.flush();
            }
        }
        let mut core = self.lock();
        if let Some(cl) = core.clients.get_mut(&client_id) {
            if cl.conn.as_ref().is_some_and(|o| o.id == out.id) {
                cl.conn = None;
            }
            if cl.is_idle() {
                core.clients.remove(&client_id);
            }
        }
    }

    fn serve_conn(&self, c: &mut Conn, s: &Session, out: &ConnOut) -> io::Result<()> {
        let l = &self.cfg.limits;
        let mut jobs: Vec<(OpKind, Job)> = Vec::new();
        let mut pending: Vec<Outgoing> = Vec::new();
        let mut last_io = Instant::now();
        let mut seen_io = (c.bytes_in, c.bytes_out);
        loop {
            if out.closed.load(Acquire) {
                return Ok(());
            }
            if c.backlog() > l.out_queue() {
                self.lock().n.out_queue_closed += 1;
                return Err(io::Error::new(
                    io::ErrorKind::QuotaExceeded,
                    "output queue over its bound (the peer does not read)",
                ));
            }
            if (c.bytes_in, c.bytes_out) != seen_io {
                seen_io = (c.bytes_in, c.bytes_out);
                last_io = Instant::now();
            } else if last_io.elapsed() > l.idle() {
                self.lock().n.idle_closed += 1;
                return Err(io::Error::new(
                    io::ErrorKind::QuotaExceeded,
                    "idle past its bound",
                ));
            }
            // A peer that does not read is not read either.
            let mut ev = 0;
            if c.backlog() < l.out_queue() / 2 {
                ev |= libc::POLLIN;
            }
            if c.backlog() > 0 {
                ev |= libc::POLLOUT;
            }
            let mut fds = [
                conn::pollfd(c.fd(), ev),
                conn::pollfd(out.wake.fd(), libc::POLLIN),
            ];
            // Heartbeats the client asked for are due by then.
            let beat = s.cuda.borrow_mut().as_mut().and_then(|c| c.heartbeat());
            let wait = beat.map_or(Duration::from_secs(1), |b| b.min(Duration::from_secs(1)));
            conn::poll(&mut fds, Some(wait))?;
            if fds[1].revents != 0 {
                out.wake.drain();
            }
            if fds[0].revents & !libc::POLLOUT != 0 {
                let r = self.read_frames(c, s, &mut jobs);
                // Whatever was accepted runs, even when the connection then broke: its
                // entries say "running", and a resend will not start it again.
                self.dispatch(&mut jobs);
                r?;
            }
            // Results, as much as the socket takes.
            if pending.is_empty() {
                pending =
                    std::mem::take(&mut *out.results.lock().unwrap_or_else(|p| p.into_inner()));
                pending.reverse();
            }
            while !pending.is_empty() && c.backlog() < (1 << 20) {
                let mut batch = Vec::new();
                let mut bytes = 0;
                while let Some(r) = pending.pop() {
                    bytes += r.2.len() + 16;
                    batch.push(r);
                    if batch.len() >= frame::MAX_OPS_PER_FRAME || bytes >= (1 << 20) {
                        break;
                    }
                }
                frame::encode_results(
                    &self.load(),
                    batch.iter().map(|(s, st, d)| (*s, *st, &d[..])),
                    &mut c.out,
                );
                if pending.is_empty() {
                    pending =
                        std::mem::take(&mut *out.results.lock().unwrap_or_else(|p| p.into_inner()));
                    pending.reverse();
                }
            }
            // CUDA notes, packed into frames of at most a few MiB.
            let notes = std::mem::take(&mut *out.cuda.lock().unwrap_or_else(|p| p.into_inner()));
            let mut blob = Vec::new();
            for n in notes {
                if !blob.is_empty() && blob.len() + n.len() > (4 << 20) {
                    frame::encode(&Msg::CudaNotes { notes: &blob }, &mut c.out);
                    blob.clear();
                }
                blob.extend_from_slice(&n);
            }
            if !blob.is_empty() {
                frame::encode(&Msg::CudaNotes { notes: &blob }, &mut c.out);
            }
            c.flush()?;
        }
    }

    fn read_frames(
        &self,
        c: &mut Conn,
        s: &Session,
        jobs: &mut Vec<(OpKind, Job)>,
    ) -> io::Result<()> {
        for _ in 0..16 {
            let got = c.read_some()?;
            while let Some(body) = c.rd.next_frame().map_err(conn::invalid)? {
                let msg = frame::decode(body).map_err(conn::invalid)?;
                self.handle(s, msg, &mut c.out, jobs)?;
            }
            if !got || c.backlog() >= self.cfg.limits.out_queue() / 2 {
                break;
            }
        }
        Ok(())
    }

    /// One frame from a client. Ops are admitted under the lock (duplicates, bounds,
    /// entries), assembled outside it.
    pub(crate) fn handle(
        &self,
        s: &Session,
        msg: Msg<'_>,
        out: &mut Vec<u8>,
        jobs: &mut Vec<(OpKind, Job)>,
    ) -> io::Result<()> {
        let (watermark, acks, ops) = match msg {
            Msg::Submit {
                watermark,
                acks,
                ops,
            } => (watermark, acks, ops),
            Msg::Ping { token } => {
                frame::encode(
                    &Msg::Pong {
                        token,
                        load: self.load(),
                    },
                    out,
                );
                return Ok(());
            }
            Msg::Cuda { calls } => return self.cuda(s, calls),
            Msg::StatsQuery => {
                let pairs = self.stats();
                let refs: Vec<(&str, u64)> = pairs.iter().map(|(k, v)| (*k, *v)).collect();
                frame::encode(&Msg::Stats { pairs: refs }, out);
                return Ok(());
            }
            m => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unexpected frame from a client: {m:?}"),
                ))
            }
        };
        // The bound on what one frame makes us assemble, before anything is.
        let asked: u64 = ops.iter().map(|o| o.payload.len() as u64).sum();
        let bound = self.cfg.limits.frame_assembly() as u64;
        if asked > bound {
            self.lock().n.frames_refused += 1;
            let reason = format!(
                "a frame asked for {asked} bytes to be assembled; this daemon's bound is \
                 {bound} (--frame-assembly-mb)"
            );
            frame::encode(&Msg::Refused { reason: &reason }, out);
            return Err(io::Error::new(io::ErrorKind::QuotaExceeded, reason));
        }
        let mut answers: Vec<(u64, i32)> = Vec::new();
        let mut admitted = Vec::with_capacity(ops.len());
        {
            let mut core = self.lock();
            let core = &mut *core;
            let dedup = self.cfg.dedup;
            let Some(cl) = core.clients.get_mut(&s.client) else {
                return Ok(());
            };
            for a in acks {
                if let Some(Entry::Done { .. }) = cl.entries.get(&a) {
                    cl.put(a, Entry::Acked);
                    if let Some(j) = &mut core.journal {
                        j.append(&Rec::Ack {
                            client: s.client,
                            seq: a,
                        });
                    }
                }
            }
            if watermark > cl.watermark {
                cl.raise_watermark(watermark);
                if let Some(j) = &mut core.journal {
                    j.append(&Rec::Watermark {
                        client: s.client,
                        wm: watermark,
                    });
                }
            }
            let l = &self.cfg.limits;
            for op in ops {
                if dedup && (op.seq < cl.watermark || cl.entries.contains_key(&op.seq)) {
                    core.n.duplicates_suppressed += 1;
                    let again = match cl.entries.get(&op.seq) {
                        Some(Entry::Done { status, data, .. }) => {
                            Some((op.seq, *status, Arc::clone(data)))
                        }
                        Some(Entry::Expired) => Some((op.seq, STATUS_EXPIRED, Arc::from(&[][..]))),
                        _ => None,
                    };
                    if let (Some(r), Some(o)) = (again, &cl.conn) {
                        core.n.results_resent += 1;
                        o.results.lock().unwrap().push(r);
                        o.wake.signal();
                    }
                    continue;
                }
                if core.journal_failed {
                    answers.push((op.seq, STATUS_JOURNAL_FAILED));
                    continue;
                }
                let len = op.payload.len();
                if cl.inflight_ops as u64 >= l.client_ops
                    || cl.inflight_bytes + len > l.client_inflight()
                {
                    core.n.ops_over_limit += 1;
                    answers.push((op.seq, STATUS_OVER_LIMIT));
                    continue;
                }
                cl.put(op.seq, Entry::Running { bytes: len });
                admitted.push(op);
            }
        }
        let mut missing = Vec::new();
        for op in admitted {
            match self.assemble(&s.part, &op.payload) {
                Some(data) => jobs.push((
                    op.kind,
                    Job {
                        client: s.client,
                        seq: op.seq,
                        data,
                    },
                )),
                None => missing.push(op.seq),
            }
        }
        {
            let mut core = self.lock();
            let core = &mut *core;
            core.n.ops_received += jobs.len() as u64;
            if !missing.is_empty() {
                core.n.missing_chunks += missing.len() as u64;
                if let Some(cl) = core.clients.get_mut(&s.client) {
                    for &seq in &missing {
                        if matches!(cl.entries.get(&seq), Some(Entry::Running { .. })) {
                            cl.remove(seq);
                        }
                    }
                }
                answers.extend(missing.iter().map(|&s| (s, STATUS_MISSING_CHUNK)));
            }
            if core.journal_failed && answers.iter().any(|a| a.1 == STATUS_JOURNAL_FAILED) {
                warn!("ops refused: the journal cannot be written (see the error above)");
            }
        }
        if !answers.is_empty() {
            frame::encode_results(
                &self.load(),
                answers.iter().map(|&(s, st)| (s, st, &[][..])),
                out,
            );
        }
        Ok(())
    }

    /// A batch of remoted CUDA calls, run on the local GPU in the connection's CUDA
    /// session; what the client waits for comes back as notes (serve_conn sends them).
    fn cuda(&self, s: &Session, calls: &[u8]) -> io::Result<()> {
        let mut slot = s.cuda.borrow_mut();
        let sess = slot.get_or_insert_with(|| {
            CudaSession::new(Arc::clone(&s.out), s.part, Arc::clone(&self.gpu))
        });
        let t = sess
            .run(calls, &self.cache, self.cfg.cache_mb > 0)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        let mut core = self.lock();
        let n = &mut core.n;
        n.cuda_frames += 1;
        n.cuda_bytes += calls.len() as u64;
        n.cuda_calls += t.calls;
        n.cuda_syncs += t.syncs;
        n.cuda_upload_hits += t.upload_hits;
        n.cuda_upload_bytes_saved += t.bytes_saved;
        n.cuda_upload_misses += t.upload_misses;
        n.cuda_failed += t.failed;
        Ok(())
    }

    /// The op's bytes: as sent, or put together from its pieces and the caller's cache
    /// partition (None: a referenced chunk is not held there). The caller checked the
    /// length against the bounds; the copy happens outside the cache lock.
    fn assemble(&self, part: &Part, p: &Payload<'_>) -> Option<Vec<u8>> {
        let (total, pieces) = match p {
            Payload::Raw(b) => return Some(b.to_vec()),
            Payload::Chunked { total, pieces } => (*total as usize, pieces),
        };
        // Only chunks the client's chunker could make are kept.
        let cache_it = |b: &[u8]| self.cfg.cache_mb > 0 && b.len() <= MAX_CHUNK;
        let hashes: Vec<Option<[u8; 32]>> = pieces
            .iter()
            .map(|p| match p {
                Piece::Literal(b) if cache_it(b) => Some(sha256(b)),
                _ => None,
            })
            .collect();
        let mut held: Vec<Arc<[u8]>> = Vec::new();
        {
            let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            for (piece, h) in pieces.iter().zip(&hashes) {
                match piece {
                    Piece::Literal(b) => {
                        if let Some(h) = h {
                            cache.insert(part, *h, b);
                        }
                    }
                    Piece::Ref { hash, len } => {
                        let d = cache.get(part, hash)?;
                        if d.len() != *len as usize {
                            return None;
                        }
                        held.push(d);
                    }
                }
            }
        }
        let mut v = Vec::with_capacity(total);
        let mut refs = held.iter();
        for piece in pieces {
            match piece {
                Piece::Literal(b) => v.extend_from_slice(b),
                Piece::Ref { .. } => v.extend_from_slice(refs.next()?),
            }
        }
        Some(v)
    }

    fn dispatch(&self, jobs: &mut Vec<(OpKind, Job)>) {
        if jobs.is_empty() {
            return;
        }
        self.queue_depth.fetch_add(jobs.len() as u64, Relaxed);
        let (aes, rsa): (Vec<_>, Vec<_>) = jobs.drain(..).partition(|(k, _)| *k == OpKind::AesCtr);
        if !aes.is_empty() {
            if let Some(a) = &*self.aes.lock().unwrap() {
                a.push(aes.into_iter().map(|(_, j)| j));
            }
        }
        if !rsa.is_empty() {
            if let Some(r) = &*self.rsa.lock().unwrap() {
                r.push(rsa.into_iter().map(|(_, j)| j));
            }
        }
    }

    /// Results from an executor: counted and journaled, then sent.
    fn complete(&self, batch: Vec<Finished>) {
        self.queue_depth.fetch_sub(batch.len() as u64, Relaxed);
        if let Some(last) = batch.iter().rev().find(|f| f.service_ns > 0) {
            let old = self.service_ns.load(Relaxed);
            let new = if old == 0 {
                last.service_ns
            } else {
                (old * 7 + last.service_ns) / 8
            };
            self.service_ns.store(new, Relaxed);
        }
        let now = Instant::now();
        let held = self.cfg.limits.held();
        let mut guard = self.lock();
        let core = &mut *guard;
        let mut send: Vec<(Arc<ConnOut>, Outgoing)> = Vec::with_capacity(batch.len());
        for f in batch {
            core.n.executions += 1;
            core.n.executions_total += 1;
            if self.cfg.track > 0 {
                let key = (f.client, f.seq);
                if !core.seen.insert(key) {
                    core.n.executed_twice += 1;
                } else {
                    core.seen_order.push_back(key);
                    if core.seen_order.len() > self.cfg.track {
                        if let Some(old) = core.seen_order.pop_front() {
                            core.seen.remove(&old);
                        }
                    }
                }
            }
            let data: Arc<[u8]> = f.data.into();
            if let Some(j) = &mut core.journal {
                j.append(&Rec::Exec {
                    client: f.client,
                    seq: f.seq,
                    status: f.status,
                    data: Arc::clone(&data),
                });
            }
            let Some(cl) = core.clients.get_mut(&f.client) else {
                continue;
            };
            if !matches!(cl.entries.get(&f.seq), Some(Entry::Running { .. })) {
                continue;
            }
            if f.seq < cl.watermark {
                cl.remove(f.seq);
                continue;
            }
            cl.put(
                f.seq,
                Entry::Done {
                    status: f.status,
                    data: Arc::clone(&data),
                    at: now,
                },
            );
            if let Some(o) = &cl.conn {
                send.push((Arc::clone(o), (f.seq, f.status, data)));
            }
            if cl.held_bytes > held {
                core.n.results_expired += cl.expire(held, None);
            }
        }
        if let Some(j) = &mut core.journal {
            if let Err(e) = j.flush() {
                core.n.journal_write_errors += 1;
                if !core.journal_failed {
                    error!("journal write failed: {e}; refusing new ops until a restart");
                }
                core.journal_failed = true;
            }
        }
        drop(guard);
        let mut woken: Vec<u64> = Vec::new();
        for (o, r) in send {
            o.results.lock().unwrap().push(r);
            if !woken.contains(&o.id) {
                woken.push(o.id);
                o.wake.signal();
            }
        }
    }

    /// Once a second: held results past their age, journal compaction (the snapshot
    /// written without the lock), the stats file.
    fn tick(&self) {
        let l = &self.cfg.limits;
        let now = Instant::now();
        let compaction = {
            let mut core = self.lock();
            let core = &mut *core;
            let mut expired = 0;
            for cl in core.clients.values_mut() {
                expired += cl.expire(l.held(), Some((now, l.held_age())));
            }
            if expired > 0 {
                core.n.results_expired += expired;
                info!(
                    results = expired,
                    "held results dropped unacknowledged past --held-age-s"
                );
            }
            let snap = match &core.journal {
                Some(j) if j.needs_compaction() => Some(core.snapshot()),
                _ => None,
            };
            snap.and_then(|s| core.journal.as_mut().map(|j| j.begin_compaction(s)))
        };
        if let Some(mut c) = compaction {
            let written = c.write();
            let mut core = self.lock();
            if let Some(j) = &mut core.journal {
                if let Err(e) = written.and_then(|()| j.finish_compaction(c)) {
                    warn!("journal compaction failed (the journal stays as it was): {e}");
                }
            }
        }
        if let Some(p) = &self.cfg.stats_file {
            let text: String = self
                .stats()
                .iter()
                .map(|(k, v)| format!("{k} {v}\n"))
                .collect();
            if let Err(e) = files::write_atomic(p, &p.with_extension("tmp"), text.as_bytes(), false)
            {
                debug!("stats file {}: {e}", p.display());
            }
        }
    }

    /// Fuzzing and tests: `bodies` handled as one connection of `client` (identity
    /// `fuzz`) would handle them, without a socket; what it accepts runs. Ok: the
    /// bytes it would send; Err: why it would close the connection.
    #[doc(hidden)]
    pub fn feed(&self, client: u64, bodies: &[&[u8]]) -> io::Result<Vec<u8>> {
        let ident = Identity::Psk("fuzz".into());
        let out = Arc::new(ConnOut {
            id: self.next_conn.fetch_add(1, Relaxed),
            results: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
            wake: EventFd::new()?,
            cuda: Mutex::new(Vec::new()),
        });
        self.register(client, &ident.to_string(), &out)
            .map_err(|owner| io::Error::other(format!("owned by {owner}")))?;
        let s = Session {
            client,
            part: ident.part(),
            out: Arc::clone(&out),
            cuda: RefCell::new(None),
        };
        let (mut bytes, mut jobs) = (Vec::new(), Vec::new());
        let r = bodies.iter().try_for_each(|b| {
            let msg = frame::decode(b).map_err(conn::invalid)?;
            self.handle(&s, msg, &mut bytes, &mut jobs)
        });
        self.dispatch(&mut jobs);
        let mut core = self.lock();
        if let Some(cl) = core.clients.get_mut(&client) {
            cl.conn = None;
            if cl.is_idle() {
                core.clients.remove(&client);
            }
        }
        r.map(|()| bytes)
    }

    /// Fuzzing and tests: every client's counters agree with its entries, and none
    /// is past the bounds. Err says which and how.
    #[doc(hidden)]
    pub fn check(&self) -> Result<(), String> {
        let l = &self.cfg.limits;
        let core = self.lock();
        for (id, c) in &core.clients {
            let (mut ops, mut bytes, mut held) = (0, 0, 0);
            for e in c.entries.values() {
                match e {
                    Entry::Running { bytes: b } => {
                        ops += 1;
                        bytes += b;
                    }
                    Entry::Done { data, .. } => held += data.len(),
                    Entry::Acked | Entry::Expired => {}
                }
            }
            let got = (c.inflight_ops, c.inflight_bytes, c.held_bytes);
            if got != (ops, bytes, held) {
                return Err(format!(
                    "client {id:x}: counters {got:?}, entries say {:?}",
                    (ops, bytes, held)
                ));
            }
            if ops as u64 > l.client_ops || bytes > l.client_inflight() || held > l.held() {
                return Err(format!("client {id:x}: past a bound: {got:?}"));
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        let core = self.lock();
        let n = &core.n;
        let (hits, misses, chunks, disk_evictions) = {
            let c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            (c.hits, c.misses, c.len() as u64, c.disk_evictions)
        };
        let held: u64 = core
            .clients
            .values()
            .map(|c| {
                c.entries
                    .values()
                    .filter(|e| matches!(e, Entry::Done { .. }))
                    .count() as u64
            })
            .sum();
        let held_bytes: u64 = core.clients.values().map(|c| c.held_bytes as u64).sum();
        let open = self.conns.lock().unwrap_or_else(|p| p.into_inner()).total;
        vec![
            ("executions", n.executions),
            ("executions_total", n.executions_total),
            ("executed_twice", n.executed_twice),
            ("duplicates_suppressed", n.duplicates_suppressed),
            ("results_resent", n.results_resent),
            ("results_held", held),
            ("results_held_bytes", held_bytes),
            ("results_expired", n.results_expired),
            ("ops_received", n.ops_received),
            ("ops_over_limit", n.ops_over_limit),
            ("frames_refused", n.frames_refused),
            ("missing_chunks", n.missing_chunks),
            ("cache_hits", hits),
            ("cache_misses", misses),
            ("cache_chunks", chunks),
            ("cache_disk_evictions", disk_evictions),
            ("connections", n.connections),
            ("connections_open", open),
            ("connections_refused", n.conns_refused),
            ("refused", n.refused),
            ("takeovers_refused", n.takeovers_refused),
            ("handshake_timeouts", n.handshake_timeouts),
            ("idle_closed", n.idle_closed),
            ("out_queue_closed", n.out_queue_closed),
            ("malformed", n.malformed),
            ("journal_damaged", n.journal_damaged),
            ("journal_write_errors", n.journal_write_errors),
            ("journal_failed", core.journal_failed as u64),
            ("clients", core.clients.len() as u64),
            ("queue_depth", self.queue_depth.load(Relaxed)),
            ("service_ns", self.service_ns.load(Relaxed)),
            ("dedup", self.cfg.dedup as u64),
            ("cuda_frames", n.cuda_frames),
            ("cuda_calls", n.cuda_calls),
            ("cuda_bytes", n.cuda_bytes),
            ("cuda_syncs", n.cuda_syncs),
            ("cuda_upload_hits", n.cuda_upload_hits),
            ("cuda_upload_bytes_saved", n.cuda_upload_bytes_saved),
            ("cuda_upload_misses", n.cuda_upload_misses),
            ("cuda_failed", n.cuda_failed),
            ("cuda_sessions", self.gpu.opened.load(Relaxed)),
            ("cuda_queue", self.gpu.beat().queue as u64),
            ("cuda_kernel_ns", self.gpu.beat().kernel_ns),
        ]
    }
}

/// A served connection: its client id and cache partition.
pub(crate) struct Session {
    pub client: u64,
    pub part: Part,
    pub out: Arc<ConnOut>,
    /// The connection's CUDA state, from its first `Cuda` frame.
    pub cuda: RefCell<Option<CudaSession>>,
}

fn housekeeping(d: Weak<Daemon>) {
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let Some(d) = d.upgrade() else {
            return;
        };
        d.tick();
    }
}
