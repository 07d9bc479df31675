//! The load generator behind `toffload-load`: one thread, epoll, closed or open loop,
//! every answer checked bit for bit against AES-128-CTR.

mod conn;
pub mod payload;
pub mod rng;
mod stats;
mod threads;

use conn::{Conn, Progress};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

pub use stats::Latencies;
pub use threads::run_threads;

#[derive(Clone, Debug)]
pub struct Config {
    pub addr: String,
    pub port: u16,
    /// Request (and answer) size, bytes.
    pub size: usize,
    pub conns: usize,
    pub duration: Duration,
    /// Run before measuring; not counted.
    pub warmup: Duration,
    /// Open loop at this many requests/s (Poisson); None = closed loop.
    pub rate: Option<f64>,
    /// A request unanswered this long is an error; its connection is reopened.
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub seed: u64,
    /// Ends the run early when set (a caller that needs load without gaps until it
    /// says stop); the rates are then over the time measured.
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

impl Config {
    pub fn new(port: u16) -> Config {
        Config {
            addr: "127.0.0.1".into(),
            port,
            size: 1024,
            conns: 64,
            duration: Duration::from_secs(5),
            warmup: Duration::from_secs(1),
            rate: None,
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            seed: 0x70ff_10ad,
            stop: None,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub requests_per_sec: f64,
    pub completed: u64,
    pub wrong: u64,
    pub errors: u64,
    pub errors_by_kind: BTreeMap<String, u64>,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub offered_rate: Option<f64>,
    pub duration_s: f64,
    pub conns: usize,
    pub size: usize,
    /// Answers completed in each TIMELINE_STEP_S of the measured time, from the Unix
    /// time timeline_start: what another tool's count over some seconds of the run
    /// (a watcher's window) is checked against.
    #[serde(default)]
    pub timeline_start: f64,
    #[serde(default)]
    pub timeline: Vec<u64>,
    /// Share of the whole run (warm-up included) the generator's thread spent sending
    /// and handling answers rather than waiting or polling in vain: how close it came
    /// to saturating (wall time, so time the thread lost to other work counts as busy).
    #[serde(default)]
    pub busy_share: f64,
    /// Answers per second of that busy time: about the most this one thread could
    /// drive against a server that answers at once.
    #[serde(default)]
    pub answers_per_busy_s: f64,
    /// Open loop: how late the generator itself handed the measured arrivals to their
    /// connections, p99 and max, microseconds. Its thread was busy or not running
    /// (other work, or the host, took its CPU); every latency above includes this,
    /// whatever the server, so a p99 near it is the generator's, not the server's.
    #[serde(default)]
    pub late_p99_us: f64,
    #[serde(default)]
    pub late_max_us: f64,
}

/// The timeline's step, seconds.
pub const TIMELINE_STEP_S: f64 = 0.1;

impl Report {
    /// Answers per second completed between the Unix times `from` and `to`, counting
    /// the steps at either edge in proportion; None where the span leaves the
    /// measured time.
    pub fn rate_between(&self, from: f64, to: f64) -> Option<f64> {
        let end = self.timeline_start + self.timeline.len() as f64 * TIMELINE_STEP_S;
        if !(to > from && from >= self.timeline_start - 1e-3 && to <= end + 1e-3) {
            return None;
        }
        let n: f64 = self
            .timeline
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let a = self.timeline_start + i as f64 * TIMELINE_STEP_S;
                let overlap = (to.min(a + TIMELINE_STEP_S) - from.max(a)).max(0.0);
                c as f64 * overlap / TIMELINE_STEP_S
            })
            .sum();
        Some(n / (to - from))
    }

