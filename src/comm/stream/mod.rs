//! Stream-ordered collectives: scheduling a communicator's calls with the work on GPU
//! streams, over the [`Device`] provider.
//!
//! A collective given a stream returns at once. [`enqueue`] makes it wait for the work
//! enqueued earlier on each of its streams and makes later work on them wait for it, with
//! stream memory operations on flags in pinned host memory: per operation, every stream gets
//! "write `ready[i] = g` when you get here" and then "wait until `done >= g`"; the
//! communicator's worker thread (the same one that orders all calls of a communicator)
//! polls the ready flags, runs the collective, and sets `done = g`. `g` is the slot's
//! generation, so flags never need resetting. A failed operation still sets `done` (the
//! stream must not hang) and leaves the communicator broken with the error, which
//! `Communicator::async_error` (`ncclCommGetAsyncError`) reports.
//!
//! Big calls run in steps staged through pinned buffers ([`enqueue_steps`], [`staging`]);
//! [`ops`] holds the operations on raw memory that the C ABI and roccl-perf share.
//!
//! A call on a stream that is being captured into a graph (CUDA stream capture, HIP graphs,
//! the simulated device's capture mode) records work that is right at every replay: the
//! copies in, a host node (the runtime runs it at each replay once the work before it is
//! done) that hands the collective to the communicators' workers, and the copies out after
//! the collective is done. Where the runtime can capture stream memory operations the host
//! node returns at once and the stream waits on a flag that the node's collective sets
//! (reset by a captured write at the start of every replay); elsewhere the host node blocks
//! until the collective is done, which holds the runtime's host-function thread meanwhile (as
//! NCCL's early designs did): ranks of one process whose host nodes share that thread could
//! wait on each other, so there one rank per process is the safe layout. The staging
//! buffers and the node live as long as the graph may run ([`Device::host_fn_repeat`]).

pub mod ops;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::comm::{Communicator, Turn};
use crate::device::{signal, Alloc, Device, Flag, FlagSlab, StreamId};
use crate::error::{Error, Result};

/// A copy a stream does before (input) or after (output) a stream-ordered operation.
#[derive(Clone, Copy, Debug)]
pub struct StreamCopy {
    /// The stream that copies.
    pub stream: StreamId,
    /// Destination address.
    pub dst: usize,
    /// Source address.
    pub src: usize,
    /// Bytes.
    pub bytes: usize,
}

/// Staging buffers of one process and device, reused across calls; a buffer is reused only
/// after the streams that copy through it have passed the copies (its release flags).
struct StagingPool {
    free: Mutex<Vec<Arc<dyn Alloc>>>,
    /// In use: (release flags, slot, generation, buffers). The slot is given back with the
    /// buffers: its release flags must not be reused while a stream may still write them.
    busy: Mutex<Vec<Busy>>,
}

/// Staging buffers in use: the release flags of their streams, the slot, its generation.
type Busy = (Vec<Flag>, usize, u64, Vec<Arc<dyn Alloc>>);

impl StagingPool {
    /// Move buffers whose streams have passed their copies back to the free list; returns
    /// the slots that are free again.
    fn sweep(&self) -> Vec<(usize, u64)> {
        let mut busy = self.busy.lock();
        let mut free = self.free.lock();
        let mut slots = Vec::new();
        busy.retain_mut(|(flags, slot, g, bufs)| {
            if flags.iter().all(|f| f.word().load(Ordering::Acquire) >= *g) {
                free.append(bufs);
                slots.push((*slot, *g));
                false
            } else {
                true
            }
        });
        slots
    }

    /// A buffer of at least `bytes` bytes (sizes rounded up to powers of two so that they are
    /// reused).
    fn take(&self, table: &Slots, dev: &dyn Device, bytes: usize) -> Result<Arc<dyn Alloc>> {
        for (slot, g) in self.sweep() {
            table.give(slot, g);
        }
        let want = bytes.max(64).next_power_of_two();
        let mut free = self.free.lock();
        if let Some(i) = free
            .iter()
            .position(|b| b.len() >= want && b.len() <= 4 * want)
        {
            return Ok(free.swap_remove(i));
        }
        drop(free);
        dev.alloc_staging(want)
    }
}

