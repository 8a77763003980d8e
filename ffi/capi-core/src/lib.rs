//! The C ABI of roccl (`include/roccl.h`): NCCL's API with the prefix `roccl`, over the
//! Rust core. This crate is an FFI edge: raw pointers from C become slices here, after
//! their checks, and nowhere else. Every exported function runs inside a panic guard, checks
//! its arguments, returns a `rocclResult_t` and records a sentence for `rocclGetLastError`.

#![allow(non_camel_case_types, clippy::missing_safety_doc)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use roccl_core::comm::stream::ops::{self, Op, RawBuf};
use roccl_core::device::fake_gpu::FakeGpu;
use roccl_core::device::{Device, StreamId};
use roccl_core::error::ErrorKind;
use roccl_core::{Collective, Communicator, Config, DataType, Error, UniqueId};

pub mod premul;
pub mod reshape;

/// `rocclResult_t`.
pub type rocclResult_t = c_int;
const SUCCESS: rocclResult_t = 0;
const UNHANDLED_DEVICE_ERROR: rocclResult_t = 1;
const SYSTEM_ERROR: rocclResult_t = 2;
const INTERNAL_ERROR: rocclResult_t = 3;
const INVALID_ARGUMENT: rocclResult_t = 4;
const INVALID_USAGE: rocclResult_t = 5;
const REMOTE_ERROR: rocclResult_t = 6;
const IN_PROGRESS: rocclResult_t = 7;

/// Version code: major * 10000 + minor * 100 + patch.
const VERSION_CODE: c_int = 100;
/// `ROCCL_CONFIG_MAGIC` ("ROCC"): not NCCL's, whose `ncclConfig_t` is laid out otherwise.
const CONFIG_MAGIC: u32 = 0x524f_4343;
const SPLIT_NOCOLOR: c_int = -1;

/// `rocclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rocclUniqueId {
    /// The id's bytes.
    pub internal: [c_char; 128],
}

/// `rocclConfig_t` (see the header for the fields).
#[repr(C)]
pub struct rocclConfig_t {
    /// `sizeof(rocclConfig_t)`.
    pub size: usize,
    /// `ROCCL_CONFIG_MAGIC`.
    pub magic: u32,
    /// The version code the caller was built against.
    pub version: u32,
    /// 1 (or unset): blocking init; 0: non-blocking.
    pub blocking: c_int,
    /// Network name, or NULL.
    pub net_name: *const c_char,
}

/// What `ROCCL_CONFIG_INITIALIZER` sets: every field unset.
pub const CONFIG_INITIALIZER: rocclConfig_t = rocclConfig_t {
    size: std::mem::size_of::<rocclConfig_t>(),
    magic: CONFIG_MAGIC,
    version: VERSION_CODE as u32,
    blocking: c_int::MIN,
    net_name: std::ptr::null(),
};

/// An error on its way to C: the code and the sentence for `rocclGetLastError`.
struct CErr(rocclResult_t, String);

type R<T = ()> = std::result::Result<T, CErr>;

fn arg(msg: impl Into<String>) -> CErr {
    CErr(INVALID_ARGUMENT, msg.into())
}

fn usage(msg: impl Into<String>) -> CErr {
    CErr(INVALID_USAGE, msg.into())
}

fn code_of(k: ErrorKind) -> rocclResult_t {
    match k {
        ErrorKind::InvalidArgument => INVALID_ARGUMENT,
        ErrorKind::InvalidUsage => INVALID_USAGE,
        ErrorKind::System => SYSTEM_ERROR,
        ErrorKind::Remote | ErrorKind::Timeout => REMOTE_ERROR,
        ErrorKind::Internal => INTERNAL_ERROR,
    }
}

impl From<Error> for CErr {
    fn from(e: Error) -> Self {
        CErr(code_of(e.kind()), e.to_string())
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// Record `msg` as this thread's last error (what `rocclGetLastError` returns).
pub fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // `try_with`: a call from a thread's TLS destructors must not panic.
    let _ = LAST_ERROR.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            *l = c;
        }
    });
}

/// Run `f` behind a panic guard and turn its result into a code.
fn guard(name: &str, f: impl FnOnce() -> R) -> rocclResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(CErr(code, msg))) => {
            set_last_error(&format!("{name}: {msg}"));
            code
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!(
                "{name}: internal error (a bug in roccl, please report it): {what}"
            ));
            INTERNAL_ERROR
        }
    }
}

// ---------------------------------------------------------------------------------------
// Communicator handles

enum State {
    Initializing,
    Ready(Arc<Communicator>),
    Failed(rocclResult_t, String),
}

struct Handle {
    state: Mutex<State>,
    cond: parking_lot::Condvar,
    /// Set by rocclCommAbort/rocclCommDestroy: ends a non-blocking init within ~100 ms.
    abort: Arc<std::sync::atomic::AtomicBool>,
    /// The thread of a non-blocking init, joined when the handle goes.
    init: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Suspended ([`suspend`]): calls are refused until [`resume`].
    suspended: std::sync::atomic::AtomicBool,
}

