//! The client's side of TLS (both modes, see tls.rs) and the PSK file, with no tie
//! to the daemon's modules: the CUDA client library (backends/cuda-remote) includes
//! this file by path, so the remote backend's client and it dial alike.

use openssl::ssl::{SslConnector, SslFiletype, SslMethod, SslVerifyMode, SslVersion};
use std::os::unix::fs::PermissionsExt;
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

pub(super) fn err(what: &str, p: &Path, e: impl std::fmt::Display) -> String {
    format!("{what} {}: {e}", p.display())
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

/// A pre-shared key: the identity the client names in its handshake and the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Psk {
    pub identity: String,
    pub key: Vec<u8>,
}

impl std::fmt::Debug for Psk {
    // The secret stays out of logs and panic messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Psk {{ identity: {:?}, key: {} bytes }}",
            self.identity,
            self.key.len()
        )
    }
}

/// Shortest and longest key accepted, bytes: 128 bits at least (a guessable key would
/// make the handshake's proof of possession worthless); 64 bytes is plenty for SHA-256.
pub const PSK_MIN: usize = 16;
pub const PSK_MAX: usize = 64;
/// Longest identity, bytes (OpenSSL's PSK_MAX_IDENTITY_LEN is 256 with the NUL).
pub const PSK_IDENTITY_MAX: usize = 128;

/// Parses a PSK file: one `IDENTITY HEXKEY` per line (blank lines and `#` comments
/// ignored), identities printable ASCII without spaces, keys 16 to 64 bytes in hex.
pub fn parse_psk(text: &str) -> Result<Vec<Psk>, String> {
    let mut v: Vec<Psk> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |what: String| format!("line {}: {what}", i + 1);
        let mut words = line.split_whitespace();
        let (Some(identity), Some(hexkey), None) = (words.next(), words.next(), words.next())
        else {
            return Err(at("expected `IDENTITY HEXKEY`".into()));
        };
        if identity.len() > PSK_IDENTITY_MAX || !identity.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(at(format!(
                "identity: expected 1 to {PSK_IDENTITY_MAX} printable ASCII characters"
            )));
        }
        let key = unhex(hexkey).filter(|k| (PSK_MIN..=PSK_MAX).contains(&k.len()));
        let Some(key) = key else {
            return Err(at(format!(
                "key: expected {} to {} hex digits ({PSK_MIN} to {PSK_MAX} bytes), got {} characters",
                2 * PSK_MIN,
                2 * PSK_MAX,
                hexkey.len()
            )));
        };
        if v.iter().any(|p| p.identity == identity) {
            return Err(at(format!("identity {identity:?} given twice")));
        }
        v.push(Psk {
            identity: identity.to_string(),
            key,
        });
    }
    if v.is_empty() {
        return Err("no key in it (expected lines of `IDENTITY HEXKEY`)".into());
    }
    Ok(v)
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Reads and parses a PSK file; every error names the file. A file open to group or
/// others is refused: its keys are the only secret of PSK mode.
pub fn read_psk(path: &Path) -> Result<Vec<Psk>, String> {
    check_secret(path, "PSK file")?;
    let text = std::fs::read_to_string(path).map_err(|e| err("PSK file", path, e))?;
    parse_psk(&text).map_err(|e| err("PSK file", path, e))
}

/// The client's key: its file must hold exactly one.
pub fn read_client_psk(path: &Path) -> Result<Psk, String> {
    let mut v = read_psk(path)?;
    if v.len() != 1 {
        return Err(err(
            "PSK file",
            path,
            format!("a client's file holds one key, this one {}", v.len()),
        ));
    }
    Ok(v.remove(0))
}

/// The client's side: offers its one identity and key.
pub fn psk_connector(p: Psk) -> Result<SslConnector, String> {
    let mut b = SslConnector::builder(SslMethod::tls_client()).map_err(|e| e.to_string())?;
    b.set_min_proto_version(Some(SslVersion::TLS1_3))
        .map_err(|e| e.to_string())?;
    b.set_psk_client_callback(move |_, _hint, identity, out| {
        let id = p.identity.as_bytes();
        // The identity is written as a C string.
        if id.len() + 1 > identity.len() || p.key.len() > out.len() {
            return Ok(0);
        }
        identity[..id.len()].copy_from_slice(id);
        identity[id.len()] = 0;
        out[..p.key.len()].copy_from_slice(&p.key);
        Ok(p.key.len())
    });
    Ok(b.build())
}

/// A secret file must be closed to group and others: Err says which file and what to do.
pub fn check_secret(path: &Path, what: &str) -> Result<(), String> {
    let md = std::fs::metadata(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    let mode = md.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{what} {} is open to group or others (mode {mode:04o}): \
             it holds secret keys; chmod 600 it",
            path.display()
        ));
    }
    Ok(())
}
