//! GPU-direct collectives: with `ROCCL_GPU_DIRECT`, stream-ordered broadcasts, all-gathers,
//! all-to-alls and sends/receives on device memory move it through the network without
//! staging copies. Here the device memory is the simulated device's device-only memory (its
//! addresses are PROT_NONE: any CPU touch kills the test) and the network is the userspace
//! RoCE v2 engine posing as a NIC that takes dmabufs (`ROCCL_ROCEV2_SIM_GPU=1`): every byte
//! moves by RDMA from and into the exported dmabufs. Producers write inputs late on each
//! rank's stream and consumers snapshot outputs and scribble over the buffers after the call,
//! so a call out of stream order shows as wrong bytes; the process-wide count of staged
//! bytes tells a GPU-direct call from a staged one.
//!
//! One test function: the engine reads `ROCCL_ROCEV2_SIM_GPU` from the environment, which
//! is set once here before any thread starts.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;
use parking_lot::Mutex;
use roccl::algo::model::Tuning;
use roccl::comm::stream::ops::{self, Op, RawBuf};
use roccl::comm::GpuDirect;
use roccl::device::fake_gpu::{FakeGpu, FakeGpuBuffer};
use roccl::device::{Device, StreamId};
use roccl::net::NetKind;
use roccl::{Algo, Collective, Communicator, Config, DataType, RedOp, UniqueId};

/// Test settings with GPU-direct `mode` down to `min` bytes.
fn cfg(net: NetKind, algo: Option<Algo>, min: usize, mode: GpuDirect) -> Config {
    let mut c = config(Tuning::default());
    c.net = net;
    c.algo = algo;
    c.gpu_direct = mode;
    c.gpu_direct_min = min;
    c
}

const DT: DataType = DataType::F32;

/// What to check after the stream ran: name, snapshot of the output, expected element `i`.
type Checks = Vec<(String, Arc<Mutex<Vec<u8>>>, Box<dyn Fn(usize) -> f64>)>;

fn raw_of(b: &FakeGpuBuffer) -> RawBuf {
    RawBuf {
        addr: b.addr(),
        len: b.len(),
    }
}

/// Write `v(i)` into element `i` of `b` late on `stream`.
fn produce(
    sim: &FakeGpu,
    stream: StreamId,
    b: &Arc<FakeGpuBuffer>,
    v: impl Fn(usize) -> f64 + Send + Sync + 'static,
) {
    let b = Arc::clone(b);
    sim.launch(stream, move || {
        b.with(|x| {
            for (i, e) in x.chunks_mut(4).enumerate() {
                put(DT, v(i), e);
            }
        })
    })
    .unwrap();
}

/// Snapshot `b` on `stream`, then scribble over `scribble`.
fn consume(
    sim: &FakeGpu,
    stream: StreamId,
    b: &Arc<FakeGpuBuffer>,
    scribble: &[&Arc<FakeGpuBuffer>],
) -> Arc<Mutex<Vec<u8>>> {
    let snap = Arc::new(Mutex::new(Vec::new()));
    let (s, b) = (Arc::clone(&snap), Arc::clone(b));
    let bs: Vec<_> = scribble.iter().map(|x| Arc::clone(x)).collect();
    sim.launch(stream, move || {
        *s.lock() = b.with(|x| x.to_vec());
        for x in &bs {
            x.with(|y| y.fill(0xee));
        }
    })
    .unwrap();
    snap
}

/// Run `ops` of this rank on `stream` (one group).
fn on_stream(dev: &Arc<dyn Device>, c: &Arc<Communicator>, stream: StreamId, ops: Vec<Op>) {
    let ops = ops
        .into_iter()
        .map(|o| (Arc::clone(c), o, stream))
        .collect();
    // SAFETY: every buffer is a live FakeGpuBuffer kept until the stream is synchronized.
    unsafe { ops::run_on_streams(dev, ops, Duration::from_secs(60)) }.unwrap();
}

