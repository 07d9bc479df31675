//! The cuda backend on a real GPU: correctness against CPU AES (OpenSSL) from 4 KiB
//! to 8 MiB, single-op latency per size (the paper's Table 2 sizes), and throughput as
//! operations in flight grow. The device half of `cargo xtask gpu-check`, which runs
//! it and adds the server half; writes a Markdown section to --out.
//!
//! Exit status: 0 all correct, 1 a wrong answer or failed op, 2 no usable GPU (with
//! the reason on stderr, at once).

use std::fmt::Write as _;
use std::time::{Duration, Instant};
use toffload_accel::cuda::{check_device, Cuda, CudaConfig};
use toffload_accel::emulated::aes::aes_ctr_in_place;
use toffload_accel::{Accelerator, OpId, OpState, WaitStyle};

const KIB: usize = 1024;
/// The paper's Table 2: size, GPU latency us, its reported speedup.
const TABLE2: &[(usize, f64)] = &[
    (4 * KIB, 46.4),
    (16 * KIB, 51.4),
    (64 * KIB, 70.2),
    (256 * KIB, 126.5),
    (1024 * KIB, 361.6),
    (2048 * KIB, 653.6),
    (4096 * KIB, 1188.1),
    (8192 * KIB, 2258.6),
];

struct Args {
    out: Option<String>,
    probe: bool,
    secs: f64,
}

fn parse_args() -> Args {
    let mut a = Args {
        out: None,
        probe: false,
        secs: 0.3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--out" => a.out = it.next(),
            "--probe" => a.probe = true,
            "--secs" => {
                a.secs = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| die("--secs: seconds per point"))
            }
            "--bench" => {} // cargo bench passes this
            "--help" | "-h" => {
                println!("cuda bench: [--probe] [--out FILE] [--secs S(0.3)]");
                std::process::exit(0);
            }
            other => die(&format!("unknown flag {other}")),
        }
    }
    a
}

fn die(msg: &str) -> ! {
    eprintln!("cuda bench: {msg}");
    std::process::exit(2)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn size_name(n: usize) -> String {
    if n >= 1 << 20 && n.trailing_zeros() >= 20 {
        format!("{}M", n >> 20)
    } else if n >= KIB && n.trailing_zeros() >= 10 {
        format!("{}K", n / KIB)
    } else {
        format!("{n}")
    }
}

/// xorshift: deterministic test data without a dependency.
fn fill(buf: &mut [u8], mut seed: u64) {
    for b in buf.iter_mut() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        *b = seed as u8;
    }
}

/// Every size, both wait styles, plus a batch of mixed sizes in flight at once.
fn correctness(dev: &Cuda, md: &mut String) -> bool {
    let mut ok = true;
    let _ = writeln!(md, "## Correctness against CPU AES-128-CTR (OpenSSL)\n");
    let _ = writeln!(md, "| size | spin wait | block wait | round trip |");
    let _ = writeln!(md, "|---:|---|---|---|");
    let mut sizes: Vec<usize> = TABLE2.iter().map(|t| t.0).collect();
    sizes.extend([4 * KIB + 1, (1 << 20) + 5, 8 * (1 << 20) - 3]);
    for &n in &sizes {
        let mut input = vec![0u8; n];
        fill(&mut input, n as u64 + 1);
        let mut want = input.clone();
        aes_ctr_in_place(&mut want);
        let mut a = input.clone();
        let spin = dev.run(&mut a, WaitStyle::Spin).is_ok() && a == want;
        let mut b = input.clone();
        let block = dev.run(&mut b, WaitStyle::Block).is_ok() && b == want;
        let back = dev.run(&mut b, WaitStyle::Block).is_ok() && b == input;
        let v = |x: bool| if x { "ok" } else { "WRONG" };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} |",
            size_name(n),
            v(spin),
            v(block),
            v(back)
        );
        ok &= spin && block && back;
    }
    // 64 ops of mixed sizes in flight together, completed out of order.
    let mut bufs: Vec<Vec<u8>> = (0..64)
        .map(|i| {
            let mut v = vec![0u8; TABLE2[i % TABLE2.len()].0 / (1 + i % 3)];
            fill(&mut v, 1000 + i as u64);
            v
        })
        .collect();
    let wants: Vec<Vec<u8>> = bufs
        .iter()
        .map(|b| {
            let mut w = b.clone();
            aes_ctr_in_place(&mut w);
            w
        })
        .collect();
    let ids: Vec<_> = bufs
        .iter_mut()
        // SAFETY: each buffer stays alive and untouched until its op is released below.
        .map(|b| unsafe { dev.submit(b.as_mut_ptr(), b.len()) })
        .collect();
    let mut batch_ok = ids.iter().all(|r| r.is_ok());
    for id in ids.iter().rev().flatten() {
        batch_ok &= dev.wait(*id).is_ok();
        batch_ok &= dev.release(*id).is_ok();
    }
    batch_ok &= bufs.iter().zip(&wants).all(|(b, w)| b == w);
    let _ = writeln!(
        md,
        "\n64 operations of mixed sizes in flight at once, waited in reverse order: {}\n",
        if batch_ok { "all correct" } else { "WRONG" }
    );
    ok && batch_ok
}

