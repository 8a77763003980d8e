//! Closing idle connections while a communicator is suspended (NCCL's `ncclCommSuspend`
//! with `NCCL_SUSPEND_MEM`), with the agreement of the peer at the other end.
//!
//! Suspend is not collective: a peer may be a call ahead and have sent a message that this
//! rank has not taken yet, or may send one before it learns of the suspend. A connection is
//! closed only when both ends are suspended and it is idle: each end has the same
//! connections to the other and posted as many receives as the other posted sends, in both
//! directions (every posted message is complete once a rank is quiesced, so equal counts
//! mean that nothing is in flight). Three steps, each a notice on a connection of its own
//! to the peer's listener (as abort notices go), settle a pair; the lower rank asks:
//!
//! 1. **request** (lower → higher): its round number and its view of the pair's connections
//!    (which exist, their posted counts, which wait unfiled);
//! 2. **answer** (higher → lower): the channels that are idle at both ends. Sent only by a
//!    rank that is suspending too; it then waits for the decision;
//! 3. **decision** (lower → higher): the channels to close, which both ends then close: the
//!    answer's, or none when the answer came after the asking rank gave up waiting
//!    (`ROCCL_SUSPEND_WAIT`). A rank that asked always sends a decision, so an answering
//!    rank never guesses, and the two ends never disagree on a connection.
//!
//! Closed connections open again on first use, as at init.

use std::time::{Duration, Instant};

use super::{HelloOut, Links, HELLO_MAGIC, HELLO_MAX, MAX_CHANNELS, SUSPEND};
use crate::error::{Error, Result};
use crate::net::Connecting;

/// Bytes of a suspend step: the 16-byte hello, the round, the masks and the counts.
pub(super) const MESSAGE_LEN: usize = 32 + 16 * MAX_CHANNELS;

const REQUEST: u32 = 1;
const ANSWER: u32 = 2;
const DECISION: u32 = 3;

/// Most steps kept from ranks that are not being answered (a peer suspending while this
/// rank runs calls sends some that nobody reads).
const INBOX_MAX: usize = 64;

/// One end's view of its connections with a peer.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(super) struct View {
    /// Channels with a send connection to the peer (bit per channel).
    sends: u8,
    /// Channels with a receive connection from the peer.
    recvs: u8,
    /// Channels with a connection from the peer accepted but not filed yet.
    unsettled: u8,
    posted_sends: [u64; MAX_CHANNELS],
    posted_recvs: [u64; MAX_CHANNELS],
}

impl View {
    /// The channels idle at both ends, `mine` and `theirs` being the two ends' views.
    fn idle_with(&self, theirs: &View) -> u8 {
        let mut mask = 0u8;
        for ch in 0..MAX_CHANNELS {
            let bit = 1u8 << ch;
            let any = (self.sends | self.recvs | theirs.sends | theirs.recvs) & bit != 0;
            let settled = (self.unsettled | theirs.unsettled) & bit == 0;
            let mirrored = (self.sends & bit == 0) == (theirs.recvs & bit == 0)
                && (self.recvs & bit == 0) == (theirs.sends & bit == 0);
            let drained = self.posted_sends[ch] == theirs.posted_recvs[ch]
                && self.posted_recvs[ch] == theirs.posted_sends[ch];
            if any && settled && mirrored && drained {
                mask |= bit;
            }
        }
        mask
    }
}

/// A suspend step received from a peer.
#[derive(Debug)]
pub(super) struct Step {
    peer: usize,
    kind: u32,
    round: u64,
    /// The channels to close (answer, decision).
    mask: u8,
    /// The sender's view (request).
    view: View,
}

/// What [`Links::close_idle`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Suspended {
    /// Connections closed (each direction of each channel counts once).
    pub closed: usize,
    /// Peers with which connections stay open: not suspending at the time, or a call
    /// ahead or behind this rank.
    pub kept_with: Vec<usize>,
}

/// A step on its way to a peer.
struct Outgoing {
    peer: usize,
    conn: Option<Box<dyn Connecting>>,
    buf: Option<Box<[u8; HELLO_MAX]>>,
    sent: Option<HelloOut>,
}

