//! roccl under NCCL's names and ABI: `libroccl-nccl.so`, the library `VLLM_NCCL_SO_PATH`
//! points at (and that can be laid out as `libnccl.so.2` / `librccl.so.1`).
//!
//! Every function forwards to the C ABI of roccl (`ffi/capi`, `include/roccl.h`), which
//! already uses NCCL's argument order, types and numbers (data types including fp8 e4m3 = 10
//! and e5m2 = 11, ops, result codes, the 128-byte unique id passed by value); that layer owns
//! the panic boundary, the argument checks and the handle table. What is NCCL-specific
//! lives here: the NCCL version code, `ncclConfig_t`'s layout, the window calls vLLM looks
//! up, and a WARN line on stderr for every failing call (vLLM shows only
//! `ncclGetErrorString`, which is one fixed sentence per code).

#![allow(non_camel_case_types, clippy::missing_safety_doc)]

mod config;
mod host;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use capi::{rocclComm_t as ncclComm_t, rocclResult_t as ncclResult_t, rocclUniqueId};

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
pub type ncclUniqueId = rocclUniqueId;
/// `cudaStream_t` / `hipStream_t`.
pub type ncclStream_t = *mut c_void;
/// `ncclWindow_t` (opaque).
pub type ncclWindow_t = *mut c_void;

const SYSTEM_ERROR: ncclResult_t = 2;
const INTERNAL_ERROR: ncclResult_t = 3;
const INVALID_ARGUMENT: ncclResult_t = 4;
const INVALID_USAGE: ncclResult_t = 5;
const IN_PROGRESS: ncclResult_t = 7;

/// The NCCL version this library answers with: NCCL 2.32.3, whose host API it exports
/// (docs/NCCL.md; `ROCCL_NCCL_VERSION` overrides it for programs that gate features on it).
pub const NCCL_VERSION: c_int = 23203;

/// Log a failing call's message (the C layer recorded it as the thread's last error).
fn checked(r: ncclResult_t) -> ncclResult_t {
    if r != 0 && r != IN_PROGRESS {
        let msg = capi::rocclGetLastError(std::ptr::null_mut());
        // SAFETY: rocclGetLastError returns this thread's NUL-terminated message.
        let text = unsafe { CStr::from_ptr(msg) }.to_string_lossy();
        // The C layer names its own function (rocclX); the caller called ncclX.
        let text = match text.strip_prefix("roccl") {
            Some(rest) => format!("nccl{rest}"),
            None => text.into_owned(),
        };
        roccl_core::log::log(
            roccl_core::log::Level::Warn,
            format_args!("NCCL API error {r}: {text}"),
        );
    }
    r
}

/// Run an exported function inside a panic boundary: a panic (in roccl, or while logging)
/// becomes ncclInternalError with a message, never an unwind into the C caller (which would
/// abort the host process, e.g. a Python interpreter).
fn boundary(name: &str, f: impl FnOnce() -> ncclResult_t) -> ncclResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            capi::set_last_error(&format!(
                "{name}: internal error (a panic in roccl, caught at the NCCL boundary; please report it)"
            ));
            INTERNAL_ERROR
        }
    }
}

/// [`boundary`] for the functions that return a message: an empty one on a panic.
fn pointer_boundary(f: impl FnOnce() -> *const c_char) -> *const c_char {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(c"".as_ptr())
}

fn fail(code: ncclResult_t, msg: &str) -> ncclResult_t {
    capi::set_last_error(msg);
    checked(code)
}

/// The NCCL-style version code (22703 = 2.27.3, or `ROCCL_NCCL_VERSION`).
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    boundary("ncclGetVersion", || {
        if version.is_null() {
            return fail(INVALID_ARGUMENT, "ncclGetVersion: version is NULL");
        }
        let v = std::env::var("ROCCL_NCCL_VERSION")
            .ok()
            .and_then(|v| v.trim().parse::<c_int>().ok())
            .filter(|v| *v >= 20000)
            .unwrap_or(NCCL_VERSION);
        // SAFETY: non-NULL storage for one int, per the API.
        unsafe { *version = v };
        0
    })
}

/// A fixed sentence per result code.
#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    pointer_boundary(|| capi::rocclGetErrorString(result))
}

/// This thread's last error message.
#[no_mangle]
pub extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    pointer_boundary(|| capi::rocclGetLastError(comm))
}

