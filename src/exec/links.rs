//! Connections to peers, one per (peer, channel, direction), opened lazily on first use.
//!
//! Every rank listens on each network at init and publishes the handles through the
//! bootstrap. When an algorithm needs `rank → peer` on channel `ch`, the sender connects to
//! the peer's handle and sends a 16-byte hello (`magic, rank, channel, comm id`) as the
//! connection's first message; the receiver accepts whatever arrives, reads the hello and
//! files the comm under `(peer, ch)`. All wanted connections of a call are polled together,
//! so no order of connects and accepts can deadlock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, PeerCause, Result};
use crate::net::{
    Connecting, ListenComm, Net, NetHandle, PollFd, RecvBuf, RecvComm, ReqId, SendComm,
};

use crate::os::wait::Waiter;

use super::hello::{self, Hello};

mod blame;
mod gpu;
mod suspend;

pub(crate) use blame::Blame;
pub(crate) use gpu::{DevCached, GpuRegs, DEV_CACHE};

/// Bytes of the longest hello-protocol message.
const HELLO_MAX: usize = hello::MAX_LEN;
/// Most channels (independent connection sets) per peer.
pub(crate) const MAX_CHANNELS: usize = 8;
/// Most lanes per peer: the network that reaches it (lane 0), then one per network of
/// `ROCCL_NETS` (`comm::config::EXTRA_NETS`: lane 1 + its place there).
pub(crate) const MAX_LANES: usize = 4;
/// Connections per peer and direction: channel `c` of lane `l` is slot `c + l *
/// MAX_CHANNELS` (what the hello carries, so both ends file it alike).
pub(crate) const SLOTS: usize = MAX_CHANNELS * MAX_LANES;

/// How long a rank that failed spends telling the others whom to blame (abort notices) or
/// which call it is in (a mismatch notice), before it closes its connections.
pub(crate) const NOTICE_BUDGET: Duration = Duration::from_millis(500);
/// How long a rank telling of a mismatch, or of its own timeout, spends on it: the others
/// may be waiting on it and would blame it otherwise.
pub(crate) const SHORT_NOTICE_BUDGET: Duration = Duration::from_millis(300);
/// How long a rank whose connection broke collects other ranks' notices before it names a
/// culprit (after a timeout it waits [`Links::timeout_grace`] instead).
const BLAME_GRACE: Duration = Duration::from_millis(300);
/// How long a rank waits on for more notices once the one it has settles the culprit.
const BLAME_SETTLE: Duration = Duration::from_millis(50);
/// The bounds of [`Links::timeout_grace`]: half the timeout, within these.
pub(crate) const TIMEOUT_GRACE_MIN: Duration = Duration::from_millis(500);
/// See [`TIMEOUT_GRACE_MIN`].
pub(crate) const TIMEOUT_GRACE_MAX: Duration = Duration::from_secs(2);

/// The message `h` from `rank` of communicator `comm_id`, boxed to stay put while it is
/// sent, and its length.
fn hello_message(h: &Hello, rank: usize, comm_id: u32) -> (Box<[u8; HELLO_MAX]>, usize) {
    let mut buf = Box::new([0u8; HELLO_MAX]);
    let len = hello::encode(h, rank, comm_id, &mut buf);
    (buf, len)
}

/// A peer's process on this host that is not simply running ([`Links::peer_state`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerProcess {
    /// It has exited.
    Exited {
        /// Its process id.
        pid: u32,
    },
    /// It is stopped (SIGSTOP, a terminal's Ctrl-Z, a debugger).
    Stopped {
        /// Its process id.
        pid: u32,
    },
}

impl PeerProcess {
    /// The cause an error blaming the peer gives.
    pub fn cause(self) -> PeerCause {
        match self {
            PeerProcess::Exited { .. } => PeerCause::Exited,
            PeerProcess::Stopped { .. } => PeerCause::Stopped,
        }
    }
}

impl std::fmt::Display for PeerProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerProcess::Exited { pid } => {
                write!(f, "its process (pid {pid} on this host) has exited")
            }
            PeerProcess::Stopped { pid } => write!(
                f,
                "its process (pid {pid} on this host) is stopped (SIGSTOP, a terminal's Ctrl-Z, or a debugger)"
            ),
        }
    }
}

/// What the communicator tells its links at init besides the connections to make
/// ([`Links::new`]); the default knows no peer process, no GPU memory and no counters.
#[derive(Default)]
pub(crate) struct LinkSettings {
    /// Per peer, its process id where this rank can look at it (same host and pid
    /// namespace): a failure then says whether it exited or is stopped.
    pub local_pids: Vec<Option<u32>>,
    /// How long to collect other ranks' notices after a timeout (default
    /// [`TIMEOUT_GRACE_MIN`]).
    pub timeout_grace: Option<Duration>,
    /// After how long without progress a call says which ranks it waits on (default: never).
    pub stuck_warn: Option<Duration>,
    /// Per peer, how GPU memory is registered toward it (see [`Links::device_memory`]);
    /// empty: nowhere.
    pub device_mem: Vec<Option<bool>>,
    /// The communicator's counters.
    pub metrics: Option<Arc<crate::metrics::CommMetrics>>,
    /// Per peer, the endpoint of each lane both ends have (lane 0: `peer_net`'s); empty:
    /// one lane per peer.
    pub lanes: Vec<[Option<usize>; MAX_LANES]>,
}

