//! The daemon's chunk cache: chunks by SHA-256, in memory (LRU, bounded in bytes)
//! and, with --cache-dir, on disk (one file per chunk, bounded in bytes, LRU too), so
//! a restarted daemon still holds what it had.
//!
//! Chunks are partitioned by the identity that sent them (a [`Part`], see
//! identity.rs): a lookup, an insert and the inventory all name a partition, and a
//! chunk of another partition is not there for them. Without that, any client could
//! reference (and, through an op over it, read) another's chunk by its hash. The byte
//! bounds are shared: one tenant's chunks may evict another's, which costs that one a
//! resend, never its data. On disk a partition is a folder named by its hex.
//!
//! Disk recency survives a restart through each file's mtime: the cache sets it (to
//! its own nanosecond clock, not the kernel's coarse file timestamps) when it writes a
//! chunk and again whenever the chunk is used, from memory or from disk, and a new
//! cache orders the files it finds by it. A use costs one utimensat(2); chunks are at
//! least 4 KiB (chunk.rs), so that is small next to moving the chunk.

use super::chunk::sha256;
use super::files;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

/// A partition of the cache: one per authenticated identity.
pub type Part = [u8; 16];
/// A chunk's place: its partition and its hash.
type Key = (Part, [u8; 32]);

/// A chunk on disk: its size and its place in the disk tier's recency order.
struct OnDisk {
    len: usize,
    tick: u64,
}

pub struct ChunkCache {
    mem: HashMap<Key, (Arc<[u8]>, u64)>,
    lru: BTreeMap<u64, Key>,
    tick: u64,
    bytes: usize,
    max_bytes: usize,
    disk: Option<PathBuf>,
    on_disk: HashMap<Key, OnDisk>,
    /// Disk recency: oldest use first.
    disk_lru: BTreeMap<u64, Key>,
    disk_bytes: usize,
    max_disk: usize,
    pub hits: u64,
    pub misses: u64,
    pub disk_evictions: u64,
}

fn hexs(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut h = [0u8; N];
    for (i, b) in h.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(h)
}

/// Sets a file's mtime to now (our clock; atime left alone). Best effort: a failure
/// only makes the order after a restart less exact.
fn stamp(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: now.as_secs() as libc::time_t,
            tv_nsec: now.subsec_nanos() as libc::c_long,
        },
    ];
    // SAFETY: a NUL-terminated path and an array of two timespecs, as utimensat takes.
    // AT_SYMLINK_NOFOLLOW: a link planted in the cache folder is not followed.
    unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
}

/// The chunk files under `dir`: (mtime, key, length). Stale temporary files of a
/// killed write are removed; anything else (links included) is left alone, unused.
fn scan(dir: &Path) -> std::io::Result<Vec<(SystemTime, Key, usize)>> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let Some(part) = e.file_name().to_str().and_then(unhex::<16>) else {
            continue;
        };
        if !e.file_type()?.is_dir() {
            continue;
        }
        for f in std::fs::read_dir(e.path())? {
            let f = f?;
            let name = f.file_name();
            let Some(name) = name.to_str() else {
                continue;
            };
            let md = f.metadata()?;
            if let Some(h) = unhex::<32>(name) {
                if md.is_file() {
                    found.push((md.modified()?, (part, h), md.len() as usize));
                }
            } else if name.starts_with('.')
                && name.ends_with(".tmp")
                && unhex::<32>(&name[1..name.len() - 4]).is_some()
            {
                // A write cut short by a kill: never renamed into place.
                let _ = std::fs::remove_file(f.path());
            }
        }
    }
    Ok(found)
}

