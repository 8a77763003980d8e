//! What collectives need from a GPU runtime, behind one trait: a provider like the networks.
//!
//! [`Device`] allocates and registers memory, runs copies on streams, and writes and waits
//! on flags in pinned host memory (stream memory operations, or host functions where a
//! runtime has none). It knows nothing of communicators or algorithms: the stream-ordered
//! collectives built on it live with the communicator (`comm::stream`).
//!
//! Backends: [`fake_gpu::FakeGpu`] (host memory posing as device memory, streams as worker
//! threads that run their work late and out of step with the caller, so missing stream
//! ordering shows up as wrong results in CI). HIP and CUDA backends implement the same
//! trait (docs/GPU.md).

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fake_gpu;
#[cfg(feature = "hip")]
pub mod hip;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
    /// Whether `stream` is being captured into a graph (stream capture: CUDA's
    /// `cuStreamIsCapturing`, `hipStreamIsCapturing`; the simulated device's capture mode).
    /// Stream-ordered calls then record work that is correct on every replay
    /// (`comm::stream`).
    fn is_capturing(&self, stream: StreamId) -> Result<bool>;
    /// Flags the streams can write and wait on.
    fn flags(&self, n: usize) -> Result<FlagSlab>;
    /// Enqueue on `stream` a copy of `bytes` bytes from `src` to `dst` (host or device
    /// memory, either way).
    ///
    /// # Safety
    /// `src..src+bytes` must be readable and `dst..dst+bytes` writable memory (host, or of
    /// this device) until the copy has run on `stream`, and nothing else may write `dst`
    /// meanwhile: the device writes through the address as given.
    unsafe fn copy_async(
        &self,
        stream: StreamId,
        dst: usize,
        src: usize,
        bytes: usize,
    ) -> Result<()>;
    /// Page-locked host memory of at least `bytes` bytes, to stage device memory the CPU
    /// cannot access.
    fn alloc_staging(&self, bytes: usize) -> Result<Arc<dyn Alloc>>;
    /// Device memory of `bytes` bytes (tools and tests that bring their own buffers).
    fn alloc_device(&self, bytes: usize) -> Result<Arc<dyn Alloc>>;
    /// A new stream.
    fn create_stream(&self) -> Result<StreamId>;
    /// Block until everything enqueued on `stream` so far has run.
    fn synchronize(&self, stream: StreamId) -> Result<()>;
    /// roccl's own stream for copies inside an operation, created on first use; it does
    /// not wait for the runtime's NULL stream (an application stream that waits for roccl
    /// must not hold it up).
    fn copy_stream(&self) -> Result<StreamId> {
        Err(Error::InvalidUsage(format!(
            "the {} runtime has no stream for roccl's own copies",
            self.name()
        )))
    }
    /// An identifier of the allocation that holds `addr`, unique for the process's lifetime
    /// (`CU_POINTER_ATTRIBUTE_BUFFER_ID`, `HIP_POINTER_ATTRIBUTE_BUFFER_ID`): memory freed and
    /// allocated again at the same address gets a new one. `None` when the runtime cannot say.
    fn allocation_id(&self, addr: usize) -> Option<u64> {
        let _ = addr;
        None
    }
    /// Whether the GPU is integrated (an APU sharing the host's memory).
    fn integrated(&self) -> bool {
        false
    }
    /// Make the runtime usable from the calling thread (CUDA: the device's primary context).
    fn bind_thread(&self) -> Result<()> {
        Ok(())
    }
    /// Export `addr..addr + len` of device memory as a dmabuf for NIC registration
    /// (`ibv_reg_dmabuf_mr`): the file descriptor and `addr`'s offset in it.
    fn dmabuf_export(&self, addr: usize, len: usize) -> Result<(std::os::fd::OwnedFd, u64)> {
        let _ = (addr, len);
        Err(Error::InvalidUsage(format!(
            "the {} runtime cannot export memory as a dmabuf",
            self.name()
        )))
    }
    /// Whether streams can write and wait on flags themselves (stream memory operations:
    /// `hipStreamWaitValue64`, `cuStreamWaitValue64`). Without, stream-ordered calls fall
    /// back to host functions ([`Device::host_fn`]).
    fn stream_waits(&self) -> bool {
        true
    }
    /// Enqueue on `stream` a function the runtime runs on a host thread once the work before
    /// it is done; later work on the stream waits until it returns (`hipLaunchHostFunc`,
    /// `cuLaunchHostFunc`).
    fn host_fn(&self, stream: StreamId, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        let _ = (stream, f);
        Err(Error::InvalidUsage(format!(
            "the {} runtime has no host functions",
            self.name()
        )))
    }
    /// Enqueue on `stream`, which is being captured, a host function that runs at every
    /// replay of the graph, once the work before it in the graph is done; later work waits
    /// until it returns (a host node: `cuLaunchHostFunc` / `hipLaunchHostFunc` under
    /// capture). `f` is kept as long as the graph may run (the simulated device: as long as
    /// its graph; CUDA and HIP: for the life of the process).
    fn host_fn_repeat(&self, stream: StreamId, f: Arc<dyn Fn() + Send + Sync>) -> Result<()> {
        let _ = (stream, f);
        Err(Error::InvalidUsage(format!(
            "the {} runtime has no host functions: stream-ordered collectives cannot be captured into a graph there",
            self.name()
        )))
    }
    /// Whether stream memory operations ([`Device::stream_write`], [`Device::stream_wait`])
    /// may be recorded into a captured graph. Then a captured collective's host node only
    /// hands the work over and the stream waits on a flag; otherwise the host node blocks
    /// until the collective is done.
    fn capture_waits(&self) -> bool {
        false
    }
}

