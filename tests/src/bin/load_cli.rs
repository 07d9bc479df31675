//! toffload-load: a thin CLI over `toffload_tests::load`.

use clap::Parser;
use std::process::ExitCode;
use std::time::Duration;
use toffload_tests::load::{self, Config};

#[derive(Parser)]
#[command(
    name = "toffload-load",
    version = toffload_cli::VERSION,
    about = "Load generator: closed or open (Poisson) loop, every answer verified against AES-128-CTR"
)]
struct Args {
    #[arg(long, default_value = "127.0.0.1")]
    addr: String,
    #[arg(long)]
    port: u16,
    /// Request size, bytes (must match the server's --size).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=(64 << 20)))]
    size: u64,
    /// Connections.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    conns: u64,
    /// Generator threads, each with its share of the connections and of --rate.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
    threads: u64,
    /// Measured time, e.g. 5s, 500ms.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    duration: Duration,
    /// Unmeasured time before it.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    warmup: Duration,
    /// Open loop: Poisson arrivals at this many requests/s (absent: closed loop).
    #[arg(long)]
    rate: Option<f64>,
    /// A request unanswered this long is an error.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    timeout: Duration,
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    connect_timeout: Duration,
    #[arg(long, default_value_t = 0x70ff_10ad)]
    seed: u64,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    json: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((s, "s"), |i| (&s[..i], &s[i..]));
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a duration such as 5s, 500ms, 200us"))?;
    let secs = match unit {
        "s" => v,
        "ms" => v / 1e3,
        "us" => v / 1e6,
        "m" => v * 60.0,
        _ => return Err(format!("{s:?}: unit must be s, ms, us or m")),
    };
    Ok(Duration::from_secs_f64(secs))
}

fn main() -> ExitCode {
    toffload_cli::generate_if_requested::<Args>();
    let a = Args::parse();
    let mut cfg = Config::new(a.port);
    cfg.addr = a.addr;
    cfg.size = a.size as usize;
    cfg.conns = a.conns as usize;
    cfg.duration = a.duration;
    cfg.warmup = a.warmup;
    cfg.rate = a.rate;
    cfg.timeout = a.timeout;
    cfg.connect_timeout = a.connect_timeout;
    cfg.seed = a.seed;
    let r = match load::run_threads(&cfg, a.threads as usize) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("toffload-load: {e}");
            return ExitCode::from(1);
        }
    };
    // Written as one block, and a closed stdout (`| head`) is not a crash.
    let text = if a.json {
        format!(
            "{}\n",
            serde_json::to_string(&r).expect("report serializes")
        )
    } else {
        let mut t = format!("requests/s   {:.0}\n", r.requests_per_sec);
        if let Some(o) = r.offered_rate {
            t.push_str(&format!("offered/s    {o:.0}\n"));
        }
        t.push_str(&format!("completed    {}\n", r.completed));
        t.push_str(&format!(
            "latency us   p50 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}\n",
            r.p50_us, r.p99_us, r.p999_us, r.max_us
        ));
        if r.offered_rate.is_some() {
            t.push_str(&format!(
                "sent late us p99 {:.1}  max {:.1} (the generator's own delay, in every latency)\n",
                r.late_p99_us, r.late_max_us
            ));
        }
        t.push_str(&format!("wrong        {}\n", r.wrong));
        t.push_str(&format!(
            "errors       {} {:?}\n",
            r.errors, r.errors_by_kind
        ));
        t
    };
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    if r.completed == 0 {
        eprintln!("toffload-load: no request completed");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