/// Most streams one operation (a group) may span.
pub const MAX_STREAMS: usize = 8;
/// Operations (steps) that may be in flight on streams at once; more wait for a free slot.
const SLOTS: usize = 1024;
/// Most steps of one operation (a big call staged in chunks).
pub const MAX_STEPS: usize = 16;
/// Flags per slot: one ready flag per stream, the done flag, one released flag per stream
/// (its copies after the operation are done).
const PER_SLOT: usize = 2 * MAX_STREAMS + 1;

/// The slots of one device: flags and generations.
struct Slots {
    slab: FlagSlab,
    free: Mutex<Vec<(usize, u64)>>,
    freed: Condvar,
    staging: StagingPool,
}

/// One table of slots per process and backend (a process uses one GPU runtime).
static SLOTS_OF: std::sync::OnceLock<Mutex<Vec<(&'static str, &'static Slots)>>> =
    std::sync::OnceLock::new();

fn slots(dev: &dyn Device) -> Result<&'static Slots> {
    let table = SLOTS_OF.get_or_init(|| Mutex::new(Vec::new()));
    let mut t = table.lock();
    if let Some((_, s)) = t.iter().find(|(n, _)| *n == dev.name()) {
        return Ok(s);
    }
    let s: &'static Slots = Box::leak(Box::new(Slots {
        slab: dev.flags(SLOTS * PER_SLOT)?,
        free: Mutex::new((0..SLOTS).rev().map(|i| (i, 0)).collect()),
        freed: Condvar::new(),
        staging: StagingPool {
            free: Mutex::new(Vec::new()),
            busy: Mutex::new(Vec::new()),
        },
    }));
    t.push((dev.name(), s));
    Ok(s)
}

impl Slots {
    fn take(&self, timeout: Duration) -> Result<(usize, u64)> {
        let mut f = self.free.lock();
        let t0 = Instant::now();
        loop {
            if let Some((i, g)) = f.pop() {
                return Ok((i, g + 1));
            }
            // Slots of staged operations come back once their streams passed the copies.
            let back = {
                drop(f);
                self.staging.sweep()
            };
            f = self.free.lock();
            f.extend(back);
            if let Some((i, g)) = f.pop() {
                return Ok((i, g + 1));
            }
            if t0.elapsed() >= timeout {
                return Err(Error::timeout(Vec::new(), format!(
                    "{SLOTS} stream-ordered operations are in flight and none completed within {timeout:.0?} (ROCCL_TIMEOUT): are the streams they wait on stuck?"
                )));
            }
            self.freed.wait_for(&mut f, Duration::from_millis(10));
        }
    }

    /// Give slot `i` of generation `g` back once its `nready` streams have written their
    /// ready flags. A step that failed before its streams got there (a timeout) must not
    /// lend the flags out: a stream's late write of `g` would lower the flag of the next
    /// user (generation `g + 1`), which would then wait for ever. Such a slot waits with the
    /// staging buffers until the streams pass.
    fn give_when_passed(&self, i: usize, g: u64, nready: usize) {
        let passed =
            (0..nready).all(|k| self.slab.flag(i * PER_SLOT + k).load(Ordering::Acquire) >= g);
        if passed {
            self.give(i, g);
        } else {
            let ready = (0..nready)
                .map(|k| self.slab.handle(i * PER_SLOT + k))
                .collect();
            self.staging.busy.lock().push((ready, i, g, Vec::new()));
        }
    }

    fn give(&self, i: usize, g: u64) {
        self.free.lock().push((i, g));
        self.freed.notify_one();
    }
}

/// The work of one communicator in a stream-ordered operation, run on its worker thread
/// with the communicator's turn.
/// It may run more than once: a call captured into a graph runs at every replay.
pub type Part = Arc<dyn Fn(&mut Turn) -> Result<()> + Send + Sync>;

/// Run `parts` (one per communicator) ordered with `streams`: after all work enqueued
/// before on every stream, and before all work enqueued after. Returns at once.
pub fn enqueue(
    dev: &Arc<dyn Device>,
    streams: &[StreamId],
    parts: Vec<(Arc<Communicator>, Part)>,
    timeout: Duration,
) -> Result<()> {
    let step = Step {
        parts,
        ..Step::default()
    };
    enqueue_steps(dev, streams, vec![step], Vec::new(), timeout)
}