/// The page-aligned range around `addr..addr + len` that runtimes export as a dmabuf, and
/// `addr`'s offset in it.
#[cfg(any(feature = "hip", feature = "cuda"))]
fn page_range(addr: usize, len: usize) -> (usize, usize, u64) {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096);
    let base = addr & !(page - 1);
    let end = (addr + len).div_ceil(page) * page;
    (base, end - base, (addr - base) as u64)
}

/// A host function as the `void *` a runtime hands back to [`host_fn_trampoline`].
#[cfg(any(feature = "hip", feature = "cuda"))]
fn host_fn_data(f: Box<dyn FnOnce() + Send>) -> *mut std::ffi::c_void {
    Box::into_raw(Box::new(f)).cast()
}

/// Free a host function's data whose launch failed.
///
/// # Safety
/// `data` came from [`host_fn_data`] and was not handed to a runtime that will call it.
#[cfg(any(feature = "hip", feature = "cuda"))]
unsafe fn host_fn_drop(data: *mut std::ffi::c_void) {
    // SAFETY: the caller's contract: made by `host_fn_data`, used nowhere else.
    drop(unsafe { Box::from_raw(data.cast::<Box<dyn FnOnce() + Send>>()) });
}

/// What the runtime calls for a host function (`hipHostFn_t`, `CUhostFn`): runs it once;
/// a panic stops here.
///
/// # Safety
/// `data` came from [`host_fn_data`]; the runtime calls this exactly once per launch.
#[cfg(any(feature = "hip", feature = "cuda"))]
unsafe extern "C" fn host_fn_trampoline(data: *mut std::ffi::c_void) {
    // SAFETY: the caller's contract.
    let f = unsafe { Box::from_raw(data.cast::<Box<dyn FnOnce() + Send>>()) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

/// A repeatable host function as the `void *` a runtime hands back to
/// [`host_fn_repeat_trampoline`] at every replay. Never freed: a graph may be replayed until
/// the process ends (tying it to the graph's life with user objects is left to do).
#[cfg(any(feature = "hip", feature = "cuda"))]
fn host_fn_repeat_data(f: Arc<dyn Fn() + Send + Sync>) -> *mut std::ffi::c_void {
    Box::into_raw(Box::new(f)).cast()
}

/// Free a repeatable host function's data whose launch failed.
///
/// # Safety
/// `data` came from [`host_fn_repeat_data`] and no runtime will call it.
#[cfg(any(feature = "hip", feature = "cuda"))]
unsafe fn host_fn_repeat_drop(data: *mut std::ffi::c_void) {
    // SAFETY: the caller's contract: made by `host_fn_repeat_data`, used nowhere else.
    drop(unsafe { Box::from_raw(data.cast::<Arc<dyn Fn() + Send + Sync>>()) });
}

/// What the runtime calls for a host node at every replay: runs the function without
/// consuming it; a panic stops here.
///
/// # Safety
/// `data` came from [`host_fn_repeat_data`] (it is never freed while the graph lives).
#[cfg(any(feature = "hip", feature = "cuda"))]
unsafe extern "C" fn host_fn_repeat_trampoline(data: *mut std::ffi::c_void) {
    // SAFETY: the caller's contract: a live `Arc<dyn Fn>` made by `host_fn_repeat_data`.
    let f = unsafe { &*data.cast::<Arc<dyn Fn() + Send + Sync>>() };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f()));
}

/// Enqueue on `stream`: store `value` in `flag` once the work before is done — with a
/// stream memory operation, or a host function where the device has none (it never blocks,
/// so host functions of several streams sharing one runtime thread cannot wait on each
/// other).
pub fn signal(dev: &dyn Device, stream: StreamId, flag: &Flag, value: u64) -> Result<()> {
    if dev.stream_waits() {
        return dev.stream_write(stream, flag, value);
    }
    let f = flag.clone();
    dev.host_fn(
        stream,
        Box::new(move || f.word().store(value, Ordering::Release)),
    )
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

/// Copy `bytes` bytes from `src` to `dst` (device or host memory) on the device, on
/// roccl's own non-blocking stream, and wait for it: a copy inside a GPU-direct operation
/// (the root's own block of a broadcast, a rank's own block of an all-gather).
///
/// # Safety
/// As [`Device::copy_async`]: `src..src+bytes` readable, `dst..dst+bytes` writable and
/// written by nothing else until this returns.
pub unsafe fn copy_now(dev: &Arc<dyn Device>, dst: usize, src: usize, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    dev.bind_thread()?;
    let s = dev.copy_stream()?;
    // SAFETY: the caller vouches for both ranges until this returns, and it waits for the
    // copy below.
    unsafe { dev.copy_async(s, dst, src, bytes)? };
    dev.synchronize(s)
}
