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
            ..Tuning::default()
        },
    );
}

#[test]
fn rocev2_4_ranks() {
    matrix(4, Tuning::default());
}

/// A receive small enough for eager messages only (1000 bytes, no clear-to-send) meeting a
/// send too large for eager (20000 bytes, which waits for one): both ranks fail at once, the
/// sender saying how much the receive holds, instead of waiting out `ROCCL_TIMEOUT` (20 s
/// here) and failing with a generic timeout.
#[test]
fn an_eager_receive_meeting_a_rendezvous_send_fails_at_once() {
    let mut cfg = config(Tuning::default());
    cfg.net = NetKind::RoceV2;
    cfg.waiter.timeout = std::time::Duration::from_secs(20);
    run_ranks(2, cfg, |c| {
        let r = if c.rank() == 0 {
            c.send(&[1u8; 20000], 1)
        } else {
            c.recv(&mut [0u8; 1000], 0)
        };
        let e = r.expect_err("mismatched sizes must fail").to_string();
        eprintln!("rank {}: {e}", c.rank());
        if c.rank() == 0 {
            assert!(e.contains("holds only 1000 bytes"), "{e}");
            assert!(e.contains("rank 1"), "{e}");
        } else {
            assert!(e.contains("rank 0"), "{e}");
            assert!(e.contains("holds only 1000 bytes"), "{e}");
        }
    });
}

#[test]
fn collective_then_destroy_at_once() {
    collective_then_destroy(NetKind::RoceV2, 3, 150);
}
