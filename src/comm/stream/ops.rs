//! Operations on memory as an application passes it (addresses of host or device memory),
//! run at once or in stream order: the model the C ABI, `libroccl-nccl.so` and roccl-perf's
//! `--device` share.
//!
//! In stream order, buffers the CPU cannot access go through pinned staging buffers: the
//! stream copies inputs in before the operation and outputs out after it. Element-wise
//! collectives (all-reduce, broadcast, reduce) of at least twice [`stream_chunk`] bytes run
//! as several steps of a pipeline, so that the copies of one chunk overlap the network work
//! of another ([`super::enqueue_steps`]). The split depends on the size alone, never on the
//! kind of memory or the path: blocking calls and groups run the same parts one after the
//! other, so every rank makes the same calls.

use std::sync::Arc;
use std::time::Duration;

use super::{enqueue_steps, staging, Part, Step, StreamCopy, MAX_STEPS};
use crate::comm::{CallOpts, Collective, Communicator, Mem, MemMut, P2pMem, Turn};
use crate::device::{Alloc, Device, StreamId};
use crate::error::{Error, Result};
use crate::types::DataType;

/// Memory as the application passes it: an address and a length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawBuf {
    /// Address (host or device memory).
    pub addr: usize,
    /// Bytes.
    pub len: usize,
}

impl RawBuf {
    /// Whether the two share a byte.
    pub fn overlaps(&self, o: &RawBuf) -> bool {
        self.len > 0 && o.len > 0 && self.addr < o.addr + o.len && o.addr < self.addr + self.len
    }

    /// Bytes `off..off + len` of it.
    fn part(&self, off: usize, len: usize) -> RawBuf {
        debug_assert!(off + len <= self.len);
        RawBuf {
            addr: self.addr + off,
            len,
        }
    }

    /// # Safety
    /// The memory is readable for `len` bytes while the slice lives.
    unsafe fn read<'a>(&self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: non-NULL with a length (the C ABI refuses NULL with a count), readable
        // per the caller's contract.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// # Safety
    /// The memory is writable for `len` bytes while the slice lives, and no other slice
    /// over it is used meanwhile.
    unsafe fn write<'a>(&self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `read`, and callers refuse overlapping writes (`check_group`).
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

/// One operation of a communicator on raw memory.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    /// A collective; `send` is `None` in place.
    Coll {
        /// Which collective.
        coll: Collective,
        /// Element type.
        dt: DataType,
        /// Input (`None`: in place, the input is in `recv`).
        send: Option<RawBuf>,
        /// Output.
        recv: RawBuf,
        /// This rank's pre-multiplier of a sum ([`CallOpts::premul`]).
        premul: Option<Premul>,
    },
    /// Send `buf` to `peer` (grouped with the other point-to-point operations).
    Send {
        /// Destination rank.
        peer: usize,
        /// Bytes to send.
        buf: RawBuf,
    },
    /// Receive `buf` from `peer`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Where to receive.
        buf: RawBuf,
    },
}

impl Op {
    /// (buffer, written) pairs.
    pub fn bufs(&self) -> [Option<(RawBuf, bool)>; 2] {
        match *self {
            Op::Coll { send, recv, .. } => [send.map(|s| (s, false)), Some((recv, true))],
            Op::Send { buf, .. } => [Some((buf, false)), None],
            Op::Recv { buf, .. } => [Some((buf, true)), None],
        }
    }

    fn p2p(&self) -> bool {
        !matches!(self, Op::Coll { .. })
    }
}

