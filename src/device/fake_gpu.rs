//! A simulated GPU for machines without one: host memory posing as device memory, and
//! streams as worker threads that run what is enqueued on them in order, but late (each item
//! after a random delay of up to `max_delay`) and out of step with the caller. A collective
//! that does not wait for the work before it on its stream, or that lets later work run
//! before it finished, then reads or leaves wrong data, and the tests see it.
//!
//! Streams can be captured into graphs as CUDA's stream capture does: between
//! [`FakeGpu::begin_capture`] and [`FakeGpu::end_capture`] the work enqueued on the
//! stream is recorded instead of run, and [`FakeGpu::graph_launch`] replays it, as often as
//! wanted. What CUDA refuses during capture is refused here too and invalidates the capture
//! (synchronizing or querying the stream, one-shot host functions).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::{Alloc, Device, Flag, FlagSlab, MemKind, PtrInfo, StreamId};

/// An allocation of the simulated device.
struct SimAlloc(Arc<FakeGpuBuffer>);

impl Alloc for SimAlloc {
    fn addr(&self) -> usize {
        self.0.addr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}
use crate::error::{Error, Result};

type Item = Box<dyn FnOnce() + Send>;

struct Queue {
    items: VecDeque<Item>,
    /// Items taken but not finished.
    running: usize,
    closed: bool,
}

/// Work recorded into a graph: runs at every replay.
type Node = Arc<dyn Fn() + Send + Sync>;

/// A capture in progress.
#[derive(Default)]
struct Capture {
    nodes: Vec<Node>,
    /// Why the capture is invalid (an operation that cannot be captured was tried).
    invalid: Option<String>,
}

/// One simulated stream.
struct SimStream {
    q: Mutex<Queue>,
    cv: Condvar,
    capture: Mutex<Option<Capture>>,
}

/// Work captured from a stream ([`FakeGpu::end_capture`]), replayed by
/// [`FakeGpu::graph_launch`].
pub struct SimGraph {
    nodes: Vec<Node>,
}

impl SimGraph {
    /// Its number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether it records nothing.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// Where the bytes of a simulated buffer are.
enum Backing {
    /// Host memory at the buffer's own address (pinned host memory; APU device memory).
    Heap(Vec<u64>),
    /// Device-only memory: the bytes are in a memfd (exported as the buffer's "dmabuf"),
    /// mapped at `alias` for the simulated device's own copies, while the buffer's address
    /// is a PROT_NONE reservation: any CPU access through it faults, as on a discrete GPU.
    Guarded {
        fd: std::os::fd::OwnedFd,
        alias: usize,
        map_len: usize,
    },
}

/// Device memory of the simulated GPU.
pub struct FakeGpuBuffer {
    data: Mutex<Backing>,
    len: usize,
    addr: usize,
    /// Unique for the process's lifetime (`Device::allocation_id`).
    id: u64,
}

impl Drop for FakeGpuBuffer {
    fn drop(&mut self) {
        if let Backing::Guarded { alias, map_len, .. } = *self.data.get_mut() {
            // SAFETY: the two mappings made by `Backing::guarded`, used by nothing else.
            unsafe {
                libc::munmap(alias as *mut libc::c_void, map_len);
                libc::munmap(self.addr as *mut libc::c_void, map_len);
            }
        }
    }
}

impl Backing {
    /// Device-only memory of `bytes` (zeroed): (backing, the address programs use).
    fn guarded(bytes: usize) -> Result<(Backing, usize)> {
        use std::os::fd::FromRawFd;
        let map_len = bytes.max(1).next_multiple_of(4096);
        // SAFETY: system calls on a descriptor and mappings this function owns; each failure
        // releases what was made before it.
        unsafe {
            let fd = libc::memfd_create(c"roccl-sim-device".as_ptr(), libc::MFD_CLOEXEC);
            if fd < 0 {
                return Err(Error::last_os("memfd_create for simulated device memory"));
            }
            let fd = std::os::fd::OwnedFd::from_raw_fd(fd);
            use std::os::fd::AsRawFd;
            if libc::ftruncate(fd.as_raw_fd(), map_len as libc::off_t) != 0 {
                return Err(Error::last_os("ftruncate for simulated device memory"));
            }
            let alias = libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            );
            if alias == libc::MAP_FAILED {
                return Err(Error::last_os("mmap of simulated device memory"));
            }
            let addr = libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            );
            if addr == libc::MAP_FAILED {
                libc::munmap(alias, map_len);
                return Err(Error::last_os(
                    "reserving addresses for simulated device memory",
                ));
            }
            Ok((
                Backing::Guarded {
                    fd,
                    alias: alias as usize,
                    map_len,
                },
                addr as usize,
            ))
        }
    }
}

