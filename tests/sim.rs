//! The simulated network (`ROCCL_NET=sim`): the real communicator, executor and algorithms
//! with every rank a thread, up to 1024 ranks; every collective with every algorithm it has,
//! every rank's output checked; and the predicted times against the link model's formulas.
//!
//! `roccl::tool::sim::run` raises the soft limit of open files to about 4 per rank (1024
//! ranks: about 4400) where the hard limit allows. Run in release mode:
//! `cargo test --release --test sim -- --test-threads 2`.

use std::time::Duration;

use roccl::net::sim::SimSpec;
use roccl::tool::sim::{run, SimCase, SimJob, SimOp, SimResult};
use roccl::Algo;

fn job(ranks: usize, spec: &str) -> SimJob {
    SimJob {
        ranks,
        spec: spec.parse::<SimSpec>().unwrap(),
        timeout: Duration::from_secs(120),
    }
}

fn case(op: SimOp, algo: Option<Algo>, bytes: usize) -> SimCase {
    SimCase {
        op,
        algo,
        bytes,
        warmup: 1,
        iters: 1,
    }
}

/// Every result right, and run with the algorithm asked for.
fn check(results: &[SimResult], what: &str) {
    for r in results {
        assert_eq!(
            r.wrong,
            0,
            "{what}: {} {:?} {} B: {} wrong elements",
            r.case.op.name(),
            r.case.algo,
            r.case.bytes,
            r.wrong
        );
        if let Some(a) = r.case.algo {
            assert_eq!(
                r.algo,
                Some(a),
                "{what}: {} ran another algorithm",
                r.case.op.name()
            );
        }
        if r.case.op != SimOp::Barrier {
            assert!(
                r.time > Duration::ZERO,
                "{what}: {:?} took no virtual time",
                r.case
            );
        }
    }
}

/// Each collective with each algorithm it has over a network, small and pipelined sizes.
fn matrix(n: usize, big: usize) -> Vec<SimCase> {
    use Algo::*;
    let with: [(SimOp, &[Algo]); 7] = [
        (SimOp::AllReduce, &[Ring, Tree, Direct, Doubling, TwoShot]),
        (SimOp::AllGather, &[Ring]),
        (SimOp::ReduceScatter, &[Ring]),
        (SimOp::Broadcast, &[Ring, Tree]),
        (SimOp::Reduce, &[Ring, Tree]),
        (SimOp::AllToAll, &[]),
        (SimOp::Barrier, &[]),
    ];
    let mut cases = Vec::new();
    for (op, algos) in with {
        let sizes: &[usize] = match op {
            SimOp::Barrier => &[0],
            // All-to-all moves n² blocks: a smaller count.
            SimOp::AllToAll => &[4 * n],
            _ => &[4 * n, big],
        };
        for &b in sizes {
            cases.push(case(op, None, b));
            for &a in algos {
                // The one-step algorithms stage n blocks or n buffers: a middle size.
                let b = match a {
                    Direct | Doubling | TwoShot => b.min(64 << 10),
                    _ => b,
                };
                cases.push(case(op, Some(a), b));
            }
        }
    }
    cases
}

#[test]
fn every_collective_and_algorithm_is_right_at_3_8_and_64_ranks() {
    for (n, big) in [(3, 1 << 20), (8, 4 << 20), (64, 1 << 20)] {
        let j = job(n, "ranks_per_host=4");
        let r = run(&j, &matrix(n, big)).unwrap();
        check(&r, &format!("{n} ranks"));
    }
}

