//! roccl's networks as an NCCL/RCCL network plugin: `libnccl-net-roccl.so` (NCCL,
//! `NCCL_NET_PLUGIN=roccl`) and `librccl-net-roccl.so` (RCCL) export `ncclNetPlugin_v8` to
//! `ncclNetPlugin_v12`, each with the exact layout of that version of NCCL's `net_vN.h`.
//!
//! One adapter per version over the core's `Net` trait (which has ncclNet semantics), all
//! sharing the functions below; nothing is written twice per version. The network is the
//! core's choice (`ROCCL_NET`: a RoCE v2 NIC through libibverbs when the `verbs` feature is
//! built and a device is usable, else TCP; `rocev2` for RoCE v2 in userspace).
//!
//! Handles NCCL holds (comms, requests, memory handles, contexts) are tokens, not pointers:
//! a NULL, closed or foreign handle is found missing in a table and answered with
//! `ncclInvalidArgument`, never dereferenced. Every exported function runs inside a panic
//! boundary (`ncclInternalError`). Logs go to NCCL's logger once `init` gave one.
#![deny(missing_docs)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_ulong, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use roccl_core::net::{
    self, Connecting, ListenComm, MemHandle, Net, NetHandle, NetKind, RecvBuf, RecvComm, ReqId,
    SendComm, HANDLE_MAX, MAX_RECVS, MAX_REQUESTS,
};

mod abi;
pub use abi::*;

/// ncclResult_t.
pub type NcclResult = c_int;
const SUCCESS: NcclResult = 0;
const SYSTEM_ERROR: NcclResult = 2;
const INTERNAL_ERROR: NcclResult = 3;
const INVALID_ARGUMENT: NcclResult = 4;
const INVALID_USAGE: NcclResult = 5;
const REMOTE_ERROR: NcclResult = 6;

/// NCCL_PTR_HOST.
const PTR_HOST: c_int = 0x1;
/// NCCL_PTR_CUDA (GPU memory, CUDA or HIP).
const PTR_CUDA: c_int = 0x2;
/// NCCL_PTR_DMABUF.
const PTR_DMABUF: c_int = 0x4;
/// Largest message per request: the RDMA network's immediate carries the size in 29 bits.
const MAX_BYTES: usize = 1 << 28;
/// Bytes of the connection handle where a connect in progress keeps its state (NCCL passes
/// the same handle to every `connect` call of one connection).
const STAGE_AT: usize = 112;
const STAGE_MAGIC: u32 = 0x4754_5352; // "RSTG"

/// NCCL's logger: `void (*)(ncclDebugLogLevel, unsigned long flags, const char* file,
/// int line, const char* fmt, ...)`.
pub type Logger =
    Option<unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...)>;

/// Levels and subsystem flags of NCCL's logger.
const LOG_WARN: c_int = 2;
const LOG_INFO: c_int = 3;
const NCCL_INIT: c_ulong = 0x1;
const NCCL_NET: c_ulong = 0x10;

struct Error(NcclResult, String);

type R<T> = std::result::Result<T, Error>;

fn code_of(e: &roccl_core::Error) -> NcclResult {
    use roccl_core::error::ErrorKind as K;
    match e.kind() {
        K::InvalidArgument => INVALID_ARGUMENT,
        K::InvalidUsage => INVALID_USAGE,
        K::System | K::Timeout => SYSTEM_ERROR,
        K::Remote => REMOTE_ERROR,
        K::Internal => INTERNAL_ERROR,
    }
}

impl From<roccl_core::Error> for Error {
    fn from(e: roccl_core::Error) -> Error {
        Error(code_of(&e), e.to_string())
    }
}

fn bad(msg: impl Into<String>) -> Error {
    Error(INVALID_ARGUMENT, msg.into())
}

