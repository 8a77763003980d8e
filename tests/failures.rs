//! Bad input and broken peers: clear errors, never a hang or silent corruption.

mod common;

use std::time::{Duration, Instant};

use common::*;
use roccl::algo::model::Tuning;
use roccl::{Communicator, Config, Error, RedOp, UniqueId};

/// Does the message blame `rank` (as "rank N" not followed by another digit)?
fn names(msg: &str, rank: usize) -> bool {
    let pat = format!("rank {rank}");
    msg.match_indices(&pat)
        .any(|(i, _)| !msg[i + pat.len()..].starts_with(|c: char| c.is_ascii_digit()))
}

fn short(timeout_s: u64) -> Config {
    let mut c = config(Tuning::default());
    c.waiter.timeout = Duration::from_secs(timeout_s);
    c
}

#[test]
fn bad_arguments_are_errors_and_leave_the_communicator_usable() {
    run_ranks(2, short(20), |c| {
        let mut out = vec![0f32; 4];
        let e = c.all_reduce(&[1f32; 3], &mut out, RedOp::Sum).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("12 bytes"), "{e}");
        let e = c.broadcast(&mut out, 7).unwrap_err();
        assert!(e.to_string().contains("root 7 is out of range"), "{e}");
        let e = c.all_gather(&[1u8; 3], &mut [0u8; 5]).unwrap_err();
        assert!(e.to_string().contains("2 ranks × 3"), "{e}");
        let e = c
            .reduce_scatter_in_place(&mut [0i32; 3], RedOp::Sum)
            .unwrap_err();
        assert!(e.to_string().contains("not divisible by 2"), "{e}");
        let e = c.send(&[1u8], 9).unwrap_err();
        assert!(e.to_string().contains("peer 9"), "{e}");
        let e = c
            .run_raw(
                roccl::Collective::AllReduce(RedOp::Sum),
                roccl::DataType::F32,
                None,
                &mut [0u8; 6],
                &Default::default(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("not a whole number of f32"), "{e}");
        // Still usable.
        let mut v = vec![c.rank() as f32 + 1.0; 5];
        c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
        assert_eq!(v, vec![3.0; 5]);
    });
}

#[test]
fn init_arguments_are_checked() {
    let id = UniqueId::new().unwrap();
    let e = Communicator::init_with(&id, 2, 2, short(5))
        .err()
        .expect("rank 2 of 2 must fail");
    assert!(e.to_string().contains("rank 2 is out of range"), "{e}");
    let e = Communicator::init_with(&id, 0, 0, short(5))
        .err()
        .expect("0 ranks must fail");
    assert!(e.to_string().contains("at least 1"), "{e}");
}

