use super::*;
use std::io::{Read, Write};
use std::net::TcpListener;

/// A thread-per-connection AES echo server; `corrupt` flips a byte of every 10th answer.
fn echo_server(size: usize, corrupt: bool) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let mut buf = vec![0u8; size];
                let mut n = 0u64;
                while s.read_exact(&mut buf).is_ok() {
                    let mut out = payload::expected(&buf);
                    n += 1;
                    if corrupt && n.is_multiple_of(10) {
                        out[size / 2] ^= 1;
                    }
                    if s.write_all(&out).is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

fn quick(port: u16) -> Config {
    let mut c = Config::new(port);
    c.size = 256;
    c.conns = 8;
    c.duration = Duration::from_millis(500);
    c.warmup = Duration::from_millis(100);
    c
}

#[test]
fn closed_loop_against_correct_server_has_no_wrong_answers() {
    let r = run(&quick(echo_server(256, false))).unwrap();
    assert!(r.completed > 100, "{r:?}");
    assert_eq!((r.wrong, r.errors), (0, 0), "{r:?}");
    assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us && r.max_us >= r.p99_us);
    // Closed loop schedules no arrival, so nothing can be sent late.
    assert_eq!((r.late_p99_us, r.late_max_us), (0.0, 0.0), "{r:?}");
}

#[test]
fn corrupted_answers_are_counted_wrong() {
    let r = run(&quick(echo_server(256, true))).unwrap();
    assert!(r.wrong > 0, "{r:?}");
    // About one in ten.
    let share = r.wrong as f64 / r.completed as f64;
    assert!((0.05..0.2).contains(&share), "{share}");
}

#[test]
fn open_loop_reports_offered_rate() {
    let mut c = quick(echo_server(256, false));
    c.rate = Some(2000.0);
    c.duration = Duration::from_secs(1);
    let r = run(&c).unwrap();
    assert_eq!(r.offered_rate, Some(2000.0));
    assert_eq!((r.wrong, r.errors), (0, 0), "{r:?}");
    // A fast server keeps up with a Poisson stream of 2000/s: about 2000 in 1 s.
    assert!((1500..2500).contains(&r.completed), "{r:?}");
    // The generator's own send delay is counted, and it is part of each latency.
    assert!(
        r.late_p99_us > 0.0 && r.late_max_us >= r.late_p99_us,
        "{r:?}"
    );
    assert!(r.late_p99_us <= r.p99_us, "{r:?}");
}

#[test]
fn nothing_listening_is_a_connect_error() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    assert!(matches!(run(&quick(port)), Err(LoadError::Connect(_))));
}

#[test]
fn a_stop_flag_ends_a_long_run_early_with_rates_over_the_time_run() {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut c = quick(echo_server(256, false));
    c.duration = Duration::from_secs(60);
    c.stop = Some(stop.clone());
    let t0 = std::time::Instant::now();
    let h = std::thread::spawn(move || run(&c).unwrap());
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let r = h.join().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(r.completed > 0 && r.wrong == 0);
    assert!(r.duration_s > 0.0 && r.duration_s < 5.0, "{}", r.duration_s);
    let rate = r.completed as f64 / r.duration_s;
    assert!((r.requests_per_sec - rate).abs() < 1e-6 * rate.max(1.0));
}

#[test]
fn the_timeline_adds_up_to_the_count_and_gives_rates_over_any_span() {
    let r = run(&quick(echo_server(256, false))).unwrap();
    assert!(r.completed > 0, "{r:?}");
    assert_eq!(r.timeline.iter().sum::<u64>(), r.completed);
    let steps = (r.duration_s / super::TIMELINE_STEP_S).ceil() as usize;
    assert_eq!(r.timeline.len(), steps);
    let (a, b) = (r.timeline_start, r.timeline_start + r.duration_s);
    let whole = r.rate_between(a, b).unwrap();
    assert!(
        (whole - r.requests_per_sec).abs() <= 1e-6 * whole,
        "{whole} {r:?}"
    );
    // Half a step: the step's count in proportion.
    let first = r.timeline[0] as f64 / super::TIMELINE_STEP_S;
    let half = r.rate_between(a, a + super::TIMELINE_STEP_S / 2.0).unwrap();
    assert!(
        (half - first).abs() <= 1e-6 * first.max(1.0),
        "{half} {first}"
    );
    // Outside the measured time there is nothing to say.
    assert_eq!(r.rate_between(a - 1.0, b), None);
    assert_eq!(r.rate_between(a, b + 1.0), None);
    assert_eq!(r.rate_between(b, a), None);
    // Spans together: their answers over their seconds, the whole again when they
    // tile it; none where one leaves it.
    let m = a + r.duration_s / 3.0;
    let tiled = r.rate_over(&[[a, m], [m, b]]).unwrap();
    assert!((tiled - whole).abs() <= 1e-6 * whole, "{tiled} {whole}");
    let step = super::TIMELINE_STEP_S;
    let two = r.rate_over(&[[a, a + step], [b - step, b]]).unwrap();
    let (c0, cn) = (r.timeline[0], r.timeline[r.timeline.len() - 1]);
    assert!(
        (two - (c0 + cn) as f64 / (2.0 * step)).abs() <= 1e-6 * two.max(1.0),
        "{two} {c0} {cn}"
    );
    assert_eq!(r.rate_over(&[[a, m], [m, b + 1.0]]), None);
    assert_eq!(r.rate_over(&[]), None);
}

#[test]
fn a_light_open_loop_leaves_the_generator_mostly_idle_and_counts_its_capacity() {
    let mut c = quick(echo_server(256, false));
    c.rate = Some(500.0);
    c.duration = Duration::from_secs(1);
    let r = run(&c).unwrap();
    // 500 answers/s take a few ms of a second: most of the run is spent waiting.
    assert!(r.busy_share > 0.0 && r.busy_share < 0.5, "{r:?}");
    // Its capacity is the answers over busy time: far above what it was asked for.
    assert!(r.answers_per_busy_s > 2000.0, "{r:?}");
}

#[test]
fn two_generator_threads_offer_the_whole_rate_between_them() {
    let mut c = quick(echo_server(256, false));
    c.rate = Some(2000.0);
    c.duration = Duration::from_secs(1);
    let r = run_threads(&c, 2).unwrap();
    assert_eq!((r.wrong, r.errors), (0, 0), "{r:?}");
    assert_eq!(r.conns, 8);
    assert_eq!(r.offered_rate, Some(2000.0));
    // Both halves of the Poisson stream arrive: about 2000 answers in 1 s.
    assert!((1500..2500).contains(&r.completed), "{r:?}");
    assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us, "{r:?}");
    assert!(
        run_threads(&quick(1), 9).is_err(),
        "more threads than connections"
    );
}
