//! The daemon's side of CUDA API remoting: one client connection's CUDA state (its
//! allocations, streams, modules and functions, under the client's own handles) and
//! the execution of its batches on the local GPU, through the same dynamically loaded
//! driver as the cuda backend (cuda/driver.rs).
//!
//! Calls run in order on the connection's thread. Whatever the client waits for (a
//! DtoH's bytes, a marker) is a host function queued on the stream behind it, which
//! puts a note on the connection's outgoing queue when the stream gets there: the
//! connection thread never waits on the GPU but to destroy a stream.

use super::cache::{ChunkCache, Part};
use super::chunk::MAX_CHUNK;
use super::cuda_ctx::SessionCtx;
use super::cuda_wire::{self as w, Beat, Call, Data, Note, Query};
use super::state::ConnOut;
use crate::cuda::driver;
use cudarc::driver::sys;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SUCCESS: i32 = 0;
const INVALID_VALUE: i32 = 1;
const NO_DEVICE: i32 = 100;
const INVALID_HANDLE: i32 = 400;
const NOT_SUPPORTED: i32 = 801;
const OUT_OF_MEMORY: i32 = 2;
/// What one session may hold (a client cannot exhaust the daemon's host memory or
/// threads with handles; device memory is bounded by the GPU itself).
const MAX_STREAMS: usize = 4096;
const MAX_MODULES: usize = 1024;
const MAX_FUNCS: usize = 65536;
const MAX_ALLOCS: usize = 1 << 20;
const MAX_EVENTS: usize = 65536;
/// A cached upload the daemon no longer holds (evicted since the client learnt of
/// it): the copy did not happen.
const MISSING_UPLOAD: i32 = 999;

fn code(r: sys::CUresult) -> i32 {
    r as i32
}

/// Heartbeat periods a client may ask for (bounded both ways: a flood of beats, or
/// beats too rare to place by).
const BEAT_MIN: Duration = Duration::from_millis(10);
const BEAT_MAX: Duration = Duration::from_secs(60);

/// The GPU's load across every session of the daemon, as heartbeats report it.
#[derive(Default, Debug)]
pub struct GpuLoad {
    /// Kernels launched and not yet passed by a reported call of their stream.
    queue: AtomicU64,
    /// The queue's recent time-weighted mean: a sustained load whose instantaneous
    /// queue happens to be empty when a probe asks still shows.
    recent: Mutex<QueueMean>,
    /// Sessions holding a context now, and ever.
    sessions: AtomicU64,
    pub opened: AtomicU64,
    /// EWMA of the time per kernel, ns.
    kernel_ns: AtomicU64,
    /// What a kernel takes on this GPU when it is free, reported while it is idle
    /// (the loaded average would otherwise stay until the next kernel ran, and a
    /// daemon whose load has gone would keep looking slow to placement, so get
    /// none). Its stretches: begun on an idle GPU (no kernel queued), with no other
    /// session's kernel launched until they passed (one begun idle that a load then
    /// joined ran at the load's pace), each divided by every kernel passed over it
    /// (a task's own streams take turns on a GPU one kernel fills: each stream's
    /// stretch is then several kernels long).
    alone_ns: AtomicU64,
    /// Kernels launched ever, by every session: a session's own launches against
    /// this count's growth tell whether its stretch ran alone.
    launches: AtomicU64,
    /// Kernels passed ever (dropped ones included), by every session.
    passed: AtomicU64,
}

/// Time constant of the queue's mean: a few of the fake or real GPU's kernels at
/// most, well under a probe's period.
const QUEUE_TAU: Duration = Duration::from_millis(200);

/// An exponentially time-weighted mean of a level that changes in steps.
#[derive(Default, Debug, Clone, Copy)]
pub struct QueueMean {
    mean: f64,
    level: u64,
    since: Option<Instant>,
}

impl QueueMean {
    /// The mean at `now`, the level having held since the last step.
    pub fn at(&self, now: Instant) -> f64 {
        match self.since {
            None => self.level as f64,
            Some(t) => {
                let dt = now.saturating_duration_since(t).as_secs_f64();
                let keep = (-dt / QUEUE_TAU.as_secs_f64()).exp();
                self.mean * keep + self.level as f64 * (1.0 - keep)
            }
        }
    }

    /// The level steps to `level` at `now`.
    pub fn step(&mut self, level: u64, now: Instant) {
        self.mean = self.at(now);
        self.level = level;
        self.since = Some(now);
    }
}

/// One session's share of the GPU's load: what it adds to the queue is also counted
/// as its own, which its heartbeats report beside the whole (a client comparing
/// daemons counts its own kernels on every candidate alike: sched.rs).
struct SessionLoad {
    gpu: Arc<GpuLoad>,
    own: AtomicU64,
    /// Kernels this session launched ever (GpuLoad::launches counts everyone's).
    launches: AtomicU64,
}

