//! toffload-watch's kernel side: tracepoints, uprobes and per-CPU maps, filtered in the
//! kernel to the tgid userspace sets in WATCHED_TGID and the further ones in WATCHED
//! (a process tree, a cgroup; forks of watched processes join it). Everything is a counter or a
//! histogram bucket, so the hot paths are a few map lookups and adds; userspace reads
//! the maps once per window and works out the differences.
//!
//! The layouts userspace reads (ThreadInfo, Site, the counter indices, the histogram
//! geometry) are toffload-abi's (ebpf/abi), shared with the watcher.

#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{pt_regs, BPF_F_USER_STACK},
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user, generated as gen},
    macros::{map, raw_tracepoint, tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, PerCpuArray, PerCpuHashMap, StackTrace},
    programs::{
        tracing::StackIdContext, ProbeContext, RawTracePointContext, RetProbeContext,
        TracePointContext,
    },
    EbpfContext,
};
use toffload_abi::hist::{fine_bucket, log2_bucket};
use toffload_abi::watch::*;

/// A thread's first record: on or off CPU since `now`, in attach epoch `epoch`.
const fn new_thread(tgid: u32, now: u64, on_cpu: bool, epoch: u64) -> ThreadInfo {
    ThreadInfo {
        tgid,
        flags: 0,
        on_since: if on_cpu { now } else { 0 },
        off_since: if on_cpu { 0 } else { now },
        wake_ts: 0,
        on_ns: 0,
        off_ns: 0,
        vol: 0,
        invol: 0,
        offload_depth: 0,
        offload_start: 0,
        offload_off0: 0,
        sys_nr: 0,
        sys_ts: 0,
        offload_calls: 0,
        futex_calls: 0,
        offload_wake_ns: 0,
        epoch,
        out_ns: 0,
        sys_on0: 0,
        sys_vol0: 0,
        sys_blocked: 0,
        reads: 0,
        mux_waits: 0,
        stall_ns: 0,
        syscalls: 0,
    }
}

/// The watched tgid, set by userspace at load time (a read-only global, so the check
/// every hook makes first, for every process on the machine, is a compare against a
/// constant rather than a map lookup).
#[no_mangle]
static WATCHED_TGID: u32 = 0;
/// [0]: the attach epoch. Userspace bumps it each time it attaches the tracepoints
/// (sampled watching detaches them between bursts); a thread record from an older
/// epoch has timestamps that span a detached gap and is reset before use.
/// [1]: 1 while tracing. Userspace clears it before detaching and sets it after
/// attaching again, so that an offload is only timed while the scheduler
/// tracepoints that measure its off-CPU part are attached.
#[map]
static CONFIG: Array<u64> = Array::with_max_entries(2, 0);

#[inline(always)]
fn tracing_on() -> bool {
    CONFIG.get(1).copied().unwrap_or(0) != 0
}
#[map]
static THREADS: HashMap<u32, ThreadInfo> = HashMap::with_max_entries(16384, 0);
/// Watched tgids besides WATCHED_TGID (value unused): seeded by userspace with the
/// process tree or cgroup, joined by every task a watched process forks, left at
/// exit. A thread's tid joins too (the fork hook cannot tell a thread from a process
/// on the classic tracepoint); no process has that number as its tgid while the
/// thread lives, and its exit removes it.
#[map]
static WATCHED: HashMap<u32, u8> = HashMap::with_max_entries(16384, 0);
// Each per-CPU array below holds its counts as rows of several u64 per element: the
// kernel allocates a per-CPU array one element at a time under a global lock, and one
// u64 per element made tens of thousands of allocations, the largest part of the
// watcher's start.
#[map]
static COUNTERS: PerCpuArray<[u64; N_COUNTERS as usize]> = PerCpuArray::with_max_entries(1, 0);
/// [nr * 2] = calls, [nr * 2 + 1] = total ns.
#[map]
static SYSCALLS: PerCpuArray<[u64; (NR_MAX * 2) as usize]> = PerCpuArray::with_max_entries(1, 0);
/// Row nr: [log2(ns)] = calls.
#[map]
static SYS_HIST: PerCpuArray<[u64; SYS_BUCKETS as usize]> =
    PerCpuArray::with_max_entries(NR_MAX as u32, 0);
