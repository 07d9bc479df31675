//! The remote backend: ops run on `toffload-remoted` daemons over TCP (optionally
//! TLS: client certificates or pre-shared keys). See README.md, "The remote backend".

pub mod cache;
pub mod chunk;
pub mod cli;
pub mod client;
pub mod config;
pub mod conn;
pub mod cuda_ctx;
pub mod cuda_exec;
pub mod cuda_wire;
pub mod daemon;
pub mod exec;
pub mod files;
pub mod frame;
pub mod identity;
pub mod journal;
pub mod limits;
pub mod startup;
pub mod state;
pub mod tls;
pub mod tls_client;

pub use client::{query_stats, ClientCounters, Remote};
pub use config::{Placement, RemoteConfig};
pub use frame::OpKind;
