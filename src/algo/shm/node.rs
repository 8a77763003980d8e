//! One shared-memory segment per rank for collectives among the ranks of one host.
//!
//! When every rank of a communicator is on this host, each rank maps every other rank's
//! segment, and a collective costs one synchronisation instead of messages: a rank copies its
//! input into its own slot, bumps its `arrive` counter, waits for the counters of the ranks
//! it reads, and reduces or copies straight out of their slots (see the parent module).
//!
//! Layout of a rank's segment: eight cache lines ([`NodeHeader`]: two `arrive` lines;
//! `result`; the number of ranks sleeping on this segment's counters; fixed facts: pid and
//! its namespace, slot size, the attach and broken flags; what each of the two latest calls
//! is, so ranks that called different things fail instead of reading each other's bytes;
//! single-copy addresses; `done`), then, from 4 KiB, two input slot sets and one result area
//! of `slot` bytes each.
//!
//! Slot reuse needs no extra step: flat call `k` writes input set `k % 2`, and before that it
//! waits until every peer has begun call `k − 1`, which a peer does only after it finished
//! call `k − 2`, the last one that read set `k % 2`. A rank writes its result area in call
//! `k` only after all peers began call `k`, so they are done with call `k − 1`'s results.
//!
//! Waiting follows the communicator's [`Waiter`]: spin, yield, then sleep in `futex(2)` on
//! the counter awaited (the writer looks for sleepers after its own wait, at the end of the
//! call or before a long copy — [`Node::flush_wakes`] — and wakes them only when the segment
//! says there are any).
//! While sleeping, the waiter checks that the lagging peers' processes exist and have not
//! marked their communicator broken, so a dead peer is named within ~10 ms.

use std::cell::Cell;
use std::ffi::CString;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::os::futex::{futex_wait, futex_wake};
use crate::os::process::{cma_read, cma_write, pid_namespace, process_gone, CMA_PROBE};
use crate::os::shm::Segment;
use crate::os::wait::Waiter;
use crate::types::{DataType, RedOp};

/// Bytes before the slots (a page, so slots start page-aligned).
const NODE_HDR: usize = 4096;

/// Polls of a counter after which a waiting rank wakes the peers sleeping on what it
/// published (see [`Node::flush_wakes`]): a few microseconds of spinning.
const SPIN_BEFORE_WAKES: u32 = 64;

/// Bytes of input a call can carry in its arrive line ([`Node::set_inline`]).
pub(crate) const INLINE: usize = 56;

/// One cache line: a call's arrive word and, for the smallest calls, its input, so that a
/// reader gets both with one cache-line transfer.
#[repr(C, align(64))]
struct ArriveLine {
    /// SegmentCall calls of this parity whose input this rank has published (low 32 bits) and a
    /// hash of what the call is (high 32 bits): one store publishes both, one load checks
    /// both.
    word: AtomicU64,
    /// Up to [`INLINE`] bytes of the call's input (little-endian words).
    data: [AtomicU64; INLINE / 8],
}

#[repr(C)]
struct NodeHeader {
    /// Arrive lines of even and odd calls: call k publishes in line k mod 2, which peers
    /// last read in call k − 2 (they have begun call k − 1, so they are done with it).
    arrive: [ArriveLine; 2],
    /// SegmentCall calls whose reduced chunk this rank has published (two-shot; low 32 bits).
    result: AtomicU64,
    _p1: [u8; 56],
    /// Ranks sleeping in futex(2) on this segment's counters.
    sleepers: AtomicU32,
    _p2: [u8; 60],
    pid: AtomicU32,
    slot_kib: AtomicU32,
    /// 0 while attaching, 1 attached to every peer, 2 attaching failed.
    attached: AtomicU32,
    /// Set when this rank's communicator failed or was aborted.
    broken: AtomicU32,
    /// The pid namespace of `pid` (inode of /proc/self/ns/pid): pids are compared only
    /// within one namespace.
    pidns: AtomicU64,
    /// Address of the CMA probe word in this rank's process: peers try to read it with
    /// process_vm_readv at attach.
    probe: AtomicU64,
    /// 1 when this rank could read every peer's probe (single-copy broadcast possible).
    cma_ok: AtomicU32,
    _p3: [u8; 28],
    /// What the call of each input slot set is (bytes per rank, collective code), so that
    /// ranks that called different collectives or counts get an error instead of each
    /// other's bytes. Not on the line of `arrive`: a line written three times per call
    /// bounces between the writer and the spinning readers (2-rank 8 B all-reduce: 0.55 µs
    /// that way, 0.42 µs apart).
    meta: [[AtomicU64; 2]; 2],
    /// Single-copy calls (broadcast, all-gather, all-reduce) of each input slot set's call:
    /// this rank's source buffer address and length, which the others read with
    /// process_vm_readv.
    direct: [[AtomicU64; 2]; 2],
    /// Single-copy all-reduce: this rank's output buffer address and length (the others read
    /// its reduced share there).
    direct_out: [[AtomicU64; 2]; 2],
    /// Single-copy broadcast root: the call whose shares it may be writing into the
    /// readers' outputs (64-bit call number; see [`Node::write_direct_at`]).
    writing: AtomicU64,
    _p4: [u8; 24],
    /// Single-copy all-reduce: calls in which every peer may have read this rank's buffers
    /// and this rank has finished reading theirs (low 32 bits).
    done: AtomicU64,
    _p5: [u8; 56],
}

