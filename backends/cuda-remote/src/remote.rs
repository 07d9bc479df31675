//! The connection to the daemon and what the client simulates: the batch of calls not
//! yet sent, the progress of each stream as the daemon reports it, the host work
//! (DtoH destinations, host functions) waiting for a stream to get somewhere, and
//! the errors owed to the next synchronize.
//!
//! Three kinds of thread touch it: the program's (calls), the flusher (sends a batch
//! that waited its linger) and the receiver (notes: answers, stream progress). Every
//! wait has the deadline TOFFLOAD_CUDA_REMOTE_TIMEOUT_MS, and a lost connection ends
//! every wait at once with CUDA_ERROR_DEVICE_UNAVAILABLE.

use crate::frame::{self, FrameReader, Msg};
use crate::knobs;
use crate::sched;
use crate::wire::{self, Call, Note};
use std::collections::{HashMap, HashSet};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
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
struct St {
    dead: Option<CuResult>,
    /// The first error of a call sent without waiting, owed to the next synchronize.
    sticky: CuResult,
    answers: HashMap<u64, (CuResult, Vec<u8>)>,
    streams: HashMap<u64, StreamSt>,
    pending: HashMap<u64, Pend>,
    /// event -> (stream, seq) of its last record.
    events: HashMap<u64, Option<(u64, u64)>>,
}

struct Tx {
    sock: TcpStream,
    batch: Vec<u8>,
    last_send: Instant,
}

pub struct Remote {
    tx: Mutex<Tx>,
    tx_cv: Condvar,
    st: Mutex<St>,
    cv: Condvar,
    pub timeout: Duration,
    linger: Duration,
    pub cache_min: usize,
    next: AtomicU64,
    next_addr: AtomicU64,
    /// Upload hashes the daemon holds for us (its Welcome inventory, then what we sent).
    held: Mutex<HashSet<[u8; 32]>>,
    /// Function id -> parameter layout.
    pub funcs: Mutex<HashMap<u64, Vec<(u32, u32)>>>,
    /// Answers that never change (device queries), by query.
    pub cached: Mutex<HashMap<String, Vec<u8>>>,
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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
pub fn get() -> Result<&'static Arc<Remote>, CuResult> {
    static R: OnceLock<Result<Arc<Remote>, CuResult>> = OnceLock::new();
    R.get_or_init(|| {
        Remote::connect().map_err(|(code, why)| {
            log(&why);
            code
        })
    })
    .as_ref()
    .map_err(|e| *e)
}

