//! The daemon's journal (under --state-dir): what it must remember across a restart
//! to keep running each op once and delivering each result once.
//!
//! An op counts as executed when its `Exec` record (client, seq, status, result) has
//! been written to the journal, which happens before its result is sent. A daemon
//! killed between computing a result and writing it loses that computation, and runs
//! the op again when the client resends it: for the pure ops served here that is
//! invisible, and the persisted execution count still counts it once. `Ack` and
//! `Watermark` records let a restarted daemon drop what the client already has;
//! `Owner` records keep each client id bound to the identity that opened it.
//!
//! Records: `u32 len | u8 type | payload | u32 CRC32C of type+payload`. Replay keeps
//! every record that verifies: a damaged stretch in the middle (a bad disk block, a
//! write that failed half-way) is skipped, counted and reported, and the records after
//! it are recovered; a torn tail (a crash mid-write) is cut off. A journal that had a
//! damaged stretch is rewritten clean. Writes go through write(2) (they survive the
//! process being killed); `--fsync` adds an fdatasync per flush so they survive the
//! machine too. When the file grows past its bound it is rewritten as a snapshot of
//! what is still needed, in three steps so that the daemon's lock is not held while
//! the snapshot is written: `begin_compaction` (under the lock: the snapshot, and from
//! then on every flush is also kept aside), `Compaction::write` (no lock: the bulk),
//! `finish_compaction` (under the lock: what was flushed meanwhile, then the rename).

use super::files;
use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rec {
    /// An execution (counted).
    Exec {
        client: u64,
        seq: u64,
        status: i32,
        data: Arc<[u8]>,
    },
    /// A result still held, from a snapshot (not counted again).
    Held {
        client: u64,
        seq: u64,
        status: i32,
        data: Arc<[u8]>,
    },
    Ack {
        client: u64,
        seq: u64,
    },
    Watermark {
        client: u64,
        wm: u64,
    },
    /// Snapshot start: executions counted before it.
    Total {
        executions: u64,
    },
    /// The identity a client id belongs to (identity.rs, as displayed).
    Owner {
        client: u64,
        identity: String,
    },
}

/// Longest identity an `Owner` record carries (a certificate subject).
pub const MAX_IDENTITY: usize = 4096;

fn put(out: &mut Vec<u8>, r: &Rec) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    match r {
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
            out.push(if matches!(r, Rec::Exec { .. }) { 1 } else { 2 });
            out.extend_from_slice(&client.to_le_bytes());
            out.extend_from_slice(&seq.to_le_bytes());
            out.extend_from_slice(&status.to_le_bytes());
            out.extend_from_slice(data);
        }
        Rec::Ack { client, seq } => {
            out.push(3);
            out.extend_from_slice(&client.to_le_bytes());
            out.extend_from_slice(&seq.to_le_bytes());
        }
        Rec::Watermark { client, wm } => {
            out.push(4);
            out.extend_from_slice(&client.to_le_bytes());
            out.extend_from_slice(&wm.to_le_bytes());
        }
        Rec::Total { executions } => {
            out.push(5);
            out.extend_from_slice(&executions.to_le_bytes());
        }
        Rec::Owner { client, identity } => {
            out.push(6);
            out.extend_from_slice(&client.to_le_bytes());
            let id = identity.as_bytes();
            out.extend_from_slice(&id[..id.len().min(MAX_IDENTITY)]);
        }
    }
    let body_len = out.len() - start - 4;
    out[start..start + 4].copy_from_slice(&(body_len as u32).to_le_bytes());
    let sum = crc32c::crc32c(&out[start + 4..]);
    out.extend_from_slice(&sum.to_le_bytes());
}

/// The records as the journal writes them (fuzzing and tools).
pub fn encode(recs: &[Rec]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in recs {
        put(&mut out, r);
    }
    out
}

/// Whether a body of `n` bytes could be a record of type `t` (cheap checks before the
/// checksum, which keep resynchronising over a damaged stretch fast).
fn plausible(t: u8, n: usize) -> bool {
    match t {
        1 | 2 => (21..=MAX_REC).contains(&n),
        3 | 4 => n == 17,
        5 => n == 9,
        6 => (9..=9 + MAX_IDENTITY).contains(&n),
        _ => false,
    }
}

