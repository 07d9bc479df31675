//! Who is on the other end of a daemon connection, as far as the daemon can prove it:
//! the subject of a client certificate its CA signed, the identity of a pre-shared key
//! the client holds, or, in plaintext mode where nothing is proven, the peer's
//! address. Client ids (sessions) and chunk-cache partitions are bound to it.

use super::cache::Part;
use super::chunk::sha256;
use openssl::ex_data::Index;
use openssl::ssl::{Ssl, SslRef};
use std::fmt;
use std::net::IpAddr;
use std::sync::OnceLock;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Identity {
    /// The client certificate's subject (its CA vouched for it).
    Cert(String),
    /// The PSK identity whose key the client proved it holds.
    Psk(String),
    /// Plaintext: the peer's IP address (nothing stronger is known).
    Peer(IpAddr),
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Cert(s) => write!(f, "cert:{s}"),
            Identity::Psk(s) => write!(f, "psk:{s}"),
            Identity::Peer(a) => write!(f, "peer:{a}"),
        }
    }
}

impl Identity {
    /// This identity's chunk-cache partition (a digest of its name: stable across
    /// restarts, so the disk cache stays with its owner).
    pub fn part(&self) -> Part {
        let d = sha256(self.to_string().as_bytes());
        let mut p = [0u8; 16];
        p.copy_from_slice(&d[..16]);
        p
    }

    /// The identity a finished TLS handshake proved (None: neither a certificate nor
    /// a PSK, which the acceptors never let through).
    pub fn of_tls(ssl: &SslRef) -> Option<Identity> {
        if let Some(id) = ssl.ex_data(psk_index()) {
            return Some(Identity::Psk(id.clone()));
        }
        let cert = ssl.peer_certificate()?;
        let subject: Vec<String> = cert
            .subject_name()
            .entries()
            .map(|e| {
                let key = e.object().nid().short_name().unwrap_or("?");
                let val = e.data().to_string().unwrap_or_default();
                format!("{key}={val}")
            })
            .collect();
        Some(Identity::Cert(subject.join(",")))
    }
}

/// Where the PSK server callback leaves the identity it found a key for.
pub fn psk_index() -> Index<Ssl, String> {
    static IDX: OnceLock<Index<Ssl, String>> = OnceLock::new();
    *IDX.get_or_init(|| Ssl::new_ex_index().expect("an SSL ex_data index"))
}
