//! Histogram geometry: the kernel files a value in a bucket, the watcher reads the
//! bucket back as a range. Two geometries: log2 (per-syscall latency) and fine,
//! log-linear with 16 linear sub-buckets per power of two, so that a percentile read
//! from it after interpolation is within about 3% (a log2 bucket is 2x wide).

use crate::watch::FINE_BUCKETS;

/// Index of the highest set bit (v > 0), without loops for the BPF verifier.
#[inline(always)]
pub fn msb(mut v: u64) -> u32 {
    let mut r = 0;
    if v >> 32 != 0 {
        v >>= 32;
        r += 32;
    }
    if v >> 16 != 0 {
        v >>= 16;
        r += 16;
    }
    if v >> 8 != 0 {
        v >>= 8;
        r += 8;
    }
    if v >> 4 != 0 {
        v >>= 4;
        r += 4;
    }
    if v >> 2 != 0 {
        v >>= 2;
        r += 2;
    }
    if v >> 1 != 0 {
        r += 1;
    }
    r
}

/// Log2 bucket of `v`: 0 for 0 and 1, else the index of its highest bit.
#[inline(always)]
pub fn log2_bucket(v: u64) -> u64 {
    if v == 0 {
        0
    } else {
        msb(v) as u64
    }
}

/// Lower bound and width of log2 bucket `idx`.
pub fn log2_bounds(idx: usize) -> (u64, u64) {
    if idx == 0 {
        (0, 1)
    } else {
        let lo = 1u64 << idx.min(63);
        (lo, lo)
    }
}

/// Fine bucket of `v`: values below 16 are exact, above that 16 buckets per octave.
#[inline(always)]
pub fn fine_bucket(v: u64) -> u32 {
    if v < 16 {
        return v as u32;
    }
    let m = msb(v);
    let idx = (m - 3) * 16 + ((v >> (m - 4)) & 15) as u32;
    if idx >= FINE_BUCKETS {
        FINE_BUCKETS - 1
    } else {
        idx
    }
}

/// Lower bound and width of fine bucket `idx` (the inverse of fine_bucket).
pub fn fine_bounds(idx: usize) -> (u64, u64) {
    if idx < 16 {
        return (idx as u64, 1);
    }
    let m = idx / 16 + 3;
    let sub = (idx % 16) as u64;
    let width = 1u64 << (m - 4);
    ((1u64 << m) + sub * width, width)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msb_is_the_highest_set_bit() {
        for s in 0..64 {
            let v = 1u64 << s;
            assert_eq!(msb(v), s);
            assert_eq!(msb(v | (v >> 1) | 1), s, "{v:#x} with lower bits");
        }
        assert_eq!(msb(u64::MAX), 63);
    }

    #[test]
    fn log2_buckets_invert() {
        // Bucket 0 holds 0 and 1 alike.
        assert_eq!((log2_bucket(0), log2_bucket(1)), (0, 0));
        for v in [2u64, 3, 1000, 1 << 40, u64::MAX] {
            let (lo, w) = log2_bounds(log2_bucket(v) as usize);
            assert!(lo <= v && v - lo < w, "{v}: [{lo}, +{w})");
        }
    }

    #[test]
    fn fine_buckets_invert() {
        for v in [
            0u64,
            5,
            15,
            16,
            17,
            31,
            32,
            100,
            1000,
            200_000,
            1_000_000,
            1 << 40,
        ] {
            let (lo, w) = fine_bounds(fine_bucket(v) as usize);
            assert!(lo <= v && v - lo < w, "{v}: [{lo}, +{w})");
            assert!(w <= (v / 16).max(1), "{v}: bucket too wide ({w})");
        }
        // Contiguous: every bucket starts where the previous ended.
        for i in 1..900 {
            let (lo0, w0) = fine_bounds(i - 1);
            let (lo1, _) = fine_bounds(i);
            assert_eq!(lo0 + w0, lo1, "bucket {i}");
        }
        // Every u64 has a bucket of its own.
        assert!(fine_bucket(u64::MAX) < FINE_BUCKETS);
    }
}
