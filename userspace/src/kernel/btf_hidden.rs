//! Loading the eBPF object without aya's parse of the kernel's BTF. aya's
//! `EbpfLoader::new()` reads and parses all of /sys/kernel/btf/vmlinux (5 MB here,
//! some 150,000 types allocated and freed) before any setter can say it is not wanted
//! (aya issue #1172; 0.13.1 and 0.14.0, the newest this toolchain builds, both do), and
//! toffload's object has no BTF relocations for it to serve: the parse and its frees
//! were about a quarter of a start's CPU, which the start takes from the target's CPU.
//!
//! So the load runs on a thread of its own in a private mount namespace where that one
//! file reads empty: the parse then fails at once and aya goes on without BTF, as
//! `.btf(None)` would. The namespace is the thread's alone (unshare(CLONE_NEWNS)
//! unshares the thread's filesystem context, allowed in a threaded process) and is
//! made private before anything is mounted in it, so the host never sees the mount;
//! it goes when the thread ends. Where any step is refused (no CAP_SYS_ADMIN, a
//! seccomp or LSM policy) the closure runs the ordinary way.

use crate::btf::VMLINUX;

/// Runs `f` on a new thread that sees the kernel's BTF (VMLINUX) empty where that can be arranged;
/// returns its result and whether the file was hidden.
pub fn with_btf_hidden<T: Send>(f: impl FnOnce() -> T + Send) -> (T, bool) {
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("bpf-load".into())
            .spawn_scoped(s, move || {
                let hidden = hide();
                (f(), hidden)
            })
            .map(|h| h.join())
            .unwrap_or_else(|e| panic!("starting the loader thread: {e}"))
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Moves the calling thread into a mount namespace of its own whose mounts propagate
/// nowhere. Allocates nothing, so a child may call it between fork and exec.
pub fn private_mount_namespace() -> std::io::Result<()> {
    // SAFETY: plain syscalls on static NUL-terminated strings.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Private first: a mount under a shared parent would propagate to the
        // namespace this thread came from.
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Moves this thread into a mount namespace of its own where VMLINUX is
/// /dev/null; false (and nothing mounted) where a step fails.
fn hide() -> bool {
    if private_mount_namespace().is_err() {
        return false;
    }
    // SAFETY: a plain syscall on static NUL-terminated strings.
    unsafe {
        libc::mount(
            c"/dev/null".as_ptr(),
            VMLINUX.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rchar() -> u64 {
        std::fs::read_to_string("/proc/thread-self/io")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("rchar:"))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0)
    }

    fn btf_len() -> usize {
        std::fs::read(crate::btf::vmlinux_path()).map_or(0, |d| d.len())
    }

    #[test]
    fn the_file_reads_empty_on_the_thread_and_whole_everywhere_else() {
        let whole = btf_len();
        if whole == 0 {
            toffload_tests::harness::skip("no /sys/kernel/btf/vmlinux");
            return;
        }
        // SAFETY: no arguments.
        let root = unsafe { libc::geteuid() } == 0;
        let (seen, hidden) = with_btf_hidden(btf_len);
        if !root {
            assert!(!hidden, "hidden without root");
            assert_eq!(seen, whole);
            toffload_tests::harness::skip("hiding the file needs CAP_SYS_ADMIN");
            return;
        }
        assert!(hidden);
        assert_eq!(seen, 0, "the loader thread still reads the kernel's BTF");
        // The host, this thread and a thread started after, untouched.
        assert_eq!(btf_len(), whole);
        assert_eq!(std::thread::spawn(btf_len).join().unwrap(), whole);
        assert!(std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .all(|l| !l.contains("/sys/kernel/btf")));
    }

    /// The cost it removes: aya's loader reads the whole file where it is not hidden,
    /// nothing of it where it is.
    #[test]
    fn aya_reads_the_kernels_btf_only_where_it_is_not_hidden() {
        let whole = btf_len() as u64;
        // SAFETY: no arguments.
        if whole == 0 || unsafe { libc::geteuid() } != 0 {
            toffload_tests::harness::skip("needs root and /sys/kernel/btf/vmlinux");
            return;
        }
        let read_by_new = || {
            let before = rchar();
            let loader = aya::EbpfLoader::new();
            let read = rchar() - before;
            drop(loader);
            read
        };
        let (plain, hidden) = (read_by_new(), with_btf_hidden(read_by_new));
        println!("EbpfLoader::new() read {plain} bytes, {} hidden", hidden.0);
        assert!(plain >= whole, "{plain} < {whole}");
        assert!(hidden.1 && hidden.0 < whole / 10, "{hidden:?}");
    }
}
