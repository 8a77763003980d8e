//! The call queue: tickets that order every call of a communicator, the worker thread that
//! runs non-blocking calls and jobs, turns ([`Turn`]) and handles ([`Handle`]).

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use crate::device::Device;
use crate::error::{AsyncError, Error, ErrorKind, Result};
use crate::exec::{Mem, MemMut};
use crate::types::{DataType, Element, RedOp};

use super::tickets::{Pause, Prims, Real, Ticketed};
use super::{Broken, CallInfo, CallOpts, Collective, Communicator, P2p, P2pMem, State, Work};

/// A non-blocking operation in flight; its buffer comes back from [`Handle::wait`].
pub struct Handle<R> {
    pub(super) rx: mpsc::Receiver<Result<R>>,
    got: Option<Result<R>>,
    /// What the call ended with when it never answered (it panicked): the communicator's
    /// error.
    broken: Arc<Broken>,
}

impl<R> Handle<R> {
    /// True once the operation has finished (successfully or not).
    pub fn test(&mut self) -> bool {
        if self.got.is_none() {
            match self.rx.try_recv() {
                Ok(r) => self.got = Some(r),
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.got = Some(Err(self.broken.error().unwrap_or_else(|| {
                        Error::Internal("the call ended without an answer".into())
                    })))
                }
                Err(mpsc::TryRecvError::Empty) => {}
            }
        }
        self.got.is_some()
    }

    /// Block until the operation finishes; returns its buffer or its error.
    pub fn wait(mut self) -> Result<R> {
        if let Some(r) = self.got.take() {
            return r;
        }
        self.rx.recv().unwrap_or_else(|_| {
            Err(self.broken.error().unwrap_or_else(|| {
                Error::Internal(
                    "the call ended without an answer (communicator worker exited)".into(),
                )
            }))
        })
    }
}

impl Communicator {
    pub(super) fn with_turn<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        self.shared.calls.with_turn(f)
    }

    /// Queue `job` for the worker thread with the next ticket, starting the worker first
    /// if need be ([`super::tickets::Tickets::submit`]).
    fn submit(&self, job: Work) -> std::result::Result<(), (Work, Error)> {
        self.shared.calls.submit(job, || self.spawn_worker())
    }

    fn spawn_worker(&self) -> Result<mpsc::Sender<Ticketed<Work>>> {
        #[cfg(test)]
        if super::tests::SPAWN_FAILS.with(|f| f.get()) {
            return Err(Error::sys(
                "starting the communicator's worker thread",
                std::io::Error::from_raw_os_error(libc::EAGAIN),
            ));
        }
        let (tx, rx) = Real::channel::<Ticketed<Work>>();
        let shared = Arc::clone(&self.shared);
        std::thread::Builder::new()
            .name(format!("roccl-r{}", self.shared.rank))
            .spawn(move || {
                // Between jobs, poll the queue as the waiting policy says (spin with a core
                // per rank, yield when sharing) before sleeping in the channel: the next
                // layer's call usually comes within microseconds, and a futex wake-up costs
                // more than the collective itself.
                let mut ws = WorkerWait(shared.worker_wait.start());
                shared.calls.serve(rx, &mut ws);
            })
            .map_err(|e| Error::sys("starting the communicator's worker thread", e))
            .map(|_| tx)
    }

    /// Run `coll` in the background on owned buffers; `send == None` means in place. The
    /// call is ordered with every other call on this communicator by issue time.
    pub fn start<T: Element>(
        &self,
        coll: Collective,
        send: Option<Vec<T>>,
        mut recv: Vec<T>,
    ) -> Handle<Vec<T>> {
        let (tx, rx) = mpsc::channel();
        let answer = tx.clone();
        let job = Box::new(move |state: &mut State| {
            let s = send.as_deref().map(bytemuck::cast_slice::<T, u8>);
            let r = state.execute(
                coll,
                T::DTYPE,
                s,
                bytemuck::cast_slice_mut(&mut recv),
                &CallOpts::default(),
            );
            let _ = tx.send(r.map(|_| recv));
        });
        if let Err((job, e)) = self.submit(job) {
            // Not started, no ticket taken: the call fails alone.
            drop(job);
            let _ = answer.send(Err(e));
        }
        Handle {
            rx,
            got: None,
            broken: Arc::clone(&self.shared.broken),
        }
    }

    /// Non-blocking in-place all-reduce.
    pub fn all_reduce_async<T: Element>(&self, buf: Vec<T>, op: RedOp) -> Handle<Vec<T>> {
        self.start(Collective::AllReduce(op), None, buf)
    }

    /// Run `job` on this communicator's worker thread, ordered with every other call on it
    /// by issue time; returns at once. The job gets the communicator's [`Turn`]: what the
    /// stream-ordered collectives of [`super::stream`] run their work with.
    pub fn enqueue(&self, job: Box<dyn FnOnce(&mut Turn) + Send>) {
        let abort = Arc::clone(&self.shared.abort);
        let job: Box<dyn FnOnce(&mut State) + Send> = Box::new(move |state: &mut State| {
            let mut turn = Turn {
                state,
                abort: &abort,
            };
            job(&mut turn)
        });
        if let Err((job, e)) = self.submit(job) {
            // No worker: run it on this thread in its turn (streams may wait on what it
            // signals, so it must run).
            crate::warn!(
                "rank {}: {e}; running a stream-ordered call on the calling thread",
                self.shared.rank
            );
            self.with_turn(job);
        }
    }
}

