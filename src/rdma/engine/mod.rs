//! The userspace RoCE v2 reliable-connection engine: a deterministic state machine with no
//! I/O, in the manner of quinn-proto. Feed it datagrams with [`Engine::handle_datagram`] and
//! the clock with [`Engine::handle_timeout`]; take datagrams to send from
//! [`Engine::poll_transmit`] and the next deadline from [`Engine::poll_timeout`]. A driver
//! owns the sockets (see `rdma::udp`); tests drive two engines through a simulated lossy link.
//!
//! Protocol (IBTA RC, as RoCE v2 NICs speak it): every request packet carries a 24-bit PSN;
//! messages longer than the path MTU are cut into FIRST/MIDDLE/LAST packets; the responder
//! acknowledges when asked (AckReq on the last packet of a message and every
//! [`ACK_EVERY`] packets), NAKs the first out-of-sequence PSN once, answers a SEND without
//! a posted receive with an RNR NAK, and checks every RDMA access against the target region's
//! rkey, bounds and rights (violation → NAK remote access error). The requester retransmits
//! go-back-N from the NAKed PSN, after an RNR wait, or from the oldest unacknowledged PSN
//! when the retransmission timer fires; when the retry count runs out the work request
//! completes with RETRY_EXC_ERR (RNR_RETRY_EXC_ERR for RNR) and the QP enters ERROR.
//!
//! Userspace extensions (the engine's peer is itself): the responder keeps out-of-order
//! packets (`rdma::reorder`), a requester with [`QpAttr::selective`] then resends only the
//! NAKed packets and times out on the measured round trip, and [`QpAttr::retry_for`] retries
//! with backoff until a deadline instead of counting retries.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use super::mem::{Access, AccessError, MrTable};
use super::reorder::Reorder;
use super::wire::{self, Aeth, IpInfo, NakCode, Opcode};
use crate::error::{Error, Result};

mod reports;
mod requester;
mod responder;
mod timers;
mod tx;
mod work;

pub use reports::{DUP_SYNDROME, HOLE_SYNDROME};
use timers::Slack;
pub use work::{QpState, RecvWr, SendWr, Sge, Wc, WcOpcode, WcStatus, WrOpcode};

/// Queue pair number (24 bits).
pub type Qpn = u32;
/// Completion queue handle.
pub type CqId = usize;

/// The requester asks for an acknowledgement at least every this many packets.
pub const ACK_EVERY: u32 = 32;
/// Largest payload copied into the work request at post time.
pub const MAX_INLINE: usize = 256;

/// Work requests a queue holds before it grows: queues are sized once, so the data path
/// does not allocate while a connection stays within this many requests in flight.
const QUEUE_HINT: usize = 256;
/// A responder repeats its sequence-error NAK after this many out-of-sequence packets.
const NAK_REPEAT: u32 = 16;
/// A responder acknowledges a packet that asks for it at once, and others (the last
/// packets of unsignaled messages, whose requester waits for nothing) within this delay,
/// coalesced: one acknowledgement then covers every message of a burst of small ones.
pub const ACK_DELAY: Duration = Duration::from_micros(100);
/// Smallest congestion window, in packets.
const MIN_WINDOW: u32 = 16;
/// Most request packets in flight (unacknowledged) per QP.
const WINDOW: u32 = 256;
const PSN_MASK: u32 = 0x00ff_ffff;

fn psn_add(a: u32, b: u32) -> u32 {
    a.wrapping_add(b) & PSN_MASK
}

/// Signed distance `a - b` in PSN space.
fn psn_diff(a: u32, b: u32) -> i32 {
    let d = a.wrapping_sub(b) & PSN_MASK;
    if d & 0x0080_0000 != 0 {
        d as i32 - (1 << 24)
    } else {
        d as i32
    }
}

/// Attributes for [`Engine::modify_qp`] (the fields each transition needs).
#[derive(Clone, Copy, Debug)]
pub struct QpAttr {
    /// Path MTU: 256, 512, 1024, 2048 or 4096.
    pub mtu: u32,
    /// The peer's address (its IP is its GID) and RoCE UDP port.
    pub dest: SocketAddr,
    /// The peer's QP number.
    pub dest_qpn: Qpn,
    /// First PSN we expect from the peer (RTR).
    pub rq_psn: u32,
    /// First PSN we send (RTS).
    pub sq_psn: u32,
    /// Retransmission timeout, as the IB code: 4.096 µs × 2^timeout (1..=31).
    pub timeout: u8,
    /// Retransmissions after a timeout (0..=7).
    pub retry_cnt: u8,
    /// Retransmissions after RNR NAKs (0..=7; 7 = unlimited).
    pub rnr_retry: u8,
    /// RNR timer code we put in our RNR NAKs (IB table; 1 = 10 µs … 31 = 491 ms).
    pub min_rnr_timer: u8,
    /// Userspace extension (RTS): `Some(limit)` replaces the retry count — a timeout
    /// retransmits with exponential backoff (capped at [`MAX_BACKOFF`]) for as long as the
    /// requester keeps waiting, and the request fails with RETRY_EXC_ERR only after `limit`
    /// without any acknowledged progress (the communicator's own deadline). `None`: IB
    /// semantics, `retry_cnt` retransmissions.
    pub retry_for: Option<Duration>,
    /// Userspace extension (RTS): the peer keeps out-of-order packets (this engine's
    /// responder does, see `rdma::reorder`), so a sequence-error NAK resends only the NAKed
    /// packet (fast retransmit) instead of everything from it, and the retransmission timer
    /// follows the measured round trip (at least [`RTO_MIN`], at most the IB timeout).
    /// The timer still goes back N. `false`: IB go-back-N, fixed timer.
    pub selective: bool,
}

