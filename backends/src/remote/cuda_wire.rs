//! The remoted CUDA driver calls: how a batch of calls (the body of a `Cuda` frame)
//! and the daemon's notes (the body of a `CudaNotes` frame) are laid out.
//!
//! Shared by the daemon (remote/cuda_exec.rs) and the client library that stands in
//! for libcuda (backends/cuda-remote, which includes this file by path: it is std
//! only). Handles are the client's: it picks stream, module and function ids and
//! device addresses itself (in [`SIM_BASE`]..), so that no call but a query waits for
//! an answer; the daemon maps them to its own.
//!
//! Every call and note is `u8 tag | fields`, little endian; byte strings are `u32
//! length | bytes`. Decoding checks every length against what remains.

use std::fmt;

/// Where the client's simulated device addresses start: non-canonical on x86-64 and
/// far from any CUDA UVA range, so an 8-byte kernel parameter holding an address
/// inside one of the client's allocations is a pointer the daemon translates (the
/// daemon cannot know which parameters are pointers).
pub const SIM_BASE: u64 = 0xd0d0_0000_0000_0000;
/// The end of the simulated address range.
pub const SIM_END: u64 = 0xd0d1_0000_0000_0000;
/// The stream id of CUDA's default (null) stream.
pub const NULL_STREAM: u64 = 0;
/// Largest byte string in one call or note.
pub const MAX_BYTES: usize = 16 << 20;
/// Largest piece a copy is cut into (a piece is one call; large uploads are cached
/// per piece, at the chunk cache's chunk size).
pub const PIECE: usize = 64 << 10;

pub fn is_sim(addr: u64) -> bool {
    (SIM_BASE..SIM_END).contains(&addr)
}

