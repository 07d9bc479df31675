//! The open-loop sweep's arithmetic (toffload-openloop): which point is a knee, where
//! to measure next, and the medians of repeated runs. Kept apart from the binary so
//! that the rules are unit-tested without a server.

/// One offered load, measured (medians over runs; counts summed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    pub offered: f64,
    pub achieved: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    /// p99 of the load generator's own delay in sending (Report::late_p99_us).
    pub gen_late_p99_us: f64,
    pub errors: u64,
    pub wrong: u64,
}

/// How a point compares with the configuration's low-load behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Latency and throughput still follow the offered load.
    Holds,
    /// p99 above P99_FACTOR x its low-load value, or achieved below ACHIEVED_SHARE of
    /// offered.
    Knee,
}

pub const P99_FACTOR: f64 = 10.0;
pub const ACHIEVED_SHARE: f64 = 0.95;

pub fn verdict(p: &Point, low_load_p99_us: f64) -> Verdict {
    if p.p99_us > P99_FACTOR * low_load_p99_us || p.achieved < ACHIEVED_SHARE * p.offered {
        Verdict::Knee
    } else {
        Verdict::Holds
    }
}

/// The point at the lowest offered load: the reference for the others.
pub fn lowest(points: &[Point]) -> Option<&Point> {
    points.iter().min_by(|a, b| a.offered.total_cmp(&b.offered))
}

/// The knee: the lowest offered load from which on every point is a Knee against the
/// lowest point's p99 (a lone disturbed point below a load that holds again is not
/// the knee: on a shared machine other work makes such points); None where the
/// highest point holds.
pub fn knee(points: &[Point]) -> Option<f64> {
    let low = lowest(points)?.p99_us;
    let mut sorted: Vec<&Point> = points.iter().collect();
    sorted.sort_by(|a, b| a.offered.total_cmp(&b.offered));
    let mut knee = None;
    for p in sorted.iter().rev() {
        match verdict(p, low) {
            Verdict::Knee => knee = Some(p.offered),
            Verdict::Holds => break,
        }
    }
    knee
}

/// The highest offered load below `below` that holds; None if none does.
pub fn last_holding(points: &[Point], below: f64) -> Option<f64> {
    let low = lowest(points)?.p99_us;
    points
        .iter()
        .filter(|p| p.offered < below && verdict(p, low) == Verdict::Holds)
        .map(|p| p.offered)
        .max_by(f64::total_cmp)
}

/// `n` rates spaced geometrically strictly between `from` and `to`.
pub fn between(from: f64, to: f64, n: usize) -> Vec<f64> {
    let ratio = (to / from).powf(1.0 / (n + 1) as f64);
    (1..=n).map(|i| from * ratio.powi(i as i32)).collect()
}

/// The next load that halves the knee's bracket (the geometric mean of the knee and
/// the last load below it that holds), while the knee is more than `resolution` times
/// that load; None once it is within it, or where there is no knee or nothing holds
/// below it.
pub fn bisect(points: &[Point], resolution: f64) -> Option<f64> {
    let k = knee(points)?;
    let good = last_holding(points, k)?;
    (k / good > resolution).then(|| (k * good).sqrt())
}

/// The measured point nearest `rate` within `tolerance` (relative), if any.
pub fn near(points: &[Point], rate: f64, tolerance: f64) -> Option<&Point> {
    points
        .iter()
        .filter(|p| (p.offered / rate - 1.0).abs() <= tolerance)
        .min_by(|a, b| {
            (a.offered - rate)
                .abs()
                .total_cmp(&(b.offered - rate).abs())
        })
}

