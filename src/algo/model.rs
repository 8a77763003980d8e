//! α-β cost model: picks the algorithm and pipeline shape of each call.
//!
//! Each network gives a per-message latency α (µs) and a bandwidth β (GB/s); local
//! reduction runs at γ (GB/s). For `n` ranks and `B` bytes:
//!
//! | algorithm | steps (α) | bytes on the wire per rank | reduced bytes per rank |
//! |---|---|---|---|
//! | all-reduce direct | 1 | (n−1)·B | (n−1)·B |
//! | all-reduce ring | 2(n−1) | 2(n−1)/n·B | (n−1)/n·B |
//! | all-reduce double tree | 2⌈log2 n⌉ | (1 + 0.55⌈log2 n⌉)·B (2·B at best; the pipeline loses per level) | ≈ B |
//! | broadcast/reduce chain | n−1 (+ slices) | B | B (reduce) |
//! | broadcast/reduce tree | ⌈log2 n⌉ (+ slices) | ≤ 2·B | ≤ 2·B (reduce) |
//! | all-gather / reduce-scatter ring | n−1 | (n−1)/n·B | (n−1)/n·B (reduce-scatter) |
//! | all-gather / reduce-scatter Bruck | ⌈log2 n⌉ | (n−1)/n·B | (n−1)/n·B (reduce-scatter) |
//! | all-reduce Bruck | 2⌈log2 n⌉ | 2(n−1)/n·B | (n−1)/n·B |
//!
//! Pipelined algorithms also pay a fill cost of (steps − 1) slices. The cheapest estimate
//! wins unless `ROCCL_ALGO` or the call's option forces one.

use super::{Algo, Pipeline};
use crate::types::DataType;

/// Latency and bandwidth of the links a call uses.
#[derive(Clone, Copy, Debug)]
pub struct LinkCost {
    /// Per-message latency in microseconds (software included).
    pub alpha_us: f64,
    /// Bandwidth in GB/s.
    pub beta_gbs: f64,
    /// Local reduction speed in GB/s of the shared-memory algorithms (which reduce data
    /// other cores just wrote).
    pub gamma_gbs: f64,
    /// Local reduction speed in GB/s of the network algorithms (which reduce data that just
    /// arrived in this rank's own buffers: the kernel's speed).
    pub wire_gamma_gbs: f64,
    /// CPU cost in µs of each message a rank sends or receives when its core is shared
    /// with other ranks (0 when every rank has a core): with more ranks than cores, a
    /// message costs a context switch, so algorithms with fewer messages win.
    pub msg_cpu_us: f64,
    /// Every rank is on this host and the shared-memory segments are mapped: the cost in µs
    /// of one synchronisation of the `shm1`/`shm2` algorithms (`None`: they do not exist).
    pub flat_sync_us: Option<f64>,
    /// Memory copy speed in GB/s of one core (shared-memory algorithms).
    pub copy_gbs: f64,
    /// The share of a core each rank of this host gets (1 with a core per rank).
    pub cpu_share: f64,
    /// Bytes per piece of the shared-memory algorithms.
    pub flat_slot: usize,
    /// Ranks can read each other's memory (process_vm_readv): large shared-memory
    /// broadcasts copy once.
    pub flat_cma: bool,
    /// The share of a NIC's bandwidth each rank gets when every rank of its host sends to
    /// other hosts at once — what the direct, two-shot, doubling and Bruck exchanges do:
    /// `min(nics, m)/m` with `m` ranks on a host over `nics` NICs (1 on one host, or with a
    /// NIC per rank). The host-ordered ring crosses each host boundary once and the double
    /// tree about once per level, so they keep the whole NIC.
    pub nic_share: f64,
}

impl Default for LinkCost {
    fn default() -> Self {
        LinkCost {
            alpha_us: 10.0,
            beta_gbs: 2.5,
            gamma_gbs: 10.0,
            wire_gamma_gbs: 40.0,
            msg_cpu_us: 0.0,
            flat_sync_us: None,
            copy_gbs: 8.0,
            cpu_share: 1.0,
            flat_slot: 256 << 10,
            flat_cma: false,
            nic_share: 1.0,
        }
    }
}

