//! The wire protocol between the remote backend and `toffload-remoted`.
//!
//! Every message is one frame: `u32 body length (little endian) | u8 kind | body`.
//! The length counts the kind byte and the body and is at most [`MAX_FRAME`]; a longer
//! (or zero) length is an error before anything is allocated. Decoding works on a
//! complete frame held in a buffer the decoder bounds ([`FrameReader`]), borrows the
//! payload bytes from it ([`Msg`] holds slices), and checks every count against the
//! bytes that remain before it reserves room for them, so malformed input costs at
//! most one frame's buffer and is reported as a [`FrameError`], never a panic.
//!
//! The first frame on a connection is the client's `Hello` (magic `TOFL`, protocol
//! version), answered by `Welcome` or `Refused`.

use std::fmt;

/// Largest frame body (kind byte included): 16 MiB of payload plus headers.
pub const MAX_FRAME: usize = (16 << 20) + (64 << 10);
/// Largest single operation the remote backend carries.
pub const MAX_OP_BYTES: usize = 16 << 20;
/// Most operations (or results) in one frame.
pub const MAX_OPS_PER_FRAME: usize = 4096;
/// Most chunk hashes a `Welcome` lists.
pub const MAX_INVENTORY: usize = (MAX_FRAME - 64) / 32;
/// Most chunks one operation is cut into.
pub const MAX_CHUNKS_PER_OP: usize = 8192;
/// Protocol version spoken here.
pub const VERSION: u16 = 2;
pub const MAGIC: [u8; 4] = *b"TOFL";

/// What an operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    /// AES-128-CTR in place (the emulated backend's transform); result = same length.
    AesCtr = 1,
    /// RSA-2048 PKCS#1 v1.5 signature over SHA-256 of the data with the daemon's key;
    /// result = the 256-byte signature.
    RsaSign = 2,
}

impl OpKind {
    pub fn from_u8(v: u8) -> Option<OpKind> {
        match v {
            1 => Some(OpKind::AesCtr),
            2 => Some(OpKind::RsaSign),
            _ => None,
        }
    }
}

/// A piece of an operation's payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Bytes sent as they are.
    Literal(&'a [u8]),
    /// A chunk the daemon is believed to hold: its SHA-256 and length.
    Ref { hash: [u8; 32], len: u32 },
}

/// An operation's payload: raw bytes, or a list of pieces whose concatenation is it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Payload<'a> {
    Raw(&'a [u8]),
    Chunked { total: u32, pieces: Vec<Piece<'a>> },
}

impl Payload<'_> {
    pub fn len(&self) -> usize {
        match self {
            Payload::Raw(b) => b.len(),
            Payload::Chunked { total, .. } => *total as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes this payload puts on the wire (encoded).
    pub fn wire_len(&self) -> usize {
        match self {
            Payload::Raw(b) => 5 + b.len(),
            Payload::Chunked { pieces, .. } => {
                7 + pieces
                    .iter()
                    .map(|p| match p {
                        Piece::Literal(b) => 5 + b.len(),
                        Piece::Ref { .. } => 37,
                    })
                    .sum::<usize>()
            }
        }
    }
}

/// One operation in a `Submit`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op<'a> {
    pub seq: u64,
    pub kind: OpKind,
    pub payload: Payload<'a>,
}

/// One result in a `Results`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Res<'a> {
    pub seq: u64,
    /// 0, or a negative errno ([`STATUS_MISSING_CHUNK`]: resend the op's bytes).
    pub status: i32,
    pub data: &'a [u8],
}

/// The daemon did not have a chunk the op referenced: the op did not run, and the
/// client sends it again with its bytes (same seq).
pub const STATUS_MISSING_CHUNK: i32 = -libc::ENOENT;

