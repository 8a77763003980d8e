//! Transmission: acknowledgements, RDMA READ responses and requests (new, selectively
//! resent, or gone back N), one datagram per call.

use std::time::Instant;

use super::reports::{dup_report, report_or_ack};
use super::{psn_add, psn_diff, Engine, Resent, Transmit, ACK_EVERY, RECENT};
use super::{QpState, WrOpcode, DUP_SYNDROME};
use crate::rdma::mem::Access;
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
        let src = qp.src_ip.unwrap_or(self.local_ip);
        let ip = IpInfo {
            src,
            dst: qp.attr.dest.ip(),
            src_port: qp.src_port,
            dst_port: qp.attr.dest.port(),
        };
        let (dest_qp, dest, src_port) = (qp.attr.dest_qpn, qp.attr.dest, qp.src_port);
        let bth = move |opcode, psn, ack_req| Bth {
            opcode,
            solicited: false,
            mig_req: false,
            pad: 0,
            pkey: wire::DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp,
            ack_req,
            psn,
        };
        let out = move |len| Transmit {
            dest,
            src,
            src_port,
            len,
        };
        // 1. Acknowledgements — after the responses of earlier reads, so that responses
        // leave in PSN order as the requester expects.
        let reads_first = match (qp.ctrl, qp.reads.front()) {
            (Some((_, c)), Some(j)) => psn_diff(j.psn, c) < 0,
            _ => false,
        };
        // Then hole reports (selective mode), which follow the NAK of the first gap.
        let ack = match qp.ctrl.filter(|_| !reads_first) {
            Some(c) => {
                qp.ctrl = None;
                qp.ack_due = None;
                Some(c)
            }
            // Then the count of duplicates received (selective mode).
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
        };
        if let Some((aeth, psn)) = ack {
            match aeth.kind() {
                Some(AckKind::Nak(NakCode::PsnSequenceError)) => self.stats.seq_naks_sent += 1,
                Some(AckKind::Nak(_)) => self.stats.error_naks_sent += 1,
                _ => {}
            }
            let p = Packet {
                bth: bth(report_or_ack(aeth.syndrome), psn, false),
                reth: None,
                imm: None,
                aeth: Some(aeth),
                payload: &[],
            };
            return wire::encode_segment(&p, &ip, seg, buf).ok().map(out);
        }
        // 2. RDMA READ responses.
        if let Some(j) = qp.reads.front_mut() {
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
                self.mrs
                    .read(rkey, va, len as usize, Access::REMOTE_READ)
                    .ok()?
            };
            let p = Packet {
                bth: bth(opcode, psn, false),
                reth: None,
                imm: None,
                aeth,
                payload,
            };
            return wire::encode_segment(&p, &ip, seg, buf).ok().map(out);
        }
        // 3. Requests.
        if qp.state != QpState::Rts || qp.rnr_until.is_some_and(|t| now < t) {
            return None;
        }
        let una = qp.una();
        // Selective retransmissions first: packet `j` of WQE `i`, cursor untouched.
        let mut resend = None;
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
                Self::rewind(qp, p); // a read request is re-sent whole, from the cursor
                break;
            }
            resend = Some((i, psn_diff(p, qp.sq[i].psn) as u32));
            break;
        }
        if resend.is_none() {
            // Acknowledgements can overtake the cursor (after going back N, the responder
            // acknowledges what it had kept): continue from the oldest unacknowledged
            // packet instead of waiting for the timer.
            let behind = qp
                .sq
                .get(qp.tx_wqe)
                .is_some_and(|w| psn_diff(psn_add(w.psn, qp.tx_pkt), una) < 0);
            if behind {
                Self::rewind(qp, una);
            }
        }
        let (wi, j) = resend.unwrap_or((qp.tx_wqe, qp.tx_pkt));
        let w = *qp.sq.get(wi)?;
        let mtu = qp.attr.mtu;
        let pkt_psn = psn_add(w.psn, j);
        if resend.is_none() && psn_diff(pkt_psn, una) >= qp.cwnd as i32 {
            return None;
        }
        let (opcode, payload_off, payload_len, reth, imm, ack_req, advance_wqe) =
            if w.wr.opcode == WrOpcode::Read {
                // One request for the remaining responses.
                let off = w.resp * mtu;
                let reth = Reth {
                    va: w.wr.remote_addr + off as u64,
                    rkey: w.wr.rkey,
                    dma_len: w.len - off.min(w.len),
                };
                (Opcode::ReadRequest, 0, 0, Some(reth), None, true, true)
            } else {
                let n = w.npkts;
                let off = j * mtu;
                let len = (w.len - off.min(w.len)).min(mtu);
                let is_send = matches!(w.wr.opcode, WrOpcode::Send | WrOpcode::SendImm);
                let with_imm = matches!(w.wr.opcode, WrOpcode::SendImm | WrOpcode::WriteImm);
                let pos = match (n, j) {
                    (1, _) => 3, // only
                    (_, 0) => 0, // first
                    (_, j) if j + 1 == n => 2,
                    _ => 1,
                };
                let opcode = match (is_send, pos, with_imm) {
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
                };
                let reth = opcode.has_reth().then_some(Reth {
                    va: w.wr.remote_addr,
                    rkey: w.wr.rkey,
                    dma_len: w.len,
                });
                let imm = opcode.has_imm().then_some(w.wr.imm);
                // Ask for an acknowledgement at the end of a message whose completion someone
                // waits for, and every ACK_EVERY packets of a stream (to move the window);
                // this engine's responder acknowledges the rest within ACK_DELAY, coalesced.
                // A NIC's responder (Linux rxe, for one) acknowledges only what asks: the end
                // of every message asks it. A selective retransmission fills a gap:
                // acknowledge it at once.
                let ack_req = (j + 1 == n && (w.wr.signaled || !qp.attr.selective))
                    || (psn_add(w.psn, j) % ACK_EVERY) == ACK_EVERY - 1
                    || resend.is_some();
                (opcode, off, len, reth, imm, ack_req, j + 1 == n)
            };
        if resend.is_none() && psn_diff(pkt_psn, una) < 0 {
            return None;
        }
        // Retransmissions are packets below the highest PSN sent so far.
        if psn_diff(pkt_psn, qp.sent_hi) < 0 {
            self.stats.retransmits += 1;
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
        if resend.is_some() {
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
        let payload: &[u8] = if w.wr.inline {
            &w.inline[payload_off as usize..(payload_off + payload_len) as usize]
        } else {
            match w.wr.sge {
                Some(s) if payload_len > 0 => {
                    match self.mrs.read(
                        s.lkey,
                        s.addr + payload_off as u64,
                        payload_len as usize,
                        Access::default(),
                    ) {
                        Ok(p) => p,
                        Err(_) => {
                            if qp.closing {
                                // Its owner deregistered the memory after closing: nothing
                                // can be delivered any more.
                                qp.sq.clear();
                                qp.rto = None;
                            }
                            return None;
                        }
                    }
                }
                _ => &[],
            }
        };
        let p = Packet {
            bth: bth(opcode, pkt_psn, ack_req),
            reth,
            imm,
            aeth: None,
            payload,
        };
        wire::encode_segment(&p, &ip, seg, buf).ok().map(out)
    }
}
