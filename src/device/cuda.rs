//! The CUDA driver behind [`Device`] (feature `cuda`): libcuda.so.1 is loaded at run time
//! with dlopen, so the feature builds without a CUDA toolkit. It lets the stream-ordered code
//! run on NVIDIA GPUs (scripts/gpu-check.sh).
//!
//! An FFI edge: every `unsafe` block calls the driver or resolves its symbols, and says why
//! it is sound. Driver calls need a current context: the application's thread has one (the
//! CUDA runtime makes the primary context current); roccl's worker threads never call the
//! driver (they poll host flags).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use super::{Alloc, Device, Flag, FlagSlab, FlagStore, MemKind, PtrInfo, StreamId};

/// Page-locked host memory from `cuMemHostAlloc`, or device memory from `cuMemAlloc`.
struct HostPinned {
    api: &'static Api,
    ptr: *mut c_void,
    len: usize,
    device: bool,
}

// SAFETY: plain memory; roccl orders every access through the stream protocol.
unsafe impl Send for HostPinned {}
// SAFETY: as above.
unsafe impl Sync for HostPinned {}

impl Alloc for HostPinned {
    fn addr(&self) -> usize {
        self.ptr as usize
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostPinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc or cuMemAlloc (per `device`), freed once, here.
        unsafe {
            if self.device {
                (self.api.mem_free)(self.ptr as u64);
            } else {
                (self.api.mem_free_host)(self.ptr);
            }
        };
    }
}
use crate::error::{Error, Result};

