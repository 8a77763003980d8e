//! Memory: the locked-memory limit, whether the CPU can read an address range, and giving
//! freed heap memory back to the system.

use crate::error::{Error, Result};

/// The locked-memory limit of this process (`ulimit -l`), soft and hard, in bytes
/// (`None` = unlimited). RDMA registration pins memory against it.
pub fn memlock_limit() -> Result<(Option<u64>, Option<u64>)> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid rlimit for the kernel to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return Err(Error::last_os("getrlimit(RLIMIT_MEMLOCK)"));
    }
    let v = |x: libc::rlim_t| (x != libc::RLIM_INFINITY).then_some(x);
    Ok((v(r.rlim_cur), v(r.rlim_max)))
}

/// Give the heap's free pages back to the system (glibc's `malloc_trim(0)`; nothing on other
/// C libraries). Buffers freed by a suspend (bounce buffers of closed connections, scratch)
/// are mostly below glibc's moving mmap threshold, so `free` keeps them resident; this
/// returns them. Returns whether any memory went back.
pub fn trim_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only walks and releases the allocator's own free lists.
        unsafe { libc::malloc_trim(0) != 0 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Whether the CPU can read `len` bytes at `addr` (at most a pipe's 64 KiB): `write(2)` them
/// into a pipe, which fails with EFAULT — instead of faulting this process — when the range
/// is not mapped readable. For GPU memory whose CPU mapping no runtime documents.
pub fn cpu_readable(addr: usize, len: usize) -> bool {
    let len = len.min(64 * 1024);
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
        return false;
    }
    // SAFETY: write(2) reads `addr` only inside the kernel, which reports EFAULT for memory
    // the CPU cannot read; the pipe is ours and an empty pipe takes 64 KiB.
    let n = unsafe { libc::write(fds[1], addr as *const libc::c_void, len) };
    // SAFETY: closing the descriptors pipe2 gave us.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    n == len as isize
}

#[cfg(test)]
mod probe_tests {
    use super::cpu_readable;

    #[test]
    fn the_read_probe_tells_mapped_from_unmapped_memory() {
        let v = vec![7u8; 8192];
        assert!(cpu_readable(v.as_ptr() as usize, v.len()));
        // The first page is never mapped; a PROT_NONE mapping is not readable either.
        assert!(!cpu_readable(16, 64));
        // SAFETY: an anonymous mapping we unmap below; nothing dereferences it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        assert!(!cpu_readable(p as usize, 64));
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, 4096) };
    }
}
