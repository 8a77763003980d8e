//! Collectives through the host's shared-memory segments (every rank on one host).
//!
//! Each call runs in pieces of at most one slot. Per piece a rank copies its input into its
//! own slot, publishes it, waits for the ranks it reads and then reduces or copies straight
//! out of their slots into its output: one synchronisation and no message per piece.
//!
//! | algorithm | syncs per piece | bytes a rank copies in / reads out |
//! |---|---|---|
//! | all-reduce one-shot | 1 | B / n·B (reduces all inputs itself) |
//! | all-reduce two-shot | 2 | B / B + (n−1)/n·B (reduces its 1/n, copies the rest reduced) |
//! | broadcast | 1 | root B / others B |
//! | reduce | 1 | B / root n·B |
//! | all-gather | 1 | B / n·B |
//! | reduce-scatter | 1 | n·B / n·B (B = output block) |
//! | all-to-all | 1 | n·B / n·B (B = block) |
//!
//! With process_vm_readv between every pair of ranks, large broadcasts, all-gathers and
//! all-reduces copy once, straight out of the other ranks' buffers (no slots):
//!
//! | single copy | from | syncs | bytes a rank reads from the others |
//! |---|---|---|---|
//! | broadcast | 256 KiB | 1 | B (root: none) |
//! | all-gather | 128 KiB per rank | 2 | (n−1)·B (B = block) |
//! | all-reduce (two-shot) | 8 MiB | 3 | 2(n−1)/n·B |
//!
//! Every rank reduces the inputs in rank order, so results are bit-identical everywhere.

use std::sync::atomic::AtomicBool;

use crate::error::Result;
use crate::os::wait::Waiter;
use node::{Area, Counter, Node, INLINE};

pub(crate) mod node;
use crate::reduce::{copy_large, finish_avg, reduce_into, reduce_to};
use crate::types::{DataType, RedOp};

/// A call through the shared segments: the segments, the waiting policy and the abort flag.
pub(crate) struct SegmentCall<'a> {
    pub node: &'a mut Node,
    pub waiter: &'a Waiter,
    pub abort: &'a AtomicBool,
    pub nranks: usize,
    pub rank: usize,
    /// What this call is, checked against every rank read: bytes per rank and the code of
    /// [`node::code`].
    pub meta: [u64; 2],
}

impl SegmentCall<'_> {
    /// Begin a call and publish, for every rank `d`, bytes `off..off + len` of block `d` of
    /// `input` (blocks of `block` bytes) as piece `d` of this rank's slot; returns once every
    /// peer has published too.
    fn publish_blocks(
        &mut self,
        input: &[u8],
        block: usize,
        off: usize,
        len: usize,
    ) -> Result<u32> {
        let k = self.begin()?;
        // SAFETY: call `k`'s input area is not published yet, and this is its only slice.
        let slot = unsafe { self.node.own(k, Area::Input, 0, self.nranks * len) };
        for (d, piece) in slot
            .chunks_exact_mut(len.max(1))
            .enumerate()
            .take(self.nranks)
        {
            piece.copy_from_slice(&input[d * block + off..d * block + off + len]);
        }
        self.node.publish(Counter::Arrive, k);
        self.wait_all(Counter::Arrive, k)?;
        Ok(k)
    }

    fn begin(&mut self) -> Result<u32> {
        self.node.begin(self.meta, self.waiter, self.abort)
    }

    fn wait_all(&self, c: Counter, k: u32) -> Result<()> {
        self.node.wait_all(c, k, self.waiter, self.abort)
    }

    fn wait_one(&self, r: usize, k: u32) -> Result<()> {
        self.node
            .wait_one(r, Counter::Arrive, k, self.waiter, self.abort)
    }

    /// Pieces of `total` bytes, each at most `max` bytes and a multiple of `esz`.
    fn pieces(total: usize, max: usize, esz: usize) -> impl Iterator<Item = (usize, usize)> {
        let step = (max / esz).max(1) * esz;
        (0..total)
            .step_by(step.max(1))
            .map(move |off| (off, step.min(total - off)))
    }

    /// Reduce `len` bytes at `off` of every rank's input slot, in rank order, into `dst`.
    /// (Copying each peer's block into an L1-resident buffer first measured no faster:
    /// 1 MiB two-shot on 2 cores, 142 µs either way.)
    fn reduce_inputs(
        &self,
        k: u32,
        off: usize,
        own: Option<&[u8]>,
        dst: &mut [u8],
        dt: DataType,
        op: RedOp,
    ) -> Result<()> {
        let len = dst.len();
        let input = |r: usize| match own {
            Some(o) if r == self.rank => o,
            _ => self.node.read(r, k, Area::Input, off, len),
        };
        reduce_to(dst, input(0), input(1), dt, op)?;
        for r in 2..self.nranks {
            reduce_into(dst, input(r), dt, op)?;
        }
        if op == RedOp::Avg {
            finish_avg(dst, dt, self.nranks)?;
        }
        Ok(())
    }
}

