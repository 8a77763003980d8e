//! Transmission: acknowledgements, RDMA READ responses and requests (new, selectively
//! resent, or gone back N), one datagram per call.

use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

use super::reports::{dup_report, report_or_ack};
use super::{psn_add, psn_diff, Engine, Qp, Qpn, Resent, SendWqe, Stats, Transmit};
use super::{QpState, WrOpcode, ACK_EVERY, DUP_SYNDROME, RECENT};
use crate::rdma::mem::{Access, MrTable};
use crate::rdma::wire::{self, AckKind, Aeth, Bth, IpInfo, NakCode, Opcode, Packet, Reth};

impl Engine {
    /// Write the next datagram into `buf` (at least 4200 bytes for MTU 4096).
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<Transmit> {
        self.poll_transmit_segment(now, buf, 0)
    }

    /// Like [`Engine::poll_transmit`], for a datagram meant to leave as segment `seg` of a UDP
    /// GSO send (its ICRC covers IPv4 identification `seg`; see `wire::encode_segment`). A
    /// driver that then sends it at another position re-marks it with `wire::reseal`.
    pub fn poll_transmit_segment(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        seg: u8,
    ) -> Option<Transmit> {
        let n = self.qps.len();
        for k in 0..n {
            let slot = (self.rr + k) % n;
            if let Some(t) = self.transmit_from(slot, now, buf, seg) {
                self.rr = slot; // stay on this QP while it has data: fewer switches
                self.stats.tx_packets += 1;
                return Some(t);
            }
        }
        None
    }

    /// The next datagram of the QP in `slot`, if it has one to send now: its pending
    /// acknowledgement or report first, then an RDMA READ response, then a request (a
    /// selective retransmission, or the packet at the send cursor).
    fn transmit_from(
        &mut self,
        slot: usize,
        now: Instant,
        buf: &mut [u8],
        seg: u8,
    ) -> Option<Transmit> {
        let qp = self.qps.get_mut(slot)?.as_mut()?;
        if !matches!(qp.state, QpState::Rtr | QpState::Rts) {
            return None;
        }
        let frame = Frame::of(qp, self.local_ip, seg);
        if let Some((aeth, psn)) = Self::next_ack(qp) {
            return Self::transmit_ack(&mut self.stats, &frame, aeth, psn, buf);
        }
        if !qp.reads.is_empty() {
            return Self::transmit_read_response(qp, &self.mrs, &frame, buf);
        }
        Self::transmit_request(qp, &self.mrs, &mut self.stats, &frame, now, buf)
    }

    /// Takes the acknowledgement to send next off the QP's queues, with the PSN it names.
    /// The pending ACK or NAK comes first, but only after the responses of earlier reads, so
    /// that responses leave in PSN order as the requester expects. Then hole reports
    /// (selective mode), which follow the NAK of the first gap; then the count of duplicates
    /// received (selective mode).
    fn next_ack(qp: &mut Qp) -> Option<(Aeth, u32)> {
        let reads_first = match (qp.ctrl, qp.reads.front()) {
            (Some((_, c)), Some(j)) => psn_diff(j.psn, c) < 0,
            _ => false,
        };
        match qp.ctrl.filter(|_| !reads_first) {
            Some(c) => {
                qp.ctrl = None;
                qp.ack_due = None;
                Some(c)
            }
            None => qp.holes.pop_front().or_else(|| {
                (qp.dups > 0 && qp.ctrl.is_none()).then(|| {
                    let n = std::mem::take(&mut qp.dups);
                    let aeth = Aeth {
                        syndrome: DUP_SYNDROME,
                        msn: dup_report(n, qp.dup_gap),
                    };
                    (aeth, qp.dup_lo)
                })
            }),
        }
    }

    /// Encodes an ACK, NAK or report (`aeth` for PSN `psn`), counting the NAKs sent.
    fn transmit_ack(
        stats: &mut Stats,
        frame: &Frame,
        aeth: Aeth,
        psn: u32,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        match aeth.kind() {
            Some(AckKind::Nak(NakCode::PsnSequenceError)) => stats.seq_naks_sent += 1,
            Some(AckKind::Nak(_)) => stats.error_naks_sent += 1,
            _ => {}
        }
        let p = Packet {
            bth: frame.bth(report_or_ack(aeth.syndrome), psn, false),
            reth: None,
            imm: None,
            aeth: Some(aeth),
            payload: &[],
        };
        frame.encode(&p, buf)
    }