impl Default for QpAttr {
    fn default() -> Self {
        QpAttr {
            mtu: 4096,
            dest: SocketAddr::from(([0, 0, 0, 0], wire::ROCEV2_PORT)),
            dest_qpn: 0,
            rq_psn: 0,
            sq_psn: 0,
            timeout: 12,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            retry_for: None,
            selective: false,
        }
    }
}

/// The IB RNR timer table in microseconds (code 0 is the longest).
fn rnr_delay(code: u8) -> Duration {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
        5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
        245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[(code & 31) as usize] as u64)
}

/// The IB local ACK timeout: 4.096 µs × 2^code.
pub fn ack_timeout(code: u8) -> Duration {
    Duration::from_nanos(4096u64 << code.clamp(1, 31))
}

/// With [`QpAttr::retry_for`], consecutive timeouts double the retransmission interval up
/// to this (or the base timeout, if longer): a peer back from a pause is heard from again
/// within this long.
pub const MAX_BACKOFF: Duration = Duration::from_millis(100);

/// With [`QpAttr::selective`], the shortest retransmission timeout (the measured round
/// trip sets it above: smoothed RTT + 4 × its variation, as TCP does).
pub const RTO_MIN: Duration = Duration::from_millis(3);

/// Hole reports queued at the responder at most (more wait for the NAK of each gap).
const HOLES_MAX: usize = 32;
/// Selective resends remembered (by PSN modulo this), so that a NAK or hole report that
/// crossed the resend on the wire does not resend the packet again.
const RECENT: usize = 64;

/// The shortest wait before a tail-loss probe ([`Qp::tail_at`]).
const TAIL_MIN: Duration = Duration::from_micros(50);
/// The wait before a tail-loss probe while no round trip has been measured yet.
const TAIL_UNMEASURED: Duration = Duration::from_millis(1);
/// Packets queued for selective retransmission at most (more NAKs wait for the timer).
const RESEND_MAX: usize = 64;

/// A selective resend, remembered ([`Qp::recent`]).
#[derive(Clone, Copy, Default)]
struct Resent {
    psn: u32,
    at: Option<Instant>,
    /// `sent_hi` when it was resent.
    mark: u32,
}

#[derive(Clone, Copy)]
struct SendWqe {
    wr: SendWr,
    inline: [u8; MAX_INLINE],
    len: u32,
    psn: u32,
    npkts: u32,
    /// Send/write: acknowledged. Read: all response packets received.
    done: bool,
    /// Read: response packets received in order.
    resp: u32,
}

struct RecvWqe {
    wr: RecvWr,
}

/// A SEND message being received.
struct InSend {
    wqe: RecvWqe,
    off: u32,
}

/// An RDMA WRITE message being received.
struct InWrite {
    va: u64,
    rkey: u32,
    left: u32,
    total: u32,
}

/// RDMA READ responses to send.
struct ReadJob {
    psn: u32,
    va: u64,
    rkey: u32,
    len: u32,
    sent: u32,
}

/// Statistics of an engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Datagrams accepted.
    pub rx_packets: u64,
    /// Datagrams produced.
    pub tx_packets: u64,
    /// Datagrams dropped for a bad ICRC.
    pub icrc_errors: u64,
    /// Datagrams dropped as malformed or for an unknown QP.
    pub malformed: u64,
    /// Duplicate requests seen.
    pub duplicates: u64,
    /// Out-of-sequence requests dropped.
    pub out_of_sequence: u64,
    /// Packets retransmitted.
    pub retransmits: u64,
    /// Of those, packets the peer reported it already had ([`DUP_SYNDROME`]): resent
    /// because an acknowledgement came late, not because anything was lost.
    pub spurious_retransmits: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// PSN sequence-error NAKs sent (a gap seen).
    pub seq_naks_sent: u64,
    /// NAKs of an error sent (invalid request, remote access, remote operation).
    pub error_naks_sent: u64,
    /// PSN sequence-error NAKs received (the peer saw a gap).
    pub seq_naks_received: u64,
    /// RNR NAKs received: each is a retry after the peer's timer (its receive queue was
    /// empty).
    pub rnr_naks_received: u64,
    /// NAKs of an error received (each fails its QP).
    pub error_naks_received: u64,
    /// Retransmission timeouts (each goes back N).
    pub timeouts: u64,
    /// Tail-loss probes sent.
    pub tail_probes: u64,
    /// Datagrams dropped because they came from another address than their QP's peer (as a
    /// NIC checks the source GID): strangers and spoofers.
    pub wrong_source: u64,
    /// ACKs and NAKs dropped because their PSN lies outside what the QP has outstanding
    /// (IBTA: ghost acknowledgements are ignored), so a forged one neither completes nor
    /// fails anything.
    pub ghost_acks: u64,
    /// Duplicate RDMA read requests not executed again because many reads were queued
    /// already (a requester asks again at its next timeout).
    pub duplicate_reads_dropped: u64,
}