/// One step of a stream-ordered operation: copies each stream does before it (device →
/// staging), the work of each communicator, copies after it (staging → device).
#[derive(Default)]
pub struct Step {
    /// Copies before the step, on their streams.
    pub before: Vec<StreamCopy>,
    /// The work, one part per communicator.
    pub parts: Vec<(Arc<Communicator>, Part)>,
    /// Copies after the step.
    pub after: Vec<StreamCopy>,
}

/// Free the staging buffers no stream-ordered call uses (of every device this process
/// used); returns their bytes. Buffers in use stay, and the pool grows again on demand.
pub fn release_idle_staging() -> usize {
    let Some(table) = SLOTS_OF.get() else {
        return 0;
    };
    let mut bytes = 0;
    for (_, s) in table.lock().iter() {
        for (slot, g) in s.staging.sweep() {
            s.give(slot, g);
        }
        let idle = std::mem::take(&mut *s.staging.free.lock());
        bytes += idle.iter().map(|b| b.len()).sum::<usize>();
    }
    bytes
}

/// A staging buffer of at least `bytes` bytes from the device's pool.
pub fn staging(dev: &Arc<dyn Device>, bytes: usize) -> Result<Arc<dyn Alloc>> {
    let table = slots(dev.as_ref())?;
    table.staging.take(table, dev.as_ref(), bytes)
}

/// Run `steps` ordered with `streams`, pipelined: each stream does the `before` copies of
/// every step, signalling after each step's copies that the step may start, and then, step
/// by step, waits until the step is done and does its `after` copies. So the copies in of
/// later steps overlap the network work of earlier ones, and the copies out of earlier
/// steps overlap later ones. The staging buffers `bufs` go back to the pool once every
/// stream has passed its last copy. Returns at once.
pub fn enqueue_steps(
    dev: &Arc<dyn Device>,
    streams: &[StreamId],
    steps: Vec<Step>,
    bufs: Vec<Arc<dyn Alloc>>,
    timeout: Duration,
) -> Result<()> {
    let distinct = checked_streams(streams, &steps)?;
    let capturing = distinct
        .iter()
        .map(|&s| dev.is_capturing(s))
        .collect::<Result<Vec<bool>>>()?;
    if capturing.iter().any(|&c| c) {
        if distinct.len() > 1 {
            return Err(Error::InvalidUsage(format!(
                "a group on {} streams while stream {:#x} is being captured into a graph: roccl captures calls of one stream only; give every call of the group the captured stream",
                distinct.len(),
                distinct[capturing.iter().position(|&c| c).unwrap_or(0)]
            )));
        }
        return capture(dev, distinct[0], steps, bufs);
    }
    if !dev.stream_waits() {
        return run_synchronously(dev, &distinct, steps, bufs);
    }
    let table = slots(dev.as_ref())?;
    let mut taken: Vec<(usize, u64)> = Vec::with_capacity(steps.len());
    for _ in 0..steps.len() {
        match table.take(timeout) {
            Ok(s) => taken.push(s),
            Err(e) => {
                for (slot, g) in taken {
                    table.give(slot, g);
                }
                return Err(e);
            }
        }
    }
    let done = |k: usize| table.slab.handle(taken[k].0 * PER_SLOT + MAX_STREAMS);
    let mut released = Vec::new();
    let emitted = emit_stream_work(
        dev,
        table,
        (&distinct, &steps),
        &taken,
        &bufs,
        &mut released,
    );
    if let Err(e) = emitted {
        // Streams may already wait on these steps: let them pass. The slots and buffers stay
        // taken (a stream may still write their flags or copy through them).
        for (k, &(_, g)) in taken.iter().enumerate() {
            done(k).word().store(g, Ordering::Release);
        }
        std::mem::forget(bufs);
        return Err(e);
    }
    let staged_bufs = !bufs.is_empty();
    if staged_bufs {
        // Back to the pool once every stream has passed its copies and the worker is done
        // with the last step.
        let (last_slot, last_g) = *taken.last().expect("at least one step");
        released.push(done(taken.len() - 1));
        table
            .staging
            .busy
            .lock()
            .push((released, last_slot, last_g, bufs));
    }
    hand_to_workers(table, steps, &taken, distinct.len(), staged_bufs);
    Ok(())
}

