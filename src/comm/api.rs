//! The public calls: what a call is ([`Collective`], [`P2p`], [`CallOpts`], [`CallInfo`]) and
//! the typed collectives, point-to-point exchanges and barrier of [`Communicator`].

use crate::algo::{Algo, Pipeline};
use crate::error::Result;
use crate::exec::{Mem, MemMut};
use crate::types::{DataType, Element, RedOp};

use super::Communicator;

/// Per-call options.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallOpts {
    /// Force an algorithm for this call (if the collective has it).
    pub algo: Option<Algo>,
    /// Give up after this long without progress, for this call only (instead of the
    /// communicator's `ROCCL_TIMEOUT`).
    pub timeout: Option<std::time::Duration>,
    /// Multiply this rank's input by this scalar before a [`RedOp::Sum`] all-reduce, reduce
    /// or reduce-scatter (NCCL's `ncclRedOpCreatePreMulSum`): the scalar's little-endian
    /// bytes, in the call's data type, in the first `dt.size()` bytes. Each rank may pass
    /// its own (or none); the caller's input is never written.
    pub premul: Option<[u8; 8]>,
}

/// What a call did.
#[derive(Clone, Copy, Debug)]
pub struct CallInfo {
    /// Algorithm used (`None` for point-to-point and barrier).
    pub algo: Option<Algo>,
    /// Pipeline shape used.
    pub pipeline: Option<Pipeline>,
}

/// One collective operation, for the byte-level API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// Every rank gets the reduction of all inputs.
    AllReduce(RedOp),
    /// Root's buffer to every rank.
    Broadcast {
        /// Source rank.
        root: usize,
    },
    /// Reduction of all inputs at the root.
    Reduce {
        /// Operation.
        op: RedOp,
        /// Destination rank.
        root: usize,
    },
    /// Concatenation of all inputs, in rank order, on every rank.
    AllGather,
    /// Reduction of all inputs, block `r` to rank `r`.
    ReduceScatter(RedOp),
    /// Block `j` of rank `i` goes to block `i` of rank `j`.
    AllToAll,
    /// Wait until every rank has arrived.
    Barrier,
    /// Send the input to `to` and/or receive the output from `from`.
    SendRecv {
        /// Destination rank.
        to: Option<usize>,
        /// Source rank.
        from: Option<usize>,
    },
}

/// One operation of a grouped point-to-point exchange ([`Communicator::p2p`]).
#[derive(Debug)]
pub enum P2p<'a> {
    /// Send `buf` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Bytes to send.
        buf: &'a [u8],
    },
    /// Receive exactly `buf.len()` bytes from `peer`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Where to receive.
        buf: &'a mut [u8],
    },
}

/// A point-to-point operation on a caller buffer that may be GPU memory.
pub(crate) enum P2pMem<'a> {
    Send { peer: usize, buf: Mem<'a> },
    Recv { peer: usize, buf: MemMut<'a> },
}

impl P2pMem<'_> {
    pub(super) fn peer(&self) -> usize {
        match self {
            P2pMem::Send { peer, .. } | P2pMem::Recv { peer, .. } => *peer,
        }
    }
    pub(super) fn len(&self) -> usize {
        match self {
            P2pMem::Send { buf, .. } => buf.len(),
            P2pMem::Recv { buf, .. } => buf.len(),
        }
    }
}

impl Communicator {
    /// Run one collective on byte buffers. `send == None` means in place. See each typed
    /// method for the buffer sizes each collective expects.
    pub fn run_raw(
        &self,
        coll: Collective,
        dt: DataType,
        send: Option<&[u8]>,
        recv: &mut [u8],
        opts: &CallOpts,
    ) -> Result<CallInfo> {
        self.with_turn(|state| {
            state.with_timeout(opts.timeout, |state| {
                state.execute(coll, dt, send, recv, opts)
            })
        })
    }

    fn typed<T: Element>(
        &self,
        coll: Collective,
        send: Option<&[T]>,
        recv: &mut [T],
    ) -> Result<()> {
        let s = send.map(bytemuck::cast_slice::<T, u8>);
        self.run_raw(
            coll,
            T::DTYPE,
            s,
            bytemuck::cast_slice_mut(recv),
            &CallOpts::default(),
        )
        .map(|_| ())
    }

