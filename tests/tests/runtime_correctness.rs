//! The fiber runtime's correctness suite (libtoffload.so under LD_PRELOAD).
//!
//! Every case first shows that the hazard is real with the mitigation off (a
//! TOFFLOAD_TEST_DISABLE switch, the stock binary, or a naive interposer built here),
//! then that the runtime removes it, and checks that the code under test really ran
//! on fibers (toffload_fiber_id() in the programs, the runtime's TOFFLOAD_STATS
//! counters for servers): a pass because nothing was fiberized would be worthless.
//! The C programs are tests/programs/rt_*.c (built by `cargo xtask build`); every
//! child runs under a timeout and is killed with its process group past it.

use std::io::Write;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use toffload_tests::harness::{self, ServerSpec};
use toffload_tests::load::{self, Config, Report};
use toffload_tests::preload::{self, Outcome, RtServer, Run, TempDir};

/// One case at a time: they measure timing on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Offload latency of the emulated device in the programs: long enough that the
/// runtime parks rather than waits inline.
const LAT_US: &str = "5000";
/// Bound on a run that should finish (they take well under a second).
const RUN_LIMIT: Duration = Duration::from_secs(10);
/// Bound on a run that is expected to deadlock.
const DEADLOCK_LIMIT: Duration = Duration::from_secs(3);

fn ready(programs: &[&str]) -> bool {
    preload::ready(programs)
}

/// A test program without the runtime.
fn stock(name: &str) -> Run {
    Run::bin(name)
        .unwrap_or_else(|e| panic!("{e}"))
        .env("TOFFLOAD_WAIT", "block")
        .env("TOFFLOAD_EMU_LAT_US", LAT_US)
        .timeout(RUN_LIMIT)
}

/// A test program under the runtime, every thread it creates a fiber.
fn fibers(name: &str) -> Run {
    stock(name).runtime().env("TOFFLOAD_FIBERIZE", "all")
}

/// The same with one mitigation turned off, and the blocked-carrier handoff too (it
/// would rescue a carrier that the hazard blocks: each mitigation is shown alone).
fn hazard(name: &str, disable: &str) -> Run {
    fibers(name).env("TOFFLOAD_TEST_DISABLE", format!("{disable},handoff"))
}

/// Carrier counts every runtime-side check runs with: the default, and several
/// carriers, where fibers and wake-ups cross threads.
const CARRIERS: [&str; 2] = ["1", "3"];

/// Runs `name` under the runtime with each of [`CARRIERS`], checking each run.
fn for_carriers(name: &str, check: impl Fn(&Outcome)) {
    for c in CARRIERS {
        let o = fibers(name).env("TOFFLOAD_CARRIERS", c).run();
        show(&format!("runtime, {c} carrier(s)"), &o);
        check(&o);
    }
}

fn expect_ok(o: &Outcome) {
    assert!(o.ok(), "expected a clean exit: {}", o.report());
}

fn eq(o: &Outcome, key: &str, want: f64) {
    let got = o.num(key);
    assert!(got == want, "{key}={got}, expected {want}: {}", o.report());
}

fn at_least(o: &Outcome, key: &str, min: f64) {
    let got = o.num(key);
    assert!(got >= min, "{key}={got}, expected >= {min}: {}", o.report());
}

fn at_most(o: &Outcome, key: &str, max: f64) {
    let got = o.num(key);
    assert!(got <= max, "{key}={got}, expected <= {max}: {}", o.report());
}

fn between(o: &Outcome, key: &str, lo: f64, hi: f64) {
    let got = o.num(key);
    assert!(
        (lo..=hi).contains(&got),
        "{key}={got}, expected in [{lo}, {hi}]: {}",
        o.report()
    );
}

fn show(label: &str, o: &Outcome) {
    let end = if o.timed_out {
        "TIMED OUT".to_string()
    } else {
        o.status.to_string()
    };
    println!(
        "{label}: {end} in {:.2} s: {}",
        o.elapsed.as_secs_f64(),
        o.stdout.split_whitespace().collect::<Vec<_>>().join(" ")
    );
}

/// A counter from the runtime's stats file (0 when absent).
fn stat(v: &serde_json::Value, key: &str) -> u64 {
    v.get(key).and_then(|x| x.as_u64()).unwrap_or(0)
}

fn read_stats(path: &Path) -> serde_json::Value {
    preload::stats(path).unwrap_or_else(|| {
        panic!(
            "the runtime wrote no readable TOFFLOAD_STATS file at {}: {:?}",
            path.display(),
            std::fs::read_to_string(path)
        )
    })
}

// ---------------------------------------------------------------- per-fiber state

#[test]
fn errno_is_per_fiber() {
    let _s = serial();
    if !ready(&["rt_errno"]) {
        return;
    }
    let o = stock("rt_errno").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "bad", 0.0);

    // Hazard: errno lives in the carrier's TLS, shared by every fiber on it.
    let o = hazard("rt_errno", "errno").run();
    show("TOFFLOAD_TEST_DISABLE=errno", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 16.0);
    at_least(&o, "bad", 1.0);

    let dir = TempDir::new("errno");
    let stats = dir.join("stats.json");
    let o = fibers("rt_errno")
        .env("TOFFLOAD_STATS", stats.display().to_string())
        .run();
    show("runtime", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 16.0);
    eq(&o, "bad", 0.0);
    eq(&o, "foreign", 0.0);
    let st = read_stats(&stats);
    println!("stats: {st}");
    assert_eq!(
        st.get("engaged"),
        Some(&serde_json::Value::Bool(true)),
        "{st}"
    );
    assert!(stat(&st, "fibers_created") >= 16, "{st}");
    assert!(stat(&st, "offloads") >= 16 * 10, "{st}");
    let o = fibers("rt_errno").env("TOFFLOAD_CARRIERS", "3").run();
    show("runtime, 3 carriers", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 16.0);
    eq(&o, "bad", 0.0);
    eq(&o, "foreign", 0.0);
}

#[test]
fn openssl_error_queue_is_per_fiber() {
    let _s = serial();
    if !ready(&["rt_sslerr"]) {
        return;
    }
    let o = stock("rt_sslerr").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "bad", 0.0);

    // Hazard: OpenSSL finds its queue through pthread_getspecific; with keys passed
    // through to glibc every fiber of a carrier shares the carrier's queue.
    let o = hazard("rt_sslerr", "keys").run();
    show("TOFFLOAD_TEST_DISABLE=keys", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 16.0);
    at_least(&o, "bad", 1.0);

    for_carriers("rt_sslerr", |o| {
        expect_ok(o);
        eq(o, "on_fiber", 16.0);
        eq(o, "bad", 0.0);
    });
}

#[test]
fn pthread_keys_are_per_fiber_with_destructors() {
    let _s = serial();
    if !ready(&["rt_keys"]) {
        return;
    }
    let o = stock("rt_keys").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "bad", 0.0);
    eq(&o, "dtor_calls", 16.0);

    // Hazard: glibc keys are per carrier: fibers see each other's values, and
    // destructors only run when a real thread exits (a carrier never does).
    let o = hazard("rt_keys", "keys").run();
    show("TOFFLOAD_TEST_DISABLE=keys", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 16.0);
    assert!(
        o.num("bad") + o.num("initial_bad") > 0.0,
        "fibers did not see each other's values: {}",
        o.report()
    );
    assert!(o.num("dtor_calls") < 16.0, "{}", o.report());

    for_carriers("rt_keys", |o| {
        expect_ok(o);
        eq(o, "on_fiber", 16.0);
        eq(o, "initial_bad", 0.0);
        eq(o, "bad", 0.0);
        eq(o, "dtor_calls", 16.0);
        eq(o, "dtor_bad", 0.0);
    });
    // Many keys (1,002 of glibc's 1,024) in many fibers: no cap of the runtime's own.
    let o = fibers("rt_keys").args(["64", "1000"]).run();
    show("runtime, 64 fibers x 1002 keys", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 64.0);
    eq(&o, "initial_bad", 0.0);
    eq(&o, "bad", 0.0);
    eq(&o, "dtor_calls", 64.0);
}

/// The program's own `__thread` variables (TOFFLOAD_FIBER_TLS): per fiber by default,
/// also across a handoff that moves a fiber to another thread.
#[test]
fn thread_local_storage_is_per_fiber() {
    let _s = serial();
    if !ready(&["rt_tls"]) {
        return;
    }
    let o = stock("rt_tls").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "initial_bad", 0.0);
    eq(&o, "bad", 0.0);

    // Hazard: one block per carrier thread, so a fiber finds the values of the fiber
    // that ran before it (mariadbd's `current_thd`).
    let o = fibers("rt_tls")
        .env("TOFFLOAD_FIBER_TLS", "shared")
        .env("TOFFLOAD_TEST_DISABLE", "handoff")
        .run();
    show("TOFFLOAD_FIBER_TLS=shared", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 16.0);
    assert!(
        o.num("bad") + o.num("initial_bad") > 0.0,
        "fibers did not see each other's thread-locals: {}",
        o.report()
    );

    // The default copies them per fiber.
    for_carriers("rt_tls", |o| {
        expect_ok(o);
        eq(o, "on_fiber", 16.0);
        eq(o, "initial_bad", 0.0);
        eq(o, "bad", 0.0);
    });
    // The raw futex waits block the carrier past the handoff threshold: fibers move
    // to other threads, their values with them.
    let o = fibers("rt_tls")
        .env("TOFFLOAD_FIBER_TLS", "copy")
        .env("TOFFLOAD_HANDOFF_US", "200")
        .run();
    show("copy, handoff at 200 us", &o);
    expect_ok(&o);
    eq(&o, "initial_bad", 0.0);
    eq(&o, "bad", 0.0);
    at_least(&o, "moved", 1.0);
}

