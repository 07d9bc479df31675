//! What /proc and the ELF files say about the watched process: its mappings, threads,
//! runtime kind, the offload entry points it has mapped, and where libc's syscall()
//! wrapper lives (to tell raw futex calls from glibc's own).

// The service around the process and what else is known of it: its environment as
// started (environ), its processes
// (service, processes), a command started under the watch (spawn), named offloads, the
// runtime's counters, the hypervisor's steal on its cores, its rate between bursts
// (untraced), the names of its code addresses (symbols) and the listening sockets
// that tell a listener from a connection (sock_diag).
pub mod environ;
pub mod offload_spec;
pub mod processes;
pub mod runtime_counters;
pub mod service;
pub mod sock_diag;
pub mod spawn;
pub mod steal;
pub mod symbols;
pub mod untraced;

use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Blocking offload entry points, probed wherever they are defined.
pub const OFFLOAD_SYMBOLS: &[&str] = &[
    "accel_run",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cuStreamSynchronize",
    "cuEventSynchronize",
    "cuCtxSynchronize",
    "cudaMemcpy",
];

pub fn exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// True while the process exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "pid (comm) S ...": the state follows the last ')'.
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X"),
        Err(_) => false,
    }
}

/// A process's liveness, polled cheaply: a pidfd turns readable when the process
/// exits (zombie included), so a poll replaces reading /proc/PID/stat on every tick
/// of the watch's loop (that read was a seventh of the watcher's CPU). Without
/// pidfd_open (kernels before 5.3), /proc as in alive().
pub struct Liveness {
    pid: u32,
    fd: Option<std::os::fd::OwnedFd>,
}

impl Liveness {
    pub fn new(pid: u32) -> Liveness {
        use std::os::fd::FromRawFd;
        // SAFETY: pidfd_open takes a pid and flags; a non-negative result is a new fd
        // owned here.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        // SAFETY: as just said: a fresh fd, owned by nothing else.
        let fd = (fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) });
        Liveness { pid, fd }
    }

    pub fn alive(&self) -> bool {
        use std::os::fd::AsRawFd;
        let Some(fd) = &self.fd else {
            return alive(self.pid);
        };
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        match unsafe { libc::poll(&mut p, 1, 0) } {
            0 => true,
            1 => false,
            _ => alive(self.pid),
        }
    }
}

pub fn thread_count(pid: u32) -> Option<usize> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()
        .map(|d| d.count())
}

/// The CPUs the target works on: those its threads may run on where that is not every
/// CPU (a pinned server), else those its threads last ran on.
pub fn cpus(pid: u32) -> Vec<usize> {
    let mut allowed = Vec::new();
    let mut last = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: a zeroed cpu_set_t is valid; the kernel fills it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                allowed
                    .extend((0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)));
            }
        }
        // Field 39 of stat, counted after the parenthesised comm.
        if let Some(cpu) = std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, r)| r.split_whitespace().nth(36)?.parse().ok())
            })
        {
            last.push(cpu);
        }
    }
    allowed.sort_unstable();
    allowed.dedup();
    last.sort_unstable();
    last.dedup();
    // SAFETY: sysconf has no memory effects.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    if !allowed.is_empty() && allowed.len() < online {
        allowed
    } else {
        last
    }
}

pub fn exe(pid: u32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/exe")).ok()
}

pub fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[derive(Clone, Debug)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub offset: u64,
    pub exec: bool,
    pub path: String,
}

/// /proc/PID/maps, file-backed mappings only.
pub fn maps(pid: u32) -> Vec<Mapping> {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return Vec::new();
    };
    parse_maps(&text)
}

pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let range = it.next()?;
            let perms = it.next()?;
            let offset = u64::from_str_radix(it.next()?, 16).ok()?;
            let _dev = it.next()?;
            let _inode = it.next()?;
            let path = it.collect::<Vec<_>>().join(" ");
            if !path.starts_with('/') || path.ends_with("(deleted)") {
                return None;
            }
            let (s, e) = range.split_once('-')?;
            Some(Mapping {
                start: u64::from_str_radix(s, 16).ok()?,
                end: u64::from_str_radix(e, 16).ok()?,
                offset,
                exec: perms.contains('x'),
                path,
            })
        })
        .collect()
}