type CuResult = c_int;
const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_NO_DEVICE: CuResult = 100;
const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (1: host, 2: device, 3: array, 4: unified).
const ATTR_MEMORY_TYPE: c_int = 2;
/// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
const ATTR_IS_MANAGED: c_int = 8;
/// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS` (`_V1` before CUDA 12, same number).
const ATTR_64_BIT_STREAM_MEM_OPS: c_int = 93;
/// `CU_STREAM_WAIT_VALUE_GEQ`.
const WAIT_GEQ: c_uint = 0;
/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`.
const HOSTALLOC_FLAGS: c_uint = 0x01 | 0x02;

/// The driver entry points used here.
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, u64) -> CuResult,
    stream_write_value64: unsafe extern "C" fn(*mut c_void, u64, u64, c_uint) -> CuResult,
    stream_wait_value64: unsafe extern "C" fn(*mut c_void, u64, u64, c_uint) -> CuResult,
    stream_is_capturing: unsafe extern "C" fn(*mut c_void, *mut c_int) -> CuResult,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    mem_host_get_device_pointer: unsafe extern "C" fn(*mut u64, *mut c_void, c_uint) -> CuResult,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
    memcpy_async: unsafe extern "C" fn(u64, u64, usize, *mut c_void) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(*mut c_void) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(*mut c_void) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(u64) -> CuResult,
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult,
    launch_host_func: unsafe extern "C" fn(
        *mut c_void,
        unsafe extern "C" fn(*mut c_void),
        *mut c_void,
    ) -> CuResult,
    /// `cuThreadExchangeStreamCaptureMode` (CUDA 10.1 and later).
    exchange_capture_mode: Option<unsafe extern "C" fn(*mut c_int) -> CuResult>,
    /// `cuDriverGetVersion`.
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    /// `cuMemGetHandleForAddressRange` (CUDA 11.7 and later).
    get_handle_for_address_range:
        Option<unsafe extern "C" fn(*mut c_void, u64, usize, c_int, u64) -> CuResult>,
}

/// A resolved symbol as the function type `F`.
///
/// # Safety
/// `p` must be the address of a function of type `F`.
unsafe fn as_fn<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size (checked), and the caller guarantees `p` is such a function.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

fn load() -> Result<&'static Api> {
    static API: std::sync::OnceLock<std::result::Result<Api, String>> = std::sync::OnceLock::new();
    API.get_or_init(|| {
        // SAFETY: dlopen with a constant NUL-terminated name; the handle is kept for the life
        // of the process.
        let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err("libcuda.so.1 could not be loaded: no NVIDIA driver on this machine (install it, or check LD_LIBRARY_PATH inside containers)".to_string());
        }
        let sym = |name: &CStr| -> std::result::Result<*mut c_void, String> {
            // SAFETY: `h` is a live handle and `name` NUL-terminated.
            let p = unsafe { libc::dlsym(h, name.as_ptr()) };
            if p.is_null() {
                Err(format!("libcuda.so.1 has no {} (driver too old?)", name.to_string_lossy()))
            } else {
                Ok(p)
            }
        };
        // SAFETY: each symbol is the driver function with the signature declared in `Api`
        // (the versioned names are the ones cuda.h maps the plain names to).
        unsafe {
            Ok(Api {
                init: as_fn(sym(c"cuInit")?),
                device_get_count: as_fn(sym(c"cuDeviceGetCount")?),
                pointer_get_attribute: as_fn(sym(c"cuPointerGetAttribute")?),
                stream_write_value64: as_fn(sym(c"cuStreamWriteValue64_v2")?),
                stream_wait_value64: as_fn(sym(c"cuStreamWaitValue64_v2")?),
                stream_is_capturing: as_fn(sym(c"cuStreamIsCapturing")?),
                mem_host_alloc: as_fn(sym(c"cuMemHostAlloc")?),
                mem_host_get_device_pointer: as_fn(sym(c"cuMemHostGetDevicePointer_v2")?),
                mem_free_host: as_fn(sym(c"cuMemFreeHost")?),
                memcpy_async: as_fn(sym(c"cuMemcpyAsync")?),
                device_get: as_fn(sym(c"cuDeviceGet")?),
                primary_ctx_retain: as_fn(sym(c"cuDevicePrimaryCtxRetain")?),
                ctx_set_current: as_fn(sym(c"cuCtxSetCurrent")?),
                stream_create: as_fn(sym(c"cuStreamCreate")?),
                stream_synchronize: as_fn(sym(c"cuStreamSynchronize")?),
                mem_alloc: as_fn(sym(c"cuMemAlloc_v2")?),
                mem_free: as_fn(sym(c"cuMemFree_v2")?),
                device_get_attribute: as_fn(sym(c"cuDeviceGetAttribute")?),
                launch_host_func: as_fn(sym(c"cuLaunchHostFunc")?),
                driver_get_version: as_fn(sym(c"cuDriverGetVersion")?),
                exchange_capture_mode: sym(c"cuThreadExchangeStreamCaptureMode")
                    .ok()
                    .map(|p| as_fn(p)),
                get_handle_for_address_range: sym(c"cuMemGetHandleForAddressRange")
                    .ok()
                    .map(|p| as_fn(p)),
                get_error_string: as_fn(sym(c"cuGetErrorString")?),
            })
        }
    })
    .as_ref()
    .map_err(|e| Error::InvalidUsage(format!("no CUDA device: {e}")))
}

fn check(api: &Api, call: &str, r: CuResult) -> Result<()> {
    if r == CUDA_SUCCESS {
        return Ok(());
    }
    let mut s: *const c_char = std::ptr::null();
    // SAFETY: valid storage for the string pointer; the driver returns a static string.
    unsafe { (api.get_error_string)(r, &mut s) };
    let name = if s.is_null() {
        "unknown".into()
    } else {
        // SAFETY: non-NULL static string from the driver.
        unsafe { CStr::from_ptr(s) }.to_string_lossy()
    };
    Err(Error::sys(
        format!("{call} failed"),
        std::io::Error::other(format!("CUDA error {r} ({name})")),
    ))
}

/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: c_int = 2;

/// The calling thread in relaxed capture mode while it lives (as NCCL does around its
/// allocations): a call made while the application captures a stream in global mode (the
/// default of PyTorch's graphs) may then allocate pinned memory, which the other modes
/// forbid.
struct Relaxed {
    api: &'static Api,
    prev: Option<c_int>,
}

impl Relaxed {
    fn new(api: &'static Api) -> Relaxed {
        let prev = api.exchange_capture_mode.and_then(|f| {
            let mut mode = CAPTURE_MODE_RELAXED;
            // SAFETY: valid storage for one mode; the driver swaps it with the thread's.
            (unsafe { f(&mut mode) } == CUDA_SUCCESS).then_some(mode)
        });
        Relaxed { api, prev }
    }
}

impl Drop for Relaxed {
    fn drop(&mut self) {
        if let (Some(f), Some(mut mode)) = (self.api.exchange_capture_mode, self.prev) {
            // SAFETY: as in `new`: the thread's previous mode goes back.
            unsafe { f(&mut mode) };
        }
    }
}

/// The CUDA driver, on device 0's primary context.
pub struct CudaDevice {
    api: &'static Api,
    ctx: usize,
    /// 64-bit stream memory operations work (else: host functions).
    can_wait: bool,
    /// The driver's version (`cuDriverGetVersion`: 1000 * major + 10 * minor).
    version: c_int,
    copy_stream: std::sync::OnceLock<StreamId>,
}

impl CudaDevice {
    /// Load the driver; "no CUDA device" when it or a GPU is missing.
    pub fn open() -> Result<CudaDevice> {
        let api = load()?;
        // SAFETY: cuInit(0) may be called any number of times.
        let r = unsafe { (api.init)(0) };
        let mut n = 0;
        if r == CUDA_SUCCESS {
            // SAFETY: valid storage for one int.
            check(api, "cuDeviceGetCount", unsafe {
                (api.device_get_count)(&mut n)
            })?;
        }
        if r == CUDA_ERROR_NO_DEVICE || n == 0 {
            return Err(Error::InvalidUsage(
                "no CUDA device: the driver is loaded but found no GPU (CUDA_VISIBLE_DEVICES? in a container, --gpus)".into(),
            ));
        }
        check(api, "cuInit", r)?;
        let (mut dev, mut ctx) = (0, std::ptr::null_mut());
        // SAFETY: valid storage for the device and the context.
        unsafe {
            check(api, "cuDeviceGet", (api.device_get)(&mut dev, 0))?;
            check(
                api,
                "cuDevicePrimaryCtxRetain",
                (api.primary_ctx_retain)(&mut ctx, dev),
            )?;
        }
        let mut can_wait = 0;
        // SAFETY: valid storage for one int; `dev` came from the driver.
        check(api, "cuDeviceGetAttribute", unsafe {
            (api.device_get_attribute)(&mut can_wait, ATTR_64_BIT_STREAM_MEM_OPS, dev)
        })?;
        let mut version = 0;
        // SAFETY: valid storage for one int.
        check(api, "cuDriverGetVersion", unsafe {
            (api.driver_get_version)(&mut version)
        })?;
        let d = CudaDevice {
            api,
            ctx: ctx as usize,
            can_wait: can_wait != 0,
            version,
            copy_stream: std::sync::OnceLock::new(),
        };
        d.bind_thread()?;
        Ok(d)
    }
}

/// Flags in mapped, page-locked host memory (`cuMemHostAlloc` with `DEVICEMAP`).
struct MappedFlags {
    api: &'static Api,
    host: *mut AtomicU64,
    device: u64,
    n: usize,
}

// SAFETY: the memory is shared by design (CPU and GPU); every CPU access is atomic.
unsafe impl Send for MappedFlags {}
// SAFETY: as above.
unsafe impl Sync for MappedFlags {}

impl FlagStore for MappedFlags {
    fn len(&self) -> usize {
        self.n
    }
    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.n, "flag {i} out of range");
        // SAFETY: in bounds (checked); page-aligned, zeroed at creation, freed only on drop.
        unsafe { &*self.host.add(i) }
    }
    fn device_addr(&self, i: usize) -> usize {
        assert!(i < self.n, "flag {i} out of range");
        (self.device + 8 * i as u64) as usize
    }
}

impl Drop for MappedFlags {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `flags` and freed once, here.
        unsafe { (self.api.mem_free_host)(self.host.cast()) };
    }
}

impl Device for CudaDevice {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn classify(&self, addr: usize) -> Result<PtrInfo> {
        let (mut t, mut managed): (c_uint, c_int) = (0, 0);
        // SAFETY: valid storage for the attribute (an unsigned int); the driver reads `addr`.
        let r = unsafe {
            (self.api.pointer_get_attribute)(
                (&mut t as *mut c_uint).cast(),
                ATTR_MEMORY_TYPE,
                addr as u64,
            )
        };
        if r == CUDA_ERROR_INVALID_VALUE {
            return Ok(PtrInfo {
                kind: MemKind::Host,
                host_accessible: true,
            });
        }
        check(self.api, "cuPointerGetAttribute", r)?;
        // SAFETY: as above, for an int attribute.
        let r = unsafe {
            (self.api.pointer_get_attribute)(
                (&mut managed as *mut c_int).cast(),
                ATTR_IS_MANAGED,
                addr as u64,
            )
        };
        check(self.api, "cuPointerGetAttribute", r)?;
        let kind = match (t, managed != 0) {
            (_, true) => MemKind::Managed,
            (1, _) => MemKind::PinnedHost,
            _ => MemKind::Device,
        };
        Ok(PtrInfo {
            kind,
            host_accessible: kind != MemKind::Device,
        })
    }

    fn stream_write(&self, stream: StreamId, flag: &Flag, value: u64) -> Result<()> {
        // SAFETY: the flag is mapped host memory alive while stream work holds `flag`.
        check(self.api, "cuStreamWriteValue64", unsafe {
            (self.api.stream_write_value64)(
                stream as *mut c_void,
                flag.device_addr() as u64,
                value,
                0,
            )
        })
    }

    fn stream_wait(&self, stream: StreamId, flag: &Flag, value: u64) -> Result<()> {
        // SAFETY: as above.
        check(self.api, "cuStreamWaitValue64", unsafe {
            (self.api.stream_wait_value64)(
                stream as *mut c_void,
                flag.device_addr() as u64,
                value,
                WAIT_GEQ,
            )
        })
    }

    fn stream_waits(&self) -> bool {
        self.can_wait
    }

    fn host_fn(&self, stream: StreamId, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        let data = super::host_fn_data(f);
        // SAFETY: the trampoline takes `data` (made just above) and runs it once; `stream`
        // is the application's.
        let r = unsafe {
            (self.api.launch_host_func)(stream as *mut c_void, super::host_fn_trampoline, data)
        };
        if r != CUDA_SUCCESS {
            // SAFETY: the launch failed, so the driver will not call the trampoline.
            unsafe { super::host_fn_drop(data) };
        }
        check(self.api, "cuLaunchHostFunc", r)
    }

    fn host_fn_repeat(&self, stream: StreamId, f: Arc<dyn Fn() + Send + Sync>) -> Result<()> {
        let data = super::host_fn_repeat_data(f);
        // SAFETY: the trampoline borrows `data` (made just above, never freed once launched)
        // at every replay of the graph; `stream` is the application's, being captured.
        let r = unsafe {
            (self.api.launch_host_func)(
                stream as *mut c_void,
                super::host_fn_repeat_trampoline,
                data,
            )
        };
        if r != CUDA_SUCCESS {
            // SAFETY: the launch failed, so the driver will not call the trampoline.
            unsafe { super::host_fn_repeat_drop(data) };
        }
        check(self.api, "cuLaunchHostFunc (captured)", r)
    }

    fn capture_waits(&self) -> bool {
        // Stream memory operations are recorded into graphs (batch memory-op nodes) by
        // CUDA 12 drivers; older ones block in the host node instead.
        self.can_wait && self.version >= 12000
    }

    fn dmabuf_export(&self, addr: usize, len: usize) -> Result<(std::os::fd::OwnedFd, u64)> {
        use std::os::fd::FromRawFd;
        let Some(f) = self.api.get_handle_for_address_range else {
            return Err(Error::InvalidUsage(
                "this CUDA driver cannot export dmabufs (needs CUDA 11.7 or later)".into(),
            ));
        };
        let (base, size, off) = super::page_range(addr, len);
        let mut fd: c_int = -1;
        // SAFETY: valid storage for the fd; handle type 1 = CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD.
        check(self.api, "cuMemGetHandleForAddressRange", unsafe {
            f((&mut fd as *mut c_int).cast(), base as u64, size, 1, 0)
        })?;
        // SAFETY: a new descriptor the driver handed over to us.
        Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, off))
    }

    fn is_capturing(&self, stream: StreamId) -> Result<bool> {
        let mut status: c_int = 0;
        // SAFETY: valid storage for one int.
        check(self.api, "cuStreamIsCapturing", unsafe {
            (self.api.stream_is_capturing)(stream as *mut c_void, &mut status)
        })?;
        Ok(status != 0)
    }

    unsafe fn copy_async(
        &self,
        stream: StreamId,
        dst: usize,
        src: usize,
        bytes: usize,
    ) -> Result<()> {
        // SAFETY: the caller keeps both ranges valid until the stream has passed the copy
        // (unified addressing: the driver infers the direction).
        check(self.api, "cuMemcpyAsync", unsafe {
            (self.api.memcpy_async)(dst as u64, src as u64, bytes, stream as *mut c_void)
        })
    }

    fn alloc_staging(&self, bytes: usize) -> Result<Arc<dyn Alloc>> {
        let _relaxed = Relaxed::new(self.api);
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid storage for the returned pointer.
        check(self.api, "cuMemHostAlloc", unsafe {
            (self.api.mem_host_alloc)(&mut ptr, bytes, HOSTALLOC_FLAGS)
        })?;
        Ok(Arc::new(HostPinned {
            api: self.api,
            ptr,
            len: bytes,
            device: false,
        }))
    }

    fn alloc_device(&self, bytes: usize) -> Result<Arc<dyn Alloc>> {
        let _relaxed = Relaxed::new(self.api);
        let mut p = 0u64;
        // SAFETY: valid storage for the device pointer.
        check(self.api, "cuMemAlloc", unsafe {
            (self.api.mem_alloc)(&mut p, bytes)
        })?;
        Ok(Arc::new(HostPinned {
            api: self.api,
            ptr: p as *mut c_void,
            len: bytes,
            device: true,
        }))
    }

    fn create_stream(&self) -> Result<StreamId> {
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid storage for the stream handle.
        check(self.api, "cuStreamCreate", unsafe {
            (self.api.stream_create)(&mut s, 0)
        })?;
        Ok(s as StreamId)
    }

    fn allocation_id(&self, addr: usize) -> Option<u64> {
        let mut id: u64 = 0;
        // SAFETY: valid storage for the attribute (an unsigned long long); 7 is
        // CU_POINTER_ATTRIBUTE_BUFFER_ID; the driver only looks `addr` up.
        let r = unsafe {
            (self.api.pointer_get_attribute)((&mut id as *mut u64).cast(), 7, addr as u64)
        };
        (r == CUDA_SUCCESS && id != 0).then_some(id)
    }

    fn copy_stream(&self) -> Result<StreamId> {
        if let Some(s) = self.copy_stream.get() {
            return Ok(*s);
        }
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid storage for the stream handle; 1 is CU_STREAM_NON_BLOCKING.
        check(self.api, "cuStreamCreate", unsafe {
            (self.api.stream_create)(&mut s, 1)
        })?;
        // Two threads may race here: one stream wins, the other stays unused.
        Ok(*self.copy_stream.get_or_init(|| s as StreamId))
    }

    fn synchronize(&self, stream: StreamId) -> Result<()> {
        // SAFETY: `stream` is a stream of this context.
        check(self.api, "cuStreamSynchronize", unsafe {
            (self.api.stream_synchronize)(stream as *mut c_void)
        })
    }

    fn bind_thread(&self) -> Result<()> {
        // SAFETY: the primary context retained in `open`.
        check(self.api, "cuCtxSetCurrent", unsafe {
            (self.api.ctx_set_current)(self.ctx as *mut c_void)
        })
    }

    fn flags(&self, n: usize) -> Result<FlagSlab> {
        let _relaxed = Relaxed::new(self.api);
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid storage for the pointer.
        check(self.api, "cuMemHostAlloc", unsafe {
            (self.api.mem_host_alloc)(&mut host, n * 8, HOSTALLOC_FLAGS)
        })?;
        let base = host.cast::<AtomicU64>();
        for i in 0..n {
            // SAFETY: `n` words were just allocated; zero them before anyone reads them.
            unsafe { base.add(i).write(AtomicU64::new(0)) };
        }
        // Owned from here: freed on any error below.
        let mut store = MappedFlags {
            api: self.api,
            host: base,
            device: 0,
            n,
        };
        // SAFETY: valid storage; `host` is mapped page-locked memory from cuMemHostAlloc.
        check(self.api, "cuMemHostGetDevicePointer", unsafe {
            (self.api.mem_host_get_device_pointer)(&mut store.device, host, 0)
        })?;
        Ok(FlagSlab::from_store(Arc::new(store)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without an NVIDIA driver, opening says so clearly; with one and a GPU, it opens.
    #[test]
    fn open_reports_no_device_or_opens() {
        let driver = std::path::Path::new("/proc/driver/nvidia").exists();
        match CudaDevice::open() {
            Ok(_) => assert!(driver, "opened CUDA without the NVIDIA driver"),
            Err(e) => {
                let m = e.to_string();
                eprintln!("CUDA: {m}");
                if !driver {
                    assert!(m.contains("no CUDA device"), "{m}");
                }
            }
        }
    }
}
