//! The connection to the daemon and what the client simulates: the batch of calls not
//! yet sent, the progress of each stream as the daemon reports it, the host work
//! (DtoH destinations, host functions) waiting for a stream to get somewhere, and
//! the errors owed to the next synchronize.
//!
//! Three kinds of thread touch it: the program's (calls), the flusher (sends a batch
//! that waited its linger) and the receiver (notes: answers, stream progress). Every
//! wait has the deadline TOFFLOAD_CUDA_REMOTE_TIMEOUT_MS. A lost connection is
//! reconnected and the session replayed by the receiver (guard.rs, replay.rs); with
//! the guardian off (TOFFLOAD_CUDA_REMOTE_REPLAY_MB=0), or when that fails, it ends
//! every wait at once with CUDA_ERROR_DEVICE_UNAVAILABLE.

use crate::frame::{self, FrameReader, Msg};
use crate::knobs;
use crate::mover::{Cut, Parked};
use crate::notify::Notifier;
use crate::replay::{Journal, Rec};
use crate::sched;
use crate::wire::{self, Call, Note};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

pub type CuResult = i32;
pub const SUCCESS: CuResult = 0;
pub const INVALID_VALUE: CuResult = 1;
pub const DEVICE_UNAVAILABLE: CuResult = 46;
pub const NO_DEVICE: CuResult = 100;
pub const INVALID_HANDLE: CuResult = 400;
pub const NOT_READY: CuResult = 600;
pub const NOT_SUPPORTED: CuResult = 801;
pub const TIMEOUT: CuResult = 909;

/// One line on stderr (never stdout: the library lives in someone else's program).
pub fn log(msg: &str) {
    eprintln!("toffload-cuda-remote: {msg}");
}

/// Work waiting for a stream to reach a call.
enum Pend {
    /// Write the DtoH bytes to `dst` (the program's memory).
    DtoH { stream: u64, dst: usize, len: usize },
    /// A marker (synchronize, query, event record, stream end).
    Mark { stream: u64 },
    /// Run the program's host function.
    HostFn {
        stream: u64,
        f: unsafe extern "C" fn(*mut libc::c_void),
        user: usize,
    },
}

#[derive(Default)]
struct StreamSt {
    /// The last call on the stream the daemon will report.
    last: u64,
    /// The last the daemon reported.
    done: u64,
    /// Calls were queued after `last`: a query must send a marker.
    dirty: bool,
    destroyed: bool,
    /// An error the stream's work ended with, owed to its next synchronize.
    error: CuResult,
}

#[derive(Default)]
pub(crate) struct St {
    pub(crate) dead: Option<CuResult>,
    /// The first error of a call sent without waiting, owed to the next synchronize.
    sticky: CuResult,
    answers: HashMap<u64, (CuResult, Vec<u8>)>,
    streams: HashMap<u64, StreamSt>,
    pending: HashMap<u64, Pend>,
    /// event -> (stream, seq) of its last record.
    events: HashMap<u64, Option<(u64, u64)>>,
    /// The guardian's base and log (replay.rs).
    pub(crate) journal: Journal,
    /// Queries sent and not answered, encoded: a replay sends them again.
    pub(crate) asks: HashMap<u64, Vec<u8>>,
    /// Allocations whose contents a replay could not restore (base -> size, and
    /// whether a line said so).
    pub(crate) lost: BTreeMap<u64, (u64, bool)>,
}

pub(crate) struct Tx {
    pub(crate) sock: TcpStream,
    pub(crate) batch: Vec<u8>,
    last_send: Instant,
}

pub struct Remote {
    pub(crate) tx: Mutex<Tx>,
    tx_cv: Condvar,
    pub(crate) st: Mutex<St>,
    /// Wakes waiters on `st` (fiber-aware: see notify.rs).
    pub(crate) cv: Notifier,
    pub timeout: Duration,
    /// The daemons, in order of preference (TOFFLOAD_CUDA_REMOTE's list).
    pub(crate) addrs: Vec<String>,
    /// The one connected now.
    pub(crate) at: AtomicUsize,
    pub(crate) client_id: u64,
    /// The guardian's bound in bytes (0: off).
    pub(crate) replay_limit: usize,
    /// How long the guardian tries to reconnect.
    pub(crate) reconnect: Duration,
    /// TOFFLOAD_CUDA_REMOTE_PROBE_MS, for placement again after a loss.
    pub(crate) probe_ms: u64,
    linger: Duration,
    /// TOFFLOAD_CUDA_REMOTE_NAIVE: every call waits for its round trip (the baseline
    /// the benchmark sets the batched, asynchronous client against).
    naive: bool,
    pub cache_min: usize,
    next: AtomicU64,
    next_addr: AtomicU64,
    /// Upload hashes the daemon holds for us (its Welcome inventory, then what we sent).
    pub(crate) held: Mutex<HashSet<[u8; 32]>>,
    /// Function id -> parameter layout.
    pub funcs: Mutex<HashMap<u64, Vec<(u32, u32)>>>,
    /// Answers that never change (device queries), by query.
    pub cached: Mutex<HashMap<String, Vec<u8>>>,
    /// TOFFLOAD_CUDA_REMOTE_MOVE_MS (mover.rs; 0: never).
    pub(crate) move_ms: u64,
    /// Our kernels in the daemon's queue, as its last heartbeat said.
    pub(crate) own: AtomicU64,
    /// Synchronizes the program made (the mover moves right after one).
    pub(crate) synced: AtomicU64,
    /// Moves made, and moves given up because the session could not move whole.
    pub(crate) moves: AtomicU64,
    pub(crate) refusals: AtomicU64,
    /// A move under way, between the mover and the receiver.
    pub(crate) cut: Mutex<Cut>,
    pub(crate) cut_cv: Condvar,
    /// The client's own counts (TOFFLOAD_CUDA_REMOTE_STATS).
    pub(crate) counts: Counts,
}

