//! Making a fiber wait from inside a fault. A signal handler cannot switch stacks
//! safely (it runs on the carrier's alternate stack, which the next fault would reuse),
//! so the handler instead rewrites the interrupted context: it pushes the faulting
//! instruction's address on the fiber's own stack (below the 128-byte red zone) and
//! resumes the fiber at `toffload_guard_trampoline`. The trampoline saves every
//! register and the full extended state (XSAVE: other fibers run meanwhile and use
//! SIMD), calls wait_for_page, which parks the fiber like any other wait, restores
//! everything and returns to the faulting instruction with `ret 128`, which also gives
//! the red zone back. The access then faults again and, the page being free, succeeds.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Bytes XSAVE needs for the enabled state components (CPUID 0xD.0:EBX), + alignment.
static XSAVE_BYTES: AtomicUsize = AtomicUsize::new(4096);

std::arch::global_asm!(
    ".globl toffload_guard_trampoline",
    ".hidden toffload_guard_trampoline",
    ".type toffload_guard_trampoline,@function",
    "toffload_guard_trampoline:",
    "pushfq",
    "push rax",
    "push rcx",
    "push rdx",
    "push rbx",
    "push rbp",
    "push rsi",
    "push rdi",
    "push r8",
    "push r9",
    "push r10",
    "push r11",
    "push r12",
    "push r13",
    "push r14",
    "push r15",
    "mov rbp, rsp",
    "sub rsp, qword ptr [rip + {xs}]",
    "and rsp, -64",
    // XRSTOR faults on a dirty XSAVE header: zero it (64 bytes at offset 512).
    "xor eax, eax",
    "mov qword ptr [rsp + 512], rax",
    "mov qword ptr [rsp + 520], rax",
    "mov qword ptr [rsp + 528], rax",
    "mov qword ptr [rsp + 536], rax",
    "mov qword ptr [rsp + 544], rax",
    "mov qword ptr [rsp + 552], rax",
    "mov qword ptr [rsp + 560], rax",
    "mov qword ptr [rsp + 568], rax",
    "mov eax, -1",
    "mov edx, -1",
    "xsave64 [rsp]",
    "call {wait}",
    "mov eax, -1",
    "mov edx, -1",
    "xrstor64 [rsp]",
    "mov rsp, rbp",
    "pop r15",
    "pop r14",
    "pop r13",
    "pop r12",
    "pop r11",
    "pop r10",
    "pop r9",
    "pop r8",
    "pop rdi",
    "pop rsi",
    "pop rbp",
    "pop rbx",
    "pop rdx",
    "pop rcx",
    "pop rax",
    "popfq",
    "ret 128",
    ".size toffload_guard_trampoline, . - toffload_guard_trampoline",
    wait = sym guard_wait,
    xs = sym XSAVE_BYTES,
);

extern "C" {
    fn toffload_guard_trampoline();
}

extern "C" fn guard_wait() {
    let _phase = crate::handoff::scope();
    if let Some(f) = crate::fiber::current() {
        let saved = crate::real::errno();
        super::own::wait_for_page(f);
        crate::real::set_errno(saved);
    }
}

/// Sizes the XSAVE area for this CPU (once, before any redirect).
pub fn init() {
    // CPUID leaf 0xD exists on every x86_64 with XSAVE (all we run on).
    let ebx = std::arch::x86_64::__cpuid_count(0xD, 0).ebx as usize;
    XSAVE_BYTES.store(ebx.max(576) + 64, Relaxed);
}

/// Rewrites the interrupted context so the fiber runs the trampoline.
///
/// # Safety
/// `uc` is the ucontext of a fault on the running fiber.
pub unsafe fn redirect(uc: *mut libc::ucontext_t) {
    // SAFETY: the kernel's ucontext of this fault (our contract), not aliased here.
    let g = unsafe { &mut (*uc).uc_mcontext.gregs };
    let rip = g[libc::REG_RIP as usize] as usize;
    let rsp = g[libc::REG_RSP as usize] as usize - 128 - 8;
    // SAFETY: below the fiber's rsp past the 128-byte red zone: its own stack, unused
    // by the interrupted code; the trampoline returns through this word.
    unsafe { *(rsp as *mut usize) = rip };
    g[libc::REG_RSP as usize] = rsp as i64;
    g[libc::REG_RIP as usize] = toffload_guard_trampoline as *const () as usize as i64;
}