    /// All-reduce: `recv[i] = op over ranks of send[i]`; both have the same length.
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: RedOp) -> Result<()> {
        self.typed(Collective::AllReduce(op), Some(send), recv)
    }

    /// In-place all-reduce.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: RedOp) -> Result<()> {
        self.typed(Collective::AllReduce(op), None, buf)
    }

    /// Broadcast `buf` from `root` to every rank (in place).
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.typed(Collective::Broadcast { root }, None, buf)
    }

    /// Broadcast `send` of `root` into `recv` of every rank (`send` is read on the root only).
    pub fn broadcast_from<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.typed(Collective::Broadcast { root }, Some(send), recv)
    }

    /// Reduce `send` of every rank into `recv` of `root` (`recv` is untouched elsewhere and
    /// may be empty there).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: RedOp,
        root: usize,
    ) -> Result<()> {
        self.typed(Collective::Reduce { op, root }, Some(send), recv)
    }

    /// In-place reduce: `buf` is the input everywhere and the output on `root`.
    pub fn reduce_in_place<T: Element>(&self, buf: &mut [T], op: RedOp, root: usize) -> Result<()> {
        self.typed(Collective::Reduce { op, root }, None, buf)
    }

    /// All-gather: `recv` (`nranks * send.len()`) gets every rank's `send` in rank order.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.typed(Collective::AllGather, Some(send), recv)
    }

    /// In-place all-gather: this rank's input is block `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.typed(Collective::AllGather, None, buf)
    }

    /// Reduce-scatter: `send` (`nranks * recv.len()`) reduced over ranks; block `rank` to `recv`.
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: RedOp) -> Result<()> {
        self.typed(Collective::ReduceScatter(op), Some(send), recv)
    }

    /// In-place reduce-scatter: the result lands in block `rank` of `buf`.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: RedOp) -> Result<()> {
        self.typed(Collective::ReduceScatter(op), None, buf)
    }

    /// All-to-all: block `j` of `send` goes to rank `j`, block `i` of `recv` comes from rank `i`.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.typed(Collective::AllToAll, Some(send), recv)
    }

    /// In-place all-to-all.
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.typed(Collective::AllToAll, None, buf)
    }

    /// Send `buf` to `peer` (returns when `peer` has received it or the network holds it).
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.typed(
            Collective::SendRecv {
                to: Some(peer),
                from: None,
            },
            Some(buf),
            &mut [],
        )
    }

    /// Receive `buf` from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        let none: &[T] = &[];
        self.typed(
            Collective::SendRecv {
                to: None,
                from: Some(peer),
            },
            Some(none),
            buf,
        )
    }

    /// Send `send` to `to` while receiving `recv` from `from` (no deadlock when peers
    /// exchange with each other).
    pub fn sendrecv<T: Element>(
        &self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<()> {
        self.typed(
            Collective::SendRecv {
                to: Some(to),
                from: Some(from),
            },
            Some(send),
            recv,
        )
    }

    /// Run several sends and receives at once, to and from any peers: all are posted
    /// together, so exchanges in any pattern cannot deadlock. Messages between two ranks
    /// are matched in the order each side lists them. A send to oneself is matched with the
    /// next receive from oneself.
    pub fn p2p(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        self.with_turn(|state| state.p2p(ops))
    }

    /// [`Communicator::p2p`] with per-call options (`opts.timeout`; `opts.algo` does not
    /// apply).
    pub fn p2p_with(&self, ops: &mut [P2p<'_>], opts: &CallOpts) -> Result<()> {
        self.with_turn(|state| state.with_timeout(opts.timeout, |state| state.p2p(ops)))
    }

    /// Block until every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.run_raw(
            Collective::Barrier,
            DataType::U8,
            None,
            &mut [],
            &CallOpts::default(),
        )
        .map(|_| ())
    }

    /// Open now, to and from every peer, the connections calls use with the default
    /// pipeline: channels 0 and 1 (one-shot, two-shot, doubling, rings of up to two
    /// channels, both trees of the double tree) and the point-to-point channel. What
    /// `ROCCL_CONNECT=all` does during init; a collective call: every rank must make it.
    /// (Rings forced to more channels, `ROCCL_NCHANNELS`, still open those when first used.)
    pub fn connect_all(&self) -> Result<()> {
        self.with_turn(|state| {
            let (n, me) = (state.links.nranks, state.links.rank);
            let peers: Vec<(usize, usize)> = (0..n)
                .filter(|&p| p != me)
                .flat_map(|p| [(p, 0), (p, 1), (p, crate::algo::P2P_CHANNEL)])
                .collect();
            state.usable()?;
            let r = state.links.ensure(&peers, &peers, &state.cfg.waiter);
            if let Err(e) = &r {
                state.failed(e);
            }
            r
        })
    }

    /// Connections this rank has open: (sends, receives) over every peer and channel.
    pub fn open_connections(&self) -> (usize, usize) {
        self.with_turn(|state| state.links.open())
    }

    /// Close the connections that are idle at both ends with the peers that do the same
    /// at about this time (a suspend: NCCL's `ncclCommSuspend` with `NCCL_SUSPEND_MEM`),
    /// releasing what the networks keep per connection (the RoCE engines' eager and bounce
    /// buffers, sockets). Not collective: a peer that is not suspending within `wait`, or
    /// that is a call ahead or behind (a message sent and not yet received), keeps its
    /// connections with this rank, and both ends agree on which close (when no step between
    /// them stalls past `ROCCL_TIMEOUT`: docs/architecture/executor.md). Closed
    /// connections open again on first use. Runs in turn, after the calls issued before.
    pub fn close_idle_connections(&self, wait: std::time::Duration) -> Result<ClosedConnections> {
        self.with_turn(|state| {
            state.usable()?;
            let timeout = state.cfg.waiter.timeout;
            let r = state.links.close_idle(wait, timeout);
            if let Err(e) = &r {
                state.failed(e);
            }
            crate::os::mem::trim_heap();
            r.map(|s| ClosedConnections {
                closed: s.closed,
                kept_with: s.kept_with,
            })
        })
    }
}

/// What [`Communicator::close_idle_connections`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClosedConnections {
    /// Connections closed (each direction of each channel counts once).
    pub closed: usize,
    /// Peers whose connections with this rank stay open: they were not suspending within
    /// the wait, a message between them and this rank was still in flight, or they are
    /// reached over a network of `ROCCL_NETS` besides the first (whose connections this does
    /// not close).
    pub kept_with: Vec<usize>,
}
