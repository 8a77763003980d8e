//! An exhaustive check of the ticket protocol (`Communicator::submit`, `run_turn`), as a
//! model: every interleaving of the atomic steps of a few submitting threads and the worker
//! is explored, and a state where something is left to do but nothing can move is a
//! deadlock. The model of the old protocol — the ticket taken and the job queued as two
//! steps — must find one; the protocol as built (both under the queue's lock) must not.

use std::collections::HashSet;

/// What a submitting thread does for one call.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Call {
    /// Non-blocking: queued for the worker.
    Async,
    /// Blocking: runs on this thread when its turn comes.
    Blocking,
}

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct State {
    next_ticket: u64,
    serving: u64,
    queue: Vec<u64>,
    /// The ticket the worker took out of the queue and waits to run.
    worker: Option<u64>,
    /// Per thread: the call it is at, and the ticket it holds (taken, not yet queued or run).
    threads: Vec<(usize, Option<u64>)>,
}

/// Explore every interleaving; returns a deadlocked state if there is one.
fn explore(programs: &[Vec<Call>], atomic_submit: bool) -> Option<State> {
    let start = State {
        next_ticket: 0,
        serving: 0,
        queue: Vec::new(),
        worker: None,
        threads: vec![(0, None); programs.len()],
    };
    let mut seen = HashSet::new();
    let mut stack = vec![start];
    while let Some(s) = stack.pop() {
        if !seen.insert(s.clone()) {
            continue;
        }
        let mut moves = Vec::new();
        for (i, prog) in programs.iter().enumerate() {
            let (pc, held) = s.threads[i];
            let Some(&call) = prog.get(pc) else { continue };
            let mut n = s.clone();
            match (call, held) {
                (Call::Async, None) if atomic_submit => {
                    n.queue.push(n.next_ticket);
                    n.next_ticket += 1;
                    n.threads[i] = (pc + 1, None);
                }
                (_, None) => {
                    n.threads[i] = (pc, Some(n.next_ticket));
                    n.next_ticket += 1;
                }
                (Call::Async, Some(t)) => {
                    n.queue.push(t);
                    n.threads[i] = (pc + 1, None);
                }
                (Call::Blocking, Some(t)) => {
                    if s.serving != t {
                        continue;
                    }
                    n.serving += 1;
                    n.threads[i] = (pc + 1, None);
                }
            }
            moves.push(n);
        }
        match s.worker {
            None if !s.queue.is_empty() => {
                let mut n = s.clone();
                n.worker = Some(n.queue.remove(0));
                moves.push(n);
            }
            Some(t) if s.serving == t => {
                let mut n = s.clone();
                n.serving += 1;
                n.worker = None;
                moves.push(n);
            }
            _ => {}
        }
        let finished = s.threads.iter().zip(programs).all(|(t, p)| t.0 == p.len())
            && s.queue.is_empty()
            && s.worker.is_none();
        if moves.is_empty() && !finished {
            return Some(s);
        }
        stack.extend(moves);
    }
    None
}

fn programs() -> Vec<Vec<Vec<Call>>> {
    use Call::*;
    vec![
        vec![vec![Async, Async], vec![Async, Async]],
        vec![vec![Async, Blocking], vec![Blocking, Async]],
        vec![vec![Async, Async], vec![Blocking, Async], vec![Async]],
        vec![vec![Blocking, Blocking, Async], vec![Async, Blocking]],
    ]
}

#[test]
fn tickets_taken_apart_from_queueing_deadlock_in_some_interleaving() {
    let p = &programs()[0];
    let dead = explore(p, false).expect("the old protocol has a deadlock");
    // The worker holds a later ticket than the one being served, which waits behind it.
    let w = dead.worker.expect("the worker holds a job");
    assert!(w > dead.serving, "{dead:?}");
}

#[test]
fn tickets_taken_with_the_queue_locked_never_deadlock() {
    for p in programs() {
        assert_eq!(explore(&p, true), None, "{p:?}");
    }
}
