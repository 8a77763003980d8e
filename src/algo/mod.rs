//! Collective algorithms, named `<collective>_<algorithm>` as in Gloo.
//!
//! Each algorithm is a state machine over an `Exec`: `advance` posts whatever sends and
//! receives its dependencies allow, reduces what has arrived, and reports whether anything
//! moved; `drive` runs several machines (channels, trees) until all are done, sleeping in
//! the executor only when none can move. Machines never touch memory directly: they name
//! regions of the call's buffers and the executor checks every access.

mod bruck;
mod by_host;
pub mod calibrate;
pub mod model;
mod ordered;
mod p2p;
mod ring;
pub(crate) mod shm;
pub mod topo;
mod tree;

use std::fmt;
use std::str::FromStr;

pub(crate) use bruck::{all_gather_bruck, all_reduce_bruck, bruck_stage, reduce_scatter_bruck};
pub(crate) use by_host::{
    all_gather_within_hosts, exchange_between_leaders, exchange_between_leaders_stage,
    gather_to_leader, leaders_fit, reduce_within_hosts, reduce_within_hosts_stage,
    scatter_from_leader,
};
pub(crate) use ordered::{
    reduce_direct, reduce_direct_stage, reduce_scatter_direct, reduce_scatter_direct_stage,
};
pub(crate) use p2p::P2P_CHANNEL;
pub(crate) use p2p::{
    all_reduce_direct, all_reduce_direct_stage, all_reduce_doubling, all_reduce_twoshot,
    all_reduce_twoshot_stage, all_to_all_pairwise, barrier_dissemination, sendrecv,
};
pub(crate) use ring::{
    all_gather_ring, all_reduce_ring, all_reduce_ring_half, all_reduce_ring_stage, broadcast_ring,
    chain_stage, reduce_ring, reduce_scatter_ring, reduce_scatter_ring_stage, ring_owned, Half,
};
pub(crate) use tree::{all_reduce_tree, broadcast_tree, reduce_tree, tree_stage};

use crate::error::{Error, Result};
use crate::exec::{Buf, Exec, Reg, Tok};

/// Algorithm choice for a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    /// Pipelined ring (chain for rooted collectives).
    Ring,
    /// Pipelined (double) binary tree.
    Tree,
    /// One step: every rank sends its whole buffer to every peer (small messages).
    Direct,
    /// Recursive doubling: log2(n) pairwise exchanges of the whole buffer (small messages).
    Doubling,
    /// Two steps: a direct reduce-scatter then a direct all-gather, a block per peer in
    /// each (small and middle messages on few ranks).
    TwoShot,
    /// Through the host's shared-memory segments, one synchronisation per piece: every rank
    /// reads every input (all ranks on one host; every collective).
    ShmOneShot,
    /// Through the host's shared-memory segments, two-shot all-reduce: each rank reduces
    /// a 1/n share, then everyone copies the reduced shares (all ranks on one host).
    ShmTwoShot,
    /// By hosts (jobs of several hosts with several ranks on some): each host reduces among
    /// its ranks, hosts exchange between one rank each (or between ranks of the same local
    /// index, each with a share), and each host spreads the result among its ranks.
    Hier,
    /// Bruck's log-step exchanges (`algo/bruck.rs`): all-gather and reduce-scatter in
    /// ⌈log2 n⌉ steps, all-reduce in twice that, on any number of ranks (small messages on
    /// many ranks).
    Bruck,
}

// Counters keep a slot per algorithm besides "none", and call tags 4 bits (0: none).
const _: () = assert!(Algo::ALL.len() < crate::metrics::MAX_ALGOS && Algo::ALL.len() < 16);

impl Algo {
    /// The names of [`Algo::ALL`], in its order.
    pub const NAMES: [&'static str; 9] = [
        "ring", "tree", "direct", "doubling", "twoshot", "shm1", "shm2", "hier", "bruck",
    ];

    /// Every algorithm (what `ROCCL_ALGO` and `roccl-perf --algo` accept, besides `auto`).
    pub const ALL: [Algo; 9] = [
        Algo::Ring,
        Algo::Tree,
        Algo::Direct,
        Algo::Doubling,
        Algo::TwoShot,
        Algo::ShmOneShot,
        Algo::ShmTwoShot,
        Algo::Hier,
        Algo::Bruck,
    ];

