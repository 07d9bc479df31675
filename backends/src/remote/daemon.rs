//! `toffload-remoted`: executes remote ops on the local backend.
//!
//! One thread accepts; each connection has its own thread (TLS handshake, hello, then
//! a poll loop over the socket and a wake-up eventfd); executors run the ops and hand
//! results back through `Daemon::complete`. The `Core` (under one lock) keeps, per
//! client id, every op between its arrival and the client's acknowledgement of its
//! result, and tombstones of acknowledged ones until the client's watermark passes
//! them: a resent op that is running or done is not run again (a done one has its
//! result sent again), which is what makes each op run once.

use super::cache::ChunkCache;
use super::chunk::sha256;
use super::conn::{self, Conn, EventFd, Stream};
use super::exec::{AesExec, Finished, Job, RsaExec, Sink};
use super::frame::{
    self, Load, Msg, OpKind, Payload, Piece, MAX_INVENTORY, STATUS_MISSING_CHUNK, VERSION,
};
use super::journal::{Journal, Rec};
use super::tls::{self, TlsFiles};
use crate::EmuConfig;
use openssl::pkey::{PKey, Private};
use openssl::rsa::Rsa;
use openssl::ssl::SslAcceptor;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io::{self, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const USAGE: &str = "\
toffload-remoted: runs toffload's remote ops (AES-128-CTR on the local emulated
device, configured by the TOFFLOAD_EMU_* knobs; RSA-2048 signing) for clients using
TOFFLOAD_BACKEND=remote.

usage: toffload-remoted [options]
  --listen HOST:PORT     address to listen on (default 127.0.0.1:7878; port 0 = any)
  --port-file FILE       write the port actually bound to FILE
  --state-dir DIR        journal of executed ops and unacknowledged results (exactly
                         once across a restart), and the RSA key if none is given
  --fsync                fdatasync the journal on every flush (survive power loss)
  --rsa-key FILE         RSA private key (PEM) to sign with; default: generated at
                         start (kept in --state-dir/rsa.pem when there is one)
  --sign-threads N       RSA signing threads (default 1)
  --tls-cert FILE --tls-key FILE --tls-ca FILE
                         TLS; clients must present a certificate signed by the CA
  --tls-psk FILE         TLS 1.3 with pre-shared keys instead: FILE has one line
                         `IDENTITY HEXKEY` per client (keys of 16 to 64 bytes);
                         a client without a listed identity and its key is refused
  --cache-mb N           chunk cache in memory, MiB (default 256; 0 = no cache)
  --cache-dir DIR        chunk cache on disk (survives restarts)
  --cache-disk-mb N      bound of the disk cache, MiB (default 1024)
  --track N              remember the last N executed (client, seq) pairs to count
                         any executed twice (default 1048576; 0 = off)
  --test-disable-dedup   tests only: run every op received, resends included
";

#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub listen: String,
    pub port_file: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub fsync: bool,
    pub rsa_key: Option<PathBuf>,
    pub sign_threads: usize,
    pub tls: Option<TlsFiles>,
    /// --tls-psk: the clients' identities and keys (read at start).
    pub psk: Option<PathBuf>,
    pub cache_mb: usize,
    pub cache_dir: Option<PathBuf>,
    pub cache_disk_mb: usize,
    pub track: usize,
    pub dedup: bool,
    pub emu: EmuConfig,
}