/// Kernels launched ever, on the whole GPU and by one session, when a stretch began.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Launches {
    gpu: u64,
    own: u64,
    /// Kernels passed on the GPU.
    passed: u64,
}

impl SessionLoad {
    fn launched(&self) {
        self.own.fetch_add(1, Relaxed);
        self.launches.fetch_add(1, Relaxed);
        self.gpu.launched();
    }

    /// `alone`: the stretch began on an idle GPU, with these launches so far. It ran
    /// alone if every kernel launched since was this session's own.
    fn passed(&self, kernels: u64, since: Option<Instant>, alone: Option<Launches>) {
        let _ = self
            .own
            .fetch_update(Relaxed, Relaxed, |q| Some(q.saturating_sub(kernels)));
        let now = self.launched_so_far();
        let alone = alone
            .filter(|b| now.gpu - b.gpu == now.own - b.own)
            .map(|b| b.passed);
        self.gpu.passed(kernels, since, alone);
    }

    fn launched_so_far(&self) -> Launches {
        // Own first: a launch between the two loads counts on the GPU's side only,
        // as another session's would (the stretch is then not taken as alone).
        let own = self.launches.load(Relaxed);
        Launches {
            gpu: self.gpu.launches.load(Relaxed),
            own,
            passed: self.gpu.passed.load(Relaxed),
        }
    }

    /// No kernel is queued now: one launched now starts on an idle GPU; the
    /// launches so far then.
    fn alone(&self) -> Option<Launches> {
        (self.gpu.queue.load(Relaxed) == 0).then(|| self.launched_so_far())
    }

    fn beat(&self) -> Beat {
        Beat {
            own: self.own.load(Relaxed).min(u32::MAX as u64) as u32,
            ..self.gpu.beat()
        }
    }
}

impl GpuLoad {
    pub fn beat(&self) -> Beat {
        let now = self.queue.load(Relaxed);
        let mean = self.recent.lock().map_or(0.0, |m| m.at(Instant::now()));
        let alone = self.alone_ns.load(Relaxed);
        let idle = now == 0 && mean < 0.5;
        Beat {
            queue: now.max(mean.round() as u64).min(u32::MAX as u64) as u32,
            sessions: self.sessions.load(Relaxed).min(u32::MAX as u64) as u32,
            kernel_ns: if idle && alone > 0 {
                alone
            } else {
                self.kernel_ns.load(Relaxed)
            },
            own: 0,
        }
    }

    /// Changes the queue by `f`, under the mean's lock so that the mean's steps
    /// follow the queue's in order.
    fn change(&self, f: impl Fn(u64) -> u64) {
        let mut m = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let old = self
            .queue
            .fetch_update(Relaxed, Relaxed, |q| Some(f(q)))
            .unwrap_or(0);
        m.step(f(old), Instant::now());
    }

    /// A kernel was launched.
    fn launched(&self) {
        self.launches.fetch_add(1, Relaxed);
        self.change(|q| q.saturating_add(1));
    }

    /// A stretch of a stream with `kernels` kernels, begun at `since`, was passed (or
    /// dropped: `since` None). `alone`: begun on an idle GPU, no other session
    /// launching a kernel until now, with this many kernels passed then.
    fn passed(&self, kernels: u64, since: Option<Instant>, alone: Option<u64>) {
        if kernels == 0 {
            return;
        }
        self.change(|q| q.saturating_sub(kernels));
        let over = self.passed.fetch_add(kernels, Relaxed) + kernels;
        if let Some(t) = since {
            let ns = t.elapsed().as_nanos() as u64;
            // 1/4 new: a load that comes or goes shows within a few stretches.
            let ewma = |per: u64| {
                let per = per.max(1);
                move |old: u64| Some(if old == 0 { per } else { (old * 3 + per) / 4 })
            };
            let _ = self
                .kernel_ns
                .fetch_update(Relaxed, Relaxed, ewma(ns / kernels));
            if let Some(before) = alone {
                let per = ns / (over - before).max(kernels);
                let _ = self.alone_ns.fetch_update(Relaxed, Relaxed, ewma(per));
            }
        }
    }
}

/// What one batch did, for the daemon's counters.
#[derive(Default, Debug)]
pub struct Tally {
    pub calls: u64,
    pub syncs: u64,
    pub upload_hits: u64,
    pub upload_misses: u64,
    pub bytes_saved: u64,
    pub failed: u64,
}

