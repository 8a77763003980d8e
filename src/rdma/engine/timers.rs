//! Timers of the RC engine: acknowledgement delays, RNR waits, tail-loss probes and the
//! retransmission timeout (which goes back N).

use std::time::{Duration, Instant};

use super::{psn_add, psn_diff, Engine, Qp, MAX_BACKOFF, MIN_WINDOW, PSN_MASK};
use super::{WcStatus, WrOpcode};
use crate::rdma::wire::Aeth;

/// How long [`Slack`] remembers a delay: it keeps the most of this window and the last.
const SLACK_WINDOW: Duration = Duration::from_secs(1);
/// The least step of a QP's slack when a retransmission timeout proves spurious.
const SPURIOUS_STEP: Duration = Duration::from_millis(1);

/// Extra wait before a retransmission timeout, on top of the measured round trip: the
/// longest delay seen in the current and the previous [`SLACK_WINDOW`]. It rises when the
/// peer reports that a timeout's resend reached it together with its original
/// ([`DUP_SYNDROME`]: the peer was descheduled, not the packet lost); it falls back within
/// two windows of quiet, so a peer that was busy for a moment does not keep slow loss
/// recovery, and to nothing when the peer reports a gap (a lossy path: a slack there cost
/// 1.2–1.3× at 10 % loss with 3 ranks on 2 cores). Tail-loss probes do not wait for it: a
/// probe costs one packet (going back N costs a window), and it is what recovers a lost
/// last packet quickly. (Raising it also when this host's own progress thread wakes late
/// cost 1.2–1.4× at 10 % loss with 3 ranks on 2 cores, and bought little beyond this.)
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Slack {
    current: Duration,
    previous: Duration,
    since: Option<Instant>,
}

impl Slack {
    /// The extra wait now.
    pub(super) fn get(&self) -> Duration {
        self.current.max(self.previous)
    }
    /// Start a new window if the current one is over.
    pub(super) fn roll(&mut self, now: Instant) {
        let Some(t) = self.since else {
            self.since = Some(now);
            return;
        };
        let age = now.saturating_duration_since(t);
        if age < SLACK_WINDOW {
            return;
        }
        self.previous = if age < 2 * SLACK_WINDOW {
            self.current
        } else {
            Duration::ZERO
        };
        self.current = Duration::ZERO;
        self.since = Some(now);
    }
    /// The peer reported a gap (a packet really lost): a timeout now is more likely a loss
    /// than a late peer, so the timer goes back to the round trip's.
    pub(super) fn lost(&mut self, now: Instant) {
        (self.current, self.previous, self.since) = (Duration::ZERO, Duration::ZERO, Some(now));
    }
    /// A timeout's resend proved spurious, reported `after` the timeout (about how much
    /// later than the timer the acknowledgement came): wait twice the larger of that and
    /// the slack so far (at least [`SPURIOUS_STEP`], at most [`MAX_BACKOFF`]).
    pub(super) fn spurious(&mut self, now: Instant, after: Duration) {
        self.roll(now);
        let d = (2 * self.get().max(after)).max(SPURIOUS_STEP);
        self.current = self.current.max(d.min(MAX_BACKOFF));
    }
}

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
                // The first timeout at this PSN: a report measures the whole stall from it.
                let una = qp.una();
                qp.timed_out = match qp.timed_out {
                    Some((p, at)) if p == una => Some((p, at)),
                    _ => Some((una, now)),
                };
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