#[test]
fn init_timeout_names_missing_ranks() {
    let id = UniqueId::new().unwrap();
    let t = Instant::now();
    let e = std::thread::scope(|s| {
        let a = s.spawn(|| Communicator::init_with(&id, 4, 0, short(2)).err());
        let b = s.spawn(|| Communicator::init_with(&id, 4, 3, short(2)).err());
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(t.elapsed() < Duration::from_secs(10));
    for err in [e.0, e.1] {
        let msg = err.expect("init must time out").to_string();
        assert!(msg.contains("ranks 1, 2 never arrived"), "{msg}");
    }
}

#[test]
fn mismatched_counts_are_detected() {
    run_ranks(2, short(10), |c| {
        let n = if c.rank() == 0 { 100 } else { 50 };
        let mut v = vec![1f32; n];
        let e = c
            .all_reduce_in_place(&mut v, RedOp::Sum)
            .unwrap_err()
            .to_string();
        // Every rank names both ranks and says the counts differ (the call tags carry a hash
        // of the byte count; the rank that finds out tells the other).
        assert!(
            e.contains("with another count of bytes") && names(&e, 0) && names(&e, 1),
            "{e}"
        );
        // The communicator is now unusable, and says why.
        let e2 = c.barrier().unwrap_err().to_string();
        assert!(e2.contains("unusable after an earlier error"), "{e2}");
    });
}

/// Shared-memory collectives compare what every rank called: different counts or different
/// collectives are errors naming both, never each other's bytes. (Calls that the model sends
/// down different paths, one rank in the segments and another over the rings, end in the
/// timeout, which names the rank and says it may have called a different collective.)
#[test]
fn mismatched_calls_are_detected_in_shared_memory_collectives() {
    let mut cfg = short(10);
    cfg.net = roccl::net::NetKind::Shm;
    cfg.algo = Some(roccl::Algo::ShmOneShot);
    for case in 0..2 {
        run_ranks(3, cfg.clone(), move |c| {
            let mut v = vec![1f32; 100];
            c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
            let r = match (case, c.rank()) {
                (0, 1) => c.all_reduce_in_place(&mut v[..50], RedOp::Sum),
                (1, 2) => c.broadcast(&mut v, 0),
                _ => c.all_reduce_in_place(&mut v, RedOp::Sum),
            };
            let e = r.expect_err("mismatched calls must fail").to_string();
            assert!(
                e.contains("bytes per rank") || e.contains("failed, was aborted or destroyed"),
                "case {case} rank {}: {e}",
                c.rank()
            );
            if case == 0 && c.rank() == 0 {
                assert!(e.contains("200 bytes") && e.contains("400 bytes"), "{e}");
            }
        });
    }
}

/// A rank that disappears mid-job: every other rank gets an error naming it, quickly.
#[test]
fn dead_rank_is_named_by_everyone() {
    dead_rank(short(30));
}

/// The same in shared-memory collectives (every rank on this host): the others see the
/// victim's segment marked when its communicator goes away.
#[test]
fn dead_rank_is_named_in_shared_memory_collectives() {
    let mut cfg = short(30);
    cfg.net = roccl::net::NetKind::Shm;
    cfg.algo = Some(roccl::Algo::ShmTwoShot);
    dead_rank(cfg);
}

fn dead_rank(cfg: Config) {
    for victim in [0usize, 2] {
        run_ranks(5, cfg.clone(), move |c| {
            let mut v = vec![1f32; 300_000];
            c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
            if c.rank() == victim {
                drop(c);
                return;
            }
            let t = Instant::now();
            let mut res = Ok(());
            for _ in 0..20 {
                res = c.all_reduce_in_place(&mut v, RedOp::Sum);
                if res.is_err() {
                    break;
                }
            }
            let e = res.expect_err("the collective must fail").to_string();
            assert!(names(&e, victim), "rank {}: {e}", c.rank());
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "took {:?}",
                t.elapsed()
            );
        });
    }
}

/// A rank that stays alive but stops participating (before its first collective, or after
/// a few): the others time out and all name it, not each other. Before its first collective
/// the others are still opening connections; on a loaded machine (a `yes` beside the test:
/// 2 failures in 6 runs before the fix, 0 in 10 after) a rank still connecting with the hung
/// one was blamed by a peer that waited on it, ended "aborted while connections were being
/// opened" without passing the blame on, and the other ranks named it. Now it passes the
/// blame to the rank it is connecting with, as a rank blamed in a collective's wait does.
/// `scripts/test.sh` runs this file again beside a busy core.
#[test]
fn hung_rank_is_named_after_the_timeout() {
    hung_rank(short(2));
}

/// The same in shared-memory collectives.
#[test]
fn hung_rank_is_named_in_shared_memory_collectives() {
    let mut cfg = short(2);
    cfg.net = roccl::net::NetKind::Shm;
    cfg.algo = Some(roccl::Algo::ShmOneShot);
    hung_rank(cfg);
}

fn hung_rank(cfg: Config) {
    for warm in [false, true] {
        run_ranks(4, cfg.clone(), move |c| {
            if warm {
                c.all_reduce_in_place(&mut [1f64; 1000], RedOp::Sum)
                    .unwrap();
            }
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_secs(6));
                return;
            }
            let t = Instant::now();
            let e = c
                .all_reduce_in_place(&mut [1f64; 1000], RedOp::Sum)
                .unwrap_err()
                .to_string();
            assert!(names(&e, 1), "warm={warm} rank {}: {e}", c.rank());
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "took {:?}",
                t.elapsed()
            );
        });
    }
}

/// A hung rank in a ring: rank 0 waits on the hung rank 3, rank 1 on rank 0, rank 2 on rank
/// 1 (and on sending to rank 3). Every rank must blame rank 3, not the live rank it waited
/// on: each that times out tells every other rank — the rank it blames included, which is
/// how rank 0 learns that rank 1, blamed by rank 2, is alive (rank 0 blamed rank 1 when the
/// notices left out the rank they blamed: seen in the torch suite over rocev2); and a rank
/// sending its notices accepts the others' meanwhile (over rocev2 a connect needs the peer's
/// accept: ranks 1 and 2, each sending while the other sent, heard nothing and named the
/// rank they waited on). Each of the two fixes alone fails this test.
#[test]
fn a_hung_rank_in_a_ring_is_blamed_by_every_rank() {
    for net in [roccl::net::NetKind::Tcp, roccl::net::NetKind::RoceV2] {
        let mut cfg = short(2);
        cfg.net = net;
        cfg.algo = Some(roccl::Algo::Ring);
        run_ranks(4, cfg, move |c| {
            let mut buf = vec![1f32; 1 << 20];
            c.all_reduce_in_place(&mut buf, RedOp::Sum).unwrap();
            if c.rank() == 3 {
                std::thread::sleep(Duration::from_secs(7));
                return;
            }
            let e = c.all_reduce_in_place(&mut buf, RedOp::Sum).unwrap_err();
            let blamed_3 = match &e {
                Error::Remote { rank, .. } => *rank == 3,
                // A plain timeout: every peer it waited on must be rank 3.
                Error::Timeout { waiting_on, .. } => {
                    !waiting_on.is_empty() && waiting_on.iter().all(|&p| p == 3)
                }
                _ => false,
            };
            assert!(blamed_3, "{net:?} rank {}: {e}", c.rank());
        });
    }
}