/// Operations of a group that run at the same time (any two on different communicators;
/// point-to-point operations of one communicator) must not write memory the other uses.
pub fn check_group(ops: &[(Arc<Communicator>, Op)]) -> Result<()> {
    for (i, (ca, a)) in ops.iter().enumerate() {
        for (cb, b) in &ops[i + 1..] {
            if Arc::ptr_eq(ca, cb) && !(a.p2p() && b.p2p()) {
                continue; // run one after the other
            }
            for (x, wx) in a.bufs().into_iter().flatten() {
                for (y, wy) in b.bufs().into_iter().flatten() {
                    if (wx || wy) && x.overlaps(&y) {
                        return Err(Error::arg(
                            "two operations of the group that run at the same time use overlapping buffers, one of them for receiving",
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// The scalar of a pre-multiplied sum ([`CallOpts::premul`]): its value, or the address of
/// one element that is read when the operation runs (NCCL's `ncclScalarDevice`: a kernel
/// enqueued before the call on its stream may write it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Premul {
    /// The element's bytes (the first `dt.size()`).
    Value([u8; 8]),
    /// Where the element is: host memory, or memory of the call's GPU runtime.
    At(usize),
}

/// The value of `p` for an operation on `dt`, reading an address now (through the runtime
/// `dev` where the CPU cannot read it).
///
/// # Safety
/// An address is valid for `dt.size()` bytes: host memory, or memory of `dev`.
unsafe fn premul_value(p: Premul, dt: DataType, dev: Option<&Arc<dyn Device>>) -> Result<[u8; 8]> {
    let addr = match p {
        Premul::Value(v) => return Ok(v),
        Premul::At(a) => a,
    };
    let n = dt.size();
    let mut v = [0u8; 8];
    if let Some(dev) = dev.filter(|d| d.classify(addr).is_ok_and(|i| !i.host_accessible)) {
        let staged = dev.alloc_staging(n)?;
        let s = dev.copy_stream()?;
        // SAFETY: `addr` is valid for `n` bytes (this function's contract); the staging buffer
        // holds `n` bytes and lives until after the synchronize below.
        unsafe { dev.copy_async(s, staged.addr(), addr, n)? };
        dev.synchronize(s)?;
        // SAFETY: the copy into the staging buffer (host memory of at least `n` bytes) is done.
        unsafe { std::ptr::copy_nonoverlapping(staged.addr() as *const u8, v.as_mut_ptr(), n) };
    } else {
        // SAFETY: host memory valid for `n` bytes, per the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), n) };
    }
    Ok(v)
}

/// Which buffers of an operation are GPU memory that moves without staging (see
/// [`Communicator::gpu_direct`]); the others are host-accessible memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Direct {
    /// The send buffer (a collective's input, a send).
    send: bool,
    /// The receive buffer (a collective's output, a receive).
    recv: bool,
}

/// What runs a communicator's share: the communicator itself (a blocking call), or its turn
/// on its worker thread (a stream-ordered call).
trait Runner {
    fn coll(
        &mut self,
        coll: Collective,
        dt: DataType,
        s: Option<Mem<'_>>,
        r: MemMut<'_>,
        premul: Option<[u8; 8]>,
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<()>;
    fn p2p(&mut self, ops: &mut [P2pMem<'_>], dev: Option<&Arc<dyn Device>>) -> Result<()>;
}

/// A communicator and its turn on the worker run collectives and point-to-point batches
/// with the same calls.
macro_rules! runner {
    ($t:ty) => {
        impl Runner for $t {
            fn coll(
                &mut self,
                coll: Collective,
                dt: DataType,
                s: Option<Mem<'_>>,
                r: MemMut<'_>,
                premul: Option<[u8; 8]>,
                dev: Option<&Arc<dyn Device>>,
            ) -> Result<()> {
                let opts = CallOpts {
                    premul,
                    ..CallOpts::default()
                };
                self.run_mem(coll, dt, s, r, &opts, dev).map(|_| ())
            }
            fn p2p(&mut self, ops: &mut [P2pMem<'_>], dev: Option<&Arc<dyn Device>>) -> Result<()> {
                self.p2p_mem(ops, dev)
            }
        }
    };
}
runner!(&Communicator);
runner!(&mut Turn<'_>);

/// Collectives in order, then all point-to-point operations together. With `split`, each
/// element-wise collective runs as its pipeline's steps one after the other, so that every
/// rank makes the same calls whether it runs the operation blocking, in a group, or
/// pipelined on a stream. `dev`: the runtime of the GPU buffers that move without staging.
///
/// # Safety
/// As [`run_now`]; buffers marked [`Direct`] are GPU memory of `dev`, valid as there.
unsafe fn run(
    mut c: impl Runner,
    ops: impl IntoIterator<Item = (Op, Direct)>,
    split_ops: bool,
    dev: Option<&Arc<dyn Device>>,
) -> Result<()> {
    let mut p2p = Batch::default();
    for (op, direct) in ops {
        if split_ops && pipelined(&op)? {
            for part in split(op)? {
                // SAFETY: the caller's contract, for every part of `op`.
                unsafe { run_one(&mut c, part, direct, dev, &mut p2p)? };
            }
        } else {
            // SAFETY: the caller's contract.
            unsafe { run_one(&mut c, op, direct, dev, &mut p2p)? };
        }
    }
    let p2p = p2p.as_mut_slice();
    if !p2p.is_empty() {
        c.p2p(p2p, dev)?;
    }
    Ok(())
}

/// The point-to-point operations of a call (no allocation for up to 32).
type Batch<'a> = crate::algo::StackVec<P2pMem<'a>, 32>;

/// Run a collective now, or add a point-to-point operation to `p2p`.
///
/// # Safety
/// As [`run`]; the buffers of point-to-point operations stay valid while `p2p` lives.
unsafe fn run_one<'a>(
    c: &mut impl Runner,
    op: Op,
    direct: Direct,
    dev: Option<&Arc<dyn Device>>,
    p2p: &mut Batch<'a>,
) -> Result<()> {
    // SAFETY (all four): valid per the caller's contract, GPU memory of `dev` where marked,
    // host memory otherwise; a written buffer overlaps no other buffer of its operation,
    // nor (point-to-point) of the group (`check_group`).
    let read = |b: RawBuf, gpu: bool| unsafe {
        if gpu {
            Mem::device(b.addr, b.len)
        } else {
            Mem::host(b.read())
        }
    };
    let write = |b: RawBuf, gpu: bool| unsafe {
        if gpu {
            MemMut::device(b.addr, b.len)
        } else {
            MemMut::host(b.write())
        }
    };
    match op {
        Op::Coll {
            coll,
            dt,
            send,
            recv,
            premul,
        } => {
            let s = send.map(|s| read(s, direct.send));
            // SAFETY: an address of the scalar is valid per the caller's contract.
            let premul = match premul {
                Some(p) => Some(unsafe { premul_value(p, dt, dev) }?),
                None => None,
            };
            c.coll(coll, dt, s, write(recv, direct.recv), premul, dev)?;
        }
        Op::Send { peer, buf } => p2p.push(P2pMem::Send {
            peer,
            buf: read(buf, direct.send),
        }),
        Op::Recv { peer, buf } => p2p.push(P2pMem::Recv {
            peer,
            buf: write(buf, direct.recv),
        }),
    }
    Ok(())
}

/// Run `ops` of one communicator now and return when they are done.
///
/// # Safety
/// Every buffer is host-accessible memory, valid for its length (written ones writable)
/// until this returns and not written by anything else meanwhile; buffers that are written
/// do not overlap the other buffers of the same operation, nor (point-to-point) of the
/// group ([`check_group`]).
pub unsafe fn run_now(comm: &Communicator, ops: &[Op]) -> Result<()> {
    // SAFETY: the caller's contract (host memory only).
    unsafe {
        run(
            comm,
            ops.iter().map(|o| (*o, Direct::default())),
            true,
            None,
        )
    }
}

/// Chunk size of pipelined stream-ordered calls: `ROCCL_STREAM_CHUNK` bytes (`K`/`M`
/// suffixes; default 4 MiB; 0: never split). Every rank must use the same value, like every
/// `ROCCL_*` setting.
pub fn stream_chunk() -> Result<usize> {
    crate::envvar::process()
        .stream_chunk
        .clone()
        .map_err(Error::arg)
}

/// The byte ranges of the steps an element-wise collective of `bytes` bytes of `dt` runs
/// in: one range below two chunks; else about `chunk` bytes each (at most [`MAX_STEPS`]),
/// cut at element boundaries.
pub fn pipeline_ranges(bytes: usize, dt: DataType, chunk: usize) -> Vec<(usize, usize)> {
    if chunk == 0 || bytes < 2 * chunk {
        return vec![(0, bytes)];
    }
    let es = dt.size();
    let n = bytes.div_ceil(chunk).min(MAX_STEPS);
    let elems = bytes / es;
    let per = elems.div_ceil(n);
    (0..n)
        .map(|k| {
            let a = (k * per).min(elems) * es;
            let b = ((k + 1) * per).min(elems) * es;
            (a, b - a)
        })
        .filter(|&(_, l)| l > 0)
        .collect()
}

/// Whether `op` runs as several parts (an element-wise collective of at least two chunks).
fn pipelined(op: &Op) -> Result<bool> {
    Ok(match *op {
        Op::Coll {
            coll:
                Collective::AllReduce(_) | Collective::Broadcast { .. } | Collective::Reduce { .. },
            send,
            recv,
            ..
        } => {
            let total = send.map_or(recv.len, |s| s.len.max(recv.len));
            let chunk = stream_chunk()?;
            chunk > 0 && total >= 2 * chunk
        }
        _ => false,
    })
}

/// Split an element-wise collective into the pipeline's steps.
fn split(op: Op) -> Result<Vec<Op>> {
    let Op::Coll {
        coll,
        dt,
        send,
        recv,
        premul,
    } = op
    else {
        return Ok(vec![op]);
    };
    let elementwise = matches!(
        coll,
        Collective::AllReduce(_) | Collective::Broadcast { .. } | Collective::Reduce { .. }
    );
    // A non-root's reduce output may be empty; every other buffer has the full length.
    let total = send.map_or(recv.len, |s| s.len.max(recv.len));
    let fits = |b: RawBuf| b.len == 0 || b.len == total;
    if !elementwise || !fits(recv) || !send.map_or(true, fits) {
        return Ok(vec![op]);
    }
    let part = |b: RawBuf, off: usize, len: usize| if b.len == 0 { b } else { b.part(off, len) };
    Ok(pipeline_ranges(total, dt, stream_chunk()?)
        .into_iter()
        .map(|(off, len)| Op::Coll {
            coll,
            dt,
            send: send.map(|s| part(s, off, len)),
            recv: part(recv, off, len),
            premul,
        })
        .collect())
}

/// Bytes copied through staging buffers by stream-ordered calls since the process started
/// (both directions; see [`staged_bytes`]).
static STAGED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bytes that stream-ordered calls have copied through pinned staging buffers so far, in
/// and out: tools and tests tell staged calls from GPU-direct ones with it.
pub fn staged_bytes() -> u64 {
    STAGED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Replace the buffers of `op` that the CPU cannot access with staging buffers, and record
/// the copies: inputs in before the operation, outputs out after it (not a non-root's
/// reduce output, which NCCL leaves untouched). Where the communicator moves the operation's
/// GPU memory without staging ([`Communicator::gpu_direct`]), nothing is staged and the
/// GPU buffers are marked instead.
fn stage(
    dev: &Arc<dyn Device>,
    comm: &Communicator,
    op: &mut Op,
    stream: StreamId,
    step: &mut Step,
    bufs: &mut Vec<Arc<dyn Alloc>>,
) -> Result<Direct> {
    let me = comm.rank();
    let gpu =
        |b: &RawBuf| -> Result<bool> { Ok(b.len > 0 && !dev.classify(b.addr)?.host_accessible) };
    let (coll, peer) = match *op {
        Op::Coll { coll, .. } => (coll, None),
        Op::Send { peer, .. } => (
            Collective::SendRecv {
                to: Some(peer),
                from: None,
            },
            Some(peer),
        ),
        Op::Recv { peer, .. } => (
            Collective::SendRecv {
                to: None,
                from: Some(peer),
            },
            Some(peer),
        ),
    };
    let [a, b] = op.bufs();
    let any_gpu = [a, b]
        .into_iter()
        .flatten()
        .try_fold(false, |acc, (x, _)| Ok::<_, Error>(acc || gpu(&x)?))?;
    // In place, an all-to-all first copies the whole buffer aside: staging does that.
    let in_place_a2a = matches!(
        *op,
        Op::Coll {
            coll: Collective::AllToAll,
            send: None,
            ..
        }
    );
    // The size of its messages: a rank's block of an all-gather or all-to-all.
    let message = match *op {
        Op::Coll {
            coll: Collective::AllGather | Collective::AllToAll,
            recv,
            ..
        } => recv.len / comm.nranks().max(1),
        Op::Coll { send, recv, .. } => recv.len.max(send.map_or(0, |s| s.len)),
        Op::Send { buf, .. } | Op::Recv { buf, .. } => buf.len,
    };
    if any_gpu && !in_place_a2a && comm.gpu_direct(&coll, peer, message, dev.integrated()) {
        return Ok(match *op {
            Op::Coll { send, recv, .. } => Direct {
                send: send.map_or(Ok(false), |s| gpu(&s))?,
                recv: gpu(&recv)?,
            },
            Op::Send { buf, .. } => Direct {
                send: gpu(&buf)?,
                recv: false,
            },
            Op::Recv { buf, .. } => Direct {
                send: false,
                recv: gpu(&buf)?,
            },
        });
    }
    let mut swap = |b: &mut RawBuf, input: bool, output: bool| -> Result<()> {
        if b.len == 0 || dev.classify(b.addr)?.host_accessible {
            return Ok(());
        }
        let staged = staging(dev, b.len)?;
        let copy = |dst: usize, src: usize| StreamCopy {
            stream,
            dst,
            src,
            bytes: b.len,
        };
        if input {
            step.before.push(copy(staged.addr(), b.addr));
        }
        if output {
            step.after.push(copy(b.addr, staged.addr()));
        }
        let n = u64::from(input) + u64::from(output);
        STAGED.fetch_add(n * b.len as u64, std::sync::atomic::Ordering::Relaxed);
        b.addr = staged.addr();
        bufs.push(staged);
        Ok(())
    };
    match op {
        Op::Coll {
            coll, send, recv, ..
        } => {
            let in_place = send.is_none();
            if let Some(s) = send {
                swap(s, true, false)?;
            }
            let root_only = matches!(*coll, Collective::Reduce { root, .. } if root != me);
            swap(recv, in_place, !root_only)?;
        }
        Op::Send { buf, .. } => swap(buf, true, false)?,
        Op::Recv { buf, .. } => swap(buf, false, true)?,
    }
    Ok(Direct::default())
}

/// One communicator's operations of a step, each with its GPU-direct buffers.
type OpsOf = Vec<(Op, Direct)>;

/// Run `ops` (each with its communicator and stream) ordered with their streams: after all
/// work enqueued before on each, and before all work enqueued after. Returns at once;
/// failures during the run become the communicators' async errors.
///
/// # Safety
/// Every buffer is valid for its length (written ones writable) until the streams have
/// passed the operation, and nothing else writes it meanwhile (the stream's order keeps the
/// application's own kernels out); buffers that are written do not overlap other buffers
/// of the group ([`check_group`]). On a stream being captured into a graph, "until the
/// streams have passed the operation" means for as long as the graph may be replayed.
pub unsafe fn run_on_streams(
    dev: &Arc<dyn Device>,
    ops: Vec<(Arc<Communicator>, Op, StreamId)>,
    timeout: Duration,
) -> Result<()> {
    let streams: Vec<StreamId> = ops.iter().map(|o| o.2).collect();
    // A single element-wise collective is pipelined, one step per part; a group runs as one
    // step whose collectives run their parts in order (the same calls either way).
    let single = ops.len() == 1;
    let steps_ops: Vec<Vec<(Arc<Communicator>, Op, StreamId)>> = match &ops[..] {
        [(c, op, s)] => split(*op)?
            .into_iter()
            .map(|o| vec![(Arc::clone(c), o, *s)])
            .collect(),
        _ => vec![ops],
    };
    let mut bufs = Vec::new();
    let mut steps = Vec::with_capacity(steps_ops.len());
    for step_ops in steps_ops {
        let mut step = Step::default();
        // One part per communicator, in the order of first use.
        let mut per: Vec<(Arc<Communicator>, OpsOf)> = Vec::new();
        for (c, mut op, s) in step_ops {
            let direct = stage(dev, &c, &mut op, s, &mut step, &mut bufs)?;
            match per.iter_mut().find(|(k, _)| Arc::ptr_eq(k, &c)) {
                Some((_, v)) => v.push((op, direct)),
                None => per.push((c, vec![(op, direct)])),
            }
        }
        step.parts = per
            .into_iter()
            .map(|(c, ops)| {
                let dev = Arc::clone(dev);
                let part: Part = Arc::new(move |turn: &mut Turn| {
                    // SAFETY: the caller's contract: the buffers (or their staging copies,
                    // filled before the step starts and kept until the worker and the streams
                    // are done with them) stay valid until the stream has passed the
                    // operation, which waits for this part (at every replay of a graph
                    // that captured it: the program keeps them for the graph's life).
                    unsafe { run(turn, ops.iter().copied(), !single, Some(&dev)) }
                });
                (c, part)
            })
            .collect();
        steps.push(step);
    }
    enqueue_steps(dev, &streams, steps, bufs, timeout)
}

/// Copy `data` into memory of the runtime `dst` (device memory too) through a pinned
/// staging buffer on `stream`, and wait for it.
pub fn upload(dev: &Arc<dyn Device>, stream: StreamId, dst: &dyn Alloc, data: &[u8]) -> Result<()> {
    if data.len() > dst.len() {
        return Err(Error::arg(format!(
            "upload of {} bytes into a buffer of {}",
            data.len(),
            dst.len()
        )));
    }
    if data.is_empty() {
        return Ok(());
    }
    let staged = dev.alloc_staging(data.len())?;
    // SAFETY: the staging buffer is host memory of at least `data.len()` bytes that nothing
    // else uses until the copy below has run.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), staged.addr() as *mut u8, data.len()) };
    // SAFETY: `dst` is an allocation of at least `data.len()` bytes (checked above) and the
    // staging buffer holds them; both live until after the synchronize below.
    unsafe { dev.copy_async(stream, dst.addr(), staged.addr(), data.len())? };
    dev.synchronize(stream)
}

/// The first `len` bytes of `src` (device memory too), copied through a pinned staging
/// buffer on `stream`.
pub fn download(
    dev: &Arc<dyn Device>,
    stream: StreamId,
    src: &dyn Alloc,
    len: usize,
) -> Result<Vec<u8>> {
    if len > src.len() {
        return Err(Error::arg(format!(
            "download of {len} bytes from a buffer of {}",
            src.len()
        )));
    }
    let mut out = vec![0u8; len];
    if len == 0 {
        return Ok(out);
    }
    let staged = dev.alloc_staging(len)?;
    // SAFETY: `src` is an allocation of at least `len` bytes (checked above) and the staging
    // buffer holds them; both live until after the synchronize below.
    unsafe { dev.copy_async(stream, staged.addr(), src.addr(), len)? };
    dev.synchronize(stream)?;
    // SAFETY: the stream has finished the copy into the staging buffer (synchronize), which
    // holds at least `len` bytes.
    unsafe { std::ptr::copy_nonoverlapping(staged.addr() as *const u8, out.as_mut_ptr(), len) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_ranges_cover_the_buffer_at_element_boundaries() {
        for (bytes, dt, chunk) in [
            (0, DataType::F32, 4096),
            (8188, DataType::F32, 4096),
            (8192, DataType::F32, 4096),
            (20012, DataType::F32, 4096),
            (1 << 30, DataType::Bf16, 4 << 20),
            (3 * 4097, DataType::F64, 4096),
            (1 << 20, DataType::U8, 0),
        ] {
            let r = pipeline_ranges(bytes, dt, chunk);
            let splits = chunk > 0 && bytes >= 2 * chunk;
            assert_eq!(r.len() > 1, splits, "{bytes} B, chunk {chunk}: {r:?}");
            assert!(r.len() <= MAX_STEPS);
            let mut at = 0;
            for &(off, len) in &r {
                assert_eq!(off, at, "{bytes} B: ranges are contiguous");
                assert_eq!(off % dt.size(), 0);
                assert!(len > 0 || bytes == 0);
                at += len;
            }
            assert_eq!(at, bytes / dt.size() * dt.size(), "{bytes} B covered");
        }
        // 20012 bytes of f32 in ~4 KiB steps: 5 steps of 1001 or 999 elements.
        let r = pipeline_ranges(20012, DataType::F32, 4096);
        assert_eq!(r.len(), 5);
        assert_eq!(r[0], (0, 4004));
        assert_eq!(r[4], (16016, 3996));
    }
}
