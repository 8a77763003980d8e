//! TCP network: each connection is `nsocks` TCP sockets (`ROCCL_NSOCKS`, default 2), or on
//! a duplex connection `1 + 2·nsocks` (see `Layout`).
//!
//! Wire format, per message: a 16-byte header — `len: u48 | number: u16 << 48` (u64 LE; the
//! message's number mod 2^16), `tag: u32 LE`, `magic: u32 LE` — then the payload. One-way
//! connections: headers on socket 0; payloads of at least `ROCCL_TCP_SPLIT` bytes (default
//! 256 KiB) are cut into `nsocks` contiguous parts of equal size (rounded up to 4 KiB), part
//! `j` on socket `j`, so both sides know the layout from the length. Messages on a socket are
//! in post order. The sender writes a header and its part with one `sendmsg`; the receiver
//! reads socket 0 through a 64 KiB buffer, so a small message costs one `recv`, and reads
//! large parts straight into the destination (no copy).
//!
//! A new connection opens its sockets and sends a 16-byte hello on each
//! (`magic`, `conn id: u64`, `index: u16`, `count: u16`, bit 15 of the count set on a duplex
//! connection); the listener groups sockets by connection id and hands out the receive comm
//! once all have arrived.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use socket2::{Domain, Protocol, Socket, Type};

use super::{
    connect_done, start_connect, Connecting, ListenComm, MemHandle, Net, NetHandle, NetProperties,
    PollFd, PtrSupport, RecvBuf, RecvComm, ReqId, SendComm, MAX_RECVS, MAX_REQUESTS,
};
use crate::error::{Error, Result};

const HANDLE_MAGIC: u32 = 0x5043_5452; // "RTCP"
const HELLO_MAGIC: u32 = 0x4f4c_4548; // "HELO"
const MSG_MAGIC: u32 = 0x4753_4d52; // "RMSG"
const HDR: usize = 16;
/// Bits of a header's first word that hold the payload length (the top 16 hold the message's
/// number).
const LEN_MASK: u64 = (1 << 48) - 1;
const RXBUF: usize = 64 * 1024;
/// Payload bytes of socket 0 read straight into the destination rather than via the buffer.
const RX_DIRECT: usize = 16 * 1024;
const MAX_SOCKS: usize = 8;
/// Sockets one side of a connection uses: a duplex connection's shared socket and its bulk
/// sockets of that direction.
const MAX_FDS: usize = MAX_SOCKS + 1;
/// Bit of the hello's socket count: the connection is duplex (see [`Layout`]).
const HELLO_DUPLEX: u16 = 0x8000;
/// On a duplex connection, payloads up to this size travel with their header on the shared
/// socket, where the peer's data carries their acknowledgement; larger ones with their header
/// on the direction's own sockets (`ROCCL_TCP_DUPLEX_INLINE`). 2 ranks over loopback: 8 B–8
/// KiB all-reduces 10–17 % faster than over one-way connections, 32 KiB–1 MiB the same or
/// better; bulk both ways on the shared socket is slower (the directions contend for it), and
/// so is 32 KiB there (13.6–14.4 µs against 11.8); docs/PERFORMANCE.md.
fn duplex_inline() -> usize {
    env_usize("ROCCL_TCP_DUPLEX_INLINE", 16 * 1024)
}

fn env_usize(name: &str, default: usize) -> usize {
    crate::envvar::value_or(name, default)
}

/// The TCP network. One device: the interface chosen by `ROCCL_SOCKET_IFNAME`.
pub struct TcpNet {
    addr: IpAddr,
    ifname: String,
    nsocks: usize,
    split: usize,
    /// `SO_SNDBUF` for sockets to a peer on this host (None: the kernel's autotuning).
    local_sndbuf: Option<usize>,
    /// Connections carry messages both ways (`ROCCL_TCP_DUPLEX`, default on; see
    /// [`Net::duplex`]).
    duplex: bool,
}

impl TcpNet {
    /// Open on the interface chosen from the environment.
    pub fn new() -> Result<Self> {
        Self::with_addr(crate::bootstrap::ifaces::local_addr(None)?)
    }

    /// Open on a given local address.
    pub fn with_addr(addr: IpAddr) -> Result<Self> {
        let nsocks = env_usize("ROCCL_NSOCKS", 2);
        if nsocks == 0 || nsocks > MAX_SOCKS {
            return Err(Error::arg(format!(
                "ROCCL_NSOCKS={nsocks} is out of range: use 1 to {MAX_SOCKS}"
            )));
        }
        let ifname = crate::bootstrap::ifaces::list()
            .ok()
            .and_then(|l| l.into_iter().find(|i| i.addr == addr).map(|i| i.name))
            .unwrap_or_else(|| addr.to_string());
        Ok(TcpNet {
            addr,
            ifname,
            nsocks,
            split: env_usize("ROCCL_TCP_SPLIT", 256 * 1024).max(4096),
            local_sndbuf: match env_usize("ROCCL_TCP_SNDBUF", LOCAL_SNDBUF) {
                0 => None,
                b => Some(b),
            },
            duplex: crate::envvar::switch_or("ROCCL_TCP_DUPLEX", true),
        })
    }

    /// `SO_SNDBUF` for sockets to `peer` (None: the kernel's autotuning).
    fn sndbuf_for(&self, peer: IpAddr) -> Option<usize> {
        self.local_sndbuf.filter(|_| is_local(peer))
    }

    /// Whether this network's handles offer duplex connections (`ROCCL_TCP_DUPLEX`).
    pub fn with_duplex(mut self, duplex: bool) -> Self {
        self.duplex = duplex;
        self
    }

    /// Local address this network listens on.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }
}

/// Byte of the handle that says whether its listener takes duplex connections.
const HANDLE_DUPLEX: usize = 32;

fn encode_handle(sa: SocketAddr, nsocks: usize, split: usize, duplex: bool) -> Result<NetHandle> {
    let mut b = [0u8; 48];
    b[0..4].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
    b[4] = nsocks as u8;
    match sa.ip() {
        IpAddr::V4(v4) => {
            b[5] = 4;
            b[8..12].copy_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            b[5] = 6;
            b[8..24].copy_from_slice(&v6.octets());
        }
    }
    b[6..8].copy_from_slice(&sa.port().to_le_bytes());
    b[24..32].copy_from_slice(&(split as u64).to_le_bytes());
    b[HANDLE_DUPLEX] = u8::from(duplex);
    NetHandle::from_bytes(&b)
}