    /// Encodes the next response packet of the oldest queued RDMA READ, reading its payload
    /// from registered memory, and drops the read from the queue once its last response is
    /// out. `None` if nothing is queued or the memory can no longer be read.
    fn transmit_read_response(
        qp: &mut Qp,
        mrs: &MrTable,
        frame: &Frame,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        let j = qp.reads.front_mut()?;
        let mtu = qp.attr.mtu;
        let n = j.len.div_ceil(mtu).max(1);
        let off = j.sent * mtu;
        let len = (j.len - off.min(j.len)).min(mtu);
        let opcode = match (n, j.sent) {
            (1, _) => Opcode::ReadRespOnly,
            (_, 0) => Opcode::ReadRespFirst,
            (_, s) if s + 1 == n => Opcode::ReadRespLast,
            _ => Opcode::ReadRespMiddle,
        };
        let psn = psn_add(j.psn, j.sent);
        let (va, rkey) = (j.va + off as u64, j.rkey);
        j.sent += 1;
        if j.sent == n {
            qp.reads.pop_front();
        }
        let aeth = opcode.has_aeth().then(|| Aeth::ack(qp.msn));
        let payload = if len == 0 {
            &[][..]
        } else {
            mrs.read(rkey, va, len as usize, Access::REMOTE_READ).ok()?
        };
        let p = Packet {
            bth: frame.bth(opcode, psn, false),
            reth: None,
            imm: None,
            aeth,
            payload,
        };
        frame.encode(&p, buf)
    }

    /// Encodes the next request packet of a QP ready to send (in RTS, not waiting out an RNR
    /// NAK): a queued selective retransmission if there is one, else the packet at the send
    /// cursor while it fits in the congestion window. Updates the cursor, the
    /// retransmission bookkeeping and the timers.
    fn transmit_request(
        qp: &mut Qp,
        mrs: &MrTable,
        stats: &mut Stats,
        frame: &Frame,
        now: Instant,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        if qp.state != QpState::Rts || qp.rnr_until.is_some_and(|t| now < t) {
            return None;
        }
        let una = qp.una();
        let resend = Self::next_resend(qp, una);
        if resend.is_none() {
            Self::skip_acknowledged(qp, una);
        }
        let (wi, j) = resend.unwrap_or((qp.tx_wqe, qp.tx_pkt));
        let w = *qp.sq.get(wi)?;
        let pkt_psn = psn_add(w.psn, j);
        if resend.is_none() && psn_diff(pkt_psn, una) >= qp.cwnd as i32 {
            return None;
        }
        let req = if w.wr.opcode == WrOpcode::Read {
            read_request(&w, qp.attr.mtu)
        } else {
            send_or_write(&w, j, qp.attr.mtu, resend.is_some())
        };
        if resend.is_none() && psn_diff(pkt_psn, una) < 0 {
            return None;
        }
        Self::note_request_sent(qp, stats, pkt_psn, resend.is_some(), req.advance_wqe, now);
        let payload = Self::request_payload(qp, mrs, &w, req.payload_off, req.payload_len)?;
        let p = Packet {
            bth: frame.bth(req.opcode, pkt_psn, req.ack_req),
            reth: req.reth,
            imm: req.imm,
            aeth: None,
            payload,
        };
        frame.encode(&p, buf)
    }

    /// Takes the next selective retransmission off the QP's queue: the index of its WQE and
    /// the packet's index within it (the send cursor stays where it is). PSNs acknowledged
    /// meanwhile, or of no unfinished WQE, are skipped. A read request is re-sent whole, from
    /// the cursor: for one, this rewinds the cursor to it and returns `None`.
    fn next_resend(qp: &mut Qp, una: u32) -> Option<(usize, u32)> {
        while let Some(p) = qp.resend.pop_front() {
            if psn_diff(p, una) < 0 {
                continue; // acknowledged meanwhile
            }
            let Some(i) = qp.sq.iter().position(|w| {
                !w.done && psn_diff(p, w.psn) >= 0 && psn_diff(p, w.psn) < w.npkts as i32
            }) else {
                continue;
            };
            if qp.sq[i].wr.opcode == WrOpcode::Read {
                Self::rewind(qp, p);
                return None;
            }
            return Some((i, psn_diff(p, qp.sq[i].psn) as u32));
        }
        None
    }

