//! Names for the addresses of a user stack (the final report's futex stacks):
//! `function+0xoff (module)` where the module's ELF symbols (.symtab, else .dynsym)
//! cover the address, read by blazesym; `module+0xoff` where none does (a stripped
//! binary, a library function that is not exported); the bare address where no
//! mapping of the target held it.

use crate::target::{AddressSpace, Module};
use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

/// The frames shown per stack (the innermost).
pub const MAX_FRAMES: usize = 8;

/// One frame of a user stack, as far as it could be named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// A symbol of the module covers the address.
    Function {
        name: String,
        offset: u64,
        module: String,
    },
    /// In a mapped file, but no symbol covers it: the offset from the module's load
    /// address (its vaddr for shared objects and PIE executables).
    Module { module: String, offset: u64 },
    /// No file mapping of the target held it (JIT code, a mapping since removed).
    Unmapped(u64),
}

impl fmt::Display for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Frame::Function {
                name,
                offset,
                module,
            } => write!(f, "{name}+{offset:#x} ({module})"),
            Frame::Module { module, offset } => write!(f, "{module}+{offset:#x}"),
            Frame::Unmapped(ip) => write!(f, "{ip:#x}"),
        }
    }
}

fn short_name(path: &str) -> String {
    path.rsplit('/').next().unwrap_or(path).to_string()
}

/// The frame a module gives when its symbols do not name the address.
fn unnamed(m: &Module, ip: u64) -> Frame {
    Frame::Module {
        module: short_name(&m.path),
        offset: ip.wrapping_sub(m.bias),
    }
}

/// The file to read a module's symbols from: through the target's root while it
/// lives (a container's /usr/lib is not the watcher's), else the path as mapped.
fn symbol_file(pid: u32, path: &str) -> PathBuf {
    let through_root = PathBuf::from(format!("/proc/{pid}/root{path}"));
    if through_root.exists() {
        through_root
    } else {
        PathBuf::from(path)
    }
}

/// The frames of one module to look up: (frame index, file offset).
struct Lookups<'a> {
    module: &'a Module,
    at: Vec<(usize, u64)>,
}

/// Names frames of one process's stacks; one per report, so that each module's
/// symbol table is read once for all its stacks.
pub struct Namer {
    pid: u32,
    symbolizer: Symbolizer,
}

impl Namer {
    pub fn new(pid: u32) -> Namer {
        Namer {
            pid,
            symbolizer: Symbolizer::builder().enable_demangling(true).build(),
        }
    }

    /// Names the innermost MAX_FRAMES frames of a stack of the process (its mappings
    /// in `space`), one symbolizer pass per module.
    pub fn frames(&self, space: &AddressSpace, ips: &[u64]) -> Vec<Frame> {
        let ips = &ips[..ips.len().min(MAX_FRAMES)];
        let mut out: Vec<Frame> = ips.iter().map(|&ip| Frame::Unmapped(ip)).collect();
        let mut by_module: BTreeMap<&str, Lookups> = BTreeMap::new();
        for (i, &ip) in ips.iter().enumerate() {
            let Some(m) = space.module_of(ip) else {
                continue;
            };
            out[i] = unnamed(m, ip);
            // Below the top frame each address is a return address, the instruction
            // after the call: the call itself (one byte back) is in the calling
            // function even when the call was its last instruction (a noreturn callee).
            let back = u64::from(i > 0);
            if let Some(off) = m.file_offset(ip).and_then(|o| o.checked_sub(back)) {
                by_module
                    .entry(&m.path)
                    .or_insert_with(|| Lookups {
                        module: m,
                        at: Vec::new(),
                    })
                    .at
                    .push((i, off));
            }
        }
        for (path, Lookups { module: m, at }) in by_module {
            let src = Source::Elf(Elf {
                debug_syms: false,
                ..Elf::new(symbol_file(self.pid, path))
            });
            let offsets: Vec<u64> = at.iter().map(|&(_, off)| off).collect();
            // A file that cannot be read (removed since, not an ELF) keeps
            // module+offset.
            let Ok(syms) = self.symbolizer.symbolize(&src, Input::FileOffset(&offsets)) else {
                continue;
            };
            for (&(i, _), sym) in at.iter().zip(syms) {
                if let Symbolized::Sym(s) = sym {
                    out[i] = Frame::Function {
                        name: s.name.into_owned(),
                        offset: s.offset as u64 + u64::from(i > 0),
                        module: short_name(&m.path),
                    };
                }
            }
        }
        out
    }

    /// The frames as text, innermost first.
    pub fn frame_names(&self, space: &AddressSpace, ips: &[u64]) -> Vec<String> {
        self.frames(space, ips)
            .iter()
            .map(Frame::to_string)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::parse_maps;

    #[test]
    fn unreadable_module_keeps_module_and_offset() {
        // Mapped at 0x1000 from file offset 0 (bias 0x1000), then its second segment
        // at 0x3000 from file offset 0x1000: a file that does not exist (as a deleted or
        // stripped binary gives no symbols) names nothing.
        let space = AddressSpace::from_maps(&parse_maps(
            "\
1000-2000 r--p 00000000 08:01 1 /nonexistent/toffload/app
3000-4000 r-xp 00001000 08:01 1 /nonexistent/toffload/app
",
        ));
        let f = Namer::new(std::process::id()).frames(&space, &[0x3010, 0x1500, 0x99999]);
        assert_eq!(
            f,
            vec![
                Frame::Module {
                    module: "app".into(),
                    offset: 0x2010
                },
                Frame::Module {
                    module: "app".into(),
                    offset: 0x500
                },
                Frame::Unmapped(0x99999),
            ]
        );
        let text: Vec<String> = f.iter().map(Frame::to_string).collect();
        assert_eq!(text, ["app+0x2010", "app+0x500", "0x99999"]);
        assert_eq!(space.modules[0].file_offset(0x3010), Some(0x1010));
    }

    #[test]
    fn function_frame_format() {
        let f = Frame::Function {
            name: "raw_lock".into(),
            offset: 0x1c,
            module: "rawfutex_server".into(),
        };
        assert_eq!(f.to_string(), "raw_lock+0x1c (rawfutex_server)");
    }

    #[test]
    fn only_the_innermost_frames() {
        let ips: Vec<u64> = (1..=20).collect();
        assert_eq!(
            Namer::new(1).frames(&AddressSpace::default(), &ips).len(),
            MAX_FRAMES
        );
    }

    /// Not inlined, so that its address is its own symbol's.
    #[inline(never)]
    fn toffload_symbols_marker(x: u64) -> u64 {
        std::hint::black_box(x.wrapping_mul(31))
    }

    #[test]
    fn names_a_function_of_this_process() {
        let f: fn(u64) -> u64 = toffload_symbols_marker;
        let ip = f as usize as u64 + 2;
        let pid = std::process::id();
        let space = AddressSpace::of(pid);
        let got = Namer::new(pid).frames(&space, &[ip]);
        match &got[0] {
            Frame::Function {
                name,
                offset,
                module,
            } => {
                assert!(name.contains("toffload_symbols_marker"), "{name}");
                assert_eq!(*offset, 2);
                let exe = std::env::current_exe().expect("exe");
                assert_eq!(
                    Some(module.as_str()),
                    exe.file_name().and_then(|n| n.to_str())
                );
            }
            other => panic!("not named: {other}"),
        }
    }
}