fn encode(b: &mut [u8; HELLO_MAX], round: u64, mask: u8, v: &View) {
    b[16..24].copy_from_slice(&round.to_le_bytes());
    b[24] = mask;
    b[25] = v.sends;
    b[26] = v.recvs;
    b[27] = v.unsettled;
    for ch in 0..MAX_CHANNELS {
        let s = 32 + 8 * ch;
        let r = 32 + 8 * (MAX_CHANNELS + ch);
        b[s..s + 8].copy_from_slice(&v.posted_sends[ch].to_le_bytes());
        b[r..r + 8].copy_from_slice(&v.posted_recvs[ch].to_le_bytes());
    }
}

fn decode(peer: usize, kind: u32, b: &[u8]) -> Option<Step> {
    if b.len() < MESSAGE_LEN || !(REQUEST..=DECISION).contains(&kind) {
        return None;
    }
    let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let mut view = View {
        sends: b[25],
        recvs: b[26],
        unsettled: b[27],
        ..View::default()
    };
    for ch in 0..MAX_CHANNELS {
        view.posted_sends[ch] = word(32 + 8 * ch);
        view.posted_recvs[ch] = word(32 + 8 * (MAX_CHANNELS + ch));
    }
    Some(Step {
        peer,
        kind,
        round: word(16),
        mask: b[24],
        view,
    })
}

impl Links {
    /// This rank's view of its connections with `peer`.
    fn view(&self, peer: usize) -> View {
        let mut v = View::default();
        for ch in 0..MAX_CHANNELS {
            let bit = 1u8 << ch;
            if self.send[peer][ch].is_some() {
                v.sends |= bit;
            }
            if self.recv[peer][ch].is_some() {
                v.recvs |= bit;
            }
            v.posted_sends[ch] = self.posted_sends[peer][ch].unwrap_or(0);
            v.posted_recvs[ch] = self.posted_recvs[peer][ch].unwrap_or(0);
        }
        for s in self
            .spare
            .iter()
            .filter(|s| s.0 == peer && s.1 < MAX_CHANNELS)
        {
            v.unsettled |= 1 << s.1;
        }
        v
    }

    /// Keep a step read by `accept_pending` (word `kind`, message `b`) for
    /// [`Links::close_idle`].
    pub(super) fn file_step(&mut self, peer: usize, kind: u32, b: &[u8]) {
        if let Some(step) = decode(peer, kind, b) {
            if self.suspend_inbox.len() >= INBOX_MAX {
                self.suspend_inbox.remove(0);
            }
            self.suspend_inbox.push(step);
        }
    }

    /// Close the connections of channels `mask` with `peer`; returns how many closed.
    fn close_channels(&mut self, peer: usize, mask: u8) -> usize {
        let mut closed = 0;
        for ch in (0..MAX_CHANNELS).filter(|ch| mask & (1 << ch) != 0) {
            closed += usize::from(self.send[peer][ch].take().is_some());
            closed += usize::from(self.recv[peer][ch].take().is_some());
            self.posted_sends[peer][ch] = None;
            self.posted_recvs[peer][ch] = None;
            // Their registrations went with them.
            self.dev_cache.retain(|d| d.peer != peer || d.ch != ch);
        }
        closed
    }

    /// Peers with a connection, or one accepted and not filed yet.
    fn connected_peers(&self) -> Vec<usize> {
        (0..self.nranks)
            .filter(|&p| {
                p != self.rank
                    && (self.send[p].iter().any(Option::is_some)
                        || self.recv[p].iter().any(Option::is_some)
                        || self.spare.iter().any(|s| s.0 == p))
            })
            .collect()
    }

