//! Ring algorithms: all-reduce (reduce-scatter then all-gather), all-gather,
//! reduce-scatter, and the chain versions of broadcast and reduce.
//!
//! Data is cut in `n` chunks (one per rank), each chunk in slices of `Pipeline::slice`
//! bytes; a "unit" is one slice of one step. Units are received and reduced in order, and
//! the send of unit `(t, k)` only waits for unit `(t-1, k)`, so up to `depth` slices of
//! consecutive steps are on the wire at once. Several channels split the buffer and run as
//! independent rings over separate connections.

use super::{
    drive, drive_all, machines, nslices, part, slice_of, InOrder, Machine, Pipeline, Slots,
};
use crate::error::Result;
use crate::exec::{Buf, Exec, Reg};
use crate::types::{DataType, RedOp};

fn md(a: isize, n: usize) -> usize {
    a.rem_euclid(n as isize) as usize
}

/// Shared geometry of one ring channel over elements `[base, base+cnt)`.
struct Geo {
    n: usize,
    r: usize,
    ch: usize,
    esz: usize,
    base: usize,
    cnt: usize,
    /// Elements per slice.
    s: usize,
    /// Slices per chunk.
    k: usize,
}

impl Geo {
    fn new(
        exec: &Exec,
        ch: usize,
        base: usize,
        cnt: usize,
        chunk_max: usize,
        dt: DataType,
        pipeline: &Pipeline,
    ) -> Geo {
        let esz = dt.size();
        let s = (pipeline.slice / esz).max(1);
        Geo {
            n: exec.nranks(),
            r: exec.rank(),
            ch,
            esz,
            base,
            cnt,
            s,
            k: nslices(chunk_max, s),
        }
    }
    fn prev(&self) -> usize {
        (self.r + self.n - 1) % self.n
    }
    fn next(&self) -> usize {
        (self.r + 1) % self.n
    }
    /// Region of slice `k` of chunk `c` (chunks cut from this channel's range) in `buf`.
    fn reg(&self, buf: Buf, c: usize, k: usize) -> Reg {
        let (cs, cl) = part(self.cnt, self.n, c);
        let (a, l) = slice_of(cl, self.s, k);
        Reg::new(buf, (self.base + cs + a) * self.esz, l * self.esz)
    }
}

/// Split `count` elements over `channels` rings, keeping each channel's range whole.
fn channel_ranges(
    count: usize,
    pipeline: &Pipeline,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let chans = pipeline.channels.clamp(1, count.max(1));
    (0..chans).map(move |c| {
        let (b, l) = part(count, chans, c);
        (c, b, l)
    })
}

struct RingAllReduce {
    geo: Geo,
    dt: DataType,
    op: RedOp,
    depth: usize,
    units: usize,
    next_send: usize,
    send_done: usize,
    next_recv: usize,
    done_recv: usize,
    sends: InOrder<()>,
    recvs: InOrder<usize>,
    slots: Slots,
}

impl RingAllReduce {
    /// (send chunk, recv chunk) of step t.
    fn chunks(&self, t: usize) -> (usize, usize) {
        let (n, r) = (self.geo.n as isize, self.geo.r as isize);
        let t = t as isize;
        if t < n - 1 {
            (md(r - t, self.geo.n), md(r - t - 1, self.geo.n))
        } else {
            let t = t - (n - 1);
            (md(r + 1 - t, self.geo.n), md(r - t, self.geo.n))
        }
    }
}

