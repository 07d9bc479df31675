//! Extra offload rows (TOFFLOAD_OFFLOAD and the built-in CUDA rows) are rerouted through the GOT: an arbitrary
//! blocking symbol cannot be interposed by defining it (our .so cannot know its name at
//! link time), so at load we rewrite every loaded object's GOT slots that bind that
//! name to a trampoline of ours for the row. The trampolines forward six integer
//! arguments: the documented limit for extra rows (no floating-point or stack
//! arguments). Objects dlopen'ed later and calls through dlsym'ed pointers are not
//! rerouted.

use crate::offload;
use libc::{c_int, c_long, c_void};

macro_rules! trampolines {
    ($($name:ident = $row:expr),*) => {
        $(
            extern "C" fn $name(a: usize, b: usize, c: usize, d: usize, e: usize, f: usize) -> c_long {
                // SAFETY: the application's own arguments for this row's function.
                unsafe { offload::interposed($row, [a, b, c, d, e, f]) }
            }
        )*
        const TRAMPOLINES: &[extern "C" fn(usize, usize, usize, usize, usize, usize) -> c_long] = &[$($name),*];
    };
}

trampolines!(
    t1 = 1,
    t2 = 2,
    t3 = 3,
    t4 = 4,
    t5 = 5,
    t6 = 6,
    t7 = 7,
    t8 = 8,
    t9 = 9,
    t10 = 10,
    t11 = 11,
    t12 = 12,
    t13 = 13,
    t14 = 14,
    t15 = 15,
    t16 = 16,
    t17 = 17,
    t18 = 18,
    t19 = 19
);
const _: () = assert!(TRAMPOLINES.len() == crate::config::MAX_TABLE_ROWS);

struct Patch<'a> {
    names: &'a [(String, usize)],
    own_base: usize,
    patched: usize,
}

const R_X86_64_GLOB_DAT: u32 = 6;
const R_X86_64_JUMP_SLOT: u32 = 7;
// <elf.h> dynamic tags (not in the libc crate).
const DT_NULL: i64 = 0;
const DT_PLTRELSZ: i64 = 2;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_RELA: i64 = 7;
const DT_RELASZ: i64 = 8;
const DT_JMPREL: i64 = 23;

#[repr(C)]
struct Elf64Dyn {
    d_tag: i64,
    d_un: u64,
}

/// Rewrites the GOT slots of every extra row; returns how many slots were patched.
pub fn patch_extra_rows() -> usize {
    let rows = &crate::settings().offload;
    if rows.len() <= 1 {
        return 0;
    }
    // Resolve the rows before any slot points at a trampoline; a built-in row whose
    // function no loaded object defines is left out.
    let resolved = offload::rows();
    let names: Vec<(String, usize)> = rows[1..]
        .iter()
        .enumerate()
        .filter(|(i, r)| !r.optional || resolved[i + 1].blocking != 0)
        .map(|(i, r)| (r.blocking.clone(), TRAMPOLINES[i] as usize))
        .collect();
    if names.is_empty() {
        return 0;
    }
    // SAFETY: an all-zero Dl_info is valid (null pointers, zero addresses).
    let mut own: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr on one of our own functions.
    unsafe { libc::dladdr(patch_extra_rows as *const c_void, &mut own) };
    let mut p = Patch {
        names: &names,
        own_base: own.dli_fbase as usize,
        patched: 0,
    };
    // SAFETY: the callback only reads the loaded objects' dynamic sections and writes
    // GOT slots of the named symbols.
    unsafe { libc::dl_iterate_phdr(Some(each_object), &mut p as *mut Patch as *mut c_void) };
    p.patched
}

unsafe extern "C" fn each_object(
    info: *mut libc::dl_phdr_info,
    _: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: data is the &mut Patch that patch_extra_rows passed, alive and unshared
    // for the whole dl_iterate_phdr call; info is ld.so's, valid during the callback.
    let (p, info) = unsafe { (&mut *(data as *mut Patch), &*info) };
    let base = info.dlpi_addr as usize;
    let name = if info.dlpi_name.is_null() {
        ""
    } else {
        // SAFETY: ld.so's object name, NUL-terminated.
        unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) }
            .to_str()
            .unwrap_or("")
    };
    if name.contains("linux-vdso") || (base == p.own_base && base != 0) {
        return 0;
    }
    // SAFETY: ld.so's program headers of the loaded object, dlpi_phnum of them.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
    let Some(dynph) = phdrs.iter().find(|ph| ph.p_type == libc::PT_DYNAMIC) else {
        return 0;
    };
    let mut dynp = (base + dynph.p_vaddr as usize) as *const Elf64Dyn;
    // ld.so relocates most d_ptr values in place; be robust to those it did not.
    let fix = |v: u64| -> usize {
        let v = v as usize;
        if v < base {
            v + base
        } else {
            v
        }
    };
    let (mut symtab, mut strtab, mut jmprel, mut pltsz, mut rela, mut relasz) = (0, 0, 0, 0, 0, 0);
    // SAFETY: the mapped dynamic section, read up to its DT_NULL terminator.
    while unsafe { (*dynp).d_tag } != DT_NULL {
        // SAFETY: as above, an entry before DT_NULL.
        let d = unsafe { &*dynp };
        match d.d_tag {
            DT_SYMTAB => symtab = fix(d.d_un),
            DT_STRTAB => strtab = fix(d.d_un),
            DT_JMPREL => jmprel = fix(d.d_un),
            DT_PLTRELSZ => pltsz = d.d_un as usize,
            DT_RELA => rela = fix(d.d_un),
            DT_RELASZ => relasz = d.d_un as usize,
            _ => {}
        }
        // SAFETY: d was not DT_NULL, so the next entry is still in the section.
        dynp = unsafe { dynp.add(1) };
    }
    if symtab == 0 || strtab == 0 {
        return 0;
    }
    for (start, size) in [(jmprel, pltsz), (rela, relasz)] {
        if start == 0 {
            continue;
        }
        let n = size / std::mem::size_of::<libc::Elf64_Rela>();
        // SAFETY: the object's relocation table of `size` bytes, mapped by ld.so.
        let relocs = unsafe { std::slice::from_raw_parts(start as *const libc::Elf64_Rela, n) };
        for r in relocs {
            let ty = (r.r_info & 0xffff_ffff) as u32;
            if ty != R_X86_64_JUMP_SLOT && ty != R_X86_64_GLOB_DAT {
                continue;
            }
            // SAFETY: a relocation's symbol index is within the object's symtab, and a
            // symbol's st_name is a NUL-terminated string in its strtab.
            let sname = unsafe {
                let sym = &*((symtab as *const libc::Elf64_Sym).add((r.r_info >> 32) as usize));
                std::ffi::CStr::from_ptr((strtab + sym.st_name as usize) as *const libc::c_char)
            };
            let Some((_, tramp)) = p
                .names
                .iter()
                .find(|(n, _)| n.as_bytes() == sname.to_bytes())
            else {
                continue;
            };
            let slot = (base + r.r_offset as usize) as *mut usize;
            // The GOT may be read-only after relocation (RELRO): open the page briefly.
            let page = (slot as usize) & !4095;
            // SAFETY: slot is a JUMP_SLOT/GLOB_DAT entry of a mapped object, a pointer-
            // sized GOT word; the trampoline has the row function's signature, so a call
            // through the slot stays valid whenever it reads it.
            unsafe {
                libc::mprotect(
                    page as *mut c_void,
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                );
                std::ptr::write_volatile(slot, *tramp);
            }
            p.patched += 1;
        }
    }
    0
}