const _: () = assert!(std::mem::size_of::<NodeHeader>() == 512);

/// Which counter of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counter {
    /// Input published.
    Arrive,
    /// Reduced chunk published.
    Result,
    /// Done with every peer's buffers (single-copy all-reduce), or done writing into them
    /// (single-copy broadcast root).
    Done,
}

/// Which area of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Area {
    /// The input slot set of a call.
    Input,
    /// The result area.
    Result,
}

/// A collective's code for [`Node::begin`]: kind, data type, op, algorithm variant (0
/// one-shot, 1 two-shot: ranks that would run different protocols must not pair up) and
/// root in one word.
pub(crate) fn code(kind: u8, dtype: u8, op: u8, variant: u8, root: Option<usize>) -> u64 {
    u64::from(kind)
        | u64::from(dtype) << 8
        | u64::from(op) << 16
        | u64::from(variant) << 24
        | root.map_or(0xffff_ffff, |r| r as u64 & 0xffff_ffff) << 32
}

fn describe(code: u64) -> String {
    let kind = [
        "?",
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "barrier",
    ]
    .get((code & 0xff) as usize)
    .copied()
    .unwrap_or("?");
    let dt = DataType::ALL
        .iter()
        .find(|d| **d as u64 == (code >> 8) & 0xff)
        .map_or("?", |d| d.name());
    let op = RedOp::ALL
        .iter()
        .find(|o| **o as u64 == (code >> 16) & 0xff)
        .map_or("?", |o| o.name());
    let variant = if (code >> 24) & 0xff == 1 {
        ", two-shot"
    } else {
        ""
    };
    match code >> 32 {
        0xffff_ffff => format!("{kind} ({dt}, {op}{variant})"),
        root => format!("{kind} ({dt}, {op}, root {root}{variant})"),
    }
}

/// The 64-bit number of 32-bit call `k`, given the current call's numbers in both widths
/// (`k` is the current call or one shortly before it).
fn full_call(calls64: u64, calls: u32, k: u32) -> u64 {
    calls64.wrapping_sub(u64::from(calls.wrapping_sub(k)))
}

/// Whether counter value `v` has reached call `k` (counters wrap).
fn reached(v: u32, k: u32) -> bool {
    v.wrapping_sub(k) as i32 >= 0
}

/// Slot size in bytes when `ROCCL_SHM_SLOT` is unset.
pub(crate) const DEFAULT_SLOT: usize = 256 << 10;

/// A slot size in bytes (`ROCCL_SHM_SLOT`, a multiple of 4096 up to 64 MiB): larger calls
/// run in pieces of this size.
pub(crate) fn parse_slot(v: &str) -> Result<usize> {
    match v.trim().parse::<usize>() {
        Ok(n) if n % 4096 == 0 && (4096..=64 << 20).contains(&n) => Ok(n),
        _ => Err(Error::arg(format!(
            "ROCCL_SHM_SLOT={v}: expected a multiple of 4096 from 4096 to 67108864 bytes"
        ))),
    }
}

fn seg_name(tag: u64, rank: usize) -> CString {
    CString::new(format!("/roccl-node-{tag:016x}-{rank}")).expect("no NUL in a formatted name")
}

/// This rank's segment, created before the rendezvous so that peers can open it after.
pub(crate) struct NodeSeg {
    seg: Segment,
    name: CString,
    slot: usize,
    linked: bool,
}

impl NodeSeg {
    /// Create rank `rank`'s segment for the communicator tagged `tag`.
    pub(crate) fn create(tag: u64, rank: usize, slot: usize) -> Result<NodeSeg> {
        if slot % 4096 != 0 || !(4096..=64 << 20).contains(&slot) {
            return Err(Error::arg(format!(
                "shared-memory slot of {slot} bytes: expected a multiple of 4096 from 4096 to 67108864"
            )));
        }
        let name = seg_name(tag, rank);
        let seg = Segment::create(&name, NODE_HDR + 3 * slot)?;
        let s = NodeSeg {
            seg,
            name,
            slot,
            linked: true,
        };
        let h = header(&s.seg);
        h.pid.store(std::process::id(), Ordering::Relaxed);
        h.pidns.store(pid_namespace(), Ordering::Relaxed);
        h.probe
            .store(&CMA_PROBE as *const u64 as u64, Ordering::Relaxed);
        h.slot_kib.store((slot >> 10) as u32, Ordering::Release);
        Ok(s)
    }

    fn unlink(&mut self) {
        if self.linked {
            // SAFETY: unlinking the name we created; mappings stay valid.
            unsafe { libc::shm_unlink(self.name.as_ptr()) };
            self.linked = false;
        }
    }
}