/// A network and this rank's endpoint on it.
pub(crate) struct Endpoint {
    pub net: Arc<dyn Net>,
    /// The device this rank's channel 0 uses (channel `c`: the `c`th after it).
    pub dev: usize,
    pub listen: Box<dyn ListenComm>,
}

struct HelloOut {
    comm: Box<dyn SendComm>,
    req: ReqId,
    _buf: Box<[u8; HELLO_MAX]>,
}

impl HelloOut {
    /// Post the first `len` bytes of `buf` (a hello or a notice) on the fresh `comm`;
    /// `None` when the network refuses it.
    fn post(mut comm: Box<dyn SendComm>, buf: Box<[u8; HELLO_MAX]>, len: usize) -> Option<Self> {
        // SAFETY: `buf` is boxed and kept in `HelloOut` with the comm (declared first,
        // dropped first) until the send completes.
        match unsafe { comm.isend(buf.as_ptr(), len, 0, None) } {
            Ok(Some(req)) => Some(HelloOut {
                comm,
                req,
                _buf: buf,
            }),
            _ => None,
        }
    }
}

struct HelloIn {
    comm: Box<dyn RecvComm>,
    req: ReqId,
    buf: Box<[u8; HELLO_MAX]>,
}

/// All of one rank's connections, and what it keeps beside them between calls, each concern
/// in its own part.
pub(crate) struct Links {
    pub rank: usize,
    pub nranks: usize,
    comm_id: u32,
    pub endpoints: Vec<Endpoint>,
    /// Which endpoint (network) each peer is reached through.
    pub peer_net: Vec<usize>,
    /// `handles[peer][net]`.
    pub handles: Vec<Vec<NetHandle>>,
    send: PerPeer<Box<dyn SendComm>>,
    recv: PerPeer<Box<dyn RecvComm>>,
    /// Per peer and lane: one connection carries both directions of each channel
    /// ([`Net::duplex`]); the lower rank of the pair opens it, whichever direction it needs
    /// first.
    duplex: Vec<[bool; MAX_LANES]>,
    /// Which network carries what to each peer (several lanes: `ROCCL_NETS`).
    pub lanes: Lanes,
    /// Connections this rank opened (not accepted).
    pub dialed: usize,
    /// Accepted connections whose hello has not arrived yet.
    incoming: Vec<HelloIn>,
    /// Identified connections not yet asked for (peer, channel, duplex, comm).
    spare: Vec<(usize, usize, bool, Box<dyn RecvComm>)>,
    /// Messages posted on each connection since it opened, sends and receives: equal
    /// counts at both ends of an idle connection say that nothing is in flight on it.
    posted_sends: PerPeer<u64>,
    posted_recvs: PerPeer<u64>,
    /// This rank's virtual clock, on a simulated network (`net::sim`).
    pub clock: Option<Arc<crate::net::sim::Clock>>,
    /// Whom to blame when something fails: notices, suspects, the abort flag.
    pub blame: Blame,
    /// Rounds of [`Links::close_idle`]: steps received, decisions seen.
    suspend: suspend::Rounds,
    /// GPU memory toward the peers, and its registrations kept across calls.
    pub gpu: GpuRegs,
    /// What the executor watches: counters and when to say a call is stuck.
    pub watch: Watch,
    /// Vectors the executor reuses from call to call.
    pub scratch: super::requests::Scratch,
}

/// The lanes to each peer, and which one the current call uses ([`Links::slot`]).
#[derive(Default)]
pub(crate) struct Lanes {
    /// Per peer, the endpoint of each lane ([`LinkSettings::lanes`]); empty: lane 0 only.
    pub endpoints: Vec<[Option<usize>; MAX_LANES]>,
    /// Per peer, the lane of the current call.
    pub current: Vec<u8>,
    /// Per peer, the lane by call size: (from this many bytes, lane), ascending; empty:
    /// lane 0 at every size.
    pub by_size: Vec<Vec<(usize, u8)>>,
    /// The lane every peer's point-to-point messages take instead of lane 0 (the
    /// measurement of each network at init).
    pub forced: Option<u8>,
}

impl Lanes {
    /// Set each peer's lane for a collective of `bytes` (the buffer every rank passes
    /// alike, so both ends of each pair choose the same lane).
    pub fn for_call(&mut self, bytes: usize) {
        for (cur, steps) in self.current.iter_mut().zip(&self.by_size) {
            *cur = steps
                .iter()
                .take_while(|s| s.0 <= bytes)
                .last()
                .map_or(0, |s| s.1);
        }
    }

    /// The lanes to `peer`: 0, then each network both ends offer.
    pub fn toward(&self, peer: usize) -> Vec<usize> {
        match self.endpoints.get(peer) {
            Some(l) => (0..MAX_LANES).filter(|&k| l[k].is_some()).collect(),
            None => vec![0],
        }
    }

    /// Set every peer's lane for point-to-point calls: lane 0, or the forced one where the
    /// peer has it.
    pub fn for_p2p(&mut self) {
        let f = self.forced.unwrap_or(0);
        for (cur, eps) in self.current.iter_mut().zip(&self.endpoints) {
            *cur = if eps[usize::from(f)].is_some() { f } else { 0 };
        }
    }
}

