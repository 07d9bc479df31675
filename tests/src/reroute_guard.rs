//! The conflict guard on the HTTP integrations' rerouted path (nginx, Python asyncio,
//! Go): what their suites share. Each serves `/incr?k=KEY` (read a counter, offload,
//! write it back plus one), `/incrlocked` (the same under a coarse lock), `/get`,
//! `/sum` and `/guard`, with the mode from TOFFLOAD_GUARD. Here: a keep-alive client
//! that counts acknowledged increments, the checks every suite runs (hazard first:
//! unguarded loses updates; detect reports; enforce keeps every acknowledged one;
//! clients that hang up leave nothing stuck), and the enforce-vs-lock benchmark that
//! writes an integration's section of tests/results/guard.md.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// One HTTP response: (status, body, the server closes the connection after it).
fn read_response(r: &mut BufReader<TcpStream>) -> std::io::Result<(u16, String, bool)> {
    let mut status = String::new();
    if r.read_line(&mut status)? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("status line {status:?}")))?;
    let (mut len, mut close) = (0usize, false);
    loop {
        let mut h = String::new();
        r.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            let v = v.trim();
            if k.eq_ignore_ascii_case("content-length") {
                len = v.parse().map_err(std::io::Error::other)?;
            } else if k.eq_ignore_ascii_case("connection") && v.eq_ignore_ascii_case("close") {
                close = true;
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok((code, String::from_utf8_lossy(&body).into_owned(), close))
}

/// A keep-alive connection that reconnects when the server closes it (nginx after
/// `keepalive_requests`), never in the middle of a request.
pub struct Conn {
    port: u16,
    r: Option<BufReader<TcpStream>>,
}

impl Conn {
    pub fn new(port: u16) -> Conn {
        Conn { port, r: None }
    }

    fn stream(&mut self) -> &mut BufReader<TcpStream> {
        self.r.get_or_insert_with(|| {
            let s = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
            BufReader::new(s)
        })
    }

    pub fn send(&mut self, target: &str) {
        let req = format!("GET {target} HTTP/1.1\r\nHost: t\r\n\r\n");
        self.stream()
            .get_mut()
            .write_all(req.as_bytes())
            .expect("send");
    }

    pub fn read(&mut self) -> std::io::Result<(u16, String)> {
        let (code, body, close) = read_response(self.stream())?;
        if close {
            self.r = None;
        }
        Ok((code, body))
    }

    pub fn get(&mut self, target: &str) -> (u16, String) {
        self.send(target);
        self.read().unwrap_or_else(|e| panic!("GET {target}: {e}"))
    }

    /// A number from `target` (200 expected).
    pub fn number(&mut self, target: &str) -> i64 {
        let (code, body) = self.get(target);
        assert_eq!(code, 200, "GET {target}: {body}");
        body.trim()
            .parse()
            .unwrap_or_else(|_| panic!("GET {target}: {body:?}"))
    }

    /// Hangs up (both directions).
    pub fn hang_up(&mut self) {
        if let Some(r) = self.r.take() {
            let _ = r.get_ref().shutdown(Shutdown::Both);
        }
    }
}

/// `/guard`: the guard's counters.
#[derive(Debug, Clone)]
pub struct GuardStats {
    pub mode: String,
    /// How detect sees writes: uffd-async or mprotect (enforce: mprotect).
    pub mech: String,
    pub pages: i64,
    pub faults: i64,
    pub conflicts: i64,
    pub deferred: i64,
    pub released: i64,
}

pub fn guard_stats(port: u16) -> GuardStats {
    let (code, body) = Conn::new(port).get("/guard");
    assert_eq!(code, 200, "/guard: {body}");
    let f: Vec<&str> = body.split_whitespace().collect();
    let n = |i: usize| -> i64 {
        f.get(i)
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("/guard: {body:?}"))
    };
    GuardStats {
        mode: f.first().unwrap_or(&"").to_string(),
        mech: f.get(1).unwrap_or(&"").to_string(),
        pages: n(2),
        faults: n(3),
        conflicts: n(4),
        deferred: n(5),
        released: n(6),
    }
}

