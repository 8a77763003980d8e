//! Every collective over the shared-memory network (ranks as threads on this host), checked
//! against the reference.

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;

#[test]
fn shm_2_ranks() {
    net_matrix(NetKind::Shm, "shm", 2, Tuning::default());
}

/// Small slices and slots: ring pipelines of many slices, shared-memory collectives of many
/// pieces (slot reuse across calls).
#[test]
fn shm_3_ranks_pipelined() {
    let mut cfg = config(Tuning {
        slice: Some(4096),
        depth: Some(3),
        channels: Some(2),
        ..Tuning::default()
    });
    cfg.net = NetKind::Shm;
    cfg.shm_slot = Some(4096);
    net_matrix_cfg(cfg, "shm", 3);
}

#[test]
fn shm_5_ranks() {
    net_matrix(NetKind::Shm, "shm", 5, Tuning::default());
}

/// `auto` reaches ranks of this host over shared memory (and says so).
#[test]
fn auto_uses_shared_memory_between_local_ranks() {
    net_matrix(NetKind::Auto, "shm", 3, Tuning::default());
}

/// Single copies between the ranks (process_vm_readv): all-reduces from 8 MiB,
/// all-gathers from 128 KiB per rank and broadcasts from 256 KiB read straight out of the
/// other ranks' buffers (broadcast roots also write into the readers', process_vm_writev). Odd
/// counts (shares of unequal size), several data types and ops including avg, in place and
/// out of place, 2, 3 and 5 ranks.
#[test]
fn single_copy_all_reduce_and_all_gather() {
    use roccl::{Algo, DataType, RedOp};
    for n in [2, 3, 5] {
        let mut cfg = config(Tuning::default());
        cfg.net = NetKind::Shm;
        run_ranks(n, cfg, |c| {
            assert!(c.shm_collectives(), "rank {}: no shared segments", c.rank());
            for (dt, op, count) in [
                (DataType::F32, RedOp::Sum, (8 << 20) / 4 + 5),
                (DataType::Bf16, RedOp::Avg, (8 << 20) / 2 + 3),
                (DataType::I32, RedOp::Max, (9 << 20) / 4 + 1),
            ] {
                for in_place in [false, true] {
                    one(
                        &c,
                        Kind::AllReduce,
                        dt,
                        op,
                        count,
                        Algo::ShmTwoShot,
                        in_place,
                        0,
                    );
                }
            }
            for count in [(128 << 10) / 4, 300_007] {
                for in_place in [false, true] {
                    one(
                        &c,
                        Kind::AllGather,
                        DataType::F32,
                        RedOp::Sum,
                        count,
                        Algo::ShmOneShot,
                        in_place,
                        0,
                    );
                }
            }
            // Broadcasts: at the minimum, odd (the cut between the readers' and the root's
            // share is page-aligned, the end is not), and past 4 MiB (out of place, the root
            // writes only the last partial page).
            for count in [(256 << 10) / 4, 300_007, (5 << 20) / 4 + 3] {
                for in_place in [false, true] {
                    for root in [0, n - 1] {
                        one(
                            &c,
                            Kind::Broadcast,
                            DataType::F32,
                            RedOp::Sum,
                            count,
                            Algo::ShmOneShot,
                            in_place,
                            root,
                        );
                    }
                }
            }
            c.barrier().unwrap();
        });
    }
}