impl Drop for NodeSeg {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// Remove the node segments of the communicator tagged `tag` that ranks other than `me`
/// left behind when their process died (killed during initialization, before they could
/// unlink their own name). Called by a rank that fails initialization: whoever notices the
/// death cleans up. A segment is removed only when its header names a process of our pid
/// namespace that is gone, so a live rank's segment (or another job's) is never touched.
/// Returns the ranks whose segment was removed.
pub(crate) fn remove_dead_segments(tag: u64, me: usize, nranks: usize) -> Vec<usize> {
    let ns = pid_namespace();
    let mut removed = Vec::new();
    for r in (0..nranks).filter(|&r| r != me) {
        let name = seg_name(tag, r);
        let Ok(s) = Segment::open(&name, NODE_HDR) else {
            continue; // never created, or unlinked already
        };
        let h = header(&s);
        // The slot size is published last (Release): before it, the pid may not be there.
        if h.slot_kib.load(Ordering::Acquire) == 0 || ns == 0 {
            continue;
        }
        let pid = h.pid.load(Ordering::Relaxed);
        if h.pidns.load(Ordering::Relaxed) == ns && pid != std::process::id() && process_gone(pid) {
            // SAFETY: unlinking a name of this job whose owner is gone; mappings stay valid.
            unsafe { libc::shm_unlink(name.as_ptr()) };
            removed.push(r);
        }
    }
    if !removed.is_empty() {
        crate::info!(
            "rank {me}: removed the shared-memory segments of {}, whose process is gone",
            crate::error::ranks_list(&removed)
        );
    }
    removed
}

fn header(seg: &Segment) -> &NodeHeader {
    // SAFETY: every node segment starts with a NodeHeader (zeroed by the kernel at creation);
    // all of its fields are atomics or padding.
    unsafe { &*(seg.base() as *const NodeHeader) }
}

/// The bit of counter `c` of call `k` in [`Node::unwoken`] (the order of
/// [`Node::flush_wakes`]'s words).
fn wake_bit(c: Counter, k: u32) -> u8 {
    match c {
        Counter::Arrive => 1 << (k & 1),
        Counter::Result => 4,
        Counter::Done => 8,
    }
}

/// Every rank's segment, mapped: the flat collectives' view of the host.
pub(crate) struct Node {
    me: usize,
    own: NodeSeg,
    /// Peers' segments by rank (`None` at our own rank).
    peers: Vec<Option<Segment>>,
    pids: Vec<u32>,
    slot: usize,
    /// Pids for process_vm_readv (0: not in our pid namespace).
    cma_pids: Vec<u32>,
    /// Every rank can read every other directly.
    cma: bool,
    /// SegmentCall calls begun so far.
    calls: u32,
    /// The same, not wrapping: `result` and `done` carry it (not every call publishes them,
    /// so a 32-bit value could fall 2^31 calls behind and read as ahead).
    calls64: u64,
    /// Hash of the current call's description (published with `arrive`).
    tag: u32,
    /// Counters published since the last [`Node::flush_wakes`] (a bit per counter word)
    /// whose sleepers have not been looked for yet.
    unwoken: Cell<u8>,
    /// Futex sleeps and wakes of this rank (`metrics`: `roccl_net_node_sleeps_total`, …).
    pub(crate) stats: std::sync::Arc<NodeStats>,
}

/// What the shared-memory collectives count: waits that slept on a futex, and futex wakes
/// of sleeping peers.
#[derive(Default)]
pub(crate) struct NodeStats {
    pub(crate) sleeps: std::sync::atomic::AtomicU64,
    pub(crate) wakeups: std::sync::atomic::AtomicU64,
}

// SAFETY: the mappings are plain shared memory; all cross-rank access goes through the
// counters' acquire/release protocol described at the top of this module.
unsafe impl Send for Node {}

impl Node {
    /// Open every peer's segment and agree with all of them that the flat path works: each
    /// rank raises its attach flag (1 ok, 2 failed) and waits for everyone's; any failure
    /// means every rank goes without (`Ok(None)`). Our own name is unlinked once all peers
    /// have mapped it.
    pub(crate) fn attach(
        mut own: NodeSeg,
        tag: u64,
        me: usize,
        nranks: usize,
        w: &Waiter,
        abort: &AtomicBool,
    ) -> Result<Option<Node>> {
        let (peers, why) = Self::open_peer_segments(&own, tag, me, nranks);
        let cma_pids = Self::peer_pids(&peers, me, nranks);
        let cma_ok = Self::can_read_every_peer(&peers, &cma_pids, me);
        let mine = header(&own.seg);
        mine.cma_ok.store(u32::from(cma_ok), Ordering::Relaxed);
        mine.attached
            .store(if why.is_some() { 2 } else { 1 }, Ordering::Release);
        // Wait for every peer's verdict (peers we could not open count as failed).
        let peer_failed = Self::wait_for_verdicts(&peers, &cma_pids, tag, me, nranks, w, abort)?;
        let failed = why.is_some() || peer_failed;
        own.unlink();
        if failed {
            crate::info!(
                "rank {me}: flat shared-memory collectives off ({}): collectives use the shared-memory rings",
                why.unwrap_or_else(|| "a peer could not attach".into())
            );
            return Ok(None);
        }
        // Liveness checks by pid only within our pid namespace, and never on our own process.
        let pids = cma_pids
            .iter()
            .map(|&p| if p == std::process::id() { 0 } else { p })
            .collect();
        // Every rank could read every other: single-copy broadcasts (all decide alike).
        let cma = cma_ok
            && peers
                .iter()
                .flatten()
                .all(|s| header(s).cma_ok.load(Ordering::Relaxed) == 1);
        let slot = own.slot;
        Ok(Some(Node {
            me,
            own,
            peers,
            pids,
            cma_pids,
            cma,
            slot,
            calls: 0,
            calls64: 0,
            tag: 0,
            unwoken: Cell::new(0),
            stats: std::sync::Arc::default(),
        }))
    }