/// 1024 ranks: the rendezvous, connections and algorithms at that count, results checked;
/// and the latency terms of the model: at 8 bytes the ring's 2(n-1) steps cost hundreds of
/// times the tree's and the doubling's 2·log2(n) and log2(n).
#[test]
fn at_1024_ranks_rings_trees_and_doubling_are_right_and_trees_win_small() {
    let n = 1024;
    let j = job(
        n,
        "hosts=128,ranks_per_host=8,nic_gbps=100,nic_us=2,local_gbps=200,local_us=0.5,msg_us=0.5",
    );
    let cases = [
        case(SimOp::AllReduce, Some(Algo::Tree), 8),
        case(SimOp::AllReduce, Some(Algo::Doubling), 8),
        case(SimOp::AllReduce, Some(Algo::Ring), 4096),
        case(SimOp::AllReduce, Some(Algo::Tree), 64 << 10),
        case(SimOp::AllGather, Some(Algo::Ring), 4 * n),
        case(SimOp::Barrier, None, 0),
    ];
    let r = run(&j, &cases).unwrap();
    check(&r, "1024 ranks");
    let (tree, doubling, ring) = (r[0].time, r[1].time, r[2].time);
    eprintln!("1024 ranks: all-reduce 8 B tree {tree:?}, doubling {doubling:?}; 4 KiB ring {ring:?}; all-gather 4 KiB ring {:?}; barrier {:?}", r[4].time, r[5].time);
    // A step costs at least the NIC latency and two message overheads (3 µs) on most hops.
    assert!(
        ring > Duration::from_micros(2 * 1023 * 3 / 2),
        "ring {ring:?}"
    );
    // Doubling: 3 exchanges inside a host (0.5 µs + 2 × 0.5 µs overhead), then 7 across
    // NICs (2 µs + 1 µs): 25.5 µs. The double tree: about 2·log2(n) such hops.
    let hops = Duration::from_nanos(3 * 1500 + 7 * 3000);
    assert!(
        doubling >= hops && doubling < hops * 2,
        "doubling {doubling:?}"
    );
    assert!(tree >= hops && tree < hops * 5, "tree {tree:?}");
    assert!(
        ring > tree * 20 && ring > doubling * 50,
        "ring {ring:?} tree {tree:?} doubling {doubling:?}"
    );
}

/// One rank per host (every message crosses a NIC): a large ring all-reduce takes
/// 2(n-1)/n · B / bandwidth plus its latency terms, and twice the bytes take about twice
/// the time; the model's bandwidth and latency show through the real algorithm.
#[test]
fn a_large_ring_all_reduce_takes_what_the_bandwidth_says() {
    let n = 16;
    let gbps = 100.0;
    let j = job(n, "ranks_per_host=1,nic_gbps=100,nic_us=2,msg_us=0.5");
    let sizes = [8 << 20, 16 << 20];
    let cases: Vec<SimCase> = sizes
        .iter()
        .map(|&b| case(SimOp::AllReduce, Some(Algo::Ring), b))
        .collect();
    let r = run(&j, &cases).unwrap();
    check(&r, "16 ranks");
    for (res, &b) in r.iter().zip(&sizes) {
        let wire = 2.0 * (n as f64 - 1.0) / n as f64 * b as f64 * 8.0 / (gbps * 1e9);
        let t = res.time.as_secs_f64();
        eprintln!(
            "ring all-reduce {b} B on {n} ranks: predicted {t:.6} s, bandwidth term {wire:.6} s"
        );
        assert!(
            t >= wire,
            "{b} B: {t} s is faster than the wire allows ({wire} s)"
        );
        // Pipelined: the latency terms (2(n-1) steps of a slice) add a few percent.
        assert!(
            t < wire * 1.1,
            "{b} B: {t} s is far above the bandwidth term {wire} s"
        );
    }
    let ratio = r[1].time.as_secs_f64() / r[0].time.as_secs_f64();
    assert!(
        (1.8..2.2).contains(&ratio),
        "doubling the bytes: time x{ratio}"
    );
}

/// Ranks of one host talk over the faster local links: the same ring on 8 ranks of one host
/// is faster than on 8 hosts by about the ratio of the links' bandwidths.
#[test]
fn ranks_of_one_host_use_the_local_links() {
    let cases = [case(SimOp::AllReduce, Some(Algo::Ring), 8 << 20)];
    let spread = run(
        &job(8, "ranks_per_host=1,nic_gbps=100,local_gbps=400"),
        &cases,
    )
    .unwrap();
    let packed = run(
        &job(8, "ranks_per_host=8,nic_gbps=100,local_gbps=400"),
        &cases,
    )
    .unwrap();
    check(&spread, "8 hosts");
    check(&packed, "one host");
    let ratio = spread[0].time.as_secs_f64() / packed[0].time.as_secs_f64();
    assert!((3.0..4.5).contains(&ratio), "8 hosts / one host: x{ratio}");
}