/// What a run of increments did: acknowledged (200 answers), error answers (the first
/// few kept), what took effect (/sum after the run) and how long it took.
#[derive(Debug)]
pub struct Increments {
    pub acked: i64,
    pub errors: Vec<String>,
    pub took: i64,
    pub secs: f64,
}

impl Increments {
    pub fn lost(&self) -> i64 {
        self.acked - self.took
    }

    pub fn rps(&self) -> f64 {
        self.acked as f64 / self.secs
    }
}

/// The keys of a run: one counter, or keys drawn from a keyspace.
#[derive(Clone, Copy, Debug)]
pub enum Keys {
    One,
    Many(u64),
}

/// `total` GETs of `path?k=...` from `conns` connections at once, one request at a time
/// each, the client threads on `cpu`.
pub fn increments(
    port: u16,
    path: &str,
    keys: Keys,
    conns: usize,
    total: usize,
    cpu: Option<usize>,
) -> Increments {
    let barrier = Arc::new(Barrier::new(conns + 1));
    let threads: Vec<_> = (0..conns)
        .map(|i| {
            let barrier = barrier.clone();
            let path = path.to_string();
            let n = total / conns + usize::from(i < total % conns);
            std::thread::spawn(move || {
                if let Some(cpu) = cpu.filter(|_| crate::harness::cpus() > 1) {
                    let _ = crate::harness::pin_current_thread(cpu);
                }
                let mut c = Conn::new(port);
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64 + 1);
                barrier.wait();
                let (mut acked, mut errors) = (0i64, Vec::new());
                for _ in 0..n {
                    let key = match keys {
                        Keys::One => "counter".to_string(),
                        Keys::Many(space) => {
                            // xorshift: a key per request, as redis-benchmark's -r.
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            format!("k:{}", rng % space)
                        }
                    };
                    match c.get(&format!("{path}?k={key}")) {
                        (200, _) => acked += 1,
                        (code, body) if errors.len() < 5 => errors.push(format!("{code} {body}")),
                        _ => {}
                    }
                }
                (acked, errors)
            })
        })
        .collect();
    barrier.wait();
    let t0 = Instant::now();
    let mut out = Increments {
        acked: 0,
        errors: Vec::new(),
        took: 0,
        secs: 0.0,
    };
    for t in threads {
        let (a, e) = t.join().expect("client thread");
        out.acked += a;
        out.errors.extend(e);
    }
    out.secs = t0.elapsed().as_secs_f64();
    out.took = Conn::new(port).number("/sum");
    out
}

/// Unguarded (TOFFLOAD_GUARD=off), overlapped increments of one counter lose updates.
pub fn check_unguarded_loses_updates(port: u16) {
    let run = increments(port, "/incr", Keys::One, 32, 10_000, None);
    let g = guard_stats(port);
    println!("TOFFLOAD_GUARD=off: {run:?}, lost {}, {g:?}", run.lost());
    assert!(run.errors.is_empty(), "error answers: {:?}", run.errors);
    assert_eq!(run.acked, 10_000);
    assert!(
        run.lost() > 0,
        "overlapped read-modify-writes of one counter lost nothing ({run:?}): the hazard is not shown"
    );
    assert_eq!((g.mode.as_str(), g.faults), ("off", 0));
}

/// Detect reports the conflicting write-backs (and does not prevent them).
pub fn check_detect_reports(port: u16) {
    let run = increments(port, "/incr", Keys::One, 32, 10_000, None);
    let g = guard_stats(port);
    println!("TOFFLOAD_GUARD=detect: {run:?}, lost {}, {g:?}", run.lost());
    assert!(run.errors.is_empty(), "error answers: {:?}", run.errors);
    assert_eq!(g.mode, "detect");
    assert!(
        ["uffd-async", "mprotect"].contains(&g.mech.as_str()),
        "{g:?}"
    );
    assert!(g.pages > 0 && g.faults > 0, "the guard saw no write: {g:?}");
    assert!(
        g.conflicts > 0,
        "{} updates lost but no conflict reported",
        run.lost()
    );
}