fn parse(body: &[u8]) -> Option<Rec> {
    let u64_at = |i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(body.get(i..i + 8)?.try_into().ok()?))
    };
    if !plausible(*body.first()?, body.len()) {
        return None;
    }
    match body[0] {
        t @ (1 | 2) => {
            let client = u64_at(1)?;
            let seq = u64_at(9)?;
            let status = i32::from_le_bytes(body.get(17..21)?.try_into().ok()?);
            let data: Arc<[u8]> = body[21..].into();
            Some(if t == 1 {
                Rec::Exec {
                    client,
                    seq,
                    status,
                    data,
                }
            } else {
                Rec::Held {
                    client,
                    seq,
                    status,
                    data,
                }
            })
        }
        3 => Some(Rec::Ack {
            client: u64_at(1)?,
            seq: u64_at(9)?,
        }),
        4 => Some(Rec::Watermark {
            client: u64_at(1)?,
            wm: u64_at(9)?,
        }),
        5 => Some(Rec::Total {
            executions: u64_at(1)?,
        }),
        6 => Some(Rec::Owner {
            client: u64_at(1)?,
            identity: String::from_utf8(body[9..].to_vec()).ok()?,
        }),
        _ => None,
    }
}

/// Largest record accepted on replay (a result of the largest op plus headers).
const MAX_REC: usize = super::frame::MAX_OP_BYTES + 64;

/// The record that verifies at `at` and its length on disk, if one does.
fn record_at(all: &[u8], at: usize) -> Option<(Rec, usize)> {
    let n = u32::from_le_bytes(all.get(at..at + 4)?.try_into().ok()?) as usize;
    if !plausible(*all.get(at + 4)?, n) || at + 8 + n > all.len() {
        return None;
    }
    let body = &all[at + 4..at + 4 + n];
    let sum = u32::from_le_bytes(all[at + 4 + n..at + 8 + n].try_into().ok()?);
    if crc32c::crc32c(body) != sum {
        return None;
    }
    Some((parse(body)?, 8 + n))
}

/// A stretch of the file that did not verify, followed by records that did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Damage {
    pub offset: u64,
    pub len: u64,
}

/// What a replay found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replay {
    pub recs: Vec<Rec>,
    /// Damaged stretches in the middle (records after each were recovered).
    pub damaged: Vec<Damage>,
    /// Bytes of a torn tail cut off (a crash mid-write: normal).
    pub torn_tail: u64,
}

/// Reads every record of `all` that verifies (journal replay; also the fuzz target's).
pub fn scan(all: &[u8]) -> Replay {
    let mut r = Replay::default();
    let mut at = 0usize;
    let mut bad_from: Option<usize> = None;
    while at < all.len() {
        if let Some((rec, len)) = record_at(all, at) {
            if let Some(from) = bad_from.take() {
                r.damaged.push(Damage {
                    offset: from as u64,
                    len: (at - from) as u64,
                });
            }
            r.recs.push(rec);
            at += len;
            continue;
        }
        // Not a record here: skip what its length field says when a record verifies
        // right after (one damaged record), else resynchronise byte by byte.
        bad_from.get_or_insert(at);
        let skip = all
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize)
            .filter(|&n| n <= MAX_REC && at + 8 + n < all.len())
            .map(|n| at + 8 + n)
            .filter(|&next| record_at(all, next).is_some());
        at = skip.unwrap_or(at + 1);
    }
    if let Some(from) = bad_from {
        r.torn_tail = (all.len() - from) as u64;
    }
    r
}

pub struct Journal {
    path: PathBuf,
    file: File,
    buf: Vec<u8>,
    size: u64,
    fsync: bool,
    /// While a compaction runs: what was flushed since its snapshot.
    since_snapshot: Option<Vec<u8>>,
    /// Rewrite as a snapshot beyond this size.
    pub compact_at: u64,
}

/// A snapshot being written beside the journal (no lock held).
pub struct Compaction {
    tmp: PathBuf,
    recs: Vec<Rec>,
    written: u64,
    file: Option<File>,
}

impl Compaction {
    /// The bulk of a compaction: the snapshot encoded and written to a temporary
    /// file, synced.
    pub fn write(&mut self) -> io::Result<()> {
        let mut bytes = Vec::new();
        for r in std::mem::take(&mut self.recs) {
            put(&mut bytes, &r);
        }
        let mut f = files::create_new(&self.tmp)?;
        f.write_all(&bytes)?;
        f.sync_data()?;
        self.written = bytes.len() as u64;
        self.file = Some(f);
        Ok(())
    }
}

