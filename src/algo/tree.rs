//! Binary-tree algorithms: the double binary tree all-reduce, and pipelined tree
//! broadcast and reduce from any root.
//!
//! The tree over labels `0..n` is built from the lowest set bit of each label: label 0 is
//! the root with the single child `2^⌈log2 n⌉ / 2`; label `x` with lowest set bit `b` has
//! parent `(x ^ b) | 2b` (or `x ^ b` when that is out of range) and children `x ± b/2`
//! (the right one shrunk into range). With `n` even, the second tree mirrors the labels
//! (`n-1-r`), with `n` odd it shifts them by one, so that (nearly) every rank is a leaf in
//! one tree and an inner node in the other and the two halves of the data load every link
//! evenly. Slices are reduced up and broadcast down in a pipeline.

use super::{
    drive_all, machines, nslices, part, slice_of, Fifo, InOrder, Machine, Pipeline, Slots,
};
use crate::error::{Error, Result};
use crate::exec::{Buf, Exec, Reg};
use crate::types::{DataType, RedOp};

/// Messages from this size use both trees of the double tree; smaller ones use one.
pub(crate) const TWO_TREES_FROM: usize = 256 * 1024;

/// Children of a node in a binary tree.
pub(crate) type Kids = arrayvec::ArrayVec<usize, 2>;

/// Parent and children of `label` in the binary tree over `0..n`.
pub(crate) fn btree(n: usize, label: usize) -> (Option<usize>, Kids) {
    if label == 0 {
        let mut bit = 1;
        while bit < n {
            bit <<= 1;
        }
        let mut kids = Kids::new();
        if n > 1 {
            kids.push(bit >> 1);
        }
        return (None, kids);
    }
    let bit = 1usize << label.trailing_zeros();
    let mut up = (label ^ bit) | (bit << 1);
    if up >= n {
        up = label ^ bit;
    }
    let mut kids = Kids::new();
    let mut low = bit >> 1;
    if low > 0 {
        kids.push(label - low);
        while low > 0 && label + low >= n {
            low >>= 1;
        }
        if low > 0 {
            kids.push(label + low);
        }
    }
    (Some(up), kids)
}

/// Parent and children of `rank` in a tree whose labels are `to_label(rank)`.
fn mapped(
    n: usize,
    rank: usize,
    to_label: impl Fn(usize) -> usize,
    from_label: impl Fn(usize) -> usize,
) -> (Option<usize>, Kids) {
    let (p, k) = btree(n, to_label(rank));
    (p.map(&from_label), k.into_iter().map(&from_label).collect())
}

/// The two trees of the double binary tree, as (parent, children) of `rank`.
pub(crate) fn double_tree(n: usize, rank: usize) -> [(Option<usize>, Kids); 2] {
    let a = btree(n, rank);
    let b = if n % 2 == 0 {
        mapped(n, rank, |r| n - 1 - r, |l| n - 1 - l)
    } else {
        mapped(n, rank, |r| (r + 1) % n, |l| (l + n - 1) % n)
    };
    [a, b]
}

/// One tree over elements `[base, base+cnt)`.
struct TreeM {
    ch: usize,
    n: usize,
    parent: Option<usize>,
    kids: Kids,
    up: bool,
    down: bool,
    dt: DataType,
    op: RedOp,
    base: usize,
    cnt: usize,
    s: usize,
    k: usize,
    esz: usize,
    depth: usize,
    /// Reduce-only inner nodes keep partials in a staging ring, not in the output.
    partial_in_stage: bool,
    cslots: Slots,
    pbase: usize,
    // up phase
    crecv_posted: [usize; 2],
    crecvs: [InOrder<usize>; 2],
    arrived: [Fifo<usize>; 2],
    reduced: usize,
    usend_posted: usize,
    usend_done: usize,
    usends: InOrder<()>,
    // down phase
    drecv_posted: usize,
    drecv_done: usize,
    drecvs: InOrder<()>,
    dsend_posted: [usize; 2],
    dsend_done: [usize; 2],
    dsends: [InOrder<()>; 2],
}