/// What the client sent and waited for, counted on its side (the daemon counts
/// what it received: the two agree on calls, frames and bytes).
#[derive(Default)]
pub(crate) struct Counts {
    calls: AtomicU64,
    frames: AtomicU64,
    bytes: AtomicU64,
    /// Waits that found the daemon's answer not there yet.
    round_trips: AtomicU64,
}

/// TOFFLOAD_CUDA_REMOTE_STATS's line, at exit.
extern "C" fn say_counts() {
    if let Some(Ok(r)) = REMOTE.get() {
        // What the program queued last (its frees at exit) goes out first: counted
        // here and there alike, not raced by the flusher's linger.
        let _ = r.flush();
        let c = &r.counts;
        log(&format!(
            "{} calls in {} frames ({} bytes), {} round trips waited, {} moves",
            c.calls.load(Relaxed),
            c.frames.load(Relaxed),
            c.bytes.load(Relaxed),
            c.round_trips.load(Relaxed),
            r.moves.load(Relaxed)
        ));
    }
}

/// write_all without SIGPIPE: a daemon gone must be an error return, never a signal
/// that kills the program (std's TcpStream writes with write(2)).
///
/// The raw system call, not libc's send: under libtoffload.so a send from a fiber
/// that would block parks the fiber, and this one is made holding the batch's lock,
/// which another fiber of the same carrier then waits for in the kernel: the carrier
/// deadlocks (seen with a full socket buffer on a delayed link). Blocking the carrier
/// for the send instead is bounded by SO_SNDTIMEO.
pub(crate) fn send_all(sock: &TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: a valid socket and a buffer of buf.len() bytes; no address.
        let n = unsafe {
            libc::syscall(
                libc::SYS_sendto,
                sock.as_raw_fd(),
                buf.as_ptr() as *const libc::c_void,
                buf.len(),
                libc::MSG_NOSIGNAL,
                std::ptr::null::<libc::sockaddr>(),
                0 as libc::socklen_t,
            )
        } as isize;
        if n < 0 {
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => continue,
                // SO_SNDTIMEO ran out.
                std::io::ErrorKind::WouldBlock => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the daemon does not read",
                    ))
                }
                _ => return Err(e),
            }
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn knob_u64(k: &knobs::Knob, dflt: u64, lo: u64, hi: u64) -> u64 {
    match std::env::var(k.var) {
        Ok(v) if !v.is_empty() => match v.parse::<u64>() {
            Ok(n) if (lo..=hi).contains(&n) => n,
            _ => {
                log(&format!("{}={v}: expected {}; using {dflt}", k.var, k.form));
                dflt
            }
        },
        _ => dflt,
    }
}

/// The process's connection, made by the first call (cuInit, normally).
static REMOTE: OnceLock<Result<Arc<Remote>, CuResult>> = OnceLock::new();

pub fn get() -> Result<&'static Arc<Remote>, CuResult> {
    REMOTE
        .get_or_init(|| {
            let r = Remote::connect().map_err(|(code, why)| {
                log(&why);
                code
            });
            if r.is_ok() && knob_u64(&knobs::CUDA_REMOTE_STATS, 0, 0, 1) == 1 {
                // SAFETY: a plain function of this library; glibc's atexit from a
                // shared object runs it at exit or when the object is unloaded.
                unsafe { libc::atexit(say_counts) };
            }
            r
        })
        .as_ref()
        .map_err(|e| *e)
}

/// A connection to one daemon: the socket (read timeout cleared), the reader with
/// whatever followed the Welcome, and the uploads the daemon holds for us.
pub(crate) struct Dialed {
    pub sock: TcpStream,
    pub rd: FrameReader,
    pub held: HashSet<[u8; 32]>,
}