/// The distinct streams of a stream-ordered operation, checked against its steps: some
/// work, not too many streams or steps, and every copy on one of the streams.
fn checked_streams(streams: &[StreamId], steps: &[Step]) -> Result<Vec<StreamId>> {
    let mut distinct: Vec<StreamId> = Vec::new();
    for &s in streams {
        if !distinct.contains(&s) {
            distinct.push(s);
        }
    }
    if distinct.is_empty() || steps.is_empty() || steps.iter().any(|s| s.parts.is_empty()) {
        return Err(Error::Internal(
            "stream-ordered operation without streams or work".into(),
        ));
    }
    if distinct.len() > MAX_STREAMS {
        return Err(Error::arg(format!(
            "one group spans {} streams; at most {MAX_STREAMS} are supported",
            distinct.len()
        )));
    }
    if steps.len() > MAX_STEPS {
        return Err(Error::Internal(format!(
            "a stream-ordered operation of {} steps (at most {MAX_STEPS})",
            steps.len()
        )));
    }
    let mut copies = steps.iter().flat_map(|s| s.before.iter().chain(&s.after));
    if copies.any(|c| !distinct.contains(&c.stream)) {
        return Err(Error::Internal(
            "a staging copy on a stream the operation does not use".into(),
        ));
    }
    Ok(distinct)
}

/// Put on each stream its copies in of every step, each step's ready signal, then step by
/// step a wait until it is done and its copies out; with staging buffers, a last signal
/// that the stream has passed them (its flag added to `released`).
fn emit_stream_work(
    dev: &Arc<dyn Device>,
    table: &'static Slots,
    (distinct, steps): (&[StreamId], &[Step]),
    taken: &[(usize, u64)],
    bufs: &[Arc<dyn Alloc>],
    released: &mut Vec<Flag>,
) -> Result<()> {
    let (last_slot, last_g) = *taken.last().expect("at least one step");
    let done = |k: usize| table.slab.handle(taken[k].0 * PER_SLOT + MAX_STREAMS);
    let ready = |k: usize, i: usize| table.slab.handle(taken[k].0 * PER_SLOT + i);
    for (i, &s) in distinct.iter().enumerate() {
        for (k, step) in steps.iter().enumerate() {
            for c in step.before.iter().filter(|c| c.stream == s) {
                // SAFETY: a plan's copies move between the call's buffers (its caller vouched
                // for them when it enqueued the call) and staging buffers kept in `bufs` until
                // the copies have run.
                unsafe { dev.copy_async(s, c.dst, c.src, c.bytes)? };
            }
            signal(dev.as_ref(), s, &ready(k, i), taken[k].1)?;
        }
        for (k, step) in steps.iter().enumerate() {
            dev.stream_wait(s, &done(k), taken[k].1)?;
            for c in step.after.iter().filter(|c| c.stream == s) {
                // SAFETY: a plan's copies move between the call's buffers (its caller vouched
                // for them when it enqueued the call) and staging buffers kept in `bufs` until
                // the copies have run.
                unsafe { dev.copy_async(s, c.dst, c.src, c.bytes)? };
            }
        }
        if !bufs.is_empty() {
            let r = table
                .slab
                .handle(last_slot * PER_SLOT + MAX_STREAMS + 1 + i);
            signal(dev.as_ref(), s, &r, last_g)?;
            released.push(r);
        }
    }
    Ok(())
}

/// Give each step's parts to their communicators' workers: a part waits until every
/// stream signalled the step ready, and the last part of a step marks it done (and gives
/// its slot back, unless it holds the staging buffers' release flags).
fn hand_to_workers(
    table: &'static Slots,
    steps: Vec<Step>,
    taken: &[(usize, u64)],
    nready: usize,
    staged_bufs: bool,
) {
    let nsteps = steps.len();
    for (k, step) in steps.into_iter().enumerate() {
        let (slot, g) = taken[k];
        let base = slot * PER_SLOT;
        let remaining = Arc::new(AtomicUsize::new(step.parts.len()));
        // The last step's slot holds the release flags: it comes back with the buffers.
        let give_back = !(staged_bufs && k + 1 == nsteps);
        for (comm, part) in step.parts {
            let remaining = Arc::clone(&remaining);
            let done = table.slab.handle(base + MAX_STREAMS);
            comm.enqueue(Box::new(move |turn: &mut Turn| {
                let r = (0..nready)
                    .try_for_each(|i| wait_flag(table.slab.flag(base + i), g, turn))
                    .and_then(|()| part(turn));
                if let Err(e) = r {
                    turn.fail(&e);
                }
                if remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                    done.word().store(g, Ordering::Release);
                    if give_back {
                        table.give_when_passed(slot, g, nready);
                    }
                }
            }));
        }
    }
}

