//! The daemon's journal (under --state-dir): what it must remember across a restart
//! to keep running each op once and delivering each result once.
//!
//! An op counts as executed when its `Exec` record (client, seq, status, result) has
//! been written to the journal, which happens before its result is sent. A daemon
//! killed between computing a result and writing it loses that computation, and runs
//! the op again when the client resends it: for the pure ops served here that is
//! invisible, and the persisted execution count still counts it once. `Ack` and
//! `Watermark` records let a restarted daemon drop what the client already has.
//! Records: `u32 len | u8 type | payload | u32 FNV-1a of type+payload`; a torn or
//! corrupt tail (a crash mid-write) ends the replay there and is cut off. Writes go
//! through write(2) (they survive the process being killed); `--fsync` adds an
//! fdatasync per flush so they survive the machine too. When the file grows past its
//! bound it is rewritten as a snapshot of what is still needed.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rec {
    /// An execution (counted).
    Exec {
        client: u64,
        seq: u64,
        status: i32,
        data: Vec<u8>,
    },
    /// A result still held, from a snapshot (not counted again).
    Held {
        client: u64,
        seq: u64,
        status: i32,
        data: Vec<u8>,
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
}

fn fnv(b: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &x in b {
        h ^= x as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

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
    }
    let body_len = out.len() - start - 4;
    out[start..start + 4].copy_from_slice(&(body_len as u32).to_le_bytes());
    let sum = fnv(&out[start + 4..]);
    out.extend_from_slice(&sum.to_le_bytes());
}

fn parse(body: &[u8]) -> Option<Rec> {
    let u64_at = |i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(body.get(i..i + 8)?.try_into().ok()?))
    };
    match *body.first()? {
        t @ (1 | 2) => {
            let client = u64_at(1)?;
            let seq = u64_at(9)?;
            let status = i32::from_le_bytes(body.get(17..21)?.try_into().ok()?);
            let data = body[21..].to_vec();
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
        3 if body.len() == 17 => Some(Rec::Ack {
            client: u64_at(1)?,
            seq: u64_at(9)?,
        }),
        4 if body.len() == 17 => Some(Rec::Watermark {
            client: u64_at(1)?,
            wm: u64_at(9)?,
        }),
        5 if body.len() == 9 => Some(Rec::Total {
            executions: u64_at(1)?,
        }),
        _ => None,
    }
}

/// Largest record accepted on replay (a result of the largest op plus headers).
const MAX_REC: usize = super::frame::MAX_OP_BYTES + 64;

pub struct Journal {
    path: PathBuf,
    file: File,
    buf: Vec<u8>,
    size: u64,
    fsync: bool,
    /// Rewrite as a snapshot beyond this size.
    pub compact_at: u64,
}

impl Journal {
    /// Opens (creating) `dir/journal`, replays it, cuts off a damaged tail.
    pub fn open(dir: &Path, fsync: bool) -> io::Result<(Journal, Vec<Rec>)> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("journal");
        let mut recs = Vec::new();
        let mut good = 0u64;
        if let Ok(mut f) = File::open(&path) {
            let mut all = Vec::new();
            f.read_to_end(&mut all)?;
            let mut at = 0usize;
            while at + 4 <= all.len() {
                let n = u32::from_le_bytes(all[at..at + 4].try_into().unwrap()) as usize;
                if n == 0 || n > MAX_REC || at + 4 + n + 4 > all.len() {
                    break;
                }
                let body = &all[at + 4..at + 4 + n];
                let sum = u32::from_le_bytes(all[at + 4 + n..at + 8 + n].try_into().unwrap());
                if fnv(body) != sum {
                    break;
                }
                match parse(body) {
                    Some(r) => recs.push(r),
                    None => break,
                }
                at += 8 + n;
            }
            good = at as u64;
        }
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)?;
        file.set_len(good)?;
        let mut j = Journal {
            path,
            file,
            buf: Vec::with_capacity(1 << 20),
            size: good,
            fsync,
            compact_at: 256 << 20,
        };
        use std::io::Seek;
        j.file.seek(io::SeekFrom::End(0))?;
        Ok((j, recs))
    }

    pub fn append(&mut self, r: &Rec) {
        put(&mut self.buf, r);
    }

    /// Writes everything appended so far (before any result it covers is sent).
    pub fn flush(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        self.file.write_all(&self.buf)?;
        if self.fsync {
            self.file.sync_data()?;
        }
        self.size += self.buf.len() as u64;
        self.buf.clear();
        Ok(())
    }

    pub fn needs_compaction(&self) -> bool {
        self.size > self.compact_at
    }

    /// Replaces the journal with `snapshot` (atomically: a new file renamed over it).
    pub fn rewrite(&mut self, snapshot: &[Rec]) -> io::Result<()> {
        self.flush()?;
        let tmp = self.path.with_extension("tmp");
        let mut out = Vec::new();
        for r in snapshot {
            put(&mut out, r);
        }
        {
            let mut f = File::create(&tmp)?;
            f.write_all(&out)?;
            f.sync_data()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        let mut file = OpenOptions::new().read(true).write(true).open(&self.path)?;
        use std::io::Seek;
        file.seek(io::SeekFrom::End(0))?;
        self.file = file;
        self.size = out.len() as u64;
        Ok(())
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
                data: vec![1, 2, 3],
            },
            Rec::Ack { client: 1, seq: 2 },
            Rec::Watermark { client: 1, wm: 3 },
            Rec::Held {
                client: 4,
                seq: 5,
                status: -5,
                data: vec![],
            },
        ];
        {
            let (mut j, got) = Journal::open(&dir, false).unwrap();
            assert!(got.is_empty());
            for r in &recs {
                j.append(r);
            }
            j.flush().unwrap();
        }
        // A torn record at the end.
        {
            let mut f = OpenOptions::new()
                .append(true)
                .open(dir.join("journal"))
                .unwrap();
            f.write_all(&[30, 0, 0, 0, 1, 2]).unwrap();
        }
        let (mut j, got) = Journal::open(&dir, false).unwrap();
        assert_eq!(got, recs);
        j.append(&Rec::Ack { client: 9, seq: 9 });
        j.flush().unwrap();
        drop(j);
        let (mut j, got) = Journal::open(&dir, false).unwrap();
        assert_eq!(got.len(), recs.len() + 1);
        j.rewrite(&recs[..1]).unwrap();
        drop(j);
        let (_, got) = Journal::open(&dir, false).unwrap();
        assert_eq!(got, recs[..1]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
