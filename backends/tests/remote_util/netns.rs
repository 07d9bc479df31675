//! Network namespaces joined by veth pairs, shaped links, made and removed by the
//! tests themselves (unique names, removed on drop, every wait bounded).
//!
//! Shaping: `tc netem` (delay, jitter, rate) where the kernel has it. This project's
//! machines run a kernel built without sch_netem (CONFIG_NET_SCH_NETEM unset), so
//! there the rate is `tc tbf` on both veth ends (kernel) and the delay a userspace
//! delay line in the daemon's namespace: a TCP relay that holds every byte for the
//! one-way delay (plus jitter, order kept) in each direction before passing it on.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Whether this process may make namespaces; otherwise the reason to skip.
pub fn can_run() -> Result<(), String> {
    // SAFETY: plain getter.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (network namespaces)".into());
    }
    if !super_ok(Command::new("ip").args(["-V"])) || !super_ok(Command::new("tc").args(["-V"])) {
        return Err("needs ip and tc (apt-get install iproute2)".into());
    }
    Ok(())
}

/// Prints why a test skips, or fails it when TOFFLOAD_NO_SKIP=1 (CI).
pub fn skip_or_fail(why: &str) {
    if std::env::var("TOFFLOAD_NO_SKIP").is_ok_and(|v| v == "1") {
        panic!("cannot run (TOFFLOAD_NO_SKIP=1 forbids skipping): {why}");
    }
    println!("SKIPPED: {why}");
}

fn super_ok(c: &mut Command) -> bool {
    c.output().map(|o| o.status.success()).unwrap_or(false)
}

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// How a link is shaped.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub mbit: u32,
    /// One-way delay, each direction, microseconds.
    pub delay_us: u32,
    /// Jitter (uniform +-), microseconds.
    pub jitter_us: u32,
}

/// A namespace `ns` holding the daemon side of a veth pair whose other end is in the
/// client namespace.
pub struct Link {
    pub ns: String,
    pub host_if: String,
    pub client_ip: String,
    pub daemon_ip: String,
    pub shape: Shape,
    /// "netem" or "tbf + userspace delay line".
    pub how: &'static str,
}

/// The client's namespace and the links from it.
pub struct Net {
    pub client_ns: String,
    pub links: Vec<Link>,
    tag: String,
}

fn ns_fd(name: &str) -> std::fs::File {
    std::fs::File::open(format!("/run/netns/{name}")).expect("netns file")
}

/// Moves the calling thread into namespace `name` (threads it creates later follow).
pub fn enter(name: &str) {
    let f = ns_fd(name);
    // SAFETY: setns on an open netns fd; affects this thread only.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {name}: {}", std::io::Error::last_os_error());
}

