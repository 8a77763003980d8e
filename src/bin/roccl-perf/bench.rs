//! The measurement: buffers, calls (blocking or issued ahead), checks and timings of one
//! collective at one size, placement, data type and reduction.

use std::sync::{mpsc, Arc};
use std::time::Instant;

use bytemuck::{Pod, Zeroable};
use roccl::comm::stream::ops::{self, RawBuf};
use roccl::device::{Alloc, Device, StreamId};
use roccl::{CallInfo, CallOpts, Collective, Communicator, DataType, RedOp};

use crate::args::{Args, Op};

/// Input element `i` of `rank` for checking: small integers, exact in every type.
fn pattern(dt: DataType, op: RedOp, rank: usize, i: usize) -> f64 {
    if op == RedOp::Prod {
        return (1 + (rank + i) % 2) as f64;
    }
    let v = ((rank * 5 + i * 7) % 4) as f64;
    let signed = dt.is_float() || matches!(dt, DataType::I8 | DataType::I32 | DataType::I64);
    if signed {
        v - 1.0
    } else {
        v
    }
}

fn expect_reduced(dt: DataType, op: RedOp, n: usize, i: usize) -> f64 {
    let it = (0..n).map(|r| pattern(dt, op, r, i));
    match op {
        RedOp::Sum => it.sum(),
        RedOp::Prod => it.product(),
        RedOp::Max => it.fold(f64::MIN, f64::max),
        RedOp::Min => it.fold(f64::MAX, f64::min),
        RedOp::Avg => {
            let s: f64 = it.sum();
            if dt.is_float() {
                s / n as f64
            } else {
                (s / n as f64).trunc()
            }
        }
    }
}

fn encode(dt: DataType, v: f64, b: &mut [u8]) {
    match dt {
        DataType::I8 => b[0] = v as i8 as u8,
        DataType::U8 => b[0] = v as u8,
        DataType::I32 => b.copy_from_slice(&(v as i32).to_le_bytes()),
        DataType::U32 => b.copy_from_slice(&(v as u32).to_le_bytes()),
        DataType::I64 => b.copy_from_slice(&(v as i64).to_le_bytes()),
        DataType::U64 => b.copy_from_slice(&(v as u64).to_le_bytes()),
        DataType::F16 => b.copy_from_slice(&half::f16::from_f64(v).to_le_bytes()),
        DataType::Bf16 => b.copy_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
        DataType::F32 => b.copy_from_slice(&(v as f32).to_le_bytes()),
        DataType::F64 => b.copy_from_slice(&v.to_le_bytes()),
        DataType::F8E4M3 => b[0] = roccl::F8E4M3::from_f32(v as f32).0,
        DataType::F8E5M2 => b[0] = roccl::F8E5M2::from_f32(v as f32).0,
    }
}

fn decode(dt: DataType, b: &[u8]) -> f64 {
    match dt {
        DataType::I8 => b[0] as i8 as f64,
        DataType::U8 => b[0] as f64,
        DataType::I32 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
        DataType::U32 => u32::from_le_bytes(b.try_into().unwrap()) as f64,
        DataType::I64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
        DataType::U64 => u64::from_le_bytes(b.try_into().unwrap()) as f64,
        DataType::F16 => half::f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DataType::Bf16 => half::bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DataType::F32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
        DataType::F64 => f64::from_le_bytes(b.try_into().unwrap()),
        DataType::F8E4M3 => roccl::F8E4M3(b[0]).to_f32() as f64,
        DataType::F8E5M2 => roccl::F8E5M2(b[0]).to_f32() as f64,
    }
}

fn fill(dt: DataType, buf: &mut [u8], f: impl Fn(usize) -> f64) {
    for (i, e) in buf.chunks_exact_mut(dt.size()).enumerate() {
        encode(dt, f(i), e);
    }
}

