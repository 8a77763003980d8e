//! Log-step algorithms for small messages on many ranks (Bruck et al., 1997): all-gather,
//! reduce-scatter and all-reduce in `⌈log2 n⌉` steps (all-reduce: twice that) on any
//! number of ranks, where the rings take `n-1` steps.
//!
//! The vector is cut in `n` blocks, block `b` belonging to rank `b`. Seen from rank `r`,
//! *position* `j` is block `(r + j) mod n`. With `d` running over the powers of two below
//! `n` and `m = min(d, n - d)`:
//!
//! - all-gather (`d` = 1, 2, 4, …): rank `r` sends its positions `[0, m)` to rank `r - d`
//!   and receives positions `[d, d + m)` from rank `r + d`; after the step with `d` it holds
//!   positions `[0, 2d)`. Positions are blocks of the output buffer itself, so every block
//!   is received where it belongs and sent from there: no staging and no final rotation.
//!   A run of positions that wraps past block `n-1` is two runs of blocks, so a step is one
//!   or two messages each way; both ends cut at the same block, so sizes match.
//! - reduce-scatter (the same steps backwards, `d` = …, 4, 2, 1): rank `r` sends the partial
//!   sums of its positions `[d, d + m)` to rank `r + d` and adds those of rank `r - d` into
//!   its positions `[0, m)`; what it sent it never needs again. Each contribution travels
//!   the all-gather's path in reverse, so it is summed exactly once. Partials live in a
//!   staging copy of the vector in position order (one message per step); a position is
//!   first written by reducing the input with what arrived (no copy), and positions sent
//!   before anything arrived for them go from the input when they are one run of blocks
//!   (always on the first step for half the ranks) and are copied otherwise. The last step
//!   reduces straight into the output.
//! - all-reduce: that reduce-scatter over `n` nearly equal blocks, each rank's block
//!   reduced into the output, then that all-gather in the output (Rabenseifner's shape on
//!   any `n`): `2⌈log2 n⌉` steps and `2(n-1)/n` of the buffer sent per rank.
//!
//! Each block is reduced in an order fixed by `n` and its owner only, so every rank gets
//! the same bits. Steps run one after the other (each waits for its messages): these
//! algorithms are for messages small enough that a step is one message.

use super::part;
use crate::error::Result;
use crate::exec::{Buf, Exec, Reg};
use crate::types::{DataType, RedOp};

/// The `n` blocks of a vector of `total` elements of `esz` bytes: block `b` is
/// `part(total, n, b)` (equal blocks when `n` divides `total`).
#[derive(Clone, Copy, Debug)]
struct Blocks {
    n: usize,
    total: usize,
    esz: usize,
}

/// A run of `count` consecutive blocks from `first` (no wrap).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Run {
    first: usize,
    count: usize,
}

impl Blocks {
    /// Byte offset of block `b` (`b == n`: the end of the vector).
    fn off(&self, b: usize) -> usize {
        part(self.total, self.n, b).0 * self.esz
    }
    /// Bytes of the run.
    fn bytes(&self, run: Run) -> usize {
        self.off(run.first + run.count) - self.off(run.first)
    }
    /// The run's bytes in `buf`, whose block 0 is at `base`.
    fn reg(&self, buf: Buf, base: usize, run: Run) -> Reg {
        Reg::new(buf, base + self.off(run.first), self.bytes(run))
    }
    /// Blocks `first, first+1, …, first+count-1` (mod n) as at most two runs (the second
    /// empty unless they wrap past block `n-1`).
    fn runs(&self, first: usize, count: usize) -> [Run; 2] {
        let first = first % self.n;
        let head = count.min(self.n - first);
        [
            Run { first, count: head },
            Run {
                first: 0,
                count: count - head,
            },
        ]
    }
    /// Bytes of positions `[0, j)` of rank `r` (blocks `r, r+1, …` mod n): the offset of
    /// position `j` in a buffer laid out in rank `r`'s position order.
    fn rotated(&self, r: usize, j: usize) -> usize {
        self.runs(r, j).iter().map(|&run| self.bytes(run)).sum()
    }
    /// Positions `[j, j + count)` of rank `r` in a buffer laid out in position order from
    /// `base`.
    fn rotated_reg(&self, r: usize, base: usize, j: usize, count: usize) -> Reg {
        let a = self.rotated(r, j);
        Reg::new(Buf::Stage, base + a, self.rotated(r, j + count) - a)
    }
}

/// The step distances `d` of an `n`-rank Bruck exchange, smallest first: the powers of two
/// below `n`.
fn distances(n: usize) -> impl DoubleEndedIterator<Item = usize> + Clone {
    let steps = usize::BITS - n.saturating_sub(1).leading_zeros();
    (0..steps).map(|k| 1usize << k)
}

/// Most positions a rank receives in one step: `max min(d, n - d)` over the distances.
fn most_received(n: usize) -> usize {
    distances(n).map(|d| d.min(n - d)).max().unwrap_or(0)
}