/// Run `f` inside a panic boundary; errors are logged and become their result codes.
fn guard(what: &str, f: impl FnOnce() -> R<()>) -> NcclResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(Error(code, msg))) => {
            if msg.starts_with(what) {
                warn(&format!("NET/roccl: {msg}"));
            } else {
                warn(&format!("NET/roccl: {what}: {msg}"));
            }
            code
        }
        Err(_) => {
            warn(&format!("NET/roccl: {what}: internal error (panic caught)"));
            INTERNAL_ERROR
        }
    }
}

static LOGGER: OnceLock<usize> = OnceLock::new();

fn emit(level: c_int, msg: &str) {
    let Some(&f) = LOGGER.get() else {
        if level == LOG_WARN {
            // Not `eprintln!`: it panics when stderr fails (a closed pipe).
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "{msg}");
        }
        return;
    };
    // SAFETY: the value was stored from a non-null logger of this type in `set_logger`.
    let f: unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...) =
        unsafe { std::mem::transmute::<usize, _>(f) };
    let text = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // SAFETY: NCCL's logger takes a printf format; "%s" with one C string argument.
    unsafe {
        f(
            level,
            NCCL_NET | NCCL_INIT,
            c"roccl".as_ptr(),
            0,
            c"%s".as_ptr(),
            text.as_ptr(),
        )
    };
}

fn warn(msg: &str) {
    emit(LOG_WARN, msg);
}

fn set_logger(l: Logger) {
    if let Some(f) = l {
        if LOGGER.set(f as usize).is_ok() {
            // The core's own log lines go to NCCL's logger too.
            roccl_core::log::set_sink(Box::new(|lvl, m| {
                let level = match lvl {
                    roccl_core::log::Level::Warn => LOG_WARN,
                    roccl_core::log::Level::Info => LOG_INFO,
                };
                emit(level, &format!("NET/roccl: {m}"));
            }));
        }
    }
}

/// The network every version's functions share, opened by the first `init`.
struct Plugin {
    net: Arc<dyn Net>,
    /// GPU memory is advertised (peer memory or dmabuf on some device).
    device_ptrs: bool,
    names: Vec<CString>,
    pci: Vec<Option<CString>>,
}

static PLUGIN: Mutex<Option<Arc<Plugin>>> = Mutex::new(None);

fn plugin() -> R<Arc<Plugin>> {
    PLUGIN.lock().clone().ok_or_else(|| {
        Error(
            INVALID_USAGE,
            "the plugin was not initialized (init)".into(),
        )
    })
}

fn init_impl(logger: Logger) -> R<()> {
    set_logger(logger);
    let mut p = PLUGIN.lock();
    if p.is_some() {
        return Ok(());
    }
    // Every ROCCL_* setting strictly, as communicator init does.
    roccl_core::comm::settings::check_with(&roccl_core::envvar::from_process)?;
    let kind: NetKind = roccl_core::envvar::get("ROCCL_NET")?.unwrap_or(NetKind::Auto);
    let ip = roccl_core::bootstrap::ifaces::local_addr(None)?;
    let settings = net::NetSettings::from_lookup(&roccl_core::envvar::from_process)?;
    let net = net::open(kind, ip, &settings).map_err(|e| {
        Error(
            SYSTEM_ERROR,
            format!("no usable network ({e}); NCCL falls back to its own networks"),
        )
    })?;
    let n = net.devices();
    if n == 0 {
        return Err(Error(
            SYSTEM_ERROR,
            format!(
                "network {} has no device; NCCL falls back to its own networks",
                net.name()
            ),
        ));
    }
    let mut names = Vec::new();
    let mut pci = Vec::new();
    let mut device_ptrs = false;
    for d in 0..n {
        let pr = net.properties(d)?;
        device_ptrs |= pr.ptr_support.device || pr.ptr_support.dmabuf;
        names.push(CString::new(pr.name.replace('\0', " ")).unwrap_or_default());
        pci.push(pr.pci_path.and_then(|s| CString::new(s).ok()));
    }
    emit(
        LOG_INFO,
        &format!(
            "NET/roccl: using {} ({}), {n} device(s), on {ip}",
            net.name(),
            names[0].to_string_lossy()
        ),
    );
    if device_ptrs {
        // NCCL may now post GPU memory: no CPU copies on the data path.
        net.expect_device_buffers();
    }
    *p = Some(Arc::new(Plugin {
        net,
        device_ptrs,
        names,
        pci,
    }));
    Ok(())
}

