//! The conflict rule, kept apart from the mechanisms so it can be tested on its own.
//!
//! A global version clock ticks on every recorded write. A fiber that parks at its
//! offload remembers the clock (start of its window); when it resumes, the clock again
//! (end). A write by that fiber, after it resumed and before it parks again, to a page
//! that another fiber (or thread) wrote inside the window is a conflict: the fiber is
//! writing back something it read before the other write happened (the unlocked
//! read-modify-write across the offload that overlap breaks). Only other fibers count:
//! a real thread racing a fiber races it with or without the runtime, and the one it
//! meets most (a thread blocking on a mutex a parked fiber holds) writes the lock word,
//! not the data.

use std::collections::HashMap;

/// Writes remembered per page: enough to see a write inside any recent window.
const HISTORY: usize = 8;

#[derive(Default)]
struct PageLog {
    /// (version, writer) of the most recent writes, oldest first.
    writes: Vec<(u64, u64)>,
}

#[derive(Default)]
pub struct Ledger {
    clock: u64,
    pages: HashMap<usize, PageLog>,
}

/// A fiber's park window at its offload: (clock at park, clock at resume).
pub type Window = (u64, u64);

impl Ledger {
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Records a write of `page` by `writer` (a fiber id; 0 for a real thread) whose
    /// open window, if any, is `window`. Returns true if the write is a conflict.
    pub fn write(&mut self, page: usize, writer: u64, window: Option<Window>) -> bool {
        let log = self.pages.entry(page).or_default();
        let conflict = window.is_some_and(|(s, r)| {
            log.writes
                .iter()
                .any(|&(v, w)| v > s && v <= r && w != writer && w != 0)
        });
        self.clock += 1;
        if log.writes.len() == HISTORY {
            log.writes.remove(0);
        }
        log.writes.push((self.clock, writer));
        conflict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: usize = 0x7000;

    #[test]
    fn write_by_another_fiber_inside_the_window_is_a_conflict() {
        let mut l = Ledger::default();
        let s = l.clock(); // fiber 1 parks at its offload
        assert!(!l.write(P, 2, None)); // fiber 2 writes meanwhile
        let r = l.clock(); // fiber 1 resumes
        assert!(l.write(P, 1, Some((s, r))));
    }

    #[test]
    fn own_writes_other_pages_and_writes_outside_the_window_are_not() {
        let mut l = Ledger::default();
        assert!(!l.write(P, 2, None)); // before the window
        let s = l.clock();
        assert!(!l.write(P + 4096, 2, None)); // another page
        assert!(!l.write(P, 1, None)); // the fiber itself (e.g. before parking)
        let r = l.clock();
        assert!(!l.write(P, 1, Some((s, r))));
        let s2 = l.clock();
        let r2 = l.clock();
        assert!(!l.write(P, 3, None)); // after the window closed
        assert!(!l.write(P, 1, Some((s2, r2))));
    }

    #[test]
    fn real_threads_do_not_make_conflicts() {
        let mut l = Ledger::default();
        let s = l.clock();
        assert!(!l.write(P, 0, None)); // a real thread writes during the park
        let r = l.clock();
        assert!(!l.write(P, 1, Some((s, r))));
    }

    #[test]
    fn history_is_bounded_but_keeps_recent_writes() {
        let mut l = Ledger::default();
        let s = l.clock();
        l.write(P, 2, None);
        for _ in 0..(HISTORY - 1) {
            l.write(P, 1, None);
        }
        let r = l.clock();
        assert!(l.write(P, 1, Some((s, r))));
    }
}