/// A rank may reuse its buffers the moment a single-copy all-reduce or broadcast returns:
/// the others have finished reading them (and, for a broadcast reader, the root writing). Each rank scribbles over its buffer right after the call and only
/// then checks the copy it took; a peer still reading would get the scribble (NaN).
#[test]
fn single_copy_buffers_are_free_when_the_call_returns() {
    use roccl::{Algo, CallOpts, Collective, DataType, RedOp};
    let mut cfg = config(Tuning::default());
    cfg.net = NetKind::Shm;
    let n = 3;
    run_ranks(n, cfg, |c| {
        let count = (8 << 20) / 4 + 7;
        let opts = CallOpts {
            algo: Some(Algo::ShmTwoShot),
            ..Default::default()
        };
        let mut buf = vec![0u8; count * 4];
        let mut got = vec![0u8; count * 4];
        for round in 0..20u32 {
            for (i, v) in buf.chunks_exact_mut(4).enumerate() {
                let x = (c.rank() as u32 + 1) * 1000 + round + (i % 97) as u32;
                v.copy_from_slice(&(x as f32).to_ne_bytes());
            }
            c.run_raw(
                Collective::AllReduce(RedOp::Sum),
                DataType::F32,
                None,
                &mut buf,
                &opts,
            )
            .unwrap();
            got.copy_from_slice(&buf);
            buf.fill(0xff);
            for (i, v) in got.chunks_exact(4).enumerate() {
                let want = (0..n as u32)
                    .map(|r| ((r + 1) * 1000 + round + (i % 97) as u32) as f32)
                    .sum::<f32>();
                let have = f32::from_ne_bytes(v.try_into().unwrap());
                assert_eq!(have, want, "rank {} round {round} element {i}", c.rank());
            }
        }
        // Broadcast: the root's buffer is free once it returns (the readers read it), and a
        // reader's buffer is complete once it returns (the root wrote its tail into it).
        let count = (1 << 20) / 4 + 3;
        let mut buf = vec![0u8; count * 4];
        for round in 0..20u32 {
            let root = round as usize % n;
            let val = |i: usize| (round * 1000 + (i % 89) as u32) as f32;
            for (i, v) in buf.chunks_exact_mut(4).enumerate() {
                let x = if c.rank() == root { val(i) } else { f32::NAN };
                v.copy_from_slice(&x.to_ne_bytes());
            }
            c.run_raw(
                Collective::Broadcast { root },
                DataType::F32,
                None,
                &mut buf[..count * 4],
                &opts_one(),
            )
            .unwrap();
            got[..count * 4].copy_from_slice(&buf);
            buf.fill(0xff);
            for (i, v) in got[..count * 4].chunks_exact(4).enumerate() {
                let have = f32::from_ne_bytes(v.try_into().unwrap());
                assert_eq!(
                    have,
                    val(i),
                    "broadcast: rank {} round {round} element {i}",
                    c.rank()
                );
            }
        }
    });
}

fn opts_one() -> roccl::CallOpts {
    roccl::CallOpts {
        algo: Some(roccl::Algo::ShmOneShot),
        ..Default::default()
    }
}

/// Ranks that force different shared-memory all-reduce variants (one-shot against two-shot)
/// get an error naming both calls, never each other's stale bytes: the variant is part of
/// the call's description that ranks compare. Small (input in the arrive line) and large.
#[test]
fn different_shared_memory_variants_are_refused() {
    use roccl::{Algo, CallOpts, Collective, DataType, RedOp};
    for count in [7usize, 300_001] {
        let mut cfg = config(Tuning::default());
        cfg.net = NetKind::Shm;
        cfg.waiter.timeout = std::time::Duration::from_secs(5);
        run_ranks(2, cfg, |c| {
            let opts = CallOpts {
                algo: Some(if c.rank() == 0 {
                    Algo::ShmOneShot
                } else {
                    Algo::ShmTwoShot
                }),
                ..Default::default()
            };
            let mut buf = vec![0u8; count * 4];
            let r = c.run_raw(
                Collective::AllReduce(RedOp::Sum),
                DataType::F32,
                None,
                &mut buf,
                &opts,
            );
            let e = r.expect_err("mismatched variants must fail").to_string();
            assert!(e.contains("two-shot"), "rank {}: {e}", c.rank());
        });
    }
}

