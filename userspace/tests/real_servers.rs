//! Verdicts on real servers from Debian's packages under their own load tools (as
//! root; `.ci/run` installs the packages, so under CI none of these may skip):
//! redis-server, nginx: event loop; memcached -t 4 and apache2's event MPM: thread
//! pool; apache2's prefork MPM and PostgreSQL: process per connection; a small Java
//! server on the JDK: beside wall; stunnel4 (a thread per connection): fiberizable.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use toffload_tests::harness;

mod common;
use common::{get, serial, watch_cmd, Watcher};

/// Root, the watcher built, and every program named on PATH; else skip.
fn ready(programs: &[&str]) -> bool {
    if !common::ready() {
        return false;
    }
    for p in programs {
        if which(p).is_none() {
            harness::skip(&format!("{p} is not installed (.ci/run installs it)"));
            return false;
        }
    }
    true
}

use harness::which;

fn free_port() -> u16 {
    harness::free_port().expect("a free port")
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("toffload-watch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A server process, killed on drop.
struct Proc(Child);

impl Drop for Proc {
    /// SIGTERM first, so a server with children (nginx's master) ends them: a SIGKILL
    /// left nginx's two workers running after the suite. SIGKILL after 10 s.
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(Some(_))) {
            return; // reaped: its pid may be another process's now
        }
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(cmd: &mut Command, port: u16) -> Proc {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let p = Proc(child);
    assert!(
        harness::wait_listening(port, Duration::from_secs(20)),
        "{cmd:?} never listened on {port}"
    );
    p
}

/// Watches `pid` (default budget) for `secs` while `load` runs (started once the
/// watcher is attached); the final report's total.
fn watch_total(pid: u32, secs: f64, load: impl FnOnce()) -> serde_json::Value {
    let mut cmd = watch_cmd();
    cmd.args(["--json", "--interval", "10s", "--duration"])
        .arg(format!("{secs}s"))
        .arg("--pid")
        .arg(pid.to_string());
    let w = Watcher::start(cmd);
    load();
    let (code, lines, err) = w.finish();
    assert_eq!(code, 0, "toffload-watch exit code: {err:?}");
    let total = get(&lines, "final")["total"].clone();
    println!(
        "verdict {} -- {} (requests {}, threads {}, futex {})\nprocesses {}",
        total["verdict"]["kind"],
        total["verdict"]["because"],
        total["requests"],
        total["threads"],
        total["futex"],
        total["processes"]
    );
    total
}

/// The final verdict (kind, because) of watch_total.
fn verdict(pid: u32, secs: f64, load: impl FnOnce()) -> (String, String) {
    let v = &watch_total(pid, secs, load)["verdict"];
    (
        v["kind"].as_str().unwrap_or_default().into(),
        v["because"].as_str().unwrap_or_default().into(),
    )
}

fn run_tool(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `conns` threads, each on its own connection, sending `req` and reading until the
/// reply ends with `end`, for `secs`.
fn tcp_load(port: u16, conns: usize, secs: f64, req: &'static [u8], end: &'static [u8]) -> u64 {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let handles: Vec<_> = (0..conns)
        .map(|_| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
                s.set_nodelay(true).ok();
                let mut n = 0u64;
                let mut buf = vec![0u8; 4096];
                while Instant::now() < deadline {
                    s.write_all(req).expect("send");
                    let mut got = Vec::new();
                    while !got.ends_with(end) {
                        let k = s.read(&mut buf).expect("recv");
                        assert!(k > 0, "server closed the connection");
                        got.extend_from_slice(&buf[..k]);
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("client")).sum()
}

/// redis-server on `port`, nothing saved, in a fresh directory, with `env` added.
fn redis(name: &str, port: u16, env: &[(&str, &str)]) -> Proc {
    let dir = tmpdir(name);
    start(
        Command::new(which("redis-server").unwrap())
            .args(["--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(&dir)
            .envs(env.iter().copied()),
        port,
    )
}

#[test]
fn redis_is_an_event_loop() {
    let _s = serial();
    if !ready(&["redis-server", "redis-benchmark"]) {
        return;
    }
    let port = free_port();
    let srv = redis("redis", port, &[]);
    let (kind, because) = verdict(srv.0.id(), 4.0, || {
        run_tool(
            Command::new("redis-benchmark")
                .args([
                    "-p",
                    &port.to_string(),
                    "-c",
                    "20",
                    "-n",
                    "40000",
                    "-t",
                    "get,set",
                    "-q",
                ])
                .stdout(Stdio::null()),
        )
    });
    assert_eq!(kind, "event_loop", "{because}");
}

/// redis-server sets its process title over its environment block: the watch must
/// neither read that as "no knob set" nor relaunch it without the environment it was
/// started with. Hazard first: the block read back is no environment at all.
#[test]
fn a_retitled_redis_is_not_relaunched_without_its_environment() {
    let _s = serial();
    if !ready(&["redis-server", "redis-benchmark"]) {
        return;
    }
    let port = free_port();
    let srv = redis("redis-retitled", port, &[("TOFFLOAD_EMU_LAT_US", "1000")]);
    let pid = srv.0.id();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
    assert!(
        !environ
            .split(|&c| c == 0)
            .any(|kv| kv.starts_with(b"TOFFLOAD_EMU_LAT_US=")),
        "redis-server kept its environment block: nothing to test"
    );
    let mut cmd = watch_cmd();
    cmd.args(["--json", "--interval", "1s", "--duration", "6s"])
        .args(["--inject", "--inject-after", "1", "--force", "--dry-run"])
        .arg("--pid")
        .arg(pid.to_string());
    let w = Watcher::start(cmd);
    run_tool(
        Command::new("redis-benchmark")
            .args([
                "-p",
                &port.to_string(),
                "-c",
                "8",
                "-n",
                "60000",
                "-t",
                "get",
                "-q",
            ])
            .stdout(Stdio::null()),
    );
    let (code, lines, err) = w.finish();
    assert_eq!(code, 8, "exit code; stderr: {err:?}");
    let ev = get(&lines, "inject");
    assert_eq!(ev["action"], "refused", "{ev}");
    assert!(
        ev["message"]
            .as_str()
            .unwrap_or("")
            .contains("wrote over its environment block"),
        "{ev}"
    );
    assert!(
        Path::new(&format!("/proc/{pid}")).exists(),
        "redis-server is gone"
    );
}

/// nginx on `port` with its own configuration in a fresh directory; `processes`
/// is its master_process/worker_processes lines.
fn nginx(name: &str, port: u16, processes: &str) -> Proc {
    let dir = tmpdir(name);
    let conf = nginx_conf(&dir, port, processes);
    start(
        Command::new(which("nginx").unwrap())
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(&conf)
            .stderr(Stdio::null()),
        port,
    )
}

fn nginx_conf(dir: &Path, port: u16, processes: &str) -> PathBuf {
    nginx_conf_serving(
        dir,
        port,
        processes,
        "location / { return 200 \"hello\\n\"; }",
    )
}

/// The same with `locations` as the server block's body.
fn nginx_conf_serving(dir: &Path, port: u16, processes: &str, locations: &str) -> PathBuf {
    let d = dir.display();
    let conf = format!(
        "daemon off;\n{processes}\npid {d}/nginx.pid;\n\
         error_log {d}/error.log;\nevents {{ worker_connections 1024; }}\n\
         http {{\n access_log off;\n client_body_temp_path {d}/body;\n proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fcgi;\n uwsgi_temp_path {d}/uwsgi;\n scgi_temp_path {d}/scgi;\n\
         server {{ listen 127.0.0.1:{port}; {locations} }}\n}}\n"
    );
    let p = dir.join("nginx.conf");
    std::fs::write(&p, conf).expect("nginx.conf");
    p
}

#[test]
fn nginx_is_an_event_loop() {
    let _s = serial();
    if !ready(&["nginx", "wrk"]) {
        return;
    }
    let port = free_port();
    // One process (master_process off), so its pid is the one serving.
    let srv = nginx("nginx", port, "master_process off;\nworker_processes 1;");
    let (kind, because) = verdict(srv.0.id(), 4.0, || {
        run_tool(
            Command::new("wrk")
                .args(["-t1", "-c20", "-d2s"])
                .arg(format!("http://127.0.0.1:{port}/"))
                .stdout(Stdio::null()),
        )
    });
    assert_eq!(kind, "event_loop", "{because}");
}

/// The pid an operator has is the master's: the watch follows it to the workers.
/// The requests it counts (socket reads, the workers') match wrk's own count, the
/// verdict is the workers' event loop, and the rows show the master idle.
#[test]
fn nginx_by_its_master_pid_watches_the_workers() {
    let _s = serial();
    if !ready(&["nginx", "wrk"]) {
        return;
    }
    let port = free_port();
    let srv = nginx(
        "nginx-master",
        port,
        "master_process on;\nworker_processes 2;",
    );
    let master = srv.0.id();
    let mut cmd = watch_cmd();
    // Every event traced: the count is compared with wrk's.
    cmd.args(["--json", "--sample", "100", "--interval", "10s"])
        .args(["--duration", "4s", "--pid"])
        .arg(master.to_string());
    let w = Watcher::start(cmd);
    let out = Command::new("wrk")
        .args(["-t1", "-c20", "-d2s"])
        .arg(format!("http://127.0.0.1:{port}/"))
        .output()
        .expect("wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    let served: f64 = text
        .lines()
        .find_map(|l| {
            l.trim()
                .split_once(" requests in ")
                .map(|(n, _)| n.trim().to_string())
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("wrk's count in {text}"));
    let (code, lines, err) = w.finish();
    assert_eq!(code, 0, "{err:?}");
    let fin = get(&lines, "final");
    let total = &fin["total"];
    let requests = total["requests"].as_f64().unwrap();
    println!(
        "nginx master {master}: {requests} requests watched, wrk {served}; verdict {} -- {}\n{}",
        total["verdict"]["kind"], total["verdict"]["because"], total["processes"]
    );
    assert!(
        (requests / served - 1.0).abs() <= 0.15,
        "{requests} requests watched, wrk counted {served}"
    );
    assert_eq!(total["verdict"]["kind"], "event_loop");
    let procs = total["processes"].as_array().expect("process rows");
    let main = procs
        .iter()
        .find(|p| p["pid"] == master)
        .expect("the master's row");
    assert_eq!(
        (main["role"].as_str(), main["model"].as_str()),
        (Some("main"), Some("idle"))
    );
    let workers: Vec<&serde_json::Value> = procs
        .iter()
        .filter(|p| p["role"] == "child" && p["model"] == "event_loop")
        .collect();
    assert_eq!(workers.len(), 2, "two workers serving: {procs:?}");
    assert!(workers.iter().all(|p| p["comm"] == "nginx"));
}

/// An apache2 parent (Proc's drop sends SIGTERM, which ends its children).
struct Apache(Proc);

/// apache2 with its own configuration (no Debian site), `mpm` = prefork or event.
fn apache(mpm: &str, port: u16) -> (Apache, PathBuf) {
    let dir = tmpdir(&format!("apache-{mpm}"));
    let www = dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("index.html"), "hello\n").unwrap();
    // Its children run as nobody: they must reach the document root.
    let _ = Command::new("chmod")
        .arg("-R")
        .arg("a+rX")
        .arg(&dir)
        .status();
    let modules = Path::new("/usr/lib/apache2/modules");
    let procs = match mpm {
        "prefork" => "StartServers 4\nMinSpareServers 4\nMaxSpareServers 16\nMaxRequestWorkers 32",
        _ => "StartServers 1\nServerLimit 1\nThreadsPerChild 16\nMaxRequestWorkers 16",
    };
    let d = dir.display();
    let conf = format!(
        "ServerRoot \"{d}\"\nDefaultRuntimeDir {d}\n\
         LoadModule mpm_{mpm}_module {m}/mod_mpm_{mpm}.so\n\
         LoadModule authz_core_module {m}/mod_authz_core.so\n\
         Listen 127.0.0.1:{port}\nPidFile {d}/httpd.pid\nErrorLog {d}/error.log\n\
         DocumentRoot {d}/www\nServerName localhost\nUser nobody\nGroup nogroup\n\
         Mutex file:{d}\n{procs}\n<Directory {d}/www>\n Require all granted\n</Directory>\n",
        m = modules.display()
    );
    let path = dir.join("httpd.conf");
    std::fs::write(&path, conf).unwrap();
    // A process group of its own: at shutdown the parent signals its whole group.
    use std::os::unix::process::CommandExt;
    let srv = start(
        Command::new(which("apache2").unwrap())
            .arg("-f")
            .arg(&path)
            .arg("-DFOREGROUND")
            .process_group(0)
            .stderr(Stdio::null()),
        port,
    );
    (Apache(srv), dir)
}

fn ab(port: u16) {
    run_tool(
        Command::new("ab")
            .args(["-q", "-c", "8", "-n", "20000"])
            .arg(format!("http://127.0.0.1:{port}/"))
            .stdout(Stdio::null()),
    );
}

/// apache2's prefork MPM serves each connection in a child process of its own;
/// the event MPM hands connections to a fixed pool of worker threads. Both watched
/// by the parent's pid, under ab.
#[test]
fn apache_prefork_is_a_process_per_connection_and_event_a_pool() {
    let _s = serial();
    if !ready(&["apache2", "ab"]) {
        return;
    }
    for (mpm, want) in [
        ("prefork", "process_per_connection"),
        ("event", "thread_pool"),
    ] {
        let port = free_port();
        let (srv, _dir) = apache(mpm, port);
        let parent = srv.0 .0.id();
        let total = watch_total(parent, 4.0, || ab(port));
        assert_eq!(
            total["verdict"]["kind"], want,
            "{mpm}: {}",
            total["verdict"]
        );
        let procs = total["processes"].as_array().expect("rows");
        let main = procs
            .iter()
            .find(|p| p["pid"] == parent)
            .expect("parent row");
        assert_eq!(main["model"], "idle", "{mpm}: the parent does not serve");
        let serving: Vec<_> = procs.iter().filter(|p| p["model"] != "idle").collect();
        if mpm == "prefork" {
            assert!(serving.len() >= 2, "prefork: {procs:?}");
            assert!(serving.iter().all(|p| p["model"] == "single_connection"));
        } else {
            assert_eq!(serving.len(), 1, "event: one child serves: {procs:?}");
            assert!(serving[0]["serving_threads"].as_u64().unwrap() >= 3);
        }
    }
}

/// PostgreSQL 15 under pgbench, watched by the postmaster's pid: a backend process
/// per client connection.
#[test]
fn postgresql_is_a_process_per_connection() {
    let _s = serial();
    let bin = Path::new("/usr/lib/postgresql/15/bin");
    if !ready(&["pgbench"]) {
        return;
    }
    if !bin.join("postgres").is_file() {
        harness::skip("PostgreSQL 15 is not installed (.ci/run installs postgresql)");
        return;
    }
    let port = free_port();
    let dir = tmpdir("postgres");
    let data = dir.join("data");
    // initdb and postgres refuse root: the package's postgres user runs them.
    let _ = Command::new("chown")
        .arg("-R")
        .arg("postgres")
        .arg(&dir)
        .status();
    let as_postgres = |cmd: String| {
        Command::new("su")
            .args(["postgres", "-s", "/bin/sh", "-c", &cmd])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("su postgres")
    };
    let st = as_postgres(format!(
        "{}/initdb -D {} -A trust -U postgres",
        bin.display(),
        data.display()
    ))
    .wait()
    .expect("initdb");
    assert!(st.success(), "initdb failed");
    let srv = start(
        Command::new("su").args([
            "postgres",
            "-s",
            "/bin/sh",
            "-c",
            &format!(
                "exec {}/postgres -D {} -k {} -p {port} -c listen_addresses=127.0.0.1 -c fsync=off",
                bin.display(),
                data.display(),
                dir.display()
            ),
        ]),
        port,
    );
    // The pid we hold is su's; the postmaster's is in its pid file. Stopped on drop
    // (SIGQUIT: immediate shutdown), whatever the test does.
    let postmaster: u32 = std::fs::read_to_string(data.join("postmaster.pid"))
        .ok()
        .and_then(|s| s.lines().next()?.trim().parse().ok())
        .expect("postmaster.pid");
    struct Stop(u32);
    impl Drop for Stop {
        fn drop(&mut self) {
            // SAFETY: signalling the test's own server.
            unsafe { libc::kill(self.0 as i32, libc::SIGQUIT) };
            for _ in 0..100 {
                if !std::path::Path::new(&format!("/proc/{}", self.0)).exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    let _stop = Stop(postmaster);
    let pg = |args: &[&str]| {
        run_tool(
            Command::new("pgbench")
                .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
                .args(args)
                .arg("postgres")
                .stdout(Stdio::null()),
        )
    };
    pg(&["-i", "-s", "1", "-q"]);
    let total = watch_total(postmaster, 5.0, || {
        pg(&["-c", "8", "-j", "2", "-T", "3", "-S"])
    });
    drop(srv);
    assert_eq!(
        total["verdict"]["kind"], "process_per_connection",
        "{}",
        total["verdict"]
    );
    let procs = total["processes"].as_array().expect("rows");
    let backends = procs
        .iter()
        .filter(|p| {
            p["model"] == "single_connection" && p["reads_per_sec"].as_f64().unwrap() > 100.0
        })
        .count();
    assert!(backends >= 8, "8 clients, a backend each: {procs:?}");
    let main = procs
        .iter()
        .find(|p| p["pid"] == postmaster)
        .expect("the postmaster's row");
    assert_eq!(main["model"], "idle");
}

#[test]
fn memcached_is_a_thread_pool() {
    let _s = serial();
    if !ready(&["memcached"]) {
        return;
    }
    let port = free_port();
    let srv = start(
        Command::new(which("memcached").unwrap()).args([
            "-p",
            &port.to_string(),
            "-U",
            "0",
            "-t",
            "4",
            "-u",
            "root",
            "-l",
            "127.0.0.1",
        ]),
        port,
    );
    let (kind, because) = verdict(srv.0.id(), 4.0, || {
        let n = tcp_load(port, 16, 2.0, b"get toffload\r\n", b"END\r\n");
        assert!(n > 100, "{n} gets");
    });
    // Four worker threads (-t 4), each multiplexing its share of the connections.
    assert_eq!(kind, "thread_pool", "{because}");
}

const JAVA_SERVER: &str = r#"
import java.io.*;
import java.net.*;

// Thread per connection: echoes each line back.
public class EchoServer {
    public static void main(String[] a) throws Exception {
        ServerSocket ss = new ServerSocket(Integer.parseInt(a[0]), 128, InetAddress.getLoopbackAddress());
        for (;;) {
            Socket s = ss.accept();
            new Thread(() -> {
                try (s; BufferedReader r = new BufferedReader(new InputStreamReader(s.getInputStream()));
                     OutputStream o = s.getOutputStream()) {
                    String l;
                    while ((l = r.readLine()) != null) o.write((l + "\n").getBytes());
                } catch (IOException e) { }
            }).start();
        }
    }
}
"#;

#[test]
fn java_server_is_beside_the_wall() {
    let _s = serial();
    if !ready(&["javac", "java"]) {
        return;
    }
    let dir = tmpdir("java");
    std::fs::write(dir.join("EchoServer.java"), JAVA_SERVER).expect("source");
    run_tool(
        Command::new("javac")
            .arg("-d")
            .arg(&dir)
            .arg(dir.join("EchoServer.java")),
    );
    let port = free_port();
    let srv = start(
        Command::new("java")
            .arg("-cp")
            .arg(&dir)
            .args(["EchoServer", &port.to_string()]),
        port,
    );
    let (kind, because) = verdict(srv.0.id(), 3.0, || {
        let n = tcp_load(port, 8, 1.5, b"ping\n", b"\n");
        assert!(n > 100, "{n} echoes");
    });
    assert_eq!(kind, "beside_wall", "{because}");
    assert!(because.contains("JVM"), "{because}");
}

#[test]
fn stunnel_is_fiberizable() {
    let _s = serial();
    if !ready(&["stunnel4", "openssl"]) {
        return;
    }
    let dir = tmpdir("stunnel");
    run_tool(
        Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .args(["-subj", "/CN=localhost", "-keyout"])
            .arg(dir.join("key.pem"))
            .arg("-out")
            .arg(dir.join("cert.pem"))
            .stderr(Stdio::null()),
    );
    // The backend: a thread-per-connection echo in this process.
    let backend = TcpListener::bind("127.0.0.1:0").expect("backend");
    let bport = backend.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for s in backend.incoming().map_while(Result::ok) {
            std::thread::spawn(move || {
                let mut s = s;
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 || s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    let port = free_port();
    let conf = format!(
        "foreground = yes\npid =\n[echo]\naccept = 127.0.0.1:{port}\nconnect = 127.0.0.1:{bport}\n\
         cert = {d}/cert.pem\nkey = {d}/key.pem\n",
        d = dir.display()
    );
    std::fs::write(dir.join("stunnel.conf"), conf).expect("stunnel.conf");
    let srv = start(
        Command::new(which("stunnel4").unwrap())
            .arg(dir.join("stunnel.conf"))
            .stderr(Stdio::null()),
        port,
    );
    let (kind, because) = verdict(srv.0.id(), 4.0, || {
        let deadline = Instant::now() + Duration::from_secs(2);
        let handles: Vec<_> = (0..8)
            .map(|_| {
                std::thread::spawn(move || {
                    let mut b = openssl::ssl::SslConnector::builder(openssl::ssl::SslMethod::tls())
                        .expect("tls");
                    b.set_verify(openssl::ssl::SslVerifyMode::NONE);
                    let c = b.build();
                    let tcp = TcpStream::connect(("127.0.0.1", port)).expect("connect");
                    let mut s = c.connect("localhost", tcp).expect("handshake");
                    let mut n = 0u64;
                    let mut buf = [0u8; 64];
                    while Instant::now() < deadline {
                        s.write_all(b"ping\n").expect("send");
                        let mut got = 0;
                        while got < 5 {
                            got += s.read(&mut buf).expect("recv");
                        }
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let n: u64 = handles.into_iter().map(|h| h.join().expect("client")).sum();
        assert!(n > 100, "{n} round trips");
    });
    assert_eq!(kind, "fiberizable", "{because}");
}

#[test]
fn mariadb_is_below_libc() {
    let _s = serial();
    if !ready(&["mariadbd", "mariadb-install-db", "mariadb-slap"]) {
        return;
    }
    let dir = tmpdir("mariadb");
    let data = dir.join("data");
    run_tool(
        Command::new("mariadb-install-db")
            .arg(format!("--datadir={}", data.display()))
            .args(["--user=root", "--auth-root-authentication-method=normal"])
            .stdout(Stdio::null()),
    );
    let port = free_port();
    let sock = dir.join("sock");
    let srv = start(
        Command::new(which("mariadbd").unwrap())
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--socket={}", sock.display()))
            .arg(format!("--port={port}"))
            .args([
                "--bind-address=127.0.0.1",
                "--user=root",
                "--skip-grant-tables",
            ])
            .arg(format!("--pid-file={}", dir.join("pid").display()))
            .arg(format!("--log-error={}", dir.join("err.log").display())),
        port,
    );
    let (kind, because) = verdict(srv.0.id(), 8.0, || {
        run_tool(
            Command::new("mariadb-slap")
                .arg(format!("--socket={}", sock.display()))
                .args([
                    "--concurrency=16",
                    "--iterations=1",
                    "--number-of-queries=8000",
                ])
                .args(["--auto-generate-sql", "--auto-generate-sql-load-type=mixed"])
                .stdout(Stdio::null()),
        )
    });
    assert_eq!(kind, "below_libc_wall", "{because}");
}

/// The server's own count of requests served, sampled with the Unix time.
type Samples = Vec<(f64, f64)>;

/// Polls `count` every 100 ms until `stop`, with the Unix time of each reading.
fn poll_own_count(
    count: impl Fn() -> Option<f64> + Send + 'static,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Samples> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some(n) = count() {
                v.push((unix_now(), n));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        v
    })
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The own count at Unix time `t`, between the readings either side of it (polled
/// every 0.1 s, so an untraced stretch's edges fall between two).
fn own_count_at(samples: &Samples, t: f64) -> Option<f64> {
    let i = samples.iter().position(|&(at, _)| at >= t)?;
    let (t1, n1) = samples[i];
    if i == 0 {
        return (t1 == t).then_some(n1);
    }
    let (t0, n0) = samples[i - 1];
    Some(n0 + (n1 - n0) * (t - t0) / (t1 - t0).max(1e-9))
}

/// The own count's rate over `spans` (Unix s) together: its growth within them over
/// their seconds; None where an edge is outside the readings.
fn own_rate_over(samples: &Samples, spans: &[(f64, f64)]) -> Option<f64> {
    let mut n = 0.0;
    let mut secs = 0.0;
    for &(a, b) in spans {
        n += own_count_at(samples, b)? - own_count_at(samples, a)?;
        secs += b - a;
    }
    (secs > 0.3).then(|| n / secs)
}

/// A stock server watched at the default budget under its own load tool: each
/// window's rate without the watch (`untraced`) against the server's own count over
/// the same seconds, and the watch's cost measured on the server beside the
/// calibration's.
fn rates_against_own_count(what: &str, pid: u32, own: impl Fn() -> Option<f64> + Send + 'static) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = poll_own_count(own, stop.clone());
    let mut cmd = watch_cmd();
    cmd.args(["--json", "--interval", "1s", "--duration", "7s", "--pid"])
        .arg(pid.to_string());
    let (code, lines, err) = Watcher::start(cmd).finish();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let samples = poller.join().expect("poller");
    assert_eq!(code, 0, "{err:?}");
    let mut ratios = Vec::new();
    let mut measured = 0;
    // The first window holds the start; the last may hold the load's end.
    let windows: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|(k, _)| k == "window")
        .map(|(_, v)| v)
        .collect();
    assert!(windows.len() >= 5, "{what}: {} windows", windows.len());
    for w in &windows[1..windows.len() - 1] {
        let (ts, wall) = (w["ts"].as_f64().unwrap(), w["wall_secs"].as_f64().unwrap());
        // The server's count over the untraced rate's own seconds.
        let spans: Vec<(f64, f64)> = w["untraced"]["spans"]
            .as_array()
            .map(|v| {
                v.iter()
                    .filter_map(|s| Some((s[0].as_f64()?, s[1].as_f64()?)))
                    .collect()
            })
            .unwrap_or_else(|| vec![(ts - wall, ts)]);
        let own = own_rate_over(&samples, &spans);
        let c = &w["watcher"];
        let (cal, meas, each) = (
            c["calibrated_us_per_request"].as_f64(),
            c["measured_us_per_request"].as_f64(),
            c["us_per_request"].as_f64(),
        );
        println!(
            "{what}: traced {:.0} req/s, untraced {}, own count {}; cost per request {each:?} us (calibrated {cal:?}, measured {meas:?}), share {:.3}, duty {:.4}",
            w["requests_per_sec"].as_f64().unwrap_or(f64::NAN),
            w["untraced"]["requests_per_sec"],
            own.map_or("-".into(), |r| format!("{r:.0}")),
            c["share_traced"].as_f64().unwrap_or(f64::NAN),
            c["duty"].as_f64().unwrap_or(f64::NAN),
        );
        if let (Some(u), Some(o)) = (w["untraced"]["requests_per_sec"].as_f64(), own) {
            ratios.push(u / o);
        }
        if let (Some(m), Some(e)) = (meas, each) {
            measured += 1;
            // The cost reported is the larger of the two.
            assert!(e + 1e-9 >= m && e + 1e-9 >= cal.unwrap_or(0.0), "{c}");
        }
    }
    assert!(
        ratios.len() >= 3,
        "{what}: {} windows with an untraced rate and the server's count",
        ratios.len()
    );
    let med = harness::median(ratios.clone());
    assert!(
        (med - 1.0).abs() <= 0.15,
        "{what}: the watch's untraced rate over the server's own count, per window: {ratios:?}"
    );
    assert!(
        measured >= 3,
        "{what}: the watch measured its cost on the server in {measured} windows"
    );
}

/// `prog` under taskset: a server on the last CPU where there are two or more, its
/// load tool on the others, so the server's rate is its own core's.
fn on_cpus(prog: impl AsRef<std::ffi::OsStr>, server: bool) -> Command {
    let cpus = harness::cpus();
    if cpus < 2 {
        return Command::new(prog);
    }
    let list = if server {
        (cpus - 1).to_string()
    } else {
        format!("0-{}", cpus - 2)
    };
    let mut c = Command::new("taskset");
    c.args(["-c", &list]).arg(prog);
    c
}

/// The rate toffload-watch reports for stock nginx (one worker, a static file, wrk)
/// and redis-server (redis-benchmark GETs) agrees with the server's own count
/// (stub_status; INFO's total_commands_processed) over the same seconds, and the
/// watch's cost is measured on each.
#[test]
fn stock_servers_rates_agree_with_their_own_counts() {
    let _s = serial();
    if !ready(&[
        "nginx",
        "wrk",
        "redis-server",
        "redis-benchmark",
        "redis-cli",
    ]) {
        return;
    }
    // nginx: a file, so each request opens, stats and reads it as a real site does.
    let port = free_port();
    let dir = tmpdir("nginx-own-count");
    std::fs::create_dir_all(dir.join("www")).unwrap();
    std::fs::write(dir.join("www/index.html"), "hello\n").unwrap();
    let conf = nginx_conf_serving(
        &dir,
        port,
        "master_process off;\nworker_processes 1;",
        &format!(
            "location = /status {{ stub_status; }} location / {{ root {}/www; }}",
            dir.display()
        ),
    );
    let srv = start(
        on_cpus(which("nginx").unwrap(), true)
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(&conf)
            .stderr(Stdio::null()),
        port,
    );
    let mut wrk = on_cpus("wrk", false)
        .args(["-t1", "-c32", "-d11s"])
        .arg(format!("http://127.0.0.1:{port}/"))
        .stdout(Stdio::null())
        .spawn()
        .expect("wrk");
    std::thread::sleep(Duration::from_millis(500));
    let stub = move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(b"GET /status HTTP/1.0\r\nHost: t\r\n\r\n")
            .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        // After the headers: "Active connections: N \nserver accepts handled
        // requests\n A H R \n...". The count includes this request.
        let body = text.split_once("\r\n\r\n")?.1;
        body.lines().nth(2)?.split_whitespace().nth(2)?.parse().ok()
    };
    assert!(stub().is_some(), "nginx's stub_status");
    rates_against_own_count("nginx", srv.0.id(), stub);
    let _ = wrk.kill();
    let _ = wrk.wait();
    drop(srv);

    let port = free_port();
    let dir = tmpdir("redis-own-count");
    let srv = start(
        on_cpus(which("redis-server").unwrap(), true)
            .args(["--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(&dir),
        port,
    );
    // -n far beyond the watch: killed at the end.
    let mut bench = on_cpus("redis-benchmark", false)
        .args(["-p", &port.to_string(), "-c", "50", "-t", "get"])
        .args(["-n", "100000000", "-q"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-benchmark");
    std::thread::sleep(Duration::from_millis(500));
    let info = move || {
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string(), "info", "stats"])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("total_commands_processed:"))
            .and_then(|v| v.trim().parse().ok())
    };
    assert!(info().is_some(), "redis' INFO stats");
    rates_against_own_count("redis-server", srv.0.id(), info);
    let _ = bench.kill();
    let _ = bench.wait();
}