/// A stream-ordered call recorded into a graph: what its host node does at every replay.
struct Captured {
    /// The parts of each step, in order.
    steps: Vec<Vec<(Arc<Communicator>, Part)>>,
    /// The staging buffers the captured copies use: kept as long as the graph.
    _bufs: Vec<Arc<dyn Alloc>>,
    /// Set to 1 when the collective is done (the stream waits on it); `None`: the host node
    /// blocks instead.
    done: Option<Flag>,
}

/// Signals a replay's end when the last of its jobs is gone, run or dropped unrun (a
/// communicator that went away must not leave the stream waiting forever).
struct Finish {
    done: Option<Flag>,
    tx: std::sync::mpsc::Sender<()>,
}

impl Drop for Finish {
    fn drop(&mut self) {
        if let Some(d) = &self.done {
            d.word().store(1, Ordering::Release);
        }
        let _ = self.tx.send(());
    }
}

impl Captured {
    /// Hand the steps to the communicators' workers (each runs its calls in the order they
    /// were handed over, so all steps go at once); with no flag, wait until all are done.
    fn replay(&self) {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let finish = Arc::new(Finish {
            done: self.done.clone(),
            tx,
        });
        for (comm, part) in self.steps.iter().flatten() {
            let (part, finish) = (Arc::clone(part), Arc::clone(&finish));
            comm.enqueue(Box::new(move |turn: &mut Turn| {
                if let Err(e) = part(turn) {
                    turn.fail(&e);
                }
                drop(finish);
            }));
        }
        drop(finish);
        if self.done.is_none() {
            let _ = rx.recv();
        }
    }
}

/// [`enqueue_steps`] on a stream being captured: the copies in of every step, a host node
/// that runs the steps at every replay, the copies out (module docs). Refuses, with the
/// runtime's error, what the runtime cannot capture.
fn capture(
    dev: &Arc<dyn Device>,
    stream: StreamId,
    steps: Vec<Step>,
    bufs: Vec<Arc<dyn Alloc>>,
) -> Result<()> {
    let done = if dev.capture_waits() {
        Some(dev.flags(1)?.handle(0))
    } else {
        None
    };
    if let Some(d) = &done {
        // Every replay starts from 0: the previous one's wait has seen 1.
        dev.stream_write(stream, d, 0)?;
    }
    for c in steps.iter().flat_map(|s| &s.before) {
        // SAFETY: a plan's copies move between the call's buffers (its caller vouched
        // for them when it enqueued the call) and staging buffers kept in `bufs` until
        // the copies have run.
        unsafe { dev.copy_async(stream, c.dst, c.src, c.bytes)? };
    }
    let after: Vec<StreamCopy> = steps.iter().flat_map(|s| s.after.clone()).collect();
    let node = Captured {
        steps: steps.into_iter().map(|s| s.parts).collect(),
        _bufs: bufs,
        done: done.clone(),
    };
    dev.host_fn_repeat(stream, Arc::new(move || node.replay()))?;
    if let Some(d) = &done {
        dev.stream_wait(stream, d, 1)?;
    }
    for c in after {
        // SAFETY: a plan's copies move between the call's buffers (its caller vouched
        // for them when it enqueued the call) and staging buffers kept in `bufs` until
        // the copies have run.
        unsafe { dev.copy_async(stream, c.dst, c.src, c.bytes)? };
    }
    Ok(())
}