    /// Answers per second over several spans together (a watch window's untraced
    /// stretches): their answers over their seconds; None where any leaves the
    /// measured time.
    pub fn rate_over(&self, spans: &[[f64; 2]]) -> Option<f64> {
        let secs: f64 = spans.iter().map(|[a, b]| b - a).sum();
        let mut n = 0.0;
        for &[a, b] in spans {
            n += self.rate_between(a, b)? * (b - a);
        }
        (secs > 0.0).then(|| n / secs)
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[derive(Debug)]
pub enum LoadError {
    /// Not one connection could be opened.
    Connect(String),
    Config(String),
    Os(std::io::Error),
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Connect(s) => write!(f, "cannot connect: {s}"),
            LoadError::Config(s) => write!(f, "{s}"),
            LoadError::Os(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for LoadError {}

struct Run<'a> {
    cfg: &'a Config,
    addr: SocketAddr,
    pool: payload::Pool,
    conns: Vec<Option<Conn>>,
    epfd: i32,
    t0: Instant,
    measure_from: u64,
    measure_to: u64,
    lat: Latencies,
    /// Open loop: each measured arrival's delay from its scheduled time to its dispatch.
    late: Latencies,
    completed: u64,
    /// Completions per TIMELINE_STEP_S from measure_from, and the Unix time of t0.
    timeline: Vec<u64>,
    unix_t0: f64,
    wrong: u64,
    errors: BTreeMap<String, u64>,
    next_payload: usize,
    /// Wall time spent sending arrivals and handling events (not waiting or polling
    /// in vain), and answers over the whole run: the generator's own capacity
    /// (Report::answers_per_busy_s).
    busy_ns: u64,
    answered_all: u64,
}

fn now_ns(t0: Instant) -> u64 {
    t0.elapsed().as_nanos() as u64
}

pub fn run(cfg: &Config) -> Result<Report, LoadError> {
    run_with_latencies(cfg).map(|(r, _)| r)
}

/// The histograms a run's percentiles came from (threads of one run merge them).
struct Hists {
    /// Answers' latencies.
    lat: Latencies,
    /// Open loop: arrivals' dispatch delays.
    late: Latencies,
}

/// A run, and the histograms its percentiles came from.
fn run_with_latencies(cfg: &Config) -> Result<(Report, Hists), LoadError> {
    if cfg.conns == 0 || cfg.size == 0 {
        return Err(LoadError::Config(
            "--conns and --size must be at least 1".into(),
        ));
    }
    if let Some(r) = cfg.rate {
        if !(r.is_finite() && r > 0.0) {
            return Err(LoadError::Config("--rate must be a positive number".into()));
        }
    }
    let addr = (cfg.addr.as_str(), cfg.port)
        .to_socket_addrs()
        .map_err(|e| LoadError::Connect(format!("{}:{}: {e}", cfg.addr, cfg.port)))?
        .next()
        .ok_or_else(|| LoadError::Connect(format!("{}: no address", cfg.addr)))?;
    let mut rng = rng::Rng::new(cfg.seed);
    // SAFETY: plain syscall.
    let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if epfd < 0 {
        return Err(LoadError::Os(std::io::Error::last_os_error()));
    }
    let mut run = Run {
        cfg,
        addr,
        pool: payload::Pool::new(cfg.size, &mut rng),
        conns: Vec::new(),
        epfd,
        t0: Instant::now(),
        measure_from: 0,
        measure_to: 0,
        lat: Latencies::new(),
        late: Latencies::new(),
        completed: 0,
        timeline: Vec::new(),
        unix_t0: 0.0,
        wrong: 0,
        errors: BTreeMap::new(),
        next_payload: 0,
        busy_ns: 0,
        answered_all: 0,
    };
    let result = run.drive(&mut rng).map(|r| {
        let h = Hists {
            lat: std::mem::take(&mut run.lat),
            late: std::mem::take(&mut run.late),
        };
        (r, h)
    });
    // SAFETY: our epoll fd.
    unsafe { libc::close(epfd) };
    result
}

impl Run<'_> {
    fn error(&mut self, kind: &str) {
        if now_ns(self.t0) >= self.measure_from {
            *self.errors.entry(kind.to_string()).or_default() += 1;
        }
    }

    fn register(&self, i: usize) {
        let c = self.conns[i].as_ref().expect("open");
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | if c.want_write { libc::EPOLLOUT } else { 0 }) as u32,
            u64: i as u64,
        };
        // SAFETY: valid fds; ADD for a new fd, MOD otherwise.
        unsafe {
            if libc::epoll_ctl(self.epfd, libc::EPOLL_CTL_MOD, c.fd(), &mut ev) < 0 {
                libc::epoll_ctl(self.epfd, libc::EPOLL_CTL_ADD, c.fd(), &mut ev);
            }
        }
    }