/// The daemon's load, carried on `Welcome`, `Results` and `Pong`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Operations received and not yet finished (all clients).
    pub queue_depth: u32,
    /// Mean service time of recent operations, ns (EWMA).
    pub service_ns: u64,
    /// Operations the daemon serves at once.
    pub lanes: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg<'a> {
    /// Client -> daemon, first frame.
    Hello {
        version: u16,
        client_id: u64,
    },
    /// Daemon -> client: accepted. `chunks`: the chunk hashes the daemon holds.
    Welcome {
        version: u16,
        daemon_id: u64,
        load: Load,
        chunks: Vec<[u8; 32]>,
    },
    /// Daemon -> client: the hello was refused (version, authentication).
    Refused {
        reason: &'a str,
    },
    /// Client -> daemon: acknowledged results, the watermark (every seq below it is
    /// finished for the client and never sent again), new or resent operations.
    Submit {
        watermark: u64,
        acks: Vec<u64>,
        ops: Vec<Op<'a>>,
    },
    /// Daemon -> client.
    Results {
        load: Load,
        results: Vec<Res<'a>>,
    },
    Ping {
        token: u64,
    },
    Pong {
        token: u64,
        load: Load,
    },
    /// Either way: the daemon's counters (query has no pairs).
    StatsQuery,
    Stats {
        pairs: Vec<(&'a str, u64)>,
    },
    /// Client -> daemon: a batch of remoted CUDA driver calls (cuda_wire.rs encodes
    /// them; the frame carries them as one blob).
    Cuda {
        calls: &'a [u8],
    },
    /// Daemon -> client: answers and stream progress for remoted CUDA calls.
    CudaNotes {
        notes: &'a [u8],
    },
}

const K_HELLO: u8 = 1;
const K_WELCOME: u8 = 2;
const K_REFUSED: u8 = 3;
const K_SUBMIT: u8 = 4;
const K_RESULTS: u8 = 5;
const K_PING: u8 = 6;
const K_PONG: u8 = 7;
const K_STATS_QUERY: u8 = 8;
const K_STATS: u8 = 9;
const K_CUDA: u8 = 10;
const K_CUDA_NOTES: u8 = 11;

/// Why bytes are not a valid frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// The length prefix is 0 or above MAX_FRAME.
    BadLength(u64),
    /// The body ends before a field does.
    Truncated,
    /// The body has bytes after its last field.
    Trailing(usize),
    UnknownKind(u8),
    BadMagic,
    BadOpKind(u8),
    BadEncoding(u8),
    /// A count or length above its bound.
    TooMany(&'static str, u64),
    /// Chunk lengths that do not add up to the op's length.
    ChunkSum,
    BadUtf8,
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::BadLength(n) => write!(f, "frame length {n} outside 1..={MAX_FRAME}"),
            FrameError::Truncated => write!(f, "frame body truncated"),
            FrameError::Trailing(n) => write!(f, "{n} stray bytes after the frame's fields"),
            FrameError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            FrameError::BadMagic => write!(f, "bad hello magic"),
            FrameError::BadOpKind(k) => write!(f, "unknown op kind {k}"),
            FrameError::BadEncoding(k) => write!(f, "unknown payload encoding {k}"),
            FrameError::TooMany(what, n) => write!(f, "{what} {n} above its bound"),
            FrameError::ChunkSum => write!(f, "chunk lengths do not add up to the op length"),
            FrameError::BadUtf8 => write!(f, "string is not UTF-8"),
        }
    }
}

impl std::error::Error for FrameError {}

/// A reader over one frame's body.
struct Cur<'a> {
    b: &'a [u8],
}

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.b.len() < n {
            return Err(FrameError::Truncated);
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn i32(&mut self) -> Result<i32, FrameError> {
        Ok(self.u32()? as i32)
    }
    fn hash(&mut self) -> Result<[u8; 32], FrameError> {
        Ok(self.take(32)?.try_into().unwrap())
    }
    /// A count whose items take at least `min_size` bytes each: checked against both
    /// its bound and the bytes left, so a lying count cannot make us reserve memory.
    fn count(
        &mut self,
        what: &'static str,
        max: usize,
        min_size: usize,
    ) -> Result<usize, FrameError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(FrameError::TooMany(what, n as u64));
        }
        if n.saturating_mul(min_size) > self.b.len() {
            return Err(FrameError::Truncated);
        }
        Ok(n)
    }
    fn bytes(&mut self, max: usize) -> Result<&'a [u8], FrameError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(FrameError::TooMany("byte string", n as u64));
        }
        self.take(n)
    }
    fn str(&mut self) -> Result<&'a str, FrameError> {
        std::str::from_utf8(self.bytes(4096)?).map_err(|_| FrameError::BadUtf8)
    }
    fn load(&mut self) -> Result<Load, FrameError> {
        Ok(Load {
            queue_depth: self.u32()?,
            service_ns: self.u64()?,
            lanes: self.u32()?,
        })
    }
}