/// The fine histograms, one row each (H_STALL, H_DONE, H_WAKE, H_OUTSIDE): the
/// offload's stall; the stall without its wake-up delay (when the completion reached
/// the thread); wake-up delays; and each request's on-CPU time outside the offload,
/// from an offload's return to the thread's next offload call (its spread tells the
/// warm cost of a request from one that came back to cold caches).
#[map]
static FINE_HISTS: PerCpuArray<[u64; FINE_BUCKETS as usize]> =
    PerCpuArray::with_max_entries(N_FINE_HISTS, 0);
/// Stalls by their on-CPU share, in tenths (11 buckets).
#[map]
static SPIN_HIST: PerCpuArray<[u64; SPIN_BUCKETS as usize]> = PerCpuArray::with_max_entries(1, 0);
#[map]
static STACKS: StackTrace = StackTrace::with_max_entries(2048, 0);
// The futex maps stay preallocated (6,144 per-CPU elements at start, a few ms): a
// run-time allocated hash map in a tracepoint program is a verifier warning and a
// kernel WARN (a tainted kernel) before Linux 6.1, which this watch must not cause.
/// Futex calls per user stack id (best effort: a full bucket drops the stack, never
/// the count, which FUTEX_SITES keeps).
#[map]
static FUTEX_STACKS: PerCpuHashMap<u32, u64> = PerCpuHashMap::with_max_entries(2048, 0);
/// Futex calls per site.
#[map]
static FUTEX_SITES: PerCpuHashMap<Site, u64> = PerCpuHashMap::with_max_entries(4096, 0);
/// [cpu] = 1 while that CPU runs its idle task, as the last switch there traced said.
#[map]
static CPU_IDLE: Array<u32> = Array::with_max_entries(MAX_CPUS, 0);
/// Slot `i` of row `row` of a per-CPU array of rows (None past either end).
#[inline(always)]
fn slot<const N: usize>(map: &PerCpuArray<[u64; N]>, row: u32, i: u32) -> Option<*mut u64> {
    let i = i as usize;
    if i >= N {
        return None;
    }
    let p = map.get_ptr_mut(row)?;
    // SAFETY: i < N, so the slot lies inside the row.
    Some(unsafe { p.cast::<u64>().add(i) })
}

#[inline(always)]
fn add(idx: u32, v: u64) {
    if let Some(p) = slot(&COUNTERS, 0, idx) {
        // SAFETY: per-CPU slot, preemption is off while a BPF program runs.
        unsafe { *p += v };
    }
}

/// The 8 bytes at the current thread's user stack pointer (0 when unreadable).
#[inline(always)]
fn user_sp_word() -> u64 {
    // SAFETY: helpers on the current task; the pt_regs pointer is only read through
    // bpf_probe_read_kernel.
    unsafe {
        let task = gen::bpf_get_current_task_btf();
        let regs = gen::bpf_task_pt_regs(task) as *const pt_regs;
        if regs.is_null() {
            return 0;
        }
        let mut sp = 0u64;
        if gen::bpf_probe_read_kernel(
            (&mut sp as *mut u64).cast(),
            8,
            core::ptr::addr_of!((*regs).rsp).cast(),
        ) != 0
        {
            return 0;
        }
        bpf_probe_read_user(sp as *const u64).unwrap_or(0)
    }
}

#[inline(always)]
fn bump<const N: usize>(map: &PerCpuArray<[u64; N]>, row: u32, idx: u32) {
    if let Some(p) = slot(map, row, idx) {
        // SAFETY: as in add().
        unsafe { *p += 1 };
    }
}