impl Handle {
    fn new(state: State) -> Handle {
        Handle {
            state: Mutex::new(state),
            cond: parking_lot::Condvar::new(),
            abort: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            init: Mutex::new(None),
            suspended: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// End a non-blocking init still running (its waits see the abort flag) and wait for
    /// its thread, so that nothing of it outlives the handle.
    fn end_init(&self) {
        self.abort.store(true, std::sync::atomic::Ordering::Relaxed);
        let t = self.init.lock().take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }
}

/// Live handles by id: a destroyed or unknown handle is refused, never dereferenced.
static COMMS: RwLock<Option<HashMap<usize, Arc<Handle>>>> = RwLock::new(None);

/// The id the next handle gets. Ids are never reused (a handle's value is not the object's
/// address, which the allocator hands out again after a destroy): a stale `rocclComm_t`
/// can never name a later communicator.
static NEXT_ID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(FIRST_ID);

/// The first handle id (no small integer a confused caller might pass, such as 0 or 1).
const FIRST_ID: usize = 0x1000;

/// Opaque `rocclComm_t`.
pub type rocclComm_t = *mut c_void;

fn register(h: Arc<Handle>) -> rocclComm_t {
    let key = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    COMMS
        .write()
        .get_or_insert_with(HashMap::new)
        .insert(key, h);
    key as rocclComm_t
}

fn lookup(comm: rocclComm_t) -> R<Arc<Handle>> {
    if comm.is_null() {
        return Err(arg("comm is NULL"));
    }
    COMMS
        .read()
        .as_ref()
        .and_then(|m| m.get(&(comm as usize)).cloned())
        .ok_or_else(|| {
            arg("comm is not a live communicator (already destroyed or aborted, or never created)")
        })
}

/// The ready communicator behind `comm`.
fn ready(comm: rocclComm_t) -> R<Arc<Communicator>> {
    let h = lookup(comm)?;
    if h.suspended.load(std::sync::atomic::Ordering::Acquire) {
        return Err(usage(
            "the communicator is suspended (ncclCommSuspend): call ncclCommResume before using it",
        ));
    }
    let st = h.state.lock();
    match &*st {
        State::Ready(c) => Ok(Arc::clone(c)),
        State::Initializing => Err(usage(
            "the communicator is still initializing (non-blocking init): poll rocclCommGetAsyncError until it is no longer rocclInProgress",
        )),
        State::Failed(_, m) => Err(usage(format!("the communicator failed to initialize: {m}"))),
    }
}

fn ready_handle(c: Communicator) -> Arc<Handle> {
    Arc::new(Handle::new(State::Ready(Arc::new(c))))
}

unsafe fn out_ptr<'a, T>(p: *mut T, name: &str) -> R<&'a mut T> {
    // SAFETY: the caller passes a pointer to writable storage for one T, or NULL (refused).
    unsafe { p.as_mut() }.ok_or_else(|| arg(format!("{name} is NULL")))
}

fn dtype(d: c_int) -> R<DataType> {
    DataType::from_nccl(d).ok_or_else(|| {
        arg(format!(
            "datatype {d} is not a roccl data type (rocclInt8 0 … rocclFloat8e5m2 11)"
        ))
    })
}

fn count_bytes(count: usize, dt: DataType, name: &str) -> R<usize> {
    count
        .checked_mul(dt.size())
        .filter(|b| *b <= isize::MAX as usize)
        .ok_or_else(|| arg(format!("{name} {count} is too large")))
}

// ---------------------------------------------------------------------------------------
// Buffers

/// A buffer given by C: address and length, checked but not yet borrowed.
fn cbuf(p: *const c_void, len: usize, name: &str) -> R<RawBuf> {
    if len > 0 && p.is_null() {
        return Err(arg(format!("{name} is NULL but the count is not zero")));
    }
    if len > 0 && (p as usize).checked_add(len).is_none() {
        return Err(arg(format!("{name} + size overflows the address space")));
    }
    Ok(RawBuf {
        addr: p as usize,
        len,
    })
}

#[derive(Default)]
struct Group {
    depth: u32,
    ops: Vec<(Arc<Communicator>, Op)>,
    /// The stream of each op (0: NULL).
    streams: Vec<StreamId>,
}

/// Run now (blocking, or ordered on `stream`), or queue when inside a group.
fn submit(c: Arc<Communicator>, w: Op, stream: StreamId) -> R {
    let queued = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return false;
        }
        g.ops.push((Arc::clone(&c), w));
        g.streams.push(stream);
        true
    });
    if queued {
        Ok(())
    } else if stream == 0 {
        null_stream(vec![(c, w)])
    } else {
        on_streams(vec![(c, w)], &[stream])
    }
}

/// Calls (one, or a group's) given a NULL stream, with NCCL's meaning. With a GPU runtime
/// present (`ROCCL_DEVICE` unset and a runtime opens, or `hip`, `cuda`, `sim`), NULL is the
/// runtime's legacy default stream (CUDA's `CU_STREAM_LEGACY` behaviour of handle 0, HIP's
/// null stream, the simulated device's stream 0): if any buffer is memory the CPU cannot
/// access, the calls are stream-ordered on that stream (they return at once, like NCCL's)
/// and the CPU never touches the buffers; if all buffers are host-accessible, the calls
/// wait for the work queued on the default stream and then run at once, returning when done
/// (so host memory works as before, in the stream's order). Without a runtime: host memory,
/// run at once, as always. The buffers are classified by the runtime, not taken on trust.
fn null_stream(ops: Vec<(Arc<Communicator>, Op)>) -> R {
    let Ok((dev, sim)) = device() else {
        return run_blocking(ops);
    };
    if let Some(sim) = &sim {
        sim.adopt_stream(0);
    }
    let mut on_device = false;
    for b in ops.iter().flat_map(|(_, w)| w.bufs()).flatten() {
        if b.0.len > 0 && !dev.classify(b.0.addr)?.host_accessible {
            on_device = true;
        }
    }
    if on_device {
        let streams = vec![0; ops.len()];
        return on_streams(ops, &streams);
    }
    dev.bind_thread()?;
    dev.synchronize(0)?;
    run_blocking(ops)
}