fn payload<'a>(c: &mut Cur<'a>) -> Result<Payload<'a>, FrameError> {
    match c.u8()? {
        0 => Ok(Payload::Raw(c.bytes(MAX_OP_BYTES)?)),
        1 => {
            let total = c.u32()?;
            if total as usize > MAX_OP_BYTES {
                return Err(FrameError::TooMany("op length", total as u64));
            }
            let n = c.u16()? as usize;
            if n > MAX_CHUNKS_PER_OP {
                return Err(FrameError::TooMany("chunks", n as u64));
            }
            if n.saturating_mul(5) > c.b.len() {
                return Err(FrameError::Truncated);
            }
            let mut pieces = Vec::with_capacity(n);
            let mut sum = 0u64;
            for _ in 0..n {
                let p = match c.u8()? {
                    0 => Piece::Literal(c.bytes(MAX_OP_BYTES)?),
                    1 => {
                        let hash = c.hash()?;
                        Piece::Ref {
                            hash,
                            len: c.u32()?,
                        }
                    }
                    t => return Err(FrameError::BadEncoding(t)),
                };
                sum += match p {
                    Piece::Literal(b) => b.len() as u64,
                    Piece::Ref { len, .. } => len as u64,
                };
                pieces.push(p);
            }
            if sum != total as u64 {
                return Err(FrameError::ChunkSum);
            }
            Ok(Payload::Chunked { total, pieces })
        }
        t => Err(FrameError::BadEncoding(t)),
    }
}

/// Decodes one frame body (kind byte first), borrowing from it.
pub fn decode(body: &[u8]) -> Result<Msg<'_>, FrameError> {
    if body.is_empty() || body.len() > MAX_FRAME {
        return Err(FrameError::BadLength(body.len() as u64));
    }
    let mut c = Cur { b: &body[1..] };
    let msg = match body[0] {
        K_HELLO => {
            if c.take(4)? != MAGIC {
                return Err(FrameError::BadMagic);
            }
            Msg::Hello {
                version: c.u16()?,
                client_id: c.u64()?,
            }
        }
        K_WELCOME => {
            if c.take(4)? != MAGIC {
                return Err(FrameError::BadMagic);
            }
            let version = c.u16()?;
            let daemon_id = c.u64()?;
            let load = c.load()?;
            let n = c.count("inventory", MAX_INVENTORY, 32)?;
            let mut chunks = Vec::with_capacity(n);
            for _ in 0..n {
                chunks.push(c.hash()?);
            }
            Msg::Welcome {
                version,
                daemon_id,
                load,
                chunks,
            }
        }
        K_REFUSED => Msg::Refused { reason: c.str()? },
        K_SUBMIT => {
            let watermark = c.u64()?;
            let na = c.count("acks", MAX_OPS_PER_FRAME * 4, 8)?;
            let mut acks = Vec::with_capacity(na);
            for _ in 0..na {
                acks.push(c.u64()?);
            }
            let no = c.count("ops", MAX_OPS_PER_FRAME, 14)?;
            let mut ops = Vec::with_capacity(no);
            for _ in 0..no {
                let seq = c.u64()?;
                let k = c.u8()?;
                let kind = OpKind::from_u8(k).ok_or(FrameError::BadOpKind(k))?;
                ops.push(Op {
                    seq,
                    kind,
                    payload: payload(&mut c)?,
                });
            }
            Msg::Submit {
                watermark,
                acks,
                ops,
            }
        }
        K_RESULTS => {
            let load = c.load()?;
            let n = c.count("results", MAX_OPS_PER_FRAME, 16)?;
            let mut results = Vec::with_capacity(n);
            for _ in 0..n {
                results.push(Res {
                    seq: c.u64()?,
                    status: c.i32()?,
                    data: c.bytes(MAX_OP_BYTES)?,
                });
            }
            Msg::Results { load, results }
        }
        K_PING => Msg::Ping { token: c.u64()? },
        K_PONG => Msg::Pong {
            token: c.u64()?,
            load: c.load()?,
        },
        K_STATS_QUERY => Msg::StatsQuery,
        K_STATS => {
            let n = c.count("stats", 256, 12)?;
            let mut pairs = Vec::with_capacity(n);
            for _ in 0..n {
                let k = c.str()?;
                pairs.push((k, c.u64()?));
            }
            Msg::Stats { pairs }
        }
        K_CUDA => Msg::Cuda {
            calls: std::mem::take(&mut c.b),
        },
        K_CUDA_NOTES => Msg::CudaNotes {
            notes: std::mem::take(&mut c.b),
        },
        k => return Err(FrameError::UnknownKind(k)),
    };
    if !c.b.is_empty() {
        return Err(FrameError::Trailing(c.b.len()));
    }
    Ok(msg)
}