impl DaemonConfig {
    pub fn parse(args: &[String], emu: EmuConfig) -> Result<DaemonConfig, String> {
        let mut c = DaemonConfig {
            listen: "127.0.0.1:7878".into(),
            port_file: None,
            state_dir: None,
            fsync: false,
            rsa_key: None,
            sign_threads: 1,
            tls: None,
            psk: None,
            cache_mb: 256,
            cache_dir: None,
            cache_disk_mb: 1024,
            track: 1 << 20,
            dedup: true,
            emu,
        };
        let (mut cert, mut key, mut ca) = (None, None, None);
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut val = |name: &str| -> Result<String, String> {
                it.next().cloned().ok_or(format!("{name} needs a value"))
            };
            let num = |name: &str, v: String, lo: usize, hi: usize| -> Result<usize, String> {
                v.parse::<usize>()
                    .ok()
                    .filter(|n| (lo..=hi).contains(n))
                    .ok_or(format!(
                        "{name} {v:?}: expected an integer from {lo} to {hi}"
                    ))
            };
            match a.as_str() {
                "--listen" => c.listen = val(a)?,
                "--port-file" => c.port_file = Some(val(a)?.into()),
                "--state-dir" => c.state_dir = Some(val(a)?.into()),
                "--fsync" => c.fsync = true,
                "--rsa-key" => c.rsa_key = Some(val(a)?.into()),
                "--sign-threads" => c.sign_threads = num(a, val(a)?, 1, 256)?,
                "--tls-cert" => cert = Some(PathBuf::from(val(a)?)),
                "--tls-key" => key = Some(PathBuf::from(val(a)?)),
                "--tls-ca" => ca = Some(PathBuf::from(val(a)?)),
                "--tls-psk" => c.psk = Some(val(a)?.into()),
                "--cache-mb" => c.cache_mb = num(a, val(a)?, 0, 1 << 20)?,
                "--cache-dir" => c.cache_dir = Some(val(a)?.into()),
                "--cache-disk-mb" => c.cache_disk_mb = num(a, val(a)?, 1, 1 << 24)?,
                "--track" => c.track = num(a, val(a)?, 0, 1 << 28)?,
                "--test-disable-dedup" => c.dedup = false,
                "-h" | "--help" => return Err(String::new()),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        c.tls = match (ca, cert, key) {
            (Some(ca), Some(cert), Some(key)) => Some(TlsFiles { ca, cert, key }),
            (None, None, None) => None,
            _ => return Err("--tls-cert, --tls-key and --tls-ca go together".into()),
        };
        if c.psk.is_some() && c.tls.is_some() {
            return Err("--tls-psk and --tls-cert/--tls-key/--tls-ca exclude each other".into());
        }
        Ok(c)
    }
}

/// Entry point of the binary.
pub fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let emu = match EmuConfig::from_env() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("toffload-remoted: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let cfg = match DaemonConfig::parse(&args, emu) {
        Ok(c) => c,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            return std::process::ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("toffload-remoted: {e}\n\n{USAGE}");
            return std::process::ExitCode::from(2);
        }
    };
    match run(cfg) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("toffload-remoted: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

enum Entry {
    Running,
    Done { status: i32, data: Arc<[u8]> },
    Acked,
}

struct Client {
    entries: BTreeMap<u64, Entry>,
    watermark: u64,
    conn: Option<Arc<ConnOut>>,
}

/// A result to send: (seq, status, bytes).
type Outgoing = (u64, i32, Arc<[u8]>);

/// What a connection's thread has to send.
struct ConnOut {
    id: u64,
    results: Mutex<Vec<Outgoing>>,
    closed: std::sync::atomic::AtomicBool,
    wake: EventFd,
}

#[derive(Default)]
struct Counters {
    executions: u64,
    executions_total: u64,
    executed_twice: u64,
    duplicates_suppressed: u64,
    results_resent: u64,
    ops_received: u64,
    missing_chunks: u64,
    connections: u64,
    refused: u64,
    malformed: u64,
}

struct Core {
    clients: HashMap<u64, Client>,
    journal: Option<Journal>,
    n: Counters,
    seen: HashSet<(u64, u64)>,
    seen_order: VecDeque<(u64, u64)>,
}

pub struct Daemon {
    cfg: DaemonConfig,
    core: Mutex<Core>,
    cache: Mutex<ChunkCache>,
    aes: Mutex<Option<Arc<AesExec>>>,
    rsa: Mutex<Option<Arc<RsaExec>>>,
    acceptor: Option<SslAcceptor>,
    queue_depth: AtomicU64,
    service_ns: AtomicU64,
    daemon_id: u64,
    next_conn: AtomicU64,
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
        std::fs::create_dir_all(p.parent().expect("dir"))?;
        let tmp = p.with_extension("tmp");
        std::fs::write(
            &tmp,
            key.private_key_to_pem_pkcs8().map_err(io::Error::other)?,
        )?;
        std::fs::rename(&tmp, p)?;
    }
    Ok(key)
}