/// Run `ops` now on host memory and return when all are done: per communicator, in the
/// order of first use; communicators run concurrently so that one thread can drive several
/// ranks of the same clique.
fn run_blocking(ops: Vec<(Arc<Communicator>, Op)>) -> R {
    let mut per: Vec<(Arc<Communicator>, Vec<Op>)> = Vec::new();
    for (c, w) in ops {
        match per.iter_mut().find(|(k, _)| Arc::ptr_eq(k, &c)) {
            Some((_, v)) => v.push(w),
            None => per.push((c, vec![w])),
        }
    }
    // SAFETY: C keeps the (checked, host) buffers valid until this blocking call returns;
    // overlaps within a group were refused.
    let run = |c: &Communicator, w: &[Op]| -> R { Ok(unsafe { ops::run_now(c, w) }?) };
    let results: Vec<R> = if per.len() <= 1 {
        per.iter().map(|(c, w)| run(c, w)).collect()
    } else {
        std::thread::scope(|s| {
            let hs: Vec<_> = per
                .iter()
                .map(|(c, w)| s.spawn(move || run(c, w)))
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(CErr(INTERNAL_ERROR, "group worker panicked".into()))
                    })
                })
                .collect()
        })
    };
    results.into_iter().collect::<R<Vec<()>>>().map(|_| ())
}

/// The device layer, and the simulated device when that is it (it adopts streams).
type Runtime = (Arc<dyn Device>, Option<Arc<FakeGpu>>);

/// The GPU runtime that orders calls given a stream, chosen once per process by
/// `ROCCL_DEVICE`: `hip` (a build with `--features hip`), `sim` (the simulated device:
/// streams are whatever non-NULL handles the program passes, buffers are host memory; for
/// testing stream-ordered code without a GPU), `none`; unset: the runtime this build has, if
/// a device is present.
fn device() -> R<Runtime> {
    static DEV: OnceLock<Result<Runtime, String>> = OnceLock::new();
    DEV.get_or_init(|| {
        let choice = std::env::var("ROCCL_DEVICE").unwrap_or_default();
        match choice.trim() {
            "sim" => {
                let us = std::env::var("ROCCL_SIM_DELAY_US")
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .unwrap_or(100);
                let sim = FakeGpu::new(Duration::from_micros(us));
                Ok((sim.clone() as Arc<dyn Device>, Some(sim)))
            }
            "none" => Err("a stream was given, but ROCCL_DEVICE=none: pass a NULL stream with host memory".into()),
            "" | "auto" => {
                let built = roccl_core::device::runtimes_built();
                if built.is_empty() {
                    return Err("a stream was given, but roccl was built without a GPU runtime (--features hip or cuda; docs/GPU.md): pass a NULL stream with host memory, or set ROCCL_DEVICE=sim to test stream-ordered code on the simulated device".into());
                }
                let mut why = Vec::new();
                for rt in built {
                    match roccl_core::device::open_runtime(rt) {
                        Ok(d) => return Ok((d, None)),
                        Err(e) => why.push(e.to_string()),
                    }
                }
                Err(format!(
                    "a stream was given, but no GPU runtime could be opened: {}",
                    why.join("; ")
                ))
            }
            rt => roccl_core::device::open_runtime(rt)
                .map(|d| (d, None))
                .map_err(|e| format!("ROCCL_DEVICE={rt}: {e}")),
        }
    })
    .clone()
    .map_err(arg)
}

/// The simulated device the C ABI uses when `ROCCL_DEVICE=sim` (tests allocate its
/// buffers and drive its streams); `None` otherwise.
pub fn sim_device() -> Option<Arc<FakeGpu>> {
    device().ok().and_then(|(_, sim)| sim)
}

/// The GPU runtime the C ABI orders stream calls with (tools allocate device buffers and
/// streams through it), or why there is none.
pub fn runtime() -> Result<Arc<dyn Device>, String> {
    device().map(|(d, _)| d).map_err(|CErr(_, m)| m)
}

