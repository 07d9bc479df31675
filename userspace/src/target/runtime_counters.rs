//! The fiber runtime's own counters, read from a watched process that runs under
//! libtoffload.so: the runtime exports them as one C block (`toffload_counters`, laid
//! out by toffload-abi's `runtime::Counters`), which we read with process_vm_readv at
//! the symbol's address in the target. No environment variable or file is needed, and
//! a process without the runtime simply has none.

use crate::hist::Hist;
use crate::target::{symbol, AddressSpace};
use core::mem::offset_of;
use serde::{Serialize, Serializer};
use toffload_abi::runtime::{
    word, Counters, GuardMode, RuntimeState, LAT_BUCKETS, MAGIC, SCALAR_WORDS, VERSION, VERSION_2,
    VERSION_3, WORDS, WORDS_V2, WORDS_V3,
};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RuntimeCounters {
    pub fibers_created: u64,
    pub fibers_live: u64,
    pub carriers: u64,
    pub parks: u64,
    pub offloads: u64,
    pub offloads_parked: u64,
    pub offloads_inline: u64,
    pub io_parks: u64,
    /// "off", "detect" or "enforce" in JSON.
    #[serde(serialize_with = "guard_name")]
    pub guard: GuardMode,
    pub guard_pages: u64,
    pub guard_faults: u64,
    pub guard_conflicts: u64,
    pub guard_serialized: u64,
    pub guard_released: u64,
    /// "loading", "active" or "disabled" in JSON.
    #[serde(serialize_with = "state_name")]
    pub state: RuntimeState,
    /// Detect's sampled share of time, percent (100: exact); 0 when off or unknown
    /// (a version-2 runtime).
    pub guard_sample: u64,
    /// Milliseconds the guard watched.
    pub guard_watched_ms: u64,
    /// Blocked-carrier handoffs (0 from a runtime older than layout version 4).
    pub handoffs: u64,
}

fn guard_name<S: Serializer>(m: &GuardMode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(m.name())
}

fn state_name<S: Serializer>(r: &RuntimeState, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.name())
}

impl RuntimeCounters {
    /// `self` with its event counts (the monotonic words) combined with `o`'s by `f`;
    /// the gauges (live fibers, carriers, modes, states) stay `self`'s.
    fn events_with(&self, o: &RuntimeCounters, f: impl Fn(u64, u64) -> u64) -> RuntimeCounters {
        RuntimeCounters {
            fibers_created: f(self.fibers_created, o.fibers_created),
            parks: f(self.parks, o.parks),
            offloads: f(self.offloads, o.offloads),
            offloads_parked: f(self.offloads_parked, o.offloads_parked),
            offloads_inline: f(self.offloads_inline, o.offloads_inline),
            io_parks: f(self.io_parks, o.io_parks),
            guard_faults: f(self.guard_faults, o.guard_faults),
            guard_conflicts: f(self.guard_conflicts, o.guard_conflicts),
            guard_serialized: f(self.guard_serialized, o.guard_serialized),
            guard_released: f(self.guard_released, o.guard_released),
            handoffs: f(self.handoffs, o.handoffs),
            ..*self
        }
    }

    /// The events of `self` less those of `o` (an earlier reading, or the events of
    /// stretches left out); gauges from `self`.
    pub fn events_minus(&self, o: &RuntimeCounters) -> RuntimeCounters {
        self.events_with(o, u64::saturating_sub)
    }

    pub fn events_plus(&self, o: &RuntimeCounters) -> RuntimeCounters {
        self.events_with(o, u64::saturating_add)
    }

    /// `self`'s event counts with `g`'s gauges.
    fn with_gauges_of(&self, g: &RuntimeCounters) -> RuntimeCounters {
        RuntimeCounters {
            fibers_live: g.fibers_live,
            carriers: g.carriers,
            guard: g.guard,
            guard_pages: g.guard_pages,
            state: g.state,
            guard_sample: g.guard_sample,
            guard_watched_ms: g.guard_watched_ms,
            ..*self
        }
    }
}