/// A field of a tracepoint's record, loaded directly from the context (the verifier
/// allows aligned loads inside the record; a bpf_probe_read per field would cost a
/// helper call each, on the hottest hooks).
#[inline(always)]
fn field<T: Copy>(ctx: &TracePointContext, offset: usize) -> T {
    // SAFETY: `offset` is a naturally aligned field of the record (see the formats
    // quoted at each use).
    unsafe { *(ctx.as_ptr().cast::<u8>().add(offset).cast::<T>()) }
}

#[inline(always)]
fn watched(tgid: u32) -> bool {
    // SAFETY: a plain read of a global; volatile so the compiler keeps the load that
    // aya patches with the real value at load time.
    tgid != 0
        && (tgid == unsafe { core::ptr::read_volatile(&WATCHED_TGID) }
            // SAFETY: a lookup; the value is not read.
            || unsafe { WATCHED.get(&tgid) }.is_some())
}

#[inline(always)]
fn epoch() -> u64 {
    CONFIG.get(0).copied().unwrap_or(0)
}

/// The thread's on-CPU time so far, the running stretch included.
#[inline(always)]
fn on_cpu_clock(t: &ThreadInfo, now: u64) -> u64 {
    if t.on_since != 0 {
        t.on_ns + now.saturating_sub(t.on_since)
    } else {
        t.on_ns
    }
}

/// A thread's entry, its timestamps reset when they predate the current epoch.
#[inline(always)]
fn thread(tid: u32) -> Option<*mut ThreadInfo> {
    let p = THREADS.get_ptr_mut(tid)?;
    let e = epoch();
    // SAFETY: a live map value (see ThreadInfo for who writes it).
    let t = unsafe { &mut *p };
    if t.epoch != e {
        t.epoch = e;
        t.on_since = 0;
        t.off_since = 0;
        t.wake_ts = 0;
        t.offload_depth = 0;
        t.sys_ts = 0;
        // An outside part that spans a detached gap has lost part of its CPU.
        t.flags &= !F_OUT_OPEN;
    }
    Some(p)
}

/// The calling thread's entry, created when missing (the thread is on CPU).
#[inline(always)]
fn current_thread(tid: u32, tgid: u32, now: u64) -> Option<*mut ThreadInfo> {
    if let Some(p) = thread(tid) {
        // A forked process was registered under its parent's tgid (on_fork).
        // SAFETY: a live map value, this thread's own.
        let t = unsafe { &mut *p };
        if t.tgid != tgid {
            t.tgid = tgid;
        }
        // It runs now: with no on-CPU stretch open, its switch-in came before this
        // burst (the epoch reset it), and a thread that keeps its CPU (a busy loop,
        // an event loop under load) would count none of its time until it next
        // sleeps. Its stretch starts here.
        if t.on_since == 0 {
            t.on_since = now;
            t.off_since = 0;
        }
        return Some(p);
    }
    if THREADS
        .insert(tid, new_thread(tgid, now, true, epoch()), 0)
        .is_err()
    {
        add(C_THREADS_MISSED, 1);
        return None;
    }
    THREADS.get_ptr_mut(tid)
}

