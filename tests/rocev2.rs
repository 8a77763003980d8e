//! Every collective over the RDMA network on the userspace RoCE v2 engine (real UDP
//! sockets on this host), ranks as threads, checked against the reference.

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;
use roccl::{Config, DataType, RedOp};

fn rocev2(tuning: Tuning) -> Config {
    let mut c = config(tuning);
    c.net = NetKind::RoceV2;
    c
}

fn matrix(n: usize, tuning: Tuning) {
    run_ranks(n, rocev2(tuning), |c| {
        assert_eq!(c.net_name(), "rocev2");
        for k in KINDS {
            for &algo in algos(k) {
                for (dt, op) in [
                    (DataType::F32, RedOp::Sum),
                    (DataType::Bf16, RedOp::Max),
                    (DataType::I64, RedOp::Avg),
                    (DataType::U8, RedOp::Prod),
                ] {
                    let reducing =
                        matches!(k, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter);
                    if !reducing && op != RedOp::Sum {
                        continue;
                    }
                    for count in [0usize, 1, 7, 1000, 70_001] {
                        for in_place in [false, true] {
                            one(&c, k, dt, op, count, algo, in_place, (count + 1) % n);
                        }
                    }
                }
            }
        }
        c.barrier().unwrap();
    });
}

#[test]
fn rocev2_2_ranks() {
    matrix(2, Tuning::default());
}

#[test]
fn rocev2_3_ranks_pipelined() {
    matrix(
        3,
        Tuning {
            slice: Some(4096),
            depth: Some(3),
            channels: Some(2),
        },
    );
}

#[test]
fn rocev2_4_ranks() {
    matrix(4, Tuning::default());
}
