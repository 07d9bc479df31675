//! One client connection: non-blocking socket, one request outstanding at a time,
//! and (open loop) the arrivals queued behind it.

use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

pub struct Conn {
    pub stream: TcpStream,
    /// Which pool payload is in flight, when it was due (ns), bytes sent and received.
    pub inflight: Option<(usize, u64)>,
    pub sent: usize,
    pub received: usize,
    pub rbuf: Vec<u8>,
    /// Open loop: scheduled arrival times waiting for this connection.
    pub queue: VecDeque<u64>,
    pub want_write: bool,
}

pub enum Progress {
    Pending,
    Answered,
}

impl Conn {
    pub fn open(addr: SocketAddr, size: usize, timeout: Duration) -> io::Result<Conn> {
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        Ok(Conn {
            stream,
            inflight: None,
            sent: 0,
            received: 0,
            rbuf: vec![0; size],
            queue: VecDeque::new(),
            want_write: false,
        })
    }

    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    pub fn begin(&mut self, payload: usize, due_ns: u64) {
        self.inflight = Some((payload, due_ns));
        self.sent = 0;
        self.received = 0;
    }

    /// Writes what it can of the request.
    pub fn write_some(&mut self, req: &[u8]) -> io::Result<()> {
        while self.sent < req.len() {
            // SAFETY: valid fd and buffer range.
            let n = unsafe {
                libc::send(
                    self.fd(),
                    req[self.sent..].as_ptr() as *const libc::c_void,
                    req.len() - self.sent,
                    libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock {
                    self.want_write = true;
                    return Ok(());
                }
                return Err(e);
            }
            self.sent += n as usize;
        }
        self.want_write = false;
        Ok(())
    }

    /// Reads what is there of the answer.
    pub fn read_some(&mut self) -> io::Result<Progress> {
        let size = self.rbuf.len();
        loop {
            if self.inflight.is_none() {
                // Bytes nobody asked for: a broken server.
                let mut junk = [0u8; 1];
                // SAFETY: valid fd and 1-byte buffer.
                let n =
                    unsafe { libc::recv(self.fd(), junk.as_mut_ptr() as *mut libc::c_void, 1, 0) };
                return match n {
                    0 => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "eof")),
                    n if n > 0 => Err(io::Error::new(io::ErrorKind::InvalidData, "unsolicited")),
                    _ => would_block_or(io::Error::last_os_error()),
                };
            }
            // SAFETY: valid fd; reads into the unfilled tail of rbuf.
            let n = unsafe {
                libc::recv(
                    self.fd(),
                    self.rbuf[self.received..].as_mut_ptr() as *mut libc::c_void,
                    size - self.received,
                    0,
                )
            };
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "eof"));
            }
            if n < 0 {
                return would_block_or(io::Error::last_os_error());
            }
            self.received += n as usize;
            if self.received == size {
                return Ok(Progress::Answered);
            }
        }
    }
}

fn would_block_or(e: io::Error) -> io::Result<Progress> {
    if e.kind() == io::ErrorKind::WouldBlock {
        Ok(Progress::Pending)
    } else {
        Err(e)
    }
}
