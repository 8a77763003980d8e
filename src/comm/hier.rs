//! Collectives by hosts (`Algo::Hier`) and rings ordered by host, for jobs of several
//! hosts ([`Topology`]).
//!
//! Each phase runs an existing algorithm on a group of ranks (the executor's
//! [`Exec::set_group`]) over a part of the call's buffers:
//!
//! - all-reduce, every host with `m` ranks: the reduce-scatter half of a ring among the
//!   host's ranks (each rank then holds the host's sum of one `1/m` share), an all-reduce of
//!   that share among the ranks of the same local index on every host (the model's choice
//!   of algorithm for `h` ranks), and the all-gather half of the host's ring;
//! - all-reduce, uneven hosts: a reduce to each host's first rank, an all-reduce among those,
//!   a broadcast inside each host;
//! - broadcast: among one rank per host (the root on its own host), then inside each host;
//! - reduce: inside each host to one rank (the root on its own host), then among those;
//! - all-gather and reduce-scatter (even hosts): a ring among the ranks of one local index
//!   on every host, and one exchange inside each host (`algo/by_host.rs`);
//! - all-gather and reduce-scatter (uneven hosts): to each host's leader (a gather, or a
//!   reduce of the whole buffer), an exchange between the leaders in rounds (each sends
//!   every other leader the blocks it needs, `algo/by_host.rs`), from the leader (a
//!   broadcast of the whole buffer, or a scatter of the blocks).
//!
//! Every rank derives the same groups and choices from the same table, so no message is
//! spent agreeing. Calls on GPU memory stay flat.

use std::sync::Arc;

use crate::algo::model::{self, CollKind, Layers, LinkCost};
use crate::algo::topo::Topology;
use crate::algo::{self, Algo, Half, Pipeline};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::exec::{Buf, Exec, Mem, MemMut, Reg};
use crate::types::{DataType, RedOp};

use super::{scratch, Hier, State};

/// Staging bytes of a network all-reduce of `count` elements on `n` ranks with `a`.
pub(super) fn all_reduce_stage(
    a: Algo,
    n: usize,
    count: usize,
    dt: DataType,
    pl: &Pipeline,
) -> usize {
    match a {
        Algo::Direct => algo::all_reduce_direct_stage(n, count * dt.size()),
        Algo::Doubling => count * dt.size(),
        Algo::TwoShot => algo::all_reduce_twoshot_stage(n, count, dt),
        Algo::Tree => 2 * algo::tree_stage(pl),
        Algo::Bruck => algo::bruck_stage(n, count, dt),
        _ => algo::all_reduce_ring_stage(pl),
    }
}

/// Run the network all-reduce `a` (not a shared-memory or hierarchical one).
pub(super) fn all_reduce_run(
    exec: &mut Exec,
    a: Algo,
    dt: DataType,
    op: RedOp,
    count: usize,
    pl: &Pipeline,
) -> Result<()> {
    match a {
        Algo::Direct => algo::all_reduce_direct(exec, dt, op, count),
        Algo::Doubling => algo::all_reduce_doubling(exec, dt, op, count),
        Algo::TwoShot => algo::all_reduce_twoshot(exec, dt, op, count),
        Algo::Tree => algo::all_reduce_tree(exec, dt, op, count, pl),
        Algo::Bruck => algo::all_reduce_bruck(exec, dt, op, count),
        _ => algo::all_reduce_ring(exec, dt, op, count, pl),
    }
}

/// Staging bytes of a broadcast (`reduce: None`) or reduce with `a`.
pub(super) fn rooted_stage(a: Algo, reduce: bool, pl: &Pipeline) -> usize {
    match (a, reduce) {
        (Algo::Tree, _) => algo::tree_stage(pl),
        (_, true) => algo::chain_stage(pl),
        (_, false) => 64,
    }
}

/// Run a broadcast (`op: None`) or reduce to the group's rank `root` with `a`.
fn rooted_run(
    exec: &mut Exec,
    a: Algo,
    root: usize,
    dt: DataType,
    op: Option<RedOp>,
    count: usize,
    pl: &Pipeline,
) -> Result<()> {
    match (a, op) {
        (Algo::Tree, None) => algo::broadcast_tree(exec, root, dt, count, pl),
        (Algo::Tree, Some(op)) => algo::reduce_tree(exec, root, dt, op, count, pl),
        (_, None) => algo::broadcast_ring(exec, root, dt, count, pl),
        (_, Some(op)) => algo::reduce_ring(exec, root, dt, op, count, pl),
    }
}