/// What the executor reports on (see [`Links::watch`]).
pub(crate) struct Watch {
    /// This rank's counters (`crate::metrics`), when the communicator keeps them.
    pub metrics: Option<Arc<crate::metrics::CommMetrics>>,
    /// How long a call may go without progress before it logs what it waits on
    /// (`ROCCL_STUCK_WARN`; default a third of the timeout).
    pub stuck_warn: Duration,
    /// Sends completed (the peer's round-trip time is read every `RTT_EVERY`, in the executor).
    pub sends_done: u64,
}

/// Connections per peer and channel. A peer's row is allocated when a connection to it is
/// first filed: a dense table took 8 × 16 bytes per peer and direction on every rank (1024
/// ranks in one process: 256 MiB), where each rank talks to a few peers.
pub(crate) struct PerPeer<T> {
    rows: Vec<Option<Box<[Option<T>; SLOTS]>>>,
    /// The row of a peer without connections.
    empty: [Option<T>; SLOTS],
}

impl<T> PerPeer<T> {
    fn new(nranks: usize) -> Self {
        PerPeer {
            rows: (0..nranks).map(|_| None).collect(),
            empty: std::array::from_fn(|_| None),
        }
    }

    /// The connections to `peer`, if it is a rank.
    fn get(&self, peer: usize) -> Option<&[Option<T>; SLOTS]> {
        (peer < self.rows.len()).then(|| &self[peer])
    }

    /// Every peer's row (peers without connections have none).
    fn iter(&self) -> impl Iterator<Item = &[Option<T>; SLOTS]> {
        self.rows.iter().flatten().map(|r| &**r)
    }

    fn clear(&mut self) {
        self.rows.iter_mut().for_each(|r| *r = None);
    }
}

impl<T> std::ops::Index<usize> for PerPeer<T> {
    type Output = [Option<T>; SLOTS];
    fn index(&self, peer: usize) -> &Self::Output {
        self.rows[peer].as_deref().unwrap_or(&self.empty)
    }
}

impl<T> std::ops::IndexMut<usize> for PerPeer<T> {
    fn index_mut(&mut self, peer: usize) -> &mut Self::Output {
        self.rows[peer].get_or_insert_with(|| Box::new(std::array::from_fn(|_| None)))
    }
}

impl Links {
    pub fn new(
        rank: usize,
        nranks: usize,
        comm_id: u32,
        endpoints: Vec<Endpoint>,
        peer_net: Vec<usize>,
        handles: Vec<Vec<NetHandle>>,
        settings: LinkSettings,
    ) -> Self {
        let lane_endpoint = |p: usize, lane: usize| match settings.lanes.get(p) {
            Some(l) => l[lane],
            None => (lane == 0).then_some(peer_net[p]),
        };
        let duplex = (0..nranks)
            .map(|p| {
                std::array::from_fn(|lane| {
                    let Some(e) = lane_endpoint(p, lane) else {
                        return false;
                    };
                    let h = |r: usize| handles.get(r).and_then(|h| h.get(e));
                    match (endpoints.get(e), h(rank), h(p)) {
                        (Some(ep), Some(mine), Some(theirs)) if p != rank => {
                            ep.net.duplex(mine, theirs)
                        }
                        _ => false,
                    }
                })
            })
            .collect();
        let lanes = Lanes {
            current: vec![0; settings.lanes.len()],
            by_size: vec![Vec::new(); settings.lanes.len()],
            endpoints: settings.lanes,
            forced: None,
        };
        let endpoints_clock = endpoints.first().and_then(|e| e.net.virtual_clock());
        Links {
            rank,
            nranks,
            comm_id,
            duplex,
            lanes,
            dialed: 0,
            endpoints,
            peer_net,
            handles,
            send: PerPeer::new(nranks),
            recv: PerPeer::new(nranks),
            incoming: Vec::new(),
            spare: Vec::new(),
            posted_sends: PerPeer::new(nranks),
            posted_recvs: PerPeer::new(nranks),
            clock: endpoints_clock,
            blame: Blame::new(rank, nranks, settings.timeout_grace, settings.local_pids),
            suspend: suspend::Rounds::default(),
            gpu: GpuRegs::new(nranks, settings.device_mem),
            watch: Watch {
                metrics: settings.metrics,
                stuck_warn: settings.stuck_warn.unwrap_or(Duration::MAX),
                sends_done: 0,
            },
            scratch: super::requests::Scratch::default(),
        }
    }

    /// A fault on this host's side of the connection to `peer` on channel `ch` (see
    /// [`crate::net::SendComm::local_fault`]).
    pub fn local_fault(&self, peer: usize, ch: usize, send: bool) -> Option<String> {
        if send {
            self.send.get(peer)?.get(ch)?.as_ref()?.local_fault()
        } else {
            self.recv.get(peer)?.get(ch)?.as_ref()?.local_fault()
        }
    }

    /// Connections open: (sends, receives), over every peer and channel.
    pub fn open(&self) -> (usize, usize) {
        (
            self.send.iter().flatten().filter(|c| c.is_some()).count(),
            // Accepted connections not (yet) in use count too.
            self.recv.iter().flatten().filter(|c| c.is_some()).count() + self.spare.len(),
        )
    }

