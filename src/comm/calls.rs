//! Each collective call as the communicator runs it: its argument checks, the algorithm the
//! cost model chooses, and the run of that algorithm (by host, through the shared segments,
//! or on the executor), one method per collective.

use std::sync::Arc;

use crate::algo::model::CollKind;
use crate::algo::{self, shm, Algo, Pipeline};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::exec::{Mem, MemMut};
use crate::types::{DataType, RedOp};

use super::{hier, CallInfo, CallOpts, Collective, State};

/// One call's arguments.
pub(super) struct Call<'a> {
    pub(super) coll: Collective,
    pub(super) dt: DataType,
    pub(super) send: Option<Mem<'a>>,
    pub(super) recv: MemMut<'a>,
    pub(super) opts: &'a CallOpts,
    pub(super) dev: Option<&'a Arc<dyn Device>>,
}

/// The bytes of a read-only caller buffer, for code that reads with the CPU.
pub(super) fn host<'a>(m: Option<Mem<'a>>) -> Result<Option<&'a [u8]>> {
    m.map(|m| m.slice()).transpose()
}

/// The elements of `dt` in `len` bytes of the buffer `what`.
pub(super) fn elems(what: &str, len: usize, dt: DataType) -> Result<usize> {
    if len % dt.size() != 0 {
        return Err(Error::arg(format!(
            "{what} of {len} bytes is not a whole number of {dt} elements ({} bytes each)",
            dt.size()
        )));
    }
    Ok(len / dt.size())
}

/// `root` is a rank of `n`.
fn check_root(root: usize, n: usize) -> Result<()> {
    if root >= n {
        return Err(Error::arg(format!(
            "root {root} is out of range for {n} ranks"
        )));
    }
    Ok(())
}

/// A send buffer, if any, has the `want` bytes the call `what` expects.
fn same_len(s: Option<Mem>, want: usize, what: &str) -> Result<()> {
    match s {
        Some(s) if s.len() != want => Err(Error::arg(format!(
            "{what}: send buffer has {} bytes but {want} are expected",
            s.len()
        ))),
        _ => Ok(()),
    }
}

/// What a call reports: the algorithm and pipeline it ran with.
fn info(a: Algo, p: Pipeline) -> CallInfo {
    CallInfo {
        algo: Some(a),
        pipeline: Some(p),
    }
}

impl State {
    /// Run the collective `c.coll`.
    pub(super) fn run_call(&mut self, c: Call<'_>) -> Result<CallInfo> {
        match c.coll {
            Collective::AllReduce(op) => self.all_reduce_call(c, op),
            Collective::Broadcast { root } => self.broadcast_call(c, root),
            Collective::Reduce { op, root } => self.reduce_call(c, (op, root)),
            Collective::AllGather => self.all_gather_call(c),
            Collective::ReduceScatter(op) => self.reduce_scatter_call(c, op),
            Collective::AllToAll => self.all_to_all_call(c),
            Collective::Barrier => self.barrier_call(c),
            Collective::SendRecv { to, from } => self.sendrecv_call(c, (to, from)),
        }
    }

