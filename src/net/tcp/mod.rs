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
//! A new connection opens its sockets and sends a 32-byte hello on each
//! (`magic`, `conn id: u64` from the OS random source, `index: u16`, `count: u16`, bit 15 of
//! the count set on a duplex connection, then a 16-byte tag: HMAC-SHA256 of the first 16
//! bytes under the listener's key, see `net::NetKey`); the listener drops a socket
//! whose tag does not check, or that repeats one already seen, before grouping it, and drops
//! one that has not sent its hello within `SETUP_DEADLINE`. It groups sockets by connection
//! id and hands out the receive comm once all have arrived. The listen handle carries the
//! listener's 16-byte token at bytes 48..64.
//!
//! On an encrypted job (`ROCCL_ENCRYPT`) bit 14 of the hello's count is set, and after the
//! hello each socket's bytes each way are AES-256-GCM records (`records`).

//!
//! The modules: `setup` (connecting and accepting), `io` (socket calls and the layout of
//! a message over the sockets), `send` and `recv` (the comms).

mod io;
mod records;
mod recv;
mod send;
mod settings;
mod setup;
#[cfg(test)]
mod tests;

pub use settings::TcpSettings;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use socket2::Socket;

use super::{Connecting, ListenComm, Net, NetHandle, NetProperties, PtrSupport, MAX_RECVS};
use crate::bootstrap::ifaces::{get_others, put_others};
use crate::error::{Error, Result};

const HANDLE_MAGIC: u32 = 0x5043_5452; // "RTCP"
const HELLO_MAGIC: u32 = 0x4f4c_4548; // "HELO"
const MSG_MAGIC: u32 = 0x4753_4d52; // "RMSG"
const HDR: usize = 16;
/// Bytes of a hello: the 16 that say which connection and socket, and their tag.
const HELLO: usize = HDR + crate::bootstrap::auth::TAG_BYTES;
/// Where the listener's token is in the handle.
const HANDLE_TOKEN: usize = 48;
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
/// Bit of the hello's socket count: the connection is duplex (see [`io::Layout`]).
const HELLO_DUPLEX: u16 = 0x8000;
/// Bit of the hello's socket count: the connection is encrypted (see [`records`]).
const HELLO_SEALED: u16 = 0x4000;

/// The TCP network. One device: the interface chosen by `ROCCL_SOCKET_IFNAME`.
pub struct TcpNet {
    addr: IpAddr,
    /// The host's other addresses: the listener takes connections on every address and its
    /// handle names these too (a switchless mesh: each cable its own subnet).
    others: Vec<Ipv4Addr>,
    ifname: String,
    nsocks: usize,
    split: usize,
    /// `SO_SNDBUF` for sockets to a peer on this host (None: the kernel's autotuning).
    local_sndbuf: Option<usize>,
    /// Connections carry messages both ways (`ROCCL_TCP_DUPLEX`, default on; see
    /// [`Net::duplex`]).
    duplex: bool,
    /// Payloads a duplex connection sends inline on its shared socket, up to this size
    /// ([`TcpSettings::duplex_inline`]).
    duplex_inline: usize,
    /// The key connections are authenticated with ([`Net::set_job_key`]).
    key: super::NetKey,
    /// Its counters ([`Net::counters`]), shared with its connections.
    stats: Arc<TcpStats>,
}

/// The way back of a duplex connection, for the comm that carries it: its sockets (the
/// shared one first), layout, keys and counters. Each side's file has a `way_back` that makes
/// its comm of one, and the setup hands the other side's to each comm it makes, so that
/// neither `send.rs` nor `recv.rs` names the other's comm.
struct WayBack {
    socks: Vec<Arc<Socket>>,
    layout: io::Layout,
    crypt: Option<records::Crypt>,
    stats: Arc<TcpStats>,
    /// The peer.
    peer: SocketAddr,
}

/// What a TCP network counts (`roccl_net_*_total{network="tcp"}`): connections set up,
/// sends the kernel took only part of (a full socket buffer: the rest waits), and sends it
/// took none of.
#[derive(Default)]
pub(super) struct TcpStats {
    pub(super) connections: AtomicU64,
    pub(super) short_writes: AtomicU64,
    pub(super) send_would_block: AtomicU64,
}

impl TcpStats {
    pub(super) fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

impl TcpNet {
    /// Open on the interface the bootstrap chooses (`ROCCL_SOCKET_IFNAME`), as `settings`
    /// say.
    pub fn new(settings: &TcpSettings) -> Result<Self> {
        Self::with_addr(crate::bootstrap::ifaces::local_addr(None)?, settings)
    }

