//! The daemon's chunk cache: chunks by SHA-256, in memory (LRU, bounded in bytes)
//! and, with --cache-dir, on disk (one file per chunk, bounded in bytes, oldest
//! written evicted first), so a restarted daemon still holds what it had.

use super::chunk::{hex, sha256};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;

pub struct ChunkCache {
    mem: HashMap<[u8; 32], (Arc<[u8]>, u64)>,
    lru: BTreeMap<u64, [u8; 32]>,
    tick: u64,
    bytes: usize,
    max_bytes: usize,
    disk: Option<PathBuf>,
    on_disk: HashMap<[u8; 32], usize>,
    disk_order: VecDeque<[u8; 32]>,
    disk_bytes: usize,
    max_disk: usize,
    pub hits: u64,
    pub misses: u64,
}

fn unhex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut h = [0u8; 32];
    for (i, b) in h.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(h)
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
            disk_order: VecDeque::new(),
            disk_bytes: 0,
            max_disk,
            hits: 0,
            misses: 0,
        };
        if let Some(dir) = &c.disk {
            std::fs::create_dir_all(dir)?;
            let mut found: Vec<(std::time::SystemTime, [u8; 32], usize)> = Vec::new();
            for e in std::fs::read_dir(dir)? {
                let e = e?;
                let name = e.file_name();
                let Some(h) = name.to_str().and_then(unhex) else {
                    continue;
                };
                let md = e.metadata()?;
                found.push((md.modified()?, h, md.len() as usize));
            }
            found.sort();
            for (_, h, n) in found {
                c.on_disk.insert(h, n);
                c.disk_order.push_back(h);
                c.disk_bytes += n;
            }
        }
        Ok(c)
    }

    pub fn len(&self) -> usize {
        self.mem.len()
            + self
                .on_disk
                .keys()
                .filter(|h| !self.mem.contains_key(*h))
                .count()
    }

    pub fn is_empty(&self) -> bool {
        self.mem.is_empty() && self.on_disk.is_empty()
    }

    pub fn mem_bytes(&self) -> usize {
        self.bytes
    }

    /// Every hash held, most recently used first, at most `max`.
    pub fn inventory(&self, max: usize) -> Vec<[u8; 32]> {
        let mut v: Vec<[u8; 32]> = self.lru.values().rev().copied().take(max).collect();
        if v.len() < max {
            for h in self.disk_order.iter().rev() {
                if v.len() >= max {
                    break;
                }
                if !self.mem.contains_key(h) {
                    v.push(*h);
                }
            }
        }
        v
    }

    fn touch(&mut self, h: &[u8; 32]) {
        self.tick += 1;
        if let Some(e) = self.mem.get_mut(h) {
            self.lru.remove(&e.1);
            e.1 = self.tick;
            self.lru.insert(self.tick, *h);
        }
    }

    pub fn get(&mut self, h: &[u8; 32]) -> Option<Arc<[u8]>> {
        if let Some((d, _)) = self.mem.get(h) {
            let d = Arc::clone(d);
            self.touch(h);
            self.hits += 1;
            return Some(d);
        }
        if self.on_disk.contains_key(h) {
            if let Some(dir) = &self.disk {
                if let Ok(d) = std::fs::read(dir.join(hex(h))) {
                    if sha256(&d) == *h {
                        self.hits += 1;
                        let d: Arc<[u8]> = d.into();
                        self.insert_mem(*h, Arc::clone(&d));
                        return Some(d);
                    }
                }
            }
            self.on_disk.remove(h);
        }
        self.misses += 1;
        None
    }

    fn insert_mem(&mut self, h: [u8; 32], d: Arc<[u8]>) {
        if d.len() > self.max_bytes || self.mem.contains_key(&h) {
            return;
        }
        self.bytes += d.len();
        self.tick += 1;
        self.mem.insert(h, (d, self.tick));
        self.lru.insert(self.tick, h);
        while self.bytes > self.max_bytes {
            let Some((_, old)) = self.lru.pop_first() else {
                break;
            };
            if let Some((d, _)) = self.mem.remove(&old) {
                self.bytes -= d.len();
            }
        }
    }

    /// Stores a chunk whose hash the caller computed from `d`.
    pub fn insert(&mut self, h: [u8; 32], d: &[u8]) {
        if self.mem.contains_key(&h) {
            self.touch(&h);
            return;
        }
        self.insert_mem(h, d.into());
        if let Some(dir) = &self.disk {
            if d.len() <= self.max_disk && !self.on_disk.contains_key(&h) {
                let tmp = dir.join(format!(".{}.tmp", hex(&h)));
                if std::fs::write(&tmp, d).is_ok()
                    && std::fs::rename(&tmp, dir.join(hex(&h))).is_ok()
                {
                    self.on_disk.insert(h, d.len());
                    self.disk_order.push_back(h);
                    self.disk_bytes += d.len();
                }
                while self.disk_bytes > self.max_disk {
                    let Some(old) = self.disk_order.pop_front() else {
                        break;
                    };
                    if let Some(n) = self.on_disk.remove(&old) {
                        self.disk_bytes -= n;
                        let _ = std::fs::remove_file(dir.join(hex(&old)));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_bounds_memory_and_disk_survives() {
        let dir = std::env::temp_dir().join(format!("toffload_cache_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let chunk = |i: u8| vec![i; 1000];
        {
            let mut c = ChunkCache::new(3000, Some(dir.clone()), 1 << 20).unwrap();
            for i in 0..5 {
                c.insert(sha256(&chunk(i)), &chunk(i));
            }
            assert!(c.mem_bytes() <= 3000);
            // 0 and 1 were evicted from memory, still on disk.
            assert_eq!(c.get(&sha256(&chunk(0))).as_deref(), Some(&chunk(0)[..]));
            assert_eq!(c.len(), 5);
        }
        let mut c = ChunkCache::new(3000, Some(dir.clone()), 1 << 20).unwrap();
        assert_eq!(c.inventory(10).len(), 5);
        assert_eq!(c.get(&sha256(&chunk(3))).as_deref(), Some(&chunk(3)[..]));
        assert!(c.get(&sha256(&chunk(9))).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
