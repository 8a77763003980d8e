//! Every collective over the RDMA network on the userspace RoCE v2 engine (real UDP
//! sockets on this host), ranks as threads, checked against the reference.

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;

fn matrix(n: usize, tuning: Tuning) {
    net_matrix(NetKind::RoceV2, "rocev2", n, tuning);
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

#[test]
fn collective_then_destroy_at_once() {
    collective_then_destroy(NetKind::RoceV2, 3, 150);
}