/// Bytes a call carries to the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Data<'a> {
    /// Sent as they are, not cached.
    Literal(&'a [u8]),
    /// Sent, and kept in the tenant's chunk cache under `hash` (SHA-256).
    Cache { hash: [u8; 32], bytes: &'a [u8] },
    /// Not sent: the daemon holds them under `hash`.
    Ref { hash: [u8; 32], len: u32 },
}

impl Data<'_> {
    pub fn len(&self) -> usize {
        match self {
            Data::Literal(b) | Data::Cache { bytes: b, .. } => b.len(),
            Data::Ref { len, .. } => *len as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a query asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Query {
    /// Answer: i32 driver version, i32 device count.
    Driver,
    /// Answer: the device name (UTF-8).
    Name { dev: i32 },
    /// Answer: i32 value.
    Attr { dev: i32, attr: i32 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call<'a> {
    CtxRetain {
        dev: i32,
    },
    /// Answered by a `Note::Answer` with the same `req`.
    Query {
        req: u64,
        q: Query,
    },
    MemAlloc {
        addr: u64,
        size: u64,
    },
    MemFree {
        addr: u64,
    },
    StreamCreate {
        id: u64,
        flags: u32,
    },
    StreamDestroy {
        id: u64,
    },
    HtoD {
        stream: u64,
        dst: u64,
        data: Data<'a>,
    },
    /// Answered by `Note::Reached { seq, data }` once the stream gets there.
    DtoH {
        stream: u64,
        seq: u64,
        src: u64,
        len: u32,
    },
    /// Answered by `Note::Reached { seq }` once the stream gets there. `sync`: the
    /// client waits for it (counted as a round trip).
    Marker {
        stream: u64,
        seq: u64,
        sync: bool,
    },
    ModuleLoad {
        id: u64,
        image: Data<'a>,
    },
    ModuleUnload {
        id: u64,
    },
    /// Answered by a `Note::Answer` whose data is the parameter layout: (u32
    /// offset, u32 size) per parameter.
    GetFunction {
        req: u64,
        module: u64,
        id: u64,
        name: &'a str,
    },
    /// Asks which of these uploads (32-byte SHA-256s, back to back) the daemon holds;
    /// those it does it keeps for the next reference to each. Answered by a
    /// `Note::Answer` with one byte (1: held) per hash.
    Pin {
        req: u64,
        hashes: &'a [u8],
    },
    /// `params`: each parameter's bytes, back to back, in the function's layout.
    Launch {
        func: u64,
        stream: u64,
        grid: [u32; 3],
        block: [u32; 3],
        shmem: u32,
        params: &'a [u8],
    },
    /// Placement's calls (tags from 30, its note from 10: apart from the driver
    /// calls' range).
    ///
    /// Subscribes the connection to `Note::Heartbeat`s, one at once and then one
    /// every `period_ms` (the daemon bounds it); 0 stops them. Opens no GPU context:
    /// a client probing several daemons for placement costs none of them a session.
    Watch {
        period_ms: u32,
    },
    /// Answered by an empty `Note::Answer` once read: the client times it against a
    /// ping to measure the link's bandwidth with `pad`'s bytes.
    Probe {
        req: u64,
        pad: &'a [u8],
    },
    /// A daemon-side event (`flags` as cuEventCreate's: timing unless
    /// CU_EVENT_DISABLE_TIMING).
    EventCreate {
        id: u64,
        flags: u32,
    },
    EventDestroy {
        id: u64,
    },
    /// cuEventRecord on the daemon, then a `Note::Reached { seq }` as for a marker.
    EventRecord {
        event: u64,
        stream: u64,
        seq: u64,
    },
    /// cuStreamWaitEvent: the stream's later work waits for the event's last record.
    WaitEvent {
        stream: u64,
        event: u64,
    },
    /// cuEventElapsedTime; answered by a `Note::Answer` with the f32 milliseconds.
    Elapsed {
        req: u64,
        start: u64,
        end: u64,
    },
}

impl Call<'_> {
    /// The driver function a call stands for (log lines, error notes).
    pub fn name(&self) -> &'static str {
        match self {
            Call::CtxRetain { .. } => "cuDevicePrimaryCtxRetain",
            Call::Query { .. } => "cuDeviceGet*",
            Call::MemAlloc { .. } => "cuMemAlloc",
            Call::MemFree { .. } => "cuMemFree",
            Call::StreamCreate { .. } => "cuStreamCreate",
            Call::StreamDestroy { .. } => "cuStreamDestroy",
            Call::HtoD { .. } => "cuMemcpyHtoD",
            Call::DtoH { .. } => "cuMemcpyDtoH",
            Call::Marker { .. } => "cuStreamSynchronize",
            Call::ModuleLoad { .. } => "cuModuleLoadData",
            Call::ModuleUnload { .. } => "cuModuleUnload",
            Call::GetFunction { .. } => "cuModuleGetFunction",
            Call::Pin { .. } => "upload cache query",
            Call::Launch { .. } => "cuLaunchKernel",
            Call::Watch { .. } => "heartbeat subscription",
            Call::Probe { .. } => "bandwidth probe",
            Call::EventCreate { .. } => "cuEventCreate",
            Call::EventDestroy { .. } => "cuEventDestroy",
            Call::EventRecord { .. } => "cuEventRecord",
            Call::WaitEvent { .. } => "cuStreamWaitEvent",
            Call::Elapsed { .. } => "cuEventElapsedTime",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Note<'a> {
    /// The stream reached the call `seq` (a DtoH's bytes in `data`). `status`: 0,
    /// or the driver's error for the stream.
    Reached {
        seq: u64,
        status: i32,
        data: &'a [u8],
    },
    Answer {
        req: u64,
        status: i32,
        data: &'a [u8],
    },
    /// A call sent without waiting failed on the daemon: the error is the client's
    /// next synchronize's (as CUDA reports asynchronous errors).
    Failed { status: i32, call: &'a str },
    /// The daemon's GPU load, for placement (sched.rs of the client library).
    Heartbeat(Beat),
}

/// What a heartbeat says about the daemon's GPU, all sessions together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Beat {
    /// Kernels launched and not yet passed by their stream's next reported call.
    pub queue: u32,
    /// CUDA sessions holding the GPU (connections that made a GPU call).
    pub sessions: u32,
    /// Recent time per kernel, ns (EWMA over stretches of streams: the time from a
    /// stretch's first kernel to the reported call after it, over its kernels; a
    /// loaded GPU stretches it), 0 before any.
    pub kernel_ns: u64,
    /// Of `queue`, the kernels of the session the beat goes to (0 for a probe's).
    pub own: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    Truncated,
    UnknownTag(u8),
    TooLong(u64),
    BadUtf8,
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Truncated => write!(f, "CUDA call truncated"),
            WireError::UnknownTag(t) => write!(f, "unknown CUDA call tag {t}"),
            WireError::TooLong(n) => write!(f, "byte string of {n} bytes above its bound"),
            WireError::BadUtf8 => write!(f, "string is not UTF-8"),
        }
    }
}

impl std::error::Error for WireError {}

struct W<'a>(&'a mut Vec<u8>);

impl W<'_> {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i32(&mut self, v: i32) -> &mut Self {
        self.u32(v as u32)
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
        self
    }
    fn data(&mut self, d: &Data<'_>) -> &mut Self {
        match d {
            Data::Literal(b) => self.u8(0).bytes(b),
            Data::Cache { hash, bytes } => {
                self.u8(1);
                self.0.extend_from_slice(hash);
                self.bytes(bytes)
            }
            Data::Ref { hash, len } => {
                self.u8(2);
                self.0.extend_from_slice(hash);
                self.u32(*len)
            }
        }
    }
}

