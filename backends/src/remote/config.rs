//! The client's knobs (TOFFLOAD_REMOTE*), strict like every other knob.

use super::frame::OpKind;
use super::tls::TlsFiles;
use crate::config::{knob, parse_range, ConfigError};
use crate::knobs::{self, Knob};
use std::path::PathBuf;

/// How the client picks a daemon for each op (TOFFLOAD_REMOTE_PLACEMENT).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Least predicted completion time: queueing + service + transfer, chunks held.
    Predicted,
    RoundRobin,
    /// Fewest ops outstanding (ours in flight + the daemon's reported queue).
    LeastLoaded,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RemoteConfig {
    /// host:port of each daemon (TOFFLOAD_REMOTE, comma-separated).
    pub endpoints: Vec<String>,
    /// An op that has no result this long after submit fails with ETIMEDOUT
    /// (TOFFLOAD_REMOTE_DEADLINE_MS, default 30000).
    pub deadline_ms: u64,
    /// Ops in flight before submit returns EAGAIN (TOFFLOAD_REMOTE_WINDOW, default 4096).
    pub window: usize,
    /// Bytes in flight before submit returns EAGAIN (TOFFLOAD_REMOTE_WINDOW_MB, default 256).
    pub window_bytes: usize,
    /// How long a small op may wait to share a frame with others
    /// (TOFFLOAD_REMOTE_COALESCE_US, default 20; 0 = send at once).
    pub coalesce_us: u64,
    /// What accel_submit does (TOFFLOAD_REMOTE_OP: `aes`, default, or `rsa-sign`).
    pub op: OpKind,
    /// TOFFLOAD_REMOTE_TLS_CA / _CERT / _KEY: all three or none.
    pub tls: Option<TlsFiles>,
    /// TOFFLOAD_REMOTE_PSK: a file with this client's `IDENTITY HEXKEY` (TLS 1.3 with a
    /// pre-shared key; excludes the certificate knobs). Read when the backend starts.
    pub psk: Option<PathBuf>,
    pub placement: Placement,
    /// Content-defined chunking and references to chunks the daemon holds, for ops of
    /// at least this many bytes (TOFFLOAD_REMOTE_CACHE_MIN, default 65536; 0 = off).
    pub cache_min: usize,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            endpoints: Vec::new(),
            deadline_ms: 30_000,
            window: 4096,
            window_bytes: 256 << 20,
            coalesce_us: 20,
            op: OpKind::AesCtr,
            tls: None,
            psk: None,
            placement: Placement::Predicted,
            cache_min: 64 << 10,
        }
    }
}

fn parse_endpoints(s: &str) -> Option<Vec<String>> {
    let v: Vec<String> = s.split(',').map(|e| e.trim().to_string()).collect();
    let ok = v.iter().all(|e| match e.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && parse_range(port, 1, 65535).is_some(),
        None => false,
    });
    (ok && !v.is_empty() && v.len() <= 64).then_some(v)
}