    /// Open on a given local address, as `settings` say.
    pub fn with_addr(addr: IpAddr, settings: &TcpSettings) -> Result<Self> {
        let nsocks = settings.nsocks;
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
            others: crate::bootstrap::ifaces::other_addrs(addr, MAX_OTHER_ADDRS),
            ifname,
            nsocks,
            split: settings.split.max(4096),
            local_sndbuf: match settings.sndbuf {
                0 => None,
                b => Some(b),
            },
            duplex: settings.duplex,
            duplex_inline: settings.duplex_inline,
            key: super::NetKey::new(),
            stats: Arc::default(),
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
/// Byte of the handle with the number of other IPv4 addresses the listener takes
/// connections on (a host of several subnets: [`crate::bootstrap::ifaces::other_addrs`]).
const HANDLE_OTHERS: usize = 33;
/// Where those addresses are, 4 bytes each, after the token.
const HANDLE_OTHER_AT: usize = HANDLE_TOKEN + super::TOKEN_BYTES;
/// Most other addresses a handle carries.
pub(crate) const MAX_OTHER_ADDRS: usize = (super::HANDLE_MAX - HANDLE_OTHER_AT) / 4;

/// What a listen handle says: where to connect (the listener's main address and the others
/// it takes connections on), and how.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Handle {
    pub(super) addr: SocketAddr,
    pub(super) others: Vec<Ipv4Addr>,
    pub(super) nsocks: usize,
    pub(super) split: usize,
}

impl Handle {
    /// The address to connect to from this host: the main one, or another that is on one
    /// of this host's subnets when the main one is not (a switchless mesh).
    pub(super) fn reachable(&self) -> SocketAddr {
        SocketAddr::new(
            crate::bootstrap::ifaces::reach(self.addr.ip(), &self.others),
            self.addr.port(),
        )
    }
}

fn encode_handle(h: &Handle, duplex: bool, token: &[u8; super::TOKEN_BYTES]) -> Result<NetHandle> {
    let mut b = [0u8; super::HANDLE_MAX];
    b[HANDLE_TOKEN..HANDLE_OTHER_AT].copy_from_slice(token);
    b[0..4].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
    b[4] = h.nsocks as u8;
    match h.addr.ip() {
        IpAddr::V4(v4) => {
            b[5] = 4;
            b[8..12].copy_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            b[5] = 6;
            b[8..24].copy_from_slice(&v6.octets());
        }
    }
    b[6..8].copy_from_slice(&h.addr.port().to_le_bytes());
    b[24..32].copy_from_slice(&(h.split as u64).to_le_bytes());
    b[HANDLE_DUPLEX] = u8::from(duplex);
    put_others(
        &mut b,
        HANDLE_OTHERS,
        HANDLE_OTHER_AT,
        &h.others,
        MAX_OTHER_ADDRS,
    );
    NetHandle::from_bytes(&b)
}

fn decode_handle(h: &NetHandle) -> Result<Handle> {
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
    let others = get_others(b, HANDLE_OTHERS, HANDLE_OTHER_AT, MAX_OTHER_ADDRS).ok_or_else(bad)?;
    let split = u64::from_le_bytes(b[24..32].try_into().unwrap()) as usize;
    Ok(Handle {
        addr: SocketAddr::new(ip, port),
        others,
        nsocks,
        split: split.max(4096),
    })
}

/// Checks of a handle and a hello (its tag checked) without I/O, for the fuzz targets:
/// decode them as the connector and the listener do, and a decoded handle encodes back.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz(handle: &[u8], hello: &[u8]) {
    if let Ok(h) = NetHandle::from_bytes(handle) {
        if let Ok(d) = decode_handle(&h) {
            let b = h.as_bytes();
            let token: [u8; super::TOKEN_BYTES] = b
                [HANDLE_TOKEN..HANDLE_TOKEN + super::TOKEN_BYTES]
                .try_into()
                .unwrap();
            let again = encode_handle(&d, b[HANDLE_DUPLEX] != 0, &token).expect("a handle's size");
            assert_eq!(decode_handle(&again).ok(), Some(d), "handle round trip");
        }
    }
    if let Ok(h) = <[u8; HELLO]>::try_from(hello) {
        if let Some(s) = setup::hello_shape(&h) {
            assert!(s.idx < s.n, "{s:?}");
            let per_way = if s.duplex { (s.n - 1) / 2 } else { s.n };
            assert!((1..=MAX_SOCKS).contains(&per_way), "{s:?}");
        }
    }
}

/// `SO_SNDBUF` for a peer on the same host (the kernel doubles it: 512 KiB of socket
/// buffer). With autotuning the buffer grows to 4 MiB and the sender copies into skb pages
/// that have left the caches: 2 ranks, 16 MiB all-reduce over loopback 5.4-5.6 ms with this
/// vs 6.3-6.9 ms without (docs/PERFORMANCE-LOG.md). Peers on other hosts keep autotuning, which
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
        self.open_listener()
    }

    /// Both listeners take duplex connections: one connection per pair and channel carries
    /// both directions, so each side's data carries the acknowledgements of the other's
    /// (2 ranks, 8 B all-reduce over loopback: one segment per message instead of a data
    /// segment and a pure ACK; docs/PERFORMANCE-LOG.md).
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

    fn set_job_key(&self, key: &crate::bootstrap::auth::JobKey) {
        self.key.set(key);
    }

    fn set_encryption(&self, on: bool) {
        self.key.set_encryption(on);
    }

    fn encrypts(&self) -> bool {
        self.key.encrypting()
    }

    fn counters(&self, out: &mut Vec<(&'static str, u64)>) {
        let s = &self.stats;
        out.extend([
            ("connections", s.connections.load(Ordering::Relaxed)),
            ("short_writes", s.short_writes.load(Ordering::Relaxed)),
            (
                "send_would_block",
                s.send_would_block.load(Ordering::Relaxed),
            ),
        ]);
    }
}
