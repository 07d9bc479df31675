//! The environment knobs, parsed once and strictly: a malformed value is an error that
//! names the variable and the accepted form, never a silent default.

use crate::knobs::{self, Knob};
use std::fmt;

/// How a blocking `accel_run` waits (TOFFLOAD_WAIT).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitStyle {
    /// Busy-poll the completion, as CUDA's default synchronize does.
    Spin,
    /// Sleep until the device signals completion.
    Block,
}

/// Which backend serves the C ABI (TOFFLOAD_BACKEND).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Emulated,
    /// AES-128-CTR on an NVIDIA GPU (backends/src/cuda).
    Cuda,
    /// Ops run by toffload-remoted daemons (backends/src/remote, TOFFLOAD_REMOTE).
    Remote,
}

/// A knob with a value we cannot accept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub var: &'static str,
    pub value: String,
    pub expected: &'static str,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={:?} is not valid: expected {}",
            self.var, self.value, self.expected
        )
    }
}

impl std::error::Error for ConfigError {}

/// Reads a knob through `get` (the environment in production, a map in tests).
/// Unset and empty both mean "use the default".
pub(crate) fn knob<T>(
    get: &dyn Fn(&str) -> Option<String>,
    k: &'static Knob,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Option<T>, ConfigError> {
    match get(k.var) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => parse(v.trim()).map(Some).ok_or(ConfigError {
            var: k.var,
            value: v,
            expected: k.form,
        }),
    }
}

/// Reads the process environment.
pub(crate) fn from_env(var: &str) -> Option<String> {
    std::env::var(var).ok()
}

pub(crate) fn parse_wait(s: &str) -> Option<WaitStyle> {
    match s {
        "spin" => Some(WaitStyle::Spin),
        "block" => Some(WaitStyle::Block),
        _ => None,
    }
}

pub(crate) fn parse_backend(s: &str) -> Option<BackendKind> {
    match s {
        "emulated" => Some(BackendKind::Emulated),
        "cuda" => Some(BackendKind::Cuda),
        "remote" => Some(BackendKind::Remote),
        _ => None,
    }
}

/// TOFFLOAD_WAIT, default spin.
pub fn wait_style(get: &dyn Fn(&str) -> Option<String>) -> Result<WaitStyle, ConfigError> {
    Ok(knob(get, &knobs::WAIT, parse_wait)?.unwrap_or(WaitStyle::Spin))
}

/// TOFFLOAD_BACKEND, default emulated.
pub fn backend(get: &dyn Fn(&str) -> Option<String>) -> Result<BackendKind, ConfigError> {
    Ok(knob(get, &knobs::BACKEND, parse_backend)?.unwrap_or(BackendKind::Emulated))
}

/// A non-negative, finite decimal (`100`, `12.5`).
pub(crate) fn parse_nonneg_f64(s: &str) -> Option<f64> {
    let v: f64 = s.parse().ok()?;
    (v.is_finite() && v >= 0.0 && s.chars().all(|c| c.is_ascii_digit() || c == '.')).then_some(v)
}

/// An integer in `lo..=hi`, digits only (no sign, no suffix).
pub(crate) fn parse_range(s: &str, lo: u64, hi: u64) -> Option<u64> {
    if !s.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let v: u64 = s.parse().ok()?;
    (lo..=hi).contains(&v).then_some(v)
}

/// A knob lookup over fixed pairs, for the backends' knob tests.
#[cfg(test)]
pub(crate) fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: std::collections::HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_style_parses_and_rejects() {
        assert_eq!(wait_style(&env(&[])).unwrap(), WaitStyle::Spin);
        assert_eq!(
            wait_style(&env(&[("TOFFLOAD_WAIT", "block")])).unwrap(),
            WaitStyle::Block
        );
        let e = wait_style(&env(&[("TOFFLOAD_WAIT", "sleep")])).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("TOFFLOAD_WAIT") && msg.contains("`spin` or `block`"),
            "{msg}"
        );
    }

    #[test]
    fn backend_parses_and_rejects_unknown() {
        assert_eq!(backend(&env(&[])).unwrap(), BackendKind::Emulated);
        assert_eq!(
            backend(&env(&[("TOFFLOAD_BACKEND", "emulated")])).unwrap(),
            BackendKind::Emulated
        );
        assert_eq!(
            backend(&env(&[("TOFFLOAD_BACKEND", " cuda ")])).unwrap(),
            BackendKind::Cuda
        );
        assert_eq!(
            backend(&env(&[("TOFFLOAD_BACKEND", "remote")])).unwrap(),
            BackendKind::Remote
        );
        for bad in ["CUDA", "gpu", "quantum"] {
            let e = backend(&env(&[("TOFFLOAD_BACKEND", bad)])).unwrap_err();
            assert_eq!(e.var, "TOFFLOAD_BACKEND");
            assert!(
                e.to_string().contains("`emulated`, `cuda` or `remote`"),
                "{e}"
            );
        }
    }

    #[test]
    fn numbers_are_strict() {
        assert_eq!(parse_nonneg_f64("12.5"), Some(12.5));
        assert_eq!(parse_nonneg_f64("0"), Some(0.0));
        for bad in ["abc", "-1", "1e3", "inf", "NaN", "10us", ""] {
            assert_eq!(parse_nonneg_f64(bad), None, "{bad}");
        }
        assert_eq!(parse_range("64", 1, 65536), Some(64));
        for bad in ["0", "65537", "-3", "+4", "4k"] {
            assert_eq!(parse_range(bad, 1, 65536), None, "{bad}");
        }
    }
}
