//! Per-fiber copies of the application's own thread-local storage (TOFFLOAD_FIBER_TLS).
//!
//! A `__thread` variable lives in a block per thread, at a fixed offset from the thread
//! pointer, so every fiber of a carrier would share its thread's block: mariadbd keeps
//! its session (`current_thd`) there, and a connection that parked found another's. In
//! copy mode each fiber owns a save area the size of the blocks taken in; switching a
//! fiber in copies its area into the running thread's blocks, switching it out copies
//! them back. A new fiber's area starts from the objects' initial images, as a new
//! thread's blocks do. Addresses stay those of the running thread: a pointer to a
//! `__thread` variable handed to another fiber reads whichever fiber runs there.
//!
//! Taken in: every object loaded at start that has a PT_TLS segment, except libc and
//! ld.so (their blocks are the thread's own machinery: malloc's per-thread cache and
//! arena, the locale, resolver state, the C++ thread_local destructor list; a fiber
//! given a fresh copy would build a new malloc cache and leak it), libpthread, and this
//! library (the runtime's per-thread state: which worker, which fiber). Objects opened
//! later with dlopen keep one block per thread, shared by its fibers.

use crate::config::FiberTls;
use libc::{c_int, c_void};
use std::sync::OnceLock;

/// `auto` copies up to this many bytes: a park + resume then stays under 200 ns
/// (tests/results/fiber_tls.md). Larger TLS stays shared unless
/// TOFFLOAD_FIBER_TLS=copy asks for the copy anyway.
pub const AUTO_MAX: usize = 2 << 10;

/// One object's TLS segment: where its copy sits in a fiber's area, and its image.
struct Module {
    modid: usize,
    off: usize,
    memsz: usize,
    image: usize,
    filesz: usize,
}

struct Layout {
    mods: Vec<Module>,
    /// Bytes of a fiber's area; 0 when nothing is copied.
    total: usize,
}

static LAYOUT: OnceLock<Layout> = OnceLock::new();

/// A thread's block address for each module of the layout (0: none on that thread).
pub type Blocks = Box<[usize]>;

/// A fiber's saved TLS (empty when nothing is copied).
pub type Area = Box<[u8]>;

fn basename(name: &str) -> &str {
    name.rsplit('/').next().unwrap_or(name)
}

/// Objects whose TLS is the thread's, never a fiber's (module doc).
fn excluded(name: &str) -> bool {
    let b = basename(name);
    ["libc.so", "libc-2.", "ld-linux", "ld64.so", "libpthread"]
        .iter()
        .any(|p| b.starts_with(p))
}

fn name_of(info: &libc::dl_phdr_info) -> &str {
    if info.dlpi_name.is_null() {
        return "";
    }
    // SAFETY: ld.so's object name, NUL-terminated, valid during the callback.
    unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) }
        .to_str()
        .unwrap_or("")
}

struct Scan {
    own_base: usize,
    mods: Vec<Module>,
}

unsafe extern "C" fn scan_object(
    info: *mut libc::dl_phdr_info,
    _: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: data is the &mut Scan that layout() passed, alive and unshared for the
    // whole dl_iterate_phdr call; info is ld.so's, valid during the callback.
    let (s, info) = unsafe { (&mut *(data as *mut Scan), &*info) };
    let base = info.dlpi_addr as usize;
    if info.dlpi_tls_modid == 0 || (base == s.own_base && base != 0) || excluded(name_of(info)) {
        return 0;
    }
    // SAFETY: ld.so's program headers of the loaded object, dlpi_phnum of them.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
    if let Some(ph) = phdrs
        .iter()
        .find(|ph| ph.p_type == libc::PT_TLS && ph.p_memsz > 0)
    {
        s.mods.push(Module {
            modid: info.dlpi_tls_modid,
            off: 0,
            memsz: ph.p_memsz as usize,
            image: base + ph.p_vaddr as usize,
            filesz: ph.p_filesz as usize,
        });
    }
    0
}

fn scan() -> Vec<Module> {
    // SAFETY: an all-zero Dl_info is valid (null pointers, zero addresses).
    let mut own: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr on one of our own functions.
    unsafe { libc::dladdr(scan as *const c_void, &mut own) };
    let mut s = Scan {
        own_base: own.dli_fbase as usize,
        mods: Vec::new(),
    };
    // SAFETY: the callback only reads the objects' program headers.
    unsafe { libc::dl_iterate_phdr(Some(scan_object), &mut s as *mut Scan as *mut c_void) };
    s.mods
}

fn layout() -> &'static Layout {
    LAYOUT.get_or_init(|| {
        let mut mods = scan();
        let mut total = 0;
        for m in &mut mods {
            m.off = total;
            // 16-aligned copies: word-sized moves for every module.
            total += m.memsz.next_multiple_of(16);
        }
        let copy = match crate::settings().fiber_tls {
            FiberTls::Shared => false,
            FiberTls::Copy => true,
            FiberTls::Auto => total <= AUTO_MAX,
        };
        crate::log_at!(
            crate::log::INFO,
            "application TLS: {} object(s), {} bytes, {}",
            mods.len(),
            total,
            if copy && total > 0 {
                "copied per fiber"
            } else {
                "shared by the fibers of a thread"
            }
        );
        if !copy || total == 0 {
            return Layout {
                mods: Vec::new(),
                total: 0,
            };
        }
        Layout { mods, total }
    })
}