    /// An all-reduce: checks, the choice, then the algorithm chosen (by host, shared
    /// segments, ring in windows, or the executor's).
    fn all_reduce_call(&mut self, c: Call<'_>, op: RedOp) -> Result<CallInfo> {
        let Call {
            coll,
            dt,
            send,
            recv,
            opts,
            dev,
        } = c;
        let (n, esz) = (self.links.nranks, dt.size());
        let count = elems("all_reduce receive buffer", recv.len(), dt)?;
        same_len(send, recv.len(), "all_reduce")?;
        let by_host = dev.is_none();
        let (a, pl) = self.choose(CollKind::AllReduce, dt, recv.len(), opts, by_host);
        if count == 0 {
            return Ok(info(a, pl));
        }
        if a == Algo::Hier {
            self.all_reduce_hier(dt, op, count, send, recv)?;
            return Ok(info(a, pl));
        }
        if let Algo::ShmOneShot | Algo::ShmTwoShot = a {
            let (send, recv) = (host(send)?, recv.into_slice()?);
            let two_shot = a == Algo::ShmTwoShot;
            self.run_in_segments(coll, dt, recv.len(), u8::from(two_shot), |f| {
                shm::all_reduce_shm(f, dt, op, send, recv, two_shot)
            })?;
            return Ok(info(a, pl));
        }
        let need = hier::all_reduce_stage(a, n, count, dt, &pl);
        // Rings go host after host (the order is rank order on one host).
        let order = self.ring_order().filter(|_| a == Algo::Ring);
        let group = order.as_ref().map_or(&[][..], |t| t.ring());
        let window = self.cfg.ring_window / esz * esz;
        if a == Algo::Ring && window > 0 && recv.len() > 2 * window {
            let mut recv = recv;
            let mut off = 0;
            while off < recv.len() {
                let len = window.min(recv.len() - off);
                let s = send.map(|s| s.part(off, len));
                let r = recv.part(off, len);
                self.run_group(group, s, r, dev, need, |exec| {
                    algo::all_reduce_ring(exec, dt, op, len / esz, &pl)
                })?;
                off += len;
            }
            return Ok(info(a, pl));
        }
        self.run_group(group, send, recv, dev, need, |exec| {
            hier::all_reduce_run(exec, a, dt, op, count, &pl)
        })?;
        Ok(info(a, pl))
    }

    /// A broadcast from `root`.
    fn broadcast_call(&mut self, c: Call<'_>, root: usize) -> Result<CallInfo> {
        let Call {
            coll,
            dt,
            send,
            recv,
            opts,
            dev,
        } = c;
        let (n, me) = (self.links.nranks, self.links.rank);
        check_root(root, n)?;
        let count = elems("broadcast buffer", recv.len(), dt)?;
        let send = if me == root { send } else { None };
        same_len(send, recv.len(), "broadcast")?;
        let (a, pl) = self.choose(CollKind::Broadcast, dt, recv.len(), opts, dev.is_none());
        if count == 0 {
            return Ok(info(a, pl));
        }
        if a == Algo::Hier {
            self.broadcast_hier(root, dt, count, send, recv)?;
            return Ok(info(a, pl));
        }
        if a == Algo::ShmOneShot {
            let (send, recv) = (host(send)?, recv.into_slice()?);
            self.run_in_segments(coll, dt, recv.len(), 0, |f| {
                shm::broadcast_shm(f, root, send, recv)
            })?;
            return Ok(info(a, pl));
        }
        let need = hier::rooted_stage(a, false, &pl);
        let order = self.ring_order().filter(|_| a == Algo::Ring);
        let group = order.as_ref().map_or(&[][..], |t| t.ring());
        self.run_group(group, send, recv, dev, need, |exec| {
            let root = exec.group_rank(root).unwrap_or(root);
            match a {
                Algo::Tree => algo::broadcast_tree(exec, root, dt, count, &pl),
                _ => algo::broadcast_ring(exec, root, dt, count, &pl),
            }
        })?;
        Ok(info(a, pl))
    }

    /// A reduce of `op` to `root`.
    fn reduce_call(&mut self, c: Call<'_>, (op, root): (RedOp, usize)) -> Result<CallInfo> {
        let Call {
            coll,
            dt,
            send,
            recv,
            opts,
            dev,
        } = c;
        let (n, me) = (self.links.nranks, self.links.rank);
        check_root(root, n)?;
        let input_len = send.map_or(recv.len(), |s| s.len());
        let count = elems("reduce input", input_len, dt)?;
        if me == root && recv.len() != input_len {
            return Err(Error::arg(format!(
                "reduce: the root's receive buffer has {} bytes but the input has {input_len}",
                recv.len()
            )));
        }
        let (a, pl) = self.choose(CollKind::Reduce, dt, input_len, opts, dev.is_none());
        if count == 0 {
            return Ok(info(a, pl));
        }
        if a == Algo::Hier {
            self.reduce_hier(root, dt, op, count, send, recv)?;
            return Ok(info(a, pl));
        }
        if a == Algo::ShmOneShot {
            let (send, recv) = (host(send)?, recv.into_slice()?);
            self.run_in_segments(coll, dt, input_len, 0, |f| {
                shm::reduce_shm(f, root, dt, op, send, recv)
            })?;
            return Ok(info(a, pl));
        }
        let need = match a {
            Algo::Direct => algo::reduce_direct_stage(n, count, dt),
            _ => hier::rooted_stage(a, true, &pl),
        };
        let order = self.ring_order().filter(|_| a == Algo::Ring);
        let group = order.as_ref().map_or(&[][..], |t| t.ring());
        self.run_group(group, send, recv, dev, need, |exec| {
            let root = exec.group_rank(root).unwrap_or(root);
            match a {
                Algo::Direct => algo::reduce_direct(exec, root, dt, op, count),
                Algo::Tree => algo::reduce_tree(exec, root, dt, op, count, &pl),
                _ => algo::reduce_ring(exec, root, dt, op, count, &pl),
            }
        })?;
        Ok(info(a, pl))
    }

