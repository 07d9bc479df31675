//! Which memory the guard watches: by default the executable's writable data and bss
//! (its RW segment without the RELRO part, which is read-only after relocation); more
//! from TOFFLOAD_GUARD_REGIONS (symbols, sized from the symbol table, or address
//! ranges) and from toffload_guard_region() calls. Pages holding the executable's
//! .got.plt are write-tracked but never made inaccessible: every PLT call reads them.

use crate::config::RegionSpec;
use libc::c_void;

pub const PAGE: usize = 4096;
/// <dlfcn.h>: dladdr1 returns the ELF symbol entry.
const RTLD_DL_SYMENT: libc::c_int = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub start: usize,
    pub end: usize,
}

impl Range {
    /// Whole pages covering [start, end).
    pub fn pages(start: usize, end: usize) -> Range {
        Range {
            start: start & !(PAGE - 1),
            end: (end + PAGE - 1) & !(PAGE - 1),
        }
    }
    pub fn contains(&self, a: usize) -> bool {
        a >= self.start && a < self.end
    }
}

struct Found {
    rw: Vec<(usize, usize)>,
    relro: Option<(usize, usize)>,
    pltgot: usize,
    pltrelsz: usize,
}

unsafe extern "C" fn first_object(
    info: *mut libc::dl_phdr_info,
    _: usize,
    data: *mut c_void,
) -> i32 {
    // SAFETY: data is the caller's &mut Found, alive and unshared for the whole
    // dl_iterate_phdr call; info and its program headers are ld.so's, valid during it.
    let (out, info, phdrs) = unsafe {
        let info = &*info;
        (
            &mut *(data as *mut Found),
            info,
            std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize),
        )
    };
    let base = info.dlpi_addr as usize;
    for ph in phdrs {
        let (s, e) = (
            base + ph.p_vaddr as usize,
            base + (ph.p_vaddr + ph.p_memsz) as usize,
        );
        match ph.p_type {
            libc::PT_LOAD if ph.p_flags & libc::PF_W != 0 => out.rw.push((s, e)),
            libc::PT_GNU_RELRO => out.relro = Some((s, e)),
            libc::PT_DYNAMIC => {
                let mut d = s as *const [u64; 2];
                // SAFETY: the mapped dynamic section of the object, (tag, value) pairs
                // read up to its DT_NULL terminator.
                unsafe {
                    while (*d)[0] != 0 {
                        match (*d)[0] {
                            // DT_PLTGOT
                            3 => {
                                let v = (*d)[1] as usize;
                                out.pltgot = if v < base { v + base } else { v };
                            }
                            // DT_PLTRELSZ
                            2 => out.pltrelsz = (*d)[1] as usize,
                            _ => {}
                        }
                        d = d.add(1);
                    }
                }
            }
            _ => {}
        }
    }
    1 // the first object is the executable: stop
}

/// The executable's guardable data: (ranges, pages that hold part of its .got.plt).
pub fn executable_data() -> (Vec<Range>, Vec<usize>) {
    let mut f = Found {
        rw: Vec::new(),
        relro: None,
        pltgot: 0,
        pltrelsz: 0,
    };
    // SAFETY: the callback only reads program headers and the dynamic section.
    unsafe { libc::dl_iterate_phdr(Some(first_object), &mut f as *mut Found as *mut c_void) };
    let mut out = Vec::new();
    for (s, e) in f.rw {
        // ld.so makes [relro start, page_floor(relro end)) read-only after relocation.
        let s = f.relro.map_or(s, |(_, re)| s.max(re));
        let r = Range::pages(s, e);
        if r.end > r.start {
            out.push(r);
        }
    }
    // .got.plt: 3 reserved entries, then one per PLT relocation (24-byte Elf64_Rela).
    let mut got = Vec::new();
    if f.pltgot != 0 {
        let end = f.pltgot + 8 * (3 + f.pltrelsz / 24);
        let mut p = f.pltgot & !(PAGE - 1);
        while p < end {
            got.push(p);
            p += PAGE;
        }
    }
    (out, got)
}

/// Resolves the user's extra regions. Errors name what could not be found.
pub fn resolve(specs: &[RegionSpec]) -> Result<Vec<Range>, String> {
    let mut out = Vec::new();
    for s in specs {
        match s {
            RegionSpec::Range(a, b) => out.push(Range::pages(*a, *b)),
            RegionSpec::Symbol(name) => {
                let c = std::ffi::CString::new(name.as_str()).map_err(|_| name.clone())?;
                // SAFETY: dlsym/dladdr1 only read the link maps.
                unsafe {
                    let p = libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr());
                    if p.is_null() {
                        return Err(format!("symbol {name} not found"));
                    }
                    let mut info: libc::Dl_info = std::mem::zeroed();
                    let mut sym: *const libc::Elf64_Sym = std::ptr::null();
                    let ok = libc::dladdr1(
                        p,
                        &mut info,
                        &mut sym as *mut *const libc::Elf64_Sym as *mut *mut c_void,
                        RTLD_DL_SYMENT,
                    );
                    let size = if ok != 0 && !sym.is_null() {
                        ((*sym).st_size as usize).max(1)
                    } else {
                        1
                    };
                    out.push(Range::pages(p as usize, p as usize + size));
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_cover_the_range() {
        let r = Range::pages(0x1010, 0x2001);
        assert_eq!((r.start, r.end), (0x1000, 0x3000));
        assert!(r.contains(0x2fff) && !r.contains(0x3000));
    }

    #[test]
    fn the_test_binary_has_writable_data() {
        let (rs, _) = executable_data();
        assert!(!rs.is_empty());
        assert!(rs.iter().all(|r| r.start % PAGE == 0 && r.end > r.start));
    }
}
