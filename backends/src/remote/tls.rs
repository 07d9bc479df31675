//! TLS through openssl, in one of two modes. Client certificates: the daemon requires
//! a certificate signed by its CA (an unauthenticated client fails the handshake), the
//! client checks the daemon's certificate against the same CA and the address it
//! dialled. Pre-shared keys: each client has an identity and a secret key the daemon
//! also holds; the TLS 1.3 handshake proves both sides have it (see `psk_acceptor`).

use openssl::ssl::{
    ErrorCode, HandshakeError, SslAcceptor, SslFiletype, SslMethod, SslStream, SslVerifyMode,
    SslVersion,
};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Instant;

use super::tls_client::err;
pub use super::tls_client::{
    connector, parse_psk, psk_connector, read_client_psk, read_psk, Psk, TlsFiles,
    PSK_IDENTITY_MAX, PSK_MAX, PSK_MIN,
};

pub fn acceptor(f: &TlsFiles) -> Result<SslAcceptor, String> {
    let mut b =
        SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server()).map_err(|e| e.to_string())?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(|e| e.to_string())?;
    b.set_certificate_chain_file(&f.cert)
        .map_err(|e| err("certificate", &f.cert, e))?;
    b.set_private_key_file(&f.key, SslFiletype::PEM)
        .map_err(|e| err("key", &f.key, e))?;
    b.check_private_key().map_err(|e| e.to_string())?;
    b.set_ca_file(&f.ca).map_err(|e| err("CA", &f.ca, e))?;
    b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    Ok(b.build())
}

// PSK mode is TLS 1.3 only, with OpenSSL's PSK callbacks (which 3.0 uses for TLS 1.3
// external PSKs, hashed with SHA-256): TLS 1.3 binds the key with a binder the server
// checks before going on, and negotiates psk_dhe_ke (an ECDHE exchange on top of the
// key), so a recorded session stays secret even if the key leaks later. TLS 1.2's PSK
// suites (PSK-AES128-GCM-SHA256) have no forward secrecy and the Mozilla profiles
// leave them out. The daemon has no certificate in this mode: a client that offers no
// known key cannot complete any handshake.

/// The daemon's side: knows every client's key by identity.
pub fn psk_acceptor(keys: Vec<Psk>) -> Result<SslAcceptor, String> {
    let mut b =
        SslAcceptor::mozilla_modern_v5(SslMethod::tls_server()).map_err(|e| e.to_string())?;
    let by_id: std::collections::HashMap<Vec<u8>, Vec<u8>> = keys
        .into_iter()
        .map(|p| (p.identity.into_bytes(), p.key))
        .collect();
    b.set_psk_server_callback(move |ssl, identity, out| {
        // An unknown identity: 0 bytes = no key; the handshake then fails.
        match identity.and_then(|i| by_id.get_key_value(i)) {
            Some((id, k)) if k.len() <= out.len() => {
                out[..k.len()].copy_from_slice(k);
                // The session is bound to it once the handshake (the binder) proves
                // the client holds the key (identity.rs).
                let id = String::from_utf8_lossy(id).into_owned();
                ssl.set_ex_data(super::identity::psk_index(), id);
                Ok(k.len())
            }
            _ => Ok(0),
        }
    });
    Ok(b.build())
}

/// Why a daemon-side handshake did not finish.
#[derive(Debug)]
pub enum AcceptError {
    /// Not done by the deadline.
    TimedOut,
    Failed(String),
}

