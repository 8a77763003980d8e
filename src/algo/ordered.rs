//! Reductions in rank order: every element is reduced as `((x0 ⊕ x1) ⊕ x2) ⊕ …`, by one
//! rank, with the same kernels, whatever the network, the buffer's size or the number of
//! pieces it is cut into. The one-shot and two-shot all-reduce (`p2p.rs`), the
//! shared-memory ones (`shm`), and the direct reduce-scatter and reduce here all reduce so;
//! the deterministic mode ([`crate::algo::model::choose_ordered`]) runs only these, so a
//! reducing collective returns the same bits whichever of them runs it.

use super::part;
use crate::error::Result;
use crate::exec::{Buf, Exec, Reg};
use crate::types::{DataType, RedOp};

/// `out = data(0) ⊕ data(1) ⊕ … ⊕ data(n-1)`, in rank order (then the average's division).
/// `data(p)` may be `out` itself only for `p == 0`.
pub(crate) fn reduce_in_rank_order(
    exec: &mut Exec,
    out: Reg,
    n: usize,
    data: impl Fn(usize) -> Reg,
    dt: DataType,
    op: RedOp,
) -> Result<()> {
    exec.reduce(out, data(0), data(1), dt, op)?;
    for p in 2..n {
        exec.reduce(out, out, data(p), dt, op)?;
    }
    if op == RedOp::Avg {
        exec.finish_avg(out, dt, n)?;
    }
    Ok(())
}

/// Every rank sends block `p` of its input (`input(p)`) to rank `p` and receives its own
/// block from every peer into `slot(peer)`, all at once (in batches past 48 peers, see
/// [`super::end_of_batch`]). Blocks of no bytes are skipped by both sides alike.
pub(crate) fn exchange_blocks(
    exec: &mut Exec,
    input: impl Fn(usize) -> Reg,
    slot: impl Fn(usize) -> Reg,
) -> Result<()> {
    let (n, r) = (exec.nranks(), exec.rank());
    exec.ensure(
        (1..n).map(|s| ((r + s) % n, 0)),
        (1..n).map(|s| ((r + n - s) % n, 0)),
    )?;
    for s in 1..n {
        let (to, from) = ((r + s) % n, (r + n - s) % n);
        if slot(from).len > 0 {
            exec.recv(from, 0, slot(from))?;
        }
        if input(to).len > 0 {
            exec.send(to, 0, input(to))?;
        }
        super::end_of_batch(exec, s)?;
    }
    exec.finish()
}

/// Staging bytes of [`reduce_scatter_direct`]: a block-sized slot per rank.
pub(crate) fn reduce_scatter_direct_stage(n: usize, count: usize, dt: DataType) -> usize {
    n * (count * dt.size()).next_multiple_of(64)
}

/// Direct reduce-scatter: `n * count` elements in, `count` out (in place: this rank's block
/// of the buffer). Every rank sends block `p` of its input to rank `p` and receives its own
/// block from everyone, then reduces them in rank order. One step, `(n-1)/n · B` sent per
/// rank. Staging: a block per rank.
pub(crate) fn reduce_scatter_direct(
    exec: &mut Exec,
    dt: DataType,
    op: RedOp,
    count: usize,
) -> Result<()> {
    let (n, r) = (exec.nranks(), exec.rank());
    let bytes = count * dt.size();
    let stride = bytes.next_multiple_of(64);
    // In place, the input is the output buffer, and the output its block `r`.
    let input = |p: usize| Reg::new(Buf::Src, p * bytes, bytes);
    let out = if exec.in_place() {
        Reg::new(Buf::Dst, r * bytes, bytes)
    } else {
        Reg::new(Buf::Dst, 0, bytes)
    };
    if n == 1 {
        return exec.copy(out, input(0));
    }
    let slot = |p: usize| Reg::new(Buf::Stage, p * stride, bytes);
    exchange_blocks(exec, input, slot)?;
    // In place, our block of the input is the output about to be written: keep it.
    let own = if exec.in_place() {
        exec.copy(slot(r), input(r))?;
        slot(r)
    } else {
        input(r)
    };
    reduce_in_rank_order(exec, out, n, |p| if p == r { own } else { slot(p) }, dt, op)
}

/// Staging bytes of [`reduce_direct`]: a block-sized slot per rank and one for the reduced
/// block.
pub(crate) fn reduce_direct_stage(n: usize, count: usize, dt: DataType) -> usize {
    (n + 1) * (count.div_ceil(n) * dt.size()).next_multiple_of(64)
}

/// Direct reduce to `root`: the buffer is cut in `n` blocks; every rank reduces one block,
/// in rank order, from everyone's (a direct reduce-scatter), and sends it to the root, which
/// receives the blocks straight into its output. Two steps, about `2(n-1)/n · B` through the
/// root's link (a chain or tree moves B per link, but sums in another order). Staging: a
/// block per rank, and the reduced block.
pub(crate) fn reduce_direct(
    exec: &mut Exec,
    root: usize,
    dt: DataType,
    op: RedOp,
    count: usize,
) -> Result<()> {
    let (n, r, esz) = (exec.nranks(), exec.rank(), dt.size());
    let block = |b: Buf, i: usize| {
        let (start, len) = part(count, n, i);
        Reg::new(b, start * esz, len * esz)
    };
    if n == 1 {
        return exec.copy(block(Buf::Dst, 0), block(Buf::Src, 0));
    }
    let stride = (count.div_ceil(n) * esz).next_multiple_of(64);
    let mine = block(Buf::Src, r).len;
    let slot = |p: usize| Reg::new(Buf::Stage, p * stride, mine);
    exchange_blocks(exec, |p| block(Buf::Src, p), slot)?;
    // The root reduces its block into its output; the others into a slot of their own.
    let out = if r == root {
        block(Buf::Dst, r)
    } else {
        Reg::new(Buf::Stage, n * stride, mine)
    };
    if mine > 0 {
        // In place at the root, our input block is the output about to be written.
        let own = if exec.in_place() {
            exec.copy(slot(r), block(Buf::Src, r))?;
            slot(r)
        } else {
            block(Buf::Src, r)
        };
        reduce_in_rank_order(exec, out, n, |p| if p == r { own } else { slot(p) }, dt, op)?;
    }
    exec.ensure(
        (r != root).then_some((root, 0)),
        (0..n).filter(|&p| r == root && p != root).map(|p| (p, 0)),
    )?;
    if r == root {
        let from = (0..n).filter(|&p| p != root && block(Buf::Dst, p).len > 0);
        for (k, p) in from.enumerate() {
            exec.recv(p, 0, block(Buf::Dst, p))?;
            super::end_of_batch(exec, k + 1)?;
        }
    } else if mine > 0 {
        exec.send(root, 0, out)?;
    }
    exec.finish()
}
