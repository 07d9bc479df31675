//! The health window after an injection: "listening again with the runtime active" is
//! where the relaunch is ready, not where it is proven. For a while after, the
//! injected server must stay alive, keep its listening sockets, keep its runtime
//! active and, when it had requests before, serve some; if it does not, the watch
//! rolls back to the original command. This is the pure state machine; the session
//! feeds it what it observes.

use std::time::{Duration, Instant};

/// The default length of the window (`--inject-health`).
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(5);

/// The read calls of `pid` so far (syscr of /proc/PID/io), when readable.
pub fn read_calls(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("syscr:"))?
        .trim()
        .parse()
        .ok()
}

/// What the session saw of the injected server at one poll.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    /// Some(how) once it has exited (its wait status, or "exited").
    pub exited: Option<String>,
    /// Ports it listened on before the injection and no longer does; None: its
    /// sockets were not looked at this time.
    pub missing_ports: Option<Vec<u16>>,
    /// Its runtime turned itself off after starting (TOFFLOAD_* knob re-read, fault).
    pub runtime_disabled: bool,
}

/// Why the injected server is judged sick.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sick {
    Exited(String),
    StoppedListening(Vec<u16>),
    RuntimeDisabled,
    /// It had requests before, and in the windows of its health window it served none.
    NoRequests {
        windows: usize,
    },
}

impl std::fmt::Display for Sick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sick::Exited(how) => write!(f, "it exited ({how})"),
            Sick::StoppedListening(p) => write!(f, "it stopped listening on port {p:?}"),
            Sick::RuntimeDisabled => write!(f, "its runtime disabled itself"),
            Sick::NoRequests { windows } => write!(
                f,
                "it served no request in {windows} window(s), where the original served \
                 requests"
            ),
        }
    }
}

/// Where the health window stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    Pending,
    Healthy,
    Sick(Sick),
}

/// One health window.
#[derive(Clone, Debug)]
pub struct Health {
    since: Instant,
    limit: Duration,
    /// The original served requests before: the injected one must serve some.
    expect_requests: bool,
    windows: usize,
    windows_with_requests: usize,
    /// Its read calls (/proc/PID/io syscr) when first looked at, and whether they
    /// moved since: the kernel's own evidence that requests arrive, for when the
    /// watch's count cannot see them (a window whose traced slice held none, the
    /// runtime's counters not located): a server is not rolled back for the watch's
    /// blind spot.
    reads_first: Option<u64>,
    reads_moved: bool,
    /// Since when a port has been missing (LISTEN_CONFIRM).
    missing_since: Option<Instant>,
}

/// A lost listener is judged when it is still lost this long after it was first
/// seen lost (the session looks every 100 ms): an exiting process closes its sockets
/// before its last thread becomes a zombie, and a look in between called a crash a
/// lost socket.
const LISTEN_CONFIRM: Duration = Duration::from_millis(100);

impl Health {
    pub fn new(since: Instant, limit: Duration, expect_requests: bool) -> Health {
        Health {
            since,
            limit,
            expect_requests,
            windows: 0,
            windows_with_requests: 0,
            reads_first: None,
            reads_moved: false,
            missing_since: None,
        }
    }

    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// A watch window of the injected server ended; `served`: it counted requests
    /// (traced, or in its untraced part: a sampled window may trace none).
    pub fn window(&mut self, served: bool) {
        self.windows += 1;
        if served {
            self.windows_with_requests += 1;
        }
    }

    /// Its read calls so far (syscr of /proc/PID/io).
    pub fn reads(&mut self, n: u64) {
        match self.reads_first {
            None => self.reads_first = Some(n),
            Some(first) if n > first => self.reads_moved = true,
            Some(_) => {}
        }
    }