impl FakeGpuBuffer {
    /// Its address (what a C program would pass as the buffer).
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Read or write its bytes (what a kernel or a device copy would do).
    pub fn with<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let mut d = self.data.lock();
        match &mut *d {
            Backing::Heap(v) => f(&mut bytemuck::cast_slice_mut(&mut v[..])[..self.len]),
            Backing::Guarded { alias, .. } => {
                // SAFETY: our own mapping of at least `len` bytes, accessed only under the
                // lock held here.
                f(unsafe { std::slice::from_raw_parts_mut(*alias as *mut u8, self.len) })
            }
        }
    }

    /// The memfd holding a device-only buffer (its "dmabuf"), if it is one.
    fn dmabuf(&self) -> Option<std::os::fd::OwnedFd> {
        match &*self.data.lock() {
            Backing::Guarded { fd, .. } => fd.try_clone().ok(),
            Backing::Heap(_) => None,
        }
    }
}

/// A buffer of the simulated device: (address, bytes, kind, the CPU may access it, the
/// buffer while it lives).
type Registered = (usize, usize, MemKind, bool, Weak<FakeGpuBuffer>);

/// The simulated device.
pub struct FakeGpu {
    streams: Mutex<HashMap<StreamId, Arc<SimStream>>>,
    buffers: Mutex<Vec<Registered>>,
    next: AtomicU64,
    max_delay: Duration,
    seed: AtomicU64,
    /// `alloc_device` gives memory the CPU may access (an APU).
    integrated: AtomicBool,
    /// Streams cannot wait on flags: stream-ordered calls use host functions.
    host_fn_only: AtomicBool,
    /// [`Device::allocation_id`] answers (as CUDA and HIP do); off, it answers `None`.
    allocation_ids: AtomicBool,
    /// roccl's own copy stream ([`Device::copy_stream`]).
    copy_stream: std::sync::OnceLock<StreamId>,
}

impl FakeGpu {
    /// A simulated device whose streams delay each item by up to `max_delay`.
    pub fn new(max_delay: Duration) -> Arc<FakeGpu> {
        Arc::new(FakeGpu {
            streams: Mutex::new(HashMap::new()),
            buffers: Mutex::new(Vec::new()),
            next: AtomicU64::new(0x5100_0000),
            max_delay,
            seed: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
            integrated: AtomicBool::new(false),
            host_fn_only: AtomicBool::new(false),
            allocation_ids: AtomicBool::new(true),
            copy_stream: std::sync::OnceLock::new(),
        })
    }

    /// Pose as an integrated GPU (an APU): [`Device::alloc_device`] gives memory the CPU may
    /// access, which collectives use in place.
    pub fn set_integrated(&self, on: bool) {
        self.integrated.store(on, Ordering::Relaxed);
    }

    /// Pose as a device without stream memory operations: stream-ordered calls take the
    /// host-function fallback.
    pub fn set_host_fn_only(&self, on: bool) {
        self.host_fn_only.store(on, Ordering::Relaxed);
    }

    /// Pose as a runtime that cannot tell allocations apart ([`Device::allocation_id`] is
    /// `None`): kept GPU-direct registrations are then told apart by their dmabuf's inode.
    pub fn set_allocation_ids(&self, on: bool) {
        self.allocation_ids.store(on, Ordering::Relaxed);
    }