/// Starts the daemon and serves until the process ends.
pub fn run(cfg: DaemonConfig) -> io::Result<()> {
    let listener = TcpListener::bind(&cfg.listen)?;
    let d = Daemon::start(cfg)?;
    let addr = listener.local_addr()?;
    if let Some(p) = &d.cfg.port_file {
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, addr.port().to_string())?;
        std::fs::rename(&tmp, p)?;
    }
    println!("toffload-remoted: listening on {addr}");
    let _ = io::stdout().flush();
    d.serve(listener)
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
        let mut core = Core {
            clients: HashMap::new(),
            journal: None,
            n: Counters::default(),
            seen: HashSet::new(),
            seen_order: VecDeque::new(),
        };
        if let Some(dir) = &cfg.state_dir {
            let (j, recs) = Journal::open(dir, cfg.fsync)?;
            core.replay(recs);
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
            queue_depth: AtomicU64::new(0),
            service_ns: AtomicU64::new(0),
            daemon_id: conn::random_u64(),
            next_conn: AtomicU64::new(1),
            cfg,
        });
        let weak = Arc::downgrade(&d);
        let sink: Sink = Arc::new(move |batch| {
            if let Some(d) = weak.upgrade() {
                d.complete(batch);
            }
        });
        *d.aes.lock().unwrap() = Some(AesExec::start(d.cfg.emu.clone(), Arc::clone(&sink))?);
        *d.rsa.lock().unwrap() = Some(RsaExec::start(key, d.cfg.sign_threads, sink)?);
        Ok(d)
    }

    pub fn serve(self: &Arc<Self>, listener: TcpListener) -> io::Result<()> {
        loop {
            let (tcp, _) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    eprintln!("toffload-remoted: accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let d = Arc::clone(self);
            let _ = std::thread::Builder::new()
                .name("remoted-conn".into())
                .stack_size(512 << 10)
                .spawn(move || d.connection(tcp));
        }
    }

    fn load(&self) -> Load {
        Load {
            queue_depth: self.queue_depth.load(Relaxed).min(u32::MAX as u64) as u32,
            service_ns: self.service_ns.load(Relaxed),
            lanes: self.cfg.emu.lanes as u32,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One connection, from handshake to close. Whatever goes wrong closes this
    /// connection only.
    fn connection(self: Arc<Self>, tcp: TcpStream) {
        let _ = tcp.set_nodelay(true);
        let _ = tcp.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = tcp.set_write_timeout(Some(Duration::from_secs(5)));
        let stream = match &self.acceptor {
            None => Stream::Plain(tcp),
            Some(a) => match a.accept(tcp) {
                Ok(s) => Stream::Tls(Box::new(s)),
                Err(_) => {
                    self.lock().n.refused += 1;
                    return;
                }
            },
        };
        let mut c = Conn::new(stream);
        let client_id = match c.recv_blocking(Instant::now() + Duration::from_secs(5)) {
            Ok(body) => match frame::decode(&body) {
                Ok(Msg::Hello { version, client_id }) if version == VERSION => client_id,
                Ok(Msg::Hello { version, .. }) => {
                    self.lock().n.refused += 1;
                    let reason =
                        format!("protocol version {version} not spoken (this daemon: {VERSION})");
                    let _ = c.send_blocking(&Msg::Refused { reason: &reason });
                    return;
                }
                _ => {
                    self.lock().n.malformed += 1;
                    let _ = c.send_blocking(&Msg::Refused {
                        reason: "expected a hello",
                    });
                    return;
                }
            },
            Err(_) => return,
        };
        let out = Arc::new(ConnOut {
            id: self.next_conn.fetch_add(1, Relaxed),
            results: Mutex::new(Vec::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
            wake: match EventFd::new() {
                Ok(e) => e,
                Err(_) => return,
            },
        });
        // Register, and queue every result the client has not acknowledged.
        {
            let mut core = self.lock();
            core.n.connections += 1;
            let cl = core.clients.entry(client_id).or_insert_with(|| Client {
                entries: BTreeMap::new(),
                watermark: 0,
                conn: None,
            });
            if let Some(old) = cl.conn.replace(Arc::clone(&out)) {
                old.closed.store(true, Release);
                old.wake.signal();
            }
            let mut resend = Vec::new();
            for (&seq, e) in &cl.entries {
                if let Entry::Done { status, data } = e {
                    resend.push((seq, *status, Arc::clone(data)));
                }
            }
            core.n.results_resent += resend.len() as u64;
            *out.results.lock().unwrap() = resend;
        }
        let inventory = {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            cache.inventory(MAX_INVENTORY.min(1 << 18))
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
            if let Err(e) = self.serve_conn(&mut c, client_id, &out) {
                if e.kind() == io::ErrorKind::InvalidData {
                    self.lock().n.malformed += 1;
                }
            }
        }
        let mut core = self.lock();
        if let Some(cl) = core.clients.get_mut(&client_id) {
            if cl.conn.as_ref().is_some_and(|o| o.id == out.id) {
                cl.conn = None;
            }
            if cl.conn.is_none() && cl.entries.is_empty() && cl.watermark == 0 {
                core.clients.remove(&client_id);
            }
        }
    }

    fn serve_conn(&self, c: &mut Conn, client: u64, out: &ConnOut) -> io::Result<()> {
        let mut jobs: Vec<(OpKind, Job)> = Vec::new();
        let mut pending: Vec<Outgoing> = Vec::new();
        loop {
            if out.closed.load(Acquire) {
                return Ok(());
            }
            let mut fds = [
                conn::pollfd(
                    c.fd(),
                    if c.backlog() > 0 {
                        libc::POLLIN | libc::POLLOUT
                    } else {
                        libc::POLLIN
                    },
                ),
                conn::pollfd(out.wake.fd(), libc::POLLIN),
            ];
            conn::poll(&mut fds, Some(Duration::from_secs(1)))?;
            if fds[1].revents != 0 {
                out.wake.drain();
            }
            if fds[0].revents != 0 {
                let r = self.read_frames(c, client, &mut jobs);
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
            c.flush()?;
        }
    }

    fn read_frames(
        &self,
        c: &mut Conn,
        client: u64,
        jobs: &mut Vec<(OpKind, Job)>,
    ) -> io::Result<()> {
        for _ in 0..16 {
            let got = c.read_some()?;
            while let Some(body) = c.rd.next_frame().map_err(conn::invalid)? {
                let msg = frame::decode(body).map_err(conn::invalid)?;
                self.handle(client, msg, &mut c.out, jobs)?;
            }
            if !got {
                break;
            }
        }
        Ok(())
    }

    fn handle(
        &self,
        client: u64,
        msg: Msg<'_>,
        out: &mut Vec<u8>,
        jobs: &mut Vec<(OpKind, Job)>,
    ) -> io::Result<()> {
        match msg {
            Msg::Submit {
                watermark,
                acks,
                ops,
            } => {
                let mut core = self.lock();
                let core = &mut *core;
                let dedup = self.cfg.dedup;
                let Some(cl) = core.clients.get_mut(&client) else {
                    return Ok(());
                };
                for a in acks {
                    if let Some(e) = cl.entries.get_mut(&a) {
                        if matches!(e, Entry::Done { .. }) {
                            *e = Entry::Acked;
                            if let Some(j) = &mut core.journal {
                                j.append(&Rec::Ack { client, seq: a });
                            }
                        }
                    }
                }
                if watermark > cl.watermark {
                    cl.entries = cl.entries.split_off(&watermark);
                    cl.watermark = watermark;
                    if let Some(j) = &mut core.journal {
                        j.append(&Rec::Watermark {
                            client,
                            wm: watermark,
                        });
                    }
                }
                let mut missing: Vec<u64> = Vec::new();
                for op in ops {
                    if dedup && (op.seq < cl.watermark || cl.entries.contains_key(&op.seq)) {
                        core.n.duplicates_suppressed += 1;
                        if let Some(Entry::Done { status, data }) = cl.entries.get(&op.seq) {
                            core.n.results_resent += 1;
                            if let Some(o) = &cl.conn {
                                o.results
                                    .lock()
                                    .unwrap()
                                    .push((op.seq, *status, Arc::clone(data)));
                                o.wake.signal();
                            }
                        }
                        continue;
                    }
                    let data = match self.assemble(&op.payload) {
                        Some(d) => d,
                        None => {
                            core.n.missing_chunks += 1;
                            missing.push(op.seq);
                            continue;
                        }
                    };
                    core.n.ops_received += 1;
                    cl.entries.insert(op.seq, Entry::Running);
                    jobs.push((
                        op.kind,
                        Job {
                            client,
                            seq: op.seq,
                            data,
                        },
                    ));
                }
                if !missing.is_empty() {
                    frame::encode_results(
                        &self.load(),
                        missing.iter().map(|&s| (s, STATUS_MISSING_CHUNK, &[][..])),
                        out,
                    );
                }
                Ok(())
            }
            Msg::Ping { token } => {
                frame::encode(
                    &Msg::Pong {
                        token,
                        load: self.load(),
                    },
                    out,
                );
                Ok(())
            }
            Msg::StatsQuery => {
                let pairs = self.stats();
                let refs: Vec<(&str, u64)> = pairs.iter().map(|(k, v)| (*k, *v)).collect();
                frame::encode(&Msg::Stats { pairs: refs }, out);
                Ok(())
            }
            m => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unexpected frame from a client: {m:?}"),
            )),
        }
    }

    /// The op's bytes: as sent, or put together from its pieces and the cache (None:
    /// a referenced chunk is not held).
    fn assemble(&self, p: &Payload<'_>) -> Option<Vec<u8>> {
        match p {
            Payload::Raw(b) => Some(b.to_vec()),
            Payload::Chunked { total, pieces } => {
                let mut v = Vec::with_capacity(*total as usize);
                let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
                for piece in pieces {
                    match piece {
                        Piece::Literal(b) => {
                            v.extend_from_slice(b);
                            if self.cfg.cache_mb > 0 {
                                cache.insert(sha256(b), b);
                            }
                        }
                        Piece::Ref { hash, len } => {
                            let d = cache.get(hash)?;
                            if d.len() != *len as usize {
                                return None;
                            }
                            v.extend_from_slice(&d);
                        }
                    }
                }
                Some(v)
            }
        }
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
        let mut core = self.lock();
        let core = &mut *core;
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
            if let Some(j) = &mut core.journal {
                j.append(&Rec::Exec {
                    client: f.client,
                    seq: f.seq,
                    status: f.status,
                    data: f.data.clone(),
                });
            }
            let data: Arc<[u8]> = f.data.into();
            if let Some(cl) = core.clients.get_mut(&f.client) {
                if let Some(e) = cl.entries.get_mut(&f.seq) {
                    *e = Entry::Done {
                        status: f.status,
                        data: Arc::clone(&data),
                    };
                    if let Some(o) = &cl.conn {
                        send.push((Arc::clone(o), (f.seq, f.status, data)));
                    }
                }
            }
        }
        if let Some(j) = &mut core.journal {
            if let Err(e) = j.flush() {
                eprintln!("toffload-remoted: journal write failed: {e}");
                std::process::abort();
            }
            if j.needs_compaction() {
                let snap = core.snapshot();
                if let Some(j) = &mut core.journal {
                    if let Err(e) = j.rewrite(&snap) {
                        eprintln!("toffload-remoted: journal compaction failed: {e}");
                    }
                }
            }
        }
        let mut woken: Vec<u64> = Vec::new();
        for (o, r) in send {
            o.results.lock().unwrap().push(r);
            if !woken.contains(&o.id) {
                woken.push(o.id);
                o.wake.signal();
            }
        }
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
        vec![
            ("executions", n.executions),
            ("executions_total", n.executions_total),
            ("executed_twice", n.executed_twice),
            ("duplicates_suppressed", n.duplicates_suppressed),
            ("results_resent", n.results_resent),
            ("results_held", held),
            ("ops_received", n.ops_received),
            ("missing_chunks", n.missing_chunks),
            ("cache_hits", hits),
            ("cache_misses", misses),
            ("cache_chunks", chunks),
            ("cache_disk_evictions", disk_evictions),
            ("connections", n.connections),
            ("refused", n.refused),
            ("malformed", n.malformed),
            ("clients", core.clients.len() as u64),
            ("queue_depth", self.queue_depth.load(Relaxed)),
            ("service_ns", self.service_ns.load(Relaxed)),
            ("dedup", self.cfg.dedup as u64),
        ]
    }
}

impl Core {
    fn client(&mut self, id: u64) -> &mut Client {
        self.clients.entry(id).or_insert_with(|| Client {
            entries: BTreeMap::new(),
            watermark: 0,
            conn: None,
        })
    }

    fn replay(&mut self, recs: Vec<Rec>) {
        for r in recs {
            match r {
                Rec::Total { executions } => self.n.executions_total = executions,
                Rec::Exec {
                    client,
                    seq,
                    status,
                    data,
                } => {
                    self.n.executions_total += 1;
                    let c = self.client(client);
                    if seq >= c.watermark {
                        c.entries.insert(
                            seq,
                            Entry::Done {
                                status,
                                data: data.into(),
                            },
                        );
                    }
                }
                Rec::Held {
                    client,
                    seq,
                    status,
                    data,
                } => {
                    let c = self.client(client);
                    if seq >= c.watermark {
                        c.entries.insert(
                            seq,
                            Entry::Done {
                                status,
                                data: data.into(),
                            },
                        );
                    }
                }
                Rec::Ack { client, seq } => {
                    let c = self.client(client);
                    if seq >= c.watermark {
                        c.entries.insert(seq, Entry::Acked);
                    }
                }
                Rec::Watermark { client, wm } => {
                    let c = self.client(client);
                    if wm > c.watermark {
                        c.entries = c.entries.split_off(&wm);
                        c.watermark = wm;
                    }
                }
            }
        }
    }

    fn snapshot(&self) -> Vec<Rec> {
        let mut v = vec![Rec::Total {
            executions: self.n.executions_total,
        }];
        for (&client, c) in &self.clients {
            v.push(Rec::Watermark {
                client,
                wm: c.watermark,
            });
            for (&seq, e) in &c.entries {
                match e {
                    Entry::Done { status, data } => v.push(Rec::Held {
                        client,
                        seq,
                        status: *status,
                        data: data.to_vec(),
                    }),
                    Entry::Acked => v.push(Rec::Ack { client, seq }),
                    // Not journaled yet: run again if resent.
                    Entry::Running => {}
                }
            }
        }
        v
    }
}
