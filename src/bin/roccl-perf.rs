//! roccl-perf: nccl-tests style benchmark with correctness checking.
//!
//! `roccl-perf --op all_reduce --ranks 4` spawns 4 local rank processes; launched by
//! torchrun/srun/mpirun (or with ROCCL_RANK/ROCCL_NRANKS/ROCCL_ROOT) it joins as one rank.
//! Sizes are total buffer bytes as in nccl-tests. `time_us` is the median over iterations
//! of the slowest rank's time (`mean_us`, in the JSON, their mean: what a loop timed as a
//! whole gets); busbw uses nccl-tests' factors.

use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Instant;

use bytemuck::{Pod, Zeroable};
use clap::builder::PossibleValuesParser;
use clap::Parser;
use roccl::algo::model::CollKind;
use roccl::comm::stream::ops::{self, RawBuf};
use roccl::device::sim::SimDevice;
use roccl::device::{self, Alloc, Device, StreamId};
use roccl::net::NetKind;
use roccl::tool::launch::{self, Outcome};
use roccl::{Algo, CallOpts, Collective, Communicator, DataType, RedOp, UniqueId};

/// Set in the environment of the ranks `--ranks N` starts.
const LAUNCHED: &str = "ROCCL_PERF_LAUNCHED";

/// A line on standard output; a closed standard output ends the program quietly.
macro_rules! outln {
    ($($t:tt)*) => {
        roccl::tool::print_line(format_args!($($t)*))
    };
}

/// A line on standard error, in one write (the ranks of a job share it).
macro_rules! errln {
    ($($t:tt)*) => {
        roccl::tool::print_error(format_args!($($t)*))
    };
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "roccl-perf",
    about = "Benchmark and check roccl collectives (nccl-tests style)"
)]
struct Args {
    /// Collectives to run, comma-separated (all: every one).
    #[arg(long, default_value = "all_reduce", value_delimiter = ',', value_parser = PossibleValuesParser::new(op_names()))]
    op: Vec<String>,
    /// Local rank processes to spawn (ignored when launched by torchrun/srun/mpirun).
    #[arg(long, short = 'n', default_value_t = 1)]
    ranks: usize,
    /// Network (as ROCCL_NET): auto (shared memory between ranks of one host, to other hosts
    /// verbs where a usable NIC exists, else tcp), tcp, rocev2 (the userspace RoCE v2 engine
    /// over UDP), verbs (RoCE v2 NIC; built with --features verbs), shm (one host).
    #[arg(long, default_value = "auto", value_parser = PossibleValuesParser::new(NETS.map(net_name)))]
    net: String,
    /// Algorithm (as ROCCL_ALGO); one a collective does not have is replaced by the cost
    /// model's choice, with a warning.
    #[arg(long, default_value = "auto", value_parser = PossibleValuesParser::new(algo_names()))]
    algo: String,
    /// Data type.
    #[arg(long, short = 'd', default_value = "f32", value_parser = PossibleValuesParser::new(DataType::ALL.map(DataType::name)))]
    dtype: String,
    /// Reduction.
    #[arg(long, short = 'o', default_value = "sum", value_parser = PossibleValuesParser::new(RedOp::ALL.map(RedOp::name)))]
    redop: String,
    /// Root of broadcast and reduce.
    #[arg(long, short = 'r', default_value_t = 0)]
    root: usize,
    /// Smallest size in bytes (K/M/G suffixes).
    #[arg(long, short = 'b', default_value = "8")]
    minbytes: String,
    /// Largest size in bytes.
    #[arg(long, short = 'e', default_value = "64M")]
    maxbytes: String,
    /// Size multiplication factor.
    #[arg(long, short = 'f', default_value_t = 4)]
    stepfactor: usize,
    /// Timed iterations per size.
    #[arg(long, short = 'i', default_value_t = 20)]
    iters: usize,
    /// Untimed iterations per size.
    #[arg(long, short = 'w', default_value_t = 5)]
    warmup: usize,
    /// Run in place.
    #[arg(long)]
    inplace: bool,
    /// Check every result against a reference (on by default; --check=false to skip).
    #[arg(long, short = 'c', default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    check: bool,
    /// Also check the result of every warm-up and timed call (its output poisoned before
    /// it, so a call that wrote nothing is seen too), not only one call after them: for
    /// tests of faults during traffic (slower; host buffers only, not with --device).
    #[arg(long)]
    check_iters: bool,
    /// Write a JSON array of results to FILE.
    #[arg(long)]
    json: Option<String>,
    /// Bind spawned ranks to CPUs: auto (one CPU each when there are enough), none.
    #[arg(long, default_value = "auto")]
    bind: String,
    /// Buffers in GPU memory and stream-ordered calls, timed from the call until the stream
    /// has passed it: hip, cuda, sim (the simulated device, memory the CPU cannot access:
    /// staged through pinned buffers) or sim-apu (simulated integrated GPU: used in place).
    #[arg(long)]
    device: Option<String>,
    /// Same as --device sim-apu.
    #[arg(long)]
    stream: bool,
}

