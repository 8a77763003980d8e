//! The typed Rust API: element types, non-blocking calls and their ordering,
//! point-to-point, barrier.

mod common;

use common::*;
use half::{bf16, f16};
use roccl::algo::model::Tuning;
use roccl::{Algo, CallOpts, Collective, DataType, RedOp};

#[test]
fn typed_calls_with_half_types() {
    run_ranks(3, config(Tuning::default()), |c| {
        let r = c.rank() as f32;
        let send: Vec<bf16> = (0..1001)
            .map(|i| bf16::from_f32(r + (i % 3) as f32))
            .collect();
        let mut out = vec![bf16::ZERO; 1001];
        c.all_reduce(&send, &mut out, RedOp::Sum).unwrap();
        for (i, v) in out.iter().enumerate() {
            assert_eq!(v.to_f32(), 3.0 + 3.0 * (i % 3) as f32, "element {i}");
        }
        let mut h: Vec<f16> = vec![f16::from_f32(r); 17];
        c.all_reduce_in_place(&mut h, RedOp::Max).unwrap();
        assert!(h.iter().all(|v| v.to_f32() == 2.0));
        let mut g = vec![0u64; 3 * 5];
        c.all_gather(&[c.rank() as u64 * 10; 5], &mut g).unwrap();
        assert_eq!(
            g,
            [0u64, 0, 0, 0, 0, 10, 10, 10, 10, 10, 20, 20, 20, 20, 20]
        );
        let mut b = if c.rank() == 1 {
            vec![7i32; 9]
        } else {
            vec![0; 9]
        };
        c.broadcast(&mut b, 1).unwrap();
        assert_eq!(b, vec![7; 9]);
    });
}

#[test]
fn non_blocking_calls_run_in_issue_order() {
    run_ranks(4, config(Tuning::default()), |c| {
        let me = c.rank() as i64;
        let mut hs = Vec::new();
        for k in 0..5i64 {
            hs.push(c.all_reduce_async(vec![me + k; 10_000], RedOp::Sum));
        }
        let gathered = c.start(Collective::AllGather, Some(vec![me; 3]), vec![0i64; 12]);
        // A blocking call issued after the non-blocking ones runs after them.
        let mut x = [1i64];
        c.all_reduce_in_place(&mut x, RedOp::Sum).unwrap();
        assert_eq!(x[0], 4);
        for (k, mut h) in hs.into_iter().enumerate() {
            let k = k as i64;
            while !h.test() {
                std::thread::yield_now();
            }
            let v = h.wait().unwrap();
            assert!(v.iter().all(|&e| e == 6 + 4 * k), "call {k}: {}", v[0]);
        }
        assert_eq!(
            gathered.wait().unwrap(),
            vec![0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        );
    });
}

#[test]
fn point_to_point() {
    run_ranks(4, config(Tuning::default()), |c| {
        let (n, me) = (c.nranks(), c.rank());
        // Ring exchange with sendrecv never deadlocks, even for large messages.
        let send = vec![me as u32; 1 << 20];
        let mut recv = vec![0u32; 1 << 20];
        c.sendrecv(&send, (me + 1) % n, &mut recv, (me + n - 1) % n)
            .unwrap();
        assert!(recv.iter().all(|&v| v == ((me + n - 1) % n) as u32));
        // Plain send / recv between two ranks.
        if me == 0 {
            c.send(&[1.5f64, 2.5], 3).unwrap();
        } else if me == 3 {
            let mut b = [0f64; 2];
            c.recv(&mut b, 0).unwrap();
            assert_eq!(b, [1.5, 2.5]);
        }
        // Self exchange is a copy.
        let mut own = [0u8; 4];
        c.sendrecv(&[9u8; 4], me, &mut own, me).unwrap();
        assert_eq!(own, [9; 4]);
        c.barrier().unwrap();
    });
}

#[test]
fn many_barriers_and_a_single_rank() {
    run_ranks(5, config(Tuning::default()), |c| {
        for _ in 0..50 {
            c.barrier().unwrap();
        }
    });
    run_ranks(1, config(Tuning::default()), |c| {
        let mut v = [3u8; 4];
        c.all_reduce_in_place(&mut v, RedOp::Prod).unwrap();
        assert_eq!(v, [3; 4]);
        c.barrier().unwrap();
    });
}

/// Float results are bit-identical on every rank and from run to run for a given
/// algorithm and rank count, with inputs whose sums round differently in other orders.
#[test]
fn float_results_are_deterministic() {
    deterministic(roccl::net::NetKind::Tcp);
}

/// The same over shared memory, where the shm1/shm2 algorithms run too.
#[test]
fn float_results_are_deterministic_over_shared_memory() {
    deterministic(roccl::net::NetKind::Shm);
}

fn deterministic(net: roccl::net::NetKind) {
    let mut cfg = config(Tuning {
        slice: Some(4096),
        depth: Some(3),
        channels: Some(2),
        ..Tuning::default()
    });
    cfg.net = net;
    cfg.shm_slot = Some(64 << 10);
    run_ranks(5, cfg, |c| {
        let me = c.rank() as u64;
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (me * 0x1234_5678);
        let input: Vec<f32> = (0..50_001)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / 1e4 - 800.0) * 1.000_123
            })
            .collect();
        let mut algos = vec![
            Algo::Direct,
            Algo::Doubling,
            Algo::TwoShot,
            Algo::Ring,
            Algo::Tree,
            Algo::Bruck,
        ];
        if c.shm_collectives() {
            algos.extend([Algo::ShmOneShot, Algo::ShmTwoShot]);
        }
        assert_eq!(c.shm_collectives(), net == roccl::net::NetKind::Shm);
        for algo in algos {
            let mut first: Option<Vec<u32>> = None;
            for _ in 0..3 {
                let mut out = vec![0f32; input.len()];
                let opts = CallOpts {
                    algo: Some(algo),
                    ..Default::default()
                };
                c.run_raw(
                    Collective::AllReduce(RedOp::Sum),
                    DataType::F32,
                    Some(bytemuck::cast_slice(&input)),
                    bytemuck::cast_slice_mut(&mut out),
                    &opts,
                )
                .unwrap();
                let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                match &first {
                    None => first = Some(bits),
                    Some(f) => assert!(f == &bits, "{algo}: result changed between runs"),
                }
            }
            // Every rank holds the same bits: compare a checksum through the library.
            let sum: u64 = first.unwrap().iter().map(|&b| b as u64).sum();
            let mut all = vec![0u64; 5];
            c.all_gather(&[sum], &mut all).unwrap();
            assert!(
                all.iter().all(|&s| s == sum),
                "{algo}: ranks disagree: {all:?}"
            );
        }
    });
}