/// The cost in µs of one synchronisation of the shared-memory algorithms among
/// `local_ranks` ranks of a host with `cores` cores ([`LinkCost::flat_sync_us`]).
///
/// With a core per rank it is a cache-line transfer. With ranks sharing cores each one
/// costs a context switch, and more where the ranks compute between calls: a rank that
/// arrived sleeps or yields while its core's other rank computes, and every
/// synchronisation after the last arrival waits for them all to run again. Lockstep
/// 4-rank all-reduces on 2 cores (`roccl-perf --ranks 4`) ran the one-shot faster up to 4
/// KiB (5.1 against 6.2 µs) and the two-shot from 16 KiB (11.2 against 13.4 µs); in
/// Hugging Face tensor-parallel decode (4 KiB per call) the two-shot's second
/// synchronisation held the last rank to arrive for about 1 ms, the one-shot 20 µs
/// (docs/PERFORMANCE.md). 3 µs per rank a core holds puts the choice between those sizes.
pub fn flat_sync_us(local_ranks: usize, cores: usize) -> f64 {
    if local_ranks > cores {
        3.0 * local_ranks as f64 / cores.max(1) as f64
    } else {
        0.3
    }
}

/// Which collective a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollKind {
    /// All-reduce.
    AllReduce,
    /// Broadcast from a root.
    Broadcast,
    /// Reduce to a root.
    Reduce,
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-to-all.
    AllToAll,
}

impl CollKind {
    /// Every kind, in the order of [`CollKind::index`].
    pub const ALL: [CollKind; 6] = [
        CollKind::AllReduce,
        CollKind::Broadcast,
        CollKind::Reduce,
        CollKind::AllGather,
        CollKind::ReduceScatter,
        CollKind::AllToAll,
    ];

    /// Its position in [`CollKind::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Its name in counters, traces and logs.
    pub const fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "all_reduce",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
            CollKind::AllGather => "all_gather",
            CollKind::ReduceScatter => "reduce_scatter",
            CollKind::AllToAll => "all_to_all",
        }
    }
}

/// Knobs that override the model (`ROCCL_SLICE`, `ROCCL_DEPTH`, `ROCCL_NCHANNELS`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Tuning {
    /// Fixed slice size in bytes.
    pub slice: Option<usize>,
    /// Fixed pipeline depth.
    pub depth: Option<usize>,
    /// Fixed channel count.
    pub channels: Option<usize>,
    /// NICs every rank has on its network (agreed at init; 0 or 1: one): messages of 1 MiB
    /// and more take a channel per NIC, whose connections the network spreads over them.
    pub nics: usize,
}

/// Steps of recursive doubling on `n` ranks (two more when n is not a power of two).
fn doubling_steps(n: usize) -> f64 {
    let lg = (usize::BITS - 1 - n.max(1).leading_zeros()) as f64;
    if n.is_power_of_two() {
        lg
    } else {
        lg + 2.0
    }
}

fn log2c(n: usize) -> f64 {
    (usize::BITS - (n.max(1) - 1).leading_zeros()) as f64
}

/// Most channels a pipeline takes (the executor's connection sets per peer).
const MAX_PIPELINE_CHANNELS: usize = 8;

/// Pipeline shape for a message of `bytes` whose per-step piece is `piece` bytes.
pub fn pipeline(piece: usize, bytes: usize, t: &Tuning) -> Pipeline {
    let slice = t
        .slice
        .unwrap_or_else(|| (piece / 4).clamp(32 * 1024, 512 * 1024))
        .max(64);
    let per_nic = if bytes >= (1 << 20) { t.nics.max(1) } else { 1 };
    let channels = t
        .channels
        .unwrap_or(if bytes >= (16 << 20) { 2 } else { 1 }.max(per_nic));
    Pipeline {
        slice,
        depth: t.depth.unwrap_or(4).clamp(1, 16),
        channels: channels.clamp(1, 4.max(per_nic).min(MAX_PIPELINE_CHANNELS)),
    }
}

/// Estimated time in µs of `algo` for `kind` on `n` ranks and `bytes` bytes.
pub fn estimate(
    kind: CollKind,
    algo: Algo,
    n: usize,
    bytes: usize,
    c: &LinkCost,
    pl: &Pipeline,
) -> f64 {
    let b = bytes as f64;
    let beta = match algo {
        Algo::Direct | Algo::Doubling | Algo::TwoShot | Algo::Bruck => c.beta_gbs * c.nic_share,
        _ => c.beta_gbs,
    };
    let wire = |x: f64| x / (beta * 1e3);
    let red = |x: f64| x / (c.wire_gamma_gbs * 1e3);
    let fill = |steps: f64| (steps - 1.0).max(0.0) * wire(pl.slice.min(bytes.max(1)) as f64);
    if n <= 1 {
        return 0.0;
    }
    if matches!(algo, Algo::ShmOneShot | Algo::ShmTwoShot) {
        return estimate_flat(kind, algo, n, bytes, c);
    }
    estimate_wire(kind, algo, n, b, c, wire, red, fill)
        + c.msg_cpu_us * messages(kind, algo, n, bytes)
}

/// Bytes per rank up to which the shared-memory algorithms' copies stay in cache
/// ([`estimate_flat`]).
const FLAT_CACHED: usize = 4 << 10;

