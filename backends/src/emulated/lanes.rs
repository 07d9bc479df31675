//! The device's service model: `lanes` operations in service at once, FIFO beyond
//! that. Completion times are computed at submit, so queueing needs no thread.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

pub struct Lanes {
    /// When each lane next becomes free (ns, monotonic).
    free_at: BinaryHeap<Reverse<u64>>,
}

impl Lanes {
    pub fn new(lanes: usize) -> Self {
        Lanes {
            free_at: (0..lanes).map(|_| Reverse(0)).collect(),
        }
    }

    /// Books the earliest free lane for an operation arriving at `now` that needs
    /// `service` ns; returns its completion time.
    pub fn book(&mut self, now: u64, service: u64) -> u64 {
        let Reverse(free) = self.free_at.pop().expect("at least one lane");
        let finish = free.max(now) + service;
        self.free_at.push(Reverse(finish));
        finish
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_up_to_lanes_then_queues() {
        let mut l = Lanes::new(2);
        assert_eq!(l.book(0, 100), 100);
        assert_eq!(l.book(0, 100), 100);
        // Third op waits for a lane: the device has a throughput ceiling.
        assert_eq!(l.book(0, 100), 200);
        assert_eq!(l.book(10, 100), 200);
        assert_eq!(l.book(10, 100), 300);
        // An idle device serves at once.
        assert_eq!(l.book(1000, 50), 1050);
    }
}