    /// Moves the send cursor up to `una`, the oldest unacknowledged packet, if
    /// acknowledgements overtook it (after going back N, the responder acknowledges what it
    /// had kept), instead of waiting for the timer.
    fn skip_acknowledged(qp: &mut Qp, una: u32) {
        let behind = qp
            .sq
            .get(qp.tx_wqe)
            .is_some_and(|w| psn_diff(psn_add(w.psn, qp.tx_pkt), una) < 0);
        if behind {
            Self::rewind(qp, una);
        }
    }

    /// Records that request packet `pkt_psn` is going out: counts it as a retransmission if
    /// it lies below the highest PSN sent so far (else times it as a round-trip probe),
    /// remembers a selective resend or advances the send cursor, and starts the
    /// retransmission timer and the progress clock if they are not running.
    fn note_request_sent(
        qp: &mut Qp,
        stats: &mut Stats,
        pkt_psn: u32,
        resent: bool,
        advance_wqe: bool,
        now: Instant,
    ) {
        if psn_diff(pkt_psn, qp.sent_hi) < 0 {
            stats.retransmits += 1;
            qp.resent += 1;
            // Karn: no round trip from retransmitted packets, nor across a recovery (whose
            // acknowledgement waits for the hole to fill).
            qp.probe = None;
        } else {
            qp.sent_hi = psn_add(pkt_psn, 1);
            // Any new packet may be timed: unsignaled ones are acknowledged within
            // ACK_DELAY, which the timer's floor covers.
            if qp.probe.is_none() && qp.attr.selective {
                qp.probe = Some((pkt_psn, now));
            }
        }
        if resent {
            qp.recent[pkt_psn as usize % RECENT] = Resent {
                psn: pkt_psn,
                at: Some(now),
                mark: qp.sent_hi,
            };
        } else {
            if advance_wqe {
                qp.tx_wqe += 1;
                qp.tx_pkt = 0;
            } else {
                qp.tx_pkt += 1;
            }
            qp.arm_tail(now);
        }
        if qp.rto.is_none() {
            qp.rto = Some(now + qp.rto_interval());
        }
        if qp.progress_at.is_none() {
            qp.progress_at = Some(now);
        }
    }

    /// The `len` payload bytes at offset `off` of send WQE `w`: from its inline copy, or read
    /// from its registered buffer. `None` if that memory can no longer be read; when the QP
    /// is closing, its owner deregistered it after closing, so nothing can be delivered any
    /// more and the send queue is dropped.
    fn request_payload<'a>(
        qp: &mut Qp,
        mrs: &'a MrTable,
        w: &'a SendWqe,
        off: u32,
        len: u32,
    ) -> Option<&'a [u8]> {
        if w.wr.inline {
            return Some(&w.inline[off as usize..(off + len) as usize]);
        }
        let Some(s) = w.wr.sge.filter(|_| len > 0) else {
            return Some(&[]);
        };
        match mrs.read(s.lkey, s.addr + off as u64, len as usize, Access::default()) {
            Ok(p) => Some(p),
            Err(_) => {
                if qp.closing {
                    qp.sq.clear();
                    qp.rto = None;
                }
                None
            }
        }
    }
}

/// Where one QP's datagrams go and what all their headers share: the addresses the ICRC
/// covers, the peer's QP number, and the GSO segment they are encoded for.
struct Frame {
    ip: IpInfo,
    dest: SocketAddr,
    dest_qp: Qpn,
    seg: u8,
}

impl Frame {
    /// The framing of `qp`'s datagrams: from its own source address if it has one, else
    /// from `local_ip`, to its peer, encoded as GSO segment `seg`.
    fn of(qp: &Qp, local_ip: IpAddr, seg: u8) -> Frame {
        let dest = qp.attr.dest;
        Frame {
            ip: IpInfo {
                src: qp.src_ip.unwrap_or(local_ip),
                dst: dest.ip(),
                src_port: qp.src_port,
                dst_port: dest.port(),
            },
            dest,
            dest_qp: qp.attr.dest_qpn,
            seg,
        }
    }

    /// A base transport header to the peer's QP (default partition key, no migration or
    /// congestion marks).
    fn bth(&self, opcode: Opcode, psn: u32, ack_req: bool) -> Bth {
        Bth {
            opcode,
            solicited: false,
            mig_req: false,
            pad: 0,
            pkey: wire::DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp: self.dest_qp,
            ack_req,
            psn,
        }
    }

