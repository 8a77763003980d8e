//! The responder side of the RC engine: requests in sequence land in memory and complete
//! receives; duplicates are re-acknowledged, gaps NAKed (and what follows them kept, see
//! `rdma::reorder`), missing receives answered with RNR NAKs.

use std::time::{Duration, Instant};

use super::reports::hole_report;
use super::{access_nak, psn_add, psn_diff, Engine, InSend, InWrite, Qp, Qpn, ReadJob};
use super::{Wc, WcOpcode, WcStatus, ACK_DELAY, HOLES_MAX, NAK_REPEAT, PSN_MASK, RECENT};
use crate::rdma::mem::Access;
use crate::rdma::wire::{Aeth, NakCode, Opcode, Packet, Reth};

/// Most RDMA reads a QP's responder keeps queued for duplicate requests.
const MAX_QUEUED_READS: usize = 16;

impl Engine {
    /// Handles a request packet for QP `qpn`: a duplicate (below the expected PSN) is
    /// answered again, one past a gap is kept and the gap NAKed, and one in sequence lands
    /// as a SEND, an RDMA WRITE or an RDMA READ request and moves the expected PSN on.
    pub(super) fn on_request(&mut self, now: Instant, qpn: Qpn, pkt: &Packet) {
        let Ok(qp) = self.qp(qpn) else { return };
        let op = pkt.bth.opcode;
        let d = psn_diff(pkt.bth.psn, qp.epsn);
        let queued_reads = qp.reads.len();
        if d < 0 {
            self.stats.duplicates += 1;
            if op == Opcode::ReadRequest {
                self.repeat_read(qpn, pkt, queued_reads);
            } else {
                let qp = self.qp(qpn).expect("checked");
                Self::answer_duplicate(qp, now, pkt);
            }
            return;
        }
        if d > 0 {
            Self::keep_out_of_sequence(qp, pkt);
            self.stats.out_of_sequence += 1;
            return;
        }
        // In sequence.
        let psn = pkt.bth.psn;
        let mut end_of_message = op.is_last() || op.is_only();
        let landed = if op.is_send() {
            self.receive_send(qpn, pkt, end_of_message)
        } else if op.is_write() {
            self.receive_write(qpn, pkt, end_of_message)
        } else if op == Opcode::ReadRequest {
            end_of_message = false; // acknowledged by the responses
            self.accept_read_request(qpn, pkt)
        } else {
            self.nak(qpn, NakCode::InvalidRequest, None);
            false
        };
        if !landed {
            return;
        }
        let qp = self.qp(qpn).expect("checked");
        qp.epsn = psn_add(qp.epsn, 1);
        qp.advanced_at = Some(now);
        qp.nak_sent = false;
        if end_of_message {
            qp.msn = (qp.msn + 1) & PSN_MASK;
        }
        if pkt.bth.ack_req && op != Opcode::ReadRequest {
            qp.ctrl = Some((Aeth::ack(qp.msn), psn));
        } else if op != Opcode::ReadRequest && qp.ack_due.is_none() {
            qp.ack_due = Some(now + ACK_DELAY);
        }
    }

    /// A duplicate RDMA READ request: re-executes the read (its responses may have been
    /// lost), replacing any queued job for the same PSN, if its key still grants the access.
    /// Only while few reads are queued (`queued_reads`): a requester has at most a few
    /// outstanding (max_rd_atomic), and a stranger who guessed the QP and a key must not
    /// queue reads without bound. One dropped here is asked for again at the requester's
    /// next timeout.
    fn repeat_read(&mut self, qpn: Qpn, pkt: &Packet, queued_reads: usize) {
        if queued_reads >= MAX_QUEUED_READS {
            self.stats.duplicate_reads_dropped += 1;
            return;
        }
        if let Some(r) = pkt.reth {
            if self
                .mrs
                .check(r.rkey, r.va, r.dma_len as usize, Access::REMOTE_READ)
                .is_ok()
            {
                let qp = self.qp(qpn).expect("checked");
                qp.reads.retain(|j| j.psn != pkt.bth.psn);
                qp.reads.push_back(ReadJob {
                    psn: pkt.bth.psn,
                    va: r.va,
                    rkey: r.rkey,
                    len: r.dma_len,
                    sent: 0,
                });
            }
        }
    }

    /// A duplicate SEND or RDMA WRITE packet: counted for the duplicate report (selective
    /// mode), and answered with where this side is.
    fn answer_duplicate(qp: &mut Qp, now: Instant, pkt: &Packet) {
        if qp.attr.selective {
            // How long after the expected PSN last moved: about nothing when the
            // original and its resend waited for this side together (it was late to
            // answer), about a timeout when the acknowledgement of the original
            // was lost.
            let gap = qp
                .advanced_at
                .map_or(Duration::MAX, |t| now.saturating_duration_since(t));
            if qp.dups == 0 {
                (qp.dup_lo, qp.dup_gap) = (pkt.bth.psn, gap);
            } else if psn_diff(pkt.bth.psn, qp.dup_lo) < 0 {
                qp.dup_lo = pkt.bth.psn;
            }
            qp.dup_gap = qp.dup_gap.min(gap);
            qp.dups = qp.dups.saturating_add(1);
        }
        // Answer a duplicate with where we are — as a NAK while a sequence error is
        // outstanding, so a duplicate never hides the NAK the requester needs.
        qp.ctrl = Some(if qp.nak_sent {
            (Aeth::nak(qp.msn, NakCode::PsnSequenceError), qp.epsn)
        } else {
            (Aeth::ack(qp.msn), psn_add(qp.epsn, PSN_MASK))
        });
    }

