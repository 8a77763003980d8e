//! The requester side of the RC engine: acknowledgements, NAKs and read responses
//! complete send work requests in order, start retransmissions and restart the retry budget.

use std::time::Instant;

use super::reports::{read_dup_report, read_hole_report, LATE_GAP};
use super::{psn_add, psn_diff, rnr_delay, Engine, Qp, Qpn, MIN_WINDOW, WINDOW};
use super::{WcStatus, WrOpcode, DUP_SYNDROME, HOLE_SYNDROME};
use crate::rdma::mem::Access;
use crate::rdma::wire::{AckKind, Aeth, NakCode, Opcode, Packet};

impl Engine {
    /// A duplicate report: that many retransmissions were of packets that had arrived (at
    /// most what this QP resent and is not yet known spurious); if they start where the last
    /// timeout resent and came with their originals, the timeout fired too early.
    fn on_dup_report(&mut self, now: Instant, qpn: Qpn, psn: u32, aeth: Aeth) {
        let Ok(qp) = self.qp(qpn) else { return };
        if !qp.attr.selective {
            return;
        }
        let (n, gap) = read_dup_report(aeth.msn);
        let n = u64::from(n).min(qp.resent - qp.spurious);
        qp.spurious += n;
        let early = n > 0 && gap < LATE_GAP;
        if let Some((_, at)) = qp.timed_out.filter(|&(p, _)| early && p == psn) {
            qp.timed_out = None;
            qp.slack.spurious(now, now.saturating_duration_since(at));
        }
        self.stats.spurious_retransmits += n;
    }

    /// Handles a response packet for QP `qpn`: a report (duplicate or hole), an RDMA READ
    /// response, or an ACK or NAK of what is outstanding (one for a PSN not outstanding is
    /// dropped as a ghost).
    pub(super) fn on_response(&mut self, now: Instant, qpn: Qpn, pkt: &Packet) {
        let Ok(qp) = self.qp(qpn) else { return };
        let psn = pkt.bth.psn;
        // Reports come only in the report opcode (an ACK with a reserved syndrome is no
        // report, whoever sent it); one of a kind this engine does not know is ignored.
        let report = pkt.aeth.filter(|_| pkt.bth.opcode == Opcode::Report);
        match report {
            Some(a) if a.syndrome == DUP_SYNDROME => return self.on_dup_report(now, qpn, psn, a),
            Some(a) if a.syndrome != HOLE_SYNDROME => return,
            _ => {}
        }
        // The peer answers, so it will report what it misses: the tail-loss probe waits
        // for it to fall silent (resends queued behind a long queue are not probed).
        qp.arm_tail(now);
        if pkt.bth.opcode.is_read_response() {
            return self.on_read_response(now, qpn, pkt);
        }
        let Some(aeth) = pkt.aeth else { return };
        let hole_report = report.is_some();
        if is_ghost(qp, psn, aeth) && !hole_report {
            self.stats.ghost_acks += 1;
            return;
        }
        if hole_report {
            return Self::on_hole_report(qp, now, psn, aeth);
        }
        match aeth.kind() {
            Some(AckKind::RnrNak { .. }) => self.stats.rnr_naks_received += 1,
            Some(AckKind::Nak(NakCode::PsnSequenceError)) => self.stats.seq_naks_received += 1,
            Some(AckKind::Nak(_)) => self.stats.error_naks_received += 1,
            _ => {}
        }
        match aeth.kind() {
            Some(AckKind::Ack { .. }) => self.on_ack(now, qpn, psn),
            Some(AckKind::RnrNak { timer }) => self.on_rnr_nak(now, qpn, psn, timer),
            Some(AckKind::Nak(NakCode::PsnSequenceError)) => self.on_sequence_nak(now, qpn, psn),
            Some(AckKind::Nak(code)) => self.on_error_nak(qpn, psn, code),
            None => {}
        }
    }