impl Machine for RingAllReduce {
    fn advance(&mut self, exec: &mut Exec) -> Result<bool> {
        let mut moved = false;
        let rs_steps = self.geo.n - 1;
        while let Some(slot) = self.recvs.pop_done(exec) {
            let u = self.done_recv;
            let (t, k) = (u / self.geo.k, u % self.geo.k);
            if t < rs_steps {
                let (_, rc) = self.chunks(t);
                let d = self.geo.reg(Buf::Dst, rc, k);
                exec.reduce(
                    d,
                    self.geo.reg(Buf::Src, rc, k),
                    self.slots.reg(slot, d.len),
                    self.dt,
                    self.op,
                )?;
                self.slots.put(slot);
                if t == rs_steps - 1 && self.op == RedOp::Avg {
                    exec.finish_avg(d, self.dt, self.geo.n)?;
                }
            }
            self.done_recv += 1;
            moved = true;
        }
        while self.sends.pop_done(exec).is_some() {
            self.send_done += 1;
            moved = true;
        }
        while self.next_recv < self.units && self.next_recv - self.done_recv < self.depth {
            let u = self.next_recv;
            let (t, k) = (u / self.geo.k, u % self.geo.k);
            let (_, rc) = self.chunks(t);
            let d = self.geo.reg(Buf::Dst, rc, k);
            let (reg, slot) = if t < rs_steps {
                let Some(slot) = self.slots.get() else { break };
                (self.slots.reg(slot, d.len), slot)
            } else {
                // The reduce-scatter step t-(n-1) sends this very region: receive into it
                // only once that send has completed.
                if self.send_done <= u - rs_steps * self.geo.k {
                    break;
                }
                (d, usize::MAX)
            };
            let tok = exec.recv(self.geo.prev(), self.geo.ch, reg)?;
            self.recvs.push(tok, slot)?;
            self.next_recv += 1;
            moved = true;
        }
        while self.next_send < self.units
            && self.next_send - self.send_done < self.depth
            && (self.next_send < self.geo.k || self.done_recv > self.next_send - self.geo.k)
        {
            let u = self.next_send;
            let (t, k) = (u / self.geo.k, u % self.geo.k);
            let (sc, _) = self.chunks(t);
            let reg = self
                .geo
                .reg(if t == 0 { Buf::Src } else { Buf::Dst }, sc, k);
            let tok = exec.send(self.geo.next(), self.geo.ch, reg)?;
            self.sends.push(tok, ())?;
            self.next_send += 1;
            moved = true;
        }
        Ok(moved)
    }

    fn done(&self) -> bool {
        self.done_recv == self.units && self.send_done == self.units
    }
}

/// Staging bytes the ring all-reduce needs.
pub(crate) fn all_reduce_ring_stage(pipeline: &Pipeline) -> usize {
    pipeline.channels * pipeline.depth * pipeline.slice
}

/// Ring all-reduce: reduce-scatter then all-gather, `2(n-1)` steps of `bytes/n`.
pub(crate) fn all_reduce_ring(
    exec: &mut Exec,
    dt: DataType,
    op: RedOp,
    count: usize,
    pipeline: &Pipeline,
) -> Result<()> {
    all_reduce_ring_half(exec, dt, op, count, pipeline, Half::Both)
}

/// Which steps of a ring all-reduce to run.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Half {
    /// Every step.
    Both,
    /// The reduce-scatter steps only: afterwards the group's rank `r` holds, in its output,
    /// the reduced chunk [`ring_owned`] of each channel's range, and nothing else is final.
    ReduceScatter,
    /// The all-gather steps only, from outputs that each hold their reduced chunk.
    AllGather,
}

/// The element range `(start, len)` of `count` whose reduction the group's rank `r` of `n`
/// holds after [`Half::ReduceScatter`] on one channel.
pub(crate) fn ring_owned(count: usize, n: usize, r: usize) -> (usize, usize) {
    part(count, n, (r + 1) % n)
}

/// The steps `half` of a ring all-reduce (see [`Half`]).
pub(crate) fn all_reduce_ring_half(
    exec: &mut Exec,
    dt: DataType,
    op: RedOp,
    count: usize,
    pipeline: &Pipeline,
    half: Half,
) -> Result<()> {
    let n = exec.nranks();
    if n == 1 {
        return match half {
            Half::AllGather => Ok(()),
            _ => exec.copy_input(count * dt.size()),
        };
    }
    let mut ms = machines(channel_ranges(count, pipeline).map(|(c, base, cnt)| {
        let geo = Geo::new(exec, c, base, cnt, cnt.div_ceil(n), dt, pipeline);
        let half_units = (n - 1) * geo.k;
        // The all-gather half starts as if the reduce-scatter half had just completed.
        let (first, units) = match half {
            Half::Both => (0, 2 * half_units),
            Half::ReduceScatter => (0, half_units),
            Half::AllGather => (half_units, 2 * half_units),
        };
        let slot = geo.s * geo.esz;
        RingAllReduce {
            geo,
            dt,
            op,
            depth: pipeline.depth,
            units,
            next_send: first,
            send_done: first,
            next_recv: first,
            done_recv: first,
            sends: InOrder::new(),
            recvs: InOrder::new(),
            slots: Slots::new(c * pipeline.depth * pipeline.slice, slot, pipeline.depth),
        }
    }))?;
    exec.ensure(
        ms.iter().map(|m| (m.geo.next(), m.geo.ch)),
        ms.iter().map(|m| (m.geo.prev(), m.geo.ch)),
    )?;
    drive_all(exec, &mut ms)
}