    /// A new stream (its handle is an opaque non-zero number, like a `cudaStream_t`).
    pub fn create_stream(&self) -> StreamId {
        let id = self.next.fetch_add(0x100, Ordering::Relaxed) as StreamId;
        self.adopt_stream(id);
        id
    }

    /// Make `id` a stream of this device if it is not one yet (a C program's handle: with
    /// `ROCCL_DEVICE=sim`, any non-NULL stream a program passes becomes a simulated stream).
    pub fn adopt_stream(&self, id: StreamId) {
        let mut streams = self.streams.lock();
        if streams.contains_key(&id) {
            return;
        }
        let s = Arc::new(SimStream {
            q: Mutex::new(Queue {
                items: VecDeque::new(),
                running: 0,
                closed: false,
            }),
            cv: Condvar::new(),
            capture: Mutex::new(None),
        });
        let worker = Arc::clone(&s);
        let max = self.max_delay;
        let mut rng = self
            .seed
            .fetch_add(0x2545_f491_4f6c_dd1d, Ordering::Relaxed)
            | 1;
        std::thread::Builder::new()
            .name(format!("sim-stream-{id:x}"))
            .spawn(move || loop {
                let item = {
                    let mut q = worker.q.lock();
                    loop {
                        if let Some(i) = q.items.pop_front() {
                            q.running += 1;
                            break Some(i);
                        }
                        if q.closed {
                            break None;
                        }
                        worker.cv.wait(&mut q);
                    }
                };
                let Some(item) = item else { return };
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                if !max.is_zero() {
                    std::thread::sleep(max.mul_f64((rng % 1000) as f64 / 1000.0));
                }
                item();
                worker.q.lock().running -= 1;
                worker.cv.notify_all();
            })
            .expect("spawning a simulated stream");
        streams.insert(id, s);
    }

    fn stream(&self, id: StreamId) -> Result<Arc<SimStream>> {
        self.streams.lock().get(&id).cloned().ok_or_else(|| {
            Error::arg(format!(
                "stream {id:#x} is not a stream of the simulated device"
            ))
        })
    }

    /// Enqueue `f` on `stream` (a kernel, or a copy); while the stream is captured, record
    /// it into the graph instead (it then runs at every replay).
    pub fn launch(&self, stream: StreamId, f: impl Fn() + Send + Sync + 'static) -> Result<()> {
        let s = self.stream(stream)?;
        if let Some(c) = &mut *s.capture.lock() {
            c.nodes.push(Arc::new(f));
            return Ok(());
        }
        s.q.lock().items.push_back(Box::new(f));
        s.cv.notify_all();
        Ok(())
    }

    /// Enqueue `f` on `stream` to run once: refused while the stream is captured (a graph
    /// runs its work at every replay).
    fn launch_once(&self, stream: StreamId, f: Item, what: &str) -> Result<()> {
        let s = self.stream(stream)?;
        self.refuse_in_capture(&s, stream, what)?;
        s.q.lock().items.push_back(f);
        s.cv.notify_all();
        Ok(())
    }

    /// Refuse an operation that cannot be captured, and invalidate the capture (as CUDA's
    /// `cudaErrorStreamCaptureUnsupported` does).
    fn refuse_in_capture(&self, s: &SimStream, stream: StreamId, what: &str) -> Result<()> {
        if let Some(c) = &mut *s.capture.lock() {
            let msg = format!(
                "{what} on stream {stream:#x} while it is being captured into a graph: not capturable (the capture is invalidated)"
            );
            c.invalid.get_or_insert_with(|| msg.clone());
            return Err(Error::InvalidUsage(msg));
        }
        Ok(())
    }

    /// Block until everything enqueued on `stream` so far has run; refused while the stream
    /// is captured.
    pub fn synchronize(&self, stream: StreamId) -> Result<()> {
        let s = self.stream(stream)?;
        self.refuse_in_capture(&s, stream, "synchronizing")?;
        let mut q = s.q.lock();
        while !q.items.is_empty() || q.running > 0 {
            s.cv.wait(&mut q);
        }
        Ok(())
    }

