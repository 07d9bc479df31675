//! Minimal-edit recipes for servers the model recognises: where the offload is moved
//! off the request path, what it costs in code (the paper's Table 1, lines added +
//! modified) and the speedup predicted for this server's own numbers.
//!
//! The prediction for a reroute uses the same terms as the fiber model, with a
//! hand-off to a worker (two context switches) in place of a fiber's park and resume:
//! the event loop keeps serving while N requests wait on the device.

use super::Inputs;
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
}

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
    }
}

/// (executable names, recipe). Names are matched against the command's basename.
const TABLE: &[(&[&str], Recipe)] = &[
    (
        &["redis-server", "redis-check-rdb"],
        r(
            "Redis 6.0",
            "module with RedisModule_BlockClient",
            83,
            0,
            3.01,
            "",
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
        r(
            "Python 3.10",
            "loop.run_in_executor around the call",
            22,
            0,
            2.37,
            "",
        ),
    ),
    (
        &["nginx"],
        r(
            "nginx 1.18",
            "thread-pool module (ngx_thread_task_post)",
            112,
            0,
            2.74,
            "",
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

const GO: Recipe = r(
    "Go 1.18",
    "blocking cgo call in a goroutine",
    28,
    0,
    3.01,
    "",
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

/// The reroute's predicted throughput and speedup: the event loop's CPU per request
/// plus a hand-off to a worker (2 switches) on `loops` threads, and as many requests
/// in flight as there are connections.
pub fn predicted_speedup(i: &Inputs, loops: f64) -> (f64, f64) {
    let handoff = 2.0 * i.switch_us.max(0.0);
    let c = i.cpu_per_request_us.max(0.0) + handoff;
    let cpu = loops.clamp(1.0, i.cores.max(1.0)) * 1e6 / c.max(1e-3);
    let overlap = i.connections.max(1.0) * 1e6 / (i.latency_us.max(0.0) + c).max(1e-3);
    let mut t = cpu.min(overlap);
    if let Some(d) = i.device_rps {
        t = t.min(d);
    }
    (t, t / i.stock_rps_untraced.unwrap_or(i.stock_rps).max(1e-9))
}

/// One line for reports.
pub fn describe(r: &Recipe, predicted: Option<f64>) -> String {
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
    s
}