impl State {
    /// Whether `kind` of `bytes` runs by hosts: the job spans hosts with several ranks on
    /// some, the buffers are host memory, and `ROCCL_HIER`, the forced algorithm or the cost
    /// model (against the flat choice `flat`) says so.
    pub(super) fn wants_hier(
        &self,
        kind: CollKind,
        dt: DataType,
        bytes: usize,
        forced: Option<Algo>,
        flat: &(Algo, Pipeline),
    ) -> bool {
        let (Some(topo), Some((intra, inter))) = (&self.topo, &self.hier_cost) else {
            return false;
        };
        let applies = match kind {
            CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => true,
            // Even hosts pair ranks of equal local index; uneven ones go through leaders.
            CollKind::AllGather | CollKind::ReduceScatter => topo.even() || algo::leaders_fit(topo),
            CollKind::AllToAll => false,
        };
        if !topo.layered() || !applies {
            return false;
        }
        match (forced, self.cfg.hier) {
            (Some(Algo::Hier), _) => true,
            (Some(_), _) | (None, Hier::Off) => false,
            (None, Hier::On) => true,
            (None, Hier::Auto) => {
                let layers = Layers {
                    hosts: topo.nhosts(),
                    local: topo.max_local(),
                    even: topo.even(),
                    nics: topo.nics(),
                };
                let t = &self.cfg.tuning;
                let Some(h) = model::estimate_hier(kind, dt, bytes, layers, intra, inter, t) else {
                    return false;
                };
                let scaled = LinkCost {
                    wire_gamma_gbs: self.cost.wire_gamma_gbs * model::reduce_factor(dt),
                    ..self.cost
                };
                let n = self.links.nranks;
                h < model::estimate(kind, flat.0, n, bytes, &scaled, &flat.1)
            }
        }
    }

    /// The ring order by host, when it is not rank order.
    pub(super) fn ring_order(&self) -> Option<Arc<Topology>> {
        self.topo
            .as_ref()
            .filter(|t| !t.ring_in_rank_order())
            .cloned()
    }

    /// [`State::run_exec`] on the group `group` (global ranks by the algorithm's numbers).
    pub(super) fn run_group(
        &mut self,
        group: &[usize],
        send: Option<Mem<'_>>,
        recv: MemMut<'_>,
        dev: Option<&Arc<dyn Device>>,
        stage_bytes: usize,
        f: impl FnOnce(&mut Exec) -> Result<()>,
    ) -> Result<()> {
        self.run_exec(send, recv, dev, stage_bytes, |exec| {
            exec.set_group(group)?;
            f(exec)
        })
    }