/// The per-version property structs, filled from one place.
pub trait PropsOut {
    /// Write the common fields.
    fn fill(&mut self, c: &CommonProps);
}

/// Properties common to every version.
pub struct CommonProps {
    name: *mut c_char,
    pci: *mut c_char,
    guid: u64,
    ptr_support: c_int,
    speed: c_int,
    port: c_int,
    latency: f32,
    max_comms: c_int,
    max_recvs: c_int,
    dev: c_int,
    max_bytes: usize,
}

fn properties_impl<P: PropsOut>(dev: c_int, out: *mut P) -> R<()> {
    if out.is_null() {
        return Err(bad("getProperties: props is NULL"));
    }
    let p = plugin()?;
    let d = usize::try_from(dev)
        .ok()
        .filter(|d| *d < p.names.len())
        .ok_or_else(|| {
            bad(format!(
                "getProperties: no device {dev} (there are {})",
                p.names.len()
            ))
        })?;
    let pr = p.net.properties(d)?;
    // GPU memory through the NIC's peer-memory support or dmabuf (ibv_reg_dmabuf_mr);
    // without either, NCCL stages GPU buffers through host memory.
    let ps = pr.ptr_support;
    let ptr_support = if ps.host { PTR_HOST } else { 0 }
        | if ps.device || ps.dmabuf { PTR_CUDA } else { 0 }
        | if ps.dmabuf { PTR_DMABUF } else { 0 };
    let c = CommonProps {
        name: p.names[d].as_ptr() as *mut c_char,
        pci: p.pci[d]
            .as_ref()
            .map_or(std::ptr::null_mut(), |s| s.as_ptr() as *mut c_char),
        guid: pr.guid,
        ptr_support,
        speed: pr.speed_mbps as c_int,
        port: pr.port as c_int,
        latency: pr.latency_us as f32,
        max_comms: pr.max_comms.min(i32::MAX as u32) as c_int,
        max_recvs: pr.max_recvs.clamp(1, MAX_RECVS as u32) as c_int,
        dev,
        max_bytes: MAX_BYTES,
    };
    // SAFETY: `out` is non-null and points to NCCL's properties struct of this version.
    unsafe {
        std::ptr::write_bytes(out, 0, 1);
        (*out).fill(&c);
    }
    Ok(())
}

/// What a token stands for.
enum Obj {
    Listen(Box<dyn ListenComm>),
    Connecting(Box<dyn Connecting>),
    Send(Box<SendW>),
    Recv(Box<RecvW>),
    Context,
}

struct SendW {
    c: Box<dyn SendComm>,
    reqs: [Option<ReqId>; MAX_REQUESTS],
    mrs: Mrs,
}

/// A request on a receive comm: a grouped receive of `n` buffers, or a flush.
#[derive(Clone, Copy)]
enum RecvReq {
    Recv(ReqId, u8),
    Flush(u64),
}

struct RecvW {
    c: Box<dyn RecvComm>,
    reqs: [Option<RecvReq>; MAX_REQUESTS],
    mrs: Mrs,
}

/// Registrations of one comm: key → (handle, users), and (addr, len) → key, so that the
/// same buffer registered again shares its registration (the cache NCCL's regMr expects).
#[derive(Default)]
struct Mrs {
    next: u64,
    by_key: HashMap<u64, (MemHandle, u32)>,
    by_range: HashMap<(usize, usize), u64>,
}

type Shared = Arc<Mutex<Obj>>;

/// Live objects by token id.
struct Registry {
    next: u64,
    objs: HashMap<u64, Shared>,
}

static REG: Mutex<Option<Registry>> = Mutex::new(None);

