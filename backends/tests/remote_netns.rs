//! The remote backend across real network hops: namespaces joined by veth pairs,
//! shaped (see remote_util/netns.rs for netem vs tbf + delay line), made and removed
//! here. Needs root; skips with a reason otherwise (fails under TOFFLOAD_NO_SKIP=1).

mod remote_util;

use remote_util::netns::{self, daemon_on, in_ns, Net, Shape};
use remote_util::*;
use std::time::{Duration, Instant};
use toffload_accel::remote::Placement;
use toffload_accel::{Accelerator, WaitStyle};

fn ready() -> bool {
    match netns::can_run() {
        Ok(()) => true,
        Err(why) => {
            netns::skip_or_fail(&why);
            false
        }
    }
}

const LAN: Shape = Shape {
    mbit: 1000,
    delay_us: 250,
    jitter_us: 0,
};
const WAN: Shape = Shape {
    mbit: 300,
    delay_us: 1500,
    jitter_us: 500,
};

#[test]
fn pipelining_beats_one_round_trip_per_op_on_a_half_millisecond_link() {
    if !ready() {
        return;
    }
    let net = Net::new("p", &[LAN]).unwrap();
    let (_d, _dl, addr) = daemon_on(&net.links[0], &[], &[("TOFFLOAD_EMU_LAT_US", "20")]);
    println!("link: {:?} via {}", net.links[0].shape, net.links[0].how);
    let (serial, piped) = in_ns(&net.client_ns, move || {
        let r = client(&[addr], |c| c.deadline_ms = 20_000);
        // Warm up (connection), then one op at a time.
        let mut b = pattern(0, 64);
        r.run(&mut b, WaitStyle::Block).unwrap();
        let n = 200;
        let t0 = Instant::now();
        for i in 0..n {
            let mut b = pattern(i, 64);
            r.run(&mut b, WaitStyle::Block).unwrap();
            assert_eq!(b, aes(pattern(i, 64)));
        }
        let serial = n as f64 / t0.elapsed().as_secs_f64();
        let n = 20_000;
        let t0 = Instant::now();
        let (ok, failed, wrong) = aes_workload(&r, n, 64, 2, 2048, Duration::from_secs(40), |_| {});
        assert_eq!((ok, failed, wrong), (n, 0, 0));
        (serial, n as f64 / t0.elapsed().as_secs_f64())
    });
    println!(
        "one round trip per op: {serial:.0} ops/s; pipelined: {piped:.0} ops/s ({:.1}x)",
        piped / serial
    );
    // A round trip is >= 0.5 ms: at most 2000 ops/s one at a time.
    assert!(
        serial < 2100.0,
        "{serial:.0} ops/s: the link is not delayed"
    );
    assert!(piped / serial >= 10.0, "{:.1}x", piped / serial);
}

#[test]
fn bulk_ops_are_right_and_fill_a_jittery_300_mbit_link() {
    if !ready() {
        return;
    }
    let net = Net::new("b", &[WAN]).unwrap();
    let (_d, _dl, addr) = daemon_on(&net.links[0], &[], &[("TOFFLOAD_EMU_LAT_US", "50")]);
    let (rate, wrong) = in_ns(&net.client_ns, move || {
        let r = client(&[addr], |c| {
            c.deadline_ms = 30_000;
            c.cache_min = 0;
        });
        let mut b = pattern(0, 1 << 20);
        r.run(&mut b, WaitStyle::Block).unwrap();
        let n = 48;
        let t0 = Instant::now();
        let (ok, failed, wrong) =
            aes_workload(&r, n, 1 << 20, 1, 16, Duration::from_secs(40), |_| {});
        assert_eq!((ok, failed), (n, 0));
        ((n << 20) as f64 / t0.elapsed().as_secs_f64(), wrong)
    });
    let link = 300e6 / 8.0;
    println!(
        "1 MiB ops over 300 Mbit/s, 3 ms RTT +-1 ms: {:.1} MB/s each way = {:.0}% of the link",
        rate / 1e6,
        rate / link * 100.0
    );
    assert_eq!(wrong, 0);
    assert!(rate <= link * 1.05, "faster than the link: not shaped");
    assert!(
        rate >= link * 0.6,
        "{:.0}% of the link",
        rate / link * 100.0
    );
}

#[test]
fn predicted_placement_beats_round_robin_across_unequal_daemons() {
    if !ready() {
        return;
    }
    // A fast daemon on the LAN link, a slow one (4 lanes, 2 ms) on the WAN link.
    let net = Net::new("pl", &[LAN, WAN]).unwrap();
    let d = netns::unequal_daemons(&net);
    let mut rates = Vec::new();
    for p in [
        Placement::RoundRobin,
        Placement::LeastLoaded,
        Placement::Predicted,
    ] {
        let (rate, per) = netns::placement_run(&net, &d, p, 6000, 30_000, Duration::from_secs(40));
        println!("{p:?}: {rate:.0} ops/s, ops per daemon {per:?}");
        rates.push(rate);
    }
    assert!(
        rates[2] >= 1.3 * rates[0],
        "predicted {:.0} vs round robin {:.0}",
        rates[2],
        rates[0]
    );
    assert!(
        rates[2] >= 0.95 * rates[1],
        "predicted {:.0} vs least loaded {:.0}",
        rates[2],
        rates[1]
    );
}