/// Enforce keeps every acknowledged increment of `total` (one counter, then many).
pub fn check_enforce_keeps_all(port: u16, total: usize) {
    let t0 = Instant::now();
    let run = increments(port, "/incr", Keys::One, 32, total, None);
    let g = guard_stats(port);
    println!(
        "TOFFLOAD_GUARD=enforce, one key: {run:?} in {:.1} s, {g:?}",
        t0.elapsed().as_secs_f64()
    );
    assert!(run.errors.is_empty(), "error answers: {:?}", run.errors);
    assert_eq!(run.acked, total as i64);
    assert_eq!(run.lost(), 0, "enforce lost updates: {run:?}");
    let mut c = Conn::new(port);
    assert_eq!(c.number("/get?k=counter"), total as i64);
    assert!(g.deferred > 0, "enforce never deferred an increment: {g:?}");
    assert_eq!(g.released, 0, "pages given up: the guarantee was broken");
    // Many keys over the 16 pages: increments on different pages overlap.
    let many = increments(port, "/incr", Keys::Many(100_000), 32, total / 2, None);
    let g = guard_stats(port);
    println!("TOFFLOAD_GUARD=enforce, many keys: {many:?}, {g:?}");
    assert!(many.errors.is_empty(), "error answers: {:?}", many.errors);
    assert_eq!(many.took, (total + total / 2) as i64, "{many:?}");
    assert_eq!(g.released, 0);
}

/// 16 clients send `/incr` on one counter (long offloads: under enforce one runs and
/// the others wait), 8 hang up; the 8 others are answered, nothing stays stuck, and
/// the counter goes on from what took effect.
pub fn check_hang_ups_leave_nothing_stuck(port: u16) {
    let mut conns: Vec<Conn> = (0..16).map(|_| Conn::new(port)).collect();
    for c in &mut conns {
        c.send("/incr?k=counter");
    }
    std::thread::sleep(Duration::from_millis(20));
    let (gone, stay) = conns.split_at_mut(8);
    for c in gone.iter_mut() {
        c.hang_up();
    }
    let acked = stay
        .iter_mut()
        .map(|c| match c.read() {
            Ok((200, _)) => 1,
            other => panic!("/incr: {other:?}"),
        })
        .sum::<i64>();
    // The requests of clients gone may still finish (a server that notices a hang-up
    // only when it answers): wait for the sum to settle.
    let mut c = Conn::new(port);
    let t0 = Instant::now();
    let mut took = c.number("/sum");
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = c.number("/sum");
        if now == took || t0.elapsed() > Duration::from_secs(15) {
            break;
        }
        took = now;
    }
    let g = guard_stats(port);
    println!("8 of 16 clients gone: {acked} acknowledged, {took} took effect, {g:?}");
    assert_eq!(acked, 8);
    assert!((8..=16).contains(&took), "{took} increments took effect");
    assert_eq!(g.released, 0);
    let t1 = Instant::now();
    assert_eq!(c.number("/incr?k=counter"), took + 1);
    assert!(
        t1.elapsed() < Duration::from_secs(5),
        "the next increment waited {:?}: something stayed stuck",
        t1.elapsed()
    );
}

/// How long each integration lets a request sent back by enforce wait in all.
pub const GUARD_WAIT: Duration = Duration::from_secs(10);

