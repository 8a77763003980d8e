//! Socket I/O and layout: the raw `send`/`recv`/`sendmsg` calls, the layout of a
//! connection's sockets and of a message's parts over them, and the errors they make.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use socket2::Socket;

use crate::error::Error;

pub(super) fn send_raw(fd: i32, b: &[u8]) -> io::Result<usize> {
    // SAFETY: `b` is a valid initialized slice for the duration of the call.
    let r = unsafe { libc::send(fd, b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// `recv` into raw memory.
///
/// # Safety
/// `ptr..ptr+len` must be writable memory that nothing else uses during the call.
pub(super) unsafe fn recv_raw(fd: i32, ptr: *mut u8, len: usize) -> io::Result<usize> {
    // SAFETY: the caller vouches for `ptr..ptr+len` (this function's contract).
    let r = unsafe { libc::recv(fd, ptr.cast(), len, 0) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// `sendmsg` of two pieces (header remainder + payload) without SIGPIPE.
///
/// # Safety
/// `b_ptr..b_ptr+b_len` must be readable memory for the duration of the call.
pub(super) unsafe fn send2(fd: i32, a: &[u8], b_ptr: usize, b_len: usize) -> io::Result<usize> {
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; 2];
    let mut k = 0;
    if !a.is_empty() {
        iov[k] = libc::iovec {
            iov_base: a.as_ptr() as *mut _,
            iov_len: a.len(),
        };
        k += 1;
    }
    if b_len > 0 {
        iov[k] = libc::iovec {
            iov_base: b_ptr as *mut _,
            iov_len: b_len,
        };
        k += 1;
    }
    if k == 0 {
        return Ok(0);
    }
    // SAFETY: a zeroed msghdr is a valid empty message; we set only the iovec fields.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = k as _;
    // SAFETY: every iovec points into memory valid for reads: `a` is a live slice and the
    // payload is a posted send buffer that the `isend` contract keeps valid.
    let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// Where one direction of a connection puts a message's bytes. One-way connections: every
/// header on socket 0; payloads of at least `split` bytes are cut over all sockets, smaller
/// ones ride with their header. Duplex connections: socket 0 is shared by both directions
/// and carries messages of up to `inline` bytes with their headers; a larger message goes
/// with its header on the direction's first own socket (socket 1 of this side), cut over its
/// own sockets 1.. from `split`. The receiver takes messages in order by their numbers.
#[derive(Clone, Copy)]
pub(super) struct Layout {
    pub(super) split: usize,
    /// `Some(inline)` on a duplex connection.
    pub(super) inline: Option<usize>,
}

impl Layout {
    /// The socket that carries a `len`-byte message's header (and its part there): on a
    /// duplex connection a payload too large to share socket 0 travels with its header on
    /// the direction's first own socket, so it costs one segment there, not one on each.
    pub(super) fn head(&self, len: usize, n: usize) -> usize {
        match self.inline {
            Some(max) if n > 1 && len > max => 1,
            _ => 0,
        }
    }

    /// Byte range of part `j` of a `len`-byte payload over `n` sockets.
    pub(super) fn part(&self, len: usize, j: usize, n: usize) -> (usize, usize) {
        match self.inline {
            Some(max) if n > 1 && len > max => {
                if j == 0 {
                    (0, 0)
                } else {
                    part(len, j - 1, n - 1, self.split)
                }
            }
            // Whole on the shared socket, however `split` compares.
            Some(_) => part(len, j, 1, self.split),
            None => part(len, j, n, self.split),
        }
    }
}

/// Byte range of part `j` of a `len`-byte payload split over `n` sockets.
pub(super) fn part(len: usize, j: usize, n: usize, split: usize) -> (usize, usize) {
    if n == 1 || len < split {
        return if j == 0 { (0, len) } else { (0, 0) };
    }
    let p = len.div_ceil(n).next_multiple_of(4096);
    let s = (j * p).min(len);
    let e = ((j + 1) * p).min(len);
    (s, e)
}

pub(super) fn io_err(what: &str, peer: Option<SocketAddr>, e: io::Error) -> Error {
    let cause = match e.kind() {
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
            " (the peer process exited or closed the connection)"
        }
        _ => "",
    };
    match peer {
        Some(p) => Error::sys(format!("{what} with {p}{cause}"), e),
        None => Error::sys(format!("{what}{cause}"), e),
    }
}

/// Shut a connection's sockets down when one of its sides goes: the peer then reads the end
/// of the stream instead of waiting. A side whose other side (on a duplex connection) is
/// still in use shuts down only its own direction.
pub(super) fn shut(socks: &[Arc<Socket>], own: std::net::Shutdown) {
    for s in socks {
        let how = if Arc::strong_count(s) > 1 {
            own
        } else {
            std::net::Shutdown::Both
        };
        let _ = s.shutdown(how);
    }
}