/// Connects to `addr` and says hello as `client_id`.
pub(crate) fn dial(addr: &str, client_id: u64, timeout: Duration) -> Result<Dialed, String> {
    let fail = |e: std::io::Error| format!("daemon {addr}: {e}");
    let mut sock = crate::link::open(addr, Instant::now() + timeout)?;
    sock.set_write_timeout(Some(timeout)).map_err(fail)?;
    sock.set_read_timeout(Some(timeout)).map_err(fail)?;
    let mut out = Vec::new();
    frame::encode(
        &Msg::Hello {
            version: frame::VERSION,
            client_id,
        },
        &mut out,
    );
    send_all(&sock, &out).map_err(fail)?;
    let mut rd = FrameReader::new();
    let held: HashSet<[u8; 32]> = loop {
        if let Some(body) = rd.next_frame().map_err(|e| format!("daemon {addr}: {e}"))? {
            match frame::decode(body) {
                Ok(Msg::Welcome { chunks, .. }) => break chunks.into_iter().collect(),
                Ok(Msg::Refused { reason }) => {
                    return Err(format!("daemon {addr} refused us: {reason}"))
                }
                other => return Err(format!("daemon {addr}: unexpected {other:?}")),
            }
        }
        if rd.fill(&mut sock).map_err(fail)? == 0 {
            return Err(format!("daemon {addr} closed the connection"));
        }
    };
    // The receiver blocks in read until the daemon speaks or goes away.
    sock.set_read_timeout(None).map_err(fail)?;
    Ok(Dialed { sock, rd, held })
}

impl Remote {
    fn connect() -> Result<Arc<Remote>, (CuResult, String)> {
        let list = std::env::var(knobs::CUDA_REMOTE.var).unwrap_or_default();
        let addrs = sched::parse_list(&list).map_err(|e| (NO_DEVICE, e))?;
        let timeout = Duration::from_millis(knob_u64(
            &knobs::CUDA_REMOTE_TIMEOUT_MS,
            30000,
            1,
            3_600_000,
        ));
        let linger =
            Duration::from_micros(knob_u64(&knobs::CUDA_REMOTE_LINGER_US, 200, 0, 100_000));
        let cache_min = knob_u64(&knobs::CUDA_REMOTE_CACHE_MIN, 65536, 0, 16 << 20) as usize;
        let naive = knob_u64(&knobs::CUDA_REMOTE_NAIVE, 0, 0, 1) == 1;
        let probe_ms = knob_u64(&knobs::CUDA_REMOTE_PROBE_MS, 1000, 1, 60_000);
        let move_ms = knob_u64(&knobs::CUDA_REMOTE_MOVE_MS, 2000, 0, 3_600_000);
        let replay_limit = (knob_u64(&knobs::CUDA_REMOTE_REPLAY_MB, 256, 0, 65536) << 20) as usize;
        let reconnect = Duration::from_millis(knob_u64(
            &knobs::CUDA_REMOTE_RECONNECT_MS,
            10000,
            1,
            3_600_000,
        ));
        let mut id = [0u8; 8];
        openssl::rand::rand_bytes(&mut id).map_err(|e| (NO_DEVICE, e.to_string()))?;
        // The session's id for reconnects (placement's probes hello with their own).
        let client_id = u64::from_le_bytes(id);
        // The daemon (of several: the one placement picks), past its Welcome; a lost
        // connection goes back to it first, then to the others in list order.
        let sched::Conn {
            addr,
            sock,
            rd,
            held,
        } = sched::place(&list, timeout, probe_ms)?;
        let at = addrs.iter().position(|a| *a == addr).unwrap_or(0);
        let fail = |e: std::io::Error| (NO_DEVICE, format!("daemon {addr}: {e}"));
        sock.set_write_timeout(Some(timeout)).map_err(fail)?;
        // The receiver blocks in read until the daemon speaks or goes away.
        sock.set_read_timeout(None).map_err(fail)?;
        let rx = sock.try_clone().map_err(fail)?;
        let r = Arc::new(Remote {
            tx: Mutex::new(Tx {
                sock,
                batch: Vec::new(),
                last_send: Instant::now(),
            }),
            tx_cv: Condvar::new(),
            st: Mutex::new(St {
                journal: Journal::new(replay_limit),
                ..St::default()
            }),
            cv: Notifier::new(),
            timeout,
            addrs,
            at: AtomicUsize::new(at),
            client_id,
            replay_limit,
            reconnect,
            probe_ms,
            linger,
            naive,
            cache_min,
            next: AtomicU64::new(1),
            next_addr: AtomicU64::new(wire::SIM_BASE),
            held: Mutex::new(held),
            funcs: Mutex::new(HashMap::new()),
            cached: Mutex::new(HashMap::new()),
            move_ms,
            own: AtomicU64::new(0),
            synced: AtomicU64::new(0),
            moves: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            cut: Mutex::new(Cut::Idle),
            cut_cv: Condvar::new(),
            counts: Counts::default(),
        });
        let me = Arc::clone(&r);
        std::thread::Builder::new()
            .name("cuda-remote-rx".into())
            .spawn(move || me.receive(rx, rd))
            .map_err(fail)?;
        let me = Arc::clone(&r);
        std::thread::Builder::new()
            .name("cuda-remote-tx".into())
            .spawn(move || me.flusher())
            .map_err(fail)?;
        if r.movable() {
            let me = Arc::clone(&r);
            std::thread::Builder::new()
                .name("cuda-remote-move".into())
                .spawn(move || me.mover())
                .map_err(fail)?;
        }
        Ok(r)
    }

