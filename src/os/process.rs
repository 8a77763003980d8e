//! Other processes of this host: whether one is gone, its pid namespace, the host's boot
//! id, and copies straight between two processes' memory (`process_vm_readv`/`writev`,
//! "cross-memory attach").

/// A known word whose address a process publishes; a peer that reads it back through
/// `process_vm_readv` knows that single-copy transfers work between the two processes.
pub static CMA_PROBE: u64 = 0x524f_4343_4c43_4d41; // "ROCCLCMA"

/// The boot id of this host (ranks with the same one share memory).
pub fn host_id() -> [u8; 16] {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let hex: Vec<u8> = s.trim().bytes().filter(|c| c.is_ascii_hexdigit()).collect();
    let mut id = [0u8; 16];
    for (i, pair) in hex.chunks(2).take(16).enumerate() {
        let txt = std::str::from_utf8(pair).unwrap_or("0");
        id[i] = u8::from_str_radix(txt, 16).unwrap_or(0);
    }
    id
}

/// This process's pid namespace (0 if unknown).
pub fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// Whether process `pid` (of our pid namespace) is gone: no such process, or a zombie that
/// its parent has not reaped yet.
pub fn process_gone(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid as i32, 0) } != 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X")
    })
}

/// Whether process `pid` (of our pid namespace) is stopped: by a signal (SIGSTOP,
/// SIGTSTP, a terminal) or by a debugger.
pub fn process_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
            .is_some_and(|state| state == "T" || state == "t")
    })
}

/// Copy `local.len()` bytes at `remote` in process `pid` into `local` (process_vm_readv).
pub fn cma_read(pid: i32, remote: u64, local: &mut [u8]) -> std::io::Result<()> {
    cma_copy(pid, remote, local.as_mut_ptr(), local.len(), false)
}

/// Copy `local` to `remote` in process `pid` (process_vm_writev).
pub fn cma_write(pid: i32, remote: u64, local: &[u8]) -> std::io::Result<()> {
    // The kernel only reads through the local pointer when writing to the other process.
    cma_copy(pid, remote, local.as_ptr().cast_mut(), local.len(), true)
}

/// Copy `len` bytes between `remote` in process `pid` and `local` (into `local` unless
/// `write`), in several calls when the kernel copies less at once. Callers pass a `local`
/// range they own (writable when reading); the kernel checks `remote` against the other
/// process and fails with EFAULT outside its mappings.
fn cma_copy(pid: i32, remote: u64, local: *mut u8, len: usize, write: bool) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        let l = libc::iovec {
            // SAFETY (pointer arithmetic): `done < len` keeps it inside the caller's range.
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: len - done,
        };
        let r = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: `l` is inside the range the caller owns (a slice in `cma_read`/`cma_write`,
        // writable when reading into it); the kernel checks `r` against the other process.
        let n = unsafe {
            if write {
                libc::process_vm_writev(pid, &l, 1, &r, 1, 0)
            } else {
                libc::process_vm_readv(pid, &l, 1, &r, 1, 0)
            }
        };
        if n <= 0 {
            return Err(if n == 0 {
                std::io::ErrorKind::UnexpectedEof.into()
            } else {
                std::io::Error::last_os_error()
            });
        }
        done += n as usize;
    }
    Ok(())
}

/// The user owning the other end of a TCP connection over IPv4 loopback whose ends are
/// `local` (ours) and `peer`, from `/proc/net/tcp` (what `SO_PEERCRED` tells of a Unix
/// socket); `None` when it cannot be found.
pub fn loopback_peer_uid(local: std::net::SocketAddr, peer: std::net::SocketAddr) -> Option<u32> {
    let hex = |a: std::net::SocketAddr| -> Option<String> {
        match a.ip() {
            std::net::IpAddr::V4(v) => {
                let o = v.octets();
                Some(format!(
                    "{:02X}{:02X}{:02X}{:02X}:{:04X}",
                    o[3],
                    o[2],
                    o[1],
                    o[0],
                    a.port()
                ))
            }
            std::net::IpAddr::V6(_) => None,
        }
    };
    let (l, p) = (hex(local)?, hex(peer)?);
    let text = std::fs::read_to_string("/proc/self/net/tcp").ok()?;
    text.lines().skip(1).find_map(|line| {
        let w: Vec<&str> = line.split_whitespace().collect();
        // The peer's socket: its local address is `peer`, its remote one `local`.
        (w.len() > 7 && w[1] == p && w[2] == l)
            .then(|| w[7].parse().ok())
            .flatten()
    })
}
