//! The remote backend's benchmark (`cargo xtask bench remote`, root: it makes network
//! namespaces): pipelined small ops vs one round trip per op on a 0.5 ms link, bulk
//! throughput vs shaped links, second-pass bytes with the chunk cache, and placement
//! vs round robin and least loaded, and the demo row: conn_server with the remote
//! backend, stock vs under the fiber runtime, next to the local emulated device at the
//! same op latency (needs the dist folder: `cargo xtask bench remote` builds it).
//! Median of `--runs` (default 3); writes `--out`. `--only conn-server` measures the
//! demo row alone and replaces just its section of an existing `--out` file.

#[path = "../tests/remote_util/mod.rs"]
mod remote_util;

use remote_util::conn_server::{self as cs, DEMO_LOAD};
use remote_util::netns::{self, daemon_on, in_ns, Net, Shape};
use remote_util::*;
use std::fmt::Write as _;
use std::time::{Duration, Instant};
use toffload_accel::remote::Placement;
use toffload_accel::{Accelerator, WaitStyle};

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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn pipelining(runs: usize) -> (f64, f64, String) {
    let net = Net::new("bp", &[LAN]).unwrap();
    let how = net.links[0].how.to_string();
    let (_d, _dl, addr) = daemon_on(&net.links[0], &[], &[("TOFFLOAD_EMU_LAT_US", "20")]);
    let mut serial = Vec::new();
    let mut piped = Vec::new();
    for _ in 0..runs {
        let a = addr.clone();
        let (s, p) = in_ns(&net.client_ns, move || {
            let r = client(&[a], |c| c.deadline_ms = 30_000);
            let mut b = pattern(0, 64);
            r.run(&mut b, WaitStyle::Block).unwrap();
            let n = 500;
            let t0 = Instant::now();
            for i in 0..n {
                let mut b = pattern(i, 64);
                r.run(&mut b, WaitStyle::Block).unwrap();
            }
            let s = n as f64 / t0.elapsed().as_secs_f64();
            let n = 100_000;
            let t0 = Instant::now();
            let (ok, failed, wrong) =
                aes_workload(&r, n, 64, 2, 2048, Duration::from_secs(120), |_| {});
            assert_eq!((ok, failed, wrong), (n, 0, 0));
            (s, n as f64 / t0.elapsed().as_secs_f64())
        });
        serial.push(s);
        piped.push(p);
    }
    (median(serial), median(piped), how)
}

fn bulk(shape: Shape, runs: usize) -> f64 {
    let net = Net::new("bb", &[shape]).unwrap();
    let (_d, _dl, addr) = daemon_on(&net.links[0], &[], &[("TOFFLOAD_EMU_LAT_US", "50")]);
    let mut v = Vec::new();
    for _ in 0..runs {
        let a = addr.clone();
        v.push(in_ns(&net.client_ns, move || {
            let r = client(&[a], |c| {
                c.deadline_ms = 60_000;
                c.cache_min = 0;
            });
            let mut b = pattern(0, 1 << 20);
            r.run(&mut b, WaitStyle::Block).unwrap();
            let n = (shape.mbit as u64 / 8).max(32);
            let t0 = Instant::now();
            let (ok, failed, wrong) =
                aes_workload(&r, n, 1 << 20, 1, 32, Duration::from_secs(120), |_| {});
            assert_eq!((ok, failed, wrong), (n, 0, 0));
            (n << 20) as f64 / t0.elapsed().as_secs_f64()
        }));
    }
    median(v)
}

fn second_pass() -> (u64, u64) {
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0"],
        &[("TOFFLOAD_EMU_LAT_US", "50")],
    );
    let r = client(&[d.addr()], |_| {});
    let pass = |p: u64| {
        let before = r.counters().bytes_sent;
        for i in 0..32u64 {
            let mut b = pattern(1000 + i, (2 << 20) - (8 << 10));
            b.extend_from_slice(&pattern(1_000_000 * p + i, 8 << 10));
            let want = aes(b.clone());
            r.run(&mut b, WaitStyle::Block).unwrap();
            assert!(b == want);
        }
        r.counters().bytes_sent - before
    };
    (pass(1), pass(2))
}

fn placement(runs: usize) -> Vec<(Placement, f64, Vec<u64>)> {
    let net = Net::new("bl", &[LAN, WAN]).unwrap();
    let d = netns::unequal_daemons(&net);
    let mut out = Vec::new();
    for p in [
        Placement::RoundRobin,
        Placement::LeastLoaded,
        Placement::Predicted,
    ] {
        let mut v = Vec::new();
        let mut per = Vec::new();
        for _ in 0..runs {
            let (rate, pe) =
                netns::placement_run(&net, &d, p, 20_000, 60_000, Duration::from_secs(120));
            v.push(rate);
            per = pe;
        }
        out.push((p, median(v), per));
    }
    out
}