/// The runtime's counters on the watch's clock. The kernel-side counts run only
/// while the probes are attached and a window's rates are per traced second; the
/// runtime counts all the time. Its events in the untraced stretches are left out
/// (read at each edge of a burst), so that both are counted over the same seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct TracedView {
    /// The reading at the last pause (None while tracing).
    at_pause: Option<RuntimeCounters>,
    /// The events of every untraced stretch so far.
    untraced: RuntimeCounters,
}

impl TracedView {
    /// The probes were detached when `now` was read.
    pub fn paused(&mut self, now: Option<RuntimeCounters>) {
        self.at_pause = now;
    }

    /// The probes are attached again as of `now`.
    pub fn resumed(&mut self, now: Option<RuntimeCounters>) {
        if let (Some(p), Some(n)) = (self.at_pause.take(), now) {
            self.untraced = self.untraced.events_plus(&n.events_minus(&p));
        }
    }

    /// `now` as the watch's clock counts it: events up to the pause while paused,
    /// less the untraced stretches'; gauges as they are now.
    pub fn view(&self, now: RuntimeCounters) -> RuntimeCounters {
        let events = self.at_pause.unwrap_or(now);
        events.with_gauges_of(&now).events_minus(&self.untraced)
    }
}

/// The runtime's latency histograms (layout version 4), cumulative since it loaded:
/// a window's are the difference of two readings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RuntimeLatency {
    /// Request latency as the runtime sees it (runtime/src/latency.rs), ns.
    pub request: Hist,
    /// Offload wait, submit to the fiber going on, ns.
    pub offload_wait: Hist,
}

/// One latency histogram over a window, as percentiles; null ones where the window
/// counted none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LatencyPercentiles {
    /// Latencies counted in the window.
    pub count: u64,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p999_us: Option<f64>,
}

impl LatencyPercentiles {
    /// Percentiles of `h` (ns), in us, interpolated inside the bucket (within about
    /// 3%: the fine geometry).
    pub fn of(h: &Hist) -> LatencyPercentiles {
        let q = |p: f64| h.quantile(p).map(|ns| ns / 1e3);
        LatencyPercentiles {
            count: h.total(),
            p50_us: q(0.5),
            p99_us: q(0.99),
            p999_us: q(0.999),
        }
    }
}

/// The runtime's latencies over a window (the `runtime_latency` of a window's JSON).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Request latency as the runtime sees it: from the carrier seeing a waiting
    /// connection readable to the server's next write on it.
    pub request: LatencyPercentiles,
    /// Offload wait: submit to the fiber going on.
    pub offload_wait: LatencyPercentiles,
}

impl RuntimeLatency {
    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            request: LatencyPercentiles::of(&self.request),
            offload_wait: LatencyPercentiles::of(&self.offload_wait),
        }
    }

    /// The latencies counted since `earlier`.
    pub fn minus(&self, earlier: &RuntimeLatency) -> RuntimeLatency {
        RuntimeLatency {
            request: self.request.minus(&earlier.request),
            offload_wait: self.offload_wait.minus(&earlier.offload_wait),
        }
    }
}

/// Decodes the block's counters (version 2: its first 17 words are read); None
/// unless the magic and version match.
pub fn decode(w: &[u64; SCALAR_WORDS]) -> Option<RuntimeCounters> {
    macro_rules! at {
        ($field:ident) => {
            w[word(offset_of!(Counters, $field))]
        };
    }
    let version = at!(version);
    if at!(magic) != MAGIC || ![VERSION, VERSION_3, VERSION_2].contains(&version) {
        return None;
    }
    let v3 = version != VERSION_2;
    let v4 = version == VERSION;
    Some(RuntimeCounters {
        fibers_created: at!(fibers_created),
        fibers_live: at!(fibers_live),
        carriers: at!(carriers),
        parks: at!(parks),
        offloads: at!(offloads),
        offloads_parked: at!(offloads_parked),
        offloads_inline: at!(offloads_inline),
        io_parks: at!(io_parks),
        guard: GuardMode::from_word(at!(guard_mode)),
        guard_pages: at!(guard_pages),
        guard_faults: at!(guard_faults),
        guard_conflicts: at!(guard_conflicts),
        guard_serialized: at!(guard_serialized),
        guard_released: at!(guard_released),
        state: RuntimeState::from_word(at!(state)),
        guard_sample: if v3 { at!(guard_sample) } else { 0 },
        guard_watched_ms: if v3 { at!(guard_watched_ms) } else { 0 },
        handoffs: if v4 { at!(handoffs) } else { 0 },
    })
}