    /// An all-gather (in place when there is no send buffer).
    fn all_gather_call(&mut self, c: Call<'_>) -> Result<CallInfo> {
        let Call {
            coll,
            dt,
            send,
            recv,
            opts,
            dev,
        } = c;
        let (n, esz) = (self.links.nranks, dt.size());
        let total = elems("all_gather receive buffer", recv.len(), dt)?;
        let count = match send {
            Some(s) => {
                let c = elems("all_gather send buffer", s.len(), dt)?;
                if c * n != total {
                    return Err(Error::arg(format!(
                        "all_gather: receive buffer holds {total} elements but {n} ranks × {c} are expected"
                    )));
                }
                c
            }
            None if total % n != 0 => {
                return Err(Error::arg(format!(
                    "in-place all_gather: buffer of {total} elements is not divisible by {n} ranks"
                )))
            }
            None => total / n,
        };
        let (a, pl) = self.choose(CollKind::AllGather, dt, recv.len(), opts, dev.is_none());
        if count == 0 {
            return Ok(info(a, pl));
        }
        if a == Algo::Hier {
            self.all_gather_hier(dt, count, send, recv)?;
            return Ok(info(a, pl));
        }
        if a == Algo::ShmOneShot {
            let block = count * esz;
            let (send, recv) = (host(send)?, recv.into_slice()?);
            self.run_in_segments(coll, dt, block, 0, |f| {
                shm::all_gather_shm(f, send, recv, block)
            })?;
            return Ok(info(a, pl));
        }
        let order = self.ring_order().filter(|_| a == Algo::Ring);
        let group = order.as_ref().map_or(&[][..], |t| t.ring());
        self.run_group(group, send, recv, dev, 64, |exec| match a {
            Algo::Bruck => algo::all_gather_bruck(exec, dt, count),
            _ => algo::all_gather_ring(exec, dt, count, &pl),
        })?;
        Ok(info(a, pl))
    }

    /// A reduce-scatter of `op` (in place when there is no send buffer).
    fn reduce_scatter_call(&mut self, c: Call<'_>, op: RedOp) -> Result<CallInfo> {
        let Call {
            coll,
            dt,
            send,
            recv,
            opts,
            dev,
        } = c;
        let (n, esz) = (self.links.nranks, dt.size());
        let count = match send {
            Some(s) => {
                let c = elems("reduce_scatter receive buffer", recv.len(), dt)?;
                let total = elems("reduce_scatter send buffer", s.len(), dt)?;
                if c * n != total {
                    return Err(Error::arg(format!(
                        "reduce_scatter: send buffer holds {total} elements but {n} ranks × {c} are expected"
                    )));
                }
                c
            }
            None => {
                let total = elems("reduce_scatter buffer", recv.len(), dt)?;
                if total % n != 0 {
                    return Err(Error::arg(format!(
                        "in-place reduce_scatter: buffer of {total} elements is not divisible by {n} ranks"
                    )));
                }
                total / n
            }
        };
        let (a, pl) = self.choose(
            CollKind::ReduceScatter,
            dt,
            count * n * esz,
            opts,
            dev.is_none(),
        );
        if count == 0 {
            return Ok(info(a, pl));
        }
        if a == Algo::Hier {
            self.reduce_scatter_hier(dt, op, count, send, recv)?;
            return Ok(info(a, pl));
        }
        if a == Algo::ShmOneShot {
            let block = count * esz;
            let (send, recv) = (host(send)?, recv.into_slice()?);
            self.run_in_segments(coll, dt, block, 0, |f| {
                shm::reduce_scatter_shm(f, dt, op, send, recv, block)
            })?;
            return Ok(info(a, pl));
        }
        let need = match a {
            Algo::Bruck => algo::bruck_stage(n, n * count, dt),
            Algo::Direct => algo::reduce_scatter_direct_stage(n, count, dt),
            _ => algo::reduce_scatter_ring_stage(count, dt, &pl),
        };
        let order = self.ring_order().filter(|_| a == Algo::Ring);
        let group = order.as_ref().map_or(&[][..], |t| t.ring());
        self.run_group(group, send, recv, dev, need, |exec| match a {
            Algo::Bruck => algo::reduce_scatter_bruck(exec, dt, op, count),
            Algo::Direct => algo::reduce_scatter_direct(exec, dt, op, count),
            _ => algo::reduce_scatter_ring(exec, dt, op, count, &pl),
        })?;
        Ok(info(a, pl))
    }