/// C++ thread_local destructors (`__cxa_thread_atexit_impl`): run when each fiber ends,
/// on its own object, also after a handoff moved it to another thread.
#[test]
fn cpp_thread_local_destructors_run_when_the_fiber_ends() {
    let _s = serial();
    if !ready(&["rt_tls_dtor"]) {
        return;
    }
    let o = stock("rt_tls_dtor").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "constructed", 16.0);
    eq(&o, "destroyed", 16.0);
    eq(&o, "wrong", 0.0);

    // Hazard: the registrations go to the carrier thread's list in glibc, so no
    // destructor has run when the workers are joined (each connection's buffer kept
    // until the process exits).
    let o = hazard("rt_tls_dtor", "tlsdtors").run();
    show("TOFFLOAD_TEST_DISABLE=tlsdtors", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 16.0);
    eq(&o, "constructed", 16.0);
    eq(&o, "destroyed", 0.0);

    for_carriers("rt_tls_dtor", |o| {
        expect_ok(o);
        eq(o, "on_fiber", 16.0);
        eq(o, "constructed", 16.0);
        eq(o, "destroyed", 16.0);
        eq(o, "wrong", 0.0);
    });
    // Moved by the handoff while their objects live: each destructor still finds its
    // own object, at its place on the thread that ends the fiber.
    let o = fibers("rt_tls_dtor")
        .env("TOFFLOAD_FIBER_TLS", "copy")
        .env("TOFFLOAD_HANDOFF_US", "200")
        .run();
    show("copy, handoff at 200 us", &o);
    expect_ok(&o);
    eq(&o, "destroyed", 16.0);
    eq(&o, "wrong", 0.0);
    at_least(&o, "moved", 1.0);
}

// ---------------------------------------------------------------- synchronisation

#[test]
fn mutex_held_across_an_offload() {
    let _s = serial();
    if !ready(&["rt_mutex"]) {
        return;
    }
    // Hazard: the holder parks in accel_run; the next fiber's glibc lock blocks the
    // carrier, so the holder never resumes.
    let o = hazard("rt_mutex", "sync").timeout(DEADLOCK_LIMIT).run();
    show("TOFFLOAD_TEST_DISABLE=sync", &o);
    assert!(
        o.timed_out && o.field("counter").is_none(),
        "a glibc mutex held by a parked fiber should deadlock the carrier: {}",
        o.report()
    );

    for_carriers("rt_mutex", |o| {
        expect_ok(o);
        eq(o, "on_fiber", 4.0);
        let expected = o.num("expected");
        eq(o, "counter", expected);
        at_least(o, "busy", 1.0);
        // timedlock on a mutex a parked fiber holds: times out, others run
        eq(o, "timedlock_rc", 110.0); // ETIMEDOUT
        between(o, "timedlock_ms", 45.0, 400.0);
        between(o, "lock_ms", 50.0, 1000.0);
        at_least(o, "ticks", 30.0);
        // a real thread holding a mutex a fiber waits for, and the reverse
        between(o, "x_fiber_ms", 90.0, 1000.0);
        at_least(o, "x_ticks", 20.0);
        between(o, "x_main_ms", 80.0, 1000.0);
    });
}

#[test]
fn recursive_and_errorcheck_mutexes_know_the_owning_fiber() {
    let _s = serial();
    if !ready(&["rt_mutex_types"]) {
        return;
    }
    let o = stock("rt_mutex_types").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "rec_violations", 0.0);
    eq(&o, "err_errors", 0.0);

    // Hazard: glibc knows owners by thread id, and every fiber of a carrier has the
    // carrier's: a second fiber walks into a recursive mutex another one holds, and
    // an error-checking one says EDEADLK to a fiber that does not own it.
    let o = hazard("rt_mutex_types", "sync").run();
    show("TOFFLOAD_TEST_DISABLE=sync", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 8.0);
    at_least(&o, "rec_violations", 1.0);
    at_least(&o, "err_errors", 1.0);

    for_carriers("rt_mutex_types", |o| {
        expect_ok(o);
        eq(o, "on_fiber", 8.0);
        eq(o, "rec_violations", 0.0);
        eq(o, "rec_errors", 0.0);
        eq(o, "err_violations", 0.0);
        eq(o, "err_errors", 0.0);
        eq(o, "self_edeadlk", 20.0);
        let tries = o.num("foreign_unlock_tries");
        eq(o, "foreign_unlock_eperm", tries);
    });
}

#[test]
fn cond_var_between_real_threads_and_fibers() {
    let _s = serial();
    if !ready(&["rt_cond"]) {
        return;
    }
    let o = stock("rt_cond").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "c_woken", 4.0);

    // Hazard: glibc's wait blocks the carrier: the ticker fiber stops while a fiber
    // waits for the real thread, and fibers waiting for a fiber never wake.
    let o = hazard("rt_cond", "sync").timeout(DEADLOCK_LIMIT).run();
    show("TOFFLOAD_TEST_DISABLE=sync", &o);
    eq(&o, "a_on_fiber", 1.0);
    at_most(&o, "a_ticks", 3.0);
    assert!(
        !o.ok() && o.field("c_woken").is_none(),
        "fibers waiting in glibc for a fiber should deadlock: {}",
        o.report()
    );

    for_carriers("rt_cond", |o| {
        expect_ok(o);
        // real thread -> fiber, with the carrier free meanwhile
        eq(o, "a_woke", 1.0);
        eq(o, "a_on_fiber", 1.0);
        at_least(o, "a_ticks", 40.0);
        at_most(o, "a_ms", 1000.0);
        // fiber -> real thread
        eq(o, "b_woke", 1.0);
        between(o, "b_ms", 45.0, 2000.0);
        // fiber -> fibers (broadcast)
        eq(o, "c_woken", 4.0);
        eq(o, "c_on_fiber", 4.0);
        // real thread -> fiber in timedwait / clockwait, well before the deadline
        eq(o, "d_rc", 0.0);
        between(o, "d_ms", 45.0, 2000.0);
        eq(o, "d_clock_rc", 0.0);
        between(o, "d_clock_ms", 45.0, 2000.0);
    });
}

#[test]
fn queue_stress_real_threads_and_fibers() {
    let _s = serial();
    if !ready(&["rt_stress"]) {
        return;
    }
    let good = |o: &Outcome| {
        expect_ok(o);
        let items = o.num("items");
        eq(o, "seen", items);
        eq(o, "dups", 0.0);
        at_least(o, "real_consumed", 1.0);
        at_least(o, "fiber_consumed", 1.0);
    };
    let o = stock("rt_stress").run();
    show("stock", &o);
    good(&o);
    // Hazard: producer and consumer fibers of one carrier waiting in glibc: the
    // first wait blocks the carrier and the fiber that would signal never runs.
    let o = stock("rt_stress")
        .runtime()
        .env("TOFFLOAD_TEST_DISABLE", "sync,handoff")
        .timeout(DEADLOCK_LIMIT)
        .run();
    show("TOFFLOAD_TEST_DISABLE=sync", &o);
    assert!(
        !o.ok() && o.field("seen").is_none(),
        "the queue survived glibc waits on fibers: {}",
        o.report()
    );
    // Default TOFFLOAD_FIBERIZE (after-accept): the early consumer stays real.
    for c in CARRIERS {
        let o = stock("rt_stress")
            .runtime()
            .env("TOFFLOAD_CARRIERS", c)
            .run();
        show(&format!("runtime, {c} carrier(s)"), &o);
        good(&o);
        eq(&o, "on_fiber", 8.0);
    }
}

#[test]
fn timedwait_and_poll_timeouts_honoured_while_others_run() {
    let _s = serial();
    if !ready(&["rt_timeouts"]) {
        return;
    }
    let timed = [
        ("tw", 110.0, 200.0),
        ("cw", 110.0, 100.0),
        ("poll", 0.0, 200.0),
        ("ppoll", 0.0, 100.0),
        ("sel", 0.0, 100.0),
    ];
    // Hazards: passed through to glibc and the kernel, the waits still time out but
    // block the carrier, and the ticker fiber stops meanwhile.
    let o = hazard("rt_timeouts", "sync").run();
    show("TOFFLOAD_TEST_DISABLE=sync", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 1.0);
    at_most(&o, "tw_ticks", 3.0);
    at_most(&o, "cw_ticks", 3.0);
    let o = hazard("rt_timeouts", "io").run();
    show("TOFFLOAD_TEST_DISABLE=io", &o);
    expect_ok(&o);
    for k in ["poll", "ppoll", "sel"] {
        at_most(&o, &format!("{k}_ticks"), 3.0);
    }

    for_carriers("rt_timeouts", |o| {
        expect_ok(o);
        eq(o, "on_fiber", 1.0);
        for (k, rc, ms) in timed {
            eq(o, &format!("{k}_rc"), rc);
            between(o, &format!("{k}_ms"), ms - 2.0, ms + 300.0);
            at_least(o, &format!("{k}_ticks"), ms / 5.0);
        }
    });
}