impl Journal {
    /// Opens (creating, 0600) `dir/journal` and replays it: a torn tail is cut off, a
    /// journal with damage in the middle is rewritten with the records that verified.
    pub fn open(dir: &Path, fsync: bool) -> io::Result<(Journal, Replay)> {
        files::create_dir(dir)?;
        let path = dir.join("journal");
        let mut file = files::open_rw(&path)?;
        let mut all = Vec::new();
        file.read_to_end(&mut all)?;
        let replay = scan(&all);
        let good = (all.len() as u64) - replay.torn_tail;
        drop(all);
        let mut j = Journal {
            path,
            file,
            buf: Vec::with_capacity(1 << 20),
            size: good,
            fsync,
            since_snapshot: None,
            compact_at: 256 << 20,
        };
        if replay.damaged.is_empty() {
            j.file.set_len(good)?;
            j.file.seek(io::SeekFrom::End(0))?;
        } else {
            let mut c = j.begin_compaction(replay.recs.clone());
            c.write()?;
            j.finish_compaction(c)?;
        }
        Ok((j, replay))
    }

    pub fn append(&mut self, r: &Rec) {
        put(&mut self.buf, r);
    }

    /// Writes everything appended so far (before any result it covers is sent). On
    /// an error what was appended is dropped: the caller stops taking new ops.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let r = self.file.write_all(&self.buf).and_then(|()| {
            if self.fsync {
                self.file.sync_data()
            } else {
                Ok(())
            }
        });
        if r.is_ok() {
            self.size += self.buf.len() as u64;
            if let Some(t) = &mut self.since_snapshot {
                t.extend_from_slice(&self.buf);
            }
        }
        self.buf.clear();
        r
    }

    pub fn needs_compaction(&self) -> bool {
        self.size > self.compact_at && self.since_snapshot.is_none()
    }

    /// Starts replacing the journal with `snapshot`: flushes, and from now on keeps
    /// what is flushed aside for `finish_compaction`.
    pub fn begin_compaction(&mut self, snapshot: Vec<Rec>) -> Compaction {
        // A failed flush leaves the daemon refusing ops; the snapshot covers it.
        let _ = self.flush();
        self.since_snapshot = Some(Vec::new());
        Compaction {
            tmp: self.path.with_extension("tmp"),
            recs: snapshot,
            written: 0,
            file: None,
        }
    }

    /// Ends a compaction: appends what was flushed meanwhile, renames the snapshot
    /// over the journal. Err: the old journal stays (still complete).
    pub fn finish_compaction(&mut self, c: Compaction) -> io::Result<()> {
        let tail = self.since_snapshot.take().unwrap_or_default();
        let Some(mut f) = c.file else {
            let _ = std::fs::remove_file(&c.tmp);
            return Err(io::Error::other("compaction snapshot not written"));
        };
        let r = f
            .write_all(&tail)
            .and_then(|()| f.sync_data())
            .and_then(|()| std::fs::rename(&c.tmp, &self.path));
        if let Err(e) = r {
            let _ = std::fs::remove_file(&c.tmp);
            return Err(e);
        }
        f.seek(io::SeekFrom::End(0))?;
        self.file = f;
        self.size = c.written + tail.len() as u64;
        Ok(())
    }

    /// Replaces the journal with `snapshot` in one go (tests and tools).
    pub fn rewrite(&mut self, snapshot: &[Rec]) -> io::Result<()> {
        let mut c = self.begin_compaction(snapshot.to_vec());
        c.write()?;
        self.finish_compaction(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replays_and_cuts_a_torn_tail() {
        let dir = std::env::temp_dir().join(format!("toffload_journal_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let recs = vec![
            Rec::Total { executions: 7 },
            Rec::Exec {
                client: 1,
                seq: 2,
                status: 0,
                data: vec![1, 2, 3].into(),
            },
            Rec::Ack { client: 1, seq: 2 },
            Rec::Watermark { client: 1, wm: 3 },
            Rec::Held {
                client: 4,
                seq: 5,
                status: -5,
                data: vec![].into(),
            },
            Rec::Owner {
                client: 4,
                identity: "psk:web-1".into(),
            },
        ];
        {
            let (mut j, got) = Journal::open(&dir, false).unwrap();
            assert!(got.recs.is_empty());
            for r in &recs {
                j.append(r);
            }
            j.flush().unwrap();
        }
        // A torn record at the end.
        {
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(dir.join("journal"))
                .unwrap();
            f.write_all(&[30, 0, 0, 0, 1, 2]).unwrap();
        }
        let (mut j, got) = Journal::open(&dir, false).unwrap();
        assert_eq!(got.recs, recs);
        assert_eq!(got.torn_tail, 6);
        assert!(got.damaged.is_empty());
        j.append(&Rec::Ack { client: 9, seq: 9 });
        j.flush().unwrap();
        drop(j);
        let (mut j, got) = Journal::open(&dir, false).unwrap();
        assert_eq!(got.recs.len(), recs.len() + 1);
        assert_eq!(got.torn_tail, 0);
        j.rewrite(&recs[..1]).unwrap();
        drop(j);
        let (_, got) = Journal::open(&dir, false).unwrap();
        assert_eq!(got.recs, recs[..1]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn exec(seq: u64, len: usize) -> Rec {
        Rec::Exec {
            client: 1,
            seq,
            status: 0,
            data: vec![seq as u8; len].into(),
        }
    }

    /// Damage in the middle: the old journal (FNV, stop at the first bad record) lost
    /// every record after it; now the damaged stretch is reported with its place and
    /// length, the records after it come back, and the file is rewritten clean.
    #[test]
    fn damage_in_the_middle_loses_only_the_damaged_records() {
        let dir = std::env::temp_dir().join(format!("toffload_journal_mid_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let recs: Vec<Rec> = (0..10).map(|i| exec(i, 100 + i as usize)).collect();
        let mut offsets = Vec::new();
        {
            let (mut j, _) = Journal::open(&dir, false).unwrap();
            let mut at = 0;
            for r in &recs {
                offsets.push(at);
                let mut one = Vec::new();
                put(&mut one, r);
                at += one.len();
                j.append(r);
            }
            j.flush().unwrap();
        }
        let path = dir.join("journal");
        let mut bytes = std::fs::read(&path).unwrap();
        // A flipped byte in record 3's payload, and garbage over record 6's length.
        bytes[offsets[3] + 30] ^= 0x40;
        bytes[offsets[6]..offsets[6] + 4].copy_from_slice(&[0xff, 0xff, 0x00, 0x7f]);
        std::fs::write(&path, &bytes).unwrap();
        // The hazard, as the old replay did it: stop at the first record that fails.
        let old_style = {
            let mut n = 0;
            let mut at = 0;
            while let Some((_, len)) = record_at(&bytes, at) {
                n += 1;
                at += len;
            }
            n
        };
        assert_eq!(old_style, 3, "records after the damage were lost before");
        let (_, got) = Journal::open(&dir, false).unwrap();
        let want: Vec<Rec> = recs
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 3 && *i != 6)
            .map(|(_, r)| r.clone())
            .collect();
        assert_eq!(got.recs, want);
        assert_eq!(
            got.damaged,
            vec![
                Damage {
                    offset: offsets[3] as u64,
                    len: (offsets[4] - offsets[3]) as u64
                },
                Damage {
                    offset: offsets[6] as u64,
                    len: (offsets[7] - offsets[6]) as u64
                },
            ]
        );
        assert_eq!(got.torn_tail, 0);
        // Rewritten clean: a second open finds no damage and the same records.
        let (_, again) = Journal::open(&dir, false).unwrap();
        assert!(again.damaged.is_empty());
        assert_eq!(again.recs, want);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A compaction keeps what is flushed while its snapshot is being written.
    #[test]
    fn compaction_keeps_writes_made_during_it() {
        let dir = std::env::temp_dir().join(format!("toffload_journal_cmp_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (mut j, _) = Journal::open(&dir, false).unwrap();
        for i in 0..5 {
            j.append(&exec(i, 10));
        }
        j.flush().unwrap();
        let mut c = j.begin_compaction(vec![exec(4, 10)]);
        j.append(&exec(5, 10));
        j.flush().unwrap();
        c.write().unwrap();
        j.append(&exec(6, 10));
        j.flush().unwrap();
        j.finish_compaction(c).unwrap();
        j.append(&exec(7, 10));
        j.flush().unwrap();
        drop(j);
        let (_, got) = Journal::open(&dir, false).unwrap();
        assert_eq!(
            got.recs,
            vec![exec(4, 10), exec(5, 10), exec(6, 10), exec(7, 10)]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Arbitrary bytes never panic the replay, and what it returns re-encodes to
    /// records that verify.
    #[test]
    fn scan_survives_garbage() {
        let mut x: u64 = 0x1234_5678;
        for round in 0..200 {
            let mut v = Vec::new();
            put(&mut v, &exec(round, (round % 50) as usize));
            for _ in 0..(round % 97) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                v.push(x as u8);
            }
            put(
                &mut v,
                &Rec::Ack {
                    client: 2,
                    seq: round,
                },
            );
            let r = scan(&v);
            assert_eq!(r.recs.first(), Some(&exec(round, (round % 50) as usize)));
            assert_eq!(
                r.recs.last(),
                Some(&Rec::Ack {
                    client: 2,
                    seq: round
                })
            );
        }
    }
}
