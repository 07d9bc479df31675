//! userfaultfd write-protect: the guard's primary way to see writes. The four ioctls
//! are written out here rather than taken from the userfaultfd crate, whose
//! write-protect support needs bindgen and libclang at build time.
//!
//! A write to a protected page blocks the writing thread until our handler thread (a
//! real thread that never touches guarded memory) records it and lifts the protection
//! of that page, which wakes the writer. The executable's .data is a file-backed
//! private mapping, which uffd-wp cannot register: it is first moved to anonymous
//! memory with mremap (atomic, so the GOT and stdio state in it stay valid).
//!
//! Asynchronous write-protect (UFFD_FEATURE_WP_ASYNC, Linux 6.7+): the kernel resolves
//! a write fault on a protected page by itself (no message, no handler thread, no
//! round trip), leaving the page marked written; the PAGEMAP_SCAN ioctl on
//! /proc/self/pagemap then reports the written pages, which are write-protected again
//! with UFFDIO_WRITEPROTECT. Not in the same walk (PM_SCAN_WP_MATCHING): that walk
//! flushes the TLB from the first page it protects to the end of the range, one
//! invalidation per page, which in a VM cost 8.7 us for one written page of 18 against
//! 1.8 us for UFFDIO_WRITEPROTECT of just that page. The window between the report
//! and the protection only lets a write by another thread to a page already reported
//! written fold into that report.

use super::regions::{Range, PAGE};
use libc::{c_int, c_void};

const UFFD_API: u64 = 0xAA;
const UFFDIO_API: u64 = 0xC018_AA3F;
const UFFDIO_REGISTER: u64 = 0xC020_AA00;
const UFFDIO_WRITEPROTECT: u64 = 0xC018_AA06;
const MODE_WP: u64 = 2;
const WP_MODE_WP: u64 = 1;
const WP_MODE_DONTWAKE: u64 = 2;
const FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
const FEATURE_THREAD_ID: u64 = 1 << 8;
/// Without it, write-protecting a page not yet populated does nothing (6.4+); async
/// write-protect needs it on anonymous memory.
const FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
/// The kernel resolves write-protect faults itself (6.7+).
const FEATURE_WP_ASYNC: u64 = 1 << 15;
/// _IOWR('f', 16, struct pm_scan_arg) (96 bytes), on /proc/<pid>/pagemap (6.7+).
const PAGEMAP_SCAN: u64 = 0xC060_6610;
const PAGE_IS_WRITTEN: u64 = 1 << 1;
const EVENT_PAGEFAULT: u8 = 0x12;
const PAGEFAULT_FLAG_WP: u64 = 2;
const USER_MODE_ONLY: c_int = 1;