/// Run `ops` ordered with `streams` (returns once they are enqueued).
fn on_streams(ops: Vec<(Arc<Communicator>, Op)>, streams: &[StreamId]) -> R {
    let (dev, sim) = device()?;
    if let Some(sim) = &sim {
        streams.iter().for_each(|&s| sim.adopt_stream(s));
    }
    let ops = ops
        .into_iter()
        .zip(streams)
        .map(|((c, w), &s)| (c, w, s))
        .collect();
    // SAFETY: C keeps the buffers valid until the streams have passed the operation (NCCL's
    // contract for calls with a stream); overlaps within a group were refused.
    unsafe { ops::run_on_streams(&dev, ops, roccl_core::comm::timeout()) }?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Exported functions

/// Version code of this library.
#[no_mangle]
pub unsafe extern "C" fn rocclGetVersion(version: *mut c_int) -> rocclResult_t {
    guard("rocclGetVersion", || {
        // SAFETY: C passes storage for one int (NULL refused).
        *unsafe { out_ptr(version, "version") }? = VERSION_CODE;
        Ok(())
    })
}

/// Human-readable name of a result code.
#[no_mangle]
pub extern "C" fn rocclGetErrorString(result: rocclResult_t) -> *const c_char {
    let s: &'static CStr = match result {
        SUCCESS => c"no error",
        UNHANDLED_DEVICE_ERROR => c"unhandled device error",
        SYSTEM_ERROR => {
            c"unhandled system error (network, memory or OS call failed; see rocclGetLastError)"
        }
        INTERNAL_ERROR => c"internal error (a bug in roccl; see rocclGetLastError)",
        INVALID_ARGUMENT => c"invalid argument (see rocclGetLastError)",
        INVALID_USAGE => c"invalid usage (see rocclGetLastError)",
        REMOTE_ERROR => c"remote process exited, failed or timed out (see rocclGetLastError)",
        IN_PROGRESS => c"operation in progress",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// The last error message of this thread.
#[no_mangle]
pub extern "C" fn rocclGetLastError(_comm: rocclComm_t) -> *const c_char {
    // The pointer stays valid until this thread's next failing roccl call.
    LAST_ERROR
        .try_with(|l| l.try_borrow().map(|s| s.as_ptr()).ok())
        .ok()
        .flatten()
        .unwrap_or(c"".as_ptr())
}

/// Create a unique id (starts the rendezvous root in this process).
#[no_mangle]
pub unsafe extern "C" fn rocclGetUniqueId(unique_id: *mut rocclUniqueId) -> rocclResult_t {
    guard("rocclGetUniqueId", || {
        // SAFETY: storage for one rocclUniqueId (NULL refused).
        let out = unsafe { out_ptr(unique_id, "uniqueId") }?;
        let id = UniqueId::new()?;
        for (d, s) in out.internal.iter_mut().zip(id.as_bytes()) {
            *d = *s as c_char;
        }
        Ok(())
    })
}

fn id_of(u: &rocclUniqueId) -> R<UniqueId> {
    let b: Vec<u8> = u.internal.iter().map(|c| *c as u8).collect();
    UniqueId::from_bytes(&b).map_err(|_| {
        arg("commId is not a roccl unique id (pass the bytes from rocclGetUniqueId unchanged)")
    })
}

fn rank_args(nranks: c_int, rank: c_int) -> R<(usize, usize)> {
    if nranks < 1 {
        return Err(arg(format!("nranks is {nranks}; it must be at least 1")));
    }
    if rank < 0 || rank >= nranks {
        return Err(arg(format!(
            "rank {rank} is out of range for nranks {nranks}"
        )));
    }
    Ok((nranks as usize, rank as usize))
}

fn config_of(config: *const rocclConfig_t) -> R<(bool, Config)> {
    let mut cfg = Config::from_env()?;
    // SAFETY: C passes a pointer to a rocclConfig_t or NULL.
    let Some(c) = (unsafe { config.as_ref() }) else {
        return Ok((true, cfg));
    };
    if c.magic != CONFIG_MAGIC || c.size < std::mem::size_of::<rocclConfig_t>() {
        return Err(arg(if c.magic == 0xcafe_beef {
            "config is an ncclConfig_t (NCCL's magic), whose layout differs from rocclConfig_t: initialize a rocclConfig_t with ROCCL_CONFIG_INITIALIZER, or call libroccl-nccl.so's ncclCommInitRankConfig"
        } else {
            "config was not initialized with ROCCL_CONFIG_INITIALIZER"
        }));
    }
    if !c.net_name.is_null() {
        // SAFETY: a NUL-terminated string per the header.
        let name = unsafe { CStr::from_ptr(c.net_name) }.to_string_lossy();
        cfg.net = name.parse()?;
    }
    // Any non-zero value, ROCCL_CONFIG_UNDEF_INT included, means blocking.
    Ok((c.blocking != 0, cfg))
}

fn init_rank(
    comm: *mut rocclComm_t,
    nranks: c_int,
    id: rocclUniqueId,
    rank: c_int,
    config: *const rocclConfig_t,
) -> R {
    // SAFETY: storage for one rocclComm_t (NULL refused).
    let out = unsafe { out_ptr(comm, "comm") }?;
    *out = std::ptr::null_mut();
    let (n, r) = rank_args(nranks, rank)?;
    let uid = id_of(&id)?;
    let (blocking, cfg) = config_of(config)?;
    make(out, blocking, r, move |abort| {
        Communicator::init_abortable(&uid, n, r, cfg, abort)
    })
}

/// Make a communicator with `f` into `*out`: here when `blocking`, else on a thread of its
/// own while the handle says rocclInProgress (`f` watches the handle's abort flag).
fn make(
    out: &mut rocclComm_t,
    blocking: bool,
    r: usize,
    f: impl FnOnce(&std::sync::atomic::AtomicBool) -> roccl_core::Result<Communicator> + Send + 'static,
) -> R {
    if blocking {
        let c = f(&std::sync::atomic::AtomicBool::new(false))?;
        *out = register(ready_handle(c));
        return Ok(());
    }
    let h = Arc::new(Handle::new(State::Initializing));
    let th = Arc::clone(&h);
    let abort = Arc::clone(&h.abort);
    let t = std::thread::Builder::new()
        .name(format!("roccl-init-r{r}"))
        .spawn(move || {
            let h = th;
            let res = catch_unwind(AssertUnwindSafe(|| f(&abort)));
            let st = match res {
                Ok(Ok(c)) => State::Ready(Arc::new(c)),
                Ok(Err(e)) => State::Failed(code_of(e.kind()), e.to_string()),
                Err(_) => State::Failed(INTERNAL_ERROR, "internal error: init panicked".into()),
            };
            *h.state.lock() = st;
            h.cond.notify_all();
        })
        .map_err(|e| CErr(SYSTEM_ERROR, format!("spawning the init thread: {e}")))?;
    *h.init.lock() = Some(t);
    *out = register(h);
    Err(CErr(
        IN_PROGRESS,
        "initialization continues in the background".into(),
    ))
}

/// Join the communicator of `commId` as `rank` of `nranks` (blocking).
#[no_mangle]
pub unsafe extern "C" fn rocclCommInitRank(
    comm: *mut rocclComm_t,
    nranks: c_int,
    comm_id: rocclUniqueId,
    rank: c_int,
) -> rocclResult_t {
    guard("rocclCommInitRank", || {
        init_rank(comm, nranks, comm_id, rank, std::ptr::null())
    })
}

/// Like rocclCommInitRank, with a config (`blocking = 0`: returns rocclInProgress).
#[no_mangle]
pub unsafe extern "C" fn rocclCommInitRankConfig(
    comm: *mut rocclComm_t,
    nranks: c_int,
    comm_id: rocclUniqueId,
    rank: c_int,
    config: *mut rocclConfig_t,
) -> rocclResult_t {
    let r = guard("rocclCommInitRankConfig", || {
        init_rank(comm, nranks, comm_id, rank, config)
    });
    if r == IN_PROGRESS {
        set_last_error("");
    }
    r
}

/// Create `ndev` communicators of one clique in this process (ranks as threads).
#[no_mangle]
pub unsafe extern "C" fn rocclCommInitAll(
    comms: *mut rocclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> rocclResult_t {
    let _ = devlist; // host memory: devices do not apply
    guard("rocclCommInitAll", || {
        if comms.is_null() {
            return Err(arg("comms is NULL"));
        }
        if ndev < 1 {
            return Err(arg(format!("ndev is {ndev}; it must be at least 1")));
        }
        let n = ndev as usize;
        // SAFETY: C passes an array of ndev rocclComm_t (NULL refused).
        let out = unsafe { std::slice::from_raw_parts_mut(comms, n) };
        out.iter_mut().for_each(|c| *c = std::ptr::null_mut());
        let id = UniqueId::new()?;
        let cfg = Config::from_env()?;
        let made: Vec<roccl_core::Result<Communicator>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let cfg = cfg.clone();
                    s.spawn(move || Communicator::init_with(&id, n, r, cfg))
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Internal("init thread panicked".into())))
                })
                .collect()
        });
        let mut comms_ok = Vec::with_capacity(n);
        for m in made {
            comms_ok.push(m?);
        }
        for (o, c) in out.iter_mut().zip(comms_ok) {
            *o = register(ready_handle(c));
        }
        Ok(())
    })
}