/// All-reduce: one-shot (every rank reduces everything) or two-shot (each rank reduces a
/// 1/n share, then everyone copies the reduced shares).
pub(crate) fn all_reduce_shm(
    f: &mut SegmentCall,
    dt: DataType,
    op: RedOp,
    send: Option<&[u8]>,
    recv: &mut [u8],
    two_shot: bool,
) -> Result<()> {
    let esz = dt.size();
    let n = f.nranks;
    if two_shot && f.node.cma() && recv.len() >= DIRECT_REDUCE_MIN && recv.len() >= n * esz {
        return all_reduce_direct(f, dt, op, send, recv);
    }
    if !two_shot && recv.len() <= INLINE {
        return all_reduce_inline(f, dt, op, send, recv);
    }
    for (off, len) in SegmentCall::pieces(recv.len(), f.node.slot(), esz) {
        let k = f.begin()?;
        let src = match send {
            Some(s) => &s[off..off + len],
            None => &recv[off..off + len],
        };
        // SAFETY: call `k`'s input area is published only below; the slice ends here.
        unsafe { f.node.own(k, Area::Input, 0, len) }.copy_from_slice(src);
        f.node.publish(Counter::Arrive, k);
        f.wait_all(Counter::Arrive, k)?;
        if !two_shot {
            // Our own input is reduced from the caller's buffer, not read back from our
            // slot, whose lines may still be on their way to being ours (2 ranks, 64 B, cores
            // not sharing a cache: 0.62 µs read back, 0.54 µs not). In place, small inputs
            // are kept in a copy (the output overwrites them).
            let kept;
            let own = match send {
                Some(s) => Some(&s[off..off + len]),
                None if len <= KEEP_MAX => {
                    kept = Kept::of(&recv[off..off + len]);
                    Some(&kept.0[..len])
                }
                None => None,
            };
            f.reduce_inputs(k, 0, own, &mut recv[off..off + len], dt, op)?;
            continue;
        }
        let out = &mut recv[off..off + len];
        let elems = len / esz;
        let share = |r: usize| share(elems, n, r, esz);
        let (mo, ml) = share(f.rank);
        if ml > 0 {
            // SAFETY: the result area is published only below, and `reduce_inputs` reads
            // input areas only.
            let mine = unsafe { f.node.own(k, Area::Result, mo, ml) };
            f.reduce_inputs(k, mo, None, mine, dt, op)?;
        }
        f.node.publish(Counter::Result, k);
        f.wait_all(Counter::Result, k)?;
        for r in 0..n {
            let (o, l) = share(r);
            out[o..o + l].copy_from_slice(f.node.read(r, k, Area::Result, o, l));
        }
    }
    Ok(())
}

/// In-place one-shot all-reduces up to this many bytes reduce a copy of their own input.
const KEEP_MAX: usize = 1024;

/// A copy of up to [`KEEP_MAX`] bytes of input, aligned for every element type.
#[repr(C, align(64))]
struct Kept([u8; KEEP_MAX]);

impl Kept {
    fn of(b: &[u8]) -> Kept {
        let mut k = Kept([0; KEEP_MAX]);
        k.0[..b.len()].copy_from_slice(b);
        k
    }
}

/// [`INLINE`] bytes aligned for every element type.
#[repr(C, align(64))]
struct Line([u8; INLINE]);