/// At load, while only the objects of the start are there: fixes the layout.
pub fn init() {
    layout();
}

/// Bytes copied each way per switch (0: TLS is shared).
pub fn bytes_per_switch() -> usize {
    layout().total
}

struct Found<'a> {
    want: &'a [Module],
    at: Vec<usize>,
}

unsafe extern "C" fn find_blocks(
    info: *mut libc::dl_phdr_info,
    _: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: data is the &mut Found that blocks() passed, alive and unshared for the
    // whole call; info is ld.so's, valid during the callback.
    let (f, info) = unsafe { (&mut *(data as *mut Found), &*info) };
    if let Some(i) = f.want.iter().position(|m| m.modid == info.dlpi_tls_modid) {
        f.at[i] = info.dlpi_tls_data as usize;
    }
    0
}

/// The calling thread's block of each module in the layout (once per worker thread).
pub fn blocks() -> Blocks {
    let l = layout();
    if l.total == 0 {
        return Box::new([]);
    }
    let mut f = Found {
        want: &l.mods,
        at: vec![0; l.mods.len()],
    };
    // SAFETY: the callback only reads the objects' TLS addresses for this thread.
    unsafe { libc::dl_iterate_phdr(Some(find_blocks), &mut f as *mut Found as *mut c_void) };
    f.at.into_boxed_slice()
}

/// Where `addr` lies in the copied blocks of the thread with `blocks`: (module index,
/// offset), or None outside them (TLS shared, another object, not TLS at all).
pub fn locate(blocks: &Blocks, addr: usize) -> Option<(usize, usize)> {
    let l = layout();
    l.mods
        .iter()
        .zip(blocks.iter())
        .position(|(m, &b)| b != 0 && addr >= b && addr - b < m.memsz)
        .map(|i| (i, addr - blocks[i]))
}

/// The address of (module index, offset) from locate() on the thread with `blocks`.
pub fn address(blocks: &Blocks, module: usize, off: usize) -> Option<usize> {
    blocks.get(module).filter(|&&b| b != 0).map(|&b| b + off)
}

/// A new fiber's area: each object's initial image, then zeros (a new thread's blocks).
pub fn new_area() -> Area {
    let l = layout();
    let mut a = vec![0u8; l.total].into_boxed_slice();
    for m in &l.mods {
        // SAFETY: the object's mapped .tdata image, filesz bytes, within its area slot
        // (filesz <= memsz).
        unsafe {
            std::ptr::copy_nonoverlapping(
                m.image as *const u8,
                a.as_mut_ptr().add(m.off),
                m.filesz.min(m.memsz),
            )
        };
    }
    a
}

/// The carrier thread with `blocks` is about to run the fiber that owns `area`; the
/// thread's own values wait in `own` (None: they are not kept, a test switch) until
/// it parks.
///
/// The thread's own values matter between fibers: the scheduler calls into other
/// objects there (a polled completion's `done`, from the device's library), and what
/// they keep in TLS (the emulated device's cipher context) must be the thread's, not
/// a stale copy of the fiber that ran last, which the next switch_in overwrites and
/// so leaks, or which that fiber's end frees under it.
///
/// # Safety
/// `blocks` are the calling thread's (blocks()), `own` and `area` new_area()s of this
/// layout.
#[inline]
pub unsafe fn switch_in(blocks: &Blocks, mut own: Option<&mut Area>, area: &Area) {
    let l = layout();
    for (m, &b) in l.mods.iter().zip(blocks.iter()) {
        if b != 0 {
            // SAFETY: per our contract, all hold memsz bytes at these places.
            unsafe {
                if let Some(own) = own.as_deref_mut() {
                    std::ptr::copy_nonoverlapping(
                        b as *const u8,
                        own.as_mut_ptr().add(m.off),
                        m.memsz,
                    );
                }
                std::ptr::copy_nonoverlapping(area.as_ptr().add(m.off), b as *mut u8, m.memsz)
            };
        }
    }
}

/// The fiber that owns `area` handed the carrier thread with `blocks` back: its
/// values go back to `area`, the thread's own come back from `own`.
///
/// # Safety
/// As for switch_in, with the `own` that switch_in filled.
#[inline]
pub unsafe fn switch_out(blocks: &Blocks, own: Option<&Area>, area: &mut Area) {
    let l = layout();
    for (m, &b) in l.mods.iter().zip(blocks.iter()) {
        if b != 0 {
            // SAFETY: per our contract, all hold memsz bytes at these places.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    b as *const u8,
                    area.as_mut_ptr().add(m.off),
                    m.memsz,
                );
                if let Some(own) = own {
                    std::ptr::copy_nonoverlapping(own.as_ptr().add(m.off), b as *mut u8, m.memsz);
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libc_and_the_loader_keep_their_own() {
        for n in [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/lib64/ld-linux-x86-64.so.2",
            "/lib/x86_64-linux-gnu/libpthread.so.0",
            "libc-2.31.so",
        ] {
            assert!(excluded(n), "{n}");
        }
        for n in [
            "",
            "/lib/x86_64-linux-gnu/libstdc++.so.6",
            "/lib/x86_64-linux-gnu/libsystemd.so.0",
            "/usr/lib/libcrypt.so.1",
        ] {
            assert!(!excluded(n), "{n}");
        }
    }
}
