//! NCCL 2.32's host API beyond roccl's own C ABI: suspend and resume, properties, buffer
//! and window registration, `ncclMemAlloc`, gather, scatter and all-to-all, the per-call
//! `*Config` variants, scalable init, and the calls roccl does not have (each a clear
//! `ncclInvalidUsage`). docs/NCCL.md lists every function with its status.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::config::{check_coll, API_MAGIC};
use super::{
    boundary, checked, fail, ncclComm_t, ncclResult_t, ncclStream_t, ncclUniqueId, ncclWindow_t,
    INVALID_ARGUMENT, INVALID_USAGE,
};

// ---------------------------------------------------------------------------------------
// Suspend and resume

/// Suspend: wait for the communicator's work, then refuse calls until `ncclCommResume`
/// (`flags`: `NCCL_SUSPEND_MEM` or 0). roccl keeps no GPU memory per communicator.
#[no_mangle]
pub extern "C" fn ncclCommSuspend(comm: ncclComm_t, flags: c_int) -> ncclResult_t {
    boundary("ncclCommSuspend", || checked(capi::suspend(comm, flags)))
}

/// Resume a suspended communicator.
#[no_mangle]
pub extern "C" fn ncclCommResume(comm: ncclComm_t) -> ncclResult_t {
    boundary("ncclCommResume", || checked(capi::resume(comm)))
}

/// `ncclCommMemStats`: roccl holds no GPU memory per communicator, so every statistic is 0.
#[no_mangle]
pub unsafe extern "C" fn ncclCommMemStats(
    comm: ncclComm_t,
    stat: c_int,
    value: *mut u64,
) -> ncclResult_t {
    boundary("ncclCommMemStats", || {
        if value.is_null() {
            return fail(INVALID_ARGUMENT, "ncclCommMemStats: value is NULL");
        }
        if !(0..=3).contains(&stat) {
            return fail(
                INVALID_ARGUMENT,
                &format!("ncclCommMemStats: unknown statistic {stat} (0 to 3)"),
            );
        }
        if let Err((code, m)) = capi::comm_info(comm) {
            return fail(code, &format!("ncclCommMemStats: {m}"));
        }
        // SAFETY: non-NULL storage for one u64, per the API.
        unsafe { *value = 0 };
        0
    })
}

// ---------------------------------------------------------------------------------------
// Properties

/// `ncclCommProperties_t` as NCCL 2.31.2 lays it out (144 bytes; what vLLM 0.33 declares).
#[repr(C)]
struct Properties {
    size: usize,
    magic: u32,
    version: u32,
    rank: c_int,
    n_ranks: c_int,
    cuda_dev: c_int,
    nvml_dev: c_int,
    device_api_support: bool,
    multimem_support: bool,
    gin_type: c_int,
    n_lsa_teams: c_int,
    host_rma_support: bool,
    railed_gin_type: c_int,
    // NCCL 2.31.0 and later.
    comm_hash: u64,
    gin_min_stride: c_int,
    gin_connection_type: c_int,
    gin_support: [bool; 64],
    dev_comm_runtime_version_size: usize,
}

const _: () = assert!(std::mem::size_of::<Properties>() == 144);
const _: () = assert!(std::mem::offset_of!(Properties, comm_hash) == 56);

