//! libtoffload.so: the LD_PRELOAD fiber runtime.
//!
//! Loaded into an unmodified, dynamically linked server, it turns connection threads
//! into fibers on a few carrier threads and every blocking point the server reaches
//! through libc into "park this fiber, run another": socket I/O, poll/select, sleeps,
//! pthread locks and condition variables, and the offload table (accel_run and the
//! rows of TOFFLOAD_OFFLOAD), where a blocking offload becomes submit + yield.
//!
//! Layout: `exports` holds the interposed C symbols (feature `preload`) and dispatches
//! to the module that does the work: `io`, `sync`, `keys`, `thread`, `offload` (+
//! `got` for extra rows). Underneath: `fiber` (a fiber and its park/wake protocol),
//! `carrier` (the scheduler: run queues, epoll, deadlines), `stack`, `waitq`. `real`
//! resolves libc's own functions; `config` parses the knobs; `fork` handles children.

pub mod alloc;
pub mod carrier;
pub mod config;
pub mod cuda_rows;
pub mod drain;
pub mod fd_facts;
pub mod fiber;
pub mod fmt_buf;
pub mod fork;
pub mod got;
pub mod guard;
pub mod handoff;
pub mod idle_poll;
pub mod io;
pub mod keys;
pub mod latency;
pub mod log;
pub mod offload;
pub mod real;
pub mod signals;
pub mod spinlock;
pub mod stack;
pub mod stats;
pub mod sync;
pub mod thread;
pub mod thread_dtors;
pub mod time;
pub mod tls;
pub mod waitq;

#[cfg(feature = "preload")]
mod exports;

/// Inside a host process, never its malloc (see alloc.rs).
#[cfg(feature = "preload")]
#[global_allocator]
pub static ALLOC: alloc::Allocator = alloc::Allocator::new();

use config::{Config, Fiberize};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::OnceLock;
use toffload_abi::runtime::RuntimeState;

struct Settings {
    cfg: Config,
    /// False when a knob was malformed or TOFFLOAD_FIBERIZE=off: pass everything through.
    active: bool,
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();
static ENGAGED: AtomicBool = AtomicBool::new(false);

fn load() -> &'static Settings {
    SETTINGS.get_or_init(|| match Config::from_env() {
        Ok(cfg) => {
            log::set_level(cfg.log);
            let active = cfg.fiberize != Fiberize::Off;
            let state = if active {
                RuntimeState::Active
            } else {
                RuntimeState::Disabled
            };
            stats::COUNTERS.state.store(state as usize, Relaxed);
            Settings { cfg, active }
        }
        Err(e) => {
            // The one message we print unasked: the user set something we cannot honour.
            log::line(format_args!(
                "{e}; the runtime stays disabled in this process"
            ));
            stats::COUNTERS
                .state
                .store(RuntimeState::Disabled as usize, Relaxed);
            Settings {
                cfg: Config::default(),
                active: false,
            }
        }
    })
}

/// The knobs (defaults when they were malformed).
#[inline]
pub fn settings() -> &'static Config {
    &load().cfg
}

/// True unless the runtime is disabled in this process.
#[inline]
pub fn active() -> bool {
    load().active
}

/// True once the first fiber exists (never reset, not even in a forked child: objects
/// may already be in our hands).
#[inline]
pub fn engaged() -> bool {
    ENGAGED.load(Relaxed)
}

pub fn engage() {
    if !ENGAGED.swap(true, AcqRel) {
        log_at!(log::INFO, "engaged: first fiber created");
        guard::arm();
    }
}

/// Runs at load.
extern "C" fn on_load() {
    let s = load();
    if !s.active {
        return;
    }
    fork::install();
    fd_facts::set_invalidate(!s.cfg.disabled.fdfacts);
    // Now, while only the objects of the start are loaded.
    tls::init();
    let n = got::patch_extra_rows();
    if n > 0 {
        log_at!(log::INFO, "offload rows: {} GOT slots rerouted", n);
    }
    log_at!(
        log::INFO,
        "loaded: fiberize={:?} carriers={} stack={} KiB",
        s.cfg.fiberize,
        s.cfg.carriers,
        s.cfg.stack_kb
    );
    stats::flush();
}

/// Runs at exit: the final counters.
extern "C" fn on_unload() {
    if SETTINGS.get().is_some_and(|s| s.active) {
        stats::flush();
    }
}

#[cfg(feature = "preload")]
#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;

#[cfg(feature = "preload")]
#[used]
#[link_section = ".fini_array"]
static ON_UNLOAD: extern "C" fn() = on_unload;

#[cfg(not(feature = "preload"))]
#[allow(dead_code)]
fn keep_unused() -> [extern "C" fn(); 2] {
    [on_load, on_unload]
}
