//! A process's environment as it was started, from /proc/PID/environ: the block the
//! kernel laid out at exec, which a server that retitles itself (redis-server, nginx)
//! writes its title over. Read back then, it holds blanks or the tail of a command
//! line, and taken as an environment it would say "no variable set".

use std::io;

/// The KEY=VALUE entries in order, or None where any entry is not one (overwritten).
pub fn parse(b: &[u8]) -> Option<Vec<(String, String)>> {
    let b = b.strip_suffix(&[0]).unwrap_or(b);
    if b.is_empty() {
        return Some(Vec::new());
    }
    b.split(|&c| c == 0)
        .map(|kv| {
            let s = String::from_utf8_lossy(kv);
            let (k, v) = s.split_once('=')?;
            (!k.is_empty() && !k.contains(' ')).then(|| (k.to_string(), v.to_string()))
        })
        .collect()
}

/// `pid`'s environment: Ok(None) when it was overwritten.
pub fn read(pid: u32) -> io::Result<Option<Vec<(String, String)>>> {
    Ok(parse(&std::fs::read(format!("/proc/{pid}/environ"))?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retitled_servers_environment_is_not_read_as_empty() {
        // redis-server 7.0 and nginx 1.22 (master), read back from /proc/PID/environ.
        assert_eq!(parse(b"\0\0\0    \0"), None);
        assert_eq!(parse(b"c /tmp/nginx.conf\0\0\0"), None);
        assert_eq!(parse(b"A=1\0 \0"), None);
        // Intact ones, the empty one included; a value may hold '=' and spaces.
        assert_eq!(parse(b""), Some(vec![]));
        assert_eq!(
            parse(b"A=1\0B=x=y z\0"),
            Some(vec![("A".into(), "1".into()), ("B".into(), "x=y z".into())])
        );
    }

    #[test]
    fn a_live_processs_environment_is_read() {
        let env = read(std::process::id())
            .unwrap()
            .expect("this test's own is intact");
        assert!(env.iter().any(|(k, _)| k == "PATH"), "{env:?}");
        assert!(read(u32::MAX).is_err());
    }
}