#[test]
fn rwlock_held_across_an_offload() {
    let _s = serial();
    if !ready(&["rt_rwlock"]) {
        return;
    }
    // Hazard: readers park in the offload holding the read lock; a writer's glibc
    // wrlock blocks the carrier and the readers never resume.
    // (glibc may instead notice that the "writer" is its own thread, the carrier,
    // and fail with EDEADLK: fibers sharing the carrier's identity is the hazard too.)
    let o = hazard("rt_rwlock", "sync").timeout(DEADLOCK_LIMIT).run();
    show("TOFFLOAD_TEST_DISABLE=sync", &o);
    assert!(
        !o.ok() && o.field("value").is_none(),
        "a glibc rwlock on fibers should deadlock the carrier (or fail): {}",
        o.report()
    );
    println!(
        "hazard: {}",
        if o.timed_out {
            "deadlocked".to_string()
        } else {
            o.stderr.trim().to_string()
        }
    );

    for_carriers("rt_rwlock", |o| {
        expect_ok(o);
        eq(o, "on_fiber", 6.0);
        at_least(o, "max_readers", 2.0);
        eq(o, "violations", 0.0);
        let expected = o.num("expected");
        eq(o, "value", expected);
        at_least(o, "busy", 1.0);
    });
}

#[test]
fn pthread_join_and_detach_on_fibers() {
    let _s = serial();
    if !ready(&["rt_join"]) {
        return;
    }
    let o = stock("rt_join").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "join_ok", 8.0);

    // Hazard: glibc's pthread_join on a fiber's handle (not a glibc thread).
    let o = hazard("rt_join", "join").timeout(DEADLOCK_LIMIT).run();
    show("TOFFLOAD_TEST_DISABLE=join", &o);
    let all_good = o.ok()
        && o.field("join_ok").as_deref() == Some("8")
        && o.field("late_ok").as_deref() == Some("1")
        && o.field("detached_done").as_deref() == Some("8")
        && o.field("fiber_join_ok").as_deref() == Some("1");
    assert!(
        !all_good,
        "glibc's pthread_join/detach on fiber handles unexpectedly worked: {}",
        o.report()
    );

    for_carriers("rt_join", |o| {
        expect_ok(o);
        eq(o, "join_ok", 8.0);
        eq(o, "late_ok", 1.0);
        eq(o, "detached_done", 8.0);
        eq(o, "fiber_join_ok", 1.0);
        // 8 joinable + 1 late + 8 detached + parent + child
        eq(o, "on_fiber", 19.0);
    });
}

/// An unversioned pthread_cond_* interposer that forwards with dlsym(RTLD_NEXT):
/// the naive way, which hands old-ABI callers the current-ABI functions.
const NAIVE_COND_INTERPOSER: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>
#define FWD(name, sig, args)                                         \
    int name sig                                                     \
    {                                                                \
        static int(*real) sig;                                       \
        if (!real)                                                   \
            real = (int(*) sig)dlsym(RTLD_NEXT, #name);              \
        return real args;                                            \
    }
FWD(pthread_cond_init, (pthread_cond_t *c, const pthread_condattr_t *a), (c, a))
FWD(pthread_cond_destroy, (pthread_cond_t *c), (c))
FWD(pthread_cond_signal, (pthread_cond_t *c), (c))
FWD(pthread_cond_broadcast, (pthread_cond_t *c), (c))
FWD(pthread_cond_wait, (pthread_cond_t *c, pthread_mutex_t *m), (c, m))
FWD(pthread_cond_timedwait, (pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *t),
    (c, m, t))
"#;

#[test]
fn old_glibc_2_2_5_cond_abi_keeps_working() {
    let _s = serial();
    if !ready(&["rt_oldcond"]) {
        return;
    }
    let good = |o: &Outcome| {
        o.ok()
            && o.field("woken").as_deref() == Some("16")
            && o.field("canary_bad").as_deref() == Some("0")
            && o.field("static_ok").as_deref() == Some("1")
            && o.field("timedwait_rc").as_deref() == Some("110")
    };
    // Stock: the old ABI really is what the program reaches (the current ABI would
    // write a 48-byte object over the canaries behind the one-word one).
    let o = stock("rt_oldcond").run();
    show("stock", &o);
    assert!(good(&o), "{}", o.report());

    let dir = TempDir::new("oldcond");
    let naive = match preload::build_shared_lib(&dir, "libnaivecond", NAIVE_COND_INTERPOSER) {
        Ok(p) => p,
        Err(e) => {
            harness::skip(&format!("cannot build the naive interposer: {e}"));
            return;
        }
    };
    // Hazard: the unversioned interposer binds the old-ABI calls and forwards them
    // to the current ABI, which takes the one-word object for a 48-byte one.
    let o = stock("rt_oldcond")
        .preload(&naive)
        .timeout(DEADLOCK_LIMIT)
        .run();
    show("naive interposer", &o);
    assert!(
        !good(&o),
        "the old-ABI program worked under the naive interposer: {}",
        o.report()
    );

    for_carriers("rt_oldcond", |o| {
        assert!(good(o), "{}", o.report());
        eq(o, "on_fiber", 4.0);
        between(o, "timedwait_ms", 98.0, 500.0);
    });
}

#[test]
fn fiber_identity_and_stack_attributes() {
    let _s = serial();
    if !ready(&["rt_identity"]) {
        return;
    }
    // Stock is the reference: pthread_self is a live thread, pthread_getattr_np
    // describes the stack the code runs on, a 1 MiB stack request is honoured.
    let o = stock("rt_identity").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "attr_ok", 8.0);
    eq(&o, "big_ok", 1.0);
    // On fibers the same must hold, even with a default fiber stack (64 KiB)
    // smaller than the 1 MiB the program asks for.
    for c in CARRIERS {
        let o = fibers("rt_identity")
            .env("TOFFLOAD_CARRIERS", c)
            .env("TOFFLOAD_STACK_KB", "64")
            .run();
        show(
            &format!("runtime, {c} carrier(s), TOFFLOAD_STACK_KB=64"),
            &o,
        );
        expect_ok(&o);
        eq(&o, "on_fiber", 9.0);
        eq(&o, "self_real", 8.0);
        eq(&o, "attr_ok", 8.0);
        eq(&o, "big_ok", 1.0);
        at_least(&o, "big_stack_kb", 1024.0);
    }
}