    /// An RDMA READ response: accepted only as the next response of the oldest unfinished
    /// read (anything else waits for the retransmission timer). It implicitly acknowledges
    /// the sends and writes before the read, its payload lands in the read's buffer, and the
    /// last one finishes the read. A response of the wrong size or place, or one whose
    /// buffer cannot be written, fails the QP.
    fn on_read_response(&mut self, now: Instant, qpn: Qpn, pkt: &Packet) {
        let Ok(qp) = self.qp(qpn) else { return };
        let Some(i) = qp
            .sq
            .iter()
            .position(|w| !w.done && w.wr.opcode == WrOpcode::Read)
        else {
            return;
        };
        let w = qp.sq[i];
        if pkt.bth.psn != psn_add(w.psn, w.resp) {
            return;
        }
        // Everything before the read is implicitly acknowledged.
        for x in qp.sq.iter_mut().take(i) {
            x.done = true;
        }
        let mtu = qp.mtu();
        let off = w.resp * mtu;
        let expect = (w.len - off.min(w.len)).min(mtu) as usize;
        let last = w.resp + 1 == w.npkts;
        if pkt.payload.len() != expect
            || (last != (pkt.bth.opcode.is_last() || pkt.bth.opcode.is_only()))
        {
            self.fail_qp(qpn, Some(WcStatus::RemInvReqErr));
            return;
        }
        if let Some(s) = w.wr.sge {
            let at = s.addr + off as u64;
            if self
                .mrs
                .write(s.lkey, at, pkt.payload, Access::LOCAL_WRITE)
                .is_err()
            {
                self.fail_qp(qpn, Some(WcStatus::LocProtErr));
                return;
            }
        }
        let Ok(qp) = self.qp(qpn) else { return };
        let w = &mut qp.sq[i];
        w.resp += 1;
        if w.resp == w.npkts {
            w.done = true;
        }
        qp.progressed(now);
        self.reap(qpn);
    }

    /// A hole report: queues the missing packets it names for selective retransmission
    /// (it acknowledges nothing). Ignored outside selective mode.
    fn on_hole_report(qp: &mut Qp, now: Instant, psn: u32, aeth: Aeth) {
        if qp.attr.selective {
            qp.slack.lost(now);
            let (missing, shown_by) = read_hole_report(psn, aeth.msn);
            for k in 0..missing {
                qp.queue_resend(psn_add(psn, k), Some(shown_by), now);
            }
        }
    }

    /// An ACK of every send and write up to `psn`: completes them (reads finish only with
    /// their responses; completions are still reaped in order), takes a round-trip sample,
    /// and on progress opens the window and restarts the RNR retry budget.
    fn on_ack(&mut self, now: Instant, qpn: Qpn, psn: u32) {
        let Ok(qp) = self.qp(qpn) else { return };
        let mut progressed = false;
        if psn_diff(psn_add(psn, 1), qp.acked) > 0 && psn_diff(psn, qp.sent_hi) < 0 {
            qp.acked = psn_add(psn, 1);
            progressed = true;
        }
        for w in qp.sq.iter_mut().filter(|w| !w.done) {
            let last = psn_add(w.psn, w.npkts - 1);
            if psn_diff(psn, last) < 0 {
                break;
            }
            if w.wr.opcode != WrOpcode::Read {
                w.done = true;
                progressed = true;
            }
        }
        qp.rtt_sample(psn_add(psn, 1), now);
        if progressed {
            qp.cwnd = (qp.cwnd + 8).min(WINDOW);
            qp.rnr_left = qp.attr.rnr_retry;
            qp.progressed(now);
        }
        self.reap(qpn);
    }

    /// An RNR NAK at `psn` (the peer had no receive posted): acknowledges what precedes it,
    /// and goes back to `psn` after the peer's RNR timer `timer` — or fails the QP once the
    /// RNR retry budget is spent (a budget of 7 never runs out).
    fn on_rnr_nak(&mut self, now: Instant, qpn: Qpn, psn: u32, timer: u8) {
        let Ok(qp) = self.qp(qpn) else { return };
        if Self::ack_before(qp, psn) {
            qp.progressed(now);
        }
        if qp.rnr_left == 0 {
            self.reap(qpn);
            self.fail_qp(qpn, Some(WcStatus::RnrRetryExcErr));
            return;
        }
        if qp.attr.rnr_retry != 7 {
            qp.rnr_left -= 1;
        }
        qp.rnr_until = Some(now + rnr_delay(timer));
        qp.rto = None;
        Self::rewind(qp, psn);
        self.reap(qpn);
    }