    /// A fresh id (handles, sequence numbers, requests share one counter).
    pub fn id(&self) -> u64 {
        self.next.fetch_add(1, Relaxed)
    }

    /// A simulated device address for `size` bytes (never reused).
    pub fn alloc_addr(&self, size: u64) -> u64 {
        let step = size.max(1).div_ceil(512) * 512 + 512;
        self.next_addr.fetch_add(step, Relaxed)
    }

    pub fn dead(&self) -> Option<CuResult> {
        lock(&self.st).dead
    }

    /// Queues a call; `now`: send the batch at once (a wait follows).
    pub fn send(&self, c: &Call<'_>, now: bool) -> Result<(), CuResult> {
        self.send_rec(c, None, now)
    }

    /// Is the guardian on?
    pub fn guarded(&self) -> bool {
        self.replay_limit > 0
    }

    /// Queues a call and, with the guardian on, keeps `rec` in its journal: the
    /// journal gets it under the same lock as the batch, so a replay (which clears
    /// the batch) holds every call the program made, once.
    pub fn send_rec(&self, c: &Call<'_>, rec: Option<Rec>, now: bool) -> Result<(), CuResult> {
        if let Some(e) = self.dead() {
            return Err(e);
        }
        let mut one = Vec::new();
        wire::put_call(c, &mut one);
        if one.len() + 64 > frame::MAX_FRAME {
            // Only an oversized module image gets here.
            return Err(INVALID_VALUE);
        }
        let mut tx = lock(&self.tx);
        if tx.batch.len() + one.len() > (1 << 20) {
            self.flush_locked(&mut tx)?;
        }
        self.counts.calls.fetch_add(1, Relaxed);
        if let Some(rec) = rec.filter(|_| self.guarded()) {
            // After the send lock, so that a replay in progress has said what it
            // could not restore.
            match &rec {
                Rec::DtoH { src, .. } => self.check_lost(*src)?,
                Rec::Launch { ptrs, .. } => {
                    for &p in ptrs {
                        self.check_lost(p)?;
                    }
                }
                _ => {}
            }
            let seq = self.id();
            lock(&self.st).journal.push(seq, rec);
        }
        tx.batch.extend_from_slice(&one);
        if self.naive && !now {
            // The naive forwarder: this call's round trip before the next (an empty
            // probe behind it, answered once the daemon has run the call).
            self.flush_locked(&mut tx)?;
            drop(tx);
            return self.ask(|req| Call::Probe { req, pad: &[] }).map(|_| ());
        }
        if now || self.linger.is_zero() {
            self.flush_locked(&mut tx)
        } else {
            self.tx_cv.notify_one();
            Ok(())
        }
    }

    /// Sends whatever is batched.
    pub fn flush(&self) -> Result<(), CuResult> {
        let mut tx = lock(&self.tx);
        self.flush_locked(&mut tx)
    }

    fn flush_locked(&self, tx: &mut Tx) -> Result<(), CuResult> {
        if tx.batch.is_empty() {
            return Ok(());
        }
        let mut out = Vec::with_capacity(tx.batch.len() + 5);
        frame::encode(&Msg::Cuda { calls: &tx.batch }, &mut out);
        self.counts.frames.fetch_add(1, Relaxed);
        self.counts.bytes.fetch_add(tx.batch.len() as u64, Relaxed);
        tx.batch.clear();
        tx.last_send = Instant::now();
        if let Err(e) = send_all(&tx.sock, &out) {
            if self.guarded() {
                // The receiver sees the connection end and replays the journal,
                // which holds what this batch held.
                let _ = tx.sock.shutdown(std::net::Shutdown::Both);
                return Ok(());
            }
            self.lost(&format!("sending to the daemon: {e}"));
            return Err(DEVICE_UNAVAILABLE);
        }
        Ok(())
    }

    /// Sends a batch once it has waited its linger; pings an idle connection so that
    /// the daemon's idle bound does not close it under a quiet program.
    fn flusher(self: Arc<Self>) {
        loop {
            let mut tx = lock(&self.tx);
            while tx.batch.is_empty() {
                let (g, t) = self
                    .tx_cv
                    .wait_timeout(tx, Duration::from_secs(10))
                    .unwrap_or_else(|p| p.into_inner());
                tx = g;
                if self.dead().is_some() {
                    return;
                }
                if t.timed_out() && tx.batch.is_empty() && tx.last_send.elapsed().as_secs() >= 30 {
                    let mut out = Vec::new();
                    frame::encode(&Msg::Ping { token: 0 }, &mut out);
                    tx.last_send = Instant::now();
                    if send_all(&tx.sock, &out).is_err() {
                        if self.guarded() {
                            let _ = tx.sock.shutdown(std::net::Shutdown::Both);
                            continue;
                        }
                        drop(tx);
                        self.lost("pinging the daemon failed");
                        return;
                    }
                }
            }
            drop(tx);
            std::thread::sleep(self.linger);
            let mut tx = lock(&self.tx);
            let _ = self.flush_locked(&mut tx);
        }
    }

