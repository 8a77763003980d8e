//! Dispatch from a call to an algorithm: checks, the cost model's choice, the flat
//! (shared-memory) path or the executor, and the errors that break the communicator.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::algo::model::{self, CollKind};
use crate::algo::{shm, Algo, Pipeline};
use crate::device::Device;
use crate::error::{Error, PeerCause, Result};
use crate::exec::{Exec, Mem, MemMut};
use crate::types::{DataType, RedOp};

use super::calls::{host, Call};
use super::MISMATCH_TEXT;
use super::{call_tag, scratch, CallInfo, CallOpts, Collective, LastChoice, P2p, P2pMem, State};
use crate::exec::links::{NOTICE_BUDGET, SHORT_NOTICE_BUDGET};

/// The kinds of call a communicator counts: every collective ([`CollKind`]), then
/// point-to-point calls, then the rest (barriers).
pub(super) const CALL_KINDS: [&str; CollKind::ALL.len() + 2] = {
    let mut names = [""; CollKind::ALL.len() + 2];
    let mut i = 0;
    while i < CollKind::ALL.len() {
        names[i] = CollKind::ALL[i].name();
        i += 1;
    }
    names[POINT_TO_POINT] = "p2p";
    names[OTHER_CALLS] = "other";
    names
};

/// The entry of [`CALL_KINDS`] of point-to-point calls.
const POINT_TO_POINT: usize = CollKind::ALL.len();
/// The entry of [`CALL_KINDS`] of the other calls.
const OTHER_CALLS: usize = POINT_TO_POINT + 1;

/// The entry of [`CALL_KINDS`] a collective is counted under.
fn metrics_kind(c: &Collective) -> usize {
    let kind = match c {
        Collective::AllReduce(_) => CollKind::AllReduce,
        Collective::Broadcast { .. } => CollKind::Broadcast,
        Collective::Reduce { .. } => CollKind::Reduce,
        Collective::AllGather => CollKind::AllGather,
        Collective::ReduceScatter(_) => CollKind::ReduceScatter,
        Collective::AllToAll => CollKind::AllToAll,
        Collective::SendRecv { .. } => return POINT_TO_POINT,
        _ => return OTHER_CALLS,
    };
    kind.index()
}

