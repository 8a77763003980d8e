//! The HIP runtime behind [`Device`] (feature `hip`; links libamdhip64 through hip-sys).
//!
//! An FFI edge: every `unsafe` block calls the HIP runtime and says why it is sound.
//!
//! hip-sys 0.1.2's bindings come from HIP 5.4, where `hipMemoryType`, `hipError_t` and
//! `hipStreamCaptureStatus` are Rust enums. A newer runtime may return values those enums do
//! not have (ROCm 6 renumbered `hipMemoryType`: Host 1, Device 2, Managed 3, Array 10; new
//! error codes appear), and reading such a value into a Rust enum is undefined behaviour. So
//! the few functions used here are declared below with plain integers, and hip-sys supplies
//! the link to libamdhip64 and the constants. Memory types are decoded by the runtime version
//! (`hipRuntimeGetVersion`: major·10⁷ + minor·10⁵ + patch).
//!
//! Not yet run on a GPU (none here): `ROCCL_DEVICE=hip` on a machine without one gives
//! "no HIP device"; docs/GPU.md lists what the first session with a GPU must check (that the
//! CPU may read and write `hipMallocSignalMemory` flags, stream waits on gfx1151).

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use hip_sys::hiprt as hip;

use super::{Alloc, Device, Flag, FlagSlab, FlagStore, MemKind, PtrInfo, StreamId};

/// Pinned host memory from `hipHostMalloc`, or device memory from `hipMalloc`.
struct HostPinned {
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
        // SAFETY: allocated by hipHostMalloc or hipMalloc (per `device`) and freed once, here.
        unsafe {
            if self.device {
                hipFree(self.ptr);
            } else {
                hipHostFree(self.ptr);
            }
        };
    }
}
use crate::error::{Error, Result};

/// `hipPointerAttribute_t` with the memory type as a plain integer (the field is
/// `memoryType` in HIP 5 and `type` in HIP 6; same place, different numbering).
#[repr(C)]
struct PointerAttributes {
    memory_type: c_int,
    device: c_int,
    device_pointer: *mut c_void,
    host_pointer: *mut c_void,
    is_managed: c_int,
    allocation_flags: c_uint,
}

// Declared with integer results and arguments (see the module comment).
extern "C" {
    fn hipGetDeviceCount(count: *mut c_int) -> c_int;
    fn hipRuntimeGetVersion(version: *mut c_int) -> c_int;
    fn hipGetDevice(device: *mut c_int) -> c_int;
    fn hipDeviceGetAttribute(value: *mut c_int, attr: c_int, device: c_int) -> c_int;
    fn hipPointerGetAttributes(attr: *mut PointerAttributes, ptr: *const c_void) -> c_int;
    fn hipPointerGetAttribute(data: *mut c_void, attribute: c_int, ptr: *mut c_void) -> c_int;
    fn hipStreamWriteValue64(
        stream: *mut c_void,
        ptr: *mut c_void,
        value: u64,
        flags: c_uint,
    ) -> c_int;
    fn hipStreamWaitValue64(
        stream: *mut c_void,
        ptr: *mut c_void,
        value: u64,
        flags: c_uint,
        mask: u64,
    ) -> c_int;
    fn hipStreamIsCapturing(stream: *mut c_void, status: *mut c_int) -> c_int;
    fn hipExtMallocWithFlags(ptr: *mut *mut c_void, size: usize, flags: c_uint) -> c_int;
    fn hipFree(ptr: *mut c_void) -> c_int;
    fn hipMemcpyAsync(
        dst: *mut c_void,
        src: *const c_void,
        bytes: usize,
        kind: c_int,
        stream: *mut c_void,
    ) -> c_int;
    fn hipHostMalloc(ptr: *mut *mut c_void, size: usize, flags: c_uint) -> c_int;
    fn hipHostFree(ptr: *mut c_void) -> c_int;
    fn hipMalloc(ptr: *mut *mut c_void, size: usize) -> c_int;
    fn hipStreamCreate(stream: *mut *mut c_void) -> c_int;
    fn hipStreamCreateWithFlags(stream: *mut *mut c_void, flags: c_uint) -> c_int;
    fn hipStreamSynchronize(stream: *mut c_void) -> c_int;
    fn hipGetErrorString(err: c_int) -> *const std::ffi::c_char;
}