impl TreeM {
    fn reg(&self, buf: Buf, k: usize) -> Reg {
        let (a, l) = slice_of(self.cnt, self.s, k);
        Reg::new(buf, (self.base + a) * self.esz, l * self.esz)
    }
    fn len(&self, k: usize) -> usize {
        slice_of(self.cnt, self.s, k).1 * self.esz
    }
    /// Where slice k's reduction accumulates.
    fn acc(&self, k: usize) -> Reg {
        if self.partial_in_stage {
            Reg::new(
                Buf::Stage,
                self.pbase + (k % (2 * self.depth)) * self.s * self.esz,
                self.len(k),
            )
        } else {
            self.reg(Buf::Dst, k)
        }
    }
    /// What goes up to the parent for slice k.
    fn up_reg(&self, k: usize) -> Reg {
        if self.kids.is_empty() {
            self.reg(Buf::Src, k)
        } else {
            self.acc(k)
        }
    }
    /// Slices whose final value this rank holds (in Dst) and may pass down.
    fn down_avail(&self) -> usize {
        match (self.parent, self.up) {
            (None, true) => self.reduced,
            (None, false) => self.k,
            (Some(_), _) => self.drecv_done,
        }
    }
}

impl TreeM {
    /// The way up: take the children's slices, combine them, pass partial results to the
    /// parent. Whether anything moved.
    fn advance_up(&mut self, exec: &mut Exec) -> Result<bool> {
        let mut moved = false;
        let nk = self.kids.len();
        for c in 0..nk {
            while let Some(slot) = self.crecvs[c].pop_done(exec) {
                self.arrived[c].push(slot)?;
                moved = true;
            }
        }
        moved |= self.combine(exec)?;
        if nk == 0 && self.reduced < self.k {
            self.reduced = self.k;
        }
        // Post child receives.
        for c in 0..nk {
            while self.crecv_posted[c] < self.k
                && self.crecv_posted[c] - self.reduced < self.depth
                && self.cslots.available() > 0
            {
                let slot = self.cslots.get().expect("checked");
                let k = self.crecv_posted[c];
                let tok = exec.recv(self.kids[c], self.ch, self.cslots.reg(slot, self.len(k)))?;
                self.crecvs[c].push(tok, slot)?;
                self.crecv_posted[c] += 1;
                moved = true;
            }
        }
        if let Some(p) = self.parent {
            while self.usends.pop_done(exec).is_some() {
                self.usend_done += 1;
                moved = true;
            }
            while self.usend_posted < self.reduced
                && self.usend_posted - self.usend_done < self.depth
            {
                let tok = exec.send(p, self.ch, self.up_reg(self.usend_posted))?;
                self.usends.push(tok, ())?;
                self.usend_posted += 1;
                moved = true;
            }
        }
        Ok(moved)
    }

    /// Combine slices in order once every child's piece is here: own input first, then
    /// children in order, so results do not depend on timing. Whether any was.
    fn combine(&mut self, exec: &mut Exec) -> Result<bool> {
        let mut moved = false;
        let nk = self.kids.len();
        while self.reduced < self.k && (0..nk).all(|c| !self.arrived[c].is_empty()) {
            let k = self.reduced;
            let acc = self.acc(k);
            if nk > 0 {
                // A staged partial slot is reused every 2*depth slices: its previous
                // slice must have gone up first.
                if self.partial_in_stage
                    && k >= 2 * self.depth
                    && self.usend_done <= k - 2 * self.depth
                {
                    break;
                }
                let Some(s0) = self.arrived[0].pop() else {
                    break;
                };
                exec.reduce(
                    acc,
                    self.reg(Buf::Src, k),
                    self.cslots.reg(s0, acc.len),
                    self.dt,
                    self.op,
                )?;
                self.cslots.put(s0);
                if nk > 1 {
                    let Some(s1) = self.arrived[1].pop() else {
                        return Err(Error::Internal(
                            "tree: second child's slice vanished".into(),
                        ));
                    };
                    exec.reduce(acc, acc, self.cslots.reg(s1, acc.len), self.dt, self.op)?;
                    self.cslots.put(s1);
                }
            }
            if self.parent.is_none() && self.op == RedOp::Avg {
                exec.finish_avg(acc, self.dt, self.n)?;
            }
            self.reduced += 1;
            moved = true;
        }
        Ok(moved)
    }

