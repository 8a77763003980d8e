//! The RDMA network on a RoCE v2 NIC through libibverbs (cargo feature `verbs`).
//!
//! Without a NIC (as on the dev machines, whose kernel has no RDMA at all) the tests here
//! check that libibverbs is really called and that every way to ask for the NIC fails with an
//! error that says what is missing and how to fix it. The collective suite on hardware is
//! `#[ignore]`d: run it with `ROCCL_TEST_IB_DEVICE=mlx5_0 cargo test --features verbs --test
//! verbs -- --ignored` on a node with a RoCE v2 NIC (`scripts/test.sh` does when the variable
//! is set, and says that it skipped them otherwise).
#![cfg(feature = "verbs")]

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;
use roccl::rdma::ibv::{IbSettings, IbvVerbs};
use roccl::rdma::select::{self, Choice, GidEntry};

fn has_rdma_device() -> bool {
    select::scan(std::path::Path::new(select::SYSFS_ROOT)).is_ok_and(|p| !p.is_empty())
}

#[test]
fn without_a_nic_every_entry_point_says_what_is_missing() {
    if has_rdma_device() {
        eprintln!("SKIPPED: this host has an RDMA device; the no-device errors are not checked");
        return;
    }
    // libibverbs itself: asked for a device by name, it finds none.
    let fake = Choice {
        dev: "mlx5_0".into(),
        port: 1,
        gid_index: 3,
        gid: GidEntry {
            index: 3,
            gid: "::ffff:10.0.0.1".parse().unwrap(),
            roce_v2: true,
            ndev: Some("eth0".into()),
        },
        why: "test".into(),
    };
    let e = IbvVerbs::open(&fake, IbSettings::from_lookup(&|_| None).unwrap())
        .err()
        .expect("no RDMA device here, yet libibverbs opened one")
        .to_string();
    assert!(
        e.contains("ibv_get_device_list") && e.contains("irdma") && e.contains("mlx5_ib"),
        "{e}"
    );
    // The network: ROCCL_NET=verbs fails at init with the same advice.
    let mut cfg = config(Tuning::default());
    cfg.net = NetKind::Verbs;
    let id = roccl::UniqueId::new().unwrap();
    let e = roccl::Communicator::init_with(&id, 1, 0, cfg)
        .err()
        .expect("a verbs communicator without a NIC")
        .to_string();
    assert!(e.contains("no RDMA device") && e.contains("irdma"), "{e}");
    // Auto falls back to TCP.
    let mut cfg = config(Tuning::default());
    cfg.net = NetKind::Auto;
    let id = roccl::UniqueId::new().unwrap();
    let c = roccl::Communicator::init_with(&id, 1, 0, cfg).unwrap();
    assert_eq!(c.net_name(), "tcp");
    eprintln!("SKIPPED (hardware): no RDMA device on this host; only the no-device paths ran");
}

fn hardware() -> String {
    match std::env::var("ROCCL_TEST_IB_DEVICE") {
        Ok(d) if !d.is_empty() => {
            std::env::set_var("ROCCL_IB_HCA", format!("={d}"));
            d
        }
        _ => panic!(
            "ROCCL_TEST_IB_DEVICE is not set: these tests need a RoCE v2 NIC (e.g. ROCCL_TEST_IB_DEVICE=mlx5_0)"
        ),
    }
}

#[test]
#[ignore = "needs a RoCE v2 NIC: set ROCCL_TEST_IB_DEVICE"]
fn verbs_2_ranks() {
    hardware();
    net_matrix(NetKind::Verbs, "verbs", 2, Tuning::default());
}

#[test]
#[ignore = "needs a RoCE v2 NIC: set ROCCL_TEST_IB_DEVICE"]
fn verbs_3_ranks_pipelined() {
    hardware();
    net_matrix(
        NetKind::Verbs,
        "verbs",
        3,
        Tuning {
            slice: Some(4096),
            depth: Some(3),
            channels: Some(2),
            ..Tuning::default()
        },
    );
}

#[test]
#[ignore = "needs a RoCE v2 NIC: set ROCCL_TEST_IB_DEVICE"]
fn verbs_4_ranks() {
    hardware();
    net_matrix(NetKind::Verbs, "verbs", 4, Tuning::default());
}
