//! The context consistency guardian's memory: what the client must send a fresh
//! daemon session so that a program between two synchronizations continues as if the
//! connection had never been lost.
//!
//! Two parts. The *base*: the state as of the last call every stream has been
//! reported past (allocations with their contents where the client knows them,
//! modules, functions, streams, events). The *log*: every call since, in the order it
//! was batched, with the bytes it carried. Replay is the base, one synchronizing
//! marker, then the log: a device buffer a kernel wrote and nobody read back is
//! recomputed by the launches in the log. The log is folded into the base at each
//! synchronize (a stream's calls up to where the program waited for it), always
//! from its front, so the base is the state after a prefix of the program's calls.
//!
//! What cannot be replayed: a buffer a kernel wrote before the base was taken (its
//! contents are gone with the old daemon) that later work reads, and a log whose
//! bytes passed the bound (TOFFLOAD_CUDA_REMOTE_REPLAY_MB). Those are a clear error,
//! never a wrong answer.

use crate::wire::{self, Call, Data};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// One call as the journal keeps it (owning its bytes).
#[derive(Debug)]
pub enum Rec {
    Alloc {
        addr: u64,
        size: u64,
    },
    Free {
        addr: u64,
    },
    StreamCreate {
        id: u64,
        flags: u32,
    },
    StreamDestroy {
        id: u64,
    },
    EventCreate {
        id: u64,
        flags: u32,
    },
    EventDestroy {
        id: u64,
    },
    Module {
        id: u64,
        image: Vec<u8>,
    },
    ModuleUnload {
        id: u64,
    },
    Func {
        id: u64,
        module: u64,
        name: String,
    },
    HtoD {
        stream: u64,
        dst: u64,
        bytes: Vec<u8>,
    },
    /// An upload the log had no room for: replaying past it is impossible.
    HtoDDropped {
        stream: u64,
        dst: u64,
        len: u64,
    },
    Launch {
        func: u64,
        stream: u64,
        grid: [u32; 3],
        block: [u32; 3],
        shmem: u32,
        params: Vec<u8>,
        /// Parameters that are addresses in the client's allocations: the buffers
        /// the kernel may write.
        ptrs: Vec<u64>,
    },
    DtoH {
        stream: u64,
        seq: u64,
        src: u64,
        len: u32,
        /// What the daemon sent back (the buffer's contents at that point).
        data: Option<Vec<u8>>,
    },
    Marker {
        stream: u64,
        seq: u64,
    },
    EventRecord {
        event: u64,
        stream: u64,
        seq: u64,
    },
    WaitEvent {
        stream: u64,
        event: u64,
    },
}

impl Rec {
    /// The stream whose progress completes it (None: done once batched).
    fn stream(&self) -> Option<u64> {
        match self {
            Rec::HtoD { stream, .. }
            | Rec::HtoDDropped { stream, .. }
            | Rec::Launch { stream, .. }
            | Rec::DtoH { stream, .. }
            | Rec::Marker { stream, .. }
            | Rec::EventRecord { stream, .. }
            | Rec::WaitEvent { stream, .. } => Some(*stream),
            _ => None,
        }
    }

    /// Its own sequence number where the daemon reports it (else the journal's).
    fn seq(&self) -> Option<u64> {
        match self {
            Rec::DtoH { seq, .. } | Rec::Marker { seq, .. } | Rec::EventRecord { seq, .. } => {
                Some(*seq)
            }
            _ => None,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Rec::HtoD { bytes, .. } => bytes.len(),
            Rec::Module { image, .. } => image.len(),
            Rec::Launch { params, .. } => params.len(),
            Rec::DtoH { data: Some(d), .. } => d.len(),
            _ => 0,
        }
    }
}

/// An allocation's contents as of the base.
#[derive(Debug)]
enum Contents {
    /// Never written: any contents will do.
    Fresh,
    /// Written by uploads or read back whole: these bytes.
    Known(Vec<u8>),
    /// Written by a kernel (or past the bound) and not read back: unknown.
    Lost,
}

#[derive(Debug)]
struct Alloc {
    size: u64,
    contents: Contents,
}

struct Entry {
    seq: u64,
    rec: Rec,
}

/// What a replay sends: encoded calls, base first.
pub struct Plan {
    pub base: Vec<Vec<u8>>,
    pub log: Vec<Vec<u8>>,
    /// Allocations whose contents are gone (not needed by the log): any later use of
    /// them is an error.
    pub lost: Vec<(u64, u64)>,
    pub calls: usize,
}