    /// An all-to-all.
    fn all_to_all_call(&mut self, c: Call<'_>) -> Result<CallInfo> {
        let Call {
            coll,
            dt,
            send,
            recv,
            opts,
            dev,
        } = c;
        let n = self.links.nranks;
        let total = elems("all_to_all receive buffer", recv.len(), dt)?;
        same_len(send, recv.len(), "all_to_all")?;
        if total % n != 0 {
            return Err(Error::arg(format!(
                "all_to_all: buffer of {total} elements is not divisible by {n} ranks"
            )));
        }
        let (a, pl) = self.choose(CollKind::AllToAll, dt, recv.len(), opts, false);
        if total == 0 {
            return Ok(info(a, pl));
        }
        let block = recv.len() / n;
        if a == Algo::ShmOneShot {
            let (send, recv) = (host(send)?, recv.into_slice()?);
            self.run_in_segments(coll, dt, block, 0, |f| {
                shm::all_to_all_shm(f, send, recv, block)
            })?;
            return Ok(info(a, pl));
        }
        let need = if send.is_none() { recv.len() } else { 64 };
        self.run_exec(send, recv, dev, need, |exec| {
            algo::all_to_all_pairwise(exec, block)
        })?;
        Ok(info(a, pl))
    }

    /// A barrier: through the shared segments where the ranks have them, else by dissemination.
    fn barrier_call(&mut self, c: Call<'_>) -> Result<CallInfo> {
        let Call { coll, dt, .. } = c;
        if self.node.is_some() {
            self.run_in_segments(coll, dt, 0, 0, shm::barrier_shm)?;
        } else {
            self.run_exec(
                None,
                MemMut::host(&mut []),
                None,
                64,
                algo::barrier_dissemination,
            )?;
        }
        Ok(CallInfo {
            algo: None,
            pipeline: None,
        })
    }

    /// A send to `to` and a receive from `from` (either may be absent).
    fn sendrecv_call(
        &mut self,
        c: Call<'_>,
        (to, from): (Option<usize>, Option<usize>),
    ) -> Result<CallInfo> {
        let Call {
            dt,
            send,
            recv,
            dev,
            ..
        } = c;
        let n = self.links.nranks;
        for p in [to, from].into_iter().flatten() {
            if p >= n {
                return Err(Error::arg(format!(
                    "peer {p} is out of range for {n} ranks"
                )));
            }
        }
        let slen = send.map_or(0, |s| s.len());
        elems("send buffer", slen, dt)?;
        elems("receive buffer", recv.len(), dt)?;
        let rlen = recv.len();
        let src = send.unwrap_or(Mem::host(&[]));
        self.run_exec(Some(src), recv, dev, 64, |exec| {
            algo::sendrecv(exec, to, slen, from, rlen)
        })?;
        Ok(CallInfo {
            algo: None,
            pipeline: None,
        })
    }
}