/// A new unique id (starts the rendezvous root in this process).
#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(unique_id: *mut ncclUniqueId) -> ncclResult_t {
    boundary("ncclGetUniqueId", || {
        // SAFETY: forwarded with the same contract.
        checked(unsafe { capi::rocclGetUniqueId(unique_id) })
    })
}

/// Join the communicator of `comm_id` as `rank` of `nranks`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    comm_id: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    boundary("ncclCommInitRank", || {
        // SAFETY: forwarded with the same contract.
        checked(unsafe { capi::rocclCommInitRank(comm, nranks, comm_id, rank) })
    })
}

/// Like ncclCommInitRank with a config (`blocking = 0`: returns ncclInProgress).
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    comm_id: ncclUniqueId,
    rank: c_int,
    cfg: *mut c_void,
) -> ncclResult_t {
    boundary("ncclCommInitRankConfig", || {
        let mut c = match config::read(cfg, "ncclCommInitRankConfig") {
            Ok(c) => c,
            Err(r) => return r,
        };
        if let Some(name) = c.as_ref().and_then(|c| c.name.as_deref()) {
            roccl_core::log::log(
                roccl_core::log::Level::Info,
                format_args!("ncclCommInitRankConfig: communicator {name:?} (config.commName)"),
            );
        }
        let p = c
            .as_mut()
            .map_or(std::ptr::null_mut(), |c| &mut c.roccl as *mut _);
        // SAFETY: forwarded with the same contract; `p` is NULL or points at `c`, alive here.
        checked(unsafe { capi::rocclCommInitRankConfig(comm, nranks, comm_id, rank, p) })
    })
}

/// `ndev` communicators of one clique in this process.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    boundary("ncclCommInitAll", || {
        // SAFETY: forwarded with the same contract.
        checked(unsafe { capi::rocclCommInitAll(comms, ndev, devlist) })
    })
}

/// Split by color and key.
#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    cfg: *mut c_void,
) -> ncclResult_t {
    boundary("ncclCommSplit", || {
        let mut c = match config::read(cfg, "ncclCommSplit") {
            Ok(c) => c,
            Err(r) => return r,
        };
        let p = c
            .as_mut()
            .map_or(std::ptr::null_mut(), |c| &mut c.roccl as *mut _);
        // SAFETY: forwarded with the same contract; `p` is NULL or points at `c`, alive here.
        checked(unsafe { capi::rocclCommSplit(comm, color, key, newcomm, p) })
    })
}

macro_rules! forward {
    ($( $(#[$m:meta])* fn $nccl:ident => $roccl:ident ( $($a:ident : $t:ty),* ); )*) => {$(
        $(#[$m])*
        #[no_mangle]
        pub unsafe extern "C" fn $nccl($($a: $t),*) -> ncclResult_t {
            boundary(stringify!($nccl), || {
                // SAFETY: forwarded with the same contract (the C layer checks every argument).
                checked(unsafe { capi::$roccl($($a),*) })
            })
        }
    )*};
}

forward! {
    /// Complete outstanding work.
    fn ncclCommFinalize => rocclCommFinalize(comm: ncclComm_t);
    /// Free a communicator.
    fn ncclCommDestroy => rocclCommDestroy(comm: ncclComm_t);
    /// Abort and free a communicator.
    fn ncclCommAbort => rocclCommAbort(comm: ncclComm_t);
    /// Number of ranks.
    fn ncclCommCount => rocclCommCount(comm: ncclComm_t, count: *mut c_int);
    /// This rank.
    fn ncclCommUserRank => rocclCommUserRank(comm: ncclComm_t, rank: *mut c_int);
    /// The communicator's asynchronous error.
    fn ncclCommGetAsyncError => rocclCommGetAsyncError(comm: ncclComm_t, async_error: *mut ncclResult_t);
    /// All-reduce.
    fn ncclAllReduce => rocclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// Broadcast (`sendbuff` read on the root only; NULL elsewhere is fine).
    fn ncclBroadcast => rocclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// In-place broadcast.
    fn ncclBcast => rocclBcast(buff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// Reduce to a root.
    fn ncclReduce => rocclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// All-gather (`count` elements per rank).
    fn ncclAllGather => rocclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// Reduce-scatter (`count` elements per rank).
    fn ncclReduceScatter => rocclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// Send to a peer.
    fn ncclSend => rocclSend(sendbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// Receive from a peer.
    fn ncclRecv => rocclRecv(recvbuff: *mut c_void, count: usize, datatype: c_int, peer: c_int, comm: ncclComm_t, stream: ncclStream_t);
}

/// Start a group.
#[no_mangle]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    boundary("ncclGroupStart", || checked(capi::rocclGroupStart()))
}

/// End a group: runs what it queued.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    boundary("ncclGroupEnd", || checked(capi::rocclGroupEnd()))
}

/// The device of a communicator: roccl's buffers are host memory, so 0 (after checking the
/// handle).
#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    boundary("ncclCommCuDevice", || {
        if device.is_null() {
            return fail(INVALID_ARGUMENT, "ncclCommCuDevice: device is NULL");
        }
        let mut n = 0;
        // SAFETY: `n` is valid storage; the handle is checked by the C layer.
        let r = checked(unsafe { capi::rocclCommCount(comm, &mut n) });
        if r == 0 {
            // SAFETY: non-NULL storage for one int.
            unsafe { *device = 0 };
        }
        r
    })
}

