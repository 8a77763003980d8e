//! Connection setup over a TCP side channel: the listen handle (its magic and the setup
//! listener's address), the setup messages (QP endpoint, FIFO address and key, eager
//! configuration, provider kind), and the two state machines — [`RoceConnecting`] on the
//! sending side and [`RoceListen`]'s accepting connections on the receiving side — that end
//! in the parts of a send comm ([`Connected`]) and of a receive comm ([`AcceptedConn`]);
//! `send.rs` and `recv.rs` make the comms of them.
//!
//! Authentication: the handle carries the listener's random 16-byte token (bytes 28..44);
//! the connector's setup message is followed by a 16-byte tag (HMAC-SHA256 under the key of
//! the job and that token, [`crate::net::NetKey`]), which the listener checks — and refuses a
//! repeated one — before it creates a queue pair or bounce buffers; the listener's answer is
//! followed by a tag over the answer and the request's tag, which the connector checks before
//! connecting its queue pair. A stranger's connection (bad tag, garbage, idle past
//! [`crate::net::SETUP_DEADLINE`], closed early) is dropped, counted and logged once per
//! source; it never fails the listener.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::cts::{Cts, CTS_BYTES, CTS_SLOTS};
use super::eager::{Bounce, EagerCfg};
use super::{RoceNet, FIFO};
use crate::bootstrap::auth::{self, JobKey};
use crate::bootstrap::ifaces::{get_addr, get_others, put_addr, put_others, reach, route_source};
use crate::error::{Error, Result};
use crate::net::{Connecting, ListenComm, NetHandle, PollFd, Side};
use crate::rdma::verbs::{Access, Mr, QpEndpoint, QpId, Verbs};
use crate::rdma::wire;

pub(super) const HANDLE_MAGIC: u32 = 0x3256_5252; // "RRV2"
const INFO_MAGIC: u32 = 0x3251_5152; // "RQQ2": several queue pairs per connection
/// Bytes of a setup message.
pub(super) const INFO: usize = 128;
/// Most queue pairs per connection (`ROCCL_IB_QPS_PER_CONNECTION`).
pub(crate) const MAX_QPS: usize = 8;
/// Bytes of a setup message's tag.
pub(super) const TAG: usize = crate::bootstrap::auth::TAG_BYTES;
/// Where the listener's token is in the handle.
const HANDLE_TOKEN: usize = 28;
/// Byte of the handle with the number of the host's other addresses, which follow the token.
const HANDLE_OTHERS: usize = 24;
const HANDLE_OTHER_AT: usize = HANDLE_TOKEN + crate::net::TOKEN_BYTES;
/// Most other addresses a handle carries.
pub(super) const MAX_OTHER_ADDRS: usize = 16;
/// Label of the setup keys (the NIC and the userspace engine connect alike).
const KEY_LABEL: &str = "rocev2";

/// The tag of a listener's answer `info` to the request whose tag is `req_tag`.
pub(super) fn reply_tag(key: &JobKey, info: &[u8], req_tag: &[u8]) -> [u8; TAG] {
    key.tag(&[b"reply", info, req_tag])
}

/// The key of connections to the listener of `handle`.
pub(super) fn conn_key(net: &RoceNet, handle: &NetHandle) -> JobKey {
    let b = handle.as_bytes();
    net.key.for_token(
        KEY_LABEL,
        &b[HANDLE_TOKEN..HANDLE_TOKEN + crate::net::TOKEN_BYTES],
    )
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

/// What one side of a connection setup tells the other: its queue pairs' endpoints, its
/// FIFO (address, rkey; the connecting side only), its eager configuration, its provider
/// kind and the device its queue pairs are on.
///
/// Layout (little-endian, [`INFO`] bytes): magic, the first endpoint's address (4..24),
/// QP number, PSN and MTU (24..36), FIFO address and rkey (36..48), eager size and slots
/// (48..56), hardware flag (56), number of queue pairs (57), device index (58), then the
/// QP number and PSN of each further queue pair (64..), which share the first one's address
/// and MTU (one device).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct SetupInfo {
    /// One endpoint per queue pair of the connection (1 to [`MAX_QPS`]).
    pub(super) eps: Vec<QpEndpoint>,
    pub(super) fifo_addr: u64,
    pub(super) fifo_rkey: u32,
    pub(super) eager: EagerCfg,
    pub(super) hardware: bool,
    /// Index of the sender's device (rails: the listener takes the matching one).
    pub(super) dev: u8,
}