fn decode_handle(h: &NetHandle) -> Result<(SocketAddr, usize, usize)> {
    let b = h.as_bytes();
    let bad = || {
        Error::arg("not a roccl TCP connection handle (wrong magic or family): was it produced by another network or another roccl version?")
    };
    if u32::from_le_bytes(b[0..4].try_into().unwrap()) != HANDLE_MAGIC {
        return Err(bad());
    }
    let nsocks = b[4] as usize;
    let port = u16::from_le_bytes([b[6], b[7]]);
    let ip: IpAddr = match b[5] {
        4 => <[u8; 4]>::try_from(&b[8..12]).unwrap().into(),
        6 => <[u8; 16]>::try_from(&b[8..24]).unwrap().into(),
        _ => return Err(bad()),
    };
    if nsocks == 0 || nsocks > MAX_SOCKS {
        return Err(bad());
    }
    let split = u64::from_le_bytes(b[24..32].try_into().unwrap()) as usize;
    Ok((SocketAddr::new(ip, port), nsocks, split.max(4096)))
}

/// `SO_SNDBUF` for a peer on the same host (the kernel doubles it: 512 KiB of socket
/// buffer). With autotuning the buffer grows to 4 MiB and the sender copies into skb pages
/// that have left the caches: 2 ranks, 16 MiB all-reduce over loopback 5.4-5.6 ms with this
/// vs 6.3-6.9 ms without (docs/PERFORMANCE.md). Peers on other hosts keep autotuning, which
/// a long fat link needs.
const LOCAL_SNDBUF: usize = 256 * 1024;

/// Whether `ip` is an address of this host: loopback, or assigned to one of its interfaces
/// (not "bindable": with `ip_nonlocal_bind` every address binds).
fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback()
        || crate::bootstrap::ifaces::list().is_ok_and(|l| l.iter().any(|i| i.addr == ip))
}

fn tune(s: &Socket) -> Result<()> {
    s.set_nodelay(true)
        .map_err(|e| Error::sys("setsockopt(TCP_NODELAY)", e))?;
    s.set_nonblocking(true)
        .map_err(|e| Error::sys("fcntl(O_NONBLOCK) on a TCP socket", e))?;
    Ok(())
}

impl Net for TcpNet {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn devices(&self) -> usize {
        1
    }

    fn properties(&self, dev: usize) -> Result<NetProperties> {
        if dev != 0 {
            return Err(Error::arg(format!(
                "TCP has one device; asked for device {dev}"
            )));
        }
        let speed = std::fs::read_to_string(format!("/sys/class/net/{}/speed", self.ifname))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .filter(|s| *s > 0)
            .unwrap_or(if self.addr.is_loopback() {
                100_000
            } else {
                10_000
            });
        Ok(NetProperties {
            name: self.ifname.clone(),
            pci_path: None,
            guid: 0,
            ptr_support: PtrSupport {
                host: true,
                device: false,
                dmabuf: false,
            },
            speed_mbps: speed as u32,
            port: 0,
            latency_us: if self.addr.is_loopback() { 5.0 } else { 30.0 },
            max_comms: 65536,
            max_recvs: MAX_RECVS as u32,
        })
    }

    fn listen(&self, dev: usize) -> Result<(NetHandle, Box<dyn ListenComm>)> {
        if dev != 0 {
            return Err(Error::arg(format!(
                "TCP has one device; asked to listen on {dev}"
            )));
        }
        let sa = SocketAddr::new(self.addr, 0);
        let s = Socket::new(Domain::for_address(sa), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::sys("socket() for the TCP listener", e))?;
        s.bind(&sa.into())
            .map_err(|e| Error::sys(format!("bind({sa}) for the TCP listener"), e))?;
        s.listen(4096)
            .map_err(|e| Error::sys(format!("listen() on {sa}"), e))?;
        s.set_nonblocking(true)
            .map_err(|e| Error::sys("fcntl(O_NONBLOCK) on the listener", e))?;
        let local = s
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .ok_or_else(|| Error::Internal("listener has no local address".into()))?;
        let handle = encode_handle(local, self.nsocks, self.split, self.duplex)?;
        Ok((
            handle,
            Box::new(TcpListen {
                sock: s,
                split: self.split,
                local_sndbuf: self.local_sndbuf,
                pending: Vec::new(),
                groups: HashMap::new(),
            }),
        ))
    }

    /// Both listeners take duplex connections: one connection per pair and channel carries
    /// both directions, so each side's data carries the acknowledgements of the other's
    /// (2 ranks, 8 B all-reduce over loopback: one segment per message instead of a data
    /// segment and a pure ACK; docs/PERFORMANCE.md).
    fn duplex(&self, mine: &NetHandle, theirs: &NetHandle) -> bool {
        let ok = |h: &NetHandle| decode_handle(h).is_ok() && h.as_bytes()[HANDLE_DUPLEX] == 1;
        ok(mine) && ok(theirs)
    }

    fn connect(&self, _dev: usize, handle: &NetHandle) -> Result<Box<dyn Connecting>> {
        self.dial(handle, false)
    }

    fn connect_duplex(&self, _dev: usize, handle: &NetHandle) -> Result<Box<dyn Connecting>> {
        self.dial(handle, self.duplex && handle.as_bytes()[HANDLE_DUPLEX] == 1)
    }
}