/// Where the block lives in `pid`, if libtoffload.so is mapped there.
pub fn locate(pid: u32) -> Option<u64> {
    let space = AddressSpace::of(pid);
    let m = space
        .modules
        .iter()
        .find(|m| crate::loader::is_fiber_runtime(&m.path))?;
    let (vaddr, size) = symbol(&m.path, "toffload_counters")?;
    (size as usize >= WORDS_V2 * 8).then_some(m.bias + vaddr)
}

/// Reads `w.len()` words at `addr` in `pid`.
fn read_words(pid: u32, addr: u64, w: &mut [u64]) -> bool {
    let local = libc::iovec {
        iov_base: w.as_mut_ptr() as *mut libc::c_void,
        iov_len: w.len() * 8,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: w.len() * 8,
    };
    // SAFETY: one local buffer of the stated size; the kernel checks the remote side.
    let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    n == (w.len() * 8) as isize
}

/// Reads the counters at `addr` in `pid` (root, or the same user with ptrace rights):
/// version 2's words, then the rest where the block says it has them.
pub fn read(pid: u32, addr: u64) -> Option<RuntimeCounters> {
    let mut w = [0u64; SCALAR_WORDS];
    if !read_words(pid, addr, &mut w[..WORDS_V2]) {
        return None;
    }
    let words = match w[word(offset_of!(Counters, version))] {
        VERSION => SCALAR_WORDS,
        VERSION_3 => WORDS_V3,
        _ => WORDS_V2,
    };
    if words > WORDS_V2 && !read_words(pid, addr + WORDS_V2 as u64 * 8, &mut w[WORDS_V2..words]) {
        return None;
    }
    decode(&w)
}

/// The histograms from the block's words after its counters; None unless the block
/// is version 4 (an older runtime measures no latency).
pub fn decode_latency(version: u64, hists: &[u64]) -> Option<RuntimeLatency> {
    (version == VERSION && hists.len() == 2 * LAT_BUCKETS).then(|| RuntimeLatency {
        request: Hist::fine(hists[..LAT_BUCKETS].to_vec()),
        offload_wait: Hist::fine(hists[LAT_BUCKETS..].to_vec()),
    })
}