fn coll(c: Collective, send: Option<&Arc<FakeGpuBuffer>>, recv: &Arc<FakeGpuBuffer>) -> Op {
    Op::Coll {
        coll: c,
        dt: DT,
        send: send.map(|s| raw_of(s)),
        recv: raw_of(recv),
        premul: None,
    }
}

/// One rank's round of every GPU-direct collective; returns what to check.
fn direct_round(
    sim: &Arc<FakeGpu>,
    c: &Arc<Communicator>,
    stream: StreamId,
    count: usize,
    round: usize,
) -> Checks {
    let dev: Arc<dyn Device> = sim.clone();
    let (n, me) = (c.nranks(), c.rank());
    let alloc = |elems: usize| sim.alloc_device_only(4 * elems);
    let mut checks: Checks = Vec::new();
    let v = move |r: usize, i: usize| (1000 * r + i + 7 * round) as f64 % 65536.0;

    // Broadcast from each root, out of place at the root.
    for root in 0..n {
        let (s, r) = (alloc(count), alloc(count));
        if me == root {
            produce(sim, stream, &s, move |i| v(root, i));
        }
        let send = (me == root).then_some(&s);
        on_stream(
            &dev,
            c,
            stream,
            vec![coll(Collective::Broadcast { root }, send, &r)],
        );
        checks.push((
            format!("broadcast from {root}"),
            consume(sim, stream, &r, &[&s, &r]),
            Box::new(move |i| v(root, i)),
        ));
    }
    // In-place broadcast.
    let b = alloc(count);
    produce(
        sim,
        stream,
        &b,
        move |i| if me == 1 { v(1, i) } else { -1.0 },
    );
    on_stream(
        &dev,
        c,
        stream,
        vec![coll(Collective::Broadcast { root: 1 }, None, &b)],
    );
    checks.push((
        "in-place broadcast".into(),
        consume(sim, stream, &b, &[&b]),
        Box::new(move |i| v(1, i)),
    ));
    // All-gather, out of place and in place.
    let (s, r) = (alloc(count), alloc(count * n));
    produce(sim, stream, &s, move |i| v(me, i));
    on_stream(
        &dev,
        c,
        stream,
        vec![coll(Collective::AllGather, Some(&s), &r)],
    );
    checks.push((
        "all_gather".into(),
        consume(sim, stream, &r, &[&s, &r]),
        Box::new(move |i| v(i / count, i % count)),
    ));
    let g = alloc(count * n);
    produce(sim, stream, &g, move |i| {
        if i / count == me {
            v(me, i % count)
        } else {
            -2.0
        }
    });
    on_stream(&dev, c, stream, vec![coll(Collective::AllGather, None, &g)]);
    checks.push((
        "in-place all_gather".into(),
        consume(sim, stream, &g, &[&g]),
        Box::new(move |i| v(i / count, i % count)),
    ));
    // All-to-all, out of place and in place: block j of rank r goes to rank j.
    let a2a = move |from: usize, to: usize, i: usize| v(from, 100 * to + i);
    let (s, r) = (alloc(count * n), alloc(count * n));
    produce(sim, stream, &s, move |i| a2a(me, i / count, i % count));
    on_stream(
        &dev,
        c,
        stream,
        vec![coll(Collective::AllToAll, Some(&s), &r)],
    );
    checks.push((
        "all_to_all".into(),
        consume(sim, stream, &r, &[&s, &r]),
        Box::new(move |i| a2a(i / count, me, i % count)),
    ));
    let t = alloc(count * n);
    produce(sim, stream, &t, move |i| a2a(me, i / count, i % count));
    on_stream(&dev, c, stream, vec![coll(Collective::AllToAll, None, &t)]);
    checks.push((
        "in-place all_to_all".into(),
        consume(sim, stream, &t, &[&t]),
        Box::new(move |i| a2a(i / count, me, i % count)),
    ));
    // A ring of sends and receives in one group, plus a send to self.
    let (to, from) = ((me + 1) % n, (me + n - 1) % n);
    let (ps, pr, ss, sr) = (alloc(count), alloc(count), alloc(3), alloc(3));
    produce(sim, stream, &ps, move |i| v(me, i) + 0.5);
    produce(sim, stream, &ss, move |i| v(me, i) + 0.25);
    on_stream(
        &dev,
        c,
        stream,
        vec![
            Op::Send {
                peer: to,
                buf: raw_of(&ps),
            },
            Op::Recv {
                peer: from,
                buf: raw_of(&pr),
            },
            Op::Send {
                peer: me,
                buf: raw_of(&ss),
            },
            Op::Recv {
                peer: me,
                buf: raw_of(&sr),
            },
        ],
    );
    checks.push((
        format!("receive from {from}"),
        consume(sim, stream, &pr, &[&ps, &pr]),
        Box::new(move |i| v(from, i) + 0.5),
    ));
    checks.push((
        "receive from self".into(),
        consume(sim, stream, &sr, &[&ss, &sr]),
        Box::new(move |i| v(me, i) + 0.25),
    ));
    checks
}