/// Ring all-gather over one channel range: `n-1` steps, each forwarding the slice received
/// in the previous step straight out of the output buffer.
struct RingAllGather {
    geo: Geo,
    depth: usize,
    units: usize,
    next_send: usize,
    send_done: usize,
    next_recv: usize,
    done_recv: usize,
    sends: InOrder<()>,
    recvs: InOrder<()>,
    /// Elements per rank (the input count).
    per: usize,
}

impl RingAllGather {
    fn reg(&self, c: usize, k: usize) -> Reg {
        // Chunk c of the output is rank c's input; the channel covers [base, base+cnt) of it.
        let (a, l) = slice_of(self.geo.cnt, self.geo.s, k);
        Reg::new(
            Buf::Dst,
            (c * self.per + self.geo.base + a) * self.geo.esz,
            l * self.geo.esz,
        )
    }
}

impl Machine for RingAllGather {
    fn advance(&mut self, exec: &mut Exec) -> Result<bool> {
        let mut moved = false;
        let (n, r) = (self.geo.n, self.geo.r as isize);
        while self.recvs.pop_done(exec).is_some() {
            self.done_recv += 1;
            moved = true;
        }
        while self.sends.pop_done(exec).is_some() {
            self.send_done += 1;
            moved = true;
        }
        while self.next_recv < self.units && self.next_recv - self.done_recv < self.depth {
            let (t, k) = (self.next_recv / self.geo.k, self.next_recv % self.geo.k);
            let rc = exec.member(md(r - t as isize - 1, n));
            let tok = exec.recv(self.geo.prev(), self.geo.ch, self.reg(rc, k))?;
            self.recvs.push(tok, ())?;
            self.next_recv += 1;
            moved = true;
        }
        while self.next_send < self.units
            && self.next_send - self.send_done < self.depth
            && (self.next_send < self.geo.k || self.done_recv > self.next_send - self.geo.k)
        {
            let (t, k) = (self.next_send / self.geo.k, self.next_send % self.geo.k);
            let sc = exec.member(md(r - t as isize, n));
            let tok = exec.send(self.geo.next(), self.geo.ch, self.reg(sc, k))?;
            self.sends.push(tok, ())?;
            self.next_send += 1;
            moved = true;
        }
        Ok(moved)
    }

    fn done(&self) -> bool {
        self.done_recv == self.units && self.send_done == self.units
    }
}

/// Ring all-gather of `count` elements per rank into `n * count` elements.
pub(crate) fn all_gather_ring(
    exec: &mut Exec,
    dt: DataType,
    count: usize,
    pipeline: &Pipeline,
) -> Result<()> {
    let (n, r, esz) = (exec.nranks(), exec.rank(), dt.size());
    // Blocks lie in global rank order, whatever order the ring takes.
    let own = Reg::new(Buf::Dst, exec.member(r) * count * esz, count * esz);
    let input = if exec.in_place() {
        own
    } else {
        Reg::new(Buf::Src, 0, count * esz)
    };
    exec.copy(own, input)?;
    if n == 1 {
        return Ok(());
    }
    let mut ms = machines(channel_ranges(count, pipeline).map(|(c, base, cnt)| {
        // Slices cut the channel's share of each rank's block.
        let mut geo = Geo::new(exec, c, base, cnt, cnt, dt, pipeline);
        geo.k = nslices(cnt, geo.s);
        let units = (n - 1) * geo.k;
        RingAllGather {
            geo,
            depth: pipeline.depth,
            units,
            next_send: 0,
            send_done: 0,
            next_recv: 0,
            done_recv: 0,
            sends: InOrder::new(),
            recvs: InOrder::new(),
            per: count,
        }
    }))?;
    exec.ensure(
        ms.iter().map(|m| (m.geo.next(), m.geo.ch)),
        ms.iter().map(|m| (m.geo.prev(), m.geo.ch)),
    )?;
    drive_all(exec, &mut ms)
}

/// Ring reduce-scatter over one channel range. Partial sums of step `t` live in one of two
/// chunk-sized staging halves (`t % 2`), so a partial is never overwritten before the next
/// step has sent it, and the final step reduces straight into the output.
struct RingReduceScatter {
    geo: Geo,
    dt: DataType,
    op: RedOp,
    depth: usize,
    units: usize,
    next_send: usize,
    send_done: usize,
    next_recv: usize,
    done_recv: usize,
    sends: InOrder<()>,
    recvs: InOrder<usize>,
    slots: Slots,
    per: usize,
    /// Stage offset of the two partial halves, each `cnt` elements.
    pbase: usize,
    in_place: bool,
    /// This rank's block of the input (its global rank).
    me_block: usize,
}