/// Appends one call to a batch.
pub fn put_call(c: &Call<'_>, out: &mut Vec<u8>) {
    let mut w = W(out);
    match c {
        Call::CtxRetain { dev } => {
            w.u8(1).i32(*dev);
        }
        Call::Query { req, q } => {
            w.u8(2).u64(*req);
            match q {
                Query::Driver => w.u8(0),
                Query::Name { dev } => w.u8(1).i32(*dev),
                Query::Attr { dev, attr } => w.u8(2).i32(*dev).i32(*attr),
            };
        }
        Call::MemAlloc { addr, size } => {
            w.u8(3).u64(*addr).u64(*size);
        }
        Call::MemFree { addr } => {
            w.u8(4).u64(*addr);
        }
        Call::StreamCreate { id, flags } => {
            w.u8(5).u64(*id).u32(*flags);
        }
        Call::StreamDestroy { id } => {
            w.u8(6).u64(*id);
        }
        Call::HtoD { stream, dst, data } => {
            w.u8(7).u64(*stream).u64(*dst).data(data);
        }
        Call::DtoH {
            stream,
            seq,
            src,
            len,
        } => {
            w.u8(8).u64(*stream).u64(*seq).u64(*src).u32(*len);
        }
        Call::Marker { stream, seq, sync } => {
            w.u8(9).u64(*stream).u64(*seq).u8(*sync as u8);
        }
        Call::ModuleLoad { id, image } => {
            w.u8(10).u64(*id).data(image);
        }
        Call::ModuleUnload { id } => {
            w.u8(11).u64(*id);
        }
        Call::GetFunction {
            req,
            module,
            id,
            name,
        } => {
            w.u8(12)
                .u64(*req)
                .u64(*module)
                .u64(*id)
                .bytes(name.as_bytes());
        }
        Call::Pin { req, hashes } => {
            w.u8(14).u64(*req).bytes(hashes);
        }
        Call::Launch {
            func,
            stream,
            grid,
            block,
            shmem,
            params,
        } => {
            w.u8(13).u64(*func).u64(*stream);
            for v in grid.iter().chain(block) {
                w.u32(*v);
            }
            w.u32(*shmem).bytes(params);
        }
        Call::Watch { period_ms } => {
            w.u8(30).u32(*period_ms);
        }
        Call::Probe { req, pad } => {
            w.u8(31).u64(*req).bytes(pad);
        }
        Call::EventCreate { id, flags } => {
            w.u8(15).u64(*id).u32(*flags);
        }
        Call::EventDestroy { id } => {
            w.u8(16).u64(*id);
        }
        Call::EventRecord { event, stream, seq } => {
            w.u8(17).u64(*event).u64(*stream).u64(*seq);
        }
        Call::WaitEvent { stream, event } => {
            w.u8(18).u64(*stream).u64(*event);
        }
        Call::Elapsed { req, start, end } => {
            w.u8(19).u64(*req).u64(*start).u64(*end);
        }
    }
}

/// Appends one note.
pub fn put_note(n: &Note<'_>, out: &mut Vec<u8>) {
    let mut w = W(out);
    match n {
        Note::Reached { seq, status, data } => {
            w.u8(1).u64(*seq).i32(*status).bytes(data);
        }
        Note::Answer { req, status, data } => {
            w.u8(2).u64(*req).i32(*status).bytes(data);
        }
        Note::Failed { status, call } => {
            w.u8(3).i32(*status).bytes(call.as_bytes());
        }
        Note::Heartbeat(b) => {
            w.u8(10)
                .u32(b.queue)
                .u32(b.sessions)
                .u64(b.kernel_ns)
                .u32(b.own);
        }
    }
}