    /// Run `f` with the communicator's scratch buffer (kept between calls, up to
    /// [`scratch::KEEP`] bytes of capacity).
    fn with_scratch(
        &mut self,
        f: impl FnOnce(&mut Self, &mut Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        let mut scratch = std::mem::take(&mut self.hier_scratch);
        let r = f(self, &mut scratch);
        self.hier_scratch = scratch::kept(scratch);
        r
    }

    fn topology(&self) -> Result<Arc<Topology>> {
        self.topo
            .clone()
            .ok_or_else(|| Error::Internal("a hierarchical call on one host".into()))
    }

    /// The model's choice for one phase of `kind` on `n` ranks over links `c`.
    fn phase(
        &self,
        kind: CollKind,
        dt: DataType,
        n: usize,
        bytes: usize,
        inter: bool,
    ) -> (Algo, Pipeline) {
        let c = match (&self.hier_cost, inter) {
            (Some((_, c)), true) | (Some((c, _)), false) => *c,
            (None, _) => self.cost,
        };
        // A group between hosts holds one rank per host: no NIC shared inside the group.
        let c = LinkCost {
            nic_share: 1.0,
            ..c
        };
        model::choose_for(kind, dt, n, bytes, &c, None, &self.cfg.tuning)
    }

    /// Hierarchical all-reduce of `count` elements (host memory).
    pub(super) fn all_reduce_hier(
        &mut self,
        dt: DataType,
        op: RedOp,
        count: usize,
        send: Option<Mem<'_>>,
        mut recv: MemMut<'_>,
    ) -> Result<()> {
        let topo = self.topology()?;
        let me = self.links.rank;
        let n = self.links.nranks;
        let esz = dt.size();
        let bytes = count * esz;
        // Averages sum in every phase and divide once, by every rank's count.
        let sum_op = if op == RedOp::Avg { RedOp::Sum } else { op };
        let local = topo.local(me);
        let m = local.len();
        if topo.even() {
            let li = topo.local_index(me);
            let mut pl = model::pipeline(bytes / m, bytes, &self.cfg.tuning);
            // One channel: each rank's share is then one range.
            pl.channels = 1;
            let need = algo::all_reduce_ring_stage(&pl);
            self.run_group(local, send, recv.part(0, bytes), None, need, |exec| {
                algo::all_reduce_ring_half(exec, dt, sum_op, count, &pl, Half::ReduceScatter)
            })?;
            let (start, len) = algo::ring_owned(count, m, li);
            if len > 0 {
                let cross = topo.cross(me);
                let (a, cpl) = self.phase(CollKind::AllReduce, dt, cross.len(), len * esz, true);
                let need = all_reduce_stage(a, cross.len(), len, dt, &cpl);
                let part = recv.part(start * esz, len * esz);
                self.run_group(&cross, None, part, None, need, |exec| {
                    all_reduce_run(exec, a, dt, sum_op, len, &cpl)?;
                    if op == RedOp::Avg {
                        exec.finish_avg(Reg::new(Buf::Dst, 0, len * esz), dt, n)?;
                    }
                    Ok(())
                })?;
            }
            return self.run_group(local, None, recv, None, need, |exec| {
                algo::all_reduce_ring_half(exec, dt, sum_op, count, &pl, Half::AllGather)
            });
        }
        // Uneven hosts: through one rank per host (each host's first).
        let leader = local[0];
        let (a, pl) = self.phase(CollKind::Reduce, dt, m, bytes, false);
        self.run_group(
            local,
            send,
            recv.part(0, bytes),
            None,
            rooted_stage(a, true, &pl),
            |exec| rooted_run(exec, a, 0, dt, Some(sum_op), count, &pl),
        )?;
        if me == leader {
            let leaders = topo.leaders(0);
            let (a, lpl) = self.phase(CollKind::AllReduce, dt, leaders.len(), bytes, true);
            let need = all_reduce_stage(a, leaders.len(), count, dt, &lpl);
            self.run_group(&leaders, None, recv.part(0, bytes), None, need, |exec| {
                all_reduce_run(exec, a, dt, sum_op, count, &lpl)?;
                if op == RedOp::Avg {
                    exec.finish_avg(Reg::new(Buf::Dst, 0, bytes), dt, n)?;
                }
                Ok(())
            })?;
        }
        let (a, pl) = self.phase(CollKind::Broadcast, dt, m, bytes, false);
        self.run_group(
            local,
            None,
            recv,
            None,
            rooted_stage(a, false, &pl),
            |exec| rooted_run(exec, a, 0, dt, None, count, &pl),
        )
    }

    /// Hierarchical broadcast from `root` (host memory): among one rank per host, then
    /// inside each host.
    pub(super) fn broadcast_hier(
        &mut self,
        root: usize,
        dt: DataType,
        count: usize,
        send: Option<Mem<'_>>,
        mut recv: MemMut<'_>,
    ) -> Result<()> {
        let topo = self.topology()?;
        let me = self.links.rank;
        let bytes = count * dt.size();
        let leaders = topo.leaders(root);
        let host = topo.host_of(me);
        let mut send = send;
        if leaders[host] == me {
            let (a, pl) = self.phase(CollKind::Broadcast, dt, leaders.len(), bytes, true);
            let r = topo.host_of(root);
            self.run_group(
                &leaders,
                send.take(),
                recv.part(0, bytes),
                None,
                rooted_stage(a, false, &pl),
                |exec| rooted_run(exec, a, r, dt, None, count, &pl),
            )?;
        }
        let local = topo.local(me);
        let lr = topo.local_index(leaders[host]);
        let (a, pl) = self.phase(CollKind::Broadcast, dt, local.len(), bytes, false);
        self.run_group(
            local,
            None,
            recv,
            None,
            rooted_stage(a, false, &pl),
            |exec| rooted_run(exec, a, lr, dt, None, count, &pl),
        )
    }

    /// Hierarchical reduce to `root` (host memory): inside each host to one rank (the root on
    /// its own host), then among those. A rank that gathers its host's sum but is not the
    /// root keeps it in a scratch buffer kept by the communicator.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reduce_hier(
        &mut self,
        root: usize,
        dt: DataType,
        op: RedOp,
        count: usize,
        send: Option<Mem<'_>>,
        mut recv: MemMut<'_>,
    ) -> Result<()> {
        let topo = self.topology()?;
        let me = self.links.rank;
        let n = self.links.nranks;
        let esz = dt.size();
        let bytes = count * esz;
        let sum_op = if op == RedOp::Avg { RedOp::Sum } else { op };
        let leaders = topo.leaders(root);
        let host = topo.host_of(me);
        let leader = leaders[host];
        let local = topo.local(me);
        let lr = topo.local_index(leader);
        // The input: the send buffer, or the receive buffer in place.
        let (a, pl) = self.phase(CollKind::Reduce, dt, local.len(), bytes, false);
        let need = rooted_stage(a, true, &pl);
        self.with_scratch(|this, scratch| {
            if me == root || me != leader {
                // The root gathers into its output; the others' outputs are not written.
                this.run_group(local, send, recv.part(0, recv.len()), None, need, |exec| {
                    rooted_run(exec, a, lr, dt, Some(sum_op), count, &pl)
                })?;
            } else {
                scratch.resize(bytes, 0);
                this.run_group(
                    local,
                    send.or(Some(recv.as_mem())),
                    MemMut::host(scratch),
                    None,
                    need,
                    |exec| rooted_run(exec, a, lr, dt, Some(sum_op), count, &pl),
                )?;
            }
            if me != leader {
                return Ok(());
            }
            let (a, lpl) = this.phase(CollKind::Reduce, dt, leaders.len(), bytes, true);
            let need = rooted_stage(a, true, &lpl);
            let r = topo.host_of(root);
            let input = (me != root).then(|| Mem::host(scratch));
            this.run_group(
                &leaders,
                input,
                recv.part(0, recv.len()),
                None,
                need,
                |exec| {
                    rooted_run(exec, a, r, dt, Some(sum_op), count, &lpl)?;
                    if op == RedOp::Avg && exec.rank() == r {
                        exec.finish_avg(Reg::new(Buf::Dst, 0, bytes), dt, n)?;
                    }
                    Ok(())
                },
            )
        })
    }

