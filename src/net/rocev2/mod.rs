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

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::{
    Connecting, ListenComm, MemHandle, Net, NetHandle, NetProperties, PollFd, PtrSupport, RecvBuf,
    RecvComm, ReqId, SendComm, MAX_RECVS, MAX_REQUESTS,
};
use crate::error::{Error, Result};
use crate::rdma::udp::UserVerbs;
use crate::rdma::verbs::{
    Access, Mr, QpEndpoint, QpId, RecvWr, SendWr, Sge, Verbs, Wc, WcOpcode, WcStatus, WrOpcode,
};

/// Clear-to-send slots per connection (= requests in flight).
pub const FIFO: usize = MAX_REQUESTS;
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
    seq_end: u32,
    _pad: u32,
}

const CTS_BYTES: usize = std::mem::size_of::<Cts>();

/// The RoCE v2 network over a verbs provider.
pub struct RoceNet {
    verbs: Arc<dyn Verbs>,
    ip: IpAddr,
}

impl RoceNet {
    /// The userspace RoCE v2 engine on `ip` (`ROCCL_ROCEV2_PORT`, `ROCCL_ROCEV2_FAULTS`).
    pub fn userspace(ip: IpAddr) -> Result<RoceNet> {
        Ok(RoceNet {
            verbs: Arc::new(UserVerbs::open(ip)?),
            ip,
        })
    }
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

/// Endpoint + FIFO description sent over the side channel.
fn encode_info(ep: &QpEndpoint, fifo: Option<&Mr>) -> [u8; INFO] {
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
    b
}

fn decode_info(b: &[u8; INFO]) -> Result<(QpEndpoint, u64, u32)> {
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
    ))
}

/// Non-blocking exchange of fixed-size messages on the side channel.
struct Side {
    s: TcpStream,
    out: Vec<u8>,
    sent: usize,
    inb: Vec<u8>,
    want: usize,
}

impl Side {
    fn new(s: TcpStream) -> Result<Side> {
        s.set_nonblocking(true)
            .map_err(|e| Error::sys("fcntl on the RoCE v2 setup socket", e))?;
        let _ = s.set_nodelay(true);
        Ok(Side {
            s,
            out: Vec::new(),
            sent: 0,
            inb: Vec::new(),
            want: 0,
        })
    }
    fn queue(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }
    fn expect(&mut self, n: usize) {
        self.want += n;
    }
    /// Move bytes; true when everything queued is sent and everything expected arrived.
    fn pump(&mut self) -> Result<bool> {
        while self.sent < self.out.len() {
            match self.s.write(&self.out[self.sent..]) {
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(Error::sys("RoCE v2 connection setup (send)", e)),
            }
        }
        let mut tmp = [0u8; 128];
        while self.inb.len() < self.want {
            let k = (self.want - self.inb.len()).min(tmp.len());
            match self.s.read(&mut tmp[..k]) {
                Ok(0) => {
                    return Err(Error::sys(
                        "RoCE v2 connection setup: the peer closed the connection",
                        std::io::ErrorKind::UnexpectedEof.into(),
                    ))
                }
                Ok(n) => self.inb.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(Error::sys("RoCE v2 connection setup (receive)", e)),
            }
        }
        Ok(self.sent == self.out.len() && self.inb.len() >= self.want)
    }
}

impl Net for RoceNet {
    fn name(&self) -> &'static str {
        "rocev2"
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
            pci_path: None,
            guid: 0,
            ptr_support: PtrSupport {
                host: true,
                device: false,
                dmabuf: false,
            },
            speed_mbps: if self.ip.is_loopback() {
                100_000
            } else {
                10_000
            },
            port: 1,
            latency_us: 8.0,
            max_comms: 4096,
            max_recvs: MAX_RECVS as u32,
        })
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
        let s = TcpStream::connect(peer)
            .map_err(|e| Error::sys(format!("RoCE v2 setup: connect to {peer}"), e))?;
        let mut side = Side::new(s)?;
        let (qp, ep) = self.verbs.create_qp()?;
        let mut fifo: Box<[Cts; FIFO]> = Box::new([Cts::default(); FIFO]);
        // SAFETY: the FIFO is boxed (stable address) and owned by the send comm, which
        // deregisters it before freeing it.
        let mr = unsafe {
            self.verbs.reg_mr(
                fifo.as_mut_ptr() as u64,
                FIFO * CTS_BYTES,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )?
        };
        side.queue(&encode_info(&ep, Some(&mr)));
        side.expect(INFO);
        Ok(Box::new(RoceConnecting {
            side,
            verbs: Arc::clone(&self.verbs),
            qp,
            mr,
            fifo: Some(fifo),
            replied: false,
        }))
    }
}

