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
fn a_rank_that_does_not_suspend(net: NetKind) {
    let n = 3;
    let met = Barrier::new(n);
    watchdog();
    run_ranks(n, cfg(net), |c| {
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

#[test]
fn a_rank_that_does_not_suspend_keeps_its_connections_over_tcp() {
    a_rank_that_does_not_suspend(NetKind::Tcp);
}

#[test]
fn a_rank_that_does_not_suspend_keeps_its_connections_over_rocev2() {
    a_rank_that_does_not_suspend(NetKind::RoceV2);
}

/// Ranks suspend again and again without waiting for each other afterwards: a rank that
/// resumes first opens connections again (or sends on the ones kept) while its peers still
/// settle theirs, requests of earlier rounds go stale, and every call's result stays right.
fn suspend_while_others_resume(net: NetKind) {
    let n = 3;
    watchdog();
    run_ranks(n, cfg(net), |c| {
        let me = c.rank();
        let mut closed = 0;
        for round in 0..12usize {
            sum_check(&c, round as i64);
            let root = round % n;
            let mut b = vec![if me == root { round as u32 + 1 } else { 0 }; 1 + 300 * round];
            c.broadcast(&mut b, root).unwrap();
            assert!(b.iter().all(|&v| v == round as u32 + 1), "round {round}");
            let send: Vec<u64> = (0..n).map(|p| (me * 100 + p + round) as u64).collect();
            let mut got = vec![0u64; n];
            c.all_to_all(&send, &mut got).unwrap();
            let want: Vec<u64> = (0..n).map(|p| (p * 100 + me + round) as u64).collect();
            assert_eq!(got, want, "rank {me} round {round}");
            // A shift around the ring, on the point-to-point channel.
            let mut from = [0u32; 8];
            c.sendrecv(&[me as u32; 8], (me + 1) % n, &mut from, (me + n - 1) % n)
                .unwrap();
            assert_eq!(from, [((me + n - 1) % n) as u32; 8]);
            let wait = Duration::from_millis(if round % 4 == 3 { 0 } else { 500 });
            closed += c.close_idle_connections(wait).unwrap().closed;
        }
        assert!(closed > 0, "rank {me}: nothing ever closed");
    });
}

#[test]
fn suspending_while_others_resume_keeps_every_result_over_tcp() {
    suspend_while_others_resume(NetKind::Tcp);
}

#[test]
fn suspending_while_others_resume_keeps_every_result_over_rocev2() {
    suspend_while_others_resume(NetKind::RoceV2);
}
