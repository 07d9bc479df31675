//! `cargo xtask bench watch`: a server's throughput with toffload-watch attached vs
//! without, median of alternating runs, server and load pinned to different CPUs.
//! Writes the table to --out (tests/results/watch.md). Needs root and the dist folder.

#[path = "watch/phase.rs"]
mod phase;
#[path = "watch/real.rs"]
mod real;

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

/// utime + stime of a process, seconds. The kernel-side programs run in the server's
/// own context, so their cost lands here.
fn cpu_secs(pid: u32) -> f64 {
    toffload_watch::untraced::cpu_secs(pid).unwrap_or(0.0)
}

/// A watcher on `pid` with extra flags (none: the default, the 0.5% overhead budget).
fn watcher(pid: u32, flags: &[&str]) -> Child {
    watcher_to(pid, flags, Stdio::null())
}

/// The same, its JSON lines to `stdout`. Unpinned, as a user starts it: this process
/// runs pinned on the load generator's CPU, and a watcher that inherited that pin
/// shared one busy CPU with the load tool, where its calibration child starved, was
/// cut short after 4 s at every start and never kept for the next.
fn watcher_to(pid: u32, flags: &[&str], stdout: Stdio) -> Child {
    let watch = harness::bin("toffload-watch").expect("toffload-watch built");
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", &format!("0-{}", harness::cpus().max(1) - 1)])
        .arg(watch);
    let mut c = cmd
        .args(["--json", "--interval", "1s"])
        .args(flags)
        .args(["--pid", &pid.to_string()])
        .stdout(stdout)
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
    let mut runs = 7;
    let mut secs = 3.0;
    // --only real: the stock servers alone; --only own: toffload's servers alone.
    let mut only: Option<String> = None;
    // Calibrating starts per stock server: one is the noise of one quarter second.
    let mut calibrating = 5;
    // Seconds of each phase-folded run (phase.rs); 0: none.
    let mut phase_secs = 30.0;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = args.next(),
            "--runs" => runs = args.next().and_then(|v| v.parse().ok()).unwrap_or(runs),
            "--secs" => secs = args.next().and_then(|v| v.parse().ok()).unwrap_or(secs),
            "--only" => only = args.next(),
            "--calibrating" => {
                calibrating = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(calibrating)
                    .max(1)
            }
            "--phase-secs" => {
                phase_secs = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(phase_secs)
            }
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
    // Unwatched, watched as a user runs it (the default: the watch's measured cost
    // kept under 0.5% of the target's CPU), and traced in full (--sample 100).
    let modes: [(&str, Option<&[&str]>); 3] = [
        ("unwatched", None),
        ("watched", Some(&[])),
        ("--sample 100", Some(&["--sample", "100"])),
    ];
    let mut rows = Vec::new();
    let own = only.as_deref() != Some("real");
    let stock = only.as_deref() != Some("own");
    for case in CASES.iter().filter(|_| own) {
        let mut rps: [Vec<f64>; 3] = Default::default();
        let mut cpu: [Vec<f64>; 3] = Default::default();
        for i in 0..runs * modes.len() {
            let m = i % modes.len();
            let server = Server::start(
                &ServerSpec::new(case.server)
                    .env("TOFFLOAD_EMU_LAT_US", case.lat_us.to_string())
                    .env("TOFFLOAD_WAIT", case.wait)
                    .cpu(server_cpu),
            )
            .expect("start server");
            let mut w = modes[m].1.map(|flags| watcher(server.pid(), flags));
            let mut cfg = Config::new(server.port);
            cfg.conns = case.conns;
            cfg.duration = Duration::from_secs_f64(secs);
            cfg.warmup = Duration::from_millis(300);
            let c0 = cpu_secs(server.pid());
            let r = load::run(&cfg).expect("load");
            let c1 = cpu_secs(server.pid());
            // Warm-up requests are not counted but burn CPU: scale by the measured share.
            let total_s = (cfg.duration + cfg.warmup).as_secs_f64();
            let us_per_req = (c1 - c0) * 1e6 * (cfg.duration.as_secs_f64() / total_s)
                / r.completed.max(1) as f64;
            assert_eq!(r.wrong, 0);
            if let Some(w) = w.as_mut() {
                // SAFETY: signalling our own child.
                unsafe { libc::kill(w.id() as i32, libc::SIGINT) };
                let _ = w.wait();
            }
            eprintln!(
                "{} {} {} us {} conns, {}: {:.0} req/s, server CPU {:.1} us/req",
                case.server,
                case.wait,
                case.lat_us,
                case.conns,
                modes[m].0,
                r.requests_per_sec,
                us_per_req
            );
            rps[m].push(r.requests_per_sec);
            cpu[m].push(us_per_req);
        }
        let r: Vec<f64> = rps.into_iter().map(median).collect();
        let c: Vec<f64> = cpu.into_iter().map(median).collect();
        rows.push(format!(
            "| {} | {} | {} | {} | {:.0} | {:.0} ({:.3}) | {:.0} ({:.3}) | {:.1} | {:.1} ({:+.1}%) | {:.1} ({:+.1}%) |",
            case.server,
            case.wait,
            case.lat_us,
            case.conns,
            r[0],
            r[1],
            r[1] / r[0],
            r[2],
            r[2] / r[0],
            c[0],
            c[1],
            (c[1] / c[0] - 1.0) * 100.0,
            c[2],
            (c[2] / c[0] - 1.0) * 100.0,
        ));
    }
    let mut real_rows = Vec::new();
    let mut phase_rows = Vec::new();
    let mut profile_rows = Vec::new();
    for kind in [real::Kind::Redis, real::Kind::Nginx]
        .into_iter()
        .filter(|_| stock)
    {
        if let Some(why) = real::missing(kind) {
            real_rows.push(format!(
                "| {} | not run: {why} | | | | | | | | | | |",
                kind.name()
            ));
            continue;
        }
        // A first start of the boot, which measures the watch's cost per event beside
        // the server (later starts reuse it: calibration_cache.rs), on its own.
        let recal = |pid: u32| watcher(pid, &["--recalibrate"]);
        let first_runs: Vec<real::Run> = (0..calibrating)
            .map(|_| {
                let r = real::run(
                    kind,
                    secs,
                    server_cpu,
                    Some(&recal as &dyn Fn(u32) -> Child),
                );
                eprintln!(
                    "{}, calibrating start: {:.0} req/s, worst quarter second {:.0} req/s, \
                     {:.0} req/s before the start",
                    kind.name(),
                    r.rps,
                    r.worst_quarter,
                    r.before
                );
                r
            })
            .collect();
        let first: Vec<(f64, f64)> = first_runs
            .iter()
            .map(|r| (r.worst_quarter, r.worst_quarter / r.before))
            .collect();
        // Unwatched and watched, interleaved run by run.
        let mut r: [Vec<real::Run>; 2] = Default::default();
        for i in 0..runs * 2 {
            let m = i % 2;
            let w = |pid: u32| watcher(pid, &[]);
            let run = real::run(
                kind,
                secs,
                server_cpu,
                (m == 1).then_some(&w as &dyn Fn(u32) -> Child),
            );
            eprintln!(
                "{}, {}: {:.0} req/s, worst quarter second {:.0} req/s, {:.2} us CPU/req",
                kind.name(),
                modes[m].0,
                run.rps,
                run.worst_quarter,
                run.cpu_us_per_req
            );
            r[m].push(run);
        }
        let med = |v: &[real::Run], f: fn(&real::Run) -> f64| median(v.iter().map(f).collect());
        let (u, w) = (med(&r[0], |x| x.rps), med(&r[1], |x| x.rps));
        let (uq, wq) = (
            med(&r[0], |x| x.worst_quarter),
            med(&r[1], |x| x.worst_quarter),
        );
        let (uc, wc) = (
            med(&r[0], |x| x.cpu_us_per_req),
            med(&r[1], |x| x.cpu_us_per_req),
        );
        // Each watched run against the unwatched runs on either side of it: this
        // host's speed drifts between two modes for seconds at a time, and the ratio
        // of the two medians then says which mode each median fell in.
        let paired = median(
            (0..r[1].len())
                .map(|i| {
                    let next = r[0].get(i + 1).unwrap_or(&r[0][i]);
                    r[1][i].rps / ((r[0][i].rps + next.rps) / 2.0)
                })
                .collect(),
        );
        // Each watched run's worst quarter second against the unwatched median rate.
        let worst = r[1]
            .iter()
            .map(|x| x.worst_quarter / u)
            .fold(f64::INFINITY, f64::min);
        // And against the same run's own rate in the 0.75 s before the watcher's start,
        // which the host's drift between runs (seconds long) does not move; the
        // unwatched runs, measured the same way, are its noise floor.
        let own = |v: &[real::Run]| -> (f64, f64) {
            let q: Vec<f64> = v.iter().map(|x| x.worst_quarter / x.before).collect();
            let least = q.iter().copied().fold(f64::INFINITY, f64::min);
            (median(q), least)
        };
        let ((uo, uo_min), (wo, wo_min)) = (own(&r[0]), own(&r[1]));
        if phase_secs > 0.0 {
            phase_rows.push(phase_row(kind, phase_secs, server_cpu));
        }
        for (mode, v, watched) in [
            ("unwatched", &r[0], false),
            ("watched", &r[1], true),
            ("calibrating start", &first_runs, true),
        ] {
            profile_rows.push(profile_row(kind, mode, v, watched));
        }
        let pct = |v: &[real::Run], f: fn(&real::Run) -> f64| med(v, f) * 100.0;
        real_rows.push(format!(
            "| {} | {u:.0} | {w:.0} ({:.3}) | {paired:.3} | {:.2} / {:.2} (worst run {:.2}) | {uo:.2} (worst {uo_min:.2}) / {wo:.2} (worst {wo_min:.2}) | {:.2} (worst {:.2}); {:.2} (worst {:.2}) | {uc:.2} | {wc:.2} ({:+.1}%) | {:.0}% / {:.0}% | {:.0}% / {:.0}% | {:.1}% |",
            kind.name(),
            w / u,
            uq / u,
            wq / u,
            worst,
            median(first.iter().map(|f| f.0).collect()) / u,
            first.iter().map(|f| f.0).fold(f64::INFINITY, f64::min) / u,
            median(first.iter().map(|f| f.1).collect()),
            first.iter().map(|f| f.1).fold(f64::INFINITY, f64::min),
            (wc / uc - 1.0) * 100.0,
            pct(&r[0], |x| x.server_busy),
            pct(&r[1], |x| x.server_busy),
            pct(&r[0], |x| x.load_busy),
            pct(&r[1], |x| x.load_busy),
            pct(&r[1], |x| x.watcher_busy),
        ));
    }
    let real_table = if real_rows.is_empty() {
        String::new()
    } else {
        format!(
            "\n## Stock Debian servers under their own load tools\n\n\
             Server pinned to CPU {}, load tool on the other, watcher unpinned; throughput is the \
             server's own count (redis INFO total_commands_processed, nginx stub_status), \
             polled every quarter second. Each run: load for 1 s, then the watcher (default \
             budget) starts and attaches, {secs} s measured while attached, SIGINT (detach), \
             1 s more; unwatched runs keep the same timeline. Median of {runs} interleaved \
             runs. Paired: the median over the watched runs of each one's rate over the \
             mean of the unwatched runs just before and after it, which a drift of the \
             host's speed between runs moves less than the ratio of the medians. Worst quarter: the lowest quarter-second rate from the watcher's start to \
             the end of the load, over the unwatched median rate (targets: throughput ratio \
             >= 0.99, worst quarter >= 0.80); the unwatched runs' own worst quarter is the \
             host's noise floor. Over own rate: each run's worst quarter over its own rate in \
             the 0.75 s before the watcher's start (median of the runs, and the worst run), \
             unwatched / watched. The watched runs reuse the calibration of this boot \
             (/run/toffload); \"calibrating start\": {calibrating} runs before them with \
             --recalibrate, a first start's worst quarter (median, and the worst of them), \
             over the unwatched median rate; then over the same run's own rate in the \
             0.75 s before the watcher started, which the host's drift between runs \
             (10-20% here, for seconds at a time) does not move. TOFFLOAD_BENCH_TIMELINE=1 prints \
             each run's quarter-second rates. The last three columns are shares of a core \
             over the attached stretch (medians): the server's, the load tool's (unwatched / \
             watched), and the watcher's own (its start included). Where the load tool's \
             core is full and the server's is not, the load tool sets the rate, and the \
             watcher's CPU on that core is what the watched runs lose.\n\n\
             | server | unwatched req/s | watched req/s (ratio) | paired ratio | \
             worst quarter unwatched / watched | \
             worst quarter over own rate, unwatched / watched | \
             worst quarter, calibrating start | server CPU us/req unwatched | watched | \
             server core busy | load tool CPU | watcher CPU |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n{}\n{}{}",
            server_cpu.map_or("any".into(), |c| c.to_string()),
            real_rows.join("\n"),
            profile_table(&profile_rows),
            phase_table(&phase_rows, phase_secs),
        )
    };
    let table = format!(
        "# toffload-watch overhead\n\n`cargo xtask bench watch` (median of {runs} interleaved runs of {secs} s \
         per mode, server on CPU {}, load generator on CPU {}, {cpus} CPUs; the watcher attached \
         with --interval 1s, unpinned, before the load starts). watched: the default, which \
         measures what each traced event costs at start and traces only the share of each \
         interval that keeps that cost under 0.5% of the target's CPU (--overhead-budget); \
         --sample 100: every event traced, the exact counts.\n\n\
         | server | wait | offload us | conns | unwatched req/s | watched req/s (ratio) | \
         --sample 100 req/s (ratio) | server CPU us/req unwatched | watched | --sample 100 |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n{}\n\n\
         Server CPU per request is utime + stime of the server process over the requests \
         completed; the kernel-side programs run in the server's context, so their cost is \
         in it. The watched ratio is what the 97% target is about; on this shared 2-core VM \
         the throughput of the same configuration moves by several percent between runs, so \
         the CPU cost per request is the steadier measure of the watcher's overhead.\n{real_table}",
        server_cpu.map_or("any".into(), |c| c.to_string()),
        load_cpu.map_or("any".into(), |c| c.to_string()),
        rows.join("\n"),
    );
    print!("{table}");
    if let Some(p) = out {
        // --only replaces its own part of an existing file and keeps the other.
        let old = std::fs::read_to_string(&p).unwrap_or_default();
        let doc = match (only.as_deref(), old.split_once(REAL_HEADING)) {
            (Some("real"), Some((own_part, _))) => {
                format!(
                    "{own_part}{}",
                    &real_table[real_table.find(REAL_HEADING).unwrap_or(0)..]
                )
            }
            (Some("own"), Some((_, real_part))) => {
                let own_part = table
                    .split_once(REAL_HEADING)
                    .map_or(table.as_str(), |t| t.0);
                format!(
                    "{}\n{REAL_HEADING}{real_part}",
                    own_part.trim_end_matches('\n')
                )
            }
            _ => table.clone(),
        };
        std::fs::write(&p, doc).expect("write the results file");
        eprintln!("wrote {p}");
    }
}