struct Strm {
    s: sys::CUstream,
    /// Host bytes of copies queued on the stream, kept until a host function behind
    /// them runs.
    keep: Vec<Arc<[u8]>>,
    /// Kernels queued since the last marker, and when the first call after it was
    /// (`alone`: no kernel was queued then; see GpuLoad::passed).
    kernels: u64,
    since: Option<Instant>,
    alone: Option<Launches>,
    /// A stretch with kernels was marked on this stream: the first one pays for what
    /// a driver does lazily at a stream's first kernel (several kernels' time on the
    /// fake driver; a module's lazy load on a real one), no kernel's time alone.
    warm: bool,
}

impl Strm {
    fn new(s: sys::CUstream) -> Strm {
        Strm {
            s,
            keep: Vec::new(),
            kernels: 0,
            since: None,
            alone: None,
            warm: false,
        }
    }
}

struct Func {
    f: sys::CUfunction,
    module: u64,
    layout: Vec<(u32, u32)>,
}

/// A queued host function's state: the note it sends.
struct Pending {
    out: Arc<ConnOut>,
    seq: u64,
    data: Vec<u8>,
    _keep: Vec<Arc<[u8]>>,
    load: Arc<SessionLoad>,
    kernels: u64,
    since: Option<Instant>,
    alone: Option<Launches>,
}

unsafe extern "C" fn reached(user: *mut c_void) {
    // SAFETY: `user` is the Box<Pending> leaked by `mark`, handed to us exactly once.
    let p = unsafe { Box::from_raw(user as *mut Pending) };
    p.load.passed(p.kernels, p.since, p.alone);
    let mut note = Vec::with_capacity(p.data.len() + 20);
    w::put_note(
        &Note::Reached {
            seq: p.seq,
            status: SUCCESS,
            data: &p.data,
        },
        &mut note,
    );
    push(&p.out, note);
}

fn push(out: &ConnOut, note: Vec<u8>) {
    out.cuda
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(note);
    out.wake.signal();
}

/// One client connection's CUDA state.
pub struct CudaSession {
    out: Arc<ConnOut>,
    part: Part,
    ctx: Option<SessionCtx>,
    default: sys::CUstream,
    events: HashMap<u64, sys::CUevent>,
    /// Client address -> (length, device address).
    mem: BTreeMap<u64, (u64, sys::CUdeviceptr)>,
    streams: HashMap<u64, Strm>,
    modules: HashMap<u64, sys::CUmodule>,
    funcs: HashMap<u64, Func>,
    /// Uploads the client was told we hold, kept until it has referred to them as
    /// often as it asked (the cache may evict them meanwhile).
    pinned: HashMap<[u8; 32], (Arc<[u8]>, u32)>,
    load: Arc<SessionLoad>,
    /// Heartbeats asked for: the period and when the next is due.
    beats: Option<(Duration, Instant)>,
}

impl CudaSession {
    pub fn new(out: Arc<ConnOut>, part: Part, load: Arc<GpuLoad>) -> Self {
        CudaSession {
            out,
            part,
            ctx: None,
            default: std::ptr::null_mut(),
            events: HashMap::new(),
            mem: BTreeMap::new(),
            streams: HashMap::new(),
            modules: HashMap::new(),
            funcs: HashMap::new(),
            pinned: HashMap::new(),
            load: Arc::new(SessionLoad {
                gpu: load,
                own: AtomicU64::new(0),
                launches: AtomicU64::new(0),
            }),
            beats: None,
        }
    }

    /// Sends a heartbeat if one is due; how long until the next (None: not asked).
    pub fn heartbeat(&mut self) -> Option<Duration> {
        let (period, next) = self.beats.as_mut()?;
        let now = Instant::now();
        if now >= *next {
            let mut note = Vec::with_capacity(24);
            w::put_note(&Note::Heartbeat(self.load.beat()), &mut note);
            push(&self.out, note);
            *next = now + *period;
        }
        Some(next.saturating_duration_since(now))
    }

    fn ensure_ctx(&mut self) -> Result<(), i32> {
        if let Some(c) = &self.ctx {
            return c.make_current();
        }
        let c = SessionCtx::open(&self.part)?;
        c.make_current()?;
        self.ctx = Some(c);
        self.load.gpu.sessions.fetch_add(1, Relaxed);
        self.load.gpu.opened.fetch_add(1, Relaxed);
        Ok(())
    }

    fn stream(&mut self, id: u64) -> Result<&mut Strm, i32> {
        if id == w::NULL_STREAM && self.default.is_null() {
            {
                let mut s = std::ptr::null_mut();
                // SAFETY: context current (ensure_ctx ran); out-pointer valid.
                let r = unsafe { sys::cuStreamCreate(&mut s, 0) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    return Err(code(r));
                }
                self.default = s;
                self.streams.insert(w::NULL_STREAM, Strm::new(s));
            }
        }
        self.streams.get_mut(&id).ok_or(INVALID_HANDLE)
    }