    /// How GPU memory is registered toward `peer` (see `device_mem`).
    pub fn device_memory(&self, peer: usize) -> Option<bool> {
        self.gpu.device_mem.get(peer).copied().flatten()
    }

    /// Name of the network used toward `peer` (on the current call's lane).
    pub fn net_name(&self, peer: usize) -> &'static str {
        let lane = self.lanes.current.get(peer).copied().unwrap_or(0);
        let e = self.endpoint_of(peer, usize::from(lane) * MAX_CHANNELS);
        self.endpoints[e.unwrap_or(self.peer_net[peer])].net.name()
    }

    /// The connection slot of channel `ch` to `peer` on the current call's lane: what the
    /// executor files its connections under.
    pub fn slot(&self, peer: usize, ch: usize) -> usize {
        match self.lanes.current.get(peer) {
            Some(&l) => ch + usize::from(l) * MAX_CHANNELS,
            None => ch,
        }
    }

    /// The endpoint of slot `slot` toward `peer`: its lane's, if the pair has that lane.
    fn endpoint_of(&self, peer: usize, slot: usize) -> Option<usize> {
        let lane = slot / MAX_CHANNELS;
        match self.lanes.endpoints.get(peer) {
            Some(l) => *l.get(lane)?,
            None => (lane == 0).then(|| self.peer_net[peer]),
        }
    }

    /// Whether the connection of slot `slot` to `peer` carries both directions.
    fn duplex_at(&self, peer: usize, slot: usize) -> bool {
        self.duplex[peer][slot / MAX_CHANNELS]
    }

    pub fn send_comm(&mut self, peer: usize, ch: usize) -> Result<&mut Box<dyn SendComm>> {
        let row = self.send.rows.get_mut(peer).and_then(|r| r.as_deref_mut());
        row.and_then(|r| r.get_mut(ch)?.as_mut()).ok_or_else(|| {
            Error::Internal(format!("no send connection to rank {peer} channel {ch}"))
        })
    }

    pub fn recv_comm(&mut self, peer: usize, ch: usize) -> Result<&mut Box<dyn RecvComm>> {
        let row = self.recv.rows.get_mut(peer).and_then(|r| r.as_deref_mut());
        row.and_then(|r| r.get_mut(ch)?.as_mut()).ok_or_else(|| {
            Error::Internal(format!(
                "no receive connection from rank {peer} channel {ch}"
            ))
        })
    }

    /// Count a message posted on the connection to (`send`) or from `peer` on channel `ch`.
    pub fn count_posted(&mut self, peer: usize, ch: usize, send: bool) {
        let counts = if send {
            &mut self.posted_sends
        } else {
            &mut self.posted_recvs
        };
        let n = &mut counts[peer][ch];
        *n = Some(n.unwrap_or(0) + 1);
    }

    pub fn send_fds(&self, peer: usize, ch: usize, out: &mut Vec<PollFd>) {
        if let Some(c) = &self.send[peer][ch] {
            c.poll_fds(out);
        }
    }

    pub fn recv_fds(&self, peer: usize, ch: usize, out: &mut Vec<PollFd>) {
        if let Some(c) = &self.recv[peer][ch] {
            c.poll_fds(out);
        }
    }

    /// Drop every connection (after an error or an abort, so nothing touches user memory
    /// again): what was sent is not drained.
    pub fn close_all(&mut self) {
        self.close(true);
    }

    /// Drop every connection; `abandon`: without draining what was sent (see
    /// [`SendComm::abandon`]), else each send comm drains as it closes (a destroy).
    fn close(&mut self, abandon: bool) {
        for s in self.send.rows.iter_mut().flatten() {
            for c in s.iter_mut().flatten().filter(|_| abandon) {
                c.abandon();
            }
        }
        self.send.clear();
        self.recv.clear();
        self.posted_sends.clear();
        self.posted_recvs.clear();
        self.suspend.inbox.clear();
        self.incoming.clear();
        self.spare.clear();
        // Their registrations went with the connections.
        self.gpu.cache.clear();
    }

    /// Release cached GPU registration `i`; false (and kept) when the network refuses,
    /// e.g. while a request still uses it. An entry whose connection is gone just goes.
    pub fn drop_cached(&mut self, i: usize) -> bool {
        let e = &self.gpu.cache[i];
        let (peer, ch, send) = (e.peer, e.ch, e.send);
        let mr = crate::net::MemHandle {
            addr: e.mr.addr,
            len: e.mr.len,
            key: e.mr.key,
        };
        let r = if send {
            self.send_comm(peer, ch).map(|c| c.dereg_mr(mr))
        } else {
            self.recv_comm(peer, ch).map(|c| c.dereg_mr(mr))
        };
        match r {
            // Still used by a request in flight: kept (and tried again later).
            Ok(Err(err @ crate::error::Error::InvalidUsage(_))) => {
                crate::info!("keeping a cached GPU registration toward rank {peer}: {err}");
                false
            }
            // Released, gone with its connection, or unknown to the network: forgotten.
            Ok(_) | Err(_) => {
                self.gpu.cache.swap_remove(i);
                true
            }
        }
    }

    /// Whether every connection of `sends` and `recvs` is open already.
    pub fn has_all(
        &self,
        sends: impl IntoIterator<Item = (usize, usize)>,
        recvs: impl IntoIterator<Item = (usize, usize)>,
    ) -> bool {
        let ok = |p: usize, c: usize| p == self.rank || (p < self.nranks && c < SLOTS);
        sends
            .into_iter()
            .all(|(p, c)| ok(p, c) && (p == self.rank || self.send[p][c].is_some()))
            && recvs
                .into_iter()
                .all(|(p, c)| ok(p, c) && (p == self.rank || self.recv[p][c].is_some()))
    }

    /// Make sure the connections `sends` (to peer, channel) and `recvs` (from peer, channel)
    /// exist, opening the missing ones together.
    pub fn ensure(
        &mut self,
        sends: &[(usize, usize)],
        recvs: &[(usize, usize)],
        waiter: &Waiter,
    ) -> Result<()> {
        if self.has_all(sends.iter().copied(), recvs.iter().copied()) {
            return Ok(()); // the common case: no allocation
        }
        let (need_send, need_recv) = self.missing(sends, recvs)?;
        if need_send.is_empty() && need_recv.is_empty() {
            return Ok(());
        }
        let dial = self.to_dial(&need_send, &need_recv);
        let mut connecting = self.dial(&dial)?;
        let mut hellos: Vec<(usize, usize, HelloOut)> = Vec::new();
        let mut fds = Vec::new();
        let mut w = waiter.start();
        loop {
            let mut progressed = self.say_hello(&mut connecting, &mut hellos)?;
            progressed |= self.hellos_sent(&mut hellos)?;
            progressed |= self.accept_pending()?;
            // Receives arrive as accepted connections, and so do sends to the duplex peers
            // that open the connection.
            let awaited: Vec<(usize, usize)> = need_recv
                .iter()
                .copied()
                .filter(|&(p, c)| self.recv[p][c].is_none())
                .chain(
                    need_send
                        .iter()
                        .copied()
                        .filter(|&(p, c)| self.send[p][c].is_none() && !dial.contains(&(p, c))),
                )
                .collect();
            if connecting.is_empty() && hellos.is_empty() && awaited.is_empty() {
                return Ok(());
            }
            if progressed {
                w.progressed();
                continue;
            }
            fds.clear();
            for (_, _, c) in &connecting {
                c.poll_fds(&mut fds);
            }
            for (_, _, h) in &hellos {
                h.comm.poll_fds(&mut fds);
            }
            self.listen_fds(&mut fds);
            let waiting_on: Vec<usize> = connecting
                .iter()
                .map(|x| x.0)
                .chain(hellos.iter().map(|x| x.0))
                .chain(awaited.iter().map(|x| x.0))
                .collect();
            if self.blame.abort.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Error::InvalidUsage(
                    "the communicator was aborted by the application while connecting".into(),
                ));
            }
            if self.blame.aborted() {
                return Err(self.aborted_while_connecting(waiting_on.iter().copied().min()));
            }
            if w.idle(&fds).is_err() {
                return Err(self.connect_timed_out(waiting_on, waiter));
            }
        }
    }

    /// The connections of `sends` and `recvs` (peer, channel) this rank lacks, each once: a
    /// batch with several messages to one peer lists it several times, and a second
    /// connection to the same (peer, channel) would replace the first after the peer had
    /// taken it (it then read end-of-file).
    #[allow(clippy::type_complexity)]
    fn missing(
        &self,
        sends: &[(usize, usize)],
        recvs: &[(usize, usize)],
    ) -> Result<(Vec<(usize, usize)>, Vec<(usize, usize)>)> {
        let mut need_send: Vec<(usize, usize)> = sends
            .iter()
            .copied()
            .filter(|&(p, c)| p != self.rank && self.send[p][c].is_none())
            .collect();
        need_send.sort_unstable();
        need_send.dedup();
        let mut need_recv: Vec<(usize, usize)> = recvs
            .iter()
            .copied()
            .filter(|&(p, c)| p != self.rank && self.recv[p][c].is_none())
            .collect();
        need_recv.sort_unstable();
        need_recv.dedup();
        for &(p, c) in need_send.iter().chain(&need_recv) {
            if p >= self.nranks || c >= SLOTS || self.endpoint_of(p, c).is_none() {
                return Err(Error::Internal(format!(
                    "connection to rank {p} slot {c}: out of range, or a network that rank does not share"
                )));
            }
        }
        Ok((need_send, need_recv))
    }

    /// What this rank dials: its sends, except to duplex peers, where the lower rank of the
    /// pair opens the connection that carries both ways, for whichever way it needs.
    fn to_dial(
        &self,
        need_send: &[(usize, usize)],
        need_recv: &[(usize, usize)],
    ) -> Vec<(usize, usize)> {
        let mut dial: Vec<(usize, usize)> = need_send
            .iter()
            .chain(need_recv)
            .copied()
            .filter(|&(p, c)| {
                if self.duplex_at(p, c) {
                    self.rank < p && self.send[p][c].is_none() && self.recv[p][c].is_none()
                } else {
                    need_send.contains(&(p, c))
                }
            })
            .collect();
        dial.sort_unstable();
        dial.dedup();
        dial
    }

    /// Start connecting to each (peer, channel) of `dial`, over the network that reaches the
    /// peer; channels spread over the network's devices (several NICs), in turn from this
    /// rank's first.
    #[allow(clippy::type_complexity)]
    fn dial(
        &mut self,
        dial: &[(usize, usize)],
    ) -> Result<Vec<(usize, usize, Box<dyn Connecting>)>> {
        let mut connecting = Vec::with_capacity(dial.len());
        for &(p, c) in dial {
            let e = self
                .endpoint_of(p, c)
                .ok_or_else(|| Error::Internal(format!("no network for rank {p} slot {c}")))?;
            let ep = &self.endpoints[e];
            let open = if self.duplex_at(p, c) {
                Net::connect_duplex
            } else {
                Net::connect
            };
            let dev = (ep.dev + c % MAX_CHANNELS) % ep.net.devices().max(1);
            let conn = open(&*ep.net, dev, &self.handles[p][e]).map_err(|err| {
                Error::remote(
                    p,
                    PeerCause::Failed,
                    format!("connecting over {}: {err}", ep.net.name()),
                )
            })?;
            connecting.push((p, c, conn));
            self.dialed += 1;
        }
        Ok(connecting)
    }

    /// Drive the connections being made: each one made sends its hello (moved from
    /// `connecting` to `hellos`). Whether any did.
    #[allow(clippy::type_complexity)]
    fn say_hello(
        &mut self,
        connecting: &mut Vec<(usize, usize, Box<dyn Connecting>)>,
        hellos: &mut Vec<(usize, usize, HelloOut)>,
    ) -> Result<bool> {
        let mut progressed = false;
        let mut i = 0;
        while i < connecting.len() {
            let (p, c) = (connecting[i].0, connecting[i].1);
            let failed = |err: Error| Error::remote(p, PeerCause::Failed, err.to_string());
            let Some(mut comm) = connecting[i].2.poll().map_err(failed)? else {
                i += 1;
                continue;
            };
            let h = Hello::Channel {
                channel: c,
                duplex: self.duplex_at(p, c),
            };
            let (buf, len) = hello_message(&h, self.rank, self.comm_id);
            // SAFETY: `buf` is boxed and kept in `HelloOut` next to the comm until the
            // send completes; the comm is declared first so it drops first.
            let req = unsafe { comm.isend(buf.as_ptr(), len, 0, None) }
                .map_err(failed)?
                .ok_or_else(|| Error::Internal("fresh connection has no free request".into()))?;
            hellos.push((
                p,
                c,
                HelloOut {
                    comm,
                    req,
                    _buf: buf,
                },
            ));
            connecting.swap_remove(i);
            progressed = true;
        }
        Ok(progressed)
    }

    /// Connections whose hello went out are ready: kept as the send (and, duplex, the
    /// receive) connection to their peer. Whether any was.
    fn hellos_sent(&mut self, hellos: &mut Vec<(usize, usize, HelloOut)>) -> Result<bool> {
        let mut progressed = false;
        let mut i = 0;
        while i < hellos.len() {
            let (p, c) = (hellos[i].0, hellos[i].1);
            let h = &mut hellos[i].2;
            let sent = h.comm.test(h.req);
            if sent
                .map_err(|err| Error::remote(p, PeerCause::Failed, err.to_string()))?
                .is_none()
            {
                i += 1;
                continue;
            }
            let (_, _, mut h) = hellos.swap_remove(i);
            if self.duplex_at(p, c) {
                let back = h.comm.reverse().ok_or_else(|| {
                    Error::Internal(format!(
                        "{} offered duplex connections but gave no receiving side",
                        self.net_name(p)
                    ))
                })?;
                self.recv[p][c] = Some(back);
            }
            self.send[p][c] = Some(h.comm);
            progressed = true;
        }
        Ok(progressed)
    }

    /// The error of connections not made within the deadline: the peers waited on, and what
    /// this host can see of their processes (exited, stopped) says why.
    fn connect_timed_out(&mut self, mut who: Vec<usize>, waiter: &Waiter) -> Error {
        who.sort_unstable();
        who.dedup();
        let seen: Vec<String> = who
            .iter()
            .filter_map(|&p| Some(format!("rank {p}: {}", self.blame.peer_state(p)?)))
            .collect();
        let why = if seen.is_empty() {
            "are they alive and running the same collectives?".to_string()
        } else {
            seen.join("; ")
        };
        let detail = format!(
            "rank {} could not connect with {} within {:.0?} (ROCCL_TIMEOUT): {why}",
            self.rank,
            crate::error::ranks_list(&who),
            waiter.timeout
        );
        self.blame.suspect = who.first().copied();
        self.failure(self.blame.suspect, true, detail)
    }
}

