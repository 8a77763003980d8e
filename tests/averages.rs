//! Values at the edge of each type's range: averages of floats whose sum overflows the type
//! (each rank's input is divided by the number of ranks first), sums that saturate fp8, and
//! integer averages, through every algorithm that reduces, over TCP and shared memory.

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;
use roccl::{Algo, CallOpts, Collective, DataType, RedOp};

/// Rounding unit of `dt` at `v` (the gap between neighbours), for tolerances that follow
/// the format.
fn ulp(dt: DataType, v: f64) -> f64 {
    let (mant, min_exp) = match dt {
        DataType::F16 => (10, -14),
        DataType::Bf16 => (7, -126),
        DataType::F8E4M3 => (3, -6),
        _ => (2, -14), // e5m2
    };
    let e = (v.abs().max(f64::MIN_POSITIVE))
        .log2()
        .floor()
        .max(min_exp as f64);
    2f64.powf(e - mant as f64)
}

/// A value per type (a power of two) whose sum over 4 or more ranks overflows (floats) or
/// saturates (fp8) the type.
fn big(dt: DataType) -> f64 {
    match dt {
        DataType::F16 => 16384.0,         // max 65504
        DataType::Bf16 => 2f64.powi(126), // max 3.39e38 (2^128 overflows)
        DataType::F8E4M3 => 256.0,        // max 448, saturating
        _ => 16384.0,                     // e5m2: max 57344
    }
}

/// The types whose averages divide before summing (`f32` and `f64` sum first: exact on
/// the usual inputs, see the communicator's `avg_premultiplied`).
const FLOATS: [DataType; 4] = [
    DataType::F16,
    DataType::Bf16,
    DataType::F8E4M3,
    DataType::F8E5M2,
];