impl Net {
    /// A client namespace and one link per shape. Names carry the pid and `tag`.
    pub fn new(tag: &str, shapes: &[Shape]) -> Result<Net, String> {
        let pid = std::process::id() % 100_000;
        let tag = format!("{tag}{pid}");
        let mut net = Net {
            client_ns: format!("tfrc{tag}"),
            links: Vec::new(),
            tag: tag.clone(),
        };
        sh(&["ip", "netns", "add", &net.client_ns])?;
        sh(&["ip", "-n", &net.client_ns, "link", "set", "lo", "up"])?;
        let netem = std::env::var("TOFFLOAD_TEST_NO_NETEM").is_err();
        for (k, s) in shapes.iter().enumerate() {
            let ns = format!("tfrd{k}{tag}");
            let host_if = format!("tfh{k}{pid}");
            let dev_if = format!("tfd{k}{pid}");
            let subnet = 100 + (pid % 100) as u8;
            let client_ip = format!("10.{subnet}.{k}.1");
            let daemon_ip = format!("10.{subnet}.{k}.2");
            sh(&["ip", "netns", "add", &ns])?;
            let link = Link {
                ns: ns.clone(),
                host_if: host_if.clone(),
                client_ip: client_ip.clone(),
                daemon_ip: daemon_ip.clone(),
                shape: *s,
                how: "",
            };
            net.links.push(link);
            let c = net.client_ns.clone();
            sh(&[
                "ip", "-n", &c, "link", "add", &host_if, "type", "veth", "peer", "name", &dev_if,
                "netns", &ns,
            ])?;
            sh(&[
                "ip",
                "-n",
                &c,
                "addr",
                "add",
                &format!("{client_ip}/24"),
                "dev",
                &host_if,
            ])?;
            sh(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{daemon_ip}/24"),
                "dev",
                &dev_if,
            ])?;
            sh(&["ip", "-n", &c, "link", "set", &host_if, "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", &dev_if, "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            let rate = format!("{}mbit", s.mbit);
            let mut how = "tbf rate + userspace delay line (no sch_netem in this kernel)";
            let mut done = false;
            if netem {
                let delay = format!("{}us", s.delay_us);
                let jitter = format!("{}us", s.jitter_us);
                let ok = [(&c, &host_if), (&ns, &dev_if)].iter().all(|(n, i)| {
                    sh(&[
                        "tc", "-n", n, "qdisc", "add", "dev", i, "root", "netem", "delay", &delay,
                        &jitter, "rate", &rate, "limit", "100000",
                    ])
                    .is_ok()
                });
                if ok {
                    how = "netem";
                    done = true;
                }
            }
            if !done {
                // Burst: at least one 10 ms worth at the rate, so tbf does not starve TSO.
                let burst = format!("{}kb", (s.mbit as u64 * 10 / 8).max(64));
                for (n, i) in [(&c, &host_if), (&ns, &dev_if)] {
                    let _ = sh(&["tc", "-n", n, "qdisc", "del", "dev", i, "root"]);
                    sh(&[
                        "tc", "-n", n, "qdisc", "add", "dev", i, "root", "tbf", "rate", &rate,
                        "burst", &burst, "latency", "100ms",
                    ])?;
                }
            }
            net.links[k].how = how;
        }
        Ok(net)
    }

    pub fn uses_netem(&self) -> bool {
        self.links.iter().all(|l| l.how == "netem")
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for l in &self.links {
            let _ = sh(&["ip", "netns", "del", &l.ns]);
        }
        let _ = sh(&["ip", "netns", "del", &self.client_ns]);
        let _ = &self.tag;
    }
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// A userspace delay line: listens on `listen` inside namespace `ns`, forwards each
/// connection to `target` (in the same namespace) and holds every byte `delay_us`
/// (+- jitter, order kept) in each direction. Buffering per direction is bounded.
pub struct DelayLine {
    pub port: u16,
    stop: Arc<AtomicBool>,
    pub bytes: Arc<AtomicU64>,
}

impl DelayLine {
    pub fn start(
        ns: &str,
        listen_ip: &str,
        target: String,
        delay_us: u32,
        jitter_us: u32,
    ) -> DelayLine {
        let (tx, rx) = mpsc::channel();
        let ns = ns.to_string();
        let listen_ip = listen_ip.to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let bytes = Arc::new(AtomicU64::new(0));
        let (stop2, bytes2) = (stop.clone(), bytes.clone());
        std::thread::spawn(move || {
            enter(&ns);
            // SAFETY: our own thread's timer slack (1 ns: sleeps end on time).
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
            let l = TcpListener::bind(format!("{listen_ip}:0")).unwrap();
            tx.send(l.local_addr().unwrap().port()).unwrap();
            l.set_nonblocking(true).unwrap();
            let mut seed = 0x1234_5678_9abc_def1u64;
            while !stop2.load(Relaxed) {
                let (a, _) = match l.accept() {
                    Ok(x) => x,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                };
                a.set_nonblocking(false).unwrap();
                let Ok(b) = TcpStream::connect(&target) else {
                    continue;
                };
                let _ = a.set_nodelay(true);
                let _ = b.set_nodelay(true);
                for (from, to) in [(a.try_clone().unwrap(), b.try_clone().unwrap()), (b, a)] {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let s = seed;
                    let stop = stop2.clone();
                    let bytes = bytes2.clone();
                    std::thread::spawn(move || pipe(from, to, delay_us, jitter_us, s, stop, bytes));
                }
            }
        });
        let port = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("delay line start");
        DelayLine { port, stop, bytes }
    }
}

impl Drop for DelayLine {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

fn pipe(
    mut from: TcpStream,
    to: TcpStream,
    delay_us: u32,
    jitter_us: u32,
    seed: u64,
    stop: Arc<AtomicBool>,
    bytes: Arc<AtomicU64>,
) {
    // Bounded: at most 256 chunks (of <= 64 KiB) held per direction.
    let (tx, rx) = mpsc::sync_channel::<(Instant, Vec<u8>)>(256);
    let writer = {
        let mut to = to.try_clone().unwrap();
        std::thread::spawn(move || {
            // SAFETY: own thread's timer slack.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
            while let Ok((at, buf)) = rx.recv() {
                sleep_until(at);
                if to.write_all(&buf).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Write);
        })
    };
    let _ = from.set_read_timeout(Some(Duration::from_millis(200)));
    let mut x = seed | 1;
    let mut last = Instant::now();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        if stop.load(Relaxed) {
            break;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(_) => break,
        };
        bytes.fetch_add(n as u64, Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let j = if jitter_us > 0 {
            (x % (2 * jitter_us as u64 + 1)) as i64 - jitter_us as i64
        } else {
            0
        };
        let d = (delay_us as i64 + j).max(0) as u64;
        let at = (Instant::now() + Duration::from_micros(d)).max(last);
        last = at;
        if tx.send((at, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.join();
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// A daemon reachable over `link`: its address as the client dials it.
pub fn daemon_on(
    link: &Link,
    args: &[&str],
    env: &[(&str, &str)],
) -> (super::Daemon, Option<DelayLine>, String) {
    // All addresses of its namespace: the link's (netem) or loopback (the delay line's
    // target, and stats queries from inside). Plaintext beyond loopback is fine here:
    // the namespace's link reaches nothing but the test.
    let mut a: Vec<&str> = vec!["--listen", "0.0.0.0:0", "--insecure-plaintext"];
    a.extend_from_slice(args);
    let d = super::Daemon::start_in(&["ip", "netns", "exec", &link.ns], &a, env);
    if link.how == "netem" {
        let addr = format!("{}:{}", link.daemon_ip, d.port);
        (d, None, addr)
    } else {
        let dl = DelayLine::start(
            &link.ns,
            &link.daemon_ip,
            format!("127.0.0.1:{}", d.port),
            link.shape.delay_us,
            link.shape.jitter_us,
        );
        let addr = format!("{}:{}", link.daemon_ip, dl.port);
        (d, Some(dl), addr)
    }
}

/// Stats of a daemon in a namespace (asked from inside it).
pub fn stats_in(ns: &str, port: u16) -> std::collections::HashMap<String, u64> {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        enter(&ns);
        super::stats(&format!("127.0.0.1:{port}"))
    })
    .join()
    .unwrap()
}

/// Runs `f` on a thread inside namespace `ns` (threads it starts stay there).
pub fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        enter(&ns);
        f()
    })
    .join()
    .expect("thread in namespace")
}

/// The placement scenario: a fast daemon (200 us, 64 lanes) on `net.links[0]` and a
/// slow one (2 ms, 4 lanes) on `net.links[1]`; kept alive by the returned guards.
pub struct UnequalDaemons {
    _fast: (super::Daemon, Option<DelayLine>),
    _slow: (super::Daemon, Option<DelayLine>),
    pub addrs: [String; 2],
}

pub fn unequal_daemons(net: &Net) -> UnequalDaemons {
    let (f, fdl, a1) = daemon_on(
        &net.links[0],
        &[],
        &[("TOFFLOAD_EMU_LAT_US", "200"), ("TOFFLOAD_EMU_LANES", "64")],
    );
    let (s, sdl, a2) = daemon_on(
        &net.links[1],
        &[],
        &[("TOFFLOAD_EMU_LAT_US", "2000"), ("TOFFLOAD_EMU_LANES", "4")],
    );
    UnequalDaemons {
        _fast: (f, fdl),
        _slow: (s, sdl),
        addrs: [a1, a2],
    }
}

/// One placement run from the client namespace: `n` 4 KiB AES ops, 64 in flight, all
/// answered right within `limit`; (ops/s, ops per daemon).
pub fn placement_run(
    net: &Net,
    d: &UnequalDaemons,
    p: toffload_accel::remote::Placement,
    n: u64,
    deadline_ms: u64,
    limit: Duration,
) -> (f64, Vec<u64>) {
    let addrs = d.addrs.to_vec();
    in_ns(&net.client_ns, move || {
        let r = super::client(&addrs, |c| {
            c.placement = p;
            c.deadline_ms = deadline_ms;
        });
        let mut b = super::pattern(0, 4096);
        toffload_accel::Accelerator::run(&r, &mut b, toffload_accel::WaitStyle::Block).unwrap();
        let t0 = Instant::now();
        let (ok, failed, wrong) = super::aes_workload(&r, n, 4096, 2, 64, limit, |_| {});
        assert_eq!((ok, failed, wrong), (n, 0, 0));
        (
            n as f64 / t0.elapsed().as_secs_f64(),
            r.counters().per_endpoint,
        )
    })
}