    /// Has the daemon reported the call `seq`?
    pub(crate) fn reported(&self, seq: u64) -> bool {
        !lock(&self.st).pending.contains_key(&seq)
    }

    pub(crate) fn wake_all(&self) {
        self.cv.notify_all();
        self.tx_cv.notify_all();
    }

    /// Keeps `rec` in the journal without sending anything (what the daemon did on
    /// a query, a function looked up).
    pub fn journal(&self, rec: Rec) {
        if !self.guarded() {
            return;
        }
        let _tx = lock(&self.tx);
        let seq = self.id();
        lock(&self.st).journal.push(seq, rec);
    }

    /// Fails a use of device memory whose contents a replay could not restore
    /// (CUDA_ERROR_DEVICE_UNAVAILABLE, one line per allocation).
    pub fn check_lost(&self, addr: u64) -> Result<(), CuResult> {
        let mut st = lock(&self.st);
        let Some((&base, (size, said))) = st.lost.range_mut(..=addr).next_back() else {
            return Ok(());
        };
        if addr >= base + *size {
            return Ok(());
        }
        if !*said {
            *said = true;
            log(&format!(
                "device memory {base:#x} ({size} bytes) was written by a kernel before the \
                 daemon was lost and never read back: its contents are gone \
                 (CUDA_ERROR_DEVICE_UNAVAILABLE until it is uploaded whole again)"
            ));
        }
        Err(DEVICE_UNAVAILABLE)
    }

    /// An upload of `len` bytes at `addr`: a lost allocation written whole is whole
    /// again.
    pub fn restored(&self, addr: u64, len: u64) {
        let mut st = lock(&self.st);
        if st.lost.get(&addr).is_some_and(|&(s, _)| s == len) {
            st.lost.remove(&addr);
        }
    }

    pub fn freed(&self, addr: u64) {
        lock(&self.st).lost.remove(&addr);
    }

    pub(crate) fn lost(&self, why: &str) {
        let mut st = lock(&self.st);
        if st.dead.is_none() {
            st.dead = Some(DEVICE_UNAVAILABLE);
            log(&format!(
                "lost the daemon ({why}): CUDA calls fail with CUDA_ERROR_DEVICE_UNAVAILABLE"
            ));
        }
        drop(st);
        self.cv.notify_all();
        self.tx_cv.notify_all();
    }

    /// Handles the frames `rd` holds. Err: the connection is unusable (why).
    pub(crate) fn frames(&self, rd: &mut FrameReader) -> Result<(), String> {
        loop {
            let body = match rd.next_frame() {
                Ok(Some(b)) => b.to_vec(),
                Ok(None) => return Ok(()),
                Err(e) => return Err(format!("bad frame: {e}")),
            };
            match frame::decode(&body) {
                Ok(Msg::CudaNotes { notes }) => {
                    self.notes(notes).map_err(|e| format!("bad note: {e}"))?
                }
                Ok(Msg::Pong { .. }) => {}
                Ok(Msg::Refused { reason }) => return Err(format!("the daemon refused: {reason}")),
                Ok(m) => return Err(format!("unexpected frame {m:?}")),
                Err(e) => return Err(format!("bad frame: {e}")),
            }
        }
    }

    fn receive(self: Arc<Self>, mut sock: TcpStream, mut rd: FrameReader) {
        loop {
            let why = match self.frames(&mut rd) {
                Err(why) => why,
                Ok(()) => match rd.fill(&mut sock) {
                    Ok(0) => "the daemon closed the connection".to_string(),
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    // The read timeout is set only while the mover asks us to park.
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                    {
                        match self.park() {
                            Parked::NotAsked | Parked::Resume => continue,
                            Parked::Moved(s, r) => {
                                (sock, rd) = (s, r);
                                self.watch();
                                continue;
                            }
                            Parked::Failed(why) => why,
                        }
                    }
                    Err(e) => e.to_string(),
                },
            };
            if !self.guarded() || self.dead().is_some() {
                return self.lost(&why);
            }
            // The guardian: another connection with the session replayed, or the
            // error for every call from now on.
            match self.recover(&why) {
                Some((s, r)) => {
                    (sock, rd) = (s, r);
                    self.watch();
                }
                None => return,
            }
        }
    }

    /// Subscribes the (new) connection to its daemon's heartbeats: the mover counts
    /// our own kernels from them.
    fn watch(&self) {
        if self.movable() {
            let _ = self.send(
                &Call::Watch {
                    period_ms: sched::BEAT_PERIOD_MS,
                },
                false,
            );
        }
    }