impl ChunkCache {
    pub fn new(max_bytes: usize, disk: Option<PathBuf>, max_disk: usize) -> std::io::Result<Self> {
        let mut c = ChunkCache {
            mem: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            bytes: 0,
            max_bytes,
            disk,
            on_disk: HashMap::new(),
            disk_lru: BTreeMap::new(),
            disk_bytes: 0,
            max_disk,
            hits: 0,
            misses: 0,
            disk_evictions: 0,
        };
        if let Some(dir) = c.disk.clone() {
            files::create_dir(&dir)?;
            let mut found = scan(&dir)?;
            // Least recently used first (ties, if any, by key: deterministic).
            found.sort();
            for (_, k, len) in found {
                c.tick += 1;
                c.on_disk.insert(k, OnDisk { len, tick: c.tick });
                c.disk_lru.insert(c.tick, k);
                c.disk_bytes += len;
            }
            // The bound may have been lowered since.
            c.evict_disk();
        }
        Ok(c)
    }

    fn file(dir: &Path, k: &Key) -> PathBuf {
        dir.join(hexs(&k.0)).join(hexs(&k.1))
    }

    pub fn len(&self) -> usize {
        self.mem.len()
            + self
                .on_disk
                .keys()
                .filter(|k| !self.mem.contains_key(*k))
                .count()
    }

    pub fn is_empty(&self) -> bool {
        self.mem.is_empty() && self.on_disk.is_empty()
    }

    pub fn mem_bytes(&self) -> usize {
        self.bytes
    }

    pub fn disk_bytes(&self) -> usize {
        self.disk_bytes
    }

    /// Whether the disk tier holds `h` in `part` (tests, and the docs' claims about it).
    pub fn on_disk(&self, part: &Part, h: &[u8; 32]) -> bool {
        self.on_disk.contains_key(&(*part, *h))
    }

    /// Every hash `part` holds, most recently used first, at most `max`.
    pub fn inventory(&self, part: &Part, max: usize) -> Vec<[u8; 32]> {
        let mut v: Vec<[u8; 32]> = self
            .lru
            .values()
            .rev()
            .filter(|k| k.0 == *part)
            .map(|k| k.1)
            .take(max)
            .collect();
        if v.len() < max {
            for k in self.disk_lru.values().rev() {
                if v.len() >= max {
                    break;
                }
                if k.0 == *part && !self.mem.contains_key(k) {
                    v.push(k.1);
                }
            }
        }
        v
    }

    fn touch(&mut self, k: &Key) {
        self.tick += 1;
        if let Some(e) = self.mem.get_mut(k) {
            self.lru.remove(&e.1);
            e.1 = self.tick;
            self.lru.insert(self.tick, *k);
        }
    }

    /// A use of a chunk the disk holds: youngest in the disk order, here and (through
    /// the file's mtime) after a restart. Already the youngest: nothing to do.
    fn touch_disk(&mut self, k: &Key) {
        let Some(dir) = &self.disk else {
            return;
        };
        let Some(e) = self.on_disk.get_mut(k) else {
            return;
        };
        if self.disk_lru.last_key_value().map(|(t, _)| *t) == Some(e.tick) {
            return;
        }
        self.tick += 1;
        self.disk_lru.remove(&e.tick);
        e.tick = self.tick;
        self.disk_lru.insert(self.tick, *k);
        stamp(&Self::file(dir, k));
    }

    fn forget_disk(&mut self, k: &Key) {
        if let Some(e) = self.on_disk.remove(k) {
            self.disk_lru.remove(&e.tick);
            self.disk_bytes -= e.len;
            if let Some(dir) = &self.disk {
                let _ = std::fs::remove_file(Self::file(dir, k));
            }
        }
    }

    /// Least recently used chunks leave the disk until it is within its bound.
    fn evict_disk(&mut self) {
        while self.disk_bytes > self.max_disk {
            let Some((_, old)) = self.disk_lru.first_key_value().map(|(t, k)| (*t, *k)) else {
                break;
            };
            self.forget_disk(&old);
            self.disk_evictions += 1;
        }
    }

