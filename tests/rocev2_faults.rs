//! The RDMA network over the userspace RoCE v2 engine with the fault injector on: real UDP
//! datagrams dropped, duplicated, reordered and corrupted at 2%, every result still exact.

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;
use roccl::{DataType, RedOp};

/// Every test of this binary injects the same faults (the variable is process-wide).
fn inject_faults() {
    std::env::set_var(
        "ROCCL_ROCEV2_FAULTS",
        "drop=0.02,dup=0.02,reorder=0.02,corrupt=0.02,seed=42",
    );
    std::env::set_var("ROCCL_IB_TIMEOUT", "12");
}

#[test]
fn collective_then_destroy_at_once_over_a_lossy_network() {
    inject_faults();
    collective_then_destroy(NetKind::RoceV2, 3, 100);
}

#[test]
fn collectives_survive_a_lossy_network() {
    inject_faults();
    let mut cfg = config(Tuning::default());
    cfg.net = NetKind::RoceV2;
    cfg.waiter.timeout = std::time::Duration::from_secs(20);
    run_ranks(3, cfg, |c| {
        for k in KINDS {
            for &algo in algos(k) {
                for count in [1usize, 1000, 200_003] {
                    one(&c, k, DataType::F32, RedOp::Sum, count, algo, false, 1);
                    one(&c, k, DataType::I32, RedOp::Max, count, algo, true, 2);
                }
            }
        }
    });
}
