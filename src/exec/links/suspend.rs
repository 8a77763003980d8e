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

use super::{HelloOut, Links, PeerProcess, HELLO_MAX, MAX_CHANNELS};
use crate::error::{Error, Result};
use crate::exec::hello::{self, Hello};
use crate::net::Connecting;

/// Bytes of a suspend step: the 16-byte hello, the round, the masks and the counts.
pub(super) const MESSAGE_LEN: usize = 32 + 16 * MAX_CHANNELS;
const _: () = assert!(
    MESSAGE_LEN == hello::MAX_LEN,
    "a suspend step fills the longest hello"
);

const REQUEST: u32 = 1;
const ANSWER: u32 = 2;
const DECISION: u32 = 3;

/// Events of a step on its way ([`Links::progress`]).
const POSTED: u8 = 1;
const DELIVERED: u8 = 2;

/// What happened to a step on its way: (peer, step, [`POSTED`] or [`DELIVERED`], the
/// connections to close once delivered).
type Event = (usize, u32, u8, Option<(u8, u8)>);

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
    kind: u32,
    /// Dropped when not delivered by then.
    deadline: Instant,
    /// Send and receive channels to close once delivered.
    then_close: Option<(u8, u8)>,
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
            if self.suspend_inbox.len() >= INBOX_MAX + 4 * self.nranks {
                // The oldest request or answer goes first: a decision may be awaited.
                let at = self
                    .suspend_inbox
                    .iter()
                    .position(|s| s.kind != DECISION)
                    .unwrap_or(0);
                self.suspend_inbox.remove(at);
            }
            self.suspend_inbox.push(step);
        }
    }

    /// Close the send connections of channels `sends` and the receive connections of
    /// channels `recvs` with `peer`; returns how many closed.
    fn close_channels(&mut self, peer: usize, sends: u8, recvs: u8) -> usize {
        let mut closed = 0;
        for ch in 0..MAX_CHANNELS {
            let bit = 1u8 << ch;
            if sends & bit != 0 {
                closed += usize::from(self.send[peer][ch].take().is_some());
                self.posted_sends[peer][ch] = None;
            }
            if recvs & bit != 0 {
                closed += usize::from(self.recv[peer][ch].take().is_some());
                self.posted_recvs[peer][ch] = None;
            }
            // Their registrations went with them.
            self.dev_cache.retain(|d| {
                d.peer != peer || d.ch != ch || (if d.send { sends } else { recvs }) & bit == 0
            });
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

    /// The last round of `peer`'s that this rank saw decided (a request of that round or
    /// before is stale).
    fn decided(&self, peer: usize) -> u64 {
        self.suspend_decided.get(peer).copied().unwrap_or(0)
    }

    fn note_decided(&mut self, peer: usize, round: u64) {
        if self.suspend_decided.len() < self.nranks {
            self.suspend_decided.resize(self.nranks, 0);
        }
        let d = &mut self.suspend_decided[peer];
        *d = (*d).max(round);
    }

    /// Queue step `kind` to `peer`, to be delivered by `deadline` or dropped; `then_close`:
    /// the connections to close once it is delivered.
    #[allow(clippy::too_many_arguments)]
    fn queue(
        &self,
        out: &mut Vec<Outgoing>,
        peer: usize,
        kind: u32,
        round: u64,
        mask: u8,
        deadline: Instant,
        then_close: Option<(u8, u8)>,
    ) {
        let mut buf = Box::new([0u8; HELLO_MAX]);
        let step = Hello::SuspendStep { kind, message: &[] };
        hello::encode(&step, self.rank, self.comm_id, &mut buf);
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
                kind,
                deadline,
                then_close,
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

    /// Move the steps on their way. Returns what happened: (peer, step, event), where the
    /// event is [`POSTED`] (its bytes are on their way: the peer may read it) or
    /// [`DELIVERED`]; a step that fails is dropped.
    fn progress(out: &mut Vec<Outgoing>, events: &mut Vec<Event>) {
        out.retain_mut(|o| {
            if let Some(h) = &mut o.sent {
                return match h.comm.test(h.req) {
                    Ok(Some(_)) => {
                        events.push((o.peer, o.kind, DELIVERED, o.then_close));
                        false
                    }
                    Ok(None) => true,
                    Err(_) => false,
                };
            }
            let Some(conn) = o.conn.as_mut() else {
                return false;
            };
            match conn.poll() {
                Ok(Some(comm)) => {
                    let Some(buf) = o.buf.take() else {
                        return false;
                    };
                    o.conn = None;
                    o.sent = HelloOut::post(comm, buf, MESSAGE_LEN);
                    if o.sent.is_some() {
                        events.push((o.peer, o.kind, POSTED, None));
                    }
                    o.sent.is_some()
                }
                Ok(None) => true,
                Err(e) => {
                    crate::info!("telling rank {} about suspending failed: {e}", o.peer);
                    false
                }
            }
        });
    }

    /// Close every connection that is idle at both ends with the peers that are suspending
    /// too (see the module's notes). Waits up to `wait` (at most half of `timeout`) for the
    /// peers to take part, and up to `timeout` for the decisions on answers given. Run
    /// between calls only.
    pub fn close_idle(&mut self, wait: Duration, timeout: Duration) -> Result<Suspended> {
        let wait = wait.min(timeout / 2);
        self.suspend_round += 1;
        let start = Instant::now();
        self.accept_pending()?;
        let peers = self.connected_peers();
        let at_start: Vec<(usize, View)> = peers.iter().map(|&p| (p, self.view(p))).collect();
        let mut r = Round {
            number: self.suspend_round,
            wait,
            timeout,
            wait_end: after(start, wait),
            asking: Vec::new(),
            expecting: peers.iter().copied().filter(|&p| p < self.rank).collect(),
            deciding: Vec::new(),
            out: Vec::new(),
            events: Vec::new(),
            closed: 0,
            shut: vec![(0u8, 0u8); self.nranks],
        };
        for &p in peers.iter().filter(|&&p| p > self.rank) {
            self.queue(&mut r.out, p, REQUEST, r.number, 0, r.wait_end, None);
            r.asking.push((p, false));
        }
        loop {
            let mut moved = self.accept_pending()?;
            moved |= self.take_steps(&mut r);
            moved |= self.deliver(&mut r);
            self.expire(&mut r, Instant::now());
            // Every step is delivered or dropped at its deadline before this returns.
            let settled = r.asking.is_empty() && r.expecting.is_empty() && r.deciding.is_empty();
            if settled && r.out.is_empty() {
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
        let kept_with = at_start
            .iter()
            .filter(|(p, v)| {
                (v.sends & !r.shut[*p].0) | (v.recvs & !r.shut[*p].1) | v.unsettled != 0
            })
            .map(|(p, _)| *p)
            .collect();
        let (round, closed) = (r.number, r.closed);
        crate::info!(
            "rank {}: suspend round {round} settled in {:.1?}: closed {closed} connections, kept those with ranks {kept_with:?}",
            self.rank,
            start.elapsed()
        );
        Ok(Suspended { closed, kept_with })
    }

    /// Take the steps the peers sent (requests, answers, decisions). Whether there were any.
    fn take_steps(&mut self, r: &mut Round) -> bool {
        let now = Instant::now();
        let inbox = std::mem::take(&mut self.suspend_inbox);
        for (i, step) in inbox.iter().enumerate() {
            match step.kind {
                REQUEST if step.peer < self.rank => {
                    let newer = inbox[i + 1..]
                        .iter()
                        .any(|s| s.kind == REQUEST && s.peer == step.peer);
                    if newer || step.round <= self.decided(step.peer) {
                        continue; // a round its asker settled or gave up on
                    }
                    self.answer(r, step, now);
                }
                ANSWER if step.round == r.number => self.decide(r, step, now),
                DECISION => {
                    self.note_decided(step.peer, step.round);
                    let at = r
                        .deciding
                        .iter()
                        .position(|d| d.peer == step.peer && d.round == step.round);
                    if let Some(at) = at {
                        let d = r.deciding.swap_remove(at);
                        let (s, rv) = (d.sends & step.mask, d.recvs & step.mask);
                        r.closed += self.close_channels(d.peer, s, rv);
                        r.shut[d.peer].0 |= s;
                        r.shut[d.peer].1 |= rv;
                    }
                }
                // A step of a round already settled.
                _ => {}
            }
        }
        !inbox.is_empty()
    }

    /// Answer a lower rank's request with the channels idle on both sides, and wait for
    /// its decision about them.
    fn answer(&mut self, r: &mut Round, step: &Step, now: Instant) {
        let view = self.view(step.peer);
        // An answer of an earlier round still open: close nothing in this one (its
        // decision could close connections reopened since).
        let open = r.deciding.iter().any(|d| d.peer == step.peer);
        let mask = if open { 0 } else { view.idle_with(&step.view) };
        // The asker waits for it, and accepts it within moments; one that gave up already
        // may never accept it (RoCE needs the accept).
        let until = after(now, r.wait.max(Duration::from_secs(1)));
        self.queue(&mut r.out, step.peer, ANSWER, step.round, mask, until, None);
        if mask != 0 {
            r.deciding.push(Deciding {
                peer: step.peer,
                round: step.round,
                sends: view.sends & mask,
                recvs: view.recvs & mask,
                until: after(now, r.timeout),
            });
        }
        r.expecting.retain(|&p| p != step.peer);
    }

    /// A higher rank answered this round's request: decide which of the channels it found
    /// idle are still idle here, and tell it.
    fn decide(&mut self, r: &mut Round, step: &Step, now: Instant) {
        let Some(at) = r.asking.iter().position(|a| a.0 == step.peer) else {
            return;
        };
        r.asking.swap_remove(at);
        let view = self.view(step.peer);
        let mask = step.mask & view.idle_mask_alone();
        // Closed once the decision is delivered: the peer closes when it reads it, so
        // neither end closes what the other keeps. An answer of "nothing" waits for no
        // decision.
        if step.mask != 0 {
            let close = (mask != 0).then_some((view.sends & mask, view.recvs & mask));
            let until = after(now, r.timeout);
            self.queue(
                &mut r.out, step.peer, DECISION, r.number, mask, until, close,
            );
        }
    }

    /// Move the outgoing steps on; a delivered decision closes its channels. Whether any
    /// moved.
    fn deliver(&mut self, r: &mut Round) -> bool {
        r.events.clear();
        Self::progress(&mut r.out, &mut r.events);
        for &(p, kind, what, close) in &r.events {
            if kind == REQUEST && what == POSTED {
                if let Some(a) = r.asking.iter_mut().find(|a| a.0 == p) {
                    a.1 = true;
                }
            }
            if let (DELIVERED, Some((s, rv))) = (what, close) {
                r.closed += self.close_channels(p, s, rv);
                r.shut[p].0 |= s;
                r.shut[p].1 |= rv;
            }
        }
        !r.events.is_empty()
    }

    /// What is past its time: the wait for answers, decisions that never came, steps that
    /// were not delivered.
    fn expire(&mut self, r: &mut Round, now: Instant) {
        if now >= r.wait_end {
            // Peers asked that did not answer: tell those that may have read the request
            // that nothing closes. One whose answer is on its way waits for this in its own
            // loop, which accepts it within moments; one that is not suspending may never
            // accept it (RoCE needs the accept), so it is tried for a while, not waited for.
            // Requests still connecting are dropped.
            let grace = after(now, r.wait.max(Duration::from_secs(1)));
            for (p, posted) in std::mem::take(&mut r.asking) {
                if posted {
                    self.queue(&mut r.out, p, DECISION, r.number, 0, grace, None);
                }
            }
            r.out.retain(|o| o.kind != REQUEST || o.sent.is_some());
            r.expecting.clear();
        }
        let timeout = r.timeout;
        r.deciding.retain(|d| {
            let gone = matches!(self.peer_state(d.peer), Some(PeerProcess::Exited { .. }));
            if now >= d.until || gone {
                crate::warn!(
                    "rank {}: rank {} sent no decision about suspending within {timeout:.0?} (ROCCL_TIMEOUT): the connections with it stay open",
                    self.rank,
                    d.peer
                );
                return false;
            }
            true
        });
        r.out.retain(|o| {
            if now < o.deadline {
                return true;
            }
            if o.then_close.is_some() {
                crate::info!(
                    "rank {}: the decision about suspending did not reach rank {}: the connections with it stay open",
                    self.rank,
                    o.peer
                );
            }
            false
        });
    }
}

/// `t + d`, or a year on where that overflows (no deadline).
fn after(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .unwrap_or_else(|| t + Duration::from_secs(86_400 * 365))
}

/// One suspend round of this rank ([`Links::close_idle`]): what it asked, answered and
/// decides, and what it closed.
struct Round {
    number: u64,
    /// How long peers are waited for.
    wait: Duration,
    timeout: Duration,
    wait_end: Instant,
    /// Peers asked, and whether the request's bytes left.
    asking: Vec<(usize, bool)>,
    /// Lower ranks whose request is awaited.
    expecting: Vec<usize>,
    /// Answers given, awaiting the asker's decision.
    deciding: Vec<Deciding>,
    out: Vec<Outgoing>,
    events: Vec<Event>,
    closed: usize,
    /// Per peer, the channels closed (sends, receives).
    shut: Vec<(u8, u8)>,
}

/// An answer given that waits for its decision.
struct Deciding {
    peer: usize,
    round: u64,
    /// The connections that existed on the channels answered idle, when answered: only
    /// those close (a peer that resumed first may have opened new ones since).
    sends: u8,
    recvs: u8,
    until: Instant,
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