/// Shared-memory algorithms: per piece of at most one slot, one synchronisation (two for
/// two-shot), plus the copies into and out of the slots and the reductions.
fn estimate_flat(kind: CollKind, algo: Algo, n: usize, bytes: usize, c: &LinkCost) -> f64 {
    let Some(sync) = c.flat_sync_us else {
        return f64::INFINITY;
    };
    let (b, nf) = (bytes as f64, n as f64);
    // A byte published by one core and read by another costs about two local copies.
    // Ranks sharing cores pay in the synchronisation (a context switch), not in the copies,
    // which stay in cache (fitted with scripts/algo-sweep.sh on 2 cores with 2 and 4 ranks;
    // docs/PERFORMANCE-LOG.md).
    // Up to FLAT_CACHED bytes per rank, what a rank publishes is still in the caches the
    // readers pull it from, and copies ran 2.5 times the model's speed (2 ranks on 2 cores:
    // a 4 KiB all-reduce took 0.67 µs through the slots against 1.73 modelled, so the model
    // chose the network at 1.6 µs; from 8 KiB the model's speed holds; docs/PERFORMANCE.md).
    let cached = match kind {
        CollKind::AllGather => b / nf,
        _ => b,
    } <= FLAT_CACHED as f64;
    let copy_gbs = c.copy_gbs * if cached { 2.5 } else { 1.0 };
    let copy = |x: f64| x / (copy_gbs * 1e3);
    let red = |x: f64| x / (c.gamma_gbs * 1e3);
    // Pieces: the slot bounds the bytes each rank publishes per piece.
    let per_piece = match kind {
        CollKind::AllGather => b / nf,
        _ => b,
    };
    let pieces = (per_piece / c.flat_slot as f64).ceil().max(1.0);
    match (kind, algo) {
        // Single copy: each rank reads its share of the others' inputs, then their reduced
        // shares, straight out of their buffers.
        (CollKind::AllReduce, Algo::ShmTwoShot)
            if c.flat_cma && bytes >= crate::algo::shm::DIRECT_REDUCE_MIN =>
        {
            3.0 * sync + copy(2.0 * (nf - 1.0) / nf * b) / 2.0 + red((nf - 1.0) / nf * b)
        }
        (CollKind::AllReduce, Algo::ShmTwoShot) => {
            2.0 * pieces * sync
                + copy(b)
                + red((nf - 1.0) / nf * b)
                + copy(2.0 * (nf - 1.0) / nf * b)
        }
        (CollKind::AllReduce, _) => pieces * sync + copy(2.0 * b) + red((nf - 1.0) * b),
        // Rooted calls tie the root to the slowest of the others every piece (it reuses a
        // slot only once all have started the next call), where chains and trees let the
        // ranks run ahead: a synchronisation with each rank.
        (CollKind::Reduce, _) => pieces * sync * nf + copy(2.0 * b) + red((nf - 1.0) * b),
        (CollKind::ReduceScatter, _) => pieces * sync + copy(2.0 * b) + red((nf - 1.0) / nf * b),
        // One copy per reader, straight from the root's buffer (the ring copies twice).
        (CollKind::Broadcast, _)
            if c.flat_cma && bytes >= crate::algo::shm::DIRECT_BROADCAST_MIN =>
        {
            sync * nf + copy(b) / 2.0
        }
        // The root's copy of the next piece overlaps the readers' copy of this one.
        (CollKind::Broadcast, _) => {
            pieces * sync * nf + copy(2.0 * b + per_piece.min(c.flat_slot as f64))
        }
        // One copy per byte, out of the other ranks' buffers (no slot shared between cores).
        (CollKind::AllGather, _)
            if c.flat_cma && per_piece >= crate::algo::shm::DIRECT_GATHER_MIN as f64 =>
        {
            sync * nf + copy((nf - 1.0) / nf * b) / 2.0
        }
        (CollKind::AllGather | CollKind::AllToAll, _) => pieces * sync + copy(b / nf + 2.0 * b),
    }
}

