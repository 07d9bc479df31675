//! Minimal-edit recipes for servers the model recognises: where the offload is moved
//! off the request path, what it costs in code (the paper's Table 1, lines added +
//! modified) and the speedup predicted for this server's own numbers.
//!
//! The prediction for a reroute uses the same terms as the fiber model, with the
//! reroute's own completion path (a hand-off to a worker, two context switches, or
//! none where the completion fd sits in the server's own loop) in place of a fiber's
//! park and resume: the event loop keeps serving while N requests wait on the device.

use super::{closed_loop_rps, Inputs, CROSS_CPU_ROUND_TRIP_US};
use crate::target::RuntimeKind;
use serde::Serialize;

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Recipe {
    pub server: &'static str,
    /// Where the offload moves.
    pub integration: &'static str,
    pub lines_added: u32,
    pub lines_modified: u32,
    /// The paper's measured speedup (1 MiB GPU AES), for reference.
    pub paper_speedup: f64,
    pub note: &'static str,
    /// The integration toffload ships for this server, if any.
    pub shipped: Option<&'static Shipped>,
}

/// An integration in backends/integrations, with the results its benchmark committed
/// (`cargo xtask bench reroute`), read from the results file itself so that the
/// numbers shown are the file's.
#[derive(Debug, Serialize, PartialEq)]
pub struct Shipped {
    /// Its folder in the repository.
    pub path: &'static str,
    /// How it is built and loaded, in a few words.
    pub how: &'static str,
    /// The results file its benchmark writes.
    pub results: &'static str,
    #[serde(skip)]
    results_text: &'static str,
}

impl Shipped {
    /// (offload us, measured speedup of the rerouted form) per row of the results
    /// table: the first cell, and the last cell that reads as a speedup (`12.3x`).
    pub fn measured(&self) -> Vec<(f64, f64)> {
        self.results_text
            .lines()
            .filter(|l| l.starts_with('|'))
            .filter_map(|l| {
                let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
                let lat: f64 = cells.first()?.parse().ok()?;
                let x = cells
                    .iter()
                    .rev()
                    .find_map(|c| c.strip_suffix('x')?.parse::<f64>().ok())?;
                Some((lat, x))
            })
            .collect()
    }

    /// The measured row nearest `latency_us` (on a log scale), or the largest.
    pub fn nearest(&self, latency_us: Option<f64>) -> Option<(f64, f64)> {
        let rows = self.measured();
        let dist = |l: f64| match latency_us {
            Some(w) if w > 0.0 && l > 0.0 => (l / w).ln().abs(),
            _ => -l,
        };
        rows.into_iter()
            .min_by(|a, b| dist(a.0).total_cmp(&dist(b.0)))
    }
}

const REDIS: Shipped = Shipped {
    path: "backends/integrations/redis",
    how: "cargo xtask build: integrations/redis/toffload_redis.so, for --loadmodule; ACCEL.ASYNC",
    results: "tests/results/reroute.md",
    results_text: include_str!("../../../../tests/results/reroute.md"),
};
const NGINX: Shipped = Shipped {
    path: "backends/integrations/nginx",
    how: "cargo xtask build with nginx-dev: integrations/nginx/, for load_module; toffload_accel async",
    results: "tests/results/reroute-nginx.md",
    results_text: include_str!("../../../../tests/results/reroute-nginx.md"),
};
const PYTHON: Shipped = Shipped {
    path: "backends/integrations/python",
    how: "toffload_asyncio.Accel: await accel.run(data)",
    results: "tests/results/reroute-python.md",
    results_text: include_str!("../../../../tests/results/reroute-python.md"),
};
const GO_SHIPPED: Shipped = Shipped {
    path: "backends/integrations/go",
    how: "cgo; the completion fd in Go's netpoller (or plain blocking cgo)",
    results: "tests/results/reroute-go.md",
    results_text: include_str!("../../../../tests/results/reroute-go.md"),
};

const fn r(
    server: &'static str,
    integration: &'static str,
    lines_added: u32,
    lines_modified: u32,
    paper_speedup: f64,
    note: &'static str,
) -> Recipe {
    Recipe {
        server,
        integration,
        lines_added,
        lines_modified,
        paper_speedup,
        note,
        shipped: None,
    }
}