#[derive(Default)]
pub struct Journal {
    /// Bound on the bytes held (log and known contents).
    limit: usize,
    held: usize,
    allocs: BTreeMap<u64, Alloc>,
    streams: HashMap<u64, u32>,
    events: HashMap<u64, u32>,
    modules: HashMap<u64, Vec<u8>>,
    funcs: HashMap<u64, (u64, String)>,
    log: VecDeque<Entry>,
    /// Per stream, the last sequence number the program synchronized it past.
    done: HashMap<u64, u64>,
    /// The log passed its bound and was dropped: no replay from here on.
    overflowed: bool,
}

/// What an entry costs beyond its bytes: the log holds at most a quarter of the
/// bound in them.
const ENTRY_COST: usize = 96;

/// The allocation holding `addr` in `m` (its base address).
fn owner<V>(m: &BTreeMap<u64, V>, addr: u64, size: impl Fn(&V) -> u64) -> Option<u64> {
    let (&base, v) = m.range(..=addr).next_back()?;
    (addr < base + size(v)).then_some(base)
}

impl Journal {
    pub fn new(limit: usize) -> Journal {
        Journal {
            limit,
            ..Journal::default()
        }
    }

    /// Appends a call batched just now; `seq` orders it (a fresh number for calls
    /// the daemon does not report).
    pub fn push(&mut self, seq: u64, mut rec: Rec) {
        if self.overflowed {
            return;
        }
        let n = rec.bytes();
        if let Rec::HtoD { stream, dst, bytes } = &rec {
            if self.held + n > self.limit {
                rec = Rec::HtoDDropped {
                    stream: *stream,
                    dst: *dst,
                    len: bytes.len() as u64,
                };
            }
        }
        if (self.log.len() + 1) * ENTRY_COST > self.limit / 4 {
            // Calls that carry few bytes, queued without end and never reported:
            // the log stops (and frees) here rather than grow without bound.
            self.overflowed = true;
            self.log.clear();
            return;
        }
        self.held += rec.bytes();
        let seq = rec.seq().unwrap_or(seq);
        self.log.push_back(Entry { seq, rec });
        self.fold();
    }

    /// The daemon reported the call `seq`: a DtoH's bytes in `data` are the
    /// buffer's contents there.
    pub fn reached(&mut self, seq: u64, data: Option<&[u8]>) {
        if let Some(d) = data {
            if let Some(e) = self.log.iter_mut().find(|e| e.seq == seq) {
                if let Rec::DtoH {
                    data: slot, len, ..
                } = &mut e.rec
                {
                    if slot.is_none() && d.len() == *len as usize {
                        self.held += d.len();
                        *slot = Some(d.to_vec());
                    }
                }
            }
        }
    }

    /// The program waited for `stream` to get past `seq` (a synchronize), or was
    /// told it had (a host function ran, the stream ended): the calls before are
    /// done with, and fold into the base. Progress reported without the program
    /// seeing it (a query's marker, an event's record) folds nothing, so that the
    /// launches since the last synchronize stay in the log to recompute from.
    pub fn synced(&mut self, stream: u64, seq: u64) {
        let s = self.done.entry(stream).or_default();
        *s = (*s).max(seq);
        self.fold();
    }

    /// Moves the log's front, as far as it is synchronized, into the base.
    fn fold(&mut self) {
        while let Some(e) = self.log.front() {
            let complete = match e.rec.stream() {
                None => true,
                Some(s) => self.done.get(&s).is_some_and(|&d| d >= e.seq),
            };
            if !complete {
                return;
            }
            let e = self.log.pop_front().expect("front");
            self.held = self.held.saturating_sub(e.rec.bytes());
            self.apply(e.rec);
        }
    }

    fn materialize(&mut self, base: u64) -> Option<&mut Vec<u8>> {
        let a = self.allocs.get_mut(&base)?;
        if let Contents::Fresh = a.contents {
            if self.held + a.size as usize > self.limit {
                a.contents = Contents::Lost;
                return None;
            }
            self.held += a.size as usize;
            a.contents = Contents::Known(vec![0; a.size as usize]);
        }
        match &mut a.contents {
            Contents::Known(v) => Some(v),
            _ => None,
        }
    }