/// One group of 40 sends and 40 receives of distinct buffers with the next and previous
/// rank, twice: more GPU registrations in one call than the cache keeps (64), so a call's own
/// registrations must not be evicted while it runs, and the second call reuses some. Every
/// other buffer is above the eager size (16 KiB), so RDMA writes use the registrations too.
fn many_buffers(sim: &Arc<FakeGpu>, c: &Arc<Communicator>, stream: StreamId) -> Checks {
    let dev: Arc<dyn Device> = sim.clone();
    let (n, me) = (c.nranks(), c.rank());
    let (to, from) = ((me + 1) % n, (me + n - 1) % n);
    let mut checks: Checks = Vec::new();
    for round in 0..2usize {
        let mut ops = Vec::new();
        let mut keep = Vec::new();
        for k in 0..40usize {
            let elems = if k % 2 == 0 { 1000 } else { 5000 };
            let (s, r) = (
                sim.alloc_device_only(4 * elems),
                sim.alloc_device_only(4 * elems),
            );
            produce(sim, stream, &s, move |i| {
                (me * 100_000 + k * 1000 + i + round) as f64
            });
            ops.push(Op::Send {
                peer: to,
                buf: raw_of(&s),
            });
            ops.push(Op::Recv {
                peer: from,
                buf: raw_of(&r),
            });
            keep.push((k, s, r));
        }
        on_stream(&dev, c, stream, ops);
        for (k, s, r) in keep {
            checks.push((
                format!("round {round}, receive {k} of 40"),
                consume(sim, stream, &r, &[&s, &r]),
                Box::new(move |i| (from * 100_000 + k * 1000 + i + round) as f64),
            ));
        }
    }
    checks
}

/// Three broadcasts of 80 KB (RDMA, not eager), each into buffers allocated after the last
/// ones were freed: the simulated device maps new memory where the old was, so a registration
/// kept from the previous round is stale and must not be used for the new memory (its bytes
/// would go to the freed buffer). Returns whether any address came back.
fn reallocated(
    sim: &Arc<FakeGpu>,
    c: &Arc<Communicator>,
    stream: StreamId,
    gate: &Barrier,
) -> bool {
    // One rank at a time frees its buffers and allocates the next ones, so the addresses it
    // just gave back are the free ones.
    static TURN: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
    let dev: Arc<dyn Device> = sim.clone();
    let me = c.rank();
    let mut seen = Vec::new();
    let mut reused = false;
    let mut bufs: Option<(Arc<FakeGpuBuffer>, Arc<FakeGpuBuffer>)> = None;
    for round in 0..4usize {
        for turn in 0..c.nranks() {
            gate.wait();
            if turn == me {
                let _t = TURN.lock();
                drop(bufs.take());
                let b = (
                    sim.alloc_device_only(4 * 20_000),
                    sim.alloc_device_only(4 * 20_000),
                );
                reused |= seen.contains(&b.0.addr()) || seen.contains(&b.1.addr());
                seen.extend([b.0.addr(), b.1.addr()]);
                bufs = Some(b);
            }
        }
        let (s, r) = bufs.clone().expect("allocated above");
        produce(sim, stream, &s, move |i| (i + 1000 * round) as f64);
        let send = (me == 0).then_some(&s);
        on_stream(
            &dev,
            c,
            stream,
            vec![coll(Collective::Broadcast { root: 0 }, send, &r)],
        );
        let snap = consume(sim, stream, &r, &[&s, &r]);
        sim.synchronize(stream).unwrap();
        check(
            &format!("rank {me}: broadcast into reallocated memory, round {round}"),
            DT,
            &snap.lock(),
            |i| (i + 1000 * round) as f64,
        );
    }
    reused
}