    /// The chunk `h` of partition `part`; None when that partition does not hold it
    /// (whoever else does).
    pub fn get(&mut self, part: &Part, h: &[u8; 32]) -> Option<Arc<[u8]>> {
        let k = (*part, *h);
        if let Some((d, _)) = self.mem.get(&k) {
            let d = Arc::clone(d);
            self.touch(&k);
            self.touch_disk(&k);
            self.hits += 1;
            return Some(d);
        }
        if self.on_disk.contains_key(&k) {
            if let Some(dir) = &self.disk {
                if let Ok(d) = std::fs::read(Self::file(dir, &k)) {
                    if sha256(&d) == *h {
                        self.hits += 1;
                        self.touch_disk(&k);
                        let d: Arc<[u8]> = d.into();
                        self.insert_mem(k, Arc::clone(&d));
                        return Some(d);
                    }
                }
            }
            // Unreadable or damaged: drop it (the client will send the bytes).
            self.forget_disk(&k);
        }
        self.misses += 1;
        None
    }

    fn insert_mem(&mut self, k: Key, d: Arc<[u8]>) {
        if d.len() > self.max_bytes || self.mem.contains_key(&k) {
            return;
        }
        self.bytes += d.len();
        self.tick += 1;
        self.mem.insert(k, (d, self.tick));
        self.lru.insert(self.tick, k);
        while self.bytes > self.max_bytes {
            let Some((_, old)) = self.lru.pop_first() else {
                break;
            };
            if let Some((d, _)) = self.mem.remove(&old) {
                self.bytes -= d.len();
            }
        }
    }