/// A symbol of the HIP runtime or the HSA runtime under it, looked up at run time (newer
/// than what the build linked against). Searched in the global scope and in the libraries
/// already loaded by name, since roccl itself may be loaded with `RTLD_LOCAL` (a plugin, or
/// Python's ctypes), which keeps its libraries out of the global scope.
fn runtime_sym(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dlsym on the global scope with a NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if !p.is_null() {
        return Some(p);
    }
    [
        c"libamdhip64.so",
        c"libamdhip64.so.6",
        c"libamdhip64.so.5",
        c"libhsa-runtime64.so.1",
    ]
    .iter()
    .find_map(|lib| {
        // SAFETY: RTLD_NOLOAD only returns a handle to a library that is already loaded
        // (adding a reference, kept for the process's life); names are NUL-terminated.
        let h = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if h.is_null() {
            return None;
        }
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(h, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    })
}

const HIP_SUCCESS: c_int = 0;
/// `hipMemcpyDefault`: direction from the pointers (unified addressing).
const MEMCPY_DEFAULT: c_int = 4;

/// `ROCCL_APU_DEVICE_MEMORY=in-place`: on an integrated GPU, device memory (`hipMalloc`) that
/// the CPU can read (a probe that cannot crash) is used in place like host memory instead of
/// being staged. Experimental and off: no source confirms that this memory is coherent for
/// the CPU at the points roccl reads and writes it on gfx1151; check with
/// `scripts/gpu-check.sh` (0 wrong results) before relying on it (docs/GPU.md).
fn apu_in_place() -> bool {
    crate::envvar::process().apu_in_place
}
const HIP_ERROR_NO_DEVICE: c_int = 100;
const HIP_ERROR_INVALID_VALUE: c_int = 1;
/// `hipDeviceAttributeCanUseStreamWaitValue` (same number in HIP 5 and 6).
const ATTR_CAN_USE_STREAM_WAIT_VALUE: c_int = 10013;
/// `hipDeviceAttributeIntegrated`.
const ATTR_INTEGRATED: c_int = hip::hipDeviceAttribute_t::hipDeviceAttributeIntegrated as c_int;

fn hip_error(call: &str, code: c_int, hint: &str) -> Error {
    // SAFETY: hipGetErrorString returns a static string for any code.
    let name = unsafe { CStr::from_ptr(hipGetErrorString(code)) }.to_string_lossy();
    Error::sys(
        format!("{call} failed{hint}"),
        std::io::Error::other(format!("HIP error {code} ({name})")),
    )
}

fn check(call: &str, code: c_int) -> Result<()> {
    if code == HIP_SUCCESS {
        Ok(())
    } else {
        Err(hip_error(call, code, ""))
    }
}

/// `hipLaunchHostFunc`'s type.
type Launch =
    unsafe extern "C" fn(*mut c_void, unsafe extern "C" fn(*mut c_void), *mut c_void) -> c_int;

/// `hipLaunchHostFunc`, looked up at run time: HIP 5.2 (Debian's libamdhip64) does not have
/// it.
fn launch_host_func() -> Result<Launch> {
    static LAUNCH: std::sync::OnceLock<Option<Launch>> = std::sync::OnceLock::new();
    let launch = LAUNCH.get_or_init(|| {
        // SAFETY: the symbol has this signature (hip_runtime_api.h).
        runtime_sym(c"hipLaunchHostFunc")
            .map(|p| unsafe { std::mem::transmute::<*mut c_void, Launch>(p) })
    });
    launch.ok_or_else(|| {
        Error::InvalidUsage(
            "this HIP runtime has no hipLaunchHostFunc: stream-ordered collectives need stream waits on this device, and graph capture needs a newer ROCm".into(),
        )
    })
}

/// `hipStreamCaptureModeRelaxed`.
const CAPTURE_MODE_RELAXED: c_int = 2;

/// `hipThreadExchangeStreamCaptureMode`'s type.
type ExchangeMode = unsafe extern "C" fn(*mut c_int) -> c_int;

/// The calling thread in relaxed capture mode while it lives (as NCCL and RCCL do around
/// their allocations): a call made while the application captures a stream in global mode
/// may then allocate pinned memory. A runtime without the call is left as it is.
struct Relaxed {
    prev: Option<(ExchangeMode, c_int)>,
}

impl Relaxed {
    fn new() -> Relaxed {
        static EXCHANGE: std::sync::OnceLock<Option<ExchangeMode>> = std::sync::OnceLock::new();
        let f = *EXCHANGE.get_or_init(|| {
            // SAFETY: the symbol has this signature (hip_runtime_api.h; the enum is an int).
            runtime_sym(c"hipThreadExchangeStreamCaptureMode")
                .map(|p| unsafe { std::mem::transmute::<*mut c_void, ExchangeMode>(p) })
        });
        let prev = f.and_then(|f| {
            let mut mode = CAPTURE_MODE_RELAXED;
            // SAFETY: valid storage for one mode; the runtime swaps it with the thread's.
            (unsafe { f(&mut mode) } == HIP_SUCCESS).then_some((f, mode))
        });
        Relaxed { prev }
    }
}

impl Drop for Relaxed {
    fn drop(&mut self) {
        if let Some((f, mut mode)) = self.prev {
            // SAFETY: as in `new`: the thread's previous mode goes back.
            unsafe { f(&mut mode) };
        }
    }
}

/// The HIP runtime.
pub struct HipDevice {
    version: c_int,
    device: c_int,
    integrated: bool,
    can_wait: bool,
    copy_stream: std::sync::OnceLock<StreamId>,
}

impl HipDevice {
    /// Open the runtime on the calling thread's current device; "no HIP device" when there is
    /// none.
    pub fn open() -> Result<HipDevice> {
        let mut n: c_int = 0;
        // SAFETY: `n` is valid storage for one int.
        let r = unsafe { hipGetDeviceCount(&mut n) };
        if r == HIP_ERROR_NO_DEVICE || (r == HIP_SUCCESS && n == 0) {
            return Err(Error::InvalidUsage(
                "no HIP device: hipGetDeviceCount found none (is this machine's GPU visible? check /dev/kfd and /dev/dri permissions, the render group, and HIP_VISIBLE_DEVICES; in a container pass --device /dev/kfd --device /dev/dri)".into(),
            ));
        }
        if r != HIP_SUCCESS {
            return Err(hip_error(
                "hipGetDeviceCount",
                r,
                " (is the amdgpu kernel driver loaded and /dev/kfd accessible?)",
            ));
        }
        let (mut version, mut device) = (0, 0);
        // SAFETY: valid storage for one int each.
        check("hipRuntimeGetVersion", unsafe {
            hipRuntimeGetVersion(&mut version)
        })?;
        // SAFETY: as above.
        check("hipGetDevice", unsafe { hipGetDevice(&mut device) })?;
        let attr = |a: c_int| -> Result<c_int> {
            let mut v = 0;
            // SAFETY: valid storage for one int; `device` came from the runtime.
            check("hipDeviceGetAttribute", unsafe {
                hipDeviceGetAttribute(&mut v, a, device)
            })?;
            Ok(v)
        };
        Ok(HipDevice {
            version,
            device,
            integrated: attr(ATTR_INTEGRATED)? != 0,
            can_wait: attr(ATTR_CAN_USE_STREAM_WAIT_VALUE)? != 0,
            copy_stream: std::sync::OnceLock::new(),
        })
    }

    /// Whether the device is an APU (integrated GPU).
    pub fn integrated(&self) -> bool {
        self.integrated
    }

    /// Decode a `hipMemoryType` by the runtime's major version.
    fn kind(&self, t: c_int, managed: bool) -> MemKind {
        if managed {
            return MemKind::Managed;
        }
        let (host, device, managed_t) = if self.version >= 60_000_000 {
            (1, 2, 3)
        } else {
            (0, 1, 4)
        };
        match t {
            x if x == host => MemKind::PinnedHost,
            x if x == device => MemKind::Device,
            x if x == managed_t => MemKind::Managed,
            // Arrays (2 in HIP 5, 10 in HIP 6) and anything newer: device memory.
            _ => MemKind::Device,
        }
    }
}

/// Flags in signal memory (`hipExtMallocWithFlags(…, hipMallocSignalMemory)`), which stream
/// waits require on AMD GPUs and which the CPU reads and writes.
struct SignalFlags {
    base: *mut AtomicU64,
    n: usize,
}

// SAFETY: the memory is shared by design (CPU and GPU); every access is atomic.
unsafe impl Send for SignalFlags {}
// SAFETY: as above.
unsafe impl Sync for SignalFlags {}

impl FlagStore for SignalFlags {
    fn len(&self) -> usize {
        self.n
    }
    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.n, "flag {i} out of range");
        // SAFETY: in bounds (checked); the allocation is 8-byte aligned, zeroed at creation and
        // lives as long as `self`.
        unsafe { &*self.base.add(i) }
    }
    fn device_addr(&self, i: usize) -> usize {
        self.word(i) as *const AtomicU64 as usize
    }
}