impl RingReduceScatter {
    fn src(&self, c: usize, k: usize) -> Reg {
        let (a, l) = slice_of(self.geo.cnt, self.geo.s, k);
        Reg::new(
            Buf::Src,
            (c * self.per + self.geo.base + a) * self.geo.esz,
            l * self.geo.esz,
        )
    }
    fn partial(&self, t: usize, k: usize) -> Reg {
        let (a, l) = slice_of(self.geo.cnt, self.geo.s, k);
        Reg::new(
            Buf::Stage,
            self.pbase + ((t % 2) * self.geo.cnt + a) * self.geo.esz,
            l * self.geo.esz,
        )
    }
    fn out(&self, k: usize) -> Reg {
        let (a, l) = slice_of(self.geo.cnt, self.geo.s, k);
        // In place, the output is this rank's block of the input buffer.
        let off = if self.in_place {
            self.me_block * self.per
        } else {
            0
        };
        Reg::new(
            Buf::Dst,
            (off + self.geo.base + a) * self.geo.esz,
            l * self.geo.esz,
        )
    }
    fn chunks(&self, t: usize) -> (usize, usize) {
        let (n, r) = (self.geo.n, self.geo.r as isize);
        (md(r - t as isize - 1, n), md(r - t as isize - 2, n))
    }
}

impl Machine for RingReduceScatter {
    fn advance(&mut self, exec: &mut Exec) -> Result<bool> {
        let mut moved = false;
        let last = self.geo.n - 2;
        while self.done_recv < self.next_recv {
            let u = self.done_recv;
            let (t, k) = (u / self.geo.k, u % self.geo.k);
            let (_, rc) = self.chunks(t);
            let dest = if t == last {
                self.out(k)
            } else {
                self.partial(t, k)
            };
            // The partial of step t-2 in the same half is sent by unit u-K: wait for it.
            if t != last && t >= 2 && self.send_done <= u - self.geo.k {
                break;
            }
            let Some(slot) = self.recvs.pop_done(exec) else {
                break;
            };
            exec.reduce(
                dest,
                self.src(exec.member(rc), k),
                self.slots.reg(slot, dest.len),
                self.dt,
                self.op,
            )?;
            self.slots.put(slot);
            if t == last && self.op == RedOp::Avg {
                exec.finish_avg(dest, self.dt, self.geo.n)?;
            }
            self.done_recv += 1;
            moved = true;
        }
        while self.sends.pop_done(exec).is_some() {
            self.send_done += 1;
            moved = true;
        }
        while self.next_recv < self.units && self.next_recv - self.done_recv < self.depth {
            let (_, k) = (self.next_recv / self.geo.k, self.next_recv % self.geo.k);
            let Some(slot) = self.slots.get() else { break };
            let len = slice_of(self.geo.cnt, self.geo.s, k).1 * self.geo.esz;
            let tok = exec.recv(self.geo.prev(), self.geo.ch, self.slots.reg(slot, len))?;
            self.recvs.push(tok, slot)?;
            self.next_recv += 1;
            moved = true;
        }
        while self.next_send < self.units
            && self.next_send - self.send_done < self.depth
            && (self.next_send < self.geo.k || self.done_recv > self.next_send - self.geo.k)
        {
            let (t, k) = (self.next_send / self.geo.k, self.next_send % self.geo.k);
            let (sc, _) = self.chunks(t);
            let reg = if t == 0 {
                self.src(exec.member(sc), k)
            } else {
                self.partial(t - 1, k)
            };
            let tok = exec.send(self.geo.next(), self.geo.ch, reg)?;
            self.sends.push(tok, ())?;
            self.next_send += 1;
            moved = true;
        }
        Ok(moved)
    }

    fn done(&self) -> bool {
        self.done_recv == self.units && self.send_done == self.units
    }
}