/// Reads calls or notes off one frame's body.
pub struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }

    pub fn is_empty(&self) -> bool {
        self.b.is_empty()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(WireError::Truncated);
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn i32(&mut self) -> Result<i32, WireError> {
        Ok(self.u32()? as i32)
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn hash(&mut self) -> Result<[u8; 32], WireError> {
        Ok(self.take(32)?.try_into().unwrap())
    }
    fn bytes(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.u32()? as usize;
        if n > MAX_BYTES {
            return Err(WireError::TooLong(n as u64));
        }
        self.take(n)
    }
    fn str(&mut self) -> Result<&'a str, WireError> {
        std::str::from_utf8(self.bytes()?).map_err(|_| WireError::BadUtf8)
    }
    fn data(&mut self) -> Result<Data<'a>, WireError> {
        match self.u8()? {
            0 => Ok(Data::Literal(self.bytes()?)),
            1 => Ok(Data::Cache {
                hash: self.hash()?,
                bytes: self.bytes()?,
            }),
            2 => {
                let hash = self.hash()?;
                let len = self.u32()?;
                if len as usize > MAX_BYTES {
                    return Err(WireError::TooLong(len as u64));
                }
                Ok(Data::Ref { hash, len })
            }
            t => Err(WireError::UnknownTag(t)),
        }
    }

    /// The next call (None at the end).
    pub fn call(&mut self) -> Result<Option<Call<'a>>, WireError> {
        if self.b.is_empty() {
            return Ok(None);
        }
        let c = match self.u8()? {
            1 => Call::CtxRetain { dev: self.i32()? },
            2 => {
                let req = self.u64()?;
                let q = match self.u8()? {
                    0 => Query::Driver,
                    1 => Query::Name { dev: self.i32()? },
                    2 => Query::Attr {
                        dev: self.i32()?,
                        attr: self.i32()?,
                    },
                    t => return Err(WireError::UnknownTag(t)),
                };
                Call::Query { req, q }
            }
            3 => Call::MemAlloc {
                addr: self.u64()?,
                size: self.u64()?,
            },
            4 => Call::MemFree { addr: self.u64()? },
            5 => Call::StreamCreate {
                id: self.u64()?,
                flags: self.u32()?,
            },
            6 => Call::StreamDestroy { id: self.u64()? },
            7 => Call::HtoD {
                stream: self.u64()?,
                dst: self.u64()?,
                data: self.data()?,
            },
            8 => {
                let (stream, seq, src, len) = (self.u64()?, self.u64()?, self.u64()?, self.u32()?);
                if len as usize > MAX_BYTES {
                    return Err(WireError::TooLong(len as u64));
                }
                Call::DtoH {
                    stream,
                    seq,
                    src,
                    len,
                }
            }
            9 => Call::Marker {
                stream: self.u64()?,
                seq: self.u64()?,
                sync: self.u8()? != 0,
            },
            10 => Call::ModuleLoad {
                id: self.u64()?,
                image: self.data()?,
            },
            11 => Call::ModuleUnload { id: self.u64()? },
            12 => Call::GetFunction {
                req: self.u64()?,
                module: self.u64()?,
                id: self.u64()?,
                name: self.str()?,
            },
            13 => {
                let func = self.u64()?;
                let stream = self.u64()?;
                let mut v = [0u32; 6];
                for x in &mut v {
                    *x = self.u32()?;
                }
                Call::Launch {
                    func,
                    stream,
                    grid: [v[0], v[1], v[2]],
                    block: [v[3], v[4], v[5]],
                    shmem: self.u32()?,
                    params: self.bytes()?,
                }
            }
            14 => {
                let req = self.u64()?;
                let hashes = self.bytes()?;
                if hashes.len() % 32 != 0 {
                    return Err(WireError::Truncated);
                }
                Call::Pin { req, hashes }
            }
            30 => Call::Watch {
                period_ms: self.u32()?,
            },
            31 => Call::Probe {
                req: self.u64()?,
                pad: self.bytes()?,
            },
            15 => Call::EventCreate {
                id: self.u64()?,
                flags: self.u32()?,
            },
            16 => Call::EventDestroy { id: self.u64()? },
            17 => Call::EventRecord {
                event: self.u64()?,
                stream: self.u64()?,
                seq: self.u64()?,
            },
            18 => Call::WaitEvent {
                stream: self.u64()?,
                event: self.u64()?,
            },
            19 => Call::Elapsed {
                req: self.u64()?,
                start: self.u64()?,
                end: self.u64()?,
            },
            t => return Err(WireError::UnknownTag(t)),
        };
        Ok(Some(c))
    }

    /// The next note (None at the end).
    pub fn note(&mut self) -> Result<Option<Note<'a>>, WireError> {
        if self.b.is_empty() {
            return Ok(None);
        }
        let n = match self.u8()? {
            1 => Note::Reached {
                seq: self.u64()?,
                status: self.i32()?,
                data: self.bytes()?,
            },
            2 => Note::Answer {
                req: self.u64()?,
                status: self.i32()?,
                data: self.bytes()?,
            },
            3 => Note::Failed {
                status: self.i32()?,
                call: self.str()?,
            },
            10 => Note::Heartbeat(Beat {
                queue: self.u32()?,
                sessions: self.u32()?,
                kernel_ns: self.u64()?,
                own: self.u32()?,
            }),
            t => return Err(WireError::UnknownTag(t)),
        };
        Ok(Some(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_and_notes_round_trip() {
        let h = [7u8; 32];
        let calls = [
            Call::CtxRetain { dev: 0 },
            Call::Query {
                req: 1,
                q: Query::Attr { dev: 0, attr: 75 },
            },
            Call::MemAlloc {
                addr: SIM_BASE,
                size: 4096,
            },
            Call::HtoD {
                stream: 3,
                dst: SIM_BASE + 16,
                data: Data::Cache {
                    hash: h,
                    bytes: b"abc",
                },
            },
            Call::HtoD {
                stream: 0,
                dst: SIM_BASE,
                data: Data::Ref { hash: h, len: 3 },
            },
            Call::DtoH {
                stream: 3,
                seq: 9,
                src: SIM_BASE,
                len: 16,
            },
            Call::Marker {
                stream: 3,
                seq: 10,
                sync: true,
            },
            Call::GetFunction {
                req: 2,
                module: 5,
                id: 6,
                name: "aes128_ctr",
            },
            Call::Pin {
                req: 3,
                hashes: &[1; 64],
            },
            Call::Launch {
                func: 6,
                stream: 3,
                grid: [1, 2, 3],
                block: [4, 5, 6],
                shmem: 0,
                params: &[1, 2, 3],
            },
            Call::Watch { period_ms: 250 },
            Call::Probe {
                req: 4,
                pad: &[9; 100],
            },
            Call::EventCreate { id: 8, flags: 2 },
            Call::EventRecord {
                event: 8,
                stream: 3,
                seq: 11,
            },
            Call::WaitEvent {
                stream: 4,
                event: 8,
            },
            Call::Elapsed {
                req: 12,
                start: 8,
                end: 9,
            },
            Call::EventDestroy { id: 8 },
        ];
        let mut b = Vec::new();
        for c in &calls {
            put_call(c, &mut b);
        }
        let mut r = Reader::new(&b);
        for c in &calls {
            assert_eq!(r.call().unwrap().as_ref(), Some(c));
        }
        assert_eq!(r.call().unwrap(), None);
        // Every truncation is an error, never a panic.
        for n in 0..b.len() {
            let mut r = Reader::new(&b[..n]);
            while let Ok(Some(_)) = r.call() {}
        }
        let notes = [
            Note::Reached {
                seq: 1,
                status: 0,
                data: b"xy",
            },
            Note::Failed {
                status: 2,
                call: "cuMemAlloc",
            },
            Note::Heartbeat(Beat {
                queue: 3,
                sessions: 2,
                kernel_ns: 300_000,
                own: 1,
            }),
        ];
        let mut b = Vec::new();
        for n in &notes {
            put_note(n, &mut b);
        }
        let mut r = Reader::new(&b);
        for n in &notes {
            assert_eq!(r.note().unwrap().as_ref(), Some(n));
        }
        assert!(r.is_empty());
    }
}