    fn notes(&self, notes: &[u8]) -> Result<(), wire::WireError> {
        let mut r = wire::Reader::new(notes);
        while let Some(n) = r.note()? {
            match n {
                Note::Answer { req, status, data } => {
                    let mut st = lock(&self.st);
                    // A replay's function lookups (req 0) are answered to nobody.
                    if req != 0 {
                        st.asks.remove(&req);
                        st.answers.insert(req, (status, data.to_vec()));
                    }
                }
                Note::Failed { status, call } => {
                    let mut st = lock(&self.st);
                    if st.sticky == SUCCESS {
                        st.sticky = status;
                        log(&format!("{call} failed on the daemon: CUDA error {status}"));
                    }
                }
                Note::Reached { seq, status, data } => self.reached(seq, status, data),
                // The chosen daemon's load: how much of its queue is ours (mover.rs).
                Note::Heartbeat(b) => self.own.store(b.own as u64, Relaxed),
            }
            self.cv.notify_all();
        }
        Ok(())
    }

    fn reached(&self, seq: u64, status: CuResult, data: &[u8]) {
        let Some(p) = lock(&self.st).pending.remove(&seq) else {
            return;
        };
        if self.guarded() {
            let stream = match &p {
                Pend::DtoH { stream, .. } | Pend::Mark { stream } | Pend::HostFn { stream, .. } => {
                    *stream
                }
            };
            let bytes = (status == SUCCESS && matches!(p, Pend::DtoH { .. })).then_some(data);
            let mut st = lock(&self.st);
            st.journal.reached(seq, bytes);
            // A host function is the program told the stream got there (a
            // completion it acts on); a destroyed stream's end is its last word.
            let ended = st.streams.get(&stream).is_none_or(|s| s.destroyed);
            if matches!(p, Pend::HostFn { .. }) || ended {
                st.journal.synced(stream, seq);
            }
        }
        let stream = match p {
            Pend::DtoH { stream, dst, len } => {
                if status == SUCCESS && data.len() == len {
                    // SAFETY: the program gave us `dst` for `len` bytes in its DtoH
                    // call and, as CUDA requires, keeps it until the stream gets here.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, len) };
                }
                stream
            }
            Pend::Mark { stream } => stream,
            Pend::HostFn { stream, f, user } => {
                if status == SUCCESS {
                    // SAFETY: the program's host function with its own argument, run
                    // once when the stream got there, as cuLaunchHostFunc promises.
                    unsafe { f(user as *mut libc::c_void) };
                }
                stream
            }
        };
        let mut st = lock(&self.st);
        if let Some(s) = st.streams.get_mut(&stream) {
            s.done = s.done.max(seq);
            if status != SUCCESS && s.error == SUCCESS {
                s.error = status;
            }
            if s.destroyed && s.done >= s.last {
                st.streams.remove(&stream);
            }
        }
    }

    /// Registers `p` under a fresh sequence number as the stream's last reported call.
    pub fn track(&self, stream: u64, p: impl FnOnce(u64) -> PendKind) -> u64 {
        let seq = self.id();
        let mut st = lock(&self.st);
        let s = st.streams.entry(stream).or_default();
        s.last = seq;
        s.dirty = false;
        let pend = match p(stream) {
            PendKind::DtoH { dst, len } => Pend::DtoH { stream, dst, len },
            PendKind::Mark => Pend::Mark { stream },
            PendKind::HostFn { f, user } => Pend::HostFn { stream, f, user },
        };
        st.pending.insert(seq, pend);
        seq
    }

    /// Notes that a call was queued on `stream` after its last reported one.
    pub fn touch(&self, stream: u64) {
        lock(&self.st).streams.entry(stream).or_default().dirty = true;
    }

    pub fn stream_created(&self, stream: u64) {
        lock(&self.st).streams.insert(stream, StreamSt::default());
    }

    pub fn stream_destroyed(&self, stream: u64) {
        let mut st = lock(&self.st);
        if let Some(s) = st.streams.get_mut(&stream) {
            s.destroyed = true;
            if s.done >= s.last {
                st.streams.remove(&stream);
            }
        }
    }

    /// Has the stream reached `seq`? (A stream gone was destroyed after reaching it.)
    fn at(st: &St, stream: u64, seq: u64) -> bool {
        st.streams.get(&stream).is_none_or(|s| s.done >= seq)
    }

    fn wait_for(&self, mut ready: impl FnMut(&mut St) -> bool) -> Result<(), CuResult> {
        let deadline = Instant::now() + self.timeout;
        let mut st = lock(&self.st);
        let mut first = true;
        loop {
            if ready(&mut st) {
                return Ok(());
            }
            if first {
                first = false;
                self.counts.round_trips.fetch_add(1, Relaxed);
            }
            if let Some(e) = st.dead {
                return Err(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TIMEOUT);
            }
            let seen = self.cv.generation();
            drop(st);
            self.cv.wait(seen, deadline);
            st = lock(&self.st);
        }
    }