    /// Writes `bytes` at `addr` into the base (a whole allocation written makes
    /// unknown contents known again).
    fn write(&mut self, addr: u64, bytes: &[u8]) {
        let Some(base) = owner(&self.allocs, addr, |a| a.size) else {
            return;
        };
        let a = &self.allocs[&base];
        let off = (addr - base) as usize;
        if off + bytes.len() > a.size as usize {
            return;
        }
        if let Contents::Lost = a.contents {
            if off != 0 || bytes.len() != a.size as usize || self.held + bytes.len() > self.limit {
                return;
            }
            self.held += bytes.len();
            self.allocs.get_mut(&base).expect("alloc").contents = Contents::Known(bytes.to_vec());
            return;
        }
        if let Some(v) = self.materialize(base) {
            v[off..off + bytes.len()].copy_from_slice(bytes);
        }
    }

    fn lose(&mut self, addr: u64) {
        if let Some(base) = owner(&self.allocs, addr, |a| a.size) {
            let a = self.allocs.get_mut(&base).expect("alloc");
            if let Contents::Known(v) = &a.contents {
                self.held = self.held.saturating_sub(v.len());
            }
            a.contents = Contents::Lost;
        }
    }

    fn apply(&mut self, rec: Rec) {
        match rec {
            Rec::Alloc { addr, size } => {
                self.allocs.insert(
                    addr,
                    Alloc {
                        size,
                        contents: Contents::Fresh,
                    },
                );
            }
            Rec::Free { addr } => {
                if let Some(Alloc {
                    contents: Contents::Known(v),
                    ..
                }) = self.allocs.remove(&addr)
                {
                    self.held = self.held.saturating_sub(v.len());
                }
            }
            Rec::StreamCreate { id, flags } => {
                self.streams.insert(id, flags);
            }
            Rec::StreamDestroy { id } => {
                self.streams.remove(&id);
                self.done.remove(&id);
            }
            Rec::EventCreate { id, flags } => {
                self.events.insert(id, flags);
            }
            Rec::EventDestroy { id } => {
                self.events.remove(&id);
            }
            Rec::Module { id, image } => {
                self.held += image.len();
                if let Some(old) = self.modules.insert(id, image) {
                    self.held = self.held.saturating_sub(old.len());
                }
            }
            Rec::ModuleUnload { id } => {
                if let Some(old) = self.modules.remove(&id) {
                    self.held = self.held.saturating_sub(old.len());
                }
                self.funcs.retain(|_, (m, _)| *m != id);
            }
            Rec::Func { id, module, name } => {
                self.funcs.insert(id, (module, name));
            }
            Rec::HtoD { dst, bytes, .. } => self.write(dst, &bytes),
            Rec::HtoDDropped { dst, .. } => self.lose(dst),
            Rec::Launch { ptrs, .. } => {
                for p in ptrs {
                    self.lose(p);
                }
            }
            Rec::DtoH {
                src, data: Some(d), ..
            } => self.write(src, &d),
            Rec::DtoH { .. } | Rec::Marker { .. } | Rec::EventRecord { .. } => {}
            Rec::WaitEvent { .. } => {}
        }
    }