    /// Map every other rank's segment (`None` at our own rank and at those that would not
    /// open), with the first reason the flat path cannot be used: a segment that would not
    /// open, or a peer whose slot size differs from ours, since all must lay out alike.
    fn open_peer_segments(
        own: &NodeSeg,
        tag: u64,
        me: usize,
        nranks: usize,
    ) -> (Vec<Option<Segment>>, Option<String>) {
        let mut peers = Vec::with_capacity(nranks);
        let mut why = None;
        for r in 0..nranks {
            if r == me {
                peers.push(None);
                continue;
            }
            match Segment::open(&seg_name(tag, r), NODE_HDR + 3 * own.slot) {
                Ok(s) => {
                    let kib = header(&s).slot_kib.load(Ordering::Acquire) as usize;
                    if kib << 10 != own.slot {
                        why.get_or_insert(format!(
                            "rank {r} uses ROCCL_SHM_SLOT={} but this rank {}",
                            kib << 10,
                            own.slot
                        ));
                    }
                    peers.push(Some(s));
                }
                Err(e) => {
                    why.get_or_insert(e.to_string());
                    peers.push(None);
                }
            }
        }
        (peers, why)
    }

    /// Every rank's pid as this process can use it: our own, and each peer's when it lives
    /// in our pid namespace (0 otherwise, and for peers not mapped), since a pid from
    /// another namespace names some other process here.
    fn peer_pids(peers: &[Option<Segment>], me: usize, nranks: usize) -> Vec<u32> {
        let ns = pid_namespace();
        (0..nranks)
            .map(|r| match &peers[r] {
                None if r == me => std::process::id(),
                None => 0,
                Some(s) => {
                    let h = header(s);
                    if ns != 0 && h.pidns.load(Ordering::Relaxed) == ns {
                        h.pid.load(Ordering::Relaxed)
                    } else {
                        0
                    }
                }
            })
            .collect()
    }

    /// Whether this rank can read every peer's memory directly (process_vm_readv), tried
    /// on the probe word each peer publishes: it fails across pid namespaces and under a
    /// restrictive ptrace policy, and single-copy transfers need it towards everyone.
    fn can_read_every_peer(peers: &[Option<Segment>], cma_pids: &[u32], me: usize) -> bool {
        peers.iter().enumerate().all(|(r, p)| {
            let Some(s) = p else { return r == me };
            let mut word = 0u64;
            cma_pids[r] != 0
                && cma_read(
                    cma_pids[r] as i32,
                    header(s).probe.load(Ordering::Relaxed),
                    bytemuck::bytes_of_mut(&mut word),
                )
                .is_ok()
                && word == CMA_PROBE
        })
    }

    /// Wait until every mapped peer has raised its attach flag, and say whether any of them
    /// failed. The application's abort ends the wait with an error; so do a peer whose
    /// process has exited and the timeout, after removing the segments of dead ranks, so
    /// that a rank that died during initialization neither holds the others for ever nor
    /// leaves its segments behind.
    fn wait_for_verdicts(
        peers: &[Option<Segment>],
        cma_pids: &[u32],
        tag: u64,
        me: usize,
        nranks: usize,
        w: &Waiter,
        abort: &AtomicBool,
    ) -> Result<bool> {
        let start = Instant::now();
        let mut failed = false;
        for (r, p) in peers.iter().enumerate() {
            let Some(s) = p else { continue };
            let mut polls = 0u32;
            loop {
                polls = polls.wrapping_add(1);
                match header(s).attached.load(Ordering::Acquire) {
                    0 if abort.load(Ordering::Relaxed) => {
                        return Err(Error::InvalidUsage(format!(
                            "rank {me}: initialization was aborted by the application while waiting for rank {r} to attach to the host's shared-memory segments"
                        )))
                    }
                    // Every ~10 ms: is its process still there?
                    0 if polls % 512 == 0
                        && r != me
                        && cma_pids[r] != 0
                        && process_gone(cma_pids[r]) =>
                    {
                        remove_dead_segments(tag, me, nranks);
                        return Err(Error::Remote {
                            rank: r,
                            cause: crate::error::PeerCause::Exited,
                            msg: format!(
                                "its process {} exited during initialization, before it attached to the host's shared-memory segments",
                                cma_pids[r]
                            ),
                        });
                    }
                    0 if start.elapsed() < w.timeout => {
                        std::thread::sleep(Duration::from_micros(20))
                    }
                    0 => {
                        remove_dead_segments(tag, me, nranks);
                        return Err(Error::timeout(vec![r], format!(
                            "rank {r} never attached to the host's shared-memory segments within {:.0?} (ROCCL_TIMEOUT): it may have died during initialization",
                            w.timeout
                        )));
                    }
                    1 => break,
                    _ => {
                        failed = true;
                        break;
                    }
                }
            }
        }
        Ok(failed)
    }

    /// Bytes of one slot (the largest piece of a flat call).
    pub(crate) fn slot(&self) -> usize {
        self.slot
    }

    /// Whether single-copy (process_vm_readv) transfers work between every pair of ranks.
    pub(crate) fn cma(&self) -> bool {
        self.cma
    }