/// Per slot, the median over `runs` of `slots(run)` (NaNs left out): the median
/// run's profile.
fn median_profile(runs: &[real::Run], slots: fn(&real::Run) -> &[f64]) -> Vec<f64> {
    let n = runs.iter().map(|r| slots(r).len()).max().unwrap_or(0);
    (0..n)
        .map(|k| {
            let v: Vec<f64> = runs
                .iter()
                .filter_map(|r| slots(r).get(k).copied())
                .filter(|x| x.is_finite())
                .collect();
            if v.is_empty() {
                f64::NAN
            } else {
                median(v)
            }
        })
        .collect()
}

/// "0.93 at +0.50 s": a profile's lowest slot and when it begins, slot 0 at `first` s.
fn lowest(profile: &[f64], first: f64) -> String {
    profile
        .iter()
        .enumerate()
        .filter(|(_, x)| x.is_finite())
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map_or("no samples".into(), |(k, x)| {
            format!("{x:.2} at {:+.2} s", first + k as f64 * 0.25)
        })
}

/// One row of the start-and-exit table: `mode`'s runs lined up on the watcher's
/// start and on its detach (`watched`: whether a watcher started, whose start time
/// the row gives).
fn profile_row(kind: real::Kind, mode: &str, runs: &[real::Run], watched: bool) -> String {
    let start = median_profile(runs, |r| &r.start_quarters);
    let exit = median_profile(runs, |r| &r.exit_quarters);
    let each_worst = median(
        runs.iter()
            .map(|r| {
                r.start_quarters
                    .iter()
                    .chain(&r.exit_quarters)
                    .copied()
                    .filter(|x| x.is_finite())
                    .fold(f64::INFINITY, f64::min)
            })
            .collect(),
    );
    let took = median(runs.iter().map(|r| r.start_secs).collect());
    format!(
        "| {} | {mode} | {} | {} | {} | {each_worst:.2} | {} |",
        kind.name(),
        runs.len(),
        lowest(&start, 0.0),
        lowest(&exit, -0.25),
        if watched {
            format!("{took:.2} s")
        } else {
            "-".into()
        },
    )
}