/// Fill the caller's properties: only the fields its `version` has and its `size` holds
/// (vLLM declares the 2.31.2 layout and clamps the version to it). roccl has no device API,
/// multimem or GPU-initiated networking: those say so (false / 0).
#[no_mangle]
pub unsafe extern "C" fn ncclCommQueryProperties(
    comm: ncclComm_t,
    props: *mut c_void,
) -> ncclResult_t {
    boundary("ncclCommQueryProperties", || {
        if props.is_null() {
            return fail(INVALID_ARGUMENT, "ncclCommQueryProperties: props is NULL");
        }
        // SAFETY: non-NULL props points at the caller's struct, which starts with its size,
        // magic and version.
        let (size, magic, version) = unsafe {
            let p = props as *const u8;
            (
                *(p as *const usize),
                *(p.add(8) as *const u32),
                *(p.add(12) as *const u32),
            )
        };
        let base_end = std::mem::offset_of!(Properties, comm_hash);
        if magic != API_MAGIC || size < base_end {
            return fail(
                INVALID_ARGUMENT,
                &format!("ncclCommQueryProperties: props was not initialized (size {size}, magic {magic:#x}): set size = sizeof, magic = NCCL_API_MAGIC and version"),
            );
        }
        let (rank, n, hash) = match capi::comm_info(comm) {
            Ok(i) => i,
            Err((code, m)) => return fail(code, &format!("ncclCommQueryProperties: {m}")),
        };
        let mut p = Properties {
            size,
            magic,
            version,
            rank: rank as c_int,
            n_ranks: n as c_int,
            cuda_dev: 0,
            nvml_dev: 0,
            device_api_support: false,
            multimem_support: false,
            gin_type: 0,
            n_lsa_teams: 0,
            host_rma_support: false,
            railed_gin_type: 0,
            comm_hash: hash,
            gin_min_stride: 0,
            gin_connection_type: 0,
            gin_support: [false; 64],
            dev_comm_runtime_version_size: 0,
        };
        // Fields of 2.31.0 and later only for callers of that version with room for them.
        let len = if version >= 23100 && size >= std::mem::size_of::<Properties>() {
            std::mem::size_of::<Properties>()
        } else {
            base_end
        };
        p.size = size;
        // SAFETY: the caller's struct holds at least `len` bytes (its size, checked), and
        // `p` is a plain struct of that layout; the header fields are written back unchanged.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &p as *const Properties as *const u8,
                props as *mut u8,
                len,
            )
        };
        0
    })
}

// ---------------------------------------------------------------------------------------
// Registrations and windows: typed handles that cannot alias after free

/// A registered range of one communicator.
#[derive(Clone, Copy)]
struct Reg {
    comm: usize,
    addr: usize,
    len: usize,
}

/// Live registrations and windows by handle value; values are never reused.
static REGS: Mutex<Option<HashMap<usize, Reg>>> = Mutex::new(None);
static NEXT_REG: AtomicUsize = AtomicUsize::new(0x5247_0000);

fn add_reg(r: Reg) -> usize {
    let h = NEXT_REG.fetch_add(16, Ordering::Relaxed);
    REGS.lock().get_or_insert_with(HashMap::new).insert(h, r);
    h
}

fn take_reg(comm: ncclComm_t, h: *mut c_void) -> Result<Reg, String> {
    let mut m = REGS.lock();
    let map = m.get_or_insert_with(HashMap::new);
    match map.get(&(h as usize)) {
        Some(r) if r.comm == comm as usize => Ok(map.remove(&(h as usize)).expect("present")),
        Some(_) => Err("the handle belongs to another communicator".into()),
        None => Err("not a live registration or window of this library (already deregistered, or never registered)".into()),
    }
}

/// Register `buff..buff+size` with `comm`: roccl's networks register what they send and
/// receive themselves (and cache it), so this records the range and returns a handle that
/// `ncclCommDeregister` releases.
fn register(
    name: &str,
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    out: *mut *mut c_void,
) -> ncclResult_t {
    if out.is_null() {
        return fail(
            INVALID_ARGUMENT,
            &format!("{name}: the handle pointer is NULL"),
        );
    }
    // SAFETY: non-NULL storage for one handle.
    unsafe { *out = std::ptr::null_mut() };
    if buff.is_null() || size == 0 {
        return fail(
            INVALID_ARGUMENT,
            &format!("{name}: buff is NULL or size is 0"),
        );
    }
    if (buff as usize).checked_add(size).is_none() {
        return fail(
            INVALID_ARGUMENT,
            &format!("{name}: buff + size overflows the address space"),
        );
    }
    if let Err((code, m)) = capi::comm_info(comm) {
        return fail(code, &format!("{name}: {m}"));
    }
    let h = add_reg(Reg {
        comm: comm as usize,
        addr: buff as usize,
        len: size,
    });
    // SAFETY: as above.
    unsafe { *out = h as *mut c_void };
    0
}

fn deregister(name: &str, comm: ncclComm_t, h: *mut c_void) -> ncclResult_t {
    match take_reg(comm, h) {
        Ok(_) => 0,
        Err(m) => fail(INVALID_ARGUMENT, &format!("{name}: {m}")),
    }
}

/// Register a buffer (see [`register`]).
#[no_mangle]
pub unsafe extern "C" fn ncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    boundary("ncclCommRegister", || {
        register("ncclCommRegister", comm, buff, size, handle)
    })
}

/// Release a registration of `ncclCommRegister`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    boundary("ncclCommDeregister", || {
        deregister("ncclCommDeregister", comm, handle)
    })
}

