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
//!
//! The decisions are [`round::Round`]'s (no I/O; checked there through every order of two
//! ranks' events); this file drives it over the connections.

use std::time::{Duration, Instant};

use super::{HelloOut, Links, PeerProcess, HELLO_MAX, MAX_CHANNELS};
use crate::error::{Error, Result};
use crate::exec::hello::{self, Hello};
use crate::net::Connecting;

mod round;

pub(super) use round::Step;
use round::{Ends, Round, View, DECISION, REQUEST};

/// Bytes of a suspend step: the 16-byte hello, the round, the masks and the counts.
pub(super) const MESSAGE_LEN: usize = 32 + 16 * MAX_CHANNELS;
const _: () = assert!(
    MESSAGE_LEN == hello::MAX_LEN,
    "a suspend step fills the longest hello"
);

/// Events of a step on its way ([`Links::progress`]).
const POSTED: u8 = 1;
const DELIVERED: u8 = 2;

/// What happened to a step on its way: (peer, step, [`POSTED`] or [`DELIVERED`], the
/// connections to close once delivered).
type Event = (usize, u32, u8, Option<(u8, u8)>);

/// Most steps kept from ranks that are not being answered (a peer suspending while this
/// rank runs calls sends some that nobody reads).
const INBOX_MAX: usize = 64;

/// What [`Links::close_idle`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Suspended {
    /// Connections closed (each direction of each channel counts once).
    pub closed: usize,
    /// Peers with which connections stay open: not suspending at the time, or a call
    /// ahead or behind this rank.
    pub kept_with: Vec<usize>,
}

/// What the links keep of the rounds of [`Links::close_idle`] between them.
#[derive(Default)]
pub(super) struct Rounds {
    /// Suspend steps received from peers, for [`Links::close_idle`].
    pub(super) inbox: Vec<Step>,
    /// Number of this rank's last [`Links::close_idle`] (names its requests).
    pub(super) round: u64,
    /// Per peer, the last of its rounds seen decided (older requests are stale).
    pub(super) decided: Vec<u64>,
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
            if self.suspend.inbox.len() >= INBOX_MAX + 4 * self.nranks {
                // The oldest request or answer goes first: a decision may be awaited.
                let at = self
                    .suspend
                    .inbox
                    .iter()
                    .position(|s| s.kind != DECISION)
                    .unwrap_or(0);
                self.suspend.inbox.remove(at);
            }
            self.suspend.inbox.push(step);
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
            self.gpu.cache.retain(|d| {
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
        self.suspend.decided.get(peer).copied().unwrap_or(0)
    }

    fn note_decided(&mut self, peer: usize, round: u64) {
        if self.suspend.decided.len() < self.nranks {
            self.suspend.decided.resize(self.nranks, 0);
        }
        let d = &mut self.suspend.decided[peer];
        *d = (*d).max(round);
    }

    /// Queue step `kind` to `peer`, to be delivered by `deadline` or dropped; `then_close`:
    /// the connections to close once it is delivered.
    fn queue(
        &self,
        out: &mut Vec<Outgoing>,
        peer: usize,
        (kind, round, mask): (u32, u64, u8),
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
        self.suspend.round += 1;
        let start = Instant::now();
        self.accept_pending()?;
        let peers = self.connected_peers();
        let at_start: Vec<(usize, View)> = peers.iter().map(|&p| (p, self.view(p))).collect();
        let mut out = Vec::new();
        let mut events = Vec::new();
        let (me, nranks, number) = (self.rank, self.nranks, self.suspend.round);
        let mut r = Round::start(
            &mut LinkEnds {
                links: self,
                out: &mut out,
            },
            (me, nranks),
            number,
            &peers,
            (start, wait, timeout),
        );
        loop {
            let mut moved = self.accept_pending()?;
            let inbox = std::mem::take(&mut self.suspend.inbox);
            moved |= !inbox.is_empty();
            let now = Instant::now();
            r.take_steps(
                &mut LinkEnds {
                    links: self,
                    out: &mut out,
                },
                &inbox,
                now,
            );
            events.clear();
            Self::progress(&mut out, &mut events);
            moved |= !events.is_empty();
            for &(p, kind, what, close) in &events {
                match what {
                    POSTED => r.posted(p, kind),
                    _ => r.delivered(
                        &mut LinkEnds {
                            links: self,
                            out: &mut out,
                        },
                        p,
                        close,
                    ),
                }
            }
            let now = Instant::now();
            for p in r.expire(
                &mut LinkEnds {
                    links: self,
                    out: &mut out,
                },
                now,
            ) {
                crate::warn!(
                    "rank {}: rank {p} sent no decision about suspending within {timeout:.0?} (ROCCL_TIMEOUT): the connections with it stay open",
                    self.rank
                );
            }
            self.drop_late(&mut out, now);
            // Every step is delivered or dropped at its deadline before this returns.
            if r.settled() && out.is_empty() {
                break;
            }
            if self.blame.abort.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Error::InvalidUsage(
                    "the communicator was aborted by the application while suspending".into(),
                ));
            }
            if !moved {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        // Connections of the other lanes (ROCCL_NETS) are not in the views: they stay open,
        // and their peers are said to be kept.
        let other_lanes = |p: usize| {
            self.send[p][MAX_CHANNELS..].iter().any(Option::is_some)
                || self.recv[p][MAX_CHANNELS..].iter().any(Option::is_some)
        };
        let kept_with = at_start
            .iter()
            .filter(|(p, v)| {
                (v.sends & !r.shut[*p].0) | (v.recvs & !r.shut[*p].1) | v.unsettled != 0
                    || other_lanes(*p)
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

    /// Drop the steps not delivered by their deadline.
    fn drop_late(&self, out: &mut Vec<Outgoing>, now: Instant) {
        out.retain(|o| {
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

/// A round's [`Ends`] over the links: views and closes on the connections, steps sent as
/// notices on connections of their own.
struct LinkEnds<'a> {
    links: &'a mut Links,
    out: &'a mut Vec<Outgoing>,
}

impl Ends for LinkEnds<'_> {
    fn view(&self, peer: usize) -> View {
        self.links.view(peer)
    }
    fn decided(&self, peer: usize) -> u64 {
        self.links.decided(peer)
    }
    fn note_decided(&mut self, peer: usize, round: u64) {
        self.links.note_decided(peer, round)
    }
    fn exited(&self, peer: usize) -> bool {
        matches!(
            self.links.blame.peer_state(peer),
            Some(PeerProcess::Exited { .. })
        )
    }
    fn send(
        &mut self,
        peer: usize,
        (kind, round, mask): (u32, u64, u8),
        deadline: Instant,
        then_close: Option<(u8, u8)>,
    ) {
        self.links
            .queue(self.out, peer, (kind, round, mask), deadline, then_close);
    }
    fn close(&mut self, peer: usize, sends: u8, recvs: u8) -> usize {
        self.links.close_channels(peer, sends, recvs)
    }
    fn drop_unsent_requests(&mut self) {
        self.out.retain(|o| o.kind != REQUEST || o.sent.is_some());
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
