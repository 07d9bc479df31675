//! The TOFFLOAD_* knobs, parsed strictly: a malformed value is an error naming the
//! variable and the accepted form. The runtime reports it once on stderr and then stays
//! out of the way (everything passes through to libc), so a typo cannot change how the
//! host program behaves beyond that one line.

use std::fmt;

/// Which threads become fibers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fiberize {
    /// Threads created after the process's first successful accept.
    AfterAccept,
    /// Every thread created after load.
    All,
    /// Never engage.
    Off,
}

/// TOFFLOAD_GUARD.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuardMode {
    Off,
    Detect,
    Enforce,
}

/// TOFFLOAD_GUARD_MECH: how detect mode sees writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuardMech {
    /// uffd-async where the kernel has it (and one carrier), else uffd; mprotect where
    /// uffd cannot register.
    Auto,
    /// userfaultfd write-protect, each first write a fault served by a handler thread.
    Uffd,
    /// userfaultfd asynchronous write-protect (UFFD_FEATURE_WP_ASYNC): the kernel
    /// resolves write faults itself; written pages are collected with PAGEMAP_SCAN.
    UffdAsync,
    Mprotect,
}

/// TOFFLOAD_IDLE_POLL: whether a SCHED_IDLE thread keeps a carrier's vCPU from halting
/// while its offloads are in flight (idle_poll.rs). Off by default: on a quiet host it
/// spends idle CPU for nothing (tests/results/model.md, README).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdlePoll {
    /// On under a hypervisor whose guest kernel does not poll before halting.
    Auto,
    On,
    Off,
}

/// TOFFLOAD_COMPLETIONS: how a parked offload on the built-in row learns that it is
/// done (offload.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completions {
    /// The backend's polled mode where it has one (accel_submit_polled): the carrier
    /// looks between fibers and sleeps until the due time; the device never wakes.
    Poll,
    /// The backend's completion fd, in each carrier's epoll.
    Signal,
}

/// TOFFLOAD_FIBER_TLS: whether each fiber gets its own copy of the application's
/// `__thread` variables (tls.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FiberTls {
    /// Copy, unless the objects' TLS exceeds tls::AUTO_MAX bytes.
    Auto,
    Copy,
    /// One block per carrier thread, shared by its fibers.
    Shared,
}

/// One TOFFLOAD_GUARD_REGIONS entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegionSpec {
    Symbol(String),
    /// [start, end)
    Range(usize, usize),
}

/// One row of the offload table: a blocking entry point and the non-blocking triple
/// that replaces it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadRow {
    pub blocking: String,
    pub submit: String,
    pub done: String,
    pub release: String,
    /// A built-in CUDA row: present only where the program has the CUDA library, so a
    /// missing symbol is expected, not an error.
    pub optional: bool,
}