/// An average of 16- and 8-bit floats overflows when summed first (8 ranks × f16 10000 sum
/// to inf; 4 ranks × e4m3 300 saturate at 448): as NCCL does, each rank's input is divided
/// by the number of ranks first and the call runs as a sum. A pre-multiplied sum
/// ([`CallOpts::premul`], NCCL's `ncclRedOpCreatePreMulSum`) multiplies each rank's input by
/// its scalar the same way, for every data type. All-reduce scales into its output and runs
/// in place; reduce and reduce-scatter scale into `scratch` (kept from call to call; the
/// caller's input is never written). `f32` and `f64` averages sum, then divide: exact for
/// the usual inputs, and their sums overflow only past 3.4e38 (1.8e308) per element.
/// Integers sum in their type (wrapping, as NCCL) and divide toward zero. Other calls come
/// back as they are.
#[allow(clippy::type_complexity)]
fn premultiplied<'a>(
    coll: Collective,
    dt: DataType,
    (me, n): (usize, usize),
    premul: Option<[u8; 8]>,
    send: Option<Mem<'a>>,
    recv: MemMut<'a>,
    scratch: &'a mut Vec<u8>,
) -> Result<(Collective, Option<Mem<'a>>, MemMut<'a>)> {
    let narrow = matches!(
        dt,
        DataType::F16 | DataType::Bf16 | DataType::F8E4M3 | DataType::F8E5M2
    );
    let op = match coll {
        Collective::AllReduce(op)
        | Collective::Reduce { op, .. }
        | Collective::ReduceScatter(op) => Some(op),
        _ => None,
    };
    if premul.is_some() && op != Some(RedOp::Sum) {
        return Err(Error::arg(format!(
            "a pre-multiplied sum is a sum of an all-reduce, reduce or reduce-scatter, not {coll:?}"
        )));
    }
    let avg = op == Some(RedOp::Avg) && narrow && n > 1;
    if premul.is_none() && !avg {
        return Ok((coll, send, recv));
    }
    let (sum, input_len) = match coll {
        Collective::AllReduce(_) => (Collective::AllReduce(RedOp::Sum), recv.len()),
        Collective::Reduce { root, .. } => (
            Collective::Reduce {
                op: RedOp::Sum,
                root,
            },
            send.map_or(recv.len(), |s| s.len()),
        ),
        Collective::ReduceScatter(_) => (
            Collective::ReduceScatter(RedOp::Sum),
            send.map_or(recv.len(), |s| s.len()),
        ),
        _ => return Ok((coll, send, recv)),
    };
    // Wrong lengths go on unchanged, to the checks that report them. (Reductions are on
    // host memory here: GPU buffers of reducing calls are staged before.)
    let fits = send.map_or(true, |s| s.len() == input_len)
        && input_len % dt.size() == 0
        && match sum {
            Collective::ReduceScatter(_) => {
                input_len % (dt.size() * n) == 0 && (send.is_none() || recv.len() * n == input_len)
            }
            _ => true,
        };
    if !fits {
        return Ok((coll, send, recv));
    }
    let scale = |x: &mut [u8]| match &premul {
        Some(s) => crate::reduce::premultiply(x, dt, &s[..dt.size()]),
        None => crate::reduce::finish_avg(x, dt, n),
    };
    if let Collective::AllReduce(_) = coll {
        let out = recv.into_slice()?;
        if let Some(s) = host(send)? {
            crate::reduce::copy_large(out, s);
        }
        scale(out)?;
        return Ok((sum, None, MemMut::host(out)));
    }
    // Reduce and reduce-scatter read their input into the scratch buffer, scaled.
    scratch.resize(input_len, 0);
    let recv = if let Some(s) = host(send)? {
        scratch.copy_from_slice(s);
        recv
    } else {
        let out = recv.into_slice()?;
        scratch.copy_from_slice(out);
        match sum {
            // In place, the result is this rank's block of the buffer.
            Collective::ReduceScatter(_) => {
                let block = input_len / n;
                MemMut::host(&mut out[me * block..(me + 1) * block])
            }
            _ => MemMut::host(out),
        }
    };
    scale(scratch)?;
    Ok((sum, Some(Mem::host(scratch)), recv))
}

