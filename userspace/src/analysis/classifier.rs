//! The verdict: where the server sits in the interpolation envelope of
//! ../shared/DESIGN.md, decided from one window's (or the whole watch's) numbers. Each
//! verdict carries the numbers that decided it.

use crate::target::RuntimeKind;
use serde::Serialize;

/// Raw (below-libc) futex calls per request at or above which the server is below
/// the libc wall, when they are also RAW_FUTEX_SHARE_WALL of its own futex calls. A
/// fiberizable server makes none outside its offload; InnoDB under the paper's load
/// ~13,000 per request, MariaDB 10.11 under mariadb-slap's mixed load here ~0.2 per
/// socket read and a third of its futex calls: any steady use on the request path
/// means a fiber would block its whole carrier there.
pub const RAW_FUTEX_PER_REQ_WALL: f64 = 0.05;
pub const RAW_FUTEX_SHARE_WALL: f64 = 0.2;
/// Threads created per accepted connection at or above which the server is
/// thread-per-connection (a pool reusing threads stays well below).
pub const THREADS_PER_ACCEPT: f64 = 0.5;
/// Threads of one process that serve by blocking in reads, at or above which a server
/// that does not create them per connection is a pool (apache's event MPM hands each
/// worker a connection at a time); below, they are an event loop's helpers (a
/// device's thread reading its eventfd).
pub const POOL_BLOCKING_THREADS: usize = 3;

/// What the classifier looks at.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Evidence {
    pub runtime: Option<RuntimeKind>,
    pub dynamic: bool,
    pub requests: u64,
    pub offload_calls: u64,
    /// Offload latency p50: the stall less its wake-up-to-run delay.
    pub stall_p50_us: Option<f64>,
    pub cpu_per_request_us: Option<f64>,
    pub raw_futex: u64,
    pub libc_futex: u64,
    pub io_uring_enters: u64,
    pub accepts: u64,
    pub threads_created: u64,
    /// epoll_wait/epoll_pwait/poll/ppoll/select/pselect6 calls.
    pub mux_waits: u64,
    pub threads: usize,
    /// The fiber runtime's own counters, when it is loaded and active in the target.
    pub fiber_runtime: Option<FiberRuntime>,
    /// How the service's processes serve (processes.rs).
    pub shape: crate::processes::Shape,
}

/// What the fiber runtime reports of itself over the window (its counters, on the
/// window's clock).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct FiberRuntime {
    pub fibers_live: u64,
    pub carriers: u64,
    pub offloads_per_sec: f64,
    /// Offloads that parked their fiber (the overlap), per second.
    pub parked_per_sec: f64,
    /// Fibers parked on socket I/O, per second.
    pub io_parks_per_sec: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Thread per connection, blocking in libc, offload longer than the CPU work.
    Fiberizable,
    /// One (or a few) loops multiplexing connections: the runtime loads safely and
    /// never engages; the path is the minimal-edit reroute.
    EventLoop,
    /// Raw futex syscalls or io_uring: a fiber would block the whole carrier.
    BelowLibcWall,
    /// A managed runtime keeping thread identity in native TLS (JVM, Go, Python).
    BesideWall,
    /// Per-request CPU already at or above the offload: nothing idle to reclaim.
    BehindWall,
    /// No dynamic loader: LD_PRELOAD cannot interpose anything.
    NotDynamic,
    /// Not enough activity in the window to decide.
    Undecided,
    /// Already running under toffload's fiber runtime (injected).
    UnderRuntime,
    /// A process per connection (PostgreSQL, apache prefork): the OS overlaps the
    /// connections already; there are no threads to turn into fibers.
    ProcessPerConnection,
    /// A fixed pool of threads serving the connections, each multiplexing many
    /// (memcached -t N) or handed one at a time (apache's event MPM): the pool
    /// overlaps already; the path is the reroute.
    ThreadPool,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Fiberizable => "fiberizable (zero-edit overlap applies)",
            Kind::EventLoop => "event loop (loads safely, no overlap; minimal-edit reroute)",
            Kind::BelowLibcWall => "below-libc wall (raw futex / io_uring)",
            Kind::BesideWall => "beside wall (managed runtime, native-TLS thread identity)",
            Kind::BehindWall => "behind wall (per-request CPU >= offload)",
            Kind::NotDynamic => "not dynamically linked (LD_PRELOAD cannot interpose)",
            Kind::Undecided => "undecided (no requests seen yet)",
            Kind::UnderRuntime => "under the fiber runtime (connection threads run as fibers)",
            Kind::ProcessPerConnection => {
                "process per connection (the OS overlaps connections; zero-edit fibers do not apply)"
            }
            Kind::ThreadPool => {
                "thread pool (a fixed set of threads serves the connections; no overlap to add; minimal-edit reroute)"
            }
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub kind: Kind,
    pub label: &'static str,
    /// Why, with the deciding numbers.
    pub because: String,
}