/// Appends frames to a byte buffer.
pub struct Enc<'a> {
    out: &'a mut Vec<u8>,
    start: usize,
}

impl<'a> Enc<'a> {
    /// Starts a frame of kind `kind` at the end of `out`.
    fn begin(out: &'a mut Vec<u8>, kind: u8) -> Self {
        let start = out.len();
        out.extend_from_slice(&[0, 0, 0, 0, kind]);
        Enc { out, start }
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.out.push(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.out.extend_from_slice(b);
        self
    }
    fn load(&mut self, l: &Load) -> &mut Self {
        self.u32(l.queue_depth).u64(l.service_ns).u32(l.lanes)
    }
    fn finish(self) {
        let len = (self.out.len() - self.start - 4) as u32;
        debug_assert!(len as usize <= MAX_FRAME, "frame of {len} bytes");
        self.out[self.start..self.start + 4].copy_from_slice(&len.to_le_bytes());
    }
}

fn put_payload(e: &mut Enc<'_>, p: &Payload<'_>) {
    match p {
        Payload::Raw(b) => {
            e.u8(0).bytes(b);
        }
        Payload::Chunked { total, pieces } => {
            e.u8(1).u32(*total).u16(pieces.len() as u16);
            for p in pieces {
                match p {
                    Piece::Literal(b) => {
                        e.u8(0).bytes(b);
                    }
                    Piece::Ref { hash, len } => {
                        e.u8(1);
                        e.out.extend_from_slice(hash);
                        e.u32(*len);
                    }
                }
            }
        }
    }
}

/// Appends `msg` as one frame to `out`. The caller keeps within the bounds
/// (MAX_OPS_PER_FRAME, MAX_FRAME); `encoded_len` tells what a message will take.
pub fn encode(msg: &Msg<'_>, out: &mut Vec<u8>) {
    match msg {
        Msg::Hello { version, client_id } => {
            let mut e = Enc::begin(out, K_HELLO);
            e.out.extend_from_slice(&MAGIC);
            e.u16(*version).u64(*client_id);
            e.finish();
        }
        Msg::Welcome {
            version,
            daemon_id,
            load,
            chunks,
        } => {
            let mut e = Enc::begin(out, K_WELCOME);
            e.out.extend_from_slice(&MAGIC);
            e.u16(*version)
                .u64(*daemon_id)
                .load(load)
                .u32(chunks.len() as u32);
            for h in chunks {
                e.out.extend_from_slice(h);
            }
            e.finish();
        }
        Msg::Refused { reason } => {
            let mut e = Enc::begin(out, K_REFUSED);
            e.bytes(reason.as_bytes());
            e.finish();
        }
        Msg::Submit {
            watermark,
            acks,
            ops,
        } => encode_submit(*watermark, acks, ops, out),
        Msg::Results { load, results } => {
            let mut e = Enc::begin(out, K_RESULTS);
            e.load(load).u32(results.len() as u32);
            for r in results {
                e.u64(r.seq).u32(r.status as u32).bytes(r.data);
            }
            e.finish();
        }
        Msg::Ping { token } => {
            let mut e = Enc::begin(out, K_PING);
            e.u64(*token);
            e.finish();
        }
        Msg::Pong { token, load } => {
            let mut e = Enc::begin(out, K_PONG);
            e.u64(*token).load(load);
            e.finish();
        }
        Msg::StatsQuery => Enc::begin(out, K_STATS_QUERY).finish(),
        Msg::Stats { pairs } => {
            let mut e = Enc::begin(out, K_STATS);
            e.u32(pairs.len() as u32);
            for (k, v) in pairs {
                e.bytes(k.as_bytes()).u64(*v);
            }
            e.finish();
        }
        Msg::Cuda { calls } => {
            let e = Enc::begin(out, K_CUDA);
            e.out.extend_from_slice(calls);
            e.finish();
        }
        Msg::CudaNotes { notes } => {
            let e = Enc::begin(out, K_CUDA_NOTES);
            e.out.extend_from_slice(notes);
            e.finish();
        }
    }
}

/// A `Submit` frame without building a `Msg` (the client's hot path).
pub fn encode_submit(watermark: u64, acks: &[u64], ops: &[Op<'_>], out: &mut Vec<u8>) {
    let mut e = Enc::begin(out, K_SUBMIT);
    e.u64(watermark).u32(acks.len() as u32);
    for a in acks {
        e.u64(*a);
    }
    e.u32(ops.len() as u32);
    for op in ops {
        e.u64(op.seq).u8(op.kind as u8);
        put_payload(&mut e, &op.payload);
    }
    e.finish();
}

/// Bytes one op adds to a `Submit` frame.
pub fn op_wire_len(op: &Op<'_>) -> usize {
    9 + op.payload.wire_len()
}

/// A `Results` frame from (seq, status, data) triples.
pub fn encode_results<'b>(
    load: &Load,
    results: impl ExactSizeIterator<Item = (u64, i32, &'b [u8])>,
    out: &mut Vec<u8>,
) {
    let mut e = Enc::begin(out, K_RESULTS);
    e.load(load).u32(results.len() as u32);
    for (seq, status, data) in results {
        e.u64(seq).u32(status as u32).bytes(data);
    }
    e.finish();
}

/// Accumulates bytes from a stream and yields whole frame bodies. It holds at most one
/// frame plus one read's worth of bytes; a bad length prefix is an error at once.
pub struct FrameReader {
    buf: Vec<u8>,
    start: usize,
}

impl Default for FrameReader {
    fn default() -> Self {
        Self::new()
    }
}

/// Bytes asked of the stream per read.
pub const READ_CHUNK: usize = 256 << 10;

impl FrameReader {
    pub fn new() -> Self {
        FrameReader {
            buf: Vec::with_capacity(64 << 10),
            start: 0,
        }
    }

    /// The length of the frame at the head, once its prefix is in, validated.
    fn head_len(&self) -> Result<Option<usize>, FrameError> {
        let avail = &self.buf[self.start..];
        if avail.len() < 4 {
            return Ok(None);
        }
        let n = u32::from_le_bytes(avail[..4].try_into().unwrap()) as usize;
        if n == 0 || n > MAX_FRAME {
            return Err(FrameError::BadLength(n as u64));
        }
        Ok(Some(n))
    }

    /// Reads once from `r` (at most READ_CHUNK bytes). Ok(0) is end of stream.
    pub fn fill(&mut self, r: &mut impl std::io::Read) -> std::io::Result<usize> {
        // Callers take every whole frame out before reading more, so the buffer holds
        // less than one maximal frame here; anything else is a caller bug, refused.
        if self.buffered() > 4 + MAX_FRAME {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "frame reader over its bound",
            ));
        }
        if self.start > 0
            && (self.start >= self.buf.len() / 2 || self.buf.len() - self.start < 4096)
        {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        let old = self.buf.len();
        self.buf.resize(old + READ_CHUNK, 0);
        let r = r.read(&mut self.buf[old..]);
        let n = *r.as_ref().unwrap_or(&0);
        self.buf.truncate(old + n);
        r
    }

    /// Appends bytes (tests, fuzzing).
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame's body, if one is buffered. The slice is valid until the
    /// next call to `fill`/`push`/`next`.
    pub fn next_frame(&mut self) -> Result<Option<&[u8]>, FrameError> {
        let Some(n) = self.head_len()? else {
            return Ok(None);
        };
        if self.buf.len() - self.start < 4 + n {
            return Ok(None);
        }
        let s = self.start + 4;
        self.start = s + n;
        Ok(Some(&self.buf[s..s + n]))
    }

    /// Bytes buffered and not yet returned.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(m: &Msg<'_>) {
        let mut out = Vec::new();
        encode(m, &mut out);
        let mut r = FrameReader::new();
        r.push(&out);
        let body = r.next_frame().unwrap().expect("one frame");
        assert_eq!(&decode(body).unwrap(), m);
        assert_eq!(r.buffered(), 0);
    }