impl Remote {
    fn connect() -> Result<Arc<Remote>, (CuResult, String)> {
        let list = std::env::var(knobs::CUDA_REMOTE.var).unwrap_or_default();
        let timeout = Duration::from_millis(knob_u64(
            &knobs::CUDA_REMOTE_TIMEOUT_MS,
            30000,
            1,
            3_600_000,
        ));
        let linger =
            Duration::from_micros(knob_u64(&knobs::CUDA_REMOTE_LINGER_US, 200, 0, 100_000));
        let cache_min = knob_u64(&knobs::CUDA_REMOTE_CACHE_MIN, 65536, 0, 16 << 20) as usize;
        let probe_ms = knob_u64(&knobs::CUDA_REMOTE_PROBE_MS, 1000, 1, 60_000);
        // The daemon (of several: the one placement picks), past its Welcome.
        let sched::Conn {
            addr,
            sock,
            rd,
            held,
        } = sched::place(&list, timeout, probe_ms)?;
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
            st: Mutex::new(St::default()),
            cv: Condvar::new(),
            timeout,
            linger,
            cache_min,
            next: AtomicU64::new(1),
            next_addr: AtomicU64::new(wire::SIM_BASE),
            held: Mutex::new(held),
            funcs: Mutex::new(HashMap::new()),
            cached: Mutex::new(HashMap::new()),
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
        tx.batch.extend_from_slice(&one);
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
        tx.batch.clear();
        tx.last_send = Instant::now();
        if let Err(e) = send_all(&tx.sock, &out) {
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

    fn lost(&self, why: &str) {
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

    fn receive(self: Arc<Self>, mut sock: TcpStream, mut rd: FrameReader) {
        loop {
            loop {
                let body = match rd.next_frame() {
                    Ok(Some(b)) => b.to_vec(),
                    Ok(None) => break,
                    Err(e) => return self.lost(&format!("bad frame: {e}")),
                };
                match frame::decode(&body) {
                    Ok(Msg::CudaNotes { notes }) => {
                        if let Err(e) = self.notes(notes) {
                            return self.lost(&format!("bad note: {e}"));
                        }
                    }
                    Ok(Msg::Pong { .. }) => {}
                    Ok(Msg::Refused { reason }) => {
                        return self.lost(&format!("the daemon refused: {reason}"))
                    }
                    Ok(m) => return self.lost(&format!("unexpected frame {m:?}")),
                    Err(e) => return self.lost(&format!("bad frame: {e}")),
                }
            }
            match rd.fill(&mut sock) {
                Ok(0) => return self.lost("the daemon closed the connection"),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return self.lost(&e.to_string()),
            }
        }
    }

    fn notes(&self, notes: &[u8]) -> Result<(), wire::WireError> {
        let mut r = wire::Reader::new(notes);
        while let Some(n) = r.note()? {
            match n {
                Note::Answer { req, status, data } => {
                    lock(&self.st).answers.insert(req, (status, data.to_vec()));
                }
                Note::Failed { status, call } => {
                    let mut st = lock(&self.st);
                    if st.sticky == SUCCESS {
                        st.sticky = status;
                        log(&format!("{call} failed on the daemon: CUDA error {status}"));
                    }
                }
                Note::Reached { seq, status, data } => self.reached(seq, status, data),
                // The chosen daemon's load: nothing re-places a running context.
                Note::Heartbeat(_) => {}
            }
            self.cv.notify_all();
        }
        Ok(())
    }

    fn reached(&self, seq: u64, status: CuResult, data: &[u8]) {
        let Some(p) = lock(&self.st).pending.remove(&seq) else {
            return;
        };
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
        loop {
            if ready(&mut st) {
                return Ok(());
            }
            if let Some(e) = st.dead {
                return Err(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TIMEOUT);
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits until `stream` reaches `seq`; then any error owed to it.
    pub fn wait_seq(&self, stream: u64, seq: u64) -> CuResult {
        if let Err(e) = self.wait_for(|st| Self::at(st, stream, seq)) {
            return e;
        }
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
        if let Err(e) = self.send(
            &Call::Marker {
                stream,
                seq,
                sync: true,
            },
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
            if let Err(e) = self.send(
                &Call::Marker {
                    stream,
                    seq,
                    sync: false,
                },
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

    pub fn event_create(&self, ev: u64) {
        lock(&self.st).events.insert(ev, None);
    }

    pub fn event_destroy(&self, ev: u64) -> CuResult {
        match lock(&self.st).events.remove(&ev) {
            Some(_) => SUCCESS,
            None => INVALID_HANDLE,
        }
    }

    pub fn event_record(&self, ev: u64, stream: u64) -> CuResult {
        if !lock(&self.st).events.contains_key(&ev) {
            return INVALID_HANDLE;
        }
        let seq = self.track(stream, |_| PendKind::Mark);
        lock(&self.st).events.insert(ev, Some((stream, seq)));
        match self.send(
            &Call::Marker {
                stream,
                seq,
                sync: false,
            },
            false,
        ) {
            Ok(()) => SUCCESS,
            Err(e) => e,
        }
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
        self.send(&c(req), true)?;
        let mut got = None;
        self.wait_for(|st| {
            got = st.answers.remove(&req);
            got.is_some()
        })?;
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
