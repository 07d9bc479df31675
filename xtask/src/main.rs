//! `cargo xtask`: the project's own build, test, benchmark and demo driver.

mod bench;
mod bench_remote;
mod bench_remote_cuda;
mod bench_reroute;
mod build;
mod chart;
mod demo;
mod docs_cover;
mod ebpf;
mod fuzz;
mod gpu_check;
mod install;
#[cfg(test)]
mod install_tests;
mod integrations;
mod manifest;
mod paths;
mod proc;
mod setup;
mod test;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "toffload's build, test, bench and demo driver"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the libraries, the load generator and the C example servers into target/toffload.
    Build,
    /// Build the eBPF programs (ebpf/, nightly), installing rust-src and bpf-linker if missing.
    BuildEbpf,
    /// Build everything and run every test, then the fuzz targets for a bounded time
    /// (the README's test command).
    Test {
        /// Extra arguments passed to `cargo test` after `--`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Only the fuzz targets of backends/fuzz, TOFFLOAD_FUZZ_SECS each (as `test` ends).
    Fuzz,
    /// Run a benchmark and write its table under tests/results/.
    Bench {
        #[command(subcommand)]
        which: bench::Which,
    },
    /// Redraw every benchmark's chart (tests/results/*.svg) from the results in the tree.
    Charts,
    /// The main job on the bundled default: a demo server under load, measured.
    Demo(demo::Args),
    /// Build, then install the binaries, libraries, header, man pages, completions and
    /// systemd units under a prefix (xtask/src/manifest.rs lists them).
    Install(install::Args),
    /// Install the system packages a fresh machine lacks (needs root).
    Setup,
    /// The cuda backend on a GPU: device benchmark and conn_server runs -> tests/results/cuda.md.
    GpuCheck(gpu_check::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Build => build::all().map(|_| ()),
        Cmd::BuildEbpf => ebpf::build(),
        Cmd::Test { args } => test::run(&args),
        Cmd::Fuzz => fuzz::run(test::under_ci()),
        Cmd::Bench { which } => bench::run(which),
        Cmd::Charts => chart::draw_all(),
        Cmd::Demo(args) => demo::run(&args),
        Cmd::Install(args) => install::run(&args),
        Cmd::Setup => setup::system_packages(),
        Cmd::GpuCheck(args) => gpu_check::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