    #[test]
    fn every_kind_round_trips() {
        let data = [7u8; 100];
        let load = Load {
            queue_depth: 3,
            service_ns: 12345,
            lanes: 64,
        };
        roundtrip(&Msg::Hello {
            version: VERSION,
            client_id: 42,
        });
        roundtrip(&Msg::Welcome {
            version: VERSION,
            daemon_id: 9,
            load,
            chunks: vec![[1; 32], [2; 32]],
        });
        roundtrip(&Msg::Refused { reason: "no" });
        roundtrip(&Msg::Submit {
            watermark: 5,
            acks: vec![1, 2, 3],
            ops: vec![
                Op {
                    seq: 6,
                    kind: OpKind::AesCtr,
                    payload: Payload::Raw(&data),
                },
                Op {
                    seq: 7,
                    kind: OpKind::RsaSign,
                    payload: Payload::Chunked {
                        total: 110,
                        pieces: vec![
                            Piece::Literal(&data),
                            Piece::Ref {
                                hash: [3; 32],
                                len: 10,
                            },
                        ],
                    },
                },
            ],
        });
        roundtrip(&Msg::Results {
            load,
            results: vec![Res {
                seq: 6,
                status: -5,
                data: &data,
            }],
        });
        roundtrip(&Msg::Ping { token: 1 });
        roundtrip(&Msg::Pong { token: 1, load });
        roundtrip(&Msg::StatsQuery);
        roundtrip(&Msg::Cuda { calls: b"calls" });
        roundtrip(&Msg::CudaNotes { notes: &[] });
        roundtrip(&Msg::Stats {
            pairs: vec![("executions", 10), ("duplicates", 0)],
        });
    }

