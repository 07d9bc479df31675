//! What waking a task that sleeps on another, idle CPU costs the waker: the CPU has
//! to be interrupted out of its idle state (an IPI; in a VM, an exit on both sides),
//! and the waker's syscall pays for sending it. A server answering a local client
//! that waits idle pays it on every answer; answering a client that is busy anyway
//! (a server fast enough to keep its load generator running) it does not. Measured as
//! the median small write to a socket whose reader sleeps on `peer`, less the median
//! one to a socket no one waits on (no wake-up to send). That baseline has no reader:
//! a reader polling for it spun on `peer`, the target's CPU where the watcher is not
//! pinned, for the whole measurement.

use std::time::{Duration, Instant};

/// The gap between two writes: long enough for a sleeping reader's CPU to go idle.
const GAP: Duration = Duration::from_micros(50);
/// How long the reader may take to drain and end after the last write.
const READER_DEADLINE: Duration = Duration::from_millis(200);

/// Nanoseconds the waker pays to wake an idle `peer` CPU, from `n` writes each way
/// (the caller stays on the CPU it runs on, which must not be `peer`; pinned, as the
/// calibration child is, or the scheduler may move it there). None when the threads
/// or sockets cannot be had.
pub fn idle_wake_ns(peer: usize, n: u32) -> Option<f64> {
    let sleeping = median_write_ns(Some(peer), n)?;
    let unread = median_write_ns(None, n)?;
    Some((sleeping - unread).max(0.0))
}

/// A CPU other than `than` that this thread may use (read before pinning it).
pub fn other_cpu(than: usize) -> Option<usize> {
    // SAFETY: a zeroed cpu_set_t is valid; the kernel fills it.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        set
    };
    // SAFETY: CPU_ISSET reads the set.
    (0..libc::CPU_SETSIZE as usize).find(|&c| c != than && unsafe { libc::CPU_ISSET(c, &set) })
}

/// The median time of `n` 64-byte writes to a socket read on `peer` by a thread that
/// sleeps in read(), or (`peer` None) read by no one until the writes are done.
fn median_write_ns(peer: Option<usize>, n: u32) -> Option<f64> {
    let mut fds = [0i32; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    } != 0
    {
        return None;
    }
    let [w, r] = fds;
    // The reader owns its end and says when it is done; it is never joined: on a CPU
    // a real-time poller holds it may not run for seconds, and the calibration must
    // go on without it (a measurement it did not finish is none).
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let reader = match peer {
        Some(peer) => std::thread::Builder::new()
            .name("idle-wake".into())
            .spawn(move || {
                crate::calibrate::pin(peer);
                let mut buf = [0u8; 4096];
                // SAFETY: reads into our own buffer, until EOF or an error.
                while unsafe { libc::read(r, buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
                // SAFETY: this thread's own end, closed once.
                unsafe { libc::close(r) };
                let _ = done_tx.send(());
            })
            .is_ok(),
        None => {
            // No reader: the writes queue in the socket and the read end is closed with
            // the write end below. Non-blocking, so that a socket buffer too small for
            // all n ends the measurement (None) instead of blocking it.
            let _ = done_tx.send(());
            // SAFETY: a descriptor of ours.
            let set = unsafe { libc::fcntl(w, libc::F_SETFL, libc::O_NONBLOCK) };
            set != -1
        }
    };
    let mut times = Vec::with_capacity(n as usize);
    if reader {
        if peer.is_some() {
            // The reader's first read, before the timed writes start.
            std::thread::sleep(Duration::from_millis(2));
        }
        let msg = [0u8; 64];
        for _ in 0..n {
            std::thread::sleep(GAP);
            let t0 = Instant::now();
            // SAFETY: writes our own buffer to our own socket (a few KiB in all,
            // within its buffer, so never blocked by a reader that does not run).
            let put = unsafe { libc::write(w, msg.as_ptr().cast(), msg.len()) };
            if put != msg.len() as isize {
                break;
            }
            times.push(t0.elapsed().as_nanos() as f64);
        }
    } else {
        // SAFETY: no thread took it.
        unsafe { libc::close(r) };
    }
    // Closing the write end ends the reader (EOF).
    // SAFETY: our own descriptors, each closed once (r here only in the unread way,
    // and not where the branch above closed it).
    unsafe {
        libc::close(w);
        if peer.is_none() && reader {
            libc::close(r);
        }
    }
    let finished = reader && done_rx.recv_timeout(READER_DEADLINE).is_ok();
    if !finished || times.len() < n as usize {
        return None;
    }
    times.sort_by(f64::total_cmp);
    Some(times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where there is a second CPU, waking it from idle costs the waker something,
    /// and not more than a slow VM's exit would.
    #[test]
    fn waking_an_idle_cpu_costs_the_waker() {
        // SAFETY: no arguments.
        let here = unsafe { libc::sched_getcpu() }.max(0) as usize;
        let Some(peer) = other_cpu(here) else {
            println!("skipped: one CPU, no idle peer to wake");
            return;
        };
        crate::calibrate::pin(here);
        let ns = idle_wake_ns(peer, 100).expect("measures");
        println!("waking an idle CPU cost the waker {:.2} us", ns / 1e3);
        assert!(ns < 100_000.0, "{ns} ns");
    }

    /// The unread baseline queues every write in one socket: more than its buffer
    /// holds ends the measurement with None, at once, where a blocking write would
    /// wait forever for a reader that does not exist.
    #[test]
    fn more_writes_than_an_unread_socket_holds_end_the_measurement() {
        let t0 = Instant::now();
        assert_eq!(median_write_ns(None, 1_000_000), None);
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    }
}