    fn open(&mut self, i: usize) -> std::io::Result<()> {
        let c = Conn::open(self.addr, self.cfg.size, self.cfg.connect_timeout)?;
        let queue = self.conns[i]
            .take()
            .map(|old| old.queue)
            .unwrap_or_default();
        let mut c = c;
        c.queue = queue;
        self.conns[i] = Some(c);
        self.register(i);
        Ok(())
    }

    /// Drops a broken connection (its request counts as an error) and reopens it.
    fn reopen(&mut self, i: usize, kind: &str) {
        self.error(kind);
        if let Some(c) = self.conns[i].as_mut() {
            c.inflight = None;
        }
        if self.open(i).is_err() {
            self.error("connect");
            self.conns[i] = None;
        }
    }

    fn send_next(&mut self, i: usize, due: u64) {
        let p = self.next_payload;
        self.next_payload = (p + 1) % self.pool.requests.len();
        let c = self.conns[i].as_mut().expect("open");
        c.begin(p, due);
        let was = c.want_write;
        let r = c.write_some(&self.pool.requests[p]);
        let changed = c.want_write != was;
        match r {
            Err(_) => self.reopen(i, "reset"),
            Ok(()) if changed => self.register(i),
            Ok(()) => {}
        }
    }

    fn start_if_idle(&mut self, i: usize) {
        let Some(c) = self.conns[i].as_mut() else {
            return;
        };
        if c.inflight.is_some() {
            return;
        }
        let due = match self.cfg.rate {
            None => now_ns(self.t0),
            Some(_) => match c.queue.pop_front() {
                Some(d) => d,
                None => return,
            },
        };
        self.send_next(i, due);
    }

    fn on_event(&mut self, i: usize, events: u32) {
        let Some(c) = self.conns[i].as_mut() else {
            return;
        };
        if events & libc::EPOLLOUT as u32 != 0 && c.want_write {
            if let Some((p, _)) = c.inflight {
                if c.write_some(&self.pool.requests[p]).is_err() {
                    return self.reopen(i, "reset");
                }
                if !c.want_write {
                    self.register(i);
                }
            }
        }
        let c = self.conns[i].as_mut().expect("open");
        match c.read_some() {
            Ok(Progress::Pending) => {}
            Ok(Progress::Answered) => {
                let (p, due) = c.inflight.take().expect("in flight");
                let ok = c.rbuf == self.pool.answers[p];
                let now = now_ns(self.t0);
                // A wrong answer counts whenever it comes, warm-up included:
                // correctness has no warm-up.
                if !ok {
                    self.wrong += 1;
                }
                self.answered_all += 1;
                if now >= self.measure_from && now < self.measure_to {
                    self.completed += 1;
                    self.lat.record(now.saturating_sub(due));
                    let step = ((now - self.measure_from) as f64 / 1e9 / TIMELINE_STEP_S) as usize;
                    if self.timeline.len() <= step {
                        self.timeline.resize(step + 1, 0);
                    }
                    self.timeline[step] += 1;
                }
                self.start_if_idle(i);
            }
            Err(e) => {
                let kind = match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => "eof",
                    std::io::ErrorKind::InvalidData => "unsolicited",
                    std::io::ErrorKind::ConnectionReset => "reset",
                    _ => "io",
                };
                self.reopen(i, kind)
            }
        }
    }