/// Every network `--net` offers (a new kind of network fails to compile in [`net_name`]).
const NETS: [NetKind; 5] = [
    NetKind::Auto,
    NetKind::Tcp,
    NetKind::RoceV2,
    NetKind::Verbs,
    NetKind::Shm,
];

/// The name `--net` and ROCCL_NET give a network.
fn net_name(k: NetKind) -> &'static str {
    match k {
        NetKind::Auto => "auto",
        NetKind::Tcp => "tcp",
        NetKind::RoceV2 => "rocev2",
        NetKind::Verbs => "verbs",
        NetKind::Shm => "shm",
    }
}

/// `--algo`'s values: auto and every algorithm.
fn algo_names() -> Vec<&'static str> {
    std::iter::once("auto")
        .chain(Algo::ALL.iter().map(|a| a.name()))
        .collect()
}

/// `--op`'s values: every collective and all.
fn op_names() -> Vec<&'static str> {
    ALL_OPS.iter().map(|o| o.name()).chain(["all"]).collect()
}

fn parse_size(s: &str) -> Result<usize, String> {
    roccl::envvar::parse_bytes(s).ok_or_else(|| format!("bad size '{s}': use e.g. 8, 64K, 16M, 1G"))
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    AllReduce,
    AllGather,
    Broadcast,
    ReduceScatter,
    Reduce,
    AllToAll,
    SendRecv,
    Barrier,
}

const ALL_OPS: [Op; 8] = [
    Op::AllReduce,
    Op::AllGather,
    Op::Broadcast,
    Op::ReduceScatter,
    Op::Reduce,
    Op::AllToAll,
    Op::SendRecv,
    Op::Barrier,
];

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::ReduceScatter => "reduce_scatter",
            Op::Reduce => "reduce",
            Op::AllToAll => "all_to_all",
            Op::SendRecv => "sendrecv",
            Op::Barrier => "barrier",
        }
    }
    fn parse(list: &[String]) -> Result<Vec<Op>, String> {
        if list.iter().any(|x| x == "all") {
            return Ok(ALL_OPS.to_vec());
        }
        list.iter()
            .map(|x| {
                ALL_OPS
                    .iter()
                    .copied()
                    .find(|o| o.name() == x.trim())
                    .ok_or_else(|| {
                        format!(
                            "unknown op '{x}': expected one of {}",
                            op_names().join(", ")
                        )
                    })
            })
            .collect()
    }
    fn reduces(self) -> bool {
        matches!(self, Op::AllReduce | Op::ReduceScatter | Op::Reduce)
    }
    fn rooted(self) -> bool {
        matches!(self, Op::Broadcast | Op::Reduce)
    }
    /// nccl-tests bus bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            _ => 1.0,
        }
    }
    fn kind(self) -> Option<CollKind> {
        Some(match self {
            Op::AllReduce => CollKind::AllReduce,
            Op::AllGather => CollKind::AllGather,
            Op::Broadcast => CollKind::Broadcast,
            Op::ReduceScatter => CollKind::ReduceScatter,
            Op::Reduce => CollKind::Reduce,
            Op::AllToAll => CollKind::AllToAll,
            _ => return None,
        })
    }
}

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
type DevStream = (Arc<dyn Device>, StreamId);