/// The daemon's side of a handshake, finished by `deadline` however slowly the peer
/// sends (a socket timeout alone is reset by every byte a peer trickles). The stream
/// comes back blocking.
pub fn accept_by(
    a: &SslAcceptor,
    tcp: TcpStream,
    deadline: Instant,
) -> Result<SslStream<TcpStream>, AcceptError> {
    let failed = |e: &dyn std::fmt::Display| AcceptError::Failed(e.to_string());
    tcp.set_nonblocking(true).map_err(|e| failed(&e))?;
    let mut r = a.accept(tcp);
    loop {
        match r {
            Ok(s) => {
                s.get_ref().set_nonblocking(false).map_err(|e| failed(&e))?;
                return Ok(s);
            }
            Err(HandshakeError::WouldBlock(mid)) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(AcceptError::TimedOut);
                }
                let ev = if mid.error().code() == ErrorCode::WANT_WRITE {
                    libc::POLLOUT
                } else {
                    libc::POLLIN
                };
                let mut fds = [super::conn::pollfd(mid.get_ref().as_raw_fd(), ev)];
                super::conn::poll(&mut fds, Some(left)).map_err(|e| failed(&e))?;
                r = mid.handshake();
            }
            Err(e) => return Err(failed(&e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openssl::ssl::SslConnector;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    const K1: &str = "00112233445566778899aabbccddeeff";

    #[test]
    fn psk_files_parse_and_bad_ones_say_why() {
        let v = parse_psk(&format!("# clients\n\nweb-1 {K1}\n  web-2   {K1}{K1}  \n")).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].identity, "web-1");
        assert_eq!(v[0].key.len(), 16);
        assert_eq!(v[1].key.len(), 32);
        assert!(
            !format!("{:?}", v[0]).contains("0011"),
            "Debug leaks the key"
        );
        for (text, want) in [
            ("", "no key"),
            ("# only a comment\n", "no key"),
            ("web-1\n", "line 1: expected `IDENTITY HEXKEY`"),
            (&format!("a {K1} extra\n"), "line 1: expected"),
            ("a 0011\n", "line 1: key: expected 32 to 128 hex digits"),
            (&format!("a {K1}0\n"), "key: expected"),
            (&format!("a {}\n", "zz".repeat(16)), "key: expected"),
            (&format!("a {}\n", "ab".repeat(65)), "key: expected"),
            (
                &format!("a {K1}\na {K1}\n"),
                "line 2: identity \"a\" given twice",
            ),
            (&format!("{} {K1}\n", "x".repeat(129)), "identity: expected"),
            (&format!("caf\u{e9} {K1}\n"), "identity: expected"),
        ] {
            let e = parse_psk(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let dir = std::env::temp_dir().join(format!("toffload_psk_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing");
        let e = read_client_psk(&missing).unwrap_err();
        assert!(e.contains("PSK file") && e.contains("missing"), "{e}");
        let two = dir.join("two");
        std::fs::write(&two, format!("a {K1}\nb {K1}\n")).unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&two, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let e = read_client_psk(&two).unwrap_err();
        assert!(e.contains("holds one key"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// One handshake against an acceptor on loopback; Ok(echoed byte) or the error.
    fn handshake(acc: SslAcceptor, con: &SslConnector) -> Result<u8, String> {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            let mut s = acc.accept(s).map_err(|e| e.to_string())?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b).map_err(|e| e.to_string())?;
            s.write_all(&b).map_err(|e| e.to_string())?;
            Ok::<_, String>(s.ssl().version_str().to_string())
        });
        let tcp = TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let r = (|| {
            let mut s = con.connect("127.0.0.1", tcp).map_err(|e| e.to_string())?;
            s.write_all(&[42]).map_err(|e| e.to_string())?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b).map_err(|e| e.to_string())?;
            Ok(b[0])
        })();
        let version = server.join().unwrap();
        if r.is_ok() {
            assert_eq!(version.as_deref(), Ok("TLSv1.3"));
        }
        r
    }

    #[test]
    fn psk_handshakes_need_the_right_key() {
        let keys = parse_psk(&format!("alice {K1}\nbob {K1}{K1}\n")).unwrap();
        let acc = || psk_acceptor(keys.clone()).unwrap();
        let right = psk_connector(keys[1].clone()).unwrap();
        assert_eq!(handshake(acc(), &right), Ok(42));
        let wrong_key = psk_connector(Psk {
            identity: "bob".into(),
            key: keys[0].key.clone(),
        })
        .unwrap();
        assert!(handshake(acc(), &wrong_key).is_err());
        let unknown = psk_connector(Psk {
            identity: "mallory".into(),
            key: keys[0].key.clone(),
        })
        .unwrap();
        assert!(handshake(acc(), &unknown).is_err());
        // A client with no key (certificate verification only) cannot finish either.
        let nokey = SslConnector::builder(SslMethod::tls_client())
            .unwrap()
            .build();
        assert!(handshake(acc(), &nokey).is_err());
    }
}
