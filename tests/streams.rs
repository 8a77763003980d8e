//! Stream-ordered collectives on the simulated device: every collective with device buffers
//! and streams whose work runs late and out of step with the caller. Each case enqueues, on
//! the collective's stream, a producer that writes the input late, then the collective, then
//! a consumer that snapshots the output and scribbles over the buffers; the host call
//! returns before any of it ran. A collective that started before its producer finished,
//! or let the consumer run before it finished, reads or leaves wrong bytes.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use roccl::algo::model::Tuning;
use roccl::comm::stream::{enqueue, Part};
use roccl::device::fake_gpu::{FakeGpu, FakeGpuBuffer};
use roccl::device::{Device, MemKind};
use roccl::net::NetKind;
use roccl::{CallOpts, Collective, Communicator, DataType, Error, RedOp, UniqueId};

const DELAY: Duration = Duration::from_micros(300);

fn timeout() -> Duration {
    Duration::from_secs(60)
}

/// Input, expected output and the collective of one case on this rank.
struct Case {
    coll: Collective,
    input: Vec<u8>,
    out_len: usize,
    /// Expected output element `i` (None: the output is not checked on this rank).
    want: Option<Box<dyn Fn(usize) -> f64 + Send>>,
}

fn case(k: Kind, dt: DataType, op: RedOp, count: usize, n: usize, me: usize, root: usize) -> Case {
    let es = dt.size();
    match k {
        Kind::AllReduce => Case {
            coll: Collective::AllReduce(op),
            input: fill(dt, count, |i| val(dt, op, me, i)),
            out_len: count * es,
            want: Some(Box::new(move |i| reduce_ref(dt, op, n, i))),
        },
        Kind::Broadcast => Case {
            coll: Collective::Broadcast { root },
            // Non-roots' inputs are never read: give them values the result must not show.
            input: fill(dt, count, |i| {
                if me == root {
                    val(dt, op, root, i)
                } else {
                    99.0
                }
            }),
            out_len: count * es,
            want: Some(Box::new(move |i| val(dt, op, root, i))),
        },
        Kind::Reduce => Case {
            coll: Collective::Reduce { op, root },
            input: fill(dt, count, |i| val(dt, op, me, i)),
            out_len: count * es,
            want: (me == root).then(|| Box::new(move |i| reduce_ref(dt, op, n, i)) as _),
        },
        Kind::AllGather => Case {
            coll: Collective::AllGather,
            input: fill(dt, count, |i| val(dt, op, me, i)),
            out_len: n * count * es,
            want: Some(Box::new(move |j| {
                val(dt, op, j / count.max(1), j % count.max(1))
            })),
        },
        Kind::ReduceScatter => Case {
            coll: Collective::ReduceScatter(op),
            input: fill(dt, n * count, |j| val(dt, op, me, j)),
            out_len: count * es,
            want: Some(Box::new(move |i| reduce_ref(dt, op, n, me * count + i))),
        },
        Kind::AllToAll => Case {
            coll: Collective::AllToAll,
            input: fill(dt, n * count, |j| {
                val(dt, op, me, j) + (j / count.max(1)) as f64
            }),
            out_len: n * count * es,
            want: Some(Box::new(move |j| {
                let (s, i) = (j / count.max(1), j % count.max(1));
                val(dt, op, s, me * count + i) + me as f64
            })),
        },
    }
}

/// The work of one collective on device buffers.
fn part(
    coll: Collective,
    dt: DataType,
    send: Arc<FakeGpuBuffer>,
    recv: Arc<FakeGpuBuffer>,
) -> Part {
    Arc::new(move |turn| {
        send.with(|s| {
            recv.with(|r| {
                turn.run_raw(coll, dt, Some(s), r, &CallOpts::default())
                    .map(|_| ())
            })
        })
    })
}

/// The work of one in-place collective on a device buffer.
fn part_in_place(coll: Collective, dt: DataType, buf: Arc<FakeGpuBuffer>) -> Part {
    Arc::new(move |turn| {
        buf.with(|x| {
            turn.run_raw(coll, dt, None, x, &CallOpts::default())
                .map(|_| ())
        })
    })
}