struct Qp {
    qpn: Qpn,
    state: QpState,
    send_cq: CqId,
    recv_cq: CqId,
    src_port: u16,
    /// The local address it sends from and receives on, when the engine listens on every
    /// address ([`Engine::set_qp_source`]); `None`: the engine's.
    src_ip: Option<IpAddr>,
    attr: QpAttr,
    // requester
    sq: VecDeque<SendWqe>,
    next_psn: u32,
    tx_wqe: usize,
    tx_pkt: u32,
    retry_left: u8,
    rnr_left: u8,
    /// Consecutive retransmission timeouts without progress (the backoff exponent).
    backoff: u32,
    /// Last acknowledged progress, or when the send queue last became busy.
    progress_at: Option<Instant>,
    rto: Option<Instant>,
    rnr_until: Option<Instant>,
    /// One past the highest PSN transmitted (to count retransmissions).
    sent_hi: u32,
    /// One past the highest PSN the responder acknowledged (cumulative).
    acked: u32,
    /// PSN of the last sequence-error NAK acted on (and when).
    last_nak: Option<u32>,
    /// PSNs to resend one by one (selective retransmission), oldest first.
    resend: VecDeque<u32>,
    /// Smoothed round trip and its variation (selective mode), and the packet timed now.
    srtt: Option<Duration>,
    rttvar: Duration,
    probe: Option<(u32, Instant)>,
    /// Tail-loss probe (selective mode): when nothing new was sent or acknowledged for
    /// about two round trips while requests are outstanding, resend the oldest
    /// unacknowledged packet instead of waiting for the retransmission timer. A lost last
    /// packet (no later packet makes the responder NAK it) or a lost acknowledgement then
    /// costs a few round trips, not [`RTO_MIN`] or more.
    tail_at: Option<Instant>,
    /// Tail-loss probes since the last progress (each waits twice as long).
    tail_probes: u32,
    /// Extra wait before a retransmission timeout: how late this host's threads wake and
    /// how late the peer's acknowledgements proved to be.
    slack: Slack,
    /// Packets retransmitted, and of those the ones the peer reported it already had.
    resent: u64,
    spurious: u64,
    /// The PSN the last retransmission timeout resent first, and when: a duplicate report
    /// that starts there shows the timer fired too early.
    timed_out: Option<(u32, Instant)>,
    /// The last selective resends by PSN modulo [`RECENT`]: PSN, when, and the PSN of the
    /// first new packet sent after it (a gap shown by that packet or a later one means
    /// the resend was lost).
    recent: [Resent; RECENT],
    /// Packets allowed in flight: halved on every loss, grown by one per acknowledgement
    /// (go-back-N resends everything in flight after a loss, so a lossy path gets a small
    /// window and a clean one the full [`WINDOW`]).
    cwnd: u32,
    // responder
    rq: VecDeque<RecvWqe>,
    epsn: u32,
    msn: u32,
    in_send: Option<InSend>,
    in_write: Option<InWrite>,
    nak_sent: bool,
    /// Out-of-sequence packets since the last NAK.
    oos_since_nak: u32,
    /// Out-of-sequence packets kept until the gap before them fills.
    reorder: Reorder,
    /// Closed by its owner: delivers what was posted, acknowledges (and discards) what
    /// arrives, until the driver frees it.
    closing: bool,
    /// When the last packet for this QP arrived.
    last_rx: Option<Instant>,
    /// Pending acknowledgement (ACK/NAK/RNR NAK) and its PSN.
    ctrl: Option<(Aeth, u32)>,
    /// Pending hole reports ([`HOLE_SYNDROME`]) and the first missing PSN of each.
    holes: VecDeque<(Aeth, u32)>,
    /// Duplicate requests received since the last duplicate report ([`DUP_SYNDROME`]),
    /// and the lowest of their PSNs.
    dups: u32,
    dup_lo: u32,
    dup_gap: Duration,
    /// When the expected PSN last moved forward.
    advanced_at: Option<Instant>,
    /// First PSNs of the gaps reported lately, by PSN modulo [`RECENT`]: when the gap
    /// before them fills, these are not NAKed again (their resends are on the way).
    reported: [Option<u32>; RECENT],
    /// Requests were accepted that no acknowledgement covers yet: acknowledge by then.
    ack_due: Option<Instant>,
    reads: VecDeque<ReadJob>,
}

impl Qp {
    /// PSN of the oldest unacknowledged request packet.
    fn una(&self) -> u32 {
        match self.sq.iter().find(|w| !w.done) {
            Some(w) if w.wr.opcode == WrOpcode::Read => psn_add(w.psn, w.resp),
            // Inside a long message, the packets acknowledged so far are done too.
            Some(w)
                if psn_diff(self.acked, w.psn) > 0
                    && psn_diff(self.acked, w.psn) < w.npkts as i32 =>
            {
                self.acked
            }
            Some(w) => w.psn,
            None => self.next_psn,
        }
    }
    fn mtu(&self) -> u32 {
        self.attr.mtu
    }
    fn outstanding(&self) -> bool {
        self.sq.iter().any(|w| !w.done)
    }
    /// The retransmission interval: the IB timeout, doubled per consecutive timeout when
    /// retrying until a deadline ([`QpAttr::retry_for`]).
    fn rto_interval(&self) -> Duration {
        let ib = ack_timeout(self.attr.timeout);
        let base = match self.srtt {
            Some(s) if self.attr.selective => {
                ((s + 4 * self.rttvar).max(RTO_MIN) + self.slack.get()).min(ib)
            }
            _ => ib,
        };
        if self.attr.retry_for.is_none() || self.backoff == 0 {
            return base;
        }
        let cap = base.max(MAX_BACKOFF);
        base.saturating_mul(1 << self.backoff.min(16)).min(cap)
    }
    /// The responder acknowledged every PSN before `upto`: time the probe if it is covered
    /// (a retransmission cancelled it: Karn's rule).
    fn rtt_sample(&mut self, upto: u32, now: Instant) {
        let Some((p, t)) = self.probe else { return };
        if psn_diff(upto, p) <= 0 {
            return;
        }
        self.probe = None;
        let r = now.saturating_duration_since(t);
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(s) => {
                let dev = if s > r { s - r } else { r - s };
                self.rttvar = (self.rttvar * 3 + dev) / 4;
                self.srtt = Some((s * 7 + r) / 8);
            }
        }
    }
    /// The responder acknowledged something new: the retry budget starts again.
    fn progressed(&mut self, now: Instant) {
        self.retry_left = self.attr.retry_cnt;
        self.backoff = 0;
        self.progress_at = Some(now);
        self.tail_probes = 0;
        self.rto = if self.outstanding() {
            Some(now + self.rto_interval())
        } else {
            None
        };
        self.arm_tail(now);
    }
    /// Queue `psn` for a selective resend unless it is queued already or was resent and
    /// nothing says that resend was lost: `shown_by` is the PSN of the packet that showed
    /// the gap (a hole report), later than the resend if the resend was lost; a NAK (which
    /// does not say) counts only a round trip after the resend. True if queued.
    fn queue_resend(&mut self, psn: u32, shown_by: Option<u32>, now: Instant) -> bool {
        if psn_diff(psn, self.una()) < 0
            || psn_diff(psn, self.sent_hi) >= 0
            || self.resend.len() >= RESEND_MAX
            || self.resend.contains(&psn)
        {
            return false;
        }
        let r = self.recent[psn as usize % RECENT];
        if let (true, Some(at)) = (r.psn == psn, r.at) {
            let stale = match shown_by {
                Some(q) => psn_diff(q, r.mark) < 0,
                None => {
                    now.saturating_duration_since(at)
                        < self.srtt.unwrap_or(ACK_DELAY).max(ACK_DELAY)
                }
            };
            if stale {
                return false;
            }
        }
        self.resend.push_back(psn);
        true
    }
    /// (Re)arm the tail-loss probe two round trips (plus the responder's acknowledgement
    /// delay) from `now`, if anything is outstanding.
    fn arm_tail(&mut self, now: Instant) {
        self.slack.roll(now);
        if !self.attr.selective || !self.outstanding() {
            self.tail_at = None;
            return;
        }
        // Before the first round trip is measured, a guess well above loopback's.
        let base = self
            .srtt
            .map_or(TAIL_UNMEASURED, |s| (2 * s + ACK_DELAY).max(TAIL_MIN));
        // The first probes at that pace (a probe costs one packet), then slower.
        let wait = base.saturating_mul(1 << self.tail_probes.saturating_sub(2).min(8));
        self.tail_at = Some(now + wait.min(self.rto_interval()));
    }
}