impl Drop for SignalFlags {
    fn drop(&mut self) {
        // SAFETY: allocated by hipExtMallocWithFlags in `flags` and freed once, here.
        unsafe { hipFree(self.base.cast()) };
    }
}

impl Device for HipDevice {
    fn name(&self) -> &'static str {
        "hip"
    }

    fn classify(&self, addr: usize) -> Result<PtrInfo> {
        let mut a = PointerAttributes {
            memory_type: -1,
            device: -1,
            device_pointer: std::ptr::null_mut(),
            host_pointer: std::ptr::null_mut(),
            is_managed: 0,
            allocation_flags: 0,
        };
        // SAFETY: `a` is valid storage with the runtime's layout; the runtime only reads `addr`.
        let r = unsafe { hipPointerGetAttributes(&mut a, addr as *const c_void) };
        if r == HIP_ERROR_INVALID_VALUE {
            // Memory the runtime does not know: ordinary host memory.
            return Ok(PtrInfo {
                kind: MemKind::Host,
                host_accessible: true,
            });
        }
        check("hipPointerGetAttributes", r)?;
        let kind = self.kind(a.memory_type, a.is_managed != 0);
        // No source confirms that the CPU may dereference hipMalloc memory on an APU: device
        // memory counts as host-accessible only when the runtime gives a host pointer for it.
        let host_accessible = match kind {
            MemKind::Host | MemKind::PinnedHost | MemKind::Managed => true,
            MemKind::Device => {
                a.host_pointer as usize == addr
                    || (self.integrated && apu_in_place() && crate::os::cpu_readable(addr, 64))
            }
        };
        Ok(PtrInfo {
            kind,
            host_accessible,
        })
    }

    fn stream_write(&self, stream: StreamId, flag: &Flag, value: u64) -> Result<()> {
        // SAFETY: the flag lives in signal memory for as long as stream work holds `flag`
        // (the slab is never freed while slots are in use); `stream` is the application's.
        check("hipStreamWriteValue64", unsafe {
            hipStreamWriteValue64(
                stream as *mut c_void,
                flag.device_addr() as *mut c_void,
                value,
                0,
            )
        })
    }

    fn stream_wait(&self, stream: StreamId, flag: &Flag, value: u64) -> Result<()> {
        if !self.can_wait {
            return Err(Error::InvalidUsage(format!(
                "HIP device {} cannot wait on a value in a stream (hipDeviceAttributeCanUseStreamWaitValue = 0): roccl uses host functions there",
                self.device
            )));
        }
        // SAFETY: as in `stream_write`.
        check("hipStreamWaitValue64", unsafe {
            hipStreamWaitValue64(
                stream as *mut c_void,
                flag.device_addr() as *mut c_void,
                value,
                hip::hipStreamWaitValueGte,
                u64::MAX,
            )
        })
    }

    fn stream_waits(&self) -> bool {
        self.can_wait
    }

    fn host_fn(&self, stream: StreamId, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        let launch = launch_host_func()?;
        let data = super::host_fn_data(f);
        // SAFETY: the trampoline takes `data` (made just above) and runs it once; `stream`
        // is the application's.
        let r = unsafe { launch(stream as *mut c_void, super::host_fn_trampoline, data) };
        if r != HIP_SUCCESS {
            // SAFETY: the launch failed, so the runtime will not call the trampoline.
            unsafe { super::host_fn_drop(data) };
        }
        check("hipLaunchHostFunc", r)
    }

    fn host_fn_repeat(&self, stream: StreamId, f: Arc<dyn Fn() + Send + Sync>) -> Result<()> {
        let launch = launch_host_func()?;
        let data = super::host_fn_repeat_data(f);
        // SAFETY: the trampoline borrows `data` (made just above, never freed once launched)
        // at every replay of the graph; `stream` is the application's, being captured.
        let r = unsafe {
            launch(
                stream as *mut c_void,
                super::host_fn_repeat_trampoline,
                data,
            )
        };
        if r != HIP_SUCCESS {
            // SAFETY: the launch failed, so the runtime will not call the trampoline.
            unsafe { super::host_fn_repeat_drop(data) };
        }
        check("hipLaunchHostFunc (captured)", r)
    }

    fn is_capturing(&self, stream: StreamId) -> Result<bool> {
        let mut status: c_int = 0;
        // SAFETY: valid storage for one int; `stream` is the application's.
        check("hipStreamIsCapturing", unsafe {
            hipStreamIsCapturing(stream as *mut c_void, &mut status)
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
        // SAFETY: the caller keeps both ranges valid until the stream has passed the copy.
        check("hipMemcpyAsync", unsafe {
            hipMemcpyAsync(
                dst as *mut c_void,
                src as *const c_void,
                bytes,
                MEMCPY_DEFAULT,
                stream as *mut c_void,
            )
        })
    }

    fn alloc_staging(&self, bytes: usize) -> Result<Arc<dyn Alloc>> {
        let _relaxed = Relaxed::new();
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid storage for the returned pointer.
        check("hipHostMalloc", unsafe {
            hipHostMalloc(&mut ptr, bytes, 0)
        })?;
        Ok(Arc::new(HostPinned {
            ptr,
            len: bytes,
            device: false,
        }))
    }

    fn alloc_device(&self, bytes: usize) -> Result<Arc<dyn Alloc>> {
        let _relaxed = Relaxed::new();
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid storage for the returned pointer.
        check("hipMalloc", unsafe { hipMalloc(&mut ptr, bytes) })?;
        Ok(Arc::new(HostPinned {
            ptr,
            len: bytes,
            device: true,
        }))
    }

    fn dmabuf_export(&self, addr: usize, len: usize) -> Result<(std::os::fd::OwnedFd, u64)> {
        use std::os::fd::FromRawFd;
        // ROCm's own path (as RCCL): hsa_amd_portable_export_dmabuf, else (ROCm >= 6)
        // hipMemGetHandleForAddressRange; both looked up at run time (older runtimes lack them).
        type Hsa = unsafe extern "C" fn(*const c_void, usize, *mut c_int, *mut u64) -> c_int;
        type Range = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, u64) -> c_int;
        let sym = runtime_sym;
        let (mut fd, mut off): (c_int, u64) = (-1, 0);
        if let Some(p) = sym(c"hsa_amd_portable_export_dmabuf") {
            // SAFETY: the symbol has this signature (hsa_ext_amd.h); valid out-pointers.
            let f: Hsa = unsafe { std::mem::transmute::<*mut c_void, Hsa>(p) };
            // SAFETY: as above; the runtime checks the range belongs to one allocation.
            let r = unsafe { f(addr as *const c_void, len, &mut fd, &mut off) };
            if r != 0 || fd < 0 {
                return Err(Error::sys(
                    "hsa_amd_portable_export_dmabuf",
                    std::io::Error::other(format!(
                        "HSA status {r:#x} (is the kernel's amdgpu dmabuf export enabled?)"
                    )),
                ));
            }
        } else if let Some(p) = sym(c"hipMemGetHandleForAddressRange") {
            // SAFETY: the symbol has this signature (hip_runtime_api.h, ROCm 6).
            let f: Range = unsafe { std::mem::transmute::<*mut c_void, Range>(p) };
            let (base, size, o) = super::page_range(addr, len);
            // SAFETY: valid storage for the fd; handle type 1 = hipMemRangeHandleTypeDmaBufFd.
            let r = unsafe {
                f(
                    (&mut fd as *mut c_int).cast(),
                    base as *mut c_void,
                    size,
                    1,
                    0,
                )
            };
            check("hipMemGetHandleForAddressRange", r)?;
            off = o;
        } else {
            return Err(Error::InvalidUsage(
                "this HIP runtime cannot export dmabufs (needs ROCm 6 or later)".into(),
            ));
        }
        // SAFETY: a new descriptor the runtime handed over to us.
        Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, off))
    }

    fn create_stream(&self) -> Result<StreamId> {
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid storage for the stream handle.
        check("hipStreamCreate", unsafe { hipStreamCreate(&mut s) })?;
        Ok(s as StreamId)
    }

    fn integrated(&self) -> bool {
        self.integrated
    }

    fn allocation_id(&self, addr: usize) -> Option<u64> {
        let mut id: u64 = 0;
        // SAFETY: valid storage for the attribute (an unsigned 64-bit integer); 7 is
        // HIP_POINTER_ATTRIBUTE_BUFFER_ID; the runtime only looks `addr` up.
        let r =
            unsafe { hipPointerGetAttribute((&mut id as *mut u64).cast(), 7, addr as *mut c_void) };
        (r == HIP_SUCCESS && id != 0).then_some(id)
    }

    fn copy_stream(&self) -> Result<StreamId> {
        if let Some(s) = self.copy_stream.get() {
            return Ok(*s);
        }
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid storage for the stream handle; 1 is hipStreamNonBlocking.
        check("hipStreamCreateWithFlags", unsafe {
            hipStreamCreateWithFlags(&mut s, 1)
        })?;
        // Two threads may race here: one stream wins, the other stays unused.
        Ok(*self.copy_stream.get_or_init(|| s as StreamId))
    }

    fn synchronize(&self, stream: StreamId) -> Result<()> {
        // SAFETY: `stream` is a stream handle of this runtime.
        check("hipStreamSynchronize", unsafe {
            hipStreamSynchronize(stream as *mut c_void)
        })
    }

    fn flags(&self, n: usize) -> Result<FlagSlab> {
        let _relaxed = Relaxed::new();
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is valid storage for the returned pointer.
        check("hipExtMallocWithFlags(hipMallocSignalMemory)", unsafe {
            hipExtMallocWithFlags(&mut p, n * 8, hip::hipMallocSignalMemory)
        })?;
        let base = p.cast::<AtomicU64>();
        for i in 0..n {
            // SAFETY: `n` words were just allocated; zero them before anyone reads them.
            unsafe { base.add(i).write(AtomicU64::new(0)) };
        }
        Ok(FlagSlab::from_store(Arc::new(SignalFlags { base, n })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU (no /dev/kfd), opening says so clearly; with one, it opens.
    #[test]
    fn open_reports_no_device_or_opens() {
        let gpu = std::path::Path::new("/dev/kfd").exists();
        match HipDevice::open() {
            Ok(d) => {
                assert!(gpu, "opened a HIP device without /dev/kfd");
                eprintln!(
                    "HIP device {} (runtime {}, integrated: {}, stream waits: {})",
                    d.device, d.version, d.integrated, d.can_wait
                );
            }
            Err(e) => {
                let m = e.to_string();
                eprintln!("HIP: {m}");
                if !gpu {
                    assert!(m.contains("no HIP device"), "{m}");
                }
            }
        }
    }

    #[test]
    fn memory_types_decode_by_runtime_version() {
        let v5 = HipDevice {
            version: 50_422_804,
            device: 0,
            integrated: false,
            can_wait: true,
            copy_stream: std::sync::OnceLock::new(),
        };
        let v6 = HipDevice {
            version: 60_443_484,
            device: 0,
            integrated: true,
            can_wait: true,
            copy_stream: std::sync::OnceLock::new(),
        };
        assert_eq!(v5.kind(0, false), MemKind::PinnedHost);
        assert_eq!(v5.kind(1, false), MemKind::Device);
        assert_eq!(v5.kind(4, false), MemKind::Managed);
        assert_eq!(v6.kind(1, false), MemKind::PinnedHost);
        assert_eq!(v6.kind(2, false), MemKind::Device);
        assert_eq!(v6.kind(3, false), MemKind::Managed);
        assert_eq!(v6.kind(10, false), MemKind::Device);
        assert_eq!(v6.kind(2, true), MemKind::Managed);
    }
}