/// Mitigations that TOFFLOAD_TEST_DISABLE can turn off to show the hazard each one
/// prevents. Test-only: never set it in production.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Disabled {
    pub errno: bool,
    pub keys: bool,
    pub sync: bool,
    pub io: bool,
    pub fork: bool,
    pub offload: bool,
    pub join: bool,
    /// The interposed fcntl, ioctl, setsockopt, close, dup* and socket calls leave the
    /// remembered fd facts alone (fd_facts.rs).
    pub fdfacts: bool,
    /// Enforce does not look for ownership cycles (a cycle then waits for the last
    /// resort, guard/own.rs).
    pub guardcycle: bool,
    /// No blocked-carrier handoff: a carrier stuck in a call the runtime does not see
    /// keeps its other fibers (handoff.rs).
    pub handoff: bool,
    /// C++ thread_local destructors registered on a fiber go to glibc's list of its
    /// carrier thread (thread_dtors.rs).
    pub tlsdtors: bool,
    /// A carrier thread's copied TLS blocks keep the last parked fiber's values
    /// between fibers instead of the thread's own (tls.rs): what the scheduler runs
    /// there, a polled completion's library, writes into a copy the next fiber
    /// overwrites.
    pub carriertls: bool,
    /// Every read that returns data counts as leaving its socket empty, whatever
    /// TCP_INQ says (drain.rs): a pipelined request then waits for the recheck.
    pub inq: bool,
    /// The interposed recvmsg leaves TCP_INQ on: the application's control buffer
    /// then gets the runtime's TCP_CM_INQ message (drain.rs).
    pub inqguard: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub fiberize: Fiberize,
    pub carriers: usize,
    pub stack_kb: usize,
    pub offload: Vec<OffloadRow>,
    /// TOFFLOAD_CUDA_ROWS: whether the built-in CUDA rows are added to `offload`.
    pub cuda_rows: bool,
    pub log: u8,
    pub stats: Option<String>,
    pub disabled: Disabled,
    pub guard: GuardMode,
    pub guard_mech: GuardMech,
    pub guard_regions: Vec<RegionSpec>,
    /// TOFFLOAD_GUARD_SAMPLE: the share of time, percent, detect watches (100: all of
    /// it, exact). Enforce ignores it (it must see every access).
    pub guard_sample: u8,
    pub idle_poll: IdlePoll,
    /// TOFFLOAD_SPIN_WAITS: whether a carrier spins through a timed wait shorter than
    /// what a timed sleep overshoots on this host (carrier.rs, `SleepCost`).
    pub spin_waits: bool,
    pub completions: Completions,
    /// TOFFLOAD_TCP_INQ: whether reads on TCP sockets learn that they left the socket
    /// empty, so that the next read parks without asking (drain.rs).
    pub tcp_inq: bool,
    /// TOFFLOAD_HANDOFF_US: how long a carrier may stay in application code, with
    /// other fibers waiting for it, before its fibers move to a spare thread.
    pub handoff_us: u64,
    /// TOFFLOAD_HANDOFF_MAX_SPARES: spare threads the handoff may start.
    pub handoff_max_spares: usize,
    pub fiber_tls: FiberTls,
}

/// TOFFLOAD_HANDOFF_US's default: the monitor's cost while carriers are awake doubles
/// as it halves, and each wait below libc costs about this much (measured in
/// docs/architecture.md, "Blocked-carrier handoff").
pub const DEFAULT_HANDOFF_US: u64 = 2000;

/// TOFFLOAD_GUARD_SAMPLE's default: the largest share at which detect's overhead on
/// hostile_server at 200 us stays within 10% (tests/results/guard.md).
pub const DEFAULT_GUARD_SAMPLE: u8 = 25;

impl Default for Config {
    fn default() -> Self {
        Config {
            fiberize: Fiberize::AfterAccept,
            carriers: 1,
            stack_kb: 256,
            offload: vec![OffloadRow::builtin()],
            cuda_rows: true,
            log: crate::log::OFF,
            stats: None,
            disabled: Disabled::default(),
            guard: GuardMode::Off,
            guard_mech: GuardMech::Auto,
            guard_regions: Vec::new(),
            guard_sample: DEFAULT_GUARD_SAMPLE,
            idle_poll: IdlePoll::Off,
            spin_waits: true,
            completions: Completions::Poll,
            tcp_inq: true,
            handoff_us: DEFAULT_HANDOFF_US,
            handoff_max_spares: 64,
            fiber_tls: FiberTls::Auto,
        }
    }
}

impl OffloadRow {
    pub fn builtin() -> Self {
        OffloadRow {
            blocking: "accel_run".into(),
            submit: "accel_submit".into(),
            done: "accel_done".into(),
            release: "accel_release".into(),
            optional: false,
        }
    }