fn verdict(kind: Kind, because: String) -> Verdict {
    Verdict {
        kind,
        label: kind.label(),
        because,
    }
}

fn per(n: u64, d: u64) -> f64 {
    if d == 0 {
        0.0
    } else {
        n as f64 / d as f64
    }
}

/// Raw futex calls per request.
fn raw_futex_per_request(e: &Evidence) -> f64 {
    per(e.raw_futex, e.requests)
}

/// Injected: the threads the other verdicts look at are fibers now (no thread per
/// accept, epoll waits on the carriers), so they would mislabel it.
fn under_runtime(e: &Evidence) -> Option<Verdict> {
    let f = e.fiber_runtime.as_ref()?;
    let parked = if f.offloads_per_sec > 0.0 {
        format!(
            " ({:.0}% of {:.0} offloads/s)",
            100.0 * f.parked_per_sec / f.offloads_per_sec,
            f.offloads_per_sec
        )
    } else {
        String::new()
    };
    Some(verdict(
        Kind::UnderRuntime,
        format!(
            "libtoffload.so active: {} fibers on {} carrier(s), {:.0} offloads parked/s{parked}, \
             {:.0} I/O parks/s",
            f.fibers_live, f.carriers, f.parked_per_sec, f.io_parks_per_sec
        ),
    ))
}

/// A managed runtime (beside the wall) or a static binary (nothing to interpose).
fn runtime_wall(e: &Evidence) -> Option<Verdict> {
    match e.runtime {
        Some(RuntimeKind::Jvm) | Some(RuntimeKind::Go) | Some(RuntimeKind::Python) => {
            let rt = e.runtime.map(|r| r.label()).unwrap_or_default();
            Some(verdict(
                Kind::BesideWall,
                format!(
                    "runtime is {rt}: it keeps thread identity in native TLS, which fibers \
                     interleaving on one carrier would corrupt"
                ),
            ))
        }
        Some(RuntimeKind::Static) => Some(verdict(
            Kind::NotDynamic,
            "no PT_INTERP and no dynamic loader mapped: LD_PRELOAD has nothing to hook".into(),
        )),
        _ => None,
    }
}

/// io_uring, or steady raw futex calls on the request path: below libc.
fn below_libc(e: &Evidence) -> Option<Verdict> {
    if e.io_uring_enters > 0 {
        return Some(verdict(
            Kind::BelowLibcWall,
            format!(
                "{} io_uring_enter calls: its I/O completes below libc, where no interposer sees it",
                e.io_uring_enters
            ),
        ));
    }
    let raw_per_req = raw_futex_per_request(e);
    let raw_share = per(e.raw_futex, e.raw_futex + e.libc_futex);
    if e.requests > 0 && raw_per_req >= RAW_FUTEX_PER_REQ_WALL && raw_share >= RAW_FUTEX_SHARE_WALL
    {
        return Some(verdict(
            Kind::BelowLibcWall,
            format!(
                "{raw_per_req:.2} raw futex syscalls per request (>= {RAW_FUTEX_PER_REQ_WALL}), \
                 {:.0}% of its futex calls (>= {:.0}%), bypass glibc's pthread code \
                 ({} raw vs {} via libc)",
                raw_share * 100.0,
                RAW_FUTEX_SHARE_WALL * 100.0,
                e.raw_futex,
                e.libc_futex
            ),
        ));
    }
    None
}

