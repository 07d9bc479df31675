//! `cargo xtask gpu-check`: the cuda backend on a GPU machine, in one command that
//! finishes in a few minutes, writing tests/results/cuda.md:
//! 1. the device: correctness against CPU AES from 4 KiB to 8 MiB, single-op latency
//!    at the paper's Table 2 sizes, throughput as ops in flight grow
//!    (backends/benches/cuda.rs);
//! 2. conn_server with TOFFLOAD_BACKEND=cuda at 64 connections under toffload-load:
//!    stock (spin and block waits) and under the runtime (LD_PRELOAD libtoffload.so).
//!
//! On a machine without a GPU it stops at step 0 (a probe of the driver, the device
//! and NVRTC), with the reason, before building or measuring anything else.
//! `--rehearse` runs the whole check on the fake driver (backends/tests/c/fake_cuda.c)
//! instead, to test this script where there is no GPU.
//!
//! Where the GPU machine has no Rust toolchain: `cargo xtask gpu-check --build-only`
//! here puts everything (this xtask included) in target/toffload; there, from the
//! repository root, `target/toffload/bin/xtask gpu-check --prebuilt`.

use crate::paths;
use crate::proc::{self, Result};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// Use the binaries already in target/toffload (built by --build-only), with the
    /// current directory as the repository root; build nothing.
    #[arg(long)]
    prebuilt: bool,
    /// Build everything the check needs into target/toffload, then stop.
    #[arg(long, conflicts_with = "prebuilt")]
    build_only: bool,
    /// Measured seconds per server run.
    #[arg(long, default_value_t = 3.0)]
    secs: f64,
    /// Seconds per device-benchmark point.
    #[arg(long, default_value_t = 0.3)]
    bench_secs: f64,
    /// Request sizes for the server runs, bytes.
    #[arg(long, value_delimiter = ',', default_values_t = [4096usize, 65536, 1048576])]
    sizes: Vec<usize>,
    /// Connections for the server runs.
    #[arg(long, default_value_t = 64)]
    conns: usize,
    /// Rehearsal without a GPU: the whole check on the fake CUDA driver of
    /// backends/tests/c/fake_cuda.c (CPU AES behind the driver API), writing
    /// target/toffload/gpu-check-rehearsal.md instead of the results file. Checks this
    /// script end to end; its numbers mean nothing.
    #[arg(long, conflicts_with_all = ["prebuilt", "build_only"])]
    rehearse: bool,
}

const BENCH_BIN: &str = "toffload-cuda-bench";
/// What --prebuilt needs from target/toffload.
const CARRY: &[&str] = &[
    "bin/xtask",
    "bin/toffload-cuda-bench",
    "bin/conn_server",
    "bin/toffload-load",
    "lib/libtoffload_accel.so",
    "lib/libtoffload.so",
];