/// Tokens: id << 8 for objects, | (slot + 1) for requests; never NULL.
fn token(id: u64) -> *mut c_void {
    (id << 8) as usize as *mut c_void
}

fn insert(o: Obj) -> *mut c_void {
    let mut g = REG.lock();
    let r = g.get_or_insert_with(|| Registry {
        next: 1,
        objs: HashMap::new(),
    });
    let id = r.next;
    r.next += 1;
    r.objs.insert(id, Arc::new(Mutex::new(o)));
    token(id)
}

fn lookup(p: *mut c_void, what: &str) -> R<(u64, Shared)> {
    let t = p as usize as u64;
    if p.is_null() {
        return Err(bad(format!("{what} is NULL")));
    }
    let id = t >> 8;
    REG.lock()
        .as_ref()
        .and_then(|r| r.objs.get(&id).cloned())
        .map(|o| (id, o))
        .ok_or_else(|| {
            bad(format!(
                "{what} {p:?} is not a live roccl object (closed twice, or never ours)"
            ))
        })
}

fn remove(p: *mut c_void, what: &str) -> R<Shared> {
    let (id, _) = lookup(p, what)?;
    if (p as usize) & 0xff != 0 {
        return Err(bad(format!("{what} {p:?} is a request, not a comm")));
    }
    REG.lock()
        .as_mut()
        .and_then(|r| r.objs.remove(&id))
        .ok_or_else(|| bad(format!("{what} {p:?} was closed concurrently")))
}

fn out_ptr<T>(p: *mut *mut T, what: &str) -> R<()> {
    if p.is_null() {
        Err(bad(format!("{what} (output pointer) is NULL")))
    } else {
        Ok(())
    }
}

fn set_out<T>(p: *mut *mut T, v: *mut T) {
    // SAFETY: checked non-null by `out_ptr` before; NCCL passes a writable pointer.
    unsafe { *p = v };
}

fn listen_impl(dev: c_int, handle: *mut c_void, listen: *mut *mut c_void) -> R<()> {
    out_ptr(listen, "listenComm")?;
    if handle.is_null() {
        return Err(bad("listen: handle is NULL"));
    }
    let p = plugin()?;
    let d = usize::try_from(dev).map_err(|_| bad(format!("listen: bad device {dev}")))?;
    let (h, l) = p.net.listen(d)?;
    // SAFETY: NCCL's handle buffer holds NCCL_NET_HANDLE_MAXSIZE (128) bytes.
    unsafe { std::ptr::copy_nonoverlapping(h.as_bytes().as_ptr(), handle as *mut u8, HANDLE_MAX) };
    set_out(listen, insert(Obj::Listen(l)));
    Ok(())
}

fn connect_impl(dev: c_int, handle: *mut c_void, send: *mut *mut c_void) -> R<()> {
    out_ptr(send, "sendComm")?;
    set_out(send, std::ptr::null_mut());
    if handle.is_null() {
        return Err(bad("connect: handle is NULL"));
    }
    // SAFETY: NCCL's handle buffer holds 128 writable bytes.
    let h = unsafe { std::slice::from_raw_parts_mut(handle as *mut u8, HANDLE_MAX) };
    let stage_magic = u32::from_le_bytes(h[STAGE_AT..STAGE_AT + 4].try_into().unwrap());
    let conn = if stage_magic == STAGE_MAGIC {
        let t = u64::from_le_bytes(h[STAGE_AT + 8..STAGE_AT + 16].try_into().unwrap());
        t as usize as *mut c_void
    } else {
        let p = plugin()?;
        let d = usize::try_from(dev).map_err(|_| bad(format!("connect: bad device {dev}")))?;
        let mut nh = [0u8; HANDLE_MAX];
        nh[..STAGE_AT].copy_from_slice(&h[..STAGE_AT]);
        let c = p.net.connect(d, &NetHandle::from_bytes(&nh)?)?;
        let t = insert(Obj::Connecting(c));
        h[STAGE_AT..STAGE_AT + 4].copy_from_slice(&STAGE_MAGIC.to_le_bytes());
        h[STAGE_AT + 8..STAGE_AT + 16].copy_from_slice(&(t as usize as u64).to_le_bytes());
        t
    };
    let (_, o) = lookup(conn, "connect in progress")?;
    let done = {
        let mut g = o.lock();
        let Obj::Connecting(c) = &mut *g else {
            return Err(bad(
                "connect: the handle's stage is not a connection in progress",
            ));
        };
        match c.poll() {
            Ok(d) => d,
            Err(e) => {
                drop(g);
                let _ = remove(conn, "connect in progress");
                h[STAGE_AT..].fill(0);
                return Err(e.into());
            }
        }
    };
    if let Some(s) = done {
        let _ = remove(conn, "connect in progress");
        h[STAGE_AT..].fill(0);
        set_out(
            send,
            insert(Obj::Send(Box::new(SendW {
                c: s,
                reqs: [None; MAX_REQUESTS],
                mrs: Mrs::default(),
            }))),
        );
    }
    Ok(())
}