/// A communicator's turn on its worker thread: collectives and point-to-point exchanges
/// run from here without taking another turn (see [`Communicator::enqueue`]).
pub struct Turn<'a> {
    pub(super) state: &'a mut State,
    pub(super) abort: &'a std::sync::atomic::AtomicBool,
}

impl Turn<'_> {
    /// [`Communicator::run_raw`], within this turn.
    pub fn run_raw(
        &mut self,
        coll: Collective,
        dt: DataType,
        send: Option<&[u8]>,
        recv: &mut [u8],
        opts: &CallOpts,
    ) -> Result<CallInfo> {
        self.state.execute(coll, dt, send, recv, opts)
    }

    /// [`Communicator::p2p`], within this turn.
    pub fn p2p(&mut self, ops: &mut [P2p<'_>]) -> Result<()> {
        self.state.p2p(ops)
    }

    /// [`Communicator::run_mem`], within this turn.
    pub(crate) fn run_mem(
        &mut self,
        coll: Collective,
        dt: DataType,
        send: Option<Mem<'_>>,
        recv: MemMut<'_>,
        opts: &CallOpts,
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<CallInfo> {
        self.state.execute_mem(coll, dt, send, recv, opts, dev)
    }

    /// [`Communicator::p2p_mem`], within this turn.
    pub(crate) fn p2p_mem(
        &mut self,
        ops: &mut [P2pMem<'_>],
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<()> {
        self.state.p2p_mem(ops, dev)
    }

    /// Record `e` as the communicator's error (nobody waits for this call's result: the
    /// application learns it from [`Communicator::async_error`]); argument errors too.
    pub fn fail(&mut self, e: &Error) {
        if self.state.broken.set(AsyncError::of(e)) {
            if let Some(node) = &self.state.node {
                node.mark_broken();
            }
        }
    }

    /// How long the worker thread spins before yielding (zero unless every rank of this
    /// host has a spare core for its worker).
    pub fn spin(&self) -> Duration {
        self.state.worker_spin
    }

    /// How long a wait may go without progress before it fails (`ROCCL_TIMEOUT`).
    pub fn timeout(&self) -> Duration {
        self.state.cfg.waiter.timeout
    }

    /// Whether the application aborted the communicator.
    pub fn aborted(&self) -> bool {
        self.abort.load(Ordering::Relaxed)
    }
}

/// The worker thread waits between jobs as the communicator's waiting policy says.
struct WorkerWait<'a>(crate::os::wait::WaitState<'a>);

impl Pause for WorkerWait<'_> {
    fn progressed(&mut self) {
        self.0.progressed();
    }
    fn pause(&mut self) -> bool {
        // Past the deadline too: block (the worker has no deadline of its own).
        matches!(self.0.pause(), Ok(true) | Err(_))
    }
}

impl State {
    /// What a call that panicked leaves: the communicator broken with the panic's text as
    /// its error, its connections closed.
    pub(super) fn panicked(&mut self, text: &str) {
        let msg = format!(
            "a call on rank {} panicked: {text} (a bug in roccl or in a job given to enqueue)",
            self.links.rank
        );
        if self.broken.set(AsyncError::new(ErrorKind::Internal, msg)) {
            if let Some(node) = &self.node {
                node.mark_broken();
            }
        }
        self.links.close_all();
    }
}