pub fn run(a: &Args) -> Result {
    let t0 = Instant::now();
    let root = if a.prebuilt {
        std::env::current_dir().map_err(|e| e.to_string())?
    } else {
        paths::root()
    };
    let dist = if a.prebuilt {
        root.join("target/toffload")
    } else {
        paths::dist()
    };
    let bench = dist.join("bin").join(BENCH_BIN);
    if a.rehearse {
        use_fake_driver(&dist)?;
    } else {
        add_nvrtc_to_library_path();
    }
    if !a.prebuilt {
        build_bench(&bench)?;
    }
    if !bench.exists() {
        return Err(format!(
            "{} is missing: run `cargo xtask gpu-check --build-only` first",
            bench.display()
        ));
    }
    // Fail fast: no driver or no device stops the check here, with the reason.
    let probe = Command::new(&bench)
        .arg("--probe")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bench.display()))?;
    let device = String::from_utf8_lossy(&probe.stdout).trim().to_string();
    if !probe.status.success() {
        if a.build_only {
            eprintln!(
                "xtask: (no GPU here: {})",
                String::from_utf8_lossy(&probe.stderr).trim()
            );
        } else {
            return Err(format!(
                "gpu-check needs a CUDA GPU: {}",
                String::from_utf8_lossy(&probe.stderr).trim()
            ));
        }
    } else {
        eprintln!("xtask: {device}");
    }
    if !a.prebuilt {
        crate::build::all()?;
    }
    if a.build_only {
        let me = std::env::current_exe().map_err(|e| e.to_string())?;
        install(&me, &dist.join("bin").join("xtask"))?;
        // What travels to a GPU machine must be small: drop the debug info.
        for f in CARRY {
            let p = dist.join(f);
            if p.is_file() {
                let _ = Command::new("strip").arg("--strip-debug").arg(&p).status();
            }
        }
        eprintln!(
            "xtask: built; carry {} and run `target/toffload/bin/xtask gpu-check --prebuilt` from the repository root",
            CARRY
                .iter()
                .map(|f| format!("target/toffload/{f}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        return Ok(());
    }

    let mut md = String::new();
    if a.rehearse {
        md.push_str("# REHEARSAL on the fake CUDA driver: these numbers mean nothing\n\n");
    }
    let _ = writeln!(
        md,
        "# cuda backend on a GPU\n\n`cargo xtask gpu-check` on {} ({} CPUs), {device}.\n",
        hostname(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    eprintln!("xtask: device benchmark");
    let section = std::env::temp_dir().join(format!("toffload-cuda-{}.md", std::process::id()));
    let status = Command::new(&bench)
        .arg("--out")
        .arg(&section)
        .arg("--secs")
        .arg(a.bench_secs.to_string())
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run {}: {e}", bench.display()))?;
    let dev_md = std::fs::read_to_string(&section).unwrap_or_default();
    let _ = std::fs::remove_file(&section);
    md.push_str(&dev_md);
    let device_ok = status.success();

    eprintln!("xtask: conn_server under load");
    let servers_ok = servers(a, &dist, "cuda", &mut md)?;
    let _ = writeln!(
        md,
        "Not part of this check: toffload-watch on libcuda's synchronize calls, and remote CUDA (backends/cuda-remote/gpu_remote.sh, tests/results/remote-cuda.md).\n\nWhole check: {:.0} s.",
        t0.elapsed().as_secs_f64()
    );

    let out = if a.rehearse {
        dist.join("gpu-check-rehearsal.md")
    } else {
        root.join("tests/results/cuda.md")
    };
    if let Some(d) = out.parent() {
        let _ = std::fs::create_dir_all(d);
    }
    std::fs::write(&out, &md).map_err(|e| format!("writing {}: {e}", out.display()))?;
    println!("{md}");
    eprintln!("xtask: wrote {}", out.display());
    match (device_ok, servers_ok) {
        (true, true) => Ok(()),
        (false, _) => Err("the device benchmark found wrong answers or failed".into()),
        (_, false) => Err("a server run had wrong answers or errors".into()),
    }
}

/// Builds the device benchmark and installs it as dist/bin/toffload-cuda-bench.
fn build_bench(dest: &Path) -> Result {
    let mut cmd = proc::cargo();
    cmd.args([
        "bench",
        "-p",
        "toffload-accel",
        "--bench",
        "cuda",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    eprintln!("+ {}", proc::describe(&cmd));
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err("building the cuda benchmark failed".into());
    }
    let exe = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"]["name"] == "cuda")
        .find_map(|v| v["executable"].as_str().map(PathBuf::from))
        .ok_or("cargo did not report the cuda benchmark's executable")?;
    if let Some(d) = dest.parent() {
        std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
    }
    install(&exe, dest)
}

fn install(src: &Path, dest: &Path) -> Result {
    let tmp = dest.with_extension("tmp");
    std::fs::copy(src, &tmp).map_err(|e| format!("copying {}: {e}", src.display()))?;
    std::fs::rename(&tmp, dest).map_err(|e| format!("installing {}: {e}", dest.display()))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "this machine".into())
}

struct Run {
    label: &'static str,
    env: Vec<(&'static str, String)>,
}

/// conn_server on CPU 0, toffload-load on CPU 1 (the demo's layout: the runtime's one
/// carrier and the stock server get the same core), every answer verified.
fn servers(
    a: &Args,
    dist: &Path,
    backend: &str,
    md: &mut String,
) -> std::result::Result<bool, String> {
    let preload = dist.join("lib/libtoffload.so");
    let runs = [
        Run {
            label: "stock, spin wait",
            env: vec![("TOFFLOAD_WAIT", "spin".into())],
        },
        Run {
            label: "stock, block wait",
            env: vec![("TOFFLOAD_WAIT", "block".into())],
        },
        Run {
            label: "runtime (LD_PRELOAD, 1 carrier)",
            env: vec![("LD_PRELOAD", preload.display().to_string())],
        },
    ];
    let pin = proc::succeeds("taskset", &["-c", "0", "true"]);
    let _ = writeln!(
        md,
        "## conn_server, TOFFLOAD_BACKEND={backend}, {} connections\n",
        a.conns
    );
    let _ = writeln!(
        md,
        "Closed loop, {:.0} s measured after 1 s of warm-up; {}. Every answer checked against AES-CTR by toffload-load.\n",
        a.secs,
        if pin {
            "server pinned to CPU 0, load generator to CPU 1"
        } else {
            "unpinned (no taskset)"
        }
    );
    let _ = writeln!(
        md,
        "| size | server | req/s | p50 us | p99 us | wrong | errors | vs stock spin |"
    );
    let _ = writeln!(md, "|---:|---|---:|---:|---:|---:|---:|---:|");
    let mut ok = true;
    for &size in &a.sizes {
        let mut base = None;
        for r in &runs {
            let res = one_run(a, dist, backend, size, r, pin);
            match res {
                Ok(rep) => {
                    let rps = rep["requests_per_sec"].as_f64().unwrap_or(0.0);
                    let wrong = rep["wrong"].as_u64().unwrap_or(u64::MAX);
                    let errors = rep["errors"].as_u64().unwrap_or(u64::MAX);
                    ok &= wrong == 0 && errors == 0;
                    let b = *base.get_or_insert(rps);
                    let ratio = if b > 0.0 {
                        format!("{:.2}x", rps / b)
                    } else {
                        "-".into()
                    };
                    let _ = writeln!(
                        md,
                        "| {size} | {} | {rps:.0} | {:.0} | {:.0} | {wrong} | {errors} | {ratio} |",
                        r.label,
                        rep["p50_us"].as_f64().unwrap_or(0.0),
                        rep["p99_us"].as_f64().unwrap_or(0.0),
                    );
                }
                Err(e) => {
                    ok = false;
                    let _ = writeln!(md, "| {size} | {} | failed: {e} | | | | | |", r.label);
                }
            }
            eprint!(".");
        }
    }
    eprintln!();
    let _ = writeln!(md);
    Ok(ok)
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn one_run(
    a: &Args,
    dist: &Path,
    backend: &str,
    size: usize,
    r: &Run,
    pin: bool,
) -> std::result::Result<serde_json::Value, String> {
    let bin = dist.join("bin");
    let mut server = if pin {
        let mut c = Command::new("taskset");
        c.args(["-c", "0"]).arg(bin.join("conn_server"));
        c
    } else {
        Command::new(bin.join("conn_server"))
    };
    server
        .args(["--port", "0", "--size", &size.to_string()])
        .env("TOFFLOAD_BACKEND", backend)
        .envs(r.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = Killed(server.spawn().map_err(|e| format!("conn_server: {e}"))?);
    let stdout = child.0.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            if let Some(p) = line.strip_prefix("READY port=") {
                let _ = tx.send(p.trim().parse::<u16>().ok());
            }
        }
    });
    let port = rx
        .recv_timeout(Duration::from_secs(30))
        .ok()
        .flatten()
        .ok_or("conn_server did not print READY port=N within 30 s")?;
    let mut load = if pin {
        let mut c = Command::new("taskset");
        c.args(["-c", "1"]).arg(bin.join("toffload-load"));
        c
    } else {
        Command::new(bin.join("toffload-load"))
    };
    let out = load
        .args(["--port", &port.to_string(), "--size", &size.to_string()])
        .args(["--conns", &a.conns.to_string()])
        .args([
            "--duration",
            &format!("{}s", a.secs),
            "--warmup",
            "1s",
            "--json",
        ])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("toffload-load: {e}"))?;
    drop(child);
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim()).map_err(|_| {
        format!(
            "toffload-load exited {} without a report",
            out.status.code().unwrap_or(-1)
        )
    })
}

/// Builds the fake driver into dist/fake-cuda as libcuda.so and libnvrtc.so and puts
/// it first on LD_LIBRARY_PATH for everything this check starts.
fn use_fake_driver(dist: &Path) -> Result {
    let dir = dist.join("fake-cuda");
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let lib = dir.join("libfakecuda.so");
    proc::run(
        Command::new("cc")
            .args([
                "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread",
            ])
            .arg("-I")
            .arg(paths::root().join("backends/src/cuda"))
            .arg(paths::root().join("backends/tests/c/fake_cuda.c"))
            .arg("-o")
            .arg(&lib),
    )?;
    for name in ["libcuda.so", "libnvrtc.so"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("libfakecuda.so", &link).map_err(|e| e.to_string())?;
    }
    eprintln!(
        "xtask: REHEARSAL on the fake CUDA driver in {}",
        dir.display()
    );
    // Single-threaded here: nothing else reads the environment concurrently.
    std::env::set_var("LD_LIBRARY_PATH", &dir);
    Ok(())
}

/// NVRTC ships with the CUDA toolkit or as a Python wheel (nvidia-cuda-nvrtc), often in
/// a folder the dynamic loader does not search: add the usual ones that hold it to
/// LD_LIBRARY_PATH for everything this check starts.
fn add_nvrtc_to_library_path() {
    let mut roots: Vec<PathBuf> = vec![
        "/usr/local/cuda/lib64".into(),
        "/usr/local/cuda/targets/x86_64-linux/lib".into(),
    ];
    let subdirs = |p: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(p)
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default()
    };
    // Toolkits installed side by side: /usr/local/cuda-13.0/lib64, ...
    for d in subdirs(Path::new("/usr/local")) {
        if d.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("cuda-"))
        {
            roots.push(d.join("lib64"));
        }
    }
    // Python wheels: <prefix>/lib/python3.X/{site,dist}-packages/nvidia/*/lib.
    for prefix in ["/opt/torch/.venv/lib", "/usr/local/lib", "/usr/lib"] {
        for py in subdirs(Path::new(prefix)) {
            if !py
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
            {
                continue;
            }
            for pk in ["site-packages", "dist-packages"] {
                for d in subdirs(&py.join(pk).join("nvidia")) {
                    roots.push(d.join("lib"));
                }
            }
        }
    }
    let has_nvrtc = |d: &Path| {
        subdirs(d).iter().any(|f| {
            f.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libnvrtc.so"))
        })
    };
    let found: Vec<String> = roots
        .iter()
        .filter(|d| has_nvrtc(d))
        .map(|d| d.display().to_string())
        .collect();
    if found.is_empty() {
        return;
    }
    let mut path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    for d in &found {
        if !path.is_empty() {
            path.push(':');
        }
        path.push_str(d);
    }
    eprintln!("xtask: NVRTC found in {}", found.join(", "));
    // Single-threaded here: nothing else reads the environment concurrently.
    std::env::set_var("LD_LIBRARY_PATH", path);
}
