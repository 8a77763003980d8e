//! CPU sets: the CPUs this process may use, the cores its host shares, binding to one.

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
