//! Algorithms made of direct exchanges: one-shot all-reduce for small messages, pairwise
//! all-to-all, the dissemination barrier, and point-to-point send/receive.

use super::ordered::{exchange_blocks, reduce_in_rank_order};
use super::{end_of_batch, part};
use crate::error::{Error, Result};
use crate::exec::{Buf, Exec, Reg};
use crate::types::{DataType, RedOp};

/// Channel reserved for point-to-point traffic, so user sends never interleave with the
/// messages of a collective on the same connection.
pub(crate) const P2P_CHANNEL: usize = crate::exec::links::MAX_CHANNELS - 1;

/// Staging bytes of the one-shot all-reduce: one slot per rank.
pub(crate) fn all_reduce_direct_stage(n: usize, bytes: usize) -> usize {
    n * bytes.next_multiple_of(64)
}

/// One-shot all-reduce: every rank sends its whole input to every peer, then reduces all
/// `n` inputs in rank order (so every rank computes bit-identical results). One network
/// step; `(n-1) * bytes` sent per rank. For small messages.
pub(crate) fn all_reduce_direct(
    exec: &mut Exec,
    dt: DataType,
    op: RedOp,
    count: usize,
) -> Result<()> {
    let (n, r) = (exec.nranks(), exec.rank());
    let bytes = count * dt.size();
    let stride = bytes.next_multiple_of(64);
    let input = Reg::new(Buf::Src, 0, bytes);
    let dst = Reg::new(Buf::Dst, 0, bytes);
    if n == 1 {
        return exec.copy(dst, input);
    }
    let slot = |p: usize| Reg::new(Buf::Stage, p * stride, bytes);
    exchange_blocks(exec, |_| input, slot)?;
    // In place, our input is about to be overwritten: keep it in our own slot.
    let own = if exec.in_place() {
        exec.copy(slot(r), input)?;
        slot(r)
    } else {
        input
    };
    reduce_in_rank_order(exec, dst, n, |p| if p == r { own } else { slot(p) }, dt, op)
}

/// Staging of the two-shot all-reduce: a block-sized slot per rank.
pub(crate) fn all_reduce_twoshot_stage(n: usize, count: usize, dt: DataType) -> usize {
    n * (count.div_ceil(n) * dt.size()).next_multiple_of(64)
}

/// Two-shot all-reduce: a direct reduce-scatter, then a direct all-gather. The buffer is cut
/// in `n` blocks; every rank sends block `p` of its input to rank `p` and receives its own
/// block from everyone (all at once), reduces its block in rank order into the output, then
/// sends the reduced block to everyone and receives theirs straight into the output. Two
/// steps, `2(n-1)/n · B` sent per rank (the one-shot sends `(n-1) · B`), each block reduced
/// once, by its owner, so every rank gets the same bits. Staging: a block per rank.
pub(crate) fn all_reduce_twoshot(
    exec: &mut Exec,
    dt: DataType,
    op: RedOp,
    count: usize,
) -> Result<()> {
    let (n, r, esz) = (exec.nranks(), exec.rank(), dt.size());
    if n == 1 {
        return exec.copy_input(count * esz);
    }
    let stride = (count.div_ceil(n) * esz).next_multiple_of(64);
    let block = |b: Buf, i: usize| {
        let (start, len) = part(count, n, i);
        Reg::new(b, start * esz, len * esz)
    };
    let slot = |p: usize| Reg::new(Buf::Stage, p * stride, block(Buf::Dst, r).len);
    // Empty blocks (count < n) are skipped by both sides alike.
    let mine = block(Buf::Dst, r).len;
    exchange_blocks(exec, |p| block(Buf::Src, p), slot)?;
    if mine > 0 {
        // In place, the output block is also our input: keep the input in our own slot.
        let own = if exec.in_place() {
            exec.copy(slot(r), block(Buf::Src, r))?;
            slot(r)
        } else {
            block(Buf::Src, r)
        };
        let data = |p: usize| if p == r { own } else { slot(p) };
        reduce_in_rank_order(exec, block(Buf::Dst, r), n, data, dt, op)?;
    }
    for s in 1..n {
        let (to, from) = ((r + s) % n, (r + n - s) % n);
        if block(Buf::Dst, from).len > 0 {
            exec.recv(from, 0, block(Buf::Dst, from))?;
        }
        if mine > 0 {
            exec.send(to, 0, block(Buf::Dst, r))?;
        }
        end_of_batch(exec, s)?;
    }
    exec.finish()
}

