//! The ticket queue that orders every call of a communicator: each call takes a ticket when
//! issued and runs when its turn comes, on the calling thread (blocking calls) or on the
//! worker thread (non-blocking calls and jobs, sent to it with their tickets).
//!
//! The queue is generic over its synchronisation primitives ([`Prims`]): the library runs
//! it on parking_lot's locks and std's channel ([`Real`]); its tests run the same code on
//! loom's, which explores every interleaving of the threads (`tests::loom_checks`).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};

/// The primitives the queue is built on.
pub(crate) trait Prims: 'static {
    /// A lock.
    type Mutex<T: Send>: Send + Sync;
    /// A held lock.
    type Guard<'a, T: Send + 'a>: DerefMut<Target = T>;
    /// A condition variable for [`Prims::Mutex`].
    type Condvar: Send + Sync;
    /// A counter taken from by several threads.
    type Counter: Send + Sync;
    /// The sending end of an unbounded channel.
    type Sender<T: Send>: Send;
    /// Its receiving end.
    type Receiver<T: Send>: Send;

    /// A new lock holding `v`.
    fn mutex<T: Send>(v: T) -> Self::Mutex<T>;
    /// Take the lock.
    fn lock<T: Send>(m: &Self::Mutex<T>) -> Self::Guard<'_, T>;
    /// A new condition variable.
    fn condvar() -> Self::Condvar;
    /// Release `g`, sleep until notified, take the lock again.
    fn wait<'a, T: Send>(c: &Self::Condvar, g: Self::Guard<'a, T>) -> Self::Guard<'a, T>;
    /// Wake every waiter.
    fn notify_all(c: &Self::Condvar);
    /// A counter at 0.
    fn counter() -> Self::Counter;
    /// The counter's value, incremented.
    fn take(c: &Self::Counter) -> u64;
    /// A new channel.
    fn channel<T: Send>() -> (Self::Sender<T>, Self::Receiver<T>);
    /// Send `v`; it comes back when the receiver is gone.
    fn send<T: Send>(s: &Self::Sender<T>, v: T) -> Result<(), T>;
    /// The next item without waiting.
    fn try_recv<T: Send>(r: &Self::Receiver<T>) -> Next<T>;
    /// The next item, waiting for it; `None` once every sender is gone.
    fn recv<T: Send>(r: &Self::Receiver<T>) -> Option<T>;
}

/// What [`Prims::try_recv`] found.
pub(crate) enum Next<T> {
    /// An item.
    Item(T),
    /// Nothing yet.
    Empty,
    /// Nothing, and every sender is gone.
    Closed,
}

/// The library's primitives: parking_lot's lock and condition variable, std's channel.
pub(crate) struct Real;

impl Prims for Real {
    type Mutex<T: Send> = parking_lot::Mutex<T>;
    type Guard<'a, T: Send + 'a> = parking_lot::MutexGuard<'a, T>;
    type Condvar = parking_lot::Condvar;
    type Counter = AtomicU64;
    type Sender<T: Send> = std::sync::mpsc::Sender<T>;
    type Receiver<T: Send> = std::sync::mpsc::Receiver<T>;

    fn mutex<T: Send>(v: T) -> Self::Mutex<T> {
        parking_lot::Mutex::new(v)
    }
    fn lock<T: Send>(m: &Self::Mutex<T>) -> Self::Guard<'_, T> {
        m.lock()
    }
    fn condvar() -> Self::Condvar {
        parking_lot::Condvar::new()
    }
    fn wait<'a, T: Send>(c: &Self::Condvar, mut g: Self::Guard<'a, T>) -> Self::Guard<'a, T> {
        c.wait(&mut g);
        g
    }
    fn notify_all(c: &Self::Condvar) {
        c.notify_all();
    }
    fn counter() -> Self::Counter {
        AtomicU64::new(0)
    }
    fn take(c: &Self::Counter) -> u64 {
        c.fetch_add(1, Ordering::SeqCst)
    }
    fn channel<T: Send>() -> (Self::Sender<T>, Self::Receiver<T>) {
        std::sync::mpsc::channel()
    }
    fn send<T: Send>(s: &Self::Sender<T>, v: T) -> Result<(), T> {
        s.send(v).map_err(|e| e.0)
    }
    fn try_recv<T: Send>(r: &Self::Receiver<T>) -> Next<T> {
        match r.try_recv() {
            Ok(v) => Next::Item(v),
            Err(std::sync::mpsc::TryRecvError::Empty) => Next::Empty,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => Next::Closed,
        }
    }
    fn recv<T: Send>(r: &Self::Receiver<T>) -> Option<T> {
        r.recv().ok()
    }
}