/// Raw tracepoints for the syscalls: the kernel hands over its arguments directly,
/// without formatting a trace record first, which matters on a path every syscall of
/// every process takes while the watch runs.
#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn sys_enter(ctx: RawTracePointContext) -> i32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if !watched(tgid) {
        if tracing_on() {
            add(C_HOST_SYSCALLS, 1);
        }
        return 0;
    }
    if !tracing_on() {
        return 0;
    }
    // sys_enter(struct pt_regs *regs, long id)
    let nr: i64 = ctx.arg(1);
    if nr < 0 {
        return 0;
    }
    let nr = nr as u64;
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(t) = current_thread(tid, tgid, now) else {
        return 0;
    };
    // SAFETY: a live map value; only this thread writes these fields.
    let t = unsafe { &mut *t };
    t.sys_nr = nr;
    t.sys_ts = now;
    t.sys_on0 = on_cpu_clock(t, now);
    t.sys_vol0 = t.vol;
    t.sys_blocked = 0;
    t.syscalls += 1;
    match nr {
        // read, readv, recvfrom, recvmsg, recvmmsg
        0 | 19 | 45 | 47 | 299 => t.reads += 1,
        // poll, select, epoll_wait, pselect6, ppoll, epoll_pwait, epoll_pwait2
        7 | 23 | 232 | 270 | 271 | 281 | 441 => t.mux_waits += 1,
        _ => {}
    }
    if nr == NR_FUTEX {
        add(C_FUTEX_TOTAL, 1);
        t.futex_calls += 1;
        if t.offload_depth > 0 {
            // The offload's own wait (a blocking accel_run sleeps on a futex): it is
            // the stall, not the application's synchronization.
            add(C_FUTEX_IN_OFFLOAD, 1);
        } else {
            // The top user frame alone decides the origin; it never collides the
            // way stack ids in a full stack map do.
            let mut top = [0u64; 1];
            // SAFETY: an 8-byte buffer on the BPF stack, its size passed.
            let n = unsafe {
                gen::bpf_get_stack(
                    ctx.as_ptr(),
                    top.as_mut_ptr().cast(),
                    8,
                    BPF_F_USER_STACK as u64,
                )
            };
            if n >= 8 {
                let site = Site {
                    ip: top[0],
                    caller: user_sp_word(),
                };
                match FUTEX_SITES.get_ptr_mut(site) {
                    // SAFETY: per-CPU value.
                    Some(p) => unsafe { *p += 1 },
                    None => {
                        let _ = FUTEX_SITES.insert(site, 1u64, 0);
                    }
                }
            } else {
                add(C_FUTEX_NOSTACK, 1);
            }
            // Whole stacks are evidence for the report, not counts: one call in 64
            // is walked, which keeps a futex-heavy server's overhead down.
            let seen = slot(&COUNTERS, 0, C_FUTEX_SEEN);
            let sample = match seen {
                // SAFETY: per-CPU value.
                Some(p) => unsafe {
                    *p += 1;
                    *p & 63 == 1
                },
                None => false,
            };
            if !sample {
                return 0;
            }
            if let Ok(sid) = ctx.get_stackid(&STACKS, BPF_F_USER_STACK as u64) {
                let key = sid as u32;
                match FUTEX_STACKS.get_ptr_mut(key) {
                    // SAFETY: per-CPU value.
                    Some(p) => unsafe { *p += 1 },
                    None => {
                        let _ = FUTEX_STACKS.insert(key, 1u64, 0);
                    }
                }
            }
        }
    }
    0
}

#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn sys_exit(ctx: RawTracePointContext) -> i32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if !watched(tgid) || !tracing_on() {
        return 0;
    }
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(t) = current_thread(tid, tgid, now) else {
        return 0;
    };
    // SAFETY: as in sys_enter.
    let t = unsafe { &mut *t };
    if t.sys_ts == 0 {
        // Entered before the watch began (a thread blocked in accept, say): count
        // the call, from the syscall number in the saved registers, without a latency.
        // sys_exit(struct pt_regs *regs, long ret)
        let regs: *const pt_regs = ctx.arg(0);
        let mut nr = 0u64;
        // SAFETY: reads one field of the kernel's pt_regs through the helper.
        let r = unsafe {
            gen::bpf_probe_read_kernel(
                (&mut nr as *mut u64).cast(),
                8,
                core::ptr::addr_of!((*regs).orig_rax).cast(),
            )
        };
        if r == 0 && nr < NR_MAX {
            bump(&SYSCALLS, 0, (nr * 2) as u32);
        }
        return 0;
    }
    let dt = now.saturating_sub(t.sys_ts);
    let nr = t.sys_nr;
    t.sys_ts = 0;
    // Only threads that call the offload: a helper's sleeps (a device engine's) are
    // not a request's.
    if t.vol != t.sys_vol0 && (t.offload_depth > 0 || t.offload_calls > 0) {
        let inside = t.offload_depth > 0;
        add(
            if inside {
                C_SLEPT_IN_SYSCALLS
            } else {
                C_SLEPT_SYSCALLS
            },
            1,
        );
        add(
            if inside {
                C_SLEPT_IN_SYSCALL_ON_NS
            } else {
                C_SLEPT_SYSCALL_ON_NS
            },
            on_cpu_clock(t, now).saturating_sub(t.sys_on0),
        );
        if !inside {
            add(C_SLEPT_SYSCALL_BLOCKED_NS, t.sys_blocked);
        }
    }
    if nr >= NR_MAX {
        return 0;
    }
    let i = (nr * 2) as u32;
    bump(&SYSCALLS, 0, i);
    if let Some(p) = slot(&SYSCALLS, 0, i + 1) {
        // SAFETY: per-CPU slot.
        unsafe { *p += dt };
    }
    bump(&SYS_HIST, nr as u32, log2_bucket(dt) as u32);
    0
}

