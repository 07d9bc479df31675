//! Syscalls entered by a server's own threads over a window, counted by `perf stat` on
//! the raw_syscalls:sys_enter tracepoint, per thread (perf is the independent count
//! here: the runtime cannot see the syscalls it does not interpose).

use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::Duration;

/// Threads of the emulated device (toffload's backend, not the server's code).
use toffload_tests::device_core::DEVICE_THREAD;

/// Counts `pid`'s syscalls for `window`, starting `after` from now, in a thread.
/// None when perf is missing, not permitted, or said nothing usable.
pub fn count(pid: u32, after: Duration, window: Duration) -> JoinHandle<Option<u64>> {
    std::thread::spawn(move || {
        std::thread::sleep(after);
        let out =
            std::env::temp_dir().join(format!("toffload-perf-{}-{pid}.csv", std::process::id()));
        let st = Command::new("perf")
            .args([
                "stat",
                "-e",
                "raw_syscalls:sys_enter",
                "--per-thread",
                "-x,",
                "-o",
            ])
            .arg(&out)
            .args(["-p", &pid.to_string(), "--", "sleep"])
            .arg(format!("{:.3}", window.as_secs_f64()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .ok()?;
        let text = std::fs::read_to_string(&out).ok();
        let _ = std::fs::remove_file(&out);
        st.success().then_some(())?;
        server_threads_total(&text?)
    })
}

/// The sum over `perf stat -x, --per-thread` lines (`comm-tid,count,...`), the
/// device's threads apart; None when no line had a count.
fn server_threads_total(csv: &str) -> Option<u64> {
    let mut total = None;
    for line in csv.lines().filter(|l| !l.starts_with('#')) {
        let mut f = line.split(',');
        let (Some(thread), Some(n)) = (f.next(), f.next()) else {
            continue;
        };
        let Ok(n) = n.trim().parse::<u64>() else {
            continue;
        };
        if !thread.starts_with(DEVICE_THREAD) {
            total = Some(total.unwrap_or(0) + n);
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::server_threads_total;

    #[test]
    fn the_device_thread_and_uncounted_lines_are_left_out() {
        let csv = "# started on Fri Dec  4 02:25:55 2026\n\n\
                   conn_server-22825,291995,,raw_syscalls:sys_enter,1674657748,100.00,,\n\
                   toffload-emu-22826,49689,,raw_syscalls:sys_enter,185075171,100.00,,\n\
                   conn_server-22821,<not counted>,,raw_syscalls:sys_enter,0,100.00,,\n\
                   conn_server-22830,5,,raw_syscalls:sys_enter,1,100.00,,\n";
        assert_eq!(server_threads_total(csv), Some(292_000));
        assert_eq!(server_threads_total("# nothing\n"), None);
    }
}