/// A datagram to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// Destination address and port.
    pub dest: SocketAddr,
    /// Source address it leaves from (part of the ICRC).
    pub src: IpAddr,
    /// Source UDP port it must leave from (part of the ICRC).
    pub src_port: u16,
    /// Bytes written at the start of the buffer.
    pub len: usize,
}

/// One RoCE v2 endpoint: its queue pairs, completion queues and registered memory.
pub struct Engine {
    local_ip: IpAddr,
    port: u16,
    qps: Vec<Option<Qp>>,
    cqs: Vec<VecDeque<Wc>>,
    /// Destroyed completion queues, reused by `create_cq`.
    free_cqs: Vec<CqId>,
    /// Registered memory.
    pub mrs: MrTable,
    rr: usize,
    stats: Stats,
    qpn_gen: u32,
}

fn access_nak(e: AccessError) -> NakCode {
    match e {
        AccessError::BadKey | AccessError::OutOfBounds | AccessError::Denied => {
            NakCode::RemoteAccessError
        }
    }
}

impl Engine {
    /// An engine receiving on `local_ip`:`port`.
    pub fn new(local_ip: IpAddr, port: u16) -> Engine {
        Engine {
            local_ip,
            port,
            qps: Vec::new(),
            cqs: Vec::new(),
            free_cqs: Vec::new(),
            mrs: MrTable::default(),
            rr: 0,
            stats: Stats::default(),
            qpn_gen: 0,
        }
    }

    /// Counters.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Local address and RoCE port.
    pub fn local(&self) -> SocketAddr {
        SocketAddr::new(self.local_ip, self.port)
    }

    /// Create a completion queue.
    pub fn create_cq(&mut self) -> CqId {
        if let Some(cq) = self.free_cqs.pop() {
            return cq;
        }
        self.cqs.push(VecDeque::with_capacity(4 * QUEUE_HINT));
        self.cqs.len() - 1
    }

    /// Destroy a completion queue no QP uses any more (its slot is reused).
    pub fn destroy_cq(&mut self, cq: CqId) {
        if let Some(q) = self.cqs.get_mut(cq) {
            if !self.free_cqs.contains(&cq) {
                q.clear();
                self.free_cqs.push(cq);
            }
        }
    }

    /// Completions waiting in `cq`.
    pub fn cq_len(&self, cq: CqId) -> usize {
        self.cqs.get(cq).map_or(0, VecDeque::len)
    }

    /// Queue pairs that exist (closing ones included).
    pub fn qp_count(&self) -> usize {
        self.qps.iter().flatten().count()
    }

    /// Whether closed QP `qpn` is done: nothing left to deliver (or failed), and no packet
    /// for it within `quiet` (the peer's retransmissions of what it lost have stopped).
    pub fn closed_and_quiet(&self, qpn: Qpn, now: Instant, quiet: Duration) -> bool {
        let Some(q) = self
            .qps
            .get((qpn & 0xfff) as usize)
            .and_then(|q| q.as_ref())
            .filter(|q| q.qpn == qpn)
        else {
            return true;
        };
        q.closing
            && (q.sq.is_empty() || q.state == QpState::Error)
            && q.last_rx
                .map_or(true, |t| now.saturating_duration_since(t) >= quiet)
    }

    /// Take up to `out.len()` completions.
    pub fn poll_cq(&mut self, cq: CqId, out: &mut [Wc]) -> usize {
        let Some(q) = self.cqs.get_mut(cq) else {
            return 0;
        };
        let n = out.len().min(q.len());
        for (o, w) in out.iter_mut().zip(q.drain(..n)) {
            *o = w;
        }
        n
    }

