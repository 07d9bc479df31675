//! libcuda.so.1 for a GPU elsewhere: a stand-in for the CUDA driver API that an
//! unmodified program loads (first on LD_LIBRARY_PATH, or LD_PRELOAD) and that runs
//! its driver calls on a `toffload-remoted` (TOFFLOAD_CUDA_REMOTE=host:port) with
//! Gleam's techniques: handles simulated here, calls that return nothing the program
//! needs batched into frames without waiting, large uploads sent once by content
//! hash. See docs/remote-cuda.md.
//!
//! api.rs: the exported driver functions; remote.rs: the connection and the
//! simulated state; replay.rs and guard.rs: the context consistency guardian (the
//! session's journal, and its replay on another connection after a loss); sched.rs:
//! placement; mover.rs: moving a running task to a daemon that became the better one. The frame layout and the calls' encoding are the daemon's own
//! files, included by path (std only), so the two sides cannot drift apart.

// The driver API's names and its C types.
#![allow(non_snake_case, clippy::missing_safety_doc)]

#[path = "../../src/remote/frame.rs"]
#[allow(dead_code)]
mod frame;

#[path = "../../src/remote/cuda_wire.rs"]
#[allow(dead_code)]
mod wire;

#[path = "../../src/knobs.rs"]
#[allow(dead_code)]
mod knobs;

#[path = "../../src/remote/tls_client.rs"]
#[allow(dead_code)]
mod tls_client;

mod api;
mod guard;
mod link;
mod mover;
mod notify;
mod remote;
mod replay;
mod sched;