    /// Publish `buf` as this rank's source of call `k`'s single-copy broadcast or all-gather.
    pub(crate) fn set_direct(&self, k: u32, buf: &[u8]) {
        let d = &header(&self.own.seg).direct[k as usize & 1];
        d[0].store(buf.as_ptr() as u64, Ordering::Relaxed);
        d[1].store(buf.len() as u64, Ordering::Relaxed);
    }

    /// Put `input` (at most [`INLINE`] bytes) into this rank's arrive line of call `k`, to
    /// be published with it.
    pub(crate) fn set_inline(&self, k: u32, input: &[u8]) {
        let mut b = [0u8; INLINE];
        b[..input.len()].copy_from_slice(input);
        let line = &header(&self.own.seg).arrive[k as usize & 1];
        for (w, chunk) in line.data.iter().zip(b.chunks_exact(8)) {
            w.store(
                u64::from_le_bytes(chunk.try_into().expect("8 bytes")),
                Ordering::Relaxed,
            );
        }
    }

    /// Rank `r`'s input of call `k` from its arrive line (after waiting for its arrive):
    /// the first `out.len()` (at most [`INLINE`]) bytes.
    pub(crate) fn get_inline(&self, r: usize, k: u32, out: &mut [u8]) {
        let line = &header(self.seg(r)).arrive[k as usize & 1];
        let mut b = [0u8; INLINE];
        for (w, chunk) in line.data.iter().zip(b.chunks_exact_mut(8)) {
            chunk.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        out.copy_from_slice(&b[..out.len()]);
    }

    /// Publish `buf` as this rank's output of call `k`'s single-copy all-reduce.
    pub(crate) fn set_direct_out(&self, k: u32, buf: &[u8]) {
        let d = &header(&self.own.seg).direct_out[k as usize & 1];
        d[0].store(buf.as_ptr() as u64, Ordering::Relaxed);
        d[1].store(buf.len() as u64, Ordering::Relaxed);
    }

    /// Copy rank `r`'s published source of call `k` into `out` with process_vm_readv.
    pub(crate) fn read_direct(&self, r: usize, k: u32, out: &mut [u8]) -> Result<()> {
        let len = self.published_len(r, k);
        if len != out.len() {
            return Err(Error::Internal(format!(
                "rank {r} published {len} bytes for a single-copy transfer of {}",
                out.len()
            )));
        }
        self.read_direct_at(r, k, false, 0, out)
    }

    /// Copy bytes `off..off + out.len()` of rank `r`'s published source (`output`: its
    /// published output) of call `k` into `out` with process_vm_readv.
    pub(crate) fn read_direct_at(
        &self,
        r: usize,
        k: u32,
        output: bool,
        off: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let addr = self.published(r, k, output, off, out.len())?;
        cma_read(self.cma_pids[r] as i32, addr, out)
            .map_err(|e| self.cma_error(r, "process_vm_readv", e))?;
        // Rank `r` may have given up on this call (a timeout) and handed its buffer back to
        // the application while we copied out of it. A failing rank marks its communicator
        // broken before its call returns, so a copy that may have seen the buffer change
        // sees the mark here and is not reported as data.
        fence(Ordering::SeqCst);
        if header(self.seg(r)).broken.load(Ordering::SeqCst) != 0 {
            return Err(self.broken_peer(
                r,
                "its communicator failed while this rank copied from its buffer, so the copy may hold what the application wrote there afterwards",
            ));
        }
        Ok(())
    }

    /// Length of the source rank `r` published for call `k` ([`Node::set_direct`]).
    pub(crate) fn published_len(&self, r: usize, k: u32) -> usize {
        header(self.seg(r)).direct[k as usize & 1][1].load(Ordering::Relaxed) as usize
    }

    /// Copy `data` into bytes `off..off + data.len()` of rank `r`'s published output of
    /// call `k` with process_vm_writev. Writing into another process needs its consent for
    /// the whole time of the write: this rank first raises its `writing` mark for call `k`,
    /// then reads the output `r` published (both sequentially consistent); a rank that gives
    /// up on the call withdraws its output and then looks at the mark
    /// ([`Node::withdraw_output`]), so either the write sees the output gone or the rank
    /// waits until the write is over. A rank that marked its communicator broken is not
    /// written to.
    pub(crate) fn write_direct_at(&self, r: usize, k: u32, off: usize, data: &[u8]) -> Result<()> {
        header(&self.own.seg)
            .writing
            .store(self.full(k), Ordering::SeqCst);
        let h = header(self.seg(r));
        if h.broken.load(Ordering::SeqCst) != 0 {
            return Err(Error::Remote {
                rank: r,
                cause: crate::error::PeerCause::Failed,
                msg: "its communicator failed before this rank wrote its share of a broadcast into it".into(),
            });
        }
        let d = &h.direct_out[k as usize & 1];
        let (addr, total) = (d[0].load(Ordering::SeqCst), d[1].load(Ordering::SeqCst));
        if off
            .checked_add(data.len())
            .map_or(true, |e| e as u64 > total)
        {
            return Err(Error::Remote {
                rank: r,
                cause: crate::error::PeerCause::Failed,
                msg: format!(
                    "it withdrew its output ({total} bytes published) before this rank wrote {} bytes at {off} of a broadcast into it: it gave up on the call",
                    data.len()
                ),
            });
        }
        // SAFETY: `addr..addr+total` is the output rank `r` published for this call (checked
        // above to hold `off + data.len()`), which it does not touch until it sees this
        // rank's write counted.
        unsafe { cma_write(self.cma_pids[r] as i32, addr + off as u64, data) }
            .map_err(|e| self.cma_error(r, "process_vm_writev", e))
    }

    /// This rank gives up on call `k` after publishing its output for `root` to write into
    /// ([`Node::write_direct_at`]): withdraw the output, and if the root may be writing,
    /// wait (up to the timeout) until its writes are over (`done`), it failed or its process
    /// is gone, so that the caller may reuse the buffer once this returns.
    pub(crate) fn withdraw_output(&self, root: usize, k: u32, w: &Waiter) {
        header(&self.own.seg).direct_out[k as usize & 1][1].store(0, Ordering::SeqCst);
        let h = header(self.seg(root));
        let full = self.full(k);
        if h.writing.load(Ordering::SeqCst) < full {
            return;
        }
        let start = Instant::now();
        while h.done.load(Ordering::SeqCst) < full
            && h.broken.load(Ordering::SeqCst) == 0
            && !(self.pids[root] != 0 && process_gone(self.pids[root]))
            && start.elapsed() < w.timeout
        {
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Address of bytes `off..off + len` of the buffer rank `r` published for call `k`
    /// (`output`: its output), checked against the published length.
    fn published(&self, r: usize, k: u32, output: bool, off: usize, len: usize) -> Result<u64> {
        let h = header(self.seg(r));
        let d = if output {
            &h.direct_out[k as usize & 1]
        } else {
            &h.direct[k as usize & 1]
        };
        let (addr, total) = (d[0].load(Ordering::Relaxed), d[1].load(Ordering::Relaxed));
        if off.checked_add(len).map_or(true, |e| e as u64 > total) {
            return Err(Error::Internal(format!(
                "rank {r} published {total} bytes; a single-copy transfer of {len} at {off} is past them"
            )));
        }
        Ok(addr + off as u64)
    }

    fn cma_error(&self, r: usize, call: &str, e: std::io::Error) -> Error {
        let pid = self.cma_pids[r];
        if e.raw_os_error() == Some(libc::ESRCH) || process_gone(pid) {
            return Error::Remote {
                rank: r,
                cause: crate::error::PeerCause::Exited,
                msg: format!(
                    "its process {pid} exited during a single-copy collective ({call}: {e})"
                ),
            };
        }
        if header(self.seg(r)).broken.load(Ordering::SeqCst) != 0 {
            return self.broken_peer(
                r,
                &format!("its buffer went away during a single-copy collective ({call}: {e})"),
            );
        }
        Error::sys(
            format!(
                "{call} with rank {r} (pid {}) for a single-copy collective",
                self.cma_pids[r]
            ),
            e,
        )
    }

    fn seg(&self, r: usize) -> &Segment {
        if r == self.me {
            &self.own.seg
        } else {
            self.peers[r].as_ref().expect("every peer is mapped")
        }
    }

    fn counter(&self, r: usize, c: Counter, k: u32) -> &AtomicU64 {
        let h = header(self.seg(r));
        match c {
            Counter::Arrive => &h.arrive[k as usize & 1].word,
            Counter::Result => &h.result,
            Counter::Done => &h.done,
        }
    }

    fn area_offset(&self, k: u32, area: Area) -> usize {
        NODE_HDR
            + match area {
                Area::Input => (k as usize & 1) * self.slot,
                Area::Result => 2 * self.slot,
            }
    }

    /// Mark this rank's communicator broken, so that peers waiting on it stop.
    pub(crate) fn mark_broken(&self) {
        self.mark_broken_by(None);
    }

    /// [`Node::mark_broken`], naming the rank this rank blames (`culprit`): a peer that then
    /// finds this rank broken blames the culprit, not this survivor. The flag holds 1
    /// (broken, nobody named) or 2 + the culprit's rank; a name replaces a 1, never another
    /// name.
    pub(crate) fn mark_broken_by(&self, culprit: Option<usize>) {
        let h = header(&self.own.seg);
        let v = culprit
            .filter(|&c| c != self.me)
            .map_or(1, |c| 2 + c as u32);
        let _ = h
            .broken
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |old| {
                (old < 2).then_some(v.max(old))
            });
        futex_wake(&h.arrive[0].word);
        futex_wake(&h.arrive[1].word);
        futex_wake(&h.result);
        futex_wake(&h.done);
    }

    /// Begin the next flat call, described by `meta` (bytes per rank, collective code):
    /// returns its number once every peer has begun the previous one (so this call's input
    /// slot set is free).
    pub(crate) fn begin(&mut self, meta: [u64; 2], w: &Waiter, abort: &AtomicBool) -> Result<u32> {
        self.calls = self.calls.wrapping_add(1);
        self.calls64 += 1;
        let k = self.calls;
        self.wait_all(Counter::Arrive, k.wrapping_sub(1), w, abort)?;
        let m = &header(&self.own.seg).meta[k as usize & 1];
        m[0].store(meta[0], Ordering::Relaxed);
        m[1].store(meta[1], Ordering::Relaxed);
        let h = meta[0].wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ meta[1].rotate_left(29).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
        self.tag = (h >> 32) as u32 ^ h as u32;
        Ok(k)
    }

    /// After rank `r`'s input of call `k` arrived: it must be the same call as ours.
    fn same_call(&self, r: usize, k: u32) -> Result<()> {
        let at = k as usize & 1;
        let (mine, theirs) = (
            &header(&self.own.seg).meta[at],
            &header(self.seg(r)).meta[at],
        );
        let get = |m: &[AtomicU64; 2]| [m[0].load(Ordering::Relaxed), m[1].load(Ordering::Relaxed)];
        let (a, b) = (get(mine), get(theirs));
        if a == b {
            return Ok(());
        }
        Err(Error::InvalidUsage(format!(
            "rank {r} called {} with {} bytes per rank while rank {} called {} with {} bytes: every rank must call the same collectives in the same order with matching counts, types, ops and roots",
            describe(b[1]),
            b[0],
            self.me,
            describe(a[1]),
            a[0]
        )))
    }

    /// Publish counter `c` = `k` (with the call's hash for `Arrive`) and wake sleepers.
    pub(crate) fn publish(&self, c: Counter, k: u32) {
        let v = match c {
            Counter::Arrive => u64::from(k) | u64::from(self.tag) << 32,
            _ => self.full(k),
        };
        // A plain store: the peers' spinning loads see it as soon as the cache line moves.
        // Whether anyone sleeps on it is looked at later ([`Node::flush_wakes`]): that needs
        // a full fence after the store, and a fence here would hold this core until the
        // line is ours, before it starts waiting for the peers' lines, instead of while
        // (2 ranks on cores that do not share a cache: one-line exchanges 400–420 ns with the
        // fence here, 300–320 after the wait; same as without any).
        self.counter(self.me, c, k).store(v, Ordering::Release);
        self.unwoken.set(self.unwoken.get() | wake_bit(c, k));
    }

    /// Wake the peers sleeping on counters published since the last call. Runs at the end of
    /// every flat call and before a wait stops spinning, so a sleeping peer is woken at the
    /// latest when this rank itself stops spinning; a sleeper spun and yielded first, and
    /// its futex wait has a timeout besides.
    pub(crate) fn flush_wakes(&self) {
        let bits = self.unwoken.replace(0);
        if bits == 0 {
            return;
        }
        // Pairs with the sleeper's SeqCst increment of `sleepers` and re-read of the word:
        // either it sees the new value or this load sees it counted.
        fence(Ordering::SeqCst);
        let h = header(&self.own.seg);
        if h.sleepers.load(Ordering::SeqCst) == 0 {
            return;
        }
        let words = [&h.arrive[0].word, &h.arrive[1].word, &h.result, &h.done];
        for (i, w) in words.into_iter().enumerate() {
            if bits & (1 << i) != 0 {
                self.stats.wakeups.fetch_add(1, Ordering::Relaxed);
                futex_wake(w);
            }
        }
    }

    /// Read `len` bytes at `off` of rank `r`'s `area` for call `k` (published by `r`).
    pub(crate) fn read(&self, r: usize, k: u32, area: Area, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.slot, "flat piece exceeds the slot");
        let at = self.area_offset(k, area) + off;
        // SAFETY: inside the mapping (checked above); rank `r` published this range before
        // the counter we acquired and does not write it again until we begin a later call.
        unsafe { std::slice::from_raw_parts(self.seg(r).base().add(at), len) }
    }

    /// This rank's own `area` for call `k`, to fill.
    ///
    /// # Safety
    /// While the returned slice lives, no peer reads these bytes and the caller holds no
    /// other slice of them (from another `own`, or from [`Node::read`] of this rank's own
    /// area). By the slot-reuse protocol (module docs) peers read a rank's area of call `k`
    /// only after that rank published the counter covering it (`arrive` for the input area,
    /// `result` for the result area), and never when the call uses its slots as scratch
    /// space (the single-copy calls).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn own(&self, k: u32, area: Area, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.slot, "flat piece exceeds the slot");
        let at = self.area_offset(k, area) + off;
        // SAFETY: inside our own mapping (checked above); by the slot-reuse protocol no peer
        // reads this range until we publish it, and the caller holds no other slice of it
        // (this function's contract).
        unsafe { std::slice::from_raw_parts_mut(self.own.seg.base().add(at), len) }
    }

