//! TLS with client certificates (openssl): a client with a certificate from the
//! daemon's CA is served; a plain-TCP client, a client without a certificate and one
//! whose certificate another CA signed are refused, and the daemon goes on serving.

mod remote_util;

use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use remote_util::pki::Pki;
use remote_util::*;
use std::net::TcpStream;
use std::time::Duration;
use toffload_accel::remote::tls::TlsFiles;

#[test]
fn only_clients_with_a_certificate_from_the_ca_are_served() {
    let dir = TempDir::new("tls");
    let mut pki = Pki::new(dir.path(), "toffload-test");
    let server = pki.issue("daemon", &["127.0.0.1"]);
    let good = pki.issue("client", &[]);
    let mut rogue_pki = Pki::new(dir.path(), "rogue");
    let rogue = rogue_pki.issue("intruder", &[]);
    let d = Daemon::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            server.cert.to_str().unwrap(),
            "--tls-key",
            server.key.to_str().unwrap(),
            "--tls-ca",
            pki.ca.to_str().unwrap(),
        ],
        &[("TOFFLOAD_EMU_LAT_US", "50")],
    );
    let files = |ca: &std::path::Path, i: &pki::Issued| TlsFiles {
        ca: ca.to_path_buf(),
        cert: i.cert.clone(),
        key: i.key.clone(),
    };
    // Authenticated: served, answers right.
    let ok_files = files(&pki.ca, &good);
    let r = client(&[d.addr()], |c| c.tls = Some(ok_files.clone()));
    let (ok, failed, wrong) = aes_workload(&r, 5000, 200, 2, 256, Duration::from_secs(20), |_| {});
    assert_eq!((ok, failed, wrong), (5000, 0, 0));
    let conn = toffload_accel::remote::tls::connector(&ok_files).unwrap();
    assert_eq!(stats_tls(&d.addr(), &conn)["refused"], 0);

    // Plain TCP to a TLS daemon: refused; the op times out.
    let plain = client(&[d.addr()], |c| c.deadline_ms = 600);
    let (ok, failed, _) = aes_workload(&plain, 3, 64, 1, 3, Duration::from_secs(10), |_| {});
    assert_eq!((ok, failed), (0, 3));
    assert!(plain.counters().connects == 0 && plain.counters().connect_failures >= 1);

    // A certificate from another CA: refused.
    let bad = client(&[d.addr()], |c| {
        c.deadline_ms = 600;
        c.tls = Some(files(&pki.ca, &rogue));
    });
    let (ok, failed, _) = aes_workload(&bad, 3, 64, 1, 3, Duration::from_secs(10), |_| {});
    assert_eq!((ok, failed), (0, 3));
    assert_eq!(bad.counters().connects, 0);

    // No certificate at all: the handshake fails (TLS 1.3 may report it on first read).
    let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
    b.set_ca_file(&pki.ca).unwrap();
    b.set_verify(SslVerifyMode::PEER);
    let anon = b.build();
    let tcp = TcpStream::connect(d.addr()).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let refused = match anon.connect("127.0.0.1", tcp) {
        Err(_) => true,
        Ok(mut s) => {
            use std::io::{Read, Write};
            let mut out = Vec::new();
            toffload_accel::remote::frame::encode(
                &toffload_accel::remote::frame::Msg::Hello {
                    version: toffload_accel::remote::frame::VERSION,
                    client_id: 5,
                },
                &mut out,
            );
            let _ = s.write_all(&out);
            let mut buf = [0u8; 16];
            !matches!(s.read(&mut buf), Ok(n) if n > 0)
        }
    };
    assert!(refused, "a client without a certificate got an answer");

    // The client checks the daemon too: a daemon certificate from another CA fails.
    let mismatched = client(&[d.addr()], |c| {
        c.deadline_ms = 600;
        c.tls = Some(TlsFiles {
            ca: rogue_pki.ca.clone(),
            ..ok_files.clone()
        });
    });
    let (ok, _, _) = aes_workload(&mismatched, 2, 64, 1, 2, Duration::from_secs(10), |_| {});
    assert_eq!(ok, 0);

    // The authenticated client was never disturbed, and the daemon counted the refusals.
    let (ok, failed, wrong) = aes_workload(&r, 1000, 200, 1, 64, Duration::from_secs(20), |_| {});
    assert_eq!((ok, failed, wrong), (1000, 0, 0));
    assert_eq!(r.counters().connects, 1);
    let s = stats_tls(&d.addr(), &conn);
    assert!(s["refused"] >= 4, "refused {}", s["refused"]);
}
