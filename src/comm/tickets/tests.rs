//! The ticket queue's code, run on loom's primitives: loom runs each test body once per
//! interleaving of its threads (up to a bound on preemptions) and fails on a deadlock, a
//! panic or a failed assertion in any of them.

use std::sync::Arc;

use super::*;

/// loom's primitives.
struct Loom;

impl Prims for Loom {
    type Mutex<T: Send> = loom::sync::Mutex<T>;
    type Guard<'a, T: Send + 'a> = loom::sync::MutexGuard<'a, T>;
    type Condvar = loom::sync::Condvar;
    type Counter = loom::sync::atomic::AtomicU64;
    type Sender<T: Send> = Sender<T>;
    type Receiver<T: Send> = Receiver<T>;

    fn mutex<T: Send>(v: T) -> Self::Mutex<T> {
        loom::sync::Mutex::new(v)
    }
    fn lock<T: Send>(m: &Self::Mutex<T>) -> Self::Guard<'_, T> {
        m.lock().unwrap()
    }
    fn condvar() -> Self::Condvar {
        loom::sync::Condvar::new()
    }
    fn wait<'a, T: Send>(c: &Self::Condvar, g: Self::Guard<'a, T>) -> Self::Guard<'a, T> {
        c.wait(g).unwrap()
    }
    fn notify_all(c: &Self::Condvar) {
        c.notify_all();
    }
    fn counter() -> Self::Counter {
        loom::sync::atomic::AtomicU64::new(0)
    }
    fn take(c: &Self::Counter) -> u64 {
        c.fetch_add(1, Ordering::SeqCst)
    }
    fn channel<T: Send>() -> (Self::Sender<T>, Self::Receiver<T>) {
        let c = Arc::new(Channel {
            queue: loom::sync::Mutex::new((std::collections::VecDeque::new(), 1)),
            ready: loom::sync::Condvar::new(),
        });
        (Sender(Arc::clone(&c)), Receiver(c))
    }
    fn send<T: Send>(s: &Self::Sender<T>, v: T) -> Result<(), T> {
        s.0.queue.lock().unwrap().0.push_back(v);
        s.0.ready.notify_one();
        Ok(())
    }
    fn try_recv<T: Send>(r: &Self::Receiver<T>) -> Next<T> {
        let mut q = r.0.queue.lock().unwrap();
        match q.0.pop_front() {
            Some(v) => Next::Item(v),
            None if q.1 == 0 => Next::Closed,
            None => Next::Empty,
        }
    }
    fn recv<T: Send>(r: &Self::Receiver<T>) -> Option<T> {
        let mut q = r.0.queue.lock().unwrap();
        loop {
            if let Some(v) = q.0.pop_front() {
                return Some(v);
            }
            if q.1 == 0 {
                return None;
            }
            q = r.0.ready.wait(q).unwrap();
        }
    }
}

/// std's channel as loom sees it: loom's own stand-in never reports the senders gone,
/// which is how the worker learns to stop. Items, and the number of senders.
struct Channel<T> {
    queue: loom::sync::Mutex<(std::collections::VecDeque<T>, usize)>,
    ready: loom::sync::Condvar,
}

struct Sender<T>(Arc<Channel<T>>);
struct Receiver<T>(Arc<Channel<T>>);

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        self.0.queue.lock().unwrap().1 -= 1;
        self.0.ready.notify_one();
    }
}

/// What the calls did, in the order they ran.
#[derive(Default)]
struct Log {
    ran: Vec<&'static str>,
    panics: Vec<String>,
}

type Job = Box<dyn FnOnce(&mut Log) + Send>;
type Queue = Tickets<Log, Job, Loom>;

fn job(name: &'static str) -> Job {
    Box::new(move |log: &mut Log| log.ran.push(name))
}

/// The worker's waiting: `spins` times nothing (the worker polls again), then block.
struct Waits {
    spins: usize,
    left: usize,
}

impl Pause for Waits {
    fn progressed(&mut self) {
        self.left = self.spins;
    }
    fn pause(&mut self) -> bool {
        if self.left == 0 {
            return true;
        }
        self.left -= 1;
        loom::thread::yield_now();
        false
    }
}