/// Medians of the runs' rates and percentiles; errors and wrong answers summed.
pub fn combine(runs: &[Point]) -> Point {
    let m = |f: fn(&Point) -> f64| crate::harness::median(runs.iter().map(f).collect());
    Point {
        offered: m(|p| p.offered),
        achieved: m(|p| p.achieved),
        p50_us: m(|p| p.p50_us),
        p99_us: m(|p| p.p99_us),
        p999_us: m(|p| p.p999_us),
        gen_late_p99_us: m(|p| p.gen_late_p99_us),
        errors: runs.iter().map(|p| p.errors).sum(),
        wrong: runs.iter().map(|p| p.wrong).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(offered: f64, achieved: f64, p99: f64) -> Point {
        Point {
            offered,
            achieved,
            p50_us: p99 / 2.0,
            p99_us: p99,
            p999_us: p99 * 2.0,
            gen_late_p99_us: 10.0,
            errors: 0,
            wrong: 0,
        }
    }

    #[test]
    fn the_knee_is_the_lowest_load_past_either_limit() {
        let pts = [
            pt(4000.0, 3990.0, 120.0),
            pt(1000.0, 1000.0, 100.0),
            pt(2000.0, 2000.0, 900.0),
            pt(8000.0, 7000.0, 200.0),
        ];
        // 8000: achieved 7000 < 95% of offered; 2000 holds (900 <= 10 x 100).
        assert_eq!(knee(&pts), Some(8000.0));
        let pts = [pt(1000.0, 1000.0, 100.0), pt(2000.0, 2000.0, 1001.0)];
        assert_eq!(knee(&pts), Some(2000.0));
        assert_eq!(knee(&pts[..1]), None);
        assert_eq!(knee(&[]), None);
    }

    #[test]
    fn bisection_halves_the_bracket_until_it_is_fine() {
        // Knee at 152k, holding at 128k: the bracket is 1.19 wide.
        let mut pts = vec![
            pt(1000.0, 1000.0, 100.0),
            pt(128_000.0, 127_800.0, 300.0),
            pt(152_000.0, 140_000.0, 9000.0),
        ];
        let mid = bisect(&pts, 1.05).expect("coarser than 1.05");
        assert!(
            (mid - (128_000.0f64 * 152_000.0).sqrt()).abs() < 1.0,
            "{mid}"
        );
        // The midpoint holds: the bracket is now [mid, 152k], 1.09 wide.
        pts.push(pt(mid, mid, 400.0));
        let next = bisect(&pts, 1.05).expect("still coarser than 1.05");
        assert!(next > mid && next < 152_000.0, "{next}");
        // That one knees: [mid, next] is 1.045 wide, within 1.05.
        pts.push(pt(next, next * 0.9, 400.0));
        assert_eq!(knee(&pts), Some(next));
        assert_eq!(bisect(&pts, 1.05), None);
        // No knee, or nothing holding below it: nothing to halve.
        assert_eq!(bisect(&pts[..2], 1.05), None);
        assert_eq!(bisect(&[pt(1000.0, 10.0, 100.0)], 1.05), None);
    }

    #[test]
    fn a_lone_disturbed_point_below_a_holding_one_is_not_the_knee() {
        let pts = [
            pt(1000.0, 1000.0, 100.0),
            pt(2000.0, 2000.0, 5000.0),
            pt(4000.0, 4000.0, 200.0),
            pt(8000.0, 8000.0, 2000.0),
            pt(16000.0, 9000.0, 90000.0),
        ];
        assert_eq!(knee(&pts), Some(8000.0));
        // The highest point holding: no knee yet.
        assert_eq!(knee(&pts[..3]), None);
    }

    #[test]
    fn last_holding_stops_below_the_knee() {
        let pts = [
            pt(1000.0, 1000.0, 100.0),
            pt(2000.0, 2000.0, 100.0),
            pt(4000.0, 3000.0, 100.0),
        ];
        assert_eq!(last_holding(&pts, 4000.0), Some(2000.0));
        assert_eq!(last_holding(&pts, 1000.0), None);
    }

    #[test]
    fn between_is_geometric_and_excludes_the_ends() {
        let r = between(1000.0, 2000.0, 3);
        assert_eq!(r.len(), 3);
        let q = 2f64.powf(0.25);
        for (i, x) in r.iter().enumerate() {
            assert!(
                (x / (1000.0 * q.powi(i as i32 + 1)) - 1.0).abs() < 1e-9,
                "{r:?}"
            );
        }
    }

    #[test]
    fn near_finds_only_within_tolerance() {
        let pts = [pt(1000.0, 1000.0, 1.0), pt(1900.0, 1900.0, 1.0)];
        assert_eq!(near(&pts, 1950.0, 0.03).map(|p| p.offered), Some(1900.0));
        assert!(near(&pts, 1500.0, 0.03).is_none());
    }

    #[test]
    fn combine_takes_medians_and_sums_counts() {
        let mut a = pt(1000.0, 990.0, 100.0);
        a.wrong = 1;
        let b = pt(1000.0, 1000.0, 300.0);
        let mut c = pt(1000.0, 995.0, 200.0);
        c.errors = 2;
        let m = combine(&[a, b, c]);
        assert_eq!(
            (m.achieved, m.p99_us, m.wrong, m.errors),
            (995.0, 200.0, 1, 2)
        );
    }
}