#[test]
fn io_semantics_on_fibers_match_threads() {
    let _s = serial();
    if !ready(&["rt_io_edges"]) {
        return;
    }
    // Parking a fiber instead of blocking its carrier means re-implementing what a
    // blocking call does. Stock threads are the reference: every check passes there.
    let o = stock("rt_io_edges").run();
    show("stock", &o);
    expect_ok(&o);
    let names: Vec<String> = Run::bin("rt_io_edges")
        .unwrap()
        .arg("--list")
        .run()
        .stdout
        .lines()
        .map(str::to_string)
        .collect();
    assert!(names.len() >= 10, "{names:?}");
    for n in &names {
        assert_eq!(
            o.field(n).as_deref(),
            Some("ok"),
            "stock {n}: {}",
            o.report()
        );
    }
    // Hazard: passed through, a blocking read holds the carrier, and the fiber that
    // would write never runs (the checks with two fibers depend on parking).
    let o = hazard("rt_io_edges", "io")
        .env("RT_HANG_MS", "1500")
        .arg("waitall")
        .run();
    show("TOFFLOAD_TEST_DISABLE=io", &o);
    assert_eq!(
        o.field("waitall").as_deref(),
        Some("hang"),
        "{}",
        o.report()
    );
    // Under the runtime, one check per run (a hung check ends its run).
    let mut failures = Vec::new();
    for c in CARRIERS {
        for n in &names {
            let o = fibers("rt_io_edges")
                .env("TOFFLOAD_CARRIERS", c)
                .env("RT_HANG_MS", "1500")
                .arg(n)
                .run();
            let got = o
                .field(n)
                .unwrap_or_else(|| format!("no result ({})", o.status));
            println!("runtime, {c} carrier(s): {n}={got}");
            if got != "ok" || o.field("on_fiber").as_deref() != Some("1") {
                failures.push(format!("{c} carrier(s): {n}={got}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "I/O on fibers differs from threads: {failures:#?}"
    );
}

/// The runtime remembers per socket whether the application made it non-blocking,
/// its SO_RCVTIMEO/SO_SNDTIMEO and its epoll registration (fewer syscalls per wait),
/// and forgets them in the interposed fcntl, ioctl, setsockopt, close and dup*.
/// Hazard: with the forgetting off, a program that changes them between reads gets
/// the old behaviour (a wait where it asked for EAGAIN: the check hangs). With it on
/// (and in io_semantics_on_fibers_match_threads, on 1 and 2 carriers), they pass.
#[test]
fn fd_facts_follow_what_the_application_changes() {
    let _s = serial();
    if !ready(&["rt_io_edges"]) {
        return;
    }
    for n in ["flip_nonblock", "flip_rcvtimeo", "dup2_nonblock"] {
        let o = stock("rt_io_edges").arg(n).run();
        assert_eq!(
            o.field(n).as_deref(),
            Some("ok"),
            "stock {n}: {}",
            o.report()
        );
        let o = hazard("rt_io_edges", "fdfacts")
            .env("RT_HANG_MS", "1500")
            .arg(n)
            .run();
        let got = o.field(n).unwrap_or_default();
        println!("TOFFLOAD_TEST_DISABLE=fdfacts: {n}={got}");
        assert_ne!(got, "ok", "{n} passed with stale facts: {}", o.report());
        let o = fibers("rt_io_edges").arg(n).run();
        let got = o.field(n).unwrap_or_default();
        println!("runtime: {n}={got}");
        assert_eq!(got, "ok", "{}", o.report());
        assert_eq!(o.field("on_fiber").as_deref(), Some("1"), "{}", o.report());
    }
}

/// A read that left its TCP socket empty (TCP_INQ says so) lets the next blocking read
/// park without the recv that would say EAGAIN (runtime/src/drain.rs). Hazards, one
/// switch each: trusting any read that filled its buffer leaves a pipelined request
/// unread until the wait's recheck; leaving TCP_INQ on hands the application's own
/// recvmsg a control message it never asked for. With both mitigations on, the reads
/// of a request-response loop mostly park unasked, and none do with TCP_INQ off.
#[test]
fn drained_sockets_park_without_asking() {
    let _s = serial();
    if !ready(&["rt_io_edges"]) {
        return;
    }
    for (n, switch) in [("pipelined", "inq"), ("inq_cmsg", "inqguard")] {
        let o = stock("rt_io_edges").arg(n).run();
        assert_eq!(
            o.field(n).as_deref(),
            Some("ok"),
            "stock {n}: {}",
            o.report()
        );
        let o = hazard("rt_io_edges", switch)
            .env("RT_HANG_MS", "1500")
            .arg(n)
            .run();
        let got = o.field(n).unwrap_or_default();
        println!("TOFFLOAD_TEST_DISABLE={switch}: {n}={got}");
        assert!(
            got.starts_with("fail:"),
            "{n} under {switch}: {}",
            o.report()
        );
        let o = fibers("rt_io_edges").arg(n).run();
        let got = o.field(n).unwrap_or_default();
        println!("runtime: {n}={got}");
        assert_eq!(got, "ok", "{}", o.report());
    }
    let dir = TempDir::new("drain");
    for inq in ["on", "off"] {
        let stats = dir.join(&format!("stats-{inq}.json"));
        let o = fibers("rt_io_edges")
            .env("TOFFLOAD_TCP_INQ", inq)
            .env("TOFFLOAD_STATS", stats.display().to_string())
            .arg("pingpong")
            .run();
        assert_eq!(o.field("pingpong").as_deref(), Some("ok"), "{}", o.report());
        let st = read_stats(&stats);
        let (parks, unasked) = (stat(&st, "io_parks"), stat(&st, "reads_unasked"));
        println!("TOFFLOAD_TCP_INQ={inq}: io_parks {parks}, reads_unasked {unasked}");
        // 400 reads wait in 200 rounds (each side once a round).
        assert!(parks >= 300, "{st}");
        if inq == "on" {
            assert!(
                unasked >= 300,
                "most waits should skip the EAGAIN recv: {st}"
            );
        } else {
            assert_eq!(unasked, 0, "{st}");
        }
    }
}

#[test]
fn fiberize_modes_choose_which_threads_become_fibers() {
    let _s = serial();
    if !ready(&["rt_fiberize"]) {
        return;
    }
    // A thread created at start-up, then an accept4, then a connection thread that
    // joins the start-up one (under the default: a fiber joining a real thread).
    let o = stock("rt_fiberize").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "echo_ok", 1.0);
    eq(&o, "join_ok", 1.0);
    // `all` makes the start-up thread a fiber too: what the default avoids for
    // threads such as a signal-waiting one.
    for (mode, before, after) in [
        (None, 0.0, 1.0),
        (Some("after-accept"), 0.0, 1.0),
        (Some("all"), 1.0, 1.0),
        (Some("off"), 0.0, 0.0),
    ] {
        for c in CARRIERS {
            let mut r = stock("rt_fiberize").runtime().env("TOFFLOAD_CARRIERS", c);
            if let Some(m) = mode {
                r = r.env("TOFFLOAD_FIBERIZE", m);
            }
            let o = r.run();
            show(&format!("TOFFLOAD_FIBERIZE={mode:?}, {c} carrier(s)"), &o);
            expect_ok(&o);
            assert_eq!(o.stderr, "", "{}", o.report());
            eq(&o, "before", before);
            eq(&o, "after", after);
            eq(&o, "echo_ok", 1.0);
            eq(&o, "join_ok", 1.0);
        }
    }
}

// ---------------------------------------------------------------- scheduling

#[test]
fn sleeps_on_fibers_overlap() {
    let _s = serial();
    if !ready(&["rt_sleep"]) {
        return;
    }
    // Hazard: sleeping in the kernel blocks the carrier: 16 x 100 ms in a row.
    let o = hazard("rt_sleep", "io").run();
    show("TOFFLOAD_TEST_DISABLE=io", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 16.0);
    at_least(&o, "elapsed_ms", 1200.0);

    for_carriers("rt_sleep", |o| {
        expect_ok(o);
        eq(o, "on_fiber", 16.0);
        between(o, "elapsed_ms", 99.0, 500.0);
        eq(o, "early", 0.0);
    });
}

#[test]
fn fiber_stack_overflow_dies_with_a_message() {
    let _s = serial();
    if !ready(&["rt_overflow"]) {
        return;
    }
    // Stock: a real thread dies of SIGSEGV on glibc's guard page, with nothing said.
    let o = stock("rt_overflow").run();
    show("stock", &o);
    assert_eq!(o.signal(), Some(libc::SIGSEGV), "{}", o.report());
    assert!(!o.stderr.contains("fiber stack overflow"), "{}", o.report());

    let o = fibers("rt_overflow").env("TOFFLOAD_STACK_KB", "64").run();
    show("runtime", &o);
    assert_eq!(
        o.field("on_fiber").as_deref(),
        Some("1"),
        "the recursion did not run on a fiber: {}",
        o.report()
    );
    assert!(!o.stdout.contains("survived"), "{}", o.report());
    assert_eq!(
        o.signal(),
        Some(libc::SIGSEGV),
        "a fiber stack overflow must end in SIGSEGV: {}",
        o.report()
    );
    assert!(
        o.stderr.contains("toffload: fiber stack overflow"),
        "no \"toffload: fiber stack overflow\" on stderr: {}",
        o.report()
    );
}

/// Blocking calls with pollable twins, for TOFFLOAD_OFFLOAD: xoff_block (2 args) and
/// xoff_block6 (6 args) block in the kernel through raw syscalls (out of the
/// runtime's reach); xoff_submit / xoff_submit6, xoff_done and xoff_release
/// implement the same wait as an operation, and the submits reject arguments that
/// did not arrive unchanged.
const XOFF_LIB: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SLOTS 4096
static struct {
    int used;
    struct timespec due;
} ops[SLOTS];
static long real_calls;

static int reached(const struct timespec *due)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec > due->tv_sec || (t.tv_sec == due->tv_sec && t.tv_nsec >= due->tv_nsec);
}

long xoff_submit(long us, long tag)
{
    if (us < 0 || tag != (us ^ 0x5eed))
        return -EINVAL;
    for (long i = 0; i < SLOTS; i++) {
        int free_ = 0;
        if (__atomic_compare_exchange_n(&ops[i].used, &free_, 1, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
            struct timespec t;
            clock_gettime(CLOCK_MONOTONIC, &t);
            t.tv_sec += us / 1000000;
            t.tv_nsec += (us % 1000000) * 1000;
            if (t.tv_nsec >= 1000000000L) {
                t.tv_sec++;
                t.tv_nsec -= 1000000000L;
            }
            ops[i].due = t;
            return i;
        }
    }
    return -EAGAIN;
}

int xoff_done(long h)
{
    if (h < 0 || h >= SLOTS || !__atomic_load_n(&ops[h].used, __ATOMIC_SEQ_CST))
        return -EBADF;
    return reached(&ops[h].due);
}

int xoff_release(long h)
{
    if (h < 0 || h >= SLOTS || !__atomic_exchange_n(&ops[h].used, 0, __ATOMIC_SEQ_CST))
        return -EBADF;
    return 0;
}

static int block_on(long h)
{
    if (h < 0)
        return (int)h;
    struct timespec due = ops[h].due;
    while (syscall(SYS_clock_nanosleep, CLOCK_MONOTONIC, TIMER_ABSTIME, &due, NULL) != 0 &&
           errno == EINTR)
        ;
    xoff_release(h);
    return 0;
}

int xoff_block(long us, long tag)
{
    __atomic_fetch_add(&real_calls, 1, __ATOMIC_SEQ_CST);
    return block_on(xoff_submit(us, tag));
}

/* Six arguments: each tag must be us + its position. */
long xoff_submit6(long us, long t1, long t2, long t3, long t4, long t5)
{
    if (t1 != us + 1 || t2 != us + 2 || t3 != us + 3 || t4 != us + 4 || t5 != us + 5)
        return -EINVAL;
    return xoff_submit(us, us ^ 0x5eed);
}

int xoff_block6(long us, long t1, long t2, long t3, long t4, long t5)
{
    __atomic_fetch_add(&real_calls, 1, __ATOMIC_SEQ_CST);
    return block_on(xoff_submit6(us, t1, t2, t3, t4, t5));
}

long xoff_real_calls(void) { return __atomic_load_n(&real_calls, __ATOMIC_SEQ_CST); }
"#;

#[test]
fn extra_offload_row_overlaps_blocking_calls() {
    let _s = serial();
    if !ready(&["rt_xoffload"]) {
        return;
    }
    let dir = TempDir::new("xoff");
    let lib = match preload::build_shared_lib(&dir, "libxoff", XOFF_LIB) {
        Ok(p) => p,
        Err(e) => {
            harness::skip(&format!("cannot build the offload library: {e}"));
            return;
        }
    };
    // Hazard: without the rows, the blocking calls block the carrier: 16 x 100 ms
    // in a row.
    // (Without the handoff, which would move the other fibers off the blocked carrier.)
    let o = fibers("rt_xoffload")
        .preload(&lib)
        .env("TOFFLOAD_TEST_DISABLE", "handoff")
        .run();
    show("runtime, no TOFFLOAD_OFFLOAD rows", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 16.0);
    eq(&o, "real_calls", 17.0);
    eq(&o, "rc_bad", 0.0);
    at_least(&o, "elapsed_ms", 1200.0);

    let stats = dir.join("stats.json");
    let o = fibers("rt_xoffload")
        .preload(&lib)
        .env(
            "TOFFLOAD_OFFLOAD",
            "xoff_block:xoff_submit:xoff_done:xoff_release,\
             xoff_block6:xoff_submit6:xoff_done:xoff_release",
        )
        .env("TOFFLOAD_STATS", stats.display().to_string())
        .run();
    show("runtime, TOFFLOAD_OFFLOAD rows", &o);
    expect_ok(&o);
    eq(&o, "on_fiber", 16.0);
    eq(&o, "rc_bad", 0.0);
    eq(&o, "main_rc", 0.0);
    // Only the real main thread's call reached a blocking function.
    eq(&o, "real_calls", 1.0);
    between(&o, "elapsed_ms", 99.0, 600.0);
    let st = read_stats(&stats);
    println!("stats: {st}");
    assert!(stat(&st, "offloads") >= 16, "{st}");
}

// ---------------------------------------------------------------- servers

fn start(spec: ServerSpec) -> RtServer {
    RtServer::start(&spec).unwrap_or_else(|e| panic!("{e}"))
}

fn load_cfg(port: u16, conns: usize, secs: f64) -> Config {
    let mut cfg = Config::new(port);
    cfg.conns = conns;
    cfg.duration = Duration::from_secs_f64(secs);
    cfg.warmup = Duration::from_millis(200);
    cfg
}

/// A load run that must give only right answers and no errors.
fn assert_clean(what: &str, r: &Report) {
    println!(
        "{what}: {:.0} req/s, p50 {:.0} us, p99 {:.0} us, completed {}, wrong {}, errors {}",
        r.requests_per_sec, r.p50_us, r.p99_us, r.completed, r.wrong, r.errors
    );
    assert!(r.completed > 0, "{what}: nothing completed");
    assert_eq!(r.wrong, 0, "{what}: wrong answers");
    assert_eq!(r.errors, 0, "{what}: errors {:?}", r.errors_by_kind);
}

/// The same, for a run against `s`, which must still be running: a failure says how
/// the server ended and what it wrote on stderr.
fn assert_served(s: &mut RtServer, what: &str, r: &Report) {
    s.expect_alive(what);
    if r.completed == 0 || r.wrong != 0 || r.errors != 0 {
        println!("server: {}", s.describe());
    }
    assert_clean(what, r);
}

#[test]
fn conn_server_zero_wrong_answers_under_runtime() {
    let _s = serial();
    if !ready(&["conn_server"]) {
        return;
    }
    let dir = TempDir::new("conn");
    // Completions polled (the default: the device never signals) and signalled (the
    // completion fd in each carrier's epoll).
    for (carriers, wait, completions) in [
        ("1", "block", "poll"),
        ("2", "spin", "poll"),
        ("2", "block", "poll"),
        ("1", "block", "signal"),
        ("2", "block", "signal"),
    ] {
        let stats = dir.join(&format!("stats-{carriers}-{wait}-{completions}.json"));
        let mut s = start(preload::server_under_runtime(
            ServerSpec::new("conn_server")
                .arg("--cpu-us")
                .arg("5")
                .env("TOFFLOAD_EMU_LAT_US", "200")
                .env("TOFFLOAD_WAIT", wait)
                .env("TOFFLOAD_CARRIERS", carriers)
                .env("TOFFLOAD_COMPLETIONS", completions)
                .env("TOFFLOAD_STATS", stats.display().to_string()),
        ));
        let what = format!("runtime carriers={carriers} wait={wait} completions={completions}");
        let r = load::run(&load_cfg(s.port, 64, 1.0)).expect("load run");
        assert_served(&mut s, &what, &r);
        let mut open = load_cfg(s.port, 32, 1.0);
        open.rate = Some(3000.0);
        let r = load::run(&open).expect("open-loop run");
        assert_served(&mut s, &format!("{what} open loop 3000/s"), &r);
        std::thread::sleep(Duration::from_millis(150));
        let st = read_stats(&stats);
        println!("stats: {st}");
        // Engaged: the connection threads were fibers and the offloads parked them.
        assert!(stat(&st, "fibers_created") >= 64, "{st}");
        assert!(stat(&st, "offloads_parked") > 0, "{st}");
        // Every parked offload went the way asked.
        let polled = stat(&st, "offloads_polled");
        match completions {
            "poll" => assert_eq!(polled, stat(&st, "offloads_parked"), "{st}"),
            _ => assert_eq!(polled, 0, "{st}"),
        }
        assert_eq!(
            stat(&st, "carriers"),
            carriers.parse::<u64>().unwrap(),
            "{st}"
        );
    }
}

/// The server's resident memory, bytes (None once it is gone).
fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    Some(
        kb.trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()?
            << 10,
    )
}

/// Between fibers the carrier asks the device whether the polled offloads are done,
/// and the emulated device keeps its cipher context in a thread-local of its library,
/// one of the objects whose TLS each fiber gets a copy of (TOFFLOAD_FIBER_TLS auto).
/// There the carrier thread's blocks must hold its own values, not the copy of the
/// fiber that parked last. Hazard (TOFFLOAD_TEST_DISABLE=carriertls): each completion
/// found between fibers builds a new context in that stale copy, the next fiber's
/// switch overwrites it, and conn_server grows by megabytes a second. With the
/// thread's own values kept, it stays flat under the same load.
#[test]
fn the_carriers_own_tls_between_fibers_leaks_nothing() {
    let _s = serial();
    if !ready(&["conn_server"]) {
        return;
    }
    let grew = |disable: Option<&str>| -> Option<u64> {
        let mut spec = ServerSpec::new("conn_server")
            .env("TOFFLOAD_EMU_LAT_US", "20")
            .env("TOFFLOAD_COMPLETIONS", "poll");
        if let Some(d) = disable {
            spec = spec.env("TOFFLOAD_TEST_DISABLE", d);
        }
        let mut s = start(preload::server_under_runtime(spec));
        let what = format!("conn_server, TOFFLOAD_TEST_DISABLE={disable:?}");
        // Warm: the connections' fibers, the carrier's and the allocator's caches.
        let r = load::run(&load_cfg(s.port, 64, 1.0)).expect("load run");
        assert_served(&mut s, &what, &r);
        let before = rss_bytes(s.pid())?;
        let r = load::run(&load_cfg(s.port, 64, 3.0)).expect("load run");
        let after = rss_bytes(s.pid());
        println!(
            "{what}: {} answers, resident {before} -> {after:?} bytes",
            r.completed
        );
        if disable.is_none() {
            assert_served(&mut s, &what, &r);
        }
        after.map(|a| a.saturating_sub(before))
    };
    let hazard = grew(Some("carriertls"));
    assert!(
        hazard.is_none_or(|g| g >= 2 << 20),
        "with the carrier's own TLS not kept, conn_server grew by only {hazard:?} bytes"
    );
    let kept = grew(None).expect("conn_server gone");
    assert!(kept < 1 << 20, "conn_server grew by {kept} bytes");
}

/// gpu_server (a thread per connection; each request a stream, an asynchronous
/// kernel and a synchronize, through libfakecuda.so, whose synchronize waits below
/// libc as a driver's does) with each of the four waits the runtime has built-in
/// rows for. Hazard: with the rows off, the synchronize blocks the carrier and the
/// server falls far below stock. With them, every kind serves at stock's pace or
/// better with every answer right, and a device error reaches the application as it
/// does stock.
#[test]
fn cuda_synchronize_calls_overlap_on_fibers() {
    let _s = serial();
    if !ready(&["gpu_server"]) {
        return;
    }
    let dir = TempDir::new("gpu");
    let run = |sync: &str, preload: bool, extra: &[(&str, &str)]| {
        let mut spec = ServerSpec::new("gpu_server")
            .env("GPU_SERVER_SYNC", sync)
            .env("TOFFLOAD_EMU_LAT_US", "1000");
        for (k, v) in extra {
            spec = spec.env(k, *v);
        }
        if preload {
            spec = preload::server_under_runtime(spec);
        }
        let mut s = start(spec);
        let mut cfg = load_cfg(s.port, 64, 1.0);
        if extra.iter().any(|(k, _)| *k == "FAKECUDA_FAIL") {
            // The connections fail at once: count them from the start.
            cfg.warmup = Duration::ZERO;
        }
        let r = load::run(&cfg).expect("load run");
        s.expect_alive(sync);
        r
    };
    let off = run(
        "stream",
        true,
        &[
            ("TOFFLOAD_CUDA_ROWS", "off"),
            ("TOFFLOAD_TEST_DISABLE", "handoff"),
        ],
    );
    assert_clean("stream, runtime, CUDA rows off", &off);
    for sync in ["stream", "event", "cu-stream", "cu-event"] {
        let stock = run(sync, false, &[]);
        assert_clean(&format!("{sync}, stock"), &stock);
        if sync == "stream" {
            assert!(
                off.requests_per_sec < 0.5 * stock.requests_per_sec,
                "the hazard: without the rows the synchronize blocks the carrier"
            );
        }
        let stats = dir.join(&format!("stats-{sync}.json"));
        let path = stats.display().to_string();
        let rt = run(sync, true, &[("TOFFLOAD_STATS", &path)]);
        assert_clean(&format!("{sync}, runtime"), &rt);
        // Overlapped, the runtime serves about what stock's 64 threads do or more
        // (0.7-1.8x of it over the hosts this ran on; where both take twice the
        // device's 1 ms per request at 64 connections, about 1x); the hazard above is
        // 0.03x. How far it beats stock is
        // the runtime bench's to measure, not a timed test's: "beats" alone was a coin
        // flip on a host where both sat at the device's pace.
        let mut ratio = rt.requests_per_sec / stock.requests_per_sec;
        println!("{sync}: {ratio:.2}x of stock");
        if ratio <= 0.6 {
            // One disturbed second (a full suite once read 0.60x, p99 41 ms under the
            // runtime against stock's own 12 ms; 1.4-2.0x alone) is measured again,
            // the pair afresh; a carrier that blocks reads 0.03x in both.
            let stock = run(sync, false, &[]);
            let rt = run(sync, true, &[]);
            assert_clean(&format!("{sync}, stock, again"), &stock);
            assert_clean(&format!("{sync}, runtime, again"), &rt);
            let again = rt.requests_per_sec / stock.requests_per_sec;
            println!("{sync}, again: {again:.2}x of stock");
            ratio = ratio.max(again);
        }
        assert!(ratio > 0.6, "{sync}: {ratio:.2}x of stock");
        std::thread::sleep(Duration::from_millis(150));
        let st = read_stats(&stats);
        assert!(stat(&st, "offloads_parked") > 0, "{sync}: {st}");
    }
    // A device error: every request fails, stock and under the runtime alike.
    for preload in [false, true] {
        let r = run("event", preload, &[("FAKECUDA_FAIL", "1")]);
        println!(
            "FAKECUDA_FAIL=1, runtime {preload}: completed {}, errors {}",
            r.completed, r.errors
        );
        assert_eq!((r.completed, r.wrong), (0, 0), "runtime {preload}");
        assert!(r.errors > 0, "runtime {preload}: the error was swallowed");
    }
}

#[test]
fn two_thousand_concurrent_connections() {
    let _s = serial();
    if !ready(&["conn_server"]) {
        return;
    }
    const CONNS: usize = 2000;
    // The load generator holds one fd per connection: raise our soft limit.
    // SAFETY: plain getrlimit/setrlimit on this process.
    let hard = unsafe {
        let mut rl: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl);
        if rl.rlim_cur < rl.rlim_max {
            rl.rlim_cur = rl.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
        }
        rl.rlim_max
    };
    if hard < CONNS as libc::rlim_t + 100 {
        harness::skip(&format!(
            "RLIMIT_NOFILE hard limit {hard} is too low for {CONNS} connections"
        ));
        return;
    }
    let run = |spec: ServerSpec, label: &str| -> (Report, u64) {
        let mut s = start(
            spec.env("TOFFLOAD_EMU_LAT_US", "1000")
                .env("TOFFLOAD_WAIT", "block"),
        );
        let pid = s.pid();
        let port = s.port;
        let h = std::thread::spawn(move || {
            let mut cfg = load_cfg(port, CONNS, 2.0);
            cfg.warmup = Duration::from_millis(500);
            cfg.timeout = Duration::from_secs(10);
            cfg.connect_timeout = Duration::from_secs(5);
            load::run(&cfg)
        });
        // Sample the server's thread count while every connection is open.
        let mut threads = 0;
        let t0 = Instant::now();
        while !h.is_finished() && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(100));
            threads = threads.max(preload::threads_of(pid).unwrap_or(0));
        }
        let r = h.join().expect("load thread").expect("load run");
        assert_served(&mut s, &format!("{label}, {CONNS} connections"), &r);
        println!("{label}: {threads} threads at most");
        (r, threads)
    };
    // The cost the runtime removes: stock runs a kernel thread per connection.
    let (_, threads) = run(ServerSpec::new("conn_server"), "stock");
    assert!(threads >= CONNS as u64, "stock ran only {threads} threads");

    let dir = TempDir::new("c2k");
    let stats = dir.join("stats.json");
    let (r, threads) = run(
        preload::server_under_runtime(
            ServerSpec::new("conn_server").env("TOFFLOAD_STATS", stats.display().to_string()),
        ),
        "runtime",
    );
    assert!(
        r.completed >= CONNS as u64,
        "only {} requests for {CONNS} connections",
        r.completed
    );
    assert!(
        threads < 100,
        "{threads} threads under the runtime for {CONNS} connections"
    );
    let st = read_stats(&stats);
    println!("stats: {st}");
    assert!(stat(&st, "fibers_created") >= CONNS as u64, "{st}");
}

