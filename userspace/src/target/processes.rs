//! A watched service, process by process: who serves the requests and how. The
//! kernel counts per thread (reads, multiplexing waits, on-CPU time); grouped by
//! process, with each process's client connections from /proc, they tell an nginx
//! master (idle) from its workers (event loops), a pool of threads each multiplexing
//! many connections from one loop, and PostgreSQL's backends (a process per
//! connection).

use crate::abi::ThreadInfo;
use serde::Serialize;
use std::collections::{BTreeMap, HashSet};

/// What /proc says of one watched process at a snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcInfo {
    pub comm: String,
    /// Connected sockets (TCP and Unix, listening ones left out): the most it held
    /// at any reading of the watch so far (a master's channels to its workers
    /// included; one reading at a window's end may fall between two connections).
    pub connections: usize,
    /// Its threads now.
    pub threads: usize,
}

/// How one process serves, from its threads over a window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Model {
    /// No reads in the window (a master, a supervisor, a helper).
    Idle,
    /// One thread serving, from a multiplexing wait (epoll, poll, select).
    EventLoop,
    /// Several threads serving, each from a multiplexing wait.
    ThreadPool,
    /// Several threads serving, blocking in reads without multiplexing: a thread per
    /// connection, or a pool handing each a connection at a time (apache's event
    /// MPM); the service verdict tells them apart by threads created per accept.
    BlockingThreads,
    /// One thread serving one connection (a backend of a process-per-connection
    /// server, or a plain blocking server).
    SingleConnection,
}

impl Model {
    pub fn label(self) -> &'static str {
        match self {
            Model::Idle => "idle",
            Model::EventLoop => "event loop",
            Model::ThreadPool => "thread pool",
            Model::BlockingThreads => "blocking threads",
            Model::SingleConnection => "one connection",
        }
    }
}

/// Which part of the service a process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The process the watch was pointed at (or the top of the cgroup).
    Main,
    /// Any other process of the service.
    Child,
}

#[derive(Clone, Debug, Serialize)]
pub struct ProcessRow {
    pub pid: u32,
    pub comm: String,
    pub role: Role,
    pub model: Model,
    /// Threads (those /proc lists now, or those seen in the window if more), and
    /// those that read (served).
    pub threads: usize,
    pub serving_threads: usize,
    /// Serving threads that made multiplexing waits (the loops).
    pub multiplexing_threads: usize,
    pub reads_per_sec: f64,
    pub mux_waits_per_read: Option<f64>,
    pub connections: usize,
    /// Share of one CPU its threads used.
    pub cpu_share: f64,
    /// Offload calls per second, and their mean stall (us).
    pub offloads_per_sec: f64,
    pub stall_mean_us: Option<f64>,
}

/// Reads per second (over the window's traced time) below which a thread does not
/// count as serving: a supervisor's occasional pipe read is not a request stream.
const SERVING_READS_PER_SEC: f64 = 5.0;

/// The socket inodes of a process (its fds that are sockets).
pub fn socket_inodes(pid: u32) -> Vec<u64> {
    let mut fds = BTreeMap::new();
    socket_inodes_cached(pid, &mut fds, true)
}

/// An fd's socket inode (None: not a socket), from its /proc link.
fn fd_socket(pid: u32, fd: &str) -> Option<u64> {
    let l = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok()?;
    let s = l.to_str()?;
    s.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
}

/// The socket inodes of a process, with `fds` (fd -> its socket inode, or None)
/// kept from the last reading: with `fresh` every fd's link is read again, else
/// only those of fds that were not sockets or not there at the last reading. The
/// quarter-second readings between two windows then cost a directory listing and a
/// readlink per other fd, not one per connection (with a socket per client, the
/// readlinks were the largest part of the watch's own CPU between windows). A
/// socket's fd closed and reused by another socket is still a connection; one reused
/// by a file counts as a socket until the next window's fresh reading, less than a
/// window later, so the most connections seen stays what the process held in that
/// time.
fn socket_inodes_cached(pid: u32, fds: &mut BTreeMap<u32, Option<u64>>, fresh: bool) -> Vec<u64> {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        fds.clear();
        return Vec::new();
    };
    let mut now = BTreeMap::new();
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(fd) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let inode = match fds.get(&fd) {
            Some(&Some(socket)) if !fresh => Some(socket),
            _ => fd_socket(pid, &fd.to_string()),
        };
        now.insert(fd, inode);
    }
    *fds = now;
    fds.values().flatten().copied().collect()
}