impl Links {
    /// Another rank aborted while this one was opening connections, still waiting on
    /// `waiting_on` (the lowest such peer). Blamed itself, this rank is alive (a slow one on
    /// a loaded machine): it passes the blame on to that peer and tells everyone, as a rank
    /// blamed in a collective's wait does.
    fn aborted_while_connecting(&mut self, waiting_on: Option<usize>) -> Error {
        let me = self.rank;
        let blamed_me = self.blame.notices.iter().any(|n| n.1 == me);
        let detail = "another rank aborted while connections were being opened";
        match waiting_on.filter(|_| blamed_me) {
            Some(p) => self.failure(
                Some(p),
                true,
                format!("{detail}; this rank was connecting with rank {p}"),
            ),
            None => self.failure(None, false, detail.into()),
        }
    }

    /// Accept new connections, read their hellos and file them. An abort notice from a peer
    /// becomes an error naming the rank that failed. Returns whether anything moved.
    pub fn accept_pending(&mut self) -> Result<bool> {
        let mut progressed = false;
        for e in 0..self.endpoints.len() {
            while let Some(mut comm) = self.endpoints[e].listen.accept()? {
                let mut buf = Box::new([0u8; HELLO_MAX]);
                let rb = RecvBuf {
                    ptr: buf.as_mut_ptr(),
                    len: HELLO_MAX,
                    tag: 0,
                };
                // SAFETY: `buf` is boxed and kept in `HelloIn` with the comm (declared first,
                // dropped first) until the receive completes.
                let req = unsafe { comm.irecv(&[rb]) }?.ok_or_else(|| {
                    Error::Internal("fresh connection has no free request".into())
                })?;
                self.incoming.push(HelloIn { comm, req, buf });
                progressed = true;
            }
        }
        let mut i = 0;
        while i < self.incoming.len() {
            let mut sizes = [0usize; 1];
            let h = &mut self.incoming[i];
            let done = match h.comm.test(h.req, &mut sizes) {
                Ok(d) => d,
                Err(_) => {
                    // A connection that died before saying who it is: forget it.
                    self.incoming.swap_remove(i);
                    continue;
                }
            };
            if !done {
                i += 1;
                continue;
            }
            let h = self.incoming.swap_remove(i);
            let Some((p, message)) = hello::decode(&h.buf[..sizes[0]], self.comm_id, self.nranks)
            else {
                continue; // not one of ours
            };
            match message {
                Hello::Mismatch { tag } => {
                    self.blame.mismatch = Some((p, tag));
                    self.blame.notices.push((p, self.rank));
                }
                Hello::SuspendStep { kind, message } => self.file_step(p, kind, message),
                Hello::Abort { failed } => self.blame.notices.push((p, failed)),
                Hello::Channel { channel, duplex } if channel < SLOTS => {
                    self.spare.push((p, channel, duplex, h.comm));
                }
                Hello::Channel { .. } => continue,
            }
            progressed = true;
        }
        let mut i = 0;
        while i < self.spare.len() {
            let (p, c, duplex) = (self.spare[i].0, self.spare[i].1, self.spare[i].2);
            if self.recv[p][c].is_none() && !(duplex && self.send[p][c].is_some()) {
                let (_, _, _, mut comm) = self.spare.swap_remove(i);
                if duplex {
                    self.send[p][c] = Some(comm.reverse().ok_or_else(|| {
                        Error::Internal(format!(
                            "rank {p} opened a duplex connection over {}, which gave no sending side",
                            self.net_name(p)
                        ))
                    })?);
                }
                self.recv[p][c] = Some(comm);
            } else {
                i += 1;
            }
        }
        Ok(progressed)
    }