/// Connects and sends half a request (it will never send the rest).
fn half_request(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(&[0x5a; 512]).expect("half a request");
    s
}

/// Closes with a TCP reset (SO_LINGER 0).
fn reset(s: TcpStream) {
    let lg = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a correctly sized option.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&lg as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "SO_LINGER: {}", std::io::Error::last_os_error());
    drop(s);
}

#[test]
fn client_reset_mid_request() {
    let _s = serial();
    if !ready(&["conn_server"]) {
        return;
    }
    let spec = |disable: Option<&str>, carriers: &str| {
        let mut s = preload::server_under_runtime(
            ServerSpec::new("conn_server")
                .env("TOFFLOAD_EMU_LAT_US", "200")
                .env("TOFFLOAD_WAIT", "block")
                .env("TOFFLOAD_CARRIERS", carriers),
        );
        if let Some(d) = disable {
            s = s.env("TOFFLOAD_TEST_DISABLE", format!("{d},handoff"));
        }
        s
    };
    let short = |port| {
        let mut cfg = load_cfg(port, 8, 1.0);
        cfg.timeout = Duration::from_millis(800);
        load::run(&cfg).expect("load run")
    };
    // Hazard: with reads passed through, the half-sent request's read blocks the
    // carrier and every other connection waits for that client.
    let mut s = start(spec(Some("io"), "1"));
    let half = half_request(s.port);
    std::thread::sleep(Duration::from_millis(200));
    let r = short(s.port);
    println!(
        "TOFFLOAD_TEST_DISABLE=io, a client holding half a request: completed {}, errors {:?}",
        r.completed, r.errors_by_kind
    );
    assert_eq!(r.wrong, 0);
    assert_eq!(r.completed, 0, "the carrier was not blocked");
    reset(half);
    s.expect_alive("TOFFLOAD_TEST_DISABLE=io, after the reset");
    drop(s);

    for carriers in ["1", "2"] {
        let mut s = start(spec(None, carriers));
        let half = half_request(s.port);
        std::thread::sleep(Duration::from_millis(200));
        let r = short(s.port);
        assert_served(
            &mut s,
            &format!("runtime, {carriers} carrier(s), a client holding half a request"),
            &r,
        );
        reset(half);
        // 50 more clients reset mid-request while the others are under load.
        let port = s.port;
        let resetter = std::thread::spawn(move || {
            for _ in 0..50 {
                reset(half_request(port));
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let r = short(s.port);
        resetter.join().expect("resetter");
        assert_served(
            &mut s,
            &format!("runtime, {carriers} carrier(s), during 50 resets mid-request"),
            &r,
        );
        let r = short(s.port);
        assert_served(
            &mut s,
            &format!("runtime, {carriers} carrier(s), after the resets"),
            &r,
        );
    }
}

#[test]
fn hostile_server_loses_updates_under_runtime() {
    let _s = serial();
    if !ready(&["hostile_server"]) {
        return;
    }
    let dir = TempDir::new("hostile");
    let run = |locked: bool, carriers: &str| {
        let stats = dir.join(&format!("stats-{locked}-{carriers}.json"));
        let mut spec = preload::server_under_runtime(
            ServerSpec::new("hostile_server")
                .env("TOFFLOAD_EMU_LAT_US", "200")
                .env("TOFFLOAD_WAIT", "block")
                .env("TOFFLOAD_CARRIERS", carriers)
                .env("TOFFLOAD_STATS", stats.display().to_string()),
        );
        if locked {
            spec = spec.env("LOCKED", "1");
        }
        let mut s = start(spec);
        let r = load::run(&load_cfg(s.port, 16, 1.5)).expect("load run");
        s.expect_alive("hostile_server after the load run");
        let out = s
            .terminate()
            .expect("hostile_server exits cleanly on SIGTERM");
        let field = |name: &str| -> u64 {
            out.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {name}= in {out:?}"))
        };
        let st = read_stats(&stats);
        println!("locked={locked} carriers={carriers}: {out:?}; stats: {st}");
        (field("shared"), field("total"), field("lost"), r, st)
    };
    // The hazard the conflict guard exists for: with overlap, the unlocked
    // read-modify-write across the offload loses updates.
    let (shared, total, lost, r, st) = run(false, "1");
    assert_clean("hostile unlocked under the runtime", &r);
    assert!(stat(&st, "fibers_created") >= 16, "not fiberized: {st}");
    assert!(stat(&st, "offloads_parked") > 0, "no overlap: {st}");
    assert_eq!(shared + lost, total);
    assert!(lost > 0, "no update lost under overlap: {total} total");
    // A mutex held across the offload (fiber-aware: it parks the fiber) keeps them,
    // also with two carriers running fibers in parallel.
    for carriers in ["1", "2"] {
        let (shared, total, lost, r, st) = run(true, carriers);
        assert_clean(&format!("hostile LOCKED=1, {carriers} carrier(s)"), &r);
        assert!(stat(&st, "fibers_created") >= 16, "not fiberized: {st}");
        assert_eq!((lost, shared), (0, total));
    }
}

/// Kills a daemon (by pid) when the test ends, however it ends.
struct Daemon(Option<i32>);

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            // SAFETY: a process this test started (through the server's fork).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// rt_forkd under the runtime: serve, fork, parent exits; returns the load run
/// against the child.
fn forking_daemon(disable: Option<&str>, env: &[(&str, &str)]) -> Report {
    let dir = TempDir::new("forkd");
    let pidfile = dir.join("daemon.pid");
    let mut spec = preload::server_under_runtime(
        ServerSpec::new("rt_forkd")
            .env("TOFFLOAD_EMU_LAT_US", "200")
            .env("TOFFLOAD_WAIT", "block")
            .env("FORK_AFTER", "3")
            .env("DAEMON_PIDFILE", pidfile.display().to_string()),
    );
    if let Some(d) = disable {
        spec = spec.env("TOFFLOAD_TEST_DISABLE", format!("{d},handoff"));
    }
    for (k, v) in env {
        spec = spec.env(k, *v);
    }
    let mut s = start(spec);
    let port = s.port;
    let r = load::run(&load_cfg(port, 3, 0.5)).expect("load run before the fork");
    assert_served(&mut s, "rt_forkd before the fork", &r);
    let mut daemon = Daemon(None);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        if let Some(pid) = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|p| p.trim().parse().ok())
        {
            daemon.0 = Some(pid);
            if !s.alive() {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(daemon.0.is_some(), "rt_forkd never forked");
    assert!(!s.alive(), "the parent did not exit after the fork");
    let mut cfg = load_cfg(port, 4, 1.0);
    cfg.timeout = Duration::from_millis(800);
    let r = match load::run(&cfg) {
        Ok(r) => r,
        Err(e) => {
            println!("load run against the child: {e}");
            Report::default()
        }
    };
    println!(
        "child (TOFFLOAD_TEST_DISABLE={disable:?}): completed {}, wrong {}, errors {:?}",
        r.completed, r.wrong, r.errors_by_kind
    );
    r
}

#[test]
fn fork_with_fibers_alive_from_a_thread_and_from_a_fiber() {
    let _s = serial();
    if !ready(&["rt_fork"]) {
        return;
    }
    let o = stock("rt_fork").run();
    show("stock", &o);
    expect_ok(&o);
    eq(&o, "main_child", 0.0);
    eq(&o, "fiber_child", 0.0);
    eq(&o, "ghost_writes", 0.0);

    // Hazard: without re-established carriers the child forked from the real
    // thread never runs a fiber (killed after 3 s); the child forked from a fiber
    // runs on the copy of its carrier, parent's parked fibers included: they wake
    // up in the child as ghosts and write with its pid.
    let o = hazard("rt_fork", "fork").run();
    show("TOFFLOAD_TEST_DISABLE=fork", &o);
    expect_ok(&o);
    assert!(
        o.num("main_child") != 0.0 || o.num("ghost_writes") > 0.0,
        "fork without re-established carriers showed no hazard: {}",
        o.report()
    );

    for_carriers("rt_fork", |o| {
        expect_ok(o);
        for who in ["main", "fiber"] {
            eq(o, &format!("{who}_child"), 0.0);
            eq(o, &format!("{who}_on_fiber"), 8.0);
            // 8 sleeps of 100 ms on fibers in the child still overlap
            between(o, &format!("{who}_ms"), 99.0, 600.0);
        }
        eq(o, "parent_writes", 4.0);
        eq(o, "ghost_writes", 0.0);
    });
}

#[test]
fn forking_daemon_keeps_serving() {
    let _s = serial();
    if !ready(&["rt_forkd"]) {
        return;
    }
    // Hazard: the child of fork() has no carrier threads: its fibers never run.
    let r = forking_daemon(Some("fork"), &[]);
    assert_eq!(r.wrong, 0);
    assert_eq!(
        r.completed, 0,
        "the child served without re-established carriers"
    );

    let r = forking_daemon(None, &[]);
    assert_clean("rt_forkd child under the runtime", &r);

    // With the guard armed in the parent: the child starts from a fresh guard state
    // (its pages open again, no parent's lock or fd kept) and serves.
    for mode in ["detect", "enforce"] {
        let r = forking_daemon(None, &[("TOFFLOAD_GUARD", mode)]);
        assert_clean(&format!("rt_forkd child, TOFFLOAD_GUARD={mode}"), &r);
    }
}

// ---------------------------------------------------------------- foreign processes

#[test]
fn never_engaging_programs_are_unchanged() {
    let _s = serial();
    if !ready(&["rt_errno"]) {
        return;
    }
    let dir = TempDir::new("foreign");
    let input = dir.join("input.txt");
    std::fs::write(&input, "pear\napple\nfig\n").unwrap();
    let input = input.display().to_string();
    let sh_line = format!("sort {input} | tr a-z A-Z; echo status=$?");
    let cases: Vec<Run> = vec![
        Run::path("/bin/echo").args(["hello", "world"]),
        Run::path("/bin/ls").args(["-la", "/"]),
        Run::path("/usr/bin/sort").arg(&input),
        Run::path("/bin/sh").args(["-c", &sh_line]),
        Run::path("/bin/ls").arg("/no/such/path"),
        // A threaded program that never accepts: under the default
        // TOFFLOAD_FIBERIZE=after-accept its threads stay real.
        stock("rt_errno"),
    ];
    for c in cases {
        let a = c.clone().run();
        let stats = dir.join("stats.json");
        let _ = std::fs::remove_file(&stats);
        let b = c
            .runtime()
            .env("TOFFLOAD_STATS", stats.display().to_string())
            .run();
        println!("{}: exit {}", b.what, b.status);
        assert!(
            !a.timed_out && !b.timed_out,
            "{}\n{}",
            a.report(),
            b.report()
        );
        assert_eq!(a.status.code(), b.status.code(), "{}", b.report());
        assert_eq!(a.stdout, b.stdout, "stdout differs: {}", b.report());
        assert_eq!(a.stderr, b.stderr, "stderr differs: {}", b.report());
        if let Some(st) = preload::stats(&stats) {
            assert_ne!(
                st.get("engaged"),
                Some(&serde_json::Value::Bool(true)),
                "{st}"
            );
            assert_eq!(stat(&st, "fibers_created"), 0, "{st}");
        }
    }
}

#[test]
fn foreign_threaded_binary_runs_on_fibers() {
    let _s = serial();
    if !ready(&[]) {
        return;
    }
    let sort = Path::new("/usr/bin/sort");
    if !sort.exists() {
        harness::skip("/usr/bin/sort is missing");
        return;
    }
    // GNU sort with --parallel sorts in pthreads that share a mutex and condition
    // variables: under TOFFLOAD_FIBERIZE=all they become fibers.
    let dir = TempDir::new("sort");
    let input = dir.join("input.txt");
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut text = String::new();
    for _ in 0..300_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        text.push_str(&format!("{}\n", x % 1_000_000_007));
    }
    std::fs::write(&input, text).unwrap();
    let run = || {
        Run::path(sort)
            .args(["--parallel=4", "-S", "64M"])
            .arg(&input)
            .timeout(RUN_LIMIT)
    };
    let reference = run().run();
    assert!(reference.ok(), "{}", reference.report());
    assert_eq!(reference.stdout.lines().count(), 300_000);

    // Hazard: its threads on fibers, blocking in glibc's mutex and condition
    // variables, deadlock their carrier.
    let o = run()
        .runtime()
        .env("TOFFLOAD_FIBERIZE", "all")
        .env("TOFFLOAD_TEST_DISABLE", "sync,handoff")
        .timeout(DEADLOCK_LIMIT)
        .run();
    println!(
        "TOFFLOAD_TEST_DISABLE=sync: timed out {}, {} bytes out",
        o.timed_out,
        o.stdout.len()
    );
    assert!(
        !o.ok() || o.stdout != reference.stdout,
        "sort on fibers with glibc's sync worked: {}",
        o.status
    );

    for c in CARRIERS {
        let stats = dir.join("stats.json");
        let o = run()
            .runtime()
            .env("TOFFLOAD_FIBERIZE", "all")
            .env("TOFFLOAD_CARRIERS", c)
            .env("TOFFLOAD_STATS", stats.display().to_string())
            .run();
        println!(
            "runtime, {c} carrier(s): {} in {:.2} s",
            o.status,
            o.elapsed.as_secs_f64()
        );
        assert!(
            o.ok(),
            "{}",
            o.report().chars().take(2000).collect::<String>()
        );
        assert!(
            o.stdout == reference.stdout,
            "sort's output differs on fibers"
        );
        assert_eq!(o.stderr, "");
        let st = read_stats(&stats);
        println!("stats: {st}");
        assert!(stat(&st, "fibers_created") >= 1, "sort made no fiber: {st}");
    }
}

#[test]
fn malformed_knob_gives_one_clear_line_and_the_program_works() {
    let _s = serial();
    if !ready(&["rt_errno"]) {
        return;
    }
    // Well formed: silent, and it engages (so the malformed runs below show a change).
    let o = fibers("rt_errno").env("TOFFLOAD_CARRIERS", "2").run();
    show("TOFFLOAD_CARRIERS=2", &o);
    expect_ok(&o);
    assert_eq!(o.stderr, "", "{}", o.report());
    eq(&o, "on_fiber", 16.0);

    let reference = stock("rt_errno").run();
    expect_ok(&reference);
    // Logging, when asked for, goes to stderr and never touches stdout.
    for prog in [
        Run::path("/bin/echo").args(["hello", "world"]),
        stock("rt_errno"),
    ] {
        let quiet = prog.clone().run();
        let o = prog
            .runtime()
            .env("TOFFLOAD_FIBERIZE", "all")
            .env("TOFFLOAD_LOG", "debug")
            .run();
        show("TOFFLOAD_LOG=debug", &o);
        expect_ok(&o);
        let fields = |s: &str| {
            s.split_whitespace()
                .filter(|w| !w.starts_with("on_fiber="))
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        assert_eq!(fields(&o.stdout), fields(&quiet.stdout), "{}", o.report());
        assert_eq!(o.stdout.lines().count(), 1, "{}", o.report());
    }
    for (var, val) in [
        ("TOFFLOAD_FIBERIZE", "sometimes"),
        ("TOFFLOAD_CARRIERS", "0"),
        ("TOFFLOAD_CARRIERS", "two"),
        ("TOFFLOAD_STACK_KB", "8"),
        ("TOFFLOAD_STACK_KB", "64k"),
        ("TOFFLOAD_LOG", "verbose"),
        ("TOFFLOAD_OFFLOAD", "accel_run:accel_submit"),
        ("TOFFLOAD_TEST_DISABLE", "everything"),
    ] {
        let o = fibers("rt_errno").env(var, val).run();
        show(&format!("{var}={val}"), &o);
        expect_ok(&o);
        let lines: Vec<&str> = o.stderr.lines().collect();
        assert_eq!(
            lines.len(),
            1,
            "{var}={val}: expected one line on stderr: {}",
            o.report()
        );
        assert!(
            lines[0].contains(var),
            "{var}={val}: the line does not name {var}: {}",
            o.report()
        );
        // The runtime stays out of the way: real threads, the stock answer.
        assert_eq!(o.stdout, reference.stdout, "{}", o.report());
    }
}

// ---------------------------------------------------------------- idle poller

/// A /proc task's stat fields after the command name: [0] is the state, [11] and [12]
/// utime and stime, [38] the scheduling policy.
fn task_stat(pid: u32, tid: &str) -> Option<(String, Vec<String>)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    let open = s.find(" (")?;
    let close = s.rfind(')')?;
    let comm = s[open + 2..close].to_string();
    Some((
        comm,
        s[close + 1..]
            .split_whitespace()
            .map(String::from)
            .collect(),
    ))
}

/// The server's threads named `toffload-poll`, by tid.
fn pollers(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .map(|t| t.file_name().to_string_lossy().into_owned())
                .filter(|tid| task_stat(pid, tid).is_some_and(|(c, _)| c == "toffload-poll"))
                .collect()
        })
        .unwrap_or_default()
}

fn task_cpu_ticks(pid: u32, tid: &str) -> u64 {
    task_stat(pid, tid).map_or(0, |(_, f)| {
        f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0)
    })
}