struct Bench<'a> {
    c: &'a Arc<Communicator>,
    a: &'a Args,
    dt: DataType,
    op: RedOp,
    opts: CallOpts,
    /// `--device`: the GPU runtime and this rank's stream.
    dev: Option<DevStream>,
}

#[derive(serde::Serialize)]
struct Row {
    op: &'static str,
    bytes: usize,
    count: usize,
    dtype: String,
    redop: String,
    root: i64,
    algo: String,
    net: String,
    ranks: usize,
    time_us: f64,
    /// The mean of the per-iteration times (slowest rank each), where `time_us` is the median.
    mean_us: f64,
    algbw_gbs: f64,
    busbw_gbs: f64,
    wrong: u64,
}

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
                let out = if self.a.inplace { n * count } else { count };
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
        if self.a.inplace {
            self.place_input(o, send, recv, count);
        }
    }

    /// One call's wrong results (`check`'s input, the pattern) on this rank, and, with
    /// `earlier`, the wrong results of earlier calls (`--check-iters`) summed over ranks.
    fn check(&self, o: Op, bytes: usize, earlier: u64) -> roccl::Result<u64> {
        let (dt, op, me) = (self.dt, self.op, self.c.rank());
        let (mut send, mut recv, coll, count) = self.setup(o, bytes);
        let inplace = self.a.inplace && o != Op::SendRecv;
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
        let inplace = self.a.inplace && o != Op::SendRecv;
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
            Some(e) => Err(roccl::Error::InvalidUsage(e)),
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
        let op = self.device_op(coll, sb.as_ref(), rb.as_ref(), self.a.inplace);
        for _ in 0..self.a.warmup {
            self.run_on_device(dev, stream, op)?;
        }
        for t in times.iter_mut() {
            let start = Instant::now();
            self.run_on_device(dev, stream, op)?;
            *t = start.elapsed().as_secs_f64() * 1e6;
        }
        Ok(())
    }

    fn run(&self, o: Op, bytes: usize) -> roccl::Result<Row> {
        let n = self.c.nranks();
        let (mut send, mut recv, coll, count) = self.setup(o, bytes);
        // Time on real data, as nccl-tests does: buffers left as allocated would be read from
        // the kernel's shared zero page (one 4 KiB page in cache, however large the buffer).
        let me = self.c.rank();
        fill(self.dt, &mut send, |i| pattern(self.dt, self.op, me, i));
        if self.a.inplace {
            self.place_input(o, &send, &mut recv, count);
        }
        let mut info = None;
        // Wrong results of the calls timed (`--check-iters`).
        let mut earlier = 0u64;
        let mut times = vec![0f64; self.a.iters.max(1)];
        if let Some((dev, stream)) = &self.dev {
            self.time_on_device(dev, *stream, coll, &send, &recv, &mut times)?;
        } else {
            let each = self.a.check_iters;
            for _ in 0..self.a.warmup {
                if each {
                    self.prepare(o, &send, &mut recv, count);
                }
                info = Some(self.call(coll, &send, &mut recv, self.a.inplace)?);
                if each {
                    earlier += self.wrong_in(o, &recv, count);
                }
            }
            for t in times.iter_mut() {
                if each {
                    self.prepare(o, &send, &mut recv, count);
                }
                let s = Instant::now();
                let i = self.call(coll, &send, &mut recv, self.a.inplace)?;
                *t = s.elapsed().as_secs_f64() * 1e6;
                info = Some(i);
                if each {
                    earlier += self.wrong_in(o, &recv, count);
                }
            }
        }
        // Slowest rank per iteration, then the median.
        self.c.all_reduce_in_place(&mut times, RedOp::Max)?;
        times.sort_by(|a, b| a.total_cmp(b));
        let med = times[times.len() / 2];
        let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
        let wrong = if self.a.check {
            self.check(o, bytes, earlier)?
        } else {
            0
        };
        let real_bytes = match o {
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => count * n * self.dt.size(),
            Op::Barrier => 0,
            _ => count * self.dt.size(),
        };
        let algbw = real_bytes as f64 / med / 1e3;
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
        Ok(Row {
            op: o.name(),
            bytes: real_bytes,
            count,
            dtype: self.dt.name().into(),
            redop: if o.reduces() {
                self.op.name().into()
            } else {
                "none".into()
            },
            root: if o.rooted() { self.a.root as i64 } else { -1 },
            algo,
            net: self.c.net_name().into(),
            ranks: n,
            time_us: med,
            mean_us: mean,
            algbw_gbs: algbw,
            busbw_gbs: algbw * o.bus_factor(n),
            wrong,
        })
    }
}

