//! Encrypted jobs (`ROCCL_ENCRYPT`, issue 22): every collective over TCP comes out right
//! when the bootstrap and the connections are sealed, and asking for encryption with an id
//! made without it is an error rather than a silent downgrade. (The wire itself, tampering
//! and replay are tested at the TCP network and record layer, `src/net/tcp/`; ranks in
//! processes with `ncclSetEncryption`'s pre-shared key in `tests/nccl/test_encryption.py`.)

mod common;

use common::*;
use roccl::algo::model::Tuning;
use roccl::bootstrap::UniqueId;
use roccl::net::NetKind;
use roccl::{Communicator, Config, RedOp};

fn tcp() -> Config {
    let mut c = config(Tuning::default());
    c.net = NetKind::Tcp;
    c
}

#[test]
fn every_collective_is_right_in_an_encrypted_job_over_tcp() {
    let id = UniqueId::new_with(true).unwrap();
    assert!(id.encrypted());
    net_matrix_of(id, tcp(), "tcp", 3);
}

#[test]
fn large_all_reduces_over_several_sockets_in_an_encrypted_job() {
    let id = UniqueId::new_with(true).unwrap();
    run_ranks_of(id, 2, tcp(), |c| {
        for count in [1usize, 65_537, 4 << 20] {
            let mut v: Vec<f32> = (0..count).map(|i| (i % 1000) as f32).collect();
            c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
            for (i, x) in v.iter().enumerate() {
                assert_eq!(*x, 2.0 * (i % 1000) as f32, "element {i} of {count}");
            }
        }
    });
}

#[test]
fn asking_for_encryption_with_an_id_made_without_it_is_an_error() {
    // Every other test of this file makes encrypted ids, which this request does not change.
    roccl::bootstrap::seal::set(true, None).unwrap();
    let id = UniqueId::new_with(false).unwrap();
    let e = Communicator::init_with(&id, 1, 0, tcp())
        .err()
        .expect("init must refuse")
        .to_string();
    assert!(
        e.contains("ROCCL_ENCRYPT") && e.contains("made without encryption"),
        "{e}"
    );
    assert!(UniqueId::new().unwrap().encrypted(), "ids made now encrypt");
}

#[test]
fn an_encrypted_job_without_a_secret_is_refused_naming_how_to_give_one() {
    // Launcher mode without ROCCL_JOB_SECRET: the id's keys would be a hash of the root's
    // address and port. Made by hand, as `ROCCL_ROOT` + `ROCCL_ENCRYPT=1` make it.
    let addr: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
    roccl::bootstrap::seal::set(true, None).unwrap();
    let id = UniqueId::for_address_with(addr, None);
    assert!(id.encrypted() && !id.has_secret());
    let e = Communicator::init_with(&id, 1, 0, tcp())
        .err()
        .expect("init must refuse")
        .to_string();
    assert!(
        e.contains("no secret") && e.contains("ROCCL_JOB_SECRET") && e.contains("rank 0"),
        "{e}"
    );
    // A job with a secret runs.
    let id = UniqueId::new_with(true).unwrap();
    assert!(id.encrypted() && id.has_secret());
    run_ranks_of(id, 2, tcp(), |c| {
        let mut v = [1.0f32; 4];
        c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
        assert_eq!(v, [2.0; 4]);
    });
}

#[test]
fn a_short_pre_shared_key_is_refused() {
    let e = roccl::bootstrap::seal::set(true, Some(b"hunter2"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("7 bytes") && e.contains("at least 16"), "{e}");
}