    /// The calls that rebuild this state on a fresh session; Err: why it cannot be.
    /// `cache_min`: uploads this large go by content hash (the daemon keeps them).
    /// Why this session cannot be moved whole to another daemon now (a loss replays
    /// it anyway, as well as it can): device memory only the daemon holds, or device
    /// memory that holds addresses of allocations, through which a kernel may write
    /// where the journal does not look (it knows a kernel's writes only from its
    /// pointer parameters), so that a replay would undo those writes.
    pub fn unmovable(&self) -> Option<&'static str> {
        if self
            .allocs
            .values()
            .any(|a| matches!(a.contents, Contents::Lost))
        {
            return Some(
                "device memory holds what a kernel wrote and nothing read back: a move \
                 would lose it",
            );
        }
        // An 8-byte word at an 8-byte device address (pointer tables are aligned)
        // that falls inside an allocation: random data does so with odds of about
        // the allocations' span over 2^64.
        let inside = |v: u64| {
            wire::is_sim(v)
                && self
                    .allocs
                    .range(..=v)
                    .next_back()
                    .is_some_and(|(&a, al)| v - a < al.size.max(1))
        };
        let points = |at: u64, b: &[u8]| {
            let skip = ((8 - at % 8) % 8) as usize;
            b.get(skip..).is_some_and(|b| {
                b.chunks_exact(8)
                    .any(|w| inside(u64::from_le_bytes(w.try_into().expect("8 bytes"))))
            })
        };
        let known = self
            .allocs
            .iter()
            .any(|(&at, a)| matches!(&a.contents, Contents::Known(v) if points(at, v)));
        let logged = self
            .log
            .iter()
            .any(|e| matches!(&e.rec, Rec::HtoD { dst, bytes, .. } if points(*dst, bytes)));
        (known || logged).then_some(
            "device memory holds addresses of allocations, through which a kernel may \
             write what a replay cannot redo: a move could undo it",
        )
    }

    pub fn plan(&self, cache_min: usize) -> Result<Plan, String> {
        if self.overflowed {
            return Err(
                "more calls were queued without a synchronize than the replay log holds \
                 (TOFFLOAD_CUDA_REMOTE_REPLAY_MB)"
                    .into(),
            );
        }
        let mut base = Vec::new();
        let put = |c: &Call<'_>, out: &mut Vec<Vec<u8>>| {
            let mut b = Vec::new();
            wire::put_call(c, &mut b);
            out.push(b);
        };
        let mk = |bytes| data_of(bytes, cache_min);
        put(&Call::CtxRetain { dev: 0 }, &mut base);
        for (&id, &flags) in &self.streams {
            put(&Call::StreamCreate { id, flags }, &mut base);
        }
        for (&id, &flags) in &self.events {
            put(&Call::EventCreate { id, flags }, &mut base);
        }
        for (&id, image) in &self.modules {
            put(
                &Call::ModuleLoad {
                    id,
                    image: mk(image),
                },
                &mut base,
            );
        }
        for (&id, (module, name)) in &self.funcs {
            put(
                &Call::GetFunction {
                    req: 0,
                    module: *module,
                    id,
                    name,
                },
                &mut base,
            );
        }
        // Lost buffers: (size, bytes uploaded from the start since).
        let mut lost: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        for (&addr, a) in &self.allocs {
            put(&Call::MemAlloc { addr, size: a.size }, &mut base);
            match &a.contents {
                Contents::Fresh => {}
                Contents::Lost => {
                    lost.insert(addr, (a.size, 0));
                }
                Contents::Known(v) => {
                    for (i, piece) in v.chunks(wire::PIECE).enumerate() {
                        put(
                            &Call::HtoD {
                                stream: wire::NULL_STREAM,
                                dst: addr + (i * wire::PIECE) as u64,
                                data: mk(piece),
                            },
                            &mut base,
                        );
                    }
                }
            }
        }
        let mut log = Vec::new();
        let gone = |lost: &BTreeMap<u64, (u64, u64)>, addr: u64| owner(lost, addr, |&(s, _)| s);
        let cannot = |addr: u64, what: &str| {
            format!(
                "{what} device memory {addr:#x}, written by a kernel before the last \
                 synchronize and never read back: its contents were lost with the daemon"
            )
        };
        for e in &self.log {
            match &e.rec {
                Rec::Alloc { addr, size } => put(
                    &Call::MemAlloc {
                        addr: *addr,
                        size: *size,
                    },
                    &mut log,
                ),
                Rec::Free { addr } => {
                    lost.remove(addr);
                    put(&Call::MemFree { addr: *addr }, &mut log)
                }
                Rec::StreamCreate { id, flags } => put(
                    &Call::StreamCreate {
                        id: *id,
                        flags: *flags,
                    },
                    &mut log,
                ),
                Rec::StreamDestroy { id } => put(&Call::StreamDestroy { id: *id }, &mut log),
                Rec::EventCreate { id, flags } => put(
                    &Call::EventCreate {
                        id: *id,
                        flags: *flags,
                    },
                    &mut log,
                ),
                Rec::EventDestroy { id } => put(&Call::EventDestroy { id: *id }, &mut log),
                Rec::Module { id, image } => put(
                    &Call::ModuleLoad {
                        id: *id,
                        image: mk(image),
                    },
                    &mut log,
                ),
                Rec::ModuleUnload { id } => put(&Call::ModuleUnload { id: *id }, &mut log),
                Rec::Func { id, module, name } => put(
                    &Call::GetFunction {
                        req: 0,
                        module: *module,
                        id: *id,
                        name,
                    },
                    &mut log,
                ),
                Rec::HtoD { stream, dst, bytes } => {
                    // Uploads from its start on, in order, make a lost buffer whole.
                    if let Some(b) = gone(&lost, *dst) {
                        let (size, covered) = lost[&b];
                        if *dst == b + covered {
                            let covered = covered + bytes.len() as u64;
                            if covered >= size {
                                lost.remove(&b);
                            } else {
                                lost.insert(b, (size, covered));
                            }
                        }
                    }
                    put(
                        &Call::HtoD {
                            stream: *stream,
                            dst: *dst,
                            data: mk(bytes),
                        },
                        &mut log,
                    )
                }
                Rec::HtoDDropped { dst, len, .. } => {
                    return Err(format!(
                        "an upload of {len} bytes to {dst:#x} since the last synchronize did \
                         not fit the replay log (TOFFLOAD_CUDA_REMOTE_REPLAY_MB)"
                    ))
                }
                Rec::Launch {
                    func,
                    stream,
                    grid,
                    block,
                    shmem,
                    params,
                    ptrs,
                } => {
                    if let Some(p) = ptrs.iter().find(|&&p| gone(&lost, p).is_some()) {
                        return Err(cannot(*p, "a kernel launched since reads"));
                    }
                    put(
                        &Call::Launch {
                            func: *func,
                            stream: *stream,
                            grid: *grid,
                            block: *block,
                            shmem: *shmem,
                            params,
                        },
                        &mut log,
                    )
                }
                Rec::DtoH {
                    stream,
                    seq,
                    src,
                    len,
                    ..
                } => {
                    if gone(&lost, *src).is_some() {
                        return Err(cannot(*src, "a copy back since reads"));
                    }
                    put(
                        &Call::DtoH {
                            stream: *stream,
                            seq: *seq,
                            src: *src,
                            len: *len,
                        },
                        &mut log,
                    )
                }
                Rec::Marker { stream, seq } => put(
                    &Call::Marker {
                        stream: *stream,
                        seq: *seq,
                        sync: false,
                    },
                    &mut log,
                ),
                Rec::EventRecord { event, stream, seq } => put(
                    &Call::EventRecord {
                        event: *event,
                        stream: *stream,
                        seq: *seq,
                    },
                    &mut log,
                ),
                Rec::WaitEvent { stream, event } => put(
                    &Call::WaitEvent {
                        stream: *stream,
                        event: *event,
                    },
                    &mut log,
                ),
            }
        }
        let calls = base.len() + log.len();
        Ok(Plan {
            base,
            log,
            lost: lost.into_iter().map(|(a, (n, _))| (a, n)).collect(),
            calls,
        })
    }
}