fn sizes(a: &Args) -> Result<Vec<usize>, String> {
    let (mut b, e) = (parse_size(&a.minbytes)?, parse_size(&a.maxbytes)?);
    if a.stepfactor < 2 {
        return Err("--stepfactor must be at least 2".into());
    }
    if b > e {
        return Err(format!(
            "-b {} ({b} bytes) is larger than -e {} ({e} bytes): no size to run; swap them",
            a.minbytes, a.maxbytes
        ));
    }
    let mut v = Vec::new();
    while b <= e {
        v.push(b);
        b = b.saturating_mul(a.stepfactor);
        if b == 0 {
            break;
        }
    }
    Ok(v)
}

/// `--device`: the runtime (bound to this thread) and a new stream.
fn open_device(a: &Args) -> Result<Option<DevStream>, String> {
    let name = match (&a.device, a.stream) {
        (Some(d), _) => d.as_str(),
        (None, true) => "sim-apu",
        (None, false) => return Ok(None),
    };
    let dev: Arc<dyn Device> = match name {
        "sim" | "sim-apu" => {
            let d = SimDevice::new(std::time::Duration::ZERO);
            d.set_integrated(name == "sim-apu");
            d
        }
        rt => device::open_runtime(rt).map_err(|e| format!("--device {rt}: {e}"))?,
    };
    dev.bind_thread().map_err(|e| e.to_string())?;
    let s = dev.create_stream().map_err(|e| e.to_string())?;
    Ok(Some((dev, s)))
}

/// What the arguments ask for, checked.
struct Plan {
    dt: DataType,
    op: RedOp,
    algo: Option<Algo>,
    ops: Vec<Op>,
    sizes: Vec<usize>,
}

/// Check the arguments for a job of `nranks` ranks, `local` of them on this host (the
/// launcher checks them before it starts any rank, so that an error is printed once).
fn check_args(a: &Args, nranks: usize, local: usize) -> Result<Plan, String> {
    let dt: DataType = a.dtype.parse().map_err(|e: roccl::Error| e.to_string())?;
    let op: RedOp = a.redop.parse().map_err(|e: roccl::Error| e.to_string())?;
    let algo = match a.algo.as_str() {
        "auto" => None,
        s => Some(s.parse::<Algo>().map_err(|e| e.to_string())?),
    };
    if a.root >= nranks {
        return Err(format!(
            "--root {} is out of range for {nranks} ranks (0 to {})",
            a.root,
            nranks - 1
        ));
    }
    if a.iters == 0 {
        return Err("--iters 0: at least one timed iteration is needed".into());
    }
    if a.check_iters && (a.device.is_some() || a.stream || !a.check) {
        return Err("--check-iters checks host buffers between calls: not with --device, --stream or --check=false".into());
    }
    let ops = Op::parse(&a.op)?;
    let sizes = sizes(a)?;
    let largest = sizes.iter().copied().max().unwrap_or(0) as u64;
    // run() and check() hold a send and a receive buffer of the largest size each, and an
    // in-place reduce-scatter one more.
    let need = largest.saturating_mul(5).saturating_mul(local as u64);
    if let Some(avail) = available_memory() {
        if need > avail {
            return Err(format!(
                "-e {} needs about {} of memory ({local} rank(s) on this host, up to 5 buffers of {} each) but {} is available: lower -e",
                a.maxbytes,
                gib(need),
                gib(largest),
                gib(avail)
            ));
        }
    }
    Ok(Plan {
        dt,
        op,
        algo,
        ops,
        sizes,
    })
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Memory this process can still get: MemAvailable, capped by the cgroup's limit.
fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let avail = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())?
        * 1024;
    let read = |f: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{f}"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    let cgroup = match (read("memory.max"), read("memory.current")) {
        (Some(max), Some(cur)) => Some(max.saturating_sub(cur)),
        _ => None,
    };
    Some(cgroup.map_or(avail, |c| c.min(avail)))
}