    /// A client address to the device's (an address inside an allocation or one past
    /// its end).
    fn translate(&self, addr: u64) -> Option<sys::CUdeviceptr> {
        let (&base, &(len, real)) = self.mem.range(..=addr).next_back()?;
        (addr - base <= len).then_some(real + (addr - base))
    }

    /// Queues a host function on `stream` that sends `Reached { seq, data }`.
    fn mark(&mut self, stream: u64, seq: u64, data: Vec<u8>) -> Result<(), i32> {
        let out = Arc::clone(&self.out);
        let load = Arc::clone(&self.load);
        let st = self.stream(stream)?;
        let s = st.s;
        let p = Box::new(Pending {
            out,
            seq,
            data,
            _keep: std::mem::take(&mut st.keep),
            load,
            kernels: std::mem::take(&mut st.kernels),
            since: st.since.take(),
            alone: std::mem::take(&mut st.alone).filter(|_| st.warm),
        });
        st.warm |= p.kernels > 0;
        let user = Box::into_raw(p) as *mut c_void;
        // SAFETY: a live stream; `reached` takes back the box when it runs.
        let r = unsafe { sys::cuLaunchHostFunc(s, Some(reached), user) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: not queued: the box is still ours.
            let p = unsafe { Box::from_raw(user as *mut Pending) };
            p.load.passed(p.kernels, None, None);
            return Err(code(r));
        }
        Ok(())
    }

    fn bytes(
        &mut self,
        d: &Data<'_>,
        cache: &Mutex<ChunkCache>,
        cache_on: bool,
        t: &mut Tally,
    ) -> Result<Arc<[u8]>, i32> {
        match d {
            Data::Literal(b) => Ok(Arc::from(*b)),
            Data::Cache { hash, bytes } => {
                if cache_on && bytes.len() <= MAX_CHUNK {
                    let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
                    c.insert(&self.part, *hash, bytes);
                }
                t.upload_misses += 1;
                Ok(Arc::from(*bytes))
            }
            Data::Ref { hash, len } => {
                let pin = match self.pinned.get_mut(hash) {
                    Some((b, n)) => {
                        *n -= 1;
                        Some((Arc::clone(b), *n == 0))
                    }
                    None => None,
                };
                let got = match pin {
                    Some((b, last)) => {
                        if last {
                            self.pinned.remove(hash);
                        }
                        Some(b)
                    }
                    None => cache
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get(&self.part, hash),
                };
                match got {
                    Some(b) if b.len() == *len as usize => {
                        t.upload_hits += 1;
                        t.bytes_saved += *len as u64;
                        Ok(b)
                    }
                    _ => Err(MISSING_UPLOAD),
                }
            }
        }
    }

    /// Runs one batch. Answers and errors go to the connection's outgoing queue.
    pub fn run(
        &mut self,
        calls: &[u8],
        cache: &Mutex<ChunkCache>,
        cache_on: bool,
    ) -> Result<Tally, w::WireError> {
        let mut t = Tally::default();
        let mut r = w::Reader::new(calls);
        while let Some(c) = r.call()? {
            t.calls += 1;
            if let Call::Marker { sync: true, .. } = c {
                t.syncs += 1;
            }
            let res = self.one(&c, cache, cache_on, &mut t);
            if let Err(status) = res {
                t.failed += 1;
                let mut note = Vec::new();
                match c {
                    // The client waits on these: answer them, failed.
                    Call::Query { req, .. }
                    | Call::GetFunction { req, .. }
                    | Call::Pin { req, .. }
                    | Call::Elapsed { req, .. } => {
                        w::put_note(
                            &Note::Answer {
                                req,
                                status,
                                data: &[],
                            },
                            &mut note,
                        );
                    }
                    Call::DtoH { seq, .. }
                    | Call::Marker { seq, .. }
                    | Call::EventRecord { seq, .. } => {
                        w::put_note(
                            &Note::Reached {
                                seq,
                                status,
                                data: &[],
                            },
                            &mut note,
                        );
                    }
                    _ => w::put_note(
                        &Note::Failed {
                            status,
                            call: c.name(),
                        },
                        &mut note,
                    ),
                }
                push(&self.out, note);
            }
        }
        Ok(t)
    }

    fn answer(&self, req: u64, data: &[u8]) {
        let mut note = Vec::new();
        w::put_note(
            &Note::Answer {
                req,
                status: SUCCESS,
                data,
            },
            &mut note,
        );
        push(&self.out, note);
    }

