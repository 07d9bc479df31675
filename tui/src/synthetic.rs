//! Synthetic data: what the demo binary (`toffload-tui-synthetic`) and the tests draw
//! when there is no watcher. Values move every window, so a screen that stops
//! changing is a dashboard that stopped drawing.

use crate::model::{
    GuardView, InjectionView, LatencyView, PredictionView, State, SyscallView, Target, VerdictView,
    WindowView,
};

/// Window `i` (one per second): requests/s ramps up by 250 a window with a wobble,
/// the rest follows it.
pub fn window(i: u64) -> WindowView {
    let t = i as f64;
    let rps = 20_000.0 + 250.0 * t + 1_500.0 * (t / 3.0).sin();
    let p50 = 200.0 + 20.0 * t.sin();
    let p99 = 450.0 + 60.0 * (t / 2.0).cos();
    // log2 buckets 1us .. 64ms, a bump around p50 and a tail towards p99.
    let stall_hist = (0..17)
        .map(|b| {
            let ub = f64::from(1u32 << b);
            let x = (ub / p50).log2();
            let count = (5_000.0 * (-x * x).exp() + 300.0 * (-(ub / p99 - 1.0).powi(2)).exp())
                .round() as u64;
            (ub, count)
        })
        .collect();
    let call = |name: &str, per_req: f64, mean_us: f64| SyscallView {
        name: name.to_string(),
        per_sec: rps * per_req,
        mean_us,
    };
    WindowView {
        t_s: t,
        requests_per_sec: rps,
        request_source: "offload calls".into(),
        stall_p50_us: Some(p50),
        stall_p99_us: Some(p99),
        spin_share: Some(0.08 + 0.02 * t.cos()),
        stall_hist,
        futex_per_request: Some(2.0 + 0.3 * (t / 4.0).sin()),
        raw_futex_per_request: Some(0.01),
        voluntary_per_sec: 2.0 * rps,
        involuntary_per_sec: 60.0 + 15.0 * t.sin(),
        wakeup_p50_us: Some(8.0 + t.cos()),
        wakeup_p99_us: Some(40.0 + 5.0 * (t / 3.0).sin()),
        cpu_per_request_us: Some(12.0),
        context_switch_us: Some(2.1),
        syscalls: vec![
            call("recvfrom", 1.0, 1.2),
            call("sendto", 1.0, 3.4),
            call("futex", 2.0, 95.0),
            call("read", 1.0, 0.9),
            call("timerfd_settime", 1.0, 0.7),
            call("write", 1.0, 0.8),
            call("epoll_wait", 0.05, 180.0),
            call("clock_gettime", 0.01, 0.1),
        ],
        processes: Vec::new(),
        latency: None,
    }
}

/// Window `i` of an injected server: its runtime's latencies too.
pub fn injected_window(i: u64) -> WindowView {
    let t = i as f64;
    WindowView {
        latency: Some(LatencyView {
            p50_us: Some(260.0 + 10.0 * t.sin()),
            p99_us: Some(520.0 + 40.0 * (t / 2.0).cos()),
            p999_us: Some(900.0 + 80.0 * (t / 3.0).sin()),
            offload_wait_p50_us: Some(205.0),
        }),
        ..window(i)
    }
}

/// A thread-per-connection server that the model says to fiberize.
pub fn state(pid: u32) -> State {
    State {
        target: Target {
            pid,
            command: "conn_server".into(),
            runtime: "glibc pthreads".into(),
            threads: 66,
        },
        verdict: Some(VerdictView {
            label: "overlap".into(),
            fiberizable: true,
            because: "thread-per-connection, blocking in accel_run through libc futexes \
                      (2.0/request, 0.01 raw), no native TLS runtime"
                .into(),
        }),
        prediction: Some(PredictionView {
            speedup: Some(1.52),
            predicted_rps: Some(43_900.0),
            binding: "server core".into(),
            stop: None,
            inputs: vec![
                ("L offload".into(), "200us".into()),
                ("c cpu/req".into(), "12us".into()),
                ("X switch".into(), "2.1us".into()),
                ("N conns".into(), "64".into()),
                ("P cores".into(), "1".into()),
            ],
            recipe: Some("LD_PRELOAD=libtoffload.so, no code change".into()),
        }),
        injection: None,
        guard: None,
        paused: false,
        status: "synthetic data".into(),
    }
}

/// What the demo shows once the user confirmed an injection.
pub fn injected(pid: u32, before_rps: f64) -> (InjectionView, GuardView) {
    (
        InjectionView {
            state: "injected (synthetic)".into(),
            old_pid: Some(pid),
            new_pid: Some(pid + 1),
            before_rps: Some(before_rps),
            after_rps: Some(before_rps * 1.48),
            predicted_speedup: Some(1.52),
        },
        GuardView {
            mode: "serialize".into(),
            faults: 3,
            conflicts: 0,
            serialized: 3,
        },
    )
}