/// A context switch from `prev_pid` (the current task) to `next_pid`.
#[inline(always)]
fn on_switch(prev_pid: u32, involuntary: bool, next_pid: u32) -> u32 {
    // Off between bursts: detaching takes the kernel an RCU grace period per link,
    // and the hot programs must not keep recording (and costing) meanwhile.
    if !tracing_on() {
        return 0;
    }
    // Every CPU's switches come here, watched or not: whether it goes idle now.
    // SAFETY: a helper without arguments.
    let cpu = unsafe { gen::bpf_get_smp_processor_id() };
    if let Some(p) = CPU_IDLE.get_ptr_mut(cpu) {
        // SAFETY: this CPU's own slot, written only by its own switches.
        unsafe { *p = (next_pid == 0) as u32 };
    }
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // The hook runs in prev's context, so the current tgid is prev's.
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if prev_pid != 0 && watched(tgid) {
        if let Some(t) = current_thread(prev_pid, tgid, now) {
            // SAFETY: a live map value; the scheduler serializes switches of one task.
            let t = unsafe { &mut *t };
            if t.on_since != 0 {
                let d = now.saturating_sub(t.on_since);
                t.on_ns += d;
                add(C_ON_NS, d);
                add(
                    if t.offload_depth > 0 {
                        C_ON_IN_NS
                    } else {
                        C_ON_OUT_NS
                    },
                    d,
                );
                if t.offload_depth == 0 && t.flags & F_OUT_OPEN != 0 {
                    t.out_ns += d;
                }
            }
            t.on_since = 0;
            t.off_since = now;
            // A wake-up that came while the thread still ran (woken before it got to
            // sleep) is no wake-up from this switch: left pending, it would date the
            // next real one (a read's, say) from before the thread ever slept.
            t.wake_ts = 0;
            if involuntary {
                t.invol += 1;
                add(C_INVOL, 1);
            } else {
                t.vol += 1;
                add(C_VOL, 1);
                if t.offload_depth > 0 {
                    add(C_OFFLOAD_SLEEPS, 1);
                }
            }
        }
    }
    if next_pid != 0 {
        if let Some(t) = thread(next_pid) {
            // SAFETY: as above.
            let t = unsafe { &mut *t };
            if t.flags & F_EXITED == 0 {
                let off_since = t.off_since;
                if off_since != 0 {
                    let d = now.saturating_sub(off_since);
                    t.off_ns += d;
                    add(C_OFF_NS, d);
                }
                t.off_since = 0;
                t.on_since = now;
                if t.wake_ts != 0 {
                    let t_wake = t.wake_ts;
                    let d = now.saturating_sub(t_wake);
                    t.wake_ts = 0;
                    add(C_WAKEUPS, 1);
                    add(C_WAKE_NS, d);
                    bump(&FINE_HISTS, H_WAKE, fine_bucket(d));
                    if t.offload_depth > 0 {
                        t.offload_wake_ns += d;
                    } else if t.sys_ts != 0 && off_since != 0 {
                        // Asleep in a syscall outside the offload: how long until
                        // the wake-up.
                        t.sys_blocked += t_wake.saturating_sub(off_since);
                    }
                }
            }
        }
    }
    0
}

