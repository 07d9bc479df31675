//! Charts of the benchmarks' results: each benchmark's module reads what the bench
//! wrote under tests/results/ and builds a Chart (plot.rs), which render.rs draws as an
//! SVG beside it. `cargo xtask bench X` draws X's chart after the run; `cargo xtask
//! charts` redraws them all from the results in the tree.

mod demo;
mod device;
mod guard;
mod model;
mod openloop;
pub mod plot;
mod remote;
mod remote_cuda;
pub mod render;
mod runtime;
mod serve;
pub mod table;
mod watch;

#[cfg(test)]
mod tests;

use crate::paths;
use crate::proc::Result;

/// The benchmarks that have a chart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bench {
    Demo,
    Device,
    Runtime,
    Openloop,
    Model,
    Guard,
    Watch,
    Remote,
    Serve,
    RemoteCuda,
}

impl Bench {
    pub const ALL: [Bench; 10] = [
        Bench::Demo,
        Bench::Device,
        Bench::Runtime,
        Bench::Openloop,
        Bench::Model,
        Bench::Guard,
        Bench::Watch,
        Bench::Remote,
        Bench::Serve,
        Bench::RemoteCuda,
    ];

    /// The results file the chart is drawn from.
    pub fn source(self) -> &'static str {
        match self {
            Bench::Demo => "demo.md",
            Bench::Device => "device.md",
            Bench::Runtime => "runtime.md",
            Bench::Openloop => "openloop.csv",
            Bench::Model => "model.md",
            Bench::Guard => "guard.md",
            Bench::Watch => "watch.md",
            Bench::Remote => "remote.md",
            Bench::Serve => "serve.md",
            Bench::RemoteCuda => "remote-cuda-bench.md",
        }
    }

    pub fn svg_name(self) -> &'static str {
        match self {
            Bench::Demo => "demo.svg",
            Bench::Device => "device.svg",
            Bench::Runtime => "runtime.svg",
            Bench::Openloop => "openloop.svg",
            Bench::Model => "model.svg",
            Bench::Guard => "guard.svg",
            Bench::Watch => "watch.svg",
            Bench::Remote => "remote.svg",
            Bench::Serve => "serve.svg",
            Bench::RemoteCuda => "remote-cuda-bench.svg",
        }
    }

    pub fn chart(self, source: &str) -> Result<plot::Chart> {
        match self {
            Bench::Demo => demo::chart(source),
            Bench::Device => device::chart(source),
            Bench::Runtime => runtime::chart(source),
            Bench::Openloop => openloop::chart(source),
            Bench::Model => model::chart(source),
            Bench::Guard => guard::chart(source),
            Bench::Watch => watch::chart(source),
            Bench::Remote => remote::chart(source),
            Bench::Serve => serve::chart(source),
            Bench::RemoteCuda => remote_cuda::chart(source),
        }
    }
}

/// Draws one benchmark's chart from its results file into tests/results/.
pub fn draw(b: Bench) -> Result {
    let src = paths::results().join(b.source());
    let text = std::fs::read_to_string(&src).map_err(|e| format!("{}: {e}", src.display()))?;
    let chart = b
        .chart(&text)
        .map_err(|e| format!("{}: {e}", src.display()))?;
    let out = paths::results().join(b.svg_name());
    std::fs::write(&out, render::svg(&chart)?).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("xtask: drew {}", out.display());
    Ok(())
}

/// Every chart whose results file is there.
pub fn draw_all() -> Result {
    for b in Bench::ALL {
        draw(b)?;
    }
    Ok(())
}