/// Producer, collective, consumer on `stream`; returns the snapshot the consumer took.
fn ordered(
    dev: &Arc<FakeGpu>,
    c: &Arc<Communicator>,
    stream: usize,
    cs: &Case,
    dt: DataType,
) -> Arc<parking_lot::Mutex<Vec<u8>>> {
    let send = dev.alloc(cs.input.len());
    let recv = dev.alloc(cs.out_len);
    assert_eq!(dev.classify(send.addr()).unwrap().kind, MemKind::Device);
    // The producer writes the input late (the buffers start zeroed).
    let (s2, input) = (Arc::clone(&send), cs.input.clone());
    dev.launch(stream, move || s2.with(|b| b.copy_from_slice(&input)))
        .unwrap();
    let as_dev: Arc<dyn Device> = dev.clone();
    enqueue(
        &as_dev,
        &[stream],
        vec![(
            Arc::clone(c),
            part(cs.coll, dt, Arc::clone(&send), Arc::clone(&recv)),
        )],
        timeout(),
    )
    .unwrap();
    // The consumer snapshots the output, then scribbles over both buffers.
    let snap = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let (sn, r2, s3) = (Arc::clone(&snap), Arc::clone(&recv), Arc::clone(&send));
    dev.launch(stream, move || {
        *sn.lock() = r2.with(|b| b.to_vec());
        r2.with(|b| b.fill(0xee));
        s3.with(|b| b.fill(0xdd));
    })
    .unwrap();
    snap
}

fn matrix(n: usize, net: NetKind) {
    let dev = FakeGpu::new(DELAY);
    let mut cfg = config(Tuning::default());
    cfg.net = net;
    run_ranks(n, cfg, |c| {
        let (me, c) = (c.rank(), Arc::new(c));
        let stream = dev.create_stream();
        for k in KINDS {
            for (dt, op) in [
                (DataType::F32, RedOp::Sum),
                (DataType::Bf16, RedOp::Max),
                (DataType::I64, RedOp::Avg),
            ] {
                let reducing = matches!(k, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter);
                if !reducing && op != RedOp::Sum {
                    continue;
                }
                for count in [1usize, 7, 1000, 70_001] {
                    let root = (count + 1) % n;
                    let cs = case(k, dt, op, count, n, me, root);
                    let snap = ordered(&dev, &c, stream, &cs, dt);
                    dev.synchronize(stream).unwrap();
                    let what = format!("{k:?} {dt} {op} count={count} n={n} rank={me}");
                    assert!(c.async_error().is_none(), "{what}: {:?}", c.async_error());
                    if let Some(want) = &cs.want {
                        check(&what, dt, &snap.lock(), want);
                    }
                }
            }
        }
    });
}

#[test]
fn every_collective_on_streams_2_ranks_shared_memory() {
    matrix(2, NetKind::Shm);
}

#[test]
fn every_collective_on_streams_3_ranks_tcp() {
    matrix(3, NetKind::Tcp);
}

/// Several calls in flight on one stream before any ran: they run in stream order.
#[test]
fn back_to_back_calls_keep_stream_order() {
    back_to_back(false);
}

/// The same through the host-function fallback (a device without stream memory operations).
#[test]
fn back_to_back_calls_keep_stream_order_with_host_functions() {
    back_to_back(true);
}