    /// Name as printed and parsed.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::Tree => "tree",
            Algo::Direct => "direct",
            Algo::Doubling => "doubling",
            Algo::TwoShot => "twoshot",
            Algo::ShmOneShot => "shm1",
            Algo::ShmTwoShot => "shm2",
            Algo::Hier => "hier",
            Algo::Bruck => "bruck",
        }
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algo {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "ring" => Ok(Algo::Ring),
            "tree" => Ok(Algo::Tree),
            "direct" | "oneshot" | "one-shot" => Ok(Algo::Direct),
            "doubling" | "rd" | "recursive-doubling" => Ok(Algo::Doubling),
            "twoshot" | "two-shot" | "2shot" => Ok(Algo::TwoShot),
            "shm1" | "shm" | "shm-oneshot" => Ok(Algo::ShmOneShot),
            "shm2" | "shm-twoshot" => Ok(Algo::ShmTwoShot),
            "hier" | "hierarchical" => Ok(Algo::Hier),
            "bruck" => Ok(Algo::Bruck),
            other => Err(Error::arg(format!(
                "unknown algorithm '{other}' (ROCCL_ALGO / --algo): expected auto, ring, tree, direct, doubling, twoshot, shm1, shm2, hier or bruck"
            ))),
        }
    }
}

/// Pipeline shape of one call, chosen by the cost model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pipeline {
    /// Bytes per slice (the unit sent in one message).
    pub slice: usize,
    /// Slices in flight per connection.
    pub depth: usize,
    /// Independent channels (connection sets) the data is split over.
    pub channels: usize,
}

/// A state machine that moves one algorithm forward.
pub(crate) trait Machine {
    /// Post, reduce and take completions as far as possible; true if anything moved.
    fn advance(&mut self, exec: &mut Exec) -> Result<bool>;
    /// True when every request of the machine has completed.
    fn done(&self) -> bool;
}

/// Run `ms` to completion.
pub(crate) fn drive(exec: &mut Exec, ms: &mut [&mut dyn Machine]) -> Result<()> {
    loop {
        let mut moved = false;
        for (i, m) in ms.iter_mut().enumerate() {
            if !m.done() {
                exec.use_lane(i);
                moved |= m.advance(exec)?;
            }
        }
        if ms.iter().all(|m| m.done()) {
            return exec.finish();
        }
        if !moved {
            exec.wait_any()?;
        }
    }
}

/// Steps (a receive and a send each) the one-step algorithms post before finishing them:
/// the executor tracks 128 requests at most, so at more than 64 ranks they go in batches.
/// Every rank cuts its steps `1..n` at the same places, so each batch's receives match the
/// other ranks' sends of the same batch.
const STEPS_PER_BATCH: usize = 48;

/// After posting step `s` of `1..n`: finish the batch when it is full.
pub(crate) fn end_of_batch(exec: &mut Exec, s: usize) -> Result<()> {
    if s % STEPS_PER_BATCH == 0 {
        exec.finish()?;
    }
    Ok(())
}

/// Element range `[start, start+len)` of part `i` when `count` elements are cut in `parts`
/// nearly equal parts (the first `count % parts` get one more).
pub(crate) fn part(count: usize, parts: usize, i: usize) -> (usize, usize) {
    let base = count / parts;
    let rem = count % parts;
    let start = i * base + i.min(rem);
    (start, base + usize::from(i < rem))
}

/// Elements of slice `k` of a `len`-element chunk cut in slices of `s` elements.
pub(crate) fn slice_of(len: usize, s: usize, k: usize) -> (usize, usize) {
    let a = (k * s).min(len);
    let b = ((k + 1) * s).min(len);
    (a, b - a)
}

/// Fixed staging slots handed out and returned, as a bit set (no allocation while running).
pub(crate) struct Slots {
    base: usize,
    size: usize,
    free: u64,
}

impl Slots {
    /// `n` slots of `size` bytes from `base`; at most 64 (the pipeline depth is at most 16).
    pub fn new(base: usize, size: usize, n: usize) -> Self {
        debug_assert!(n <= 64, "{n} staging slots");
        Slots {
            base,
            size,
            free: if n >= 64 { u64::MAX } else { (1u64 << n) - 1 },
        }
    }
    /// The lowest free slot.
    pub fn get(&mut self) -> Option<usize> {
        if self.free == 0 {
            return None;
        }
        let s = self.free.trailing_zeros() as usize;
        self.free &= self.free - 1;
        Some(s)
    }
    pub fn put(&mut self, s: usize) {
        self.free |= 1 << s;
    }
    pub fn available(&self) -> usize {
        self.free.count_ones() as usize
    }
    /// The first `len` bytes of slot `s`.
    pub fn reg(&self, s: usize, len: usize) -> Reg {
        Reg::new(Buf::Stage, self.base + s * self.size, len)
    }
}