    /// Waits until `stream` reaches `seq`; then any error owed to it. A wait the
    /// program makes is a synchronize: the guardian's log folds there.
    pub fn wait_seq(&self, stream: u64, seq: u64) -> CuResult {
        if let Err(e) = self.wait_for(|st| Self::at(st, stream, seq)) {
            return e;
        }
        if self.guarded() {
            lock(&self.st).journal.synced(stream, seq);
        }
        self.synced.fetch_add(1, Relaxed);
        self.owed(Some(stream))
    }

    /// The error owed to a synchronize (once).
    pub fn owed(&self, stream: Option<u64>) -> CuResult {
        let mut st = lock(&self.st);
        if st.sticky != SUCCESS {
            return std::mem::replace(&mut st.sticky, SUCCESS);
        }
        if let Some(s) = stream.and_then(|s| st.streams.get_mut(&s)) {
            return std::mem::replace(&mut s.error, SUCCESS);
        }
        SUCCESS
    }

    /// A marker on `stream`: synchronize (wait) or query (do not).
    pub fn sync_stream(&self, stream: u64) -> CuResult {
        let seq = self.track(stream, |_| PendKind::Mark);
        if let Err(e) = self.send_rec(
            &Call::Marker {
                stream,
                seq,
                sync: true,
            },
            Some(Rec::Marker { stream, seq }),
            true,
        ) {
            return e;
        }
        self.wait_seq(stream, seq)
    }

    /// cuCtxSynchronize: every stream with work the daemon has not reported done.
    pub fn sync_all(&self) -> CuResult {
        let busy: Vec<u64> = lock(&self.st)
            .streams
            .iter()
            .filter(|(_, s)| !s.destroyed && (s.dirty || s.done < s.last))
            .map(|(&id, _)| id)
            .collect();
        for id in busy {
            let rc = self.sync_stream(id);
            if rc != SUCCESS {
                return rc;
            }
        }
        if self.guarded() {
            // The streams that were idle are synchronized too.
            let mut st = lock(&self.st);
            let idle: Vec<(u64, u64)> = st.streams.iter().map(|(&i, s)| (i, s.done)).collect();
            for (id, done) in idle {
                st.journal.synced(id, done);
            }
        }
        self.owed(None)
    }

    pub fn query_stream(&self, stream: u64) -> CuResult {
        let (dirty, last) = {
            let st = lock(&self.st);
            match st.streams.get(&stream) {
                Some(s) => (s.dirty, s.last),
                None => return SUCCESS,
            }
        };
        let last = if dirty {
            let seq = self.track(stream, |_| PendKind::Mark);
            if let Err(e) = self.send_rec(
                &Call::Marker {
                    stream,
                    seq,
                    sync: false,
                },
                Some(Rec::Marker { stream, seq }),
                true,
            ) {
                return e;
            }
            seq
        } else {
            if let Err(e) = self.flush() {
                return e;
            }
            last
        };
        let st = lock(&self.st);
        if let Some(e) = st.dead {
            return e;
        }
        if Self::at(&st, stream, last) {
            SUCCESS
        } else {
            NOT_READY
        }
    }

    /// An event, on the daemon too (stream waits and timing are the driver's).
    pub fn event_create(&self, ev: u64, flags: u32) -> CuResult {
        lock(&self.st).events.insert(ev, None);
        match self.send_rec(
            &Call::EventCreate { id: ev, flags },
            Some(Rec::EventCreate { id: ev, flags }),
            false,
        ) {
            Ok(()) => SUCCESS,
            Err(e) => e,
        }
    }

    pub fn event_destroy(&self, ev: u64) -> CuResult {
        if lock(&self.st).events.remove(&ev).is_none() {
            return INVALID_HANDLE;
        }
        match self.send_rec(
            &Call::EventDestroy { id: ev },
            Some(Rec::EventDestroy { id: ev }),
            false,
        ) {
            Ok(()) => SUCCESS,
            Err(e) => e,
        }
    }

    pub fn event_record(&self, ev: u64, stream: u64) -> CuResult {
        if !lock(&self.st).events.contains_key(&ev) {
            return INVALID_HANDLE;
        }
        let seq = self.track(stream, |_| PendKind::Mark);
        lock(&self.st).events.insert(ev, Some((stream, seq)));
        match self.send_rec(
            &Call::EventRecord {
                event: ev,
                stream,
                seq,
            },
            Some(Rec::EventRecord {
                event: ev,
                stream,
                seq,
            }),
            false,
        ) {
            Ok(()) => SUCCESS,
            Err(e) => e,
        }
    }

    /// cuStreamWaitEvent: the daemon's stream waits for the event's last record.
    pub fn wait_event(&self, stream: u64, ev: u64) -> CuResult {
        if !lock(&self.st).events.contains_key(&ev) {
            return INVALID_HANDLE;
        }
        let rc = match self.send_rec(
            &Call::WaitEvent { stream, event: ev },
            Some(Rec::WaitEvent { stream, event: ev }),
            false,
        ) {
            Ok(()) => SUCCESS,
            Err(e) => e,
        };
        self.touch(stream);
        rc
    }

