//! The RDMA network (`ROCCL_NET=rocev2`): the core's network trait over any verbs provider
//! (today the userspace RoCE v2 engine; real NICs with issue 5).
//!
//! Receiver-driven, as proven RDMA transports are. Each connection is one RC QP. The sender
//! owns a FIFO of [`FIFO`] clear-to-send slots registered for remote write. For every
//! (grouped) receive, the receiver registers its buffers, posts one receive work request per
//! buffer and RDMA-writes a slot — sequence number, buffer count, and per buffer address,
//! size, rkey and tag — into the sender's FIFO. The sender, for each send in order, waits for
//! the slot of the current sequence number, matches its tag to a buffer of the slot, and
//! RDMA-writes the data with immediate: the immediate is the size (one buffer) or
//! `index << 29 | size` (grouped). The receiver's receive completion carries the size.
//!
//! Connection setup runs over a TCP side channel whose address is the listen handle: the
//! connecting side sends its QP endpoint and FIFO (address, rkey), the listener creates its
//! QP, connects it and answers with its endpoint, the connecting side connects its QP and
//! sends one byte to say it is ready to receive.
//!
//! Memory: buffers are registered per request and released at completion (registration in
//! the userspace engine is a table insert; a cache for hardware comes with the verbs provider).

mod regcache;

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::{
    Connecting, ListenComm, Liveness, MemHandle, Net, NetHandle, NetProperties, PollFd, PtrSupport,
    RecvBuf, RecvComm, RecvGroup, ReqId, SendComm, Side, MAX_RECVS, MAX_REQUESTS,
};
use crate::error::{Error, Result};
use crate::rdma::udp::UserVerbs;
use crate::rdma::verbs::{
    Access, Mr, QpEndpoint, QpId, RecvWr, SendWr, Sge, Verbs, Wc, WcOpcode, WcStatus, WrOpcode,
};
use regcache::{Pinned, RegCache};

/// Clear-to-send slots per connection (= requests in flight).
pub const FIFO: usize = MAX_REQUESTS;
/// Clear-to-send slots in the sender's FIFO: twice the requests in flight, because the
/// receiver also writes credit-only entries (see [`EagerCfg`]) and never reuses the slot of
/// a receive still waiting for data.
const CTS_SLOTS: usize = 2 * FIFO;
const HANDLE_MAGIC: u32 = 0x3256_5252; // "RRV2"
const INFO_MAGIC: u32 = 0x5851_5152; // "RQPX"
const INFO: usize = 64;

/// One buffer of a clear-to-send slot.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, bytemuck::Pod, bytemuck::Zeroable)]
struct CtsElem {
    addr: u64,
    size: u32,
    rkey: u32,
    tag: u32,
    _pad: u32,
}

/// A clear-to-send slot; `seq` is written at both ends so a torn read is detected.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, bytemuck::Pod, bytemuck::Zeroable)]
struct Cts {
    seq: u32,
    n: u32,
    elems: [CtsElem; MAX_RECVS],
    /// Receive work requests the receiver has posted again so far (wrapping): the sender's
    /// credit, see [`EagerCfg`].
    credits: u32,
    /// Number (wrapping) of the first message that belongs to this receive: the sender's
    /// messages fill the receives' buffers in order.
    first: u32,
    /// [`CTS_EAGER_ONLY`] or 0.
    flags: u32,
    seq_end: u32,
}

/// Eager messages: a message of at most `size` bytes is sent at once with SEND_WITH_IMM
/// (immediate = tag) into one of the receiver's `slots` pre-posted bounce buffers of `size`
/// bytes, without waiting for a clear-to-send; the receiver copies it out when it matches a
/// receive. Every message (eager or not) consumes one of the receiver's `slots` receive work
/// requests, which the receiver posts again as it consumes them and reports in each
/// clear-to-send (`credits`), so the sender never has more than `slots` messages unconsumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct EagerCfg {
    size: u32,
    slots: u32,
}

/// Receive work requests (and bounce buffers) per connection; at least [`FIFO`], so that
/// messages sent against clear-to-send entries never lack one.
const EAGER_SLOTS: u32 = 64;
/// Default and largest eager size (`ROCCL_ROCEV2_EAGER`, 0 turns eager messages off).
const EAGER_DEFAULT: u32 = 16384;
const EAGER_MAX: u32 = 65536;

impl EagerCfg {
    fn from_env() -> Result<EagerCfg> {
        let size = match std::env::var("ROCCL_ROCEV2_EAGER") {
            Ok(v) if !v.trim().is_empty() => match v.trim().parse::<u32>() {
                Ok(n) if n <= EAGER_MAX => n,
                _ => {
                    return Err(Error::arg(format!(
                        "ROCCL_ROCEV2_EAGER={v}: want the largest eager message in bytes, 0 to {EAGER_MAX} (0: off)"
                    )))
                }
            },
            _ => EAGER_DEFAULT,
        };
        Ok(EagerCfg {
            size,
            slots: EAGER_SLOTS,
        })
    }
}

const CTS_BYTES: usize = std::mem::size_of::<Cts>();

/// Flag of a clear-to-send entry that describes a receive whose buffers take eager messages
/// only (no addresses, no keys): written when such a receive has waited
/// [`ANNOUNCE_AFTER`] for its data, so that a sender holding a larger message for it (which
/// waits for a clear-to-send that never comes) learns the sizes and fails at once instead of
/// at `ROCCL_TIMEOUT`.
const CTS_EAGER_ONLY: u32 = 1;

/// How long the oldest receive waits for eager data before it describes itself to the
/// sender (one write per receive that waited this long; none on the fast path).
const ANNOUNCE_AFTER: std::time::Duration = std::time::Duration::from_millis(10);

/// The RoCE v2 network over a verbs provider.
pub struct RoceNet {
    verbs: Arc<dyn Verbs>,
    /// Address of the TCP side channel that sets connections up.
    ip: IpAddr,
    /// Link speed, if known.
    speed_mbps: Option<u32>,
    pci_path: Option<String>,
    dmabuf: bool,
    /// GPU memory may be posted: connections send and receive without CPU copies.
    device_buffers: AtomicBool,
}

impl RoceNet {
    /// The userspace RoCE v2 engine on `ip` (`ROCCL_ROCEV2_PORT`, `ROCCL_ROCEV2_FAULTS`).
    pub fn userspace(ip: IpAddr) -> Result<RoceNet> {
        let verbs = UserVerbs::open(ip)?;
        Ok(RoceNet {
            dmabuf: verbs.dmabuf_supported(),
            verbs: Arc::new(verbs),
            ip,
            speed_mbps: None,
            pci_path: None,
            device_buffers: AtomicBool::new(false),
        })
    }

    /// A RoCE v2 NIC through libibverbs: device, port and GID chosen from sysfs as
    /// `ROCCL_IB_HCA`, `ROCCL_IB_GID_INDEX`, `ROCCL_IB_ADDR_FAMILY` and `ROCCL_IB_ADDR_RANGE`
    /// say; connections are set up over TCP on `ip`.
    #[cfg(feature = "verbs")]
    pub fn nic(ip: IpAddr) -> Result<RoceNet> {
        use crate::rdma::select;
        let ports = select::scan(std::path::Path::new(select::SYSFS_ROOT))?;
        let choice = select::choose(&ports, &select::Criteria::from_env()?)?;
        let port = ports
            .iter()
            .find(|p| p.dev == choice.dev && p.port == choice.port);
        let v =
            crate::rdma::ibv::IbvVerbs::open(&choice, crate::rdma::ibv::IbSettings::from_env()?)?;
        Ok(RoceNet {
            dmabuf: v.dmabuf(),
            verbs: Arc::new(v),
            ip,
            speed_mbps: port.and_then(|p| p.rate_gbps).map(|g| (g * 1000.0) as u32),
            pci_path: port.and_then(|p| p.pci.clone()),
            device_buffers: AtomicBool::new(false),
        })
    }

    /// Over any provider (connections set up over TCP on `ip`).
    pub fn over(verbs: Arc<dyn Verbs>, ip: IpAddr) -> RoceNet {
        RoceNet {
            verbs,
            ip,
            speed_mbps: None,
            pci_path: None,
            dmabuf: false,
            device_buffers: AtomicBool::new(false),
        }
    }

    /// This side's eager configuration: none where GPU memory may be posted (the receiver
    /// would copy eager messages out of its bounce buffers with the CPU).
    fn eager_cfg(&self) -> Result<EagerCfg> {
        let mut e = EagerCfg::from_env()?;
        if self.device_buffers.load(Ordering::Relaxed) {
            e.size = 0;
        }
        Ok(e)
    }

    /// The provider's name.
    pub fn provider(&self) -> String {
        self.verbs.name()
    }
}

/// Whether a kernel module lets the NIC register GPU memory by its address (peer memory:
/// `nvidia_peermem`, or AMD's `amdkfd` peer-memory client), as NCCL and RCCL check.
pub fn peer_memory() -> bool {
    [
        "/sys/kernel/mm/memory_peers/nv_mem/version",
        "/sys/module/nvidia_peermem/version",
        "/sys/kernel/mm/memory_peers/amdkfd/version",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists())
}

fn put_addr(b: &mut [u8], a: SocketAddr) {
    match a.ip() {
        IpAddr::V4(v) => {
            b[0] = 4;
            b[4..8].copy_from_slice(&v.octets());
        }
        IpAddr::V6(v) => {
            b[0] = 6;
            b[4..20].copy_from_slice(&v.octets());
        }
    }
    b[2..4].copy_from_slice(&a.port().to_le_bytes());
}

fn get_addr(b: &[u8]) -> Option<SocketAddr> {
    let ip: IpAddr = match b[0] {
        4 => <[u8; 4]>::try_from(&b[4..8]).ok()?.into(),
        6 => <[u8; 16]>::try_from(&b[4..20]).ok()?.into(),
        _ => return None,
    };
    Some(SocketAddr::new(ip, u16::from_le_bytes([b[2], b[3]])))
}

/// Most receive work requests a peer may say it posts: the sender sizes its staging
/// buffers (`slots × eager size`) by that number, so it is bounded before anything is
/// allocated (this roccl posts [`EAGER_SLOTS`]).
const MAX_PEER_SLOTS: u32 = 1024;

/// The peer's receive work request count, from its setup message, within what this roccl
/// can work with (at least [`FIFO`]) and allocate for (at most [`MAX_PEER_SLOTS`]).
fn check_peer_slots(slots: u32, peer: SocketAddr) -> Result<()> {
    if !(FIFO as u32..=MAX_PEER_SLOTS).contains(&slots) {
        return Err(Error::InvalidUsage(format!(
            "RoCE v2 connection setup with {peer}: the peer says it posts {slots} receive buffers, outside the {FIFO} to {MAX_PEER_SLOTS} this roccl works with (another roccl version, or not a roccl peer?)"
        )));
    }
    Ok(())
}

/// Largest grouped-receive buffer index and size an immediate carries: `index << 29 | size`.
const IMM_SIZE_BITS: u32 = 29;

/// The buffer of receive `g` that an RDMA write with immediate `imm` from `peer` filled, and
/// its size: what the peer claims, checked against the posted receive (a size beyond the
/// buffer or an index beyond the group is the peer's error, never trusted).
fn written(g: &RecvGroup, imm: u32, peer: SocketAddr) -> Result<(usize, usize)> {
    let (e, len) = if g.len() == 1 {
        (0usize, imm as usize)
    } else {
        (
            (imm >> IMM_SIZE_BITS) as usize,
            (imm & ((1 << IMM_SIZE_BITS) - 1)) as usize,
        )
    };
    if e >= g.len() {
        return Err(Error::InvalidUsage(format!(
            "RoCE v2 receive from {peer}: the peer says it wrote buffer {e} of a receive of {} buffers (corrupt immediate, or another roccl version?)",
            g.len()
        )));
    }
    let size = g.bufs[e].1;
    if len > size {
        return Err(Error::InvalidUsage(format!(
            "RoCE v2 receive from {peer}: the peer says it wrote {len} bytes into buffer {e}, which holds only {size} bytes (corrupt immediate, or another roccl version?)"
        )));
    }
    Ok((e, len))
}

/// Endpoint + FIFO description sent over the side channel.
fn encode_info(
    ep: &QpEndpoint,
    fifo: Option<&Mr>,
    eager: Option<EagerCfg>,
    hardware: bool,
) -> [u8; INFO] {
    let mut b = [0u8; INFO];
    b[0..4].copy_from_slice(&INFO_MAGIC.to_le_bytes());
    put_addr(&mut b[4..24], ep.addr);
    b[24..28].copy_from_slice(&ep.qpn.to_le_bytes());
    b[28..32].copy_from_slice(&ep.psn.to_le_bytes());
    b[32..36].copy_from_slice(&ep.mtu.to_le_bytes());
    if let Some(m) = fifo {
        b[36..44].copy_from_slice(&m.addr.to_le_bytes());
        b[44..48].copy_from_slice(&m.rkey.to_le_bytes());
    }
    if let Some(e) = eager {
        b[48..52].copy_from_slice(&e.size.to_le_bytes());
        b[52..56].copy_from_slice(&e.slots.to_le_bytes());
    }
    b[56] = u8::from(hardware);
    b
}

