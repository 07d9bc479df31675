//! The fiber runtime's own counters, read from a watched process that runs under
//! libtoffload.so: the runtime exports them as one C block (`toffload_counters`,
//! runtime/src/stats.rs), which we read with process_vm_readv at the symbol's address
//! in the target. No environment variable or file is needed, and a process without
//! the runtime simply has none.

use crate::target::{symbol, AddressSpace};
use serde::Serialize;

/// "TOFFLOAD" little-endian, and the layout version this reader knows.
const MAGIC: u64 = u64::from_le_bytes(*b"TOFFLOAD");
const VERSION: u64 = 2;
const WORDS: usize = 17;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RuntimeCounters {
    pub fibers_created: u64,
    pub fibers_live: u64,
    pub carriers: u64,
    pub parks: u64,
    pub offloads: u64,
    pub offloads_parked: u64,
    pub offloads_inline: u64,
    pub io_parks: u64,
    /// "off", "detect" or "enforce".
    pub guard: &'static str,
    pub guard_pages: u64,
    pub guard_faults: u64,
    pub guard_conflicts: u64,
    pub guard_serialized: u64,
    pub guard_released: u64,
    /// "loading", "active" or "disabled" (a malformed knob or TOFFLOAD_FIBERIZE=off).
    pub state: &'static str,
}

/// Decodes the block; None unless the magic and version match.
pub fn decode(w: &[u64; WORDS]) -> Option<RuntimeCounters> {
    if w[0] != MAGIC || w[1] != VERSION {
        return None;
    }
    Some(RuntimeCounters {
        fibers_created: w[2],
        fibers_live: w[3],
        carriers: w[4],
        parks: w[5],
        offloads: w[6],
        offloads_parked: w[7],
        offloads_inline: w[8],
        io_parks: w[9],
        guard: match w[10] {
            1 => "detect",
            2 => "enforce",
            _ => "off",
        },
        guard_pages: w[11],
        guard_faults: w[12],
        guard_conflicts: w[13],
        guard_serialized: w[14],
        guard_released: w[15],
        state: match w[16] {
            1 => "active",
            2 => "disabled",
            _ => "loading",
        },
    })
}

/// Where the block lives in `pid`, if libtoffload.so is mapped there.
pub fn locate(pid: u32) -> Option<u64> {
    let space = AddressSpace::of(pid);
    let m = space
        .modules
        .iter()
        .find(|m| crate::loader::is_fiber_runtime(&m.path))?;
    let (vaddr, size) = symbol(&m.path, "toffload_counters")?;
    (size as usize >= WORDS * 8).then_some(m.bias + vaddr)
}

/// Reads the counters at `addr` in `pid` (root, or the same user with ptrace rights).
pub fn read(pid: u32, addr: u64) -> Option<RuntimeCounters> {
    let mut w = [0u64; WORDS];
    let local = libc::iovec {
        iov_base: w.as_mut_ptr() as *mut libc::c_void,
        iov_len: WORDS * 8,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: WORDS * 8,
    };
    // SAFETY: one local buffer of the stated size; the kernel checks the remote side.
    let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    if n != (WORDS * 8) as isize {
        return None;
    }
    decode(&w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_only_the_known_layout() {
        let mut w = [0u64; WORDS];
        assert_eq!(decode(&w), None);
        w[0] = MAGIC;
        w[1] = VERSION;
        w[2] = 64;
        w[10] = 2;
        w[13] = 5;
        let c = decode(&w).unwrap();
        assert_eq!(
            (c.fibers_created, c.guard, c.guard_conflicts),
            (64, "enforce", 5)
        );
        w[1] = VERSION + 1;
        assert_eq!(decode(&w), None, "an unknown version is not guessed at");
    }
}