    /// A PSN sequence-error NAK (the peer saw a gap at `psn`): it acknowledges everything
    /// before `psn`, progress like an ACK's, so the retry budget starts again. In selective
    /// mode the named packet alone is resent; otherwise the QP goes back N to it.
    fn on_sequence_nak(&mut self, now: Instant, qpn: Qpn, psn: u32) {
        let Ok(qp) = self.qp(qpn) else { return };
        if Self::ack_before(qp, psn) {
            qp.progressed(now);
        }
        qp.rtt_sample(psn, now);
        qp.slack.lost(now);
        if qp.attr.selective {
            // The responder keeps what came after the gap: resend just the packet it
            // names (again only if it names it once more a round trip later).
            if qp.queue_resend(psn, None, now) {
                qp.probe = None;
                qp.cwnd = (qp.cwnd - qp.cwnd / 8).max(MIN_WINDOW);
            }
        } else {
            Self::go_back_once(qp, psn);
        }
        self.reap(qpn);
    }

    /// Goes back N to `psn` and halves the window, once per round: NAKs for the same PSN
    /// that the responder sent before our retransmission reached it would restart the burst
    /// again and again. A repeat is acted on only once the previous retransmission has
    /// caught up with what had been sent.
    fn go_back_once(qp: &mut Qp, psn: u32) {
        let cursor = qp
            .sq
            .get(qp.tx_wqe)
            .map_or(qp.next_psn, |w| psn_add(w.psn, qp.tx_pkt));
        let repeating = qp.last_nak == Some(psn) && psn_diff(cursor, qp.sent_hi) < 0;
        if !repeating {
            qp.last_nak = Some(psn);
            qp.cwnd = (qp.cwnd / 2).max(MIN_WINDOW);
            Self::rewind(qp, psn);
        }
    }

    /// A NAK of an error (invalid request, remote access or remote operation) at `psn`:
    /// completes what it acknowledges before `psn`, then fails the QP with the matching
    /// completion status.
    fn on_error_nak(&mut self, qpn: Qpn, psn: u32, code: NakCode) {
        let Ok(qp) = self.qp(qpn) else { return };
        let _ = Self::ack_before(qp, psn);
        self.reap(qpn);
        let status = match code {
            NakCode::RemoteAccessError => WcStatus::RemAccessErr,
            NakCode::InvalidRequest => WcStatus::RemInvReqErr,
            _ => WcStatus::RemOpErr,
        };
        self.fail_qp(qpn, Some(status));
    }

    /// Mark every send/write that ends before `psn` acknowledged; true if that acknowledged
    /// anything new.
    fn ack_before(qp: &mut Qp, psn: u32) -> bool {
        let mut progressed = false;
        if psn_diff(psn, qp.acked) > 0 && psn_diff(psn, qp.sent_hi) <= 0 {
            qp.acked = psn;
            progressed = true;
        }
        for w in qp.sq.iter_mut().filter(|w| !w.done) {
            if w.wr.opcode == WrOpcode::Read || psn_diff(psn, psn_add(w.psn, w.npkts - 1)) <= 0 {
                break;
            }
            w.done = true;
            progressed = true;
        }
        progressed
    }
}

/// Whether an ACK or NAK for `psn` names nothing outstanding: an ACK of a PSN not sent yet,
/// or a NAK of one already acknowledged or not sent yet. Such a ghost (a stale or forged
/// packet) is dropped, as IBTA requires.
fn is_ghost(qp: &Qp, psn: u32, aeth: Aeth) -> bool {
    match aeth.kind() {
        Some(AckKind::Ack { .. }) => psn_diff(psn, qp.sent_hi) >= 0,
        Some(_) => psn_diff(psn, qp.acked) < 0 || psn_diff(psn, qp.sent_hi) >= 0,
        None => false,
    }
}
