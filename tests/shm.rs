//! Every collective over the shared-memory network (ranks as threads on this host), checked
//! against the reference.

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;

#[test]
fn shm_2_ranks() {
    net_matrix(NetKind::Shm, "shm", 2, Tuning::default());
}

/// Small slices and slots: ring pipelines of many slices, shared-memory collectives of many
/// pieces (slot reuse across calls).
#[test]
fn shm_3_ranks_pipelined() {
    let mut cfg = config(Tuning {
        slice: Some(4096),
        depth: Some(3),
        channels: Some(2),
    });
    cfg.net = NetKind::Shm;
    cfg.shm_slot = Some(4096);
    net_matrix_cfg(cfg, "shm", 3);
}

#[test]
fn shm_5_ranks() {
    net_matrix(NetKind::Shm, "shm", 5, Tuning::default());
}

/// `auto` reaches ranks of this host over shared memory (and says so).
#[test]
fn auto_uses_shared_memory_between_local_ranks() {
    net_matrix(NetKind::Auto, "shm", 3, Tuning::default());
}