/// The state calls run on, with the ticket being served.
pub(crate) struct Turns<S> {
    serving: u64,
    state: S,
}

impl<S> Deref for Turns<S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.state
    }
}

impl<S> DerefMut for Turns<S> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.state
    }
}

/// A job for the worker thread, with its ticket.
pub(crate) type Ticketed<W> = (u64, W);

/// How the worker thread waits between jobs.
pub(crate) trait Pause {
    /// A job ran.
    fn progressed(&mut self);
    /// Nothing queued: wait a little (spin, yield); true when it is time to block.
    fn pause(&mut self) -> bool;
}

/// Calls on state `S` in ticket order; `W`, a job for the worker thread.
pub(crate) struct Tickets<S: Send, W: Send, P: Prims = Real> {
    turns: P::Mutex<Turns<S>>,
    turn: P::Condvar,
    next: P::Counter,
    worker: P::Mutex<Option<P::Sender<Ticketed<W>>>>,
    /// What a call that panicked leaves behind (the panic's text): the state's error.
    panicked: fn(&mut S, &str),
}

impl<S: Send, W: FnOnce(&mut S) + Send, P: Prims> Tickets<S, W, P> {
    /// A queue at ticket 0 over `state`.
    pub(crate) fn new(state: S, panicked: fn(&mut S, &str)) -> Self {
        Tickets {
            turns: P::mutex(Turns { serving: 0, state }),
            turn: P::condvar(),
            next: P::counter(),
            worker: P::mutex(None),
            panicked,
        }
    }

    /// The state, locked (it may be in another call's turn: wait for it to end).
    pub(crate) fn lock(&self) -> P::Guard<'_, Turns<S>> {
        P::lock(&self.turns)
    }

    /// Run `f` on the calling thread in the next turn.
    pub(crate) fn with_turn<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        let t = P::take(&self.next);
        self.run_turn(t, f)
    }

    /// Run `f` in turn `t`. The turn always advances, also when `f` panics: the state then
    /// gets the panic's text (`panicked`), and the panic goes on to the caller.
    pub(crate) fn run_turn<R>(&self, t: u64, f: impl FnOnce(&mut S) -> R) -> R {
        let mut turns = self.lock();
        while turns.serving != t {
            turns = P::wait(&self.turn, turns);
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut turns.state)));
        if let Err(p) = &r {
            (self.panicked)(&mut turns.state, &panic_text(&**p));
        }
        turns.serving += 1;
        P::notify_all(&self.turn);
        drop(turns);
        r.unwrap_or_else(|p| std::panic::resume_unwind(p))
    }

    /// Queue `job` for the worker thread with the next ticket. The ticket is taken and the
    /// job sent with the worker's slot locked, so the worker receives jobs in ticket order
    /// (a job sent after a later ticket's would wait for its turn forever). The worker is
    /// started first (`spawn`) if need be: when it cannot start, no ticket is taken and the
    /// job comes back with the error.
    pub(crate) fn submit<E>(
        &self,
        job: W,
        spawn: impl FnOnce() -> Result<P::Sender<Ticketed<W>>, E>,
    ) -> Result<(), (W, E)> {
        let mut w = P::lock(&self.worker);
        if w.is_none() {
            match spawn() {
                Ok(tx) => *w = Some(tx),
                Err(e) => return Err((job, e)),
            }
        }
        let tx = w.as_ref().expect("worker started above");
        let t = P::take(&self.next);
        if let Err((t, job)) = P::send(tx, (t, job)) {
            // The worker is gone (it ends only when the channel closes, which needs the
            // queue dropped): run the job here, in its turn.
            drop(w);
            self.run_turn(t, job);
        }
        Ok(())
    }

    /// The worker thread's loop: run the jobs received in turn, waiting between them as
    /// `wait` says, until the channel closes ([`Tickets::close`]). A job that panics has
    /// broken the state (see [`Tickets::run_turn`]); the worker goes on with the next, which
    /// fails at once, rather than leaving queued tickets unserved.
    pub(crate) fn serve(&self, rx: P::Receiver<Ticketed<W>>, wait: &mut impl Pause) {
        let run = |(t, job): Ticketed<W>| {
            let _ =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_turn(t, job)));
        };
        loop {
            match P::try_recv(&rx) {
                Next::Item(job) => {
                    run(job);
                    wait.progressed();
                }
                Next::Closed => return,
                Next::Empty => {
                    if wait.pause() {
                        match P::recv(&rx) {
                            Some(job) => run(job),
                            None => return,
                        }
                        wait.progressed();
                    }
                }
            }
        }
    }

    /// Close the worker's channel: it stops after the jobs already queued.
    pub(crate) fn close(&self) {
        P::lock(&self.worker).take();
    }
}

/// The text of a panic's payload.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests;