impl RingReduceScatter {
    #[allow(clippy::too_many_arguments)]
    fn build(
        exec: &Exec,
        c: usize,
        base: usize,
        cnt: usize,
        count: usize,
        dt: DataType,
        op: RedOp,
        pipeline: &Pipeline,
        sbase: usize,
    ) -> Self {
        let mut geo = Geo::new(exec, c, base, cnt, cnt, dt, pipeline);
        geo.k = nslices(cnt, geo.s);
        let units = (geo.n - 1) * geo.k;
        let slot = geo.s * geo.esz;
        let slots_bytes = pipeline.depth * slot;
        RingReduceScatter {
            slots: Slots::new(sbase, slot, pipeline.depth),
            pbase: sbase + slots_bytes,
            geo,
            dt,
            op,
            depth: pipeline.depth,
            units,
            next_send: 0,
            send_done: 0,
            next_recv: 0,
            done_recv: 0,
            sends: InOrder::new(),
            recvs: InOrder::new(),
            per: count,
            in_place: exec.in_place(),
            me_block: exec.member(exec.rank()),
        }
    }
}

/// Staging bytes of the ring reduce-scatter for `count` elements per rank.
pub(crate) fn reduce_scatter_ring_stage(count: usize, dt: DataType, pipeline: &Pipeline) -> usize {
    let chans = pipeline.channels.clamp(1, count.max(1));
    let per = count.div_ceil(chans) * dt.size();
    chans * (pipeline.depth * pipeline.slice.next_multiple_of(dt.size()) + 2 * per)
}

/// Ring reduce-scatter: `n * count` elements in, `count` out (in place: this rank's block).
pub(crate) fn reduce_scatter_ring(
    exec: &mut Exec,
    dt: DataType,
    op: RedOp,
    count: usize,
    pipeline: &Pipeline,
) -> Result<()> {
    let (n, r, esz) = (exec.nranks(), exec.rank(), dt.size());
    if n == 1 {
        let out = Reg::new(Buf::Dst, 0, count * esz);
        exec.copy(out, Reg::new(Buf::Src, 0, count * esz))?;
        return Ok(());
    }
    let _ = r;
    let chans = pipeline.channels.clamp(1, count.max(1));
    let per = count.div_ceil(chans) * esz;
    let chan_stage = pipeline.depth * pipeline.slice.next_multiple_of(esz) + 2 * per;
    let mut ms = machines(channel_ranges(count, pipeline).map(|(c, base, cnt)| {
        RingReduceScatter::build(exec, c, base, cnt, count, dt, op, pipeline, c * chan_stage)
    }))?;
    exec.ensure(
        ms.iter().map(|m| (m.geo.next(), m.geo.ch)),
        ms.iter().map(|m| (m.geo.prev(), m.geo.ch)),
    )?;
    drive_all(exec, &mut ms)
}

/// Chain from the root around the ring: broadcast (root first) or reduce (root last).
struct Chain {
    n: usize,
    ch: usize,
    prev: Option<usize>,
    next: Option<usize>,
    is_root: bool,
    reduce: Option<(DataType, RedOp)>,
    esz: usize,
    s: usize,
    k: usize,
    count: usize,
    depth: usize,
    next_send: usize,
    send_done: usize,
    next_recv: usize,
    done_recv: usize,
    sends: InOrder<()>,
    recvs: InOrder<usize>,
    slots: Slots,
    /// Stage offset of the reduce partials ring (2*depth slices).
    pbase: usize,
}

impl Chain {
    fn reg(&self, buf: Buf, k: usize) -> Reg {
        let (a, l) = slice_of(self.count, self.s, k);
        Reg::new(buf, a * self.esz, l * self.esz)
    }
    fn partial(&self, k: usize) -> Reg {
        let l = slice_of(self.count, self.s, k).1;
        Reg::new(
            Buf::Stage,
            self.pbase + (k % (2 * self.depth)) * self.s * self.esz,
            l * self.esz,
        )
    }
    /// What this rank sends for slice k.
    fn send_reg(&self, k: usize) -> Reg {
        match (self.reduce, self.prev) {
            (None, None) => self.reg(Buf::Src, k),    // broadcast root
            (None, Some(_)) => self.reg(Buf::Dst, k), // forward what arrived
            (Some(_), None) => self.reg(Buf::Src, k), // chain head: own input
            (Some(_), Some(_)) => self.partial(k),
        }
    }
    /// Slices available to send.
    fn ready(&self) -> usize {
        if self.prev.is_none() {
            self.k
        } else {
            self.done_recv
        }
    }
}