    /// Descriptors of the listeners (to wake up on connections and abort notices).
    pub fn listen_fds(&self, out: &mut Vec<PollFd>) {
        for e in &self.endpoints {
            e.listen.poll_fds(out);
        }
        for h in &self.incoming {
            h.comm.poll_fds(out);
        }
    }

    /// Decide which rank failed. `own` is the peer this rank saw fail (a broken connection
    /// or a wait that timed out), if any. Abort notices from other ranks are collected for up
    /// to `grace`; once one has arrived, 50 ms more suffice if `own` has reported (it is
    /// alive, so not the culprit) or there is no `own`. Every rank that sent a notice is
    /// alive, so the culprit is a rank that is blamed but has not reported; the most blamed
    /// wins.
    ///
    /// Waiting for `own` matters in chains of waits: rank 2 waits on rank 0, which waits on
    /// the hung rank 1, which rank 3 blames. Should rank 0's notice come late (a loaded
    /// machine), rank 0 and rank 1 would have one vote each and rank 2 would blame rank 0;
    /// other ranks blaming rank 0 too (rank 0's other children in a tree) do not settle it
    /// either. A suspect that is really gone costs the whole grace period (0.5–2 s, after a
    /// timeout of at least twice that).
    pub fn blame(&mut self, own: Option<usize>, grace: Duration) -> Option<usize> {
        let start = Instant::now();
        let mut first: Option<Instant> = None;
        loop {
            let _ = self.accept_pending();
            if first.is_none() && self.blame.aborted() {
                first = Some(Instant::now());
            }
            let settled = own.map_or(true, |o| self.blame.notices.iter().any(|n| n.0 == o));
            let now = Instant::now();
            // Settled with a culprit in view; or every rank blamed so far has reported (is
            // alive), so wait on for the notices that leave one rank silent.
            if now >= start + grace
                || (settled
                    && first.is_some_and(|f| now >= f + BLAME_SETTLE)
                    && self.blame.culprit(None).is_some())
            {
                break;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        self.blame.culprit(own).or(own)
    }

    /// The error to report when this rank gives up: names the culprit found by
    /// [`Links::blame`], and who reported it. `timed_out` tells a timeout from a broken
    /// connection; `detail` says what this rank itself saw.
    pub fn failure(&mut self, own: Option<usize>, timed_out: bool, detail: String) -> Error {
        if timed_out {
            if let Some(s) = own {
                // Tell the others first: they may be waiting on us and blame us otherwise.
                self.notify_abort(s, true, SHORT_NOTICE_BUDGET);
            }
        }
        // After a timeout the real culprit's neighbours time out at about the same moment,
        // give or take scheduling: wait long enough to hear from them.
        let grace = if timed_out {
            self.blame.timeout_grace
        } else {
            BLAME_GRACE
        };
        let culprit = self.blame(own, grace);
        if let Some((p, tag)) = self
            .blame
            .mismatch
            .filter(|m| own.map_or(true, |o| o == m.0))
        {
            // The peer closed because it found us in another call: say so (the
            // communicator names both calls).
            return Error::remote(
                p,
                PeerCause::OtherCall {
                    ours: self.blame.call,
                    theirs: tag,
                },
                crate::net::unexpected_tag(tag).to_string(),
            );
        }
        let reporters: Vec<usize> = self
            .blame
            .notices
            .iter()
            .filter(|n| Some(n.1) == culprit)
            .map(|n| n.0)
            .collect();
        match culprit {
            Some(c) if !reporters.is_empty() && Some(c) != own => {
                let state = self.blame.peer_state(c);
                Error::remote(
                    c,
                    state.map_or(PeerCause::Failed, PeerProcess::cause),
                    format!(
                        "rank {c} {} (reported by {}); this rank saw: {detail}",
                        state.map_or("failed or stopped responding".into(), |s| format!(
                            "failed: {s}"
                        )),
                        crate::error::ranks_list(&reporters)
                    ),
                )
            }
            // The rank this one waited on while others reported (they are alive), or, nobody
            // having blamed it, the one rank that did not report: name it.
            Some(c) if timed_out && (Some(c) != own || self.blame.aborted()) => {
                let why = if Some(c) == own {
                    "this rank waited on it; the ranks that reported are alive".to_string()
                } else {
                    format!("every other rank reported that its call stopped; rank {c} reported nothing")
                };
                let process = self.blame.peer_state(c);
                let state = process.map_or(
                    "did not answer: it is hung, stopped or unreachable".into(),
                    |s| format!("failed: {s}"),
                );
                Error::remote(
                    c,
                    process.map_or(PeerCause::Unresponsive, PeerProcess::cause),
                    format!("rank {c} {state} ({why}); this rank saw: {detail}"),
                )
            }
            Some(c) if !timed_out => Error::remote(c, PeerCause::Failed, detail),
            _ => Error::timeout(own.into_iter().collect(), detail),
        }
    }

    /// Best effort: tell every other rank that `cause` failed, so that ranks not connected
    /// to it learn which rank to blame. Bounded to about `budget` in total. With
    /// `tell_cause` (after a timeout), `cause` is told too: it may be alive, waiting on
    /// another rank, and must learn that this rank is alive (a rank that sent a notice is not
    /// the culprit) — in a ring where rank 1 waits on rank 0, which waits on the hung rank 3,
    /// rank 0 would otherwise count rank 2's vote against rank 1 as much as its own against
    /// rank 3, and could blame rank 1; a rank blamed while it waits passes the blame on to
    /// the rank it waits for. Without (a peer that broke its connection or sent what this
    /// rank refused), the cause already knows what went wrong from its own side.
    pub fn notify_abort(&mut self, cause: usize, tell_cause: bool, budget: Duration) {
        if self.blame.notified {
            return;
        }
        self.blame.notified = true;
        let others: Vec<usize> = (0..self.nranks)
            .filter(|&p| p != self.rank && (tell_cause || p != cause))
            .collect();
        self.send_notices(&others, Hello::Abort { failed: cause }, budget);
    }

    /// Best effort: tell `peer` that it is in another call than this rank's (tag `tag`), so
    /// that its error names both calls too. Bounded to about `budget`.
    pub fn notify_mismatch(&mut self, peer: usize, tag: u32, budget: Duration) {
        self.send_notices(&[peer], Hello::Mismatch { tag }, budget);
    }

    fn send_notices(&mut self, to: &[usize], notice: Hello, budget: Duration) {
        let end = Instant::now() + budget;
        let mut pending = Vec::new();
        for &p in to {
            let e = self.peer_net[p];
            let ep = &self.endpoints[e];
            if let Ok(c) = ep.net.connect(ep.dev, &self.handles[p][e]) {
                pending.push((c, None::<HelloOut>));
            }
        }
        while !pending.is_empty() && Instant::now() < end {
            // The others may be sending theirs at this moment: over networks whose connect
            // needs the peer's accept (the userspace RoCE v2 engine), two ranks each waiting
            // for the other to accept would exchange nothing.
            let _ = self.accept_pending();
            pending.retain_mut(|(conn, sent)| {
                if let Some(h) = sent {
                    return !matches!(h.comm.test(h.req), Ok(Some(_)) | Err(_));
                }
                match conn.poll() {
                    Ok(Some(comm)) => {
                        let (buf, len) = hello_message(&notice, self.rank, self.comm_id);
                        *sent = HelloOut::post(comm, buf, len);
                        sent.is_some()
                    }
                    Ok(None) => true,
                    Err(_) => false,
                }
            });
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        // A destroy: sends already reported done reach their peers first.
        self.close(false);
    }
}

#[cfg(test)]
mod tests;
