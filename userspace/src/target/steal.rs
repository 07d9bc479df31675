//! The hypervisor's steal on the target's cores (/proc/stat): on a VM, the time the
//! host gave those vCPUs to other guests. A CPU-bound stock server's rate is what the
//! cores it got allowed; the fibers get no more of them, so the model takes the
//! cores' capacity less what was stolen while the window was measured (11% steal
//! made a 400 us-CPU server behind the wall read as a 1.15x gain).

/// Steal, idle (iowait included) and all time of some CPUs, in clock ticks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ticks {
    pub steal: u64,
    pub idle: u64,
    pub total: u64,
}

/// The `cpuN` lines of /proc/stat for `cpus`, summed; None when one is missing.
/// Fields: user nice system idle iowait irq softirq steal (guest time is already in
/// user and nice).
pub fn parse(stat: &str, cpus: &[usize]) -> Option<Ticks> {
    let mut t = Ticks::default();
    for &cpu in cpus {
        let name = format!("cpu{cpu}");
        let line = stat
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name.as_str()))?;
        let f: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|v| v.parse().ok())
            .collect::<Option<_>>()?;
        if f.len() < 8 {
            return None;
        }
        t.steal += f[7];
        t.idle += f[3] + f[4];
        t.total += f.iter().sum::<u64>();
    }
    (!cpus.is_empty()).then_some(t)
}

/// Steal shares between successive reads.
#[derive(Debug)]
pub struct Meter {
    cpus: Vec<usize>,
    last: Option<Ticks>,
}

impl Meter {
    pub fn new(cpus: Vec<usize>) -> Meter {
        let mut m = Meter { cpus, last: None };
        m.last = m.read();
        m
    }

    fn read(&self) -> Option<Ticks> {
        parse(&std::fs::read_to_string("/proc/stat").ok()?, &self.cpus)
    }

    /// The share of the cores' time stolen since the last call (None when unreadable
    /// or when no tick passed).
    pub fn share(&mut self) -> Option<f64> {
        let now = self.read();
        let share = match (self.last, now) {
            (Some(a), Some(b)) if b.total > a.total => {
                Some(b.steal.saturating_sub(a.steal) as f64 / (b.total - a.total) as f64)
            }
            _ => None,
        };
        self.last = now;
        share
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  100 0 50 800 0 0 10 40 0 0\n\
                        cpu0 60 0 30 380 0 0 5 25 0 0\n\
                        cpu1 40 0 20 420 0 0 5 15 0 0\n\
                        intr 12345\n";

    #[test]
    fn sums_the_chosen_cpus() {
        assert_eq!(
            parse(STAT, &[0]),
            Some(Ticks {
                steal: 25,
                idle: 380,
                total: 500
            })
        );
        assert_eq!(
            parse(STAT, &[0, 1]),
            Some(Ticks {
                steal: 40,
                idle: 800,
                total: 1000
            })
        );
        // A CPU the file lacks, or none asked: no answer rather than a wrong one.
        assert_eq!(parse(STAT, &[2]), None);
        assert_eq!(parse(STAT, &[]), None);
        assert_eq!(parse("cpu0 1 2 x 4 5 6 7 8\n", &[0]), None);
    }

    #[test]
    fn the_meter_reads_this_machine() {
        let mut m = Meter::new(vec![0]);
        std::thread::sleep(std::time::Duration::from_millis(30));
        if let Some(s) = m.share() {
            assert!((0.0..=1.0).contains(&s), "{s}");
        }
    }
}