/// Heading of the demo row's section: `--only conn-server` replaces from here on.
const CS_HEADING: &str = "## conn_server under the runtime with the remote backend";

/// The demo row: conn_server over the remote backend (0.5 ms link) and over the local
/// emulated device at the remote op's measured round trip, each stock vs runtime,
/// for both of accel_run's wait styles. Returns the markdown section.
fn conn_server_rows(runs: usize) -> String {
    let lib = cs::dist_ready().unwrap_or_else(|e| panic!("{e}"));
    let side = cs::remote_side("bc").expect("namespaces");
    let rtt = side.serial_round_trip_us(DEMO_LOAD.size, 300);
    let local_us = rtt.round() as u32;
    println!("conn_server: remote serial round trip {rtt:.0} us");
    let ns = Some(side.net.client_ns.as_str());
    let mut rows = Vec::new();
    for wait in ["spin", "block"] {
        let p = cs::pair(ns, &side.env(), wait, &lib, DEMO_LOAD, runs).expect("remote runs");
        println!("conn_server remote {wait}: {p:?}");
        rows.push(("remote", wait, p));
    }
    for wait in ["spin", "block"] {
        let p = cs::pair(None, &cs::local_env(local_us), wait, &lib, DEMO_LOAD, runs)
            .expect("local runs");
        println!("conn_server local {wait}: {p:?}");
        rows.push(("local", wait, p));
    }
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{CS_HEADING}\n\n\
         conn_server (tests/servers, unmodified), stock vs under libtoffload.so (LD_PRELOAD), \
         {} connections, {} B requests, server pinned to core 0 and toffload-load to core 1, \
         {} s measured after {} s warm-up per run, median of {runs} runs (stock and runtime \
         alternating). remote: TOFFLOAD_BACKEND=remote, server and load in the client \
         namespace, toffload-remoted (emulated device, {} us, 64 lanes) across a {} Mbit/s \
         link with {} us each way ({}); one op's round trip as a lone caller sees it: \
         {rtt:.0} us (median of 300). local: TOFFLOAD_BACKEND=emulated at that latency \
         ({local_us} us, 64 lanes), the reference. Target: the remote backend overlaps like \
         the local device, >= 3x stock with the default wait (spin).\n",
        DEMO_LOAD.conns,
        DEMO_LOAD.size,
        DEMO_LOAD.secs,
        DEMO_LOAD.warmup,
        cs::DAEMON_LAT_US,
        cs::LINK.mbit,
        cs::LINK.delay_us,
        side.how,
    );
    let _ = writeln!(
        md,
        "| backend | op latency | wait | stock req/s | runtime req/s | runtime/stock | stock p50 us | runtime p50 us | ops in flight (runtime) | wrong | errors | target | met |\n\
         |---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    );
    for (backend, wait, p) in &rows {
        let (what, lat) = match *backend {
            "remote" => (
                "remote (toffload-remoted)",
                format!("0.5 ms link, {rtt:.0} us round trip"),
            ),
            _ => ("local emulated", format!("{local_us} us")),
        };
        let (target, met) = if *backend == "remote" && *wait == "spin" {
            (">= 3x", if p.speedup() >= 3.0 { "yes" } else { "no" })
        } else {
            ("", "")
        };
        let _ = writeln!(
            md,
            "| {what} | {lat} | {wait} | {:.0} | {:.0} | {:.2}x | {:.0} | {:.0} | {:.1} | {} | {} | {target} | {met} |",
            p.stock,
            p.runtime,
            p.speedup(),
            p.stock_p50_us,
            p.runtime_p50_us,
            p.runtime * rtt * 1e-6,
            p.wrong,
            p.errors,
        );
    }
    let _ = writeln!(
        md,
        "\nops in flight: runtime req/s x the round trip (Little's law); 1 would be one \
         connection's op at a time. The runtime replaces accel_run's wait, so TOFFLOAD_WAIT \
         changes only the stock server."
    );
    md
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut out: Option<String> = None;
    let mut runs = 3;
    let mut only_cs = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = it.next().cloned(),
            "--runs" => runs = it.next().and_then(|v| v.parse().ok()).expect("--runs N"),
            "--bench" => {}
            "--only" => match it.next().map(String::as_str) {
                Some("conn-server") => only_cs = true,
                other => panic!("--only {other:?}: expected `conn-server`"),
            },
            "--help" | "-h" => {
                println!(
                    "remote bench: [--runs N] [--out FILE.md] [--only conn-server] \
                     (root: network namespaces)"
                );
                return;
            }
            other => panic!("unknown argument {other:?}"),
        }
    }
    if let Err(why) = netns::can_run() {
        eprintln!("remote bench: {why}");
        std::process::exit(1);
    }
    if only_cs {
        let section = conn_server_rows(runs);
        print!("{section}");
        if let Some(o) = out {
            // Keep the rest of the file; replace (or add) the demo row's section.
            let old = std::fs::read_to_string(&o).unwrap_or_default();
            let head = old.split(CS_HEADING).next().unwrap_or("").trim_end();
            let text = if head.is_empty() {
                section
            } else {
                format!("{head}\n\n{section}")
            };
            std::fs::write(&o, text).expect("writing results");
            println!("wrote {o}");
        }
        return;
    }
    let mut md = String::new();
    let (serial, piped, how) = pipelining(runs);
    let ideal = 1.0 / (2.0 * LAN.delay_us as f64 * 1e-6 + 20e-6);
    println!("pipelining: serial {serial:.0} ops/s, pipelined {piped:.0} ops/s");
    let bulk_lan = bulk(LAN, runs);
    let bulk_wan = bulk(WAN, runs);
    println!(
        "bulk: LAN {:.1} MB/s, WAN {:.1} MB/s",
        bulk_lan / 1e6,
        bulk_wan / 1e6
    );
    let (p1, p2) = second_pass();
    println!("second pass: {p1} -> {p2} bytes");
    let pl = placement(runs);
    for (p, r, per) in &pl {
        println!("placement {p:?}: {r:.0} ops/s {per:?}");
    }
    let _ = writeln!(md, "# Remote backend benchmark\n");
    let _ = writeln!(
        md,
        "`cargo xtask bench remote` (backends/benches/remote.rs), median of {runs} runs. \
         Client and daemons in their own network namespaces joined by veth pairs. Link \
         shaping: {how}. LAN link: 1000 Mbit/s, 0.25 ms each way (0.5 ms round trip); WAN \
         link: 300 Mbit/s, 1.5 ms +- 0.5 ms each way. Daemon: toffload-remoted on the \
         emulated device.\n"
    );
    let _ = writeln!(
        md,
        "| measure | result | target | met |\n|---|---:|---:|---|"
    );
    let ratio = piped / serial;
    let _ = writeln!(
        md,
        "| 64 B AES ops, LAN: one round trip per op | {serial:.0} ops/s (ideal at 0.5 ms + 20 us service: {ideal:.0}) | | |"
    );
    let _ = writeln!(
        md,
        "| 64 B AES ops, LAN: pipelined (2 threads x 2048 in flight) | {piped:.0} ops/s = {ratio:.0}x measured serial, {:.0}x ideal serial | >= 20x | {} |",
        piped / ideal,
        if piped / ideal >= 20.0 { "yes" } else { "no" }
    );
    for (name, shape, rate) in [("LAN", LAN, bulk_lan), ("WAN", WAN, bulk_wan)] {
        let link = shape.mbit as f64 * 1e6 / 8.0;
        let pct = rate / link * 100.0;
        let _ = writeln!(
            md,
            "| 1 MiB AES ops, {name} ({} Mbit/s): payload each way | {:.1} MB/s = {pct:.0}% of the link | >= 90% | {} |",
            shape.mbit,
            rate / 1e6,
            if pct >= 90.0 { "yes" } else { "no" }
        );
    }
    let pct = p2 as f64 / p1 as f64 * 100.0;
    let _ = writeln!(
        md,
        "| bytes sent, second pass of 32 x 2 MiB ops (8 KiB of each changes per pass) | {p2} of {p1} = {pct:.2}% | <= 2% | {} |",
        if pct <= 2.0 { "yes" } else { "no" }
    );
    let rr = pl[0].1;
    let ll = pl[1].1;
    let pr = pl[2].1;
    for (p, r, per) in &pl {
        let _ = writeln!(
            md,
            "| placement {p:?}: 4 KiB ops over a fast daemon (64 lanes, 200 us, LAN) and a slow one (4 lanes, 2 ms, WAN) | {r:.0} ops/s (ops per daemon {per:?}) | | |"
        );
    }
    let _ = writeln!(
        md,
        "| predicted vs round robin / least loaded | {:.2}x / {:.2}x | >= 1.3x | {} |",
        pr / rr,
        pr / ll,
        if pr / rr >= 1.3 && pr / ll >= 1.3 {
            "yes"
        } else if pr / rr >= 1.3 {
            "vs round robin only"
        } else {
            "no"
        }
    );
    let _ = writeln!(md);
    md.push_str(&conn_server_rows(runs));
    print!("{md}");
    if let Some(o) = out {
        std::fs::write(&o, md).expect("writing results");
        println!("wrote {o}");
    }
}