    fn one(
        &mut self,
        c: &Call<'_>,
        cache: &Mutex<ChunkCache>,
        cache_on: bool,
        t: &mut Tally,
    ) -> Result<(), i32> {
        let ok = |r: sys::CUresult| {
            if r == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(code(r))
            }
        };
        if let Call::Query {
            req,
            q: Query::Driver,
        } = c
        {
            driver::probe_driver().map_err(|_| NO_DEVICE)?;
            let (mut v, mut n) = (0, 0);
            // SAFETY: symbols checked by probe_driver; valid out-pointers.
            unsafe {
                ok(sys::cuInit(0))?;
                ok(sys::cuDriverGetVersion(&mut v))?;
                ok(sys::cuDeviceGetCount(&mut n))?;
            }
            let mut a = v.to_le_bytes().to_vec();
            a.extend_from_slice(&n.to_le_bytes());
            self.answer(*req, &a);
            return Ok(());
        }
        // Placement's calls: no context for them (a probe is not a session).
        match *c {
            Call::Watch { period_ms } => {
                self.beats = (period_ms > 0).then(|| {
                    let p = Duration::from_millis(period_ms as u64).clamp(BEAT_MIN, BEAT_MAX);
                    (p, Instant::now())
                });
                return Ok(());
            }
            Call::Probe { req, .. } => {
                self.answer(req, &[]);
                return Ok(());
            }
            _ => {}
        }
        self.ensure_ctx()?;
        match *c {
            Call::CtxRetain { .. } => Ok(()),
            Call::Watch { .. } | Call::Probe { .. } => unreachable!("answered above"),
            Call::Query { req, q } => {
                let dev = match q {
                    Query::Name { dev } | Query::Attr { dev, .. } => dev,
                    Query::Driver => unreachable!("answered above"),
                };
                let mut d: sys::CUdevice = 0;
                // SAFETY: driver initialised; out-pointer valid.
                ok(unsafe { sys::cuDeviceGet(&mut d, dev) })?;
                let a = match q {
                    Query::Name { .. } => {
                        let mut name = [0 as std::ffi::c_char; 256];
                        // SAFETY: the buffer and its length match.
                        ok(unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, d) })?;
                        // SAFETY: the driver NUL-terminated it within the buffer.
                        unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
                            .to_bytes()
                            .to_vec()
                    }
                    Query::Attr { attr, .. } => device_attribute(attr, d)?.to_le_bytes().to_vec(),
                    Query::Driver => unreachable!("answered above"),
                };
                self.answer(req, &a);
                Ok(())
            }
            Call::MemAlloc { addr, size } => {
                if !w::is_sim(addr) || self.mem.contains_key(&addr) {
                    return Err(INVALID_VALUE);
                }
                if self.mem.len() >= MAX_ALLOCS {
                    return Err(OUT_OF_MEMORY);
                }
                let mut p: sys::CUdeviceptr = 0;
                // SAFETY: context current; out-pointer valid.
                ok(unsafe { sys::cuMemAlloc_v2(&mut p, size as usize) })?;
                self.mem.insert(addr, (size, p));
                Ok(())
            }
            Call::MemFree { addr } => {
                let (_, p) = self.mem.remove(&addr).ok_or(INVALID_VALUE)?;
                // SAFETY: allocated by cuMemAlloc_v2 above, freed once.
                ok(unsafe { sys::cuMemFree_v2(p) })
            }
            Call::StreamCreate { id, flags } => {
                if id == w::NULL_STREAM || self.streams.contains_key(&id) {
                    return Err(INVALID_VALUE);
                }
                if self.streams.len() >= MAX_STREAMS {
                    return Err(OUT_OF_MEMORY);
                }
                let mut s = std::ptr::null_mut();
                // SAFETY: context current; out-pointer valid.
                ok(unsafe { sys::cuStreamCreate(&mut s, flags) })?;
                self.streams.insert(id, Strm::new(s));
                Ok(())
            }
            Call::StreamDestroy { id } => {
                if id == w::NULL_STREAM {
                    return Err(INVALID_HANDLE);
                }
                let st = self.streams.remove(&id).ok_or(INVALID_HANDLE)?;
                destroy(st, &self.load);
                Ok(())
            }
            Call::HtoD { stream, dst, data } => {
                let b = self.bytes(&data, cache, cache_on, t)?;
                let d = self.translate(dst).ok_or(INVALID_VALUE)?;
                if self.translate(dst + b.len() as u64).is_none() {
                    return Err(INVALID_VALUE);
                }
                let st = self.stream(stream)?;
                // SAFETY: `b` stays alive in `keep` until a host function behind the
                // copy runs (or the stream is synchronized and destroyed).
                ok(unsafe {
                    sys::cuMemcpyHtoDAsync_v2(d, b.as_ptr() as *const c_void, b.len(), st.s)
                })?;
                st.keep.push(b);
                Ok(())
            }
            Call::DtoH {
                stream,
                seq,
                src,
                len,
            } => {
                let d = self.translate(src).ok_or(INVALID_VALUE)?;
                if self.translate(src + len as u64).is_none() {
                    return Err(INVALID_VALUE);
                }
                let mut buf = vec![0u8; len as usize];
                let s = self.stream(stream)?.s;
                // SAFETY: `buf`'s heap block moves into the host function's box below
                // and lives until it runs, after the copy.
                ok(unsafe {
                    sys::cuMemcpyDtoHAsync_v2(buf.as_mut_ptr() as *mut c_void, d, buf.len(), s)
                })?;
                self.mark(stream, seq, buf)
            }
            Call::Marker { stream, seq, .. } => self.mark(stream, seq, Vec::new()),
            Call::ModuleLoad { id, image } => {
                if self.modules.len() >= MAX_MODULES && !self.modules.contains_key(&id) {
                    return Err(OUT_OF_MEMORY);
                }
                let mut b = self.bytes(&image, cache, cache_on, t)?.to_vec();
                // A PTX image is a C string: make sure one ends it.
                b.push(0);
                let mut m = std::ptr::null_mut();
                // SAFETY: a complete image in memory for the call.
                ok(unsafe { sys::cuModuleLoadData(&mut m, b.as_ptr() as *const c_void) })?;
                if let Some(old) = self.modules.insert(id, m) {
                    // SAFETY: a module we loaded, replaced under the same id.
                    unsafe { sys::cuModuleUnload(old) };
                }
                Ok(())
            }
            Call::Pin { req, hashes } => {
                let mut a = Vec::with_capacity(hashes.len() / 32);
                {
                    let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
                    for h in hashes.chunks_exact(32) {
                        let h: [u8; 32] = h.try_into().expect("32 bytes");
                        let got = match self.pinned.get_mut(&h) {
                            Some((_, n)) => {
                                *n += 1;
                                true
                            }
                            None => match c.get(&self.part, &h) {
                                Some(b) => {
                                    self.pinned.insert(h, (b, 1));
                                    true
                                }
                                None => false,
                            },
                        };
                        a.push(got as u8);
                    }
                }
                self.answer(req, &a);
                Ok(())
            }
            Call::ModuleUnload { id } => {
                let m = self.modules.remove(&id).ok_or(INVALID_HANDLE)?;
                self.funcs.retain(|_, f| f.module != id);
                // SAFETY: loaded above, unloaded once.
                ok(unsafe { sys::cuModuleUnload(m) })
            }
            Call::GetFunction {
                req,
                module,
                id,
                name,
            } => {
                let m = *self.modules.get(&module).ok_or(INVALID_HANDLE)?;
                if self.funcs.len() >= MAX_FUNCS {
                    return Err(OUT_OF_MEMORY);
                }
                let cname = CString::new(name).map_err(|_| INVALID_VALUE)?;
                let mut f = std::ptr::null_mut();
                // SAFETY: a live module and a C string.
                ok(unsafe { sys::cuModuleGetFunction(&mut f, m, cname.as_ptr()) })?;
                let layout = param_layout(f)?;
                let mut a = Vec::new();
                for (o, s) in &layout {
                    a.extend_from_slice(&o.to_le_bytes());
                    a.extend_from_slice(&s.to_le_bytes());
                }
                self.funcs.insert(id, Func { f, module, layout });
                self.answer(req, &a);
                Ok(())
            }
            Call::Launch {
                func,
                stream,
                grid,
                block,
                shmem,
                params,
            } => {
                let fun = self.funcs.get(&func).ok_or(INVALID_HANDLE)?;
                let (f, layout) = (fun.f, fun.layout.clone());
                // Each parameter in its own 8-aligned buffer, device addresses
                // translated.
                let mut bufs: Vec<Vec<u64>> = Vec::with_capacity(layout.len());
                let mut at = 0usize;
                for &(_, size) in &layout {
                    let size = size as usize;
                    let src = params.get(at..at + size).ok_or(INVALID_VALUE)?;
                    at += size;
                    let mut b = vec![0u64; size.div_ceil(8)];
                    // SAFETY: `b` holds at least `size` bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src.as_ptr(), b.as_mut_ptr() as *mut u8, size)
                    };
                    // A pointer parameter is 8 bytes holding an address inside one of
                    // the client's allocations (words inside structures are left as
                    // they are: their bytes may be anything).
                    if size == 8 && w::is_sim(b[0]) {
                        if let Some(real) = self.translate(b[0]) {
                            b[0] = real;
                        }
                    }
                    bufs.push(b);
                }
                if at != params.len() {
                    return Err(INVALID_VALUE);
                }
                let mut ptrs: Vec<*mut c_void> = bufs
                    .iter_mut()
                    .map(|b| b.as_mut_ptr() as *mut c_void)
                    .collect();
                let alone = self.load.alone();
                let st = self.stream(stream)?;
                let s = st.s;
                // SAFETY: a live function and stream; the parameter buffers outlive
                // the call (the driver copies them at launch).
                let r = ok(unsafe {
                    sys::cuLaunchKernel(
                        f,
                        grid[0],
                        grid[1],
                        grid[2],
                        block[0],
                        block[1],
                        block[2],
                        shmem,
                        s,
                        ptrs.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                });
                if r.is_ok() {
                    st.kernels += 1;
                    if st.since.is_none() {
                        st.since = Some(Instant::now());
                        st.alone = alone;
                    }
                    self.load.launched();
                }
                r
            }
            Call::EventCreate { id, flags } => {
                if self.events.contains_key(&id) {
                    return Err(INVALID_VALUE);
                }
                if self.events.len() >= MAX_EVENTS {
                    return Err(OUT_OF_MEMORY);
                }
                let mut e = std::ptr::null_mut();
                // SAFETY: context current; out-pointer valid.
                ok(unsafe { sys::cuEventCreate(&mut e, flags) })?;
                self.events.insert(id, e);
                Ok(())
            }
            Call::EventDestroy { id } => {
                let e = self.events.remove(&id).ok_or(INVALID_HANDLE)?;
                // SAFETY: created above, destroyed once (the driver defers the release
                // of an event still queued on a stream).
                ok(unsafe { sys::cuEventDestroy_v2(e) })
            }
            Call::EventRecord { event, stream, seq } => {
                let e = *self.events.get(&event).ok_or(INVALID_HANDLE)?;
                let s = self.stream(stream)?.s;
                // SAFETY: a live event and stream.
                ok(unsafe { sys::cuEventRecord(e, s) })?;
                self.mark(stream, seq, Vec::new())
            }
            Call::WaitEvent { stream, event } => {
                let e = *self.events.get(&event).ok_or(INVALID_HANDLE)?;
                let s = self.stream(stream)?.s;
                type F = unsafe extern "C" fn(sys::CUstream, sys::CUevent, u32) -> i32;
                let p = driver::driver_sym("cuStreamWaitEvent").ok_or(NOT_SUPPORTED)?;
                // SAFETY: the driver's cuStreamWaitEvent has this C signature; a live
                // stream and event.
                let r = unsafe { std::mem::transmute::<usize, F>(p)(s, e, 0) };
                if r != SUCCESS {
                    return Err(r);
                }
                Ok(())
            }
            Call::Elapsed { req, start, end } => {
                let a = *self.events.get(&start).ok_or(INVALID_HANDLE)?;
                let b = *self.events.get(&end).ok_or(INVALID_HANDLE)?;
                type F = unsafe extern "C" fn(*mut f32, sys::CUevent, sys::CUevent) -> i32;
                // CUDA 13 names it _v2 (the same signature).
                let p = driver::driver_sym("cuEventElapsedTime_v2")
                    .or_else(|| driver::driver_sym("cuEventElapsedTime"))
                    .ok_or(NOT_SUPPORTED)?;
                let mut ms = 0f32;
                // SAFETY: the driver's signature; live events; out-pointer valid.
                let r = unsafe { std::mem::transmute::<usize, F>(p)(&mut ms, a, b) };
                if r != SUCCESS {
                    return Err(r);
                }
                self.answer(req, &ms.to_le_bytes());
                Ok(())
            }
        }
    }
}

