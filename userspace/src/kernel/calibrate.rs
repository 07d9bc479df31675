//! The context-switch cost X, measured at start: two threads pinned to one CPU pass a
//! byte back and forth over two pipes, so every hand-off is a sleep, a wake-up and a
//! switch. X = elapsed / switches (it includes the pipe calls, as a real blocking wait
//! includes its futex calls).

use std::time::Instant;

/// Microseconds per context switch, or None when the benchmark cannot run.
pub fn context_switch_us(rounds: u32) -> Option<f64> {
    let cpu = current_cpu()?;
    let prev = affinity();
    let elapsed = ping_pong(cpu, rounds);
    if let Some(set) = prev {
        set_affinity(0, &set);
    }
    elapsed.map(|e| e.as_secs_f64() * 1e6 / (2.0 * rounds as f64))
}

/// `rounds` hand-offs of a byte between this thread and a helper thread, both pinned
/// to `cpu` (this thread stays pinned): the time they took.
pub fn ping_pong(cpu: usize, rounds: u32) -> Option<std::time::Duration> {
    let (a_r, a_w) = pipe()?;
    let (b_r, b_w) = pipe()?;
    let pong = std::thread::spawn(move || {
        pin(cpu);
        let mut buf = [0u8; 1];
        for _ in 0..rounds {
            if !read1(a_r, &mut buf) || !write1(b_w) {
                return false;
            }
        }
        true
    });
    pin(cpu);
    let mut buf = [0u8; 1];
    let t0 = Instant::now();
    let mut ok = true;
    for _ in 0..rounds {
        if !write1(a_w) || !read1(b_r, &mut buf) {
            ok = false;
            break;
        }
    }
    let elapsed = t0.elapsed();
    if !ok {
        // Unblocks the helper if it waits for a byte that will not come.
        // SAFETY: closing our own write end.
        unsafe { libc::close(a_w) };
    }
    let pong_ok = pong.join().unwrap_or(false);
    for fd in [a_r, b_r, b_w].into_iter().chain(ok.then_some(a_w)) {
        // SAFETY: closing our own pipe ends once both threads are done.
        unsafe { libc::close(fd) };
    }
    (ok && pong_ok).then_some(elapsed)
}

fn current_cpu() -> Option<usize> {
    // SAFETY: no arguments.
    let c = unsafe { libc::sched_getcpu() };
    (c >= 0).then_some(c as usize)
}

/// The calling thread's CPU mask.
pub fn affinity() -> Option<libc::cpu_set_t> {
    // SAFETY: a zeroed cpu_set_t is valid; the kernel fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        (libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0)
            .then_some(set)
    }
}

/// Sets the CPU mask of `tid`, a thread of this process (0: the calling thread).
pub fn set_affinity(tid: libc::pid_t, set: &libc::cpu_set_t) {
    // SAFETY: a valid mask of the right size; affects only that thread.
    unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), set) };
}

/// Pins the calling thread to `cpu`.
pub fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET only writes within it.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        set
    };
    set_affinity(0, &set);
}

fn pipe() -> Option<(i32, i32)> {
    let mut fds = [0i32; 2];
    // SAFETY: fds has room for two descriptors.
    (unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0).then_some((fds[0], fds[1]))
}

fn read1(fd: i32, buf: &mut [u8; 1]) -> bool {
    // SAFETY: one byte into a one-byte buffer.
    unsafe { libc::read(fd, buf.as_mut_ptr().cast(), 1) == 1 }
}

fn write1(fd: i32) -> bool {
    // SAFETY: one byte from a static.
    unsafe { libc::write(fd, b"x".as_ptr().cast(), 1) == 1 }
}

#[cfg(test)]
mod tests {
    #[test]
    fn switch_cost_is_plausible() {
        let x = super::context_switch_us(2000).expect("benchmark runs");
        // Anything from a fast bare-metal switch to a slow, busy VM.
        assert!(x > 0.1 && x < 200.0, "{x} us");
    }
}