const fn shipped(recipe: Recipe, s: &'static Shipped) -> Recipe {
    Recipe {
        shipped: Some(s),
        ..recipe
    }
}

/// (executable names, recipe). Names are matched against the command's basename.
const TABLE: &[(&[&str], Recipe)] = &[
    (
        &["redis-server", "redis-check-rdb"],
        shipped(
            r(
                "Redis 6.0",
                "module with RedisModule_BlockClient",
                83,
                0,
                3.01,
                "",
            ),
            &REDIS,
        ),
    ),
    (
        &["node", "nodejs"],
        r(
            "Node.js 22",
            "N-API addon queuing on the libuv pool",
            34,
            0,
            2.54,
            "",
        ),
    ),
    (
        &["python", "python3", "uwsgi", "gunicorn"],
        shipped(
            r(
                "Python 3.10",
                "loop.run_in_executor around the call",
                22,
                0,
                2.37,
                "",
            ),
            &PYTHON,
        ),
    ),
    (
        &["nginx"],
        shipped(
            r(
                "nginx 1.18",
                "thread-pool module (ngx_thread_task_post)",
                112,
                0,
                2.74,
                "",
            ),
            &NGINX,
        ),
    ),
    (
        &["memcached"],
        r(
            "memcached 1.6",
            "state-machine patch: park the connection, resume on completion",
            70,
            1,
            2.93,
            "",
        ),
    ),
    (
        &["apache2", "httpd"],
        r(
            "Apache 2.4",
            "module hooking the handler (MPM worker threads)",
            27,
            0,
            3.45,
            "",
        ),
    ),
    (
        &["haproxy"],
        r("HAProxy 2.4", "SPOE filter + C agent", 138, 0, 2.10, ""),
    ),
    (
        &["postgres", "postmaster"],
        r(
            "PostgreSQL 14",
            "C extension",
            42,
            0,
            2.59,
            "intra-query: overlaps offloads within one query",
        ),
    ),
    (
        &["mariadbd", "mysqld", "mariadb"],
        r(
            "MariaDB 10.6",
            "user-defined function (UDF)",
            34,
            0,
            2.59,
            "intra-query: overlaps offloads within one query",
        ),
    ),
];

const GO: Recipe = shipped(
    r(
        "Go 1.18",
        "blocking cgo call in a goroutine",
        28,
        0,
        3.01,
        "",
    ),
    &GO_SHIPPED,
);

/// The recipe for a command (its basename) and runtime, if the model knows one.
pub fn lookup(command: &str, runtime: Option<RuntimeKind>) -> Option<Recipe> {
    let base = command.rsplit('/').next().unwrap_or(command);
    // "python3.11" is python; "redis-server *:6379" as comm shows only the name.
    let stem = base.trim_end_matches(|c: char| c.is_ascii_digit() || c == '.');
    for (names, recipe) in TABLE {
        if names.iter().any(|n| *n == base || *n == stem) {
            return Some(recipe.clone());
        }
    }
    (runtime == Some(RuntimeKind::Go)).then_some(GO)
}

impl Recipe {
    /// What the reroute's completion path costs per request besides the loop's and
    /// the backend's CPU, us, with `switch_us` a context switch. The paper's recipes
    /// hand each offload to a worker thread and back: two switches. toffload's
    /// shipped integrations put the backend's completion fd in the server's own loop,
    /// which a busy loop reads many completions per wake-up from (nginx at 50 us,
    /// rerouted: 0.2 switches a request, the backend's thread's included); their own
    /// suspend and resume (a blocked client unblocked, a future resolved), measured
    /// once as the rerouted form's CPU at a 100 us offload less what the model keeps,
    /// came to 1.7 us for redis and nothing past the estimate's noise for nginx, Python
    /// and Go: not modelled.
    pub fn completion_us(&self, switch_us: f64) -> f64 {
        match self.shipped {
            Some(_) => 0.0,
            None => 2.0 * switch_us.max(0.0),
        }
    }
}

/// The reroute's prediction for one server.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Forecast {
    /// Requests/s and the speedup over the stock rate.
    pub rps: f64,
    pub speedup: f64,
    /// The CPU per request the rerouted loop keeps from the stock one (its own, less
    /// the idle wake-ups, plus the backend's threads'), us.
    pub kept_cpu_us: f64,
    /// The completion path's, us (Recipe::completion_us).
    pub completion_us: f64,
}