    /// Create a QP in RESET whose packets leave from UDP port `src_port`.
    pub fn create_qp(&mut self, send_cq: CqId, recv_cq: CqId, src_port: u16) -> Result<Qpn> {
        self.create_qp_gen(send_cq, recv_cq, src_port, None)
    }

    /// [`Engine::create_qp`] with the QPN's generation bits given (`None`: random).
    fn create_qp_gen(
        &mut self,
        send_cq: CqId,
        recv_cq: CqId,
        src_port: u16,
        generation: Option<u32>,
    ) -> Result<Qpn> {
        if send_cq >= self.cqs.len() || recv_cq >= self.cqs.len() {
            return Err(Error::arg("create_qp: unknown completion queue"));
        }
        let slot = self
            .qps
            .iter()
            .position(Option::is_none)
            .unwrap_or_else(|| {
                self.qps.push(None);
                self.qps.len() - 1
            });
        // A generation from the OS random source (unlike the last one), so that stale
        // packets miss new QPs and a stranger cannot guess a QP's number from another's.
        let mut r = [0u8; 4];
        let drawn = getrandom::getrandom(&mut r).map(|()| u32::from_le_bytes(r) & 0xfff);
        let next = match (generation, drawn) {
            (Some(g), _) => g,
            (None, Ok(g)) if g != self.qpn_gen & 0xfff => g,
            _ => self.qpn_gen.wrapping_add(1),
        };
        self.qpn_gen = next;
        // Low 12 bits: the slot; high bits: a generation, so stale packets miss new QPs.
        let qpn = ((self.qpn_gen & 0xfff) << 12 | slot as u32) & PSN_MASK;
        let qpn = if qpn < 2 { qpn | 0x1000 } else { qpn }; // QPs 0 and 1 are special in IB
        if slot >= 0x1000 {
            return Err(Error::arg("too many queue pairs"));
        }
        self.qps[slot] = Some(Qp {
            qpn,
            state: QpState::Reset,
            send_cq,
            recv_cq,
            src_port,
            src_ip: None,
            attr: QpAttr::default(),
            sq: VecDeque::with_capacity(QUEUE_HINT),
            next_psn: 0,
            tx_wqe: 0,
            tx_pkt: 0,
            retry_left: 0,
            rnr_left: 0,
            backoff: 0,
            progress_at: None,
            rto: None,
            rnr_until: None,
            sent_hi: 0,
            acked: 0,
            last_nak: None,
            resend: VecDeque::with_capacity(RESEND_MAX),
            srtt: None,
            rttvar: Duration::ZERO,
            probe: None,
            tail_at: None,
            tail_probes: 0,
            slack: Slack::default(),
            resent: 0,
            spurious: 0,
            timed_out: None,
            recent: [Resent::default(); RECENT],
            reorder: Reorder::default(),
            cwnd: WINDOW,
            rq: VecDeque::with_capacity(QUEUE_HINT),
            epsn: 0,
            msn: 0,
            in_send: None,
            in_write: None,
            nak_sent: false,
            oos_since_nak: 0,
            closing: false,
            last_rx: None,
            ctrl: None,
            holes: VecDeque::new(),
            dups: 0,
            dup_lo: 0,
            dup_gap: Duration::ZERO,
            advanced_at: None,
            reported: [None; RECENT],
            ack_due: None,
            reads: VecDeque::new(),
        });
        Ok(qpn)
    }

    fn qp(&mut self, qpn: Qpn) -> Result<&mut Qp> {
        self.qps
            .get_mut((qpn & 0xfff) as usize)
            .and_then(|q| q.as_mut())
            .filter(|q| q.qpn == qpn)
            .ok_or_else(|| Error::arg(format!("no queue pair {qpn:#x}")))
    }

    /// Whether QP `qpn` has no send left unacknowledged (an unknown QP has none).
    pub fn sends_acknowledged(&mut self, qpn: Qpn) -> bool {
        self.qp(qpn).map_or(true, |q| q.sq.is_empty())
    }

    /// A QP's smoothed round-trip time (from acknowledged sends; `None` before the first).
    pub fn qp_rtt(&mut self, qpn: Qpn) -> Option<Duration> {
        self.qp(qpn).ok().and_then(|q| q.srtt)
    }

    /// State of a QP.
    pub fn qp_state(&mut self, qpn: Qpn) -> Result<QpState> {
        Ok(self.qp(qpn)?.state)
    }

    /// Destroy a QP (no completions for what was outstanding).
    pub fn destroy_qp(&mut self, qpn: Qpn) -> Result<()> {
        self.qp(qpn)?;
        self.qps[(qpn & 0xfff) as usize] = None;
        Ok(())
    }

    /// Close a QP gracefully: it keeps delivering the requests posted on it until they are
    /// acknowledged (or fail at the retry deadline; a request whose memory was deregistered
    /// meanwhile is given up), and keeps acknowledging what the peer sends — its
    /// retransmissions of what we received (the peer may have lost our last ACK: TCP's
    /// TIME_WAIT, for RC) and new requests, which are discarded. Its completions go
    /// nowhere. Destroy it once [`Engine::closed_and_quiet`].
    pub fn close_qp(&mut self, qpn: Qpn, now: Instant) -> Result<()> {
        let qp = self.qp(qpn)?;
        qp.closing = true;
        // Reads would write into memory the owner may free now: given up.
        qp.sq.retain(|w| !w.done && w.wr.opcode != WrOpcode::Read);
        qp.reads.clear();
        qp.tx_wqe = 0;
        qp.tx_pkt = 0;
        let una = qp.una();
        Self::rewind(qp, una);
        if qp.sq.is_empty() {
            qp.rto = None;
        }
        qp.rnr_until = None;
        qp.last_rx = Some(now);
        Ok(())
    }