/// The inodes of listening sockets (TCP over IPv4 and IPv6, and Unix) in this
/// network namespace: from sock_diag, or from /proc/net where it is missing.
pub fn listening_inodes() -> HashSet<u64> {
    if let Some(found) = super::sock_diag::listening_inodes() {
        return found;
    }
    let mut out = HashSet::new();
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(t) = std::fs::read_to_string(f) {
            out.extend(listening_in_tcp(&t));
        }
    }
    if let Ok(t) = std::fs::read_to_string("/proc/net/unix") {
        out.extend(listening_in_unix(&t));
    }
    out
}

/// /proc/net/tcp: state (field 4) 0A is LISTEN; the inode is field 10.
fn listening_in_tcp(text: &str) -> Vec<u64> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(3) == Some(&"0A")).then(|| f.get(9)?.parse().ok())?
        })
        .collect()
}

/// /proc/net/unix: Flags (field 3) with __SO_ACCEPTCON (0x10000) is a listener; the
/// inode is field 7.
fn listening_in_unix(text: &str) -> Vec<u64> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = u64::from_str_radix(f.get(3)?, 16).ok()?;
            (flags & 0x10000 != 0).then(|| f.get(6)?.parse().ok())?
        })
        .collect()
}

/// Readings a process is still reported after its exit (the session reads every
/// quarter second, and at each window's end).
const GONE_READINGS: u32 = 8;

/// What was read of a process while it lived.
#[derive(Clone, Debug, Default)]
struct Known {
    comm: String,
    most_connections: usize,
    /// Its fds at the last reading: fd -> socket inode (None: not a socket).
    fds: BTreeMap<u32, Option<u64>>,
    /// Readings since it was last seen alive.
    gone: u32,
}

/// Reads the watched processes from /proc, keeping what was seen of each: its most
/// connections, its name (for GONE_READINGS more readings after it exits: a backend
/// that served its client and ended within the window), and its fds.
#[derive(Debug, Default)]
pub struct Reader {
    known: BTreeMap<u32, Known>,
    /// The listening sockets' inodes as the last fresh reading found them.
    listening: HashSet<u64>,
}

impl Reader {
    /// What /proc says of each process now. A `fresh` reading (each window's) reads
    /// every fd's link, the listening sockets and the names; the others (the
    /// quarter-second ones between) only look for fds opened since.
    pub fn read(&mut self, pids: &[u32], fresh: bool) -> BTreeMap<u32, ProcInfo> {
        if fresh || self.known.is_empty() {
            self.listening = listening_inodes();
        }
        let mut out = BTreeMap::new();
        for &p in pids {
            let threads = crate::target::thread_count(p).unwrap_or(0);
            let k = self.known.entry(p).or_default();
            if threads > 0 {
                let first = k.comm.is_empty();
                let now = socket_inodes_cached(p, &mut k.fds, fresh || first)
                    .into_iter()
                    .filter(|i| !self.listening.contains(i))
                    .count();
                k.most_connections = k.most_connections.max(now);
                if fresh || first {
                    let comm = crate::target::comm(p);
                    if !comm.is_empty() {
                        k.comm = comm;
                    }
                }
                k.gone = 0;
            }
            out.insert(
                p,
                ProcInfo {
                    comm: k.comm.clone(),
                    connections: k.most_connections,
                    threads,
                },
            );
        }
        for (&p, k) in self.known.iter_mut() {
            if !pids.contains(&p) || crate::target::thread_count(p).is_none() {
                k.gone += 1;
                if k.gone <= GONE_READINGS {
                    out.entry(p).or_insert_with(|| ProcInfo {
                        comm: k.comm.clone(),
                        connections: k.most_connections,
                        threads: 0,
                    });
                }
            }
        }
        self.known.retain(|_, k| k.gone <= GONE_READINGS);
        out
    }
}