/// One-shot all-reduce of at most [`INLINE`] bytes: the input travels in the arrive line,
/// so each peer's input reaches a rank with the one cache-line transfer that tells it the
/// input is there (no slot, no second line). Reduced in rank order like the slot path.
fn all_reduce_inline(
    f: &mut SegmentCall,
    dt: DataType,
    op: RedOp,
    send: Option<&[u8]>,
    recv: &mut [u8],
) -> Result<()> {
    let len = recv.len();
    let k = f.begin()?;
    // Our own input is reduced from a copy, not read back from our arrive line: that line
    // may still be on its way to being ours (the store waits in the store buffer).
    let mut own = Line([0; INLINE]);
    own.0[..len].copy_from_slice(send.unwrap_or(recv));
    f.node.set_inline(k, &own.0[..len]);
    f.node.publish(Counter::Arrive, k);
    f.wait_all(Counter::Arrive, k)?;
    let (mut acc, mut next) = (Line([0; INLINE]), Line([0; INLINE]));
    if f.rank == 0 {
        acc.0[..len].copy_from_slice(&own.0[..len]);
    } else {
        f.node.get_inline(0, k, &mut acc.0[..len]);
    }
    for r in 1..f.nranks {
        let input = if r == f.rank {
            &own.0[..len]
        } else {
            f.node.get_inline(r, k, &mut next.0[..len]);
            &next.0[..len]
        };
        reduce_into(&mut acc.0[..len], input, dt, op)?;
    }
    if op == RedOp::Avg {
        finish_avg(&mut acc.0[..len], dt, f.nranks)?;
    }
    recv.copy_from_slice(&acc.0[..len]);
    Ok(())
}

/// Two-shot all-reduces from this many bytes on copy once (when every rank can read every
/// other): [`all_reduce_direct`]. Below it the ring through the shared-memory network is
/// faster while the ranks' cores share a cache (4 MiB, 2 ranks: 336–368 µs against 468–488)
/// and not much slower when they do not (2076–2110 against 1341–1359, Open MPI 2189–2220);
/// at 16 MiB the ring is 8 % faster in the first case and 2.7× slower in the second.
pub(crate) const DIRECT_REDUCE_MIN: usize = 8 << 20;

/// Bytes `[start, start + len)` of rank `r`'s share of `elems` elements of `esz` bytes.
fn share(elems: usize, n: usize, r: usize, esz: usize) -> (usize, usize) {
    let (q, m) = (elems / n, elems % n);
    let start = r * q + r.min(m);
    (start * esz, (q + usize::from(r < m)) * esz)
}

/// Single-copy two-shot all-reduce. Every rank publishes where its input and its output are;
/// then reduces its share of the elements, in rank order, reading each peer's part of it
/// straight out of the peer's input with process_vm_readv (through its own slot, a piece at a
/// time), into its output; publishes `result`; copies every peer's reduced share straight out
/// of the peer's output; publishes `done` and returns once every peer is done, since until
/// then peers may still read its buffers. Each byte crosses between ranks once per phase and
/// nothing is written into shared slots that another core then reads (see
/// [`all_gather_direct`]).
///
/// In place, a rank overwrites another rank's share of its buffer (its input there) only
/// after that rank published `result`, i.e. finished reading it.
fn all_reduce_direct(
    f: &mut SegmentCall,
    dt: DataType,
    op: RedOp,
    send: Option<&[u8]>,
    recv: &mut [u8],
) -> Result<()> {
    let (n, me, esz) = (f.nranks, f.rank, dt.size());
    let k = f.begin()?;
    f.node.set_direct(k, send.unwrap_or(recv));
    f.node.set_direct_out(k, recv);
    f.node.publish(Counter::Arrive, k);
    // Peers asleep on our arrive must copy while we do, not after.
    f.node.flush_wakes();
    // Every peer has begun this call, so it is done with our slots of the last one: they
    // serve as scratch space.
    f.wait_all(Counter::Arrive, k)?;
    let (mo, ml) = share(recv.len() / esz, n, me, esz);
    let piece = (f.node.slot() / esz).max(1) * esz;
    let mut at = 0;
    while at < ml {
        let len = piece.min(ml - at);
        let (lo, hi) = (mo + at, mo + at + len);
        // In place, our own part is about to be overwritten by rank 0's: keep it.
        let saved = if send.is_none() && me != 0 {
            // SAFETY: a single-copy call: peers read our buffers, never our slots, which
            // serve as scratch; the input area below is a disjoint range.
            let b = unsafe { f.node.own(k, Area::Result, 0, len) };
            b.copy_from_slice(&recv[lo..hi]);
            Some(b)
        } else {
            None
        };
        let dst = &mut recv[lo..hi];
        match (me, send) {
            (0, Some(s)) => dst.copy_from_slice(&s[lo..hi]),
            (0, None) => {}
            _ => f.node.read_direct_at(0, k, false, lo, dst)?,
        }
        for r in 1..n {
            if r == me {
                let own: &[u8] = match (send, &saved) {
                    (Some(s), _) => &s[lo..hi],
                    (None, Some(b)) => b,
                    (None, None) => unreachable!("saved above when in place and not rank 0"),
                };
                reduce_into(dst, own, dt, op)?;
            } else {
                // SAFETY: scratch as above (the result area holds `saved`, disjoint).
                let tmp = unsafe { f.node.own(k, Area::Input, 0, len) };
                f.node.read_direct_at(r, k, false, lo, tmp)?;
                reduce_into(dst, tmp, dt, op)?;
            }
        }
        if op == RedOp::Avg {
            finish_avg(dst, dt, n)?;
        }
        at += len;
    }
    f.node.publish(Counter::Result, k);
    f.node.flush_wakes();
    for i in 1..n {
        let r = (me + i) % n;
        let (o, l) = share(recv.len() / esz, n, r, esz);
        f.node.wait_one(r, Counter::Result, k, f.waiter, f.abort)?;
        f.node.read_direct_at(r, k, true, o, &mut recv[o..o + l])?;
    }
    f.node.publish(Counter::Done, k);
    f.wait_all(Counter::Done, k)
}