/// Both ends must run RoCE v2 through the same kind of provider.
fn same_provider(peer_info: &[u8; INFO], verbs: &dyn Verbs) -> Result<()> {
    let kind = |hw: bool| {
        if hw {
            "an RDMA NIC (ROCCL_NET=verbs)"
        } else {
            "the userspace RoCE v2 engine over UDP (ROCCL_NET=rocev2)"
        }
    };
    let (theirs, ours) = (peer_info[56] != 0, verbs.hardware());
    if theirs != ours {
        return Err(Error::InvalidUsage(format!(
            "RoCE v2 connection setup: the peer uses {} but this rank {}: set the same ROCCL_NET on every rank (verbs needs an RDMA NIC on every node)",
            kind(theirs),
            kind(ours)
        )));
    }
    Ok(())
}

/// What the peer sent: its endpoint, FIFO (address, rkey) and eager configuration.
type Info = (QpEndpoint, u64, u32, EagerCfg);

fn decode_info(b: &[u8; INFO]) -> Result<Info> {
    let bad = || {
        Error::InvalidUsage(
            "RoCE v2 connection setup: the peer sent an unknown message (another roccl version?)"
                .into(),
        )
    };
    if u32::from_le_bytes(b[0..4].try_into().unwrap()) != INFO_MAGIC {
        return Err(bad());
    }
    let addr = get_addr(&b[4..24]).ok_or_else(bad)?;
    let u32at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    let ep = QpEndpoint {
        addr,
        qpn: u32at(24),
        psn: u32at(28),
        mtu: u32at(32),
    };
    Ok((
        ep,
        u64::from_le_bytes(b[36..44].try_into().unwrap()),
        u32at(44),
        EagerCfg {
            size: u32at(48),
            slots: u32at(52),
        },
    ))
}

impl Net for RoceNet {
    fn name(&self) -> &'static str {
        if self.verbs.hardware() {
            "verbs"
        } else {
            "rocev2"
        }
    }

    fn devices(&self) -> usize {
        1
    }

    fn properties(&self, dev: usize) -> Result<NetProperties> {
        if dev != 0 {
            return Err(Error::arg(format!(
                "rocev2 has one device; asked for device {dev}"
            )));
        }
        Ok(NetProperties {
            name: self.verbs.name(),
            pci_path: self.pci_path.clone(),
            guid: 0,
            ptr_support: PtrSupport {
                host: true,
                device: if self.verbs.hardware() {
                    peer_memory()
                } else {
                    self.dmabuf
                },
                dmabuf: self.dmabuf,
            },
            speed_mbps: self.speed_mbps.unwrap_or(if self.ip.is_loopback() {
                100_000
            } else {
                10_000
            }),
            port: 1,
            latency_us: if self.verbs.hardware() { 3.0 } else { 8.0 },
            max_comms: 4096,
            max_recvs: MAX_RECVS as u32,
        })
    }

    fn set_timeout(&self, timeout: std::time::Duration) {
        self.verbs.set_timeout(timeout);
    }

    fn expect_device_buffers(&self) {
        self.device_buffers.store(true, Ordering::Relaxed);
    }

    fn listen(&self, dev: usize) -> Result<(NetHandle, Box<dyn ListenComm>)> {
        self.properties(dev)?;
        let l = TcpListener::bind(SocketAddr::new(self.ip, 0)).map_err(|e| {
            Error::sys(format!("bind the RoCE v2 setup listener on {}", self.ip), e)
        })?;
        l.set_nonblocking(true)
            .map_err(|e| Error::sys("fcntl on the RoCE v2 setup listener", e))?;
        let a = l.local_addr().map_err(|e| Error::sys("getsockname", e))?;
        let mut h = [0u8; 28];
        h[0..4].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
        put_addr(&mut h[4..24], a);
        Ok((
            NetHandle::from_bytes(&h)?,
            Box::new(RoceListen {
                l,
                verbs: Arc::clone(&self.verbs),
                pending: Vec::new(),
                eager: self.eager_cfg()?,
            }),
        ))
    }

    fn connect(&self, _dev: usize, handle: &NetHandle) -> Result<Box<dyn Connecting>> {
        let b = handle.as_bytes();
        if u32::from_le_bytes(b[0..4].try_into().unwrap()) != HANDLE_MAGIC {
            return Err(Error::arg(
                "not a roccl RoCE v2 connection handle: was it produced by another network?",
            ));
        }
        let peer =
            get_addr(&b[4..24]).ok_or_else(|| Error::arg("RoCE v2 handle has no address"))?;
        let mut side = Side::dial(peer, "RoCE v2 setup: ")?;
        let (qp, ep) = self.verbs.create_qp()?;
        let mut fifo: Box<[Cts; CTS_SLOTS]> = Box::new([Cts::default(); CTS_SLOTS]);
        // SAFETY: the FIFO is boxed (stable address) and owned by the send comm, which
        // deregisters it before freeing it.
        let mr = unsafe {
            self.verbs.reg_mr(
                fifo.as_mut_ptr() as u64,
                CTS_SLOTS * CTS_BYTES,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )?
        };
        let eager = self.eager_cfg()?;
        side.queue(&encode_info(
            &ep,
            Some(&mr),
            Some(eager),
            self.verbs.hardware(),
        ));
        side.expect(INFO);
        Ok(Box::new(RoceConnecting {
            side,
            verbs: Arc::clone(&self.verbs),
            qp,
            mr,
            fifo: Some(fifo),
            replied: false,
            eager,
            peer_eager: None,
            peer_addr: None,
        }))
    }
}

/// `h` with its setup port replaced by `port` (tests of peers that do not answer).
#[cfg(test)]
pub(crate) fn handle_with_port(h: &NetHandle, port: u16) -> NetHandle {
    let mut b = *h.as_bytes();
    b[6..8].copy_from_slice(&port.to_le_bytes());
    NetHandle::from_bytes(&b).unwrap()
}

struct RoceConnecting {
    side: Side,
    verbs: Arc<dyn Verbs>,
    qp: QpId,
    mr: Mr,
    fifo: Option<Box<[Cts; CTS_SLOTS]>>,
    replied: bool,
    eager: EagerCfg,
    peer_eager: Option<EagerCfg>,
    peer_addr: Option<SocketAddr>,
}

impl Connecting for RoceConnecting {
    fn poll(&mut self) -> Result<Option<Box<dyn SendComm>>> {
        if !self.side.pump()? {
            return Ok(None);
        }
        if !self.replied {
            let b: [u8; INFO] = self.side.inb[..INFO].try_into().unwrap();
            let (peer, _, _, peer_eager) = decode_info(&b)?;
            same_provider(&b, &*self.verbs)?;
            check_peer_slots(peer_eager.slots, peer.addr)?;
            self.peer_eager = Some(peer_eager);
            self.peer_addr = Some(peer.addr);
            self.verbs.connect_qp(self.qp, &peer)?;
            self.side.queue(&[1]);
            self.replied = true;
            if !self.side.pump()? {
                return Ok(None);
            }
        }
        if self.fifo.is_none() {
            return Err(Error::Internal("connection polled after completion".into()));
        }
        // Fallible steps first: on error the FIFO stays here, registered, and Drop releases
        // both together.
        let side = self
            .side
            .s
            .try_clone()
            .map_err(|e| Error::sys("dup of the RoCE v2 setup socket", e))?;
        let peer = self.peer_eager.unwrap_or(EagerCfg { size: 0, slots: 0 });
        let eager_size = self.eager.size.min(peer.size);
        // Eager messages are copied here at post, so the send completes at once; slot
        // `m % slots` is free again once the receiver consumed message `m - slots`, which
        // the credit check before each send guarantees.
        let staging = Bounce::alloc(
            &*self.verbs,
            EagerCfg {
                size: eager_size,
                slots: peer.slots,
            },
        )?;
        let fifo = self.fifo.take().expect("checked above");
        Ok(Some(Box::new(RoceSend {
            verbs: Arc::clone(&self.verbs),
            device_copy: None,
            qp: self.qp,
            peer: self
                .peer_addr
                .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0))),
            live: Liveness::new(side, "RoCE v2"),
            fifo_mr: self.mr,
            fifo,
            reqs: VecDeque::with_capacity(FIFO),
            base: 0,
            seq: 1,
            wcs: [EMPTY_WC; 16],
            failed: None,
            eager_size: eager_size as usize,
            staging,
            slots: peer.slots,
            sent: 0,
            tags: [0; TAG_RING],
            credits: 0,
            cache: RegCache::new(&*self.verbs),
        })))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(PollFd {
            fd: self.side.s.as_raw_fd(),
            events: libc::POLLIN | libc::POLLOUT,
        });
    }
}

impl Drop for RoceConnecting {
    fn drop(&mut self) {
        if self.fifo.is_some() {
            // Setup abandoned: release what the send comm would have owned.
            let _ = self.verbs.dereg_mr(&self.mr);
            self.verbs.destroy_qp(self.qp);
        }
    }
}

struct Accepting {
    side: Side,
    qp: Option<Accepted>,
}

/// A receive side whose QP is connected, waiting for the sender's "ready".
struct Accepted {
    qp: QpId,
    peer: SocketAddr,
    fifo_addr: u64,
    fifo_rkey: u32,
    bounce: Bounce,
    eager: usize,
}

/// The receiver's bounce buffers: one per receive work request, posted at setup. The
/// provider writes them (possibly from its progress thread), hence the cells.
struct Bounce {
    buf: Box<[std::cell::UnsafeCell<u8>]>,
    mr: Mr,
    size: usize,
    slots: u32,
}

impl Bounce {
    /// Register `cfg.slots` buffers of `cfg.size` bytes and post a receive for each.
    fn new(verbs: &dyn Verbs, qp: QpId, cfg: EagerCfg) -> Result<Bounce> {
        let b = Bounce::alloc(verbs, cfg)?;
        for slot in 0..cfg.slots as usize {
            if let Err(e) = b.post(verbs, qp, slot) {
                let _ = verbs.dereg_mr(&b.mr);
                return Err(e);
            }
        }
        Ok(b)
    }

    /// Register `cfg.slots` buffers of `cfg.size` bytes.
    fn alloc(verbs: &dyn Verbs, cfg: EagerCfg) -> Result<Bounce> {
        let size = cfg.size as usize;
        let buf: Box<[std::cell::UnsafeCell<u8>]> = (0..(size * cfg.slots as usize).max(1))
            .map(|_| std::cell::UnsafeCell::new(0))
            .collect();
        let addr = std::cell::UnsafeCell::raw_get(buf.as_ptr()) as u64;
        // SAFETY: the boxed slice has a stable address and is owned by the receive side,
        // which deregisters it before freeing it.
        let mr = unsafe { verbs.reg_mr(addr, buf.len(), Access::LOCAL_WRITE)? };
        Ok(Bounce {
            buf,
            mr,
            size,
            slots: cfg.slots,
        })
    }

    fn post(&self, verbs: &dyn Verbs, qp: QpId, slot: usize) -> Result<()> {
        let sge = (self.size > 0).then(|| Sge {
            addr: self.mr.addr + (slot * self.size) as u64,
            len: self.size as u32,
            lkey: self.mr.lkey,
        });
        verbs.post_recv(
            qp,
            &RecvWr {
                wr_id: slot as u64,
                sge,
            },
        )
    }

    /// Start of buffer `slot` (a receive's data is valid once the receive completed).
    fn slot(&self, slot: usize) -> *mut u8 {
        std::cell::UnsafeCell::raw_get(self.buf[slot * self.size..].as_ptr())
    }
}

struct RoceListen {
    l: TcpListener,
    verbs: Arc<dyn Verbs>,
    pending: Vec<Accepting>,
    eager: EagerCfg,
}