/// Where the further queue pairs' numbers and PSNs start in a setup message.
const INFO_MORE_QPS: usize = 64;

/// A setup message of `info` (which has 1 to [`MAX_QPS`] endpoints).
pub(super) fn encode_info(info: &SetupInfo) -> [u8; INFO] {
    let mut b = [0u8; INFO];
    let ep = &info.eps[0];
    b[0..4].copy_from_slice(&INFO_MAGIC.to_le_bytes());
    put_addr(&mut b[4..24], ep.addr);
    b[24..28].copy_from_slice(&ep.qpn.to_le_bytes());
    b[28..32].copy_from_slice(&ep.psn.to_le_bytes());
    b[32..36].copy_from_slice(&ep.mtu.to_le_bytes());
    b[36..44].copy_from_slice(&info.fifo_addr.to_le_bytes());
    b[44..48].copy_from_slice(&info.fifo_rkey.to_le_bytes());
    b[48..52].copy_from_slice(&info.eager.size.to_le_bytes());
    b[52..56].copy_from_slice(&info.eager.slots.to_le_bytes());
    b[56] = u8::from(info.hardware);
    b[57] = info.eps.len().min(MAX_QPS) as u8;
    b[58] = info.dev;
    for (i, e) in info.eps.iter().enumerate().take(MAX_QPS).skip(1) {
        let at = INFO_MORE_QPS + (i - 1) * 8;
        b[at..at + 4].copy_from_slice(&e.qpn.to_le_bytes());
        b[at + 4..at + 8].copy_from_slice(&e.psn.to_le_bytes());
    }
    b
}

/// A NIC and the userspace engine speak one protocol, so either may meet either; but a NIC
/// sends RoCE v2 only to UDP port 4791, so an engine that a NIC meets must be reached there.
/// `ours`: this rank's own endpoint.
fn providers_meet(peer: &SetupInfo, verbs: &dyn Verbs, ours: &QpEndpoint) -> Result<()> {
    let theirs = &peer.eps[0];
    let off_port = |ep: &QpEndpoint| ep.engine && ep.addr.port() != wire::ROCEV2_PORT;
    if verbs.hardware() && off_port(theirs) {
        return Err(Error::InvalidUsage(format!(
            "RoCE v2 connection setup: the peer at {} runs the userspace engine on UDP port {}, but this rank's NIC sends RoCE v2 only to port {}: on that host free port {} (another process or rank holds it) and unset ROCCL_ROCEV2_PORT",
            theirs.addr.ip(),
            theirs.addr.port(),
            wire::ROCEV2_PORT,
            wire::ROCEV2_PORT
        )));
    }
    if peer.hardware && off_port(ours) {
        return Err(Error::InvalidUsage(format!(
            "RoCE v2 connection setup: the peer at {} is an RDMA NIC, which sends RoCE v2 only to UDP port {}, but this rank's userspace engine is on port {}: free port {} on this host (another process or rank holds it) and unset ROCCL_ROCEV2_PORT",
            theirs.addr.ip(),
            wire::ROCEV2_PORT,
            ours.addr.port(),
            wire::ROCEV2_PORT
        )));
    }
    Ok(())
}