/// One op at a time; completion seen by spinning on accel_done (cuEventQuery), by
/// cuEventSynchronize (blocking wait), and by poll() on the completion fd.
fn latency(dev: &Cuda, secs: f64, md: &mut String) {
    let _ = writeln!(md, "## Single-operation latency (one in flight)\n");
    let _ = writeln!(
        md,
        "Submit to done, including the copies through pinned memory on both sides. `spin`: polling accel_done (cuEventQuery); `block`: cuEventSynchronize on a blocking-sync event; `fd`: poll() on the completion fd (host callback), then accel_done.\n"
    );
    let _ = writeln!(
        md,
        "| size | spin p50 us | spin p99 us | block p50 us | fd p50 us | GB/s (spin p50) | paper's GPU us |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|");
    let fd = dev.completion_fd();
    for &(n, paper) in TABLE2 {
        let mut buf = vec![0u8; n];
        fill(&mut buf, 7);
        let mut modes = [vec![], vec![], vec![]];
        for (m, lats) in modes.iter_mut().enumerate() {
            let end = Instant::now() + Duration::from_secs_f64(secs);
            // Warm the lane (its buffers grow on first use).
            dev.run(&mut buf, WaitStyle::Block).unwrap();
            while Instant::now() < end || lats.len() < 20 {
                drain(fd);
                let t = Instant::now();
                // SAFETY: buf stays alive and untouched until the op is released below.
                let id = unsafe { dev.submit(buf.as_mut_ptr(), n) }.unwrap();
                match m {
                    0 => spin(dev, id),
                    1 => dev.wait(id).unwrap(),
                    _ => {
                        let mut p = libc::pollfd {
                            fd,
                            events: libc::POLLIN,
                            revents: 0,
                        };
                        // SAFETY: a local pollfd.
                        unsafe { libc::poll(&mut p, 1, 10_000) };
                        spin(dev, id);
                    }
                }
                lats.push(t.elapsed().as_secs_f64() * 1e6);
                dev.release(id).unwrap();
            }
        }
        let p50 = pct(&mut modes[0], 0.5);
        let _ = writeln!(
            md,
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} |",
            size_name(n),
            p50,
            pct(&mut modes[0], 0.99),
            pct(&mut modes[1], 0.5),
            pct(&mut modes[2], 0.5),
            n as f64 / p50 / 1e3,
            paper
        );
        eprint!(".");
    }
    let _ = writeln!(md);
}

fn drain(fd: i32) {
    let mut v = 0u64;
    // SAFETY: 8 bytes into a local u64.
    unsafe { libc::read(fd, &mut v as *mut u64 as *mut libc::c_void, 8) };
}

fn spin(dev: &Cuda, id: OpId) {
    while dev.done(id).unwrap() == OpState::Pending {
        std::hint::spin_loop();
    }
}