/// With a 12 s offload (`lat_us` of the server) one `/incr` owns its counter's page
/// the whole time; a second on that counter, sent back by enforce, is answered 503
/// after GUARD_WAIT (not held until the owner ends, never held for good), and the
/// first still counts.
pub fn check_guard_wait_has_a_deadline(port: u16) {
    let mut owner = Conn::new(port);
    owner.send("/incr?k=deadline");
    std::thread::sleep(Duration::from_millis(300));
    let mut waiter = Conn::new(port);
    let t0 = Instant::now();
    let (code, body) = waiter.get("/incr?k=deadline");
    let waited = t0.elapsed();
    println!("sent back: {code} {body:?} after {waited:?}");
    assert_eq!(code, 503, "{body}");
    assert!(
        waited >= GUARD_WAIT - Duration::from_millis(500)
            && waited < GUARD_WAIT + Duration::from_millis(1500),
        "answered after {waited:?}, the deadline is {GUARD_WAIT:?}"
    );
    match owner.read() {
        Ok((200, b)) => assert_eq!(b.trim(), "1"),
        other => panic!("the owner's /incr: {other:?}"),
    }
    assert_eq!(Conn::new(port).number("/get?k=deadline"), 1);
}

/// A running server for the benchmark: kept alive while held.
pub type Running = (Box<dyn std::any::Any>, u16);

/// Starts the integration's server with an environment, pinned to a CPU.
pub type Start<'a> = &'a dyn Fn(&[(&str, String)], Option<usize>) -> Running;

/// The benchmark's configurations, in its table's column order: (TOFFLOAD_GUARD, the
/// path): unguarded, detect, coarse lock, enforce.
const CONFIGS: [(&str, &str); 4] = [
    ("off", "/incr"),
    ("detect", "/incr"),
    ("off", "/incrlocked"),
    ("enforce", "/incr"),
];

/// Requests per run at `lat_us`: about 2-3 s for the coarse lock.
fn requests(lat_us: u64) -> usize {
    (2_500_000 / (lat_us as usize + 100)).max(2000)
}