/// Decode a setup message (its tag already checked).
pub(super) fn decode_info(b: &[u8; INFO]) -> Result<SetupInfo> {
    let bad = |what: &str| {
        Error::InvalidUsage(format!(
            "RoCE v2 connection setup: the peer sent {what} (another roccl version?)"
        ))
    };
    if u32::from_le_bytes(b[0..4].try_into().unwrap()) != INFO_MAGIC {
        return Err(bad("an unknown message"));
    }
    let addr = get_addr(&b[4..24]).ok_or_else(|| bad("no address"))?;
    let u32at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    let n = b[57] as usize;
    if !(1..=MAX_QPS).contains(&n) {
        return Err(bad(&format!(
            "{n} queue pairs per connection, outside the 1 to {MAX_QPS} this roccl works with"
        )));
    }
    let mtu = u32at(32);
    let eps = (0..n)
        .map(|i| {
            let (q, p) = if i == 0 {
                (24, 28)
            } else {
                let at = INFO_MORE_QPS + (i - 1) * 8;
                (at, at + 4)
            };
            QpEndpoint {
                addr,
                qpn: u32at(q),
                psn: u32at(p),
                mtu,
                engine: b[56] == 0,
            }
        })
        .collect();
    Ok(SetupInfo {
        eps,
        fifo_addr: u64::from_le_bytes(b[36..44].try_into().unwrap()),
        fifo_rkey: u32at(44),
        eager: EagerCfg {
            size: u32at(48),
            slots: u32at(52),
        },
        hardware: b[56] != 0,
        dev: b[58],
    })
}

/// Listen for connections of `net` on its setup address: the handle says where.
pub(super) fn listen(net: &RoceNet) -> Result<(NetHandle, Box<dyn ListenComm>)> {
    // With other addresses, every address takes setups (one port for all).
    let bind = if net.others.is_empty() {
        net.ip
    } else {
        Ipv4Addr::UNSPECIFIED.into()
    };
    let l = TcpListener::bind(SocketAddr::new(bind, 0))
        .map_err(|e| Error::sys(format!("bind the RoCE v2 setup listener on {bind}"), e))?;
    l.set_nonblocking(true)
        .map_err(|e| Error::sys("fcntl on the RoCE v2 setup listener", e))?;
    let a = l.local_addr().map_err(|e| Error::sys("getsockname", e))?;
    let a = SocketAddr::new(net.ip, a.port());
    let (token, key) = net.key.listener(KEY_LABEL)?;
    let mut h = [0u8; crate::net::HANDLE_MAX];
    h[0..4].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
    put_addr(&mut h[4..24], a);
    h[HANDLE_TOKEN..HANDLE_OTHER_AT].copy_from_slice(&token);
    put_others(
        &mut h,
        HANDLE_OTHERS,
        HANDLE_OTHER_AT,
        &net.others,
        MAX_OTHER_ADDRS,
    );
    Ok((
        NetHandle::from_bytes(&h)?,
        Box::new(RoceListen {
            key,
            seen: crate::net::SeenTags::new(),
            listener: l,
            devs: net
                .devs
                .iter()
                .map(|d| (Arc::clone(&d.verbs), d.ip))
                .collect(),
            pending: Vec::new(),
            ready: std::collections::VecDeque::new(),
            eager: net.eager_cfg()?,
            any_addr: !net.others.is_empty(),
        }),
    ))
}

/// The setup listener's address in a handle, and the host's other addresses it takes setups
/// on.
pub(super) fn decode_handle(handle: &NetHandle) -> Result<(SocketAddr, Vec<Ipv4Addr>)> {
    let b = handle.as_bytes();
    if u32::from_le_bytes(b[0..4].try_into().unwrap()) != HANDLE_MAGIC {
        return Err(Error::arg(
            "not a roccl RoCE v2 connection handle: was it produced by another network?",
        ));
    }
    let a = get_addr(&b[4..24]).ok_or_else(|| Error::arg("RoCE v2 handle has no address"))?;
    let others = get_others(b, HANDLE_OTHERS, HANDLE_OTHER_AT, MAX_OTHER_ADDRS)
        .ok_or_else(|| Error::arg("RoCE v2 handle names too many addresses"))?;
    Ok((a, others))
}