/// What TOFFLOAD_IDLE_POLL=auto should choose here: a hypervisor, and a guest idle
/// loop that halts without polling first (runtime/src/idle_poll.rs).
fn host_halts_idle_vcpu() -> bool {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let hv = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .is_some_and(|l| l.split_whitespace().any(|f| f == "hypervisor"));
    let drv = std::fs::read_to_string("/sys/devices/system/cpu/cpuidle/current_driver")
        .unwrap_or_default();
    hv && drv.trim() != "haltpoll"
}

/// The idle poller (TOFFLOAD_IDLE_POLL) lives inside the server, so what must hold is
/// what keeps it harmless: it exists only when asked for (or, under auto, where the
/// host halts idle vCPUs), it runs at SCHED_IDLE on one core (the carrier's), it spins
/// while offloads are in flight, and once they stop it parks instead of burning the
/// core. Each check fails on a poller that lacks the property.
#[test]
fn idle_poller_spins_only_while_offloads_are_in_flight() {
    let _s = serial();
    if !ready(&["conn_server"]) {
        return;
    }
    // SAFETY: sysconf takes only a name.
    let hz = (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as f64;
    let auto = host_halts_idle_vcpu();
    println!("host halts idle vCPUs (auto turns the poller on): {auto}");
    // "": unset, the default (off). A mode whose poller spun too little is measured
    // again, once, at the end: the poller runs at SCHED_IDLE, and a host that slows
    // the server's 1 ms offloads to several ms (seen once in a full suite: 1,419 req/s,
    // p50 4.9 ms) leaves it less of the core.
    let mut modes: Vec<(&str, bool)> = ["on", "off", "auto", ""]
        .iter()
        .map(|&m| (m, false))
        .collect();
    let mut next = 0;
    while next < modes.len() {
        let (mode, again) = modes[next];
        next += 1;
        let mut s = start(preload::server_under_runtime(
            ServerSpec::new("conn_server")
                .env("TOFFLOAD_EMU_LAT_US", "1000")
                .env("TOFFLOAD_WAIT", "block")
                .env("TOFFLOAD_IDLE_POLL", mode),
        ));
        let pid = s.pid();
        // Offloads in flight for 1.5 s: 8 connections on a 1 ms device leave the
        // carrier asleep most of the time, which is when the poller spins.
        let load = std::thread::spawn({
            let port = s.port;
            move || load::run(&load_cfg(port, 8, 1.5)).expect("load run")
        });
        std::thread::sleep(Duration::from_millis(700));
        let during = pollers(pid);
        let t0 = during.iter().map(|t| task_cpu_ticks(pid, t)).sum::<u64>();
        let w0 = Instant::now();
        std::thread::sleep(Duration::from_millis(500));
        let spun = (during.iter().map(|t| task_cpu_ticks(pid, t)).sum::<u64>() - t0) as f64
            / hz
            / w0.elapsed().as_secs_f64();
        let placement: Vec<(String, String)> = during
            .iter()
            .map(|t| {
                let policy = task_stat(pid, t).map_or(String::new(), |(_, f)| f[38].clone());
                let status = std::fs::read_to_string(format!("/proc/{pid}/task/{t}/status"))
                    .unwrap_or_default();
                let cpus = status
                    .lines()
                    .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                    .unwrap_or("")
                    .trim()
                    .to_string();
                (policy, cpus)
            })
            .collect();
        let r = load.join().expect("load thread");
        assert_served(&mut s, &format!("TOFFLOAD_IDLE_POLL={mode}"), &r);
        println!(
            "TOFFLOAD_IDLE_POLL={mode}: pollers {during:?}, (policy, cpus) {placement:?}, \
             spun {:.0}% of a core under load",
            spun * 100.0
        );
        let want = match mode {
            "on" => true,
            "auto" => auto,
            _ => false,
        };
        if !want {
            assert!(during.is_empty(), "{mode}: a poller runs: {during:?}");
            assert!(pollers(pid).is_empty(), "{mode}: a poller started late");
            continue;
        }
        assert_eq!(
            during.len(),
            1,
            "{mode}: one carrier, one poller: {during:?}"
        );
        for (policy, cpus) in &placement {
            // SCHED_IDLE is policy 5: it never takes the core from the server.
            assert_eq!(policy, "5", "{mode}: poller policy");
            assert!(
                !cpus.is_empty() && !cpus.contains(',') && !cpus.contains('-'),
                "{mode}: the poller must be pinned to its carrier's core, allowed {cpus:?}"
            );
        }
        if spun <= 0.2 && !again {
            println!(
                "{mode}: the poller spun {:.0}% of a core at {:.0} req/s; measured again, once",
                spun * 100.0,
                r.requests_per_sec
            );
            modes.push((mode, true));
            continue;
        }
        assert!(
            spun > 0.2,
            "{mode}: the poller spun {:.0}% of a core while offloads were in flight",
            spun * 100.0
        );
        // Load over: nothing in flight, so after the linger it parks.
        std::thread::sleep(Duration::from_millis(300));
        let t1 = during.iter().map(|t| task_cpu_ticks(pid, t)).sum::<u64>();
        std::thread::sleep(Duration::from_millis(1000));
        let idle_ticks = during.iter().map(|t| task_cpu_ticks(pid, t)).sum::<u64>() - t1;
        let states: Vec<String> = during
            .iter()
            .filter_map(|t| task_stat(pid, t).map(|(_, f)| f[0].clone()))
            .collect();
        println!("{mode}: after the load, {idle_ticks} ticks in 1 s, states {states:?}");
        assert!(
            (idle_ticks as f64) / hz < 0.05,
            "{mode}: the poller kept spinning with nothing in flight: {idle_ticks} ticks in 1 s"
        );
        assert!(states.iter().all(|s| s == "S"), "{mode}: states {states:?}");
        s.expect_alive(mode);
    }
}