    /// The built-in CUDA rows (cuda_rows.rs), after the user's rows; a user's row for
    /// the same function replaces the built-in one.
    fn cuda(user: &[OffloadRow]) -> impl Iterator<Item = OffloadRow> + '_ {
        crate::cuda_rows::ROWS
            .iter()
            .filter(|c| !user.iter().any(|u| u.blocking == c.blocking))
            .map(|c| OffloadRow {
                blocking: c.blocking.into(),
                submit: crate::cuda_rows::SUBMIT.into(),
                done: c.done.into(),
                release: crate::cuda_rows::RELEASE.into(),
                optional: true,
            })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnobError {
    pub var: &'static str,
    pub value: String,
    pub expected: &'static str,
}

impl fmt::Display for KnobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={:?} is not valid: expected {}",
            self.var, self.value, self.expected
        )
    }
}

/// Most rows a process can add (the table holds the built-in row as well).
pub const MAX_EXTRA_ROWS: usize = 15;
/// The rows besides accel_run: the user's and the built-in CUDA ones.
pub const MAX_TABLE_ROWS: usize = MAX_EXTRA_ROWS + crate::cuda_rows::ROWS.len();

fn int_in(s: &str, lo: u64, hi: u64) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let v: u64 = s.parse().ok()?;
    (lo..=hi).contains(&v).then_some(v)
}

fn is_symbol(s: &str) -> bool {
    let mut b = s.bytes();
    matches!(b.next(), Some(c) if c == b'_' || c.is_ascii_alphabetic())
        && b.all(|c| c == b'_' || c.is_ascii_alphanumeric())
}

fn parse_rows(s: &str) -> Option<Vec<OffloadRow>> {
    let mut rows = Vec::new();
    for part in s.split(',') {
        let f: Vec<&str> = part.trim().split(':').collect();
        if f.len() != 4 || !f.iter().all(|x| is_symbol(x)) {
            return None;
        }
        rows.push(OffloadRow {
            blocking: f[0].into(),
            submit: f[1].into(),
            done: f[2].into(),
            release: f[3].into(),
            optional: false,
        });
    }
    (rows.len() <= MAX_EXTRA_ROWS).then_some(rows)
}

fn hex(s: &str) -> Option<usize> {
    usize::from_str_radix(s.strip_prefix("0x")?, 16).ok()
}

fn parse_regions(s: &str) -> Option<Vec<RegionSpec>> {
    s.split(',')
        .map(|w| {
            let w = w.trim();
            if let Some((a, b)) = w.split_once('-') {
                let (a, b) = (hex(a)?, hex(b)?);
                (b > a).then_some(RegionSpec::Range(a, b))
            } else if let Some((a, n)) = w.split_once('+') {
                let a = hex(a)?;
                let n: usize = n.parse().ok().filter(|&n| n > 0)?;
                Some(RegionSpec::Range(a, a.checked_add(n)?))
            } else if is_symbol(w) {
                Some(RegionSpec::Symbol(w.into()))
            } else {
                None
            }
        })
        .collect()
}

fn parse_disabled(s: &str) -> Option<Disabled> {
    let mut d = Disabled::default();
    for w in s.split(',') {
        match w.trim() {
            "errno" => d.errno = true,
            "keys" => d.keys = true,
            "sync" => d.sync = true,
            "io" => d.io = true,
            "fork" => d.fork = true,
            "offload" => d.offload = true,
            "join" => d.join = true,
            "fdfacts" => d.fdfacts = true,
            "guardcycle" => d.guardcycle = true,
            "handoff" => d.handoff = true,
            "tlsdtors" => d.tlsdtors = true,
            "carriertls" => d.carriertls = true,
            "inq" => d.inq = true,
            "inqguard" => d.inqguard = true,
            _ => return None,
        }
    }
    Some(d)
}

/// Where a knob is documented (docs/configuration.md has one table per section).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    Runtime,
    Guard,
}