/// Checks of a setup message or answer (its tag checked) without I/O, for the fuzz
/// targets: decode it as the listener and the connector do, and encode it back.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz(handle: &[u8], info: &[u8]) {
    if let Ok(h) = NetHandle::from_bytes(handle) {
        if let Ok((a, others)) = decode_handle(&h) {
            let mut b = *h.as_bytes();
            put_addr(&mut b[4..24], a);
            put_others(
                &mut b,
                HANDLE_OTHERS,
                HANDLE_OTHER_AT,
                &others,
                MAX_OTHER_ADDRS,
            );
            let again = NetHandle::from_bytes(&b).expect("a handle's size");
            assert_eq!(
                decode_handle(&again).ok(),
                Some((a, others)),
                "handle round trip"
            );
        }
    }
    let Ok(b) = <[u8; INFO]>::try_from(info) else {
        return;
    };
    if let Ok(d) = decode_info(&b) {
        let _ = check_peer_slots(d.eager.slots, d.eps[0].addr);
        let back = decode_info(&encode_info(&d)).expect("an encoded setup message decodes");
        assert_eq!(back, d, "setup message round trip");
    }
}

/// A handle of a listener at `setup` and a setup message of a connector whose queue pair
/// is at `ep`: seeds of the fuzz targets' corpus.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_seed(setup: SocketAddr, ep: &QpEndpoint) -> (Vec<u8>, Vec<u8>) {
    let mut h = [0u8; HANDLE_TOKEN + crate::net::TOKEN_BYTES];
    h[0..4].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
    put_addr(&mut h[4..24], setup);
    let info = SetupInfo {
        eps: vec![
            *ep,
            QpEndpoint {
                qpn: ep.qpn + 1,
                ..*ep
            },
        ],
        fifo_addr: 0x7f00_0000_1000,
        fifo_rkey: 0x1234,
        eager: EagerCfg {
            size: 8192,
            slots: super::eager::EAGER_SLOTS,
        },
        hardware: false,
        dev: 1,
    };
    (h.to_vec(), encode_info(&info).to_vec())
}

/// Start connecting `net`'s device `dev` to the listener of `handle`: the queue pairs are
/// made, the FIFO registered and the first setup message queued here;
/// [`RoceConnecting::poll`] does the rest.
pub(super) fn connect(
    net: &RoceNet,
    dev: usize,
    handle: &NetHandle,
) -> Result<Box<dyn Connecting>> {
    let (main, others) = decode_handle(handle)?;
    // A host of several subnets: its address on one this host shares.
    let peer = SocketAddr::new(reach(main.ip(), &others), main.port());
    let mut side = Side::dial(peer, "RoCE v2 setup: ")?;
    let (dev, device) = net.device(dev);
    let verbs = Arc::clone(&device.verbs);
    let mut qps = Qps::new(&verbs);
    let mut eps = Vec::with_capacity(net.qps);
    for _ in 0..net.qps {
        let (qp, ep) = verbs.create_qp()?;
        qps.0.push(qp);
        eps.push(ep);
    }
    if !net.others.is_empty() {
        // Our engine takes packets on every address: tell the peer the one on our way to it.
        let Some(ip) = route_source(peer.ip()) else {
            return Err(Error::arg(format!(
                "RoCE v2 setup: no route from this host to the peer's address {peer} (is the cable to that host up, with an address on its subnet?)"
            )));
        };
        for (q, ep) in qps.0.iter().zip(&mut eps) {
            ep.addr.set_ip(ip);
            verbs.set_qp_addr(*q, ip);
        }
    }
    let mut fifo: Box<[Cts; CTS_SLOTS]> = Box::new([Cts::default(); CTS_SLOTS]);
    // SAFETY: the FIFO is boxed (stable address) and owned by the send comm, which
    // deregisters it before freeing it.
    let mr = unsafe {
        verbs.reg_mr(
            fifo.as_mut_ptr() as u64,
            CTS_SLOTS * CTS_BYTES,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )?
    };
    let eager = net.eager_cfg()?;
    let key = conn_key(net, handle);
    let own = eps[0];
    let info = encode_info(&SetupInfo {
        eps,
        fifo_addr: mr.addr,
        fifo_rkey: mr.rkey,
        eager,
        hardware: verbs.hardware(),
        dev: dev as u8,
    });
    let req_tag = key.tag(&[&info]);
    side.queue(&info);
    side.queue(&req_tag);
    side.expect(INFO + TAG);
    Ok(Box::new(RoceConnecting {
        key,
        req_tag,
        peer_setup: peer,
        own,
        side,
        qps,
        mr,
        fifo: Some(fifo),
        replied: false,
        eager,
        peer_eager: None,
        peer_addr: None,
        verbs,
    }))
}

