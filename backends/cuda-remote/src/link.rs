//! The connection to a daemon: TCP, or TLS when the remote backend's TLS or PSK knobs
//! are set (the same files and the same rules as its client: all three TLS_* or none,
//! PSK not with them). Under TLS the rest of the library still sees a TcpStream: one
//! end of a loopback connection whose other end a relay thread pumps through the
//! TLS session. Why: the library reads on its receiver thread and writes from the
//! program's threads on one socket, which a TcpStream allows and an SslStream (one
//! object, one thread at a time) does not.

use crate::knobs;
use crate::tls_client::{self, TlsFiles};
use openssl::ssl::{ErrorCode, SslConnector, SslStream};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Bytes a relay holds in each direction before it stops reading that side.
const RELAY_CAP: usize = 4 << 20;

fn var(k: &knobs::Knob) -> Option<PathBuf> {
    std::env::var_os(k.var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn load() -> Result<Option<SslConnector>, String> {
    let files = (
        var(&knobs::REMOTE_TLS_CA),
        var(&knobs::REMOTE_TLS_CERT),
        var(&knobs::REMOTE_TLS_KEY),
    );
    let psk = var(&knobs::REMOTE_PSK);
    match (files, psk) {
        ((None, None, None), None) => Ok(None),
        ((None, None, None), Some(p)) => tls_client::read_client_psk(&p)
            .and_then(tls_client::psk_connector)
            .map(Some)
            .map_err(|e| format!("{}: {e}", knobs::REMOTE_PSK.var)),
        ((Some(ca), Some(cert), Some(key)), None) => {
            tls_client::connector(&TlsFiles { ca, cert, key }).map(Some)
        }
        ((_, _, _), Some(_)) => Err(format!(
            "{} and the TOFFLOAD_REMOTE_TLS_* certificates exclude each other",
            knobs::REMOTE_PSK.var
        )),
        _ => Err(format!(
            "{}, {} and {}: all three or none",
            knobs::REMOTE_TLS_CA.var,
            knobs::REMOTE_TLS_CERT.var,
            knobs::REMOTE_TLS_KEY.var
        )),
    }
}

/// The TLS set-up, read once (every connection of the process uses the same).
fn tls() -> &'static Result<Option<SslConnector>, String> {
    static TLS: OnceLock<Result<Option<SslConnector>, String>> = OnceLock::new();
    TLS.get_or_init(load)
}

fn left(addr: &str, deadline: Instant) -> Result<Duration, String> {
    let l = deadline.saturating_duration_since(Instant::now());
    if l.is_zero() {
        Err(format!("daemon {addr}: no answer in time"))
    } else {
        Ok(l)
    }
}

/// Connects to `addr` by `deadline`: the plain socket, or under TLS the program's end
/// of the relay once the handshake is done. Nodelay set; timeouts are the caller's.
pub fn open(addr: &str, deadline: Instant) -> Result<TcpStream, String> {
    let fail = |e: std::io::Error| format!("daemon {addr}: {e}");
    let sa = addr
        .to_socket_addrs()
        .map_err(fail)?
        .next()
        .ok_or_else(|| format!("daemon {addr}: no address"))?;
    let tcp = TcpStream::connect_timeout(&sa, left(addr, deadline)?).map_err(fail)?;
    let _ = tcp.set_nodelay(true);
    let connector = match tls() {
        Ok(None) => return Ok(tcp),
        Ok(Some(c)) => c,
        Err(e) => return Err(e.clone()),
    };
    // The handshake, bounded: each read and write by what is left.
    let t = left(addr, deadline)?;
    tcp.set_read_timeout(Some(t)).map_err(fail)?;
    tcp.set_write_timeout(Some(t)).map_err(fail)?;
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ssl = connector
        .connect(host, tcp)
        .map_err(|e| format!("daemon {addr}: TLS handshake: {e}"))?;
    // The loopback pair: the library's end and the relay's.
    let l = TcpListener::bind(("127.0.0.1", 0)).map_err(fail)?;
    let mine = TcpStream::connect(l.local_addr().map_err(fail)?).map_err(fail)?;
    let (theirs, _) = l.accept().map_err(fail)?;
    let _ = mine.set_nodelay(true);
    let _ = theirs.set_nodelay(true);
    std::thread::Builder::new()
        .name("cuda-remote-tls".into())
        .spawn(move || relay(theirs, ssl))
        .map_err(fail)?;
    Ok(mine)
}

/// What one pass of reading the TLS side found.
enum Got {
    More,
    Blocked,
    Ended,
}

fn ssl_read(ssl: &mut SslStream<TcpStream>, buf: &mut [u8], down: &mut Vec<u8>) -> Got {
    match ssl.ssl_read(buf) {
        Ok(0) => Got::Ended,
        Ok(n) => {
            down.extend_from_slice(&buf[..n]);
            Got::More
        }
        Err(e) if matches!(e.code(), ErrorCode::WANT_READ | ErrorCode::WANT_WRITE) => Got::Blocked,
        Err(_) => Got::Ended,
    }
}

/// Pumps bytes between the library's loopback end and the TLS session until either
/// side ends; then closes the other, so the library sees the loss as on a plain
/// socket.
fn relay(local: TcpStream, mut ssl: SslStream<TcpStream>) {
    if local.set_nonblocking(true).is_err() || ssl.get_ref().set_nonblocking(true).is_err() {
        return;
    }
    let _ = ssl.get_ref().set_read_timeout(None);
    let _ = ssl.get_ref().set_write_timeout(None);
    let (mut up, mut down) = (Vec::new(), Vec::new());
    let mut buf = vec![0u8; 64 << 10];
    let (mut local_eof, mut tls_eof) = (false, false);
    loop {
        while !tls_eof && down.len() < RELAY_CAP {
            match ssl_read(&mut ssl, &mut buf, &mut down) {
                Got::More => {}
                Got::Blocked => break,
                Got::Ended => tls_eof = true,
            }
        }
        while !down.is_empty() {
            match (&local).write(&down) {
                Ok(n) => {
                    down.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
        while !local_eof && up.len() < RELAY_CAP {
            match (&local).read(&mut buf) {
                Ok(0) => local_eof = true,
                Ok(n) => up.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => local_eof = true,
            }
        }
        while !up.is_empty() {
            match ssl.ssl_write(&up) {
                Ok(n) => {
                    up.drain(..n);
                }
                Err(e) if matches!(e.code(), ErrorCode::WANT_READ | ErrorCode::WANT_WRITE) => break,
                Err(_) => {
                    let _ = local.shutdown(Shutdown::Both);
                    return;
                }
            }
        }
        if tls_eof && down.is_empty() {
            let _ = local.shutdown(Shutdown::Both);
            return;
        }
        if local_eof && up.is_empty() {
            let _ = ssl.shutdown();
            return;
        }
        let mut local_ev = 0;
        if !local_eof && up.len() < RELAY_CAP {
            local_ev |= libc::POLLIN;
        }
        if !down.is_empty() {
            local_ev |= libc::POLLOUT;
        }
        let mut tls_ev = libc::POLLIN;
        if !up.is_empty() {
            tls_ev |= libc::POLLOUT;
        }
        let mut fds = [
            libc::pollfd {
                fd: local.as_raw_fd(),
                events: local_ev,
                revents: 0,
            },
            libc::pollfd {
                fd: ssl.get_ref().as_raw_fd(),
                events: tls_ev,
                revents: 0,
            },
        ];
        // A bounded poll: TLS may want the other direction than the one asked for
        // (a key update); the next pass tries both again.
        // SAFETY: two valid pollfd entries.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
    }
}
