//! Per-CPU array maps whose elements are rows of u64, read a range of rows at a time
//! and summed over CPUs.
//!
//! aya 0.13 reads a map one key per bpf(2) call and has no binding for
//! BPF_MAP_LOOKUP_BATCH (Linux 5.6+), which reads a whole range in one call; the
//! command is issued here by hand, with the per-key read (BPF_MAP_LOOKUP_ELEM) kept
//! as the fallback where the kernel refuses it. Both work on raw rows, whose length
//! aya's typed maps would want as a constant per map.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use aya::maps::Map;

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
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

/// The element commands' member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

pub struct PerCpuRows {
    fd: OwnedFd,
    /// u64 per row (the map's value size / 8).
    row: usize,
    cpus: usize,
    /// Cleared at the first refusal, so a kernel without the command is asked once.
    batch: AtomicBool,
}

impl PerCpuRows {
    /// A reader of `map`, whose values must be rows of `row` u64.
    pub fn new(map: Map, row: usize) -> Result<PerCpuRows, String> {
        let Map::PerCpuArray(data) = &map else {
            return Err("not a per-CPU array".into());
        };
        let size = data.info().map_err(|e| e.to_string())?.value_size() as usize;
        if size != row * 8 {
            return Err(format!("values of {size} bytes, expected {}", row * 8));
        }
        let fd = data
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| e.to_string())?;
        let cpus = aya::util::nr_cpus().map_err(|(path, e)| format!("{path}: {e}"))?;
        Ok(PerCpuRows {
            fd,
            row,
            cpus,
            batch: AtomicBool::new(true),
        })
    }

    /// Rows `start..start + n`, each bucket summed over CPUs, one row after another
    /// (zeros for a row that cannot be read).
    pub fn sums(&self, start: u32, n: usize) -> Vec<u64> {
        if self.batch.load(Ordering::Relaxed) {
            match self.batch_sums(start, n) {
                Some(v) => return v,
                None => self.batch.store(false, Ordering::Relaxed),
            }
        }
        let mut sums = vec![0u64; n * self.row];
        let mut values = vec![0u64; self.row * self.cpus];
        for (i, out) in sums.chunks_mut(self.row).enumerate() {
            // SAFETY: the value buffer holds a row (the map's value size, checked at
            // new()) for each possible CPU.
            let rc =
                unsafe { self.elem(BPF_MAP_LOOKUP_ELEM, start + i as u32, values.as_mut_ptr()) };
            if rc == 0 {
                self.add_cpus(&values, out);
            }
        }
        sums
    }

    /// An element command (lookup or update) on `key` with `values` as the value
    /// buffer; the syscall's return.
    ///
    /// # Safety
    /// `values` must hold a row per possible CPU, writable for a lookup.
    unsafe fn elem(&self, cmd: libc::c_long, key: u32, values: *mut u64) -> libc::c_long {
        let mut attr = ElemAttr {
            map_fd: self.fd.as_raw_fd() as u32,
            key: &key as *const u32 as u64,
            value: values as u64,
            ..ElemAttr::default()
        };
        // SAFETY: attr points at the key and, by the caller's word, a large enough
        // value buffer, both alive for the call.
        unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                &mut attr as *mut ElemAttr,
                std::mem::size_of::<ElemAttr>() as u32,
            )
        }
    }

    /// Adds one key's per-CPU rows (`values`, CPU after CPU) into `out`.
    fn add_cpus(&self, values: &[u64], out: &mut [u64]) {
        for cpu_row in values.chunks(self.row) {
            for (o, v) in out.iter_mut().zip(cpu_row) {
                *o += v;
            }
        }
    }

    fn batch_sums(&self, start: u32, n: usize) -> Option<Vec<u64>> {
        let mut keys = vec![0u32; n];
        let per_key = self.row * self.cpus;
        let mut values = vec![0u64; n * per_key];
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
            map_fd: self.fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        // SAFETY: attr points at buffers sized for `count` keys and values (a per-CPU
        // value is a row per possible CPU) that outlive the call.
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
        let mut sums = vec![0u64; n * self.row];
        for (i, key) in keys.iter().enumerate() {
            let slot = key.checked_sub(start)? as usize;
            let out = sums.get_mut(slot * self.row..(slot + 1) * self.row)?;
            self.add_cpus(&values[i * per_key..(i + 1) * per_key], out);
        }
        Some(sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aya::maps::MapData;
    use std::os::fd::FromRawFd;

    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;

    /// A per-CPU array of `n` rows of `row` u64 made with bpf(2) (needs root or
    /// CAP_BPF).
    fn percpu_array(n: u32, row: usize) -> Option<Map> {
        // map_type, key_size, value_size, max_entries, then zeroed fields.
        let mut attr = [0u32; 16];
        attr[..4].copy_from_slice(&[BPF_MAP_TYPE_PERCPU_ARRAY, 4, row as u32 * 8, n]);
        // SAFETY: a zero-padded attr of the size passed.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, attr.as_mut_ptr(), 64u32) };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh fd the call above returned, owned from here on.
        let owned = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Some(Map::PerCpuArray(MapData::from_fd(owned).ok()?))
    }

    fn set(reader: &PerCpuRows, key: u32, values: &[u64]) {
        // SAFETY: values holds a row per possible CPU, only read by an update.
        let rc = unsafe { reader.elem(BPF_MAP_UPDATE_ELEM, key, values.as_ptr().cast_mut()) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    }

    #[test]
    fn the_batch_read_agrees_with_the_key_by_key_read() {
        const ROW: usize = 3;
        let Some(map) = percpu_array(300, ROW) else {
            assert!(std::env::var_os("CI").is_none(), "bpf(2) refused under CI");
            eprintln!("skipped: cannot create a BPF map here (not root?)");
            return;
        };
        let reader = PerCpuRows::new(map, ROW).unwrap();
        let cpus = reader.cpus as u64;
        // Key k, CPU c, bucket b holds k * 100 + c * 10 + b.
        for key in [0u32, 1, 63, 64, 65, 299] {
            let values = (0..cpus)
                .flat_map(|c| (0..ROW as u64).map(move |b| u64::from(key) * 100 + c * 10 + b))
                .collect::<Vec<_>>();
            set(&reader, key, &values);
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
        let expect = |k: u64, b: u64| (0..cpus).map(|c| k * 100 + c * 10 + b).sum::<u64>();
        let all = reader.sums(0, 300);
        assert_eq!(all.len(), 300 * ROW);
        assert_eq!(
            (all[65 * ROW + 2], all[299 * ROW], all[2 * ROW + 1]),
            (expect(65, 2), expect(299, 0), 0)
        );
    }

    #[test]
    fn a_row_of_the_wrong_size_is_refused() {
        let Some(map) = percpu_array(4, 2) else {
            assert!(std::env::var_os("CI").is_none(), "bpf(2) refused under CI");
            eprintln!("skipped: cannot create a BPF map here (not root?)");
            return;
        };
        let err = PerCpuRows::new(map, 3)
            .err()
            .expect("a 16-byte value read as 24");
        assert!(err.contains("16 bytes"), "{err}");
    }
}