    /// Whether everything enqueued on `stream` has run (`cudaStreamQuery`, an event query);
    /// refused while the stream is captured.
    pub fn query(&self, stream: StreamId) -> Result<bool> {
        let s = self.stream(stream)?;
        self.refuse_in_capture(&s, stream, "querying")?;
        let q = s.q.lock();
        Ok(q.items.is_empty() && q.running == 0)
    }

    /// Start capturing `stream` into a graph (`cudaStreamBeginCapture`): from now on, work
    /// enqueued on it is recorded, not run.
    pub fn begin_capture(&self, stream: StreamId) -> Result<()> {
        let s = self.stream(stream)?;
        let mut c = s.capture.lock();
        if c.is_some() {
            return Err(Error::InvalidUsage(format!(
                "stream {stream:#x} is already being captured"
            )));
        }
        *c = Some(Capture::default());
        Ok(())
    }

    /// End the capture of `stream` (`cudaStreamEndCapture`): the graph of the work recorded,
    /// or the error that invalidated the capture.
    pub fn end_capture(&self, stream: StreamId) -> Result<SimGraph> {
        let s = self.stream(stream)?;
        let c = s.capture.lock().take().ok_or_else(|| {
            Error::InvalidUsage(format!("stream {stream:#x} is not being captured"))
        })?;
        match c.invalid {
            Some(why) => Err(Error::InvalidUsage(format!(
                "the capture of stream {stream:#x} was invalidated: {why}"
            ))),
            None => Ok(SimGraph { nodes: c.nodes }),
        }
    }

    /// Replay `graph` on `stream` (`cudaGraphLaunch`): its work runs in order after the work
    /// enqueued before on the stream, and before the work enqueued after.
    pub fn graph_launch(&self, graph: &SimGraph, stream: StreamId) -> Result<()> {
        for n in &graph.nodes {
            let n = Arc::clone(n);
            self.launch(stream, move || n())?;
        }
        Ok(())
    }

    /// Device memory of `bytes` bytes, zeroed, that the CPU may access (as on an APU).
    pub fn alloc(&self, bytes: usize) -> Arc<FakeGpuBuffer> {
        self.alloc_as(bytes, MemKind::Device, true)
    }

    /// Device memory the CPU may not access (as on a discrete GPU): collectives on it go
    /// through staging copies on the stream. Its address faults on any CPU access (the
    /// bytes live in a memfd the simulated device maps for itself), so a path that touched
    /// it would crash the test instead of passing.
    pub fn alloc_device_only(&self, bytes: usize) -> Arc<FakeGpuBuffer> {
        self.alloc_as(bytes, MemKind::Device, false)
    }

    fn alloc_as(&self, bytes: usize, kind: MemKind, host: bool) -> Arc<FakeGpuBuffer> {
        let heap = || {
            let data = vec![0u64; bytes.div_ceil(8).max(1)];
            let addr = data.as_ptr() as usize;
            (Backing::Heap(data), addr)
        };
        let (data, addr) = if host {
            heap()
        } else {
            Backing::guarded(bytes).unwrap_or_else(|e| {
                crate::log::log(
                    crate::log::Level::Warn,
                    format_args!("simulated device-only memory as plain host memory: {e}"),
                );
                heap()
            })
        };
        static IDS: AtomicU64 = AtomicU64::new(1);
        let b = Arc::new(FakeGpuBuffer {
            data: Mutex::new(data),
            len: bytes,
            addr,
            id: IDS.fetch_add(1, Ordering::Relaxed),
        });
        let mut all = self.buffers.lock();
        all.retain(|e| e.4.strong_count() > 0);
        all.push((addr, bytes, kind, host, Arc::downgrade(&b)));
        b
    }