/// Broadcasts from this size on copy once, straight from the root's buffer
/// (process_vm_readv), when every rank can read every other.
pub(crate) const DIRECT_BROADCAST_MIN: usize = 256 << 10;

/// Single-copy broadcast, the copying shared between the root and the readers: each reader
/// copies the head of the root's buffer into its own (process_vm_readv) while the root copies
/// the tail into each reader's buffer (process_vm_writev). In place, the root writes 1/n of
/// the buffer to each of the n − 1 readers and each reader reads the other (n − 1)/n, so
/// every core copies (n − 1)/n of it instead of the readers copying all of it while the root
/// waits (2 ranks: 1 MiB 78 → 40 µs, 64 MiB 11.8 → 5.9 ms). Out of place the root also
/// copies its input to its output and takes a smaller share ([`root_share`]). The root
/// publishes the head as its source, so readers learn where the cut is; it publishes `done`
/// when its writes are over (readers return then) and returns once every reader published
/// `result` (done reading its buffer).
fn broadcast_direct(
    f: &mut SegmentCall,
    root: usize,
    send: Option<&[u8]>,
    recv: &mut [u8],
) -> Result<()> {
    let (n, len) = (f.nranks, recv.len());
    let k = f.begin()?;
    if f.rank == root {
        // A multiple of 4 KiB from the start of the buffer: whole pages when the buffer is
        // page-aligned (large allocations are, give or take a malloc header).
        let cut = (len - root_share(len, n, send.is_some())) & !4095;
        let push = |f: &mut SegmentCall, src: &[u8]| -> Result<()> {
            f.node.set_direct(k, &src[..cut]);
            f.node.publish(Counter::Arrive, k);
            // Readers asleep on our arrive must copy while we do, not after.
            f.node.flush_wakes();
            if cut < len {
                for i in 1..n {
                    let r = (root + i) % n;
                    f.wait_one(r, k)?;
                    f.node.write_direct_at(r, k, cut, &src[cut..])?;
                }
            }
            f.node.publish(Counter::Done, k);
            f.node.flush_wakes();
            Ok(())
        };
        match send {
            Some(s) => {
                push(f, s)?;
                copy_large(recv, s);
            }
            None => push(f, recv)?,
        }
        // The buffer must stay as it is until every reader has copied it.
        return f.wait_all(Counter::Result, k);
    }
    f.node.set_direct_out(k, recv);
    f.node.publish(Counter::Arrive, k);
    f.node.flush_wakes();
    let r = (|| {
        f.wait_one(root, k)?;
        let cut = f.node.published_len(root, k).min(len);
        f.node.read_direct_at(root, k, false, 0, &mut recv[..cut])?;
        f.node.publish(Counter::Result, k);
        // Our buffer must stay ours until the root has written its tail.
        f.node.wait_one(root, Counter::Done, k, f.waiter, f.abort)
    })();
    if r.is_err() {
        // Giving up: the root must not write into the buffer once the caller has it back.
        f.node.withdraw_output(root, k, f.waiter);
    }
    r
}