struct RoceConnecting {
    side: Side,
    verbs: Arc<dyn Verbs>,
    qp: QpId,
    mr: Mr,
    fifo: Option<Box<[Cts; FIFO]>>,
    replied: bool,
}

impl Connecting for RoceConnecting {
    fn poll(&mut self) -> Result<Option<Box<dyn SendComm>>> {
        if !self.side.pump()? {
            return Ok(None);
        }
        if !self.replied {
            let b: [u8; INFO] = self.side.inb[..INFO].try_into().unwrap();
            let (peer, _, _) = decode_info(&b)?;
            self.verbs.connect_qp(self.qp, &peer)?;
            self.side.queue(&[1]);
            self.replied = true;
            if !self.side.pump()? {
                return Ok(None);
            }
        }
        let fifo = self
            .fifo
            .take()
            .ok_or_else(|| Error::Internal("connection polled after completion".into()))?;
        let side = self
            .side
            .s
            .try_clone()
            .map_err(|e| Error::sys("dup of the RoCE v2 setup socket", e))?;
        Ok(Some(Box::new(RoceSend {
            verbs: Arc::clone(&self.verbs),
            qp: self.qp,
            live: Liveness::new(side),
            fifo_mr: self.mr,
            fifo,
            reqs: VecDeque::with_capacity(FIFO),
            base: 0,
            seq: 1,
            used: 0,
            wcs: [EMPTY_WC; 16],
            failed: None,
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
    qp: Option<(QpId, u64, u32)>,
}

struct RoceListen {
    l: TcpListener,
    verbs: Arc<dyn Verbs>,
    pending: Vec<Accepting>,
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
                    if let Some((qp, _, _)) = self.pending.swap_remove(i).qp {
                        self.verbs.destroy_qp(qp);
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
                let (peer, fifo_addr, fifo_rkey) = decode_info(&b)?;
                let (qp, ep) = self.verbs.create_qp()?;
                self.verbs.connect_qp(qp, &peer)?;
                a.side.queue(&encode_info(&ep, None));
                a.side.expect(1); // the sender's "ready"
                a.qp = Some((qp, fifo_addr, fifo_rkey));
                i += 1;
                continue;
            }
            let a = self.pending.swap_remove(i);
            let (qp, fifo_addr, fifo_rkey) = a.qp.expect("set above");
            let mut staging: Box<[Cts; FIFO]> = Box::new([Cts::default(); FIFO]);
            // SAFETY: boxed (stable address), owned by the receive comm, deregistered first.
            let smr = unsafe {
                self.verbs.reg_mr(
                    staging.as_mut_ptr() as u64,
                    FIFO * CTS_BYTES,
                    Access::LOCAL_WRITE,
                )?
            };
            return Ok(Some(Box::new(RoceRecv {
                verbs: Arc::clone(&self.verbs),
                qp,
                live: Liveness::new(a.side.s),
                fifo_addr,
                fifo_rkey,
                staging,
                staging_mr: smr,
                reqs: VecDeque::with_capacity(FIFO),
                base: 0,
                seq: 1,
                wcs: [EMPTY_WC; 16],
                failed: None,
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
            if let Some((qp, _, _)) = a.qp {
                self.verbs.destroy_qp(qp);
            }
        }
    }
}

/// Watches the setup connection, which stays open for the comm's lifetime: when the peer's
/// process exits, the kernel closes it. RDMA itself only notices a dead peer while it has
/// something to retransmit; a rank waiting for a clear-to-send or for data would otherwise
/// wait for `ROCCL_TIMEOUT`.
struct Liveness {
    side: TcpStream,
    polls: u32,
    gone_since: Option<std::time::Instant>,
}

/// After the peer closed, pending work may still complete (its engine lingers to deliver
/// inline sends); give it this long.
const PEER_GONE_GRACE: std::time::Duration = std::time::Duration::from_millis(300);

impl Liveness {
    fn new(side: TcpStream) -> Liveness {
        let _ = side.set_nonblocking(true);
        Liveness {
            side,
            polls: 0,
            gone_since: None,
        }
    }

    /// Err when the peer is gone and `waiting` says we still need it.
    fn check(&mut self, waiting: bool, what: &str) -> Result<()> {
        self.polls = self.polls.wrapping_add(1);
        if self.gone_since.is_none() && self.polls % 32 == 0 {
            let mut b = [0u8; 1];
            match self.side.peek(&mut b) {
                Ok(0) => self.gone_since = Some(std::time::Instant::now()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => self.gone_since = Some(std::time::Instant::now()),
            }
        }
        match self.gone_since {
            Some(t) if waiting && t.elapsed() > PEER_GONE_GRACE => Err(Error::sys(
                format!("RoCE v2 {what}: the peer closed its connection (its process exited or it destroyed the communicator) while this rank still waits for it"),
                std::io::ErrorKind::UnexpectedEof.into(),
            )),
            _ => Ok(()),
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

fn wc_error(w: &Wc, side: &str) -> Error {
    let hint = match w.status {
        WcStatus::RetryExcErr => {
            " (no acknowledgement after all retries: the peer is gone or unreachable)"
        }
        WcStatus::RnrRetryExcErr => " (the peer never posted a receive)",
        WcStatus::RemAccessErr => " (the peer refused the memory key or range)",
        WcStatus::WrFlushErr => " (the queue pair failed earlier)",
        _ => "",
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
    /// Waiting for a clear-to-send entry.
    Waiting,
    /// Written; waiting for the completion (and the registration to release).
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
    qp: QpId,
    live: Liveness,
    fifo_mr: Mr,
    fifo: Box<[Cts; FIFO]>,
    reqs: VecDeque<SReq>,
    base: u64,
    /// Sequence number of the clear-to-send slot being consumed.
    seq: u32,
    /// Buffers of that slot already matched.
    used: u8,
    wcs: [Wc; 16],
    failed: Option<String>,
}

impl RoceSend {
    fn progress(&mut self) -> Result<()> {
        super::refuse_if_failed(&self.failed, "RoCE v2 send comm")?;
        let r = self.progress_inner();
        super::remember_failure(&mut self.failed, r)
    }

    fn progress_inner(&mut self) -> Result<()> {
        let waiting = self
            .reqs
            .iter()
            .any(|r| matches!(r.state, SendState::Waiting));
        self.live.check(waiting, "send")?;
        let n = self.verbs.poll_cq(self.qp, &mut self.wcs)?;
        for w in &self.wcs[..n] {
            if w.status != WcStatus::Success {
                return Err(wc_error(w, "send"));
            }
            let idx = (w.wr_id - self.base) as usize;
            if let Some(r) = self.reqs.get_mut(idx) {
                if let SendState::Posted(Some(mr)) = r.state {
                    let _ = self.verbs.dereg_mr(&mr);
                }
                r.state = SendState::Done;
            }
        }
        // Match waiting sends, in order, to clear-to-send entries.
        for i in 0..self.reqs.len() {
            if !matches!(self.reqs[i].state, SendState::Waiting) {
                continue;
            }
            let slot = &self.fifo[(self.seq as usize) % FIFO];
            // The provider writes the slot (remote RDMA) possibly from another thread: copy it
            // through the provider, and trust it only when the sequence number at both ends
            // matches (a slot still being written is retried on the next poll).
            let mut cts = Cts::default();
            self.verbs
                .read_registered(slot as *const Cts as u64, bytemuck::bytes_of_mut(&mut cts));
            if cts.seq != self.seq || cts.seq_end != self.seq {
                break;
            }
            let n = (cts.n as usize).min(MAX_RECVS);
            let r = &self.reqs[i];
            let Some(e) = (0..n).find(|&e| self.used & (1 << e) == 0 && cts.elems[e].tag == r.tag)
            else {
                return Err(Error::InvalidUsage(format!(
                    "sent a message with tag {} but the receiver posted no buffer with that tag",
                    r.tag
                )));
            };
            let el = cts.elems[e];
            if r.len > el.size as usize {
                return Err(Error::InvalidUsage(format!(
                    "sent {} bytes but the receiver's buffer holds only {} (mismatched counts between sender and receiver?)",
                    r.len, el.size
                )));
            }
            let imm = if n == 1 {
                r.len as u32
            } else {
                ((e as u32) << 29) | r.len as u32
            };
            let mr = if r.len > 0 {
                // SAFETY: the isend contract keeps the buffer valid until completion; the
                // registration is released when the write completes.
                Some(unsafe { self.verbs.reg_mr(r.addr, r.len, Access::default())? })
            } else {
                None
            };
            // Small messages go inline: the provider copies them at post time, so the send
            // is complete for the caller at once (no wait for the acknowledgement; an error
            // still surfaces as an error completion).
            let inline = r.len <= self.verbs.max_inline();
            let wr = SendWr {
                wr_id: self.base + i as u64,
                opcode: WrOpcode::WriteImm,
                sge: mr.map(|m| Sge {
                    addr: r.addr,
                    len: r.len as u32,
                    lkey: m.lkey,
                }),
                inline,
                imm,
                remote_addr: el.addr,
                rkey: el.rkey,
                signaled: !inline,
            };
            self.verbs.post_send(self.qp, &wr)?;
            if inline {
                if let Some(m) = mr {
                    let _ = self.verbs.dereg_mr(&m);
                }
                self.reqs[i].state = SendState::Done;
            } else {
                self.reqs[i].state = SendState::Posted(mr);
            }
            self.used |= 1 << e;
            if self.used.count_ones() as usize == n {
                self.seq = self.seq.wrapping_add(1).max(1);
                self.used = 0;
            }
        }
        Ok(())
    }
}

impl SendComm for RoceSend {
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
        if len > (1 << 29) {
            return Err(Error::arg(format!(
                "RoCE v2 message of {len} bytes exceeds the 512 MiB limit of one message"
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
        while self.reqs.front().is_some_and(|r| r.reaped) {
            self.reqs.pop_front();
            self.base += 1;
        }
        Ok(Some(len))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        self.verbs.poll_fds(out);
        out.push(PollFd {
            fd: self.live.side.as_raw_fd(),
            events: libc::POLLIN,
        });
    }
}

impl Drop for RoceSend {
    fn drop(&mut self) {
        self.verbs.destroy_qp(self.qp);
        for r in &self.reqs {
            if let SendState::Posted(Some(mr)) = r.state {
                let _ = self.verbs.dereg_mr(&mr);
            }
        }
        let _ = self.verbs.dereg_mr(&self.fifo_mr);
    }
}

struct RReq {
    n: u8,
    got: u8,
    sizes: [usize; MAX_RECVS],
    mrs: [Option<Mr>; MAX_RECVS],
    reaped: bool,
}

struct RoceRecv {
    verbs: Arc<dyn Verbs>,
    qp: QpId,
    live: Liveness,
    fifo_addr: u64,
    fifo_rkey: u32,
    staging: Box<[Cts; FIFO]>,
    staging_mr: Mr,
    reqs: VecDeque<RReq>,
    base: u64,
    seq: u32,
    wcs: [Wc; 16],
    failed: Option<String>,
}

impl RoceRecv {
    fn progress(&mut self) -> Result<()> {
        super::refuse_if_failed(&self.failed, "RoCE v2 receive comm")?;
        let r = self.progress_inner();
        super::remember_failure(&mut self.failed, r)
    }

    fn progress_inner(&mut self) -> Result<()> {
        let n = self.verbs.poll_cq(self.qp, &mut self.wcs)?;
        for w in &self.wcs[..n] {
            if w.status != WcStatus::Success {
                return Err(wc_error(w, "receive"));
            }
            if w.opcode != WcOpcode::RecvRdmaWithImm {
                continue; // our clear-to-send writes are unsignaled; nothing else expected
            }
            let idx = (w.wr_id - self.base) as usize;
            let Some(r) = self.reqs.get_mut(idx) else {
                continue;
            };
            let imm = w.imm.unwrap_or(0);
            let (e, size) = if r.n == 1 {
                (0usize, imm as usize)
            } else {
                ((imm >> 29) as usize, (imm & 0x1fff_ffff) as usize)
            };
            if e < r.n as usize {
                r.sizes[e] = size;
                r.got += 1;
                if r.got == r.n {
                    for m in r.mrs.iter_mut().filter_map(Option::take) {
                        let _ = self.verbs.dereg_mr(&m);
                    }
                }
            }
        }
        let waiting = self.reqs.iter().any(|r| r.got < r.n);
        self.live.check(waiting, "receive")
    }
}

impl RecvComm for RoceRecv {
    unsafe fn irecv(&mut self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        self.progress()?;
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(Error::arg(format!(
                "a grouped receive takes 1 to {MAX_RECVS} buffers, got {}",
                bufs.len()
            )));
        }
        if self.reqs.len() >= FIFO {
            return Ok(None);
        }
        let id = self.base + self.reqs.len() as u64;
        let mut r = RReq {
            n: bufs.len() as u8,
            got: 0,
            sizes: [0; MAX_RECVS],
            mrs: [None; MAX_RECVS],
            reaped: false,
        };
        let mut cts = Cts {
            seq: self.seq,
            n: bufs.len() as u32,
            seq_end: self.seq,
            ..Cts::default()
        };
        for (i, b) in bufs.iter().enumerate() {
            let (addr, rkey) = if b.len > 0 {
                // SAFETY: the irecv contract keeps the buffer valid until completion; the
                // registration is released when the data has arrived.
                let m = unsafe {
                    self.verbs.reg_mr(
                        b.ptr as u64,
                        b.len,
                        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                    )?
                };
                r.mrs[i] = Some(m);
                (m.addr, m.rkey)
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
            self.verbs.post_recv(
                self.qp,
                &RecvWr {
                    wr_id: id,
                    sge: None,
                },
            )?;
        }
        let slot = (self.seq as usize) % FIFO;
        self.staging[slot] = cts;
        let wr = SendWr {
            wr_id: u64::MAX,
            opcode: WrOpcode::Write,
            sge: Some(Sge {
                addr: &self.staging[slot] as *const Cts as u64,
                len: CTS_BYTES as u32,
                lkey: self.staging_mr.lkey,
            }),
            inline: false,
            imm: 0,
            remote_addr: self.fifo_addr + (slot * CTS_BYTES) as u64,
            rkey: self.fifo_rkey,
            signaled: false,
        };
        self.verbs.post_send(self.qp, &wr)?;
        self.seq = self.seq.wrapping_add(1).max(1);
        self.reqs.push_back(r);
        Ok(Some(ReqId(id as u32)))
    }

    fn test(&mut self, req: ReqId, sizes: &mut [usize]) -> Result<bool> {
        self.progress()?;
        let r = super::pending_request(&mut self.reqs, self.base, req, |r| r.reaped, "receive")?;
        if r.got < r.n {
            return Ok(false);
        }
        for (d, s) in sizes.iter_mut().zip(&r.sizes[..r.n as usize]) {
            *d = *s;
        }
        r.reaped = true;
        while self.reqs.front().is_some_and(|r| r.reaped) {
            self.reqs.pop_front();
            self.base += 1;
        }
        Ok(true)
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        self.verbs.poll_fds(out);
        out.push(PollFd {
            fd: self.live.side.as_raw_fd(),
            events: libc::POLLIN,
        });
    }
}

impl Drop for RoceRecv {
    fn drop(&mut self) {
        self.verbs.destroy_qp(self.qp);
        for r in &mut self.reqs {
            for m in r.mrs.iter_mut().filter_map(Option::take) {
                let _ = self.verbs.dereg_mr(&m);
            }
        }
        let _ = self.verbs.dereg_mr(&self.staging_mr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn pair(net: &RoceNet) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
        crate::net::connect_pair(net)
    }

    fn exchange(
        s: &mut dyn SendComm,
        r: &mut dyn RecvComm,
        data: &[u8],
        cap: usize,
        tag: u32,
    ) -> Result<(Vec<u8>, usize)> {
        let mut buf = vec![0u8; cap];
        // SAFETY: `buf` and `data` outlive the loop, which completes both requests.
        let (rq, sq) = unsafe {
            let rq = r
                .irecv(&[RecvBuf {
                    ptr: buf.as_mut_ptr(),
                    len: cap,
                    tag: 1,
                }])?
                .unwrap();
            let sq = s.isend(data.as_ptr(), data.len(), tag, None)?.unwrap();
            (rq, sq)
        };
        let (mut sd, mut rd, mut size) = (false, false, [0usize]);
        while !(sd && rd) {
            if !sd {
                sd = s.test(sq)?.is_some();
            }
            if !rd {
                rd = r.test(rq, &mut size)?;
            }
        }
        Ok((buf, size[0]))
    }

    #[test]
    fn messages_of_every_size() {
        let net = RoceNet {
            verbs: Arc::new(UserVerbs::with(Ipv4Addr::LOCALHOST.into(), 0, None).unwrap()),
            ip: Ipv4Addr::LOCALHOST.into(),
        };
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
}