fn accept_impl(listen: *mut c_void, recv: *mut *mut c_void) -> R<()> {
    out_ptr(recv, "recvComm")?;
    set_out(recv, std::ptr::null_mut());
    let (_, o) = lookup(listen, "listenComm")?;
    let r = {
        let mut g = o.lock();
        let Obj::Listen(l) = &mut *g else {
            return Err(bad("accept: not a listen comm"));
        };
        l.accept()?
    };
    if let Some(r) = r {
        set_out(
            recv,
            insert(Obj::Recv(Box::new(RecvW {
                c: r,
                reqs: [None; MAX_REQUESTS],
                mrs: Mrs::default(),
            }))),
        );
    }
    Ok(())
}

fn reg_mr_impl(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    typ: c_int,
    mh: *mut *mut c_void,
) -> R<()> {
    register(comm, data, size, typ, None, mh, "regMr")
}

fn reg_mr_dmabuf_impl(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    typ: c_int,
    offset: u64,
    fd: c_int,
    mh: *mut *mut c_void,
) -> R<()> {
    if fd < 0 {
        return Err(bad(format!("regMrDmaBuf: fd {fd} is not a dmabuf")));
    }
    register(comm, data, size, typ, Some((fd, offset)), mh, "regMrDmaBuf")
}

/// `regMr` / `regMrDmaBuf`: host memory, or GPU memory (`NCCL_PTR_CUDA`) through peer
/// memory or the dmabuf `fd`.
fn register(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    typ: c_int,
    dmabuf: Option<(c_int, u64)>,
    mh: *mut *mut c_void,
    what: &str,
) -> R<()> {
    out_ptr(mh, "mhandle")?;
    let device = match typ {
        PTR_HOST if dmabuf.is_none() => false,
        PTR_CUDA => true,
        _ => {
            return Err(bad(format!(
                "{what}: memory type {typ} is not NCCL_PTR_HOST or NCCL_PTR_CUDA"
            )))
        }
    };
    if device && !plugin()?.device_ptrs {
        return Err(bad(format!(
            "{what}: GPU memory, but this network does not advertise it (no dmabuf or peer-memory support on the NIC, or the userspace engine): NCCL should stage it through host memory"
        )));
    }
    let (_, o) = lookup(comm, "comm")?;
    let mut g = o.lock();
    let (a, l) = (data as usize, size);
    // SAFETY (each registration below): NCCL's regMr/regMrDmaBuf contract — `data..data +
    // size` (and the dmabuf `fd` covering it) stays valid until NCCL deregisters it
    // (deregMr) or closes the comm; a range registered more than once is released only at
    // its last deregMr (`Mrs`), and closing the comm releases what is left.
    let k = match &mut *g {
        Obj::Send(s) if device => {
            // SAFETY: NCCL's contract, above.
            let reg = |a, l| unsafe { s.c.reg_mr_device(a, l, dmabuf) };
            Mrs::reg(&mut s.mrs, reg, a, l)?
        }
        Obj::Recv(r) if device => {
            // SAFETY: NCCL's contract, above.
            let reg = |a, l| unsafe { r.c.reg_mr_device(a, l, dmabuf) };
            Mrs::reg(&mut r.mrs, reg, a, l)?
        }
        Obj::Send(s) => {
            // SAFETY: NCCL's contract, above.
            let reg = |a, l| unsafe { s.c.reg_mr(a, l) };
            Mrs::reg(&mut s.mrs, reg, a, l)?
        }
        Obj::Recv(r) => {
            // SAFETY: NCCL's contract, above.
            let reg = |a, l| unsafe { r.c.reg_mr(a, l) };
            Mrs::reg(&mut r.mrs, reg, a, l)?
        }
        _ => return Err(bad(format!("{what}: not a send or receive comm"))),
    };
    set_out(mh, k as usize as *mut c_void);
    Ok(())
}