/// Bytes at the end of a `len`-byte broadcast that the root writes into each of the other
/// `n − 1` ranks' buffers (the rest they read): balanced so that the root's copying
/// (`n − 1` writes, and its own input to its output when `out_of_place`) takes as long as
/// each reader's. An in-cache memcpy costs about a third of a process_vm_readv of the same
/// size; past 4 MiB both run at memory speed (2 ranks, 64 MiB out of place: the root
/// writing half made the call 17.4–19.7 ms against 13.3–14.8 writing nothing).
fn root_share(len: usize, n: usize, out_of_place: bool) -> usize {
    // Reader: len − x; root: (n − 1) x + c·len  ⇒  x = (1 − c) len / n.
    let c = match (out_of_place, len <= 4 << 20) {
        (false, _) => 0.0,
        (true, true) => 1.0 / 3.0,
        (true, false) => 1.0,
    };
    ((1.0 - c) * len as f64 / n as f64) as usize
}

/// Broadcast from `root`: the root fills its slot, the others copy it out; or, for large
/// messages, the others copy straight out of the root's buffer (one copy instead of two) and
/// the root waits until they have.
pub(crate) fn broadcast_shm(
    f: &mut SegmentCall,
    root: usize,
    send: Option<&[u8]>,
    recv: &mut [u8],
) -> Result<()> {
    if f.node.cma() && recv.len() >= DIRECT_BROADCAST_MIN {
        return broadcast_direct(f, root, send, recv);
    }
    for (off, len) in SegmentCall::pieces(recv.len(), f.node.slot(), 1) {
        let k = f.begin()?;
        // Up to INLINE bytes travel in the root's arrive line (one cache-line transfer).
        let inline = len <= INLINE;
        if f.rank == root {
            let src = match send {
                Some(s) => &s[off..off + len],
                None => &recv[off..off + len],
            };
            if inline {
                f.node.set_inline(k, src);
            } else {
                // SAFETY: call `k`'s input area is published only below; the slice ends here.
                unsafe { f.node.own(k, Area::Input, 0, len) }.copy_from_slice(src);
            }
            f.node.publish(Counter::Arrive, k);
            if let Some(s) = send {
                recv[off..off + len].copy_from_slice(&s[off..off + len]);
            }
        } else {
            f.node.publish(Counter::Arrive, k);
            f.wait_one(root, k)?;
            let out = &mut recv[off..off + len];
            if inline {
                f.node.get_inline(root, k, out);
            } else {
                out.copy_from_slice(f.node.read(root, k, Area::Input, 0, len));
            }
        }
    }
    Ok(())
}

/// Reduce to `root`: everyone publishes its input, the root reduces all of them.
pub(crate) fn reduce_shm(
    f: &mut SegmentCall,
    root: usize,
    dt: DataType,
    op: RedOp,
    send: Option<&[u8]>,
    recv: &mut [u8],
) -> Result<()> {
    let total = send.map_or(recv.len(), |s| s.len());
    for (off, len) in SegmentCall::pieces(total, f.node.slot(), dt.size()) {
        let k = f.begin()?;
        let src = match send {
            Some(s) => &s[off..off + len],
            None => &recv[off..off + len],
        };
        // SAFETY: call `k`'s input area is published only below; the slice ends here.
        unsafe { f.node.own(k, Area::Input, 0, len) }.copy_from_slice(src);
        f.node.publish(Counter::Arrive, k);
        if f.rank == root {
            f.wait_all(Counter::Arrive, k)?;
            f.reduce_inputs(k, 0, None, &mut recv[off..off + len], dt, op)?;
        }
    }
    Ok(())
}

