//! TLS through openssl with client certificates: the daemon requires a certificate
//! signed by its CA (an unauthenticated client fails the handshake), the client checks
//! the daemon's certificate against the same CA and the address it dialled.

use openssl::ssl::{SslAcceptor, SslConnector, SslFiletype, SslMethod, SslVerifyMode, SslVersion};
use std::path::{Path, PathBuf};

/// The three PEM files of one side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The CA that signs the other side's certificate.
    pub ca: PathBuf,
    /// This side's certificate and private key.
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn err(what: &str, p: &Path, e: impl std::fmt::Display) -> String {
    format!("{what} {}: {e}", p.display())
}

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

pub fn connector(f: &TlsFiles) -> Result<SslConnector, String> {
    let mut b = SslConnector::builder(SslMethod::tls_client()).map_err(|e| e.to_string())?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(|e| e.to_string())?;
    b.set_ca_file(&f.ca).map_err(|e| err("CA", &f.ca, e))?;
    b.set_certificate_chain_file(&f.cert)
        .map_err(|e| err("certificate", &f.cert, e))?;
    b.set_private_key_file(&f.key, SslFiletype::PEM)
        .map_err(|e| err("key", &f.key, e))?;
    b.check_private_key().map_err(|e| e.to_string())?;
    b.set_verify(SslVerifyMode::PEER);
    Ok(b.build())
}