fn back_to_back(host_fn_only: bool) {
    let dev = FakeGpu::new(DELAY);
    dev.set_host_fn_only(host_fn_only);
    run_ranks(2, config(Tuning::default()), |c| {
        let (me, c) = (c.rank(), Arc::new(c));
        let stream = dev.create_stream();
        let buf = dev.alloc(4 * 100);
        let as_dev: Arc<dyn Device> = dev.clone();
        let snaps: Vec<_> = (0..20u32)
            .map(|round| {
                // Each round: set the buffer to rank+round, all-reduce it in place.
                let b = Arc::clone(&buf);
                dev.launch(stream, move || {
                    b.with(|x| {
                        let v = (me as f32 + round as f32).to_le_bytes();
                        x.chunks_mut(4).for_each(|e| e.copy_from_slice(&v));
                    })
                })
                .unwrap();
                let b = Arc::clone(&buf);
                let p: Part = Arc::new(move |turn| {
                    b.with(|x| {
                        turn.run_raw(
                            Collective::AllReduce(RedOp::Sum),
                            DataType::F32,
                            None,
                            x,
                            &CallOpts::default(),
                        )
                        .map(|_| ())
                    })
                });
                enqueue(&as_dev, &[stream], vec![(Arc::clone(&c), p)], timeout()).unwrap();
                let snap = Arc::new(parking_lot::Mutex::new(0f32));
                let (s, b) = (Arc::clone(&snap), Arc::clone(&buf));
                dev.launch(stream, move || {
                    *s.lock() = b.with(|x| f32::from_le_bytes(x[..4].try_into().unwrap()))
                })
                .unwrap();
                snap
            })
            .collect();
        dev.synchronize(stream).unwrap();
        for (round, s) in snaps.iter().enumerate() {
            // 0 + round + 1 + round
            assert_eq!(*s.lock(), (2 * round + 1) as f32, "round {round}");
        }
    });
}

/// One group over two communicators and two streams (one per communicator), each with a
/// late producer: both collectives wait for both streams, and both streams wait for both.
#[test]
fn group_over_two_communicators_and_two_streams() {
    group_two_streams(false);
}

/// The same through the host-function fallback.
#[test]
fn group_over_two_communicators_and_two_streams_with_host_functions() {
    group_two_streams(true);
}

fn group_two_streams(host_fn_only: bool) {
    let dev = FakeGpu::new(DELAY);
    dev.set_host_fn_only(host_fn_only);
    let id2 = UniqueId::new().unwrap();
    run_ranks(2, config(Tuning::default()), |c| {
        let me = c.rank();
        let c2 = Arc::new(Communicator::init_with(&id2, 2, me, config(Tuning::default())).unwrap());
        let c = Arc::new(c);
        let (s1, s2) = (dev.create_stream(), dev.create_stream());
        let (a, b) = (dev.alloc(4 * 5000), dev.alloc(4 * 5000));
        let (a2, b2) = (Arc::clone(&a), Arc::clone(&b));
        dev.launch(s1, move || {
            a2.with(|x| x.copy_from_slice(&fill(DataType::F32, 5000, |i| (me + i) as f64)))
        })
        .unwrap();
        dev.launch(s2, move || {
            b2.with(|x| x.copy_from_slice(&fill(DataType::F32, 5000, |i| (10 * me + i) as f64)))
        })
        .unwrap();
        let inplace = |buf: Arc<FakeGpuBuffer>| -> Part {
            Arc::new(move |turn| {
                buf.with(|x| {
                    turn.run_raw(
                        Collective::AllReduce(RedOp::Sum),
                        DataType::F32,
                        None,
                        x,
                        &CallOpts::default(),
                    )
                    .map(|_| ())
                })
            })
        };
        let as_dev: Arc<dyn Device> = dev.clone();
        enqueue(
            &as_dev,
            &[s1, s2],
            vec![
                (Arc::clone(&c), inplace(Arc::clone(&a))),
                (Arc::clone(&c2), inplace(Arc::clone(&b))),
            ],
            timeout(),
        )
        .unwrap();
        // Each stream's consumer sees both results (the group completes as one).
        let snaps: Vec<_> = [s1, s2]
            .iter()
            .map(|&s| {
                let snap = Arc::new(parking_lot::Mutex::new((Vec::new(), Vec::new())));
                let (sn, a3, b3) = (Arc::clone(&snap), Arc::clone(&a), Arc::clone(&b));
                dev.launch(s, move || {
                    *sn.lock() = (a3.with(|x| x.to_vec()), b3.with(|x| x.to_vec()))
                })
                .unwrap();
                snap
            })
            .collect();
        dev.synchronize(s1).unwrap();
        dev.synchronize(s2).unwrap();
        for s in snaps {
            let (x, y) = s.lock().clone();
            check("group comm 1", DataType::F32, &x, |i| (2 * i + 1) as f64);
            check("group comm 2", DataType::F32, &y, |i| (2 * i + 10) as f64);
        }
    });
}