#[test]
fn grouped_point_to_point_in_any_pattern() {
    use roccl::P2p;
    run_ranks(4, config(Tuning::default()), |c| {
        let (n, me) = (c.nranks(), c.rank());
        // Everyone sends a distinct buffer to everyone (self included) in one call.
        let sends: Vec<Vec<u8>> = (0..n)
            .map(|p| vec![(me * 10 + p) as u8; 70_000 + p])
            .collect();
        let mut recvs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 70_000 + me]).collect();
        let mut ops: Vec<P2p> = Vec::new();
        // Receives listed first on even ranks, sends first on odd ones: order does not matter.
        let (mut s_ops, mut r_ops): (Vec<P2p>, Vec<P2p>) = (Vec::new(), Vec::new());
        for (p, b) in sends.iter().enumerate() {
            s_ops.push(P2p::Send { peer: p, buf: b });
        }
        for (p, b) in recvs.iter_mut().enumerate() {
            r_ops.push(P2p::Recv { peer: p, buf: b });
        }
        if me % 2 == 0 {
            ops.extend(r_ops);
            ops.extend(s_ops);
        } else {
            ops.extend(s_ops);
            ops.extend(r_ops);
        }
        c.p2p(&mut ops).unwrap();
        drop(ops);
        for (p, b) in recvs.iter().enumerate() {
            assert!(b.iter().all(|&v| v == (p * 10 + me) as u8), "from {p}");
        }
        // Bad peer is an argument error; the communicator stays usable.
        let e = c.p2p(&mut [P2p::Send { peer: 9, buf: &[1] }]).unwrap_err();
        assert!(e.to_string().contains("peer 9"), "{e}");
        c.barrier().unwrap();
    });
}

#[test]
fn split_by_color_and_key() {
    run_ranks(5, config(Tuning::default()), |c| {
        let me = c.rank();
        // Colors: even / odd ranks; rank 4 opts out. Key reverses the order.
        let color = if me == 4 { None } else { Some((me % 2) as u32) };
        let sub = c.split(color, -(me as i32)).unwrap();
        match sub {
            None => assert_eq!(me, 4),
            Some(s) => {
                assert_eq!(s.nranks(), 2);
                let expect_rank = match me {
                    0 => 1,
                    2 => 0,
                    1 => 1,
                    3 => 0,
                    _ => unreachable!(),
                };
                assert_eq!(s.rank(), expect_rank);
                let mut v = [me as u32];
                s.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
                assert_eq!(v[0], if me % 2 == 0 { 2 } else { 4 });
            }
        }
        c.barrier().unwrap();
    });
}

#[test]
fn abort_from_another_thread_unblocks_a_collective() {
    use std::time::{Duration, Instant};
    run_ranks(2, config(Tuning::default()), |c| {
        // Connected first, so the abort interrupts a wait for data.
        c.all_reduce_in_place(&mut [1f32; 8], RedOp::Sum).unwrap();
        if c.rank() == 1 {
            // Never joins: rank 0 would block until the timeout (60 s).
            std::thread::sleep(Duration::from_millis(1500));
            return;
        }
        std::thread::scope(|s| {
            let t = Instant::now();
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                c.abort();
            });
            let e = c
                .all_reduce_in_place(&mut [1f32; 8], RedOp::Sum)
                .unwrap_err();
            assert!(e.to_string().contains("aborted by the application"), "{e}");
            assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        });
        assert!(c.barrier().is_err());
        assert!(c.async_error().is_some());
    });
}

