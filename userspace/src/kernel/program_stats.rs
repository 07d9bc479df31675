//! The kernel's own count of what the watch's programs cost: with BPF_ENABLE_STATS
//! held, the kernel times every run of every program (`run_time_ns`, `run_cnt`). The
//! calibration (probe_cost.rs) measures a traced event's cost as the difference of two
//! timed loops, which the host's noise can take to nothing: a switch adds a few
//! hundred ns to a hand-off of a few us, and on a noisy VM some starts read 0 for it
//! while the kernel counted the programs alone at hundreds of ns a switch
//! (tests/kernel_count.rs). The programs' run time is only part of what an event costs
//! (not the tracepoint's slow path, nor a uprobe's trap), so it is a floor under the
//! calibration, not a replacement.
//!
//! Held only around one short loop of the calibration: while stats are on, each run
//! of every program on the host pays two clock reads, which the watch's own budget
//! does not count.

use aya::Ebpf;
use std::os::fd::OwnedFd;

/// Run time (ns) and runs of each named program.
#[derive(Clone, Debug, Default)]
pub struct Counts(Vec<(u64, u64)>);

/// Turns the kernel's counting on until the guard drops (None where the kernel
/// refuses: no CAP_SYS_ADMIN, or older than 5.8).
pub fn enable() -> Option<OwnedFd> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime).ok()
}

/// The counts of `names` in `bpf` now (a program missing or unreadable counts 0).
pub fn read(bpf: &Ebpf, names: &[&str]) -> Counts {
    Counts(
        names
            .iter()
            .map(|n| {
                bpf.program(n)
                    .and_then(|p| p.info().ok())
                    .map_or((0, 0), |i| (i.run_time().as_nanos() as u64, i.run_count()))
            })
            .collect(),
    )
}

/// Between two readings of the same names: the sum over the programs of each one's
/// run time per run, ns (a program that did not run adds nothing). The programs run
/// for every process on the host while attached, most of them stopping at the filter,
/// so the mean per run is at most what a watched event's run costs.
pub fn ns_per_event(before: &Counts, after: &Counts) -> f64 {
    before
        .0
        .iter()
        .zip(&after.0)
        .map(|(&(t0, n0), &(t1, n1))| {
            let runs = n1.saturating_sub(n0);
            if runs == 0 {
                0.0
            } else {
                t1.saturating_sub(t0) as f64 / runs as f64
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_event_is_the_sum_of_each_programs_mean_run() {
        let a = Counts(vec![(1_000, 10), (500, 5), (7, 7)]);
        let b = Counts(vec![(2_000, 20), (1_500, 10), (7, 7)]);
        // 1000 ns over 10 runs + 1000 over 5; the third did not run.
        assert_eq!(ns_per_event(&a, &b), 100.0 + 200.0);
        // Counters that went back (a program reloaded) count nothing, not a wrap.
        assert_eq!(ns_per_event(&b, &a), 0.0);
    }
}