impl State {
    pub(super) fn p2p(&mut self, ops: &mut [P2p<'_>]) -> Result<()> {
        let mut m = crate::algo::StackVec::<P2pMem, 64>::default();
        for o in ops.iter_mut() {
            m.push(match o {
                P2p::Send { peer, buf } => P2pMem::Send {
                    peer: *peer,
                    buf: Mem::host(buf),
                },
                P2p::Recv { peer, buf } => P2pMem::Recv {
                    peer: *peer,
                    buf: MemMut::host(buf),
                },
            });
        }
        self.p2p_mem(m.as_mut_slice(), None)
    }

    /// [`State::p2p`] on caller buffers that may be GPU memory (`dev`: its runtime).
    pub(super) fn p2p_mem(
        &mut self,
        ops: &mut [P2pMem<'_>],
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<()> {
        let bytes: usize = ops.iter().map(|o| o.len()).sum();
        if let Some(m) = &self.links.watch.metrics {
            m.call_start(POINT_TO_POINT, bytes);
        }
        // Point-to-point messages take the main network: the two ends of a pair need not
        // pass equal sizes to agree on it.
        self.links.lanes.for_p2p();
        if let Some(c) = &self.links.clock {
            c.call_started();
        }
        let r = self.p2p_counted(ops, dev);
        if let Some(c) = &self.links.clock {
            c.call_done();
        }
        if let Some(m) = &self.links.watch.metrics {
            m.call_done();
        }
        r
    }

    fn p2p_counted(&mut self, ops: &mut [P2pMem<'_>], dev: Option<&Arc<dyn Device>>) -> Result<()> {
        self.usable()?;
        let (n, me) = (self.links.nranks, self.links.rank);
        for o in ops.iter() {
            let p = o.peer();
            if p >= n {
                return Err(Error::arg(format!(
                    "peer {p} is out of range for {n} ranks"
                )));
            }
        }
        let self_lens = |send: bool| -> Vec<usize> {
            ops.iter()
                .filter(|o| o.peer() == me && matches!(o, P2pMem::Send { .. }) == send)
                .map(|o| o.len())
                .collect()
        };
        let (self_sends, self_recvs) = (self_lens(true), self_lens(false));
        if self_sends != self_recvs {
            return Err(Error::arg(format!(
                "sends to self ({self_sends:?} bytes) do not match receives from self ({self_recvs:?} bytes)"
            )));
        }
        let r = self.p2p_inner(ops, dev);
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }

    fn p2p_inner(&mut self, ops: &mut [P2pMem<'_>], dev: Option<&Arc<dyn Device>>) -> Result<()> {
        use crate::algo::P2P_CHANNEL;
        use crate::exec::Reg;
        let me = self.links.rank;
        self.stage(64);
        let stage = &mut bytemuck::cast_slice_mut(&mut self.stage)[..64];
        let mut exec = Exec::new(
            None,
            MemMut::host(&mut []),
            stage,
            &mut self.links,
            &self.cfg.waiter,
            dev,
        );
        // Each operation's buffer becomes caller buffer `i`; (send, peer, region) per
        // operation on the stack for the usual few (no allocation per call).
        let mut posts = crate::algo::StackVec::<(bool, usize, Reg), 64>::default();
        for o in ops.iter_mut() {
            let post = match o {
                P2pMem::Send { peer, buf } => {
                    (true, *peer, Reg::new(exec.add_read(*buf), 0, buf.len()))
                }
                P2pMem::Recv { peer, buf } => {
                    let len = buf.len();
                    (false, *peer, Reg::new(exec.add_write(buf.take()), 0, len))
                }
            };
            posts.push(post);
        }
        let posts = posts.as_slice();
        let links = |send: bool| {
            posts
                .iter()
                .filter(move |p| p.0 == send && p.1 != me)
                .map(|p| (p.1, P2P_CHANNEL))
        };
        exec.ensure(links(true), links(false))?;
        let mut self_sends = posts.iter().filter(|p| p.0 && p.1 == me).map(|p| p.2);
        for &(send, peer, reg) in posts {
            match (send, peer == me) {
                (true, false) => {
                    exec.send(peer, P2P_CHANNEL, reg)?;
                }
                (false, false) => {
                    exec.recv(peer, P2P_CHANNEL, reg)?;
                }
                (false, true) => {
                    let from = self_sends
                        .next()
                        .ok_or_else(|| Error::Internal("unmatched receive from self".into()))?;
                    exec.copy(reg, from)?;
                }
                (true, true) => {}
            }
        }
        exec.finish()?;
        exec.device_done()
    }

    fn stage(&mut self, bytes: usize) -> &mut [u8] {
        let words = bytes.div_ceil(8) + 8;
        if self.stage.len() < words {
            self.stage = vec![0u64; words.next_power_of_two()];
        }
        &mut bytemuck::cast_slice_mut(&mut self.stage)[..bytes]
    }

    /// The algorithm and pipeline of a call; `by_host`: the call may run hierarchically
    /// (host memory).
    pub(super) fn choose(
        &mut self,
        kind: CollKind,
        dt: DataType,
        bytes: usize,
        opts: &CallOpts,
        by_host: bool,
    ) -> (Algo, Pipeline) {
        let forced = opts.algo.or(self.cfg.algo);
        // Calls repeat (one all-reduce per layer): the last choice is kept.
        if let Some(last) = self.last_choice {
            let shape = (last.kind, last.dt, last.bytes, last.forced, last.by_host);
            if shape == (kind, dt, bytes, forced, by_host) {
                self.call_tag = call_tag::with_algo(self.call_tag, last.choice.0);
                self.note_algo(last.choice.0);
                return last.choice;
            }
        }
        let choose = if self.cfg.deterministic {
            model::choose_ordered
        } else {
            model::choose_for
        };
        let mut choice = choose(
            kind,
            dt,
            self.links.nranks,
            bytes,
            &self.cost,
            forced.filter(|&a| a != Algo::Hier),
            &self.cfg.tuning,
        );
        // Hierarchical reductions sum by host first: not in the deterministic mode.
        let hier_allowed = !self.cfg.deterministic || model::rank_ordered(kind, Algo::Hier);
        if by_host && hier_allowed && self.wants_hier(kind, dt, bytes, forced, &choice) {
            choice.0 = Algo::Hier;
        }
        self.last_choice = Some(LastChoice {
            kind,
            dt,
            bytes,
            forced,
            by_host,
            choice,
        });
        self.call_tag = call_tag::with_algo(self.call_tag, choice.0);
        self.note_algo(choice.0);
        choice
    }

    /// Tell the counters which algorithm the call in flight runs.
    fn note_algo(&self, algo: Algo) {
        if let Some(m) = &self.links.watch.metrics {
            // `Algo::ALL` lists the variants in declaration order (`Algo::NAMES` too).
            m.call_algo(algo as usize + 1);
        }
    }

    /// Run `f` with the timeout `timeout` (when given) in place of the communicator's.
    pub(super) fn with_timeout<R>(
        &mut self,
        timeout: Option<std::time::Duration>,
        f: impl FnOnce(&mut Self) -> R,
    ) -> R {
        let Some(t) = timeout else {
            return f(self);
        };
        let saved = std::mem::replace(&mut self.cfg.waiter.timeout, t);
        let r = f(self);
        self.cfg.waiter.timeout = saved;
        r
    }

    pub(super) fn execute(
        &mut self,
        coll: Collective,
        dt: DataType,
        send: Option<&[u8]>,
        recv: &mut [u8],
        opts: &CallOpts,
    ) -> Result<CallInfo> {
        self.execute_mem(
            coll,
            dt,
            send.map(Mem::host),
            MemMut::host(recv),
            opts,
            None,
        )
    }

    /// [`State::execute`] on caller buffers that may be GPU memory (`dev`: its runtime).
    pub(super) fn execute_mem(
        &mut self,
        coll: Collective,
        dt: DataType,
        send: Option<Mem<'_>>,
        recv: MemMut<'_>,
        opts: &CallOpts,
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<CallInfo> {
        self.usable()?;
        // The buffer every rank passes alike: a reduce's output may be empty off the root.
        // (A reduce-scatter's whole input: in place the buffer, out of place n blocks.)
        let bytes = match (coll, send) {
            (Collective::Reduce { .. }, Some(s)) => s.len(),
            (Collective::ReduceScatter(_), Some(_)) => recv.len() * self.links.nranks,
            _ => recv.len(),
        };
        self.call_tag = call_tag::call_tag(&coll, dt, bytes);
        // Each peer's network for a call of this size (ROCCL_NETS; nothing to do without).
        // A send or receive takes the main network (or the one the measurement forces): its
        // two ends pass different buffers, so a size would not give both the same lane.
        if matches!(coll, Collective::SendRecv { .. }) {
            self.links.lanes.for_p2p();
        } else {
            self.links.lanes.for_call(bytes);
        }
        if let Some(m) = &self.links.watch.metrics {
            m.call_start(metrics_kind(&coll), bytes);
        }
        if let Some(c) = &self.links.clock {
            c.call_started();
        }
        // The scratch buffer of averages leaves `self` while the call borrows it.
        let mut scratch = std::mem::take(&mut self.premul);
        let r = match premultiplied(
            coll,
            dt,
            (self.links.rank, self.links.nranks),
            opts.premul,
            send,
            recv,
            &mut scratch,
        ) {
            Ok((coll, send, recv)) => self.run_call(Call {
                coll,
                dt,
                send,
                recv,
                opts,
                dev,
            }),
            Err(e) => Err(e),
        };
        self.premul = scratch::kept(scratch);
        let r = r.map_err(|e| self.explain_mismatch(e));
        if let Err(e) = &r {
            self.failed(e);
        }
        if let Some(c) = &self.links.clock {
            c.call_done();
        }
        if let Some(m) = &self.links.watch.metrics {
            m.call_done();
        }
        self.call_tag = 0;
        r
    }

    /// A tag mismatch with a peer (the networks' error) as an error naming both ranks and
    /// both calls.
    fn explain_mismatch(&self, e: Error) -> Error {
        let Error::Remote {
            rank,
            cause: cause @ PeerCause::OtherCall { ours, theirs },
            ..
        } = e
        else {
            return e;
        };
        let msg = format!(
            "rank {} called {} but rank {rank} called {}{MISMATCH_TEXT}",
            self.links.rank,
            call_tag::describe(ours),
            call_tag::differ(ours, theirs)
        );
        Error::remote(rank, cause, msg)
    }

    /// Refuse work once the communicator is broken.
    pub(super) fn usable(&self) -> Result<()> {
        self.broken.error().map_or(Ok(()), Err)
    }

    /// After a failed call: argument errors are caught before any data moves; anything
    /// later leaves the peers mid-protocol, so the communicator cannot continue. Tell the
    /// other ranks whom to blame (unless the application aborted) and close everything.
    pub(super) fn failed(&mut self, e: &Error) {
        if e.kind() == crate::error::ErrorKind::InvalidArgument {
            return;
        }
        self.broken.set(crate::error::AsyncError::of(e));
        let cause = match e {
            Error::Remote { rank, .. } => Some(*rank),
            _ => self.links.blame.suspect,
        };
        if let Some(node) = &self.node {
            node.mark_broken_by(cause);
        }
        let by_app = self.links.blame.abort.load(Ordering::Relaxed);
        if let (Error::Remote { rank, cause, .. }, false) = (e, by_app) {
            if matches!(cause, PeerCause::OtherCall { .. }) && self.links.blame.mismatch.is_none() {
                // The peer would only see its connection close: tell it which call we are in.
                self.links
                    .notify_mismatch(*rank, self.call_tag, SHORT_NOTICE_BUDGET);
            }
        }
        if let Some(c) = cause.filter(|c| *c != self.links.rank && !by_app) {
            self.links.notify_abort(c, false, NOTICE_BUDGET);
        }
        self.links.close_all();
    }

    /// Run a collective through the host's shared-memory segments (the model offers those
    /// algorithms only when they are mapped).
    pub(super) fn run_in_segments(
        &mut self,
        coll: Collective,
        dt: DataType,
        bytes: usize,
        variant: u8,
        f: impl FnOnce(&mut shm::SegmentCall) -> Result<()>,
    ) -> Result<()> {
        let (kind, op, root) = match coll {
            Collective::AllReduce(op) => (1, Some(op), None),
            Collective::Broadcast { root } => (2, None, Some(root)),
            Collective::Reduce { op, root } => (3, Some(op), Some(root)),
            Collective::AllGather => (4, None, None),
            Collective::ReduceScatter(op) => (5, Some(op), None),
            Collective::AllToAll => (6, None, None),
            Collective::Barrier | Collective::SendRecv { .. } => (7, None, None),
        };
        let code = crate::algo::shm::node::code(
            kind,
            dt as u8,
            op.map_or(0xff, |o| o as u8),
            variant,
            root,
        );
        let node = self.node.as_mut().ok_or_else(|| {
            Error::Internal("shared-memory algorithm chosen without segments".into())
        })?;
        let mut call = shm::SegmentCall {
            node,
            waiter: &self.cfg.waiter,
            abort: &self.links.blame.abort,
            nranks: self.links.nranks,
            rank: self.links.rank,
            meta: [bytes as u64, code],
        };
        let r = f(&mut call);
        call.node.flush_wakes();
        r
    }

    pub(super) fn run_exec(
        &mut self,
        send: Option<Mem<'_>>,
        recv: MemMut<'_>,
        dev: Option<&Arc<dyn Device>>,
        stage_bytes: usize,
        f: impl FnOnce(&mut Exec) -> Result<()>,
    ) -> Result<()> {
        self.stage(stage_bytes);
        let stage = &mut bytemuck::cast_slice_mut(&mut self.stage)[..stage_bytes];
        let mut exec = Exec::new(send, recv, stage, &mut self.links, &self.cfg.waiter, dev);
        exec.set_tag(self.call_tag);
        f(&mut exec)?;
        exec.device_done()
    }
}
