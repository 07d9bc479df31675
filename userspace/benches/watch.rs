//! `cargo xtask bench watch`: a server's throughput with toffload-watch attached vs
//! without, median of alternating runs, server and load pinned to different CPUs.
//! Writes the table to --out (tests/results/watch.md). Needs root and the dist folder.

use std::process::{Child, Command, Stdio};
use std::time::Duration;
use toffload_tests::harness::{self, Server, ServerSpec};
use toffload_tests::load::{self, Config};

struct Case {
    server: &'static str,
    wait: &'static str,
    lat_us: u32,
    conns: usize,
}

const CASES: &[Case] = &[
    Case {
        server: "conn_server",
        wait: "block",
        lat_us: 200,
        conns: 16,
    },
    Case {
        server: "conn_server",
        wait: "block",
        lat_us: 1000,
        conns: 64,
    },
    Case {
        server: "evloop_server",
        wait: "block",
        lat_us: 200,
        conns: 16,
    },
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn watcher(pid: u32) -> Child {
    let mut c = Command::new(harness::bin("toffload-watch").expect("toffload-watch built"))
        .args(["--json", "--interval", "1s", "--pid", &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start toffload-watch");
    // Wait for "attached" so that the measured run is fully watched.
    use std::io::BufRead;
    let err = c.stderr.take().expect("piped");
    let mut lines = std::io::BufReader::new(err).lines();
    for l in lines.by_ref() {
        if l.map(|l| l.contains("attached to pid")).unwrap_or(false) {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    c
}

fn main() {
    let mut out = None;
    let mut runs = 5;
    let mut secs = 2.0;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = args.next(),
            "--runs" => runs = args.next().and_then(|v| v.parse().ok()).unwrap_or(runs),
            "--secs" => secs = args.next().and_then(|v| v.parse().ok()).unwrap_or(secs),
            "--bench" => {}
            other => eprintln!("watch bench: ignoring {other}"),
        }
    }
    let cpus = harness::cpus();
    let (load_cpu, server_cpu) = if cpus >= 2 {
        (Some(0), Some(cpus - 1))
    } else {
        (None, None)
    };
    if let Some(c) = load_cpu {
        harness::pin_current_thread(c).expect("pin the load generator");
    }
    let mut rows = Vec::new();
    for case in CASES {
        let (mut plain, mut watched) = (Vec::new(), Vec::new());
        for i in 0..runs * 2 {
            let watch = i % 2 == 1;
            let server = Server::start(
                &ServerSpec::new(case.server)
                    .env("TOFFLOAD_EMU_LAT_US", case.lat_us.to_string())
                    .env("TOFFLOAD_WAIT", case.wait)
                    .cpu(server_cpu),
            )
            .expect("start server");
            let mut w = watch.then(|| watcher(server.pid()));
            let mut cfg = Config::new(server.port);
            cfg.conns = case.conns;
            cfg.duration = Duration::from_secs_f64(secs);
            cfg.warmup = Duration::from_millis(300);
            let r = load::run(&cfg).expect("load");
            assert_eq!(r.wrong, 0);
            if let Some(w) = w.as_mut() {
                // SAFETY: signalling our own child.
                unsafe { libc::kill(w.id() as i32, libc::SIGINT) };
                let _ = w.wait();
            }
            eprintln!(
                "{} {} {} us {} conns, watched={watch}: {:.0} req/s",
                case.server, case.wait, case.lat_us, case.conns, r.requests_per_sec
            );
            if watch {
                watched.push(r.requests_per_sec)
            } else {
                plain.push(r.requests_per_sec)
            }
        }
        let (p, w) = (median(plain), median(watched));
        rows.push(format!(
            "| {} | {} | {} | {} | {:.0} | {:.0} | {:.3} | {} |",
            case.server,
            case.wait,
            case.lat_us,
            case.conns,
            p,
            w,
            w / p,
            if w / p >= 0.97 { "yes" } else { "NO" }
        ));
    }
    let table = format!(
        "# toffload-watch overhead\n\n`cargo xtask bench watch` (median of {runs} alternating runs of {secs} s each, \
         server on CPU {}, load generator on CPU {}, {cpus} CPUs; the watcher attached with \
         --interval 1s, unpinned).\n\n\
         | server | wait | offload us | conns | unwatched req/s | watched req/s | ratio | >= 0.97 |\n\
         |---|---|---:|---:|---:|---:|---:|---|\n{}\n",
        server_cpu.map_or("any".into(), |c| c.to_string()),
        load_cpu.map_or("any".into(), |c| c.to_string()),
        rows.join("\n")
    );
    print!("{table}");
    if let Some(p) = out {
        std::fs::write(&p, &table).expect("write the results file");
        eprintln!("wrote {p}");
    }
}