impl TcpNet {
    /// Open a connection to `handle`'s listener; `duplex`: the shared socket, then each
    /// direction's own (see [`Layout`]).
    fn dial(&self, handle: &NetHandle, duplex: bool) -> Result<Box<dyn Connecting>> {
        let (sa, per_way, split) = decode_handle(handle)?;
        let nsocks = if duplex { 1 + 2 * per_way } else { per_way };
        let count = nsocks as u16 | if duplex { HELLO_DUPLEX } else { 0 };
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let id = nanos ^ ((std::process::id() as u64) << 40) ^ NEXT.fetch_add(1, Ordering::Relaxed);
        let mut socks = Vec::with_capacity(nsocks);
        let sndbuf = self.sndbuf_for(sa.ip());
        for i in 0..nsocks {
            let s = Socket::new(Domain::for_address(sa), Type::STREAM, Some(Protocol::TCP))
                .map_err(|e| Error::sys("socket() for a TCP connection", e))?;
            tune(&s)?;
            if let Some(b) = sndbuf {
                s.set_send_buffer_size(b)
                    .map_err(|e| Error::sys("setsockopt(SO_SNDBUF)", e))?;
            }
            start_connect(&s, sa, "")?;
            let mut hello = [0u8; HDR];
            hello[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
            hello[4..12].copy_from_slice(&id.to_le_bytes());
            hello[12..14].copy_from_slice(&(i as u16).to_le_bytes());
            hello[14..16].copy_from_slice(&count.to_le_bytes());
            socks.push(PendingSock {
                sock: s,
                hello,
                sent: 0,
                connected: false,
            });
        }
        Ok(Box::new(TcpConnecting {
            peer: sa,
            socks,
            layout: Layout {
                split,
                inline: duplex.then(duplex_inline),
            },
        }))
    }
}

struct PendingSock {
    sock: Socket,
    hello: [u8; HDR],
    sent: usize,
    connected: bool,
}

struct TcpConnecting {
    peer: SocketAddr,
    socks: Vec<PendingSock>,
    layout: Layout,
}

/// A connection's sockets: those of the direction of its opener (the shared one first) and,
/// on a duplex connection, those of the way back.
fn ways(mut socks: Vec<Arc<Socket>>, duplex: bool) -> (Vec<Arc<Socket>>, Vec<Arc<Socket>>) {
    if !duplex {
        return (socks, Vec::new());
    }
    let back = socks.split_off(1 + (socks.len() - 1) / 2);
    (socks, back)
}

impl Connecting for TcpConnecting {
    fn poll(&mut self) -> Result<Option<Box<dyn SendComm>>> {
        let mut all = true;
        for p in &mut self.socks {
            if !p.connected {
                if !connect_done(
                    &p.sock,
                    self.peer,
                    "",
                    "is the peer alive and the address reachable? check ROCCL_SOCKET_IFNAME",
                )? {
                    all = false;
                    continue;
                }
                p.connected = true;
            }
            while p.sent < HDR {
                match send_raw(p.sock.as_raw_fd(), &p.hello[p.sent..]) {
                    Ok(n) => p.sent += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(Error::sys(format!("sending hello to {}", self.peer), e)),
                }
            }
            if p.sent < HDR {
                all = false;
            }
        }
        if !all {
            return Ok(None);
        }
        let socks: Vec<Arc<Socket>> = self.socks.drain(..).map(|p| Arc::new(p.sock)).collect();
        let (own, back) = ways(socks, self.layout.inline.is_some());
        Ok(Some(Box::new(TcpSendComm::new(
            own,
            back,
            self.layout,
            self.peer,
        ))))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        for p in &self.socks {
            out.push(PollFd {
                fd: p.sock.as_raw_fd(),
                events: libc::POLLOUT,
            });
        }
    }
}

struct Incoming {
    sock: Socket,
    hello: [u8; HDR],
    got: usize,
}

struct TcpListen {
    sock: Socket,
    /// Split threshold published in our handle; senders cut messages with it (both ways on
    /// a duplex connection).
    split: usize,
    /// `SO_SNDBUF` for sending back to a peer on this host ([`RecvComm::reverse`]).
    local_sndbuf: Option<usize>,
    pending: Vec<Incoming>,
    /// Sockets of connections still arriving, by connection id, and whether it is duplex.
    groups: HashMap<u64, (bool, Vec<Option<Socket>>)>,
}

impl ListenComm for TcpListen {
    fn accept(&mut self) -> Result<Option<Box<dyn RecvComm>>> {
        loop {
            match self.sock.accept() {
                Ok((s, _)) => {
                    tune(&s)?;
                    self.pending.push(Incoming {
                        sock: s,
                        hello: [0; HDR],
                        got: 0,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::sys("accept() on the TCP listener", e)),
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            let inc = &mut self.pending[i];
            let mut drop_it = false;
            while inc.got < HDR {
                match recv_raw(
                    inc.sock.as_raw_fd(),
                    inc.hello[inc.got..].as_mut_ptr(),
                    HDR - inc.got,
                ) {
                    Ok(0) => {
                        drop_it = true; // connection closed before hello: ignore it
                        break;
                    }
                    Ok(n) => inc.got += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        drop_it = true;
                        break;
                    }
                }
            }
            if drop_it {
                self.pending.swap_remove(i);
                continue;
            }
            if inc.got < HDR {
                i += 1;
                continue;
            }
            let inc = self.pending.swap_remove(i);
            let h = &inc.hello;
            if u32::from_le_bytes(h[0..4].try_into().unwrap()) != HELLO_MAGIC {
                continue; // a stranger (port scan, wrong program): drop it
            }
            let id = u64::from_le_bytes(h[4..12].try_into().unwrap());
            let idx = u16::from_le_bytes([h[12], h[13]]) as usize;
            let count = u16::from_le_bytes([h[14], h[15]]);
            let duplex = count & HELLO_DUPLEX != 0;
            let n = (count & !HELLO_DUPLEX) as usize;
            let per_way = if duplex { n.saturating_sub(1) / 2 } else { n };
            let shape_ok = !duplex || n % 2 == 1;
            if per_way == 0 || per_way > MAX_SOCKS || idx >= n || !shape_ok {
                continue;
            }
            let g = self
                .groups
                .entry(id)
                .or_insert_with(|| (duplex, (0..n).map(|_| None).collect()));
            if g.1.len() == n && g.0 == duplex {
                g.1[idx] = Some(inc.sock);
            }
            if g.1.iter().all(Option::is_some) {
                let socks: Vec<Arc<Socket>> = self
                    .groups
                    .remove(&id)
                    .map(|g| g.1)
                    .unwrap_or_default()
                    .into_iter()
                    .flatten()
                    .map(Arc::new)
                    .collect();
                let (own, back) = ways(socks, duplex);
                let layout = Layout {
                    split: self.split,
                    inline: duplex.then(duplex_inline),
                };
                let mut comm = TcpRecvComm::new(own, back, layout);
                comm.local_sndbuf = self.local_sndbuf;
                return Ok(Some(Box::new(comm)));
            }
        }
        Ok(None)
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(PollFd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLIN,
        });
        for p in &self.pending {
            out.push(PollFd {
                fd: p.sock.as_raw_fd(),
                events: libc::POLLIN,
            });
        }
    }
}

fn send_raw(fd: i32, b: &[u8]) -> io::Result<usize> {
    // SAFETY: `b` is a valid initialized slice for the duration of the call.
    let r = unsafe { libc::send(fd, b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// `recv` into raw memory. The caller guarantees `ptr..ptr+len` is writable.
fn recv_raw(fd: i32, ptr: *mut u8, len: usize) -> io::Result<usize> {
    // SAFETY: callers pass memory they own for writing (a local buffer, or a posted receive
    // buffer whose validity the `irecv` contract guarantees until the request completes).
    let r = unsafe { libc::recv(fd, ptr.cast(), len, 0) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// `sendmsg` of two pieces (header remainder + payload) without SIGPIPE.
fn send2(fd: i32, a: &[u8], b_ptr: usize, b_len: usize) -> io::Result<usize> {
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
struct Layout {
    split: usize,
    /// `Some(inline)` on a duplex connection.
    inline: Option<usize>,
}

impl Layout {
    /// The socket that carries a `len`-byte message's header (and its part there): on a
    /// duplex connection a payload too large to share socket 0 travels with its header on
    /// the direction's first own socket, so it costs one segment there, not one on each.
    fn head(&self, len: usize, n: usize) -> usize {
        match self.inline {
            Some(max) if n > 1 && len > max => 1,
            _ => 0,
        }
    }

    /// Byte range of part `j` of a `len`-byte payload over `n` sockets.
    fn part(&self, len: usize, j: usize, n: usize) -> (usize, usize) {
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
fn part(len: usize, j: usize, n: usize, split: usize) -> (usize, usize) {
    if n == 1 || len < split {
        return if j == 0 { (0, len) } else { (0, 0) };
    }
    let p = len.div_ceil(n).next_multiple_of(4096);
    let s = (j * p).min(len);
    let e = ((j + 1) * p).min(len);
    (s, e)
}

fn io_err(what: &str, peer: Option<SocketAddr>, e: io::Error) -> Error {
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

struct SendMsg {
    addr: usize,
    len: usize,
    hdr: [u8; HDR],
    /// Bytes sent on each socket (socket 0 counts the header).
    off: [usize; MAX_FDS],
    parts_left: u8,
    reaped: bool,
}

/// Shut a connection's sockets down when one of its sides goes: the peer then reads the end
/// of the stream instead of waiting. A side whose other side (on a duplex connection) is
/// still in use shuts down only its own direction.
fn shut(socks: &[Arc<Socket>], own: std::net::Shutdown) {
    for s in socks {
        let how = if Arc::strong_count(s) > 1 {
            own
        } else {
            std::net::Shutdown::Both
        };
        let _ = s.shutdown(how);
    }
}

struct TcpSendComm {
    socks: Vec<Arc<Socket>>,
    /// A duplex connection's sockets of the way back, until [`SendComm::reverse`].
    back: Vec<Arc<Socket>>,
    fds: Vec<i32>,
    layout: Layout,
    peer: SocketAddr,
    msgs: VecDeque<SendMsg>,
    /// Sequence number of `msgs[0]`.
    base: u64,
    /// Per socket: the message it is sending (absolute sequence number).
    cur: [u64; MAX_FDS],
    failed: Option<String>,
}

impl TcpSendComm {
    fn new(
        socks: Vec<Arc<Socket>>,
        back: Vec<Arc<Socket>>,
        layout: Layout,
        peer: SocketAddr,
    ) -> Self {
        let fds = socks.iter().map(|s| s.as_raw_fd()).collect();
        TcpSendComm {
            socks,
            back,
            fds,
            layout,
            peer,
            msgs: VecDeque::with_capacity(MAX_REQUESTS),
            base: 0,
            cur: [0; MAX_FDS],
            failed: None,
        }
    }

    fn fail(&mut self, e: Error) -> Error {
        self.failed = Some(e.to_string());
        e
    }

    fn progress(&mut self) -> Result<()> {
        super::refuse_if_failed(&self.failed, "TCP send comm")?;
        let n = self.fds.len();
        let end = self.base + self.msgs.len() as u64;
        for j in 0..n {
            while self.cur[j] < end {
                let m = &mut self.msgs[(self.cur[j] - self.base) as usize];
                let (s, e) = self.layout.part(m.len, j, n);
                let hdr = if j == self.layout.head(m.len, n) {
                    HDR
                } else {
                    0
                };
                let total = hdr + (e - s);
                if m.off[j] < total {
                    let o = m.off[j];
                    let r = if o < hdr {
                        send2(self.fds[j], &m.hdr[o..], m.addr + s, e - s)
                    } else {
                        send2(self.fds[j], &[], m.addr + s + (o - hdr), total - o)
                    };
                    match r {
                        Ok(w) => m.off[j] += w,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            let err = io_err("TCP send", Some(self.peer), e);
                            return Err(self.fail(err));
                        }
                    }
                }
                if m.off[j] == total {
                    m.parts_left -= 1;
                    self.cur[j] += 1;
                } else {
                    break;
                }
            }
        }
        Ok(())
    }
}

impl SendComm for TcpSendComm {
    unsafe fn isend(
        &mut self,
        data: *const u8,
        len: usize,
        tag: u32,
        _mr: Option<&MemHandle>,
    ) -> Result<Option<ReqId>> {
        super::refuse_if_failed(&self.failed, "TCP send comm")?;
        if self.msgs.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        if len as u64 > LEN_MASK {
            return Err(Error::arg(format!(
                "a TCP message of {len} bytes: at most {LEN_MASK} bytes per message"
            )));
        }
        let mut hdr = [0u8; HDR];
        // The message's number (mod 2^16) in the top bits of the length: on a duplex
        // connection messages arrive on two sockets and the receiver takes them in order.
        let seq = self.base + self.msgs.len() as u64;
        hdr[0..8].copy_from_slice(&(len as u64 & LEN_MASK | seq << 48).to_le_bytes());
        hdr[8..12].copy_from_slice(&tag.to_le_bytes());
        hdr[12..16].copy_from_slice(&MSG_MAGIC.to_le_bytes());
        self.msgs.push_back(SendMsg {
            addr: data as usize,
            len,
            hdr,
            off: [0; MAX_FDS],
            parts_left: self.fds.len() as u8,
            reaped: false,
        });
        self.progress()?;
        Ok(Some(ReqId(seq as u32)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>> {
        self.progress()?;
        let m = super::pending_request(&mut self.msgs, self.base, req, |r| r.reaped, "send")?;
        if m.parts_left > 0 {
            return Ok(None);
        }
        m.reaped = true;
        let len = m.len;
        while self.msgs.front().is_some_and(|m| m.reaped) {
            self.msgs.pop_front();
            self.base += 1;
        }
        Ok(Some(len))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        let end = self.base + self.msgs.len() as u64;
        for (j, fd) in self.fds.iter().enumerate() {
            if self.cur[j] < end {
                out.push(PollFd {
                    fd: *fd,
                    events: libc::POLLOUT,
                });
            }
        }
    }

    /// The shared socket and the sockets of the way back read: the peer's messages back,
    /// laid out as this side lays out its own.
    fn reverse(&mut self) -> Option<Box<dyn RecvComm>> {
        if self.back.is_empty() {
            return None;
        }
        let mut socks = vec![Arc::clone(&self.socks[0])];
        socks.append(&mut self.back);
        Some(Box::new(TcpRecvComm::new(socks, Vec::new(), self.layout)))
    }
}

impl Drop for TcpSendComm {
    fn drop(&mut self) {
        shut(&self.socks, std::net::Shutdown::Write);
        shut(&self.back, std::net::Shutdown::Both);
    }
}

#[derive(Clone, Copy)]
struct PostedBuf {
    addr: usize,
    len: usize,
    tag: u32,
}

struct RecvReq {
    bufs: [PostedBuf; MAX_RECVS],
    n: u8,
    assigned: u8,
    sizes: [usize; MAX_RECVS],
    left: u8,
    reaped: bool,
}

struct Slot {
    /// Index into `reqs` (by sequence).
    req: u64,
    /// Payload length and destination once the header has been read.
    len: usize,
    dst: usize,
    known: bool,
    /// The socket that carried the header (see [`Layout::head`]).
    head: u8,
    off: [usize; MAX_FDS],
    parts_left: u8,
}

struct TcpRecvComm {
    socks: Vec<Arc<Socket>>,
    /// A duplex connection's sockets of the way back, until [`RecvComm::reverse`].
    back: Vec<Arc<Socket>>,
    fds: Vec<i32>,
    layout: Layout,
    rx: Box<[u8]>,
    rx_start: usize,
    rx_end: usize,
    reqs: VecDeque<RecvReq>,
    req_base: u64,
    slots: VecDeque<Slot>,
    slot_base: u64,
    cur: [u64; MAX_FDS],
    failed: Option<String>,
    peer: Option<SocketAddr>,
    /// `SO_SNDBUF` for the sending side back to a peer on this host.
    local_sndbuf: Option<usize>,
    /// Duplex connection: the header read so far from socket 1 (`hdr1_got` bytes).
    hdr1: [u8; HDR],
    hdr1_got: usize,
    /// Socket 1 reached the end of the peer's stream.
    hdr1_end: bool,
    /// Socket 0 reached the end of the peer's stream (duplex: socket 1 may still hold
    /// messages).
    rx_end_seen: bool,
    /// Number (mod 2^16) of the next message to take.
    seq: u16,
    /// The socket that carried the last header.
    last_head: u8,
}

impl TcpRecvComm {
    fn new(socks: Vec<Arc<Socket>>, back: Vec<Arc<Socket>>, layout: Layout) -> Self {
        let fds = socks.iter().map(|s| s.as_raw_fd()).collect();
        let peer = socks
            .first()
            .and_then(|s| s.peer_addr().ok())
            .and_then(|a| a.as_socket());
        TcpRecvComm {
            socks,
            back,
            fds,
            layout,
            rx: vec![0u8; RXBUF].into_boxed_slice(),
            rx_start: 0,
            rx_end: 0,
            reqs: VecDeque::with_capacity(MAX_REQUESTS),
            req_base: 0,
            slots: VecDeque::with_capacity(MAX_REQUESTS * 2),
            slot_base: 0,
            cur: [0; MAX_FDS],
            failed: None,
            peer,
            local_sndbuf: None,
            hdr1: [0; HDR],
            hdr1_got: 0,
            hdr1_end: false,
            rx_end_seen: false,
            last_head: 0,
            seq: 0,
        }
    }

    fn fail(&mut self, e: Error) -> Error {
        self.failed = Some(e.to_string());
        e
    }

    fn eof(&self) -> Error {
        let p = self.peer.map(|p| format!(" from {p}")).unwrap_or_default();
        Error::sys(
            format!("TCP receive{p}: connection closed by the peer (its process exited or closed the communicator)"),
            io::Error::from(io::ErrorKind::UnexpectedEof),
        )
    }

    /// Fill the socket-0 buffer; returns bytes read (0 = would block).
    fn fill_rx(&mut self) -> Result<usize> {
        self.fill_rx_or_end()?.ok_or_else(|| self.eof())
    }

    /// [`TcpRecvComm::fill_rx`], with the end of the peer's stream as `None`.
    fn fill_rx_or_end(&mut self) -> Result<Option<usize>> {
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        } else if self.rx_end == RXBUF {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        let free = RXBUF - self.rx_end;
        let ptr = self.rx[self.rx_end..].as_mut_ptr();
        match recv_raw(self.fds[0], ptr, free) {
            Ok(0) => Ok(None),
            Ok(n) => {
                self.rx_end += n;
                Ok(Some(n))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Some(0)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(Some(0)),
            Err(e) => Err(io_err("TCP receive", self.peer, e)),
        }
    }

    /// Find the header of the next message: in the buffer of socket 0, or (duplex) read
    /// from socket 1, whichever carries the message numbered `seq`. `Some(socket)` with
    /// the header taken into slot `si`; `None` when it has not arrived.
    fn next_header(&mut self, si: usize) -> Result<Option<usize>> {
        let number = |h: &[u8]| (u64::from_le_bytes(h[0..8].try_into().unwrap()) >> 48) as u16;
        loop {
            let buffered = self.rx_end - self.rx_start >= HDR;
            if self.layout.inline.is_none() || self.fds.len() < 2 {
                if !buffered {
                    if self.fill_rx()? == 0 {
                        return Ok(None);
                    }
                    continue;
                }
                return self.take_buffered(si);
            }
            if buffered && number(&self.rx[self.rx_start..self.rx_start + HDR]) == self.seq {
                return self.take_buffered(si);
            }
            if self.hdr1_got == HDR {
                if number(&self.hdr1) != self.seq && buffered {
                    return Err(Error::Internal(format!(
                        "TCP stream out of sync: message {} due, sockets 0 and 1 hold {} and {}",
                        self.seq,
                        number(&self.rx[self.rx_start..self.rx_start + HDR]),
                        number(&self.hdr1)
                    )));
                }
                if number(&self.hdr1) == self.seq {
                    let h = self.hdr1;
                    self.hdr1_got = 0;
                    self.take_header(si, &h)?;
                    return Ok(Some(1));
                }
            }
            // Read on, the socket of the last message first (a run of large or of small
            // messages then costs no system call on the other): socket 0 into its buffer,
            // socket 1 only up to the end of a header. The end of the peer's stream on one
            // socket is an error only mid-header or once the other has ended too: messages
            // it sent on the other before it left may still be coming.
            let mut moved = false;
            for sock in if self.last_head == 1 { [1, 0] } else { [0, 1] } {
                if sock == 0 && !buffered && !self.rx_end_seen {
                    match self.fill_rx_or_end()? {
                        Some(k) => moved |= k > 0,
                        None if self.rx_end > self.rx_start => return Err(self.eof()),
                        None => self.rx_end_seen = true,
                    }
                }
                if sock == 1 && self.hdr1_got < HDR && !self.hdr1_end {
                    let at = self.hdr1[self.hdr1_got..].as_mut_ptr();
                    match recv_raw(self.fds[1], at, HDR - self.hdr1_got) {
                        Ok(0) if self.hdr1_got == 0 => self.hdr1_end = true,
                        Ok(0) => return Err(self.eof()),
                        Ok(k) => {
                            self.hdr1_got += k;
                            moved = true;
                            if self.hdr1_got == HDR && number(&self.hdr1) == self.seq {
                                break;
                            }
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                            ) => {}
                        Err(e) => return Err(io_err("TCP receive", self.peer, e)),
                    }
                }
                if moved && sock == 0 && self.rx_end - self.rx_start >= HDR {
                    break;
                }
            }
            if self.rx_end_seen && self.hdr1_end {
                return Err(self.eof());
            }
            if !moved {
                return Ok(None);
            }
        }
    }

    /// Take the header at the start of socket 0's buffer into slot `si`.
    fn take_buffered(&mut self, si: usize) -> Result<Option<usize>> {
        let h: [u8; HDR] = self.rx[self.rx_start..self.rx_start + HDR]
            .try_into()
            .unwrap();
        self.rx_start += HDR;
        self.take_header(si, &h)?;
        Ok(Some(0))
    }

    /// Take header `h` into slot `si` (on a duplex connection the caller has matched its
    /// number with `seq`).
    fn take_header(&mut self, si: usize, h: &[u8; HDR]) -> Result<()> {
        let word = u64::from_le_bytes(h[0..8].try_into().unwrap());
        let len = (word & LEN_MASK) as usize;
        let tag = u32::from_le_bytes(h[8..12].try_into().unwrap());
        let magic = u32::from_le_bytes(h[12..16].try_into().unwrap());
        if magic != MSG_MAGIC {
            return Err(Error::Internal(
                "TCP stream out of sync (bad message magic): the peer speaks another protocol version".into(),
            ));
        }
        self.seq = self.seq.wrapping_add(1);
        let n = self.fds.len();
        let slot = &mut self.slots[si];
        let r = &mut self.reqs[(slot.req - self.req_base) as usize];
        let Some(b) =
            (0..r.n as usize).find(|&b| r.assigned & (1 << b) == 0 && r.bufs[b].tag == tag)
        else {
            return Err(super::unexpected_tag(tag));
        };
        if len > r.bufs[b].len {
            return Err(Error::InvalidUsage(format!(
                "received a {len}-byte message but the posted receive holds only {} bytes (mismatched counts between sender and receiver?)",
                r.bufs[b].len
            )));
        }
        r.assigned |= 1 << b;
        r.sizes[b] = len;
        slot.len = len;
        slot.dst = r.bufs[b].addr;
        slot.known = true;
        slot.parts_left = (0..n)
            .filter(|&j| {
                let (s, e) = self.layout.part(len, j, n);
                e > s || j == 0
            })
            .count() as u8;
        Ok(())
    }

    fn finish_part(&mut self, si: usize) {
        let slot = &mut self.slots[si];
        slot.parts_left -= 1;
        if slot.parts_left == 0 {
            let r = &mut self.reqs[(slot.req - self.req_base) as usize];
            r.left -= 1;
        }
    }

    fn progress(&mut self) -> Result<()> {
        super::refuse_if_failed(&self.failed, "TCP receive comm")?;
        let r = self.progress_inner();
        r.map_err(|e| self.fail(e))
    }

    fn progress_inner(&mut self) -> Result<()> {
        let n = self.fds.len();
        let end = self.slot_base + self.slots.len() as u64;
        // Messages in order: each one's header, then its part on socket 0 (through the buffer
        // for small pieces) or, on a duplex connection, the part that came with the header
        // on socket 1; further parts are read below.
        'sock0: while self.cur[0] < end {
            let si = (self.cur[0] - self.slot_base) as usize;
            if !self.slots[si].known {
                let Some(head) = self.next_header(si)? else {
                    break 'sock0;
                };
                self.slots[si].head = head as u8;
                self.last_head = head as u8;
            }
            if self.slots[si].head == 1 {
                // Socket 0 carries nothing of this message: its empty part is done once
                // (`off[0]` = 1 marks it).
                if self.slots[si].off[0] == 0 {
                    self.slots[si].off[0] = 1;
                    self.finish_part(si);
                }
                let (s, e) = self.layout.part(self.slots[si].len, 1, n);
                while self.slots[si].off[1] < e - s {
                    let slot = &mut self.slots[si];
                    let want = (e - s) - slot.off[1];
                    let dst = slot.dst + s + slot.off[1];
                    match recv_raw(self.fds[1], dst as *mut u8, want) {
                        Ok(0) => return Err(self.eof()),
                        Ok(k) => slot.off[1] += k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break 'sock0,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(io_err("TCP receive", self.peer, e)),
                    }
                }
                self.finish_part(si);
                self.cur[0] += 1;
                continue;
            }
            let (s, e) = self.layout.part(self.slots[si].len, 0, n);
            loop {
                let slot = &mut self.slots[si];
                let want = (e - s) - slot.off[0];
                if want == 0 {
                    break;
                }
                let have = self.rx_end - self.rx_start;
                let dst = slot.dst + s + slot.off[0];
                if have > 0 {
                    let k = have.min(want);
                    // SAFETY: `dst..dst+k` lies inside a posted receive buffer (checked
                    // against its capacity in take_header); the irecv contract keeps it valid
                    // and unaliased; the source is our own buffer, which cannot overlap it.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.rx[self.rx_start..].as_ptr(),
                            dst as *mut u8,
                            k,
                        );
                    }
                    self.rx_start += k;
                    slot.off[0] += k;
                } else if want >= RX_DIRECT {
                    match recv_raw(self.fds[0], dst as *mut u8, want) {
                        Ok(0) => return Err(self.eof()),
                        Ok(k) => slot.off[0] += k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break 'sock0,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(io_err("TCP receive", self.peer, e)),
                    }
                } else if self.fill_rx()? == 0 {
                    break 'sock0;
                }
            }
            self.finish_part(si);
            self.cur[0] += 1;
        }
        // Sockets 1..n: large parts straight into the destination (on a duplex connection,
        // socket 1's parts come with their headers, above).
        let first = if self.layout.inline.is_some() { 2 } else { 1 };
        for j in first..n {
            while self.cur[j] < end {
                let si = (self.cur[j] - self.slot_base) as usize;
                let slot = &mut self.slots[si];
                if !slot.known {
                    break;
                }
                let (s, e) = self.layout.part(slot.len, j, n);
                if e == s {
                    self.cur[j] += 1;
                    continue;
                }
                let want = (e - s) - slot.off[j];
                if want > 0 {
                    let dst = slot.dst + s + slot.off[j];
                    match recv_raw(self.fds[j], dst as *mut u8, want) {
                        Ok(0) => return Err(self.eof()),
                        Ok(k) => slot.off[j] += k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(io_err("TCP receive", self.peer, e)),
                    }
                }
                if self.slots[si].off[j] == e - s {
                    self.finish_part(si);
                    self.cur[j] += 1;
                } else {
                    break;
                }
            }
        }
        Ok(())
    }
}

impl RecvComm for TcpRecvComm {
    unsafe fn irecv(&mut self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        super::refuse_if_failed(&self.failed, "TCP receive comm")?;
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(Error::arg(format!(
                "a grouped receive takes 1 to {MAX_RECVS} buffers, got {}",
                bufs.len()
            )));
        }
        if self.reqs.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let seq = self.req_base + self.reqs.len() as u64;
        let mut arr = [PostedBuf {
            addr: 0,
            len: 0,
            tag: 0,
        }; MAX_RECVS];
        for (a, b) in arr.iter_mut().zip(bufs) {
            *a = PostedBuf {
                addr: b.ptr as usize,
                len: b.len,
                tag: b.tag,
            };
        }
        self.reqs.push_back(RecvReq {
            bufs: arr,
            n: bufs.len() as u8,
            assigned: 0,
            sizes: [0; MAX_RECVS],
            left: bufs.len() as u8,
            reaped: false,
        });
        for _ in bufs {
            self.slots.push_back(Slot {
                req: seq,
                len: 0,
                dst: 0,
                known: false,
                head: 0,
                off: [0; MAX_FDS],
                parts_left: 0,
            });
        }
        // No progress here: the caller tests right away, and skipping the would-block
        // `recv` saves a system call per message.
        Ok(Some(ReqId(seq as u32)))
    }

    fn test(&mut self, req: ReqId, sizes: &mut [usize]) -> Result<bool> {
        self.progress()?;
        let r =
            super::pending_request(&mut self.reqs, self.req_base, req, |r| r.reaped, "receive")?;
        if r.left > 0 {
            return Ok(false);
        }
        for (d, s) in sizes.iter_mut().zip(&r.sizes[..r.n as usize]) {
            *d = *s;
        }
        r.reaped = true;
        while self.reqs.front().is_some_and(|r| r.reaped) {
            let r = self.reqs.pop_front().unwrap();
            self.req_base += 1;
            for _ in 0..r.n {
                self.slots.pop_front();
                self.slot_base += 1;
            }
        }
        for c in &mut self.cur[..self.fds.len()] {
            *c = (*c).max(self.slot_base);
        }
        Ok(true)
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        let end = self.slot_base + self.slots.len() as u64;
        for (j, fd) in self.fds.iter().enumerate() {
            if self.cur[j] < end {
                out.push(PollFd {
                    fd: *fd,
                    events: libc::POLLIN,
                });
            }
        }
    }

    /// The shared socket and the sockets of the way back written: messages back to the
    /// peer that connected, laid out as it lays out its own.
    fn reverse(&mut self) -> Option<Box<dyn SendComm>> {
        let peer = self.peer?;
        if self.back.is_empty() {
            return None;
        }
        let mut socks = vec![Arc::clone(&self.socks[0])];
        socks.append(&mut self.back);
        if let Some(b) = self.local_sndbuf.filter(|_| is_local(peer.ip())) {
            for s in &socks {
                // Best effort: the kernel's autotuned buffer also works, a bit slower.
                let _ = s.set_send_buffer_size(b);
            }
        }
        Some(Box::new(TcpSendComm::new(
            socks,
            Vec::new(),
            self.layout,
            peer,
        )))
    }
}

impl Drop for TcpRecvComm {
    fn drop(&mut self) {
        shut(&self.socks, std::net::Shutdown::Read);
        shut(&self.back, std::net::Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::Net;
    use std::net::Ipv4Addr;

    fn pair(net: &TcpNet) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
        crate::net::connect_pair(net)
    }

    fn net(nsocks: usize) -> TcpNet {
        TcpNet {
            addr: Ipv4Addr::LOCALHOST.into(),
            ifname: "lo".into(),
            nsocks,
            split: 64 * 1024,
            local_sndbuf: Some(LOCAL_SNDBUF),
            duplex: true,
        }
    }

    /// Post `sizes` as messages from `s` to `r` (tag 4) into buffers `slack` bytes larger,
    /// and check what arrives.
    fn exchange(
        s: &mut dyn SendComm,
        r: &mut dyn RecvComm,
        sizes: &[usize],
        seed: usize,
        slack: usize,
    ) {
        let data: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&l| (0..l).map(|i| (i * 7 + l + seed) as u8).collect())
            .collect();
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&l| vec![0u8; l + slack]).collect();
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        for (d, b) in data.iter().zip(bufs.iter_mut()) {
            let rb = RecvBuf {
                ptr: b.as_mut_ptr(),
                len: b.len(),
                tag: 4,
            };
            // SAFETY: `bufs` and `data` outlive `settle`, which completes every request.
            unsafe {
                recvs.push((r.irecv(&[rb]).unwrap().unwrap(), 1));
                sends.push(s.isend(d.as_ptr(), d.len(), 4, None).unwrap().unwrap());
            }
        }
        let got = settle(s, r, &sends, &recvs);
        for (i, l) in sizes.iter().enumerate() {
            assert_eq!(got[i], vec![*l], "size reported");
            assert!(bufs[i][..*l] == data[i][..], "{l}-byte payload");
        }
    }

    #[test]
    fn a_duplex_connection_carries_messages_both_ways() {
        let on = net(2);
        let off = TcpNet {
            duplex: false,
            ..net(2)
        };
        let (h_on, _l1) = on.listen(0).unwrap();
        let (h_off, _l2) = off.listen(0).unwrap();
        assert!(on.duplex(&h_on, &h_on));
        assert!(!on.duplex(&h_on, &h_off) && !off.duplex(&h_off, &h_on));

        // A plain connection goes one way.
        let (mut s, mut r) = pair(&on);
        assert!(
            r.reverse().is_none() && s.reverse().is_none(),
            "one-way connection"
        );
        let (h, mut l) = on.listen(0).unwrap();
        let mut c = on.connect_duplex(0, &h).unwrap();
        let (mut s, mut r) = loop {
            if let Some(s) = c.poll().unwrap() {
                break loop {
                    if let Some(r) = l.accept().unwrap() {
                        break (s, r);
                    }
                };
            }
            assert!(l.accept().unwrap().is_none());
        };
        let mut back_s = r.reverse().expect("a sending side back");
        let mut back_r = s.reverse().expect("a receiving side back");
        assert!(
            r.reverse().is_none() && s.reverse().is_none(),
            "each side once"
        );
        // Both ways at once; small payloads share socket 0, larger ones come with their
        // header on the direction's first own socket (split over both from 64 KiB), in
        // any interleaving.
        let inline = duplex_inline();
        let sizes = [
            1usize,
            4096,
            300_001,
            0,
            70_000,
            inline,
            inline + 1,
            5,
            200_000,
            3,
        ];
        exchange(&mut *s, &mut *r, &sizes, 1, 0);
        exchange(&mut *back_s, &mut *back_r, &sizes, 2, 0);

        // Messages sent just before the first side goes, the last ones on its own socket:
        // all arrive although the shared socket ends first.
        let last: Vec<Vec<u8>> = [7usize, 100_000, 90_000]
            .iter()
            .map(|&l| (0..l).map(|i| (i % 251) as u8).collect())
            .collect();
        // SAFETY: `last` outlives the sends, which complete before `s` goes.
        let reqs: Vec<ReqId> = last
            .iter()
            .map(|d| {
                unsafe { s.isend(d.as_ptr(), d.len(), 4, None) }
                    .unwrap()
                    .unwrap()
            })
            .collect();
        for q in reqs {
            while s.test(q).unwrap().is_none() {}
        }
        drop(s);
        for d in &last {
            let mut b = vec![0u8; d.len()];
            let rb = RecvBuf {
                ptr: b.as_mut_ptr(),
                len: b.len(),
                tag: 4,
            };
            // SAFETY: `b` outlives the request, completed below.
            let q = unsafe { r.irecv(&[rb]) }.unwrap().unwrap();
            while !r.test(q, &mut [0]).unwrap() {}
            assert!(
                &b == d,
                "{}-byte message sent before the side went",
                d.len()
            );
        }
        // The way back still works, and the first side's peer reads the end.
        exchange(&mut *back_s, &mut *back_r, &[5, 200_000], 3, 0);
        let mut b = [0u8; 8];
        let rb = RecvBuf {
            ptr: b.as_mut_ptr(),
            len: 8,
            tag: 4,
        };
        // SAFETY: `b` outlives the request, which fails below.
        let q = unsafe { r.irecv(&[rb]) }.unwrap().unwrap();
        let t0 = std::time::Instant::now();
        let err = loop {
            match r.test(q, &mut [0]) {
                Err(e) => break e.to_string(),
                Ok(done) => assert!(!done, "nothing was sent"),
            }
            assert!(
                t0.elapsed().as_secs() < 10,
                "the end of the stream never came"
            );
        };
        assert!(err.contains("closed by the peer"), "{err}");
    }

    #[test]
    fn send_buffers_are_capped_for_peers_on_this_host_only() {
        let n = net(1);
        assert_eq!(n.sndbuf_for(Ipv4Addr::LOCALHOST.into()), Some(LOCAL_SNDBUF));
        // An address of no interface here (TEST-NET-3): another host keeps autotuning.
        assert_eq!(n.sndbuf_for(Ipv4Addr::new(203, 0, 113, 7).into()), None);
        let auto = TcpNet {
            local_sndbuf: None,
            ..net(1)
        };
        assert_eq!(auto.sndbuf_for(Ipv4Addr::LOCALHOST.into()), None);
    }

    /// Drive sends and receives until all are done.
    fn settle(
        s: &mut dyn SendComm,
        r: &mut dyn RecvComm,
        sends: &[ReqId],
        recvs: &[(ReqId, usize)],
    ) -> Vec<Vec<usize>> {
        let mut out = vec![Vec::new(); recvs.len()];
        let mut sdone = vec![false; sends.len()];
        let mut rdone = vec![false; recvs.len()];
        while !(sdone.iter().all(|d| *d) && rdone.iter().all(|d| *d)) {
            for (i, q) in sends.iter().enumerate() {
                if !sdone[i] {
                    sdone[i] = s.test(*q).unwrap().is_some();
                }
            }
            for (i, (q, n)) in recvs.iter().enumerate() {
                if !rdone[i] {
                    let mut sizes = vec![0; *n];
                    if r.test(*q, &mut sizes).unwrap() {
                        rdone[i] = true;
                        out[i] = sizes;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn messages_of_every_size_over_several_sockets() {
        for nsocks in [1, 3] {
            let n = net(nsocks);
            let (mut s, mut r) = pair(&n);
            let sizes = [0usize, 1, 7, 4096, 65535, 65536, 300_001, 4 << 20];
            exchange(&mut *s, &mut *r, &sizes, nsocks, 5);
        }
    }

    #[test]
    fn grouped_receive_matches_tags_in_any_order() {
        let n = net(2);
        let (mut s, mut r) = pair(&n);
        let a = vec![1u8; 100];
        let b = vec![2u8; 200_000];
        let c = [3u8; 3];
        let mut ba = vec![0u8; 100];
        let mut bb = vec![0u8; 200_000];
        let mut bc = vec![0u8; 10];
        let group = [
            RecvBuf {
                ptr: bc.as_mut_ptr(),
                len: bc.len(),
                tag: 30,
            },
            RecvBuf {
                ptr: ba.as_mut_ptr(),
                len: ba.len(),
                tag: 10,
            },
            RecvBuf {
                ptr: bb.as_mut_ptr(),
                len: bb.len(),
                tag: 20,
            },
        ];
        // SAFETY: all buffers outlive `settle`, which completes every request.
        let (rq, sq) = unsafe {
            let rq = r.irecv(&group).unwrap().unwrap();
            let sq = [
                s.isend(b.as_ptr(), b.len(), 20, None).unwrap().unwrap(),
                s.isend(a.as_ptr(), a.len(), 10, None).unwrap().unwrap(),
                s.isend(c.as_ptr(), c.len(), 30, None).unwrap().unwrap(),
            ];
            (rq, sq)
        };
        let got = settle(&mut *s, &mut *r, &sq, &[(rq, 3)]);
        assert_eq!(got[0], vec![3, 100, 200_000]);
        assert_eq!(ba, a);
        assert_eq!(bb, b);
        assert_eq!(&bc[..3], &c[..]);
    }

    #[test]
    fn oversized_message_and_unknown_tag_are_errors() {
        let n = net(1);
        for (len, tag) in [(64usize, 5u32), (8, 6)] {
            let (mut s, mut r) = pair(&n);
            let data = vec![0u8; len];
            let mut buf = vec![0u8; 16];
            // SAFETY: buffers outlive the loop below, which ends with the receive failing.
            unsafe {
                let q = r
                    .irecv(&[RecvBuf {
                        ptr: buf.as_mut_ptr(),
                        len: 16,
                        tag: 5,
                    }])
                    .unwrap()
                    .unwrap();
                let sq = s.isend(data.as_ptr(), len, tag, None).unwrap().unwrap();
                while s.test(sq).unwrap().is_none() {}
                let e = loop {
                    match r.test(q, &mut [0]) {
                        Ok(false) => continue,
                        Ok(true) => panic!("a bad message was accepted"),
                        Err(e) => break e.to_string(),
                    }
                };
                if tag == 5 {
                    assert!(e.contains("holds only 16 bytes"), "{e}");
                } else {
                    assert_eq!(crate::net::unexpected_tag_of(&e), Some(6), "{e}");
                }
            }
        }
    }

    #[test]
    fn request_slots_are_bounded_and_closed_peer_is_reported() {
        let n = net(1);
        let (mut s, mut r) = pair(&n);
        let mut bufs = vec![[0u8; 4]; MAX_REQUESTS + 1];
        let mut got_none = false;
        for b in bufs.iter_mut() {
            // SAFETY: the receive comm is dropped before `bufs`.
            if unsafe {
                r.irecv(&[RecvBuf {
                    ptr: b.as_mut_ptr(),
                    len: 4,
                    tag: 0,
                }])
            }
            .unwrap()
            .is_none()
            {
                got_none = true;
            }
        }
        assert!(got_none, "more than MAX_REQUESTS receives were accepted");
        drop(s);
        let e = loop {
            match r.test(ReqId(0), &mut [0]) {
                Ok(false) => continue,
                Ok(true) => panic!("nothing was sent"),
                Err(e) => break e.to_string(),
            }
        };
        assert!(e.contains("closed by the peer"), "{e}");
        s = pair(&n).0;
        drop(r);
        drop(s);
        drop(bufs);
    }

    #[test]
    fn handles_are_checked() {
        let n = net(2);
        let bad = NetHandle::from_bytes(&[1, 2, 3]).unwrap();
        let e = n
            .connect(0, &bad)
            .err()
            .expect("a foreign handle must be refused")
            .to_string();
        assert!(e.contains("not a roccl TCP connection handle"), "{e}");
        assert!(NetHandle::from_bytes(&[0u8; 129]).is_err());
        assert_eq!(n.properties(0).unwrap().max_recvs, MAX_RECVS as u32);
        assert!(n.properties(1).is_err());
    }
}