/// The rows of the window from `prev` to `cur` (threads keyed by tid), `secs` traced.
pub fn rows(
    prev: &BTreeMap<u32, ThreadInfo>,
    cur: &BTreeMap<u32, ThreadInfo>,
    info: &BTreeMap<u32, ProcInfo>,
    root: u32,
    secs: f64,
) -> Vec<ProcessRow> {
    #[derive(Default)]
    struct Acc {
        threads: usize,
        serving: usize,
        serving_mux: usize,
        reads: u64,
        mux: u64,
        on_ns: u64,
        offloads: u64,
        stall_ns: u64,
    }
    let secs = secs.max(1e-9);
    let mut by: BTreeMap<u32, Acc> = BTreeMap::new();
    for (tid, t) in cur {
        let b = prev.get(tid);
        let d = |f: fn(&ThreadInfo) -> u64| f(t).saturating_sub(b.map_or(0, f));
        let (reads, mux) = (d(|t| t.reads), d(|t| t.mux_waits));
        let a = by.entry(t.tgid).or_default();
        a.threads += 1;
        a.reads += reads;
        a.mux += mux;
        a.on_ns += d(|t| t.on_ns);
        a.offloads += d(|t| t.offload_calls);
        a.stall_ns += d(|t| t.stall_ns);
        if reads as f64 / secs >= SERVING_READS_PER_SEC {
            a.serving += 1;
            // Any multiplexing wait: a busy loop reads many requests per wait (an
            // evloop_server read 60 per epoll_wait), a blocking thread makes none.
            if mux > 0 {
                a.serving_mux += 1;
            }
        }
    }
    // Processes /proc knows but whose threads have not run while traced.
    for &p in info.keys() {
        by.entry(p).or_default();
    }
    let mut out: Vec<ProcessRow> = by
        .into_iter()
        // A process gone before the window and idle in it is history, not a row.
        .filter(|(pid, a)| info.contains_key(pid) || a.on_ns > 0 || a.reads > 0)
        .map(|(pid, a)| {
            let i = info.get(&pid).cloned().unwrap_or_default();
            // A device's or a helper's thread reading its own eventfd or pipe reads
            // as often as the loop it serves, but makes no multiplexing wait: the
            // loops are the threads that do.
            // One thread serving at most one connection is that connection's process
            // whether it polls (apache prefork's children poll to accept) or not.
            let model = match (a.serving, a.serving_mux) {
                (0, _) => Model::Idle,
                (1, _) if i.connections <= 1 => Model::SingleConnection,
                (_, m) if m >= 2 => Model::ThreadPool,
                (_, 1) => Model::EventLoop,
                (1, 0) => Model::SingleConnection,
                _ => Model::BlockingThreads,
            };
            ProcessRow {
                pid,
                comm: i.comm,
                role: if pid == root { Role::Main } else { Role::Child },
                model,
                threads: a.threads.max(i.threads),
                serving_threads: a.serving,
                multiplexing_threads: a.serving_mux,
                reads_per_sec: a.reads as f64 / secs,
                mux_waits_per_read: (a.reads > 0).then(|| a.mux as f64 / a.reads as f64),
                connections: i.connections,
                cpu_share: a.on_ns as f64 / 1e9 / secs,
                offloads_per_sec: a.offloads as f64 / secs,
                stall_mean_us: (a.offloads > 0)
                    .then(|| a.stall_ns as f64 / a.offloads as f64 / 1e3),
            }
        })
        .collect();
    out.sort_by(|a, b| {
        (b.role == Role::Main)
            .cmp(&(a.role == Role::Main))
            .then(b.reads_per_sec.total_cmp(&a.reads_per_sec))
    });
    out
}

/// What the rows say of the service as a whole, for the classifier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Shape {
    /// Processes that served in the window.
    pub serving_processes: usize,
    /// The most threads serving in one process.
    pub max_serving_threads: usize,
    /// The most serving threads in one process that multiplex (2 or more: a pool).
    pub max_multiplexing_threads: usize,
    /// The most serving threads in one process that block in reads instead.
    pub max_blocking_threads: usize,
    /// Serving processes that hold at most one connection each, one thread serving.
    pub single_connection_processes: usize,
}