/// Most entries a [`Fifo`] holds: twice the deepest pipeline.
pub(crate) const FIFO_CAP: usize = 32;

/// First in, first out, of fixed capacity (lives in the machine: no allocation per call).
pub(crate) struct Fifo<T> {
    buf: [Option<T>; FIFO_CAP],
    head: usize,
    len: usize,
}

impl<T: Copy> Fifo<T> {
    pub fn new() -> Self {
        Fifo {
            buf: [None; FIFO_CAP],
            head: 0,
            len: 0,
        }
    }
    pub fn push(&mut self, v: T) -> Result<()> {
        if self.len == FIFO_CAP {
            return Err(Error::Internal(format!(
                "more than {FIFO_CAP} pipeline entries in flight on one connection"
            )));
        }
        self.buf[(self.head + self.len) % FIFO_CAP] = Some(v);
        self.len += 1;
        Ok(())
    }
    pub fn front(&self) -> Option<T> {
        if self.len == 0 {
            None
        } else {
            self.buf[self.head]
        }
    }
    pub fn pop(&mut self) -> Option<T> {
        let v = self.front()?;
        self.head = (self.head + 1) % FIFO_CAP;
        self.len -= 1;
        Some(v)
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A list kept on the stack up to `N` items and moved to the heap beyond: the usual few
/// items of a call cost no allocation, and a large call still works.
pub(crate) struct StackVec<T, const N: usize> {
    small: arrayvec::ArrayVec<T, N>,
    large: Vec<T>,
}

impl<T, const N: usize> Default for StackVec<T, N> {
    fn default() -> Self {
        StackVec {
            small: arrayvec::ArrayVec::new(),
            large: Vec::new(),
        }
    }
}

impl<T, const N: usize> StackVec<T, N> {
    pub fn push(&mut self, v: T) {
        if !self.large.is_empty() {
            self.large.push(v);
        } else if let Err(e) = self.small.try_push(v) {
            self.large.extend(self.small.drain(..));
            self.large.push(e.element());
        }
    }
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        if self.large.is_empty() {
            &mut self.small
        } else {
            &mut self.large
        }
    }
    pub fn as_slice(&self) -> &[T] {
        if self.large.is_empty() {
            &self.small
        } else {
            &self.large
        }
    }
}

/// Requests completed in post order, with a value per request.
pub(crate) struct InOrder<T> {
    q: Fifo<(Tok, T)>,
}

impl<T: Copy> InOrder<T> {
    pub fn new() -> Self {
        InOrder { q: Fifo::new() }
    }
    pub fn push(&mut self, t: Tok, v: T) -> Result<()> {
        self.q.push((t, v))
    }
    /// Pop the oldest request if it has completed.
    pub fn pop_done(&mut self, exec: &mut Exec) -> Option<T> {
        let (t, v) = self.q.front()?;
        exec.take(t)?;
        self.q.pop();
        Some(v)
    }
}

/// The machines of one call: one per channel or tree, on the stack.
pub(crate) type Machines<M> = arrayvec::ArrayVec<M, MAX_MACHINES>;

/// Most machines one call runs (channels of a ring; trees of a double tree).
pub(crate) const MAX_MACHINES: usize = crate::exec::links::MAX_CHANNELS;

/// Run every machine of `ms` to completion.
pub(crate) fn drive_all<M: Machine>(exec: &mut Exec, ms: &mut [M]) -> Result<()> {
    let mut refs: arrayvec::ArrayVec<&mut dyn Machine, MAX_MACHINES> = arrayvec::ArrayVec::new();
    for m in ms.iter_mut() {
        refs.try_push(m as &mut dyn Machine).map_err(|_| {
            Error::Internal(format!("more than {MAX_MACHINES} machines in one call"))
        })?;
    }
    drive(exec, &mut refs)
}

/// Collect `it` into [`Machines`], failing (not panicking) past its capacity.
pub(crate) fn machines<M>(it: impl IntoIterator<Item = M>) -> Result<Machines<M>> {
    let mut ms = Machines::new();
    for m in it {
        ms.try_push(m).map_err(|_| {
            Error::Internal(format!("more than {MAX_MACHINES} machines in one call"))
        })?;
    }
    Ok(ms)
}

/// Number of slices of `s` elements needed for `len` elements (at least one, so that every
/// step exchanges a message and both sides agree on the count).
pub(crate) fn nslices(len: usize, s: usize) -> usize {
    len.div_ceil(s.max(1)).max(1)
}