impl Mrs {
    /// Register (or share) `addr..addr+len`; returns the nonzero key.
    fn reg(
        mrs: &mut Mrs,
        mut reg: impl FnMut(usize, usize) -> roccl_core::Result<MemHandle>,
        addr: usize,
        len: usize,
    ) -> R<u64> {
        if let Some(&k) = mrs.by_range.get(&(addr, len)) {
            if let Some(e) = mrs.by_key.get_mut(&k) {
                e.1 += 1;
                return Ok(k);
            }
        }
        let m = reg(addr, len)?;
        mrs.next += 1;
        let k = mrs.next;
        mrs.by_key.insert(k, (m, 1));
        mrs.by_range.insert((addr, len), k);
        Ok(k)
    }

    /// Drop one use of `key`; the last one deregisters.
    fn dereg(
        &mut self,
        key: u64,
        dereg: impl FnOnce(MemHandle) -> roccl_core::Result<()>,
    ) -> R<()> {
        let e = self.by_key.get_mut(&key).ok_or_else(|| {
            bad(format!(
                "deregMr: mhandle {key:#x} is not registered on this comm"
            ))
        })?;
        e.1 -= 1;
        if e.1 == 0 {
            let (m, _) = self.by_key.remove(&key).expect("present");
            self.by_range.retain(|_, v| *v != key);
            dereg(m)?;
        }
        Ok(())
    }

    fn get(&self, mh: *mut c_void) -> R<Option<&MemHandle>> {
        if mh.is_null() {
            return Ok(None);
        }
        self.by_key
            .get(&(mh as usize as u64))
            .map(|e| Some(&e.0))
            .ok_or_else(|| {
                bad(format!(
                    "mhandle {mh:?} was not registered on this comm (or was deregistered)"
                ))
            })
    }
}

fn dereg_mr_impl(comm: *mut c_void, mh: *mut c_void) -> R<()> {
    let (_, o) = lookup(comm, "comm")?;
    let mut g = o.lock();
    let k = mh as usize as u64;
    match &mut *g {
        Obj::Send(s) => s.mrs.dereg(k, |m| s.c.dereg_mr(m)),
        Obj::Recv(r) => r.mrs.dereg(k, |m| r.c.dereg_mr(m)),
        _ => Err(bad("deregMr: not a send or receive comm")),
    }
}

