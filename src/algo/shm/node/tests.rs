//! Tests of the shared segments: attach, waits, dead and aborted peers.

use super::*;

#[test]
fn call_numbers_widen_across_wrap() {
    let base = 1u64 << 32;
    assert_eq!(full_call(base + 5, 5, 5), base + 5);
    assert_eq!(full_call(base + 5, 5, 3), base + 3);
    // The call before the 32-bit counter wrapped.
    assert_eq!(full_call(base + 1, 1, u32::MAX), base - 1);
    // A `result` never published (0) has not reached a call past 2^31, where the 32-bit
    // comparison would say it had.
    let k = (1u32 << 31) + 7;
    assert!(reached(0, k));
    assert!(0 < full_call(u64::from(k), k, k));
}

#[test]
fn counters_compare_across_wrap() {
    assert!(reached(5, 5));
    assert!(reached(6, 5));
    assert!(!reached(4, 5));
    assert!(reached(2, u32::MAX));
    assert!(!reached(u32::MAX, 2));
}

/// Two ranks' nodes in this process (process_vm_readv reads our own memory).
fn pair(w: &Waiter) -> (Node, Node) {
    let tag = u64::from(std::process::id()) << 20 ^ 0x5eed;
    let segs: Vec<NodeSeg> = (0..2)
        .map(|r| NodeSeg::create(tag, r, 4096).unwrap())
        .collect();
    let mut nodes: Vec<Node> = std::thread::scope(|s| {
        let hs: Vec<_> = segs
            .into_iter()
            .enumerate()
            .map(|(r, seg)| {
                s.spawn(move || Node::attach(seg, tag, r, 2, w, &AtomicBool::new(false)))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap().unwrap().expect("attached"))
            .collect()
    });
    let b = nodes.pop().unwrap();
    (nodes.pop().unwrap(), b)
}

#[test]
fn a_copy_from_a_rank_that_failed_meanwhile_is_an_error() {
    let w = Waiter {
        timeout: Duration::from_secs(10),
        ..Waiter::default()
    };
    let abort = AtomicBool::new(false);
    let (mut a, mut b) = pair(&w);
    assert!(a.cma() && b.cma(), "process_vm_readv on our own process");
    let src: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
    let mut out = vec![0u8; src.len()];
    for fail in [false, true] {
        let k = a.begin([5000, 1], &w, &abort).unwrap();
        assert_eq!(b.begin([5000, 1], &w, &abort).unwrap(), k);
        a.set_direct(k, &src);
        a.publish(Counter::Arrive, k);
        if fail {
            // Rank 0 gives up after publishing its buffer, before rank 1 copies it.
            a.mark_broken();
        }
        b.publish(Counter::Arrive, k);
        b.wait_one(0, Counter::Arrive, k, &w, &abort).unwrap();
        let r = b.read_direct(0, k, &mut out);
        if fail {
            let e = r.expect_err("copied from a rank that failed").to_string();
            assert!(e.contains("rank 0") && e.contains("failed"), "{e}");
        } else {
            r.unwrap();
            assert_eq!(out, src);
            a.wait_one(1, Counter::Arrive, k, &w, &abort).unwrap();
        }
    }
}

/// Only segments whose owner is gone are removed: of three ranks' segments, the one
/// whose header names a process that exited goes, a live process's and our own stay.
#[test]
fn only_the_segments_of_dead_processes_are_removed() {
    let tag = u64::from(std::process::id()) << 20 ^ 0xdead;
    let segs: Vec<NodeSeg> = (0..3)
        .map(|r| NodeSeg::create(tag, r, 4096).unwrap())
        .collect();
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let mut live = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    header(&segs[1].seg).pid.store(dead_pid, Ordering::Relaxed);
    header(&segs[2].seg).pid.store(live.id(), Ordering::Relaxed);
    let exists =
        |r: usize| std::path::Path::new(&format!("/dev/shm/roccl-node-{tag:016x}-{r}")).exists();
    assert!((0..3).all(exists));
    assert_eq!(remove_dead_segments(tag, 0, 3), vec![1]);
    assert_eq!((exists(0), exists(1), exists(2)), (true, false, true));
    let _ = live.kill();
    let _ = live.wait();
}

/// A peer that never attaches: if its process is gone, attach fails naming it and
/// removes its segment (instead of waiting out the timeout, 5 s here, and failing with
/// a timeout); if the application aborts, attach ends with an error saying so.
#[test]
fn attach_ends_on_a_dead_peer_or_an_abort() {
    let w = Waiter {
        timeout: Duration::from_secs(5),
        ..Waiter::default()
    };
    for abort in [false, true] {
        let tag = u64::from(std::process::id()) << 20 ^ 0xa77 ^ u64::from(abort);
        let mine = NodeSeg::create(tag, 0, 4096).unwrap();
        let peer = NodeSeg::create(tag, 1, 4096).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        header(&peer.seg).pid.store(child.id(), Ordering::Relaxed);
        if !abort {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        let flag = AtomicBool::new(abort);
        let r = Node::attach(mine, tag, 0, 2, &w, &flag);
        let _ = child.kill();
        let _ = child.wait();
        let e = match r {
            Err(e) => e.to_string(),
            Ok(_) => panic!("attached without the peer"),
        };
        if abort {
            assert!(e.contains("aborted by the application"), "{e}");
        } else {
            assert!(
                e.contains("rank 1") && e.contains("exited during initialization"),
                "{e}"
            );
            let name = format!("/dev/shm/roccl-node-{tag:016x}-1");
            assert!(!std::path::Path::new(&name).exists(), "{name} left behind");
        }
        drop(peer);
    }
}

#[test]
fn a_killed_process_is_gone_before_it_is_reaped() {
    assert!(!process_gone(std::process::id()));
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    assert!(!process_gone(child.id()));
    child.kill().unwrap();
    let t = Instant::now();
    while !process_gone(child.id()) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "zombie not seen as gone"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.wait().unwrap();
}