/// [`enqueue_steps`] on a device whose streams cannot wait on a flag: the calling thread
/// does the waiting instead of the stream. The copies in are enqueued and every stream is
/// synchronized (the work before the call is done), the steps run on the communicators'
/// workers while the caller waits, then the copies out are enqueued and a host function per
/// stream (which never blocks) releases the staging buffers after them. The call returns
/// once the collective is done, not at once; work enqueued afterwards is ordered after it
/// because it is enqueued after. Blocking host functions are not used: a runtime that runs
/// the host functions of several streams on one thread would let a waiting one hold up the
/// one it waits for.
fn run_synchronously(
    dev: &Arc<dyn Device>,
    streams: &[StreamId],
    steps: Vec<Step>,
    bufs: Vec<Arc<dyn Alloc>>,
) -> Result<()> {
    for &s in streams {
        for c in steps
            .iter()
            .flat_map(|step| &step.before)
            .filter(|c| c.stream == s)
        {
            // SAFETY: a plan's copies move between the call's buffers (its caller vouched
            // for them when it enqueued the call) and staging buffers kept in `bufs` until
            // the copies have run.
            unsafe { dev.copy_async(s, c.dst, c.src, c.bytes)? };
        }
    }
    for &s in streams {
        dev.synchronize(s)?;
    }
    let after: Vec<StreamCopy> = steps
        .iter()
        .flat_map(|step| step.after.iter().copied())
        .collect();
    let (tx, rx) = std::sync::mpsc::channel::<Result<()>>();
    let mut n = 0;
    for step in steps {
        for (comm, part) in step.parts {
            let tx = tx.clone();
            n += 1;
            comm.enqueue(Box::new(move |turn: &mut Turn| {
                let r = part(turn);
                if let Err(e) = &r {
                    turn.fail(e);
                }
                let _ = tx.send(r);
            }));
        }
    }
    drop(tx);
    let mut first: Option<Error> = None;
    for _ in 0..n {
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                first.get_or_insert(e);
            }
            Err(_) => {
                first.get_or_insert(Error::Internal(
                    "a communicator's worker exited during a stream-ordered call".into(),
                ));
                break;
            }
        }
    }
    for &s in streams {
        for c in after.iter().filter(|c| c.stream == s) {
            // SAFETY: a plan's copies move between the call's buffers (its caller vouched
            // for them when it enqueued the call) and staging buffers kept in `bufs` until
            // the copies have run.
            unsafe { dev.copy_async(s, c.dst, c.src, c.bytes)? };
        }
    }
    if !bufs.is_empty() {
        let table = slots(dev.as_ref())?;
        let (slot, g) = table.take(super::timeout())?;
        let base = slot * PER_SLOT;
        // The operation is done: only the streams' copies out hold the buffers now.
        let mut released = vec![table.slab.handle(base + MAX_STREAMS)];
        released[0].word().store(g, Ordering::Release);
        for (i, &s) in streams.iter().enumerate() {
            let r = table.slab.handle(base + MAX_STREAMS + 1 + i);
            signal(dev.as_ref(), s, &r, g)?;
            released.push(r);
        }
        table.staging.busy.lock().push((released, slot, g, bufs));
    }
    first.map_or(Ok(()), Err)
}

/// Wait until `flag >= g`: spin for the worker's spin time (none when ranks share cores),
/// then yield for up to 10 ms (a collective that follows GPU work should not pay a sleep),
/// then sleep in 20 µs steps (a stream may run long work first). An error if the
/// communicator was aborted meanwhile, or when the stream has not come to the call within
/// the communicator's timeout (`ROCCL_TIMEOUT`).
fn wait_flag(flag: &AtomicU64, g: u64, turn: &Turn) -> Result<()> {
    // The ready flag is on the critical path of every stream-ordered call: spin while the
    // waiting policy allows (a core per rank), then yield for up to YIELD_FOR (the stream
    // may still run long kernels before it), then sleep in short steps.
    const YIELD_FOR: Duration = Duration::from_millis(10);
    let spin = turn.spin();
    let t0 = Instant::now();
    let mut n = 0u32;
    let mut spinning = !spin.is_zero();
    loop {
        if flag.load(Ordering::Acquire) >= g {
            return Ok(());
        }
        if turn.aborted() {
            return Err(Error::InvalidUsage(
                "communicator aborted while a stream-ordered operation waited for its stream"
                    .into(),
            ));
        }
        if spinning {
            // The clock only every 64 polls.
            n = n.wrapping_add(1);
            if n % 64 != 0 || t0.elapsed() < spin {
                std::hint::spin_loop();
                continue;
            }
            spinning = false;
        }
        let waited = t0.elapsed();
        if waited < spin + YIELD_FOR {
            std::thread::yield_now();
        } else if waited > turn.timeout() {
            return Err(Error::timeout(Vec::new(), format!(
                "a stream-ordered call waited {waited:?} (ROCCL_TIMEOUT) for its stream to reach it: the work queued on the stream before it has not finished (a kernel that does not end, or a stream that waits on this call)"
            )));
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}
