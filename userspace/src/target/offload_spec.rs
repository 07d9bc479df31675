//! `--offload SYMBOL[@LIBRARY][=SUBMIT:DONE:RELEASE]`: a wait the watch does not
//! know by name (an HSM's C_Sign, a vendor's encrypt call, an inference client's
//! request). The symbol is probed as the offload; with its non-blocking triple the
//! row is handed to the injected runtime (TOFFLOAD_OFFLOAD), which then hides it.

use serde::Serialize;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OffloadSpec {
    pub symbol: String,
    /// Only in this library (its file name, with or without a version suffix, or
    /// its path); None: any file the target maps.
    pub library: Option<String>,
    /// The non-blocking equivalent: submit(args...) -> handle, done(handle) ->
    /// 1/0/-errno, release(handle).
    pub triple: Option<[String; 3]>,
}

/// What the flag takes, for error messages.
pub const FORM: &str = "SYMBOL[@LIBRARY][=SUBMIT:DONE:RELEASE]";

fn ident(s: &str) -> bool {
    let mut c = s.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

impl std::str::FromStr for OffloadSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<OffloadSpec, String> {
        let bad = |why: &str| format!("--offload {s:?}: {why} (expected {FORM})");
        let (head, triple) = match s.split_once('=') {
            Some((h, t)) => (h, Some(t)),
            None => (s, None),
        };
        let (symbol, library) = match head.split_once('@') {
            Some((sym, lib)) => (sym, Some(lib)),
            None => (head, None),
        };
        if !ident(symbol) {
            return Err(bad("the symbol is not a C identifier"));
        }
        if let Some(l) = library {
            if l.is_empty()
                || !l
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "/._-+".contains(c))
            {
                return Err(bad("the library is not a file name or path"));
            }
        }
        let triple = match triple {
            None => None,
            Some(t) => {
                let parts: Vec<&str> = t.split(':').collect();
                if parts.len() != 3 || !parts.iter().all(|p| ident(p)) {
                    return Err(bad(
                        "the triple is three C identifiers, SUBMIT:DONE:RELEASE",
                    ));
                }
                if parts.contains(&symbol) {
                    return Err(bad("the triple must name functions other than the symbol"));
                }
                Some([parts[0].into(), parts[1].into(), parts[2].into()])
            }
        };
        Ok(OffloadSpec {
            symbol: symbol.into(),
            library: library.map(Into::into),
            triple,
        })
    }
}

impl OffloadSpec {
    /// Whether `path` (a mapped file) is where this symbol is looked for.
    pub fn applies_to(&self, path: &str) -> bool {
        let Some(lib) = &self.library else {
            return true;
        };
        if lib.contains('/') {
            return path == lib;
        }
        let name = path.rsplit('/').next().unwrap_or(path);
        // libxhsm.so matches libxhsm.so.1.2 (the versioned file a link points to).
        name == lib
            || name
                .strip_prefix(lib.as_str())
                .is_some_and(|r| r.starts_with('.'))
    }

    /// The runtime's row (TOFFLOAD_OFFLOAD), when the triple was given.
    pub fn runtime_row(&self) -> Option<String> {
        self.triple
            .as_ref()
            .map(|[s, d, r]| format!("{}:{s}:{d}:{r}", self.symbol))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_forms_parse() {
        let s: OffloadSpec = "hsm_sign".parse().unwrap();
        assert_eq!((s.library, s.triple), (None, None));
        let s: OffloadSpec = "C_Sign@libsofthsm2.so".parse().unwrap();
        assert_eq!(s.symbol, "C_Sign");
        assert_eq!(s.library.as_deref(), Some("libsofthsm2.so"));
        let s: OffloadSpec = "hsm_sign@/opt/x/libxhsm.so=hsm_submit:hsm_poll:hsm_free"
            .parse()
            .unwrap();
        assert_eq!(
            s.runtime_row().as_deref(),
            Some("hsm_sign:hsm_submit:hsm_poll:hsm_free")
        );
        assert!(s.applies_to("/opt/x/libxhsm.so"));
        assert!(!s.applies_to("/usr/lib/libxhsm.so"));
    }

    #[test]
    fn bad_forms_say_why() {
        for (bad, why) in [
            ("", "C identifier"),
            ("9x", "C identifier"),
            ("a b", "C identifier"),
            ("f@", "library"),
            ("f@lib;rm", "library"),
            ("f=a:b", "three C identifiers"),
            ("f=a:b:c:d", "three C identifiers"),
            ("f=a::c", "three C identifiers"),
            ("f=f:b:c", "other than the symbol"),
        ] {
            let e = bad.parse::<OffloadSpec>().unwrap_err();
            assert!(e.contains(why) && e.contains(FORM), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_library_name_matches_its_versions() {
        let s: OffloadSpec = "f@libxhsm.so".parse().unwrap();
        assert!(s.applies_to("/usr/lib/libxhsm.so"));
        assert!(s.applies_to("/usr/lib/libxhsm.so.1.2"));
        assert!(!s.applies_to("/usr/lib/libxhsm.so2"));
        assert!(!s.applies_to("/usr/lib/libother.so"));
        let any: OffloadSpec = "f".parse().unwrap();
        assert!(any.applies_to("/anything"));
    }
}
