//! TLS with pre-shared keys (TOFFLOAD_REMOTE_PSK, --tls-psk): a client with its listed
//! identity and key is served bit-identical answers; a wrong key, an unknown identity,
//! plain TCP and a certificate-only TLS client are refused while the served client
//! goes on; malformed or missing key files stop the daemon and the client with a
//! message naming the file and the fault.

mod remote_util;

use remote_util::*;
use std::process::Command;
use std::time::Duration;
use toffload_accel::remote::tls::{psk_connector, read_client_psk};
use toffload_accel::remote::{Remote, RemoteConfig};

const KEY_A: &str = "8f3c0a1e5b7d92c46e10f2a3b4c5d6e7";
const KEY_B: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

#[test]
fn only_clients_with_their_key_are_served() {
    let dir = TempDir::new("psk");
    let daemon_keys = dir.path().join("daemon.psk");
    write_secret(
        &daemon_keys,
        format!("# identity key\nweb-1 {KEY_A}\nweb-2 {KEY_B}\n"),
    );
    let file = |name: &str, text: String| {
        let p = dir.path().join(name);
        write_secret(&p, text);
        p
    };
    let good = file("good.psk", format!("web-2 {KEY_B}\n"));
    let d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-psk",
            daemon_keys.to_str().unwrap(),
        ],
        &[("TOFFLOAD_EMU_LAT_US", "50")],
    );

    // The right identity and key: served, every answer bit-identical to AES-128-CTR
    // as the emulated backend computes it, sizes 1 B to 256 KiB.
    let r = client(&[d.addr()], |c| c.psk = Some(good.clone()));
    let (ok, failed, wrong) = aes_workload(&r, 5000, 200, 2, 256, Duration::from_secs(20), |_| {});
    assert_eq!((ok, failed, wrong), (5000, 0, 0));
    for len in [1usize, 255, 4096, 256 << 10] {
        let mut b = pattern(len as u64, len);
        toffload_accel::Accelerator::run(&r, &mut b, toffload_accel::WaitStyle::Block).unwrap();
        assert!(b == aes(pattern(len as u64, len)), "{len} B differ");
    }
    let conn = psk_connector(read_client_psk(&good).unwrap()).unwrap();
    assert_eq!(stats_tls(&d.addr(), &conn)["refused"], 0);

    // The right identity with another client's key: refused; its ops time out.
    let wrong_key = file("wrong.psk", format!("web-2 {KEY_A}\n"));
    let bad = client(&[d.addr()], |c| {
        c.deadline_ms = 600;
        c.psk = Some(wrong_key.clone());
    });
    let (ok, failed, _) = aes_workload(&bad, 3, 64, 1, 3, Duration::from_secs(10), |_| {});
    assert_eq!((ok, failed), (0, 3));
    assert!(bad.counters().connects == 0 && bad.counters().connect_failures >= 1);

    // An identity the daemon does not list.
    let stranger = file("stranger.psk", format!("web-9 {KEY_B}\n"));
    let bad = client(&[d.addr()], |c| {
        c.deadline_ms = 600;
        c.psk = Some(stranger.clone());
    });
    let (ok, failed, _) = aes_workload(&bad, 3, 64, 1, 3, Duration::from_secs(10), |_| {});
    assert_eq!((ok, failed), (0, 3));
    assert_eq!(bad.counters().connects, 0);

    // Plain TCP: no TLS at all.
    let plain = client(&[d.addr()], |c| c.deadline_ms = 600);
    let (ok, failed, _) = aes_workload(&plain, 3, 64, 1, 3, Duration::from_secs(10), |_| {});
    assert_eq!((ok, failed), (0, 3));
    assert_eq!(plain.counters().connects, 0);

    // A TLS client with no key (it would accept a certificate, the daemon has none).
    let anon = openssl::ssl::SslConnector::builder(openssl::ssl::SslMethod::tls_client())
        .unwrap()
        .build();
    let tcp = std::net::TcpStream::connect(d.addr()).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(anon.connect("127.0.0.1", tcp).is_err());

    // The served client was never disturbed; the daemon counted every refusal.
    let (ok, failed, wrong) = aes_workload(&r, 1000, 200, 1, 64, Duration::from_secs(20), |_| {});
    assert_eq!((ok, failed, wrong), (1000, 0, 0));
    assert_eq!(r.counters().connects, 1);
    let s = stats_tls(&d.addr(), &conn);
    assert!(s["refused"] >= 4, "refused {}", s["refused"]);
}

#[test]
fn bad_key_files_are_refused_with_the_reason() {
    let dir = TempDir::new("pskbad");
    let cases = [
        (
            "short.psk",
            format!("web-1 {}\n", &KEY_A[..20]),
            "line 1: key: expected 32 to 128 hex digits",
        ),
        (
            "nothex.psk",
            format!("web-1 {}\n", "xy".repeat(16)),
            "line 1: key: expected",
        ),
        (
            "nokey.psk",
            "web-1\n".to_string(),
            "line 1: expected `IDENTITY HEXKEY`",
        ),
        ("empty.psk", "# nothing\n".to_string(), "no key in it"),
        (
            "twice.psk",
            format!("a {KEY_A}\na {KEY_B}\n"),
            "line 2: identity \"a\" given twice",
        ),
    ];
    let missing = dir.path().join("missing.psk");
    let mut all: Vec<(std::path::PathBuf, &str)> = vec![(missing, "No such file")];
    for (name, text, want) in &cases {
        let p = dir.path().join(name);
        write_secret(&p, text);
        all.push((p, want));
    }
    // A good key in a file others may read: refused before it is parsed.
    let open = dir.path().join("open.psk");
    std::fs::write(&open, format!("web-1 {KEY_A}\n")).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    all.push((open, "open to group or others (mode 0644)"));
    for (p, want) in &all {
        // The daemon: exits at start, saying which file and what is wrong.
        let out = Command::new(DAEMON)
            .args(["--listen", "127.0.0.1:0", "--tls-psk"])
            .arg(p)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{}: daemon started", p.display());
        assert!(
            err.contains(&p.display().to_string()) && err.contains(want),
            "{}: {err}",
            p.display()
        );
        // The client: the backend does not start.
        let e = Remote::new(RemoteConfig {
            endpoints: vec!["127.0.0.1:9".into()],
            psk: Some(p.clone()),
            ..RemoteConfig::default()
        })
        .err()
        .expect("a client with a bad key file started");
        let e = e.to_string();
        assert!(
            e.contains("TOFFLOAD_REMOTE_PSK") && e.contains(want),
            "{}: {e}",
            p.display()
        );
    }
    // A daemon file may list many clients; a client's holds exactly one.
    let two = dir.path().join("two.psk");
    write_secret(&two, format!("a {KEY_A}\nb {KEY_B}\n"));
    let e = Remote::new(RemoteConfig {
        endpoints: vec!["127.0.0.1:9".into()],
        psk: Some(two),
        ..RemoteConfig::default()
    })
    .err()
    .expect("two keys accepted");
    assert!(e.to_string().contains("holds one key"), "{e}");
    // Both modes at once is a usage error.
    let out = Command::new(DAEMON)
        .args([
            "--tls-psk",
            "/x",
            "--tls-cert",
            "/c",
            "--tls-key",
            "/k",
            "--tls-ca",
            "/a",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("exclude each other"));
}