/// A window (NCCL ≥ 2.27): a registration collectives may use; roccl's collectives work on
/// it as on any buffer (no symmetric-memory kernels), and `ncclWinGetUserPtr` returns it.
#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    _flags: c_int,
) -> ncclResult_t {
    boundary("ncclCommWindowRegister", || {
        register("ncclCommWindowRegister", comm, buff, size, win)
    })
}

/// Release a window of `ncclCommWindowRegister`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowDeregister(
    comm: ncclComm_t,
    win: ncclWindow_t,
) -> ncclResult_t {
    boundary("ncclCommWindowDeregister", || {
        deregister("ncclCommWindowDeregister", comm, win)
    })
}

/// The buffer a window was registered with.
#[no_mangle]
pub unsafe extern "C" fn ncclWinGetUserPtr(
    comm: ncclComm_t,
    win: ncclWindow_t,
    out: *mut *mut c_void,
) -> ncclResult_t {
    boundary("ncclWinGetUserPtr", || {
        if out.is_null() {
            return fail(INVALID_ARGUMENT, "ncclWinGetUserPtr: outUserPtr is NULL");
        }
        let m = REGS.lock();
        match m.as_ref().and_then(|m| m.get(&(win as usize))) {
            Some(r) if r.comm == comm as usize => {
                // SAFETY: non-NULL storage for one pointer.
                unsafe { *out = r.addr as *mut c_void };
                let _ = r.len;
                0
            }
            _ => fail(
                INVALID_ARGUMENT,
                "ncclWinGetUserPtr: not a live window of this communicator",
            ),
        }
    })
}

// ---------------------------------------------------------------------------------------
// Memory

/// Allocations of `ncclMemAlloc`: host memory (page-aligned), or the GPU runtime's.
enum Mem {
    Host(std::alloc::Layout),
    Device(#[allow(dead_code)] std::sync::Arc<dyn roccl_core::device::Alloc>),
}

static MEMS: Mutex<Option<HashMap<usize, Mem>>> = Mutex::new(None);

/// Allocate `size` bytes for collectives: with a GPU runtime (or `ROCCL_DEVICE=sim`), device
/// memory of that runtime; without one, page-aligned host memory (what roccl's calls take
/// with a NULL stream there).
#[no_mangle]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    boundary("ncclMemAlloc", || {
        if ptr.is_null() {
            return fail(INVALID_ARGUMENT, "ncclMemAlloc: ptr is NULL");
        }
        // SAFETY: non-NULL storage for one pointer.
        unsafe { *ptr = std::ptr::null_mut() };
        if size == 0 {
            return fail(INVALID_ARGUMENT, "ncclMemAlloc: size is 0");
        }
        let (addr, mem) = match capi::runtime() {
            Ok(dev) => match dev.alloc_device(size) {
                Ok(a) => (a.addr(), Mem::Device(a)),
                Err(e) => return fail(super::INTERNAL_ERROR, &format!("ncclMemAlloc: {e}")),
            },
            Err(_) => {
                let Ok(layout) = std::alloc::Layout::from_size_align(size, 4096) else {
                    return fail(
                        INVALID_ARGUMENT,
                        &format!("ncclMemAlloc: {size} bytes is too large"),
                    );
                };
                // SAFETY: a non-zero size, checked above.
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                if p.is_null() {
                    return fail(
                        super::SYSTEM_ERROR,
                        &format!("ncclMemAlloc: out of memory for {size} bytes"),
                    );
                }
                (p as usize, Mem::Host(layout))
            }
        };
        MEMS.lock()
            .get_or_insert_with(HashMap::new)
            .insert(addr, mem);
        // SAFETY: as above.
        unsafe { *ptr = addr as *mut c_void };
        0
    })
}

/// Free memory of `ncclMemAlloc` (NULL is a no-op); any other pointer is refused.
#[no_mangle]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    boundary("ncclMemFree", || {
        if ptr.is_null() {
            return 0;
        }
        let m = MEMS.lock().as_mut().and_then(|m| m.remove(&(ptr as usize)));
        match m {
            Some(Mem::Host(layout)) => {
                // SAFETY: allocated by ncclMemAlloc with this layout and not freed since
                // (it was still in the table).
                unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
                0
            }
            Some(Mem::Device(_)) => 0, // dropped: the runtime frees it
            None => fail(
                INVALID_ARGUMENT,
                "ncclMemFree: not a pointer from ncclMemAlloc (or already freed)",
            ),
        }
    })
}

// ---------------------------------------------------------------------------------------
// Gather, scatter, all-to-all