impl ListenComm for RoceListen {
    fn accept(&mut self) -> Result<Option<Box<dyn RecvComm>>> {
        loop {
            match self.l.accept() {
                Ok((s, _)) => {
                    let mut side = Side::new(s)?;
                    side.expect(INFO);
                    self.pending.push(Accepting { side, qp: None });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(Error::sys("accept on the RoCE v2 setup listener", e)),
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            let a = &mut self.pending[i];
            let ready = match a.side.pump() {
                Ok(r) => r,
                Err(_) => {
                    if let Some(a) = self.pending.swap_remove(i).qp {
                        self.verbs.destroy_qp(a.qp);
                        let _ = self.verbs.dereg_mr(&a.bounce.mr);
                    }
                    continue;
                }
            };
            if !ready {
                i += 1;
                continue;
            }
            if a.qp.is_none() {
                let b: [u8; INFO] = a.side.inb[..INFO].try_into().unwrap();
                let (peer, fifo_addr, fifo_rkey, sender_eager) = decode_info(&b)?;
                same_provider(&b, &*self.verbs)?;
                let (qp, ep) = self.verbs.create_qp()?;
                // Receives are posted before the sender learns our endpoint: its first
                // message (eager, without a clear-to-send) always finds one.
                let cfg = self.eager;
                let bounce = match self
                    .verbs
                    .connect_qp(qp, &peer)
                    .and_then(|()| Bounce::new(&*self.verbs, qp, cfg))
                {
                    Ok(b) => b,
                    Err(e) => {
                        self.verbs.destroy_qp(qp);
                        return Err(e);
                    }
                };
                a.side
                    .queue(&encode_info(&ep, None, Some(cfg), self.verbs.hardware()));
                a.side.expect(1); // the sender's "ready"
                a.qp = Some(Accepted {
                    qp,
                    peer: peer.addr,
                    fifo_addr,
                    fifo_rkey,
                    bounce,
                    // The sender sends eagerly what fits both sides' limit.
                    eager: cfg.size.min(sender_eager.size) as usize,
                });
                i += 1;
                continue;
            }
            let a = self.pending.swap_remove(i);
            let Accepted {
                qp,
                peer,
                fifo_addr,
                fifo_rkey,
                bounce,
                eager,
            } = a.qp.expect("set above");
            let mut staging: Box<[Cts; CTS_SLOTS]> = Box::new([Cts::default(); CTS_SLOTS]);
            // SAFETY: boxed (stable address), owned by the receive comm, deregistered first.
            let smr = unsafe {
                self.verbs.reg_mr(
                    staging.as_mut_ptr() as u64,
                    CTS_SLOTS * CTS_BYTES,
                    Access::LOCAL_WRITE,
                )?
            };
            return Ok(Some(Box::new(RoceRecv {
                verbs: Arc::clone(&self.verbs),
                device_copy: None,
                qp,
                peer,
                live: Liveness::new(a.side.s, "RoCE v2"),
                fifo_addr,
                fifo_rkey,
                staging,
                staging_mr: smr,
                reqs: VecDeque::with_capacity(FIFO),
                base: 0,
                seq: 1,
                wcs: [EMPTY_WC; 16],
                failed: None,
                bounce,
                arrived: VecDeque::with_capacity(EAGER_SLOTS as usize),
                filling: 0,
                credits: 0,
                reported: 0,
                next_first: 0,
                eager,
                cache: RegCache::new(&*self.verbs),
                flusher: None,
            })));
        }
        Ok(None)
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(PollFd {
            fd: self.l.as_raw_fd(),
            events: libc::POLLIN,
        });
        for a in &self.pending {
            out.push(PollFd {
                fd: a.side.s.as_raw_fd(),
                events: libc::POLLIN,
            });
        }
    }
}

impl Drop for RoceListen {
    fn drop(&mut self) {
        for a in self.pending.drain(..) {
            if let Some(a) = a.qp {
                self.verbs.destroy_qp(a.qp);
                let _ = self.verbs.dereg_mr(&a.bounce.mr);
            }
        }
    }
}

const EMPTY_WC: Wc = Wc {
    wr_id: 0,
    status: WcStatus::Success,
    opcode: WcOpcode::Send,
    byte_len: 0,
    imm: None,
    qpn: 0,
};

fn wc_error(w: &Wc, side: &str, verbs: &dyn Verbs, peer: SocketAddr) -> Error {
    let hint = crate::rdma::hints::wc_hint(w.status, &verbs.name(), &peer.ip().to_string());
    let hint = if hint.is_empty() {
        String::new()
    } else {
        format!(": {hint}")
    };
    Error::sys(
        format!(
            "RoCE v2 {side}: work completion {:?} (status {}){hint}",
            w.status, w.status as u32
        ),
        std::io::Error::other("RDMA completion error"),
    )
}

#[derive(Clone, Copy)]
enum SendState {
    /// Not posted yet (waiting for a clear-to-send entry or a credit).
    Waiting,
    /// Posted; waiting for the completion (and the registration to release).
    Posted(Option<Mr>),
    /// Completed.
    Done,
}

struct SReq {
    addr: u64,
    len: usize,
    tag: u32,
    state: SendState,
    reaped: bool,
}

struct RoceSend {
    verbs: Arc<dyn Verbs>,
    /// Copies GPU memory into eager staging slots (set by the caller that posts GPU memory).
    device_copy: Option<super::DeviceCopy>,
    qp: QpId,
    /// The peer's address (its GID).
    peer: SocketAddr,
    live: Liveness,
    fifo_mr: Mr,
    fifo: Box<[Cts; CTS_SLOTS]>,
    reqs: VecDeque<SReq>,
    base: u64,
    /// Sequence number of the oldest clear-to-send slot that may still be needed.
    seq: u32,
    wcs: [Wc; 16],
    failed: Option<String>,
    /// Largest eager message (0: none).
    eager_size: usize,
    /// Where eager messages are copied before they leave (one buffer per receiver slot).
    staging: Bounce,
    /// The receiver's receive work requests (credits when nothing is consumed).
    slots: u32,
    /// Messages posted so far (wrapping): the number of the next message.
    sent: u32,
    /// Tags of the last messages, by message number modulo the ring's size.
    tags: [u32; TAG_RING],
    /// Receive work requests the receiver reposted so far (wrapping), from its clear-to-send.
    credits: u32,
    cache: RegCache,
}

/// Offset of [`Cts::seq_end`], the last field.
const CTS_END: usize = CTS_BYTES - 4;

/// Copy the clear-to-send entry at address `at`, which the peer may be writing meanwhile (an RDMA
/// write, placed by the provider or the NIC from its first byte to its last), through `read`
/// (the provider's `read_registered`). A seqlock read, as NCCL's net_ib reads its FIFO: the
/// end marker, a fence, the body, a fence, the start marker. The copy is whole when both
/// markers match: the end marker says the body before it was written; a start marker still
/// equal to it after the body says no newer write of the slot began meanwhile (front to back
/// instead, a body read while the writer passes through it looks whole once the writer has
/// written the end marker too).
fn read_cts(read: impl Fn(u64, &mut [u8]), at: u64) -> Cts {
    use std::sync::atomic::fence;
    let mut cts = Cts::default();
    let b = bytemuck::bytes_of_mut(&mut cts);
    read(at + CTS_END as u64, &mut b[CTS_END..]);
    fence(Ordering::Acquire);
    read(at + 4, &mut b[4..CTS_END]);
    fence(Ordering::Acquire);
    read(at, &mut b[..4]);
    cts
}

/// Tags remembered per send comm (a grouped receive spans at most MAX_RECVS messages).
const TAG_RING: usize = 64;

/// `a - b` as a signed distance between wrapping counters.
fn dist(a: u32, b: u32) -> i32 {
    a.wrapping_sub(b) as i32
}

impl RoceSend {
    fn progress(&mut self) -> Result<()> {
        super::refuse_if_failed(&self.failed, "RoCE v2 send comm")?;
        let r = self.progress_inner();
        super::remember_failure(&mut self.failed, r)
    }

    /// Address of the FIFO slot of sequence number `seq` (the peer writes it: no reference
    /// to it is made).
    fn slot_addr(&self, seq: u32) -> u64 {
        self.fifo.as_ptr() as u64 + ((seq as usize % CTS_SLOTS) * CTS_BYTES) as u64
    }

    /// Whether the receiver has a receive work request for one more message.
    fn has_credit(&self) -> bool {
        self.sent.wrapping_sub(self.credits) < self.slots
    }

    /// The clear-to-send entry of the receive that message `m` belongs to, once written,
    /// taking the credits of every entry read on the way. Entries of receives whose messages
    /// all went out already (eagerly) are passed over; the receiver may even have reused
    /// their slots (it cannot reuse the slot of a receive still waiting for data: it keeps
    /// at most FIFO receives unfinished).
    fn cts_for(&mut self, m: u32) -> Option<Cts> {
        loop {
            let slot = self.slot_addr(self.seq);
            // The provider writes the slot (remote RDMA) possibly from another thread: copy
            // it through the provider, and trust it only when the sequence number at both
            // ends matches (a slot still being written is retried on the next poll).
            let cts = read_cts(|a, b| self.verbs.read_registered(a, b), slot);
            if cts.seq != cts.seq_end {
                return None;
            }
            if cts.seq != self.seq {
                if dist(cts.seq, self.seq) > 0 {
                    self.seq = self.seq.wrapping_add(1).max(1); // reused: long done
                    continue;
                }
                return None; // not written yet
            }
            if dist(cts.credits, self.credits) > 0 {
                self.credits = cts.credits;
            }
            if cts.n == 0 || dist(m, cts.first) >= cts.n as i32 {
                // Credits only, or a receive whose messages all went out.
                self.seq = self.seq.wrapping_add(1).max(1);
                continue;
            }
            return Some(cts);
        }
    }

    /// Take the credits of every entry written so far, without consuming any: the freshest
    /// may sit behind the entry of a receive that later messages still need.
    fn refresh_credits(&mut self) {
        let mut seq = self.seq;
        for _ in 0..CTS_SLOTS {
            let slot = self.slot_addr(seq);
            let cts = read_cts(|a, b| self.verbs.read_registered(a, b), slot);
            if cts.seq != cts.seq_end || dist(cts.seq, seq) < 0 {
                return; // not written yet (or being written)
            }
            if dist(cts.credits, self.credits) > 0 {
                self.credits = cts.credits;
            }
            seq = cts.seq.wrapping_add(1).max(1);
        }
    }

    /// Index of the buffer of `cts` that message `m` (tag `tag`, `len` bytes) fills: as the
    /// receiver matches, the first buffer with that tag not taken by an earlier message of
    /// the same receive.
    fn buffer_for(&self, cts: &Cts, m: u32, tag: u32, len: usize) -> Result<usize> {
        let n = (cts.n as usize).min(MAX_RECVS);
        let pick =
            |used: u32, t: u32| (0..n).find(|&e| used & (1 << e) == 0 && cts.elems[e].tag == t);
        let mut used = 0u32;
        let mut k = cts.first;
        while k != m {
            if let Some(e) = pick(used, self.tags[k as usize % TAG_RING]) {
                used |= 1 << e;
            }
            k = k.wrapping_add(1);
        }
        let Some(e) = pick(used, tag) else {
            // The receiver's call is what its first buffer not yet taken says.
            let theirs = (0..n)
                .find(|&e| used & (1 << e) == 0)
                .map_or(0, |e| cts.elems[e].tag);
            return Err(crate::net::unexpected_tag(theirs));
        };
        let size = cts.elems[e].size as usize;
        if len > size {
            return Err(Error::InvalidUsage(format!(
                "sent {len} bytes but the receiver's buffer holds only {size} bytes (mismatched counts between sender and receiver?)"
            )));
        }
        Ok(e)
    }

    /// Post `wr` for request `i`; `done_now`: the data was copied (inline or staged), so the
    /// request completes at once.
    fn post(&mut self, i: usize, wr: SendWr, done_now: bool, mr: Option<Mr>) -> Result<()> {
        self.verbs.post_send(self.qp, &wr)?;
        self.tags[self.sent as usize % TAG_RING] = self.reqs[i].tag;
        self.sent = self.sent.wrapping_add(1);
        if done_now {
            if let Some(m) = mr {
                self.cache.release(&*self.verbs, &m);
            }
            self.reqs[i].state = SendState::Done;
        } else {
            self.reqs[i].state = SendState::Posted(mr);
        }
        Ok(())
    }

    fn progress_inner(&mut self) -> Result<()> {
        // Waiting for a clear-to-send, or for the completion of a posted write: a peer that
        // is gone answers neither (the engine retries until the deadline), so its closed
        // setup connection ends the wait.
        let waiting = self
            .reqs
            .iter()
            .any(|r| matches!(r.state, SendState::Waiting | SendState::Posted(_)));
        self.live.check(waiting, "send")?;
        let n = self.verbs.poll_cq(self.qp, &mut self.wcs)?;
        for w in &self.wcs[..n] {
            if w.status != WcStatus::Success {
                return Err(wc_error(w, "send", &*self.verbs, self.peer));
            }
            let idx = (w.wr_id - self.base) as usize;
            if let Some(r) = self.reqs.get_mut(idx) {
                if let SendState::Posted(Some(mr)) = r.state {
                    self.cache.release(&*self.verbs, &mr);
                }
                r.state = SendState::Done;
            }
        }
        // Post the waiting sends in order (the receiver matches messages by their order).
        while let Some(i) = self
            .reqs
            .iter()
            .position(|r| matches!(r.state, SendState::Waiting))
        {
            let (addr, len, tag) = (self.reqs[i].addr, self.reqs[i].len, self.reqs[i].tag);
            let m = self.sent;
            let eager = self.eager_size > 0 && len <= self.eager_size;
            // Rendezvous needs the clear-to-send entry; either kind needs a credit, which
            // clear-to-send entries bring.
            if !self.has_credit() {
                self.refresh_credits();
            }
            let cts = if eager && self.has_credit() {
                None
            } else {
                match self.cts_for(m) {
                    Some(c) => Some(c),
                    None if eager && self.has_credit() => None,
                    None => return Ok(()),
                }
            };
            if !self.has_credit() {
                self.refresh_credits();
                if !self.has_credit() {
                    return Ok(()); // a later entry brings credits
                }
            }
            // GPU memory is never read by the CPU (inline copies at post time).
            let inline =
                len <= self.verbs.qp_max_inline(self.qp) && !self.cache.is_device(addr, len);
            if eager {
                // Eager: copied to staging slot `m % slots`, sent into one of the receiver's
                // bounce buffers without a clear-to-send; complete for the caller at once
                // (an error still surfaces as an error completion of the QP).
                let slot = m as usize % self.slots as usize;
                let at = self.staging.slot(slot);
                if len > 0 && self.cache.is_device(addr, len) {
                    // GPU memory: the GPU copies it (the CPU may not reach it).
                    let copy = self.device_copy.as_ref().ok_or_else(no_device_copy)?;
                    copy(at as usize, addr as usize, len)?;
                } else if len > 0 {
                    // SAFETY: the isend contract keeps `addr..addr+len` readable; the staging
                    // slot holds eager_size >= len bytes and is ours (see `staging`).
                    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, at, len) };
                }
                let wr = SendWr {
                    wr_id: self.base + i as u64,
                    opcode: WrOpcode::SendImm,
                    sge: (len > 0).then_some(Sge {
                        addr: at as u64,
                        len: len as u32,
                        lkey: self.staging.mr.lkey,
                    }),
                    inline,
                    imm: tag,
                    remote_addr: 0,
                    rkey: 0,
                    signaled: false,
                };
                self.post(i, wr, true, None)?;
                continue;
            }
            // Small messages go inline: the provider copies them at post time, so the send
            // is complete for the caller at once (no wait for the acknowledgement; an error
            // still surfaces as an error completion).
            let mr = self.register(addr, len)?;
            let wr = {
                let cts = cts.expect("rendezvous has its entry");
                let checked = if dist(m, cts.first) < 0 {
                    // The receive of message `m` wrote no clear-to-send: all its buffers
                    // take eager messages only, i.e. they are smaller than this one.
                    Err(Error::InvalidUsage(format!(
                        "sent {len} bytes but the receiver's buffer holds only {} bytes at most (mismatched counts between sender and receiver?)",
                        self.eager_size
                    )))
                } else {
                    self.buffer_for(&cts, m, tag, len).and_then(|e| {
                        if cts.flags & CTS_EAGER_ONLY == 0 {
                            return Ok(e);
                        }
                        // Its buffers are no larger than the eager size, which this message
                        // exceeds: `buffer_for` refused it already.
                        Err(Error::InvalidUsage(format!(
                            "sent {len} bytes but the receiver's buffer holds only {} bytes, for eager messages (mismatched counts between sender and receiver?)",
                            cts.elems[e].size
                        )))
                    })
                };
                let e = match checked {
                    Ok(e) => e,
                    Err(err) => {
                        if let Some(m) = mr {
                            self.cache.release(&*self.verbs, &m);
                        }
                        return Err(err);
                    }
                };
                let el = cts.elems[e];
                let imm = if cts.n == 1 {
                    len as u32
                } else {
                    ((e as u32) << IMM_SIZE_BITS) | len as u32
                };
                SendWr {
                    wr_id: self.base + i as u64,
                    opcode: WrOpcode::WriteImm,
                    sge: sge(addr, len, mr),
                    inline,
                    imm,
                    remote_addr: el.addr,
                    rkey: el.rkey,
                    signaled: !inline,
                }
            };
            self.post(i, wr, inline, mr)?;
        }
        Ok(())
    }