/// The ranks' inputs average to `big` (element 0), `-big` (element 1), and a value of the
/// type's finest precision near 1 (element 2): the result is each, within the format's
/// rounding. `n` is even.
fn float_averages(net: NetKind, n: usize, algos: &[Algo]) {
    let mut cfg = config(Tuning::default());
    cfg.net = net;
    run_ranks(n, cfg, |c| {
        for &dt in &FLOATS {
            let es = dt.size();
            let want = |i: usize| match i % 3 {
                0 => big(dt),
                1 => -big(dt),
                _ => 1.0 + ulp(dt, 1.0),
            };
            // Even ranks give 1.75 times the average, odd ranks 0.25 times it (exact in every
            // type, and the ranks are even in number), so a reduction that kept any one
            // rank's input fails too.
            let me = c.rank();
            let mine = |i: usize| {
                let x = want(i);
                if i % 3 == 2 {
                    x
                } else if me % 2 == 0 {
                    1.75 * x
                } else {
                    0.25 * x
                }
            };
            let count = 33;
            for &algo in algos {
                if matches!(algo, Algo::ShmOneShot | Algo::ShmTwoShot) && !c.shm_collectives() {
                    continue;
                }
                let opts = CallOpts {
                    algo: Some(algo),
                    ..Default::default()
                };
                let input = fill(dt, count, mine);
                let tol = |i: usize| 2.0 * ulp(dt, want(i));
                let what = format!("{dt} avg n={n} algo={algo} net={net:?}");
                // All-reduce, in place and out.
                let mut out = vec![0u8; count * es];
                c.run_raw(
                    Collective::AllReduce(RedOp::Avg),
                    dt,
                    Some(&input),
                    &mut out,
                    &opts,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                let mut inplace = input.clone();
                c.run_raw(
                    Collective::AllReduce(RedOp::Avg),
                    dt,
                    None,
                    &mut inplace,
                    &opts,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                for (name, buf) in [("out of place", &out), ("in place", &inplace)] {
                    for i in 0..count {
                        let g = get(dt, &buf[i * es..(i + 1) * es]);
                        assert!(
                            (g - want(i)).abs() <= tol(i),
                            "{what} all_reduce {name}: element {i}: got {g}, want {}",
                            want(i)
                        );
                    }
                }
                if !matches!(
                    algo,
                    Algo::Ring | Algo::Tree | Algo::ShmOneShot | Algo::Bruck
                ) {
                    continue;
                }
                // Reduce to the last rank (Bruck has no reduce); the input is not written.
                if algo != Algo::Bruck {
                    let root = n - 1;
                    let before = input.clone();
                    let mut out = vec![0u8; count * es];
                    c.run_raw(
                        Collective::Reduce {
                            op: RedOp::Avg,
                            root,
                        },
                        dt,
                        Some(&input),
                        &mut out,
                        &opts,
                    )
                    .unwrap_or_else(|e| panic!("{what} reduce: {e}"));
                    assert_eq!(input, before, "{what}: reduce wrote its input");
                    if c.rank() == root {
                        for i in 0..count {
                            let g = get(dt, &out[i * es..(i + 1) * es]);
                            assert!(
                                (g - want(i)).abs() <= tol(i),
                                "{what} reduce: element {i}: got {g}"
                            );
                        }
                    }
                }
                if matches!(algo, Algo::Tree) {
                    continue;
                }
                // Reduce-scatter: block r of every rank's input.
                let rs_in = fill(dt, n * count, |j| mine(j % count));
                let mut out = vec![0u8; count * es];
                c.run_raw(
                    Collective::ReduceScatter(RedOp::Avg),
                    dt,
                    Some(&rs_in),
                    &mut out,
                    &opts,
                )
                .unwrap_or_else(|e| panic!("{what} reduce_scatter: {e}"));
                for i in 0..count {
                    let g = get(dt, &out[i * es..(i + 1) * es]);
                    assert!(
                        (g - want(i)).abs() <= tol(i),
                        "{what} reduce_scatter: element {i}: got {g}"
                    );
                }
            }
        }
    });
}

const NET_ALGOS: [Algo; 6] = [
    Algo::Direct,
    Algo::Doubling,
    Algo::TwoShot,
    Algo::Ring,
    Algo::Tree,
    Algo::Bruck,
];

#[test]
fn float_averages_do_not_overflow_over_tcp_8_ranks() {
    float_averages(NetKind::Tcp, 8, &NET_ALGOS);
}

#[test]
fn float_averages_do_not_overflow_over_tcp_4_ranks() {
    float_averages(NetKind::Tcp, 4, &NET_ALGOS);
}

#[test]
fn float_averages_do_not_overflow_in_shared_memory() {
    float_averages(
        NetKind::Shm,
        4,
        &[Algo::ShmOneShot, Algo::ShmTwoShot, Algo::Ring],
    );
}

/// Sums that leave fp8's range saturate at its largest finite value (e4m3 has no
/// infinity; e5m2 saturates too, as NCCL's fp8 kernels do), and integer averages are the
/// truncated quotient of the sum in the type.
#[test]
fn saturating_sums_and_integer_averages() {
    run_ranks(4, config(Tuning::default()), |c| {
        for (dt, v, want) in [
            (DataType::F8E4M3, 300.0, 448.0),
            (DataType::F8E5M2, 28672.0, 57344.0),
        ] {
            let mut b = fill(dt, 5, |_| v);
            c.run_raw(
                Collective::AllReduce(RedOp::Sum),
                dt,
                None,
                &mut b,
                &CallOpts::default(),
            )
            .unwrap();
            check(&format!("{dt} saturating sum"), dt, &b, |_| want);
        }
        // i32: 4 × 1e9 wraps (as in NCCL): the average of the wrapped sum, truncated.
        let mut b = vec![1_000_000_000i32, -7, 7, i32::MIN / 4];
        c.all_reduce_in_place(&mut b, RedOp::Avg).unwrap();
        let wrapped = 1_000_000_000i32.wrapping_mul(4) / 4;
        assert_eq!(b, vec![wrapped, -7, 7, i32::MIN / 4]);
        let mut u = vec![200u8, 3];
        c.all_reduce_in_place(&mut u, RedOp::Avg).unwrap();
        assert_eq!(u, vec![200u8.wrapping_mul(4) / 4, 3]);
    });
}
