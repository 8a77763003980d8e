//! The responder side of the RC engine: requests in sequence land in memory and complete
//! receives; duplicates are re-acknowledged, gaps NAKed (and what follows them kept, see
//! `rdma::reorder`), missing receives answered with RNR NAKs.

use std::time::{Duration, Instant};

use super::reports::hole_report;
use super::{access_nak, psn_add, psn_diff, Engine, InSend, InWrite, Qpn, ReadJob};
use super::{Wc, WcOpcode, WcStatus, ACK_DELAY, HOLES_MAX, NAK_REPEAT, PSN_MASK, RECENT};
use crate::rdma::mem::Access;
use crate::rdma::wire::{Aeth, NakCode, Opcode, Packet};

/// Most RDMA reads a QP's responder keeps queued for duplicate requests.
const MAX_QUEUED_READS: usize = 16;

impl Engine {
    pub(super) fn on_request(&mut self, now: Instant, qpn: Qpn, pkt: &Packet) {
        let Ok(qp) = self.qp(qpn) else { return };
        let op = pkt.bth.opcode;
        let d = psn_diff(pkt.bth.psn, qp.epsn);
        let queued_reads = qp.reads.len();
        if d < 0 {
            self.stats.duplicates += 1;
            if op == Opcode::ReadRequest {
                // Re-execute the read (the responses may have been lost) — while few reads
                // are queued: a requester has at most a few outstanding (max_rd_atomic), and
                // a stranger who guessed the QP and a key must not queue reads without bound.
                // One dropped here is asked for again at the requester's next timeout.
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
            } else {
                let qp = self.qp(qpn).expect("checked");
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
            return;
        }
        if d > 0 {
            // NAK the first gap once, and again every NAK_REPEAT out-of-sequence packets in
            // case the NAK itself was lost (cheaper than waiting for the requester's timer).
            if !qp.nak_sent || qp.oos_since_nak >= NAK_REPEAT {
                if qp.nak_sent && qp.attr.selective {
                    // Repeat as a hole report, which says which packet showed the gap.
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
            self.stats.out_of_sequence += 1;
            return;
        }
        // In sequence.
        let psn = pkt.bth.psn;
        let mut end_of_message = op.is_last() || op.is_only();
        if op.is_send() {
            if op.is_first() || op.is_only() {
                if qp.in_send.is_some() {
                    return self.nak(qpn, NakCode::InvalidRequest, None);
                }
                let Some(wqe) = qp.rq.pop_front() else {
                    return self.rnr(qpn);
                };
                qp.in_send = Some(InSend { wqe, off: 0 });
            }
            let Some(mut s) = qp.in_send.take() else {
                return self.nak(qpn, NakCode::InvalidRequest, None);
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
                return self.nak(qpn, NakCode::InvalidRequest, None);
            }
            if let Some(g) = s.wqe.wr.sge {
                if self
                    .mrs
                    .write(
                        g.lkey,
                        g.addr + s.off as u64,
                        pkt.payload,
                        Access::LOCAL_WRITE,
                    )
                    .is_err()
                {
                    return self.nak(qpn, NakCode::RemoteOperationalError, None);
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
        } else if op.is_write() {
            if op.is_first() || op.is_only() {
                let Some(r) = pkt.reth else {
                    return self.nak(qpn, NakCode::InvalidRequest, None);
                };
                // A zero-length write touches no memory: its rkey is not checked (IBTA).
                if r.dma_len > 0 {
                    if let Err(e) =
                        self.mrs
                            .check(r.rkey, r.va, r.dma_len as usize, Access::REMOTE_WRITE)
                    {
                        return self.nak(qpn, access_nak(e), None);
                    }
                }
                let qp = self.qp(qpn).expect("checked");
                qp.in_write = Some(InWrite {
                    va: r.va,
                    rkey: r.rkey,
                    left: r.dma_len,
                    total: r.dma_len,
                });
            }
            let qp = self.qp(qpn).expect("checked");
            if pkt.imm.is_some() && qp.rq.is_empty() {
                return self.rnr(qpn); // the immediate needs a receive; data not written yet
            }
            let Some(mut w) = qp.in_write.take() else {
                return self.nak(qpn, NakCode::InvalidRequest, None);
            };
            let n = pkt.payload.len() as u32;
            if n > w.left || (end_of_message && n != w.left) {
                return self.nak(qpn, NakCode::InvalidRequest, None);
            }
            if n > 0
                && self
                    .mrs
                    .write(w.rkey, w.va, pkt.payload, Access::REMOTE_WRITE)
                    .is_err()
            {
                return self.nak(qpn, NakCode::RemoteAccessError, None);
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
        } else if op == Opcode::ReadRequest {
            let Some(r) = pkt.reth else {
                return self.nak(qpn, NakCode::InvalidRequest, None);
            };
            if r.dma_len > 0 {
                if let Err(e) =
                    self.mrs
                        .check(r.rkey, r.va, r.dma_len as usize, Access::REMOTE_READ)
                {
                    return self.nak(qpn, access_nak(e), None);
                }
            }
            let qp = self.qp(qpn).expect("checked");
            let n = r.dma_len.div_ceil(qp.mtu()).max(1);
            qp.reads.push_back(ReadJob {
                psn,
                va: r.va,
                rkey: r.rkey,
                len: r.dma_len,
                sent: 0,
            });
            qp.epsn = psn_add(qp.epsn, n - 1); // plus one below
            qp.msn = (qp.msn + 1) & PSN_MASK;
            end_of_message = false; // acknowledged by the responses
        } else {
            return self.nak(qpn, NakCode::InvalidRequest, None);
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