    /// True if any QP is closing (see [`Engine::close_qp`]).
    pub fn has_closing(&self) -> bool {
        self.qps.iter().flatten().any(|q| q.closing)
    }

    /// True if a closing QP still has inline sends to deliver.
    pub fn closing_busy(&self) -> bool {
        self.qps
            .iter()
            .flatten()
            .any(|q| q.closing && !q.sq.is_empty() && q.state != QpState::Error)
    }

    /// Move a QP to `to`, taking the attributes that transition needs (RESET→INIT,
    /// INIT→RTR: mtu, dest, dest_qpn, rq_psn, min_rnr_timer; RTR→RTS: sq_psn, timeout,
    /// retry_cnt, rnr_retry; any→ERROR; any→RESET).
    pub fn modify_qp(&mut self, qpn: Qpn, to: QpState, attr: &QpAttr) -> Result<()> {
        let qp = self.qp(qpn)?;
        let from = qp.state;
        let bad = || {
            Err(Error::InvalidUsage(format!(
                "modify_qp({qpn:#x}): no transition from {from:?} to {to:?} (RESET → INIT → RTR → RTS; any → ERROR or RESET)"
            )))
        };
        match (from, to) {
            (QpState::Reset, QpState::Init) => {}
            (QpState::Init, QpState::Rtr) => {
                if ![256, 512, 1024, 2048, 4096].contains(&attr.mtu) {
                    return Err(Error::arg(format!(
                        "path MTU {} is not one of 256, 512, 1024, 2048, 4096",
                        attr.mtu
                    )));
                }
                qp.attr.mtu = attr.mtu;
                qp.attr.dest = attr.dest;
                qp.attr.dest_qpn = attr.dest_qpn & PSN_MASK;
                qp.attr.min_rnr_timer = attr.min_rnr_timer;
                qp.epsn = attr.rq_psn & PSN_MASK;
            }
            (QpState::Rtr, QpState::Rts) => {
                qp.attr.timeout = attr.timeout.clamp(1, 31);
                qp.attr.retry_cnt = attr.retry_cnt.min(7);
                qp.attr.rnr_retry = attr.rnr_retry.min(7);
                qp.attr.retry_for = attr.retry_for;
                qp.attr.selective = attr.selective;
                qp.next_psn = attr.sq_psn & PSN_MASK;
                qp.sent_hi = qp.next_psn;
                qp.acked = qp.next_psn;
                qp.retry_left = qp.attr.retry_cnt;
                qp.rnr_left = qp.attr.rnr_retry;
            }
            (_, QpState::Error) => {
                self.fail_qp(qpn, None);
                return Ok(());
            }
            (_, QpState::Reset) => {
                let qp = self.qp(qpn)?;
                let (scq, rcq, port) = (qp.send_cq, qp.recv_cq, qp.src_port);
                self.qps[(qpn & 0xfff) as usize] = None;
                let n = self.create_qp_at(qpn, scq, rcq, port);
                debug_assert_eq!(n, qpn);
                return Ok(());
            }
            _ => return bad(),
        }
        self.qp(qpn)?.state = to;
        Ok(())
    }

    fn create_qp_at(&mut self, qpn: Qpn, scq: CqId, rcq: CqId, port: u16) -> Qpn {
        let saved = self.qpn_gen;
        let n = self
            .create_qp_gen(scq, rcq, port, Some(qpn >> 12))
            .unwrap_or(qpn);
        self.qpn_gen = saved;
        n
    }

    /// Post a send work request (RTS only; on an ERROR QP it completes with WR_FLUSH_ERR).
    pub fn post_send(&mut self, qpn: Qpn, wr: &SendWr) -> Result<()> {
        let len = wr.sge.map_or(0, |s| s.len);
        let mut inline = [0u8; MAX_INLINE];
        if wr.inline {
            if len as usize > MAX_INLINE {
                return Err(Error::arg(format!(
                    "inline data of {len} bytes exceeds {MAX_INLINE}"
                )));
            }
            if let Some(s) = wr.sge {
                let data = self
                    .mrs
                    .read(s.lkey, s.addr, len as usize, Access::default())
                    .map_err(|e| {
                        Error::arg(format!("inline data not in a registered region: {e:?}"))
                    })?;
                inline[..len as usize].copy_from_slice(data);
            }
        } else if let Some(s) = wr.sge {
            let need = if wr.opcode == WrOpcode::Read {
                Access::LOCAL_WRITE
            } else {
                Access::default()
            };
            if self.mrs.check(s.lkey, s.addr, len as usize, need).is_err() {
                let qp = self.qp(qpn)?;
                let cq = qp.send_cq;
                let c = Wc {
                    wr_id: wr.wr_id,
                    status: WcStatus::LocProtErr,
                    opcode: wc_op(wr.opcode),
                    byte_len: 0,
                    imm: None,
                    qpn,
                };
                self.cqs[cq].push_back(c);
                self.fail_qp(qpn, None);
                return Ok(());
            }
        }
        let qp = self.qp(qpn)?;
        match qp.state {
            QpState::Rts => {}
            QpState::Error => {
                let cq = qp.send_cq;
                let c = Wc {
                    wr_id: wr.wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: wc_op(wr.opcode),
                    byte_len: 0,
                    imm: None,
                    qpn,
                };
                self.cqs[cq].push_back(c);
                return Ok(());
            }
            s => {
                return Err(Error::InvalidUsage(format!(
                    "post_send on QP {qpn:#x} in state {s:?}: it must be in RTS"
                )))
            }
        }
        let mtu = qp.mtu();
        let npkts = len.div_ceil(mtu).max(1);
        let psn = qp.next_psn;
        qp.next_psn = psn_add(psn, npkts);
        if qp.sq.iter().all(|w| w.done) {
            qp.rto = None; // restarted below by transmission
            qp.progress_at = None; // set at the first transmission
            qp.backoff = 0;
        }
        qp.sq.push_back(SendWqe {
            wr: *wr,
            inline,
            len,
            psn,
            npkts,
            done: false,
            resp: 0,
        });
        Ok(())
    }

