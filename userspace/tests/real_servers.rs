//! Verdicts on real servers from Debian's packages under their own load tools (as
//! root; `.ci/run` installs the packages, so under CI none of these may skip):
//! redis-server, nginx, memcached: event loop; a small Java server on the JDK: beside
//! wall; stunnel4 (a thread per connection): fiberizable.

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
    fn drop(&mut self) {
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

/// Watches `pid` for `secs` while `load` runs (started once the watcher is attached);
/// returns the final verdict (kind, because).
fn verdict(pid: u32, secs: f64, load: impl FnOnce()) -> (String, String) {
    let mut cmd = watch_cmd();
    cmd.args(["--json", "--interval", "10s", "--duration"])
        .arg(format!("{secs}s"))
        .arg("--pid")
        .arg(pid.to_string());
    let w = Watcher::start(cmd);
    load();
    let (code, lines, _) = w.finish();
    assert_eq!(code, 0, "toffload-watch exit code");
    let fin = get(&lines, "final");
    let v = &fin["total"]["verdict"];
    println!(
        "verdict {} -- {} (requests {}, threads {}, futex {})",
        v["kind"],
        v["because"],
        fin["total"]["requests"],
        fin["total"]["threads"],
        fin["total"]["futex"]
    );
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

#[test]
fn redis_is_an_event_loop() {
    let _s = serial();
    if !ready(&["redis-server", "redis-benchmark"]) {
        return;
    }
    let port = free_port();
    let dir = tmpdir("redis");
    let srv = start(
        Command::new(which("redis-server").unwrap())
            .args([
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&dir),
        port,
    );
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

fn nginx_conf(dir: &Path, port: u16) -> PathBuf {
    let d = dir.display();
    let conf = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\n\
         error_log {d}/error.log;\nevents {{ worker_connections 1024; }}\n\
         http {{\n access_log off;\n client_body_temp_path {d}/body;\n proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fcgi;\n uwsgi_temp_path {d}/uwsgi;\n scgi_temp_path {d}/scgi;\n\
         server {{ listen 127.0.0.1:{port}; location / {{ return 200 \"hello\\n\"; }} }}\n}}\n"
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
    let dir = tmpdir("nginx");
    let conf = nginx_conf(&dir, port);
    // One process (master_process off), so its pid is the one serving.
    let srv = start(
        Command::new(which("nginx").unwrap())
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(&conf)
            .stderr(Stdio::null()),
        port,
    );
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

#[test]
fn memcached_is_an_event_loop() {
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
    assert_eq!(kind, "event_loop", "{because}");
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