pub fn shape(rows: &[ProcessRow]) -> Shape {
    let serving: Vec<&ProcessRow> = rows.iter().filter(|r| r.model != Model::Idle).collect();
    Shape {
        serving_processes: serving.len(),
        max_serving_threads: serving.iter().map(|r| r.serving_threads).max().unwrap_or(0),
        max_multiplexing_threads: serving
            .iter()
            .map(|r| r.multiplexing_threads)
            .max()
            .unwrap_or(0),
        max_blocking_threads: serving
            .iter()
            .map(|r| r.serving_threads - r.multiplexing_threads)
            .max()
            .unwrap_or(0),
        single_connection_processes: serving
            .iter()
            .filter(|r| r.model == Model::SingleConnection)
            .count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(tgid: u32, reads: u64, mux: u64, on_ms: u64) -> ThreadInfo {
        ThreadInfo {
            tgid,
            reads,
            mux_waits: mux,
            on_ns: on_ms * 1_000_000,
            ..ThreadInfo::default()
        }
    }

    fn info(pairs: &[(u32, &str, usize)]) -> BTreeMap<u32, ProcInfo> {
        pairs
            .iter()
            .map(|&(p, c, n)| {
                (
                    p,
                    ProcInfo {
                        comm: c.into(),
                        connections: n,
                        threads: 1,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn an_nginx_master_is_idle_and_its_workers_are_event_loops() {
        let prev = BTreeMap::new();
        // Master 10 (no reads), workers 11 and 12 (one thread each, epoll).
        let cur: BTreeMap<u32, ThreadInfo> = [
            (10, t(10, 0, 1, 1)),
            (11, t(11, 5000, 900, 400)),
            (12, t(12, 4000, 700, 350)),
        ]
        .into_iter()
        .collect();
        let r = rows(
            &prev,
            &cur,
            &info(&[(10, "nginx", 0), (11, "nginx", 16), (12, "nginx", 16)]),
            10,
            1.0,
        );
        assert_eq!(r[0].pid, 10);
        assert_eq!((r[0].role, r[0].model), (Role::Main, Model::Idle));
        assert_eq!(r[1].pid, 11, "busiest child next");
        assert!(r.iter().skip(1).all(|x| x.model == Model::EventLoop));
        let s = shape(&r);
        assert_eq!(s.serving_processes, 2);
        assert_eq!(s.single_connection_processes, 0);
    }

    #[test]
    fn backends_hold_one_connection_each() {
        let prev: BTreeMap<u32, ThreadInfo> = [(21, t(21, 100, 100, 10))].into_iter().collect();
        let cur: BTreeMap<u32, ThreadInfo> = [
            (20, t(20, 0, 3, 1)),
            (21, t(21, 900, 900, 100)),
            (22, t(22, 700, 690, 90)),
        ]
        .into_iter()
        .collect();
        let r = rows(
            &prev,
            &cur,
            &info(&[
                (20, "postgres", 0),
                (21, "postgres", 1),
                (22, "postgres", 1),
            ]),
            20,
            1.0,
        );
        let b = r.iter().find(|x| x.pid == 21).unwrap();
        assert!(
            (b.reads_per_sec - 800.0).abs() < 1e-9,
            "the delta, not the total"
        );
        let s = shape(&r);
        assert_eq!(s.serving_processes, 2);
        assert_eq!(s.single_connection_processes, 2);
        assert_eq!(s.max_serving_threads, 1);
    }

    #[test]
    fn a_device_thread_beside_a_loop_is_still_one_loop() {
        // evloop_server: the loop (many reads per epoll_wait) and the emulated
        // device's thread reading its eventfd at the same rate, without epoll.
        let cur: BTreeMap<u32, ThreadInfo> = [(50, t(50, 4000, 68, 500)), (51, t(50, 4000, 0, 50))]
            .into_iter()
            .collect();
        let r = rows(&BTreeMap::new(), &cur, &info(&[]), 50, 1.0);
        assert_eq!(r[0].model, Model::EventLoop);
        assert_eq!((r[0].serving_threads, r[0].multiplexing_threads), (2, 1));
        assert_eq!(shape(&r).max_multiplexing_threads, 1);
    }

    #[test]
    fn a_prefork_child_is_its_connections_process() {
        // Polls to accept, then serves the one connection it took.
        let cur: BTreeMap<u32, ThreadInfo> = [
            (60, t(60, 0, 0, 1)),
            (61, t(61, 3000, 1000, 90)),
            (62, t(62, 2900, 990, 90)),
        ]
        .into_iter()
        .collect();
        let r = rows(
            &BTreeMap::new(),
            &cur,
            &info(&[(60, "apache2", 0), (61, "apache2", 1), (62, "apache2", 1)]),
            60,
            1.0,
        );
        assert!(
            r.iter().skip(1).all(|x| x.model == Model::SingleConnection),
            "{r:?}"
        );
        assert_eq!(shape(&r).single_connection_processes, 2);
    }

    #[test]
    fn a_process_stall_is_its_threads_mean() {
        let mut a = t(70, 100, 0, 10);
        a.offload_calls = 10;
        a.stall_ns = 10 * 500_000;
        let mut b = t(70, 100, 0, 10);
        b.offload_calls = 30;
        b.stall_ns = 30 * 1_500_000;
        let cur: BTreeMap<u32, ThreadInfo> = [(70, a), (71, b)].into_iter().collect();
        let r = rows(&BTreeMap::new(), &cur, &info(&[]), 70, 2.0);
        assert_eq!(r[0].offloads_per_sec, 20.0);
        assert!((r[0].stall_mean_us.unwrap() - 1250.0).abs() < 1e-6);
    }

    #[test]
    fn pools_and_blocking_threads() {
        let prev = BTreeMap::new();
        // Process 30: four threads each in epoll (memcached -t 4). Process 40: three
        // threads blocking in read (thread per connection).
        let mut cur: BTreeMap<u32, ThreadInfo> = BTreeMap::new();
        for tid in 30..34 {
            cur.insert(tid, t(30, 1000, 300, 100));
        }
        for tid in 40..43 {
            cur.insert(tid, t(40, 1000, 0, 100));
        }
        cur.insert(43, t(40, 0, 0, 1));
        let r = rows(&prev, &cur, &info(&[]), 30, 1.0);
        let m = |p: u32| r.iter().find(|x| x.pid == p).unwrap();
        assert_eq!(m(30).model, Model::ThreadPool);
        assert_eq!(m(30).serving_threads, 4);
        assert_eq!(m(40).model, Model::BlockingThreads);
        assert_eq!((m(40).threads, m(40).serving_threads), (4, 3));
    }

    #[test]
    fn listeners_are_read_from_proc_net() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
           0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0\n\
           1: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 23456 1 0\n";
        assert_eq!(listening_in_tcp(tcp), [12345]);
        let unix = "Num       RefCount Protocol Flags    Type St Inode Path\n\
           0000000000000000: 00000002 00000000 00010000 0001 01 3456 /run/x.sock\n\
           0000000000000000: 00000003 00000000 00000000 0001 03 4567\n";
        assert_eq!(listening_in_unix(unix), [3456]);
        // This process: a listener is not a connection, an accepted pair is.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let mut reader = Reader::default();
        let me = reader.read(&[std::process::id()], true);
        assert!(me[&std::process::id()].connections >= 2, "{me:?}");
        // A reading between windows sees the fds opened since the last one.
        let pid = std::process::id();
        let mut fds = BTreeMap::new();
        socket_inodes_cached(pid, &mut fds, true);
        let c2 = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s2, _) = l.accept().unwrap();
        let ino = |f: &std::net::TcpStream| {
            use std::os::fd::AsRawFd;
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(format!("/proc/self/fd/{}", f.as_raw_fd()))
                .unwrap()
                .ino()
        };
        let cached = socket_inodes_cached(pid, &mut fds, false);
        assert!(
            cached.contains(&ino(&c2)) && cached.contains(&ino(&s2)),
            "{cached:?}"
        );
        drop((c, s, c2, s2));
        // Gone now, but the most seen stays.
        let again = reader.read(&[pid], true);
        assert!(again[&pid].connections >= 2, "{again:?}");
    }
}
