//! `cargo xtask bench reroute`: the Redis reroute, ACCEL.SYNC vs ACCEL.ASYNC of
//! toffload_redis.so in Debian's redis-server under redis-benchmark at 50, 200 and
//! 1000 us -> tests/results/reroute.md. The measurement is the `reroute_benchmark`
//! test of tests/tests/reroute_redis.rs (which compiles the module itself); without
//! redis-server it skips with the reason (fails under CI).

use crate::paths;
use crate::proc::{self, Result};

pub fn run(args: Vec<String>) -> Result {
    let rounds = match args.as_slice() {
        [] => 3,
        [flag, n] if flag == "--rounds" => n
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("--rounds wants a positive integer, not {n:?}"))?,
        _ => {
            return Err(format!(
                "bench reroute takes only `-- --rounds N`, not {args:?}"
            ))
        }
    };
    let dist = crate::build::all()?;
    proc::run(
        proc::cargo()
            .args([
                "test",
                "--release",
                "-p",
                "toffload-tests",
                "--test",
                "reroute_redis",
            ])
            .args(["--", "--exact", "reroute_benchmark", "--nocapture"])
            .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"))
            .env("TOFFLOAD_REROUTE_OUT", paths::results().join("reroute.md"))
            .env("TOFFLOAD_REROUTE_ROUNDS", rounds.to_string()),
    )
}
