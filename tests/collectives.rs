//! Every collective × rank counts × odd and zero counts × data types × ops × algorithms,
//! in place and out of place, with ranks as threads, checked against an independent
//! reference (tests/common).

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::{Algo, CallOpts, Collective, Communicator, DataType, RedOp};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
}

const KINDS: [Kind; 6] = [
    Kind::AllReduce,
    Kind::Broadcast,
    Kind::Reduce,
    Kind::AllGather,
    Kind::ReduceScatter,
    Kind::AllToAll,
];

fn algos(k: Kind) -> &'static [Algo] {
    match k {
        Kind::AllReduce => &[Algo::Direct, Algo::Doubling, Algo::Ring, Algo::Tree],
        Kind::Broadcast | Kind::Reduce => &[Algo::Ring, Algo::Tree],
        _ => &[Algo::Ring],
    }
}

/// Run one collective and check this rank's result. `count` is the per-rank element count
/// (the block size for all-gather, reduce-scatter and all-to-all).
#[allow(clippy::too_many_arguments)]
fn one(
    c: &Communicator,
    k: Kind,
    dt: DataType,
    op: RedOp,
    count: usize,
    algo: Algo,
    in_place: bool,
    root: usize,
) {
    let (n, me) = (c.nranks(), c.rank());
    let es = dt.size();
    let opts = CallOpts { algo: Some(algo) };
    let what = format!(
        "{k:?} {dt} {op} count={count} algo={algo} in_place={in_place} n={n} rank={me} root={root}"
    );
    let run = |coll: Collective, send: &[u8], out: &mut Vec<u8>| {
        let r = if in_place {
            out.copy_from_slice(send);
            c.run_raw(coll, dt, None, out, &opts)
        } else {
            c.run_raw(coll, dt, Some(send), out, &opts)
        };
        r.unwrap_or_else(|e| panic!("{what}: {e}"));
    };
    match k {
        Kind::AllReduce => {
            let send = fill(dt, count, |i| val(dt, op, me, i));
            let mut out = vec![0xa5u8; count * es];
            run(Collective::AllReduce(op), &send, &mut out);
            check(&what, dt, &out, |i| reduce_ref(dt, op, n, i));
        }
        Kind::Broadcast => {
            let send = fill(dt, count, |i| {
                if me == root {
                    val(dt, op, root, i)
                } else {
                    -7.0f64.max(0.0) + 9.0
                }
            });
            let mut out = vec![0xa5u8; count * es];
            run(Collective::Broadcast { root }, &send, &mut out);
            check(&what, dt, &out, |i| val(dt, op, root, i));
        }
        Kind::Reduce => {
            let send = fill(dt, count, |i| val(dt, op, me, i));
            let mut out = vec![0xa5u8; count * es];
            run(Collective::Reduce { op, root }, &send, &mut out);
            if me == root {
                check(&what, dt, &out, |i| reduce_ref(dt, op, n, i));
            } else if !in_place {
                assert!(
                    out.iter().all(|b| *b == 0xa5),
                    "{what}: non-root receive buffer was written"
                );
            }
        }
        Kind::AllGather => {
            let mine = fill(dt, count, |i| val(dt, op, me, i));
            let mut out = vec![0xa5u8; n * count * es];
            let r = if in_place {
                out[me * count * es..(me + 1) * count * es].copy_from_slice(&mine);
                c.run_raw(Collective::AllGather, dt, None, &mut out, &opts)
            } else {
                c.run_raw(Collective::AllGather, dt, Some(&mine), &mut out, &opts)
            };
            r.unwrap_or_else(|e| panic!("{what}: {e}"));
            check(&what, dt, &out, |j| {
                val(dt, op, j / count.max(1), j % count.max(1))
            });
        }
        Kind::ReduceScatter => {
            let send = fill(dt, n * count, |j| val(dt, op, me, j));
            let mut out = vec![0xa5u8; if in_place { n * count * es } else { count * es }];
            let r = if in_place {
                out.copy_from_slice(&send);
                c.run_raw(Collective::ReduceScatter(op), dt, None, &mut out, &opts)
            } else {
                c.run_raw(
                    Collective::ReduceScatter(op),
                    dt,
                    Some(&send),
                    &mut out,
                    &opts,
                )
            };
            r.unwrap_or_else(|e| panic!("{what}: {e}"));
            let mine = if in_place {
                &out[me * count * es..(me + 1) * count * es]
            } else {
                &out[..]
            };
            check(&what, dt, mine, |i| reduce_ref(dt, op, n, me * count + i));
        }
        Kind::AllToAll => {
            let send = fill(dt, n * count, |j| {
                val(dt, op, me, j) + (j / count.max(1)) as f64
            });
            let mut out = vec![0xa5u8; n * count * es];
            run(Collective::AllToAll, &send, &mut out);
            // Block s of the output is block `me` of rank s's input.
            check(&what, dt, &out, |j| {
                let (s, i) = (j / count.max(1), j % count.max(1));
                val(dt, op, s, me * count + i) + me as f64
            });
        }
    }
}

/// Data types × ops at small odd and zero counts, every algorithm, both placements.
fn small_matrix(n: usize, tuning: Tuning) {
    run_ranks(n, config(tuning), |c| {
        for k in KINDS {
            for &algo in algos(k) {
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
                for &algo in algos(k) {
                    if matches!(algo, Algo::Direct | Algo::Doubling) {
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

/// Small slices, shallow pipeline, two channels: many units per call at small counts.
fn pipelined() -> Tuning {
    Tuning {
        slice: Some(256),
        depth: Some(2),
        channels: Some(2),
    }
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
            for &algo in algos(k) {
                for count in [0usize, 1, 7, 1000] {
                    one(&c, k, DataType::F32, RedOp::Sum, count, algo, false, 15);
                }
            }
        }
    });
}