impl Machine for Chain {
    fn advance(&mut self, exec: &mut Exec) -> Result<bool> {
        let mut moved = false;
        while self.done_recv < self.next_recv {
            let k = self.done_recv;
            if let Some((dt, op)) = self.reduce {
                let dest = if self.is_root {
                    self.reg(Buf::Dst, k)
                } else {
                    self.partial(k)
                };
                // The partial slot's previous slice (k - 2*depth) must have been sent.
                if !self.is_root && k >= 2 * self.depth && self.send_done <= k - 2 * self.depth {
                    break;
                }
                let Some(slot) = self.recvs.pop_done(exec) else {
                    break;
                };
                exec.reduce(
                    dest,
                    self.reg(Buf::Src, k),
                    self.slots.reg(slot, dest.len),
                    dt,
                    op,
                )?;
                self.slots.put(slot);
                if self.is_root && op == RedOp::Avg {
                    exec.finish_avg(dest, dt, self.n)?;
                }
            } else if self.recvs.pop_done(exec).is_none() {
                break;
            }
            self.done_recv += 1;
            moved = true;
        }
        while self.sends.pop_done(exec).is_some() {
            self.send_done += 1;
            moved = true;
        }
        if let Some(prev) = self.prev {
            while self.next_recv < self.k && self.next_recv - self.done_recv < self.depth {
                let k = self.next_recv;
                let (reg, slot) = if self.reduce.is_some() {
                    let Some(slot) = self.slots.get() else { break };
                    (
                        self.slots
                            .reg(slot, slice_of(self.count, self.s, k).1 * self.esz),
                        slot,
                    )
                } else {
                    (self.reg(Buf::Dst, k), usize::MAX)
                };
                let tok = exec.recv(prev, self.ch, reg)?;
                self.recvs.push(tok, slot)?;
                self.next_recv += 1;
                moved = true;
            }
        }
        if let Some(next) = self.next {
            while self.next_send < self.ready() && self.next_send - self.send_done < self.depth {
                let tok = exec.send(next, self.ch, self.send_reg(self.next_send))?;
                self.sends.push(tok, ())?;
                self.next_send += 1;
                moved = true;
            }
        }
        Ok(moved)
    }

    fn done(&self) -> bool {
        let recv_ok = self.prev.is_none() || self.done_recv == self.k;
        let send_ok = self.next.is_none() || self.send_done == self.k;
        recv_ok && send_ok
    }
}

/// Staging bytes of a reduce chain.
pub(crate) fn chain_stage(pipeline: &Pipeline) -> usize {
    3 * pipeline.depth * pipeline.slice + 64
}

fn run_chain(
    exec: &mut Exec,
    root: usize,
    count: usize,
    dt: DataType,
    reduce: Option<RedOp>,
    pipeline: &Pipeline,
) -> Result<()> {
    let (n, r, esz) = (exec.nranks(), exec.rank(), dt.size());
    // Broadcast: root, root+1, ..., root-1. Reduce: root+1, ..., root-1, root.
    let pos = if reduce.is_some() {
        (r + n - root - 1) % n
    } else {
        (r + n - root) % n
    };
    let prev = (pos > 0).then(|| (r + n - 1) % n);
    let next = (pos + 1 < n).then(|| (r + 1) % n);
    let s = (pipeline.slice / esz).max(1);
    let depth = pipeline.depth;
    let slot = s * esz;
    let mut m = Chain {
        n,
        ch: 0,
        prev,
        next,
        is_root: r == root,
        reduce: reduce.map(|op| (dt, op)),
        esz,
        s,
        k: nslices(count, s),
        count,
        depth,
        next_send: 0,
        send_done: 0,
        next_recv: 0,
        done_recv: 0,
        sends: InOrder::new(),
        recvs: InOrder::new(),
        slots: Slots::new(0, slot, depth),
        pbase: depth * slot,
    };
    exec.ensure(next.map(|p| (p, 0)), prev.map(|p| (p, 0)))?;
    drive(exec, &mut [&mut m])
}

/// Pipelined chain broadcast from `root`: `n-1` hops, each slice forwarded as it arrives.
pub(crate) fn broadcast_ring(
    exec: &mut Exec,
    root: usize,
    dt: DataType,
    count: usize,
    pipeline: &Pipeline,
) -> Result<()> {
    if exec.rank() == root {
        exec.copy_input(count * dt.size())?;
    }
    if exec.nranks() == 1 {
        return Ok(());
    }
    run_chain(exec, root, count, dt, None, pipeline)
}

/// Pipelined chain reduce to `root`: partial sums travel `root+1 → … → root`.
pub(crate) fn reduce_ring(
    exec: &mut Exec,
    root: usize,
    dt: DataType,
    op: RedOp,
    count: usize,
    pipeline: &Pipeline,
) -> Result<()> {
    if exec.nranks() == 1 {
        return exec.copy_input(count * dt.size());
    }
    run_chain(exec, root, count, dt, Some(op), pipeline)
}