/// Finish outstanding work (all calls complete before returning, so nothing is pending
/// unless a non-blocking init still runs: then rocclInProgress).
#[no_mangle]
pub unsafe extern "C" fn rocclCommFinalize(comm: rocclComm_t) -> rocclResult_t {
    guard("rocclCommFinalize", || {
        let h = lookup(comm)?;
        let st = h.state.lock();
        match &*st {
            State::Initializing => Err(CErr(IN_PROGRESS, "initialization is still running".into())),
            _ => Ok(()),
        }
    })
}

fn remove(comm: rocclComm_t) -> R<Arc<Handle>> {
    let h = lookup(comm)?;
    premul::forget(comm);
    if let Some(m) = COMMS.write().as_mut() {
        m.remove(&(comm as usize));
    }
    Ok(h)
}

/// Free a communicator (a non-blocking init still running is ended first, within about
/// 100 ms: nobody can use the communicator once its handle is gone).
#[no_mangle]
pub unsafe extern "C" fn rocclCommDestroy(comm: rocclComm_t) -> rocclResult_t {
    guard("rocclCommDestroy", || {
        let h = remove(comm)?;
        h.end_init();
        Ok(())
    })
}

/// Abort: unblock any call in progress on this communicator (from another thread) and free it.
#[no_mangle]
pub unsafe extern "C" fn rocclCommAbort(comm: rocclComm_t) -> rocclResult_t {
    guard("rocclCommAbort", || {
        let h = remove(comm)?;
        h.end_init();
        let c = match &*h.state.lock() {
            State::Ready(c) => Some(Arc::clone(c)),
            _ => None,
        };
        if let Some(c) = c {
            c.abort();
        }
        Ok(())
    })
}

