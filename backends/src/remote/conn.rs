//! A connection: a TCP or TLS stream, non-blocking once set up, with a frame reader
//! and an output buffer. Shared by the client's I/O thread and the daemon.

use super::frame::{self, FrameReader, Msg};
use openssl::ssl::SslStream;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

pub enum Stream {
    Plain(TcpStream),
    Tls(Box<SslStream<TcpStream>>),
}

impl Stream {
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        }
    }
}

pub struct Conn {
    pub stream: Stream,
    pub rd: FrameReader,
    pub out: Vec<u8>,
    out_pos: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

impl Conn {
    pub fn new(stream: Stream) -> Self {
        Conn {
            stream,
            rd: FrameReader::new(),
            out: Vec::with_capacity(64 << 10),
            out_pos: 0,
            bytes_in: 0,
            bytes_out: 0,
        }
    }

    pub fn fd(&self) -> RawFd {
        self.stream.tcp().as_raw_fd()
    }

    /// Bytes queued and not yet written.
    pub fn backlog(&self) -> usize {
        self.out.len() - self.out_pos
    }

    /// Writes what it can without blocking. Ok(true) when everything went out.
    pub fn flush(&mut self) -> io::Result<bool> {
        while self.out_pos < self.out.len() {
            match self.stream.write(&self.out[self.out_pos..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.out_pos += n;
                    self.bytes_out += n as u64;
                }
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(e),
            }
        }
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
            Ok(true)
        } else {
            if self.out_pos > (1 << 20) {
                self.out.drain(..self.out_pos);
                self.out_pos = 0;
            }
            Ok(false)
        }
    }

    /// Reads once without blocking. Ok(false): nothing there now. End of stream is an
    /// error (UnexpectedEof).
    pub fn read_some(&mut self) -> io::Result<bool> {
        match self.rd.fill(&mut self.stream) {
            Ok(0) => Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                self.bytes_in += n as u64;
                Ok(true)
            }
            Err(e) if would_block(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Set-up phase (blocking socket with timeouts): sends one frame.
    pub fn send_blocking(&mut self, msg: &Msg<'_>) -> io::Result<()> {
        frame::encode(msg, &mut self.out);
        let r = self.stream.write_all(&self.out[self.out_pos..]);
        self.bytes_out += (self.out.len() - self.out_pos) as u64;
        self.out.clear();
        self.out_pos = 0;
        r
    }

    /// Set-up phase: waits (until `deadline`) for one whole frame and returns its body.
    pub fn recv_blocking(&mut self, deadline: Instant) -> io::Result<Vec<u8>> {
        loop {
            if let Some(body) = self.rd.next_frame().map_err(invalid)? {
                return Ok(body.to_vec());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            self.stream
                .tcp()
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
            match self.rd.fill(&mut self.stream) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.bytes_in += n as u64,
                Err(e) if would_block(&e) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

pub fn invalid(e: frame::FrameError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// ppoll(2) on a set of fds (nanosecond timeout: poll's milliseconds would turn a
/// 20 us coalescing delay into 1 ms).
pub fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<()> {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: a valid array of pollfd; a valid or null timespec; no signal mask change.
    let rc = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            tsp,
            std::ptr::null(),
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

pub fn pollfd(fd: RawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// A non-blocking eventfd used to wake a thread.
pub struct EventFd(std::os::fd::OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain syscall; result checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own.
        Ok(EventFd(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }
    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
    pub fn signal(&self) {
        let one = 1u64;
        // SAFETY: 8-byte write to our eventfd; EAGAIN (counter full) is harmless.
        unsafe { libc::write(self.fd(), &one as *const u64 as *const libc::c_void, 8) };
    }
    pub fn drain(&self) {
        let mut v = 0u64;
        // SAFETY: 8-byte read from our non-blocking eventfd.
        unsafe { libc::read(self.fd(), &mut v as *mut u64 as *mut libc::c_void, 8) };
    }
}

/// A random 64-bit id (client ids, daemon incarnations) from openssl's CSPRNG. Its
/// failure is an error: an id others could guess would let them claim a session.
pub fn random_u64() -> io::Result<u64> {
    let mut b = [0u8; 8];
    openssl::rand::rand_bytes(&mut b)
        .map_err(|e| io::Error::other(format!("no random bytes from openssl: {e}")))?;
    Ok(u64::from_le_bytes(b))
}
