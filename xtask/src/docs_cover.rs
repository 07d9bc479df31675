//! A check that every TOFFLOAD_* variable the code reads is documented: the names
//! are taken from the sources (each as a string literal), the docs are docs/*.md and
//! README.md. Run by `cargo test` (xtask's unit tests), so a knob added without a
//! line in docs/configuration.md fails CI.

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::{Path, PathBuf};

    /// Where the code that reads variables lives.
    const SOURCE_DIRS: &[&str] = &[
        "backends",
        "userspace/cli",
        "runtime",
        "tests",
        "tui",
        "userspace",
        "xtask",
        "ebpf/src",
    ];

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace root")
            .to_path_buf()
    }

    fn files(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name();
            if name == "target" || name.to_string_lossy().starts_with('.') {
                continue;
            }
            if p.is_dir() {
                files(&p, out);
            } else if matches!(
                p.extension().and_then(|x| x.to_str()),
                Some("rs" | "c" | "h")
            ) {
                out.push(p);
            }
        }
    }

    /// Every `"TOFFLOAD_NAME"` string literal in `text`.
    fn quoted_vars(text: &str, out: &mut BTreeSet<String>) {
        let mut rest = text;
        while let Some(i) = rest.find("\"TOFFLOAD_") {
            let tail = &rest[i + 1..];
            let n = tail
                .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(tail.len());
            if tail[n..].starts_with('"') {
                out.insert(tail[..n].to_string());
            }
            rest = &tail[n..];
        }
    }

    /// Whether `name` appears in `docs` as a whole word.
    fn mentioned(docs: &str, name: &str) -> bool {
        docs.match_indices(name).any(|(i, _)| {
            let after = docs[i + name.len()..].chars().next();
            !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        })
    }

    #[test]
    fn the_scan_finds_quoted_names_only() {
        let mut v = BTreeSet::new();
        quoted_vars(
            r#"env("TOFFLOAD_A_1") "TOFFLOAD_B" TOFFLOAD_C "TOFFLOAD_D x""#,
            &mut v,
        );
        assert_eq!(
            v.into_iter().collect::<Vec<_>>(),
            ["TOFFLOAD_A_1", "TOFFLOAD_B"]
        );
        assert!(mentioned("| TOFFLOAD_X | y", "TOFFLOAD_X"));
        assert!(!mentioned("TOFFLOAD_XY", "TOFFLOAD_X"));
    }

    #[test]
    fn every_variable_the_code_reads_is_documented() {
        let root = root();
        let mut srcs = Vec::new();
        for d in SOURCE_DIRS {
            files(&root.join(d), &mut srcs);
        }
        let mut vars = BTreeSet::new();
        // This file's own examples are not variables.
        let this = root.join(file!());
        for f in srcs.iter().filter(|f| **f != this) {
            if let Ok(t) = std::fs::read_to_string(f) {
                quoted_vars(&t, &mut vars);
            }
        }
        assert!(vars.len() > 20, "the scan found only {vars:?}");
        let mut docs = std::fs::read_to_string(root.join("README.md")).expect("README.md");
        for e in std::fs::read_dir(root.join("docs"))
            .expect("docs/")
            .flatten()
        {
            if e.path().extension().is_some_and(|x| x == "md") {
                docs += &std::fs::read_to_string(e.path()).unwrap_or_default();
            }
        }
        let missing: Vec<&String> = vars.iter().filter(|v| !mentioned(&docs, v)).collect();
        assert!(
            missing.is_empty(),
            "read by the code but in no doc (add them to docs/configuration.md): {missing:?}"
        );
    }
}