fn wrong(dt: DataType, buf: &[u8], f: impl Fn(usize) -> f64) -> u64 {
    let tol = |w: f64| match dt {
        DataType::F16 | DataType::Bf16 => 1e-2 * w.abs() + 1e-3,
        // 3 and 2 mantissa bits, rounded at every partial sum.
        DataType::F8E4M3 => 0.13 * w.abs() + 1e-3,
        DataType::F8E5M2 => 0.26 * w.abs() + 1e-3,
        DataType::F32 => 1e-6 * w.abs(),
        _ => 0.0,
    };
    buf.chunks_exact(dt.size())
        .enumerate()
        .filter(|(i, e)| {
            let w = f(*i);
            (decode(dt, e) - w).abs() > tol(w)
        })
        .count() as u64
}

/// A GPU runtime and a stream of it.
pub type DevStream = (Arc<dyn Device>, StreamId);

/// What one placement of one collective at one size measured.
pub struct Measured {
    /// Per-iteration times (us), combined over ranks as `-a` asks.
    pub times: Vec<f64>,
    /// Wrong results summed over ranks; None when checking is off.
    pub wrong: Option<u64>,
    /// Bytes the size stands for (nccl-tests' size column).
    pub bytes: usize,
    pub count: usize,
    pub algo: String,
}

#[derive(Clone)]
pub struct Bench<'a> {
    pub c: &'a Arc<Communicator>,
    pub a: &'a Args,
    pub dt: DataType,
    pub op: RedOp,
    pub opts: CallOpts,
    /// `--device`: the GPU runtime and this rank's stream.
    pub dev: Option<DevStream>,
    /// In place (the output buffer holds the input).
    pub inplace: bool,
}

/// A call's buffers for the communicator's worker thread (`-z 0`).
struct Bufs {
    send: *const u8,
    send_len: usize,
    recv: *mut u8,
    recv_len: usize,
}

// SAFETY: the buffers outlive every queued call (the issuer waits for all of them before it
// touches or frees the buffers) and the worker runs the calls one after another.
unsafe impl Send for Bufs {}

