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

// Hosts of any sizes (uneven): through each host's first rank, its leader.

/// Runs of consecutive ranks in `ranks` (in rank order): (first, how many).
fn runs(ranks: &[usize]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &r in ranks {
        match out.last_mut() {
            Some((first, len)) if *first + *len == r => *len += 1,
            _ => out.push((r, 1)),
        }
    }
    out
}

/// The leader of `r`'s host: its lowest rank.
fn leader_of(topo: &Topology, r: usize) -> usize {
    topo.local(r)[0]
}

/// The first phase of the all-gather by leaders: each rank's block (its input, or in place
/// block `rank` of the output) to its host's leader, which gathers them at their global
/// places in its output. `block`: bytes per rank.
pub(crate) fn gather_to_leader(
    exec: &mut Exec,
    topo: &Topology,
    block: usize,
    in_place: bool,
) -> Result<()> {
    let me = exec.rank();
    let leader = leader_of(topo, me);
    let mine = Reg::new(Buf::Dst, me * block, block);
    let input = if in_place {
        mine
    } else {
        Reg::new(Buf::Src, 0, block)
    };
    if me != leader {
        exec.ensure([(leader, 0)], std::iter::empty())?;
        exec.send(leader, 0, input)?;
        return exec.finish();
    }
    if !in_place {
        exec.copy(mine, input)?;
    }
    let others = &topo.local(me)[1..];
    for batch in others.chunks(BATCH) {
        exec.ensure(std::iter::empty(), batch.iter().map(|&p| (p, 0)))?;
        for &p in batch {
            exec.recv(p, 0, Reg::new(Buf::Dst, p * block, block))?;
        }
        exec.finish()?;
    }
    Ok(())
}

/// The last phase of the reduce-scatter by leaders: the leader holds the job's result for
/// every rank of its host (in its source, at their global places) and gives each its block;
/// every rank's block lands at the start of its output.
pub(crate) fn scatter_from_leader(exec: &mut Exec, topo: &Topology, block: usize) -> Result<()> {
    let me = exec.rank();
    let leader = leader_of(topo, me);
    let out = Reg::new(Buf::Dst, 0, block);
    if me != leader {
        exec.ensure(std::iter::empty(), [(leader, 0)])?;
        exec.recv(leader, 0, out)?;
        return exec.finish();
    }
    exec.copy(out, Reg::new(Buf::Src, me * block, block))?;
    let others = &topo.local(me)[1..];
    for batch in others.chunks(BATCH) {
        exec.ensure(batch.iter().map(|&p| (p, 0)), std::iter::empty())?;
        for &p in batch {
            exec.send(p, 0, Reg::new(Buf::Src, p * block, block))?;
        }
        exec.finish()?;
    }
    Ok(())
}

/// Most runs of consecutive ranks a host may have for [`exchange_between_leaders`]: one
/// round posts a message per run to one peer, and a connection takes 32 requests at once.
const MAX_RUNS: usize = 16;

/// Whether the exchanges by leaders apply to `topo`: no host's ranks fall in more than
/// [`MAX_RUNS`] runs (ranks dealt round-robin over hosts of uneven sizes, on large jobs, go
/// flat).
pub(crate) fn leaders_fit(topo: &Topology) -> bool {
    (0..topo.nhosts()).all(|h| runs(topo.local(leader_of_host(topo, h))).len() <= MAX_RUNS)
}

/// Rounds of [`exchange_between_leaders`] per batch: the same on every leader (from the
/// largest host), so that every batch ends at the same round everywhere.
fn rounds_per_batch(topo: &Topology) -> usize {
    let most_runs = (0..topo.nhosts())
        .map(|h| runs(topo.local(leader_of_host(topo, h))).len())
        .max()
        .unwrap_or(1);
    (BATCH / (2 * most_runs)).max(1)
}

fn leader_of_host(topo: &Topology, h: usize) -> usize {
    topo.at(h, 0).unwrap_or(0)
}

/// The middle phase by leaders, between the hosts' leaders (others return at once). In
/// round `k` the leader of host `h` sends to the leader of host `h + k` and receives from
/// that of `h - k`. All-gather (`reduce == None`): it sends its host's blocks and receives
/// the other host's at their places. Reduce-scatter: it sends the other host's blocks of
/// its host's partial sums and reduces what it receives into its own host's blocks.
pub(crate) fn exchange_between_leaders(
    exec: &mut Exec,
    topo: &Topology,
    block: usize,
    reduce: Option<(DataType, RedOp)>,
) -> Result<()> {
    let me = exec.rank();
    let hosts = topo.nhosts();
    if me != leader_of(topo, me) || hosts < 2 {
        return Ok(());
    }
    let h = topo.host_of(me);
    let mine = runs(topo.local(me));
    let per = rounds_per_batch(topo);
    let range = |(first, len): (usize, usize)| Reg::new(Buf::Dst, first * block, len * block);
    let mut k0 = 1;
    while k0 < hosts {
        let k1 = (k0 + per).min(hosts);
        let to = |k: usize| leader_of_host(topo, (h + k) % hosts);
        let from = |k: usize| leader_of_host(topo, (h + hosts - k) % hosts);
        exec.ensure((k0..k1).map(|k| (to(k), 0)), (k0..k1).map(|k| (from(k), 0)))?;
        let mut staged = Vec::new();
        let mut slot = 0;
        for k in k0..k1 {
            match reduce {
                None => {
                    for &r in &mine {
                        exec.send(to(k), 0, range(r))?;
                    }
                    for r in runs(topo.local(from(k))) {
                        exec.recv(from(k), 0, range(r))?;
                    }
                }
                Some(_) => {
                    for r in runs(topo.local(to(k))) {
                        exec.send(to(k), 0, range(r))?;
                    }
                    for &r in &mine {
                        let s = Reg::new(Buf::Stage, slot, r.1 * block);
                        exec.recv(from(k), 0, s)?;
                        staged.push((range(r), s));
                        slot += r.1 * block;
                    }
                }
            }
        }
        exec.finish()?;
        if let Some((dt, op)) = reduce {
            for (d, s) in staged {
                exec.reduce(d, d, s, dt, op)?;
            }
        }
        k0 = k1;
    }
    Ok(())
}

/// Staging bytes of [`exchange_between_leaders`] for a reduce-scatter.
pub(crate) fn exchange_between_leaders_stage(topo: &Topology, block: usize) -> usize {
    let per = rounds_per_batch(topo).min(topo.nhosts());
    per * topo.max_local() * block + 64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_fall_in_runs_and_many_runs_go_flat() {
        assert_eq!(runs(&[0, 1, 2, 5, 6, 9]), vec![(0, 3), (5, 2), (9, 1)]);
        assert!(runs(&[]).is_empty());
        // 3 + 1 hosts in rank order: one run each.
        assert!(leaders_fit(&Topology::new(&[7, 7, 7, 8])));
        // 40 ranks dealt over hosts of 27 and 13: host 7 holds 14 runs, fits; 70 ranks over
        // hosts of 47 and 23 in the same pattern: 24 runs, does not.
        let dealt =
            |n: usize| -> Vec<u64> { (0..n).map(|r| if r % 3 == 1 { 8 } else { 7 }).collect() };
        assert!(leaders_fit(&Topology::new(&dealt(40))));
        assert!(!leaders_fit(&Topology::new(&dealt(70))));
    }
}
