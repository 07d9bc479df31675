//! Latency histogram: log-linear buckets (64 sub-buckets per power of two, so <= 1.6%
//! relative error), fixed memory, no allocation per sample.

const SUB: usize = 64;

pub struct Latencies {
    counts: Vec<u64>,
    n: u64,
    max_ns: u64,
}

fn bucket(ns: u64) -> usize {
    if ns < SUB as u64 {
        return ns as usize;
    }
    let exp = 63 - ns.leading_zeros() as usize; // >= 6
    let sub = ((ns >> (exp - 6)) as usize) & (SUB - 1);
    (exp - 5) * SUB + sub
}

fn bucket_low(b: usize) -> u64 {
    if b < SUB {
        return b as u64;
    }
    let exp = b / SUB + 5;
    let sub = (b % SUB) as u64;
    (SUB as u64 + sub) << (exp - 6)
}

impl Default for Latencies {
    fn default() -> Self {
        Self::new()
    }
}

impl Latencies {
    pub fn new() -> Self {
        Latencies {
            counts: vec![0; 60 * SUB],
            n: 0,
            max_ns: 0,
        }
    }

    pub fn record(&mut self, ns: u64) {
        let b = bucket(ns).min(self.counts.len() - 1);
        self.counts[b] += 1;
        self.n += 1;
        self.max_ns = self.max_ns.max(ns);
    }

    pub fn count(&self) -> u64 {
        self.n
    }

    pub fn quantile_us(&self, q: f64) -> f64 {
        if self.n == 0 {
            return 0.0;
        }
        let rank = ((self.n as f64 * q).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                // Midpoint of the bucket.
                let lo = bucket_low(b);
                let hi = bucket_low(b + 1);
                return ((lo + hi) as f64 / 2.0).min(self.max_ns as f64) / 1000.0;
            }
        }
        self.max_us()
    }

    pub fn max_us(&self) -> f64 {
        self.max_ns as f64 / 1000.0
    }

    /// Adds another histogram's samples to this one (threads of one run).
    pub fn merge(&mut self, other: &Latencies) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.n += other.n;
        self.max_ns = self.max_ns.max(other.max_ns);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_within_two_percent() {
        let mut l = Latencies::new();
        for us in 1..=10_000u64 {
            l.record(us * 1000);
        }
        for (q, want) in [(0.5, 5000.0), (0.99, 9900.0), (0.999, 9990.0)] {
            let got = l.quantile_us(q);
            assert!((got - want).abs() / want < 0.02, "q{q}: {got} vs {want}");
        }
        assert_eq!(l.max_us(), 10_000.0);
        assert_eq!(l.count(), 10_000);
    }

    #[test]
    fn merged_histograms_give_the_quantiles_of_all_samples() {
        let (mut a, mut b) = (Latencies::new(), Latencies::new());
        for us in 1..=5_000u64 {
            a.record(us * 1000);
            b.record((us + 5_000) * 1000);
        }
        a.merge(&b);
        assert_eq!(a.count(), 10_000);
        assert!((a.quantile_us(0.5) - 5000.0).abs() / 5000.0 < 0.02);
        assert_eq!(a.max_us(), 10_000.0);
    }

    #[test]
    fn buckets_are_monotonic() {
        let mut last = 0;
        for ns in (0..5_000_000u64).step_by(997) {
            let b = bucket(ns);
            assert!(b >= last);
            assert!(bucket_low(b) <= ns && ns < bucket_low(b + 1), "{ns}");
            last = b;
        }
    }
}
