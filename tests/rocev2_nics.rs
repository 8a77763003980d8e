//! Several NICs and several queue pairs per connection on the userspace RoCE v2 engine:
//! `ROCCL_IB_HCA` lists two loopback addresses (an engine on each, two "NICs") and
//! `ROCCL_IB_QPS_PER_CONNECTION=3`; every collective, ranks as threads, checked against
//! the reference. One test in this binary: it sets the environment for the whole process.

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;

#[test]
fn every_collective_over_two_nics_and_three_queue_pairs() {
    std::env::set_var("ROCCL_IB_HCA", "127.0.0.1,127.0.0.2");
    std::env::set_var("ROCCL_IB_QPS_PER_CONNECTION", "3");
    // Two channels for every size (the model takes one per NIC from 1 MiB on): both NICs
    // carry the small calls too.
    net_matrix(
        NetKind::RoceV2,
        "rocev2",
        3,
        Tuning {
            channels: Some(2),
            slice: Some(64 << 10),
            ..Tuning::default()
        },
    );
}