impl RemoteConfig {
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let d = RemoteConfig::default();
        let endpoints = knob(get, &knobs::REMOTE, parse_endpoints)?.unwrap_or_default();
        let deadline_ms = knob(get, &knobs::REMOTE_DEADLINE_MS, |s| {
            parse_range(s, 1, 3_600_000)
        })?
        .unwrap_or(d.deadline_ms);
        let window = knob(get, &knobs::REMOTE_WINDOW, |s| {
            parse_range(s, 1, crate::slots::MAX_SLOTS as u64)
        })?
        .map_or(d.window, |v| v as usize);
        let window_bytes = knob(get, &knobs::REMOTE_WINDOW_MB, |s| parse_range(s, 1, 65536))?
            .map_or(d.window_bytes, |v| (v as usize) << 20);
        let coalesce_us = knob(get, &knobs::REMOTE_COALESCE_US, |s| {
            parse_range(s, 0, 10_000)
        })?
        .unwrap_or(d.coalesce_us);
        let op = knob(get, &knobs::REMOTE_OP, |s| match s {
            "aes" => Some(OpKind::AesCtr),
            "rsa-sign" => Some(OpKind::RsaSign),
            _ => None,
        })?
        .unwrap_or(d.op);
        let path = |k: &'static Knob| knob(get, k, |s| Some(PathBuf::from(s)));
        let (ca, cert, key) = (
            path(&knobs::REMOTE_TLS_CA)?,
            path(&knobs::REMOTE_TLS_CERT)?,
            path(&knobs::REMOTE_TLS_KEY)?,
        );
        let tls = match (ca, cert, key) {
            (Some(ca), Some(cert), Some(key)) => Some(TlsFiles { ca, cert, key }),
            (None, None, None) => None,
            _ => {
                return Err(ConfigError {
                    var: "TOFFLOAD_REMOTE_TLS_CA",
                    value: "(some of the three set)".into(),
                    expected: "TOFFLOAD_REMOTE_TLS_CA, _CERT and _KEY all set, or none",
                })
            }
        };
        let psk = path(&knobs::REMOTE_PSK)?;
        if psk.is_some() && tls.is_some() {
            return Err(ConfigError {
                var: "TOFFLOAD_REMOTE_PSK",
                value: "(set with TOFFLOAD_REMOTE_TLS_*)".into(),
                expected:
                    "either TOFFLOAD_REMOTE_PSK or the TOFFLOAD_REMOTE_TLS_* certificates, not both",
            });
        }
        let placement = knob(get, &knobs::REMOTE_PLACEMENT, |s| match s {
            "predicted" => Some(Placement::Predicted),
            "round-robin" => Some(Placement::RoundRobin),
            "least-loaded" => Some(Placement::LeastLoaded),
            _ => None,
        })?
        .unwrap_or(d.placement);
        let cache_min = knob(get, &knobs::REMOTE_CACHE_MIN, |s| {
            parse_range(s, 0, 16 << 20)
        })?
        .map_or(d.cache_min, |v| v as usize);
        Ok(RemoteConfig {
            endpoints,
            deadline_ms,
            window,
            window_bytes,
            coalesce_us,
            op,
            tls,
            psk,
            placement,
            cache_min,
        })
    }

    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(&crate::config::from_env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::env;

    #[test]
    fn parses_and_rejects() {
        let c = RemoteConfig::from_lookup(&env(&[
            ("TOFFLOAD_REMOTE", "10.0.0.1:7000, host:1"),
            ("TOFFLOAD_REMOTE_DEADLINE_MS", "250"),
            ("TOFFLOAD_REMOTE_OP", "rsa-sign"),
        ]))
        .unwrap();
        assert_eq!(c.endpoints, vec!["10.0.0.1:7000", "host:1"]);
        assert_eq!(c.deadline_ms, 250);
        assert_eq!(c.op, OpKind::RsaSign);
        assert_eq!(c.psk, None);
        let c = RemoteConfig::from_lookup(&env(&[("TOFFLOAD_REMOTE_PSK", "/etc/k.psk")])).unwrap();
        assert_eq!(c.psk, Some(PathBuf::from("/etc/k.psk")));
        let e = RemoteConfig::from_lookup(&env(&[
            ("TOFFLOAD_REMOTE_PSK", "/k"),
            ("TOFFLOAD_REMOTE_TLS_CA", "/ca"),
            ("TOFFLOAD_REMOTE_TLS_CERT", "/c"),
            ("TOFFLOAD_REMOTE_TLS_KEY", "/k"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("not both"), "{e}");
        for (var, bad) in [
            ("TOFFLOAD_REMOTE", "nohost"),
            ("TOFFLOAD_REMOTE", "h:0"),
            ("TOFFLOAD_REMOTE", "h:70000"),
            ("TOFFLOAD_REMOTE", ":80"),
            ("TOFFLOAD_REMOTE_DEADLINE_MS", "0"),
            ("TOFFLOAD_REMOTE_WINDOW", "-1"),
            ("TOFFLOAD_REMOTE_OP", "sha"),
            ("TOFFLOAD_REMOTE_PLACEMENT", "random"),
            ("TOFFLOAD_REMOTE_TLS_CA", "/x"),
        ] {
            let e = RemoteConfig::from_lookup(&env(&[(var, bad)])).unwrap_err();
            assert!(e.to_string().contains(var), "{var}={bad}: {e}");
        }
    }
}