    #[test]
    fn oversized_length_prefix_is_refused_before_buffering() {
        let mut r = FrameReader::new();
        r.push(&((MAX_FRAME as u32) + 1).to_le_bytes());
        assert_eq!(
            r.next_frame(),
            Err(FrameError::BadLength(MAX_FRAME as u64 + 1))
        );
        let mut r = FrameReader::new();
        r.push(&[0, 0, 0, 0]);
        assert!(r.next_frame().is_err());
    }

    #[test]
    fn lying_counts_are_errors_not_allocations() {
        // A Submit claiming 4096 ops in a 20-byte body.
        let mut body = vec![K_SUBMIT];
        body.extend_from_slice(&0u64.to_le_bytes());
        body.extend_from_slice(&0u32.to_le_bytes());
        body.extend_from_slice(&4096u32.to_le_bytes());
        assert_eq!(decode(&body), Err(FrameError::Truncated));
        // A Welcome claiming u32::MAX hashes.
        let mut body = vec![K_WELCOME];
        body.extend_from_slice(&MAGIC);
        body.extend_from_slice(&[0; 2 + 8 + 16]);
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(&body), Err(FrameError::TooMany(..))));
        // Chunk lengths that do not sum to the total.
        let mut out = Vec::new();
        encode_submit(
            0,
            &[],
            &[Op {
                seq: 1,
                kind: OpKind::AesCtr,
                payload: Payload::Chunked {
                    total: 11,
                    pieces: vec![Piece::Literal(&[1; 10])],
                },
            }],
            &mut out,
        );
        assert_eq!(decode(&out[4..]), Err(FrameError::ChunkSum));
    }

    /// Raw bytes, and maybe pieces as (literal?, hash byte, length).
    type ArbPayload = (Vec<u8>, Option<Vec<(bool, u8, u32)>>);
    /// (seq, kind, raw bytes, pieces as (literal?, hash, length, literal bytes)).
    type BuiltOp = (
        u64,
        OpKind,
        Vec<u8>,
        Option<Vec<(bool, [u8; 32], u32, Vec<u8>)>>,
    );

    fn arb_payload() -> impl Strategy<Value = ArbPayload> {
        (
            proptest::collection::vec(any::<u8>(), 0..300),
            proptest::option::of(proptest::collection::vec(
                (any::<bool>(), any::<u8>(), 0u32..5000),
                0..6,
            )),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Random bytes: an error or a message, never a panic; the reader never holds
        /// more than what it was given.
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode(&bytes);
            let mut r = FrameReader::new();
            r.push(&bytes);
            for _ in 0..bytes.len() + 1 {
                match r.next_frame() {
                    Ok(Some(body)) => { let _ = decode(body); }
                    Ok(None) | Err(_) => break,
                }
            }
        }

        /// Random bytes after a valid kind byte reach deeper into each decoder.
        #[test]
        fn random_bodies_never_panic(kind in 0u8..12, bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut body = vec![kind];
            if kind == K_HELLO || kind == K_WELCOME { body.extend_from_slice(&MAGIC); }
            body.extend_from_slice(&bytes);
            let _ = decode(&body);
        }

        /// Submit frames round-trip; every truncation and every one-byte corruption of
        /// one decodes to an error or to some message without panicking.
        #[test]
        fn submit_round_trips_and_survives_damage(
            wm in any::<u64>(),
            acks in proptest::collection::vec(any::<u64>(), 0..20),
            ops in proptest::collection::vec((any::<u64>(), any::<bool>(), arb_payload()), 0..8),
            cut in any::<proptest::sample::Index>(),
            flip in any::<proptest::sample::Index>(),
            xor in 1u8..=255,
        ) {
            let built: Vec<BuiltOp> = ops
                .into_iter()
                .map(|(seq, rsa, (raw, pieces))| {
                    let kind = if rsa { OpKind::RsaSign } else { OpKind::AesCtr };
                    let pieces = pieces.map(|ps| ps.into_iter().map(|(lit, h, len)| {
                        (lit, [h; 32], len, vec![h; (len % 97) as usize])
                    }).collect());
                    (seq, kind, raw, pieces)
                })
                .collect();
            let ops: Vec<Op<'_>> = built.iter().map(|(seq, kind, raw, pieces)| {
                let payload = match pieces {
                    None => Payload::Raw(raw),
                    Some(ps) => {
                        let pieces: Vec<Piece<'_>> = ps.iter().map(|(lit, hash, len, bytes)| {
                            if *lit { Piece::Literal(bytes) } else { Piece::Ref { hash: *hash, len: *len } }
                        }).collect();
                        let total = pieces.iter().map(|p| match p {
                            Piece::Literal(b) => b.len() as u32,
                            Piece::Ref { len, .. } => *len,
                        }).sum();
                        Payload::Chunked { total, pieces }
                    }
                };
                Op { seq: *seq, kind: *kind, payload }
            }).collect();
            let msg = Msg::Submit { watermark: wm, acks, ops };
            let mut out = Vec::new();
            encode(&msg, &mut out);
            let expect: usize = 4 + 1 + 8 + 4 + 8 * match &msg { Msg::Submit { acks, .. } => acks.len(), _ => 0 } + 4
                + match &msg { Msg::Submit { ops, .. } => ops.iter().map(op_wire_len).sum::<usize>(), _ => 0 };
            prop_assert_eq!(out.len(), expect);
            prop_assert_eq!(decode(&out[4..]).unwrap(), msg.clone());
            let body = &out[4..];
            let k = cut.index(body.len());
            prop_assert!(decode(&body[..k]).is_err());
            let mut damaged = body.to_vec();
            let i = flip.index(damaged.len());
            damaged[i] ^= xor;
            let _ = decode(&damaged);
        }

        /// A byte stream of several frames split at random points yields the same
        /// frames as when it arrives whole.
        #[test]
        fn reader_reassembles_split_streams(
            tokens in proptest::collection::vec(any::<u64>(), 1..20),
            splits in proptest::collection::vec(any::<proptest::sample::Index>(), 0..10),
        ) {
            let mut stream = Vec::new();
            for t in &tokens { encode(&Msg::Ping { token: *t }, &mut stream); }
            let mut cuts: Vec<usize> = splits.iter().map(|s| s.index(stream.len())).collect();
            cuts.push(stream.len());
            cuts.sort();
            let mut r = FrameReader::new();
            let mut got = Vec::new();
            let mut at = 0;
            for c in cuts {
                r.push(&stream[at..c]);
                at = c;
                while let Some(body) = r.next_frame().unwrap() {
                    match decode(body).unwrap() { Msg::Ping { token } => got.push(token), m => panic!("{m:?}") }
                }
            }
            prop_assert_eq!(got, tokens);
        }
    }
}