#[repr(C)]
struct Api {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct Register {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct WriteProtect {
    start: u64,
    len: u64,
    mode: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Msg {
    event: u8,
    _r1: u8,
    _r2: u16,
    _r3: u32,
    flags: u64,
    address: u64,
    ptid: u32,
    _pad: u32,
}

/// Opens a userfaultfd with write-protect faults and thread ids. Err(errno).
pub fn open() -> Result<c_int, c_int> {
    // SAFETY: plain syscalls and ioctls on our own fd.
    unsafe {
        let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | USER_MODE_ONLY) as c_int;
        if fd < 0 {
            return Err(crate::real::errno());
        }
        // Ask for WP_UNPOPULATED where the kernel has it; a kernel without it refuses
        // the whole handshake (which can be tried once per fd), so then start over
        // without it: pages are populated before being protected anyway (`watch`).
        let mut api = Api {
            api: UFFD_API,
            features: FEATURE_PAGEFAULT_FLAG_WP | FEATURE_THREAD_ID | FEATURE_WP_UNPOPULATED,
            ioctls: 0,
        };
        if libc::ioctl(fd, UFFDIO_API as _, &mut api) == 0 {
            return Ok(fd);
        }
        libc::close(fd);
        let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | USER_MODE_ONLY) as c_int;
        if fd < 0 {
            return Err(crate::real::errno());
        }
        retry_plain(fd)
    }
}

/// Opens a userfaultfd whose write-protect faults the kernel resolves itself
/// (WP_ASYNC), and /proc/self/pagemap to collect the written pages: (uffd, pagemap).
/// Err(errno) where the kernel lacks either (before 6.7).
pub fn open_async() -> Result<(c_int, c_int), c_int> {
    // SAFETY: plain syscalls and ioctls on our own fds.
    unsafe {
        let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | USER_MODE_ONLY) as c_int;
        if fd < 0 {
            return Err(crate::real::errno());
        }
        let want = FEATURE_PAGEFAULT_FLAG_WP | FEATURE_WP_UNPOPULATED | FEATURE_WP_ASYNC;
        let mut api = Api {
            api: UFFD_API,
            features: want,
            ioctls: 0,
        };
        if libc::ioctl(fd, UFFDIO_API as _, &mut api) < 0 || api.features & want != want {
            let e = crate::real::errno();
            libc::close(fd);
            return Err(if e == 0 { libc::ENOSYS } else { e });
        }
        let pm = libc::syscall(
            libc::SYS_openat,
            libc::AT_FDCWD,
            c"/proc/self/pagemap".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        ) as c_int;
        if pm < 0 {
            let e = crate::real::errno();
            libc::close(fd);
            return Err(e);
        }
        // Probe PAGEMAP_SCAN itself (a kernel with WP_ASYNC has it; a seccomp'd or
        // emulated /proc might not): an empty walk over nothing.
        let mut none = [PageRegion::default(); 1];
        if scan_raw(pm, 0, 0, &mut none).is_err() {
            let e = crate::real::errno();
            libc::close(pm);
            libc::close(fd);
            return Err(e);
        }
        Ok((fd, pm))
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct PageRegion {
    pub start: u64,
    pub end: u64,
    categories: u64,
}

#[repr(C)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// One PAGEMAP_SCAN over [start, end): fills `out` with the written runs.
/// Ok((runs filled, where the walk stopped)).
fn scan_raw(
    pm: c_int,
    start: usize,
    end: usize,
    out: &mut [PageRegion],
) -> Result<(usize, usize), ()> {
    let mut a = PmScanArg {
        size: std::mem::size_of::<PmScanArg>() as u64,
        flags: 0,
        start: start as u64,
        end: end as u64,
        walk_end: 0,
        vec: out.as_mut_ptr() as u64,
        vec_len: out.len() as u64,
        max_pages: 0,
        category_inverted: 0,
        category_mask: PAGE_IS_WRITTEN,
        category_anyof_mask: 0,
        return_mask: PAGE_IS_WRITTEN,
    };
    // SAFETY: ioctl on our pagemap fd with a valid argument and output vector.
    let n = unsafe { libc::ioctl(pm, PAGEMAP_SCAN as _, &mut a) };
    if n < 0 {
        return Err(());
    }
    Ok((n as usize, a.walk_end as usize))
}

/// Calls `seen(page)` for every page of [start, end) written since the last scan, and
/// write-protects it again with the uffd `fd`. [start, end) must be registered for
/// async write-protect: elsewhere every present page counts as written. False on an
/// error.
pub fn scan_written(
    pm: c_int,
    fd: c_int,
    start: usize,
    end: usize,
    mut seen: impl FnMut(usize),
) -> bool {
    let mut runs = [PageRegion::default(); 16];
    let mut at = start;
    while at < end {
        let Ok((n, walk_end)) = scan_raw(pm, at, end, &mut runs) else {
            return false;
        };
        for r in &runs[..n.min(runs.len())] {
            let (s, e) = (r.start as usize, r.end as usize);
            protect(fd, s, e - s, true);
            let mut p = s;
            while p < e {
                seen(p);
                p += PAGE;
            }
        }
        // A full vector stops the walk early; otherwise it went to the end.
        if n < runs.len() || walk_end <= at {
            break;
        }
        at = walk_end;
    }
    true
}

unsafe fn retry_plain(fd: c_int) -> Result<c_int, c_int> {
    let mut api = Api {
        api: UFFD_API,
        features: FEATURE_PAGEFAULT_FLAG_WP | FEATURE_THREAD_ID,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API takes a uffdio_api, which Api mirrors; api is a local.
    if unsafe { libc::ioctl(fd, UFFDIO_API as _, &mut api) } < 0 {
        let e = crate::real::errno();
        // SAFETY: our own fd, unused after this.
        unsafe { libc::close(fd) };
        return Err(e);
    }
    Ok(fd)
}

/// Populates every page of `r` writable without changing a byte (an atomic add of 0),
/// so that write protection has a page to mark.
fn populate(r: Range) {
    let mut p = r.start;
    while p < r.end {
        // SAFETY: a page of the program's own writable data; adding 0 atomically
        // changes nothing even if another thread writes it at the same moment.
        unsafe { std::sync::atomic::AtomicU8::from_ptr(p as *mut u8) }
            .fetch_add(0, std::sync::atomic::Ordering::Relaxed);
        p += PAGE;
    }
}

fn register(fd: c_int, r: Range) -> bool {
    let mut reg = Register {
        start: r.start as u64,
        len: (r.end - r.start) as u64,
        mode: MODE_WP,
        ioctls: 0,
    };
    // SAFETY: ioctl on our uffd with a valid struct.
    unsafe { libc::ioctl(fd, UFFDIO_REGISTER as _, &mut reg) == 0 }
}

/// Moves [start, end) onto anonymous memory, keeping its contents: mmap a copy
/// elsewhere, then mremap it over the original in one step.
fn make_anonymous(r: Range) -> bool {
    let len = r.end - r.start;
    // SAFETY: a fresh mapping, filled from the range and moved over it atomically.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return false;
        }
        std::ptr::copy_nonoverlapping(r.start as *const u8, p as *mut u8, len);
        let q = libc::mremap(
            p,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            r.start as *mut c_void,
        );
        if q == libc::MAP_FAILED {
            libc::munmap(p, len);
            return false;
        }
        true
    }
}

/// Registers `r` for write-protect faults (moving it to anonymous memory if needed).
pub fn watch(fd: c_int, r: Range) -> bool {
    populate(r);
    register(fd, r) || (make_anonymous(r) && register(fd, r))
}

/// Write-protects (`wp`) or releases pages; releasing also wakes a blocked writer.
pub fn protect(fd: c_int, start: usize, len: usize, wp: bool) -> bool {
    let mut w = WriteProtect {
        start: start as u64,
        len: len as u64,
        mode: if wp { WP_MODE_WP } else { 0 },
    };
    // SAFETY: ioctl on our uffd with a valid struct.
    unsafe { libc::ioctl(fd, UFFDIO_WRITEPROTECT as _, &mut w) == 0 }
}

/// Write-protects or releases pages without waking a writer blocked in a fault on
/// them (releasing only: the kernel refuses DONTWAKE with WP): the handler thread
/// still serves that fault, and its wake-up, in order.
pub fn protect_nowake(fd: c_int, start: usize, len: usize, wp: bool) -> bool {
    let mut w = WriteProtect {
        start: start as u64,
        len: len as u64,
        mode: if wp { WP_MODE_WP } else { WP_MODE_DONTWAKE },
    };
    // SAFETY: ioctl on our uffd with a valid struct.
    unsafe { libc::ioctl(fd, UFFDIO_WRITEPROTECT as _, &mut w) == 0 }
}

/// The handler thread: for each write fault, `on_write(page, tid)` records it; then
/// the page is released and the writer resumes.
pub fn serve(fd: c_int, on_write: fn(usize, i32)) -> ! {
    let mut msgs = [Msg {
        event: 0,
        _r1: 0,
        _r2: 0,
        _r3: 0,
        flags: 0,
        address: 0,
        ptid: 0,
        _pad: 0,
    }; 16];
    loop {
        // SAFETY: reading whole messages into our buffer (raw syscall: read is ours).
        let n = unsafe {
            libc::syscall(
                libc::SYS_read,
                fd,
                msgs.as_mut_ptr(),
                std::mem::size_of_val(&msgs),
            )
        };
        if n <= 0 {
            if crate::real::errno() == libc::EINTR {
                continue;
            }
            // The fd is gone (exec, or an unrecoverable error): nothing left to guard.
            // SAFETY: ends only this thread.
            unsafe { libc::syscall(libc::SYS_exit, 0) };
            unreachable!();
        }
        for m in msgs.iter().take(n as usize / std::mem::size_of::<Msg>()) {
            if m.event != EVENT_PAGEFAULT || m.flags & PAGEFAULT_FLAG_WP == 0 {
                continue;
            }
            let page = m.address as usize & !(PAGE - 1);
            on_write(page, m.ptid as i32);
            protect(fd, page, PAGE, false);
        }
    }
}
