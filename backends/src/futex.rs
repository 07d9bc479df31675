//! The two futex calls the blocking wait needs. std has no public futex, and a
//! condvar per operation would cost a mutex round trip on every completion.

use std::sync::atomic::AtomicU32;

/// Sleeps while `*word == expected` (spurious wake-ups are the caller's to handle).
pub fn wait(word: &AtomicU32, expected: u32) {
    // SAFETY: the pointer is to a live, aligned u32; a null timeout waits forever.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

/// Wakes every thread sleeping on `word`.
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: as above; FUTEX_WAKE only reads the address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}