/// Messages sent plus received per rank, averaged over the ranks (for the shared-core CPU
/// term: with more ranks than cores, every message anywhere on the host costs CPU time
/// that some rank on the critical path waits for).
fn messages(kind: CollKind, algo: Algo, n: usize, bytes: usize) -> f64 {
    let nf = n as f64;
    let trees = if bytes >= super::tree::TWO_TREES_FROM {
        2.0
    } else {
        1.0
    };
    let tree_edges = 2.0 * (nf - 1.0) / nf; // one message each way per edge, two ends
    match (kind, algo) {
        (CollKind::AllReduce, Algo::ShmOneShot | Algo::ShmTwoShot) => 0.0,
        (CollKind::AllReduce, Algo::Direct) | (CollKind::AllToAll, _) => 2.0 * (nf - 1.0),
        (CollKind::AllReduce, Algo::Doubling) => 2.0 * doubling_steps(n),
        (CollKind::AllReduce, Algo::TwoShot) => 4.0 * (nf - 1.0),
        (CollKind::AllReduce, Algo::Ring | Algo::Hier) => 4.0 * (nf - 1.0),
        (CollKind::AllReduce, Algo::Tree) => 2.0 * tree_edges * trees,
        (CollKind::Broadcast | CollKind::Reduce, _) => tree_edges,
        (_, Algo::Bruck) => bruck_messages(kind, n),
        (CollKind::AllGather | CollKind::ReduceScatter, _) => 2.0 * (nf - 1.0),
    }
}

/// Bruck's log-step algorithms (`algo/bruck.rs`): ⌈log2 n⌉ steps for an all-gather or a
/// reduce-scatter, twice that for an all-reduce, each one message of whole blocks (not
/// pipelined), the ring's bytes on the wire. The reduce-scatter (and all-reduce) copies
/// about half the vector into its partials on more than three ranks and reduces the ring's
/// share.
fn estimate_bruck(
    kind: CollKind,
    n: usize,
    b: f64,
    c: &LinkCost,
    wire: impl Fn(f64) -> f64,
    red: impl Fn(f64) -> f64,
) -> f64 {
    let (nf, steps) = (n as f64, log2c(n));
    let copy = if n > 3 {
        b / 2.0 / (c.copy_gbs * 1e3)
    } else {
        0.0
    };
    let share = (nf - 1.0) / nf * b;
    match kind {
        CollKind::AllGather => steps * c.alpha_us + wire(share),
        CollKind::ReduceScatter => steps * c.alpha_us + wire(share) + red(share) + copy,
        CollKind::AllReduce => 2.0 * steps * c.alpha_us + wire(2.0 * share) + red(share) + copy,
        _ => f64::INFINITY,
    }
}

/// Messages per rank of Bruck's algorithms (sent plus received): one each way per step,
/// and the all-gather's runs that wrap past the last block are two (about half of them).
fn bruck_messages(kind: CollKind, n: usize) -> f64 {
    let steps = log2c(n);
    match kind {
        CollKind::AllGather => 3.0 * steps,
        CollKind::ReduceScatter => 2.0 * steps,
        _ => 5.0 * steps,
    }
}

#[allow(clippy::too_many_arguments)]
fn estimate_wire(
    kind: CollKind,
    algo: Algo,
    n: usize,
    b: f64,
    c: &LinkCost,
    wire: impl Fn(f64) -> f64,
    red: impl Fn(f64) -> f64,
    fill: impl Fn(f64) -> f64,
) -> f64 {
    let nf = n as f64;
    match (kind, algo) {
        (CollKind::AllReduce, Algo::Doubling) => {
            let steps = doubling_steps(n);
            steps * c.alpha_us + wire(steps * b) + red(steps * b)
        }
        (CollKind::AllReduce, Algo::Direct | Algo::ShmOneShot | Algo::ShmTwoShot) => {
            c.alpha_us + fan_out(n, c) + wire((nf - 1.0) * b) + red((nf - 1.0) * b)
        }
        (CollKind::AllReduce, Algo::TwoShot) => {
            2.0 * (c.alpha_us + fan_out(n, c))
                + wire(2.0 * (nf - 1.0) / nf * b)
                + red((nf - 1.0) / nf * b)
        }
        // (Hierarchical calls are estimated by `estimate_hier`; here as the flat ring.)
        (CollKind::AllReduce, Algo::Ring | Algo::Hier) => {
            let steps = 2.0 * (nf - 1.0);
            steps * c.alpha_us
                + wire(steps / nf * b)
                + red((nf - 1.0) / nf * b)
                + fill(steps.min(4.0))
        }
        // Each rank is an inner node of one tree (two children's halves in, one out, on the
        // way up; one in, two out on the way down) and a leaf of the other: 2·B each way
        // through its NIC at best. The pipeline loses more with every level (an inner node
        // waits for the slower child, its parent for it): the simulator, which runs this
        // tree, gives 2.2·B/β at 4 ranks, 3.2 at 16 and 5.0 at 128 (roccl-sim, nic_gbps=100;
        // docs/PERFORMANCE.md), about (1 + 0.55·levels)·B/β.
        (CollKind::AllReduce, Algo::Tree) => {
            let steps = 2.0 * log2c(n);
            steps * c.alpha_us + wire((1.0 + 0.55 * log2c(n)) * b) + red(b) + fill(steps)
        }
        (CollKind::Broadcast | CollKind::Reduce, Algo::Tree) => {
            let steps = log2c(n);
            let r = if kind == CollKind::Reduce {
                red(2.0 * b)
            } else {
                0.0
            };
            steps * c.alpha_us + wire(2.0 * b) + r + fill(steps)
        }
        (CollKind::Broadcast | CollKind::Reduce, _) => {
            let steps = nf - 1.0;
            let r = if kind == CollKind::Reduce {
                red(b)
            } else {
                0.0
            };
            steps * c.alpha_us + wire(b) + r + fill(steps)
        }
        (_, Algo::Bruck) => estimate_bruck(kind, n, b, c, wire, red),
        (CollKind::AllGather | CollKind::ReduceScatter, _) => {
            (nf - 1.0) * c.alpha_us + wire(b * (nf - 1.0) / nf)
        }
        (CollKind::AllToAll, _) => c.alpha_us + fan_out(n, c) + wire(b * (nf - 1.0) / nf),
    }
}

