//! What collectives need from a GPU runtime, behind one trait, and stream-ordered
//! collectives on top of it.
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
//! Backends: [`sim::SimDevice`] (host memory posing as device memory, streams as worker
//! threads that run their work late and out of step with the caller, so missing stream
//! ordering shows up as wrong results in CI). HIP and CUDA backends implement the same
//! trait (docs/GPU.md).

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "hip")]
pub mod hip;
pub mod sim;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::comm::{Communicator, Turn};
use crate::error::{Error, Result};

/// What kind of memory an address is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemKind {
    /// Ordinary (pageable) host memory.
    Host,
    /// Page-locked host memory known to the runtime.
    PinnedHost,
    /// Device memory.
    Device,
    /// Managed (unified) memory.
    Managed,
}

/// What the runtime says about an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtrInfo {
    /// Kind of memory.
    pub kind: MemKind,
    /// The CPU may read and write it directly (host memory, managed memory, or device
    /// memory of an integrated GPU that the runtime reports as host-accessible).
    pub host_accessible: bool,
}

/// A stream handle as the application passes it (`cudaStream_t` / `hipStream_t`).
pub type StreamId = usize;

/// Where a slab of flags lives: words the CPU reads and writes atomically, at addresses the
/// GPU runtime's stream memory operations take.
pub trait FlagStore: Send + Sync {
    /// Number of flags.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Flag `i` as the CPU sees it.
    fn word(&self, i: usize) -> &AtomicU64;
    /// Flag `i`'s address for the runtime's stream memory operations.
    fn device_addr(&self, i: usize) -> usize;
}

/// Flags in ordinary memory (the simulated device).
struct HostFlags(Box<[AtomicU64]>);

impl FlagStore for HostFlags {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn word(&self, i: usize) -> &AtomicU64 {
        &self.0[i]
    }
    fn device_addr(&self, i: usize) -> usize {
        &self.0[i] as *const AtomicU64 as usize
    }
}

/// Flags in pinned host memory that streams write and wait on.
pub struct FlagSlab {
    store: Arc<dyn FlagStore>,
}

impl FlagSlab {
    /// `n` zeroed flags in ordinary memory.
    pub fn host(n: usize) -> FlagSlab {
        FlagSlab::from_store(Arc::new(HostFlags(
            (0..n).map(|_| AtomicU64::new(0)).collect(),
        )))
    }

    /// Flags a backend allocated.
    pub fn from_store(store: Arc<dyn FlagStore>) -> FlagSlab {
        FlagSlab { store }
    }

    /// Flag `i`.
    pub fn flag(&self, i: usize) -> &AtomicU64 {
        self.store.word(i)
    }

    /// A shared handle to flag `i` (kept alive by the stream work that uses it).
    pub fn handle(&self, i: usize) -> Flag {
        assert!(i < self.store.len(), "flag {i} out of range");
        Flag {
            store: Arc::clone(&self.store),
            i,
        }
    }
}

/// One flag of a slab.
#[derive(Clone)]
pub struct Flag {
    store: Arc<dyn FlagStore>,
    i: usize,
}

impl Flag {
    /// The flag's word.
    pub fn word(&self) -> &AtomicU64 {
        self.store.word(self.i)
    }

    /// Its address for the runtime's stream memory operations.
    pub fn device_addr(&self) -> usize {
        self.store.device_addr(self.i)
    }
}

/// What collectives need from a GPU runtime.
pub trait Device: Send + Sync {
    /// Backend name (`sim`, `hip`, `cuda`).
    fn name(&self) -> &'static str;
    /// Classify an address.
    fn classify(&self, addr: usize) -> Result<PtrInfo>;
    /// Enqueue on `stream`: once the work before it is done, store `value` in `flag`.
    fn stream_write(&self, stream: StreamId, flag: &Flag, value: u64) -> Result<()>;
    /// Enqueue on `stream`: hold later work until `flag >= value`.
    fn stream_wait(&self, stream: StreamId, flag: &Flag, value: u64) -> Result<()>;
    /// Whether `stream` is being captured into a graph (`true`: collectives refuse it).
    fn is_capturing(&self, stream: StreamId) -> Result<bool>;
    /// Flags the streams can write and wait on.
    fn flags(&self, n: usize) -> Result<FlagSlab>;
    /// Enqueue on `stream` a copy of `bytes` bytes from `src` to `dst` (host or device
    /// memory, either way).
    fn copy_async(&self, stream: StreamId, dst: usize, src: usize, bytes: usize) -> Result<()>;
    /// Page-locked host memory of at least `bytes` bytes, to stage device memory the CPU
    /// cannot access.
    fn alloc_staging(&self, bytes: usize) -> Result<Arc<dyn Alloc>>;
    /// Device memory of `bytes` bytes (tools and tests that bring their own buffers).
    fn alloc_device(&self, bytes: usize) -> Result<Arc<dyn Alloc>>;
    /// A new stream.
    fn create_stream(&self) -> Result<StreamId>;
    /// Block until everything enqueued on `stream` so far has run.
    fn synchronize(&self, stream: StreamId) -> Result<()>;
    /// Make the runtime usable from the calling thread (CUDA: the device's primary context).
    fn bind_thread(&self) -> Result<()> {
        Ok(())
    }
}