    /// Stream memory operations refused when posing as a device without them.
    fn check_waits(&self, what: &str) -> Result<()> {
        if self.host_fn_only.load(Ordering::Relaxed) {
            return Err(Error::InvalidUsage(format!(
                "simulated device without stream memory operations: {what} is not available"
            )));
        }
        Ok(())
    }

    /// The live buffer holding `addr..addr + n`, and the offset of `addr` in it.
    fn find(&self, addr: usize, n: usize) -> Result<(Arc<FakeGpuBuffer>, usize)> {
        self.buffers
            .lock()
            .iter()
            .filter(|e| addr >= e.0 && addr + n <= e.0 + e.1)
            .find_map(|e| e.4.upgrade().map(|b| (b, addr - e.0)))
            .ok_or_else(|| {
                Error::arg(format!(
                    "{addr:#x}+{n} is not inside a buffer of the simulated device"
                ))
            })
    }
}

impl Drop for FakeGpu {
    fn drop(&mut self) {
        for s in self.streams.lock().values() {
            s.q.lock().closed = true;
            s.cv.notify_all();
        }
    }
}

impl Device for FakeGpu {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn classify(&self, addr: usize) -> Result<PtrInfo> {
        let b = self.buffers.lock();
        Ok(b.iter()
            .find(|e| addr >= e.0 && addr < e.0 + e.1.max(1) && e.4.strong_count() > 0)
            .map_or(
                PtrInfo {
                    kind: MemKind::Host,
                    host_accessible: true,
                },
                |e| PtrInfo {
                    kind: e.2,
                    host_accessible: e.3,
                },
            ))
    }

