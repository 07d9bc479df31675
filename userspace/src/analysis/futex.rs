//! Where a futex call came from: glibc's pthread code, a raw syscall below libc (the
//! application's own futex, InnoDB-style, or inline assembly as in Go), or the
//! offload's own wait (inside an offload call, or from the offload's library).

use crate::target::AddressSpace;
use serde::Serialize;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Origins {
    /// From inside glibc (pthread mutex/cond, sem, ...), not its syscall() wrapper.
    pub libc: u64,
    /// syscall(SYS_futex) or an inline syscall instruction outside libc.
    pub raw: u64,
    /// The offload's own: during an offload call, or from the offload library.
    pub offload: u64,
    /// No user stack could be taken.
    pub unknown: u64,
}

impl Origins {
    pub fn total(&self) -> u64 {
        self.libc + self.raw + self.offload + self.unknown
    }

    pub fn minus(&self, o: &Origins) -> Origins {
        Origins {
            libc: self.libc.saturating_sub(o.libc),
            raw: self.raw.saturating_sub(o.raw),
            offload: self.offload.saturating_sub(o.offload),
            unknown: self.unknown.saturating_sub(o.unknown),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    Libc,
    /// Inside libc's syscall() wrapper: attributed by its caller instead.
    LibcSyscallWrapper,
    Offload,
    Raw,
}

/// The code layout futex sites are judged against.
#[derive(Clone, Debug, Default)]
pub struct Layout {
    pub space: AddressSpace,
    /// Absolute [start, end) of libc's syscall().
    pub syscall_fn: Option<(u64, u64)>,
    pub offload_modules: Vec<String>,
}

impl Layout {
    pub fn new(space: AddressSpace, offload_modules: Vec<String>) -> Layout {
        let syscall_fn = space.libc().and_then(|m| {
            let (addr, size) = crate::target::symbol(&m.path, "syscall")?;
            Some((m.bias + addr, m.bias + addr + size.max(1)))
        });
        Layout {
            space,
            syscall_fn,
            offload_modules,
        }
    }

    fn in_offload_module(&self, ip: u64) -> bool {
        self.space
            .module_of(ip)
            .is_some_and(|m| self.offload_modules.contains(&m.path))
    }

    /// The site of a futex syscall instruction (top of the user stack).
    pub fn site_of_syscall(&self, ip: u64) -> Site {
        if let Some((s, e)) = self.syscall_fn {
            if ip >= s && ip < e {
                return Site::LibcSyscallWrapper;
            }
        }
        if self.in_offload_module(ip) {
            return Site::Offload;
        }
        match self.space.module_of(ip) {
            Some(m) if crate::target::is_libc(&m.path) => Site::Libc,
            _ => Site::Raw,
        }
    }

    /// The site of a syscall(SYS_futex) caller (its return address).
    pub fn site_of_caller(&self, ip: u64) -> Site {
        if self.in_offload_module(ip) {
            return Site::Offload;
        }
        match self.space.module_of(ip) {
            Some(m) if crate::target::is_libc(&m.path) => Site::Libc,
            _ => Site::Raw,
        }
    }
}

/// Cumulative origins from the kernel's maps: counts per futex site (syscall
/// address, and the caller when that address is libc's syscall() wrapper), and the
/// counters of futexes inside an offload and without a user stack.
pub fn attribute(
    layout: &Layout,
    sites: &[(Site2, u64)],
    in_offload: u64,
    no_stack: u64,
) -> Origins {
    let mut o = Origins {
        offload: in_offload,
        unknown: no_stack,
        ..Default::default()
    };
    for &((ip, caller), n) in sites {
        let site = match layout.site_of_syscall(ip) {
            Site::LibcSyscallWrapper => layout.site_of_caller(caller),
            s => s,
        };
        match site {
            Site::Libc | Site::LibcSyscallWrapper => o.libc += n,
            Site::Offload => o.offload += n,
            Site::Raw => o.raw += n,
        }
    }
    o
}

/// (syscall instruction address, word at the user stack pointer).
pub type Site2 = (u64, u64);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::{parse_maps, AddressSpace};

    fn layout() -> Layout {
        let maps = parse_maps(
            "\
1000-2000 r-xp 00000000 08:01 1 /srv/app
10000-20000 r-xp 00000000 08:01 2 /lib/libc.so.6
30000-40000 r-xp 00000000 08:01 3 /opt/lib/libtoffload_accel.so
",
        );
        Layout {
            space: AddressSpace::from_maps(&maps),
            syscall_fn: Some((0x11000, 0x11040)),
            offload_modules: vec!["/opt/lib/libtoffload_accel.so".into()],
        }
    }

    #[test]
    fn sites() {
        let l = layout();
        assert_eq!(l.site_of_syscall(0x15000), Site::Libc);
        assert_eq!(l.site_of_syscall(0x11010), Site::LibcSyscallWrapper);
        assert_eq!(l.site_of_syscall(0x1500), Site::Raw);
        assert_eq!(l.site_of_syscall(0x35000), Site::Offload);
        assert_eq!(l.site_of_syscall(0x99999), Site::Raw);
        assert_eq!(l.site_of_caller(0x1500), Site::Raw);
        assert_eq!(l.site_of_caller(0x35000), Site::Offload);
    }

    #[test]
    fn attribution_by_site_and_caller() {
        let l = layout();
        // 10 pthread futexes; 7 through syscall() (5 called from the app, 2 from the
        // offload library); 3 inline in the app; 4 inside an offload; 1 without a stack.
        let sites = [
            ((0x15000, 0), 10),
            ((0x11010, 0x1600), 5),
            ((0x11010, 0x35000), 2),
            ((0x1500, 0x1234), 3),
        ];
        let o = attribute(&l, &sites, 4, 1);
        assert_eq!(
            o,
            Origins {
                libc: 10,
                raw: 8,
                offload: 6,
                unknown: 1
            }
        );
        assert_eq!(o.total(), 10 + 7 + 3 + 4 + 1);
    }
}