#[inline(always)]
fn on_wakeup(pid: u32) -> u32 {
    if pid == 0 || !tracing_on() {
        return 0;
    }
    stamp_wake(pid);
    0
}

/// Dates a watched thread's wake-up; false when `pid` is no watched thread.
#[inline(always)]
fn stamp_wake(pid: u32) -> bool {
    let Some(t) = thread(pid) else {
        return false;
    };
    // SAFETY: a live map value; a racing second wake-up only moves the timestamp.
    let t = unsafe { &mut *t };
    if t.wake_ts == 0 {
        // SAFETY: a helper without arguments.
        t.wake_ts = unsafe { bpf_ktime_get_ns() };
    }
    true
}

/// A task created by the current one (a thread, or a forked process).
#[inline(always)]
fn on_fork(child: u32) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !watched(tgid) || child == 0 {
        return 0;
    }
    // A forked process is watched from its first instruction, like its parent. This
    // hook and the exit's stay attached between bursts (loader::KEPT), so that the
    // set is complete whenever tracing resumes; the counts are the bursts' only.
    if WATCHED.insert(&child, &1u8, 0).is_err() {
        add(C_THREADS_MISSED, 1);
    }
    if !tracing_on() {
        return 0;
    }
    add(C_THREADS_CREATED, 1);
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // Registered now so that its first run is seen; a forked process (not a thread)
    // is registered under its parent's tgid and corrected at its first event.
    if THREADS
        .insert(child, new_thread(tgid, now, false, epoch()), 0)
        .is_err()
    {
        add(C_THREADS_MISSED, 1);
    }
    0
}

#[inline(always)]
fn on_exit(pid: u32) -> u32 {
    let _ = WATCHED.remove(&pid);
    if !tracing_on() {
        return 0;
    }
    if let Some(t) = THREADS.get_ptr_mut(pid) {
        // SAFETY: a live map value. Userspace reads the final numbers, then deletes.
        let t = unsafe { &mut *t };
        if t.flags & F_EXITED == 0 {
            t.flags |= F_EXITED;
            add(C_THREADS_EXITED, 1);
        }
    }
    0
}

// Classic tracepoints (the default). Offsets from their format files.

#[tracepoint]
pub fn sched_switch(ctx: TracePointContext) -> u32 {
    // prev_pid 24, prev_state 32, next_pid 56. A still-runnable prev (state 0, or
    // TASK_REPORT_MAX 0x100 for a preemption) had the CPU taken away.
    let prev_state = field::<i64>(&ctx, 32);
    on_switch(
        field::<i32>(&ctx, 24) as u32,
        prev_state & 0xff == 0,
        field::<i32>(&ctx, 56) as u32,
    )
}

/// sched_waking, not sched_wakeup: it runs in the waker's context, where sched_wakeup
/// of a task on an idle CPU runs on that CPU after the IPI, its waker unknown. One
/// program for both uses, so that each wake-up on the machine costs one record: a
/// watched thread's wake-up dates its wake-up latency (from the waker's call, the IPI
/// included); a watched thread waking a task outside the watch on another CPU counts
/// as a peer wake-up, and as an idle one where that CPU was idle.
#[tracepoint]
pub fn sched_waking(ctx: TracePointContext) -> u32 {
    if !tracing_on() {
        return 0;
    }
    // pid 24, target_cpu 32 (the CPU the wakee last ran on).
    on_waking(field::<i32>(&ctx, 24) as u32, field::<i32>(&ctx, 32) as u32)
}