fn isend_impl(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    req: *mut *mut c_void,
) -> R<()> {
    out_ptr(req, "request")?;
    set_out(req, std::ptr::null_mut());
    if size > MAX_BYTES {
        return Err(bad(format!(
            "isend of {size} bytes exceeds maxP2pBytes ({MAX_BYTES})"
        )));
    }
    if data.is_null() && size > 0 {
        return Err(bad("isend: data is NULL"));
    }
    let (id, o) = lookup(comm, "sendComm")?;
    let mut g = o.lock();
    let Obj::Send(s) = &mut *g else {
        return Err(bad("isend: not a send comm"));
    };
    let Some(slot) = s.reqs.iter().position(Option::is_none) else {
        return Ok(()); // NCCL_NET_MAX_REQUESTS in flight: NULL request, NCCL retries
    };
    let m = s.mrs.get(mh)?;
    // SAFETY: NCCL keeps `data` valid for `size` bytes until the request completes.
    // (None: out of resources, the request stays NULL and NCCL retries.)
    if let Some(r) = unsafe { s.c.isend(data as *const u8, size, tag as u32, m) }? {
        s.reqs[slot] = Some(r);
        set_out(
            req,
            (((id << 8) | (slot as u64 + 1)) as usize) as *mut c_void,
        );
    }
    Ok(())
}

fn irecv_impl(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    size_of: impl Fn(usize) -> usize,
    tags: *mut c_int,
    mhs: *mut *mut c_void,
    req: *mut *mut c_void,
) -> R<()> {
    out_ptr(req, "request")?;
    set_out(req, std::ptr::null_mut());
    let n = usize::try_from(n)
        .ok()
        .filter(|n| (1..=MAX_RECVS).contains(n))
        .ok_or_else(|| bad(format!("irecv: n = {n}, expected 1 to {MAX_RECVS}")))?;
    if data.is_null() || tags.is_null() {
        return Err(bad("irecv: data or tags is NULL"));
    }
    let (id, o) = lookup(comm, "recvComm")?;
    let mut g = o.lock();
    let Obj::Recv(r) = &mut *g else {
        return Err(bad("irecv: not a receive comm"));
    };
    let Some(slot) = r.reqs.iter().position(Option::is_none) else {
        return Ok(());
    };
    let mut bufs = [RecvBuf {
        ptr: std::ptr::null_mut(),
        len: 0,
        tag: 0,
    }; MAX_RECVS];
    for (i, b) in bufs.iter_mut().enumerate().take(n) {
        // SAFETY: NCCL passes arrays of `n` entries.
        let (p, t, m) = unsafe {
            (
                *data.add(i),
                *tags.add(i),
                if mhs.is_null() {
                    std::ptr::null_mut()
                } else {
                    *mhs.add(i)
                },
            )
        };
        r.mrs.get(m)?;
        let len = size_of(i);
        if p.is_null() && len > 0 {
            return Err(bad(format!("irecv: buffer {i} is NULL")));
        }
        *b = RecvBuf {
            ptr: p as *mut u8,
            len,
            tag: t as u32,
        };
    }
    // SAFETY: NCCL keeps the buffers valid until the request completes.
    if let Some(q) = unsafe { r.c.irecv(&bufs[..n]) }? {
        r.reqs[slot] = Some(RecvReq::Recv(q, n as u8));
        set_out(
            req,
            (((id << 8) | (slot as u64 + 1)) as usize) as *mut c_void,
        );
    }
    Ok(())
}

fn iflush_impl(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    req: *mut *mut c_void,
) -> R<()> {
    out_ptr(req, "request")?;
    let n = usize::try_from(n)
        .ok()
        .filter(|n| *n <= MAX_RECVS)
        .ok_or_else(|| bad(format!("iflush: {n} buffers (1 to {MAX_RECVS})")))?;
    if n > 0 && (data.is_null() || sizes.is_null()) {
        return Err(bad("iflush: data or sizes is NULL"));
    }
    let mut bufs = [RecvBuf {
        ptr: std::ptr::null_mut(),
        len: 0,
        tag: 0,
    }; MAX_RECVS];
    for (i, b) in bufs[..n].iter_mut().enumerate() {
        // SAFETY: NCCL passes n pointers and n sizes (non-NULL, checked).
        let (p, l) = unsafe { (*data.add(i), *sizes.add(i)) };
        b.ptr = p.cast();
        b.len = usize::try_from(l).unwrap_or(0);
    }
    let (id, o) = lookup(comm, "recvComm")?;
    let mut g = o.lock();
    let Obj::Recv(r) = &mut *g else {
        return Err(bad("iflush: not a receive comm"));
    };
    // GPU memory registered by this comm is read back through the NIC: the reads are posted
    // and the request completes with them (test). Host memory needs nothing: a NULL request
    // tells NCCL the flush is done. With every request slot taken, flush before returning.
    match r.reqs.iter().position(Option::is_none) {
        Some(slot) => match r.c.iflush(&bufs[..n])? {
            Some(f) => {
                r.reqs[slot] = Some(RecvReq::Flush(f));
                set_out(req, ((id << 8) | (slot as u64 + 1)) as usize as *mut c_void);
            }
            None => set_out(req, std::ptr::null_mut()),
        },
        None => {
            r.c.flush(&bufs[..n], roccl_core::envvar::timeout())?;
            set_out(req, std::ptr::null_mut());
        }
    }
    Ok(())
}