/// Bytes of one element of NCCL data type `dt` (0 for an unknown one: the C layer refuses
/// it with a message).
fn elem(dt: c_int) -> usize {
    roccl_core::DataType::from_nccl(dt).map_or(0, |d| d.size())
}

/// This rank and the size of `comm`, with `root` checked against it, or the failing code
/// (message set).
fn rooted(name: &str, comm: ncclComm_t, root: c_int) -> Result<(usize, usize), ncclResult_t> {
    let (me, n) = capi::comm_info(comm)
        .map(|(r, n, _)| (r, n))
        .map_err(|(code, m)| fail(code, &format!("{name}: {m}")))?;
    if root < 0 || root as usize >= n {
        return Err(fail(
            INVALID_ARGUMENT,
            &format!("{name}: root {root} is out of range for {n} ranks"),
        ));
    }
    Ok((me, n))
}

/// Run `body` (sends and receives) as one group, as NCCL builds gather and scatter.
fn grouped(body: impl FnOnce() -> ncclResult_t) -> ncclResult_t {
    let r = checked(capi::rocclGroupStart());
    if r != 0 {
        return r;
    }
    let b = body();
    let e = checked(capi::rocclGroupEnd());
    if b != 0 {
        b
    } else {
        e
    }
}

/// Gather: every rank's `count` elements to `root`, rank `i`'s at `recvbuff + i·count`.
#[no_mangle]
pub unsafe extern "C" fn ncclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: ncclStream_t,
) -> ncclResult_t {
    boundary("ncclGather", || {
        let (me, n) = match rooted("ncclGather", comm, root) {
            Ok(s) => s,
            Err(r) => return r,
        };
        let block = count.saturating_mul(elem(datatype));
        grouped(|| {
            if me == root as usize {
                for r in 0..n {
                    let at = (recvbuff as usize).wrapping_add(r * block) as *mut c_void;
                    if r == me && std::ptr::eq(at, sendbuff) {
                        continue; // in place
                    }
                    // SAFETY: forwarded; the C layer checks the arguments.
                    let x = checked(unsafe {
                        capi::rocclRecv(at, count, datatype, r as c_int, comm, stream)
                    });
                    if x != 0 {
                        return x;
                    }
                }
            }
            let own_in_place = me == root as usize
                && sendbuff == (recvbuff as usize).wrapping_add(me * block) as *const c_void;
            if own_in_place {
                return 0;
            }
            // SAFETY: forwarded; the C layer checks the arguments.
            checked(unsafe { capi::rocclSend(sendbuff, count, datatype, root, comm, stream) })
        })
    })
}

/// Scatter: `root` sends `sendbuff + i·count` (`count` elements) to rank `i`.
#[no_mangle]
pub unsafe extern "C" fn ncclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: ncclStream_t,
) -> ncclResult_t {
    boundary("ncclScatter", || {
        let (me, n) = match rooted("ncclScatter", comm, root) {
            Ok(s) => s,
            Err(r) => return r,
        };
        let block = count.saturating_mul(elem(datatype));
        grouped(|| {
            let own_in_place = me == root as usize
                && std::ptr::eq(
                    recvbuff,
                    (sendbuff as usize).wrapping_add(me * block) as *const c_void,
                );
            if me == root as usize {
                for r in 0..n {
                    if r == me && own_in_place {
                        continue;
                    }
                    let at = (sendbuff as usize).wrapping_add(r * block) as *const c_void;
                    // SAFETY: forwarded; the C layer checks the arguments.
                    let x = checked(unsafe {
                        capi::rocclSend(at, count, datatype, r as c_int, comm, stream)
                    });
                    if x != 0 {
                        return x;
                    }
                }
            }
            if own_in_place {
                return 0;
            }
            // SAFETY: forwarded; the C layer checks the arguments.
            checked(unsafe { capi::rocclRecv(recvbuff, count, datatype, root, comm, stream) })
        })
    })
}

/// All-to-all: block `j` (`count` elements) of `sendbuff` to rank `j`.
#[no_mangle]
pub unsafe extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    comm: ncclComm_t,
    stream: ncclStream_t,
) -> ncclResult_t {
    boundary("ncclAlltoAll", || {
        // SAFETY: forwarded; the C layer checks the arguments.
        checked(unsafe { capi::rocclAlltoAll(sendbuff, recvbuff, count, datatype, comm, stream) })
    })
}