    /// Encodes `p` into `buf` and says where to send it; `None` if it cannot be encoded
    /// there (the buffer is too small).
    fn encode(&self, p: &Packet, buf: &mut [u8]) -> Option<Transmit> {
        let len = wire::encode_segment(p, &self.ip, self.seg, buf).ok()?;
        Some(Transmit {
            dest: self.dest,
            src: self.ip.src,
            src_port: self.ip.src_port,
            len,
        })
    }
}

/// What distinguishes one request packet: its opcode and optional headers, the slice of
/// its WQE's data it carries, whether it asks for an acknowledgement, and whether the send
/// cursor moves to the next WQE after it.
struct RequestShape {
    opcode: Opcode,
    payload_off: u32,
    payload_len: u32,
    reth: Option<Reth>,
    imm: Option<u32>,
    ack_req: bool,
    advance_wqe: bool,
}

/// The RDMA READ request of WQE `w`: one request for the responses not yet received, which
/// always asks for an acknowledgement and completes the WQE's transmission.
fn read_request(w: &SendWqe, mtu: u32) -> RequestShape {
    let off = w.resp * mtu;
    let reth = Reth {
        va: w.wr.remote_addr + off as u64,
        rkey: w.wr.rkey,
        dma_len: w.len - off.min(w.len),
    };
    RequestShape {
        opcode: Opcode::ReadRequest,
        payload_off: 0,
        payload_len: 0,
        reth: Some(reth),
        imm: None,
        ack_req: true,
        advance_wqe: true,
    }
}

/// Packet `j` of SEND or RDMA WRITE WQE `w` (`resent`: as a selective retransmission).
fn send_or_write(w: &SendWqe, j: u32, mtu: u32, resent: bool) -> RequestShape {
    let n = w.npkts;
    let off = j * mtu;
    let len = (w.len - off.min(w.len)).min(mtu);
    let opcode = send_or_write_opcode(w, j);
    let reth = opcode.has_reth().then_some(Reth {
        va: w.wr.remote_addr,
        rkey: w.wr.rkey,
        dma_len: w.len,
    });
    let imm = opcode.has_imm().then_some(w.wr.imm);
    // Ask for an acknowledgement at the end of every message, and every ACK_EVERY packets
    // of a stream (to move the window); this engine's responder acknowledges the rest
    // within ACK_DELAY, coalesced. A NIC's responder (Linux rxe, for one) acknowledges only
    // what asks. Not only where the sender waits for the completion: the receiving
    // application may leave the engine alone right after the message (a model computing
    // between two all-reduces), and an acknowledgement delayed until it comes back drew the
    // sender's tail-loss probe, a resent packet, in 7 % of 4 KiB all-reduces 1.5 ms apart.
    // A selective retransmission fills a gap: acknowledge it at once.
    let ack_req = j + 1 == n || (psn_add(w.psn, j) % ACK_EVERY) == ACK_EVERY - 1 || resent;
    RequestShape {
        opcode,
        payload_off: off,
        payload_len: len,
        reth,
        imm,
        ack_req,
        advance_wqe: j + 1 == n,
    }
}

/// The opcode of packet `j` of SEND or RDMA WRITE WQE `w`: by its place in the message
/// (first, middle, last or only) and whether the message carries immediate data.
fn send_or_write_opcode(w: &SendWqe, j: u32) -> Opcode {
    let n = w.npkts;
    let is_send = matches!(w.wr.opcode, WrOpcode::Send | WrOpcode::SendImm);
    let with_imm = matches!(w.wr.opcode, WrOpcode::SendImm | WrOpcode::WriteImm);
    let pos = match (n, j) {
        (1, _) => 3, // only
        (_, 0) => 0, // first
        (_, j) if j + 1 == n => 2,
        _ => 1,
    };
    match (is_send, pos, with_imm) {
        (true, 0, _) => Opcode::SendFirst,
        (true, 1, _) => Opcode::SendMiddle,
        (true, 2, false) => Opcode::SendLast,
        (true, 2, true) => Opcode::SendLastImm,
        (true, _, false) => Opcode::SendOnly,
        (true, _, true) => Opcode::SendOnlyImm,
        (false, 0, _) => Opcode::WriteFirst,
        (false, 1, _) => Opcode::WriteMiddle,
        (false, 2, false) => Opcode::WriteLast,
        (false, 2, true) => Opcode::WriteLastImm,
        (false, _, false) => Opcode::WriteOnly,
        (false, _, true) => Opcode::WriteOnlyImm,
    }
}