/// The sender's own cost of a step that posts a message to every other rank at once: each
/// message past the first costs the sender a fifth of a message's latency (LogP's `o`: a
/// system call, a doorbell). Negligible on a few ranks, it makes one-step algorithms lose
/// to log-step ones from some 16–32 ranks on.
fn fan_out(n: usize, c: &LinkCost) -> f64 {
    0.2 * c.alpha_us * n.saturating_sub(2) as f64
}

/// Algorithms that exist for `kind` over the network.
pub fn candidates(kind: CollKind) -> &'static [Algo] {
    match kind {
        CollKind::AllReduce => &[
            Algo::Direct,
            Algo::Doubling,
            Algo::TwoShot,
            Algo::Ring,
            Algo::Tree,
            Algo::Bruck,
        ],
        CollKind::Broadcast | CollKind::Reduce => &[Algo::Ring, Algo::Tree],
        CollKind::AllGather | CollKind::ReduceScatter => &[Algo::Ring, Algo::Bruck],
        CollKind::AllToAll => &[Algo::Direct],
    }
}

/// Algorithms that exist for `kind` when every rank is on this host with shared memory.
pub fn flat_candidates(kind: CollKind) -> &'static [Algo] {
    match kind {
        CollKind::AllReduce => &[Algo::ShmOneShot, Algo::ShmTwoShot],
        _ => &[Algo::ShmOneShot],
    }
}

/// Largest message the one-shot all-reduce is considered for (its staging is `n * bytes`).
pub const DIRECT_MAX: usize = 256 * 1024;

/// Largest message recursive doubling is considered for over links with α ≥ 5 µs (TCP, RDMA;
/// over shared memory the limit is [`DIRECT_MAX`]). The α-β terms miss both sides of it: up
/// to here the ring's pipelined slices each pay a message's overhead that one whole-buffer
/// exchange does not; beyond it the ring moves data faster. `scripts/algo-sweep.sh`, 2 ranks
/// over TCP: 1 MiB doubling 218–233 µs vs ring 325–335, 2 MiB 411–446 vs 560–566, 4 MiB
/// 1337–1375 vs 1039–1059; over shared memory 1 MiB doubling 91 vs ring 77
/// (docs/PERFORMANCE-LOG.md).
pub const DOUBLING_MAX: usize = 2 << 20;

/// Largest all-gather (bytes of the whole output) Bruck's algorithm is considered for over
/// links with α ≥ 5 µs (TCP, RDMA): its steps send whole blocks, one message each, where
/// the ring pipelines slices, and beyond this the ring wins. `roccl-perf`, 8 ranks over TCP
/// on 2 cores, alternating runs (docs/PERFORMANCE-LOG.md): 64 KiB Bruck 0.66–0.69 of the ring's
/// time, 128 KiB 0.72–1.09, 256 KiB 1.05–1.18, 1 MiB 1.09–1.35.
pub const BRUCK_GATHER_MAX: usize = 128 << 10;

/// [`BRUCK_GATHER_MAX`] for the reduce-scatter and the all-reduce (same runs: 512 KiB
/// 0.82–0.83 of the ring's time, 1 MiB 1.78–1.93).
pub const BRUCK_REDUCE_MAX: usize = 512 << 10;

/// Largest call Bruck's algorithms are considered for over shared memory (α < 2 µs): 8
/// ranks, 32 KiB 0.50–0.78 of the ring's time, 128 KiB 0.18–1.04, 512 KiB 0.86–1.26.
pub const BRUCK_SHM_MAX: usize = 128 << 10;