/// Recursive-doubling all-reduce: with `p` the largest power of two ≤ n, ranks `p..n` first
/// hand their input to rank `r - p`; then ranks `0..p` exchange whole buffers with
/// `r ^ 2^k` for k = 0..log2(p) and reduce; finally ranks `r - p` send the result back.
/// Every rank evaluates the same expression tree (reductions are commutative), so results
/// are bit-identical. log2(p) (+2) steps, each of the whole buffer. Staging: one buffer.
/// The input is never copied: the first exchange sends it from where it is and the first
/// reduction writes the output (`dst = src ⊕ peer`).
pub(crate) fn all_reduce_doubling(
    exec: &mut Exec,
    dt: DataType,
    op: RedOp,
    count: usize,
) -> Result<()> {
    let (n, r) = (exec.nranks(), exec.rank());
    let bytes = count * dt.size();
    if n == 1 {
        return exec.copy_input(bytes);
    }
    let src = Reg::new(Buf::Src, 0, bytes);
    let dst = Reg::new(Buf::Dst, 0, bytes);
    let other = Reg::new(Buf::Stage, 0, bytes);
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    // Every peer of this rank, on channel 0 both ways (at most 1 + log2(n) of them).
    let mut peers = arrayvec::ArrayVec::<(usize, usize), { 1 + usize::BITS as usize }>::new();
    if r >= p {
        peers.push((r - p, 0));
    } else {
        if r + p < n {
            peers.push((r + p, 0));
        }
        let mut k = 1;
        while k < p {
            peers.push((r ^ k, 0));
            k <<= 1;
        }
    }
    exec.ensure(peers.iter().copied(), peers.iter().copied())?;
    if r >= p {
        exec.send(r - p, 0, src)?;
        exec.finish()?;
        exec.recv(r - p, 0, dst)?;
        return exec.finish();
    }
    // Where this rank's running result is: its input until the first reduction.
    let mut acc = src;
    if r + p < n {
        exec.recv(r + p, 0, other)?;
        exec.finish()?;
        exec.reduce(dst, acc, other, dt, op)?;
        acc = dst;
    }
    let mut k = 1;
    while k < p {
        exec.recv(r ^ k, 0, other)?;
        exec.send(r ^ k, 0, acc)?;
        exec.finish()?;
        exec.reduce(dst, acc, other, dt, op)?;
        acc = dst;
        k <<= 1;
    }
    if op == RedOp::Avg {
        exec.finish_avg(dst, dt, n)?;
    }
    if r + p < n {
        exec.send(r + p, 0, dst)?;
        exec.finish()?;
    }
    Ok(())
}

/// Pairwise all-to-all: at step `s` send block `r+s` to rank `r+s` and receive block `r-s`
/// from rank `r-s`; the steps are posted at once (48 at a time beyond 49 ranks) so every
/// link works in parallel. In place, the input is first copied to staging.
pub(crate) fn all_to_all_pairwise(exec: &mut Exec, block: usize) -> Result<()> {
    let (n, r) = (exec.nranks(), exec.rank());
    let src_buf = if exec.in_place() {
        let all = Reg::new(Buf::Dst, 0, n * block);
        exec.copy(Reg::new(Buf::Stage, 0, n * block), all)?;
        Buf::Stage
    } else {
        Buf::Src
    };
    let blk = |b: Buf, i: usize| Reg::new(b, i * block, block);
    exec.copy(blk(Buf::Dst, r), blk(src_buf, r))?;
    if n == 1 {
        return Ok(());
    }
    exec.ensure(
        (1..n).map(|s| ((r + s) % n, 0)),
        (1..n).map(|s| ((r + n - s) % n, 0)),
    )?;
    for s in 1..n {
        let (t, f) = ((r + s) % n, (r + n - s) % n);
        exec.recv(f, 0, blk(Buf::Dst, f))?;
        exec.send(t, 0, blk(src_buf, t))?;
        end_of_batch(exec, s)?;
    }
    exec.finish()
}

/// Dissemination barrier: `⌈log2 n⌉` rounds of empty messages to `r + 2^k`.
pub(crate) fn barrier_dissemination(exec: &mut Exec) -> Result<()> {
    let (n, r) = (exec.nranks(), exec.rank());
    let empty = Reg::new(Buf::Stage, 0, 0);
    let mut d = 1;
    while d < n {
        let (to, from) = ((r + d) % n, (r + n - d) % n);
        exec.ensure([(to, 0)], [(from, 0)])?;
        exec.recv(from, 0, empty)?;
        exec.send(to, 0, empty)?;
        exec.finish()?;
        d *= 2;
    }
    Ok(())
}

/// Send `Src` to `to` and/or receive `Dst` from `from`, concurrently. Sending to oneself
/// and receiving from oneself in the same call is a local copy.
pub(crate) fn sendrecv(
    exec: &mut Exec,
    to: Option<usize>,
    send_len: usize,
    from: Option<usize>,
    recv_len: usize,
) -> Result<()> {
    let r = exec.rank();
    let sreg = Reg::new(Buf::Src, 0, send_len);
    let rreg = Reg::new(Buf::Dst, 0, recv_len);
    if to == Some(r) || from == Some(r) {
        if to != from {
            return Err(Error::InvalidUsage(format!(
                "rank {r} sends to itself but receives from {from:?} (or the reverse): a self-exchange must both send to and receive from {r}"
            )));
        }
        if send_len != recv_len {
            return Err(Error::arg(format!(
                "self send of {send_len} bytes into a receive of {recv_len} bytes"
            )));
        }
        return exec.copy(rreg, sreg);
    }
    exec.ensure(to.map(|p| (p, P2P_CHANNEL)), from.map(|p| (p, P2P_CHANNEL)))?;
    if let Some(p) = from {
        exec.recv(p, P2P_CHANNEL, rreg)?;
    }
    if let Some(p) = to {
        exec.send(p, P2P_CHANNEL, sreg)?;
    }
    exec.finish()
}