    /// Hierarchical all-gather of `count` elements per rank (even hosts, host memory): a
    /// ring all-gather among the ranks of this rank's local index on every host (blocks at
    /// their global places), then each rank hands those to the other ranks of its host.
    pub(super) fn all_gather_hier(
        &mut self,
        dt: DataType,
        count: usize,
        send: Option<Mem<'_>>,
        mut recv: MemMut<'_>,
    ) -> Result<()> {
        let topo = self.topology()?;
        let me = self.links.rank;
        let block = count * dt.size();
        if !topo.even() {
            // Uneven hosts: gathered at each host's leader, exchanged between the leaders,
            // broadcast inside each host.
            let whole = recv.len();
            let in_place = send.is_none();
            self.run_exec(send, recv.part(0, whole), None, 64, |exec| {
                algo::gather_to_leader(exec, &topo, block, in_place)?;
                algo::exchange_between_leaders(exec, &topo, block, None)
            })?;
            let local = topo.local(me).to_vec();
            let (a, pl) = self.phase(CollKind::Broadcast, dt, local.len(), whole, false);
            let total = whole / dt.size();
            return self.run_group(
                &local,
                None,
                recv,
                None,
                rooted_stage(a, false, &pl),
                |exec| rooted_run(exec, a, 0, dt, None, total, &pl),
            );
        }
        let cross = topo.cross(me);
        let (_, pl) = self.phase(
            CollKind::AllGather,
            dt,
            cross.len(),
            block * cross.len(),
            true,
        );
        let whole = recv.len();
        self.run_group(&cross, send, recv.part(0, whole), None, 64, |exec| {
            algo::all_gather_ring(exec, dt, count, &pl)
        })?;
        self.run_exec(None, recv, None, 64, |exec| {
            algo::all_gather_within_hosts(exec, &topo, block)
        })
    }