    /// Register a send buffer (none when empty), through the cache.
    fn register(&mut self, addr: u64, len: usize) -> Result<Option<Mr>> {
        if len == 0 {
            return Ok(None);
        }
        // SAFETY: the isend contract keeps the buffer valid until completion; the
        // registration is released at completion (inline: right after the post).
        let m = unsafe {
            self.cache
                .acquire(&*self.verbs, addr, len, Access::default())?
        };
        Ok(Some(m))
    }
}

fn sge(addr: u64, len: usize, mr: Option<Mr>) -> Option<Sge> {
    mr.map(|m| Sge {
        addr,
        len: len as u32,
        lkey: m.lkey,
    })
}

/// An explicit registration (`regMr`, `regMrDmaBuf`), kept in `cache` until `dereg`.
fn reg_explicit(
    verbs: &dyn Verbs,
    cache: &mut RegCache,
    addr: usize,
    len: usize,
    device: bool,
    dmabuf: Option<(i32, u64)>,
) -> Result<MemHandle> {
    if len == 0 {
        return Err(Error::arg("registering 0 bytes"));
    }
    // Remote read too: receive buffers in GPU memory are flushed by reading them.
    let access = Access::ALL;
    // SAFETY: the registration contract (regMr): the memory, or the dmabuf, stays valid
    // until `dereg_mr`, which the plugin's user calls before freeing it.
    let mr = unsafe {
        match dmabuf {
            Some((fd, offset)) => verbs.reg_dmabuf(fd, offset, len, addr as u64, access)?,
            None => verbs.reg_mr(addr as u64, len, access)?,
        }
    };
    cache.pin(Pinned { mr, access, device });
    Ok(MemHandle {
        addr,
        len,
        key: mr.lkey as u64,
    })
}

/// An eager message met GPU memory on a connection nobody told how to copy it.
fn no_device_copy() -> Error {
    Error::InvalidUsage(
        "an eager message met GPU memory, but this RoCE v2 connection has no way to copy GPU memory (it was set up for host memory): announce GPU buffers before connecting (Net::expect_device_buffers), or set a device copy"
            .into(),
    )
}

impl SendComm for RoceSend {
    fn abandon(&mut self) {
        // Closing after a failure or an abort: no drain (the peer may be the failure).
        self.failed
            .get_or_insert_with(|| "closed after a failure or an abort".into());
    }

    fn reg_mr(&mut self, addr: usize, len: usize) -> Result<MemHandle> {
        reg_explicit(&*self.verbs, &mut self.cache, addr, len, false, None)
    }

    fn reg_mr_device(
        &mut self,
        addr: usize,
        len: usize,
        dmabuf: Option<(i32, u64)>,
    ) -> Result<MemHandle> {
        reg_explicit(&*self.verbs, &mut self.cache, addr, len, true, dmabuf)
    }

    fn dereg_mr(&mut self, mr: MemHandle) -> Result<()> {
        self.cache.unpin(&*self.verbs, mr.key as u32)
    }

    fn set_device_copy(&mut self, copy: super::DeviceCopy) {
        self.device_copy = Some(copy);
    }

    unsafe fn isend(
        &mut self,
        data: *const u8,
        len: usize,
        tag: u32,
        _mr: Option<&MemHandle>,
    ) -> Result<Option<ReqId>> {
        self.progress()?;
        if self.reqs.len() >= FIFO {
            return Ok(None);
        }
        // A grouped receive's immediate carries the size in its low 29 bits: 2^29 itself
        // would spill into the buffer index.
        if len >= 1 << IMM_SIZE_BITS {
            return Err(Error::arg(format!(
                "RoCE v2 message of {len} bytes exceeds the limit of one message, 512 MiB less one byte"
            )));
        }
        let id = self.base + self.reqs.len() as u64;
        self.reqs.push_back(SReq {
            addr: data as u64,
            len,
            tag,
            state: SendState::Waiting,
            reaped: false,
        });
        self.progress()?;
        Ok(Some(ReqId(id as u32)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>> {
        self.progress()?;
        let r = super::pending_request(&mut self.reqs, self.base, req, |r| r.reaped, "send")?;
        if !matches!(r.state, SendState::Done) {
            return Ok(None);
        }
        r.reaped = true;
        let len = r.len;
        super::pop_reaped(&mut self.reqs, &mut self.base, |r| r.reaped);
        Ok(Some(len))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        self.verbs.qp_fds(self.qp, out);
        out.push(PollFd {
            fd: self.live.side.as_raw_fd(),
            events: libc::POLLIN,
        });
    }
}

/// `wr_id` of the marker a closing send comm posts (requests count up from 0).
const DRAIN_MARK: u64 = u64::MAX;

/// Wait until everything posted on `qp` so far has been acknowledged by the peer: RC
/// completes in order, so a signaled zero-length RDMA WRITE (which touches no memory and
/// needs no rkey) posted after it completes only then. Eager and inline sends were reported
/// done when posted, and the staging memory they are sent from is freed with the comm: a
/// destroy right after the last call would otherwise lose them. Ends early when the QP
/// fails, when the peer's process is gone, or after the provider's drain limit.
fn drain_sends(verbs: &dyn Verbs, qp: QpId, live: &mut Liveness) {
    // Nothing unacknowledged (the userspace engine can tell): no marker, no wait — a peer
    // that already left would otherwise hold the close up until it is seen gone.
    if verbs.qp_state(qp).ok() != Some(crate::rdma::verbs::QpState::Rts)
        || verbs.sends_acknowledged(qp)
    {
        return;
    }
    let mark = SendWr {
        wr_id: DRAIN_MARK,
        opcode: WrOpcode::Write,
        sge: None,
        inline: false,
        imm: 0,
        remote_addr: 0,
        rkey: 0,
        signaled: true,
    };
    if verbs.post_send(qp, &mark).is_err() {
        return;
    }
    let (start, limit) = (std::time::Instant::now(), verbs.drain_limit());
    let mut wcs = [EMPTY_WC; 16];
    let mut fds = Vec::new();
    loop {
        let Ok(n) = verbs.poll_cq(qp, &mut wcs) else {
            return;
        };
        if wcs[..n]
            .iter()
            .any(|w| w.wr_id == DRAIN_MARK || w.status != WcStatus::Success)
        {
            return;
        }
        if start.elapsed() >= limit || live.check(true, "close").is_err() {
            crate::info!("RoCE v2 send comm: closed before the peer acknowledged everything sent (peer gone or {limit:?} passed)");
            return;
        }
        fds.clear();
        verbs.qp_fds(qp, &mut fds);
        let mut p: arrayvec::ArrayVec<libc::pollfd, 8> = fds
            .iter()
            .take(8)
            .map(|f| libc::pollfd {
                fd: f.fd,
                events: f.events,
                revents: 0,
            })
            .collect();
        // SAFETY: `p` is a valid array of pollfd for the duration of the call.
        unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, 1) };
    }
}

impl Drop for RoceSend {
    fn drop(&mut self) {
        // A failed comm has nothing worth waiting for (its peer may be the failure).
        if self.failed.is_none() {
            drain_sends(&*self.verbs, self.qp, &mut self.live);
        }
        self.verbs.destroy_qp(self.qp);
        for r in &self.reqs {
            if let SendState::Posted(Some(mr)) = r.state {
                self.cache.release(&*self.verbs, &mr);
            }
        }
        self.cache.clear(&*self.verbs);
        let _ = self.verbs.dereg_mr(&self.fifo_mr);
        let _ = self.verbs.dereg_mr(&self.staging.mr);
    }
}

struct RReq {
    g: RecvGroup,
    mrs: [Option<Mr>; MAX_RECVS],
    reaped: bool,
    /// Its clear-to-send entry, kept for a receive whose buffers take eager messages only
    /// until it describes itself to the sender ([`CTS_EAGER_ONLY`]).
    eager_only: Option<(std::time::Instant, Cts)>,
    /// It did so.
    announced: bool,
}

/// A message that arrived, in arrival (= send) order, not yet matched to a receive.
#[derive(Clone, Copy)]
enum Arrival {
    /// In bounce buffer `slot`.
    Eager { slot: usize, tag: u32, len: usize },
    /// Written into the buffer of a clear-to-send entry; the immediate says which and how much.
    Written { imm: u32 },
}

struct RoceRecv {
    verbs: Arc<dyn Verbs>,
    /// Copies eager messages out of bounce buffers into GPU memory.
    device_copy: Option<super::DeviceCopy>,
    qp: QpId,
    /// The peer's address (its GID).
    peer: SocketAddr,
    live: Liveness,
    fifo_addr: u64,
    fifo_rkey: u32,
    staging: Box<[Cts; CTS_SLOTS]>,
    staging_mr: Mr,
    reqs: VecDeque<RReq>,
    base: u64,
    seq: u32,
    wcs: [Wc; 16],
    failed: Option<String>,
    bounce: Bounce,
    arrived: VecDeque<Arrival>,
    /// Request id of the receive the next arriving message belongs to.
    filling: u64,
    /// Receive work requests posted again so far (wrapping).
    credits: u32,
    /// Credits last sent to the sender.
    reported: u32,
    /// Number (wrapping) of the first message of the next receive.
    next_first: u32,
    /// Messages up to this size come eagerly (0: none).
    eager: usize,
    cache: RegCache,
    /// For flushes of GPU memory, made at the first one.
    flusher: Option<Flusher>,
}

impl RoceRecv {
    fn progress(&mut self) -> Result<()> {
        super::refuse_if_failed(&self.failed, "RoCE v2 receive comm")?;
        let r = self.progress_inner();
        super::remember_failure(&mut self.failed, r)
    }