/// Whether the model considers Bruck's algorithms for a call: up to their fitted sizes;
/// for all-reduce only from 4 ranks (on 2 and 3 it is the two-shot's exchange in as many
/// steps, or more). The sizes were fitted on 8 ranks, where the ring's steps are few; past
/// 16 ranks the estimates decide alone (the simulator, 256 ranks of their own hosts at
/// 100 Gbit/s, 1 MiB all-reduce: Bruck 216 µs, two-shot 510, the ring and tree more;
/// docs/PERFORMANCE-LOG.md).
fn bruck_applies(kind: CollKind, n: usize, bytes: usize, c: &LinkCost) -> bool {
    let max = match kind {
        // Shared memory (α of 1 µs; a network's is at least 2).
        _ if c.alpha_us < 2.0 => BRUCK_SHM_MAX,
        CollKind::AllGather => BRUCK_GATHER_MAX,
        _ => BRUCK_REDUCE_MAX,
    };
    (bytes <= max || n > 16) && (kind != CollKind::AllReduce || n >= 4)
}

/// Reduction speed of `dt` relative to f32, from the kernels' throughput in cache
/// (`cargo bench --bench reduce`, 2026-11-30 15:00 UTC, AVX-512 versions: f32 45.6 GB/s, bf16
/// 27.1, f16 3.16, fp8 2.46): the 16-bit and 8-bit floats are widened to f32 and rounded back,
/// so reductions cost more and algorithms that reduce less (two-shot) win earlier.
pub fn reduce_factor(dt: DataType) -> f64 {
    match dt {
        DataType::Bf16 => 0.59,
        DataType::F16 => 0.069,
        DataType::F8E4M3 | DataType::F8E5M2 => 0.054,
        _ => 1.0,
    }
}

/// [`choose`] for data of type `dt` (its reduction speed scales γ).
pub fn choose_for(
    kind: CollKind,
    dt: DataType,
    n: usize,
    bytes: usize,
    c: &LinkCost,
    forced: Option<Algo>,
    t: &Tuning,
) -> (Algo, Pipeline) {
    choose(kind, n, bytes, &scaled_for(c, dt), forced, t)
}

/// `c` with its reduction speeds scaled for data of type `dt`.
fn scaled_for(c: &LinkCost, dt: DataType) -> LinkCost {
    LinkCost {
        gamma_gbs: c.gamma_gbs * reduce_factor(dt),
        wire_gamma_gbs: c.wire_gamma_gbs * reduce_factor(dt),
        ..*c
    }
}

/// How a job spreads over hosts, for [`estimate_hier`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layers {
    /// Hosts in the job.
    pub hosts: usize,
    /// The most ranks on one host.
    pub local: usize,
    /// Every host holds `local` ranks.
    pub even: bool,
    /// The NICs each host's ranks spread over (the fewest of any host): the phases between
    /// hosts, one flow per local index, share `min(nics, local)` NICs.
    pub nics: usize,
}

/// The model's best flat estimate in µs of `kind` on `n` ranks over links `c`.
fn best(kind: CollKind, dt: DataType, n: usize, bytes: usize, c: &LinkCost, t: &Tuning) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let (a, pl) = choose_for(kind, dt, n, bytes, c, None, t);
    let scaled = LinkCost {
        wire_gamma_gbs: c.wire_gamma_gbs * reduce_factor(dt),
        ..*c
    };
    estimate(kind, a, n, bytes, &scaled, &pl)
}