    fn queue(&self, out: &mut Vec<Outgoing>, peer: usize, kind: u32, round: u64, mask: u8) {
        let mut buf = Box::new([0u8; HELLO_MAX]);
        buf[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        buf[4..8].copy_from_slice(&(self.rank as u32).to_le_bytes());
        buf[8..12].copy_from_slice(&(SUSPEND | kind).to_le_bytes());
        buf[12..16].copy_from_slice(&self.comm_id.to_le_bytes());
        let view = if kind == REQUEST {
            self.view(peer)
        } else {
            View::default()
        };
        encode(&mut buf, round, mask, &view);
        let e = self.peer_net[peer];
        let ep = &self.endpoints[e];
        match ep.net.connect(ep.dev, &self.handles[peer][e]) {
            Ok(conn) => out.push(Outgoing {
                peer,
                conn: Some(conn),
                buf: Some(buf),
                sent: None,
            }),
            Err(e) => crate::info!(
                "rank {}: could not tell rank {peer} about suspending: {e}",
                self.rank
            ),
        }
    }

    /// Move the steps on their way; drop those delivered or failed.
    fn progress(out: &mut Vec<Outgoing>) -> bool {
        let before = out.len();
        let mut moved = false;
        out.retain_mut(|o| {
            if let Some(h) = &mut o.sent {
                return !matches!(h.comm.test(h.req), Ok(Some(_)) | Err(_));
            }
            let Some(conn) = o.conn.as_mut() else {
                return false;
            };
            match conn.poll() {
                Ok(Some(mut comm)) => {
                    let Some(buf) = o.buf.take() else {
                        return false;
                    };
                    // SAFETY: `buf` is boxed and kept in `HelloOut` with the comm (declared
                    // first, dropped first) until the send completes.
                    match unsafe { comm.isend(buf.as_ptr(), MESSAGE_LEN, 0, None) } {
                        Ok(Some(req)) => {
                            moved = true;
                            o.conn = None;
                            o.sent = Some(HelloOut {
                                comm,
                                req,
                                _buf: buf,
                            });
                            true
                        }
                        _ => false,
                    }
                }
                Ok(None) => true,
                Err(e) => {
                    crate::info!("telling rank {} about suspending failed: {e}", o.peer);
                    false
                }
            }
        });
        moved || out.len() != before
    }

    /// Close every connection that is idle at both ends with the peers that are suspending
    /// too (see the module's notes). Waits up to `wait` for the peers to take part, and up
    /// to `timeout` for the decisions on answers already given. Run between calls only.
    pub fn close_idle(&mut self, wait: Duration, timeout: Duration) -> Result<Suspended> {
        self.suspend_round += 1;
        let round = self.suspend_round;
        let start = Instant::now();
        self.accept_pending()?;
        let peers = self.connected_peers();
        let mut out: Vec<Outgoing> = Vec::new();
        let mut asking: Vec<usize> = peers.iter().copied().filter(|&p| p > self.rank).collect();
        let mut expecting: Vec<usize> = peers.iter().copied().filter(|&p| p < self.rank).collect();
        // Answers given that wait for their decision: (peer, its round, channels).
        let mut deciding: Vec<(usize, u64, u8)> = Vec::new();
        // Decisions read before their request (a round the asker gave up on).
        let mut decided: Vec<(usize, u64)> = Vec::new();
        let mut closed = 0;
        for &p in &asking {
            self.queue(&mut out, p, REQUEST, round, 0);
        }
        loop {
            let mut moved = self.accept_pending()?;
            for step in std::mem::take(&mut self.suspend_inbox) {
                moved = true;
                match step.kind {
                    REQUEST if step.peer < self.rank => {
                        // A decision already came for this round: the asker gave up on it.
                        if decided.contains(&(step.peer, step.round)) {
                            continue;
                        }
                        let mask = self.view(step.peer).idle_with(&step.view);
                        self.queue(&mut out, step.peer, ANSWER, step.round, mask);
                        if mask != 0 {
                            deciding.push((step.peer, step.round, mask));
                        }
                        expecting.retain(|&p| p != step.peer);
                    }
                    ANSWER if step.round == round && asking.contains(&step.peer) => {
                        let mask = step.mask & self.view(step.peer).idle_mask_alone();
                        closed += self.close_channels(step.peer, mask);
                        self.queue(&mut out, step.peer, DECISION, round, mask);
                        asking.retain(|&p| p != step.peer);
                    }
                    DECISION => {
                        if let Some(i) = deciding
                            .iter()
                            .position(|d| d.0 == step.peer && d.1 == step.round)
                        {
                            let (p, _, mask) = deciding.swap_remove(i);
                            closed += self.close_channels(p, step.mask & mask);
                        } else {
                            decided.push((step.peer, step.round));
                        }
                    }
                    // A step of a round already settled.
                    _ => {}
                }
            }
            moved |= Self::progress(&mut out);
            let now = Instant::now();
            if now >= start + wait {
                for p in std::mem::take(&mut asking) {
                    self.queue(&mut out, p, DECISION, round, 0);
                }
                expecting.clear();
            }
            if now >= start + timeout {
                for &(p, _, _) in &deciding {
                    crate::warn!(
                        "rank {}: rank {p} answered about suspending but sent no decision within {timeout:.0?} (ROCCL_TIMEOUT): its connections stay open",
                        self.rank
                    );
                }
                deciding.clear();
                out.clear();
            }
            // An asker that is gone will not decide.
            deciding.retain(|d| {
                let gone = self.peer_state(d.0).is_some_and(|s| s.contains("exited"));
                !gone
            });
            if asking.is_empty() && expecting.is_empty() && deciding.is_empty() && out.is_empty() {
                break;
            }
            if self.abort.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Error::InvalidUsage(
                    "the communicator was aborted by the application while suspending".into(),
                ));
            }
            if !moved {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        // Connections the peers opened again since (they resumed first) are new ones.
        let kept_with = (0..self.nranks)
            .filter(|&p| {
                self.send[p].iter().any(Option::is_some) || self.recv[p].iter().any(Option::is_some)
            })
            .collect();
        Ok(Suspended { closed, kept_with })
    }
}

impl View {
    /// The channels this end could close on its own evidence (it has connections there and
    /// none waits unfiled): a check on the peer's answer.
    fn idle_mask_alone(&self) -> u8 {
        (self.sends | self.recvs) & !self.unsettled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(sends: u8, recvs: u8, s: u64, r: u64) -> View {
        let mut v = View {
            sends,
            recvs,
            ..View::default()
        };
        v.posted_sends[0] = s;
        v.posted_recvs[0] = r;
        v
    }

    #[test]
    fn only_mirrored_drained_settled_channels_are_idle() {
        // Channel 0 both ways, 5 messages each way: idle.
        assert_eq!(view(1, 1, 5, 3).idle_with(&view(1, 1, 3, 5)), 1);
        // A message sent and not yet received (a call ahead): busy.
        assert_eq!(view(1, 1, 6, 3).idle_with(&view(1, 1, 3, 5)), 0);
        assert_eq!(view(1, 1, 5, 3).idle_with(&view(1, 1, 4, 5)), 0);
        // A connection one end has and the other has not filed: busy.
        assert_eq!(view(1, 0, 0, 0).idle_with(&view(0, 0, 0, 0)), 0);
        let mut unsettled = view(1, 1, 0, 0);
        unsettled.unsettled = 1;
        assert_eq!(unsettled.idle_with(&view(1, 1, 0, 0)), 0);
        // Nothing on the channel: nothing to close.
        assert_eq!(View::default().idle_with(&View::default()), 0);
    }

    #[test]
    fn a_step_reads_back_as_written() {
        let mut v = view(0b101, 0b11, 7, 9);
        v.unsettled = 0b1000_0000;
        v.posted_sends[7] = u64::MAX;
        let mut b = Box::new([0u8; HELLO_MAX]);
        encode(&mut b, 42, 0b110, &v);
        let s = decode(3, REQUEST, &b[..]).unwrap();
        assert_eq!((s.peer, s.kind, s.round, s.mask), (3, REQUEST, 42, 0b110));
        assert_eq!(s.view, v);
        assert!(decode(3, 9, &b[..]).is_none());
        assert!(decode(3, REQUEST, &b[..100]).is_none());
    }
}
