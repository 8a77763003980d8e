//! futex(2) on the low half of a 64-bit counter in shared memory (waker and sleeper may be
//! different processes).

use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// The 32-bit futex word of a 64-bit counter: its low half, which holds the call number.
fn low_half(word: &AtomicU64) -> *mut u32 {
    let p = word.as_ptr() as *mut u32;
    if cfg!(target_endian = "big") {
        p.wrapping_add(1)
    } else {
        p
    }
}

/// Sleep until woken, `timeout` passes, or the low half of `word` no longer holds `expected`.
pub fn futex_wait(word: &AtomicU64, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the low half of `word` is a valid, aligned 32-bit word in shared memory for the
    // call's duration;
    // a shared (non-private) futex because the waker is another process.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            low_half(word),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

/// Wake every sleeper on the low half of `word`.
pub fn futex_wake(word: &AtomicU64) {
    // SAFETY: as above; waking has no memory effects beyond the syscall.
    unsafe { libc::syscall(libc::SYS_futex, low_half(word), libc::FUTEX_WAKE, i32::MAX) };
}