/// A per-call timeout (`CallOpts::timeout`, what torch's per-operation timeouts become)
/// replaces the communicator's for that call only: a collective and a batch of receives
/// waiting on a rank that never calls give up after it, naming that rank, though the
/// communicator's own timeout is a minute.
#[test]
fn a_per_call_timeout_replaces_the_communicators() {
    use roccl::{CallOpts, Collective, DataType, P2p};
    for p2p in [false, true] {
        run_ranks(2, short(60), move |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_secs(3));
                return;
            }
            let opts = CallOpts {
                timeout: Some(Duration::from_millis(500)),
                ..Default::default()
            };
            let mut buf = vec![1u8; 64];
            let t = Instant::now();
            let e = if p2p {
                c.p2p_with(
                    &mut [P2p::Recv {
                        peer: 1,
                        buf: &mut buf,
                    }],
                    &opts,
                )
            } else {
                c.run_raw(
                    Collective::AllReduce(RedOp::Sum),
                    DataType::F32,
                    None,
                    &mut buf,
                    &opts,
                )
                .map(|_| ())
            }
            .unwrap_err()
            .to_string();
            assert!(names(&e, 1), "p2p={p2p}: {e}");
            assert!(e.contains("500ms"), "p2p={p2p}: {e}");
            assert!(
                t.elapsed() < Duration::from_secs(3),
                "p2p={p2p}: took {:?}",
                t.elapsed()
            );
        });
    }
}

/// Different calls on different ranks whose messages have the same sizes: every network
/// carries each call's tag, so the first exchange fails on both ranks naming both calls,
/// instead of summing one call's bytes into the other's.
#[test]
fn mismatched_calls_of_equal_sizes_are_detected_over_networks() {
    for net in [roccl::net::NetKind::Tcp, roccl::net::NetKind::RoceV2] {
        let mut cfg = short(10);
        cfg.net = net;
        for case in [0, 1, 3] {
            run_ranks(2, cfg.clone(), move |c| {
                let mut v = vec![1f32; 64];
                c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
                let one = c.rank() == 1;
                let r = match (case, one) {
                    (0, true) => c.all_reduce_in_place(&mut v, RedOp::Max),
                    (1, true) => c.broadcast(&mut v, 0),
                    (3, true) => c.all_reduce_in_place(&mut v[..32], RedOp::Sum),
                    _ => c.all_reduce_in_place(&mut v, RedOp::Sum),
                };
                let err = r.expect_err("mismatched calls must fail");
                if case < 3 {
                    // The cause is typed: the peer was in another call, with both calls'
                    // tags (which differ).
                    assert!(
                        matches!(
                            err,
                            roccl::Error::Remote {
                                cause: roccl::PeerCause::OtherCall { ours, theirs },
                                ..
                            } if ours != theirs && ours != 0 && theirs != 0
                        ),
                        "{net:?} case {case} rank {}: {err:?}",
                        c.rank()
                    );
                }
                let e = err.to_string();
                // The communicator reports the same, typed.
                let later = c.async_error().expect("the communicator is broken");
                assert_eq!(later.message, e, "{net:?} case {case}");
                if case < 3 {
                    assert!(
                        matches!(later.cause, Some(roccl::PeerCause::OtherCall { .. })),
                        "{later:?}"
                    );
                }
                let want: &[&str] = match case {
                    0 => &["all_reduce(sum, f32)", "all_reduce(max, f32)"],
                    1 => &["all_reduce(sum, f32)", "broadcast(root 0)"],
                    _ => &["with another count of bytes", "holds only"],
                };
                assert!(
                    names(&e, 0) && names(&e, 1) && want.iter().any(|w| e.contains(w)),
                    "{net:?} case {case} rank {}: {e}",
                    c.rank()
                );
                if case < 3 {
                    assert!(
                        want.iter().all(|w| e.contains(w)),
                        "{net:?} case {case}: {e}"
                    );
                }
            });
        }
    }
}
