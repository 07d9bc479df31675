//! splitmix64: enough randomness for payloads and arrival times, and reproducible
//! from --seed.

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Exponential inter-arrival time for a Poisson process of `rate` per second, ns.
    pub fn exp_ns(&mut self, rate: f64) -> u64 {
        (-self.unit().ln() / rate * 1e9) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_mean_interarrival_matches_rate() {
        let mut r = Rng::new(7);
        let n = 200_000;
        let rate = 5000.0;
        let mean = (0..n).map(|_| r.exp_ns(rate) as f64).sum::<f64>() / n as f64;
        let want = 1e9 / rate;
        assert!((mean - want).abs() / want < 0.02, "mean {mean} want {want}");
    }
}