    fn repost(&mut self, slot: usize) -> Result<()> {
        self.bounce.post(&*self.verbs, self.qp, slot)?;
        self.credits = self.credits.wrapping_add(1);
        Ok(())
    }

    /// RDMA-write `cts` (with our sequence number, credits and next message number) into the
    /// sender's FIFO.
    fn write_entry(&mut self, mut cts: Cts) -> Result<()> {
        cts.seq = self.seq;
        cts.seq_end = self.seq;
        cts.credits = self.credits;
        self.reported = self.credits;
        let slot = (self.seq as usize) % CTS_SLOTS;
        self.staging[slot] = cts;
        let wr = SendWr {
            wr_id: u64::MAX,
            opcode: WrOpcode::Write,
            sge: Some(Sge {
                addr: &self.staging[slot] as *const Cts as u64,
                len: CTS_BYTES as u32,
                lkey: self.staging_mr.lkey,
            }),
            inline: CTS_BYTES <= self.verbs.qp_max_inline(self.qp),
            imm: 0,
            remote_addr: self.fifo_addr + (slot * CTS_BYTES) as u64,
            rkey: self.fifo_rkey,
            signaled: false,
        };
        self.verbs.post_send(self.qp, &wr)?;
        self.seq = self.seq.wrapping_add(1).max(1);
        Ok(())
    }

    /// Tell the sender about freed receive buffers once a quarter of them piled up (receives
    /// with a clear-to-send carry credits anyway; eager-only ones do not).
    fn report_credits(&mut self) -> Result<()> {
        if self.credits.wrapping_sub(self.reported) >= self.bounce.slots / 4 {
            let first = self.next_first;
            self.write_entry(Cts {
                n: 0,
                first,
                ..Cts::default()
            })?;
        }
        Ok(())
    }

    fn progress_inner(&mut self) -> Result<()> {
        let n = self.verbs.poll_cq(self.qp, &mut self.wcs)?;
        for k in 0..n {
            let w = self.wcs[k];
            if w.status != WcStatus::Success {
                return Err(wc_error(&w, "receive", &*self.verbs, self.peer));
            }
            let slot = w.wr_id as usize;
            match w.opcode {
                WcOpcode::Recv => self.arrived.push_back(Arrival::Eager {
                    slot,
                    tag: w.imm.unwrap_or(0),
                    len: w.byte_len as usize,
                }),
                WcOpcode::RecvRdmaWithImm => {
                    // The data is in place: the receive (and its bounce buffer) is free again.
                    self.repost(slot)?;
                    self.arrived.push_back(Arrival::Written {
                        imm: w.imm.unwrap_or(0),
                    });
                }
                _ => {} // our clear-to-send writes are unsignaled; nothing else expected
            }
        }
        self.match_arrivals()?;
        self.announce_eager_only()?;
        self.report_credits()?;
        let waiting = self.reqs.iter().any(|r| !r.g.done());
        self.live.check(waiting, "receive").map_err(|e| {
            let idx = (self.filling - self.base) as usize;
            match (self.reqs.get(idx), e) {
                (Some(r), Error::System { what, source }) if r.announced => {
                    let n: usize = r.g.bufs[..r.g.len()].iter().map(|b| b.1).sum();
                    Error::System {
                        what: format!("{what}; the receive it was to fill holds only {n} bytes, for eager messages: a larger message fails at the sender (mismatched counts between sender and receiver?)"),
                        source,
                    }
                }
                (_, e) => e,
            }
        })
    }

    /// Describe the receive the next message belongs to to the sender, once, if its buffers
    /// take eager messages only and it has waited [`ANNOUNCE_AFTER`]: a sender with a
    /// message too large for them waits for a clear-to-send and would otherwise never learn
    /// of the mismatch.
    fn announce_eager_only(&mut self) -> Result<()> {
        let idx = (self.filling - self.base) as usize;
        let Some(r) = self.reqs.get_mut(idx) else {
            return Ok(());
        };
        match r.eager_only {
            Some((posted, cts)) if posted.elapsed() >= ANNOUNCE_AFTER => {
                r.eager_only = None;
                r.announced = true;
                self.write_entry(Cts {
                    flags: CTS_EAGER_ONLY,
                    ..cts
                })
            }
            _ => Ok(()),
        }
    }

    /// Give arrived messages, in order, to the receives they belong to: the sender fills the
    /// buffers of each receive in turn, so the next message belongs to the oldest receive
    /// not yet filled (an eager message that comes before its receive waits in its bounce
    /// buffer).
    fn match_arrivals(&mut self) -> Result<()> {
        while let Some(&a) = self.arrived.front() {
            let idx = (self.filling - self.base) as usize;
            let Some(r) = self.reqs.get_mut(idx) else {
                if let Arrival::Written { .. } = a {
                    return Err(Error::Internal(
                        "RoCE v2 receive: data was written for a receive that was never posted"
                            .into(),
                    ));
                }
                return Ok(());
            };
            let complete = match a {
                Arrival::Eager { slot, tag, len } => {
                    let e = r.g.buffer_for(tag, len)?;
                    let addr = r.g.bufs[e].0;
                    if len > 0 && self.cache.is_device(addr as u64, len) {
                        // Into GPU memory: the GPU copies it.
                        let copy = self.device_copy.as_ref().ok_or_else(no_device_copy)?;
                        copy(addr, self.bounce.slot(slot) as usize, len)?;
                    } else if len > 0 {
                        // SAFETY: the irecv contract keeps the buffer valid (and writable for
                        // `size >= len` bytes) until the receive completes; the bounce buffer
                        // holds `len <= bounce.size` bytes, complete since its receive
                        // completed (the provider wrote them before reporting it).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                self.bounce.slot(slot),
                                addr as *mut u8,
                                len,
                            )
                        };
                    }
                    let complete = r.g.fill(e, len)?;
                    self.arrived.pop_front();
                    self.repost(slot)?;
                    complete
                }
                Arrival::Written { imm } => {
                    let (e, len) = written(&r.g, imm, self.peer)?;
                    let complete = r.g.fill(e, len)?;
                    self.arrived.pop_front();
                    complete
                }
            };
            let r = &mut self.reqs[idx];
            if complete {
                for m in r.mrs.iter_mut().filter_map(Option::take) {
                    self.cache.release(&*self.verbs, &m);
                }
                self.filling += 1;
            }
        }
        Ok(())
    }
}

/// A QP connected to itself and a scratch buffer: reads of received GPU memory through it
/// complete only after the NIC's earlier writes to that memory (`iflush`).
struct Flusher {
    qp: QpId,
    scratch: Box<[u8; 64]>,
    mr: Mr,
    /// Id of the next flush.
    next: u64,
    /// Flushes in flight, oldest first: (id, reads not yet completed).
    pending: VecDeque<(u64, usize)>,
    /// Reads in flight over all of them (bounded by [`FLUSH_READS`]).
    reads: usize,
}

/// Most flush reads in flight on the loopback QP (NCCL keeps at most 8 receives per
/// connection, each of up to `MAX_RECVS` buffers).
const FLUSH_READS: usize = 8 * MAX_RECVS;

impl RoceRecv {
    fn flusher(&mut self) -> Result<&mut Flusher> {
        if self.flusher.is_none() {
            let (qp, ep) = self.verbs.create_qp()?;
            if let Err(e) = self.verbs.connect_qp(qp, &ep) {
                self.verbs.destroy_qp(qp);
                return Err(e);
            }
            let mut scratch = Box::new([0u8; 64]);
            // SAFETY: boxed (stable address), owned by this comm, deregistered in Drop
            // before it is freed.
            let mr = unsafe {
                self.verbs
                    .reg_mr(scratch.as_mut_ptr() as u64, 64, Access::LOCAL_WRITE)
            };
            let mr = match mr {
                Ok(m) => m,
                Err(e) => {
                    self.verbs.destroy_qp(qp);
                    return Err(e);
                }
            };
            self.flusher = Some(Flusher {
                qp,
                scratch,
                mr,
                next: 1,
                pending: VecDeque::with_capacity(FLUSH_READS),
                reads: 0,
            });
        }
        Ok(self.flusher.as_mut().expect("set above"))
    }