/// The `*Config` variants: the config checked, then the plain call.
macro_rules! with_config {
    ($( $(#[$m:meta])* fn $name:ident => $($plain:ident)::+ ( $($a:ident : $t:ty),* ); )*) => {$(
        $(#[$m])*
        #[no_mangle]
        pub unsafe extern "C" fn $name($($a: $t,)* config: *const c_void) -> ncclResult_t {
            boundary(stringify!($name), || {
                if let Err(r) = check_coll(config, stringify!($name)) {
                    return r;
                }
                // SAFETY: forwarded with the same contract.
                unsafe { $($plain)::+($($a),*) }
            })
        }
    )*};
}

with_config! {
    /// All-reduce with a per-call config.
    fn ncclAllReduceConfig => super::ncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// Broadcast with a per-call config.
    fn ncclBroadcastConfig => super::ncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// Reduce with a per-call config.
    fn ncclReduceConfig => super::ncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// All-gather with a per-call config.
    fn ncclAllGatherConfig => super::ncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// Reduce-scatter with a per-call config.
    fn ncclReduceScatterConfig => super::ncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: c_int, op: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// All-to-all with a per-call config.
    fn ncclAlltoAllConfig => ncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// Gather with a per-call config.
    fn ncclGatherConfig => ncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: ncclStream_t);
    /// Scatter with a per-call config.
    fn ncclScatterConfig => ncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: ncclStream_t);
}

// ---------------------------------------------------------------------------------------
// Init variants

/// Init from one of several unique ids (every rank passes the same list): roccl's
/// rendezvous needs one root, so the first id's serves everyone.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    newcomm: *mut ncclComm_t,
    nranks: c_int,
    myrank: c_int,
    n_id: c_int,
    comm_ids: *mut ncclUniqueId,
    config: *mut c_void,
) -> ncclResult_t {
    boundary("ncclCommInitRankScalable", || {
        if n_id < 1 || comm_ids.is_null() {
            return fail(INVALID_ARGUMENT, &format!("ncclCommInitRankScalable: nId is {n_id} and commIds is {} (need at least one id)", if comm_ids.is_null() { "NULL" } else { "set" }));
        }
        // SAFETY: non-NULL array of at least one id, per the API.
        let id = unsafe { *comm_ids };
        // SAFETY: forwarded with the same contract.
        unsafe { super::ncclCommInitRankConfig(newcomm, nranks, id, myrank, config) }
    })
}

// ---------------------------------------------------------------------------------------
// Shrink, grow, revoke (capi's reshape module; the core's comm::reshape)

/// A new communicator without the excluded ranks (usable after they died; with
/// `NCCL_SHRINK_ABORT` the parent's calls still waiting on them end first).
#[no_mangle]
pub unsafe extern "C" fn ncclCommShrink(
    comm: ncclComm_t,
    exclude: *mut c_int,
    n_exclude: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut c_void,
    flags: c_int,
) -> ncclResult_t {
    boundary("ncclCommShrink", || {
        let c = match super::config::read(config, "ncclCommShrink") {
            Ok(c) => c,
            Err(r) => return r,
        };
        let p = c
            .as_ref()
            .map_or(std::ptr::null(), |c| &c.roccl as *const _);
        // SAFETY: forwarded with the same contract; `p` is NULL or points at `c`, alive here.
        checked(unsafe { capi::reshape::shrink(comm, exclude, n_exclude, newcomm, p, flags) })
    })
}

/// Stop the communicator's work: only shrink, destroy and abort remain.
#[no_mangle]
pub extern "C" fn ncclCommRevoke(comm: ncclComm_t, flags: c_int) -> ncclResult_t {
    boundary("ncclCommRevoke", || {
        checked(capi::reshape::revoke(comm, flags))
    })
}

/// The id the new ranks of the communicator's next grow join with.
#[no_mangle]
pub unsafe extern "C" fn ncclCommGetUniqueId(
    comm: ncclComm_t,
    id: *mut ncclUniqueId,
) -> ncclResult_t {
    boundary("ncclCommGetUniqueId", || {
        // SAFETY: forwarded with the same contract.
        checked(unsafe { capi::reshape::grow_id(comm, id) })
    })
}