/// A call captured on a device whose streams cannot wait on flags (the host node blocks
/// until the collective is done) replays correctly: 2 ranks capture producer, in-place
/// all-reduce and consumer into a graph, replay it 20 times with a new round number each
/// time, and see every round's sum; a group spanning a captured and another stream is
/// refused by name. Then a collective that fails on its stream still releases the stream
/// and reports the error through the communicator.
#[test]
fn captured_calls_replay_and_failures_release_the_stream() {
    // No delay: the consumer runs as soon as the host node returns, so a node that returned
    // before the collective was done would show stale sums.
    let dev = FakeGpu::new(Duration::ZERO);
    dev.set_host_fn_only(true);
    let as_dev: Arc<dyn Device> = dev.clone();
    let plain = FakeGpu::new(DELAY);
    let as_plain: Arc<dyn Device> = plain.clone();
    let sum = |buf: Arc<FakeGpuBuffer>| -> Part {
        Arc::new(move |turn| {
            buf.with(|x| {
                turn.run_raw(
                    Collective::AllReduce(RedOp::Sum),
                    DataType::F32,
                    None,
                    x,
                    &CallOpts::default(),
                )
                .map(|_| ())
            })
        })
    };
    run_ranks(2, config(Tuning::default()), |c| {
        let c = Arc::new(c);
        let me = c.rank();
        let s = dev.create_stream();
        let other = dev.create_stream();
        let buf = dev.alloc(64);
        let round = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        dev.begin_capture(s).unwrap();
        let (b, r) = (Arc::clone(&buf), Arc::clone(&round));
        dev.launch(s, move || {
            let v = (me as f32 + r.load(std::sync::atomic::Ordering::Relaxed) as f32).to_le_bytes();
            b.with(|x| x.chunks_mut(4).for_each(|e| e.copy_from_slice(&v)));
        })
        .unwrap();
        enqueue(
            &as_dev,
            &[s],
            vec![(Arc::clone(&c), sum(Arc::clone(&buf)))],
            timeout(),
        )
        .unwrap();
        let (b, out) = (Arc::clone(&buf), Arc::clone(&seen));
        dev.launch(s, move || {
            out.lock()
                .push(b.with(|x| f32::from_le_bytes(x[60..64].try_into().unwrap())));
            b.with(|x| x.fill(0xee));
        })
        .unwrap();
        let e = enqueue(
            &as_dev,
            &[s, other],
            vec![
                (Arc::clone(&c), sum(Arc::clone(&buf))),
                (Arc::clone(&c), sum(Arc::clone(&buf))),
            ],
            timeout(),
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::InvalidUsage(_)) && e.to_string().contains("captured stream"),
            "{e}"
        );
        let graph = dev.end_capture(s).unwrap();
        for k in 0..20u32 {
            dev.synchronize(s).unwrap();
            round.store(k, std::sync::atomic::Ordering::Relaxed);
            dev.graph_launch(&graph, s).unwrap();
        }
        dev.synchronize(s).unwrap();
        let want: Vec<f32> = (0..20u32).map(|k| (1 + 2 * k) as f32).collect();
        assert_eq!(*seen.lock(), want, "rank {me}: one sum per replay");
        // 15 bytes is not a whole number of f32: the collective fails on the worker (on a
        // device with stream waits, where the call returns before it runs).
        let (dev, s) = (&plain, plain.create_stream());
        let odd = dev.alloc(15);
        enqueue(
            &as_plain,
            &[s],
            vec![(
                Arc::clone(&c),
                part_in_place(
                    Collective::AllReduce(RedOp::Sum),
                    DataType::F32,
                    Arc::clone(&odd),
                ),
            )],
            timeout(),
        )
        .unwrap();
        dev.synchronize(s).unwrap();
        let e = c.async_error().expect("the failure is reported");
        assert!(e.message.contains("15"), "{e}");
    });
}
