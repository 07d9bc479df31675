//! The kernel side's layouts (map sizes, counter indices, ThreadInfo, Site, the
//! histogram geometry): toffload-abi's, which ebpf/ builds with too.

pub use toffload_abi::hist::{fine_bounds, fine_bucket, log2_bounds};
pub use toffload_abi::watch::*;
