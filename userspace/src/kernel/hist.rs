//! Percentiles from the kernel's bucket histograms, interpolated linearly inside the
//! bucket the rank falls in.

use crate::abi;

/// A histogram's per-bucket counts (summed over CPUs, one window's difference).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hist {
    pub counts: Vec<u64>,
    /// Fine (log-linear) geometry when true, log2 otherwise.
    pub fine: bool,
}

impl Hist {
    pub fn fine(counts: Vec<u64>) -> Hist {
        Hist { counts, fine: true }
    }

    pub fn log2(counts: Vec<u64>) -> Hist {
        Hist {
            counts,
            fine: false,
        }
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    fn bounds(&self, i: usize) -> (f64, f64) {
        let (lo, w) = if self.fine {
            abi::fine_bounds(i)
        } else {
            abi::log2_bounds(i)
        };
        (lo as f64, w as f64)
    }

    /// The mean, each count taken at its bucket's middle (None when empty).
    pub fn mean(&self) -> Option<f64> {
        let total = self.total();
        if total == 0 {
            return None;
        }
        let sum: f64 = (self.counts.iter().enumerate())
            .filter(|(_, &c)| c > 0)
            .map(|(i, &c)| {
                let (lo, w) = self.bounds(i);
                c as f64 * (lo + w / 2.0)
            })
            .sum();
        Some(sum / total as f64)
    }

    /// The q-quantile (0..=1) in the histogram's unit, None when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.total();
        if total == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            if (seen + c) as f64 >= rank {
                let (lo, w) = self.bounds(i);
                let frac = ((rank - seen as f64) / c as f64).clamp(0.0, 1.0);
                return Some(lo + frac * w);
            }
            seen += c;
        }
        let last = self.counts.iter().rposition(|&c| c > 0)?;
        let (lo, w) = self.bounds(last);
        Some(lo + w)
    }

    /// Counts regrouped into powers of two of the unit: (upper bound, count) from the
    /// first to the last non-empty bucket (a fine bucket goes where its lower bound
    /// falls). For a chart; percentiles come from the full geometry.
    pub fn log2_buckets(&self) -> Vec<(f64, u64)> {
        let mut out: Vec<u64> = vec![0; 64];
        for (i, &c) in self.counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            let lo = self.bounds(i).0.max(1.0);
            let b = (lo.log2().floor() as usize).min(63);
            out[b] += c;
        }
        let (Some(first), Some(last)) = (
            out.iter().position(|&c| c > 0),
            out.iter().rposition(|&c| c > 0),
        ) else {
            return Vec::new();
        };
        (first..=last)
            .map(|b| (2f64.powi(b as i32 + 1), out[b]))
            .collect()
    }

    /// Element-wise `self - earlier` (counters only grow; saturate on a reset).
    pub fn minus(&self, earlier: &Hist) -> Hist {
        let counts = self
            .counts
            .iter()
            .enumerate()
            .map(|(i, &c)| c.saturating_sub(earlier.counts.get(i).copied().unwrap_or(0)))
            .collect();
        Hist {
            counts,
            fine: self.fine,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fine_of(values: &[u64]) -> Hist {
        let mut counts = vec![0; abi::FINE_BUCKETS as usize];
        for &v in values {
            counts[abi::fine_bucket(v) as usize] += 1;
        }
        Hist::fine(counts)
    }

    #[test]
    fn quantiles_of_a_constant_are_within_a_bucket() {
        let h = fine_of(&vec![200_000; 1000]);
        let p50 = h.quantile(0.5).unwrap();
        assert!((p50 - 200_000.0).abs() / 200_000.0 < 0.07, "{p50}");
    }

    #[test]
    fn quantiles_of_a_spread() {
        let v: Vec<u64> = (1..=10_000).map(|i| i * 100).collect();
        let h = fine_of(&v);
        let p50 = h.quantile(0.5).unwrap();
        let p99 = h.quantile(0.99).unwrap();
        assert!((p50 - 500_000.0).abs() / 500_000.0 < 0.04, "{p50}");
        assert!((p99 - 990_000.0).abs() / 990_000.0 < 0.04, "{p99}");
        assert_eq!(Hist::fine(vec![0; 8]).quantile(0.5), None);
    }

    #[test]
    fn mean_of_a_spread() {
        let v: Vec<u64> = (1..=10_000).map(|i| i * 100).collect();
        let m = fine_of(&v).mean().unwrap();
        assert!((m - 500_050.0).abs() / 500_050.0 < 0.03, "{m}");
        assert_eq!(Hist::fine(vec![0; 8]).mean(), None);
    }

    #[test]
    fn log2_regrouping_keeps_every_count() {
        let h = fine_of(&[3, 5, 100, 150, 1000]);
        let b = h.log2_buckets();
        assert_eq!(b.iter().map(|x| x.1).sum::<u64>(), 5);
        assert_eq!(b.first().unwrap().0, 4.0);
        assert_eq!(b.last().unwrap().0, 1024.0);
        assert!(Hist::default().log2_buckets().is_empty());
    }

    #[test]
    fn minus_saturates() {
        let a = Hist::log2(vec![5, 3]);
        let b = Hist::log2(vec![2, 4]);
        assert_eq!(a.minus(&b).counts, vec![3, 0]);
    }
}