/// cuDeviceGetAttribute with the attribute as the C int it is on the wire (through
/// the symbol: cudarc's enum cannot hold a value it does not list).
fn device_attribute(attr: i32, dev: sys::CUdevice) -> Result<i32, i32> {
    type F = unsafe extern "C" fn(*mut i32, i32, sys::CUdevice) -> i32;
    let f = driver::driver_sym("cuDeviceGetAttribute").ok_or(NO_DEVICE)?;
    // SAFETY: the driver's cuDeviceGetAttribute has this C signature.
    let f: F = unsafe { std::mem::transmute::<usize, F>(f) };
    let mut v = 0;
    // SAFETY: valid out-pointer; the driver rejects an attribute it does not know.
    let r = unsafe { f(&mut v, attr, dev) };
    if r != SUCCESS {
        return Err(r);
    }
    Ok(v)
}

/// The function's parameters (offset, size), from cuFuncGetParamInfo (CUDA 12.4+);
/// a driver without it cannot be remoted (the client could not marshal arguments).
fn param_layout(f: sys::CUfunction) -> Result<Vec<(u32, u32)>, i32> {
    type F = unsafe extern "C" fn(sys::CUfunction, usize, *mut usize, *mut usize) -> i32;
    let Some(p) = driver::driver_sym("cuFuncGetParamInfo") else {
        return Err(code(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED));
    };
    // SAFETY: the driver's cuFuncGetParamInfo has this C signature.
    let g: F = unsafe { std::mem::transmute::<usize, F>(p) };
    let mut out = Vec::new();
    for i in 0..4096usize {
        let (mut off, mut size) = (0usize, 0usize);
        // SAFETY: a live function; valid out-pointers; past the last parameter the
        // driver answers an error.
        if unsafe { g(f, i, &mut off, &mut size) } != SUCCESS {
            break;
        }
        out.push((off as u32, size as u32));
    }
    Ok(out)
}