fn profile_table(rows: &[String]) -> String {
    if rows.is_empty() {
        return String::new();
    }
    format!(
        "\n### The watcher's start and exit in the median run\n\n\
         The runs above lined up on the moment the watcher starts and the moment it is \
         interrupted (detach): each run's quarter-second rates over its own rate in the \
         0.75 s before the start, {} quarters from the start and {} from a quarter before \
         the interrupt; per quarter, the median over the runs of a mode. The host's \
         slow-downs (seconds long, at any moment) land at different times in different \
         runs and the median run leaves them out; what the watcher does at the same moment \
         in every run stays in it. The unwatched runs, lined up on the same clock, are the \
         method's floor. Lowest quarter: the median run's lowest, and when it begins \
         (seconds from the start, from the interrupt). Each run's worst: the median over the \
         runs of each run's own lowest quarter in both stretches, host noise included. \
         Start took: from the watcher's start to its \"attached\" line (median).\n\n\
         | server | mode | runs | start: lowest quarter of the median run | exit: lowest quarter of the median run | each run's worst (median) | start took |\n\
         |---|---|---:|---:|---:|---:|---:|\n{}\n",
        real::START_QUARTERS,
        real::EXIT_QUARTERS,
        rows.join("\n")
    )
}

/// Where the stock servers' part of the results file begins.
const REAL_HEADING: &str = "\n## Stock Debian servers";