/// A connection's queue pairs on their device, destroyed on drop unless taken.
pub(super) struct Qps(pub(super) Vec<QpId>, Arc<dyn Verbs>);

impl Qps {
    fn new(verbs: &Arc<dyn Verbs>) -> Qps {
        Qps(Vec::new(), Arc::clone(verbs))
    }

    /// The queue pairs, no longer destroyed here.
    fn take(&mut self) -> Vec<QpId> {
        std::mem::take(&mut self.0)
    }
}

impl Drop for Qps {
    fn drop(&mut self) {
        for &q in &self.0 {
            self.1.destroy_qp(q);
        }
    }
}

/// `h` with its setup port replaced by `port` (tests of peers that do not answer).
#[cfg(test)]
pub(crate) fn handle_with_port(h: &NetHandle, port: u16) -> NetHandle {
    let mut b = *h.as_bytes();
    b[6..8].copy_from_slice(&port.to_le_bytes());
    NetHandle::from_bytes(&b).unwrap()
}

pub(super) struct RoceConnecting {
    /// The key of this setup, and the tag of our request (the answer's tag covers it).
    key: JobKey,
    req_tag: [u8; TAG],
    /// The listener's setup address.
    peer_setup: SocketAddr,
    /// Our first queue pair's endpoint, as the peer was told it.
    own: QpEndpoint,
    side: Side,
    /// The queue pairs (destroyed with the setup unless it completes).
    qps: Qps,
    mr: Mr,
    fifo: Option<Box<[Cts; CTS_SLOTS]>>,
    replied: bool,
    eager: EagerCfg,
    peer_eager: Option<EagerCfg>,
    peer_addr: Option<SocketAddr>,
    /// The device's provider (declared last: the queue pairs and the FIFO go first).
    verbs: Arc<dyn Verbs>,
}

impl RoceConnecting {
    /// Drive the setup: the parts of the send comm once it is done ([`Connecting::poll`],
    /// in `send.rs`, makes the comm).
    pub(super) fn poll_connected(&mut self) -> Result<Option<Connected>> {
        if !self.side.pump()? {
            return Ok(None);
        }
        if !self.replied {
            let b: [u8; INFO] = self.side.inb[..INFO].try_into().unwrap();
            let tag = &self.side.inb[INFO..INFO + TAG];
            if !self.key.verify(&[b"reply", &b, &self.req_tag], tag) {
                return Err(Error::InvalidUsage(format!(
                    "RoCE v2 connection setup with {}: the answer is not authenticated by this job's key (a process of another job, or without the job secret, listens at the peer's address)",
                    self.peer_setup
                )));
            }
            let peer = decode_info(&b)?;
            providers_meet(&peer, &*self.verbs, &self.own)?;
            let addr = peer.eps[0].addr;
            check_peer_slots(peer.eager.slots, addr)?;
            if peer.eps.len() != self.qps.0.len() {
                return Err(Error::InvalidUsage(format!(
                    "RoCE v2 connection setup with {addr}: the peer answered with {} queue pairs for our {} (another roccl version?)",
                    peer.eps.len(),
                    self.qps.0.len()
                )));
            }
            self.peer_eager = Some(peer.eager);
            self.peer_addr = Some(addr);
            for (q, ep) in self.qps.0.iter().zip(&peer.eps) {
                self.verbs.connect_qp(*q, ep)?;
            }
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
        Ok(Some(Connected {
            verbs: Arc::clone(&self.verbs),
            qps: self.qps.take(),
            peer: self
                .peer_addr
                .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0))),
            side,
            fifo_mr: self.mr,
            fifo,
            eager_size: eager_size as usize,
            staging,
            peer_slots: peer.slots,
        }))
    }

    /// The setup socket, for [`Connecting::poll_fds`].
    pub(super) fn setup_fds(&self, out: &mut Vec<PollFd>) {
        out.push(PollFd {
            fd: self.side.s.as_raw_fd(),
            events: libc::POLLIN | libc::POLLOUT,
        });
    }
}

