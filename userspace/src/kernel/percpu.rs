//! Per-CPU array maps of u64 read a range at a time, summed over CPUs.
//!
//! aya 0.13 reads a map one key per bpf(2) call; the watcher's fine histograms are
//! 1024 buckets each, so a window cost thousands of calls. BPF_MAP_LOOKUP_BATCH
//! (Linux 5.6+) reads a whole range in one call; aya has no binding for it, so the
//! command is issued here by hand, with the per-key read kept as the fallback where
//! the kernel refuses it.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use aya::maps::{Map, MapData, PerCpuArray};

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// The `batch` member of `union bpf_attr` (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

pub struct PerCpuU64 {
    map: PerCpuArray<MapData, u64>,
    /// A duplicate of the map's fd for the batch command (aya keeps its own private).
    fd: Option<OwnedFd>,
    cpus: usize,
    /// Cleared at the first refusal, so a kernel without the command is asked once.
    batch: AtomicBool,
}

impl PerCpuU64 {
    pub fn new(map: Map) -> Result<PerCpuU64, String> {
        let fd = match &map {
            Map::PerCpuArray(data) => data.fd().as_fd().try_clone_to_owned().ok(),
            _ => None,
        };
        let map = PerCpuArray::try_from(map).map_err(|e| e.to_string())?;
        let cpus = aya::util::nr_cpus().map_err(|(path, e)| format!("{path}: {e}"))?;
        Ok(PerCpuU64 {
            batch: AtomicBool::new(fd.is_some()),
            map,
            fd,
            cpus,
        })
    }

    /// Keys `start..start + n`, each summed over CPUs (0 for a key that fails).
    pub fn sums(&self, start: u32, n: usize) -> Vec<u64> {
        if self.batch.load(Ordering::Relaxed) {
            match self.batch_sums(start, n) {
                Some(v) => return v,
                None => self.batch.store(false, Ordering::Relaxed),
            }
        }
        (start..start + n as u32)
            .map(|i| self.map.get(&i, 0).map(|v| v.iter().sum()).unwrap_or(0))
            .collect()
    }

    fn batch_sums(&self, start: u32, n: usize) -> Option<Vec<u64>> {
        let fd = self.fd.as_ref()?;
        let mut keys = vec![0u32; n];
        let mut values = vec![0u64; n * self.cpus];
        // The kernel resumes after the key in in_batch; none means from key 0.
        let prev = start.wrapping_sub(1);
        let mut out = 0u32;
        let mut attr = BatchAttr {
            in_batch: if start == 0 {
                0
            } else {
                &prev as *const u32 as u64
            },
            out_batch: &mut out as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: n as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        // SAFETY: attr points at buffers sized for `count` keys and values (a per-CPU
        // value is 8 bytes per possible CPU) that outlive the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &mut attr as *mut BatchAttr,
                std::mem::size_of::<BatchAttr>() as u32,
            )
        };
        // ENOENT: the map's end was reached, with `count` still filled in.
        let ok = rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT);
        if !ok || attr.count as usize != n {
            return None;
        }
        let mut sums = vec![0u64; n];
        for (i, key) in keys.iter().enumerate() {
            let slot = key.checked_sub(start)? as usize;
            let per_cpu = &values[i * self.cpus..(i + 1) * self.cpus];
            *sums.get_mut(slot)? = per_cpu.iter().sum();
        }
        Some(sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;

    /// A per-CPU array of `n` u64 made with bpf(2) (needs root or CAP_BPF).
    fn percpu_array(n: u32) -> Option<Map> {
        // map_type, key_size, value_size, max_entries, then zeroed fields.
        let mut attr = [0u32; 16];
        attr[..4].copy_from_slice(&[BPF_MAP_TYPE_PERCPU_ARRAY, 4, 8, n]);
        // SAFETY: a zero-padded attr of the size passed.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, attr.as_mut_ptr(), 64u32) };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh fd the call above returned, owned from here on.
        let owned = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Some(Map::PerCpuArray(MapData::from_fd(owned).ok()?))
    }

    #[test]
    fn the_batch_read_agrees_with_the_key_by_key_read() {
        let Some(map) = percpu_array(300) else {
            assert!(std::env::var_os("CI").is_none(), "bpf(2) refused under CI");
            eprintln!("skipped: cannot create a BPF map here (not root?)");
            return;
        };
        let reader = PerCpuU64::new(map).unwrap();
        let cpus = reader.cpus;
        let mut writer = PerCpuArray::<MapData, u64>::try_from(Map::PerCpuArray(
            MapData::from_fd(reader.fd.as_ref().unwrap().try_clone().unwrap()).unwrap(),
        ))
        .unwrap();
        for key in [0u32, 1, 63, 64, 65, 299] {
            let values = (0..cpus as u64)
                .map(|c| u64::from(key) * 10 + c)
                .collect::<Vec<_>>();
            writer.set(key, values.try_into().unwrap(), 0).unwrap();
        }
        for (start, n) in [(0u32, 300usize), (64, 64), (1, 1), (250, 50)] {
            let batch = reader
                .batch_sums(start, n)
                .expect("BPF_MAP_LOOKUP_BATCH (Linux 5.6+)");
            reader.batch.store(false, Ordering::Relaxed);
            let by_key = reader.sums(start, n);
            reader.batch.store(true, Ordering::Relaxed);
            assert_eq!(batch, by_key, "keys {start}..+{n}");
        }
        let expect = |k: u64| (0..cpus as u64).map(|c| k * 10 + c).sum::<u64>();
        let all = reader.sums(0, 300);
        assert_eq!((all[65], all[299], all[2]), (expect(65), expect(299), 0));
    }
}
