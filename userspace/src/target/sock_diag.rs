//! Listening sockets through sock_diag(7) netlink, filtered by state in the kernel.
//!
//! /proc/net/tcp walks every established socket of the host on each read (the
//! kernel's whole established hash, under its bucket locks) to print the few
//! listeners the watcher wants; on a loaded server that walk was most of the
//! watcher's own CPU. A sock_diag dump asking for LISTEN only never enters the
//! established hash. The caller falls back to /proc/net where the diag modules
//! are missing (a container that cannot load them).

use std::collections::HashSet;
use std::os::fd::AsRawFd;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP};
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_packet_sock_diag::unix::{self, ShowFlags, UnixRequest};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket, SocketAddr};

/// How long one dump may take before the caller falls back: the kernel answers a
/// dump at once, so this only bounds a broken netlink stack.
const RECV_TIMEOUT: libc::timeval = libc::timeval {
    tv_sec: 0,
    tv_usec: 200_000,
};

/// The inodes of the listening TCP (IPv4 and IPv6) and Unix sockets of this
/// network namespace; None when any of the three dumps fails.
pub fn listening_inodes() -> Option<HashSet<u64>> {
    let socket = open()?;
    let mut out = HashSet::new();
    for family in [AF_INET, AF_INET6] {
        let socket_id = if family == AF_INET {
            SocketId::new_v4()
        } else {
            SocketId::new_v6()
        };
        let request = SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::LISTEN,
            socket_id,
        });
        dump(&socket, request, &mut out)?;
    }
    let request = SockDiagMessage::UnixRequest(UnixRequest {
        state_flags: unix::StateFlags::LISTEN,
        inode: 0,
        show_flags: ShowFlags::empty(),
        cookie: [0; 8],
    });
    dump(&socket, request, &mut out)?;
    Some(out)
}

fn open() -> Option<Socket> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG).ok()?;
    socket.bind_auto().ok()?;
    socket.connect(&SocketAddr::new(0, 0)).ok()?;
    // SAFETY: a valid fd and a timeval of the size passed; the kernel copies it.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&RECV_TIMEOUT as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    (rc == 0).then_some(socket)
}

/// Sends one dump request and adds the inode of every socket in its answer.
fn dump(socket: &Socket, request: SockDiagMessage, out: &mut HashSet<u64>) -> Option<()> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut packet = NetlinkMessage::new(header, request.into());
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    socket.send(&buf, 0).ok()?;

    let mut rx = vec![0u8; 32 * 1024];
    loop {
        let size = socket.recv(&mut &mut rx[..], 0).ok()?;
        if size == 0 {
            return None;
        }
        let mut offset = 0;
        while offset < size {
            let message = NetlinkMessage::<SockDiagMessage>::deserialize(&rx[offset..size]).ok()?;
            let length = message.header.length as usize;
            match message.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                    out.insert(u64::from(r.header.inode));
                }
                NetlinkPayload::InnerMessage(SockDiagMessage::UnixResponse(r)) => {
                    out.insert(u64::from(r.header.inode));
                }
                NetlinkPayload::Done(_) => return Some(()),
                NetlinkPayload::Noop => {}
                // An error (the diag module missing: ENOENT) or anything unexpected.
                _ => return None,
            }
            if length == 0 {
                return None;
            }
            offset += length;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn inode_of(fd: i32) -> u64 {
        std::fs::metadata(format!("/proc/self/fd/{fd}"))
            .unwrap()
            .ino()
    }

    #[test]
    fn finds_a_tcp_and_a_unix_listener_and_not_a_connection() {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp6 = std::net::TcpListener::bind("[::1]:0").ok();
        let path = std::env::temp_dir().join(format!("toffload-sockdiag-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let unix = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let conn = std::net::TcpStream::connect(tcp.local_addr().unwrap()).unwrap();
        let Some(found) = listening_inodes() else {
            // The diag modules cannot be loaded here: the caller falls back to /proc.
            assert!(
                std::env::var_os("CI").is_none(),
                "sock_diag unavailable under CI"
            );
            eprintln!("skipped: sock_diag unavailable (no inet_diag/unix_diag)");
            let _ = std::fs::remove_file(&path);
            return;
        };
        assert!(found.contains(&inode_of(tcp.as_raw_fd())));
        if let Some(l) = &tcp6 {
            assert!(found.contains(&inode_of(l.as_raw_fd())));
        }
        assert!(found.contains(&inode_of(unix.as_raw_fd())));
        assert!(!found.contains(&inode_of(conn.as_raw_fd())));
        let _ = std::fs::remove_file(&path);
    }
}