    /// cuEventElapsedTime: once both records are done, the daemon's driver measures.
    pub fn elapsed(&self, start: u64, end: u64) -> Result<f32, CuResult> {
        for ev in [start, end] {
            if let Some((stream, seq)) = self.event_at(ev)? {
                self.flush()?;
                let rc = self.wait_seq(stream, seq);
                if rc != SUCCESS {
                    return Err(rc);
                }
            }
        }
        let a = self.ask(|req| Call::Elapsed { req, start, end })?;
        let b: [u8; 4] = a.as_slice().try_into().map_err(|_| INVALID_VALUE)?;
        Ok(f32::from_le_bytes(b))
    }

    fn event_at(&self, ev: u64) -> Result<Option<(u64, u64)>, CuResult> {
        lock(&self.st)
            .events
            .get(&ev)
            .copied()
            .ok_or(INVALID_HANDLE)
    }

    pub fn event_query(&self, ev: u64) -> CuResult {
        let at = match self.event_at(ev) {
            Ok(Some(at)) => at,
            Ok(None) => return SUCCESS,
            Err(e) => return e,
        };
        if let Err(e) = self.flush() {
            return e;
        }
        let st = lock(&self.st);
        if let Some(e) = st.dead {
            return e;
        }
        if Self::at(&st, at.0, at.1) {
            SUCCESS
        } else {
            NOT_READY
        }
    }

    pub fn event_sync(&self, ev: u64) -> CuResult {
        let at = match self.event_at(ev) {
            Ok(Some(at)) => at,
            Ok(None) => return SUCCESS,
            Err(e) => return e,
        };
        // The record itself waits in the batch for its linger: a wait sends it now.
        if let Err(e) = self.flush() {
            return e;
        }
        self.wait_seq(at.0, at.1)
    }

    /// Sends a query and waits for its answer.
    pub fn ask<'a>(&self, c: impl FnOnce(u64) -> Call<'a>) -> Result<Vec<u8>, CuResult> {
        let req = self.id();
        let c = c(req);
        if self.guarded() {
            let mut enc = Vec::new();
            wire::put_call(&c, &mut enc);
            lock(&self.st).asks.insert(req, enc);
        }
        if let Err(e) = self.send(&c, true) {
            lock(&self.st).asks.remove(&req);
            return Err(e);
        }
        let mut got = None;
        let waited = self.wait_for(|st| {
            got = st.answers.remove(&req);
            got.is_some()
        });
        lock(&self.st).asks.remove(&req);
        waited?;
        let (status, data) = got.expect("answered");
        if status != SUCCESS {
            return Err(status);
        }
        Ok(data)
    }

    /// An upload's pieces as calls' data. Uncached: sent as they are. Cached: the
    /// pieces whose hash the daemon is believed to hold (its Welcome inventory, what
    /// we sent since) are asked about first (one round trip; the daemon keeps what
    /// it says it holds until we refer to it), then sent by reference; the others
    /// are sent and cached.
    pub fn upload<'a>(
        &self,
        pieces: Vec<&'a [u8]>,
        cache: bool,
    ) -> Result<Vec<wire::Data<'a>>, CuResult> {
        if !cache {
            return Ok(pieces.into_iter().map(wire::Data::Literal).collect());
        }
        let hashes: Vec<[u8; 32]> = pieces.iter().map(|p| openssl::sha::sha256(p)).collect();
        let ask: Vec<usize> = {
            let held = lock(&self.held);
            (0..pieces.len())
                .filter(|&i| held.contains(&hashes[i]))
                .collect()
        };
        let mut pinned = vec![false; pieces.len()];
        if !ask.is_empty() {
            let mut blob = Vec::with_capacity(ask.len() * 32);
            for &i in &ask {
                blob.extend_from_slice(&hashes[i]);
            }
            match self.ask(|req| Call::Pin { req, hashes: &blob }) {
                Ok(a) if a.len() == ask.len() => {
                    let mut held = lock(&self.held);
                    for (k, &i) in ask.iter().enumerate() {
                        if a[k] == 1 {
                            pinned[i] = true;
                        } else {
                            held.remove(&hashes[i]);
                        }
                    }
                }
                Err(e) if self.dead().is_some() => return Err(e),
                // Not answered as asked: send everything.
                _ => {}
            }
        }
        let mut held = lock(&self.held);
        Ok(pieces
            .into_iter()
            .zip(hashes)
            .zip(pinned)
            .map(|((bytes, hash), p)| {
                if p {
                    wire::Data::Ref {
                        hash,
                        len: bytes.len() as u32,
                    }
                } else {
                    held.insert(hash);
                    wire::Data::Cache { hash, bytes }
                }
            })
            .collect())
    }
}

/// What `track` registers (the stream is filled in).
pub enum PendKind {
    DtoH {
        dst: usize,
        len: usize,
    },
    Mark,
    HostFn {
        f: unsafe extern "C" fn(*mut libc::c_void),
        user: usize,
    },
}