/// Memory allocated through the runtime: a staging buffer in pinned host memory, or device
/// memory (freed when the last handle goes).
pub trait Alloc: Send + Sync {
    /// Its address.
    fn addr(&self) -> usize;
    /// Its size in bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

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

/// Open the GPU runtime `name` (`hip`, `cuda`), or say why not.
pub fn open_runtime(name: &str) -> Result<Arc<dyn Device>> {
    match name {
        #[cfg(feature = "hip")]
        "hip" => Ok(Arc::new(hip::HipDevice::open()?)),
        #[cfg(not(feature = "hip"))]
        "hip" => Err(Error::InvalidUsage(
            "roccl was built without HIP support: rebuild with --features hip (needs ROCm or libamdhip64-dev; docs/GPU.md)".into(),
        )),
        #[cfg(feature = "cuda")]
        "cuda" => Ok(Arc::new(cuda::CudaDevice::open()?)),
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err(Error::InvalidUsage(
            "roccl was built without CUDA support: rebuild with --features cuda (no toolkit needed; docs/GPU.md)".into(),
        )),
        other => Err(Error::arg(format!(
            "unknown GPU runtime '{other}': expected hip, cuda, sim or none"
        ))),
    }
}

/// Whether this build has a GPU runtime backend compiled in.
pub const fn runtimes_built() -> &'static [&'static str] {
    match (cfg!(feature = "hip"), cfg!(feature = "cuda")) {
        (true, true) => &["hip", "cuda"],
        (true, false) => &["hip"],
        (false, true) => &["cuda"],
        (false, false) => &[],
    }
}

/// Most streams one operation (a group) may span.
pub const MAX_STREAMS: usize = 8;
/// Operations that may be in flight on streams at once; more wait for a free slot.
const SLOTS: usize = 1024;
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

fn slots(dev: &dyn Device) -> Result<&'static Slots> {
    // One table per process and backend (a process uses one GPU runtime).
    static SLOTS_OF: std::sync::OnceLock<Mutex<Vec<(&'static str, &'static Slots)>>> =
        std::sync::OnceLock::new();
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
                return Err(Error::Timeout(format!(
                    "{SLOTS} stream-ordered operations are in flight and none completed within {timeout:.0?} (ROCCL_TIMEOUT): are the streams they wait on stuck?"
                )));
            }
            self.freed.wait_for(&mut f, Duration::from_millis(10));
        }
    }

    fn give(&self, i: usize, g: u64) {
        self.free.lock().push((i, g));
        self.freed.notify_one();
    }
}

/// The work of one communicator in a stream-ordered operation, run on its worker thread
/// with the communicator's turn.
pub type Part = Box<dyn FnOnce(&mut Turn) -> Result<()> + Send>;

/// Run `parts` (one per communicator) ordered with `streams`: after all work enqueued
/// before on every stream, and before all work enqueued after. Returns at once.
pub fn enqueue(
    dev: &Arc<dyn Device>,
    streams: &[StreamId],
    parts: Vec<(Arc<Communicator>, Part)>,
    timeout: Duration,
) -> Result<()> {
    enqueue_staged(dev, streams, parts, Staged::default(), timeout)
}

/// Staging of one stream-ordered operation: copies each stream does before and after it,
/// and the buffers they go through.
#[derive(Default)]
pub struct Staged {
    /// Copies before the operation (device → staging), on their streams.
    pub before: Vec<StreamCopy>,
    /// Copies after it (staging → device).
    pub after: Vec<StreamCopy>,
    /// The staging buffers, kept until the streams have passed the copies.
    pub bufs: Vec<Arc<dyn Alloc>>,
}