/// Widths of the table's columns (op, size, count, type, redop, root, algo, time, algbw,
/// busbw, wrong); the headers use the same, so that they sit over their data.
const COLUMNS: [usize; 11] = [16, 12, 12, 6, 6, 5, 9, 11, 9, 9, 7];

/// One row of the table, each cell right-aligned in its column.
fn table_line<S: AsRef<str>>(cells: &[S]) -> String {
    cells
        .iter()
        .zip(COLUMNS)
        .map(|(c, w)| format!("{:>w$}", c.as_ref()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A header row: a table row whose first character is `#`.
fn header_line(cells: &[&str]) -> String {
    let mut l = table_line(cells);
    l.replace_range(..1, "#");
    l
}

fn rank_main(c: Communicator, a: &Args) -> Result<bool, String> {
    let local = if std::env::var_os(LAUNCHED).is_some() {
        c.nranks()
    } else {
        1
    };
    let Plan {
        dt,
        op,
        algo,
        ops,
        sizes,
    } = check_args(a, c.nranks(), local)?;
    let c = Arc::new(c);
    let b = Bench {
        c: &c,
        a,
        dt,
        op,
        opts: CallOpts {
            algo,
            ..Default::default()
        },
        dev: open_device(a)?,
    };
    let lead = c.rank() == 0;
    if lead {
        outln!(
            "# roccl-perf: {} ranks, net {}{}, dtype {}, redop {}, iters {}, warmup {}, {}, check {}",
            c.nranks(),
            c.net_name(),
            match &b.dev {
                Some((d, _)) => format!(
                    ", {} device buffers, stream-ordered (chunk {})",
                    d.name(),
                    ops::stream_chunk().map_err(|e| e.to_string())?
                ),
                None => String::new(),
            },
            dt,
            op,
            a.iters,
            a.warmup,
            if a.inplace {
                "in place"
            } else {
                "out of place"
            },
            if a.check { "on" } else { "off" }
        );
        let names = [
            "op", "size", "count", "type", "redop", "root", "algo", "time", "algbw", "busbw",
            "wrong",
        ];
        let units = [
            "",
            "(B)",
            "(elements)",
            "",
            "",
            "",
            "",
            "(us)",
            "(GB/s)",
            "(GB/s)",
            "(#)",
        ];
        outln!("{}", header_line(&names));
        outln!("{}", header_line(&units));
    }
    let mut rows = Vec::new();
    let mut ok = true;
    for o in ops {
        let list: Vec<usize> = if o == Op::Barrier {
            vec![0]
        } else {
            sizes.clone()
        };
        for &s in &list {
            let row = b
                .run(o, s)
                .map_err(|e| format!("{} at {s} bytes: {e}", o.name()))?;
            ok &= row.wrong == 0;
            if lead {
                outln!(
                    "{}",
                    table_line(&[
                        row.op.to_string(),
                        row.bytes.to_string(),
                        row.count.to_string(),
                        row.dtype.clone(),
                        row.redop.clone(),
                        row.root.to_string(),
                        row.algo.clone(),
                        format!("{:.2}", row.time_us),
                        format!("{:.3}", row.algbw_gbs),
                        format!("{:.3}", row.busbw_gbs),
                        row.wrong.to_string(),
                    ])
                );
            }
            rows.push(row);
        }
    }
    if lead {
        let total: u64 = rows.iter().map(|r| r.wrong).sum();
        outln!(
            "# wrong results: {total}{}",
            if total == 0 { "" } else { "  <-- FAILED" }
        );
        if a.device.is_some() || a.stream {
            // Device memory the CPU cannot reach is staged, except what went GPU-direct.
            outln!(
                "# bytes staged through pinned host buffers (rank 0, in and out): {}",
                roccl::comm::stream::ops::staged_bytes()
            );
        }
        if let Some(path) = &a.json {
            let text = serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?;
            std::fs::write(path, text).map_err(|e| format!("writing {path}: {e}"))?;
        }
    }
    Ok(ok)
}

fn launched_by_env() -> bool {
    [
        "ROCCL_RANK",
        "RANK",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
    ]
    .iter()
    .any(|k| std::env::var_os(k).is_some())
}

fn main() -> ExitCode {
    let a = Args::parse();
    if let Ok(cpu) = std::env::var("ROCCL_PERF_CPU") {
        // Set by our own launcher: stay on one CPU so that the kernel does not pull
        // communicating ranks onto the same core when they sleep.
        if let Err(e) = cpu
            .parse::<usize>()
            .map_err(|e| e.to_string())
            .and_then(|c| roccl::os::bind_to_cpu(c).map_err(|e| e.to_string()))
        {
            errln!("roccl-perf: warning: could not bind to CPU {cpu}: {e}");
        }
    }
    if a.net != "auto" {
        std::env::set_var("ROCCL_NET", &a.net);
    }
    if std::env::var_os(LAUNCHED).is_some() {
        // Our launcher ends the job quietly when rank 0 finds standard output closed.
        roccl::tool::set_closed_stdout_status(roccl::tool::EXIT_STDOUT_CLOSED);
    }
    // Errors of a rank of several name it: the ranks of a job share standard error.
    let res = if launched_by_env() {
        match Communicator::from_env() {
            Ok(c) => {
                let who = format!("rank {} of {}: ", c.rank(), c.nranks());
                rank_main(c, &a).map_err(|e| format!("{who}{e}"))
            }
            Err(e) => Err(match std::env::var("ROCCL_RANK") {
                Ok(r) => format!("rank {r}: {e}"),
                Err(_) => e.to_string(),
            }),
        }
    } else if a.ranks == 0 {
        Err("--ranks 0: a job needs at least one rank".into())
    } else if a.ranks == 1 {
        UniqueId::new()
            .and_then(|id| Communicator::init(&id, 1, 0))
            .map_err(|e| e.to_string())
            .and_then(|c| rank_main(c, &a))
    } else {
        launch(&a)
    };
    match res {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            errln!("roccl-perf: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Spawn `--ranks` copies of this program as the ranks of one communicator whose root runs
/// here; rank 0 prints. The job ends as soon as one rank fails (`roccl::tool::launch`).
fn launch(a: &Args) -> Result<bool, String> {
    check_args(a, a.ranks, a.ranks)?;
    roccl::comm::settings::check().map_err(|e| e.to_string())?;
    let id = UniqueId::new().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| format!("finding roccl-perf's own path: {e}"))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cpus = roccl::os::allowed_cpus().unwrap_or_default();
    let bind = match a.bind.as_str() {
        "auto" => a.ranks <= cpus.len(),
        "none" => false,
        other => return Err(format!("--bind {other}: expected auto or none")),
    };
    let mut cmds = Vec::new();
    for r in 0..a.ranks {
        let mut cmd = Command::new(&exe);
        if let Some(cpu) = cpus.get(r).filter(|_| bind) {
            cmd.env("ROCCL_PERF_CPU", cpu.to_string());
        }
        cmd.args(&args)
            .env(LAUNCHED, "1")
            .env("ROCCL_UNIQUE_ID", id.to_hex())
            .env("ROCCL_RANK", r.to_string())
            .env("ROCCL_NRANKS", a.ranks.to_string())
            .stdout(if r == 0 {
                std::process::Stdio::inherit()
            } else {
                std::process::Stdio::null()
            });
        cmds.push(cmd);
    }
    match launch::run(cmds)? {
        Outcome::Done { all_ok } => Ok(all_ok),
        Outcome::StdoutClosed => std::process::exit(0),
        Outcome::Failed(e) => Err(e),
        Outcome::Signalled(sig) => std::process::exit(128 + sig),
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
/// offsets against 205–216 page-aligned; docs/PERFORMANCE.md).
#[derive(Clone)]
struct Buf {
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
