//! The libc functions we interpose, as libc defines them. Resolved lazily with
//! dlsym(RTLD_NEXT) (dlvsym for the condition variables, whose two ABIs must never be
//! mixed), because our interposers can run before our constructor: other libraries'
//! constructors call read or pthread_mutex_lock too. The runtime's own code calls
//! these, never the interposed names, so it cannot recurse into itself.

use libc::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering::*};

/// Resolves `name` (NUL-terminated) once and caches it in `slot`.
#[cold]
fn resolve(slot: &AtomicUsize, name: &[u8], version: Option<&[u8]>) -> usize {
    // SAFETY: NUL-terminated literals; RTLD_NEXT is valid from a shared object.
    let p = unsafe {
        match version {
            Some(v) => libc::dlvsym(
                libc::RTLD_NEXT,
                name.as_ptr() as *const c_char,
                v.as_ptr() as *const c_char,
            ),
            None => libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char),
        }
    } as usize;
    if p == 0 {
        // libc always has these; without one we cannot even pass through.
        crate::log::fatal(name);
    }
    slot.store(p, Release);
    p
}

/// Declares `pub fn NAME() -> extern "C" fn(ARGS) -> RET`, the real libc function.
macro_rules! real {
    ($($name:ident $(@ $ver:literal)? = $sym:literal : fn($($arg:ty),*) -> $ret:ty;)*) => {
        $(
            #[allow(non_snake_case)]
            #[inline]
            pub fn $name() -> unsafe extern "C" fn($($arg),*) -> $ret {
                static SLOT: AtomicUsize = AtomicUsize::new(0);
                let mut p = SLOT.load(Acquire);
                if p == 0 {
                    #[allow(unused_mut, unused_assignments)]
                    let mut ver: Option<&[u8]> = None;
                    $( ver = Some(concat!($ver, "\0").as_bytes()); )?
                    p = resolve(&SLOT, concat!($sym, "\0").as_bytes(), ver);
                }
                // SAFETY: the symbol has this C signature in glibc.
                unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> $ret>(p) }
            }
        )*
    };
}

type Ptr = *mut c_void;
type CPtr = *const c_void;
type Ts = *const libc::timespec;