    /// Post a receive work request (INIT, RTR or RTS).
    pub fn post_recv(&mut self, qpn: Qpn, wr: &RecvWr) -> Result<()> {
        if let Some(s) = wr.sge {
            if self
                .mrs
                .check(s.lkey, s.addr, s.len as usize, Access::LOCAL_WRITE)
                .is_err()
            {
                return Err(Error::arg(format!(
                    "post_recv: buffer {:#x}+{} is not inside a region with local write access (lkey {:#x})",
                    s.addr, s.len, s.lkey
                )));
            }
        }
        let qp = self.qp(qpn)?;
        match qp.state {
            QpState::Init | QpState::Rtr | QpState::Rts => {
                qp.rq.push_back(RecvWqe { wr: *wr });
                Ok(())
            }
            QpState::Error => {
                let cq = qp.recv_cq;
                self.cqs[cq].push_back(Wc {
                    wr_id: wr.wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: WcOpcode::Recv,
                    byte_len: 0,
                    imm: None,
                    qpn,
                });
                Ok(())
            }
            QpState::Reset => Err(Error::InvalidUsage(format!(
                "post_recv on QP {qpn:#x} in RESET: move it to INIT first"
            ))),
        }
    }

    /// Put a QP in ERROR: `first` completes with its own status, every other outstanding
    /// request with WR_FLUSH_ERR.
    fn fail_qp(&mut self, qpn: Qpn, first: Option<WcStatus>) {
        let Ok(qp) = self.qp(qpn) else { return };
        qp.state = QpState::Error;
        let (scq, rcq) = (qp.send_cq, qp.recv_cq);
        let sq: Vec<SendWqe> = qp.sq.drain(..).collect();
        let rq: Vec<RecvWqe> = qp.rq.drain(..).collect();
        let in_send = qp.in_send.take();
        qp.reads.clear();
        qp.in_write = None;
        qp.rto = None;
        qp.rnr_until = None;
        let mut first = first;
        for w in sq.iter().filter(|w| !w.done || w.wr.signaled) {
            let status = if w.done {
                WcStatus::Success
            } else {
                first.take().unwrap_or(WcStatus::WrFlushErr)
            };
            self.cqs[scq].push_back(Wc {
                wr_id: w.wr.wr_id,
                status,
                opcode: wc_op(w.wr.opcode),
                byte_len: w.len,
                imm: None,
                qpn,
            });
        }
        for r in in_send.map(|s| s.wqe).into_iter().chain(rq) {
            self.cqs[rcq].push_back(Wc {
                wr_id: r.wr.wr_id,
                status: WcStatus::WrFlushErr,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: None,
                qpn,
            });
        }
    }

    /// Complete finished send WQEs at the head of the queue, in order.
    fn reap(&mut self, qpn: Qpn) {
        // The QP and the completion queues are borrowed apart: completions go straight to
        // the queue (no allocation per acknowledgement).
        let Some(qp) = self
            .qps
            .get_mut((qpn & 0xfff) as usize)
            .and_then(|q| q.as_mut())
            .filter(|q| q.qpn == qpn)
        else {
            return;
        };
        let Some(out) = self.cqs.get_mut(qp.send_cq) else {
            return;
        };
        while qp.sq.front().is_some_and(|w| w.done) {
            let w = qp.sq.pop_front().expect("front exists");
            if qp.tx_wqe == 0 {
                // The cursor was inside this WQE (a retransmission it no longer needs):
                // continue with the next WQE from its first packet.
                qp.tx_pkt = 0;
            } else {
                qp.tx_wqe -= 1;
            }
            if w.wr.signaled {
                out.push_back(Wc {
                    wr_id: w.wr.wr_id,
                    status: WcStatus::Success,
                    opcode: wc_op(w.wr.opcode),
                    byte_len: w.len,
                    imm: None,
                    qpn,
                });
            }
        }
        if !qp.outstanding() {
            qp.rto = None;
            qp.tail_at = None;
        }
    }

    /// One line per QP with its protocol state (for debugging stalls).
    pub fn describe(&self, now: Instant) -> String {
        let mut out = String::new();
        for q in self.qps.iter().flatten() {
            out += &format!(
                "qp {:#x} {:?} -> {:#x}@{}: sq {} (tx {}+{}) next {:#x} acked {:#x} sent_hi {:#x} cwnd {} rto {:?} rnr {:?} | epsn {:#x} rq {} ctrl {:?} nak_sent {} reads {} in_write {}\n",
                q.qpn,
                q.state,
                q.attr.dest_qpn,
                q.attr.dest,
                q.sq.len(),
                q.tx_wqe,
                q.tx_pkt,
                q.next_psn,
                q.acked,
                q.sent_hi,
                q.cwnd,
                q.rto.map(|t| t.saturating_duration_since(now)),
                q.rnr_until.map(|t| t.saturating_duration_since(now)),
                q.epsn,
                q.rq.len(),
                q.ctrl.map(|c| (c.0.kind(), c.1)),
                q.nak_sent,
                q.reads.len(),
                q.in_write.is_some()
            );
        }
        out
    }