/// A rank asleep in futex(2) on a peer's counter is woken by the peer's publish, not by its
/// nap running out. Publishing looks for sleepers only at the end of a call or once the
/// publisher stops spinning in a wait of its own; here one rank comes late to each call
/// while the other sleeps, and then both meet outside roccl (nothing else wakes the
/// sleeper): with naps of 20 s, a lost wake-up makes the test take 20 s more. Spinning
/// before sleeping and not (ranks sharing cores), each flat collective shape.
#[test]
fn sleeping_ranks_are_woken_by_the_publish() {
    use roccl::{Algo, CallOpts, Collective, DataType, RedOp};
    use std::time::{Duration, Instant};
    for spin in [Duration::ZERO, Duration::from_micros(200)] {
        let mut cfg = config(Tuning::default());
        cfg.net = NetKind::Shm;
        cfg.waiter.spin = spin;
        cfg.waiter.yield_for = Duration::ZERO;
        cfg.waiter.nap = Duration::from_secs(20);
        // Inline, slot and single-copy (process_vm_readv/writev) shapes of each.
        let calls: [(Collective, usize, Algo); 8] = [
            (Collective::AllReduce(RedOp::Sum), 2, Algo::ShmOneShot),
            (Collective::AllReduce(RedOp::Sum), 1000, Algo::ShmOneShot),
            (Collective::AllReduce(RedOp::Sum), 100_000, Algo::ShmTwoShot),
            (
                Collective::AllReduce(RedOp::Sum),
                2_100_000,
                Algo::ShmTwoShot,
            ),
            (Collective::Broadcast { root: 1 }, 3, Algo::ShmOneShot),
            (Collective::Broadcast { root: 1 }, 70_003, Algo::ShmOneShot),
            (Collective::AllGather, 2000, Algo::ShmOneShot),
            (Collective::AllGather, 80_000, Algo::ShmOneShot),
        ];
        let meet = std::sync::Barrier::new(2);
        run_ranks(2, cfg, |c| {
            let me = c.rank();
            let start = Instant::now();
            for (i, &(coll, count, algo)) in calls.iter().enumerate() {
                for late in 0..2 {
                    if me == late {
                        std::thread::sleep(Duration::from_millis(30));
                    }
                    let mut buf = vec![0u8; count * 4];
                    for (j, x) in buf.chunks_exact_mut(4).enumerate() {
                        x.copy_from_slice(&((me + 1) as f32 * (j % 7) as f32).to_le_bytes());
                    }
                    let opts = CallOpts {
                        algo: Some(algo),
                        ..Default::default()
                    };
                    c.run_raw(coll, DataType::F32, None, &mut buf, &opts)
                        .unwrap_or_else(|e| panic!("rank {me}, call {i}: {e}"));
                    let want = |j: usize| match coll {
                        Collective::AllReduce(_) => 3.0 * (j % 7) as f32,
                        Collective::Broadcast { .. } => 2.0 * (j % 7) as f32,
                        _ => (j / (count / 2) + 1) as f32 * (j % 7) as f32,
                    };
                    for (j, x) in buf.chunks_exact(4).enumerate() {
                        let got = f32::from_le_bytes(x.try_into().unwrap());
                        assert_eq!(got, want(j), "rank {me}, call {i}, element {j}");
                    }
                    meet.wait();
                }
            }
            let took = start.elapsed();
            assert!(
                took < Duration::from_secs(10),
                "rank {me} (spin {spin:?}): 16 calls took {took:?}: a sleeping rank was not woken by its peer's publish"
            );
        });
    }
}

/// A broadcast reader that gave up on the call (its timeout passed before the root came) has
/// its buffer back untouched: the root, coming late, finds the reader's communicator broken
/// or its output withdrawn and fails instead of writing its share into the reader's memory.
#[test]
fn a_broadcast_reader_that_gave_up_is_not_written_to() {
    use roccl::{Algo, CallOpts, Collective, Communicator, DataType, UniqueId};
    use std::time::Duration;
    let id = UniqueId::new().expect("unique id");
    let len = 1 << 20;
    std::thread::scope(|s| {
        for rank in 0..2 {
            let id = &id;
            s.spawn(move || {
                let mut cfg = config(Tuning::default());
                cfg.net = NetKind::Shm;
                cfg.waiter.timeout = Duration::from_millis(if rank == 0 { 30_000 } else { 500 });
                let c = Communicator::init_with(id, 2, rank, cfg).expect("init");
                c.barrier().unwrap();
                let opts = CallOpts {
                    algo: Some(Algo::ShmOneShot),
                    ..Default::default()
                };
                let mut buf = vec![rank as u8 + 1; len];
                let bcast = |buf: &mut [u8]| {
                    c.run_raw(
                        Collective::Broadcast { root: 0 },
                        DataType::U8,
                        None,
                        buf,
                        &opts,
                    )
                };
                if rank == 0 {
                    // Come after the reader gave up.
                    std::thread::sleep(Duration::from_millis(1500));
                    let e = bcast(&mut buf)
                        .expect_err("the reader gave up: the root must fail")
                        .to_string();
                    assert!(e.contains("rank 1"), "{e}");
                } else {
                    let r = bcast(&mut buf);
                    assert!(
                        r.is_err(),
                        "the reader's timeout passed before the root came"
                    );
                    buf.fill(0x5a);
                    // The root comes and leaves meanwhile.
                    std::thread::sleep(Duration::from_millis(2500));
                    assert!(
                        buf.iter().all(|&b| b == 0x5a),
                        "the root wrote into the buffer of a reader that had given up"
                    );
                }
            });
        }
    });
}