/// `k` ops kept in flight by one thread that spins over their handles.
fn throughput(dev: &Cuda, secs: f64, md: &mut String) {
    let _ = writeln!(md, "## Throughput as operations in flight grow\n");
    let _ = writeln!(
        md,
        "One client thread keeps k operations in flight, polling them with accel_done and resubmitting each as it completes ({} streams).\n",
        dev.config().streams
    );
    let _ = writeln!(md, "| size | in flight | ops/s | GB/s | p50 us |");
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|");
    for &n in &[4 * KIB, 64 * KIB, 1 << 20] {
        for k in [1usize, 2, 4, 8, 16, 32, 64, 128, 256] {
            let mut bufs: Vec<Vec<u8>> = (0..k).map(|_| vec![3u8; n]).collect();
            let mut ops: Vec<(OpId, Instant)> = bufs
                .iter_mut()
                .map(|b| {
                    (
                        // SAFETY: each buffer stays alive and untouched until its op is
                        // released below.
                        unsafe { dev.submit(b.as_mut_ptr(), n) }.unwrap(),
                        Instant::now(),
                    )
                })
                .collect();
            let mut lats = Vec::new();
            let start = Instant::now();
            let end = start + Duration::from_secs_f64(secs);
            while Instant::now() < end {
                for (i, op) in ops.iter_mut().enumerate() {
                    if dev.done(op.0).unwrap() == OpState::Done {
                        lats.push(op.1.elapsed().as_secs_f64() * 1e6);
                        dev.release(op.0).unwrap();
                        *op = (
                            // SAFETY: bufs[i] stays alive and untouched until this op is
                            // released.
                            unsafe { dev.submit(bufs[i].as_mut_ptr(), n) }.unwrap(),
                            Instant::now(),
                        );
                    }
                }
            }
            let wall = start.elapsed().as_secs_f64();
            for op in ops {
                dev.wait(op.0).unwrap();
                dev.release(op.0).unwrap();
            }
            let rate = lats.len() as f64 / wall;
            let _ = writeln!(
                md,
                "| {} | {k} | {:.0} | {:.2} | {:.1} |",
                size_name(n),
                rate,
                rate * n as f64 / 1e9,
                if lats.is_empty() {
                    0.0
                } else {
                    pct(&mut lats, 0.5)
                }
            );
            eprint!(".");
        }
    }
    let _ = writeln!(md);
}

fn main() {
    let a = parse_args();
    let cfg = CudaConfig::from_env().unwrap_or_else(|e| die(&e.to_string()));
    // Fail fast on a machine without a GPU, with the driver's or loader's reason.
    let info = check_device(&cfg).unwrap_or_else(|e| die(&format!("no usable CUDA device: {e}")));
    // The kernel is compiled at run time: NVRTC is as necessary as the driver.
    toffload_accel::cuda::driver::probe_nvrtc().unwrap_or_else(|e| die(&e.to_string()));
    if a.probe {
        println!(
            "CUDA device {}: {} (compute {}.{}, driver {}.{})",
            info.ordinal,
            info.name,
            info.cc.0,
            info.cc.1,
            info.driver_version / 1000,
            info.driver_version % 1000 / 10
        );
        return;
    }
    let t = Instant::now();
    let dev =
        Cuda::new(cfg).unwrap_or_else(|e| die(&format!("cannot start the cuda backend: {e}")));
    let startup = t.elapsed();
    let mut md = String::new();
    let _ = writeln!(
        md,
        "Device {}: {} (compute capability {}.{}, {} device(s)), driver API {}.{}; backend start (context + NVRTC compile) {:.0} ms.\n",
        info.ordinal,
        info.name,
        info.cc.0,
        info.cc.1,
        info.count,
        info.driver_version / 1000,
        info.driver_version % 1000 / 10,
        startup.as_secs_f64() * 1e3
    );
    let ok = correctness(&dev, &mut md);
    latency(&dev, a.secs, &mut md);
    throughput(&dev, a.secs, &mut md);
    eprintln!();
    print!("{md}");
    if let Some(out) = a.out {
        std::fs::write(&out, &md).unwrap_or_else(|e| die(&format!("writing {out}: {e}")));
    }
    if !ok {
        eprintln!("cuda bench: WRONG ANSWERS (see the correctness table)");
        std::process::exit(1);
    }
}