/// One wake-up: `pid` the wakee, `target` the CPU it last ran on.
#[inline(always)]
fn on_waking(pid: u32, target: u32) -> u32 {
    if pid == 0 {
        return 0;
    }
    // One lookup on this path, which every wake-up on the machine takes.
    if stamp_wake(pid) {
        return 0;
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !watched(tgid) {
        return 0;
    }
    // SAFETY: a helper without arguments.
    let cpu = unsafe { gen::bpf_get_smp_processor_id() };
    if target == cpu {
        return 0;
    }
    add(C_PEER_WAKES, 1);
    if CPU_IDLE.get(target).is_some_and(|&idle| idle != 0) {
        add(C_PEER_IDLE_WAKES, 1);
    }
    0
}

#[tracepoint]
pub fn sched_wakeup_new(ctx: TracePointContext) -> u32 {
    on_wakeup(field::<i32>(&ctx, 24) as u32)
}

#[tracepoint]
pub fn sched_process_fork(ctx: TracePointContext) -> u32 {
    on_fork(field::<i32>(&ctx, 20) as u32)
}

#[tracepoint]
pub fn sched_process_exit(ctx: TracePointContext) -> u32 {
    on_exit(field::<i32>(&ctx, 24) as u32)
}

// Raw tracepoints (the default where the kernel's BTF gives the offsets below): the
// kernel's own arguments, no trace record built first, and a link the kernel
// releases at once, where a classic tracepoint's perf event takes an RCU grace
// period to go (one at a time, ~80 ms each), still building a record per event.
// task_struct's pid and cpu offsets come from the kernel's BTF, read by userspace
// and set at load time.

/// Offset of `pid` in `struct task_struct` (0: unknown; the raw programs are then
/// not attached).
#[no_mangle]
static TASK_PID_OFF: u32 = 0;
/// Offset of the CPU a task last ran on (task_cpu()) in `struct task_struct`.
#[no_mangle]
static TASK_CPU_OFF: u32 = 0;

/// The u32 at `off` in the task at `task` (0 where either is unknown).
#[inline(always)]
fn task_u32(task: u64, off: u32) -> u32 {
    if task == 0 || off == 0 {
        return 0;
    }
    let mut v = 0u32;
    // SAFETY: the helper copies 4 bytes into the local v, and checks the kernel
    // address itself (a bad one fails, leaving 0).
    unsafe {
        gen::bpf_probe_read_kernel(
            (&mut v as *mut u32).cast(),
            4,
            (task + off as u64) as *const core::ffi::c_void,
        )
    };
    v
}

#[inline(always)]
fn task_pid(task: u64) -> u32 {
    // SAFETY: a volatile read of a load-time global.
    task_u32(task, unsafe { core::ptr::read_volatile(&TASK_PID_OFF) })
}

#[inline(always)]
fn task_cpu(task: u64) -> u32 {
    // SAFETY: a volatile read of a load-time global.
    task_u32(task, unsafe { core::ptr::read_volatile(&TASK_CPU_OFF) })
}

/// sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next,
/// unsigned int prev_state)
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn raw_sched_switch(ctx: RawTracePointContext) -> i32 {
    // Before the kernel read below: between bursts the link may linger a moment.
    if !tracing_on() {
        return 0;
    }
    let preempt: u64 = ctx.arg(0);
    let next: u64 = ctx.arg(2);
    let prev_state: u64 = ctx.arg(3);
    let prev_pid = bpf_get_current_pid_tgid() as u32;
    on_switch(
        prev_pid,
        preempt & 0xff != 0 || prev_state & 0xffff_ffff == 0,
        task_pid(next),
    ) as i32
}

/// sched_waking(struct task_struct *p): as sched_waking above, the target CPU read
/// from the task.
#[raw_tracepoint(tracepoint = "sched_waking")]
pub fn raw_sched_waking(ctx: RawTracePointContext) -> i32 {
    if !tracing_on() {
        return 0;
    }
    let p: u64 = ctx.arg(0);
    on_waking(task_pid(p), task_cpu(p)) as i32
}

#[raw_tracepoint(tracepoint = "sched_wakeup_new")]
pub fn raw_sched_wakeup_new(ctx: RawTracePointContext) -> i32 {
    on_wakeup(task_pid(ctx.arg(0))) as i32
}

/// sched_process_fork(struct task_struct *parent, struct task_struct *child)
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn raw_sched_process_fork(ctx: RawTracePointContext) -> i32 {
    on_fork(task_pid(ctx.arg(1))) as i32
}

/// sched_process_exit(struct task_struct *p, ...)
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn raw_sched_process_exit(ctx: RawTracePointContext) -> i32 {
    on_exit(task_pid(ctx.arg(0))) as i32
}

/// Closes the running thread's on-CPU stretch at an offload's entry or return, so
/// that the time before it counts in `side` (C_ON_OUT_NS or C_ON_IN_NS).
#[inline(always)]
fn split_on_cpu(t: &mut ThreadInfo, now: u64, side: u32) {
    if t.on_since != 0 {
        let d = now.saturating_sub(t.on_since);
        t.on_ns += d;
        add(C_ON_NS, d);
        add(side, d);
        t.on_since = now;
    }
}

#[uprobe]
pub fn offload_enter(_ctx: ProbeContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if !tracing_on() || !watched(tgid) {
        return 0;
    }
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(t) = current_thread(tid, tgid, now) {
        // SAFETY: own thread's entry.
        let t = unsafe { &mut *t };
        if t.offload_depth == 0 {
            if t.flags & F_OUT_OPEN != 0 && t.on_since != 0 {
                let d = now.saturating_sub(t.on_since);
                bump(&FINE_HISTS, H_OUTSIDE, fine_bucket(t.out_ns + d));
            }
            t.flags &= !F_OUT_OPEN;
            split_on_cpu(t, now, C_ON_OUT_NS);
            t.offload_start = now;
            t.offload_off0 = t.off_ns;
            t.offload_wake_ns = 0;
        }
        t.offload_depth += 1;
    }
    0
}

#[uretprobe]
pub fn offload_exit(_ctx: RetProbeContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if !tracing_on() || !watched(tgid) {
        return 0;
    }
    let Some(t) = thread(tid) else {
        return 0;
    };
    // SAFETY: own thread's entry.
    let t = unsafe { &mut *t };
    if t.offload_depth == 0 {
        return 0;
    }
    t.offload_depth -= 1;
    if t.offload_depth != 0 {
        return 0;
    }
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    split_on_cpu(t, now, C_ON_IN_NS);
    t.out_ns = 0;
    t.flags |= F_OUT_OPEN;
    let stall = now.saturating_sub(t.offload_start);
    // Every off-CPU interval of the stall was closed by the switch that brought the
    // thread back, so off_ns now includes all of them.
    let off = t.off_ns.saturating_sub(t.offload_off0);
    let off = if off > stall { stall } else { off };
    t.offload_calls += 1;
    t.stall_ns += stall;
    add(C_OFFLOAD_CALLS, 1);
    add(C_OFFLOAD_NS, stall);
    add(C_OFFLOAD_OFF_NS, off);
    bump(&FINE_HISTS, H_STALL, fine_bucket(stall));
    let wake = if t.offload_wake_ns > stall {
        stall
    } else {
        t.offload_wake_ns
    };
    add(C_OFFLOAD_WAKE_NS, wake);
    bump(&FINE_HISTS, H_DONE, fine_bucket(stall - wake));
    // This stall's on-CPU share in tenths (0: blocked throughout, 10: spun throughout).
    if stall > 0 {
        let tenth = ((stall - off) * 10 / stall) as u32;
        bump(&SPIN_HIST, 0, if tenth > 10 { 10 } else { tenth });
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
