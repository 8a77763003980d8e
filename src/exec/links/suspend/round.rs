//! One rank's part of a suspend round, as decisions without I/O: what it asks, answers and
//! decides, and which connections it closes, from the steps it is given and an explicit
//! `now`. [`Links::close_idle`](super::super::Links::close_idle) drives it over real
//! connections ([`Ends`] over the links); `tests` drives two of it through every order of
//! the events between them and checks that both ends close the same connections.

use std::time::{Duration, Instant};

use crate::exec::links::MAX_CHANNELS;

/// A lower rank asks a higher one which channels are idle.
pub(super) const REQUEST: u32 = 1;
/// The higher rank answers with the channels idle at both ends.
pub(super) const ANSWER: u32 = 2;
/// The lower rank decides which of those close.
pub(super) const DECISION: u32 = 3;

/// One end's view of its connections with a peer.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq, Hash)]
pub(super) struct View {
    /// Channels with a send connection to the peer (bit per channel).
    pub(super) sends: u8,
    /// Channels with a receive connection from the peer.
    pub(super) recvs: u8,
    /// Channels with a connection from the peer accepted but not filed yet.
    pub(super) unsettled: u8,
    pub(super) posted_sends: [u64; MAX_CHANNELS],
    pub(super) posted_recvs: [u64; MAX_CHANNELS],
}

impl View {
    /// The channels idle at both ends, `mine` and `theirs` being the two ends' views.
    pub(super) fn idle_with(&self, theirs: &View) -> u8 {
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

    /// The channels this end could close on its own evidence (it has connections there and
    /// none waits unfiled): a check on the peer's answer.
    pub(super) fn idle_mask_alone(&self) -> u8 {
        (self.sends | self.recvs) & !self.unsettled
    }
}

/// A suspend step received from a peer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(in crate::exec::links) struct Step {
    pub(super) peer: usize,
    pub(super) kind: u32,
    pub(super) round: u64,
    /// The channels to close (answer, decision).
    pub(super) mask: u8,
    /// The sender's view (request).
    pub(super) view: View,
}

/// What a round needs of its rank: its connections, what it remembers of the peers'
/// rounds, and a way to send steps.
pub(super) trait Ends {
    /// This rank's view of its connections with `peer`.
    fn view(&self, peer: usize) -> View;
    /// The last round of `peer`'s that this rank saw decided.
    fn decided(&self, peer: usize) -> u64;
    /// `peer`'s round `round` was decided.
    fn note_decided(&mut self, peer: usize, round: u64);
    /// Whether `peer`'s process is known to have exited.
    fn exited(&self, peer: usize) -> bool;
    /// Send `step` (kind, round, mask; a request carries this rank's view) to `peer`, delivered by `deadline` or dropped; once delivered, close `then_close`
    /// (sends, receives) and report it ([`Round::delivered`]).
    fn send(
        &mut self,
        peer: usize,
        step: (u32, u64, u8),
        deadline: Instant,
        then_close: Option<(u8, u8)>,
    );
    /// Close the send connections of channels `sends` and the receive connections of
    /// channels `recvs` with `peer`; how many closed.
    fn close(&mut self, peer: usize, sends: u8, recvs: u8) -> usize;
    /// The wait for answers is over: drop the requests whose bytes have not left.
    fn drop_unsent_requests(&mut self);
}

/// An answer given that waits for its decision.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Deciding {
    peer: usize,
    round: u64,
    /// The connections that existed on the channels answered idle, when answered: only
    /// those close (a peer that resumed first may have opened new ones since).
    sends: u8,
    recvs: u8,
    until: Instant,
}

/// One suspend round of this rank: what it asked, answered and decides, and what it closed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct Round {
    /// This rank.
    me: usize,
    pub(super) number: u64,
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
    /// Connections closed.
    pub(super) closed: usize,
    /// Per peer, the channels closed (sends, receives).
    pub(super) shut: Vec<(u8, u8)>,
}

/// `t + d`, or a year on where that overflows (no deadline).
pub(super) fn after(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .unwrap_or_else(|| t + Duration::from_secs(86_400 * 365))
}

impl Round {
    /// Round `number` of rank `me` (of `nranks`) with the connected `peers`, begun at
    /// `now`: ask the higher ranks, expect the lower ones to ask.
    pub(super) fn start(
        e: &mut impl Ends,
        (me, nranks): (usize, usize),
        number: u64,
        peers: &[usize],
        (now, wait, timeout): (Instant, Duration, Duration),
    ) -> Round {
        let wait_end = after(now, wait);
        let mut r = Round {
            me,
            number,
            wait,
            timeout,
            wait_end,
            asking: Vec::new(),
            expecting: peers.iter().copied().filter(|&p| p < me).collect(),
            deciding: Vec::new(),
            closed: 0,
            shut: vec![(0u8, 0u8); nranks],
        };
        for &p in peers.iter().filter(|&&p| p > me) {
            e.send(p, (REQUEST, number, 0), wait_end, None);
            r.asking.push((p, false));
        }
        r
    }

    /// Nothing left to ask, answer or decide (steps may still be on their way).
    pub(super) fn settled(&self) -> bool {
        self.asking.is_empty() && self.expecting.is_empty() && self.deciding.is_empty()
    }