real! {
    read = "read": fn(c_int, Ptr, usize) -> isize;
    write = "write": fn(c_int, CPtr, usize) -> isize;
    recv = "recv": fn(c_int, Ptr, usize, c_int) -> isize;
    send = "send": fn(c_int, CPtr, usize, c_int) -> isize;
    recvfrom = "recvfrom": fn(c_int, Ptr, usize, c_int, *mut libc::sockaddr, *mut libc::socklen_t) -> isize;
    sendto = "sendto": fn(c_int, CPtr, usize, c_int, *const libc::sockaddr, libc::socklen_t) -> isize;
    readv = "readv": fn(c_int, *const libc::iovec, c_int) -> isize;
    writev = "writev": fn(c_int, *const libc::iovec, c_int) -> isize;
    recvmsg = "recvmsg": fn(c_int, *mut libc::msghdr, c_int) -> isize;
    sendmsg = "sendmsg": fn(c_int, *const libc::msghdr, c_int) -> isize;
    accept = "accept": fn(c_int, *mut libc::sockaddr, *mut libc::socklen_t) -> c_int;
    accept4 = "accept4": fn(c_int, *mut libc::sockaddr, *mut libc::socklen_t, c_int) -> c_int;
    connect = "connect": fn(c_int, *const libc::sockaddr, libc::socklen_t) -> c_int;
    getsockopt = "getsockopt": fn(c_int, c_int, c_int, Ptr, *mut libc::socklen_t) -> c_int;
    setsockopt = "setsockopt": fn(c_int, c_int, c_int, CPtr, libc::socklen_t) -> c_int;
    // Variadic in C; called with the one integer/pointer argument they take, which the
    // x86-64 calling convention passes as for a fixed one.
    fcntl = "fcntl": fn(c_int, c_int, usize) -> c_int;
    ioctl = "ioctl": fn(c_int, libc::c_ulong, usize) -> c_int;
    close = "close": fn(c_int) -> c_int;
    dup = "dup": fn(c_int) -> c_int;
    dup2 = "dup2": fn(c_int, c_int) -> c_int;
    dup3 = "dup3": fn(c_int, c_int, c_int) -> c_int;
    socket = "socket": fn(c_int, c_int, c_int) -> c_int;
    socketpair = "socketpair": fn(c_int, c_int, c_int, *mut c_int) -> c_int;
    poll = "poll": fn(*mut libc::pollfd, libc::nfds_t, c_int) -> c_int;
    ppoll = "ppoll": fn(*mut libc::pollfd, libc::nfds_t, Ts, *const libc::sigset_t) -> c_int;
    select = "select": fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *mut libc::timeval) -> c_int;
    sleep = "sleep": fn(libc::c_uint) -> libc::c_uint;
    usleep = "usleep": fn(libc::useconds_t) -> c_int;
    nanosleep = "nanosleep": fn(Ts, *mut libc::timespec) -> c_int;
    clock_nanosleep = "clock_nanosleep": fn(libc::clockid_t, c_int, Ts, *mut libc::timespec) -> c_int;
    sched_yield = "sched_yield": fn() -> c_int;
    sigaction = "sigaction": fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;
    epoll_wait = "epoll_wait": fn(c_int, *mut libc::epoll_event, c_int, c_int) -> c_int;
    epoll_pwait = "epoll_pwait": fn(c_int, *mut libc::epoll_event, c_int, c_int, *const libc::sigset_t) -> c_int;

    pthread_create = "pthread_create": fn(*mut libc::pthread_t, *const libc::pthread_attr_t, extern "C" fn(Ptr) -> Ptr, Ptr) -> c_int;
    pthread_join = "pthread_join": fn(libc::pthread_t, *mut Ptr) -> c_int;
    pthread_tryjoin_np = "pthread_tryjoin_np": fn(libc::pthread_t, *mut Ptr) -> c_int;
    pthread_timedjoin_np = "pthread_timedjoin_np": fn(libc::pthread_t, *mut Ptr, Ts) -> c_int;
    pthread_clockjoin_np = "pthread_clockjoin_np": fn(libc::pthread_t, *mut Ptr, libc::clockid_t, Ts) -> c_int;
    pthread_detach = "pthread_detach": fn(libc::pthread_t) -> c_int;
    pthread_exit = "pthread_exit": fn(Ptr) -> ();
    pthread_getattr_np = "pthread_getattr_np": fn(libc::pthread_t, *mut libc::pthread_attr_t) -> c_int;
    pthread_kill = "pthread_kill": fn(libc::pthread_t, c_int) -> c_int;
    pthread_setname_np = "pthread_setname_np": fn(libc::pthread_t, *const c_char) -> c_int;
    pthread_getname_np = "pthread_getname_np": fn(libc::pthread_t, *mut c_char, usize) -> c_int;
    pthread_cancel = "pthread_cancel": fn(libc::pthread_t) -> c_int;
    cxa_thread_atexit_impl = "__cxa_thread_atexit_impl": fn(Ptr, Ptr, Ptr) -> c_int;

    pthread_mutex_lock = "pthread_mutex_lock": fn(*mut libc::pthread_mutex_t) -> c_int;
    pthread_mutex_trylock = "pthread_mutex_trylock": fn(*mut libc::pthread_mutex_t) -> c_int;
    pthread_mutex_timedlock = "pthread_mutex_timedlock": fn(*mut libc::pthread_mutex_t, Ts) -> c_int;
    pthread_mutex_clocklock = "pthread_mutex_clocklock": fn(*mut libc::pthread_mutex_t, libc::clockid_t, Ts) -> c_int;
    pthread_mutex_unlock = "pthread_mutex_unlock": fn(*mut libc::pthread_mutex_t) -> c_int;

    pthread_rwlock_rdlock = "pthread_rwlock_rdlock": fn(*mut libc::pthread_rwlock_t) -> c_int;
    pthread_rwlock_wrlock = "pthread_rwlock_wrlock": fn(*mut libc::pthread_rwlock_t) -> c_int;
    pthread_rwlock_tryrdlock = "pthread_rwlock_tryrdlock": fn(*mut libc::pthread_rwlock_t) -> c_int;
    pthread_rwlock_trywrlock = "pthread_rwlock_trywrlock": fn(*mut libc::pthread_rwlock_t) -> c_int;
    pthread_rwlock_timedrdlock = "pthread_rwlock_timedrdlock": fn(*mut libc::pthread_rwlock_t, Ts) -> c_int;
    pthread_rwlock_timedwrlock = "pthread_rwlock_timedwrlock": fn(*mut libc::pthread_rwlock_t, Ts) -> c_int;
    pthread_rwlock_clockrdlock = "pthread_rwlock_clockrdlock": fn(*mut libc::pthread_rwlock_t, libc::clockid_t, Ts) -> c_int;
    pthread_rwlock_clockwrlock = "pthread_rwlock_clockwrlock": fn(*mut libc::pthread_rwlock_t, libc::clockid_t, Ts) -> c_int;
    pthread_rwlock_unlock = "pthread_rwlock_unlock": fn(*mut libc::pthread_rwlock_t) -> c_int;

    cond_init_232 @ "GLIBC_2.3.2" = "pthread_cond_init": fn(Ptr, CPtr) -> c_int;
    cond_destroy_232 @ "GLIBC_2.3.2" = "pthread_cond_destroy": fn(Ptr) -> c_int;
    cond_signal_232 @ "GLIBC_2.3.2" = "pthread_cond_signal": fn(Ptr) -> c_int;
    cond_broadcast_232 @ "GLIBC_2.3.2" = "pthread_cond_broadcast": fn(Ptr) -> c_int;
    cond_wait_232 @ "GLIBC_2.3.2" = "pthread_cond_wait": fn(Ptr, *mut libc::pthread_mutex_t) -> c_int;
    cond_timedwait_232 @ "GLIBC_2.3.2" = "pthread_cond_timedwait": fn(Ptr, *mut libc::pthread_mutex_t, Ts) -> c_int;
    cond_init_225 @ "GLIBC_2.2.5" = "pthread_cond_init": fn(Ptr, CPtr) -> c_int;
    cond_destroy_225 @ "GLIBC_2.2.5" = "pthread_cond_destroy": fn(Ptr) -> c_int;
    cond_signal_225 @ "GLIBC_2.2.5" = "pthread_cond_signal": fn(Ptr) -> c_int;
    cond_broadcast_225 @ "GLIBC_2.2.5" = "pthread_cond_broadcast": fn(Ptr) -> c_int;
    cond_wait_225 @ "GLIBC_2.2.5" = "pthread_cond_wait": fn(Ptr, *mut libc::pthread_mutex_t) -> c_int;
    cond_timedwait_225 @ "GLIBC_2.2.5" = "pthread_cond_timedwait": fn(Ptr, *mut libc::pthread_mutex_t, Ts) -> c_int;
    pthread_cond_clockwait = "pthread_cond_clockwait": fn(Ptr, *mut libc::pthread_mutex_t, libc::clockid_t, Ts) -> c_int;

    sem_trywait = "sem_trywait": fn(*mut libc::sem_t) -> c_int;
    sem_post = "sem_post": fn(*mut libc::sem_t) -> c_int;
    sem_wait = "sem_wait": fn(*mut libc::sem_t) -> c_int;
    sem_timedwait = "sem_timedwait": fn(*mut libc::sem_t, Ts) -> c_int;
    sem_clockwait = "sem_clockwait": fn(*mut libc::sem_t, libc::clockid_t, Ts) -> c_int;
    pthread_once = "pthread_once": fn(*mut c_int, unsafe extern "C" fn()) -> c_int;
    pthread_key_create = "pthread_key_create": fn(*mut libc::pthread_key_t, Option<unsafe extern "C" fn(Ptr)>) -> c_int;
    pthread_key_delete = "pthread_key_delete": fn(libc::pthread_key_t) -> c_int;
    pthread_getspecific = "pthread_getspecific": fn(libc::pthread_key_t) -> Ptr;
    pthread_setspecific = "pthread_setspecific": fn(libc::pthread_key_t, CPtr) -> c_int;
}

/// errno of the calling thread.
#[inline]
pub fn errno_ptr() -> *mut c_int {
    // SAFETY: always valid for the calling thread.
    unsafe { libc::__errno_location() }
}

#[inline]
pub fn errno() -> c_int {
    // SAFETY: see errno_ptr.
    unsafe { *errno_ptr() }
}

#[inline]
pub fn set_errno(e: c_int) {
    // SAFETY: see errno_ptr.
    unsafe { *errno_ptr() = e }
}

/// The calling thread's kernel id (raw syscall: glibc caches nothing we could confuse).
pub fn gettid() -> i32 {
    // SAFETY: no arguments.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

/// A raw write for the runtime's own messages: never through the interposed write.
pub fn raw_write(fd: c_int, b: &[u8]) {
    let mut off = 0;
    while off < b.len() {
        // SAFETY: valid slice.
        let n = unsafe { libc::syscall(libc::SYS_write, fd, b[off..].as_ptr(), b.len() - off) };
        if n <= 0 {
            if n < 0 && errno() == libc::EINTR {
                continue;
            }
            return;
        }
        off += n as usize;
    }
}
