//! A raw protocol client for the daemon's hardening tests: frames as a hostile or
//! exact client sends them, over plaintext or TLS with a pre-shared key.

use std::io;
use std::net::TcpStream;
use std::time::{Duration, Instant};
use toffload_accel::remote::conn::{Conn, Stream};
use toffload_accel::remote::frame::{self, Msg, Op};
use toffload_accel::remote::tls::{psk_connector, Psk};

pub struct Raw {
    pub c: Conn,
    /// The chunk hashes the Welcome listed.
    pub chunks: Vec<[u8; 32]>,
}

/// A frame from the daemon, owned.
#[derive(Debug)]
pub enum Got {
    Results(Vec<(u64, i32, Vec<u8>)>),
    Refused(String),
    Pong,
    Other(String),
}

impl Raw {
    /// Connects and says hello as `client_id`; Err: the daemon's refusal or the error.
    pub fn hello(addr: &str, psk: Option<&Psk>, client_id: u64) -> Result<Raw, String> {
        let tcp = TcpStream::connect(addr).map_err(|e| e.to_string())?;
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        tcp.set_write_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let stream = match psk {
            None => Stream::Plain(tcp),
            Some(p) => {
                let con = psk_connector(p.clone()).unwrap();
                Stream::Tls(Box::new(
                    con.connect("127.0.0.1", tcp).map_err(|e| e.to_string())?,
                ))
            }
        };
        let mut c = Conn::new(stream);
        c.send_blocking(&Msg::Hello {
            version: frame::VERSION,
            client_id,
        })
        .map_err(|e| e.to_string())?;
        let body = c
            .recv_blocking(Instant::now() + Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        match frame::decode(&body).map_err(|e| e.to_string())? {
            Msg::Welcome { chunks, .. } => Ok(Raw { c, chunks }),
            Msg::Refused { reason } => Err(format!("refused: {reason}")),
            m => Err(format!("unexpected {m:?}")),
        }
    }

    pub fn submit(&mut self, watermark: u64, acks: &[u64], ops: &[Op<'_>]) -> io::Result<()> {
        let mut out = Vec::new();
        frame::encode_submit(watermark, acks, ops, &mut out);
        self.write(&out)
    }

    pub fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        use std::io::Write;
        self.c.stream.write_all(bytes)?;
        self.c.stream.flush()
    }

    pub fn ping(&mut self) -> io::Result<()> {
        let mut out = Vec::new();
        frame::encode(&Msg::Ping { token: 7 }, &mut out);
        self.write(&out)
    }

    /// The next frame, within `within`.
    pub fn next(&mut self, within: Duration) -> io::Result<Got> {
        let body = self.c.recv_blocking(Instant::now() + within)?;
        Ok(
            match frame::decode(&body).map_err(|e| io::Error::other(e.to_string()))? {
                Msg::Results { results, .. } => Got::Results(
                    results
                        .iter()
                        .map(|r| (r.seq, r.status, r.data.to_vec()))
                        .collect(),
                ),
                Msg::Refused { reason } => Got::Refused(reason.to_string()),
                Msg::Pong { .. } => Got::Pong,
                m => Got::Other(format!("{m:?}")),
            },
        )
    }

    /// Results until `n` have come (other frames skipped), within `within`.
    pub fn results(&mut self, n: usize, within: Duration) -> Vec<(u64, i32, Vec<u8>)> {
        let end = Instant::now() + within;
        let mut v = Vec::new();
        while v.len() < n {
            let left = end.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "only {} of {n} results: {v:?}", v.len());
            if let Got::Results(r) = self.next(left).expect("results") {
                v.extend(r);
            }
        }
        v
    }
}

/// The resident and virtual sizes of process `pid`, bytes.
pub fn rss_and_vsz(pid: u32) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = |key: &str| -> u64 {
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
            * 1024
    };
    (kb("VmRSS:"), kb("VmSize:"))
}
