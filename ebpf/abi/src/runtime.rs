//! The counters block the fiber runtime exports as `toffload_counters` and the
//! watcher reads from the target's memory (process_vm_readv at the symbol's address).
//! The watcher reads it as 64-bit words, each at its field's offset.

use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// "TOFFLOAD" in little-endian ASCII: says the block is what the watcher expects.
pub const MAGIC: u64 = u64::from_le_bytes(*b"TOFFLOAD");
/// The layout version: 3 appends the sampled guard's two words to version 2's
/// seventeen, 4 the handoff count and the two latency histograms (older runtimes are
/// still read, without what they lack).
pub const VERSION: u64 = 4;
pub const VERSION_3: u64 = 3;
pub const VERSION_2: u64 = 2;

/// Buckets of a latency histogram: the fine (log-linear) geometry of crate::hist,
/// cut at bucket 511 (2^34 ns, 17 s; everything longer lands in the last one).
pub const LAT_BUCKETS: usize = 512;

/// A latency histogram in nanoseconds, one word per bucket.
pub type LatencyHist = [AtomicU64; LAT_BUCKETS];

/// The bucket a latency of `ns` is counted in.
#[inline]
pub fn latency_bucket(ns: u64) -> usize {
    (crate::hist::fine_bucket(ns) as usize).min(LAT_BUCKETS - 1)
}

/// Counts one latency of `ns` in `h`: one relaxed increment, no lock.
#[inline]
pub fn record_latency(h: &LatencyHist, ns: u64) {
    h[latency_bucket(ns)].fetch_add(1, Relaxed);
}

/// The block, C-laid-out, every field one 64-bit word.
#[repr(C)]
pub struct Counters {
    /// MAGIC.
    pub magic: AtomicU64,
    pub version: AtomicU64,
    pub fibers_created: AtomicUsize,
    pub fibers_live: AtomicUsize,
    pub carriers: AtomicUsize,
    pub parks: AtomicUsize,
    pub offloads: AtomicUsize,
    pub offloads_parked: AtomicUsize,
    pub offloads_inline: AtomicUsize,
    pub io_parks: AtomicUsize,
    /// A GuardMode.
    pub guard_mode: AtomicUsize,
    pub guard_pages: AtomicUsize,
    pub guard_faults: AtomicUsize,
    pub guard_conflicts: AtomicUsize,
    pub guard_serialized: AtomicUsize,
    pub guard_released: AtomicUsize,
    /// A RuntimeState.
    pub state: AtomicUsize,
    /// Detect's TOFFLOAD_GUARD_SAMPLE (percent of the time watched; 100 exact, and
    /// for enforce); 0 while the guard is off or not armed. (Layout version 3.)
    pub guard_sample: AtomicUsize,
    /// Milliseconds the guard has watched since it armed (up to date within 50 ms
    /// while watching).
    pub guard_watched_ms: AtomicUsize,
    /// Blocked-carrier handoffs: a carrier's fibers moved to a spare thread because
    /// its thread stayed in a call the runtime does not see. (Layout version 4.)
    pub handoffs: AtomicUsize,
    /// Request latency as the runtime sees it, ns (runtime/src/latency.rs says
    /// exactly what it covers). (Layout version 4.)
    pub request_latency: LatencyHist,
    /// Offload wait: from submit until the waiting fiber goes on, ns.
    pub offload_wait: LatencyHist,
}

impl Counters {
    /// A fresh block: the magic and version set, everything else zero.
    pub const fn new() -> Counters {
        Counters {
            magic: AtomicU64::new(MAGIC),
            version: AtomicU64::new(VERSION),
            fibers_created: AtomicUsize::new(0),
            fibers_live: AtomicUsize::new(0),
            carriers: AtomicUsize::new(0),
            parks: AtomicUsize::new(0),
            offloads: AtomicUsize::new(0),
            offloads_parked: AtomicUsize::new(0),
            offloads_inline: AtomicUsize::new(0),
            io_parks: AtomicUsize::new(0),
            guard_mode: AtomicUsize::new(GuardMode::Off as usize),
            guard_pages: AtomicUsize::new(0),
            guard_faults: AtomicUsize::new(0),
            guard_conflicts: AtomicUsize::new(0),
            guard_serialized: AtomicUsize::new(0),
            guard_released: AtomicUsize::new(0),
            state: AtomicUsize::new(RuntimeState::Loading as usize),
            guard_sample: AtomicUsize::new(0),
            guard_watched_ms: AtomicUsize::new(0),
            handoffs: AtomicUsize::new(0),
            request_latency: [const { AtomicU64::new(0) }; LAT_BUCKETS],
            offload_wait: [const { AtomicU64::new(0) }; LAT_BUCKETS],
        }
    }
}