/// Bytes as a replayed call carries them: from `cache_min` on with their content
/// hash, so that the new daemon caches them for the program's later uploads.
fn data_of(bytes: &[u8], cache_min: usize) -> Data<'_> {
    if bytes.len() >= cache_min {
        Data::Cache {
            hash: openssl::sha::sha256(bytes),
            bytes,
        }
    } else {
        Data::Literal(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: u64 = wire::SIM_BASE + 4096;
    const B: u64 = wire::SIM_BASE + 8192;

    fn two_buffers() -> Journal {
        let mut j = Journal::new(64 << 20);
        j.push(1, Rec::Alloc { addr: A, size: 256 });
        j.push(2, Rec::Alloc { addr: B, size: 256 });
        j
    }

    #[test]
    fn a_table_of_device_addresses_makes_a_session_unmovable() {
        // Data that is not an address: movable, logged or folded into the base.
        let mut j = two_buffers();
        let noise: Vec<u8> = (0..256u32).map(|i| (i * 37 + 11) as u8).collect();
        j.push(
            3,
            Rec::HtoD {
                stream: 0,
                dst: B,
                bytes: noise.clone(),
            },
        );
        assert_eq!(j.unmovable(), None);
        // A's address, uploaded into B: a kernel may write A through it.
        let mut table = noise;
        table[16..24].copy_from_slice(&(A + 64).to_le_bytes());
        j.push(
            4,
            Rec::HtoD {
                stream: 0,
                dst: B,
                bytes: table,
            },
        );
        assert!(j.unmovable().unwrap().contains("addresses"));
        // Once folded into the base (a synchronize), still seen.
        j.synced(0, u64::MAX);
        assert!(j.unmovable().unwrap().contains("addresses"));
        // An address of the simulated range outside every allocation is data.
        let mut j = two_buffers();
        let mut far = vec![0u8; 256];
        far[0..8].copy_from_slice(&(wire::SIM_BASE + (1 << 40)).to_le_bytes());
        j.push(
            3,
            Rec::HtoD {
                stream: 0,
                dst: B,
                bytes: far,
            },
        );
        assert_eq!(j.unmovable(), None);
    }
}