/// What a completed setup gives the send comm (`RoceSend::connected`).
pub(super) struct Connected {
    pub(super) verbs: Arc<dyn Verbs>,
    pub(super) qps: Vec<QpId>,
    pub(super) peer: SocketAddr,
    /// The setup socket, kept to notice the peer closing.
    pub(super) side: std::net::TcpStream,
    pub(super) fifo_mr: Mr,
    pub(super) fifo: Box<[Cts; CTS_SLOTS]>,
    pub(super) eager_size: usize,
    pub(super) staging: Bounce,
    /// The receiver's clear-to-send slots.
    pub(super) peer_slots: u32,
}

/// What a completed setup gives the receive comm (`RoceRecv::accepted`).
pub(super) struct AcceptedConn {
    pub(super) verbs: Arc<dyn Verbs>,
    pub(super) qps: Vec<QpId>,
    pub(super) peer: SocketAddr,
    /// The setup socket, kept to notice the peer closing.
    pub(super) side: std::net::TcpStream,
    pub(super) fifo_addr: u64,
    pub(super) fifo_rkey: u32,
    pub(super) staging: Box<[Cts; CTS_SLOTS]>,
    pub(super) staging_mr: Mr,
    pub(super) bounce: Vec<Bounce>,
    pub(super) eager: usize,
}

impl Drop for RoceConnecting {
    fn drop(&mut self) {
        if self.fifo.is_some() {
            // Setup abandoned: release what the send comm would have owned (the queue
            // pairs go with `qps`).
            let _ = self.verbs.dereg_mr(&self.mr);
        }
    }
}

/// A connection being accepted: its setup socket, and once its QP is connected, the rest.
struct Accepting {
    side: Side,
    accepted: Option<Accepted>,
}

/// A receive side whose queue pairs are connected, waiting for the sender's "ready".
struct Accepted {
    /// Declared first: the queue pairs go before their bounce buffers are deregistered.
    qps: Qps,
    verbs: Arc<dyn Verbs>,
    peer: SocketAddr,
    fifo_addr: u64,
    fifo_rkey: u32,
    /// One pool of bounce buffers per queue pair.
    bounce: Bounces,
    eager: usize,
}

/// Bounce buffers of a connection's queue pairs, deregistered on drop unless taken.
pub(super) struct Bounces(pub(super) Vec<Bounce>, Arc<dyn Verbs>);

impl Bounces {
    fn take(&mut self) -> Vec<Bounce> {
        std::mem::take(&mut self.0)
    }
}

impl Drop for Bounces {
    fn drop(&mut self) {
        for b in &self.0 {
            let _ = self.1.dereg_mr(&b.mr);
        }
    }
}

pub(super) struct RoceListen {
    /// The key setup messages are authenticated with.
    key: JobKey,
    /// Tags of the setup messages accepted (a replayed one is refused).
    seen: crate::net::SeenTags,
    /// The setup listener (its address is in the handle).
    listener: TcpListener,
    /// The devices (provider and address) connections may be accepted on.
    devs: Vec<(Arc<dyn Verbs>, std::net::IpAddr)>,
    pending: Vec<Accepting>,
    /// Receive comms whose setup is done, not handed out yet: a call drives every pending
    /// setup (refusing every stranger whose bytes are in) and hands out one of these. Whole
    /// comms, so that one left here when the listener goes tears its queue pair down first.
    pub(super) ready: std::collections::VecDeque<Box<dyn crate::net::RecvComm>>,
    eager: EagerCfg,
    /// The engine takes packets on every address ([`RoceNet`]'s other addresses).
    any_addr: bool,
}

/// Which of `devs` (their addresses) takes a connection from device `dev` of a peer at
/// `peer`: the one of the same index, unless it is on an interface whose subnet does not
/// hold the peer and another device's does (rails: NIC i of every host on network i, listed
/// in another order here).
pub(super) fn pick_device(devs: &[std::net::IpAddr], dev: usize, peer: std::net::IpAddr) -> usize {
    if devs.len() == 1 {
        return 0;
    }
    let ifaces = crate::bootstrap::ifaces::list().unwrap_or_default();
    pick_device_among(devs, dev, peer, &ifaces)
}