    /// Take the steps the peers sent (requests, answers, decisions), in their order.
    pub(super) fn take_steps(&mut self, e: &mut impl Ends, inbox: &[Step], now: Instant) {
        for (i, step) in inbox.iter().enumerate() {
            match step.kind {
                REQUEST if step.peer < self.me => {
                    let newer = inbox[i + 1..]
                        .iter()
                        .any(|s| s.kind == REQUEST && s.peer == step.peer);
                    if newer || step.round <= e.decided(step.peer) {
                        continue; // a round its asker settled or gave up on
                    }
                    self.answer(e, step, now);
                }
                ANSWER if step.round == self.number => self.decide(e, step, now),
                DECISION => {
                    e.note_decided(step.peer, step.round);
                    let at = self
                        .deciding
                        .iter()
                        .position(|d| d.peer == step.peer && d.round == step.round);
                    if let Some(at) = at {
                        let d = self.deciding.swap_remove(at);
                        self.close(e, d.peer, d.sends & step.mask, d.recvs & step.mask);
                    }
                }
                // A step of a round already settled.
                _ => {}
            }
        }
    }

    fn close(&mut self, e: &mut impl Ends, peer: usize, sends: u8, recvs: u8) {
        self.closed += e.close(peer, sends, recvs);
        self.shut[peer].0 |= sends;
        self.shut[peer].1 |= recvs;
    }

    /// Answer a lower rank's request with the channels idle on both sides, and wait for
    /// its decision about them.
    fn answer(&mut self, e: &mut impl Ends, step: &Step, now: Instant) {
        let view = e.view(step.peer);
        // An answer of an earlier round still open: close nothing in this one (its
        // decision could close connections reopened since).
        let open = self.deciding.iter().any(|d| d.peer == step.peer);
        let mask = if open { 0 } else { view.idle_with(&step.view) };
        // The asker waits for it, and accepts it within moments; one that gave up already
        // may never accept it (RoCE needs the accept).
        let until = after(now, self.wait.max(Duration::from_secs(1)));
        e.send(step.peer, (ANSWER, step.round, mask), until, None);
        if mask != 0 {
            self.deciding.push(Deciding {
                peer: step.peer,
                round: step.round,
                sends: view.sends & mask,
                recvs: view.recvs & mask,
                until: after(now, self.timeout),
            });
        }
        self.expecting.retain(|&p| p != step.peer);
    }

    /// A higher rank answered this round's request: decide which of the channels it found
    /// idle are still idle here, and tell it.
    fn decide(&mut self, e: &mut impl Ends, step: &Step, now: Instant) {
        let Some(at) = self.asking.iter().position(|a| a.0 == step.peer) else {
            return;
        };
        self.asking.swap_remove(at);
        let view = e.view(step.peer);
        let mask = step.mask & view.idle_mask_alone();
        // Closed once the decision is delivered: the peer closes when it reads it, so
        // neither end closes what the other keeps. An answer of "nothing" waits for no
        // decision.
        if step.mask != 0 {
            let close = (mask != 0).then_some((view.sends & mask, view.recvs & mask));
            let until = after(now, self.timeout);
            e.send(step.peer, (DECISION, self.number, mask), until, close);
        }
    }

    /// Step `kind` to `peer` has left (its bytes are on their way: the peer may read it).
    pub(super) fn posted(&mut self, peer: usize, kind: u32) {
        if kind == REQUEST {
            if let Some(a) = self.asking.iter_mut().find(|a| a.0 == peer) {
                a.1 = true;
            }
        }
    }

    /// A step to `peer` was delivered: close what it said to close once delivered.
    pub(super) fn delivered(
        &mut self,
        e: &mut impl Ends,
        peer: usize,
        then_close: Option<(u8, u8)>,
    ) {
        if let Some((s, rv)) = then_close {
            self.close(e, peer, s, rv);
        }
    }

    /// What is past its time at `now`: the wait for answers, decisions that never came.
    /// Returns the peers whose decision never came (their connections stay open).
    pub(super) fn expire(&mut self, e: &mut impl Ends, now: Instant) -> Vec<usize> {
        if now >= self.wait_end {
            // Peers asked that did not answer: tell those that may have read the request
            // that nothing closes. One whose answer is on its way waits for this in its own
            // loop, which accepts it within moments; one that is not suspending may never
            // accept it (RoCE needs the accept), so it is tried for a while, not waited for.
            // Requests still connecting are dropped.
            let grace = after(now, self.wait.max(Duration::from_secs(1)));
            for (p, posted) in std::mem::take(&mut self.asking) {
                if posted {
                    e.send(p, (DECISION, self.number, 0), grace, None);
                }
            }
            e.drop_unsent_requests();
            self.expecting.clear();
        }
        let mut undecided = Vec::new();
        self.deciding.retain(|d| {
            if now >= d.until || e.exited(d.peer) {
                undecided.push(d.peer);
                return false;
            }
            true
        });
        undecided
    }

    /// The next moment at which [`Round::expire`] may act.
    #[cfg(test)]
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        let wait = (!self.asking.is_empty() || !self.expecting.is_empty()).then_some(self.wait_end);
        wait.into_iter()
            .chain(self.deciding.iter().map(|d| d.until))
            .min()
    }
}

#[cfg(test)]
mod tests;