fn test_impl(req: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> R<()> {
    if done.is_null() {
        return Err(bad("test: done is NULL"));
    }
    let t = req as usize as u64;
    let slot = (t & 0xff) as usize;
    if req.is_null() || slot == 0 || slot > MAX_REQUESTS {
        return Err(bad(format!("test: {req:?} is not a request")));
    }
    let (_, o) = lookup(req, "request's comm")?;
    let mut g = o.lock();
    let put = |i: usize, v: usize| {
        if !sizes.is_null() {
            // SAFETY: NCCL passes room for one size per buffer of the request.
            unsafe { *sizes.add(i) = v.min(i32::MAX as usize) as c_int };
        }
    };
    // SAFETY: checked non-null.
    unsafe { *done = 0 };
    match &mut *g {
        Obj::Send(s) => {
            let Some(id) = s.reqs[slot - 1] else {
                return Err(bad(format!("test: request {req:?} already completed")));
            };
            if let Some(n) = s.c.test(id)? {
                s.reqs[slot - 1] = None;
                put(0, n);
                // SAFETY: checked non-null.
                unsafe { *done = 1 };
            }
        }
        Obj::Recv(r) => match r.reqs[slot - 1] {
            None => return Err(bad(format!("test: request {req:?} already completed"))),
            Some(RecvReq::Recv(id, n)) => {
                let mut got = [0usize; MAX_RECVS];
                if r.c.test(id, &mut got[..n as usize])? {
                    r.reqs[slot - 1] = None;
                    for (i, v) in got[..n as usize].iter().enumerate() {
                        put(i, *v);
                    }
                    // SAFETY: checked non-null.
                    unsafe { *done = 1 };
                }
            }
            Some(RecvReq::Flush(f)) => {
                if r.c.test_flush(f)? {
                    r.reqs[slot - 1] = None;
                    // SAFETY: checked non-null.
                    unsafe { *done = 1 };
                }
            }
        },
        _ => return Err(bad(format!("test: {req:?} is not a request"))),
    }
    Ok(())
}

fn close_impl(comm: *mut c_void, what: &str, ok: fn(&Obj) -> bool) -> R<()> {
    let (_, o) = lookup(comm, what)?;
    if !ok(&o.lock()) {
        return Err(bad(format!("close: {comm:?} is not a {what}")));
    }
    drop(remove(comm, what)?);
    Ok(())
}

fn init_ctx_impl(ctx: *mut *mut c_void, logger: Logger) -> R<()> {
    out_ptr(ctx, "ctx")?;
    init_impl(logger)?;
    set_out(ctx, insert(Obj::Context));
    Ok(())
}

fn check_ctx(ctx: *mut c_void) -> R<()> {
    let (_, o) = lookup(ctx, "ctx")?;
    if !matches!(&*o.lock(), Obj::Context) {
        return Err(bad("ctx is not a context from init"));
    }
    Ok(())
}

fn finalize_impl(ctx: *mut c_void) -> R<()> {
    check_ctx(ctx)?;
    drop(remove(ctx, "ctx")?);
    Ok(())
}