/// Split into sub-communicators by color and key (`ROCCL_SPLIT_NOCOLOR`: no new comm).
#[no_mangle]
pub unsafe extern "C" fn rocclCommSplit(
    comm: rocclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut rocclComm_t,
    config: *mut rocclConfig_t,
) -> rocclResult_t {
    guard("rocclCommSplit", || {
        // SAFETY: storage for one rocclComm_t (NULL refused).
        let out = unsafe { out_ptr(newcomm, "newcomm") }?;
        *out = std::ptr::null_mut();
        if color < 0 && color != SPLIT_NOCOLOR {
            return Err(arg(format!(
                "color {color} is negative (use ROCCL_SPLIT_NOCOLOR to opt out)"
            )));
        }
        config_of(config)?;
        let c = ready(comm)?;
        let sub = c.split((color >= 0).then_some(color as u32), key)?;
        if let Some(s) = sub {
            *out = register(ready_handle(s));
        }
        Ok(())
    })
}

/// Number of ranks.
#[no_mangle]
pub unsafe extern "C" fn rocclCommCount(comm: rocclComm_t, count: *mut c_int) -> rocclResult_t {
    guard("rocclCommCount", || {
        // SAFETY: storage for one int (NULL refused).
        let out = unsafe { out_ptr(count, "count") }?;
        *out = ready(comm)?.nranks() as c_int;
        Ok(())
    })
}

/// This rank.
#[no_mangle]
pub unsafe extern "C" fn rocclCommUserRank(comm: rocclComm_t, rank: *mut c_int) -> rocclResult_t {
    guard("rocclCommUserRank", || {
        // SAFETY: storage for one int (NULL refused).
        let out = unsafe { out_ptr(rank, "rank") }?;
        *out = ready(comm)?.rank() as c_int;
        Ok(())
    })
}

/// The communicator's asynchronous state: rocclInProgress while a non-blocking init runs,
/// the error that broke it, or rocclSuccess.
#[no_mangle]
pub unsafe extern "C" fn rocclCommGetAsyncError(
    comm: rocclComm_t,
    async_error: *mut rocclResult_t,
) -> rocclResult_t {
    guard("rocclCommGetAsyncError", || {
        // SAFETY: storage for one rocclResult_t (NULL refused).
        let out = unsafe { out_ptr(async_error, "asyncError") }?;
        let h = lookup(comm)?;
        let st = h.state.lock();
        *out = match &*st {
            State::Initializing => IN_PROGRESS,
            State::Failed(code, msg) => {
                set_last_error(msg);
                *code
            }
            // Revoked: quiescent once revoke returned (NCCL: ncclSuccess then).
            State::Ready(c) if c.revoked() => SUCCESS,
            State::Ready(c) => match c.async_error() {
                None => SUCCESS,
                Some(e) => {
                    set_last_error(&e.message);
                    code_of(e.kind)
                }
            },
        };
        Ok(())
    })
}

fn coll(
    name: &str,
    comm: rocclComm_t,
    stream: *mut c_void,
    datatype: c_int,
    make: impl FnOnce(&Communicator, DataType) -> R<Op>,
) -> rocclResult_t {
    guard(name, || {
        let dt = dtype(datatype)?;
        let c = ready(comm)?;
        let w = make(&c, dt)?;
        submit(c, w, stream as StreamId)
    })
}

/// Out of place unless `send` is exactly `recv + inplace_at` (NCCL's in-place convention).
fn place(send: RawBuf, recv: RawBuf, inplace_at: usize) -> R<Option<RawBuf>> {
    if send.len > 0
        && send.addr == recv.addr.wrapping_add(inplace_at)
        && send.len + inplace_at <= recv.len
    {
        return Ok(None);
    }
    if send.overlaps(&recv) {
        return Err(arg(
            "sendbuff and recvbuff overlap without being the in-place layout",
        ));
    }
    Ok(Some(send))
}

/// All-reduce `count` elements.
#[no_mangle]
pub unsafe extern "C" fn rocclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: rocclComm_t,
    stream: *mut c_void,
) -> rocclResult_t {
    coll("rocclAllReduce", comm, stream, datatype, |_, dt| {
        let (op, premul) = premul::resolve(op, comm, dt)?;
        let b = count_bytes(count, dt, "count")?;
        let recv = cbuf(recvbuff, b, "recvbuff")?;
        let send = place(cbuf(sendbuff, b, "sendbuff")?, recv, 0)?;
        Ok(Op::Coll {
            coll: Collective::AllReduce(op),
            dt,
            send,
            recv,
            premul,
        })
    })
}

/// Broadcast `count` elements from `root` (`sendbuff` is read on the root only).
#[no_mangle]
pub unsafe extern "C" fn rocclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: rocclComm_t,
    stream: *mut c_void,
) -> rocclResult_t {
    coll("rocclBroadcast", comm, stream, datatype, |c, dt| {
        let root = check_rank(root, c, "root")?;
        let b = count_bytes(count, dt, "count")?;
        let recv = cbuf(recvbuff, b, "recvbuff")?;
        let send = if c.rank() == root {
            place(cbuf(sendbuff, b, "sendbuff")?, recv, 0)?
        } else {
            None
        };
        Ok(Op::Coll {
            coll: Collective::Broadcast { root },
            dt,
            send,
            recv,
            premul: None,
        })
    })
}

/// In-place broadcast (NCCL's legacy ncclBcast).
#[no_mangle]
pub unsafe extern "C" fn rocclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: rocclComm_t,
    stream: *mut c_void,
) -> rocclResult_t {
    // SAFETY: forwarded with the same contract.
    unsafe { rocclBroadcast(buff, buff, count, datatype, root, comm, stream) }
}