/// The queue, and a slot for its worker thread once one submit started it.
struct Harness {
    q: Arc<Queue>,
    worker: Arc<loom::sync::Mutex<Option<loom::thread::JoinHandle<()>>>>,
    spins: usize,
}

impl Harness {
    fn new(spins: usize) -> Harness {
        Harness {
            q: Arc::new(Queue::new(Log::default(), |log, msg| {
                log.panics.push(msg.to_string())
            })),
            worker: Arc::default(),
            spins,
        }
    }

    /// Submit `j`, starting the worker thread as the communicator does.
    fn submit(&self, j: Job) {
        let (q, slot, spins) = (Arc::clone(&self.q), Arc::clone(&self.worker), self.spins);
        let spawn = move || -> Result<_, ()> {
            let (tx, rx) = Loom::channel();
            let h = loom::thread::spawn(move || q.serve(rx, &mut Waits { spins, left: spins }));
            *slot.lock().unwrap() = Some(h);
            Ok(tx)
        };
        assert!(self.q.submit(j, spawn).is_ok());
    }

    /// Close the worker's channel, wait for the worker, return the log.
    fn finish(self) -> Vec<&'static str> {
        self.q.close();
        if let Some(h) = self.worker.lock().unwrap().take() {
            h.join().unwrap();
        }
        let log = self.q.lock();
        assert!(log.panics.is_empty(), "{:?}", log.panics);
        log.ran.clone()
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// Two threads mix non-blocking jobs and blocking calls; every call runs, each thread's in
/// the order it issued them, and nobody waits forever (a job queued behind a later ticket
/// than its own would: loom reports the deadlock).
#[test]
fn jobs_and_blocking_calls_all_run_in_issue_order() {
    for spins in [0, 1] {
        model(move || {
            let j = Arc::new(Harness::new(spins));
            let other = {
                let j = Arc::clone(&j);
                loom::thread::spawn(move || {
                    j.submit(job("b1"));
                    j.q.with_turn(|log| log.ran.push("b2"));
                })
            };
            j.submit(job("a1"));
            j.submit(job("a2"));
            j.q.with_turn(|log| log.ran.push("a3"));
            other.join().unwrap();
            let ran = Arc::try_unwrap(j).ok().expect("threads joined").finish();
            assert_eq!(ran.len(), 5, "{ran:?}");
            let pos = |n: &str| ran.iter().position(|r| *r == n).unwrap();
            assert!(pos("a1") < pos("a2") && pos("a2") < pos("a3"), "{ran:?}");
            assert!(pos("b1") < pos("b2"), "{ran:?}");
        });
    }
}

/// A worker that cannot start takes no ticket: the job comes back, and calls issued after
/// it (on this thread or another) still get their turns.
#[test]
fn a_worker_that_cannot_start_takes_no_ticket() {
    model(|| {
        let j = Arc::new(Harness::new(0));
        let other = {
            let j = Arc::clone(&j);
            loom::thread::spawn(move || j.q.with_turn(|log| log.ran.push("b")))
        };
        let back = j.q.submit(job("a1"), || {
            Err::<<Loom as Prims>::Sender<_>, _>("no thread")
        });
        assert!(matches!(back, Err((_, "no thread"))));
        j.q.with_turn(|log| log.ran.push("a2"));
        other.join().unwrap();
        let mut ran = Arc::try_unwrap(j).ok().expect("threads joined").finish();
        ran.sort();
        assert_eq!(ran, ["a2", "b"]);
    });
}

/// A call that panics leaves its text as the state's error and its turn passes on: the
/// call after it runs (on the real primitives; loom's threads do not unwind).
#[test]
fn a_panicking_call_passes_its_turn_on() {
    let q: Tickets<Log, Job> =
        Tickets::new(Log::default(), |log, msg| log.panics.push(msg.to_string()));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        q.with_turn(|_| panic!("boom"))
    }));
    assert!(r.is_err());
    q.with_turn(|log| log.ran.push("after"));
    let log = q.lock();
    assert_eq!(log.panics, ["boom"]);
    assert_eq!(log.ran, ["after"]);
}
