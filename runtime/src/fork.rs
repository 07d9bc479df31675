//! fork(): the child has only the thread that called fork. Our tables may hold locks
//! taken by threads that vanished and records of fibers that do not exist there, so
//! the child forgets them; if the forking thread was a carrier running a fiber, that
//! carrier is reset in place and keeps running it, and new fibers get new carriers.

use std::sync::atomic::Ordering::Relaxed;

extern "C" fn in_child() {
    if !crate::active() || crate::settings().disabled.fork {
        return;
    }
    // SAFETY: we are the only thread of the child.
    unsafe {
        #[cfg(feature = "preload")]
        crate::ALLOC.after_fork_child();
        crate::stack::after_fork_child();
        crate::keys::after_fork_child();
        crate::sync::after_fork_child();
        crate::thread::after_fork_child();
        crate::handoff::after_fork_child();
        crate::carrier::after_fork_child();
    }
    crate::offload::after_fork_child();
    crate::guard::after_fork_child();
    crate::stats::COUNTERS
        .carriers
        .store(crate::carrier::all().len(), Relaxed);
    crate::log_at!(
        crate::log::INFO,
        "forked: carriers re-established in the child"
    );
}

pub fn install() {
    // SAFETY: registering a plain extern "C" handler.
    unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
}
