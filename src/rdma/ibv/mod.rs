//! The NIC provider (cargo feature `verbs`): the verbs layer over libibverbs through rdma-sys,
//! for Intel E810 (irdma), NVIDIA ConnectX (mlx5) and any RoCE v2 NIC.
//!
//! The device, port and GID come from `rdma::select` (sysfs, `ROCCL_IB_HCA`,
//! `ROCCL_IB_GID_INDEX`, `ROCCL_IB_ADDR_FAMILY`, `ROCCL_IB_ADDR_RANGE`). Each QP has its own
//! completion queue and completion channel, so a rank with nothing to do can sleep in
//! `poll(2)` on the channel's descriptor. QPs are brought up RESET → INIT (at creation) →
//! RTR → RTS (at connection) with RoCE v2 addressing: a global route to the peer's GID from
//! our GID index, hop limit, traffic class `ROCCL_IB_TC`, service level `ROCCL_IB_SL`,
//! timeout `ROCCL_IB_TIMEOUT`, retry count `ROCCL_IB_RETRY_CNT`. An async-event thread turns
//! fatal device, port and QP events into errors of the QPs they hit (reported at their next
//! poll). Every failing verb becomes a [`verb_errors::VerbError`]: the C call, the device, errno,
//! the likely cause and the fix.
//!
//! The data path (`post_send`, `post_recv`, `poll_cq`) looks QPs up in a lock-free table and
//! builds work requests on the stack: nothing allocates or locks there. Unsignaled sends are
//! signaled every [`SIGNAL_EVERY`] posts (their completion is hidden) so that the send queue
//! drains. Registrations pin memory, so they are not cacheable past their requests unless
//! `ROCCL_IB_REG_CACHE=1` says the application never frees buffers it communicates from.
//!
//! Its modules: `settings` (from the environment), `convert` (values to and from
//! libibverbs'), `dmabuf` (dmabuf registration), `events` (the async-event thread),
//! `teardown` (freeing a QP: its owner, the network, drained it first if it wanted its sends
//! acknowledged), `kick` (restarting a soft-RoCE requester that stalled: Linux rxe's sends
//! can stop mid-message; before a caller sleeps, a QP whose sends made no progress for
//! `ROCCL_IB_KICK_MS` gets its doorbell rung, which runs rxe's requester again).

mod convert;
mod dmabuf;
mod events;
mod kick;
mod settings;
mod teardown;

pub use convert::{gid_of, ip_of, mtu_bytes, mtu_code, wc_opcode, wr_opcode};
pub use settings::IbSettings;

use dmabuf::{probe_dmabuf, reg_dmabuf_fn};
use events::async_events;
use kick::SendWatch;
use teardown::free_qp;

use std::ffi::CStr;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::raw::c_int;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rdma_sys as ffi;

use super::select::Choice;
use super::verb_errors::{self, Context, Verb};
use super::verbs::{
    Access, Mr, QpEndpoint, QpId, QpState, RecvWr, SendWr, Verbs, Wc, WcOpcode, WcStatus,
};
use crate::error::{Error, Result};
use crate::os::wait::PollFd;

/// Work requests per queue (send and receive) of a QP.
const QUEUE: u32 = 512;
/// QPs one provider can hold.
const MAX_QPS: usize = 4096;
/// An unsignaled send is signaled (hidden) this often, so the send queue drains.
pub const SIGNAL_EVERY: u32 = QUEUE / 4;
/// Marks the completions of those forced signals (the bit callers leave to the provider).
const HIDDEN: u64 = super::verbs::PROVIDER_WR_ID_BIT;