/// Estimated time in µs of the hierarchical version of `kind` (all-reduce, broadcast,
/// reduce) of `bytes` bytes: phases inside hosts over `intra`, between hosts over `inter`.
/// Even hosts all-reduce as a reduce-scatter inside each host, an all-reduce of each 1/m
/// share between the ranks of one local index (the m shares share the host's NIC), and an
/// all-gather inside each host; uneven hosts reduce to one rank per host, all-reduce
/// between those, and broadcast inside each host. `None` for collectives without one.
pub fn estimate_hier(
    kind: CollKind,
    dt: DataType,
    bytes: usize,
    l: Layers,
    intra: &LinkCost,
    inter: &LinkCost,
    t: &Tuning,
) -> Option<f64> {
    let m = l.local;
    // The m flows between hosts of each host share its NICs; a group of one rank per host
    // (leaders, or one local index) has the NICs to itself.
    let nic_share = l.nics.clamp(1, m.max(1)) as f64 / m.max(1) as f64;
    let inter = &LinkCost {
        nic_share: 1.0,
        ..*inter
    };
    Some(match kind {
        CollKind::AllReduce if l.even => {
            let nic = LinkCost {
                beta_gbs: inter.beta_gbs * nic_share,
                nic_share: 1.0,
                ..*inter
            };
            let ring = |k| {
                let pl = pipeline(bytes / m.max(1), bytes, t);
                estimate(k, Algo::Ring, m, bytes, intra, &pl)
            };
            ring(CollKind::ReduceScatter)
                + best(CollKind::AllReduce, dt, l.hosts, bytes / m.max(1), &nic, t)
                + ring(CollKind::AllGather)
        }
        CollKind::AllReduce => {
            best(CollKind::Reduce, dt, m, bytes, intra, t)
                + best(CollKind::AllReduce, dt, l.hosts, bytes, inter, t)
                + best(CollKind::Broadcast, dt, m, bytes, intra, t)
        }
        CollKind::Broadcast | CollKind::Reduce => {
            best(kind, dt, l.hosts, bytes, inter, t) + best(kind, dt, m, bytes, intra, t)
        }
        // Between hosts a ring of h ranks over B/m (the m rings share the NICs); inside, one
        // step: every rank gives each other rank of its host (m-1)/m of the blocks it has.
        CollKind::AllGather | CollKind::ReduceScatter if l.even => {
            let nic = LinkCost {
                beta_gbs: inter.beta_gbs * nic_share,
                nic_share: 1.0,
                ..*inter
            };
            let pl = pipeline(bytes / l.hosts.max(1), bytes, t);
            let between = estimate(kind, Algo::Ring, l.hosts, bytes / m.max(1), &nic, &pl);
            let b = bytes as f64 * (m as f64 - 1.0) / (m * l.hosts) as f64;
            let inside = if m > 1 {
                intra.alpha_us + fan_out(m, intra) + b / (intra.beta_gbs * 1e3)
            } else {
                0.0
            };
            between + inside
        }
        // Uneven hosts, through leaders: B/n per local rank to (from) the leader, an exchange
        // between the leaders (each sends its host's m/n of B to, and takes the rest from,
        // the others at once), the whole buffer from (to) the leader to (from) the m-1 others.
        CollKind::AllGather | CollKind::ReduceScatter => {
            let (b, n) = (bytes as f64, (m * l.hosts).max(1) as f64);
            let per_us = |c: &LinkCost| c.beta_gbs * 1e3;
            let edge = |bytes: f64| {
                if m > 1 {
                    intra.alpha_us + fan_out(m, intra) + bytes / per_us(intra)
                } else {
                    0.0
                }
            };
            let between = inter.alpha_us
                + fan_out(l.hosts, inter)
                + b * (l.hosts as f64 - 1.0) * m as f64 / n / per_us(inter);
            edge(b * (m as f64 - 1.0) / n) + between + edge(b * (m as f64 - 1.0))
        }
        _ => return None,
    })
}

/// A forced algorithm the collective does not have is replaced by the model's choice; say so
/// (once per collective and algorithm in a process).
fn warn_not_applicable<'a>(kind: CollKind, f: Algo, cands: impl Iterator<Item = &'a Algo>) {
    static SAID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let bit = 1u64 << (kind as u32 * 8 + f as u32);
    if SAID.fetch_or(bit, std::sync::atomic::Ordering::Relaxed) & bit == 0 {
        let have: Vec<&str> = cands.map(|a| a.name()).collect();
        crate::log::log(
            crate::log::Level::Warn,
            format_args!(
                "algorithm {f} (ROCCL_ALGO / --algo) does not apply to {kind:?} here (it has {}): the cost model chooses instead",
                have.join(", ")
            ),
        );
    }
}

/// Whether `a` reduces every element of `kind` in rank order, with the same kernels as
/// the others that do (`algo/ordered.rs`): a call of the deterministic mode returns the
/// same bits whichever of them runs it.
pub fn rank_ordered(kind: CollKind, a: Algo) -> bool {
    match kind {
        CollKind::AllReduce => matches!(
            a,
            Algo::Direct | Algo::TwoShot | Algo::ShmOneShot | Algo::ShmTwoShot
        ),
        CollKind::Reduce | CollKind::ReduceScatter => matches!(a, Algo::Direct | Algo::ShmOneShot),
        CollKind::Broadcast | CollKind::AllGather | CollKind::AllToAll => true,
    }
}

