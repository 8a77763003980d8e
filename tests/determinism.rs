//! The deterministic mode (`Config::deterministic`, `ROCCL_DETERMINISTIC=1`): every
//! reducing collective returns bitwise one result for a given rank count and data type,
//! whatever algorithm is asked for, whatever network carries it (TCP, the userspace RoCE v2
//! engine, the shared-memory segments) and however the pipeline cuts it (slice, depth,
//! channels). Random floats of every float type, at sizes on both sides of the one-shot's
//! limit; the results of every setup are compared bit for bit with the first one's, and
//! with a sum in rank order computed here for f32 and f64.
//!
//! Without the mode the same comparison fails (a ring sums in another order): the last
//! test shows it, so the comparison here can tell.

mod common;

use std::collections::HashMap;

use common::*;
use parking_lot::Mutex;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;
use roccl::{Algo, CallOpts, Collective, Communicator, DataType, RedOp};

const RANKS: usize = 3;

const FLOATS: [DataType; 6] = [
    DataType::F32,
    DataType::F64,
    DataType::F16,
    DataType::Bf16,
    DataType::F8E4M3,
    DataType::F8E5M2,
];

/// Elements per call: one, a few thousand (one-shot), and past the one-shot's 256 KiB limit
/// in f32 (two-shot over a network).
const COUNTS: [usize; 3] = [1, 3001, 90_001];

/// A random value of magnitude up to about 100 that `dt` holds (so sums stay finite).
fn random(dt: DataType, seed: &mut u64) -> f64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    let unit = (*seed >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    let exp = (*seed % 17) as i32 - 8; // mantissas of many magnitudes
    let v = (unit * 2.0 - 1.0) * 2f64.powi(exp) * 0.39;
    match dt {
        DataType::F8E4M3 | DataType::F8E5M2 => v.clamp(-15.0, 15.0),
        _ => v,
    }
}

/// `count` random elements of `dt` for `rank` (the same in every setup).
fn input(dt: DataType, rank: usize, count: usize) -> Vec<u8> {
    let mut seed = 0x9e37_79b9_7f4a_7c15 ^ ((rank as u64 + 1) << 32) ^ count as u64;
    seed ^= dt.size() as u64 * 0x1234_5678;
    let vals: Vec<f64> = (0..count).map(|_| random(dt, &mut seed)).collect();
    fill(dt, count, |i| vals[i])
}

