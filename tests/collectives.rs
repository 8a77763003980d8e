//! Every collective × rank counts × odd and zero counts × data types × ops × algorithms,
//! in place and out of place, with ranks as threads, checked against an independent
//! reference (tests/common).

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::{Algo, DataType, RedOp};

/// Data types × ops at small odd and zero counts, every algorithm, both placements.
fn small_matrix(n: usize, tuning: Tuning) {
    run_ranks(n, config(tuning), |c| {
        for k in KINDS {
            for algo in algos_on(&c, k) {
                for dt in DataType::ALL {
                    for op in RedOp::ALL {
                        let reducing =
                            matches!(k, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter);
                        if !reducing && op != RedOp::Sum {
                            continue;
                        }
                        for count in [0usize, 1, 7, 1000] {
                            let root = (count + 1) % n;
                            for in_place in [false, true] {
                                one(&c, k, dt, op, count, algo, in_place, root);
                            }
                        }
                    }
                }
            }
        }
        c.barrier().unwrap();
    });
}

/// Large odd counts (1M + 3 elements) on a representative subset, with the default
/// pipeline and several channels.
fn large(n: usize) {
    run_ranks(
        n,
        config(Tuning {
            channels: Some(2),
            ..Default::default()
        }),
        |c| {
            for k in KINDS {
                let count = if matches!(k, Kind::AllGather | Kind::ReduceScatter | Kind::AllToAll) {
                    (1_000_003 / n) | 1
                } else {
                    1_000_003
                };
                for algo in algos_on(&c, k) {
                    // The one-shot stages n copies; doubling (sliced first exchange) stays.
                    if algo == Algo::Direct {
                        continue;
                    }
                    for (dt, op) in [
                        (DataType::F32, RedOp::Sum),
                        (DataType::Bf16, RedOp::Max),
                        (DataType::I64, RedOp::Avg),
                    ] {
                        one(
                            &c,
                            k,
                            dt,
                            op,
                            count,
                            algo,
                            k == Kind::AllReduce && dt == DataType::Bf16,
                            n / 2,
                        );
                    }
                }
            }
        },
    );
}

/// Ring all-reduces split into windows (4100 bytes, so about ten of them, the last one
/// partial, cut down to 4096 for 8-byte elements), in and out of place.
#[test]
fn ring_all_reduce_in_windows() {
    let mut cfg = config(Tuning::default());
    cfg.ring_window = 4100;
    for n in [2, 3] {
        run_ranks(n, cfg.clone(), |c| {
            for (dt, op) in [
                (DataType::F32, RedOp::Sum),
                (DataType::Bf16, RedOp::Max),
                (DataType::F64, RedOp::Avg),
                (DataType::I8, RedOp::Min),
            ] {
                for in_place in [false, true] {
                    one(
                        &c,
                        Kind::AllReduce,
                        dt,
                        op,
                        41_003 / dt.size(),
                        Algo::Ring,
                        in_place,
                        0,
                    );
                }
            }
        });
    }
}

/// Small slices, shallow pipeline, two channels: many units per call at small counts.
fn pipelined() -> Tuning {
    Tuning {
        slice: Some(256),
        depth: Some(2),
        channels: Some(2),
        ..Tuning::default()
    }
}

/// The deepest pipeline and most channels the tuning allows, many slices per call: the
/// machines' fixed-size queues and slot sets at their fullest.
#[test]
fn deepest_pipeline() {
    let t = Tuning {
        slice: Some(1024),
        depth: Some(64),
        channels: Some(64),
        ..Tuning::default()
    };
    run_ranks(3, config(t), |c| {
        for k in KINDS {
            for algo in algos_on(&c, k) {
                for (dt, op) in [(DataType::F32, RedOp::Sum), (DataType::Bf16, RedOp::Max)] {
                    for in_place in [false, true] {
                        one(&c, k, dt, op, 50_001, algo, in_place, 1);
                    }
                }
            }
        }
    });
}

#[test]
fn ranks_1() {
    small_matrix(1, Tuning::default());
}

#[test]
fn ranks_2() {
    small_matrix(2, pipelined());
    large(2);
}

#[test]
fn ranks_3() {
    small_matrix(3, pipelined());
    large(3);
}

#[test]
fn ranks_4() {
    small_matrix(4, Tuning::default());
    large(4);
}

#[test]
fn ranks_5() {
    small_matrix(5, pipelined());
    large(5);
}

#[test]
fn ranks_8() {
    small_matrix(8, pipelined());
}

#[test]
fn ranks_16_f32() {
    run_ranks(16, config(Tuning::default()), |c| {
        for k in KINDS {
            for algo in algos_on(&c, k) {
                for count in [0usize, 1, 7, 1000] {
                    one(&c, k, DataType::F32, RedOp::Sum, count, algo, false, 15);
                }
            }
        }
    });
}

/// A windowed ring all-reduce with values unique per element (the usual patterns repeat
/// every few elements, so a window at the wrong offset could pass them): 16 windows.
#[test]
fn windowed_ring_keeps_every_element_in_place() {
    let mut cfg = config(Tuning::default());
    cfg.ring_window = 4096;
    run_ranks(2, cfg, |c| {
        let me = c.rank();
        let send: Vec<f32> = (0..16384).map(|i| (i + me) as f32).collect();
        let mut recv = vec![0f32; 16384];
        let opts = roccl::CallOpts {
            algo: Some(Algo::Ring),
            ..Default::default()
        };
        for _ in 0..3 {
            c.run_raw(
                roccl::Collective::AllReduce(RedOp::Sum),
                DataType::F32,
                Some(bytemuck::cast_slice(&send)),
                bytemuck::cast_slice_mut(&mut recv),
                &opts,
            )
            .unwrap();
            let bad: Vec<(usize, f32)> = recv
                .iter()
                .enumerate()
                .filter(|(i, v)| **v != (2 * i + 1) as f32)
                .map(|(i, v)| (i, *v))
                .take(5)
                .collect();
            assert!(bad.is_empty(), "rank {me}: wrong elements {bad:?}");
            recv.fill(0.0);
        }
    });
}

/// Bruck's log-step algorithms on 2 to 9 ranks (powers of two and not): counts 0, 1, fewer
/// elements than ranks (all-reduce blocks left empty), odd; several types and reductions,
/// averages included; in place and out of place.
#[test]
fn bruck_ranks_2_to_9() {
    for n in 2..=9 {
        run_ranks(n, config(Tuning::default()), |c| {
            for k in [Kind::AllReduce, Kind::AllGather, Kind::ReduceScatter] {
                for (dt, op) in [
                    (DataType::F32, RedOp::Sum),
                    (DataType::Bf16, RedOp::Max),
                    (DataType::I64, RedOp::Avg),
                    (DataType::F16, RedOp::Avg),
                    (DataType::U8, RedOp::Prod),
                    (DataType::I32, RedOp::Min),
                ] {
                    if k == Kind::AllGather && op != RedOp::Sum {
                        continue;
                    }
                    for count in [0, 1, n - 1, 7, 1001 + 2 * n] {
                        for in_place in [false, true] {
                            one(&c, k, dt, op, count, Algo::Bruck, in_place, 0);
                        }
                    }
                }
            }
        });
    }
}