    /// Take the loopback QP's completions: each finished read counts down its flush.
    fn reap_flushes(&mut self) -> Result<()> {
        let Some(f) = self.flusher.as_mut() else {
            return Ok(());
        };
        let mut wcs = [EMPTY_WC; MAX_RECVS];
        loop {
            let n = self.verbs.poll_cq(f.qp, &mut wcs)?;
            for wc in &wcs[..n] {
                if wc.status != WcStatus::Success {
                    return Err(Error::sys(
                        "flushing received GPU memory (RDMA read through a loopback QP)",
                        std::io::Error::other(format!("completion status {:?}", wc.status)),
                    ));
                }
                let Some(front) = f.pending.front_mut().filter(|p| p.0 == wc.wr_id) else {
                    return Err(Error::Internal(format!(
                        "flush read {} completed out of order",
                        wc.wr_id
                    )));
                };
                front.1 -= 1;
                f.reads -= 1;
                if front.1 == 0 {
                    f.pending.pop_front();
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    /// Post a 1-byte read of each buffer in GPU memory through the NIC; the id to test.
    fn iflush_device(&mut self, bufs: &[RecvBuf]) -> Result<Option<u64>> {
        let device = |c: &RegCache, b: &RecvBuf| {
            c.pinned_for(b.ptr as u64, b.len.max(1), Access::default())
                .filter(|p| p.device && b.len > 0)
        };
        let targets: [Option<(u64, u32)>; MAX_RECVS] = std::array::from_fn(|i| {
            bufs.get(i)
                .and_then(|b| device(&self.cache, b).map(|p| (b.ptr as u64, p.mr.rkey)))
        });
        let count = targets.iter().flatten().count();
        if count == 0 {
            return Ok(None);
        }
        // Room on the loopback QP: wait for older flushes if NCCL ran far ahead.
        self.flusher()?;
        let t0 = std::time::Instant::now();
        let limit = self.verbs.drain_limit(); // the deadline the provider was told
        while self
            .flusher
            .as_ref()
            .is_some_and(|f| f.reads + count > FLUSH_READS)
        {
            self.reap_flushes()?;
            if t0.elapsed() > limit {
                return Err(Error::Timeout(format!(
                    "flushing received GPU memory took over {limit:.0?}: the NIC did not complete reads on its loopback QP"
                )));
            }
            std::thread::yield_now();
        }
        let verbs = Arc::clone(&self.verbs);
        let f = self.flusher()?;
        let (qp, lkey, at, id) = (f.qp, f.mr.lkey, f.scratch.as_ptr() as u64, f.next);
        f.next += 1;
        // Counted as posted before the posts: a failed post fails the comm (and its flusher).
        f.pending.push_back((id, count));
        f.reads += count;
        for (i, &(addr, rkey)) in targets.iter().flatten().enumerate() {
            verbs.post_send(
                qp,
                &SendWr {
                    wr_id: id,
                    opcode: WrOpcode::Read,
                    sge: Some(Sge {
                        addr: at + i as u64,
                        len: 1,
                        lkey,
                    }),
                    inline: false,
                    imm: 0,
                    remote_addr: addr,
                    rkey,
                    signaled: true,
                },
            )?;
        }
        Ok(Some(id))
    }

    /// Whether flush `id` completed: flushes before the oldest one in flight have.
    fn flush_done(&mut self, id: u64) -> Result<bool> {
        self.reap_flushes()?;
        Ok(self
            .flusher
            .as_ref()
            .and_then(|f| f.pending.front())
            .map_or(true, |p| p.0 > id))
    }

    /// After a failed flush: reads may still be outstanding on the loopback QP, so a later
    /// flush would count their completions as its own. Start over with a new one.
    fn drop_flusher(&mut self) {
        if let Some(f) = self.flusher.take() {
            self.verbs.destroy_qp(f.qp);
            let _ = self.verbs.dereg_mr(&f.mr);
        }
    }
}

impl RecvComm for RoceRecv {
    fn reg_mr(&mut self, addr: usize, len: usize) -> Result<MemHandle> {
        reg_explicit(&*self.verbs, &mut self.cache, addr, len, false, None)
    }

    fn reg_mr_device(
        &mut self,
        addr: usize,
        len: usize,
        dmabuf: Option<(i32, u64)>,
    ) -> Result<MemHandle> {
        reg_explicit(&*self.verbs, &mut self.cache, addr, len, true, dmabuf)
    }

    fn dereg_mr(&mut self, mr: MemHandle) -> Result<()> {
        self.cache.unpin(&*self.verbs, mr.key as u32)
    }

    fn set_device_copy(&mut self, copy: super::DeviceCopy) {
        self.device_copy = Some(copy);
    }

    fn iflush(&mut self, bufs: &[RecvBuf]) -> Result<Option<u64>> {
        self.progress()?;
        let r = self.iflush_device(bufs);
        if r.is_err() {
            self.drop_flusher();
        }
        super::remember_failure(&mut self.failed, r)
    }

    fn test_flush(&mut self, id: u64) -> Result<bool> {
        super::refuse_if_failed(&self.failed, "RoCE v2 receive comm")?;
        if id == 0 || self.flusher.as_ref().map_or(true, |f| id >= f.next) {
            return Err(Error::InvalidUsage(format!("test on unknown flush {id}")));
        }
        let r = self.flush_done(id);
        if r.is_err() {
            self.drop_flusher();
        }
        super::remember_failure(&mut self.failed, r)
    }

    unsafe fn irecv(&mut self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        self.progress()?;
        let g = RecvGroup::new(bufs)?;
        if self.reqs.len() >= FIFO {
            return Ok(None);
        }
        let id = self.base + self.reqs.len() as u64;
        let mut r = RReq {
            g,
            mrs: [None; MAX_RECVS],
            reaped: false,
            eager_only: None,
            announced: false,
        };
        let mut cts = Cts {
            n: bufs.len() as u32,
            first: self.next_first,
            ..Cts::default()
        };
        // Buffers that only eager messages can fill (all of them no larger than the eager
        // size) need no clear-to-send: the sender sends those messages without one.
        let eager_only = self.eager > 0 && bufs.iter().all(|b| b.len <= self.eager);
        for (i, b) in bufs.iter().enumerate() {
            let (addr, rkey) = if b.len > 0 && !eager_only {
                // SAFETY: the irecv contract keeps the buffer valid until completion; the
                // registration is released when the data has arrived.
                let m = unsafe {
                    self.cache.acquire(
                        &*self.verbs,
                        b.ptr as u64,
                        b.len,
                        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                    )
                };
                let m = match m {
                    Ok(m) => m,
                    Err(e) => {
                        for m in r.mrs.iter_mut().filter_map(Option::take) {
                            self.cache.release(&*self.verbs, &m);
                        }
                        return Err(e);
                    }
                };
                r.mrs[i] = Some(m);
                (b.ptr as u64, m.rkey)
            } else {
                (0, 0)
            };
            cts.elems[i] = CtsElem {
                addr,
                size: b.len.min(u32::MAX as usize) as u32,
                rkey,
                tag: b.tag,
                _pad: 0,
            };
        }
        if eager_only {
            r.eager_only = Some((std::time::Instant::now(), cts));
        }
        self.next_first = self.next_first.wrapping_add(bufs.len() as u32);
        self.reqs.push_back(r);
        // Eager messages that came first land now (and free their bounce buffers, which the
        // credits then report).
        self.match_arrivals()?;
        if eager_only {
            self.report_credits()?;
        } else {
            self.write_entry(cts)?;
        }
        Ok(Some(ReqId(id as u32)))
    }

    fn test(&mut self, req: ReqId, sizes: &mut [usize]) -> Result<bool> {
        self.progress()?;
        let r = super::pending_request(&mut self.reqs, self.base, req, |r| r.reaped, "receive")?;
        if !r.g.done() {
            return Ok(false);
        }
        for (d, s) in sizes.iter_mut().zip(r.g.sizes()) {
            *d = *s;
        }
        r.reaped = true;
        super::pop_reaped(&mut self.reqs, &mut self.base, |r| r.reaped);
        Ok(true)
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        self.verbs.qp_fds(self.qp, out);
        out.push(PollFd {
            fd: self.live.side.as_raw_fd(),
            events: libc::POLLIN,
        });
    }
}

impl Drop for RoceRecv {
    fn drop(&mut self) {
        self.verbs.destroy_qp(self.qp);
        if let Some(f) = self.flusher.take() {
            self.verbs.destroy_qp(f.qp);
            let _ = self.verbs.dereg_mr(&f.mr);
        }
        for r in &mut self.reqs {
            for m in r.mrs.iter_mut().filter_map(Option::take) {
                self.cache.release(&*self.verbs, &m);
            }
        }
        self.cache.clear(&*self.verbs);
        let _ = self.verbs.dereg_mr(&self.staging_mr);
        let _ = self.verbs.dereg_mr(&self.bounce.mr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn pair(net: &RoceNet) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
        crate::net::connect_pair(net)
    }

    /// Post the receive `rb` and a send of `len` bytes at `src` (registered as `mh`, if
    /// given), and drive both to completion; the size received.
    ///
    /// # Safety
    /// `src` is readable for `len` bytes and `rb`'s buffer writable until this returns.
    unsafe fn transfer(
        s: &mut dyn SendComm,
        r: &mut dyn RecvComm,
        src: *const u8,
        len: usize,
        tag: u32,
        mh: Option<&MemHandle>,
        rb: &RecvBuf,
    ) -> Result<usize> {
        // SAFETY: the caller's contract; both requests complete before this returns.
        let (rq, sq) = unsafe {
            let rq = r.irecv(std::slice::from_ref(rb))?.unwrap();
            (rq, s.isend(src, len, tag, mh)?.unwrap())
        };
        let (mut sd, mut rd, mut size) = (false, false, [0usize]);
        let t0 = std::time::Instant::now();
        while !(sd && rd) {
            assert!(t0.elapsed().as_secs() < 10, "exchange stalled");
            sd = sd || s.test(sq)?.is_some();
            rd = rd || r.test(rq, &mut size)?;
        }
        Ok(size[0])
    }

    fn exchange(
        s: &mut dyn SendComm,
        r: &mut dyn RecvComm,
        data: &[u8],
        cap: usize,
        tag: u32,
    ) -> Result<(Vec<u8>, usize)> {
        let mut buf = vec![0u8; cap];
        let rb = RecvBuf {
            ptr: buf.as_mut_ptr(),
            len: cap,
            tag: 1,
        };
        // SAFETY: `buf` and `data` outlive the call.
        let n = unsafe { transfer(s, r, data.as_ptr(), data.len(), tag, None, &rb)? };
        Ok((buf, n))
    }

    /// Item 11 of issue 19: an eager send is done for the caller once posted; a send comm
    /// destroyed right after must still deliver it, here through a link that loses
    /// everything until after the destroy began.
    #[test]
    fn an_eager_send_survives_the_destroy_that_follows_it() {
        use crate::rdma::udp::Faults;
        let lo = Ipv4Addr::LOCALHOST.into();
        let verbs = Arc::new(UserVerbs::with(lo, 0, None).unwrap());
        let net = RoceNet::over(verbs.clone(), lo);
        let (mut s, mut r) = pair(&net);
        // Eager (at most 16 KiB) and not inline (over 256 B): sent from the comm's staging.
        let data = vec![7u8; 1000];
        let mut buf = vec![0u8; 1000];
        let rb = RecvBuf {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            tag: 1,
        };
        // SAFETY: `buf` outlives the receive (tested to completion below).
        let rq = unsafe { r.irecv(std::slice::from_ref(&rb)) }
            .unwrap()
            .unwrap();
        verbs.set_faults(Some(Faults {
            drop: 1.0,
            seed: 1,
            ..Faults::default()
        }));
        // SAFETY: `data` outlives the send.
        let sq = unsafe { s.isend(data.as_ptr(), data.len(), 1, None) }
            .unwrap()
            .unwrap();
        assert!(
            s.test(sq).unwrap().is_some(),
            "an eager send is done at once"
        );
        let healer = {
            let v = verbs.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(100));
                v.set_faults(None);
            })
        };
        drop(s);
        healer.join().unwrap();
        let mut size = [0usize];
        let t0 = std::time::Instant::now();
        loop {
            match r.test(rq, &mut size) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => panic!("the message sent before the destroy was lost: {e}"),
            }
            assert!(
                t0.elapsed().as_secs() < 10,
                "the message sent before the destroy never arrived"
            );
        }
        assert_eq!((size[0], &buf), (1000, &data));
    }

    #[test]
    fn messages_of_every_size() {
        let net = RoceNet::over(
            Arc::new(UserVerbs::with(Ipv4Addr::LOCALHOST.into(), 0, None).unwrap()),
            Ipv4Addr::LOCALHOST.into(),
        );
        let (mut s, mut r) = pair(&net);
        for len in [0usize, 1, 4, 4095, 4096, 4097, 100_000, 1 << 20] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let (buf, got) = exchange(&mut *s, &mut *r, &data, len + 3, 1)
                .unwrap_or_else(|e| panic!("{len} bytes: {e}"));
            assert_eq!(got, len);
            assert_eq!(&buf[..len], &data[..]);
        }
        // A grouped receive: three buffers matched by tag, sent in another order.
        let (a, b, c) = (vec![1u8; 10], vec![2u8; 70_000], vec![3u8; 0]);
        let (mut ba, mut bb, mut bc) = (vec![0u8; 10], vec![0u8; 70_000], vec![9u8; 4]);
        let group = [
            RecvBuf {
                ptr: bc.as_mut_ptr(),
                len: 4,
                tag: 30,
            },
            RecvBuf {
                ptr: ba.as_mut_ptr(),
                len: 10,
                tag: 10,
            },
            RecvBuf {
                ptr: bb.as_mut_ptr(),
                len: 70_000,
                tag: 20,
            },
        ];
        // SAFETY: every buffer outlives the loop below, which completes all requests.
        let (rq, sq) = unsafe {
            let rq = r.irecv(&group).unwrap().unwrap();
            let sq = [
                s.isend(b.as_ptr(), b.len(), 20, None).unwrap().unwrap(),
                s.isend(c.as_ptr(), 0, 30, None).unwrap().unwrap(),
                s.isend(a.as_ptr(), a.len(), 10, None).unwrap().unwrap(),
            ];
            (rq, sq)
        };
        let mut sizes = [0usize; 3];
        let mut done = [false; 3];
        while !done.iter().all(|d| *d) || !r.test(rq, &mut sizes).unwrap() {
            for (d, q) in done.iter_mut().zip(sq) {
                *d = *d || s.test(q).unwrap().is_some();
            }
        }
        assert_eq!(sizes, [0, 10, 70_000]);
        assert_eq!((ba, bb, bc), (a, b, vec![9u8; 4]));
        // Larger than the posted buffer, or an unknown tag: errors, not corruption.
        let e = exchange(&mut *s, &mut *r, &[1u8; 100], 10, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds only 10"), "{e}");
    }

    /// Hundreds of messages, eager and rendezvous mixed, up to FIFO in flight, with the
    /// receiver posting its receives late (eager messages wait in bounce buffers, and their
    /// clear-to-send slots are reused before the sender reads them): every byte arrives in
    /// order and nothing stalls.
    #[test]
    fn eager_and_rendezvous_mixed_with_a_late_receiver() {
        let net = RoceNet::userspace(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        let (mut s, mut r) = pair(&net);
        let sizes: Vec<usize> = (0..400)
            .map(|i| match i % 7 {
                0 => 0,
                1 => 8,
                2 => 4096,
                3 => 4097,
                4 => 300,
                5 => 70_000,
                _ => 1 + (i * 37) % 9000,
            })
            .collect();
        let data: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|k| (i * 131 + k * 7) as u8).collect())
            .collect();
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let (mut next_s, mut next_r) = (0usize, 0usize);
        let mut sq: VecDeque<(usize, ReqId)> = VecDeque::new();
        let mut rq: VecDeque<(usize, ReqId)> = VecDeque::new();
        let mut done = 0usize;
        let start = std::time::Instant::now();
        while done < sizes.len() || !sq.is_empty() {
            assert!(
                start.elapsed().as_secs() < 60,
                "stalled: sent {next_s}, received {done}"
            );
            // The sender runs ahead; the receiver posts only while it lags by 40+ messages,
            // the sender is blocked, or at the end, so eager messages arrive before their
            // receives.
            while next_s < sizes.len() && sq.len() < FIFO {
                // SAFETY: `data` outlives every request.
                match unsafe { s.isend(data[next_s].as_ptr(), sizes[next_s], 5, None) }.unwrap() {
                    Some(q) => {
                        sq.push_back((next_s, q));
                        next_s += 1;
                    }
                    None => break,
                }
            }
            while let Some(&(_, q)) = sq.front() {
                if s.test(q).unwrap().is_none() {
                    break;
                }
                sq.pop_front();
            }
            let blocked = sq.len() >= FIFO;
            let lagging = next_s >= next_r + 40 || next_s == sizes.len() || blocked;
            while lagging && next_r < sizes.len() && rq.len() < FIFO {
                let b = RecvBuf {
                    ptr: bufs[next_r].as_mut_ptr(),
                    len: sizes[next_r],
                    tag: 5,
                };
                // SAFETY: `bufs` outlives every request and is not touched until it completes.
                match unsafe { r.irecv(&[b]) }.unwrap() {
                    Some(q) => {
                        rq.push_back((next_r, q));
                        next_r += 1;
                    }
                    None => break,
                }
            }
            while let Some(&(i, q)) = rq.front() {
                let mut got = [0usize];
                if !r.test(q, &mut got).unwrap() {
                    break;
                }
                assert_eq!(got[0], sizes[i], "message {i}");
                rq.pop_front();
                done += 1;
            }
        }
        for (i, (b, d)) in bufs.iter().zip(&data).enumerate() {
            assert!(b == d, "message {i} ({} bytes) arrived corrupted", d.len());
        }
    }