/// The mapped files and their load bias (address of file vaddr 0).
#[derive(Clone, Debug, Default)]
pub struct AddressSpace {
    pub modules: Vec<Module>,
}

#[derive(Clone, Debug)]
pub struct Module {
    pub path: String,
    /// Its mappings: [start, end) and the file offset mapped at start.
    pub ranges: Vec<(u64, u64, u64)>,
    pub bias: u64,
}

impl Module {
    /// The offset in the module's file that `ip` was loaded from (what a symbolizer
    /// reading the ELF file needs, whatever the file's layout).
    pub fn file_offset(&self, ip: u64) -> Option<u64> {
        self.ranges
            .iter()
            .find(|&&(s, e, _)| ip >= s && ip < e)
            .map(|&(s, _, off)| ip - s + off)
    }
}

impl AddressSpace {
    pub fn of(pid: u32) -> AddressSpace {
        Self::from_maps(&maps(pid))
    }

    pub fn from_maps(maps: &[Mapping]) -> AddressSpace {
        let mut by_path: BTreeMap<&str, Module> = BTreeMap::new();
        for m in maps {
            let e = by_path.entry(&m.path).or_insert_with(|| Module {
                path: m.path.clone(),
                ranges: Vec::new(),
                bias: u64::MAX,
            });
            e.ranges.push((m.start, m.end, m.offset));
            // The mapping of file offset 0 is where vaddr 0 lands for the usual
            // (first PT_LOAD at vaddr 0) shared objects and PIE executables.
            if m.offset == 0 {
                e.bias = e.bias.min(m.start);
            }
        }
        AddressSpace {
            modules: by_path
                .into_values()
                .map(|mut m| {
                    if m.bias == u64::MAX {
                        m.bias = m.ranges.iter().map(|r| r.0).min().unwrap_or(0);
                    }
                    m
                })
                .collect(),
        }
    }

    pub fn module_of(&self, ip: u64) -> Option<&Module> {
        self.modules
            .iter()
            .find(|m| m.ranges.iter().any(|&(s, e, _)| ip >= s && ip < e))
    }

    pub fn libc(&self) -> Option<&Module> {
        self.modules.iter().find(|m| is_libc(&m.path))
    }
}

pub fn is_libc(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("libc.so") || name.starts_with("libc-") || name.starts_with("ld-musl")
}

/// A symbol's file vaddr and size in an ELF file (dynamic symbols first).
pub fn symbol(path: &str, name: &str) -> Option<(u64, u64)> {
    let data = std::fs::read(path).ok()?;
    let obj = object::File::parse(&*data).ok()?;
    obj.dynamic_symbols()
        .chain(obj.symbols())
        .find(|s| s.is_definition() && s.name() == Ok(name))
        .map(|s| (s.address(), s.size()))
}

/// The offload entry points an ELF file defines (the known ones and `extra`, the
/// user's --offload symbols that apply to this file), with the file offset a uprobe is
/// placed at. Resolved once per file: the sampled watch re-attaches every interval,
/// and resolving by name there re-read the whole file each time (30% of the
/// watcher's CPU on a library with debug info).
pub fn offload_symbols_in(path: &str, extra: &[&str]) -> Vec<(String, u64)> {
    let Ok(data) = std::fs::read(path) else {
        return Vec::new();
    };
    let Ok(obj) = object::File::parse(&*data) else {
        return Vec::new();
    };
    let mut found: Vec<(String, u64)> = Vec::new();
    for s in obj.dynamic_symbols().chain(obj.symbols()) {
        if !s.is_definition() {
            continue;
        }
        if let Ok(n) = s.name() {
            if (OFFLOAD_SYMBOLS.contains(&n) || extra.contains(&n))
                && !found.iter().any(|f| f.0 == n)
            {
                if let Some(off) = file_offset_of(&obj, &s) {
                    found.push((n.to_string(), off));
                }
            }
        }
    }
    found
}