    /// A request packet past the expected PSN: NAKs the gap (or repeats it), reports a new
    /// gap past what is kept (selective mode), counts a resend of a packet already kept as a
    /// duplicate, and keeps the packet until the gap fills.
    fn keep_out_of_sequence(qp: &mut Qp, pkt: &Packet) {
        Self::nak_gap(qp, pkt);
        // A gap past the highest packet kept so far (beyond the expected PSN, which the
        // NAK names): report it, so the requester resends every hole at once.
        if qp.attr.selective {
            let from = psn_add(qp.reorder.highest(qp.epsn).unwrap_or(qp.epsn), 1);
            let missing = psn_diff(pkt.bth.psn, from);
            if missing > 0 && qp.holes.len() < HOLES_MAX {
                let report = hole_report(from, missing as u32, pkt.bth.psn);
                qp.holes.push_back((report, from));
                qp.reported[from as usize % RECENT] = Some(from);
            }
        }
        if qp.attr.selective && qp.reorder.holds(pkt.bth.psn) {
            // A resend of a packet kept out of order: a duplicate too (not a late one:
            // its original did not wait for this side with it).
            if qp.dups == 0 {
                (qp.dup_lo, qp.dup_gap) = (pkt.bth.psn, Duration::MAX);
            }
            qp.dups = qp.dups.saturating_add(1);
        }
        qp.reorder.store(qp.epsn, pkt);
    }

    /// NAKs the first gap (at the expected PSN) once, and again every NAK_REPEAT
    /// out-of-sequence packets in case the NAK itself was lost (cheaper than waiting for the
    /// requester's timer); in selective mode the repeat is a hole report, which says which
    /// packet showed the gap.
    fn nak_gap(qp: &mut Qp, pkt: &Packet) {
        if !qp.nak_sent || qp.oos_since_nak >= NAK_REPEAT {
            if qp.nak_sent && qp.attr.selective {
                let end = qp.reorder.lowest(qp.epsn).unwrap_or(pkt.bth.psn);
                let missing = psn_diff(end, qp.epsn) as u32;
                if qp.holes.len() < HOLES_MAX {
                    let report = hole_report(qp.epsn, missing, pkt.bth.psn);
                    qp.holes.push_back((report, qp.epsn));
                }
            } else {
                qp.ctrl = Some((Aeth::nak(qp.msn, NakCode::PsnSequenceError), qp.epsn));
            }
            qp.nak_sent = true;
            qp.oos_since_nak = 0;
        }
        qp.oos_since_nak += 1;
    }

    /// A SEND packet in sequence: the first of a message takes a receive (or is answered
    /// with an RNR NAK if none is posted), its payload lands in the receive's buffer, and the
    /// last completes the receive. False if it was refused (a NAK or RNR NAK is queued).
    fn receive_send(&mut self, qpn: Qpn, pkt: &Packet, end_of_message: bool) -> bool {
        let op = pkt.bth.opcode;
        let qp = self.qp(qpn).expect("checked");
        if op.is_first() || op.is_only() {
            if qp.in_send.is_some() {
                self.nak(qpn, NakCode::InvalidRequest, None);
                return false;
            }
            let Some(wqe) = qp.rq.pop_front() else {
                self.rnr(qpn);
                return false;
            };
            qp.in_send = Some(InSend { wqe, off: 0 });
        }
        let Some(mut s) = qp.in_send.take() else {
            self.nak(qpn, NakCode::InvalidRequest, None);
            return false;
        };
        let cap = s.wqe.wr.sge.map_or(0, |g| g.len);
        let n = pkt.payload.len() as u32;
        if s.off + n > cap {
            let rcq = qp.recv_cq;
            self.cqs[rcq].push_back(Wc {
                wr_id: s.wqe.wr.wr_id,
                status: WcStatus::LocLenErr,
                opcode: WcOpcode::Recv,
                byte_len: s.off + n,
                imm: None,
                qpn,
            });
            self.nak(qpn, NakCode::InvalidRequest, None);
            return false;
        }
        if let Some(g) = s.wqe.wr.sge {
            let at = g.addr + s.off as u64;
            if self
                .mrs
                .write(g.lkey, at, pkt.payload, Access::LOCAL_WRITE)
                .is_err()
            {
                self.nak(qpn, NakCode::RemoteOperationalError, None);
                return false;
            }
        }
        s.off += n;
        let qp = self.qp(qpn).expect("checked");
        if end_of_message {
            let rcq = qp.recv_cq;
            let wc = Wc {
                wr_id: s.wqe.wr.wr_id,
                status: WcStatus::Success,
                opcode: WcOpcode::Recv,
                byte_len: s.off,
                imm: pkt.imm,
                qpn,
            };
            self.cqs[rcq].push_back(wc);
        } else {
            qp.in_send = Some(s);
        }
        true
    }