    /// The clear-to-send FIFO read against a writer that rewrites one slot over and over,
    /// as an RDMA write lands: start marker first, the body's bytes in a random order, the
    /// end marker last (each phase ordered by a fence, as the NIC's in-order placement
    /// does). Every field of entry `k` is derived from `k`, so an entry that mixes two writes
    /// is seen; no such entry may ever be accepted (both markers equal).
    #[test]
    fn a_clear_to_send_entry_being_written_is_never_accepted_torn() {
        use std::sync::atomic::{fence, AtomicBool, AtomicU8};
        let mem: Arc<Vec<AtomicU8>> = Arc::new((0..CTS_BYTES).map(|_| AtomicU8::new(0)).collect());
        let base = mem.as_ptr() as u64;
        let entry = |k: u32| {
            let mut c = Cts {
                seq: k,
                n: k,
                credits: k.wrapping_mul(3),
                first: k.wrapping_mul(5),
                flags: k,
                seq_end: k,
                ..Cts::default()
            };
            for (i, e) in c.elems.iter_mut().enumerate() {
                *e = CtsElem {
                    addr: (k as u64) << 20 | i as u64,
                    size: k ^ i as u32,
                    rkey: !k,
                    tag: k.wrapping_add(i as u32),
                    _pad: k,
                };
            }
            c
        };
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (mem, stop) = (Arc::clone(&mem), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut rng = 0x2545_f491_4f6c_dd1du64;
                let mut order: Vec<usize> = (4..CTS_END).collect();
                for k in 1..=200_000u32 {
                    let c = entry(k);
                    let b = bytemuck::bytes_of(&c);
                    for i in 0..4 {
                        mem[i].store(b[i], Ordering::Relaxed);
                    }
                    fence(Ordering::Release);
                    for i in (1..order.len()).rev() {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        order.swap(i, rng as usize % (i + 1));
                    }
                    for &i in &order {
                        mem[i].store(b[i], Ordering::Relaxed);
                    }
                    fence(Ordering::Release);
                    for i in CTS_END..CTS_BYTES {
                        mem[i].store(b[i], Ordering::Relaxed);
                    }
                    // The entry stays a while (a real slot is rewritten only every 64
                    // entries), so that reads meet both written and half-written entries.
                    for _ in 0..rng % 256 {
                        std::hint::spin_loop();
                    }
                }
                stop.store(true, Ordering::Relaxed);
            })
        };
        let read = |at: u64, out: &mut [u8]| {
            let off = (at - base) as usize;
            for (i, o) in out.iter_mut().enumerate() {
                *o = mem[off + i].load(Ordering::Relaxed);
            }
        };
        let (mut accepted, mut torn) = (0u64, 0u64);
        while mem[CTS_END].load(Ordering::Relaxed) == 0 {
            std::thread::yield_now(); // the writer's first entry
        }
        let mut reads = 0u64;
        while !stop.load(Ordering::Relaxed) {
            reads += 1;
            let c = read_cts(read, base);
            if c.seq == c.seq_end && c.seq != 0 {
                accepted += 1;
                if bytemuck::bytes_of(&c) != bytemuck::bytes_of(&entry(c.seq)) {
                    torn += 1;
                }
            }
        }
        writer.join().unwrap();
        assert!(accepted > 0, "no entry was accepted in {reads} reads");
        assert_eq!(
            torn, 0,
            "{torn} torn entries of {accepted} accepted in {reads} reads"
        );
    }

    /// What a peer says about sizes is checked, never trusted: an immediate's size beyond
    /// the posted buffer or its index beyond the group, and a message of exactly 2^29 bytes
    /// (whose size would spill into a grouped immediate's index bits).
    #[test]
    fn peer_supplied_sizes_are_bounds_checked() {
        let peer = SocketAddr::from(([10, 0, 0, 2], 4791));
        let (mut a, mut b) = ([0u8; 100], [0u8; 200]);
        let one = RecvGroup::new(&[RecvBuf {
            ptr: a.as_mut_ptr(),
            len: 100,
            tag: 1,
        }])
        .unwrap();
        assert_eq!(written(&one, 100, peer).unwrap(), (0, 100));
        let e = written(&one, 101, peer).unwrap_err().to_string();
        assert!(
            e.contains("101 bytes") && e.contains("holds only 100") && e.contains("10.0.0.2"),
            "{e}"
        );
        let two = RecvGroup::new(&[
            RecvBuf {
                ptr: a.as_mut_ptr(),
                len: 100,
                tag: 1,
            },
            RecvBuf {
                ptr: b.as_mut_ptr(),
                len: 200,
                tag: 2,
            },
        ])
        .unwrap();
        assert_eq!(written(&two, (1 << 29) | 200, peer).unwrap(), (1, 200));
        let e = written(&two, (1 << 29) | 201, peer)
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds only 200"), "{e}");
        let e = written(&two, (2 << 29) | 5, peer).unwrap_err().to_string();
        assert!(e.contains("buffer 2 of a receive of 2"), "{e}");

        let net = RoceNet::userspace(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        let (mut s, _r) = pair(&net);
        // Zero pages until touched; nothing touches them (the send is refused).
        let big = vec![0u8; 1 << 29];
        // SAFETY: `big` outlives the comm's use of it (the send is refused at once).
        let e = unsafe { s.isend(big.as_ptr(), big.len(), 1, None) };
        let e = e
            .expect_err("a 2^29-byte message must be refused")
            .to_string();
        assert!(e.contains("512 MiB less one byte"), "{e}");
    }

    /// A peer whose setup message claims 2^32 - 1 receive buffers (the sender would allocate
    /// its staging for that many) is refused with an error naming it, not an allocation
    /// failure.
    #[test]
    fn a_peer_claiming_absurd_receive_buffers_is_refused() {
        use std::io::{Read, Write};
        let net = RoceNet::userspace(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = fake.local_addr().unwrap().port();
        let (h, _l) = net.listen(0).unwrap();
        let mut c = net.connect(0, &handle_with_port(&h, port)).unwrap();
        let peer = std::thread::spawn(move || {
            let (mut s, _) = fake.accept().unwrap();
            let mut req = [0u8; INFO];
            s.read_exact(&mut req).unwrap();
            // Answer with the connector's own endpoint (a QP connected to itself).
            let (ep, _, _, _) = decode_info(&req).unwrap();
            let eager = EagerCfg {
                size: EAGER_DEFAULT,
                slots: u32::MAX,
            };
            s.write_all(&encode_info(&ep, None, Some(eager), false))
                .unwrap();
            s
        });
        let start = std::time::Instant::now();
        let e = loop {
            assert!(start.elapsed().as_secs() < 10, "no answer within 10 s");
            match c.poll() {
                Err(e) => break e.to_string(),
                Ok(Some(_)) => panic!("connected to a peer claiming 2^32 - 1 receive buffers"),
                Ok(None) => std::thread::sleep(std::time::Duration::from_millis(1)),
            }
        };
        assert!(
            e.contains("4294967295 receive buffers") && e.contains("127.0.0.1"),
            "{e}"
        );
        drop(peer.join().unwrap());
    }

    #[test]
    fn a_nic_and_the_userspace_engine_refuse_each_other_clearly() {
        let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
        let user = RoceNet::over(Arc::new(UserVerbs::with(lo, 0, None).unwrap()), lo);
        let nic = RoceNet::over(Arc::new(Wrapped::new(lo, true)), lo);
        assert_eq!((user.name(), nic.name()), ("rocev2", "verbs"));
        let (h, mut l) = user.listen(0).unwrap();
        let mut c = nic.connect(0, &h).unwrap();
        let start = std::time::Instant::now();
        let err = loop {
            assert!(start.elapsed().as_secs() < 10, "no error within 10 s");
            match c.poll() {
                Err(e) => break e.to_string(),
                Ok(Some(_)) => panic!("connected a NIC to the userspace engine"),
                Ok(None) => {}
            }
            if let Err(e) = l.accept() {
                break e.to_string();
            }
        };
        assert!(
            err.contains("ROCCL_NET") && err.contains("userspace") && err.contains("NIC"),
            "{err}"
        );
    }

    /// Grouped receives (up to 8 buffers, tags matched in shuffled send order), eager and
    /// rendezvous sizes mixed in one group, sender and receiver on their own threads with up
    /// to FIFO requests each: the NCCL proxy's pattern.
    #[test]
    fn grouped_receives_with_mixed_sizes_from_two_threads() {
        let net = RoceNet::userspace(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        let (mut s, mut r) = pair(&net);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        // Per group: (size, tag) of each buffer, and the order the sender sends them in.
        type Group = (Vec<(usize, u32)>, Vec<usize>);
        let mut groups: Vec<Group> = Vec::new();
        for _ in 0..150 {
            let n = if next() % 3 == 0 {
                1 + (next() % 8) as usize
            } else {
                1
            };
            let bufs: Vec<(usize, u32)> = (0..n)
                .map(|i| {
                    let size = match next() % 10 {
                        0 => 0,
                        1..=5 => (next() % 4097) as usize,
                        6..=7 => 16_000 + (next() % 800) as usize,
                        _ => (next() % 300_000) as usize,
                    };
                    (size, 100 + i as u32)
                })
                .collect();
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                order.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            groups.push((bufs, order));
        }
        let fill = |g: usize, b: usize, i: usize| (g * 31 + b * 7 + i * 13) as u8;
        let sent: Vec<Vec<Vec<u8>>> = groups
            .iter()
            .enumerate()
            .map(|(g, (bufs, _))| {
                bufs.iter()
                    .enumerate()
                    .map(|(b, &(n, _))| (0..n).map(|i| fill(g, b, i)).collect())
                    .collect()
            })
            .collect();
        let plan = groups.clone();
        let data = sent.clone();
        let sender = std::thread::spawn(move || {
            let mut q: VecDeque<ReqId> = VecDeque::new();
            let start = std::time::Instant::now();
            for (g, (bufs, order)) in plan.iter().enumerate() {
                for &b in order {
                    loop {
                        assert!(
                            start.elapsed().as_secs() < 60,
                            "sender stalled at group {g}"
                        );
                        // SAFETY: `data` outlives every request (joined below).
                        let d = &data[g][b];
                        if let Some(id) =
                            unsafe { s.isend(d.as_ptr(), d.len(), bufs[b].1, None) }.unwrap()
                        {
                            q.push_back(id);
                            break;
                        }
                        while let Some(&f) = q.front() {
                            if s.test(f).unwrap().is_none() {
                                break;
                            }
                            q.pop_front();
                        }
                    }
                }
            }
            while let Some(f) = q.pop_front() {
                while s.test(f).unwrap().is_none() {
                    assert!(start.elapsed().as_secs() < 60, "sender stalled at the end");
                }
            }
            s
        });
        let mut bufs: Vec<Vec<Vec<u8>>> = groups
            .iter()
            .map(|(b, _)| b.iter().map(|&(n, _)| vec![0xEEu8; n + 16]).collect())
            .collect();
        let mut q: VecDeque<(usize, ReqId)> = VecDeque::new();
        let mut g = 0;
        let start = std::time::Instant::now();
        while g < groups.len() || !q.is_empty() {
            assert!(
                start.elapsed().as_secs() < 60,
                "receiver stalled: posted {g}, waiting {}",
                q.len()
            );
            if g < groups.len() && q.len() < FIFO {
                let rb: Vec<RecvBuf> = bufs[g]
                    .iter_mut()
                    .zip(&groups[g].0)
                    .map(|(b, &(_, tag))| RecvBuf {
                        ptr: b.as_mut_ptr(),
                        len: b.len(),
                        tag,
                    })
                    .collect();
                // SAFETY: `bufs` outlives the requests and is read only after completion.
                if let Some(id) = unsafe { r.irecv(&rb) }.unwrap() {
                    q.push_back((g, id));
                    g += 1;
                }
            }
            if let Some(&(k, id)) = q.front() {
                let mut sizes = [0usize; MAX_RECVS];
                if r.test(id, &mut sizes[..groups[k].0.len()]).unwrap() {
                    for (b, &(n, _)) in groups[k].0.iter().enumerate() {
                        assert_eq!(sizes[b], n, "group {k} buffer {b}");
                        assert!(
                            bufs[k][b][..n] == sent[k][b][..],
                            "group {k} buffer {b} data"
                        );
                    }
                    q.pop_front();
                }
            }
        }
        drop(sender.join().unwrap());
    }

    /// The userspace engine, posing as a NIC when `nic` is set (to check that both ends
    /// must agree), recording every send work request (opcode, inline, local address,
    /// remote address); with `Some(n)` in the last field every queue pair is granted `n`
    /// bytes of inline data, as a NIC may grant less than its provider asked for.
    struct Wrapped(
        UserVerbs,
        parking_lot::Mutex<Vec<(WrOpcode, bool, u64, u64)>>,
        bool,
        Option<usize>,
    );

    impl Wrapped {
        fn new(ip: IpAddr, nic: bool) -> Wrapped {
            Wrapped(
                UserVerbs::with(ip, 0, None).unwrap(),
                parking_lot::Mutex::new(Vec::new()),
                nic,
                None,
            )
        }
    }

    impl Verbs for Wrapped {
        fn name(&self) -> String {
            self.0.name()
        }
        fn dmabuf_supported(&self) -> bool {
            self.0.dmabuf_supported()
        }
        unsafe fn reg_dmabuf(
            &self,
            fd: i32,
            offset: u64,
            len: usize,
            iova: u64,
            access: Access,
        ) -> Result<Mr> {
            // SAFETY: forwarded contract.
            unsafe { self.0.reg_dmabuf(fd, offset, len, iova, access) }
        }
        fn hardware(&self) -> bool {
            self.2
        }
        fn max_inline(&self) -> usize {
            self.0.max_inline()
        }
        fn qp_max_inline(&self, qp: QpId) -> usize {
            self.3.unwrap_or_else(|| self.0.qp_max_inline(qp))
        }
        unsafe fn reg_mr(&self, addr: u64, len: usize, access: Access) -> Result<Mr> {
            // SAFETY: forwarded contract.
            unsafe { self.0.reg_mr(addr, len, access) }
        }
        fn dereg_mr(&self, mr: &Mr) -> Result<()> {
            self.0.dereg_mr(mr)
        }
        fn create_qp(&self) -> Result<(QpId, QpEndpoint)> {
            self.0.create_qp()
        }
        fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<()> {
            self.0.connect_qp(qp, remote)
        }
        fn destroy_qp(&self, qp: QpId) {
            self.0.destroy_qp(qp)
        }
        fn post_send(&self, qp: QpId, wr: &SendWr) -> Result<()> {
            let local = wr.sge.map_or(0, |g| g.addr);
            self.1
                .lock()
                .push((wr.opcode, wr.inline, local, wr.remote_addr));
            self.0.post_send(qp, wr)
        }
        fn post_recv(&self, qp: QpId, wr: &RecvWr) -> Result<()> {
            self.0.post_recv(qp, wr)
        }
        fn poll_cq(&self, qp: QpId, out: &mut [Wc]) -> Result<usize> {
            self.0.poll_cq(qp, out)
        }
        fn poll_fds(&self, out: &mut Vec<PollFd>) {
            self.0.poll_fds(out)
        }
        fn qp_state(&self, qp: QpId) -> Result<crate::rdma::verbs::QpState> {
            self.0.qp_state(qp)
        }
        fn read_registered(&self, addr: u64, out: &mut [u8]) {
            self.0.read_registered(addr, out)
        }
    }

    /// Inline data is what each queue pair was granted, not one value for the provider: on
    /// queue pairs granted none, no send (eager message, clear-to-send entry, small
    /// rendezvous write) asks for inline, although the provider as a whole offers some.
    #[test]
    fn inline_sends_follow_the_queue_pairs_grant() {
        let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
        let mut w = Wrapped::new(lo, false);
        w.3 = Some(0);
        assert!(w.max_inline() >= 64, "the provider offers inline data");
        let rec = Arc::new(w);
        let net = RoceNet::over(rec.clone(), lo);
        let (mut s, mut r) = pair(&net);
        for len in [8usize, 100, 20_000] {
            let data = vec![3u8; len];
            let (got, n) = exchange(&mut *s, &mut *r, &data, len, 1).unwrap();
            assert_eq!((n, got), (len, data));
        }
        let log = rec.1.lock().clone();
        assert!(log.len() >= 4, "{log:?}");
        assert!(
            log.iter().all(|w| !w.1),
            "inline on a queue pair granted none: {log:?}"
        );
    }

    /// Memory registered as GPU memory (`regMr` with `NCCL_PTR_CUDA`; the userspace engine
    /// takes host memory for it): once the network expects GPU buffers, a small message
    /// moves by RDMA write straight from the registered send buffer into the registered
    /// receive buffer — no eager bounce buffer, no inline copy — and a flush reads the
    /// received buffer back through a loopback QP. Without it, the same message goes eagerly.
    #[test]
    fn gpu_memory_moves_without_cpu_copies_and_is_flushed() {
        let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
        for device in [true, false] {
            let rec = Arc::new(Wrapped::new(lo, false));
            let net = RoceNet::over(rec.clone(), lo);
            if device {
                net.expect_device_buffers();
            }
            let (mut s, mut r) = pair(&net);
            let data: Vec<u8> = (0..64u8).map(|i| i ^ 0x5a).collect();
            let mut buf = vec![0u8; 256];
            let (sa, ra) = (data.as_ptr() as usize, buf.as_mut_ptr() as usize);
            let (sm, rm) = if device {
                (
                    s.reg_mr_device(sa, data.len(), None).unwrap(),
                    r.reg_mr_device(ra, buf.len(), None).unwrap(),
                )
            } else {
                (
                    s.reg_mr(sa, data.len()).unwrap(),
                    r.reg_mr(ra, buf.len()).unwrap(),
                )
            };
            let rb = [RecvBuf {
                ptr: buf.as_mut_ptr(),
                len: buf.len(),
                tag: 7,
            }];
            // SAFETY: `buf` and `data` outlive the call.
            let size = unsafe {
                transfer(
                    &mut *s,
                    &mut *r,
                    data.as_ptr(),
                    data.len(),
                    7,
                    Some(&sm),
                    &rb[0],
                )
            }
            .unwrap();
            assert_eq!((size, &buf[..64]), (64, &data[..]));
            r.flush(&rb, crate::os::wait::timeout_from_env()).unwrap();
            let log = rec.1.lock().clone();
            let data_wr = log.iter().find(|w| w.2 == sa as u64);
            if device {
                let w = data_wr.expect("the message was sent from the registered buffer");
                assert_eq!(
                    (w.0, w.1, w.3),
                    (WrOpcode::WriteImm, false, ra as u64),
                    "{log:?}"
                );
                assert!(!log.iter().any(|w| w.0 == WrOpcode::SendImm), "{log:?}");
                let read = log
                    .iter()
                    .find(|w| w.0 == WrOpcode::Read)
                    .expect("the flush read the received buffer");
                assert_eq!(read.3, ra as u64);
                let mut got = [0u8];
                rec.read_registered(read.2, &mut got);
                assert_eq!(got[0], buf[0], "the flush read the buffer's first byte");
            } else {
                assert!(data_wr.is_none(), "{log:?}");
                assert!(log.iter().any(|w| w.0 == WrOpcode::SendImm), "{log:?}");
                assert!(!log.iter().any(|w| w.0 == WrOpcode::Read), "{log:?}");
            }
            s.dereg_mr(sm).unwrap();
            let again = MemHandle { ..rm };
            r.dereg_mr(rm).unwrap();
            assert!(
                r.dereg_mr(again).is_err(),
                "a second deregistration is refused"
            );
        }
    }

    /// "GPU memory" for the dmabuf test: device-only memory of the simulated device (its
    /// address is PROT_NONE, its bytes a memfd), `len` bytes at `offset` of a buffer, with
    /// the dmabuf (fd, offset) it exports.
    fn fake_gpu(
        dev: &Arc<crate::device::sim::SimDevice>,
        len: usize,
        offset: usize,
    ) -> (
        Arc<crate::device::sim::SimBuffer>,
        usize,
        (std::os::fd::OwnedFd, u64),
    ) {
        use crate::device::Device;
        let b = dev.alloc_device_only(offset + len);
        let iova = b.addr() + offset;
        let exported = dev.dmabuf_export(iova, len).unwrap();
        (b, iova, exported)
    }

    /// dmabufs registered through `reg_mr_device(.., Some((fd, offset)))` (what NCCL's
    /// `regMrDmaBuf` does): the engine maps them itself, as a NIC maps GPU memory, and the
    /// data moves between them while the addresses in the work requests are never touched
    /// by the CPU (they are PROT_NONE: a touch would crash this test); small and large
    /// messages, then a flush read through the registration. Refused without GPU support.
    #[test]
    fn dmabuf_registrations_move_memory_the_cpu_cannot_touch() {
        use std::os::fd::AsRawFd;
        let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
        let rec = Arc::new(Wrapped::new(lo, false));
        let net = RoceNet::over(rec.clone(), lo);
        net.expect_device_buffers();
        let (mut s, mut r) = pair(&net);
        let dev = crate::device::sim::SimDevice::new(std::time::Duration::ZERO);
        let dmabuf = |e: &(std::os::fd::OwnedFd, u64)| Some((e.0.as_raw_fd(), e.1));
        let (_probe, piova, pbuf) = fake_gpu(&dev, 4096, 0);
        assert!(
            s.reg_mr_device(piova, 4096, dmabuf(&pbuf)).is_err(),
            "a dmabuf taken without ROCCL_ROCEV2_SIM_GPU"
        );
        rec.0.set_sim_gpu(true);
        // A range past the end of the dmabuf is refused (mapped, it would fault on use).
        let e = s.reg_mr_device(piova, 8192, dmabuf(&pbuf)).unwrap_err();
        assert!(e.to_string().contains("exceeds"), "{e}");
        for (len, offset) in [(64usize, 4096usize), ((1 << 20) + 3, 100)] {
            let (a, aiova, abuf) = fake_gpu(&dev, len, offset);
            let rlen = len + 61;
            let (b, biova, bbuf) = fake_gpu(&dev, rlen, 8192);
            let pattern: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ 0x3c).collect();
            a.with(|x| x[offset..].copy_from_slice(&pattern));
            let sm = s.reg_mr_device(aiova, len, dmabuf(&abuf)).unwrap();
            let rm = r.reg_mr_device(biova, rlen, dmabuf(&bbuf)).unwrap();
            let rb = RecvBuf {
                ptr: biova as *mut u8,
                len: rlen,
                tag: 3,
            };
            // SAFETY: the registered ranges outlive the call.
            let size =
                unsafe { transfer(&mut *s, &mut *r, aiova as *const u8, len, 3, Some(&sm), &rb) }
                    .unwrap();
            assert_eq!(size, len);
            let got = b.with(|x| x[8192..].to_vec());
            assert!(got[..len] == pattern[..], "{len} bytes arrived intact");
            assert!(
                got[len..].iter().all(|x| *x == 0),
                "nothing past the message"
            );
            r.flush(
                std::slice::from_ref(&rb),
                crate::os::wait::timeout_from_env(),
            )
            .unwrap();
            s.dereg_mr(sm).unwrap();
            r.dereg_mr(rm).unwrap();
        }
    }

    /// `iflush` returns at once with an id; flushes complete in order through `test_flush`
    /// and their reads; more flushes than the loopback QP takes at once wait for older ones;
    /// host memory needs none; an id never handed out is refused.
    #[test]
    fn flushes_are_asynchronous_and_complete_in_order() {
        let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
        let rec = Arc::new(Wrapped::new(lo, false));
        let net = RoceNet::over(rec.clone(), lo);
        net.expect_device_buffers();
        let (_s, mut r) = pair(&net);
        let mut gpu = vec![0u8; 4096];
        let mut host = vec![0u8; 64];
        let rm = r
            .reg_mr_device(gpu.as_mut_ptr() as usize, gpu.len(), None)
            .unwrap();
        let bufs: Vec<RecvBuf> = (0..MAX_RECVS)
            .map(|i| RecvBuf {
                // SAFETY: inside `gpu`.
                ptr: unsafe { gpu.as_mut_ptr().add(i * 512) },
                len: 512,
                tag: 0,
            })
            .collect();
        let hb = [RecvBuf {
            ptr: host.as_mut_ptr(),
            len: host.len(),
            tag: 0,
        }];
        assert_eq!(r.iflush(&hb).unwrap(), None, "host memory needs no flush");
        // Twice the reads the QP takes at once, MAX_RECVS buffers per flush.
        let ids: Vec<u64> = (0..2 * FLUSH_READS / MAX_RECVS)
            .map(|_| r.iflush(&bufs).unwrap().expect("GPU memory is flushed"))
            .collect();
        assert!(ids.windows(2).all(|w| w[1] > w[0]), "{ids:?}");
        let t0 = std::time::Instant::now();
        let mut done = vec![false; ids.len()];
        while !done.iter().all(|d| *d) {
            assert!(t0.elapsed().as_secs() < 10, "flushes stalled");
            for (i, &id) in ids.iter().enumerate() {
                if !done[i] && r.test_flush(id).unwrap() {
                    assert!(
                        done[..i].iter().all(|d| *d),
                        "flush {id} finished before older ones"
                    );
                    done[i] = true;
                }
            }
        }
        let reads = rec
            .1
            .lock()
            .iter()
            .filter(|w| w.0 == WrOpcode::Read)
            .count();
        assert_eq!(reads, ids.len() * MAX_RECVS, "one read per buffer");
        let next = ids.last().unwrap() + 1;
        assert!(r.test_flush(next).is_err(), "an unknown flush is refused");
        assert!(r.test_flush(0).is_err());
        r.dereg_mr(rm).unwrap();
    }
}
