//! Shrink, grow and revoke (NCCL's `ncclCommShrink`, `ncclCommGrow`, `ncclCommRevoke`):
//! new communicators from an existing one, without a new unique id, also after a rank
//! stopped answering.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;
use roccl::algo::model::Tuning;
use roccl::{Communicator, Config, RedOp, UniqueId};

fn short(timeout_s: u64) -> Config {
    let mut c = config(Tuning::default());
    c.waiter.timeout = Duration::from_secs(timeout_s);
    c
}

/// Ranks 0..3 of 4 as threads (rank 3 is silent: it never calls again, as a hung or dead
/// rank would not); a call of the survivors waits for it until shrink with abort ends it,
/// and the 3 survivors then run collectives on the new communicator.
#[test]
fn survivors_shrink_after_a_rank_stops_answering() {
    let id = UniqueId::new().unwrap();
    let done = Barrier::new(4);
    std::thread::scope(|s| {
        for r in 0..4 {
            let done = &done;
            s.spawn(move || {
                let c = Arc::new(Communicator::init_with(&id, 4, r, short(30)).unwrap());
                let mut x = [1i64];
                c.all_reduce_in_place(&mut x, RedOp::Sum).unwrap();
                assert_eq!(x[0], 4);
                if r == 3 {
                    // Stops answering; keeps its connections open (a hung process).
                    done.wait();
                    return;
                }
                // A survivor that fails still meets the others at the end (or rank 3 would
                // wait there forever), then fails the test.
                let survivor =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| survive(&c, r)));
                done.wait();
                if let Err(p) = survivor {
                    std::panic::resume_unwind(p);
                }
            });
        }
    });
}

/// What a survivor of `survivors_shrink_after_a_rank_stops_answering` does.
fn survive(c: &Arc<Communicator>, r: usize) {
    let waiting = {
        let c = Arc::clone(c);
        std::thread::spawn(move || {
            let mut x = [1i64];
            c.all_reduce_in_place(&mut x, RedOp::Sum)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    let small = c.shrink(&[3], true, None).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let e = waiting.join().unwrap().unwrap_err().to_string();
    assert!(e.contains("revoked"), "{e}");
    assert!(c.revoked());
    let e = c.all_reduce_in_place(&mut [1i64], RedOp::Sum).unwrap_err();
    assert!(e.to_string().contains("revoked"), "{e}");
    assert_eq!((small.rank(), small.nranks()), (r, 3));
    for round in 0..20i64 {
        let mut x = [r as i64 + round; 5];
        small.all_reduce_in_place(&mut x, RedOp::Sum).unwrap();
        assert_eq!(x, [3 + 3 * round; 5]);
    }
    let mut b = if r == 2 {
        vec![7u32; 1000]
    } else {
        vec![0u32; 1000]
    };
    small.broadcast(&mut b, 2).unwrap();
    assert_eq!(b, vec![7u32; 1000]);
}

/// Ranks that disagree on the excluded ranks meet nobody: they fail at the timeout with a
/// message saying what must agree. A rank that excludes itself, or a rank out of range, is
/// refused at once.
#[test]
fn disagreeing_shrinks_fail_and_say_why() {
    run_ranks(3, short(2), |c| {
        let e = c
            .shrink(&[c.rank()], false, None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("own exclude list"), "{e}");
        let e = c.shrink(&[7], false, None).err().unwrap().to_string();
        assert!(e.contains("out of range"), "{e}");
        match c.rank() {
            0 | 1 => {
                let list: &[usize] = if c.rank() == 0 { &[2] } else { &[] };
                let e = c.shrink(list, false, None).err().unwrap().to_string();
                assert!(e.contains("same excluded ranks"), "rank {}: {e}", c.rank());
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    });
}

/// A healthy communicator shrinks without abort (the parent goes on working, with every
/// rank), then grows back from 2 to 4 ranks: the new ranks join with the id any old rank
/// hands out; old ranks keep their numbers. A wrong id is refused.
#[test]
fn shrink_without_abort_then_grow_with_new_ranks() {
    let id = UniqueId::new().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<UniqueId>();
    let rx = std::sync::Mutex::new(rx);
    std::thread::scope(|s| {
        for r in 0..3 {
            let tx = tx.clone();
            s.spawn(move || {
                let c = Communicator::init_with(&id, 3, r, short(30)).unwrap();
                let small = (r != 1).then(|| c.shrink(&[1], false, None).unwrap());
                // The parent still works with all three.
                let mut x = [1u8];
                c.all_reduce_in_place(&mut x, RedOp::Sum).unwrap();
                assert_eq!(x[0], 3);
                let Some(small) = small else { return };
                assert_eq!(small.nranks(), 2);
                let grow_id = small.grow_id().unwrap();
                let wrong = UniqueId::new().unwrap();
                let e = small
                    .grow(4, Some(&wrong), None, &AtomicBool::new(false))
                    .err()
                    .unwrap();
                assert!(e.to_string().contains("next grow id"), "{e}");
                if small.rank() == 1 {
                    tx.send(grow_id).unwrap();
                    tx.send(grow_id).unwrap();
                }
                let mine = (small.rank() == 0).then_some(&grow_id);
                let big = small.grow(4, mine, None, &AtomicBool::new(false)).unwrap();
                assert_eq!((big.rank(), big.nranks()), (small.rank(), 4));
                let mut x = [10f32 * big.rank() as f32];
                big.all_reduce_in_place(&mut x, RedOp::Sum).unwrap();
                assert_eq!(x[0], 60.0);
                // The id was for that grow only.
                assert_ne!(small.grow_id().unwrap(), grow_id);
            });
        }
        for new_rank in [2, 3] {
            let rx = &rx;
            s.spawn(move || {
                let gid = rx.lock().unwrap().recv().unwrap();
                let big = Communicator::init_with(&gid, 4, new_rank, short(30)).unwrap();
                let mut x = [10f32 * new_rank as f32];
                big.all_reduce_in_place(&mut x, RedOp::Sum).unwrap();
                assert_eq!(x[0], 60.0);
            });
        }
    });
}