    unsafe fn copy_async(
        &self,
        stream: StreamId,
        dst: usize,
        src: usize,
        bytes: usize,
    ) -> Result<()> {
        // One end may be ordinary host memory of the process (pageable memory, which real
        // runtimes copy too: a network's bounce buffers), never both.
        let (d, s) = (self.find(dst, bytes), self.find(src, bytes));
        let host = |a: usize, e: Error| -> Result<usize> {
            if crate::os::cpu_readable(a, bytes) {
                Ok(a)
            } else {
                Err(e)
            }
        };
        match (d, s) {
            (Ok((d, doff)), Ok((s, soff))) => self.launch(stream, move || {
                let tmp = s.with(|x| x[soff..soff + bytes].to_vec());
                d.with(|x| x[doff..doff + bytes].copy_from_slice(&tmp));
            }),
            (Ok((d, doff)), Err(e)) => {
                let src = host(src, e)?;
                self.launch(stream, move || {
                    // SAFETY: the caller keeps host memory `src..src + bytes` readable until
                    // the stream has run the copy (the contract of an async copy).
                    let from = unsafe { std::slice::from_raw_parts(src as *const u8, bytes) };
                    d.with(|x| x[doff..doff + bytes].copy_from_slice(from));
                })
            }
            (Err(e), Ok((s, soff))) => {
                let dst = host(dst, e)?;
                self.launch(stream, move || {
                    // SAFETY: as above, writable, and nothing else uses it meanwhile.
                    let to = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, bytes) };
                    s.with(|x| to.copy_from_slice(&x[soff..soff + bytes]));
                })
            }
            (Err(e), Err(_)) => Err(e),
        }
    }

    fn alloc_staging(&self, bytes: usize) -> Result<Arc<dyn Alloc>> {
        Ok(Arc::new(SimAlloc(self.alloc_as(
            bytes,
            MemKind::PinnedHost,
            true,
        ))))
    }

    fn alloc_device(&self, bytes: usize) -> Result<Arc<dyn Alloc>> {
        let host = self.integrated.load(Ordering::Relaxed);
        Ok(Arc::new(SimAlloc(self.alloc_as(
            bytes,
            MemKind::Device,
            host,
        ))))
    }

    fn stream_waits(&self) -> bool {
        !self.host_fn_only.load(Ordering::Relaxed)
    }

    fn dmabuf_export(&self, addr: usize, len: usize) -> Result<(std::os::fd::OwnedFd, u64)> {
        let (b, off) = self.find(addr, len)?;
        let fd = b.dmabuf().ok_or_else(|| {
            Error::InvalidUsage(format!(
                "{addr:#x} is not device-only memory of the simulated device: only that exports as a dmabuf"
            ))
        })?;
        Ok((fd, off as u64))
    }

    fn host_fn(&self, stream: StreamId, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        self.launch_once(stream, f, "a one-shot host function")
    }

    fn host_fn_repeat(&self, stream: StreamId, f: Arc<dyn Fn() + Send + Sync>) -> Result<()> {
        self.launch(stream, move || f())
    }

    fn capture_waits(&self) -> bool {
        self.stream_waits()
    }

    fn create_stream(&self) -> Result<StreamId> {
        Ok(FakeGpu::create_stream(self))
    }

    fn synchronize(&self, stream: StreamId) -> Result<()> {
        FakeGpu::synchronize(self, stream)
    }

    fn integrated(&self) -> bool {
        self.integrated.load(Ordering::Relaxed)
    }

    fn allocation_id(&self, addr: usize) -> Option<u64> {
        if !self.allocation_ids.load(Ordering::Relaxed) {
            return None;
        }
        self.find(addr, 1).ok().map(|(b, _)| b.id)
    }

    fn copy_stream(&self) -> Result<StreamId> {
        Ok(*self
            .copy_stream
            .get_or_init(|| FakeGpu::create_stream(self)))
    }

    fn stream_write(&self, stream: StreamId, flag: &Flag, value: u64) -> Result<()> {
        self.check_waits("stream_write")?;
        let f = flag.clone();
        self.launch(stream, move || f.word().store(value, Ordering::Release))
    }

    fn stream_wait(&self, stream: StreamId, flag: &Flag, value: u64) -> Result<()> {
        self.check_waits("stream_wait")?;
        let f = flag.clone();
        // A GPU polls the flag; here: spin and yield for a while, then sleep in steps.
        self.launch(stream, move || {
            let t0 = std::time::Instant::now();
            while f.word().load(Ordering::Acquire) < value {
                if t0.elapsed() < Duration::from_millis(1) {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(10));
                }
            }
        })
    }

    fn is_capturing(&self, stream: StreamId) -> Result<bool> {
        Ok(self.stream(stream)?.capture.lock().is_some())
    }

    fn flags(&self, n: usize) -> Result<FlagSlab> {
        Ok(FlagSlab::host(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Device-only memory faults on CPU access (the read probe says so without faulting),
    /// moves through the device's copies, and exports as a dmabuf whose mapping holds its
    /// bytes at the offset given; APU memory is ordinary host memory.
    #[test]
    fn device_only_memory_is_out_of_the_cpus_reach() {
        use std::os::fd::AsRawFd;
        let dev = FakeGpu::new(Duration::ZERO);
        let d: Arc<dyn Device> = dev.clone();
        let s = dev.create_stream();
        let b = dev.alloc_device_only(10_000);
        let apu = dev.alloc(64);
        assert!(!crate::os::cpu_readable(b.addr(), 64));
        assert!(crate::os::cpu_readable(apu.addr(), 64));
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        let alloc = SimAlloc(Arc::clone(&b));
        crate::comm::stream::ops::upload(&d, s, &alloc, &data).unwrap();
        assert_eq!(
            crate::comm::stream::ops::download(&d, s, &alloc, 10_000).unwrap(),
            data
        );
        let (fd, off) = d.dmabuf_export(b.addr() + 5000, 100).unwrap();
        assert_eq!(off, 5000);
        let mut got = [0u8; 100];
        // SAFETY: reading 100 bytes of the memfd into our buffer.
        let n = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                got.as_mut_ptr().cast(),
                100,
                off as libc::off_t,
            )
        };
        assert_eq!(n, 100);
        assert_eq!(&got[..], &data[5000..5100]);
        assert!(
            d.dmabuf_export(apu.addr(), 8).is_err(),
            "host memory is no dmabuf"
        );
    }
}