/// A staging buffer of at least `bytes` bytes from the device's pool.
pub fn staging(dev: &Arc<dyn Device>, bytes: usize) -> Result<Arc<dyn Alloc>> {
    let table = slots(dev.as_ref())?;
    table.staging.take(table, dev.as_ref(), bytes)
}

/// [`enqueue`] with staging: each stream first does its `before` copies, then the operation
/// runs, then the stream does its `after` copies.
pub fn enqueue_staged(
    dev: &Arc<dyn Device>,
    streams: &[StreamId],
    parts: Vec<(Arc<Communicator>, Part)>,
    staged: Staged,
    timeout: Duration,
) -> Result<()> {
    let mut distinct: Vec<StreamId> = Vec::new();
    for &s in streams {
        if !distinct.contains(&s) {
            distinct.push(s);
        }
    }
    if distinct.is_empty() || parts.is_empty() {
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
    for c in staged.before.iter().chain(&staged.after) {
        if !distinct.contains(&c.stream) {
            return Err(Error::Internal(
                "a staging copy on a stream the operation does not use".into(),
            ));
        }
    }
    for &s in &distinct {
        if dev.is_capturing(s)? {
            return Err(Error::InvalidUsage(format!(
                "stream {s:#x} is being captured into a graph: roccl's stream-ordered collectives cannot be replayed from a graph yet; run this collective outside capture (eager mode; in vLLM --enforce-eager)"
            )));
        }
    }
    let table = slots(dev.as_ref())?;
    let (slot, g) = table.take(timeout)?;
    let base = slot * PER_SLOT;
    let done = table.slab.handle(base + MAX_STREAMS);
    let mut released = Vec::new();
    for (i, &s) in distinct.iter().enumerate() {
        for c in staged.before.iter().filter(|c| c.stream == s) {
            dev.copy_async(s, c.dst, c.src, c.bytes)?;
        }
        let ready = table.slab.handle(base + i);
        dev.stream_write(s, &ready, g)?;
        dev.stream_wait(s, &done, g)?;
        for c in staged.after.iter().filter(|c| c.stream == s) {
            dev.copy_async(s, c.dst, c.src, c.bytes)?;
        }
        if !staged.bufs.is_empty() {
            let r = table.slab.handle(base + MAX_STREAMS + 1 + i);
            dev.stream_write(s, &r, g)?;
            released.push(r);
        }
    }
    let staged_bufs = !staged.bufs.is_empty();
    if staged_bufs {
        table
            .staging
            .busy
            .lock()
            .push((released, slot, g, staged.bufs));
    }
    let nready = distinct.len();
    let remaining = Arc::new(AtomicUsize::new(parts.len()));
    for (comm, part) in parts {
        let remaining = Arc::clone(&remaining);
        let done = done.clone();
        comm.enqueue(Box::new(move |turn: &mut Turn| {
            let ready = (0..nready).all(|i| wait_flag(table.slab.flag(base + i), g, turn));
            let r = if ready {
                part(turn)
            } else {
                Err(Error::InvalidUsage(
                    "communicator aborted while a stream-ordered operation waited for its stream"
                        .into(),
                ))
            };
            if let Err(e) = r {
                turn.fail(&e);
            }
            if remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                done.word().store(g, Ordering::Release);
                if !staged_bufs {
                    table.give(slot, g);
                }
            }
        }));
    }
    Ok(())
}

/// Wait until `flag >= g`: spin, then yield for up to 1 ms (a collective that follows a
/// short kernel should not pay a sleep), then sleep in 20 µs steps (a stream may run long GPU
/// work first). False if the communicator was aborted meanwhile.
fn wait_flag(flag: &AtomicU64, g: u64, turn: &Turn) -> bool {
    let mut spins = 0u32;
    let mut since: Option<Instant> = None;
    loop {
        if flag.load(Ordering::Acquire) >= g {
            return true;
        }
        if turn.aborted() {
            return false;
        }
        spins += 1;
        if spins < 256 {
            std::hint::spin_loop();
            continue;
        }
        let t = *since.get_or_insert_with(Instant::now);
        if t.elapsed() < Duration::from_millis(1) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}