/// [`choose_for`] in the deterministic mode: for a reducing collective, only algorithms
/// that reduce in rank order ([`rank_ordered`]) — the one-shot or two-shot all-reduce
/// (through shared memory when every rank is on this host), the direct reduce-scatter and
/// reduce; a `forced` algorithm applies only if it is one of them. Other collectives move
/// bytes without arithmetic and choose as usual.
pub fn choose_ordered(
    kind: CollKind,
    dt: DataType,
    n: usize,
    bytes: usize,
    c: &LinkCost,
    forced: Option<Algo>,
    t: &Tuning,
) -> (Algo, Pipeline) {
    let flat = c.flat_sync_us.is_some() && n > 1;
    let cands: &[Algo] = match (kind, flat) {
        (CollKind::AllReduce, true) => &[Algo::ShmOneShot, Algo::ShmTwoShot],
        (CollKind::AllReduce, false) if bytes <= DIRECT_MAX => &[Algo::Direct, Algo::TwoShot],
        (CollKind::AllReduce, false) => &[Algo::TwoShot],
        (CollKind::Reduce | CollKind::ReduceScatter, true) => &[Algo::ShmOneShot],
        (CollKind::Reduce | CollKind::ReduceScatter, false) => &[Algo::Direct],
        _ => return choose_for(kind, dt, n, bytes, c, forced, t),
    };
    let scaled = scaled_for(c, dt);
    let pl = pipeline(bytes, bytes, t);
    let pick = forced.filter(|f| cands.contains(f)).or_else(|| {
        cands.iter().copied().min_by(|&a, &b| {
            let (ea, eb) = (
                estimate(kind, a, n, bytes, &scaled, &pl),
                estimate(kind, b, n, bytes, &scaled, &pl),
            );
            ea.total_cmp(&eb)
        })
    });
    (pick.unwrap_or(cands[0]), pl)
}

/// Choose algorithm and pipeline (reductions at `c.gamma_gbs`). `forced` wins when the
/// collective has it; otherwise the model chooses and a WARN says so.
pub fn choose(
    kind: CollKind,
    n: usize,
    bytes: usize,
    c: &LinkCost,
    forced: Option<Algo>,
    t: &Tuning,
) -> (Algo, Pipeline) {
    let flat: &[Algo] = if c.flat_sync_us.is_some() && n > 1 {
        flat_candidates(kind)
    } else {
        &[]
    };
    let cands = candidates(kind).iter().chain(flat);
    let piece = |a: Algo| match (kind, a) {
        (CollKind::AllReduce, Algo::Ring) => bytes / n.max(1),
        (CollKind::AllReduce, Algo::Tree) => bytes / 2,
        _ => bytes,
    };
    if let Some(f) = forced {
        if cands.clone().any(|a| *a == f) {
            return (f, pipeline(piece(f), bytes, t));
        }
        warn_not_applicable(kind, f, cands.clone());
    }
    let mut best = (candidates(kind)[0], f64::INFINITY);
    for &a in cands {
        let limit = match a {
            Algo::Direct => DIRECT_MAX,
            // Over a network, one whole-buffer exchange beats the ring's pipelined slices up
            // to a few MiB; over shared memory (α of 1 µs) it does not (fitted, see
            // DOUBLING_MAX). A network's α is at least 2 µs: 5 µs of software over TCP and
            // the RoCE engine, or the simulated cluster's latency plus two message overheads.
            Algo::Doubling | Algo::TwoShot if c.alpha_us >= 2.0 => DOUBLING_MAX,
            Algo::Doubling => DIRECT_MAX,
            // Over shared memory the flat two-shot (`shm2`) does this job.
            Algo::TwoShot => 0,
            _ => usize::MAX,
        };
        if kind == CollKind::AllReduce && bytes > limit {
            continue;
        }
        if a == Algo::Bruck && !bruck_applies(kind, n, bytes, c) {
            continue;
        }
        let e = estimate(kind, a, n, bytes, c, &pipeline(piece(a), bytes, t));
        if e < best.1 {
            best = (a, e);
        }
    }
    let mut pl = pipeline(piece(best.0), bytes, t);
    if kind == CollKind::Broadcast && n == 2 && best.0 == Algo::Ring && t.slice.is_none() {
        // A chain of two has nothing to overlap: one message (TCP, 2 ranks, 1 MiB: 204 µs
        // as one slice vs 322 µs as four; docs/PERFORMANCE-LOG.md), up to 16 MiB (measured up
        // to there; networks also bound a message, e.g. RoCE at 512 MiB). Broadcast stages
        // nothing.
        pl.slice = bytes.clamp(64, 16 << 20);
    }
    if kind == CollKind::AllGather
        && n == 2
        && best.0 == Algo::Ring
        && t.slice.is_none()
        && c.alpha_us >= 5.0
    {
        // Likewise a 2-rank ring all-gather is one exchange with nothing to forward, and
        // over links that pay system calls per message each slice costs (TCP, 1 MiB: 118–123
        // µs in 256 KiB slices, 102–109 as one; 64 MiB: 14.4–15.4 ms in 512 KiB slices,
        // 12.8–13.1 in 32 MiB; docs/PERFORMANCE-LOG.md): each rank's block in one message, up to
        // 16 MiB as above.
        pl.slice = (bytes / 2).clamp(64, 16 << 20);
    }
    (best.0, pl)
}

#[cfg(test)]
mod tests;
