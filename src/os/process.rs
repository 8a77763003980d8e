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
///
/// # Safety
/// `remote..remote+local.len()` must be memory of process `pid` that it lets this process
/// write (a receive buffer it published) and does not use meanwhile: the kernel checks only
/// that the range is mapped there.
pub unsafe fn cma_write(pid: i32, remote: u64, local: &[u8]) -> std::io::Result<()> {
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

/// The user owning the other end of a TCP connection over IPv4 whose ends are `local` (ours)
/// and `peer` (what `SO_PEERCRED` tells of a Unix socket), asked of the kernel through
/// `NETLINK_SOCK_DIAG` (one exact lookup: reading `/proc/net/tcp` walks every socket, 5 ms
/// on a busy host); `None` when it cannot be told (IPv6, no such socket, no netlink).
pub fn loopback_peer_uid(local: std::net::SocketAddr, peer: std::net::SocketAddr) -> Option<u32> {
    let (std::net::IpAddr::V4(l), std::net::IpAddr::V4(p)) = (local.ip(), peer.ip()) else {
        return None;
    };
    // nlmsghdr (16 bytes), then inet_diag_req_v2 (56): the peer's socket has `peer` as its
    // source and `local` as its destination.
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    let mut req = [0u8; 72];
    req[0..4].copy_from_slice(&72u32.to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    req[16] = libc::AF_INET as u8;
    req[17] = libc::IPPROTO_TCP as u8;
    req[20..24].copy_from_slice(&u32::MAX.to_ne_bytes()); // every state
    req[24..26].copy_from_slice(&peer.port().to_be_bytes());
    req[26..28].copy_from_slice(&local.port().to_be_bytes());
    req[28..32].copy_from_slice(&p.octets());
    req[44..48].copy_from_slice(&l.octets());
    req[64..72].copy_from_slice(&[0xff; 8]); // no cookie
                                             // SAFETY: socket(2) takes no pointers; the result is checked and closed below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: an all-zero sockaddr_nl addresses the kernel.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    let mut reply = [0u8; 512];
    // SAFETY: `req` and `kernel` are valid for the lengths given; the kernel answers a diag
    // request while it handles the send, so a non-blocking receive finds the answer.
    let got = unsafe {
        let sent = libc::sendto(
            fd,
            req.as_ptr().cast(),
            req.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        );
        let got = if sent == req.len() as isize {
            libc::recv(
                fd,
                reply.as_mut_ptr().cast(),
                reply.len(),
                libc::MSG_DONTWAIT,
            )
        } else {
            -1
        };
        libc::close(fd);
        got
    };
    // nlmsghdr, then inet_diag_msg: family, state, timer, retrans, id (48), expires,
    // rqueue, wqueue, uid.
    let ty = u16::from_ne_bytes([reply[4], reply[5]]);
    (got >= 84 && ty == SOCK_DIAG_BY_FAMILY)
        .then(|| u32::from_ne_bytes(reply[80..84].try_into().unwrap()))
}

/// The kernel's smoothed round-trip time of the TCP socket `fd` (`TCP_INFO`'s `tcpi_rtt`),
/// or `None` when it cannot say.
pub fn tcp_rtt(fd: i32) -> Option<std::time::Duration> {
    // SAFETY: tcp_info is plain data; all zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is writable storage of `len` bytes; the kernel writes at most `len`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    (r == 0 && info.tcpi_rtt > 0).then(|| std::time::Duration::from_micros(info.tcpi_rtt as u64))
}

#[cfg(test)]
mod peer_tests {
    /// The other end of a loopback connection of this process is this user's.
    #[test]
    fn the_peer_of_a_loopback_connection_is_this_user() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, from) = l.accept().unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(
            super::loopback_peer_uid(s.local_addr().unwrap(), from),
            Some(me)
        );
        // A port nobody uses: no answer.
        let nobody = std::net::SocketAddr::from(([127, 0, 0, 1], 1));
        assert_eq!(
            super::loopback_peer_uid(s.local_addr().unwrap(), nobody),
            None
        );
        drop(c);
    }
}
