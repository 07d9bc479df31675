//! conn_server, unmodified, with TOFFLOAD_BACKEND=remote against a toffload-remoted
//! across a shaped link (1 Gbit/s, 0.5 ms round trip), stock and under the fiber
//! runtime: every answer right, and under the runtime its connections' remote ops
//! overlap, as local ones do. Needs root (network namespaces), iproute2 and the dist
//! folder (`cargo xtask build`); skips with the reason otherwise, and fails instead
//! under TOFFLOAD_NO_SKIP=1.

mod remote_util;

use remote_util::conn_server::{self as cs, DEMO_LOAD};
use remote_util::netns;

#[test]
fn conn_server_overlaps_remote_ops_under_the_runtime() {
    if let Err(why) = netns::can_run() {
        return netns::skip_or_fail(&why);
    }
    let lib = match cs::dist_ready() {
        Ok(l) => l,
        Err(why) => return netns::skip_or_fail(&why),
    };
    let side = cs::remote_side("cs").expect("namespaces");
    let rtt = side.serial_round_trip_us(DEMO_LOAD.size, 200);
    // The link alone is 500 us; anything less means the shaping is not there.
    assert!(
        rtt >= 500.0,
        "serial round trip {rtt:.0} us < the link's 500 us"
    );
    let ns = Some(side.net.client_ns.as_str());
    // The default wait (spin): each stock connection thread holds the core while its
    // op crosses the link; under the runtime it parks and another runs.
    let p = cs::pair(ns, &side.env(), "spin", &lib, DEMO_LOAD, 3).expect("runs");
    // Little's law: ops in flight on average = throughput x time each op takes. Every
    // op takes at least the link's 0.5 ms round trip, so this is a lower bound that
    // does not lean on the serial measurement (which a busy machine inflates).
    let link_rtt_us = 2.0 * cs::LINK.delay_us as f64;
    let in_flight = p.runtime * link_rtt_us * 1e-6;
    println!(
        "remote ({}): round trip {rtt:.0} us; stock {:.0} req/s, runtime {:.0} req/s = \
         {:.1}x, >= {in_flight:.1} ops in flight; wrong {}, errors {}",
        side.how,
        p.stock,
        p.runtime,
        p.speedup(),
        p.wrong,
        p.errors
    );
    assert_eq!(p.wrong, 0, "wrong answers");
    assert_eq!(p.errors, 0, "errors");
    assert!(p.min_fibers > 0, "the runtime did not engage");
    assert!(
        p.speedup() >= 3.0,
        "runtime {:.0} req/s vs stock {:.0}: {:.2}x < 3x",
        p.runtime,
        p.stock,
        p.speedup()
    );
    // Overlap, not just less spinning: one connection at a time would be 1 op in
    // flight; the runtime keeps many of the 64 connections' ops on the link at once.
    assert!(
        in_flight >= 3.0,
        "only >= {in_flight:.1} ops in flight on average (runtime {:.0} req/s x {link_rtt_us} us)",
        p.runtime
    );
}