/// `wr_id` as the caller posts it, refused when it uses the bit kept for forced signals: its
/// successful completion would be hidden (a drain marker with it never came back, and the
/// close waited until its limit), its failed one reported under another id.
fn caller_wr_id(wr_id: u64, what: &str) -> Result<u64> {
    if wr_id & HIDDEN != 0 {
        return Err(Error::Internal(format!(
            "{what} work request id {wr_id:#x} uses bit 63, which the NIC provider keeps for the sends it signals itself: ids must stay below 2^63 (rdma::verbs::PROVIDER_WR_ID_BIT)"
        )));
    }
    Ok(wr_id)
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// The devices libibverbs lists (an error with the cause and fix when it lists none).
pub fn device_names() -> Result<Vec<String>> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(
            verb_errors::verb_error(Verb::GetDeviceList, errno(), &Context::default()).into(),
        );
    }
    let names = (0..n.max(0) as usize)
        .map(|i| {
            // SAFETY: the list holds `n` valid devices; names are NUL-terminated strings.
            unsafe { CStr::from_ptr(ffi::ibv_get_device_name(*list.add(i))) }
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    // SAFETY: `list` came from ibv_get_device_list.
    unsafe { ffi::ibv_free_device_list(list) };
    Ok(names)
}

/// The opened device: context, protection domain, chosen port and GID.
struct Dev {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    name: String,
    port: u8,
    gid_index: u8,
    addr: IpAddr,
    mtu: u32,
    max_qp: u32,
    max_mr_size: u64,
    relaxed: bool,
    dmabuf: bool,
    why: String,
    settings: IbSettings,
    /// A fatal device event, reported to every QP.
    fatal: Mutex<Option<String>>,
    fatal_flag: AtomicBool,
    /// The port's last loss of link, while QPs retry through it (not fatal by itself).
    port_down: Mutex<Option<events::PortDown>>,
    /// The port has no link now: sends wait for it (see [`Dev::await_link`]).
    link_down: AtomicBool,
    /// How long a QP's sends may make no progress before a kick (`kick`); `None`: never.
    kick_after: Option<std::time::Duration>,
}

// SAFETY: libibverbs contexts and protection domains may be used from any thread; the raw
// pointers are only dereferenced through verbs calls, which are thread-safe.
unsafe impl Send for Dev {}
// SAFETY: as above.
unsafe impl Sync for Dev {}

impl Dev {
    fn cx(&self) -> Context {
        Context {
            dev: self.name.clone(),
            memlock: crate::os::memlock_limit().ok().and_then(|l| l.0),
            gid: Some(format!("{} ({})", self.gid_index, self.why)),
            ..Context::default()
        }
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        // SAFETY: every QP, CQ and MR of this PD is gone (the provider destroys them before
        // the last reference to the device drops); the pointers came from libibverbs.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd);
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// Errors the async-event thread found for one QP.
#[derive(Default)]
struct QpFlags {
    fatal: Mutex<Option<String>>,
    flag: AtomicBool,
}

/// QP numbers and their error flags, for the async-event thread.
type FlagTable = Arc<Mutex<Vec<(u32, Arc<QpFlags>)>>>;

/// One QP with its completion queue and channel.
struct Qp {
    qp: *mut ffi::ibv_qp,
    cq: *mut ffi::ibv_cq,
    chan: *mut ffi::ibv_comp_channel,
    qpn: u32,
    psn: u32,
    unsignaled: AtomicU32,
    /// The CQ is armed and its event not read yet (see [`Verbs::qp_fds`]).
    armed: AtomicBool,
    /// Completions taken from the CQ right after arming it, before sleeping: the next
    /// `poll_cq` returns them first. `stashed` says whether there are any, so the data path
    /// takes the lock only then.
    stash: Mutex<Vec<Wc>>,
    stashed: AtomicBool,
    flags: Arc<QpFlags>,
    /// Inline data this QP was granted (`max_inline_data` after `ibv_create_qp`): each QP
    /// keeps its own, since the device may grant less (or more) than asked.
    max_inline: u32,
    /// Its signaled sends, counted only where kicks are on (`Dev::kick_after`).
    watch: SendWatch,
}

/// Whether `wr` goes inline on a QP granted `granted` bytes of inline data. A request that
/// asks for inline (its caller treats it as complete once posted and may reuse the buffer)
/// but exceeds the grant is refused rather than silently posted by reference.
fn inline_flag(wr: &SendWr, granted: u32) -> Result<bool> {
    let len = wr.sge.map_or(0, |s| s.len);
    if wr.inline && len > granted {
        return Err(Error::Internal(format!(
            "an inline send of {len} bytes on a QP granted {granted} bytes of inline data (the caller should ask Verbs::qp_max_inline)"
        )));
    }
    Ok(wr.inline)
}

/// The NIC provider.
pub struct IbvVerbs {
    dev: Arc<Dev>,
    qps: Box<[AtomicPtr<Qp>]>,
    held: AtomicU32,
    flags: FlagTable,
    mrs: Mutex<Vec<(u32, usize)>>,
    /// Inline data each new QP asks for (`ROCCL_IB_INLINE`); what it gets is its own.
    inline: u32,
    stop: Arc<AtomicBool>,
    events: Option<std::thread::JoinHandle<()>>,
    /// The communicator's deadline in ms ([`Verbs::set_timeout`]; 0: `ROCCL_TIMEOUT`): how
    /// long a closing connection waits for the peer's acknowledgements.
    drain_ms: std::sync::atomic::AtomicU64,
    /// Completions in error the network saw, by status.
    wc_errors: crate::rdma::verbs::WcErrors,
    /// Its kicks (`kick`).
    kicks: kick::KickCounts,
    /// A descriptor that is always readable (an eventfd holding 1, never read): handed to a
    /// caller about to sleep while completions wait in a stash (see `qp_fds`).
    ready: OwnedFd,
}

/// Find the device `choice` names among those libibverbs lists and open it. The list is
/// freed before returning either way; a device sysfs shows but libibverbs does not list
/// means its provider library is missing, which the error says.
fn open_context(choice: &Choice, cx: &Context) -> Result<*mut ffi::ibv_context> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() || n == 0 {
        if !list.is_null() {
            // SAFETY: `list` came from ibv_get_device_list.
            unsafe { ffi::ibv_free_device_list(list) };
        }
        return Err(verb_errors::verb_error(Verb::GetDeviceList, errno(), cx).into());
    }
    let mut found = ptr::null_mut();
    let mut names = Vec::new();
    for i in 0..n as usize {
        // SAFETY: the list holds `n` valid device pointers.
        let d = unsafe { *list.add(i) };
        // SAFETY: ibv_get_device_name returns a NUL-terminated string owned by the device.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(d)) }
            .to_string_lossy()
            .into_owned();
        if name == choice.dev {
            found = d;
        }
        names.push(name);
    }
    let ctx = if found.is_null() {
        ptr::null_mut()
    } else {
        // SAFETY: `found` is a device of the list, which is still alive.
        unsafe { ffi::ibv_open_device(found) }
    };
    let open_errno = errno();
    // SAFETY: opened contexts stay valid after the list is freed.
    unsafe { ffi::ibv_free_device_list(list) };
    if found.is_null() {
        return Err(Error::arg(format!(
            "RDMA device {} (chosen from sysfs) is not among the devices libibverbs lists ({}): is its provider library installed (ibverbs-providers)?",
            choice.dev,
            names.join(", ")
        )));
    }
    if ctx.is_null() {
        return Err(verb_errors::verb_error(Verb::OpenDevice, open_errno, cx).into());
    }
    Ok(ctx)
}

/// The device's and the chosen port's attributes, from the open context `ctx`. The port
/// must be up and speak Ethernet (RoCE v2), since roccl cannot use it otherwise; the
/// caller closes the context on an error.
fn query_device_and_port(
    ctx: *mut ffi::ibv_context,
    choice: &Choice,
    cx: &Context,
) -> Result<(ffi::ibv_device_attr, ffi::ibv_port_attr)> {
    // SAFETY: zeroed attribute structs are valid out-parameters.
    let mut dattr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is open; `dattr` is a valid out-pointer.
    let r = unsafe { ffi::ibv_query_device(ctx, &mut dattr) };
    if r != 0 {
        return Err(verb_errors::verb_error(Verb::QueryDevice, r, cx).into());
    }
    let port = choice.port as u8;
    // SAFETY: as above.
    let mut pattr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is open; `pattr` is a valid out-pointer of the size passed inside.
    let r = unsafe { ffi::___ibv_query_port(ctx, port, &mut pattr) };
    if r != 0 {
        return Err(verb_errors::verb_error(Verb::QueryPort, r, cx).into());
    }
    if pattr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
        // Its link went down after the choice (which saw it ACTIVE), or it never came up.
        return Err(Error::arg(format!(
            "{} port {port} is {} (not ACTIVE) as this rank opens it: check the cable and `ip link` of its interface",
            choice.dev,
            convert::port_state_name(pattr.state)
        )));
    }
    if pattr.link_layer != 2 {
        return Err(Error::arg(format!(
            "{}:{port} has an InfiniBand link layer: roccl speaks RoCE v2 (Ethernet) only",
            choice.dev
        )));
    }
    Ok((dattr, pattr))
}

/// The IP address of the chosen GID as libibverbs reads it from the open context `ctx`,
/// noting in the log when it differs from what sysfs showed (the address libibverbs gives
/// is the one used). The caller closes the context on an error.
fn read_gid(ctx: *mut ffi::ibv_context, choice: &Choice, cx: &Context) -> Result<IpAddr> {
    let port = choice.port as u8;
    // SAFETY: a zeroed GID is a valid out-parameter.
    let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is open; `gid` is a valid out-pointer.
    let r = unsafe { ffi::ibv_query_gid(ctx, port, choice.gid_index as c_int, &mut gid) };
    if r != 0 {
        return Err(verb_errors::verb_error(Verb::QueryGid, errno(), cx).into());
    }
    // SAFETY: a GID is 16 plain bytes in either view of the union.
    let raw = unsafe { gid.raw };
    let addr = ip_of(raw);
    if addr != choice.gid.ip() {
        crate::info!(
            "RoCE v2: {}:{port} GID {} reads {addr} through libibverbs but {} in sysfs",
            choice.dev,
            choice.gid_index,
            choice.gid.ip()
        );
    }
    Ok(addr)
}

/// Start the thread that turns the device's asynchronous events (fatal errors, lost
/// links, QPs in error) into errors of the QPs they hit, until `stop` is set.
fn spawn_event_thread(
    dev: &Arc<Dev>,
    flags: &FlagTable,
    stop: &Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>> {
    let (d, f, s) = (Arc::clone(dev), Arc::clone(flags), Arc::clone(stop));
    std::thread::Builder::new()
        .name("roccl-ibv-events".into())
        .spawn(move || async_events(d, f, s))
        .map_err(|e| Error::sys("spawning the RDMA async-event thread", e))
}

impl IbvVerbs {
    /// Open the device, port and GID of `choice`.
    pub fn open(choice: &Choice, settings: IbSettings) -> Result<IbvVerbs> {
        let mut cx = Context {
            dev: choice.dev.clone(),
            ..Context::default()
        };
        let ctx = open_context(choice, &cx)?;
        let close = |e: Error| {
            // SAFETY: `ctx` was opened above and nothing else uses it yet.
            unsafe { ffi::ibv_close_device(ctx) };
            e
        };
        let (dattr, pattr) = query_device_and_port(ctx, choice, &cx).map_err(close)?;
        let port = choice.port as u8;
        let addr = read_gid(ctx, choice, &cx).map_err(close)?;
        // SAFETY: `ctx` is open.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return Err(close(
                verb_errors::verb_error(Verb::AllocPd, errno(), &cx).into(),
            ));
        }
        let dmabuf = probe_dmabuf(pd);
        let dev = Arc::new(Dev {
            ctx,
            pd,
            name: choice.dev.clone(),
            port,
            gid_index: choice.gid_index as u8,
            addr,
            mtu: mtu_bytes(pattr.active_mtu),
            max_qp: dattr.max_qp.max(0) as u32,
            max_mr_size: dattr.max_mr_size,
            relaxed: settings.relaxed,
            dmabuf,
            why: choice.why.clone(),
            settings,
            fatal: Mutex::new(None),
            fatal_flag: AtomicBool::new(false),
            port_down: Mutex::new(None),
            link_down: AtomicBool::new(false),
            kick_after: kick::after(&settings, dattr.vendor_id),
        });
        cx.max_qp = Some((dev.max_qp, 0));
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor we own.
        let fd = unsafe { libc::eventfd(1, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::sys(
                "creating the eventfd that wakes a verbs caller with completions waiting",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: `fd` is a new descriptor nobody else owns.
        let ready = unsafe { OwnedFd::from_raw_fd(fd) };
        let flags: FlagTable = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let events = spawn_event_thread(&dev, &flags, &stop)?;
        crate::info!(
            "RoCE v2 on {}:{port} GID {} {addr} ({}), MTU {}, max QPs {}, dmabuf {}",
            dev.name,
            dev.gid_index,
            dev.why,
            dev.mtu,
            dev.max_qp,
            if dmabuf { "yes" } else { "no" }
        );
        Ok(IbvVerbs {
            qps: (0..MAX_QPS)
                .map(|_| AtomicPtr::new(ptr::null_mut()))
                .collect(),
            held: AtomicU32::new(0),
            flags,
            mrs: Mutex::new(Vec::new()),
            inline: settings.inline,
            stop,
            events: Some(events),
            dev,
            drain_ms: std::sync::atomic::AtomicU64::new(0),
            wc_errors: Default::default(),
            kicks: Default::default(),
            ready,
        })
    }

    /// Whether the device registers dmabuf memory (`ibv_reg_dmabuf_mr`).
    pub fn dmabuf(&self) -> bool {
        self.dev.dmabuf
    }

    fn check_mr_size(&self, len: usize) -> Result<()> {
        if self.dev.max_mr_size > 0 && len as u64 > self.dev.max_mr_size {
            return Err(Error::arg(format!(
                "a registration of {len} bytes exceeds the largest memory region {} allows ({} bytes): use smaller buffers or more calls",
                self.dev.name, self.dev.max_mr_size
            )));
        }
        Ok(())
    }

    /// Register `len` bytes at `offset` of the dmabuf `fd` (GPU memory exported by its
    /// driver), mapped at `iova` for our work requests; deregistered with `dereg_mr`.
    ///
    /// # Safety
    /// The dmabuf must stay alive and mapped until [`Verbs::dereg_mr`].
    pub unsafe fn reg_dmabuf_mr(
        &self,
        fd: i32,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Mr> {
        self.check_mr_size(len)?;
        let mut cx = self.dev.cx();
        cx.len = Some(len);
        let Some(reg) = reg_dmabuf_fn().filter(|_| self.dev.dmabuf) else {
            return Err(verb_errors::verb_error(Verb::RegDmabufMr, libc::EOPNOTSUPP, &cx).into());
        };
        // SAFETY: the PD is live; the caller keeps the dmabuf alive until deregistration.
        let mr = unsafe { reg(self.dev.pd, offset, len, iova, fd, access.0 as c_int) };
        if mr.is_null() {
            return Err(verb_errors::verb_error(Verb::RegDmabufMr, errno(), &cx).into());
        }
        // SAFETY: `mr` is a valid registration.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.mrs.lock().push((lkey, mr as usize));
        Ok(Mr {
            addr: iova,
            len,
            lkey,
            rkey,
        })
    }

    /// The port's active MTU in bytes.
    pub fn mtu(&self) -> u32 {
        self.dev.mtu
    }

    fn qp(&self, id: QpId) -> Result<&Qp> {
        let p = self
            .qps
            .get(id.0 as usize)
            .map_or(ptr::null_mut(), |a| a.load(Ordering::Acquire));
        if p.is_null() {
            return Err(Error::arg(format!("unknown or destroyed QP {}", id.0)));
        }
        // SAFETY: non-null entries point to live boxed QPs; a QP is freed only by
        // destroy_qp, which its owner calls once it stopped using it.
        let q = unsafe { &*p };
        if q.flags.flag.load(Ordering::Relaxed) || self.dev.fatal_flag.load(Ordering::Relaxed) {
            let why = q
                .flags
                .fatal
                .lock()
                .clone()
                .or_else(|| self.dev.fatal.lock().clone())
                .unwrap_or_default();
            return Err(Error::sys(
                format!("RDMA device {}: {why}", self.dev.name),
                std::io::Error::other("fatal RDMA async event"),
            ));
        }
        Ok(q)
    }

    fn modify(
        &self,
        q: &Qp,
        attr: &mut ffi::ibv_qp_attr,
        mask: u32,
        verb: Verb,
        peer: Option<IpAddr>,
    ) -> Result<()> {
        // SAFETY: `q.qp` is live; `attr` is a valid attribute struct for `mask`.
        let r = unsafe { ffi::ibv_modify_qp(q.qp, attr, mask as c_int) };
        if r != 0 {
            let mut cx = self.dev.cx();
            cx.peer = peer.map(|p| p.to_string());
            return Err(verb_errors::verb_error(verb, r, &cx).into());
        }
        Ok(())
    }
}

impl Drop for IbvVerbs {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.events.take() {
            let _ = t.join();
        }
        for i in 0..self.qps.len() {
            self.destroy_qp(QpId(i as u32));
        }
        for (_, p) in self.mrs.lock().drain(..) {
            // SAFETY: registrations still held when the provider goes away.
            unsafe { ffi::ibv_dereg_mr(p as *mut ffi::ibv_mr) };
        }
    }
}

impl Verbs for IbvVerbs {
    fn counters(&self, out: &mut Vec<(&'static str, u64)>) {
        self.wc_errors.report(out, true);
        self.kicks.report(out);
    }

    fn local_fault(&self) -> Option<String> {
        self.dev.local_fault()
    }

    fn completion_error(&self, status: WcStatus) {
        self.wc_errors.note(status);
    }

    fn set_timeout(&self, timeout: std::time::Duration) {
        // The NIC keeps IB's retry count; only the drain at close follows the deadline.
        self.drain_ms.store(
            timeout.as_millis().clamp(1, u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    fn drain_limit(&self) -> std::time::Duration {
        match self.drain_ms.load(Ordering::Relaxed) {
            0 => self.dev.settings.deadline,
            ms => std::time::Duration::from_millis(ms),
        }
    }

    fn name(&self) -> String {
        format!(
            "{}:{} (RoCE v2, GID {} {})",
            self.dev.name, self.dev.port, self.dev.gid_index, self.dev.addr
        )
    }

    fn max_inline(&self) -> usize {
        self.inline as usize
    }

    fn qp_max_inline(&self, qp: QpId) -> usize {
        self.qp(qp).map_or(0, |q| q.max_inline as usize)
    }

    fn hardware(&self) -> bool {
        true
    }

    unsafe fn reg_mr(&self, addr: u64, len: usize, access: Access) -> Result<Mr> {
        self.check_mr_size(len)?;
        let mut flags = access.0;
        if self.dev.relaxed {
            flags |= ffi::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
        }
        // SAFETY: the caller keeps the memory valid until dereg_mr; the PD is live.
        let mr = unsafe {
            ffi::ibv_reg_mr_iova2(self.dev.pd, addr as *mut libc::c_void, len, addr, flags)
        };
        if mr.is_null() {
            let mut cx = self.dev.cx();
            cx.len = Some(len);
            return Err(verb_errors::verb_error(Verb::RegMr, errno(), &cx).into());
        }
        // SAFETY: `mr` is a valid registration.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.mrs.lock().push((lkey, mr as usize));
        Ok(Mr {
            addr,
            len,
            lkey,
            rkey,
        })
    }

    fn dereg_mr(&self, mr: &Mr) -> Result<()> {
        let p = {
            let mut l = self.mrs.lock();
            let i = l.iter().position(|(k, _)| *k == mr.lkey).ok_or_else(|| {
                Error::arg(format!("deregistering unknown memory key {:#x}", mr.lkey))
            })?;
            l.swap_remove(i).1
        };
        // SAFETY: `p` is a registration of ours, removed from the table above.
        let r = unsafe { ffi::ibv_dereg_mr(p as *mut ffi::ibv_mr) };
        if r != 0 {
            return Err(Error::sys(
                format!("ibv_dereg_mr failed on {}", self.dev.name),
                std::io::Error::from_raw_os_error(r),
            ));
        }
        Ok(())
    }

    fn cacheable_registrations(&self) -> bool {
        self.dev.settings.reg_cache
    }

    fn dmabuf_supported(&self) -> bool {
        self.dev.dmabuf
    }

    unsafe fn reg_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Mr> {
        // SAFETY: forwarded contract.
        unsafe { IbvVerbs::reg_dmabuf_mr(self, fd, offset, len, iova, access) }
    }

    fn create_qp(&self) -> Result<(QpId, QpEndpoint)> {
        let dev = &self.dev;
        let mut cx = dev.cx();
        cx.max_qp = Some((dev.max_qp, self.held.load(Ordering::Relaxed)));
        let slot = self
            .qps
            .iter()
            .position(|p| p.load(Ordering::Relaxed).is_null())
            .ok_or_else(|| Error::arg(format!("more than {MAX_QPS} QPs in one process")))?;
        // SAFETY: `dev.ctx` is open.
        let chan = unsafe { ffi::ibv_create_comp_channel(dev.ctx) };
        if chan.is_null() {
            return Err(verb_errors::verb_error(Verb::CreateCompChannel, errno(), &cx).into());
        }
        // SAFETY: `chan` is live; its descriptor becomes non-blocking so draining never waits.
        unsafe {
            let fd = (*chan).fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        let cq_size = (2 * QUEUE) as c_int;
        // SAFETY: `dev.ctx` and `chan` are live.
        let cq = unsafe { ffi::ibv_create_cq(dev.ctx, cq_size, ptr::null_mut(), chan, 0) };
        if cq.is_null() {
            let e = errno();
            // SAFETY: created above, unused.
            unsafe { ffi::ibv_destroy_comp_channel(chan) };
            return Err(verb_errors::verb_error(Verb::CreateCq, e, &cx).into());
        }
        let mut inline = self.inline;
        let (qp, max_inline) = loop {
            // SAFETY: zeroed init attributes are valid; the fields set below describe the QP.
            let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            init.send_cq = cq;
            init.recv_cq = cq;
            init.cap.max_send_wr = QUEUE;
            init.cap.max_recv_wr = QUEUE;
            init.cap.max_send_sge = 1;
            init.cap.max_recv_sge = 1;
            init.cap.max_inline_data = inline;
            init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
            init.sq_sig_all = 0;
            // SAFETY: the PD and CQ are live; `init` is valid.
            let qp = unsafe { ffi::ibv_create_qp(dev.pd, &mut init) };
            if !qp.is_null() {
                break (qp, init.cap.max_inline_data);
            }
            let e = errno();
            if e == libc::EINVAL && inline > 0 {
                inline = if inline > 64 { 64 } else { 0 }; // smaller inline, then none
                continue;
            }
            // SAFETY: created above, unused.
            unsafe {
                ffi::ibv_destroy_cq(cq);
                ffi::ibv_destroy_comp_channel(chan);
            }
            return Err(verb_errors::verb_error(Verb::CreateQp, e, &cx).into());
        };
        let psn = {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.subsec_nanos());
            (t ^ (slot as u32).wrapping_mul(2_654_435_761)) & 0x00ff_ffff
        };
        // SAFETY: `qp` is live.
        let qpn = unsafe { (*qp).qp_num };
        let flags = Arc::new(QpFlags::default());
        let q = Box::new(Qp {
            qp,
            cq,
            chan,
            qpn,
            psn,
            unsignaled: AtomicU32::new(0),
            armed: AtomicBool::new(false),
            stash: Mutex::new(Vec::new()),
            stashed: AtomicBool::new(false),
            flags: Arc::clone(&flags),
            max_inline,
            watch: SendWatch::default(),
        });
        // RESET → INIT.
        // SAFETY: zeroed attributes are valid; the mask names the fields set.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = dev.port;
        attr.qp_access_flags = Access::ALL.0;
        use ffi::ibv_qp_attr_mask as M;
        let mask = M::IBV_QP_STATE.0
            | M::IBV_QP_PKEY_INDEX.0
            | M::IBV_QP_PORT.0
            | M::IBV_QP_ACCESS_FLAGS.0;
        if let Err(e) = self.modify(&q, &mut attr, mask, Verb::ModifyQpInit, None) {
            free_qp(*q);
            return Err(e);
        }
        let p = Box::into_raw(q);
        if self.qps[slot]
            .compare_exchange(ptr::null_mut(), p, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            // SAFETY: `p` came from Box::into_raw just above and was not shared.
            free_qp(*unsafe { Box::from_raw(p) });
            return Err(Error::Internal("QP table slot taken concurrently".into()));
        }
        self.flags.lock().push((qpn, flags));
        self.held.fetch_add(1, Ordering::Relaxed);
        Ok((
            QpId(slot as u32),
            QpEndpoint {
                addr: SocketAddr::new(dev.addr, super::wire::ROCEV2_PORT),
                qpn,
                psn,
                mtu: dev.mtu,
                engine: false,
            },
        ))
    }

    fn connect_qp(&self, id: QpId, remote: &QpEndpoint) -> Result<()> {
        let q = self.qp(id)?;
        let s = self.dev.settings;
        use ffi::ibv_qp_attr_mask as M;
        // INIT → RTR: the path to the peer's GID.
        // SAFETY: zeroed attributes are valid; the mask names the fields set.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = mtu_code(self.dev.mtu.min(remote.mtu));
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = ffi::ibv_gid {
            raw: gid_of(remote.addr.ip()),
        };
        a.ah_attr.grh.sgid_index = self.dev.gid_index;
        a.ah_attr.grh.hop_limit = 255;
        a.ah_attr.grh.traffic_class = s.tc;
        a.ah_attr.grh.flow_label = 0;
        a.ah_attr.sl = s.sl;
        a.ah_attr.port_num = self.dev.port;
        let mask = M::IBV_QP_STATE.0
            | M::IBV_QP_AV.0
            | M::IBV_QP_PATH_MTU.0
            | M::IBV_QP_DEST_QPN.0
            | M::IBV_QP_RQ_PSN.0
            | M::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | M::IBV_QP_MIN_RNR_TIMER.0;
        self.modify(q, &mut a, mask, Verb::ModifyQpRtr, Some(remote.addr.ip()))?;
        // RTR → RTS.
        // SAFETY: as above.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = s.timeout;
        a.retry_cnt = s.retry_cnt;
        a.rnr_retry = 7;
        a.sq_psn = q.psn;
        a.max_rd_atomic = 1;
        let mask = M::IBV_QP_STATE.0
            | M::IBV_QP_TIMEOUT.0
            | M::IBV_QP_RETRY_CNT.0
            | M::IBV_QP_RNR_RETRY.0
            | M::IBV_QP_SQ_PSN.0
            | M::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify(q, &mut a, mask, Verb::ModifyQpRts, Some(remote.addr.ip()))
    }

    fn destroy_qp(&self, id: QpId) {
        let Some(slot) = self.qps.get(id.0 as usize) else {
            return;
        };
        let p = slot.swap(ptr::null_mut(), Ordering::AcqRel);
        if p.is_null() {
            return;
        }
        // SAFETY: `p` came from Box::into_raw in create_qp and left the table just now.
        let q = unsafe { Box::from_raw(p) };
        self.flags.lock().retain(|(n, _)| *n != q.qpn);
        self.held.fetch_sub(1, Ordering::Relaxed);
        // No drain here: the network drains what it posted before it destroys its QP
        // (`drain_sends`, once, within `drain_limit`, the communicator's deadline), and
        // only when it wants to (not after a failure or an abort).
        free_qp(*q);
    }

    fn post_send(&self, id: QpId, wr: &SendWr) -> Result<()> {
        let q = self.qp(id)?;
        self.dev.await_link(self.drain_limit())?;
        let mut sge = sge_of(wr.sge);
        // SAFETY: a zeroed work request is valid; the fields used are set below.
        let mut w: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        w.wr_id = caller_wr_id(wr.wr_id, "send")?;
        if wr.sge.is_some() {
            w.sg_list = &mut sge;
            w.num_sge = 1;
        }
        w.opcode = wr_opcode(wr.opcode);
        let mut flags = 0;
        if wr.signaled {
            flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        } else if q.unsignaled.fetch_add(1, Ordering::Relaxed) + 1 >= SIGNAL_EVERY {
            // Drain the send queue: signal this one, hide its completion.
            q.unsignaled.store(0, Ordering::Relaxed);
            flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            w.wr_id |= HIDDEN;
        }
        if inline_flag(wr, q.max_inline)? {
            flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        }
        w.send_flags = flags;
        w.imm_data_invalidated_rkey_union.imm_data = wr.imm.to_be();
        w.wr.rdma = ffi::rdma_t {
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
        };
        if self.dev.kick_after.is_some() {
            q.watch.posting();
        }
        let mut bad = ptr::null_mut();
        // SAFETY: `q.qp` is live; `w` and `sge` outlive the call (the NIC copies the request).
        let r = unsafe { ffi::ibv_post_send(q.qp, &mut w, &mut bad) };
        if r != 0 {
            return Err(verb_errors::verb_error(Verb::PostSend, r, &self.dev.cx()).into());
        }
        if self.dev.kick_after.is_some() && flags & ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 != 0 {
            q.watch.posted();
        }
        Ok(())
    }

    fn post_recv(&self, id: QpId, wr: &RecvWr) -> Result<()> {
        let q = self.qp(id)?;
        let mut sge = sge_of(wr.sge);
        let mut w = ffi::ibv_recv_wr {
            wr_id: caller_wr_id(wr.wr_id, "receive")?,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
        };
        if wr.sge.is_some() {
            w.sg_list = &mut sge;
            w.num_sge = 1;
        }
        let mut bad = ptr::null_mut();
        // SAFETY: `q.qp` is live; `w` and `sge` outlive the call.
        let r = unsafe { ffi::ibv_post_recv(q.qp, &mut w, &mut bad) };
        if r != 0 {
            return Err(verb_errors::verb_error(Verb::PostRecv, r, &self.dev.cx()).into());
        }
        Ok(())
    }

    fn poll_cq(&self, id: QpId, out: &mut [Wc]) -> Result<usize> {
        let q = self.qp(id)?;
        // Only the CQ itself while the caller spins: completion-channel events and arming
        // are system calls (on rxe, arming is one too), so they wait until the caller is
        // about to sleep (`qp_fds`).
        let mut got = 0;
        if q.stashed.load(Ordering::Acquire) {
            let mut stash = q.stash.lock();
            got = stash.len().min(out.len());
            for (o, w) in out.iter_mut().zip(stash.drain(..got)) {
                *o = w;
            }
            q.stashed.store(!stash.is_empty(), Ordering::Release);
        }
        if got < out.len() {
            got += self.poll_into(q, &mut out[got..])?;
        }
        Ok(got)
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        for p in self.qps.iter() {
            let q = p.load(Ordering::Acquire);
            if !q.is_null() {
                // SAFETY: non-null entries are live QPs (see `qp`).
                out.push(PollFd {
                    fd: unsafe { (*(*q).chan).fd },
                    events: libc::POLLIN,
                });
            }
        }
    }

    /// About to sleep: read the channel's event (if the CQ raised one), arm the CQ again
    /// and look at it once more, since a completion that came before arming raises no
    /// event. What that look finds is stashed for the next `poll_cq`, and the always-ready
    /// descriptor keeps the caller from sleeping.
    fn qp_fds(&self, id: QpId, out: &mut Vec<PollFd>) {
        let Ok(q) = self.qp(id) else { return };
        if let Some(after) = self.dev.kick_after {
            self.kick_if_stalled(q, after);
        }
        let mut events = 0u32;
        loop {
            let mut cq = ptr::null_mut();
            let mut cx = ptr::null_mut();
            // SAFETY: `q.chan` is live (non-blocking descriptor); out-pointers are valid.
            if unsafe { ffi::ibv_get_cq_event(q.chan, &mut cq, &mut cx) } != 0 {
                break;
            }
            events += 1;
        }
        if events > 0 {
            // SAFETY: acknowledging events we received for this CQ.
            unsafe { ffi::ibv_ack_cq_events(q.cq, events) };
            q.armed.store(false, Ordering::Relaxed);
        }
        let ready = if q.armed.swap(true, Ordering::Relaxed) {
            // Armed, and no event since: nothing completed after the look that armed it.
            q.stashed.load(Ordering::Acquire)
        } else {
            // SAFETY: `q.cq` is live.
            let r = unsafe { ffi::ibv_req_notify_cq(q.cq, 0) };
            if r != 0 {
                // Not armed: the caller's sleep is bounded; stay awake instead.
                q.armed.store(false, Ordering::Relaxed);
                true
            } else {
                let mut stash = q.stash.lock();
                let mut buf = [Wc::EMPTY; 16];
                match self.poll_into(q, &mut buf) {
                    Ok(n) => stash.extend_from_slice(&buf[..n]),
                    // The next poll_cq reports the error.
                    Err(_) => q.armed.store(false, Ordering::Relaxed),
                }
                q.stashed.store(!stash.is_empty(), Ordering::Release);
                !stash.is_empty() || !q.armed.load(Ordering::Relaxed)
            }
        };
        if ready {
            out.push(PollFd {
                fd: self.ready.as_raw_fd(),
                events: libc::POLLIN,
            });
        }
        // SAFETY: `q.chan` is live while the QP is.
        out.push(PollFd {
            fd: unsafe { (*q.chan).fd },
            events: libc::POLLIN,
        });
    }

    unsafe fn read_registered(&self, addr: u64, out: &mut [u8]) {
        // The NIC writes this memory by DMA at any time: read it volatile, each aligned
        // 4-byte word with one load (a sequence marker the peer writes as one aligned word
        // is never seen half old, half new), then order later reads after it.
        let mut i = 0;
        while i < out.len() {
            let at = addr + i as u64;
            if at % 4 == 0 && out.len() - i >= 4 {
                // SAFETY: the caller passes memory inside one of its registered regions, not
                // yet deregistered (this function's contract); `at` is aligned for a u32.
                let word = unsafe { ptr::read_volatile(at as *const u32) };
                out[i..i + 4].copy_from_slice(&word.to_ne_bytes());
                i += 4;
            } else {
                // SAFETY: as above, one byte.
                out[i] = unsafe { ptr::read_volatile(at as *const u8) };
                i += 1;
            }
        }
        std::sync::atomic::fence(Ordering::Acquire);
    }

    fn qp_state(&self, id: QpId) -> Result<QpState> {
        let q = self.qp(id)?;
        // SAFETY: zeroed out-parameters are valid.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut i: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `q.qp` is live.
        let r = unsafe {
            ffi::ibv_query_qp(
                q.qp,
                &mut a,
                ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int,
                &mut i,
            )
        };
        if r != 0 {
            return Err(Error::sys(
                format!("ibv_query_qp failed on {}", self.dev.name),
                std::io::Error::from_raw_os_error(r),
            ));
        }
        Ok(match a.qp_state {
            ffi::ibv_qp_state::IBV_QPS_RESET => QpState::Reset,
            ffi::ibv_qp_state::IBV_QPS_INIT => QpState::Init,
            ffi::ibv_qp_state::IBV_QPS_RTR => QpState::Rtr,
            ffi::ibv_qp_state::IBV_QPS_RTS => QpState::Rts,
            _ => QpState::Error,
        })
    }
}

impl IbvVerbs {
    /// Before the caller sleeps: a QP whose signaled sends made no progress for `after`
    /// gets its doorbell rung (and again after each `after` until they move), which runs a
    /// stalled soft-RoCE requester again; its send PSN tells whether it was (`kick`).
    fn kick_if_stalled(&self, q: &Qp, after: std::time::Duration) {
        let now = std::time::Instant::now();
        let look = q.watch.due(now, after);
        if look.kick.is_some() || look.read_psn {
            let who = (self.dev.name.as_str(), q.qpn);
            // SAFETY: `q.qp` is live while `q` is borrowed from the table; the watch is its.
            unsafe { kick::act(look, &q.watch, &self.kicks, q.qp, now, who) };
        }
    }

    fn poll_into(&self, q: &Qp, out: &mut [Wc]) -> Result<usize> {
        const N: usize = 16;
        // SAFETY: ibv_wc is plain data; zeroed entries are valid and overwritten by the poll.
        let mut wcs: [ffi::ibv_wc; N] = unsafe { std::mem::zeroed() };
        let want = out.len().min(N) as c_int;
        // SAFETY: `q.cq` is live; `wcs` holds `want` entries.
        let n = unsafe { ffi::ibv_poll_cq(q.cq, want, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(verb_errors::verb_error(Verb::PollCq, -n, &self.dev.cx()).into());
        }
        let mut k = 0;
        if self.dev.kick_after.is_some() {
            // Send-side completions have opcodes below IBV_WC_RECV (errors too: their
            // opcode is undefined, and their QP is failing anyway).
            let sends = wcs[..n as usize]
                .iter()
                .filter(|w| w.opcode < ffi::ibv_wc_opcode::IBV_WC_RECV)
                .count();
            q.watch.completed(sends as u64);
        }
        for w in &wcs[..n as usize] {
            let status = WcStatus::from_ibv(w.status);
            if w.wr_id & HIDDEN != 0 && status == WcStatus::Success {
                continue; // a forced signal of an unsignaled send
            }
            let imm = (w.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
                // SAFETY: with IBV_WC_WITH_IMM the union holds the immediate data.
                .then(|| u32::from_be(unsafe { w.imm_data_invalidated_rkey_union.imm_data }));
            out[k] = Wc {
                wr_id: w.wr_id & !HIDDEN,
                status,
                opcode: wc_opcode(w.opcode).unwrap_or(WcOpcode::Send),
                byte_len: w.byte_len,
                imm,
                qpn: w.qp_num,
            };
            k += 1;
        }
        Ok(k)
    }
}

fn sge_of(s: Option<super::verbs::Sge>) -> ffi::ibv_sge {
    s.map_or(
        ffi::ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        },
        |s| ffi::ibv_sge {
            addr: s.addr,
            length: s.len,
            lkey: s.lkey,
        },
    )
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::verbs::WrOpcode;

    /// A send asks for inline against its own QP's grant: within it, inline; beyond it (a
    /// caller that would reuse the buffer at once), an error rather than a silent send by
    /// reference; not asked, never inline.
    #[test]
    fn inline_follows_the_queue_pairs_grant() {
        let wr = |len: u32, inline: bool| SendWr {
            wr_id: 1,
            opcode: WrOpcode::SendImm,
            sge: Some(crate::rdma::verbs::Sge {
                addr: 0x1000,
                len,
                lkey: 1,
            }),
            inline,
            imm: 0,
            remote_addr: 0,
            rkey: 0,
            signaled: false,
        };
        assert!(inline_flag(&wr(64, true), 220).unwrap());
        assert!(inline_flag(&wr(220, true), 220).unwrap());
        assert!(!inline_flag(&wr(64, false), 220).unwrap());
        let e = inline_flag(&wr(64, true), 0).unwrap_err().to_string();
        assert!(e.contains("granted 0 bytes"), "{e}");
        let e = inline_flag(&wr(100, true), 64).unwrap_err().to_string();
        assert!(e.contains("granted 64 bytes"), "{e}");
    }

    /// Work request ids keep clear of the bit that marks the provider's own signals: every
    /// id below it is posted as it is (the network's drain marker, `PROVIDER_WR_ID_BIT - 1`,
    /// included), any id with it is refused, naming the id (a drain marker of `u64::MAX`
    /// had its completion hidden as a forced signal, and the close waited out its limit).
    #[test]
    fn work_request_ids_leave_the_providers_bit_alone() {
        for id in [0, 1, 4096, HIDDEN - 2, HIDDEN - 1] {
            assert_eq!(caller_wr_id(id, "send").unwrap(), id);
        }
        for id in [HIDDEN, HIDDEN | 5, u64::MAX] {
            let e = caller_wr_id(id, "send").unwrap_err().to_string();
            assert!(
                e.contains(&format!("{id:#x}")) && e.contains("bit 63"),
                "{e}"
            );
        }
    }
}
