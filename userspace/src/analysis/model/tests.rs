use super::*;
use crate::classifier::Kind;
use crate::target::RuntimeKind;

/// conn_server-like: 64 connections blocking on a 200 us offload, 12 us of CPU per
/// request of which 2 switches x 1.5 us are the blocking itself, one core, which the
/// stock server keeps 90% busy.
fn base() -> Inputs {
    Inputs {
        stock_rps: 75_000.0,
        latency_us: 200.0,
        cpu_per_request_us: 12.0,
        cpu_warm_quartile: false,
        spin: false,
        connections: 64.0,
        client_connections: None,
        cores: 1.0,
        cpu_available: 1.0,
        carriers: 1.0,
        switch_us: 1.5,
        blocking_switches_per_request: 2.0,
        preemptions_per_request: 0.0,
        sleep_cost_us: None,
        sleeps_per_call: 1.0,
        outside_cpu_warm_us: None,
        device_rps: None,
        watch_us_per_request: 0.0,
        stock_rps_untraced: None,
        cpu_untraced_us: None,
        outside_wait_us: None,
        reroute_cpu_us: None,
        backend_cpu_us: 0.0,
        peer_idle_wakes_per_request: 0.0,
        idle_wake_us: 0.0,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

#[test]
fn cpu_ceiling_binds_with_many_connections() {
    let p = predict(&base());
    // c_f = 12 - 2 x 1.5 + 2 x (0.052 + 1.2)
    let cf = 12.0 - 3.0 + runtime_overhead_us(YIELDS_PER_REQUEST);
    assert!(close(p.fiber_cpu_us, cf), "{}", p.fiber_cpu_us);
    assert_eq!(p.binding, Ceiling::Cpu);
    assert!(close(p.fiber_rps, 1e6 / cf));
    assert!(close(p.speedup, 1e6 / cf / 75_000.0));
    assert_eq!(p.think_us, 0.0);
    assert!(p.stop.is_none(), "{:?}", p.stop);
    // Two carriers on two cores double the CPU ceiling; carriers beyond the cores
    // do not.
    let mut i = base();
    i.cores = 2.0;
    i.carriers = 2.0;
    assert!(close(predict(&i).cpu_ceiling_rps, 2e6 / cf));
    i.carriers = 8.0;
    assert!(close(predict(&i).cpu_ceiling_rps, 2e6 / cf));
}

#[test]
fn overlap_ceiling_binds_with_few_connections() {
    let mut i = base();
    i.connections = 4.0;
    i.latency_us = 1000.0;
    i.stock_rps = 3_900.0;
    let p = predict(&i);
    assert_eq!(p.binding, Ceiling::Overlap);
    // The stock loop's four connections would make 3,953/s on the server alone: the
    // rest is time outside it (a few us per request), which the fibers spend too.
    assert!(p.think_us > 5.0 && p.think_us < 20.0, "{}", p.think_us);
    // Four connections hardly ever queue for the carrier: the overlap asymptote,
    // a hair below.
    let asymptote = 4e6 / (1000.0 + p.fiber_cpu_us + p.think_us);
    assert!(
        p.fiber_rps <= asymptote && p.fiber_rps > 0.995 * asymptote,
        "{} vs {asymptote}",
        p.fiber_rps
    );
    // Four blocking threads already keep four ops in flight: no gain.
    assert!(p.speedup < NO_GAIN, "{}", p.speedup);
    assert!(p.stop.is_some());
}

#[test]
fn device_ceiling_binds_when_known() {
    let mut i = base();
    i.device_rps = Some(8_000.0);
    i.stock_rps = 7_990.0;
    let p = predict(&i);
    assert_eq!(p.binding, Ceiling::Device);
    assert!(close(p.fiber_rps, 8_000.0));
    assert!(
        p.stop.as_deref().unwrap().contains("device"),
        "{:?}",
        p.stop
    );
}

#[test]
fn spin_wait_is_predicted_against_its_measured_rate() {
    let mut i = base();
    i.spin = true;
    i.stock_rps = 270.0;
    i.blocking_switches_per_request = 1.0;
    let p = predict(&i);
    assert_eq!(p.binding, Ceiling::Cpu);
    assert!(p.speedup > 100.0, "{}", p.speedup);
    // The formula's stock rate for a spinning server is min(P, N) / (c + L).
    assert!(close(p.stock_model_rps, 1e6 / 212.0));
}

#[test]
fn behind_the_wall_is_no_gain() {
    // CPU per request above the latency: nothing idle to overlap.
    let mut i = base();
    i.cpu_per_request_us = 300.0;
    i.stock_rps = 1e6 / 303.0;
    let a = assess(Kind::BehindWall, Some(&i), "/usr/bin/conn_server", None);
    let p = a.zero_edit.as_ref().unwrap();
    assert!(p.speedup < NO_GAIN, "{}", p.speedup);
    assert!(
        a.stop.as_deref().unwrap().contains("not clearly above"),
        "{:?}",
        a.stop
    );
}

#[test]
fn short_offload_is_stopped() {
    let mut i = base();
    i.latency_us = 12.0;
    i.stock_rps = 60_000.0;
    let p = predict(&i);
    assert!(p.stop.is_some());
}

#[test]
fn stock_formulas() {
    let i = base();
    let p = predict(&i);
    // Blocking: min(P / (c + 2X), N / (L + c + X)).
    let want = (1e6 / 15.0f64).min(64e6 / 213.5);
    assert!(close(p.stock_model_rps, want), "{}", p.stock_model_rps);
}

#[test]
fn walls_get_no_zero_edit_prediction() {
    for (kind, word) in [
        (Kind::BelowLibcWall, "below"),
        (Kind::BesideWall, "beside"),
        (Kind::NotDynamic, "statically"),
    ] {
        let a = assess(kind, Some(&base()), "mariadbd", None);
        assert!(
            a.zero_edit.is_none() && a.zero_edit_speedup.is_none(),
            "{kind:?}"
        );
        assert!(
            a.stop.as_deref().unwrap().contains(word),
            "{kind:?}: {:?}",
            a.stop
        );
    }
}

#[test]
fn event_loop_gets_one_and_a_recipe() {
    let mut i = base();
    // One loop thread makes the offload calls; 50 clients are connected to it.
    i.connections = 1.0;
    i.client_connections = Some(50.0);
    i.stock_rps = 1e6 / 212.0;
    let a = assess(Kind::EventLoop, Some(&i), "/usr/bin/redis-server", None);
    assert_eq!(a.zero_edit_speedup, Some(1.0));
    let r = a.recipe.as_ref().unwrap();
    assert_eq!((r.lines_added, r.lines_modified), (83, 0));
    // The reroute keeps 50 requests in flight on one loop: bound by the loop's CPU,
    // 12 us less its blocking sleep (2 switches of 1.5 us) plus a worker's hand-off
    // (2 more, 3 us), as the paper's recipes do it.
    let f = recipes::predicted_speedup(&i, 1.0, 3.0);
    assert!(close(f.rps, 1e6 / 12.0), "{f:?}");
    assert!(
        close(f.kept_cpu_us, 9.0) && close(f.completion_us, 3.0),
        "{f:?}"
    );
    // The assessment uses the recipe's own completion cost.
    let done = r.completion_us(i.switch_us);
    let f = recipes::predicted_speedup(&i, 1.0, done);
    assert!(close(a.recipe_speedup.unwrap(), f.speedup));
    assert_eq!(a.recipe_completion_us, Some(done));
    assert!(a.recipe_text.unwrap().contains("+83 lines"));
    // Counted by its one offload thread instead, the loop would keep one in flight,
    // each request its offload, its CPU and the round trip to its idle client.
    i.client_connections = None;
    let f = recipes::predicted_speedup(&i, 1.0, 3.0);
    assert!(
        close(f.rps, 1e6 / (212.0 + CROSS_CPU_ROUND_TRIP_US)),
        "{f:?}"
    );
    // Where the window shows the loop's own CPU per request apart from its per-second
    // work (inputs.rs), the reroute pays that: 7 us less the sleep plus the hand-off;
    // 50 requests in flight come within a percent of that CPU's ceiling.
    let near_ceiling = |rps: f64, c: f64, within: f64| rps <= 1e6 / c && rps >= within * 1e6 / c;
    i.client_connections = Some(50.0);
    i.reroute_cpu_us = Some(7.0);
    let f = recipes::predicted_speedup(&i, 1.0, 3.0);
    assert!(near_ceiling(f.rps, 7.0, 0.99), "{f:?}");
    // Every answer woke an idle client CPU at 2 us: the rerouted loop, its clients
    // kept busy, does not pay that; the backend's threads' 1.5 us it does.
    i.peer_idle_wakes_per_request = 1.0;
    i.idle_wake_us = 2.0;
    i.backend_cpu_us = 1.5;
    let f = recipes::predicted_speedup(&i, 1.0, 3.0);
    assert!(near_ceiling(f.rps, 6.5, 0.98), "{f:?}");
}

#[test]
fn a_reroute_near_its_knee_queues() {
    // 64 clients on a 1000 us offload, 15 us of loop CPU each: min(CPU, overlap) says
    // 64 / 1065 us = 60.1k/s (the round trip to the client included), with the loop
    // 90% busy there, so requests wait for it: the mean value analysis says less.
    let mut i = base();
    i.connections = 1.0;
    i.client_connections = Some(64.0);
    i.latency_us = 1000.0;
    i.spin = true;
    i.reroute_cpu_us = Some(15.0);
    i.stock_rps = 1e6 / 1015.0;
    let f = recipes::predicted_speedup(&i, 1.0, 0.0);
    let bound = 64e6 / (1000.0 + 15.0 + CROSS_CPU_ROUND_TRIP_US);
    assert!(
        f.rps < 0.97 * bound && f.rps > 0.85 * bound,
        "{f:?} vs {bound}"
    );
    assert!(close(f.speedup, f.rps / i.stock_rps));
    // Far from it (8 clients), the loop hardly queues: the overlap bound holds.
    i.client_connections = Some(8.0);
    let f = recipes::predicted_speedup(&i, 1.0, 0.0);
    let bound = 8e6 / (1000.0 + 15.0 + CROSS_CPU_ROUND_TRIP_US);
    assert!(f.rps <= bound && f.rps > 0.99 * bound, "{f:?} vs {bound}");
}

#[test]
fn only_the_papers_recipes_hand_off_to_a_worker() {
    // memcached's recipe is the paper's alone: two switches; nginx's ships with
    // toffload, its completion fd in nginx's own loop: none.
    let m = recipes::lookup("memcached", None).unwrap();
    assert_eq!(m.completion_us(2.5), 5.0);
    let n = recipes::lookup("nginx", None).unwrap();
    assert!(n.shipped.is_some());
    assert_eq!(n.completion_us(2.5), 0.0);
}

#[test]
fn recipes_are_found_by_name_and_runtime() {
    assert_eq!(recipes::lookup("nginx", None).unwrap().lines_added, 112);
    assert_eq!(
        recipes::lookup("/usr/bin/python3.11", None)
            .unwrap()
            .lines_added,
        22
    );
    assert_eq!(
        recipes::lookup("memcached", None).unwrap().lines_modified,
        1
    );
    assert_eq!(
        recipes::lookup("mariadbd", None).unwrap().server,
        "MariaDB 10.6"
    );
    assert_eq!(
        recipes::lookup("myservice", Some(RuntimeKind::Go))
            .unwrap()
            .server,
        "Go 1.18"
    );
    assert!(recipes::lookup("conn_server", Some(RuntimeKind::GlibcDynamic)).is_none());
}

#[test]
fn lines_show_every_input() {
    let p = predict(&base());
    let text: String = p.lines().iter().map(|(k, v)| format!("{k}={v};")).collect();
    for want in [
        "75000 req/s",
        "200.0 us",
        "12.0 us",
        "64 conns",
        "1.50 us",
        "Z outside",
    ] {
        assert!(text.contains(want), "{want} missing in {text}");
    }
}

/// The probes' cost leaves c, and the stock rate rises by what the stock formulas say
/// that cost took: fully where the CPU binds the stock server, not where its
/// connections do.
#[test]
fn the_watch_cost_is_taken_out() {
    let mut i = base();
    i.watch_us_per_request = 4.0;
    let p = predict(&i);
    let cf = 12.0 - 4.0 - 3.0 + runtime_overhead_us(YIELDS_PER_REQUEST);
    assert!(close(p.fiber_cpu_us, cf), "{}", p.fiber_cpu_us);
    // Stock, one core, blocking: bound by the CPU, 1 / (c + 2X).
    let scale = (12.0 + 3.0) / (8.0 + 3.0);
    assert!(close(p.stock_rps, 75_000.0 * scale), "{}", p.stock_rps);
    assert!(close(p.speedup, p.fiber_rps / (75_000.0 * scale)));
    // Eight connections of a 2 ms offload on 8 cores: bound by the connections, and
    // 4 us of 2 ms moves the stock rate by a fraction of a percent only.
    let mut j = base();
    j.connections = 8.0;
    j.cores = 8.0;
    j.latency_us = 2000.0;
    j.watch_us_per_request = 4.0;
    j.stock_rps = 3_900.0;
    let q = predict(&j);
    assert!(
        q.stock_rps > 3_900.0 && q.stock_rps < 3_900.0 * 1.003,
        "{}",
        q.stock_rps
    );
    // Unknown cost: nothing changes.
    let r = predict(&base());
    assert!(close(r.stock_rps, 75_000.0));
    // Measured between bursts: the untraced rate and CPU are taken as they are.
    let mut k = base();
    k.watch_us_per_request = 4.0;
    k.stock_rps = 50_000.0;
    k.stock_rps_untraced = Some(72_000.0);
    k.cpu_untraced_us = Some(12.5);
    let u = predict(&k);
    assert!(close(u.stock_rps, 72_000.0));
    let cf = 12.5 - 3.0 + runtime_overhead_us(YIELDS_PER_REQUEST);
    assert!(close(u.fiber_cpu_us, cf), "{}", u.fiber_cpu_us);
    assert!(close(u.speedup, u.fiber_rps / 72_000.0));
    // A spinning wait's c is the part outside the offload: the untraced CPU, spin and
    // all, is not it.
    k.spin = true;
    let s = predict(&k);
    assert!(close(
        s.fiber_cpu_us,
        12.0 - 4.0 - 3.0 + runtime_overhead_us(YIELDS_PER_REQUEST)
    ));
}

/// Z, the time outside the server, is fitted on the stock loop and spent by the
/// fibers' loop too: a loop bound by its connections and Z gains nothing from fibers.
#[test]
fn think_time_is_fitted_on_the_stock_loop() {
    // 64 connections, 2 ms device, 20 us CPU on one core, 150 us outside.
    let (n, c, l) = (64.0, 20.0, 2000.0);
    let rate = closed_loop_rps(n, c, 1.0, l, None, 150.0);
    let z = think_time_us(n, c, 1.0, l, None, rate);
    assert!((z - 150.0).abs() < 0.5, "{z}");
    let mut i = base();
    i.latency_us = l;
    i.cpu_per_request_us = c;
    i.stock_rps = rate;
    let p = predict(&i);
    assert!((p.think_us - 150.0).abs() < 0.5, "{}", p.think_us);
    // Without Z the fibers' 64 connections would make about 64 / (2 ms + c_f), a
    // gain the stock loop rules out.
    let without = closed_loop_rps(n, p.fiber_cpu_us, 1.0, l, None, 0.0) / rate;
    assert!(without > 1.05, "{without}");
    assert!(p.speedup < 1.02, "{}", p.speedup);
    assert_eq!(p.binding, Ceiling::Overlap);
    // A saturated station says nothing of Z: the CPU (1 / 12 us at 75,000/s) ...
    assert_eq!(think_time_us(64.0, 12.0, 1.0, 200.0, None, 75_000.0), 0.0);
    // ... or the device (8 lanes of 1 ms at 7,990/s).
    assert_eq!(
        think_time_us(64.0, 12.0, 1.0, 1000.0, Some(8.0), 7_990.0),
        0.0
    );
    // A stock rate above what the stations allow: no Z (the model's c is high).
    assert_eq!(think_time_us(4.0, 12.0, 1.0, 1000.0, None, 4_000.0), 0.0);
    // 64 connections of a 20 us offload at 20 us CPU would saturate the core alone:
    // a stock rate 20% short of that (80% busy) is waste, not time outside.
    assert_eq!(think_time_us(64.0, 20.0, 1.0, 20.0, None, 40_000.0), 0.0);
    // A spinning server's loop is its spinners', which never idle: Z is not fitted,
    // and the fibers' loop, which idles between requests, pays the cross-CPU round
    // trip on each.
    i.spin = true;
    i.stock_rps = 270.0;
    assert_eq!(predict(&i).think_us, CROSS_CPU_ROUND_TRIP_US);
}

/// Eight spinners of a 500 us offload: the fibers' loop is bound by its connections,
/// each request's cycle the latency, its CPU and the round trip between the client's
/// CPU and the idle carrier's; without the round trip the cycle would be 50 us short.
#[test]
fn a_spinning_loop_bound_by_its_connections_pays_the_round_trip() {
    let mut i = base();
    i.spin = true;
    i.connections = 8.0;
    i.latency_us = 500.0;
    i.stock_rps = 1_600.0;
    i.blocking_switches_per_request = 1.0;
    let p = predict(&i);
    assert_eq!(p.binding, Ceiling::Overlap);
    let cycle = 500.0 + p.fiber_cpu_us + CROSS_CPU_ROUND_TRIP_US;
    assert!(
        close(p.overlap_ceiling_rps, 8e6 / cycle),
        "{}",
        p.overlap_ceiling_rps
    );
    assert!(p.fiber_rps <= 8e6 / cycle * (1.0 + 1e-9), "{}", p.fiber_rps);
    assert!(p.fiber_rps > 0.95 * 8e6 / cycle, "{}", p.fiber_rps);
    assert!(p
        .lines()
        .iter()
        .any(|(k, v)| k == "Z outside" && v.contains("cross-CPU round trip")));
}

/// The closed loop's rate: one connection is one request at a time; many
/// connections reach the carriers' ceiling; at the knee (connections just covering
/// the latency) queueing keeps the rate clearly below both asymptotes; a device with
/// fewer lanes than connections queues too.
#[test]
fn closed_loop_queueing() {
    let (c, l) = (20.0, 1000.0);
    assert!(close(
        closed_loop_rps(1.0, c, 1.0, l, None, 0.0),
        1e6 / (l + c)
    ));
    let deep = closed_loop_rps(1000.0, c, 1.0, l, None, 0.0);
    assert!(deep <= 1e6 / c && deep > 0.999 * 1e6 / c, "{deep}");
    // The knee: N = (L + c) / c = 51 connections.
    let knee = closed_loop_rps(51.0, c, 1.0, l, None, 0.0);
    let asymptote = (1e6 / c).min(51e6 / (l + c));
    assert!(
        knee < 0.95 * asymptote && knee > 0.7 * asymptote,
        "{knee} vs {asymptote}"
    );
    // More connections never lower the rate.
    let mut last = 0.0;
    for n in [1.0, 2.0, 8.0, 32.0, 64.0, 128.0] {
        let x = closed_loop_rps(n, c, 1.0, l, None, 0.0);
        assert!(x >= last, "{n}: {x} < {last}");
        last = x;
    }
    // Two carriers: twice the CPU ceiling, deep in the queue.
    let two = closed_loop_rps(1000.0, c, 2.0, l, None, 0.0);
    assert!(two > 0.99 * 2e6 / c && two <= 2e6 / c, "{two}");
    // Four lanes of 1 ms with 64 connections: the device's 4,000/s.
    let dev = closed_loop_rps(64.0, 1.0, 1.0, l, Some(4.0), 0.0);
    assert!(dev > 0.99 * 4000.0 && dev <= 4000.0, "{dev}");
}

/// A sleep's cost read in a traced window carries most of the watch's cost: where the
/// untraced CPU shows how much the watch added, that cost per sleep comes off it.
#[test]
fn the_watchs_measured_cost_comes_off_the_sleeps_cost() {
    let mut i = base();
    i.cpu_per_request_us = 30.0;
    i.sleep_cost_us = Some(6.0);
    i.switch_us = 1.0;
    // Traced: c_f = c - 2 sleeps x 6 us (less the calibrated 0 us of watch).
    let traced = predict(&i).fiber_cpu_us;
    assert!(close(
        traced,
        30.0 - 12.0 + runtime_overhead_us(YIELDS_PER_REQUEST)
    ));
    // Untraced c of 24 us: the watch cost 6 us per request, 3 us per sleep, and a
    // sleep 6 - 3 = 3 us.
    i.cpu_untraced_us = Some(24.0);
    i.stock_rps_untraced = Some(36_000.0);
    let p = predict(&i);
    assert!(
        close(
            p.fiber_cpu_us,
            24.0 - 6.0 + runtime_overhead_us(YIELDS_PER_REQUEST)
        ),
        "{}",
        p.fiber_cpu_us
    );
    // The lines show the X taken.
    assert!(close(p.switch_cost_us, 3.0));
    let text: String = p.lines().iter().map(|(k, v)| format!("{k}={v};")).collect();
    assert!(text.contains("x 3.00 us (its sleeps' cost)"), "{text}");
    // Never below the calibrated switch cost.
    i.switch_us = 5.0;
    assert!(close(
        predict(&i).fiber_cpu_us,
        24.0 - 10.0 + runtime_overhead_us(YIELDS_PER_REQUEST)
    ));
}

#[test]
fn a_spinners_sleep_for_its_next_request_comes_off_at_its_cost() {
    // 64 spinners: c 24 us outside the offload, one sleep per request (the read that
    // waits for the next one) measured at 11 us, well above the calibrated 1.5.
    let mut i = base();
    i.spin = true;
    i.stock_rps = 250.0;
    i.cpu_per_request_us = 24.0;
    i.blocking_switches_per_request = 1.0;
    i.preemptions_per_request = 1.0;
    let calibrated = predict(&i).fiber_cpu_us;
    assert!(close(
        calibrated,
        24.0 - 1.5 + runtime_overhead_us(YIELDS_PER_REQUEST)
    ));
    i.sleep_cost_us = Some(11.0);
    let p = predict(&i);
    // The preemption lands inside the spin: only the sleep comes off.
    assert!(
        close(
            p.fiber_cpu_us,
            24.0 - 11.0 + runtime_overhead_us(YIELDS_PER_REQUEST)
        ),
        "{}",
        p.fiber_cpu_us
    );
    assert!(close(p.switch_cost_us, 11.0));
    let mut j = i.clone();
    j.sleep_cost_us = None;
    assert!(p.speedup > 1.5 * predict(&j).speedup);
    // The lines say which c it is.
    i.cpu_warm_quartile = true;
    let text: String = predict(&i)
        .lines()
        .iter()
        .map(|(k, v)| format!("{k}={v};"))
        .collect();
    assert!(text.contains("spin wait, warm quartile"), "{text}");
}

#[test]
fn the_hypervisors_steal_comes_off_the_fibers_cpu() {
    // The stock rate was measured on cores the host took 11% of: the fibers get no
    // more of them.
    let full = predict(&base());
    let mut i = base();
    i.cpu_available = 0.89;
    let p = predict(&i);
    assert_eq!(p.binding, Ceiling::Cpu);
    assert!(close(p.fiber_cpu_us, full.fiber_cpu_us));
    assert!(close(p.cpu_ceiling_rps, 0.89 * full.cpu_ceiling_rps));
    assert!(close(p.speedup, 0.89 * full.speedup), "{}", p.speedup);
    let text: String = p.lines().iter().map(|(k, v)| format!("{k}={v};")).collect();
    assert!(
        text.contains("1 cores (11% stolen by the hypervisor)"),
        "{text}"
    );
}

/// Z measured in the kernel (the reads' sleep for the next request) is shown beside the
/// fitted one and changes nothing: it moved 60 us-2.4 ms between windows of one point.
#[test]
fn measured_think_time_is_shown_not_used() {
    let mut i = base();
    i.latency_us = 1000.0;
    i.stock_rps = 60_000.0;
    let fitted = predict(&i);
    i.outside_wait_us = Some(300.0);
    let p = predict(&i);
    assert_eq!(p.think_us, fitted.think_us);
    assert_eq!(p.fiber_rps, fitted.fiber_rps);
    assert!(p
        .lines()
        .iter()
        .any(|(k, v)| k == "Z outside" && v.contains("slept 300.0 us/req (measured, not used)")));
    assert!(!fitted
        .lines()
        .iter()
        .any(|(k, v)| k == "Z outside" && v.contains("measured")));
}

#[test]
fn shipped_integrations_are_named_with_what_their_results_file_measured() {
    for (cmd, rt, path) in [
        ("/usr/bin/redis-server", None, "backends/integrations/redis"),
        ("/usr/sbin/nginx", None, "backends/integrations/nginx"),
        ("python3.11", None, "backends/integrations/python"),
        (
            "myservice",
            Some(RuntimeKind::Go),
            "backends/integrations/go",
        ),
    ] {
        let r = recipes::lookup(cmd, rt).unwrap();
        let sh = r.shipped.unwrap_or_else(|| panic!("{cmd}: no integration"));
        assert_eq!(sh.path, path);
        let rows = sh.measured();
        let lats: Vec<f64> = rows.iter().map(|r| r.0).collect();
        assert_eq!(lats, [50.0, 200.0, 1000.0], "{cmd}: rows of {}", sh.results);
        assert!(rows.iter().all(|r| r.1 > 0.0), "{rows:?}");
        // The row nearest the watched latency, on a log scale.
        assert_eq!(sh.nearest(Some(700.0)).unwrap().0, 1000.0);
        assert_eq!(sh.nearest(Some(90.0)).unwrap().0, 50.0);
        assert_eq!(sh.nearest(None).unwrap().0, 1000.0);
        let (lat, x) = sh.nearest(Some(180.0)).unwrap();
        let text = recipes::describe(&r, Some(2.0), Some(180.0));
        assert!(
            text.contains(path) && text.contains(&format!("measured {x:.2}x at {lat:.0} us")),
            "{text}"
        );
    }
    // The file's own numbers: the Go table's last speedup column is the reroute's.
    let go = recipes::lookup("x", Some(RuntimeKind::Go))
        .unwrap()
        .shipped
        .unwrap();
    let text = include_str!("../../../../tests/results/reroute-go.md");
    let row = text.lines().find(|l| l.starts_with("| 1000 |")).unwrap();
    let last_x = row
        .split('|')
        .rev()
        .find(|c| c.trim().ends_with('x'))
        .unwrap();
    let want: f64 = last_x.trim().trim_end_matches('x').parse().unwrap();
    assert_eq!(go.nearest(Some(1000.0)).unwrap().1, want);
    // No integration: no claim.
    let m = recipes::lookup("memcached", None).unwrap();
    assert!(m.shipped.is_none());
    assert!(!recipes::describe(&m, None, Some(200.0)).contains("ships"));
}

#[test]
fn a_reroute_takes_out_each_sleep_at_what_it_cost_the_server() {
    // A one-at-a-time handler that blocks: 50 us of its CPU a request with one sleep,
    // against a calibrated switch of 1.5 us.
    let mut i = base();
    i.connections = 1.0;
    i.client_connections = Some(64.0);
    i.reroute_cpu_us = Some(50.0);
    i.blocking_switches_per_request = 1.0;
    let kept = |i: &Inputs| recipes::predicted_speedup(i, 1.0, 0.0).kept_cpu_us;
    assert!(close(kept(&i), 48.5), "{}", kept(&i));
    // The window shows each sleep cost it 14 us (Go's scheduler handing its P over
    // and waking a thread): the rerouted loop, which does not sleep per request,
    // keeps 36.
    i.sleep_cost_us = Some(14.0);
    assert!(close(kept(&i), 36.0), "{}", kept(&i));
    // A spinning wait has no sleep in its c to take out.
    i.spin = true;
    assert!(close(kept(&i), 50.0), "{}", kept(&i));
}

/// hsm_server-like: 64 threads whose vendor call sleeps in 20 us slices, 1.4 times a
/// call; the stock core pays 23 us a request, far more than 2.45 switches at X.
fn vendor_sleeper() -> Inputs {
    Inputs {
        stock_rps: 43_000.0,
        latency_us: 300.0,
        cpu_per_request_us: 23.0,
        switch_us: 3.4,
        blocking_switches_per_request: 2.45,
        sleep_cost_us: Some(2.4),
        sleeps_per_call: 1.4,
        outside_cpu_warm_us: Some(5.2),
        ..base()
    }
}

#[test]
fn c_f_is_the_requests_own_work_where_the_sleeps_cost_more_than_switches() {
    let i = vendor_sleeper();
    let p = predict(&i);
    // Less blocking: 23 - 2.45 x 3.4 + 2 yields. From the work: 5.2 outside, and the
    // offload's calls (2.4 x 1.4 on CPU, all of it its sleeps at X) at one yield.
    let stock = 23.0 - 2.45 * 3.4 + runtime_overhead_us(YIELDS_PER_REQUEST);
    let work = 5.2 + runtime_overhead_us(1.0);
    assert!(
        close(p.fiber_cpu_stock_us, stock),
        "{}",
        p.fiber_cpu_stock_us
    );
    assert!(close(p.fiber_cpu_us, work), "{}", p.fiber_cpu_us);
    assert_eq!(p.fiber_cpu_source, FiberCpuSource::RequestWork);
    // Without the warm quartile the model is what it was: c less blocking.
    let q = predict(&Inputs {
        outside_cpu_warm_us: None,
        ..i.clone()
    });
    assert!(close(q.fiber_cpu_us, stock));
    assert_eq!(q.fiber_cpu_source, FiberCpuSource::StockLessBlocking);
    assert!(
        p.speedup > 2.0 * q.speedup,
        "{} vs {}",
        p.speedup,
        q.speedup
    );
}

#[test]
fn request_work_keeps_what_the_offload_call_itself_computes() {
    // A vendor call that works 10 us on the CPU around its one sleep: the fibers do
    // that work too (not at X, which here is that whole CPU per sleep).
    let i = Inputs {
        cpu_per_request_us: 60.0,
        sleep_cost_us: Some(13.4),
        sleeps_per_call: 1.0,
        ..vendor_sleeper()
    };
    let p = predict(&i);
    assert!(
        close(p.fiber_cpu_us, 5.2 + (13.4 - 3.4)),
        "{}",
        p.fiber_cpu_us
    );
    assert_eq!(p.fiber_cpu_source, FiberCpuSource::RequestWork);
}

#[test]
fn c_less_blocking_stays_unless_the_work_is_clearly_lower() {
    // conn_server-like: c less blocking is 12 - 3 + 2.5 = 11.5 us. Work above it, or
    // below it by less than a quarter (the two estimates' noise), leaves it; a spinning
    // wait never takes the other.
    let stock = predict(&base()).fiber_cpu_us;
    for warm in [11.0, 0.8 * stock - runtime_overhead_us(1.0)] {
        let p = predict(&Inputs {
            outside_cpu_warm_us: Some(warm),
            sleep_cost_us: Some(1.5),
            ..base()
        });
        assert_eq!(
            p.fiber_cpu_source,
            FiberCpuSource::StockLessBlocking,
            "{warm}"
        );
        assert!(close(p.fiber_cpu_us, stock));
    }
    let p = predict(&Inputs {
        outside_cpu_warm_us: Some(0.7 * stock - runtime_overhead_us(1.0)),
        sleep_cost_us: Some(1.5),
        ..base()
    });
    assert_eq!(p.fiber_cpu_source, FiberCpuSource::RequestWork);
    assert!(close(p.fiber_cpu_us, 0.7 * stock));
    let s = predict(&Inputs {
        spin: true,
        outside_cpu_warm_us: Some(0.5),
        sleep_cost_us: Some(0.5),
        ..base()
    });
    assert_eq!(s.fiber_cpu_source, FiberCpuSource::StockLessBlocking);
}