/// `ncclEncryptionConfig_t` (NCCL 2.32): a versioned struct.
#[repr(C)]
struct NcclEncryptionConfig {
    size: usize,
    magic: u32,
    version: u32,
    mode: c_int,
    psk: *const c_char,
}

/// `NCCL_API_MAGIC`, which NCCL's versioned structs carry.
const NCCL_API_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_ENCRYPTION_MODE_NONE` and `NCCL_ENCRYPTION_MODE_PSK`.
const ENCRYPTION_NONE: c_int = 0;
const ENCRYPTION_PSK: c_int = 1;

/// Encrypt (mode PSK) or stop encrypting (mode NONE) the jobs of ids made and communicators
/// joined afterwards in this process: roccl's `ROCCL_ENCRYPT` (docs/SECURITY.md), with the
/// pre-shared key mixed into the job key, so every rank must call it with the same key
/// (the rank that makes the unique id before `ncclGetUniqueId`, every other before joining).
#[no_mangle]
pub unsafe extern "C" fn ncclSetEncryption(config: *const c_void) -> ncclResult_t {
    boundary("ncclSetEncryption", || {
        if config.is_null() {
            return fail(INVALID_ARGUMENT, "ncclSetEncryption: config is NULL");
        }
        // SAFETY: a non-NULL config points at the caller's struct, whose first field is its
        // size in bytes; only the fields that size covers are read below.
        let size = unsafe { *(config as *const usize) };
        if size < std::mem::size_of::<NcclEncryptionConfig>() {
            return fail(
                INVALID_ARGUMENT,
                &format!(
                    "ncclSetEncryption: config.size is {size}, smaller than ncclEncryptionConfig_t ({} bytes): initialize it with NCCL_ENCRYPTION_CONFIG_INITIALIZER",
                    std::mem::size_of::<NcclEncryptionConfig>()
                ),
            );
        }
        // SAFETY: the caller's struct is at least as large as ours (checked above).
        let c = unsafe { &*(config as *const NcclEncryptionConfig) };
        if c.magic != NCCL_API_MAGIC {
            return fail(
                INVALID_ARGUMENT,
                &format!(
                    "ncclSetEncryption: config.magic is {:#x}, not NCCL_API_MAGIC: initialize the config with NCCL_ENCRYPTION_CONFIG_INITIALIZER",
                    c.magic
                ),
            );
        }
        match c.mode {
            ENCRYPTION_NONE => {
                // Without a key nothing can be refused.
                let _ = roccl_core::bootstrap::seal::set(false, None);
                0
            }
            ENCRYPTION_PSK if c.psk.is_null() => fail(
                INVALID_ARGUMENT,
                "ncclSetEncryption: mode NCCL_ENCRYPTION_MODE_PSK needs config.psk (the pre-shared key, a NUL-terminated string every rank gives alike)",
            ),
            ENCRYPTION_PSK => {
                // SAFETY: a non-NULL psk is a NUL-terminated string, per the API.
                let psk = unsafe { CStr::from_ptr(c.psk) }.to_bytes();
                match roccl_core::bootstrap::seal::set(true, Some(psk)) {
                    Ok(()) => 0,
                    Err(e) => fail(INVALID_ARGUMENT, &format!("ncclSetEncryption: {e}")),
                }
            }
            m => fail(
                INVALID_ARGUMENT,
                &format!(
                    "ncclSetEncryption: unknown mode {m} (NCCL_ENCRYPTION_MODE_NONE = 0, NCCL_ENCRYPTION_MODE_PSK = 1)"
                ),
            ),
        }
    })
}