/// `/incr` unguarded, under detect, `/incrlocked`, `/incr` under enforce, at 200 and
/// 1000 us, one key and many; `start(env, cpu)` starts the integration's server. The
/// section for guard.md, headed `### {name}`; asserts that neither the lock nor
/// enforce lost an update.
pub fn benchmark(name: &str, about: &str, start: Start) -> String {
    let rounds = crate::reroute::rounds_from_env("TOFFLOAD_GUARD_ROUNDS");
    let clients = 50;
    let (scpu, bcpu) = crate::reroute::server_and_load_cpus();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let workloads = [
        ("one key", Keys::One),
        (
            "100000 keys over 1024 counters on 16 pages",
            Keys::Many(100_000),
        ),
    ];
    let (mut rows, mut lost_guarded, mut many_keys_ratio) = (Vec::new(), 0, f64::MAX);
    let mut detect_mech = String::new();
    for lat_us in [200u64, 1000] {
        let n = requests(lat_us);
        for (what, keys) in workloads {
            let mut got: Vec<Vec<(f64, i64, i64)>> = vec![Vec::new(); CONFIGS.len()];
            for _ in 0..rounds {
                for (i, &(mode, path)) in CONFIGS.iter().enumerate() {
                    let env = vec![
                        ("TOFFLOAD_GUARD", mode.to_string()),
                        ("TOFFLOAD_EMU_LAT_US", lat_us.to_string()),
                        ("TOFFLOAD_EMU_LANES", "64".to_string()),
                    ];
                    let (_server, port) = start(&env, scpu);
                    let run = increments(port, path, keys, clients, n, bcpu);
                    assert!(run.errors.is_empty(), "{path}: {:?}", run.errors);
                    let g = guard_stats(port);
                    assert_eq!(g.mode, mode);
                    if mode == "detect" {
                        detect_mech = g.mech.clone();
                    }
                    got[i].push((run.rps(), run.lost(), g.conflicts));
                }
            }
            let med = |i: usize| crate::reroute::median(got[i].iter().map(|x| x.0).collect());
            let lost = |i: usize| got[i].iter().map(|x| x.1).max().unwrap_or(0);
            let conflicts =
                |i: usize| crate::reroute::median(got[i].iter().map(|x| x.2 as f64).collect());
            let ratio = med(3) / med(2);
            lost_guarded += lost(2) + lost(3);
            if matches!(keys, Keys::Many(_)) {
                many_keys_ratio = many_keys_ratio.min(ratio);
            }
            let row = format!(
                "| {lat_us} | {what} | {:.0} ({}) | {:.0} ({:.0}, {}) | {:.0} ({}) | {:.0} ({}) | {ratio:.2}x |",
                med(0),
                lost(0),
                med(1),
                conflicts(1),
                lost(1),
                med(2),
                lost(2),
                med(3),
                lost(3)
            );
            println!("{name}: {row}");
            rows.push(row);
        }
    }
    let md = format!(
        "### {name}\n\n{about} `/incr?k=KEY` reads a counter, offloads (rerouted), writes it back \
         plus one; `/incrlocked` holds one coarse lock across the offload. 1024 counters, 64 to a \
         page, registered with the guard; detect saw writes with {detect_mech}. {clients} keep-alive \
         connections, one request at a time each, N requests per run (N = {n200} at 200 us, {n1000} \
         at 1000 us); a fresh server per run (the mode is per process); emulated device, 64 lanes. \
         Server on core 0, clients on core 1. {rounds} round(s), each running every configuration \
         back to back; req/s are medians, lost the largest over rounds: lost = acknowledged - /sum. \
         The host was loaded (other builds running); load average at the start: {load}.\n\
         Written by `guard_benchmark` of the integration's suite (tests/src/reroute_guard.rs) with \
         TOFFLOAD_GUARD_OUT set (`cargo xtask bench guard`).\n\n\
         | offload us | keys | unguarded req/s (lost) | detect req/s (conflicts, lost) | coarse lock req/s (lost) | enforce req/s (lost) | enforce / lock |\n\
         |---:|---|---:|---:|---:|---:|---:|\n{}\n\n\
         Target: enforce faster than the coarse lock with many keys, lost 0: {}.\n",
        rows.join("\n"),
        if many_keys_ratio > 1.0 && lost_guarded == 0 {
            format!("met ({many_keys_ratio:.2}x at least)")
        } else {
            format!("not met ({many_keys_ratio:.2}x, lost {lost_guarded})")
        },
        n200 = requests(200),
        n1000 = requests(1000),
        load = load.trim(),
    );
    println!("\n{md}");
    if let Some(out) = std::env::var_os("TOFFLOAD_GUARD_OUT") {
        write_section(Path::new(&out), &format!("### {name}"), &md);
    }
    assert_eq!(lost_guarded, 0, "the coarse lock or enforce lost updates");
    md
}

/// Replaces the section headed `heading` (up to the next `### ` heading) in `path`, or
/// appends it.
pub fn write_section(path: &Path, heading: &str, md: &str) {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let new = match old.find(&format!("{heading}\n")) {
        Some(i) => {
            let rest = &old[i + heading.len()..];
            let end = rest
                .find("\n### ")
                .map_or(old.len(), |j| i + heading.len() + j + 1);
            format!(
                "{}{md}{}",
                &old[..i],
                if end < old.len() { "\n" } else { "" }
            ) + &old[end..]
        }
        None => {
            let sep = if old.is_empty() || old.ends_with("\n\n") {
                ""
            } else if old.ends_with('\n') {
                "\n"
            } else {
                "\n\n"
            };
            format!("{old}{sep}{md}")
        }
    };
    std::fs::write(path, new).expect("writing the results file");
    println!("wrote {}", path.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_replaced_in_place_or_appended() {
        let p = std::env::temp_dir().join(format!("guard-section-{}.md", std::process::id()));
        std::fs::write(&p, "# t\n\n### A\nold a\n\n### B\nold b\n").unwrap();
        write_section(&p, "### A", "### A\nnew a\n");
        write_section(&p, "### C", "### C\nc\n");
        write_section(&p, "### B", "### B\nnew b\n");
        let got = std::fs::read_to_string(&p).unwrap();
        let _ = std::fs::remove_file(&p);
        assert_eq!(got, "# t\n\n### A\nnew a\n\n### B\nnew b\n\n### C\nc\n");
    }
}