/// One knob: the single source of its parsing, its error message and its line in
/// docs/configuration.md (`docs_table`, checked by a test).
pub struct Knob {
    pub var: &'static str,
    /// As the docs show it.
    pub default: &'static str,
    /// The accepted form, in the error message and the docs.
    pub form: &'static str,
    pub doc: &'static str,
    pub section: Section,
    /// Sets the knob from its (non-empty) value; false when malformed.
    set: fn(&mut Config, &str) -> bool,
}

/// `v` as one of `names`, for an enum knob.
fn one_of<T: Copy>(v: &str, names: &[(&str, T)]) -> Option<T> {
    names.iter().find(|(n, _)| *n == v).map(|(_, t)| *t)
}

/// Every knob, in the order they are checked (the first malformed one is reported).
pub const KNOBS: &[Knob] = &[
    Knob {
        var: "TOFFLOAD_FIBERIZE",
        default: "after-accept",
        form: "`after-accept`, `all` or `off`",
        doc: "which threads become fibers",
        section: Section::Runtime,
        set: |c, v| {
            let m = [
                ("after-accept", Fiberize::AfterAccept),
                ("all", Fiberize::All),
                ("off", Fiberize::Off),
            ];
            one_of(v.trim(), &m).map(|x| c.fiberize = x).is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_CARRIERS",
        default: "1",
        form: "an integer from 1 to 64",
        doc: "carrier threads",
        section: Section::Runtime,
        set: |c, v| {
            int_in(v.trim(), 1, 64)
                .map(|n| c.carriers = n as usize)
                .is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_STACK_KB",
        default: "256",
        form: "a stack size in KiB, an integer from 16 to 1048576",
        doc: "fiber stack size (the application's own, if larger)",
        section: Section::Runtime,
        set: |c, v| {
            int_in(v.trim(), 16, 1 << 20)
                .map(|n| c.stack_kb = n as usize)
                .is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_OFFLOAD",
        default: "(none)",
        form: "comma-separated rows blocking:submit:done:release of C symbol names (at most 15)",
        doc: "extra offload rows: the blocking function's calls are rerouted through the GOT \
              of every object loaded at start; up to six integer/pointer arguments, passed \
              unchanged to submit; done returns 1/0/-errno",
        section: Section::Runtime,
        set: |c, v| parse_rows(v.trim()).map(|r| c.offload.extend(r)).is_some(),
    },
    Knob {
        var: "TOFFLOAD_CUDA_ROWS",
        default: "on",
        form: "`on` or `off`",
        doc: "the built-in rows for `cudaStreamSynchronize`, `cudaEventSynchronize`, \
              `cuStreamSynchronize` and `cuEventSynchronize` (a fiber parks until the stream \
              or event query says done; see [cuda.md](cuda.md#gpu-waits-in-your-own-server)); \
              they apply only where the program links the CUDA library, and a \
              `TOFFLOAD_OFFLOAD` row for the same function replaces them",
        section: Section::Runtime,
        set: |c, v| {
            one_of(v.trim(), &[("on", true), ("off", false)])
                .map(|x| c.cuda_rows = x)
                .is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_LOG",
        default: "silent",
        form: "`error`, `info` or `debug`",
        doc: "log on stderr",
        section: Section::Runtime,
        set: |c, v| {
            let m = [
                ("error", crate::log::ERROR),
                ("info", crate::log::INFO),
                ("debug", crate::log::DEBUG),
            ];
            one_of(v.trim(), &m).map(|x| c.log = x).is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_COMPLETIONS",
        default: "poll",
        form: "`poll` or `signal`",
        doc: "how a parked offload of accel_run learns it is done: poll (the backend's polled \
              mode, where it has one: the carrier looks between fibers and sleeps until the \
              due time, and the device spends no wake-up) or signal (the backend's completion \
              fd)",
        section: Section::Runtime,
        set: |c, v| {
            let m = [("poll", Completions::Poll), ("signal", Completions::Signal)];
            one_of(v.trim(), &m).map(|x| c.completions = x).is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_TCP_INQ",
        default: "on",
        form: "`on` or `off`",
        doc: "a fiber's reads on a TCP socket ask the kernel (TCP_INQ) whether they left it \
              empty, and the next blocking read then parks without the recv that would say \
              EAGAIN; the application's own recvmsg with a control buffer turns it off on \
              that socket first. Off where a socket is handed to an exec'd program that \
              reads control messages on it",
        section: Section::Runtime,
        set: |c, v| {
            one_of(v.trim(), &[("on", true), ("off", false)])
                .map(|x| c.tcp_inq = x)
                .is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_IDLE_POLL",
        default: "off",
        form: "`auto`, `on` or `off`",
        doc: "a SCHED_IDLE thread per carrier keeps its vCPU from halting while offloads are \
              in flight (auto: on under a hypervisor whose guest does not poll before halting)",
        section: Section::Runtime,
        set: |c, v| {
            let m = [
                ("auto", IdlePoll::Auto),
                ("on", IdlePoll::On),
                ("off", IdlePoll::Off),
            ];
            one_of(v.trim(), &m).map(|x| c.idle_poll = x).is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_SPIN_WAITS",
        default: "auto",
        form: "`auto` or `off`",
        doc: "auto: a carrier whose next wake-up is due sooner than its timed sleeps \
              overshoot their deadline (measured as it runs; at most 100 us) spins \
              instead, polling I/O as it does; off: it always sleeps",
        section: Section::Runtime,
        set: |c, v| {
            one_of(v.trim(), &[("auto", true), ("off", false)])
                .map(|x| c.spin_waits = x)
                .is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_HANDOFF_US",
        default: "2000",
        form: "microseconds, an integer from 100 to 10000000",
        doc: "how long a carrier may stay inside a call the runtime does not see (a raw futex, \
              io_uring_enter, a driver ioctl) while its other fibers wait, before they move to \
              a spare thread",
        section: Section::Runtime,
        set: |c, v| {
            int_in(v.trim(), 100, 10_000_000)
                .map(|n| c.handoff_us = n)
                .is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_HANDOFF_MAX_SPARES",
        default: "64",
        form: "an integer from 0 to 256 (0: no handoff)",
        doc: "spare threads the blocked-carrier handoff may start, never more than the live \
              fibers; the process has at most carriers + that many runtime threads running \
              fibers. Each fiber waiting below libc at the same time holds one: a cap below \
              the number that can wait at once can freeze the server when all of them wait",
        section: Section::Runtime,
        set: |c, v| {
            int_in(v.trim(), 0, 256)
                .map(|n| c.handoff_max_spares = n as usize)
                .is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_FIBER_TLS",
        default: "auto",
        form: "`auto`, `copy` or `shared`",
        doc: "the application's own `__thread` variables (those of every object loaded at \
              start but libc and ld.so): `copy` gives each fiber its own, copied into its \
              carrier thread's blocks when it runs and back when it parks; `shared` leaves \
              one set per carrier thread to all its fibers; auto: copy up to 2 KiB of them \
              (a park + resume stays under 200 ns), share more",
        section: Section::Runtime,
        set: |c, v| {
            let m = [
                ("auto", FiberTls::Auto),
                ("copy", FiberTls::Copy),
                ("shared", FiberTls::Shared),
            ];
            one_of(v.trim(), &m).map(|x| c.fiber_tls = x).is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_STATS",
        default: "(none)",
        form: "a path (`%p` = pid)",
        doc: "a one-line JSON of the runtime's counters, kept up to date (every 50 ms while \
              they change, and at exit)",
        section: Section::Runtime,
        set: |c, v| {
            c.stats = Some(v.to_string());
            true
        },
    },
    Knob {
        var: "TOFFLOAD_TEST_DISABLE",
        default: "(none)",
        form: "a comma-separated list of errno, keys, sync, io, fork, offload, join, fdfacts, \
               guardcycle, handoff, tlsdtors, carriertls, inq, inqguard (tests only)",
        doc: "tests only: turn a mitigation off to show the hazard it prevents",
        section: Section::Runtime,
        set: |c, v| parse_disabled(v.trim()).map(|d| c.disabled = d).is_some(),
    },
    Knob {
        var: "TOFFLOAD_GUARD",
        default: "off",
        form: "`off`, `detect` or `enforce`",
        doc: "the guard's mode",
        section: Section::Guard,
        set: |c, v| {
            let m = [
                ("off", GuardMode::Off),
                ("detect", GuardMode::Detect),
                ("enforce", GuardMode::Enforce),
            ];
            one_of(v.trim(), &m).map(|x| c.guard = x).is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_GUARD_MECH",
        default: "auto",
        form: "`auto`, `uffd-async`, `uffd` or `mprotect`",
        doc: "how detect sees writes (auto: uffd-async on Linux 6.7+ with one carrier, else \
              uffd; mprotect where uffd cannot register)",
        section: Section::Guard,
        set: |c, v| {
            let m = [
                ("auto", GuardMech::Auto),
                ("uffd", GuardMech::Uffd),
                ("uffd-async", GuardMech::UffdAsync),
                ("mprotect", GuardMech::Mprotect),
            ];
            one_of(v.trim(), &m).map(|x| c.guard_mech = x).is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_GUARD_REGIONS",
        default: "(none)",
        form: "comma-separated symbol names or address ranges 0xSTART-0xEND or 0xSTART+LEN",
        doc: "more memory to guard",
        section: Section::Guard,
        set: |c, v| {
            parse_regions(v.trim())
                .map(|r| c.guard_regions = r)
                .is_some()
        },
    },
    Knob {
        var: "TOFFLOAD_GUARD_SAMPLE",
        default: "25",
        form: "a percentage of the time detect watches, an integer from 1 to 100",
        doc: "the share of time detect watches, percent (100: exact; enforce ignores it)",
        section: Section::Guard,
        set: |c, v| {
            int_in(v.trim(), 1, 100)
                .map(|n| c.guard_sample = n as u8)
                .is_some()
        },
    },
];

/// The markdown table of one section's knobs, as docs/configuration.md shows it.
pub fn docs_table(section: Section) -> String {
    let mut t = String::from("| variable | default | accepted | meaning |\n|---|---|---|---|\n");
    for k in KNOBS.iter().filter(|k| k.section == section) {
        t += &format!("| {} | {} | {} | {} |\n", k.var, k.default, k.form, k.doc);
    }
    t
}

impl Config {
    /// Reads the knobs through `get` (the environment, or a map in tests). Unset and
    /// empty mean the default.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Config, KnobError> {
        let mut c = Config::default();
        for k in KNOBS {
            let Some(v) = get(k.var).filter(|v| !v.trim().is_empty()) else {
                continue;
            };
            if !(k.set)(&mut c, &v) {
                return Err(KnobError {
                    var: k.var,
                    value: v,
                    expected: k.form,
                });
            }
        }
        if c.cuda_rows {
            let cuda: Vec<OffloadRow> = OffloadRow::cuda(&c.offload[1..]).collect();
            c.offload.extend(cuda);
        }
        Ok(c)
    }

    pub fn from_env() -> Result<Config, KnobError> {
        Config::from_lookup(&|k| std::env::var(k).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, KnobError> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&move |k| m.get(k).cloned())
    }

    #[test]
    fn the_docs_show_every_knob_as_the_table_says() {
        let docs = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/configuration.md"
        ))
        .expect("docs/configuration.md");
        for s in [Section::Runtime, Section::Guard] {
            let t = docs_table(s);
            assert!(
                docs.contains(&t),
                "docs/configuration.md lacks the {s:?} knobs as config.rs has them; \
                 put this table there:\n{t}"
            );
        }
    }

    #[test]
    fn defaults() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c.fiberize, Fiberize::AfterAccept);
        assert_eq!((c.carriers, c.stack_kb), (1, 256));
        assert_eq!(c.offload[0], OffloadRow::builtin());
        let cuda: Vec<&str> = c.offload[1..].iter().map(|r| r.blocking.as_str()).collect();
        assert_eq!(cuda.len(), crate::cuda_rows::ROWS.len());
        assert!(cuda.contains(&"cudaStreamSynchronize"), "{cuda:?}");
        assert!(c.offload[1..].iter().all(|r| r.optional));
        assert_eq!(c.disabled, Disabled::default());
        let off = cfg(&[("TOFFLOAD_CUDA_ROWS", "off")]).unwrap();
        assert_eq!(off.offload, vec![OffloadRow::builtin()]);
        assert!(cfg(&[("TOFFLOAD_CUDA_ROWS", "yes")]).is_err());
    }

    #[test]
    fn parses_every_knob() {
        let c = cfg(&[
            ("TOFFLOAD_FIBERIZE", "all"),
            ("TOFFLOAD_CARRIERS", "2"),
            ("TOFFLOAD_STACK_KB", "64"),
            ("TOFFLOAD_OFFLOAD", "hsm_sign:hsm_submit:hsm_poll:hsm_free"),
            ("TOFFLOAD_LOG", "info"),
            ("TOFFLOAD_STATS", "/tmp/s.json"),
            ("TOFFLOAD_TEST_DISABLE", "errno,sync"),
        ])
        .unwrap();
        assert_eq!(c.fiberize, Fiberize::All);
        assert_eq!((c.carriers, c.stack_kb), (2, 64));
        assert_eq!(c.offload.len(), 2 + crate::cuda_rows::ROWS.len());
        assert_eq!(c.offload[1].done, "hsm_poll");
        assert!(!c.offload[1].optional);
        // A user's row for a CUDA wait replaces the built-in one.
        let own = "cuStreamSynchronize:my_submit:my_done:my_free";
        let mine = cfg(&[("TOFFLOAD_OFFLOAD", own)]).unwrap();
        let named: Vec<_> = mine
            .offload
            .iter()
            .filter(|r| r.blocking == "cuStreamSynchronize")
            .collect();
        assert_eq!(named.len(), 1);
        assert_eq!(named[0].done, "my_done");
        assert_eq!(c.log, crate::log::INFO);
        assert!(c.disabled.errno && c.disabled.sync && !c.disabled.keys);
    }

    #[test]
    fn rejects_malformed_values_naming_the_variable() {
        for (var, v) in [
            ("TOFFLOAD_FIBERIZE", "sometimes"),
            ("TOFFLOAD_CARRIERS", "0"),
            ("TOFFLOAD_CARRIERS", "65"),
            ("TOFFLOAD_CARRIERS", "two"),
            ("TOFFLOAD_STACK_KB", "8"),
            ("TOFFLOAD_STACK_KB", "-1"),
            ("TOFFLOAD_OFFLOAD", "a:b:c"),
            ("TOFFLOAD_OFFLOAD", "a:b:c:1d"),
            ("TOFFLOAD_LOG", "loud"),
            ("TOFFLOAD_TEST_DISABLE", "everything"),
            ("TOFFLOAD_GUARD", "on"),
            ("TOFFLOAD_GUARD_MECH", "ebpf"),
            ("TOFFLOAD_GUARD_SAMPLE", "0"),
            ("TOFFLOAD_GUARD_SAMPLE", "101"),
            ("TOFFLOAD_GUARD_SAMPLE", "abc"),
            ("TOFFLOAD_GUARD_SAMPLE", "25%"),
            ("TOFFLOAD_GUARD_SAMPLE", "-5"),
            ("TOFFLOAD_GUARD_REGIONS", "0x2000-0x1000"),
            ("TOFFLOAD_GUARD_REGIONS", "not a symbol"),
            ("TOFFLOAD_COMPLETIONS", "interrupt"),
            ("TOFFLOAD_IDLE_POLL", "yes"),
            ("TOFFLOAD_IDLE_POLL", "1"),
            ("TOFFLOAD_FIBER_TLS", "on"),
        ] {
            let e = cfg(&[(var, v)]).unwrap_err();
            assert_eq!(e.var, var);
            let msg = e.to_string();
            assert!(msg.contains(var) && msg.contains("expected"), "{msg}");
        }
    }

    #[test]
    fn guard_knobs() {
        let c = cfg(&[
            ("TOFFLOAD_GUARD", "enforce"),
            ("TOFFLOAD_GUARD_MECH", "mprotect"),
            (
                "TOFFLOAD_GUARD_REGIONS",
                "shared_counter, 0x1000-0x3000,0x5000+4096",
            ),
        ])
        .unwrap();
        assert_eq!(c.guard, GuardMode::Enforce);
        assert_eq!(c.guard_mech, GuardMech::Mprotect);
        assert_eq!(
            c.guard_regions,
            vec![
                RegionSpec::Symbol("shared_counter".into()),
                RegionSpec::Range(0x1000, 0x3000),
                RegionSpec::Range(0x5000, 0x6000),
            ]
        );
        assert_eq!(cfg(&[]).unwrap().guard, GuardMode::Off);
        assert_eq!(cfg(&[]).unwrap().guard_mech, GuardMech::Auto);
        assert_eq!(cfg(&[]).unwrap().guard_sample, DEFAULT_GUARD_SAMPLE);
        for (v, want) in [("1", 1), ("25", 25), (" 100 ", 100)] {
            assert_eq!(
                cfg(&[("TOFFLOAD_GUARD_SAMPLE", v)]).unwrap().guard_sample,
                want
            );
        }
        assert_eq!(
            cfg(&[("TOFFLOAD_GUARD_MECH", "uffd-async")])
                .unwrap()
                .guard_mech,
            GuardMech::UffdAsync
        );
    }

    #[test]
    fn completions_knob() {
        assert_eq!(cfg(&[]).unwrap().completions, Completions::Poll);
        for (v, want) in [
            ("poll", Completions::Poll),
            (" signal ", Completions::Signal),
        ] {
            assert_eq!(
                cfg(&[("TOFFLOAD_COMPLETIONS", v)]).unwrap().completions,
                want
            );
        }
    }

    #[test]
    fn idle_poll_knob() {
        assert_eq!(cfg(&[]).unwrap().idle_poll, IdlePoll::Off);
        for (v, want) in [
            ("auto", IdlePoll::Auto),
            ("on", IdlePoll::On),
            (" off ", IdlePoll::Off),
        ] {
            assert_eq!(cfg(&[("TOFFLOAD_IDLE_POLL", v)]).unwrap().idle_poll, want);
        }
    }

    #[test]
    fn spin_waits_knob() {
        assert!(cfg(&[]).unwrap().spin_waits);
        assert!(cfg(&[("TOFFLOAD_SPIN_WAITS", "auto")]).unwrap().spin_waits);
        assert!(!cfg(&[("TOFFLOAD_SPIN_WAITS", " off ")]).unwrap().spin_waits);
        assert!(cfg(&[("TOFFLOAD_SPIN_WAITS", "on")]).is_err());
    }

    #[test]
    fn fiber_tls_knob() {
        assert_eq!(cfg(&[]).unwrap().fiber_tls, FiberTls::Auto);
        for (v, want) in [
            ("auto", FiberTls::Auto),
            (" copy", FiberTls::Copy),
            ("shared", FiberTls::Shared),
        ] {
            assert_eq!(cfg(&[("TOFFLOAD_FIBER_TLS", v)]).unwrap().fiber_tls, want);
        }
    }

    #[test]
    fn empty_means_default() {
        assert_eq!(cfg(&[("TOFFLOAD_CARRIERS", " ")]).unwrap().carriers, 1);
    }
}