/// Reads the latency histograms at `addr` in `pid` (the block `read` reads), where
/// the runtime has them.
pub fn read_latency(pid: u32, addr: u64) -> Option<RuntimeLatency> {
    let mut head = [0u64; 2];
    if !read_words(pid, addr, &mut head) || head[0] != MAGIC || head[1] != VERSION {
        return None;
    }
    let mut w = vec![0u64; WORDS - SCALAR_WORDS];
    read_words(pid, addr + SCALAR_WORDS as u64 * 8, &mut w)
        .then(|| decode_latency(head[1], &w))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_only_the_known_layout() {
        let mut w = [0u64; SCALAR_WORDS];
        assert_eq!(decode(&w), None);
        w[0] = MAGIC;
        w[1] = VERSION;
        w[2] = 64;
        w[10] = 2;
        w[13] = 5;
        let c = decode(&w).unwrap();
        assert_eq!(
            (c.fibers_created, c.guard, c.guard_conflicts),
            (64, GuardMode::Enforce, 5)
        );
        assert_eq!(c.guard_sample, 0);
        w[17] = 25;
        w[18] = 1234;
        let c = decode(&w).unwrap();
        assert_eq!((c.guard_sample, c.guard_watched_ms), (25, 1234));
        w[19] = 7;
        assert_eq!(decode(&w).unwrap().handoffs, 7);
        // A version-3 runtime: no handoff word.
        w[1] = VERSION_3;
        let c = decode(&w).unwrap();
        assert_eq!((c.guard_watched_ms, c.handoffs), (1234, 0));
        w[1] = VERSION;
        // A version-2 runtime: its first 17 words, whatever follows them.
        w[1] = VERSION_2;
        let c = decode(&w).unwrap();
        assert_eq!(
            (c.guard_conflicts, c.guard_sample, c.guard_watched_ms),
            (5, 0, 0)
        );
        w[1] = VERSION_3;
        assert_eq!(decode(&w).unwrap().guard_conflicts, 5);
        w[1] = VERSION + 1;
        assert_eq!(decode(&w), None, "an unknown version is not guessed at");
    }

    /// Only a version-4 block has histograms; each is its own half of the words.
    #[test]
    fn latency_histograms_decode_from_version_4_only() {
        let mut h = vec![0u64; 2 * LAT_BUCKETS];
        h[toffload_abi::runtime::latency_bucket(30_000)] = 7;
        h[LAT_BUCKETS + toffload_abi::runtime::latency_bucket(20_000)] = 3;
        let l = decode_latency(VERSION, &h).unwrap();
        assert_eq!((l.request.total(), l.offload_wait.total()), (7, 3));
        let p50 = l.request.quantile(0.5).unwrap();
        assert!((28_000.0..32_000.0).contains(&p50), "{p50}");
        assert_eq!(decode_latency(VERSION_3, &h), None);
        assert_eq!(decode_latency(VERSION, &h[1..]), None);
        let d = l.minus(&l);
        assert_eq!((d.request.total(), d.offload_wait.total()), (0, 0));
        let s = d.summary();
        assert_eq!((s.request.count, s.request.p50_us), (0, None));
    }

    /// Percentiles from a histogram: p50, p99 and p99.9 of 1..=10000 us within the
    /// fine geometry's few percent.
    #[test]
    fn percentiles_from_the_histogram() {
        let mut counts = vec![0u64; LAT_BUCKETS];
        for us in 1..=10_000u64 {
            counts[toffload_abi::runtime::latency_bucket(us * 1000)] += 1;
        }
        let p = LatencyPercentiles::of(&Hist::fine(counts));
        assert_eq!(p.count, 10_000);
        for (got, want) in [
            (p.p50_us, 5_000.0),
            (p.p99_us, 9_900.0),
            (p.p999_us, 9_990.0),
        ] {
            let got = got.unwrap();
            assert!((got - want).abs() / want < 0.04, "{got} vs {want}");
        }
        // One outlier among 1000 fast ones moves p99.9, not p99.
        let mut counts = vec![0u64; LAT_BUCKETS];
        counts[toffload_abi::runtime::latency_bucket(20_000)] = 999;
        counts[toffload_abi::runtime::latency_bucket(5_000_000)] = 1;
        let p = LatencyPercentiles::of(&Hist::fine(counts));
        assert!(p.p99_us.unwrap() < 25.0, "{p:?}");
        assert!(p.p999_us.unwrap() > 19.0, "{p:?}");
        assert!(
            p.p50_us.unwrap() > 19.0 && p.p50_us.unwrap() < 21.5,
            "{p:?}"
        );
    }

    /// The states are enums here and the same strings as ever in the JSON.
    #[test]
    fn states_serialize_as_their_names() {
        let c = RuntimeCounters {
            guard: GuardMode::Detect,
            state: RuntimeState::Active,
            ..Default::default()
        };
        let j = serde_json::to_value(c).unwrap();
        assert_eq!(
            (&j["guard"], &j["state"]),
            (&"detect".into(), &"active".into())
        );
    }

    /// Events counted while the probes were off are left out of the traced view, and
    /// the gauges are always the current ones.
    #[test]
    fn traced_view_leaves_the_untraced_stretches_out() {
        let at = |offloads, fibers_live| RuntimeCounters {
            offloads,
            parks: offloads * 2,
            fibers_live,
            ..Default::default()
        };
        let mut v = TracedView::default();
        assert_eq!(v.view(at(100, 8)).offloads, 100);
        v.paused(Some(at(150, 8)));
        // While paused the count stays at the pause's, the gauge moves.
        let p = v.view(at(900, 9));
        assert_eq!((p.offloads, p.parks, p.fibers_live), (150, 300, 9));
        v.resumed(Some(at(1000, 9)));
        // 850 offloads ran untraced: the clock goes on from 150.
        assert_eq!(v.view(at(1010, 7)).offloads, 160);
        v.paused(Some(at(1100, 7)));
        v.resumed(Some(at(3100, 7)));
        let r = v.view(at(3150, 7));
        assert_eq!((r.offloads, r.parks), (300, 600));
    }
}