/// Grow the communicator to `nranks` ranks (existing ranks: `comm`, rank -1; new ranks:
/// NULL, the id of ncclCommGetUniqueId and their rank).
#[no_mangle]
pub unsafe extern "C" fn ncclCommGrow(
    comm: ncclComm_t,
    nranks: c_int,
    id: *const ncclUniqueId,
    rank: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut c_void,
) -> ncclResult_t {
    boundary("ncclCommGrow", || {
        let c = match super::config::read(config, "ncclCommGrow") {
            Ok(c) => c,
            Err(r) => return r,
        };
        let p = c
            .as_ref()
            .map_or(std::ptr::null(), |c| &c.roccl as *const _);
        // SAFETY: forwarded with the same contract; `p` is NULL or points at `c`, alive here.
        checked(unsafe { capi::reshape::grow(comm, nranks, id, rank, newcomm, p) })
    })
}

/// A reduction that sums each rank's input times `scalar` (capi's premul module).
#[no_mangle]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut c_int,
    scalar: *mut c_void,
    datatype: c_int,
    residence: c_int,
    comm: ncclComm_t,
) -> ncclResult_t {
    boundary("ncclRedOpCreatePreMulSum", || {
        // SAFETY: forwarded with the same contract.
        checked(unsafe { capi::premul::create(op, scalar, datatype, residence, comm) })
    })
}

/// Forget an op of ncclRedOpCreatePreMulSum.
#[no_mangle]
pub extern "C" fn ncclRedOpDestroy(op: c_int, comm: ncclComm_t) -> ncclResult_t {
    boundary("ncclRedOpDestroy", || {
        checked(capi::premul::destroy(op, comm))
    })
}

// ---------------------------------------------------------------------------------------
// What roccl does not have (yet): clear errors

macro_rules! missing {
    ($( $(#[$m:meta])* fn $name:ident ( $($a:ident : $t:ty),* ) => $why:expr; )*) => {$(
        $(#[$m])*
        #[no_mangle]
        pub unsafe extern "C" fn $name($($a: $t),*) -> ncclResult_t {
            $( let _ = $a; )*
            boundary(stringify!($name), || {
                fail(INVALID_USAGE, concat!(stringify!($name), ": ", $why))
            })
        }
    )*};
}

missing! {
    /// Not in roccl.
    fn ncclPutSignal(local: *const c_void, count: usize, datatype: c_int, peer: c_int, win: ncclWindow_t, off: usize, sig: c_int, ctx: c_int, flags: u32, comm: ncclComm_t, stream: ncclStream_t)
        => "one-sided operations are not supported by roccl: use ncclSend/ncclRecv (docs/NCCL.md)";
    /// Not in roccl.
    fn ncclSignal(peer: c_int, sig: c_int, ctx: c_int, flags: u32, comm: ncclComm_t, stream: ncclStream_t)
        => "one-sided operations are not supported by roccl: use ncclSend/ncclRecv (docs/NCCL.md)";
    /// Not in roccl.
    fn ncclWaitSignal(n: c_int, descs: *mut c_void, comm: ncclComm_t, stream: ncclStream_t)
        => "one-sided operations are not supported by roccl: use ncclSend/ncclRecv (docs/NCCL.md)";
    /// Not in roccl.
    fn ncclGroupSimulateEnd(info: *mut c_void)
        => "not supported by roccl: call ncclGroupEnd (roccl-perf measures what a call costs)";
    /// Not in roccl.
    fn ncclParamBind(out: *mut *mut c_void, key: *const c_char)
        => "NCCL's parameter API is not supported: roccl's settings are ROCCL_* variables (README)";
    /// Not in roccl.
    fn ncclParamGetStr(h: *mut c_void, out: *mut *const c_char)
        => "NCCL's parameter API is not supported: roccl's settings are ROCCL_* variables (README)";
    /// Not in roccl.
    fn ncclParamGet(h: *mut c_void, out: *mut c_void, max: c_int, len: *mut c_int)
        => "NCCL's parameter API is not supported: roccl's settings are ROCCL_* variables (README)";
    /// Not in roccl.
    fn ncclParamGetParameter(key: *const c_char, value: *mut *const c_char, len: *mut c_int)
        => "NCCL's parameter API is not supported: roccl's settings are ROCCL_* variables (README)";
    /// Not in roccl.
    fn ncclParamGetAllParameterKeys(table: *mut *mut *const c_char, len: *mut c_int)
        => "NCCL's parameter API is not supported: roccl's settings are ROCCL_* variables (README)";
}

/// NCCL's parameter dump: roccl's settings are the ROCCL_* variables; this prints nothing.
#[no_mangle]
pub extern "C" fn ncclParamDumpAll() {}

/// Re-read NCCL's debug settings: roccl reads `ROCCL_DEBUG` when it logs; nothing to do.
#[no_mangle]
pub extern "C" fn ncclResetDebugInit() {}