    /// The verdict at `now`. A crash, a lost socket or a disabled runtime fail at
    /// once; requests are judged at the end, over whole windows: the window ends no
    /// sooner than one watch window in it has ended, so that "no requests" is never
    /// decided on none.
    pub fn check(&mut self, now: Instant, o: &Observed) -> Check {
        if let Some(how) = &o.exited {
            return Check::Sick(Sick::Exited(how.clone()));
        }
        match &o.missing_ports {
            Some(m) if !m.is_empty() => {
                let since = *self.missing_since.get_or_insert(now);
                if now.duration_since(since) >= LISTEN_CONFIRM {
                    return Check::Sick(Sick::StoppedListening(m.clone()));
                }
                return Check::Pending;
            }
            Some(_) => self.missing_since = None,
            None => {}
        }
        if o.runtime_disabled {
            return Check::Sick(Sick::RuntimeDisabled);
        }
        if now.duration_since(self.since) < self.limit {
            return Check::Pending;
        }
        if !self.expect_requests {
            return Check::Healthy;
        }
        match (self.windows, self.windows_with_requests) {
            (0, _) => Check::Pending,
            (w, 0) if !self.reads_moved => Check::Sick(Sick::NoRequests { windows: w }),
            _ => Check::Healthy,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_healthy_server_passes_after_the_window() {
        let t0 = Instant::now();
        let mut h = Health::new(t0, Duration::from_secs(5), true);
        let ok = Observed::default();
        assert_eq!(h.check(t0 + Duration::from_secs(1), &ok), Check::Pending);
        h.window(false);
        h.window(true);
        assert_eq!(h.check(t0 + Duration::from_secs(4), &ok), Check::Pending);
        assert_eq!(h.check(t0 + Duration::from_secs(5), &ok), Check::Healthy);
    }

    #[test]
    fn failures() {
        let t0 = Instant::now();
        let mut h = Health::new(t0, Duration::from_secs(5), true);
        let crashed = Observed {
            exited: Some("signal 6 (SIGABRT)".into()),
            ..Default::default()
        };
        assert!(matches!(
            h.check(t0 + Duration::from_millis(10), &crashed),
            Check::Sick(Sick::Exited(_))
        ));
        let deaf = Observed {
            missing_ports: Some(vec![8080]),
            ..Default::default()
        };
        // Judged on the second look: the first may fall between an exiting process's
        // closed sockets and its exit.
        assert_eq!(h.check(t0, &deaf), Check::Pending);
        assert_eq!(
            h.check(t0 + Duration::from_millis(100), &deaf),
            Check::Sick(Sick::StoppedListening(vec![8080]))
        );
        let off = Observed {
            runtime_disabled: true,
            ..Default::default()
        };
        assert_eq!(h.check(t0, &off), Check::Sick(Sick::RuntimeDisabled));
        // No window yet at the end: wait for one; then none with requests is sick.
        let ok = Observed::default();
        assert_eq!(h.check(t0 + Duration::from_secs(6), &ok), Check::Pending);
        h.window(false);
        h.window(false);
        assert_eq!(
            h.check(t0 + Duration::from_secs(6), &ok),
            Check::Sick(Sick::NoRequests { windows: 2 })
        );
        // The watch counted none, but the kernel saw it read: not rolled back.
        let mut blind = h.clone();
        blind.reads(100);
        blind.reads(100);
        assert!(matches!(
            blind.check(t0 + Duration::from_secs(6), &ok),
            Check::Sick(_)
        ));
        blind.reads(250);
        assert_eq!(
            blind.check(t0 + Duration::from_secs(6), &ok),
            Check::Healthy
        );
        // Ports lost, then the process gone: a crash, not a lost socket; ports lost
        // and back: nothing.
        let mut dying = Health::new(t0, Duration::from_secs(5), true);
        assert_eq!(dying.check(t0, &deaf), Check::Pending);
        assert!(matches!(
            dying.check(t0 + Duration::from_millis(100), &crashed),
            Check::Sick(Sick::Exited(_))
        ));
        let mut blip = Health::new(t0, Duration::from_secs(5), true);
        let back = Observed {
            missing_ports: Some(vec![]),
            ..Default::default()
        };
        assert_eq!(blip.check(t0, &deaf), Check::Pending);
        assert_eq!(
            blip.check(t0 + Duration::from_millis(100), &back),
            Check::Pending
        );
        assert_eq!(
            blip.check(t0 + Duration::from_millis(200), &deaf),
            Check::Pending
        );
        // Idle before (forced on an idle server): idle after is fine.
        let mut idle = Health::new(t0, Duration::from_secs(5), false);
        assert_eq!(idle.check(t0 + Duration::from_secs(5), &ok), Check::Healthy);
        // A zero window on an idle server: healthy at once, unless it already died.
        let mut none = Health::new(t0, Duration::ZERO, false);
        assert_eq!(none.check(t0, &ok), Check::Healthy);
        assert!(matches!(none.check(t0, &crashed), Check::Sick(_)));
    }
}