    fn drive(&mut self, rng: &mut rng::Rng) -> Result<Report, LoadError> {
        let cfg = self.cfg;
        let mut first_err = None;
        for i in 0..cfg.conns {
            self.conns.push(None);
            if let Err(e) = self.open(i) {
                first_err.get_or_insert(e.to_string());
                self.error("connect");
            }
        }
        if self.conns.iter().all(|c| c.is_none()) {
            return Err(LoadError::Connect(format!(
                "{}: {}",
                self.addr,
                first_err.unwrap_or_default()
            )));
        }
        self.t0 = Instant::now();
        self.unix_t0 = unix_now();
        self.measure_from = cfg.warmup.as_nanos() as u64;
        self.measure_to = self.measure_from + cfg.duration.as_nanos() as u64;
        let mut next_arrival = 0u64;
        let mut next_conn = 0usize;
        if cfg.rate.is_none() {
            for i in 0..cfg.conns {
                self.start_if_idle(i);
            }
        }
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; cfg.conns.min(1024)];
        let mut next_timeout_check = 0u64;
        loop {
            let now = now_ns(self.t0);
            if now >= self.measure_to {
                break;
            }
            if cfg
                .stop
                .as_ref()
                .is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed))
            {
                self.measure_to = now.max(self.measure_from);
                break;
            }
            let mut dispatched = false;
            if let Some(rate) = cfg.rate {
                // Hand every arrival that is due to the next connection in turn.
                while next_arrival <= now {
                    dispatched = true;
                    if (self.measure_from..self.measure_to).contains(&next_arrival) {
                        self.late.record(now - next_arrival);
                    }
                    let i = next_conn;
                    next_conn = (next_conn + 1) % cfg.conns;
                    if let Some(c) = self.conns[i].as_mut() {
                        c.queue.push_back(next_arrival);
                        self.start_if_idle(i);
                    } else {
                        self.error("no connection");
                    }
                    next_arrival += rng.exp_ns(rate).max(1);
                }
            }
            if now >= next_timeout_check {
                next_timeout_check = now + 10_000_000;
                self.expire(now);
            }
            let wait_ns = match cfg.rate {
                Some(_) => next_arrival.saturating_sub(now),
                None => 10_000_000,
            }
            .min(self.measure_to - now);
            let timeout_ms = (wait_ns / 1_000_000) as i32;
            let before_wait = now_ns(self.t0);
            if dispatched {
                self.busy_ns += before_wait - now;
            }
            // SAFETY: events buffer sized as passed.
            let n = unsafe {
                libc::epoll_wait(
                    self.epfd,
                    events.as_mut_ptr(),
                    events.len() as i32,
                    timeout_ms,
                )
            };
            // Polls that found nothing and waits are not work; a call that returned
            // events at once is.
            let after_wait = now_ns(self.t0);
            if n > 0 && timeout_ms == 0 {
                self.busy_ns += after_wait - before_wait;
            }
            for ev in events.iter().take(n.max(0) as usize).copied() {
                self.on_event(ev.u64 as usize, ev.events);
            }
            if n > 0 {
                self.busy_ns += now_ns(self.t0) - after_wait;
            }
        }
        let secs = (self.measure_to - self.measure_from) as f64 / 1e9;
        let wall_ns = now_ns(self.t0).max(1);
        let busy_ns = self.busy_ns.max(1);
        // Steps with no answer at the end count as such.
        let steps = (secs / TIMELINE_STEP_S).ceil() as usize;
        if self.timeline.len() < steps {
            self.timeline.resize(steps, 0);
        }
        Ok(Report {
            requests_per_sec: self.completed as f64 / secs.max(1e-9),
            completed: self.completed,
            wrong: self.wrong,
            errors: self.errors.values().sum(),
            errors_by_kind: self.errors.clone(),
            p50_us: self.lat.quantile_us(0.5),
            p99_us: self.lat.quantile_us(0.99),
            p999_us: self.lat.quantile_us(0.999),
            max_us: self.lat.max_us(),
            offered_rate: cfg.rate,
            duration_s: secs,
            conns: cfg.conns,
            size: cfg.size,
            timeline_start: self.unix_t0 + self.measure_from as f64 / 1e9,
            timeline: std::mem::take(&mut self.timeline),
            busy_share: busy_ns as f64 / wall_ns as f64,
            answers_per_busy_s: self.answered_all as f64 / (busy_ns as f64 / 1e9),
            late_p99_us: self.late.quantile_us(0.99),
            late_max_us: self.late.max_us(),
        })
    }

    fn expire(&mut self, now: u64) {
        let limit = self.cfg.timeout.as_nanos() as u64;
        for i in 0..self.conns.len() {
            let late = matches!(&self.conns[i], Some(c) if c.inflight.is_some_and(|(_, due)| now.saturating_sub(due) > limit));
            if late {
                self.reopen(i, "timeout");
                self.start_if_idle(i);
            } else if self.conns[i].is_none() && self.open(i).is_ok() {
                self.start_if_idle(i);
            }
        }
    }
}

#[cfg(test)]
mod tests;