impl Default for Counters {
    fn default() -> Self {
        Self::new()
    }
}

/// The block's size in words.
pub const WORDS: usize = core::mem::size_of::<Counters>() / 8;
/// The words every block has (version 2's): up to guard_sample.
pub const WORDS_V2: usize = core::mem::offset_of!(Counters, guard_sample) / 8;
/// Version 3's words: up to handoffs (the first word of version 4).
pub const WORDS_V3: usize = core::mem::offset_of!(Counters, handoffs) / 8;
/// Version 4's counters, before its latency histograms.
pub const SCALAR_WORDS: usize = core::mem::offset_of!(Counters, request_latency) / 8;

/// The word index of a field at byte offset `off` (core::mem::offset_of!).
pub const fn word(off: usize) -> usize {
    off / 8
}

/// The guard's mode, as `guard_mode` holds it.
#[repr(usize)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GuardMode {
    #[default]
    Off = 0,
    Detect = 1,
    Enforce = 2,
}

impl GuardMode {
    /// An unknown word reads as Off.
    pub fn from_word(w: u64) -> GuardMode {
        match w {
            1 => GuardMode::Detect,
            2 => GuardMode::Enforce,
            _ => GuardMode::Off,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GuardMode::Off => "off",
            GuardMode::Detect => "detect",
            GuardMode::Enforce => "enforce",
        }
    }
}

/// Whether the runtime will fiberize, as `state` holds it: lets an injector tell a
/// runtime that loaded but stays out of the way from one that will fiberize.
#[repr(usize)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RuntimeState {
    /// The knobs are not read yet.
    #[default]
    Loading = 0,
    Active = 1,
    /// A malformed knob, or TOFFLOAD_FIBERIZE=off.
    Disabled = 2,
}

impl RuntimeState {
    /// An unknown word reads as Loading.
    pub fn from_word(w: u64) -> RuntimeState {
        match w {
            1 => RuntimeState::Active,
            2 => RuntimeState::Disabled,
            _ => RuntimeState::Loading,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RuntimeState::Loading => "loading",
            RuntimeState::Active => "active",
            RuntimeState::Disabled => "disabled",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::offset_of;

    /// The layout the watcher has always read: versions 2 and 3 word by word.
    #[test]
    fn words_stay_where_readers_expect_them() {
        assert_eq!((WORDS_V2, WORDS_V3), (17, 19));
        assert_eq!(word(offset_of!(Counters, handoffs)), 19);
        assert_eq!(SCALAR_WORDS, 20);
        assert_eq!(WORDS, 20 + 2 * LAT_BUCKETS);
        assert_eq!(word(offset_of!(Counters, offload_wait)), 20 + LAT_BUCKETS);
        assert_eq!(word(offset_of!(Counters, fibers_created)), 2);
        assert_eq!(word(offset_of!(Counters, guard_mode)), 10);
        assert_eq!(word(offset_of!(Counters, state)), 16);
        assert_eq!(word(offset_of!(Counters, guard_watched_ms)), 18);
    }

    /// The latency buckets are crate::hist's fine ones, the longest in the last.
    #[test]
    fn latencies_land_in_the_fine_buckets() {
        for ns in [0u64, 15, 20_000, 200_000, 1 << 33] {
            let (lo, w) = crate::hist::fine_bounds(latency_bucket(ns));
            assert!(lo <= ns && ns - lo < w, "{ns}");
        }
        assert_eq!(latency_bucket(u64::MAX), LAT_BUCKETS - 1);
        let c = Counters::new();
        record_latency(&c.offload_wait, 20_000);
        assert_eq!(c.offload_wait[latency_bucket(20_000)].load(Relaxed), 1);
    }

    #[test]
    fn states_round_trip_through_their_words() {
        for m in [GuardMode::Off, GuardMode::Detect, GuardMode::Enforce] {
            assert_eq!(GuardMode::from_word(m as u64), m);
        }
        for s in [
            RuntimeState::Loading,
            RuntimeState::Active,
            RuntimeState::Disabled,
        ] {
            assert_eq!(RuntimeState::from_word(s as u64), s);
        }
        assert_eq!(GuardMode::from_word(7), GuardMode::Off);
        assert_eq!(RuntimeState::from_word(7), RuntimeState::Loading);
    }
}