    /// The way down: take the final slices from the parent, pass them to the children.
    /// Whether anything moved.
    fn advance_down(&mut self, exec: &mut Exec) -> Result<bool> {
        let mut moved = false;
        let nk = self.kids.len();
        if let Some(p) = self.parent {
            while self.drecvs.pop_done(exec).is_some() {
                self.drecv_done += 1;
                moved = true;
            }
            while self.drecv_posted < self.k && self.drecv_posted - self.drecv_done < self.depth {
                let r = self.reg(Buf::Dst, self.drecv_posted);
                if self.up && self.usend_done <= self.drecv_posted {
                    break; // this slice still has to go up (from this very memory)
                }
                let tok = exec.recv(p, self.ch, r)?;
                self.drecvs.push(tok, ())?;
                self.drecv_posted += 1;
                moved = true;
            }
        }
        let avail = self.down_avail();
        for c in 0..nk {
            while self.dsends[c].pop_done(exec).is_some() {
                self.dsend_done[c] += 1;
                moved = true;
            }
            while self.dsend_posted[c] < avail
                && self.dsend_posted[c] - self.dsend_done[c] < self.depth
            {
                let tok = exec.send(
                    self.kids[c],
                    self.ch,
                    self.reg(Buf::Dst, self.dsend_posted[c]),
                )?;
                self.dsends[c].push(tok, ())?;
                self.dsend_posted[c] += 1;
                moved = true;
            }
        }
        Ok(moved)
    }
}

impl Machine for TreeM {
    fn advance(&mut self, exec: &mut Exec) -> Result<bool> {
        let mut moved = false;
        if self.up {
            moved |= self.advance_up(exec)?;
        }
        if self.down {
            moved |= self.advance_down(exec)?;
        }
        Ok(moved)
    }

    fn done(&self) -> bool {
        let nk = self.kids.len();
        let up_ok = !self.up
            || (self.reduced == self.k && (self.parent.is_none() || self.usend_done == self.k));
        let down_ok = !self.down
            || ((self.parent.is_none() || self.drecv_done == self.k)
                && (0..nk).all(|c| self.dsend_done[c] == self.k));
        up_ok && down_ok
    }
}

#[allow(clippy::too_many_arguments)]
fn tree_machine(
    ch: usize,
    n: usize,
    (parent, kids): (Option<usize>, Kids),
    up: bool,
    down: bool,
    dt: DataType,
    op: RedOp,
    base: usize,
    cnt: usize,
    pipeline: &Pipeline,
    sbase: usize,
) -> TreeM {
    let esz = dt.size();
    let s = (pipeline.slice / esz).max(1);
    let slot = s * esz;
    let partial_in_stage = up && !down && parent.is_some() && !kids.is_empty();
    TreeM {
        ch,
        n,
        parent,
        kids,
        up,
        down,
        dt,
        op,
        base,
        cnt,
        s,
        k: nslices(cnt, s),
        esz,
        depth: pipeline.depth,
        partial_in_stage,
        cslots: Slots::new(sbase, slot, 2 * pipeline.depth),
        pbase: sbase + 2 * pipeline.depth * slot,
        crecv_posted: [0; 2],
        crecvs: [InOrder::new(), InOrder::new()],
        arrived: [Fifo::new(), Fifo::new()],
        reduced: 0,
        usend_posted: 0,
        usend_done: 0,
        usends: InOrder::new(),
        drecv_posted: 0,
        drecv_done: 0,
        drecvs: InOrder::new(),
        dsend_posted: [0; 2],
        dsend_done: [0; 2],
        dsends: [InOrder::new(), InOrder::new()],
    }
}

/// Staging bytes of one tree.
pub(crate) fn tree_stage(pipeline: &Pipeline) -> usize {
    4 * pipeline.depth * pipeline.slice + 64
}

fn run(exec: &mut Exec, ms: &mut [TreeM]) -> Result<()> {
    // Up: send to the parent, receive from the children; down: the reverse.
    let links = |to_parent: bool| {
        ms.iter().flat_map(move |m| {
            let parent = m.parent.filter(|_| if to_parent { m.up } else { m.down });
            let kids = if to_parent { m.down } else { m.up };
            parent
                .into_iter()
                .chain(m.kids.iter().copied().filter(move |_| kids))
                .map(move |p| (p, m.ch))
        })
    };
    exec.ensure(links(true), links(false))?;
    drive_all(exec, ms)
}