    /// An RDMA WRITE packet in sequence: the first of a message starts the write (checking
    /// its key), the payload lands in the target memory, and the last of a write with
    /// immediate data completes a receive (asked for before any data is written: an RNR NAK
    /// if none is posted). False if it was refused (a NAK or RNR NAK is queued).
    fn receive_write(&mut self, qpn: Qpn, pkt: &Packet, end_of_message: bool) -> bool {
        let op = pkt.bth.opcode;
        if (op.is_first() || op.is_only()) && !self.begin_write(qpn, pkt) {
            return false;
        }
        let qp = self.qp(qpn).expect("checked");
        if pkt.imm.is_some() && qp.rq.is_empty() {
            self.rnr(qpn); // the immediate needs a receive; data not written yet
            return false;
        }
        let Some(mut w) = qp.in_write.take() else {
            self.nak(qpn, NakCode::InvalidRequest, None);
            return false;
        };
        let n = pkt.payload.len() as u32;
        if n > w.left || (end_of_message && n != w.left) {
            self.nak(qpn, NakCode::InvalidRequest, None);
            return false;
        }
        if n > 0
            && self
                .mrs
                .write(w.rkey, w.va, pkt.payload, Access::REMOTE_WRITE)
                .is_err()
        {
            self.nak(qpn, NakCode::RemoteAccessError, None);
            return false;
        }
        w.va += n as u64;
        w.left -= n;
        let qp = self.qp(qpn).expect("checked");
        if end_of_message {
            if let Some(imm) = pkt.imm {
                let r = qp.rq.pop_front().expect("checked non-empty");
                let rcq = qp.recv_cq;
                let wc = Wc {
                    wr_id: r.wr.wr_id,
                    status: WcStatus::Success,
                    opcode: WcOpcode::RecvRdmaWithImm,
                    byte_len: w.total,
                    imm: Some(imm),
                    qpn,
                };
                self.cqs[rcq].push_back(wc);
            }
        } else {
            qp.in_write = Some(w);
        }
        true
    }

    /// The RETH of `pkt`, once its key grants `access` to the range it names; else a NAK
    /// is queued (invalid request without a RETH, the access error otherwise) and `None`.
    /// A zero-length range touches no memory: its key is not checked (IBTA).
    fn granted(&mut self, qpn: Qpn, pkt: &Packet, access: Access) -> Option<Reth> {
        let Some(r) = pkt.reth else {
            self.nak(qpn, NakCode::InvalidRequest, None);
            return None;
        };
        if r.dma_len > 0 {
            if let Err(e) = self.mrs.check(r.rkey, r.va, r.dma_len as usize, access) {
                self.nak(qpn, access_nak(e), None);
                return None;
            }
        }
        Some(r)
    }

    /// Starts the RDMA WRITE message whose first (or only) packet is `pkt`, once its RETH's
    /// key grants write access to the target range. False if it was refused (NAKed).
    fn begin_write(&mut self, qpn: Qpn, pkt: &Packet) -> bool {
        let Some(r) = self.granted(qpn, pkt, Access::REMOTE_WRITE) else {
            return false;
        };
        let qp = self.qp(qpn).expect("checked");
        qp.in_write = Some(InWrite {
            va: r.va,
            rkey: r.rkey,
            left: r.dma_len,
            total: r.dma_len,
        });
        true
    }

    /// An RDMA READ request in sequence: once its key grants read access, queues the read's
    /// responses and moves the expected PSN past all but the last of them (the caller moves
    /// it past that one). False if it was refused (NAKed).
    fn accept_read_request(&mut self, qpn: Qpn, pkt: &Packet) -> bool {
        let Some(r) = self.granted(qpn, pkt, Access::REMOTE_READ) else {
            return false;
        };
        let qp = self.qp(qpn).expect("checked");
        let n = r.dma_len.div_ceil(qp.mtu()).max(1);
        qp.reads.push_back(ReadJob {
            psn: pkt.bth.psn,
            va: r.va,
            rkey: r.rkey,
            len: r.dma_len,
            sent: 0,
        });
        qp.epsn = psn_add(qp.epsn, n - 1); // plus one below
        qp.msn = (qp.msn + 1) & PSN_MASK;
        true
    }

    fn rnr(&mut self, qpn: Qpn) {
        self.stats.rnr_naks_sent += 1;
        if let Ok(qp) = self.qp(qpn) {
            qp.ctrl = Some((Aeth::rnr_nak(qp.msn, qp.attr.min_rnr_timer), qp.epsn));
        }
    }

    /// NAK the expected PSN; fatal codes also put the responder QP in ERROR.
    fn nak(&mut self, qpn: Qpn, code: NakCode, _status: Option<WcStatus>) {
        if let Ok(qp) = self.qp(qpn) {
            qp.ctrl = Some((Aeth::nak(qp.msn, code), qp.epsn));
            qp.in_write = None;
        }
    }
}