/// Staging bytes of [`reduce_scatter_bruck`] and [`all_reduce_bruck`] for a vector of
/// `total` elements on `n` ranks: the partials in position order, then the largest step's
/// receive.
pub(crate) fn bruck_stage(n: usize, total: usize, dt: DataType) -> usize {
    let block = total.div_ceil(n.max(1)) * dt.size();
    (total * dt.size()).next_multiple_of(64) + most_received(n) * block
}

/// Bruck all-gather over `g`'s blocks of the output (`Dst`, block 0 at `base`), this rank's
/// block already in place.
fn gather(exec: &mut Exec, g: Blocks, base: usize) -> Result<()> {
    let (n, r) = (g.n, exec.rank());
    exec.ensure(
        distances(n).map(|d| ((r + n - d) % n, 0)),
        distances(n).map(|d| ((r + d) % n, 0)),
    )?;
    for d in distances(n) {
        let m = d.min(n - d);
        let (to, from) = ((r + n - d) % n, (r + d) % n);
        // Both ends cut a wrapping run at block n-1, and skip empty runs (fewer elements
        // than ranks), alike.
        for run in g.runs(r + d, m) {
            if g.bytes(run) > 0 {
                exec.recv(from, 0, g.reg(Buf::Dst, base, run))?;
            }
        }
        for run in g.runs(r, m) {
            if g.bytes(run) > 0 {
                exec.send(to, 0, g.reg(Buf::Dst, base, run))?;
            }
        }
        exec.finish()?;
    }
    Ok(())
}

/// Bruck reduce-scatter of `g`'s blocks of the input (`Src`, block 0 at offset 0): this
/// rank's block of the result goes to `out`. Staging from 0: partials in position order
/// (`g`'s whole vector, 64-byte aligned), then one step's receive (see [`bruck_stage`]).
fn scatter(exec: &mut Exec, g: Blocks, out: Reg, dt: DataType, op: RedOp) -> Result<()> {
    let (n, r) = (g.n, exec.rank());
    let acc = 0;
    let inbox = (g.total * g.esz).next_multiple_of(64);
    exec.ensure(
        distances(n).map(|d| ((r + d) % n, 0)),
        distances(n).map(|d| ((r + n - d) % n, 0)),
    )?;
    // Positions [0, touched) hold partial sums in `acc`; the others only the input.
    let mut touched = 0;
    for d in distances(n).rev() {
        let m = d.min(n - d);
        let (to, from) = ((r + d) % n, (r + n - d) % n);
        let [head, tail] = g.runs(r + d, m);
        let send = if touched <= d && tail.count == 0 {
            // Nothing arrived for these positions yet and they are one run of the input.
            g.reg(Buf::Src, 0, head)
        } else {
            let fresh = touched.max(d);
            if fresh < d + m {
                copy_positions(exec, g, r, acc, fresh, d + m - fresh)?;
            }
            g.rotated_reg(r, acc, d, m)
        };
        let got = g.rotated_reg(r, inbox, 0, m);
        if got.len > 0 {
            exec.recv(from, 0, got)?;
        }
        if send.len > 0 {
            exec.send(to, 0, send)?;
        }
        exec.finish()?;
        if d == 1 {
            // Position 0 is this rank's block: its last partial goes to the output.
            let mine = if touched > 0 {
                g.rotated_reg(r, acc, 0, 1)
            } else {
                g.reg(Buf::Src, 0, Run { first: r, count: 1 })
            };
            exec.reduce(out, mine, got, dt, op)?;
            break;
        }
        // Positions that already hold partials add to them; the others start from input.
        let old = touched.min(m);
        exec.reduce(
            g.rotated_reg(r, acc, 0, old),
            g.rotated_reg(r, acc, 0, old),
            g.rotated_reg(r, inbox, 0, old),
            dt,
            op,
        )?;
        let mut j = old;
        for run in g.runs(r + old, m - old) {
            exec.reduce(
                g.rotated_reg(r, acc, j, run.count),
                g.reg(Buf::Src, 0, run),
                g.rotated_reg(r, inbox, j, run.count),
                dt,
                op,
            )?;
            j += run.count;
        }
        touched = touched.max(m);
    }
    if op == RedOp::Avg {
        exec.finish_avg(out, dt, n)?;
    }
    Ok(())
}

/// Copy positions `[j, j + count)` of rank `r` from the input to the partials at `acc`.
fn copy_positions(
    exec: &mut Exec,
    g: Blocks,
    r: usize,
    acc: usize,
    j: usize,
    count: usize,
) -> Result<()> {
    let mut at = j;
    for run in g.runs(r + j, count) {
        exec.copy(
            g.rotated_reg(r, acc, at, run.count),
            g.reg(Buf::Src, 0, run),
        )?;
        at += run.count;
    }
    Ok(())
}