    /// Stores a chunk of `part` whose hash the caller computed from `d`.
    pub fn insert(&mut self, part: &Part, h: [u8; 32], d: &[u8]) {
        let k = (*part, h);
        if self.mem.contains_key(&k) {
            self.touch(&k);
            self.touch_disk(&k);
            return;
        }
        self.insert_mem(k, d.into());
        let Some(dir) = self.disk.clone() else {
            return;
        };
        if self.on_disk.contains_key(&k) {
            self.touch_disk(&k);
            return;
        }
        if d.len() > self.max_disk {
            return;
        }
        let path = Self::file(&dir, &k);
        let tmp = dir.join(hexs(part)).join(format!(".{}.tmp", hexs(&h)));
        let written = files::create_dir(&dir.join(hexs(part)))
            .and_then(|()| files::write_atomic(&path, &tmp, d, false));
        if written.is_ok() {
            stamp(&path);
            self.tick += 1;
            self.on_disk.insert(
                k,
                OnDisk {
                    len: d.len(),
                    tick: self.tick,
                },
            );
            self.disk_lru.insert(self.tick, k);
            self.disk_bytes += d.len();
            self.evict_disk();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::remote::chunk::hex;

    const P: Part = [7; 16];
    const Q: Part = [9; 16];

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("toffload_cache_{tag}_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn lru_bounds_memory_and_disk_survives() {
        let dir = scratch("mem");
        let chunk = |i: u8| vec![i; 1000];
        {
            let mut c = ChunkCache::new(3000, Some(dir.clone()), 1 << 20).unwrap();
            for i in 0..5 {
                c.insert(&P, sha256(&chunk(i)), &chunk(i));
            }
            assert!(c.mem_bytes() <= 3000);
            // 0 and 1 were evicted from memory, still on disk.
            assert_eq!(
                c.get(&P, &sha256(&chunk(0))).as_deref(),
                Some(&chunk(0)[..])
            );
            assert_eq!(c.len(), 5);
        }
        let mut c = ChunkCache::new(3000, Some(dir.clone()), 1 << 20).unwrap();
        assert_eq!(c.inventory(&P, 10).len(), 5);
        assert_eq!(
            c.get(&P, &sha256(&chunk(3))).as_deref(),
            Some(&chunk(3)[..])
        );
        assert!(c.get(&P, &sha256(&chunk(9))).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The disk tier is LRU, not oldest-written first: a chunk read after it was
    /// written outlives one written later and never read, within one life of the
    /// daemon and across a restart (the order comes back from the files' mtimes).
    #[test]
    fn disk_tier_evicts_the_least_recently_used() {
        let dir = scratch("disk");
        let chunk = |i: u8| vec![i; 1000];
        let h = |i: u8| sha256(&chunk(i));
        {
            // No memory tier (0 bytes): every hit is a disk hit. Room for 3 chunks.
            let mut c = ChunkCache::new(0, Some(dir.clone()), 3000).unwrap();
            for i in 0..3 {
                c.insert(&P, h(i), &chunk(i));
            }
            // Oldest written is 0; reading it makes 1 the least recently used.
            assert_eq!(c.get(&P, &h(0)).as_deref(), Some(&chunk(0)[..]));
            c.insert(&P, h(3), &chunk(3));
            assert!(c.on_disk(&P, &h(0)), "the recently read chunk was evicted");
            assert!(!c.on_disk(&P, &h(1)), "the unread older chunk survived");
            assert!(!dir.join(hexs(&P)).join(hex(&h(1))).exists());
            assert_eq!(c.disk_evictions, 1);
            assert!(c.disk_bytes() <= 3000);
            // Order now (old to new): 2, 0, 3. Read 2.
            assert!(c.get(&P, &h(2)).is_some());
        }
        // A restart: order 0, 3, 2 comes back from the mtimes; a new chunk evicts 0.
        let mut c = ChunkCache::new(0, Some(dir.clone()), 3000).unwrap();
        assert_eq!(c.inventory(&P, 10), vec![h(2), h(3), h(0)]);
        c.insert(&P, h(4), &chunk(4));
        assert!(!c.on_disk(&P, &h(0)));
        assert!(c.on_disk(&P, &h(2)) && c.on_disk(&P, &h(3)) && c.on_disk(&P, &h(4)));
        // A memory hit counts as a use for the disk tier too.
        drop(c);
        // Order 3, 2, 4; each read from disk into memory makes it the youngest.
        let mut c = ChunkCache::new(1 << 20, Some(dir.clone()), 3000).unwrap();
        for i in [3, 2, 4] {
            assert!(c.get(&P, &h(i)).is_some());
        }
        assert!(c.get(&P, &h(3)).is_some()); // from memory: order 2, 4, 3
        c.insert(&P, h(5), &chunk(5));
        assert!(
            c.on_disk(&P, &h(3)),
            "a memory hit did not refresh the disk order"
        );
        assert!(!c.on_disk(&P, &h(2)));
        assert!(c.on_disk(&P, &h(4)) && c.on_disk(&P, &h(5)));
        // A lower bound at start evicts down to it, oldest use first; stale temporary
        // files of a killed write are removed.
        drop(c);
        std::fs::write(
            dir.join(hexs(&P)).join(format!(".{}.tmp", hex(&h(9)))),
            b"partial",
        )
        .unwrap();
        let c = ChunkCache::new(0, Some(dir.clone()), 1000).unwrap();
        assert_eq!(c.inventory(&P, 10), vec![h(5)]);
        assert!(!dir
            .join(hexs(&P))
            .join(format!(".{}.tmp", hex(&h(9))))
            .exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A chunk is held for the partition that sent it only: another partition that
    /// names its hash gets nothing, and its inventory lists none of it, in memory and
    /// from disk after a restart.
    #[test]
    fn partitions_do_not_see_each_other() {
        let dir = scratch("parts");
        let a = vec![1u8; 5000];
        let ha = sha256(&a);
        {
            let mut c = ChunkCache::new(1 << 20, Some(dir.clone()), 1 << 20).unwrap();
            c.insert(&P, ha, &a);
            assert_eq!(c.get(&P, &ha).as_deref(), Some(&a[..]));
            assert!(c.get(&Q, &ha).is_none());
            assert_eq!(c.inventory(&P, 10), vec![ha]);
            assert!(c.inventory(&Q, 10).is_empty());
            // Q sending the same bytes gets its own copy; P's is unaffected.
            c.insert(&Q, ha, &a);
            assert_eq!(c.get(&Q, &ha).as_deref(), Some(&a[..]));
        }
        let mut c = ChunkCache::new(1 << 20, Some(dir.clone()), 1 << 20).unwrap();
        assert!(c.on_disk(&P, &ha) && c.on_disk(&Q, &ha));
        let other: Part = [3; 16];
        assert!(c.get(&other, &ha).is_none());
        assert!(c.inventory(&other, 10).is_empty());
        assert_eq!(c.get(&P, &ha).as_deref(), Some(&a[..]));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