/// Several single-threaded processes of one connection each. Before the thread rule:
/// each forked backend counts as a task created per accepted connection, which would
/// read as thread per connection.
fn process_per_connection(e: &Evidence) -> Option<Verdict> {
    let sh = &e.shape;
    let holds = sh.serving_processes >= 2
        && sh.max_serving_threads == 1
        && sh.single_connection_processes * 2 > sh.serving_processes;
    holds.then(|| {
        verdict(
            Kind::ProcessPerConnection,
            format!(
                "{} processes serve, {} of them one connection each with one thread; \
                 {} tasks created per accepted connection",
                sh.serving_processes,
                sh.single_connection_processes,
                if e.accepts > 0 {
                    format!("{:.2}", per(e.threads_created, e.accepts))
                } else {
                    "-".into()
                }
            ),
        )
    })
}

/// Threads are made per connection; without connections in the window, when they
/// block without multiplexing.
fn threads_per_connection(e: &Evidence) -> bool {
    if e.accepts > 0 {
        per(e.threads_created, e.accepts) >= THREADS_PER_ACCEPT
    } else {
        // No connection arrived in the window: fall back on how it waits.
        e.mux_waits == 0
    }
}

/// Threads not made per connection: a pool (multiplexing or blocking), else an
/// event loop.
fn shared_threads(e: &Evidence) -> Option<Verdict> {
    if threads_per_connection(e) {
        return None;
    }
    let why = if e.accepts > 0 {
        format!(
            "{:.2} threads created per accepted connection ({} / {}), {} multiplexing waits \
             ({:.2} per request), {} threads",
            per(e.threads_created, e.accepts),
            e.threads_created,
            e.accepts,
            e.mux_waits,
            per(e.mux_waits, e.requests),
            e.threads
        )
    } else {
        format!(
            "{} multiplexing waits ({:.2} per request) and no new connections, {} threads",
            e.mux_waits,
            per(e.mux_waits, e.requests),
            e.threads
        )
    };
    let sh = &e.shape;
    Some(if sh.max_multiplexing_threads >= 2 {
        verdict(
            Kind::ThreadPool,
            format!(
                "{} threads of one process serve, each multiplexing; {why}",
                sh.max_multiplexing_threads
            ),
        )
    } else if sh.max_blocking_threads >= POOL_BLOCKING_THREADS {
        verdict(
            Kind::ThreadPool,
            format!(
                "{} threads of one process serve, blocking in reads, and are not \
                 created per connection (>= {POOL_BLOCKING_THREADS}: a pool); {why}",
                sh.max_blocking_threads
            ),
        )
    } else {
        verdict(Kind::EventLoop, why)
    })
}

/// Thread per connection: fiberizable unless its CPU per request reaches the offload.
fn thread_per_connection(e: &Evidence) -> Verdict {
    let conn = if e.accepts > 0 {
        format!(
            "{:.2} threads per accepted connection ({} / {})",
            per(e.threads_created, e.accepts),
            e.threads_created,
            e.accepts
        )
    } else {
        "threads block without multiplexing (no epoll/poll/select)".to_string()
    };
    let raw_per_req = raw_futex_per_request(e);
    match (e.stall_p50_us, e.cpu_per_request_us) {
        (Some(l), Some(c)) if e.offload_calls > 0 && c >= l => verdict(
            Kind::BehindWall,
            format!(
                "per-request CPU {c:.1} us >= offload latency p50 {l:.1} us: nothing idle to \
                 reclaim; {conn}"
            ),
        ),
        (Some(l), c) if e.offload_calls > 0 => verdict(
            Kind::Fiberizable,
            format!(
                "{conn}; offload latency p50 {l:.1} us > per-request CPU {:.1} us; \
                 {raw_per_req:.2} raw futex per request",
                c.unwrap_or(0.0)
            ),
        ),
        _ => verdict(
            Kind::Fiberizable,
            format!("{conn}; no offload symbol called: blocking waits are libc calls"),
        ),
    }
}