fn destroy(st: Strm, load: &SessionLoad) {
    // SAFETY: a live stream, synchronized (its copies' host bytes are in `keep`)
    // then destroyed once.
    unsafe {
        sys::cuStreamSynchronize(st.s);
        sys::cuStreamDestroy_v2(st.s);
    }
    drop(st.keep);
    load.passed(st.kernels, None, None);
}

impl Drop for CudaSession {
    fn drop(&mut self) {
        let Some(c) = &self.ctx else { return };
        self.load.gpu.sessions.fetch_sub(1, Relaxed);
        if c.make_current().is_err() {
            return;
        }
        for (_, st) in self.streams.drain() {
            destroy(st, &self.load);
        }
        for (_, e) in self.events.drain() {
            // SAFETY: created by this session, destroyed once (its streams are done).
            unsafe { sys::cuEventDestroy_v2(e) };
        }
        for (_, (_, p)) in std::mem::take(&mut self.mem) {
            // SAFETY: allocated by this session, freed once.
            unsafe { sys::cuMemFree_v2(p) };
        }
        for (_, m) in self.modules.drain() {
            // SAFETY: loaded by this session, unloaded once.
            unsafe { sys::cuModuleUnload(m) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_mean_keeps_a_sustained_load_through_an_empty_moment() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut m = QueueMean::default();
        // Eight kernels queued for a second, then empty for 5 ms.
        m.step(8, ms(0));
        m.step(0, ms(1000));
        assert!(m.at(ms(1005)) > 7.5, "{}", m.at(ms(1005)));
        // Gone for two seconds: the mean follows.
        assert!(m.at(ms(3000)) < 0.01, "{}", m.at(ms(3000)));
    }

    #[test]
    fn a_beat_reports_the_larger_of_the_queue_and_its_mean() {
        let load = GpuLoad::default();
        for _ in 0..3 {
            load.launched();
        }
        assert_eq!(load.beat().queue, 3, "a load that just came shows at once");
        load.passed(3, None, None);
        // The mean has barely moved off zero in the microseconds since.
        assert_eq!(load.beat().queue, 0);
        let held = GpuLoad::default();
        held.recent
            .lock()
            .unwrap()
            .step(6, Instant::now() - Duration::from_secs(2));
        held.queue.store(6, Relaxed);
        held.passed(6, None, None);
        assert_eq!(held.beat().queue, 6, "the queue is empty, its mean is not");
    }

    #[test]
    fn an_idle_gpu_reports_its_time_per_kernel_alone() {
        let load = Arc::new(GpuLoad::default());
        let session = || SessionLoad {
            gpu: Arc::clone(&load),
            own: AtomicU64::new(0),
            launches: AtomicU64::new(0),
        };
        let (task, other) = (session(), session());
        let ago = |ms| Some(Instant::now() - Duration::from_millis(ms));
        // A task's two streams alone on a GPU one kernel fills, 2 ms a kernel: the
        // second stream's kernel ran first, so the first one's stretch took 4 ms.
        let begun = task.alone();
        assert!(begun.is_some(), "an idle GPU");
        task.launched();
        assert!(task.alone().is_none(), "a kernel is queued");
        task.launched();
        task.passed(1, ago(2), None);
        task.passed(1, ago(4), begun);
        // 10 stretches behind another session's: 20 ms each.
        for _ in 0..10 {
            other.launched();
            task.launched();
            task.passed(1, ago(20), None);
            other.passed(1, None, None);
        }
        // Stretches begun on an idle GPU that another session's kernels then joined
        // (a load arriving): they ran at the loaded pace, which is not the alone one.
        for _ in 0..10 {
            let begun = task.alone();
            assert!(begun.is_some());
            task.launched();
            other.launched();
            other.launched();
            task.passed(1, ago(20), begun);
            other.passed(2, None, None);
        }
        let ms = |b: Beat| b.kernel_ns as f64 / 1e6;
        // The mean of the queue still shows the load: the loaded time.
        load.queue.store(1, Relaxed);
        assert!(ms(load.beat()) > 15.0, "{}", ms(load.beat()));
        // Idle (no queue, its mean gone): what a kernel takes alone.
        load.queue.store(0, Relaxed);
        *load.recent.lock().unwrap() = QueueMean::default();
        let idle = ms(load.beat());
        assert!((1.9..2.5).contains(&idle), "{idle}");
    }
}
