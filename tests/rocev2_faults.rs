//! The RDMA network over the userspace RoCE v2 engine with the fault injector on: real UDP
//! datagrams dropped, duplicated, reordered and corrupted at 2%, every result still exact,
//! and the injector's and engines' counters show that faults happened and were recovered from.

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;
use roccl::rdma::udp::{fault_stats, FaultStats};
use roccl::{DataType, RedOp};

/// Faults of each kind were injected and the engines recovered from them (retransmitted
/// what was lost, dropped what failed its ICRC, recognised duplicates).
fn assert_recovered(before: FaultStats) {
    let a = fault_stats();
    let what = format!("{before:?} -> {a:?}");
    for (now, then, missing) in [
        (a.dropped, before.dropped, "nothing dropped"),
        (a.corrupted, before.corrupted, "nothing corrupted"),
        (a.duplicated, before.duplicated, "nothing duplicated"),
        (a.reordered, before.reordered, "nothing reordered"),
        (a.retransmits, before.retransmits, "no retransmission"),
        (a.icrc_errors, before.icrc_errors, "no ICRC drop"),
        (a.duplicates, before.duplicates, "no duplicate seen"),
    ] {
        assert!(now > then, "{missing}: {what}");
    }
}

fn inject_faults() {
    std::env::set_var(
        "ROCCL_ROCEV2_FAULTS",
        "drop=0.02,dup=0.02,reorder=0.02,corrupt=0.02,seed=42",
    );
    std::env::set_var("ROCCL_IB_TIMEOUT", "12");
}

/// The one test of this binary: the fault injector is configured through the environment,
/// which is process-wide, so it is set once, before any thread of the test runs, and the
/// cases run one after the other (each checking its own counters).
#[test]
fn collectives_survive_a_lossy_network() {
    inject_faults();
    // A collective followed at once by destroy on every rank, rounds after rounds.
    let before = fault_stats();
    collective_then_destroy(NetKind::RoceV2, 3, 100);
    assert_recovered(before);
    let before = fault_stats();
    let mut cfg = config(Tuning::default());
    cfg.net = NetKind::RoceV2;
    cfg.waiter.timeout = std::time::Duration::from_secs(20);
    run_ranks(3, cfg, |c| {
        for k in KINDS {
            for algo in algos_on(&c, k) {
                for count in [1usize, 1000, 200_003] {
                    one(&c, k, DataType::F32, RedOp::Sum, count, algo, false, 1);
                    one(&c, k, DataType::I32, RedOp::Max, count, algo, true, 2);
                }
            }
        }
    });
    assert_recovered(before);
}