    /// The local address QP `qpn` sends from and receives on (an engine whose own address is
    /// unspecified receives on every address of its host: a switchless mesh, where each
    /// peer is reached on the subnet of the cable to it). Part of each packet's ICRC.
    pub fn set_qp_source(&mut self, qpn: Qpn, ip: IpAddr) -> Result<()> {
        self.qp(qpn)?.src_ip = Some(ip);
        Ok(())
    }

    /// The address a datagram was sent to: the engine's, or, when that is unspecified, the
    /// source address of the QP the datagram's BTH names (the ICRC covers it).
    fn datagram_dest(&self, data: &[u8]) -> IpAddr {
        if !self.local_ip.is_unspecified() {
            return self.local_ip;
        }
        self.datagram_qp(data)
            .and_then(|q| q.src_ip)
            .unwrap_or(self.local_ip)
    }

    /// The QP a datagram's BTH names, before the datagram is checked.
    fn datagram_qp(&self, data: &[u8]) -> Option<&Qp> {
        let b = data.get(5..8)?;
        let qpn = u32::from_be_bytes([0, b[0], b[1], b[2]]);
        self.qps
            .get((qpn & 0xfff) as usize)
            .and_then(|q| q.as_ref())
            .filter(|q| q.qpn == qpn)
    }

    /// Whether a datagram whose ICRC differs by `diff` from the one with IPv4 identification
    /// 0 is intact: only for a QP whose peer is a NIC (not this engine), which numbers its
    /// IPv4 packets as it likes; the identification is then solved from the ICRC.
    fn nic_icrc_holds(&self, data: &[u8], ip: &IpInfo, diff: u32) -> bool {
        let nic_peer = self.datagram_qp(data).is_some_and(|q| !q.attr.selective);
        nic_peer && wire::any_ipv4_id(ip, data.len() - 4, diff).is_some()
    }

    /// Process one received UDP datagram from `from` (sent to our port on `self.local_ip`,
    /// or on the address of the QP it names when that is unspecified).
    pub fn handle_datagram(&mut self, now: Instant, from: SocketAddr, data: &[u8]) {
        let ip = IpInfo {
            src: from.ip(),
            dst: self.datagram_dest(data),
            src_port: from.port(),
            dst_port: self.port,
        };
        let pkt = match wire::decode(data, &ip, true) {
            Ok(p) => p,
            Err(wire::DecodeError::BadIcrc { got, want })
                if self.nic_icrc_holds(data, &ip, got ^ want) =>
            {
                match wire::decode(data, &ip, false) {
                    Ok(p) => p,
                    Err(_) => {
                        self.stats.malformed += 1;
                        return;
                    }
                }
            }
            Err(wire::DecodeError::BadIcrc { .. }) => {
                self.stats.icrc_errors += 1;
                return;
            }
            Err(_) => {
                self.stats.malformed += 1;
                return;
            }
        };
        let qpn = pkt.bth.dest_qp;
        let Ok(qp) = self.qp(qpn) else {
            self.stats.malformed += 1;
            return;
        };
        if !matches!(qp.state, QpState::Rtr | QpState::Rts) {
            return;
        }
        if from.ip() != qp.attr.dest.ip() {
            self.stats.wrong_source += 1;
            return;
        }
        let op = pkt.bth.opcode;
        qp.last_rx = Some(now);
        if qp.closing && !matches!(op, Opcode::Ack | Opcode::Report) {
            if op.is_read_response() {
                return; // its reads were given up at close
            }
            // Re-acknowledge duplicates; acknowledge and discard new requests in sequence
            // (nothing lands in memory the owner freed, and a peer still writing to us —
            // credits, say — completes instead of retrying until its deadline).
            let d = psn_diff(pkt.bth.psn, qp.epsn);
            if d == 0 && op != Opcode::ReadRequest {
                qp.epsn = psn_add(qp.epsn, 1);
                if op.is_last() || op.is_only() {
                    qp.msn = (qp.msn + 1) & PSN_MASK;
                }
            }
            if d <= 0 {
                qp.ctrl = Some((Aeth::ack(qp.msn), psn_add(qp.epsn, PSN_MASK)));
            }
            self.stats.duplicates += u64::from(d < 0);
            self.stats.rx_packets += 1;
            return;
        }
        self.stats.rx_packets += 1;
        if matches!(op, Opcode::Ack | Opcode::Report) || op.is_read_response() {
            self.on_response(now, qpn, &pkt);
        } else {
            self.on_request(now, qpn, &pkt);
            self.replay(now, qpn);
        }
    }

    /// Process the kept out-of-order packets that are in sequence now; NAK the next gap at
    /// once if packets past it are kept (its packet was lost too).
    fn replay(&mut self, now: Instant, qpn: Qpn) {
        loop {
            let Ok(qp) = self.qp(qpn) else { return };
            let epsn = qp.epsn;
            let Some((kept, data)) = qp.reorder.take(epsn) else {
                let reported = qp.reported[epsn as usize % RECENT] == Some(epsn);
                if qp.reorder.beyond(epsn) && !qp.nak_sent && !reported {
                    qp.nak_sent = true;
                    qp.oos_since_nak = 0;
                    qp.ctrl = Some((Aeth::nak(qp.msn, NakCode::PsnSequenceError), epsn));
                }
                return;
            };
            self.on_request(now, qpn, &kept.packet(&data));
            let Ok(qp) = self.qp(qpn) else { return };
            qp.reorder.give_back(epsn, data);
            if qp.epsn == epsn {
                return; // not taken (no receive posted, an error): the requester resends
            }
        }
    }
}

fn wc_op(op: WrOpcode) -> WcOpcode {
    match op {
        WrOpcode::Send | WrOpcode::SendImm => WcOpcode::Send,
        WrOpcode::Write | WrOpcode::WriteImm => WcOpcode::RdmaWrite,
        WrOpcode::Read => WcOpcode::RdmaRead,
    }
}