/// The reroute's predicted throughput and speedup: the event loop's own CPU per request
/// (`reroute_cpu_us`), less the idle client wake-ups it no longer pays, plus the
/// backend's own threads' CPU and the completion path's `completion_us`, on `loops`
/// threads; as many requests in flight as there are client connections (the offload
/// threads where the sockets were not seen: a thread-per-connection server's), each
/// also spending the cross-CPU round trip to its client.
pub fn predicted_speedup(i: &Inputs, loops: f64, completion_us: f64) -> Forecast {
    // A blocking wait's c holds the loop's own sleep per request (its switches), which
    // the rerouted loop, waiting in its poll for many completions at once, no longer
    // pays: taken out as the zero-edit model takes it out of the fibers' CPU, each at
    // what one of this server's sleeps costs it where the window shows that (a Go
    // handler's: 12-23 us, its scheduler handing the P and waking an M, against the
    // calibration's 2.7 us switch).
    let blocking = if i.spin {
        0.0
    } else {
        i.blocking_switches_per_request.max(0.0) * super::switch_cost_of(i)
    };
    // The loop's own CPU per request, as the rerouted loop pays it (inputs.rs): without
    // the per-second work of its idle threads and its timers, which a synchronous loop
    // spreads over few requests.
    let own = i.reroute_cpu_us.unwrap_or(i.cpu_per_request_us).max(0.0);
    // Each answer that woke an idle client CPU cost the stock loop that CPU's
    // interrupt (7 us a wake in this kind of VM, a third of nginx's request); the
    // rerouted loop answers clients its own speed keeps busy, whose wake-ups are
    // cheap. A backend's own threads on the same cores work per offload, and the
    // rerouted loop keeps that work.
    let idle_wakes = i.peer_idle_wakes_per_request.max(0.0) * i.idle_wake_us.max(0.0);
    let kept = (own - blocking - idle_wakes).max(0.0) + i.backend_cpu_us.max(0.0);
    let completion_us = completion_us.max(0.0);
    let c = kept + completion_us;
    let loops = loops.clamp(1.0, i.cores.max(1.0));
    let l = i.latency_us.max(0.0);
    let cpu = loops * 1e6 / c.max(1e-3);
    let in_flight = i.client_connections.unwrap_or(i.connections).max(1.0);
    // Each request also spends the round trip to its client outside the loop, and
    // where the loop is not saturated its CPUs idle between requests, so that trip
    // costs the wake-ups of idle CPUs, as in the fibers' loop (mod.rs). Near the knee
    // requests queue for the loop's CPU and the device's lanes: the same mean value
    // analysis as the zero-edit model's, which min(CPU, overlap) overstates there.
    let think = CROSS_CPU_ROUND_TRIP_US;
    let overlap = in_flight * 1e6 / (l + c + think).max(1e-3);
    let lanes = i.device_rps.map(|d| (d * l / 1e6).max(1.0));
    let mut t = closed_loop_rps(in_flight, c, loops, l, lanes, think)
        .min(cpu)
        .min(overlap);
    if let Some(d) = i.device_rps {
        t = t.min(d);
    }
    Forecast {
        rps: t,
        speedup: t / i.stock_rps_untraced.unwrap_or(i.stock_rps).max(1e-9),
        kept_cpu_us: kept,
        completion_us,
    }
}

/// One line for reports; with a shipped integration, where it is and what it
/// measured at the offload latency nearest `latency_us`.
pub fn describe(r: &Recipe, predicted: Option<f64>, latency_us: Option<f64>) -> String {
    let mut s = format!(
        "{}: {} (+{} lines, {} modified; paper {:.2}x at 1 MiB GPU AES",
        r.server, r.integration, r.lines_added, r.lines_modified, r.paper_speedup
    );
    if let Some(p) = predicted {
        s += &format!("; here {p:.2}x");
    }
    s.push(')');
    if !r.note.is_empty() {
        s += &format!(" [{}]", r.note);
    }
    if let Some(sh) = r.shipped {
        s += &format!("; toffload ships it: {} ({}", sh.path, sh.how);
        if let Some((lat, x)) = sh.nearest(latency_us) {
            s += &format!("; measured {x:.2}x at {lat:.0} us, {}", sh.results);
        }
        s.push(')');
    }
    s
}