/// All-gather of blocks of `block` bytes (in place: our block is block `rank` of `recv`).
pub(crate) fn all_gather_shm(
    f: &mut SegmentCall,
    send: Option<&[u8]>,
    recv: &mut [u8],
    block: usize,
) -> Result<()> {
    let me = f.rank;
    if f.node.cma() && block >= DIRECT_GATHER_MIN {
        return all_gather_direct(f, send, recv, block);
    }
    for (off, len) in SegmentCall::pieces(block, f.node.slot(), 1) {
        let k = f.begin()?;
        let src = match send {
            Some(s) => &s[off..off + len],
            None => &recv[me * block + off..me * block + off + len],
        };
        // SAFETY: call `k`'s input area is published only below; the slice ends here.
        unsafe { f.node.own(k, Area::Input, 0, len) }.copy_from_slice(src);
        f.node.publish(Counter::Arrive, k);
        f.wait_all(Counter::Arrive, k)?;
        for r in 0..f.nranks {
            if r == me && send.is_none() {
                continue;
            }
            let at = r * block + off;
            recv[at..at + len].copy_from_slice(f.node.read(r, k, Area::Input, 0, len));
        }
    }
    Ok(())
}

/// All-gathers from this many bytes per rank on copy once, each rank straight out of the
/// others' buffers (process_vm_readv), when every rank can read every other.
pub(crate) const DIRECT_GATHER_MIN: usize = 128 << 10;

/// Single-copy all-gather: every rank publishes where its block is, copies each peer's block
/// out of the peer's memory, and keeps its own buffer as it is until every peer has copied
/// it. One copy per byte and no shared slot whose cache lines travel between the cores twice
/// per call (written by one, read by the other, written again): when the ranks' cores do not
/// share a cache, copying through slots is several times slower (docs/PERFORMANCE-LOG.md).
fn all_gather_direct(
    f: &mut SegmentCall,
    send: Option<&[u8]>,
    recv: &mut [u8],
    block: usize,
) -> Result<()> {
    let (n, me) = (f.nranks, f.rank);
    let k = f.begin()?;
    let mine = me * block..(me + 1) * block;
    f.node.set_direct(k, send.unwrap_or(&recv[mine.clone()]));
    f.node.publish(Counter::Arrive, k);
    // Peers asleep on our arrive must copy while we do, not after.
    f.node.flush_wakes();
    // Peers in a different order on each rank, so that no rank's memory is read by all at once.
    for i in 1..n {
        let r = (me + i) % n;
        f.wait_one(r, k)?;
        f.node
            .read_direct(r, k, &mut recv[r * block..(r + 1) * block])?;
    }
    if let Some(s) = send {
        copy_large(&mut recv[mine], s);
    }
    // Our block must stay as it is until every peer has copied it.
    f.node.publish(Counter::Result, k);
    f.wait_all(Counter::Result, k)
}

/// Reduce-scatter into blocks of `block` bytes (in place: the result is block `rank` of
/// `recv`, which holds every rank's input).
pub(crate) fn reduce_scatter_shm(
    f: &mut SegmentCall,
    dt: DataType,
    op: RedOp,
    send: Option<&[u8]>,
    recv: &mut [u8],
    block: usize,
) -> Result<()> {
    let (n, me) = (f.nranks, f.rank);
    for (off, len) in SegmentCall::pieces(block, f.node.slot() / n, dt.size()) {
        let k = f.publish_blocks(send.unwrap_or(recv), block, off, len)?;
        let at = if send.is_some() {
            off
        } else {
            me * block + off
        };
        f.reduce_inputs(k, me * len, None, &mut recv[at..at + len], dt, op)?;
    }
    Ok(())
}

/// All-to-all of blocks of `block` bytes.
pub(crate) fn all_to_all_shm(
    f: &mut SegmentCall,
    send: Option<&[u8]>,
    recv: &mut [u8],
    block: usize,
) -> Result<()> {
    let (n, me) = (f.nranks, f.rank);
    for (off, len) in SegmentCall::pieces(block, f.node.slot() / n, 1) {
        let k = f.publish_blocks(send.unwrap_or(recv), block, off, len)?;
        for r in 0..n {
            let at = r * block + off;
            recv[at..at + len].copy_from_slice(f.node.read(r, k, Area::Input, me * len, len));
        }
    }
    Ok(())
}

/// Barrier: one flat call with no data.
pub(crate) fn barrier_shm(f: &mut SegmentCall) -> Result<()> {
    let k = f.begin()?;
    f.node.publish(Counter::Arrive, k);
    f.wait_all(Counter::Arrive, k)
}