    /// The 64-bit number of call `k` (the current call or one shortly before it).
    fn full(&self, k: u32) -> u64 {
        full_call(self.calls64, self.calls, k)
    }

    /// Whether value `v` of counter `c` says call `k` is reached. Every call publishes
    /// `arrive` (its line holds call k or k − 2): 32 bits with wrap-around suffice there;
    /// `result` and `done` hold 64-bit call numbers.
    fn passed(&self, c: Counter, v: u64, k: u32) -> bool {
        match c {
            Counter::Arrive => reached(v as u32, k),
            _ => v >= self.full(k),
        }
    }

    /// Wait until counter `c` of every peer has reached `k`.
    pub(crate) fn wait_all(
        &self,
        c: Counter,
        k: u32,
        w: &Waiter,
        abort: &AtomicBool,
    ) -> Result<()> {
        for r in 0..self.pids.len() {
            if r != self.me {
                self.wait_one(r, c, k, w, abort)?;
            }
        }
        Ok(())
    }

    /// Wait until counter `c` of rank `r` has reached `k`.
    pub(crate) fn wait_one(
        &self,
        r: usize,
        c: Counter,
        k: u32,
        w: &Waiter,
        abort: &AtomicBool,
    ) -> Result<()> {
        let word = self.counter(r, c, k);
        // The input of our current call arrived: the peer's hash must match ours (when it is
        // already further, compare the full descriptions of call k instead).
        let done = |v: u64| {
            if c != Counter::Arrive
                || k != self.calls
                || (v as u32 == k && (v >> 32) as u32 == self.tag)
            {
                Ok(())
            } else {
                self.same_call(r, k)
            }
        };
        let v = word.load(Ordering::Acquire);
        if self.passed(c, v, k) {
            return done(v);
        }
        let mut ws = w.start();
        // Sharing cores, the waiter yields at once: the peer it waits for may sleep on us.
        if w.spin.is_zero() {
            self.flush_wakes();
        }
        let mut polls = 0u32;
        loop {
            let v = word.load(Ordering::Acquire);
            if self.passed(c, v, k) {
                return done(v);
            }
            polls += 1;
            // Long enough that the line of our last publish is ours by now (the fence
            // costs nothing then); early enough that a peer sleeping on it wakes soon.
            if polls == SPIN_BEFORE_WAKES {
                self.flush_wakes();
            }
            match ws.pause() {
                Err(_) => return Err(self.stuck(r, c, k, w)),
                Ok(false) => continue,
                Ok(true) => {}
            }
            self.flush_wakes();
            if let Err(e) = self.check_peer(r, abort) {
                // A peer that passed this step and then left at once (its communicator
                // destroyed right after the call) marked itself broken after publishing:
                // what it published still counts.
                let v = word.load(Ordering::Acquire);
                return if self.passed(c, v, k) {
                    done(v)
                } else {
                    Err(e)
                };
            }
            let sleepers = &header(self.seg(r)).sleepers;
            sleepers.fetch_add(1, Ordering::SeqCst);
            let v = word.load(Ordering::SeqCst);
            if !self.passed(c, v, k) {
                self.stats.sleeps.fetch_add(1, Ordering::Relaxed);
                futex_wait(word, v as u32, w.nap);
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn check_peer(&self, r: usize, abort: &AtomicBool) -> Result<()> {
        if abort.load(Ordering::Relaxed) {
            return Err(Error::InvalidUsage(
                "communicator aborted by the application".into(),
            ));
        }
        if header(self.seg(r)).broken.load(Ordering::Acquire) != 0 {
            return Err(self.broken_peer(
                r,
                "its communicator failed or was aborted while this rank waited on it",
            ));
        }
        let pid = self.pids[r];
        if pid != 0 && process_gone(pid) {
            return Err(Error::Remote {
                rank: r,
                cause: crate::error::PeerCause::Exited,
                msg: format!("its process {pid} exited while this rank waited on it"),
            });
        }
        Ok(())
    }

    /// The error for peer `r` found broken (`what` happened): the rank that failed first is
    /// named — a peer whose process is gone, else the rank `r` blamed when it broke, else
    /// `r` itself — so that a survivor is never blamed for another rank's death.
    fn broken_peer(&self, r: usize, what: &str) -> Error {
        for (p, &pid) in self.pids.iter().enumerate() {
            if p != self.me && pid != 0 && process_gone(pid) {
                return Error::Remote {
                    rank: p,
                    cause: crate::error::PeerCause::Exited,
                    msg: format!(
                        "its process {pid} exited (rank {r} stopped because of it: {what})"
                    ),
                };
            }
        }
        let v = header(self.seg(r)).broken.load(Ordering::Acquire);
        match (v as usize).checked_sub(2) {
            Some(c) if c != r && c < self.pids.len() => Error::Remote {
                rank: c,
                cause: crate::error::PeerCause::Failed,
                msg: format!("rank {r} stopped because rank {c} failed ({what})"),
            },
            _ => Error::Remote {
                rank: r,
                cause: crate::error::PeerCause::Failed,
                msg: what.into(),
            },
        }
    }

    fn stuck(&self, r: usize, c: Counter, k: u32, w: &Waiter) -> Error {
        let behind: Vec<String> = (0..self.pids.len())
            .filter(|&p| {
                p != self.me && !self.passed(c, self.counter(p, c, k).load(Ordering::Acquire), k)
            })
            .map(|p| p.to_string())
            .collect();
        // A peer whose process this rank sees (same pid namespace) may be stopped: the rank
        // waited on first, then any rank behind.
        let stopped = std::iter::once(r)
            .chain((0..self.pids.len()).filter(|&p| p != self.me))
            .find_map(|q| {
                let pid = self.cma_pids.get(q).copied().filter(|&p| p != 0)?;
                crate::os::process::process_stopped(pid).then_some((q, pid))
            });
        let why = match stopped {
            Some((q, p)) => format!(
                "rank {q}: its process (pid {p} on this host) is stopped (SIGSTOP, a terminal's Ctrl-Z, or a debugger)"
            ),
            None => "the peer may have hung or called a different collective".into(),
        };
        Error::timeout(vec![r], format!(
            "rank {} made no progress for {:.0?} (ROCCL_TIMEOUT) waiting on rank {r} in a shared-memory collective (ranks behind: {}); {why}",
            self.me,
            w.timeout,
            behind.join(", ")
        ))
    }
}

impl Drop for Node {
    /// A rank that leaves while peers still wait on it (an error, or a destroyed
    /// communicator) must not leave them waiting for the timeout.
    fn drop(&mut self) {
        self.mark_broken();
    }
}

#[cfg(test)]
mod tests;