/// The rules in order; the first that holds decides.
pub fn classify(e: &Evidence) -> Verdict {
    under_runtime(e)
        .or_else(|| runtime_wall(e))
        .or_else(|| below_libc(e))
        .or_else(|| {
            (e.requests == 0).then(|| verdict(Kind::Undecided, "no requests in the window".into()))
        })
        .or_else(|| process_per_connection(e))
        .or_else(|| shared_threads(e))
        .unwrap_or_else(|| thread_per_connection(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn_server() -> Evidence {
        Evidence {
            runtime: Some(RuntimeKind::GlibcDynamic),
            dynamic: true,
            requests: 10_000,
            offload_calls: 10_000,
            stall_p50_us: Some(200.0),
            cpu_per_request_us: Some(12.0),
            raw_futex: 0,
            libc_futex: 40,
            io_uring_enters: 0,
            accepts: 64,
            threads_created: 64,
            mux_waits: 0,
            threads: 66,
            fiber_runtime: None,
            shape: crate::processes::Shape {
                serving_processes: 1,
                max_serving_threads: 64,
                max_multiplexing_threads: 0,
                max_blocking_threads: 64,
                single_connection_processes: 0,
            },
        }
    }

    #[test]
    fn backends_are_a_process_per_connection() {
        // PostgreSQL: a backend forked per connection, each in epoll on its socket.
        let mut e = conn_server();
        e.offload_calls = 0;
        e.stall_p50_us = None;
        e.mux_waits = 9_000;
        e.threads = 10;
        e.shape = crate::processes::Shape {
            serving_processes: 8,
            max_serving_threads: 1,
            max_multiplexing_threads: 1,
            max_blocking_threads: 0,
            single_connection_processes: 8,
        };
        let v = classify(&e);
        assert_eq!(v.kind, Kind::ProcessPerConnection, "{v:?}");
        // nginx's workers also serve one thread each, but many connections each.
        e.shape.single_connection_processes = 0;
        e.accepts = 0;
        assert_eq!(classify(&e).kind, Kind::EventLoop);
    }

    #[test]
    fn multiplexing_threads_are_a_pool() {
        let mut e = conn_server();
        e.accepts = 0;
        e.threads_created = 0;
        e.mux_waits = 2_000;
        e.shape = crate::processes::Shape {
            serving_processes: 1,
            max_serving_threads: 4,
            max_multiplexing_threads: 4,
            max_blocking_threads: 0,
            single_connection_processes: 0,
        };
        let v = classify(&e);
        assert_eq!(v.kind, Kind::ThreadPool, "{v:?}");
        assert!(v.because.contains("4 threads"), "{}", v.because);
        e.shape.max_multiplexing_threads = 1;
        assert_eq!(classify(&e).kind, Kind::EventLoop);
        // apache's event MPM: a listener multiplexing, 16 workers blocking in reads,
        // none created per accepted connection.
        e.accepts = 20_000;
        e.shape.max_multiplexing_threads = 0;
        e.shape.max_blocking_threads = 16;
        let v = classify(&e);
        assert_eq!(v.kind, Kind::ThreadPool, "{v:?}");
        assert!(v.because.contains("16 threads"), "{}", v.because);
        // An event loop beside its device's thread is still an event loop.
        e.shape.max_multiplexing_threads = 1;
        e.shape.max_blocking_threads = 1;
        assert_eq!(classify(&e).kind, Kind::EventLoop);
    }

    #[test]
    fn thread_per_connection_is_fiberizable() {
        let v = classify(&conn_server());
        assert_eq!(v.kind, Kind::Fiberizable, "{v:?}");
        assert!(
            v.because.contains("1.00 threads per accepted connection"),
            "{}",
            v.because
        );
        // Persistent connections opened before the watch: no accepts, no epoll.
        let mut e = conn_server();
        e.accepts = 0;
        e.threads_created = 0;
        assert_eq!(classify(&e).kind, Kind::Fiberizable);
    }

    #[test]
    fn event_loop() {
        let mut e = conn_server();
        e.threads_created = 0;
        e.mux_waits = 900;
        e.threads = 2;
        e.shape.max_blocking_threads = 1;
        e.shape.max_multiplexing_threads = 1;
        let v = classify(&e);
        assert_eq!(v.kind, Kind::EventLoop, "{v:?}");
        e.accepts = 0;
        assert_eq!(classify(&e).kind, Kind::EventLoop);
    }

    #[test]
    fn raw_futex_is_below_libc() {
        let mut e = conn_server();
        e.raw_futex = 13_000 * e.requests;
        let v = classify(&e);
        assert_eq!(v.kind, Kind::BelowLibcWall, "{v:?}");
        assert!(v.because.contains("13000.00 raw futex"), "{}", v.because);
        // Under the rate line: still fiberizable.
        e.raw_futex = e.requests / 50;
        assert_eq!(classify(&e).kind, Kind::Fiberizable);
        // A steady rate, but a small share next to pthread's: still fiberizable.
        e.raw_futex = e.requests / 10;
        e.libc_futex = e.requests;
        assert_eq!(classify(&e).kind, Kind::Fiberizable);
        e.libc_futex = e.requests / 10;
        assert_eq!(classify(&e).kind, Kind::BelowLibcWall);
    }

    #[test]
    fn io_uring_is_below_libc() {
        let mut e = conn_server();
        e.io_uring_enters = 5;
        assert_eq!(classify(&e).kind, Kind::BelowLibcWall);
    }

    #[test]
    fn managed_runtimes_are_beside() {
        for rt in [RuntimeKind::Jvm, RuntimeKind::Go, RuntimeKind::Python] {
            let mut e = conn_server();
            e.runtime = Some(rt);
            assert_eq!(classify(&e).kind, Kind::BesideWall, "{rt:?}");
        }
    }

    #[test]
    fn cpu_heavy_is_behind() {
        let mut e = conn_server();
        e.cpu_per_request_us = Some(250.0);
        let v = classify(&e);
        assert_eq!(v.kind, Kind::BehindWall, "{v:?}");
        assert!(v
            .because
            .contains("250.0 us >= offload latency p50 200.0 us"));
    }

    #[test]
    fn static_binary() {
        let mut e = conn_server();
        e.runtime = Some(RuntimeKind::Static);
        e.dynamic = false;
        assert_eq!(classify(&e).kind, Kind::NotDynamic);
    }

    /// After an injection the carriers wait in epoll and no thread is made per
    /// connection: without the runtime's own word that reads as an event loop.
    #[test]
    fn injected_is_under_the_runtime() {
        let mut e = conn_server();
        e.threads_created = 0;
        e.mux_waits = 900;
        e.threads = 4;
        e.shape.max_blocking_threads = 1;
        e.shape.max_multiplexing_threads = 1;
        assert_eq!(classify(&e).kind, Kind::EventLoop);
        e.fiber_runtime = Some(FiberRuntime {
            fibers_live: 64,
            carriers: 1,
            offloads_per_sec: 10_000.0,
            parked_per_sec: 9_000.0,
            io_parks_per_sec: 20_000.0,
        });
        let v = classify(&e);
        assert_eq!(v.kind, Kind::UnderRuntime, "{v:?}");
        assert!(
            v.because
                .contains("64 fibers on 1 carrier(s), 9000 offloads parked/s (90% of"),
            "{}",
            v.because
        );
    }

    #[test]
    fn idle_is_undecided() {
        let mut e = conn_server();
        e.requests = 0;
        e.offload_calls = 0;
        assert_eq!(classify(&e).kind, Kind::Undecided);
    }
}