fn check_all(what: &str, checks: Checks) {
    for (name, snap, want) in checks {
        let got = snap.lock();
        assert!(!got.is_empty(), "{what} {name}: the consumer never ran");
        check(&format!("{what} {name}"), DT, &got, &want);
    }
}

/// One simulated device for the process (roccl keeps one table of flags per runtime and
/// process, as with a real GPU runtime).
fn run(sim: &Arc<FakeGpu>, n: usize, cfg: Config, counts: &[usize], expect_direct: bool) {
    let id = UniqueId::new().unwrap();
    let gate = Barrier::new(n);
    let (net, algo, direct_min) = (cfg.net, cfg.algo, cfg.gpu_direct_min);
    std::thread::scope(|sc| {
        for rank in 0..n {
            let (sim, cfg, id, gate) = (Arc::clone(sim), cfg.clone(), &id, &gate);
            sc.spawn(move || {
                let c = Arc::new(Communicator::init_with(id, n, rank, cfg).unwrap());
                let stream = sim.create_stream();
                let what = format!("{n} ranks over {net:?}, algorithm {algo:?}, rank {rank}");
                for (round, &count) in counts.iter().enumerate() {
                    gate.wait();
                    let before = ops::staged_bytes();
                    gate.wait();
                    let checks = direct_round(&sim, &c, stream, count, round);
                    sim.synchronize(stream).unwrap();
                    gate.wait();
                    let staged = ops::staged_bytes() - before;
                    gate.wait();
                    assert_eq!(c.async_error(), None, "{what}");
                    check_all(&format!("{what}, {count} elements:"), checks);
                    // Bytes a round stages on each rank, in and out (4-byte elements):
                    // everything when nothing goes GPU-direct — n + 1 broadcasts (a non-root's
                    // output is its input: in and out), all-gathers (4c + 4cn, 8cn), all-to-
                    // alls (8cn, 8cn), the exchange (8c) and the 12-byte self exchange (24);
                    // else only the in-place all-to-all (it copies the whole buffer aside
                    // first) and messages below the GPU-direct minimum.
                    let (c, nn) = (count as u64, n as u64);
                    let all = 8 * c * (nn + 1)
                        + (4 * c + 4 * c * nn + 8 * c * nn)
                        + 16 * c * nn
                        + 8 * c
                        + 24;
                    let small = if direct_min > 12 { 24 } else { 0 };
                    let want = if expect_direct && 4 * count >= direct_min {
                        8 * c * nn + small
                    } else {
                        all
                    };
                    assert_eq!(staged, want * nn, "{what}: bytes staged");
                }
                if direct_min == 0 && expect_direct && n == 2 {
                    let reused = reallocated(&sim, &c, stream, gate);
                    assert!(
                        reused,
                        "{what}: no address came back: the stale-registration case did not run"
                    );
                }
                if direct_min == 0 && expect_direct {
                    let checks = many_buffers(&sim, &c, stream);
                    sim.synchronize(stream).unwrap();
                    assert_eq!(c.async_error(), None, "{what}");
                    check_all(&format!("{what}, 80 buffers in one call:"), checks);
                    // ncclCommSuspend(NCCL_SUSPEND_MEM): the cached registrations go (they
                    // pin the GPU memory they name); later calls register again.
                    let r = c.release_memory();
                    assert!(
                        r.registrations > 0,
                        "{what}: nothing cached to release: {r:?}"
                    );
                    assert_eq!(c.release_memory().registrations, 0, "{what}");
                    let checks = direct_round(&sim, &c, stream, 777, 9);
                    sim.synchronize(stream).unwrap();
                    assert_eq!(c.async_error(), None, "{what}");
                    check_all(&format!("{what}, after release_memory:"), checks);
                }
                // A reduction on device memory still goes through staging, in stream order.
                gate.wait();
                let before = ops::staged_bytes();
                let dev: Arc<dyn Device> = sim.clone();
                let (s, r) = (
                    sim.alloc_device_only(4 * 1001),
                    sim.alloc_device_only(4 * 1001),
                );
                produce(&sim, stream, &s, move |i| (rank + i) as f64);
                on_stream(
                    &dev,
                    &c,
                    stream,
                    vec![coll(Collective::AllReduce(RedOp::Sum), Some(&s), &r)],
                );
                let snap = consume(&sim, stream, &r, &[&s, &r]);
                sim.synchronize(stream).unwrap();
                assert!(
                    ops::staged_bytes() > before,
                    "{what}: the all-reduce was not staged"
                );
                let nn = n;
                check_all(
                    &what,
                    vec![(
                        "staged all_reduce".into(),
                        snap,
                        Box::new(move |i| (nn * i + nn * (nn - 1) / 2) as f64),
                    )],
                );
                gate.wait();
            });
        }
    });
}

