//! The binary layouts that cross a boundary between toffload's parts, defined once:
//! the kernel side (ebpf/, bpfel-unknown-none) and the watcher (userspace/) share the
//! maps' value types, counter indices and histogram geometry; the fiber runtime
//! (runtime/) and the watcher share the counters block the runtime exports.
//!
//! no_std and without dependencies in the kernel build, as aya's project template
//! does with its `-common` crate; the `user` feature adds aya's `Pod` impls for the
//! watcher.

#![cfg_attr(not(test), no_std)]

pub mod hist;
// The runtime's block is atomics for a host process; the kernel side never sees it.
#[cfg(not(target_arch = "bpf"))]
pub mod runtime;
// Names read from /proc by the watcher; the kernel side never needs them.
#[cfg(not(target_arch = "bpf"))]
pub mod threads;
pub mod watch;