/// Bruck all-gather of `count` elements per rank into `n * count`: `⌈log2 n⌉` steps of one
/// or two messages each way, received straight into the output and sent from it.
pub(crate) fn all_gather_bruck(exec: &mut Exec, dt: DataType, count: usize) -> Result<()> {
    let (n, r, esz) = (exec.nranks(), exec.rank(), dt.size());
    let own = Reg::new(Buf::Dst, r * count * esz, count * esz);
    if !exec.in_place() {
        exec.copy(own, Reg::new(Buf::Src, 0, count * esz))?;
    }
    if n == 1 {
        return Ok(());
    }
    let g = Blocks {
        n,
        total: n * count,
        esz,
    };
    gather(exec, g, 0)
}

/// Bruck reduce-scatter: `n * count` elements in, `count` out (in place: this rank's block
/// of the buffer). `⌈log2 n⌉` steps of one message each way. Staging: [`bruck_stage`] of
/// `n * count` elements.
pub(crate) fn reduce_scatter_bruck(
    exec: &mut Exec,
    dt: DataType,
    op: RedOp,
    count: usize,
) -> Result<()> {
    let (n, r, esz) = (exec.nranks(), exec.rank(), dt.size());
    let at = if exec.in_place() { r * count * esz } else { 0 };
    let out = Reg::new(Buf::Dst, at, count * esz);
    if n == 1 {
        return exec.copy(out, Reg::new(Buf::Src, 0, count * esz));
    }
    let g = Blocks {
        n,
        total: n * count,
        esz,
    };
    scatter(exec, g, out, dt, op)
}

/// Bruck all-reduce: the Bruck reduce-scatter of `n` nearly equal blocks, each rank's
/// block reduced (and averaged) into the output, then the Bruck all-gather in the output.
/// `2⌈log2 n⌉` steps, `2(n-1)/n` of the buffer sent per rank. Staging: [`bruck_stage`] of
/// `count` elements.
pub(crate) fn all_reduce_bruck(
    exec: &mut Exec,
    dt: DataType,
    op: RedOp,
    count: usize,
) -> Result<()> {
    let (n, r, esz) = (exec.nranks(), exec.rank(), dt.size());
    if n == 1 {
        return exec.copy_input(count * esz);
    }
    let g = Blocks {
        n,
        total: count,
        esz,
    };
    let out = g.reg(Buf::Dst, 0, Run { first: r, count: 1 });
    scatter(exec, g, out, dt, op)?;
    gather(exec, g, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulate the exchanges on `n` ranks with sets of contributions: every rank must end
    /// with each block once (all-gather) or with every rank's contribution to its block
    /// exactly once (reduce-scatter).
    #[test]
    fn every_block_arrives_once() {
        for n in 1..=70usize {
            // All-gather: have[r] = the blocks rank r holds, in position order.
            let mut have: Vec<Vec<usize>> = (0..n).map(|r| vec![r]).collect();
            for d in distances(n) {
                let m = d.min(n - d);
                let before = have.clone();
                for (r, h) in have.iter_mut().enumerate() {
                    let from = (r + d) % n;
                    h.extend_from_slice(&before[from][..m]);
                }
            }
            for (r, h) in have.iter().enumerate() {
                let want: Vec<usize> = (0..n).map(|j| (r + j) % n).collect();
                assert_eq!(h, &want, "all-gather n={n} rank {r}");
            }
            // Reduce-scatter: sums[r][j] = how often each rank's contribution is in rank r's
            // partial for position j.
            let mut sums: Vec<Vec<Vec<usize>>> = (0..n)
                .map(|r| {
                    (0..n)
                        .map(|_| {
                            let mut c = vec![0; n];
                            c[r] = 1;
                            c
                        })
                        .collect()
                })
                .collect();
            for d in distances(n).rev() {
                let m = d.min(n - d);
                let before = sums.clone();
                for (r, s) in sums.iter_mut().enumerate() {
                    let from = (r + n - d) % n;
                    for j in 0..m {
                        for (k, c) in before[from][d + j].iter().enumerate() {
                            s[j][k] += c;
                        }
                    }
                }
            }
            for (r, s) in sums.iter().enumerate() {
                assert_eq!(s[0], vec![1; n], "reduce-scatter n={n} rank {r}");
            }
        }
    }

    #[test]
    fn runs_cut_at_the_last_block() {
        let g = Blocks {
            n: 5,
            total: 7,
            esz: 4,
        };
        assert_eq!(
            g.runs(3, 4),
            [Run { first: 3, count: 2 }, Run { first: 0, count: 2 }]
        );
        assert_eq!(g.runs(6, 2)[1].count, 0);
        // Blocks of 7 over 5: 2, 2, 1, 1, 1 elements.
        assert_eq!(g.rotated(3, 4), (1 + 1 + 2 + 2) * 4);
        assert_eq!(g.rotated(0, 5), 7 * 4);
        assert!(bruck_stage(5, 7, DataType::F32) >= 64 + 2 * 2 * 4);
    }
}