/// `ROCCL_CONNECT=all` (`Config::connect_all`): when init returns every rank is connected to
/// and from every peer on the channels the default pipeline uses and the point-to-point one,
/// and a one-shot all-reduce, a two-channel ring and a send/receive open nothing more; by
/// default nothing is open until a call needs it.
#[test]
fn connect_all_opens_the_mesh_during_init() {
    for connect_all in [false, true] {
        let mut cfg = config(Tuning {
            channels: Some(2),
            ..Tuning::default()
        });
        cfg.connect_all = connect_all;
        run_ranks(4, cfg, |c| {
            let (n, me) = (c.nranks(), c.rank());
            let all = (3 * (n - 1), 3 * (n - 1));
            assert_eq!(
                c.open_connections(),
                if connect_all { all } else { (0, 0) },
                "connect_all={connect_all}"
            );
            for algo in [Algo::Direct, Algo::Ring] {
                let mut out = [0f32; 4096];
                c.run_raw(
                    Collective::AllReduce(RedOp::Sum),
                    DataType::F32,
                    Some(bytemuck::cast_slice(&[1f32; 4096])),
                    bytemuck::cast_slice_mut(&mut out),
                    &CallOpts {
                        algo: Some(algo),
                        ..Default::default()
                    },
                )
                .unwrap();
                assert!(out.iter().all(|x| *x == n as f32));
            }
            let mut got = [0u32; 8];
            c.sendrecv(&[me as u32; 8], (me + 1) % n, &mut got, (me + n - 1) % n)
                .unwrap();
            assert_eq!(got, [((me + n - 1) % n) as u32; 8]);
            if connect_all {
                assert_eq!(c.open_connections(), all, "a call opened a connection");
            }
        });
    }
}

/// A batch of many point-to-point operations (more than the stack holds: the executor's 64,
/// the raw path's 32) through the raw-buffer path of the C ABI: every message arrives in
/// order, and sends to oneself pair with receives from oneself.
#[test]
fn large_point_to_point_batches() {
    use roccl::comm::stream::ops::{run_now, Op};
    run_ranks(2, config(Tuning::default()), |c| {
        let (me, peer) = (c.rank(), 1 - c.rank());
        let k = 40;
        let out: Vec<Vec<u8>> = (0..k).map(|i| vec![(me * 100 + i) as u8; 16]).collect();
        let mine = vec![0xabu8; 8];
        let mut inb: Vec<Vec<u8>> = vec![vec![0u8; 16]; k];
        let mut selfb = vec![0u8; 8];
        let mut ops = Vec::new();
        for i in 0..k {
            ops.push(Op::Send {
                peer,
                buf: raw(&out[i]),
            });
            ops.push(Op::Recv {
                peer,
                buf: raw_mut(&mut inb[i]),
            });
        }
        ops.push(Op::Recv {
            peer: me,
            buf: raw_mut(&mut selfb),
        });
        ops.push(Op::Send {
            peer: me,
            buf: raw(&mine),
        });
        // SAFETY: host buffers, valid and otherwise unused during the call; no receive
        // buffer overlaps another buffer.
        unsafe { run_now(&c, &ops) }.unwrap();
        for (i, b) in inb.iter_mut().enumerate() {
            assert_eq!(b, &vec![(peer * 100 + i) as u8; 16], "message {i}");
        }
        assert_eq!(selfb, mine);
    });
}

/// Several messages to one peer in one batch open one connection per (peer, channel), not
/// one per message: a second connection used to replace the first after the peer had taken
/// it, and the peer then read end-of-file (seen as a rare failure of the batch above). The
/// peer's connections are counted after a barrier, which accepts whatever arrived.
#[test]
fn a_batch_opens_each_connection_once() {
    use roccl::comm::stream::ops::{run_now, Op};
    let counts = |k: usize| {
        let seen = parking_lot::Mutex::new(Vec::new());
        run_ranks(2, config(Tuning::default()), |c| {
            let peer = 1 - c.rank();
            let out = vec![7u8; 16];
            let mut inb: Vec<Vec<u8>> = vec![vec![0u8; 16]; k];
            let mut ops = Vec::new();
            for b in inb.iter_mut() {
                ops.push(Op::Send {
                    peer,
                    buf: raw(&out),
                });
                ops.push(Op::Recv {
                    peer,
                    buf: raw_mut(b),
                });
            }
            // SAFETY: host buffers, valid and otherwise unused during the call; receive
            // buffers are distinct.
            unsafe { run_now(&c, &ops) }.unwrap();
            assert!(inb.iter().all(|b| b == &out));
            for _ in 0..3 {
                c.barrier().unwrap();
            }
            seen.lock().push((c.rank(), c.open_connections()));
        });
        let mut v = seen.into_inner();
        v.sort();
        v
    };
    let one = counts(1);
    for _ in 0..3 {
        assert_eq!(
            counts(4),
            one,
            "connections after 4 messages each way vs after 1"
        );
    }
}