/// [`pick_device`] with this host's interfaces `ifaces`.
pub(super) fn pick_device_among(
    devs: &[std::net::IpAddr],
    dev: usize,
    peer: std::net::IpAddr,
    ifaces: &[crate::bootstrap::ifaces::Iface],
) -> usize {
    let same = dev % devs.len();
    // Some(true): on the peer's subnet; Some(false): on an interface that is not; None: on
    // no interface this host lists (e.g. a second loopback address).
    let near = |a: &std::net::IpAddr| {
        let on: Vec<_> = ifaces.iter().filter(|i| i.addr == *a).collect();
        (!on.is_empty()).then(|| {
            on.iter()
                .any(|i| crate::bootstrap::ifaces::on_subnet(i, peer))
        })
    };
    if near(&devs[same]) != Some(false) {
        return same;
    }
    devs.iter()
        .position(|a| near(a) == Some(true))
        .unwrap_or(same)
}

impl RoceListen {
    /// Make the receive side of the authenticated setup message `peer`: its queue pairs on
    /// the device that suits it, connected, with their receives posted; and the answer.
    fn accept_setup(
        &self,
        peer: &SetupInfo,
        local: Option<SocketAddr>,
    ) -> Result<(Accepted, [u8; INFO])> {
        let addrs: Vec<std::net::IpAddr> = self.devs.iter().map(|d| d.1).collect();
        let d = pick_device(&addrs, peer.dev as usize, peer.eps[0].addr.ip());
        let verbs = Arc::clone(&self.devs[d].0);
        let mut qps = Qps::new(&verbs);
        let mut bounce = Bounces(Vec::new(), Arc::clone(&verbs));
        let mut eps = Vec::with_capacity(peer.eps.len());
        let cfg = self.eager;
        for theirs in &peer.eps {
            let (qp, mut ep) = verbs.create_qp()?;
            qps.0.push(qp);
            providers_meet(peer, &*verbs, &ep)?;
            if self.any_addr {
                // Our engine takes packets on every address: answer with the one the peer
                // reached us at.
                if let Some(a) = local {
                    ep.addr.set_ip(a.ip());
                    verbs.set_qp_addr(qp, a.ip());
                }
            }
            // Receives are posted before the sender learns our endpoint: its first message
            // (eager, without a clear-to-send) always finds one.
            verbs.connect_qp(qp, theirs)?;
            bounce.0.push(Bounce::new(&*verbs, qp, cfg)?);
            eps.push(ep);
        }
        let answer = encode_info(&SetupInfo {
            eps,
            fifo_addr: 0,
            fifo_rkey: 0,
            eager: cfg,
            hardware: verbs.hardware(),
            dev: d as u8,
        });
        Ok((
            Accepted {
                qps,
                verbs,
                peer: peer.eps[0].addr,
                fifo_addr: peer.fifo_addr,
                fifo_rkey: peer.fifo_rkey,
                bounce,
                // The sender sends eagerly what fits both sides' limit.
                eager: cfg.size.min(peer.eager.size) as usize,
            },
            answer,
        ))
    }
}

