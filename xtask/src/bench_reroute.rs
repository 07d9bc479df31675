//! `cargo xtask bench reroute`: the minimal-edit reroutes at 50, 200 and 1000 us.
//! Redis: ACCEL.SYNC vs ACCEL.ASYNC of toffload_redis.so in Debian's redis-server
//! under redis-benchmark -> tests/results/reroute.md (the `reroute_benchmark` test of
//! tests/tests/reroute_redis.rs, which compiles the module itself). Python asyncio:
//! /sync vs /async of toffload_asyncio.py under wrk -> tests/results/reroute-python.md
//! (`reroute_python_benchmark` in tests/tests/reroute_python.rs). Go: /serial, /sync
//! and /async of accelhttp under wrk -> tests/results/reroute-go.md
//! (`reroute_go_benchmark` in tests/tests/reroute_go.rs). nginx: sync vs async of
//! ngx_http_toffload_module.so in Debian's nginx under wrk ->
//! tests/results/reroute-nginx.md (`reroute_nginx_benchmark`). Without the server
//! or its load tool a bench skips with the reason (fails under CI).

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
    for (test, name) in [
        ("reroute_redis", "reroute_benchmark"),
        ("reroute_python", "reroute_python_benchmark"),
        ("reroute_go", "reroute_go_benchmark"),
        ("reroute_nginx", "reroute_nginx_benchmark"),
    ] {
        proc::run(
            proc::cargo()
                .args(["test", "--release", "-p", "toffload-tests", "--test", test])
                .args(["--", "--exact", name, "--nocapture"])
                .env("TOFFLOAD_DIST", dist.bin.parent().expect("dist"))
                .env("TOFFLOAD_REROUTE_OUT", paths::results().join("reroute.md"))
                .env("TOFFLOAD_REROUTE_ROUNDS", rounds.to_string()),
        )?;
    }
    Ok(())
}
