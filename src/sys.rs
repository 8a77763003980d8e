//! Small operating-system helpers (an FFI edge: each unsafe block says why it is sound).

use crate::error::{Error, Result};

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size we pass; pid 0 means this thread.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(Error::last_os("sched_getaffinity"));
    }
    // SAFETY: CPU_ISSET reads the set we own, for indices below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Cores the ranks of this host share: the CPUs online, capped by the cgroup's CPU quota
/// (`cpu.max`). Unlike `available_parallelism`, a launcher that binds each rank to its own
/// core (roccl-perf, `mpirun --bind-to core`) does not make every rank see one core.
pub fn host_cores() -> usize {
    // SAFETY: sysconf has no memory effects.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    let quota = std::fs::read_to_string("/sys/fs/cgroup/cpu.max")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace();
            let q = it.next()?.parse::<f64>().ok()?;
            let period = it.next()?.parse::<f64>().ok()?;
            Some((q / period).ceil().max(1.0) as usize)
        });
    quota.map_or(online, |q| q.min(online))
}

/// Bind the calling thread (and the threads it starts later) to one CPU.
pub fn bind_to_cpu(cpu: usize) -> Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(Error::arg(format!(
            "CPU {cpu} is beyond the {} the kernel interface supports",
            libc::CPU_SETSIZE
        )));
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes an index we checked.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size we pass; pid 0 means this thread.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(Error::last_os(format!("sched_setaffinity to CPU {cpu}")));
    }
    Ok(())
}

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

/// Bytes written as a number with an optional `K`, `M` or `G` suffix (powers of 1024), as
/// the `ROCCL_*` size settings and the tools take them; `None` when it is not one.
pub fn parse_bytes(s: &str) -> Option<usize> {
    let t = s.trim();
    let (num, mul) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mul)
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