/// A defined symbol's file offset (see file_offset_of).
pub fn symbol_file_offset(path: &str, name: &str) -> Option<u64> {
    let data = std::fs::read(path).ok()?;
    let obj = object::File::parse(&*data).ok()?;
    let sym = obj
        .dynamic_symbols()
        .chain(obj.symbols())
        .find(|s| s.is_definition() && s.name() == Ok(name))?;
    file_offset_of(&obj, &sym)
}

/// Where a symbol's code lies in its file: what the kernel's uprobe takes. For an
/// executable or shared object, the symbol's vaddr moved from its section's address to
/// the section's file offset (as aya's resolve_symbol does); for other objects, the
/// address itself.
fn file_offset_of<'a>(obj: &object::File<'a>, sym: &object::Symbol<'a, '_>) -> Option<u64> {
    use object::ObjectKind;
    if !matches!(obj.kind(), ObjectKind::Dynamic | ObjectKind::Executable) {
        return Some(sym.address());
    }
    let section = obj.section_by_index(sym.section_index()?).ok()?;
    let (file_off, _) = section.file_range()?;
    Some(sym.address() - section.address() + file_off)
}

/// The libraries a dynamically linked executable will load, as its dynamic loader
/// resolves them (`ld.so --list`, what ldd runs), plus the executable itself.
pub fn planned_files(exe: &str) -> Vec<String> {
    let mut files = vec![exe.to_string()];
    let interp = exe_facts(exe).interp;
    let Some(ld) = interp else { return files };
    let Ok(out) = std::process::Command::new(&ld)
        .arg("--list")
        .arg(exe)
        .output()
    else {
        return files;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "\t/lib64/ld-linux... (0x...)"
        let path = match line.split_once("=>") {
            Some((_, rhs)) => rhs.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            let p = std::fs::canonicalize(p)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_else(|_| p.to_string());
            if !files.contains(&p) {
                files.push(p);
            }
        }
    }
    files
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeKind {
    GlibcDynamic,
    MuslDynamic,
    Static,
    Jvm,
    Go,
    Python,
    Node,
}

impl RuntimeKind {
    pub fn label(self) -> &'static str {
        match self {
            RuntimeKind::GlibcDynamic => "glibc, dynamically linked",
            RuntimeKind::MuslDynamic => "musl, dynamically linked",
            RuntimeKind::Static => "statically linked",
            RuntimeKind::Jvm => "JVM",
            RuntimeKind::Go => "Go",
            RuntimeKind::Python => "Python",
            RuntimeKind::Node => "Node.js",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Runtime {
    pub kind: RuntimeKind,
    /// Has a PT_INTERP (a dynamic loader runs, so LD_PRELOAD applies).
    pub dynamic: bool,
    /// What decided the kind.
    pub evidence: String,
}

/// The runtime kind from the mapped files and the executable's ELF.
pub fn runtime(pid: u32) -> Runtime {
    let maps = maps(pid);
    let exe = exe(pid)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let elf = exe_facts(&exe);
    classify_runtime(&exe, &maps, &elf)
}

#[derive(Clone, Debug, Default)]
pub struct ExeFacts {
    pub interp: Option<String>,
    pub go: bool,
}

pub fn exe_facts(exe: &str) -> ExeFacts {
    let mut f = ExeFacts::default();
    let Ok(data) = std::fs::read(exe) else {
        return f;
    };
    let Ok(obj) = object::File::parse(&*data) else {
        return f;
    };
    f.go = obj.section_by_name(".go.buildinfo").is_some()
        || obj.section_by_name(".gopclntab").is_some()
        || obj.symbols().any(|s| s.name() == Ok("runtime.main"));
    if let Some(sec) = obj.section_by_name(".interp") {
        if let Ok(d) = sec.data() {
            f.interp = Some(
                String::from_utf8_lossy(d)
                    .trim_end_matches('\0')
                    .to_string(),
            );
        }
    } else {
        // A stripped binary may lack section headers: look for PT_INTERP's text.
        for seg in obj.segments() {
            if let Ok(d) = seg.data() {
                if let Some(p) = find_interp(d) {
                    f.interp = Some(p);
                    break;
                }
            }
        }
    }
    f
}

fn find_interp(d: &[u8]) -> Option<String> {
    for pat in [&b"/lib64/ld-linux"[..], b"/lib/ld-linux", b"/lib/ld-musl"] {
        if let Some(i) = d.windows(pat.len()).position(|w| w == pat) {
            let end = d[i..].iter().position(|&b| b == 0)? + i;
            return Some(String::from_utf8_lossy(&d[i..end]).into_owned());
        }
    }
    None
}

pub fn classify_runtime(exe: &str, maps: &[Mapping], elf: &ExeFacts) -> Runtime {
    let has = |pred: &dyn Fn(&str) -> bool| maps.iter().find(|m| pred(&m.path));
    let base = |p: &str| p.rsplit('/').next().unwrap_or(p).to_string();
    let exe_name = base(exe);
    let dynamic = elf.interp.is_some() || maps.iter().any(|m| base(&m.path).starts_with("ld-"));
    let (kind, evidence) = if let Some(m) = has(&|p| base(p).starts_with("libjvm.so")) {
        (RuntimeKind::Jvm, format!("{} is mapped", m.path))
    } else if elf.go {
        (RuntimeKind::Go, format!("{exe} has Go's build info"))
    } else if let Some(m) = has(&|p| base(p).starts_with("libpython")) {
        (RuntimeKind::Python, format!("{} is mapped", m.path))
    } else if exe_name.starts_with("python") {
        (RuntimeKind::Python, format!("the executable is {exe}"))
    } else if exe_name == "node"
        || exe_name == "nodejs"
        || has(&|p| base(p).starts_with("libnode")).is_some()
    {
        (RuntimeKind::Node, format!("the executable is {exe}"))
    } else if let Some(m) = has(&|p| base(p).starts_with("ld-musl")) {
        (RuntimeKind::MuslDynamic, format!("{} is mapped", m.path))
    } else if !dynamic {
        (
            RuntimeKind::Static,
            format!("{exe} has no PT_INTERP and no dynamic loader is mapped"),
        )
    } else if let Some(m) = has(&|p| is_libc(p)) {
        (RuntimeKind::GlibcDynamic, format!("{} is mapped", m.path))
    } else {
        (
            RuntimeKind::GlibcDynamic,
            format!("{exe} has interpreter {:?}", elf.interp),
        )
    };
    Runtime {
        kind,
        dynamic,
        evidence,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0000000-55d0c0001000 r--p 00000000 08:01 1 /usr/bin/srv
55d0c0001000-55d0c0002000 r-xp 00001000 08:01 1 /usr/bin/srv
7f0000000000-7f0000028000 r--p 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000028000-7f000019d000 r-xp 00028000 08:01 2 /usr/lib/x86_64-linux-gnu/libc.so.6
7f00001f0000-7f00001f1000 rw-p 00000000 00:00 0
7f0000200000-7f0000202000 r--p 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
";

    /// The offset a uprobe is placed at must hold the function's first bytes: a wrong
    /// one would plant a breakpoint mid-instruction in the target.
    #[test]
    fn symbol_file_offset_holds_the_code() {
        let me = std::process::id();
        let libc = maps(me)
            .into_iter()
            .find(|m| is_libc(&m.path))
            .expect("this test links glibc")
            .path;
        let off = symbol_file_offset(&libc, "getpid").expect("getpid in libc");
        let file = std::fs::read(&libc).unwrap();
        let on_disk = &file[off as usize..off as usize + 16];
        // SAFETY: reading 16 bytes of mapped, executable libc code.
        let in_memory =
            unsafe { std::slice::from_raw_parts(libc::getpid as *const () as *const u8, 16) };
        assert_eq!(on_disk, in_memory);
        assert_eq!(symbol_file_offset(&libc, "no_such_symbol_here"), None);
    }

    #[test]
    fn a_pinned_process_is_on_its_cpus() {
        // A child pinned to CPU 0 reads as CPU 0, whatever the machine has.
        let mut c = std::process::Command::new("taskset")
            .args(["-c", "0", "sleep", "5"])
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        let got = cpus(c.id());
        let _ = c.kill();
        let _ = c.wait();
        // SAFETY: as above.
        if unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) } > 1 {
            assert_eq!(got, [0]);
        } else {
            assert!(got.len() <= 1, "{got:?}");
        }
        assert!(cpus(u32::MAX - 1).is_empty());
    }

    #[test]
    fn liveness_sees_an_exit_and_a_zombie() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let l = Liveness::new(child.id());
        assert!(l.fd.is_some(), "pidfd_open on this kernel");
        assert!(l.alive());
        // Not reaped yet: a zombie, which is not alive.
        std::thread::sleep(std::time::Duration::from_millis(600));
        assert!(!l.alive());
        child.wait().unwrap();
        assert!(!l.alive());
        assert!(!Liveness::new(u32::MAX / 2).alive());
    }

    #[test]
    fn maps_parse_and_resolve() {
        let m = parse_maps(MAPS);
        assert_eq!(m.len(), 5);
        let a = AddressSpace::from_maps(&m);
        let libc = a.libc().expect("libc");
        assert_eq!(libc.bias, 0x7f0000000000);
        assert_eq!(
            a.module_of(0x7f0000030000).map(|m| m.path.as_str()),
            Some("/usr/lib/x86_64-linux-gnu/libc.so.6")
        );
        assert!(a.module_of(0x7f00001f0100).is_none());
    }

    #[test]
    fn runtime_kinds() {
        let m = parse_maps(MAPS);
        let dynf = ExeFacts {
            interp: Some("/lib64/ld-linux-x86-64.so.2".into()),
            go: false,
        };
        assert_eq!(
            classify_runtime("/usr/bin/srv", &m, &dynf).kind,
            RuntimeKind::GlibcDynamic
        );
        let mut jvm = m.clone();
        jvm.push(Mapping {
            start: 1,
            end: 2,
            offset: 0,
            exec: true,
            path: "/usr/lib/jvm/java-17/lib/server/libjvm.so".into(),
        });
        assert_eq!(
            classify_runtime("/usr/bin/java", &jvm, &dynf).kind,
            RuntimeKind::Jvm
        );
        let stat = ExeFacts::default();
        let only_exe = parse_maps(MAPS.lines().take(2).collect::<Vec<_>>().join("\n").as_str());
        assert_eq!(
            classify_runtime("/srv", &only_exe, &stat).kind,
            RuntimeKind::Static
        );
        let gof = ExeFacts {
            interp: None,
            go: true,
        };
        assert_eq!(
            classify_runtime("/srv", &only_exe, &gof).kind,
            RuntimeKind::Go
        );
        assert_eq!(
            classify_runtime("/usr/bin/python3.11", &m, &dynf).kind,
            RuntimeKind::Python
        );
        assert_eq!(
            classify_runtime("/usr/bin/node", &m, &dynf).kind,
            RuntimeKind::Node
        );
    }

    #[test]
    fn this_process_is_glibc_dynamic() {
        let r = runtime(std::process::id());
        assert_eq!(r.kind, RuntimeKind::GlibcDynamic, "{r:?}");
        assert!(r.dynamic);
    }

    #[test]
    fn libc_has_syscall() {
        let a = AddressSpace::of(std::process::id());
        let libc = a.libc().expect("libc mapped");
        let (addr, size) = symbol(&libc.path, "syscall").expect("syscall in libc");
        assert!(addr > 0 && size > 0);
    }
}
