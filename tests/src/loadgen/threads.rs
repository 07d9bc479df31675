//! Several generator threads as one run: where one epoll thread cannot offer what a
//! server can take, each of N threads drives its share of the connections and of the
//! open-loop rate, and their reports add up (latency histograms merged, not averaged).

use super::{run_with_latencies, Config, Hists, LoadError, Report};

/// Thread `i` of `n`'s share of the run: conns split as evenly as they go, rate / n,
/// its own seed.
fn share(cfg: &Config, i: usize, n: usize) -> Config {
    let mut c = cfg.clone();
    c.conns = cfg.conns / n + usize::from(i < cfg.conns % n);
    c.rate = cfg.rate.map(|r| r / n as f64);
    c.seed = cfg
        .seed
        .wrapping_add(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64));
    c
}

/// `run` over `threads` threads (1: `run` itself); needs at least as many
/// connections as threads.
pub fn run_threads(cfg: &Config, threads: usize) -> Result<Report, LoadError> {
    if threads <= 1 {
        return super::run(cfg);
    }
    if cfg.conns < threads {
        return Err(LoadError::Config(format!(
            "{threads} threads need at least as many connections ({})",
            cfg.conns
        )));
    }
    let parts: Vec<Result<(Report, Hists), LoadError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let c = share(cfg, i, threads);
                s.spawn(move || run_with_latencies(&c))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("generator thread"))
            .collect()
    });
    let mut parts = parts.into_iter().collect::<Result<Vec<_>, _>>()?;
    let (mut total, mut h) = parts.remove(0);
    for (r, l) in parts {
        h.lat.merge(&l.lat);
        h.late.merge(&l.late);
        total.requests_per_sec += r.requests_per_sec;
        total.completed += r.completed;
        total.wrong += r.wrong;
        total.errors += r.errors;
        for (k, v) in r.errors_by_kind {
            *total.errors_by_kind.entry(k).or_default() += v;
        }
        total.duration_s = total.duration_s.max(r.duration_s);
        total.conns += r.conns;
        // Threads start within microseconds of each other: steps add up as they are.
        if total.timeline.len() < r.timeline.len() {
            total.timeline.resize(r.timeline.len(), 0);
        }
        for (a, b) in total.timeline.iter_mut().zip(&r.timeline) {
            *a += b;
        }
        // The busiest thread says how close the generator came to saturating; the
        // capacity of several threads is the sum of theirs.
        total.busy_share = total.busy_share.max(r.busy_share);
        total.answers_per_busy_s += r.answers_per_busy_s;
    }
    total.offered_rate = cfg.rate;
    total.p50_us = h.lat.quantile_us(0.5);
    total.p99_us = h.lat.quantile_us(0.99);
    total.p999_us = h.lat.quantile_us(0.999);
    total.max_us = h.lat.max_us();
    total.late_p99_us = h.late.quantile_us(0.99);
    total.late_max_us = h.late.max_us();
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_add_up_to_the_whole() {
        let mut cfg = Config::new(1);
        cfg.conns = 10;
        cfg.rate = Some(3000.0);
        let parts: Vec<Config> = (0..3).map(|i| share(&cfg, i, 3)).collect();
        assert_eq!(parts.iter().map(|c| c.conns).sum::<usize>(), 10);
        let rate: f64 = parts.iter().filter_map(|c| c.rate).sum();
        assert!((rate - 3000.0).abs() < 1e-9);
        assert_ne!(parts[0].seed, parts[1].seed);
    }
}