#[test]
fn gpu_memory_moves_without_staging_over_rdma() {
    std::env::set_var("ROCCL_ROCEV2_SIM_GPU", "1");
    // Broadcasts of 300 KiB and more run as pipelined steps (two chunks or more).
    std::env::set_var("ROCCL_STREAM_CHUNK", "128K");
    // Odd counts, one element, and a pipelined broadcast; ring and tree broadcasts. The
    // repeated count allocates buffers where the last round's were freed: registrations kept
    // from that round must not be taken for the new memory (it would never see the data).
    let sim = FakeGpu::new(Duration::from_micros(200));
    let (auto, rdma) = (GpuDirect::Auto, NetKind::RoceV2);
    let tree = Some(Algo::Tree);
    run(
        &sim,
        2,
        cfg(rdma, None, 0, auto),
        &[1, 5003, 5003, 80_001],
        true,
    );
    run(&sim, 3, cfg(rdma, None, 0, auto), &[777, 80_001], true);
    run(&sim, 3, cfg(rdma, tree, 0, auto), &[4099], true);
    // With the default minimum: small calls staged, large ones GPU-direct.
    let min = roccl::comm::GPU_DIRECT_MIN;
    run(&sim, 2, cfg(rdma, None, min, auto), &[5003, 80_001], true);
    // Integrated GPUs (APUs) stage by default; ROCCL_GPU_DIRECT=1 takes them too.
    sim.set_integrated(true);
    run(&sim, 2, cfg(rdma, None, 0, auto), &[5003], false);
    run(&sim, 2, cfg(rdma, None, 0, GpuDirect::On), &[5003], true);
    sim.set_integrated(false);
    // A runtime without allocation ids: kept registrations are told apart by the dmabuf's
    // inode (the reallocated-memory round runs here too).
    sim.set_allocation_ids(false);
    run(&sim, 2, cfg(rdma, None, 0, auto), &[5003, 80_001], true);
    sim.set_allocation_ids(true);
    // Off, and a network that cannot take GPU memory: staged, still right.
    run(&sim, 2, cfg(rdma, None, 0, GpuDirect::Off), &[5003], false);
    run(&sim, 2, cfg(NetKind::Tcp, None, 0, auto), &[5003], false);
}
