//! The exchanges inside each host of the hierarchical all-gather and reduce-scatter
//! (`comm/hier.rs` runs the phases between hosts with the rings over groups). Every host
//! holds the same number of ranks; blocks lie in the call's buffers at their global rank's
//! place. Requests are posted in batches of at most [`BATCH`] and finished per batch.

use super::topo::Topology;
use crate::error::{Error, Result};
use crate::exec::{Buf, Exec, Reg};
use crate::types::{DataType, RedOp};

/// Requests posted before the executor finishes them (it tracks 128 at most).
const BATCH: usize = 64;

fn peers(exec: &Exec, topo: &Topology) -> Result<(Vec<usize>, usize)> {
    let me = exec.rank();
    if !topo.even() {
        return Err(Error::Internal(
            "an exchange by host on uneven hosts".into(),
        ));
    }
    Ok((topo.local(me).to_vec(), topo.local_index(me)))
}

/// The rank of local index `j` on host `h` (every host has as many ranks as this one).
fn at(topo: &Topology, h: usize, j: usize) -> Result<usize> {
    topo.at(h, j)
        .ok_or_else(|| Error::Internal(format!("host {h} has no rank of local index {j}")))
}

/// After each rank holds, in its output, the block of every host's rank of its own local
/// index (the all-gather between hosts), each rank sends those to the other ranks of its host
/// and receives theirs: every rank then holds every block. `block`: bytes per rank.
pub(crate) fn all_gather_within_hosts(
    exec: &mut Exec,
    topo: &Topology,
    block: usize,
) -> Result<()> {
    let (local, i) = peers(exec, topo)?;
    let m = local.len();
    if m == 1 {
        return Ok(());
    }
    let others = || local.iter().enumerate().filter(|&(j, _)| j != i);
    exec.ensure(
        others().map(|(_, &p)| (p, 0)),
        others().map(|(_, &p)| (p, 0)),
    )?;
    let mut posted = 0;
    for h in 0..topo.nhosts() {
        let mine = Reg::new(Buf::Dst, at(topo, h, i)? * block, block);
        for (j, &p) in others() {
            exec.recv(p, 0, Reg::new(Buf::Dst, at(topo, h, j)? * block, block))?;
            exec.send(p, 0, mine)?;
            posted += 2;
        }
        if posted + 2 * (m - 1) > BATCH {
            exec.finish()?;
            posted = 0;
        }
    }
    exec.finish()
}

/// The first phase of the hierarchical reduce-scatter: each rank sends every other rank `j`
/// of its host its input blocks of every host's rank of local index `j`, and reduces those it
/// receives into its own: afterwards its output (`Dst`, laid out as the input) holds, at the
/// blocks of its own local index, the host's reduction of them. Receives land in staging
/// (`(m-1)` blocks per host of a batch). `count`: elements per block.
pub(crate) fn reduce_within_hosts(
    exec: &mut Exec,
    topo: &Topology,
    dt: DataType,
    op: RedOp,
    count: usize,
) -> Result<()> {
    let (local, i) = peers(exec, topo)?;
    let m = local.len();
    let block = count * dt.size();
    let blk = |b: Buf, r: usize| Reg::new(b, r * block, block);
    for h in 0..topo.nhosts() {
        let r = at(topo, h, i)?;
        exec.copy(blk(Buf::Dst, r), blk(Buf::Src, r))?;
    }
    if m == 1 {
        return Ok(());
    }
    let others = || local.iter().enumerate().filter(|&(j, _)| j != i);
    exec.ensure(
        others().map(|(_, &p)| (p, 0)),
        others().map(|(_, &p)| (p, 0)),
    )?;
    // Hosts per batch: each host costs 2(m-1) requests and m-1 staged blocks.
    let per = (BATCH / (2 * (m - 1))).max(1);
    let hosts = topo.nhosts();
    let mut h0 = 0;
    while h0 < hosts {
        let h1 = (h0 + per).min(hosts);
        for h in h0..h1 {
            for (k, (j, &p)) in others().enumerate() {
                let slot = ((h - h0) * (m - 1) + k) * block;
                exec.recv(p, 0, Reg::new(Buf::Stage, slot, block))?;
                exec.send(p, 0, blk(Buf::Src, at(topo, h, j)?))?;
            }
        }
        exec.finish()?;
        for h in h0..h1 {
            let d = blk(Buf::Dst, at(topo, h, i)?);
            for k in 0..m - 1 {
                let slot = ((h - h0) * (m - 1) + k) * block;
                exec.reduce(d, d, Reg::new(Buf::Stage, slot, block), dt, op)?;
            }
        }
        h0 = h1;
    }
    Ok(())
}

/// Staging bytes of [`reduce_within_hosts`].
pub(crate) fn reduce_within_hosts_stage(topo: &Topology, block: usize) -> usize {
    let m = topo.max_local().max(2);
    let per = (BATCH / (2 * (m - 1))).max(1).min(topo.nhosts());
    per * (m - 1) * block + 64
}
