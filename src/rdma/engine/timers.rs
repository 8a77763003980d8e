//! Timers of the RC engine: acknowledgement delays, RNR waits, tail-loss probes and the
//! retransmission timeout (which goes back N).

use super::*;

impl Engine {
    /// The next deadline, if any.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.qps
            .iter()
            .flatten()
            .flat_map(|q| [q.rto, q.rnr_until, q.ack_due, q.tail_at])
            .flatten()
            .min()
    }

    /// Advance timers to `now`: retransmit after a timeout or an RNR wait.
    pub fn handle_timeout(&mut self, now: Instant) {
        let (mut probes, mut timeouts) = (0, 0);
        for i in 0..self.qps.len() {
            let Some(qpn) = self.qps[i].as_ref().map(|q| q.qpn) else {
                continue;
            };
            let Ok(qp) = self.qp(qpn) else { continue };
            if qp.rnr_until.is_some_and(|t| now >= t) {
                qp.rnr_until = None;
            }
            if qp.ack_due.is_some_and(|t| now >= t) {
                qp.ack_due = None;
                if qp.ctrl.is_none() {
                    qp.ctrl = Some((Aeth::ack(qp.msn), psn_add(qp.epsn, PSN_MASK)));
                }
            }
            if qp.tail_at.is_some_and(|t| now >= t) {
                // Probe again, twice as late each time, until progress or a new packet
                // re-arms it from the start.
                qp.tail_probes = qp.tail_probes.saturating_add(1);
                qp.arm_tail(now);
                let una = qp.una();
                if qp.outstanding() && qp.queue_resend(una, None, now) {
                    probes += 1;
                }
            }
            if qp.rto.is_some_and(|t| now >= t) && qp.outstanding() {
                let exhausted = match qp.attr.retry_for {
                    // Retry until the deadline: `limit` without any progress.
                    Some(limit) => {
                        now.saturating_duration_since(*qp.progress_at.get_or_insert(now)) >= limit
                    }
                    None => qp.retry_left == 0,
                };
                if exhausted {
                    self.fail_qp(qpn, Some(WcStatus::RetryExcErr));
                    continue;
                }
                timeouts += 1;
                qp.retry_left = qp.retry_left.saturating_sub(1);
                qp.backoff = qp.backoff.saturating_add(1);
                qp.rto = Some(now + qp.rto_interval());
                qp.cwnd = MIN_WINDOW;
                qp.resend.clear(); // going back N resends them
                qp.tail_at = None;
                qp.probe = None;
                crate::info!(
                    "RoCE v2 QP {qpn:#x}: retransmission timeout ({} retries left, backoff {}): resending from PSN {:#x} (acked {:#x}, sent up to {:#x}, tx wqe {} pkt {}, sq {})",
                    qp.retry_left,
                    qp.backoff,
                    qp.una(),
                    qp.acked,
                    qp.sent_hi,
                    qp.tx_wqe,
                    qp.tx_pkt,
                    qp.sq.len()
                );
                Self::rewind(qp, qp.una());
            }
        }
        self.stats.tail_probes += probes;
        self.stats.timeouts += timeouts;
    }

    /// Go back to PSN `psn` (go-back-N).
    pub(super) fn rewind(qp: &mut Qp, psn: u32) {
        for (i, w) in qp.sq.iter().enumerate() {
            if w.done {
                continue;
            }
            let d = psn_diff(psn, w.psn);
            if d < w.npkts as i32 {
                qp.tx_wqe = i;
                qp.tx_pkt = if w.wr.opcode == WrOpcode::Read {
                    w.resp
                } else {
                    d.max(0) as u32
                };
                return;
            }
        }
    }
}