/// What a call is: (collective's name, data type, elements, rank).
type Key = (&'static str, DataType, usize, usize);

/// Every reducing collective of every float type and count on `c`, its output by key.
fn run_all(c: &Communicator) -> Vec<(Key, Vec<u8>)> {
    let (n, me) = (c.nranks(), c.rank());
    let opts = CallOpts::default();
    let mut out = Vec::new();
    for dt in FLOATS {
        for count in COUNTS {
            let es = dt.size();
            let mine = input(dt, me, count);
            let calls: [(&'static str, Collective); 3] = [
                ("all_reduce sum", Collective::AllReduce(RedOp::Sum)),
                ("all_reduce avg", Collective::AllReduce(RedOp::Avg)),
                (
                    "reduce sum to 1",
                    Collective::Reduce {
                        op: RedOp::Sum,
                        root: 1,
                    },
                ),
            ];
            for (name, coll) in calls {
                let mut got = vec![0u8; count * es];
                if matches!(coll, Collective::Reduce { .. }) && me != 1 {
                    got.clear(); // only the root has an output
                }
                c.run_raw(coll, dt, Some(&mine), &mut got, &opts)
                    .unwrap_or_else(|e| panic!("{name} {dt} {count}: {e}"));
                // In place: the same bits (at the root, for a reduce).
                let mut inplace = mine.clone();
                c.run_raw(coll, dt, None, &mut inplace, &opts)
                    .unwrap_or_else(|e| panic!("{name} in place {dt} {count}: {e}"));
                if !got.is_empty() {
                    assert!(
                        inplace == got,
                        "{name} {dt} {count} rank {me}: in place differs"
                    );
                }
                out.push(((name, dt, count, me), got));
            }
            // Reduce-scatter: `n` blocks of `count` in, this rank's block out.
            let whole: Vec<u8> = (0..n).flat_map(|b| input(dt, me * n + b, count)).collect();
            let mut got = vec![0u8; count * es];
            c.run_raw(
                Collective::ReduceScatter(RedOp::Sum),
                dt,
                Some(&whole),
                &mut got,
                &opts,
            )
            .unwrap_or_else(|e| panic!("reduce_scatter {dt} {count}: {e}"));
            // In place: the output is this rank's block of the buffer.
            let mut inplace = whole.clone();
            c.run_raw(
                Collective::ReduceScatter(RedOp::Sum),
                dt,
                None,
                &mut inplace,
                &opts,
            )
            .unwrap_or_else(|e| panic!("reduce_scatter in place {dt} {count}: {e}"));
            let block = &inplace[me * count * es..(me + 1) * count * es];
            assert!(
                block == got,
                "reduce_scatter {dt} {count} rank {me}: in place differs"
            );
            out.push((("reduce_scatter sum", dt, count, me), got));
        }
    }
    out
}

/// A setup: the network, whether shared memory joins the ranks, the algorithm asked for,
/// and the pipeline.
#[derive(Clone, Copy, Debug)]
struct Setup {
    net: NetKind,
    shm: bool,
    algo: Option<Algo>,
    tuning: Tuning,
}

/// The outputs of every call on every rank under `s`.
fn outputs(s: Setup, deterministic: bool) -> HashMap<Key, Vec<u8>> {
    let mut cfg = config(s.tuning);
    cfg.net = s.net;
    cfg.shm = s.shm;
    cfg.algo = s.algo;
    cfg.deterministic = deterministic;
    let all = Mutex::new(HashMap::new());
    run_ranks(RANKS, cfg, |c| {
        let got = run_all(&c);
        all.lock().extend(got);
    });
    all.into_inner()
}

/// The first difference between two sets of outputs, if any.
fn first_difference(a: &HashMap<Key, Vec<u8>>, b: &HashMap<Key, Vec<u8>>) -> Option<String> {
    let mut keys: Vec<&Key> = a.keys().collect();
    keys.sort_by_key(|k| (k.0, k.1.size(), format!("{}", k.1), k.2, k.3));
    for k in keys {
        let (x, y) = (&a[k], b.get(k)?);
        if x != y {
            let at = x.iter().zip(y).position(|(p, q)| p != q).unwrap_or(0);
            return Some(format!(
                "{} {} count {} rank {}: byte {at} differs",
                k.0, k.1, k.2, k.3
            ));
        }
    }
    None
}

fn tunings() -> [Tuning; 2] {
    let small = Tuning {
        slice: Some(4096),
        depth: Some(2),
        channels: Some(2),
        ..Tuning::default()
    };
    [Tuning::default(), small]
}

/// Every setup of one network (with and without shared memory between the ranks where
/// the network is not shared memory itself).
fn setups(net: NetKind) -> Vec<Setup> {
    let algos = [
        None,
        Some(Algo::Ring),
        Some(Algo::Tree),
        Some(Algo::Doubling),
        Some(Algo::Bruck),
        Some(Algo::Direct),
        Some(Algo::TwoShot),
    ];
    let mut out = Vec::new();
    for algo in algos {
        for tuning in tunings() {
            out.push(Setup {
                net,
                shm: net == NetKind::Shm,
                algo,
                tuning,
            });
        }
    }
    out
}

/// The sum in rank order of f32 and f64 all-reduces, computed here, against the library's.
fn check_rank_order(got: &HashMap<Key, Vec<u8>>) {
    for count in COUNTS {
        let ins: Vec<Vec<u8>> = (0..RANKS).map(|r| input(DataType::F32, r, count)).collect();
        let f =
            |r: usize, i: usize| f32::from_le_bytes(ins[r][i * 4..i * 4 + 4].try_into().unwrap());
        let out = &got[&("all_reduce sum", DataType::F32, count, 0)];
        for i in 0..count {
            let want = (1..RANKS).fold(f(0, i), |s, r| s + f(r, i));
            let have = f32::from_le_bytes(out[i * 4..i * 4 + 4].try_into().unwrap());
            assert_eq!(
                have.to_bits(),
                want.to_bits(),
                "f32 count {count} element {i}"
            );
        }
        let ins: Vec<Vec<u8>> = (0..RANKS).map(|r| input(DataType::F64, r, count)).collect();
        let f =
            |r: usize, i: usize| f64::from_le_bytes(ins[r][i * 8..i * 8 + 8].try_into().unwrap());
        let out = &got[&("all_reduce sum", DataType::F64, count, 2)];
        for i in 0..count {
            let want = (1..RANKS).fold(f(0, i), |s, r| s + f(r, i));
            let have = f64::from_le_bytes(out[i * 8..i * 8 + 8].try_into().unwrap());
            assert_eq!(
                have.to_bits(),
                want.to_bits(),
                "f64 count {count} element {i}"
            );
        }
    }
}

/// The reference every network's setups are compared with: TCP, the model's choice.
fn reference() -> HashMap<Key, Vec<u8>> {
    let s = setups(NetKind::Tcp)[0];
    let r = outputs(s, true);
    check_rank_order(&r);
    r
}

fn every_setup_gives_the_reference(net: NetKind) {
    let want = reference();
    for s in setups(net) {
        let got = outputs(s, true);
        assert_eq!(got.len(), want.len(), "{s:?}");
        if let Some(d) = first_difference(&want, &got) {
            panic!("deterministic mode, {s:?}: {d}");
        }
    }
}

#[test]
fn deterministic_reductions_are_bitwise_equal_over_tcp() {
    every_setup_gives_the_reference(NetKind::Tcp);
}

#[test]
fn deterministic_reductions_are_bitwise_equal_over_shared_memory() {
    every_setup_gives_the_reference(NetKind::Shm);
}

#[test]
fn deterministic_reductions_are_bitwise_equal_over_the_rocev2_engine() {
    every_setup_gives_the_reference(NetKind::RoceV2);
}

/// The comparison can fail: without the mode, a ring (which sums each block starting at a
/// different rank) gives other bits than the rank-order sum for some of these inputs.
#[test]
fn without_the_mode_a_ring_sums_in_another_order() {
    let want = reference();
    let ring = Setup {
        algo: Some(Algo::Ring),
        ..setups(NetKind::Tcp)[0]
    };
    let got = outputs(ring, false);
    assert!(
        first_difference(&want, &got).is_some(),
        "a ring gave the rank-order sum's bits everywhere: the inputs do not tell orders apart"
    );
}
