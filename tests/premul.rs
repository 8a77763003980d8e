//! Pre-multiplied sums (`CallOpts::premul`, NCCL's `ncclRedOpCreatePreMulSum`): each rank's
//! input times its own scalar, summed, for every data type, through all-reduce (in and out
//! of place), reduce and reduce-scatter, at sizes below and above the pipeline's chunk; the
//! caller's input is never written; a scalar on anything but a sum is refused.

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::{Algo, CallOpts, Collective, DataType, RedOp};

#[test]
fn every_type_sums_its_scaled_inputs() {
    const N: usize = 3;
    run_ranks(N, config(Tuning::default()), |c| {
        let me = c.rank();
        for &dt in &DataType::ALL {
            let es = dt.size();
            // Rank r scales by 2^r (rank 2 passes none: 1), inputs are 0 or 1: every product
            // and partial sum (at most 7) is exact in every type, fp8 included.
            let factor = |r: usize| if r == 2 { 1.0 } else { (1u32 << r) as f64 };
            let x = |r: usize, i: usize| ((i + r) % 2) as f64;
            let want = |i: usize| (0..N).map(|r| factor(r) * x(r, i)).sum::<f64>();
            let mut premul = None;
            if me != 2 {
                let mut s = [0u8; 8];
                s[..es].copy_from_slice(&fill(dt, 1, |_| factor(me)));
                premul = Some(s);
            }
            for (count, algo) in [(33, None), (33, Some(Algo::Ring)), ((1 << 17) + 6, None)] {
                let opts = CallOpts {
                    algo,
                    premul,
                    ..Default::default()
                };
                let what = format!("{dt} count {count} algo {algo:?}");
                let input = fill(dt, count, |i| x(me, i));
                let check = |buf: &[u8], name: &str, off: usize| {
                    for i in 0..buf.len() / es {
                        let g = get(dt, &buf[i * es..(i + 1) * es]);
                        assert_eq!(g, want(i + off), "{what} {name}: element {i}");
                    }
                };
                let mut out = vec![0u8; count * es];
                c.run_raw(
                    Collective::AllReduce(RedOp::Sum),
                    dt,
                    Some(&input),
                    &mut out,
                    &opts,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                check(&out, "all-reduce", 0);
                let mut inplace = input.clone();
                c.run_raw(
                    Collective::AllReduce(RedOp::Sum),
                    dt,
                    None,
                    &mut inplace,
                    &opts,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                check(&inplace, "all-reduce in place", 0);
                let before = input.clone();
                let mut out = vec![0u8; count * es];
                let reduce = Collective::Reduce {
                    op: RedOp::Sum,
                    root: 1,
                };
                c.run_raw(reduce, dt, Some(&input), &mut out, &opts)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(input, before, "{what}: reduce wrote its input");
                if me == 1 {
                    check(&out, "reduce", 0);
                }
                let per = count / N;
                let input = fill(dt, per * N, |i| x(me, i));
                let mut block = vec![0u8; per * es];
                c.run_raw(
                    Collective::ReduceScatter(RedOp::Sum),
                    dt,
                    Some(&input),
                    &mut block,
                    &opts,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                check(&block, "reduce-scatter", me * per);
            }
        }
        // A 64-bit integer scalar keeps every bit (no trip through a float).
        let big = (1i64 << 40) + 1;
        let opts = CallOpts {
            premul: Some(big.to_le_bytes()),
            ..Default::default()
        };
        let mut v = 3i64.to_le_bytes();
        c.run_raw(
            Collective::AllReduce(RedOp::Sum),
            DataType::I64,
            None,
            &mut v,
            &opts,
        )
        .unwrap();
        assert_eq!(i64::from_le_bytes(v), 3 * 3 * big);
        // Only sums are pre-multiplied.
        let mut v = 3i64.to_le_bytes();
        let e = c
            .run_raw(
                Collective::AllReduce(RedOp::Max),
                DataType::I64,
                None,
                &mut v,
                &opts,
            )
            .unwrap_err();
        assert!(e.to_string().contains("pre-multiplied sum"), "{e}");
    });
}