/// One stock server's phase-folded runs (phase.rs): unwatched, then watched.
fn phase_row(kind: real::Kind, secs: f64, server_cpu: Option<usize>) -> String {
    let w = |pid: u32| watcher_to(pid, &[], Stdio::piped());
    let control = phase::run(kind, secs, server_cpu, None);
    let watched = phase::run(kind, secs, server_cpu, Some(&w as &dyn Fn(u32) -> Child));
    let (Some(c), Some(f)) = (control, watched) else {
        return format!(
            "| {} | too few samples to fold | | | | | | | | | |",
            kind.name()
        );
    };
    let bin = |i: usize| f.rel[i];
    let mid_min = f.rel[2..6].iter().copied().fold(f64::INFINITY, f64::min);
    let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.2}%", v * 100.0));
    let loss = |f: &phase::Folded| match f.loss_se {
        Some(se) => format!("{:.2}% ± {:.2}%", f.loss * 100.0, 2.0 * se * 100.0),
        None => format!("{:.2}%", f.loss * 100.0),
    };
    eprintln!(
        "{}, folded by phase: watched {:?}, unwatched {:?}",
        kind.name(),
        f.rel.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>(),
        c.rel.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>()
    );
    format!(
        "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {} |",
        kind.name(),
        f.intervals,
        pct(f.duty),
        pct(f.burst_share),
        pct(f.host_share),
        bin(0),
        bin(1),
        mid_min,
        bin(phase::BINS - 1),
        loss(&f),
        loss(&c),
        pct(f.claimed),
    )
}