fn check_rank(r: c_int, c: &Communicator, name: &str) -> R<usize> {
    if r < 0 || r as usize >= c.nranks() {
        return Err(arg(format!(
            "{name} {r} is out of range for {} ranks",
            c.nranks()
        )));
    }
    Ok(r as usize)
}

/// Reduce `count` elements to `root` (`recvbuff` is written on the root only).
#[no_mangle]
pub unsafe extern "C" fn rocclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    root: c_int,
    comm: rocclComm_t,
    stream: *mut c_void,
) -> rocclResult_t {
    coll("rocclReduce", comm, stream, datatype, |c, dt| {
        let (op, premul) = premul::resolve(op, comm, dt)?;
        let root = check_rank(root, c, "root")?;
        let b = count_bytes(count, dt, "count")?;
        let send = cbuf(sendbuff, b, "sendbuff")?;
        let is_root = c.rank() == root;
        // recvbuff matters on the root only (or as the in-place buffer anywhere).
        let recv = if is_root || std::ptr::eq(recvbuff, sendbuff) {
            cbuf(recvbuff, b, "recvbuff")?
        } else {
            RawBuf { addr: 0, len: 0 }
        };
        let send = place(send, recv, 0)?;
        Ok(Op::Coll {
            coll: Collective::Reduce { op, root },
            dt,
            send,
            recv,
            premul,
        })
    })
}

/// All-gather: `sendcount` elements from each rank into `nranks * sendcount`.
#[no_mangle]
pub unsafe extern "C" fn rocclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: c_int,
    comm: rocclComm_t,
    stream: *mut c_void,
) -> rocclResult_t {
    coll("rocclAllGather", comm, stream, datatype, |c, dt| {
        let b = count_bytes(sendcount, dt, "sendcount")?;
        let total = count_bytes(
            sendcount.saturating_mul(c.nranks()),
            dt,
            "sendcount * nranks",
        )?;
        let recv = cbuf(recvbuff, total, "recvbuff")?;
        let send = place(cbuf(sendbuff, b, "sendbuff")?, recv, c.rank() * b)?;
        Ok(Op::Coll {
            coll: Collective::AllGather,
            dt,
            send,
            recv,
            premul: None,
        })
    })
}

/// Reduce-scatter: `nranks * recvcount` elements in, block `rank` (`recvcount`) out.
#[no_mangle]
pub unsafe extern "C" fn rocclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: c_int,
    op: c_int,
    comm: rocclComm_t,
    stream: *mut c_void,
) -> rocclResult_t {
    coll("rocclReduceScatter", comm, stream, datatype, |c, dt| {
        let (op, premul) = premul::resolve(op, comm, dt)?;
        let b = count_bytes(recvcount, dt, "recvcount")?;
        let total = count_bytes(
            recvcount.saturating_mul(c.nranks()),
            dt,
            "recvcount * nranks",
        )?;
        let send = cbuf(sendbuff, total, "sendbuff")?;
        let recv = cbuf(recvbuff, b, "recvbuff")?;
        // In place: recvbuff is block `rank` of sendbuff; the core then works on sendbuff.
        if b > 0 && recv.addr == send.addr.wrapping_add(c.rank() * b) {
            return Ok(Op::Coll {
                coll: Collective::ReduceScatter(op),
                dt,
                send: None,
                recv: send,
                premul,
            });
        }
        if send.overlaps(&recv) {
            return Err(arg(
                "sendbuff and recvbuff overlap without being the in-place layout",
            ));
        }
        Ok(Op::Coll {
            coll: Collective::ReduceScatter(op),
            dt,
            send: Some(send),
            recv,
            premul,
        })
    })
}

/// All-to-all: block `j` (`count` elements) of `sendbuff` to rank `j`.
#[no_mangle]
pub unsafe extern "C" fn rocclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    comm: rocclComm_t,
    stream: *mut c_void,
) -> rocclResult_t {
    coll("rocclAlltoAll", comm, stream, datatype, |c, dt| {
        let total = count_bytes(count.saturating_mul(c.nranks()), dt, "count * nranks")?;
        let recv = cbuf(recvbuff, total, "recvbuff")?;
        let send = place(cbuf(sendbuff, total, "sendbuff")?, recv, 0)?;
        Ok(Op::Coll {
            coll: Collective::AllToAll,
            dt,
            send,
            recv,
            premul: None,
        })
    })
}

/// Send `count` elements to `peer`.
#[no_mangle]
pub unsafe extern "C" fn rocclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: rocclComm_t,
    stream: *mut c_void,
) -> rocclResult_t {
    coll("rocclSend", comm, stream, datatype, |c, dt| {
        let peer = check_rank(peer, c, "peer")?;
        let buf = cbuf(sendbuff, count_bytes(count, dt, "count")?, "sendbuff")?;
        Ok(Op::Send { peer, buf })
    })
}

/// Receive `count` elements from `peer`.
#[no_mangle]
pub unsafe extern "C" fn rocclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: rocclComm_t,
    stream: *mut c_void,
) -> rocclResult_t {
    coll("rocclRecv", comm, stream, datatype, |c, dt| {
        let peer = check_rank(peer, c, "peer")?;
        let buf = cbuf(recvbuff, count_bytes(count, dt, "count")?, "recvbuff")?;
        Ok(Op::Recv { peer, buf })
    })
}