    /// Hierarchical reduce-scatter of `count` elements per rank (even hosts, host memory):
    /// inside each host every rank reduces the blocks of its local index on every host (into
    /// a scratch buffer the communicator keeps), then the ranks of one local index
    /// reduce-scatter those in a ring between hosts.
    pub(super) fn reduce_scatter_hier(
        &mut self,
        dt: DataType,
        op: RedOp,
        count: usize,
        send: Option<Mem<'_>>,
        mut recv: MemMut<'_>,
    ) -> Result<()> {
        let topo = self.topology()?;
        let me = self.links.rank;
        let n = self.links.nranks;
        let esz = dt.size();
        let block = count * esz;
        let sum_op = if op == RedOp::Avg { RedOp::Sum } else { op };
        if !topo.even() {
            return self.reduce_scatter_by_leaders(&topo, dt, op, count, send, recv);
        }
        let cross = topo.cross(me);
        let (_, pl) = self.phase(
            CollKind::ReduceScatter,
            dt,
            cross.len(),
            block * cross.len(),
            true,
        );
        let stage = algo::reduce_within_hosts_stage(&topo, block);
        self.with_scratch(|this, scratch| {
            scratch.resize(n * block, 0);
            let input = send.unwrap_or(recv.as_mem());
            this.run_exec(Some(input), MemMut::host(scratch), None, stage, |exec| {
                algo::reduce_within_hosts(exec, &topo, dt, sum_op, count)
            })?;
            // In place, this rank's result is its block of the buffer.
            let out = if send.is_some() {
                recv.part(0, block)
            } else {
                recv.part(me * block, block)
            };
            let need = algo::reduce_scatter_ring_stage(count, dt, &pl);
            this.run_group(&cross, Some(Mem::host(scratch)), out, None, need, |exec| {
                algo::reduce_scatter_ring(exec, dt, sum_op, count, &pl)?;
                if op == RedOp::Avg {
                    exec.finish_avg(Reg::new(Buf::Dst, 0, block), dt, n)?;
                }
                Ok(())
            })
        })
    }

    /// Reduce-scatter on uneven hosts: reduced to each host's leader, exchanged (and
    /// reduced) between the leaders, scattered inside each host.
    fn reduce_scatter_by_leaders(
        &mut self,
        topo: &Topology,
        dt: DataType,
        op: RedOp,
        count: usize,
        send: Option<Mem<'_>>,
        mut recv: MemMut<'_>,
    ) -> Result<()> {
        let me = self.links.rank;
        let n = self.links.nranks;
        let block = count * dt.size();
        let sum_op = if op == RedOp::Avg { RedOp::Sum } else { op };
        let local = topo.local(me).to_vec();
        self.with_scratch(|this, scratch| {
            scratch.resize(n * block, 0);
            let input = send.unwrap_or(recv.as_mem());
            let (a, pl) = this.phase(CollKind::Reduce, dt, local.len(), n * block, false);
            this.run_group(
                &local,
                Some(input),
                MemMut::host(scratch),
                None,
                rooted_stage(a, true, &pl),
                |exec| rooted_run(exec, a, 0, dt, Some(sum_op), n * count, &pl),
            )?;
            let stage = algo::exchange_between_leaders_stage(topo, block);
            this.run_exec(None, MemMut::host(scratch), None, stage, |exec| {
                algo::exchange_between_leaders(exec, topo, block, Some((dt, sum_op)))
            })?;
            // In place, this rank's result is its block of the buffer.
            let out = if send.is_some() {
                recv.part(0, block)
            } else {
                recv.part(me * block, block)
            };
            this.run_exec(Some(Mem::host(scratch)), out, None, 64, |exec| {
                algo::scatter_from_leader(exec, topo, block)?;
                if op == RedOp::Avg {
                    exec.finish_avg(Reg::new(Buf::Dst, 0, block), dt, n)?;
                }
                Ok(())
            })
        })
    }
}