impl Bench<'_> {
    /// Buffers and collective for `op` at total size `bytes`; returns (send, recv, coll, count).
    fn setup(&self, o: Op, bytes: usize) -> (Buf, Buf, Collective, usize) {
        let (n, es) = (self.c.nranks(), self.dt.size());
        let root = self.a.root;
        let me = self.c.rank();
        match o {
            Op::AllReduce => {
                let count = bytes / es;
                (
                    Buf::zeroed(count * es),
                    Buf::zeroed(count * es),
                    Collective::AllReduce(self.op),
                    count,
                )
            }
            Op::Broadcast => {
                let count = bytes / es;
                (
                    Buf::zeroed(count * es),
                    Buf::zeroed(count * es),
                    Collective::Broadcast { root },
                    count,
                )
            }
            Op::Reduce => {
                let count = bytes / es;
                (
                    Buf::zeroed(count * es),
                    Buf::zeroed(count * es),
                    Collective::Reduce { op: self.op, root },
                    count,
                )
            }
            Op::AllGather => {
                let count = (bytes / es / n).max(1);
                (
                    Buf::zeroed(count * es),
                    Buf::zeroed(n * count * es),
                    Collective::AllGather,
                    count,
                )
            }
            Op::ReduceScatter => {
                let count = (bytes / es / n).max(1);
                // In place, the output is block `rank` of the n-block input buffer.
                let out = if self.inplace { n * count } else { count };
                (
                    Buf::zeroed(n * count * es),
                    Buf::zeroed(out * es),
                    Collective::ReduceScatter(self.op),
                    count,
                )
            }
            Op::AllToAll => {
                let count = (bytes / es / n).max(1);
                (
                    Buf::zeroed(n * count * es),
                    Buf::zeroed(n * count * es),
                    Collective::AllToAll,
                    count,
                )
            }
            Op::SendRecv => {
                let count = bytes / es;
                let to = (me + 1) % n;
                let from = (me + n - 1) % n;
                (
                    Buf::zeroed(count * es),
                    Buf::zeroed(count * es),
                    Collective::SendRecv {
                        to: Some(to),
                        from: Some(from),
                    },
                    count,
                )
            }
            Op::Barrier => (Buf::zeroed(0), Buf::zeroed(0), Collective::Barrier, 0),
        }
    }

    fn call(
        &self,
        coll: Collective,
        send: &[u8],
        recv: &mut [u8],
        inplace: bool,
    ) -> roccl::Result<roccl::CallInfo> {
        let inplace = inplace && !matches!(coll, Collective::SendRecv { .. } | Collective::Barrier);
        if inplace {
            self.c.run_raw(coll, self.dt, None, recv, &self.opts)
        } else {
            self.c.run_raw(coll, self.dt, Some(send), recv, &self.opts)
        }
    }

    /// For in-place runs the input must sit where each collective expects it.
    fn place_input(&self, o: Op, send: &[u8], recv: &mut [u8], count: usize) {
        let es = self.dt.size();
        match o {
            Op::AllGather => {
                let me = self.c.rank();
                recv[me * count * es..(me + 1) * count * es].copy_from_slice(send);
            }
            Op::SendRecv | Op::Barrier => {}
            _ => recv[..send.len()].copy_from_slice(send),
        }
    }

    /// `--check-iters`, before a call: the output poisoned (a value no check expects, so a
    /// call that wrote nothing is counted wrong) and, in place, the input placed again.
    fn prepare(&self, o: Op, send: &[u8], recv: &mut [u8], count: usize) {
        recv.fill(0x5a);
        if self.inplace {
            self.place_input(o, send, recv, count);
        }
    }

    /// One call's wrong results (`check`'s input, the pattern) on this rank, and, with
    /// `earlier`, the wrong results of earlier calls (`--check-iters`) summed over ranks.
    fn check(&self, o: Op, bytes: usize, earlier: u64) -> roccl::Result<u64> {
        let (dt, op, me) = (self.dt, self.op, self.c.rank());
        let (mut send, mut recv, coll, count) = self.setup(o, bytes);
        let inplace = self.inplace && o != Op::SendRecv;
        match o {
            Op::AllReduce | Op::Reduce | Op::Broadcast | Op::SendRecv => {
                fill(dt, &mut send, |i| pattern(dt, op, me, i))
            }
            Op::AllGather => fill(dt, &mut send, |i| pattern(dt, op, me, i)),
            Op::ReduceScatter | Op::AllToAll => fill(dt, &mut send, |j| pattern(dt, op, me, j)),
            Op::Barrier => {}
        }
        if o == Op::ReduceScatter && inplace {
            recv = send.clone();
        } else if inplace {
            self.place_input(o, &send, &mut recv, count);
        }
        match &self.dev {
            Some((dev, stream)) => {
                self.call_on_device(dev, *stream, coll, &send, &mut recv, inplace)?;
            }
            None => {
                self.call(coll, &send, &mut recv, inplace)?;
            }
        }
        // Sum the wrong counts over ranks.
        let mut total = [earlier + self.wrong_in(o, &recv, count)];
        self.c.all_reduce_in_place(&mut total, RedOp::Sum)?;
        Ok(total[0])
    }

    /// Elements of `recv` (a call's output on the pattern's input) that are wrong here.
    fn wrong_in(&self, o: Op, recv: &[u8], count: usize) -> u64 {
        let (dt, op, n, me, root) = (
            self.dt,
            self.op,
            self.c.nranks(),
            self.c.rank(),
            self.a.root,
        );
        let inplace = self.inplace && o != Op::SendRecv;
        let es = dt.size();
        match o {
            Op::AllReduce => wrong(dt, recv, |i| expect_reduced(dt, op, n, i)),
            Op::Reduce if me == root => wrong(dt, recv, |i| expect_reduced(dt, op, n, i)),
            Op::Reduce | Op::Barrier => 0,
            Op::Broadcast => wrong(dt, recv, |i| pattern(dt, op, root, i)),
            Op::AllGather => wrong(dt, recv, |j| pattern(dt, op, j / count, j % count)),
            Op::ReduceScatter => {
                let mine = if inplace {
                    &recv[me * count * es..(me + 1) * count * es]
                } else {
                    recv
                };
                wrong(dt, mine, |i| expect_reduced(dt, op, n, me * count + i))
            }
            Op::AllToAll => wrong(dt, recv, |j| {
                pattern(dt, op, j / count, me * count + j % count)
            }),
            Op::SendRecv => wrong(dt, recv, |i| pattern(dt, op, (me + n - 1) % n, i)),
        }
    }

    /// The stream-ordered operation of `coll` on device buffers.
    fn device_op(
        &self,
        coll: Collective,
        send: &dyn Alloc,
        recv: &dyn Alloc,
        inplace: bool,
    ) -> ops::Op {
        let raw = |b: &dyn Alloc| RawBuf {
            addr: b.addr(),
            len: b.len(),
        };
        let inplace = inplace && !matches!(coll, Collective::SendRecv { .. } | Collective::Barrier);
        ops::Op::Coll {
            coll,
            dt: self.dt,
            send: (!inplace).then(|| raw(send)),
            recv: raw(recv),
            premul: None,
        }
    }

    /// `--device`: run `op` on `stream` and wait until the stream has passed it.
    fn run_on_device(
        &self,
        dev: &Arc<dyn Device>,
        stream: StreamId,
        op: ops::Op,
    ) -> roccl::Result<()> {
        // SAFETY: the buffers are the runtime's allocations, alive until after the
        // synchronize below, and written only by this operation meanwhile.
        unsafe {
            ops::run_on_streams(
                dev,
                vec![(Arc::clone(self.c), op, stream)],
                roccl::comm::timeout(),
            )
        }?;
        dev.synchronize(stream)?;
        match self.c.async_error() {
            Some(e) => Err(roccl::Error::InvalidUsage(e.message)),
            None => Ok(()),
        }
    }

    /// `--device`: `call` with the data in device buffers (uploaded, run, downloaded).
    fn call_on_device(
        &self,
        dev: &Arc<dyn Device>,
        stream: StreamId,
        coll: Collective,
        send: &[u8],
        recv: &mut [u8],
        inplace: bool,
    ) -> roccl::Result<()> {
        let (sb, rb) = (dev.alloc_device(send.len())?, dev.alloc_device(recv.len())?);
        ops::upload(dev, stream, sb.as_ref(), send)?;
        ops::upload(dev, stream, rb.as_ref(), recv)?;
        self.run_on_device(
            dev,
            stream,
            self.device_op(coll, sb.as_ref(), rb.as_ref(), inplace),
        )?;
        recv.copy_from_slice(&ops::download(dev, stream, rb.as_ref(), recv.len())?);
        Ok(())
    }

    /// `--device`: time each call from its enqueue until the stream has passed it.
    /// `--device`: time each call from its enqueue until the stream has passed it (`-z 1`),
    /// or issue all of them and wait once (`-z 0`: each gets the mean).
    fn time_on_device(
        &self,
        dev: &Arc<dyn Device>,
        stream: StreamId,
        coll: Collective,
        send: &[u8],
        recv: &[u8],
        times: &mut [f64],
    ) -> roccl::Result<()> {
        let (sb, rb) = (dev.alloc_device(send.len())?, dev.alloc_device(recv.len())?);
        ops::upload(dev, stream, sb.as_ref(), send)?;
        ops::upload(dev, stream, rb.as_ref(), recv)?;
        let op = self.device_op(coll, sb.as_ref(), rb.as_ref(), self.inplace);
        for _ in 0..self.a.warmup {
            self.run_on_device(dev, stream, op)?;
        }
        if self.a.blocking == 1 {
            for t in times.iter_mut() {
                let start = Instant::now();
                self.run_on_device(dev, stream, op)?;
                *t = start.elapsed().as_secs_f64() * 1e6;
            }
            return Ok(());
        }
        let start = Instant::now();
        for _ in 0..times.len() {
            // SAFETY: as in run_on_device; the synchronize below waits for all of them.
            unsafe {
                ops::run_on_streams(
                    dev,
                    vec![(Arc::clone(self.c), op, stream)],
                    roccl::comm::timeout(),
                )
            }?;
        }
        dev.synchronize(stream)?;
        if let Some(e) = self.c.async_error() {
            return Err(roccl::Error::InvalidUsage(e.message));
        }
        let each = start.elapsed().as_secs_f64() * 1e6 / times.len() as f64;
        times.fill(each);
        Ok(())
    }

    /// `-z 0`: issue `calls` calls on the communicator's worker thread without waiting, then
    /// wait for all; the time of call i is from the end of call i-1 (the first: from the
    /// issue of all) to its own end.
    fn issue(
        &self,
        coll: Collective,
        send: &[u8],
        recv: &mut [u8],
        calls: usize,
    ) -> roccl::Result<(Vec<f64>, Option<CallInfo>)> {
        let inplace =
            self.inplace && !matches!(coll, Collective::SendRecv { .. } | Collective::Barrier);
        let (tx, rx) = mpsc::channel();
        let start = Instant::now();
        for _ in 0..calls {
            let b = Bufs {
                send: send.as_ptr(),
                send_len: send.len(),
                recv: recv.as_mut_ptr(),
                recv_len: recv.len(),
            };
            let (dt, opts, tx) = (self.dt, self.opts, tx.clone());
            self.c.enqueue(Box::new(move |turn| {
                let b = b;
                // SAFETY: see `Bufs`: the issuer waits below for every call before it uses
                // the buffers again, and the calls run one at a time.
                let (s, r) = unsafe {
                    (
                        std::slice::from_raw_parts(b.send, b.send_len),
                        std::slice::from_raw_parts_mut(b.recv, b.recv_len),
                    )
                };
                let res = turn.run_raw(coll, dt, (!inplace).then_some(s), r, &opts);
                let _ = tx.send((Instant::now(), res));
            }));
        }
        drop(tx);
        let (mut times, mut info, mut last, mut err) = (Vec::new(), None, start, None);
        // Every call is waited for, even after an error: the buffers must outlive them.
        for (end, res) in rx.iter() {
            times.push(end.duration_since(last).as_secs_f64() * 1e6);
            last = end;
            match res {
                Ok(i) => info = Some(i),
                Err(e) => err = err.or(Some(e)),
            }
        }
        match err {
            Some(e) => Err(e),
            None if times.len() < calls => Err(roccl::Error::Internal(
                "a call issued without waiting ended without an answer".into(),
            )),
            None => Ok((times, info)),
        }
    }

    /// Time `o` at `bytes`: warm-up, timed iterations, their times combined over ranks as
    /// `-a` asks, then `-c` checked calls.
    pub fn run(&self, o: Op, bytes: usize) -> roccl::Result<Measured> {
        let n = self.c.nranks();
        let (mut send, mut recv, coll, count) = self.setup(o, bytes);
        // Time on real data, as nccl-tests does: buffers left as allocated would be read from
        // the kernel's shared zero page (one 4 KiB page in cache, however large the buffer).
        let me = self.c.rank();
        fill(self.dt, &mut send, |i| pattern(self.dt, self.op, me, i));
        if self.inplace {
            self.place_input(o, &send, &mut recv, count);
        }
        let mut info = None;
        // Wrong results of the calls timed (`--check-iters`).
        let mut earlier = 0u64;
        let mut times = vec![0f64; self.a.iters.max(1)];
        if let Some((dev, stream)) = &self.dev {
            self.time_on_device(dev, *stream, coll, &send, &recv, &mut times)?;
        } else if self.a.blocking == 0 {
            self.issue(coll, &send, &mut recv, self.a.warmup)?;
            let (t, i) = self.issue(coll, &send, &mut recv, times.len())?;
            times = t;
            info = i;
        } else {
            let each = self.a.check_iters;
            for _ in 0..self.a.warmup {
                if each {
                    self.prepare(o, &send, &mut recv, count);
                }
                info = Some(self.call(coll, &send, &mut recv, self.inplace)?);
                if each {
                    earlier += self.wrong_in(o, &recv, count);
                }
            }
            for t in times.iter_mut() {
                if each {
                    self.prepare(o, &send, &mut recv, count);
                }
                let s = Instant::now();
                let i = self.call(coll, &send, &mut recv, self.inplace)?;
                *t = s.elapsed().as_secs_f64() * 1e6;
                info = Some(i);
                if each {
                    earlier += self.wrong_in(o, &recv, count);
                }
            }
        }
        let times = self.combine(times)?;
        let wrong = match self.a.check {
            0 => None,
            k => {
                let mut w = self.check(o, bytes, earlier)?;
                for _ in 1..k {
                    w += self.check(o, bytes, 0)?;
                }
                Some(w)
            }
        };
        let real_bytes = match o {
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => count * n * self.dt.size(),
            Op::Barrier => 0,
            _ => count * self.dt.size(),
        };
        let algo = match info.and_then(|i| i.algo) {
            Some(a) => a.name().to_string(),
            None => match o.kind() {
                Some(k) => self
                    .c
                    .plan(k, self.dt, real_bytes, self.opts.algo)
                    .0
                    .name()
                    .to_string(),
                None => "p2p".into(),
            },
        };
        Ok(Measured {
            times,
            wrong,
            bytes: real_bytes,
            count,
            algo,
        })
    }

    /// Each iteration's time over ranks, as `-a` asks: 0 rank 0's, 1 the mean, 2 the
    /// fastest rank's, 3 the slowest rank's.
    fn combine(&self, mut times: Vec<f64>) -> roccl::Result<Vec<f64>> {
        let n = self.c.nranks() as f64;
        match self.a.average {
            0 => {
                let mut v = if self.c.rank() == 0 {
                    times
                } else {
                    vec![0.0; times.len()]
                };
                self.c.all_reduce_in_place(&mut v, RedOp::Sum)?;
                Ok(v)
            }
            1 => {
                self.c.all_reduce_in_place(&mut times, RedOp::Sum)?;
                Ok(times.into_iter().map(|t| t / n).collect())
            }
            2 => {
                self.c.all_reduce_in_place(&mut times, RedOp::Min)?;
                Ok(times)
            }
            _ => {
                self.c.all_reduce_in_place(&mut times, RedOp::Max)?;
                Ok(times)
            }
        }
    }
}

/// One page of a [`Buf`].
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(4096))]
struct Page([u8; 4096]);

/// A page-aligned byte buffer, as device memory and tensors are. A collective's speed depends
/// on how its buffers are aligned against each other: a process_vm_readv between a source and
/// a destination that sit at different offsets within a cache line copies much slower (2
/// ranks, all-gather of 4 MiB over shared memory: 250–333 µs on heap buffers at arbitrary
/// offsets against 205–216 page-aligned; docs/PERFORMANCE-LOG.md).
#[derive(Clone)]
pub struct Buf {
    pages: Vec<Page>,
    len: usize,
}

impl Buf {
    fn zeroed(len: usize) -> Buf {
        Buf {
            pages: vec![Page::zeroed(); len.div_ceil(4096)],
            len,
        }
    }
}

impl std::ops::Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.pages)[..self.len]
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.pages)[..self.len]
    }
}