/// Start a group: calls until the matching rocclGroupEnd are queued.
#[no_mangle]
pub extern "C" fn rocclGroupStart() -> rocclResult_t {
    guard("rocclGroupStart", || {
        GROUP.with(|g| g.borrow_mut().depth += 1);
        Ok(())
    })
}

/// End a group; the outermost end runs every queued call and returns when all are done.
#[no_mangle]
pub extern "C" fn rocclGroupEnd() -> rocclResult_t {
    guard("rocclGroupEnd", || {
        let (ops, streams) = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return Err(usage("rocclGroupEnd without rocclGroupStart"));
            }
            g.depth -= 1;
            Ok(if g.depth == 0 {
                (std::mem::take(&mut g.ops), std::mem::take(&mut g.streams))
            } else {
                (Vec::new(), Vec::new())
            })
        })?;
        ops::check_group(&ops)?;
        if streams.iter().any(|&s| s != 0) {
            if streams.contains(&0) {
                return Err(arg(
                    "the group mixes calls with a NULL stream and calls with a stream: give every call of a group a stream, or none",
                ));
            }
            return on_streams(ops, &streams);
        }
        if ops.is_empty() {
            return Ok(());
        }
        null_stream(ops)
    })
}

// ---------------------------------------------------------------------------------------
// For the NCCL-named library: what NCCL's API has beyond roccl's C ABI.

/// Run `f` on the ready communicator behind `comm` (refused while it is suspended,
/// initializing, failed, destroyed), inside the C layer's panic guard; `name` prefixes the
/// last-error message.
pub fn with_comm(
    name: &str,
    comm: rocclComm_t,
    f: impl FnOnce(&Communicator) -> Result<(), String>,
) -> rocclResult_t {
    guard(name, || {
        let c = ready(comm)?;
        f(&c).map_err(usage)
    })
}

/// Wait until every call issued on `comm` before this one has run (stream-ordered calls
/// included: a job queued behind them on the communicator's worker).
fn quiesce(c: &Communicator) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    c.enqueue(Box::new(move |_| {
        let _ = tx.send(());
    }));
    let limit = roccl_core::comm::timeout();
    rx.recv_timeout(limit).map_err(|_| {
        CErr(
            INTERNAL_ERROR,
            format!("the communicator's earlier calls did not finish within {limit:.0?} (ROCCL_TIMEOUT)"),
        )
    })
}

/// Suspend `comm`: wait for its outstanding work, then refuse calls until [`resume`]. With
/// `NCCL_SUSPEND_MEM` it releases its cached GPU registrations, scratch and the process's
/// idle staging buffers ([`Communicator::release_memory`]), and closes the connections idle
/// at both ends with the peers that suspend within `ROCCL_SUSPEND_WAIT` seconds (default 1;
/// [`Communicator::close_idle_connections`]); they open again on first use after resume.
pub fn suspend(comm: rocclComm_t, flags: c_int) -> rocclResult_t {
    guard("ncclCommSuspend", || {
        if flags & !1 != 0 {
            return Err(arg(format!(
                "unknown flags {flags:#x} (NCCL_SUSPEND_MEM = 1)"
            )));
        }
        let c = ready(comm)?;
        quiesce(&c)?;
        let h = lookup(comm)?;
        if h.suspended.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return Err(usage("the communicator is already suspended"));
        }
        if flags & 1 != 0 {
            let r = c.release_memory();
            roccl_core::info!(
                "ncclCommSuspend(NCCL_SUSPEND_MEM): rank {} released {} cached GPU registrations and {} bytes of buffers",
                c.rank(),
                r.registrations,
                r.bytes
            );
            let wait = roccl_core::envvar::value_or::<f64>("ROCCL_SUSPEND_WAIT", 1.0);
            if wait > 0.0 && wait.is_finite() {
                let wait = std::time::Duration::from_secs_f64(wait.min(3600.0));
                match c.close_idle_connections(wait) {
                    Ok(k) => roccl_core::info!(
                        "ncclCommSuspend(NCCL_SUSPEND_MEM): rank {} closed {} idle connections{}",
                        c.rank(),
                        k.closed,
                        if k.kept_with.is_empty() {
                            String::new()
                        } else {
                            format!(
                                "; kept those with ranks {:?} (not suspending within {wait:.1?}, ROCCL_SUSPEND_WAIT, or a call apart)",
                                k.kept_with
                            )
                        }
                    ),
                    Err(e) => {
                        h.suspended
                            .store(false, std::sync::atomic::Ordering::Release);
                        return Err(e.into());
                    }
                }
            }
        }
        Ok(())
    })
}

/// Resume a communicator suspended by [`suspend`].
pub fn resume(comm: rocclComm_t) -> rocclResult_t {
    guard("ncclCommResume", || {
        let h = lookup(comm)?;
        if !h.suspended.swap(false, std::sync::atomic::Ordering::AcqRel) {
            return Err(usage(
                "the communicator is not suspended (ncclCommSuspend first)",
            ));
        }
        Ok(())
    })
}

/// The rank, size and hash (equal on every rank) of the ready communicator `comm`.
pub fn comm_info(comm: rocclComm_t) -> Result<(usize, usize, u64), (rocclResult_t, String)> {
    ready(comm)
        .map(|c| (c.rank(), c.nranks(), c.id_hash()))
        .map_err(|CErr(code, m)| (code, m))
}