fn phase_table(rows: &[String], secs: f64) -> String {
    if rows.is_empty() {
        return String::new();
    }
    format!(
        "\n### The steady watch, folded by phase\n\n\
         One {secs} s run per server under its load tool, watched with the default budget \
         (calibration reused), the server's own count read every 25 ms; each sample placed \
         at its time since the last window line (where the next burst attaches; the first \
         two windows skipped), in {:.0} ms bins. Each bin's rate is over the median of the \
         bins from 300 to 900 ms, the same run untraced; the steady loss is 1 - the mean of \
         all bins over that level: the watch's cost within one run, which the host's drift \
         between runs does not move. ± is two standard errors, jackknifed over the intervals \
         (each left out in turn): the host's hiccups within the run, which a loss smaller \
         than it cannot be told from. The unwatched run, folded on the same 1 s clock, is the \
         method's noise floor. Not in it: what the watcher costs evenly over the interval \
         (its polls), in the watcher CPU column above. The last column is what the watch \
         itself says it costs the target over an interval (each window's share while \
         tracing, its cost per request measured on the target where that is higher than \
         the calibration's, times the duty, plus a burst's attach and detach; median of \
         the windows): the figure to set beside the steady loss.\n\n\
         | server | intervals | duty | burst share | host share | 0-50 ms | 50-100 ms \
         | 100-300 ms (lowest) | 950-1000 ms | steady loss, watched | unwatched, folded the \
         same | the watch's own estimate |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n{}\n",
        phase::BIN * 1e3,
        rows.join("\n")
    )
}