impl RoceListen {
    /// Take new connections and drive every setup; each one done becomes a receive comm
    /// (`made`, from `recv.rs`) in `ready`, which [`ListenComm::accept`] hands out.
    pub(super) fn drive(
        &mut self,
        made: fn(AcceptedConn) -> Box<dyn crate::net::RecvComm>,
    ) -> Result<()> {
        loop {
            match self.listener.accept() {
                Ok((s, _)) => {
                    let Ok(mut side) = Side::new(s) else {
                        continue; // a socket already gone: drop it
                    };
                    side.expect(INFO + TAG);
                    if let Some(old) = crate::net::oldest_stranger(
                        &self.pending,
                        |p| p.accepted.is_none(),
                        |p| p.side.born(),
                    ) {
                        let old = self.pending.swap_remove(old);
                        auth::refuse(
                            "RoCE v2 setup listener",
                            old.side.peer_ip(),
                            "too many connections without a setup message: the oldest is dropped for a new one",
                        );
                    }
                    self.pending.push(Accepting {
                        side,
                        accepted: None,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // Out of descriptors, a connection reset before accept...: the listener itself
                // is fine; try again at the next call.
                Err(_) => break,
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            let accepting = &mut self.pending[i];
            let pumped = accepting.side.pump();
            let bad = match &pumped {
                Err(e) => Some(format!("the connection failed during setup ({e})")),
                Ok(false) if accepting.side.overdue() => Some(format!(
                    "no whole setup message within {:.0?} ({} bytes)",
                    crate::net::SETUP_DEADLINE,
                    accepting.side.inb.len()
                )),
                _ => None,
            };
            if let Some(why) = bad {
                // (What was accepted goes with it.)
                let gone = self.pending.swap_remove(i);
                // A peer that had its setup message accepted is one of ours: its errors are
                // its own to report.
                if gone.accepted.is_none() {
                    auth::refuse("RoCE v2 setup listener", gone.side.peer_ip(), &why);
                }
                continue;
            }
            if pumped.ok() != Some(true) {
                i += 1;
                continue;
            }
            if accepting.accepted.is_none() {
                let b: [u8; INFO] = accepting.side.inb[..INFO].try_into().unwrap();
                let tag: [u8; TAG] = accepting.side.inb[INFO..INFO + TAG].try_into().unwrap();
                let refused = if !self.key.verify(&[&b], &tag) {
                    Some("a setup message not authenticated by this job's key (garbage, a rank of another job, or without the job secret)")
                } else if !self.seen.first(&tag) {
                    Some("a replayed setup message")
                } else {
                    None
                };
                if let Some(why) = refused {
                    let gone = self.pending.swap_remove(i);
                    auth::refuse("RoCE v2 setup listener", gone.side.peer_ip(), why);
                    continue;
                }
                // An authenticated peer set up differently: its error is the job's.
                let local = accepting.side.s.local_addr().ok();
                let made = decode_info(&b).and_then(|d| self.accept_setup(&d, local));
                let (accepted, answer) = match made {
                    Ok(x) => x,
                    Err(e) => {
                        self.pending.swap_remove(i);
                        return Err(e);
                    }
                };
                let reply = reply_tag(&self.key, &answer, &tag);
                let accepting = &mut self.pending[i];
                accepting.side.queue(&answer);
                accepting.side.queue(&reply);
                accepting.side.expect(1); // the sender's "ready"
                accepting.accepted = Some(accepted);
                i += 1;
                continue;
            }
            let ready = self.pending.swap_remove(i);
            let conn = Self::finish(ready)?;
            self.ready.push_back(made(conn));
        }
        Ok(())
    }

    /// The parts of the receive comm of setup `ready`, whose peer said it is ready.
    fn finish(ready: Accepting) -> Result<AcceptedConn> {
        let Accepted {
            mut qps,
            verbs,
            peer,
            fifo_addr,
            fifo_rkey,
            mut bounce,
            eager,
        } = ready.accepted.expect("set above");
        let mut staging: Box<[Cts; CTS_SLOTS]> = Box::new([Cts::default(); CTS_SLOTS]);
        // SAFETY: boxed (stable address), owned by the receive comm, deregistered first.
        let smr = unsafe {
            verbs.reg_mr(
                staging.as_mut_ptr() as u64,
                CTS_SLOTS * CTS_BYTES,
                Access::LOCAL_WRITE,
            )?
        };
        Ok(AcceptedConn {
            verbs,
            qps: qps.take(),
            peer,
            side: ready.side.s,
            fifo_addr,
            fifo_rkey,
            staging,
            staging_mr: smr,
            bounce: bounce.take(),
            eager,
        })
    }

    /// The listener and its setups' sockets, for [`ListenComm::poll_fds`].
    pub(super) fn setup_fds(&self, out: &mut Vec<PollFd>) {
        out.push(PollFd {
            fd: self.listener.as_raw_fd(),
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
