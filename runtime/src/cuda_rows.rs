//! The CUDA waits the runtime reroutes without being told: each blocking
//! synchronize and the query that tells its handle is done (the triples are in
//! csrc/cuda_rows.c). toffload-watch compiles this file too (`#[path]`), so the set
//! of GPU waits it calls hideable is this one.

/// A synchronize call on a handle (a stream or an event) and the triple's done
/// function that queries that handle.
pub struct CudaRow {
    pub blocking: &'static str,
    pub done: &'static str,
}

/// Hands the handle (the call's one argument) back: the work is already queued.
pub const SUBMIT: &str = "toffload_cuda_submit";
/// Nothing to free: the handle is the application's.
pub const RELEASE: &str = "toffload_cuda_release";

pub const ROWS: &[CudaRow] = &[
    CudaRow {
        blocking: "cudaStreamSynchronize",
        done: "toffload_cudart_stream_done",
    },
    CudaRow {
        blocking: "cudaEventSynchronize",
        done: "toffload_cudart_event_done",
    },
    CudaRow {
        blocking: "cuStreamSynchronize",
        done: "toffload_cu_stream_done",
    },
    CudaRow {
        blocking: "cuEventSynchronize",
        done: "toffload_cu_event_done",
    },
];

/// True for a CUDA wait the runtime hides (a row above).
pub fn rerouted(symbol: &str) -> bool {
    ROWS.iter().any(|r| r.blocking == symbol)
}
