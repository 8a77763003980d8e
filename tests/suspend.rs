//! Closing idle connections while suspended (NCCL's `ncclCommSuspend` with
//! `NCCL_SUSPEND_MEM`): ranks that suspend together close the connections idle at both
//! ends, keep those a message is still in flight on (a rank a call ahead), keep those with
//! ranks that do not suspend, and open them again on the next call.

mod common;

use std::sync::{Barrier, Mutex};
use std::time::Duration;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;
use roccl::{Algo, Communicator, Config, RedOp};

fn cfg(net: NetKind) -> Config {
    let mut c = config(Tuning::default());
    c.net = net;
    c.waiter.timeout = Duration::from_secs(20);
    c
}

fn sum_check(c: &Communicator, round: i64) {
    let n = c.nranks() as i64;
    let mut x = vec![c.rank() as i64 + round; 1000];
    c.all_reduce_in_place(&mut x, RedOp::Sum).unwrap();
    let want = n * (n - 1) / 2 + n * round;
    assert!(x.iter().all(|&v| v == want), "rank {}: {}", c.rank(), x[0]);
}

fn all_suspend_together(net: NetKind) {
    let n = 3;
    let met = Barrier::new(n);
    watchdog();
    run_ranks(n, cfg(net), |c| {
        for round in 0..3 {
            sum_check(&c, round);
        }
        let mut b = vec![if c.rank() == 2 { 9u32 } else { 0 }; 100];
        c.broadcast(&mut b, 2).unwrap();
        assert_eq!(b, vec![9u32; 100]);
        let (s, r) = c.open_connections();
        assert!(s + r > 0, "rank {}: no connections to close", c.rank());
        met.wait();
        let k = c.close_idle_connections(Duration::from_secs(5)).unwrap();
        assert_eq!(k.closed, s + r, "rank {}: {k:?}", c.rank());
        assert!(k.kept_with.is_empty(), "rank {}: {k:?}", c.rank());
        assert_eq!(c.open_connections(), (0, 0));
        met.wait();
        // Resumed: the next calls open them again.
        for round in 3..6 {
            sum_check(&c, round);
        }
        assert!(c.open_connections().0 > 0);
    });
}

#[test]
fn ranks_that_suspend_together_close_their_connections_over_tcp() {
    all_suspend_together(NetKind::Tcp);
}

#[test]
fn ranks_that_suspend_together_close_their_connections_over_rocev2() {
    all_suspend_together(NetKind::RoceV2);
}

/// Rank 1 broadcasts (a chain: its send completes, the message waits in rank 2's receive
/// buffers) and suspends before the others make that call: what it sent is kept for them,
/// and the connection it went over stays open at both ends; the others' broadcast then
/// receives it.
fn a_rank_a_call_ahead(net: NetKind) {
    let n = 3;
    let met = Barrier::new(n);
    let kept = Mutex::new(vec![Vec::new(); n]);
    let mut cfg = cfg(net);
    cfg.algo = Some(Algo::Ring);
    watchdog();
    run_ranks(n, cfg, |c| {
        sum_check(&c, 0);
        let mut b = vec![if c.rank() == 1 { 5u64 } else { 0 }; 64];
        if c.rank() == 1 {
            c.broadcast(&mut b, 1).unwrap();
        }
        met.wait();
        let k = c.close_idle_connections(Duration::from_secs(5)).unwrap();
        kept.lock().unwrap()[c.rank()] = k.kept_with.clone();
        met.wait();
        // Both ends agree on every connection kept; rank 1 kept the one it sent on.
        let kept = kept.lock().unwrap().clone();
        for (p, with) in kept.iter().enumerate() {
            for &q in with {
                assert!(kept[q].contains(&p), "{kept:?}");
            }
        }
        assert!(kept[1].contains(&2), "{kept:?}");
        if c.rank() != 1 {
            c.broadcast(&mut b, 1).unwrap();
        }
        assert_eq!(b, vec![5u64; 64], "rank {}", c.rank());
        for round in 1..4 {
            sum_check(&c, round);
        }
    });
}

/// A rank that panics leaves the others waiting at a barrier: end the test instead.
fn watchdog() {
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(120));
        eprintln!("suspend tests: still running after 120 s, a rank must have failed");
        std::process::exit(1);
    });
}

#[test]
fn a_message_in_flight_keeps_its_connection_over_tcp() {
    a_rank_a_call_ahead(NetKind::Tcp);
}

#[test]
fn a_message_in_flight_keeps_its_connection_over_rocev2() {
    a_rank_a_call_ahead(NetKind::RoceV2);
}

/// Rank 2 does not suspend: ranks 0 and 1 close what they share and keep their
/// connections with rank 2, after waiting for it as long as they were told to.
#[test]
fn a_rank_that_does_not_suspend_keeps_its_connections() {
    let n = 3;
    let met = Barrier::new(n);
    watchdog();
    run_ranks(n, cfg(NetKind::Tcp), |c| {
        sum_check(&c, 0);
        met.wait();
        if c.rank() != 2 {
            let t = std::time::Instant::now();
            let k = c
                .close_idle_connections(Duration::from_millis(300))
                .unwrap();
            assert!(k.closed > 0, "rank {}: {k:?}", c.rank());
            assert_eq!(k.kept_with, vec![2], "rank {}", c.rank());
            assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        }
        met.wait();
        for round in 1..4 {
            sum_check(&c, round);
        }
    });
}