/// Double binary tree all-reduce: each half of the data is reduced up one tree and
/// broadcast down it, pipelined, on its own channel.
pub(crate) fn all_reduce_tree(
    exec: &mut Exec,
    dt: DataType,
    op: RedOp,
    count: usize,
    pipeline: &Pipeline,
) -> Result<()> {
    let (n, r) = (exec.nranks(), exec.rank());
    if n == 1 {
        return exec.copy_input(count * dt.size());
    }
    let trees = double_tree(n, r);
    // Small messages gain nothing from splitting and pay twice the messages: one tree.
    let ntrees = if count * dt.size() >= TWO_TREES_FROM {
        2
    } else {
        1
    };
    let mut ms = machines(
        trees
            .into_iter()
            .take(ntrees)
            .enumerate()
            .map(|(t, shape)| {
                let (base, cnt) = part(count, ntrees, t);
                tree_machine(
                    t,
                    n,
                    shape,
                    true,
                    true,
                    dt,
                    op,
                    base,
                    cnt,
                    pipeline,
                    t * tree_stage(pipeline),
                )
            }),
    )?;
    run(exec, &mut ms)
}

fn rooted(n: usize, rank: usize, root: usize) -> (Option<usize>, Kids) {
    mapped(n, rank, |r| (r + n - root) % n, |l| (l + root) % n)
}

/// Pipelined binary-tree broadcast from `root`.
pub(crate) fn broadcast_tree(
    exec: &mut Exec,
    root: usize,
    dt: DataType,
    count: usize,
    pipeline: &Pipeline,
) -> Result<()> {
    let (n, r) = (exec.nranks(), exec.rank());
    if r == root {
        exec.copy_input(count * dt.size())?;
    }
    if n == 1 {
        return Ok(());
    }
    let mut ms = [tree_machine(
        0,
        n,
        rooted(n, r, root),
        false,
        true,
        dt,
        RedOp::Sum,
        0,
        count,
        pipeline,
        0,
    )];
    run(exec, &mut ms)
}

/// Pipelined binary-tree reduce to `root`.
pub(crate) fn reduce_tree(
    exec: &mut Exec,
    root: usize,
    dt: DataType,
    op: RedOp,
    count: usize,
    pipeline: &Pipeline,
) -> Result<()> {
    let (n, r) = (exec.nranks(), exec.rank());
    if n == 1 {
        return exec.copy_input(count * dt.size());
    }
    let mut ms = [tree_machine(
        0,
        n,
        rooted(n, r, root),
        true,
        false,
        dt,
        op,
        0,
        count,
        pipeline,
        0,
    )];
    run(exec, &mut ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_tree(n: usize, f: impl Fn(usize) -> (Option<usize>, Kids)) {
        let shapes: Vec<_> = (0..n).map(&f).collect();
        let roots: Vec<usize> = (0..n).filter(|&r| shapes[r].0.is_none()).collect();
        assert_eq!(roots.len(), 1, "n={n}: one root");
        for (r, (p, kids)) in shapes.iter().enumerate() {
            assert!(kids.len() <= 2);
            for &c in kids {
                assert!(c < n && c != r);
                assert_eq!(
                    shapes[c].0,
                    Some(r),
                    "n={n}: child {c} of {r} has parent {:?}",
                    shapes[c].0
                );
            }
            if let Some(p) = p {
                assert!(
                    shapes[*p].1.contains(&r),
                    "n={n}: {r} not among children of its parent {p}"
                );
            }
        }
        // Every rank reaches the root.
        for r in 0..n {
            let mut x = r;
            let mut steps = 0;
            while let Some(p) = shapes[x].0 {
                x = p;
                steps += 1;
                assert!(steps <= n);
            }
            assert_eq!(x, roots[0]);
        }
    }

    #[test]
    fn trees_are_trees() {
        for n in 1..=70 {
            check_tree(n, |r| btree(n, r));
            check_tree(n, |r| double_tree(n, r)[1].clone());
            for root in [0, n / 2, n - 1] {
                check_tree(n, |r| rooted(n, r, root));
                assert_eq!(rooted(n, root, root).0, None);
            }
        }
    }

    #[test]
    fn double_tree_balances_inner_nodes() {
        for n in [4usize, 8, 16] {
            let inner_both = (0..n)
                .filter(|&r| double_tree(n, r).iter().all(|(_, k)| !k.is_empty()))
                .count();
            assert!(
                inner_both <= 1,
                "n={n}: {inner_both} ranks are inner nodes of both trees"
            );
        }
    }
}
