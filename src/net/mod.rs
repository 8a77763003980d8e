//! Networks behind one trait with `ncclNet_t` semantics.
//!
//! A network has devices; each device can `listen` (giving an opaque handle of at most
//! [`HANDLE_MAX`] bytes to pass to the peer out of band), `connect` to a peer's handle and
//! `accept` incoming connections — both non-blocking: they are polled until they yield a
//! comm. A [`SendComm`] posts `isend`s, a [`RecvComm`] posts (possibly grouped, tagged)
//! `irecv`s; both are completed by `test`. Requests make progress only inside `test`
//! (and `isend`/`irecv` themselves), so a network needs no helper threads and the caller
//! decides how to wait (see [`PollFd`]).
//!
//! The same trait serves the core and, through a thin adapter, the NCCL/RCCL plugin ABI.

pub mod rocev2;
mod settings;
pub mod shm;
pub mod sim;
pub mod tcp;

pub use settings::NetSettings;

use std::fmt;
use std::io::{Read, Write};
use std::sync::Arc;

use crate::bootstrap::auth::{JobKey, TAG_BYTES};
use crate::error::{Error, Result};

/// Largest connection handle, as in NCCL (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_MAX: usize = 128;
/// Most requests a comm accepts in flight (`NCCL_NET_MAX_REQUESTS`).
pub const MAX_REQUESTS: usize = 32;
/// Most buffers in one grouped receive.
pub const MAX_RECVS: usize = 8;

/// Opaque connection handle produced by `listen`, at most [`HANDLE_MAX`] bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct NetHandle {
    bytes: [u8; HANDLE_MAX],
}

impl NetHandle {
    /// Build a handle from raw bytes (at most [`HANDLE_MAX`]; the rest is zero).
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.len() > HANDLE_MAX {
            return Err(Error::arg(format!(
                "net handle of {} bytes exceeds the {HANDLE_MAX}-byte limit",
                b.len()
            )));
        }
        let mut bytes = [0u8; HANDLE_MAX];
        bytes[..b.len()].copy_from_slice(b);
        Ok(NetHandle { bytes })
    }

    /// The handle's bytes.
    pub fn as_bytes(&self) -> &[u8; HANDLE_MAX] {
        &self.bytes
    }
}

impl fmt::Debug for NetHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let used = self
            .bytes
            .iter()
            .rposition(|b| *b != 0)
            .map_or(0, |p| p + 1);
        write!(f, "NetHandle({used} bytes)")
    }
}

/// Which memory a device can send from and receive into (`NCCL_PTR_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtrSupport {
    /// Host memory.
    pub host: bool,
    /// Device (GPU) memory.
    pub device: bool,
    /// dma-buf file descriptors.
    pub dmabuf: bool,
}

/// Properties of one network device, as `ncclNetProperties_t` reports them.
#[derive(Clone, Debug)]
pub struct NetProperties {
    /// Device name (interface name for TCP).
    pub name: String,
    /// PCI path in sysfs, `None` for virtual devices.
    pub pci_path: Option<String>,
    /// Unique identifier of the device.
    pub guid: u64,
    /// Memory the device can use.
    pub ptr_support: PtrSupport,
    /// Link speed in Mbit/s (0 when unknown).
    pub speed_mbps: u32,
    /// Port number.
    pub port: u32,
    /// Typical one-way latency of a small message, in microseconds.
    pub latency_us: f32,
    /// Most comms this device supports.
    pub max_comms: u32,
    /// Most buffers in one grouped receive.
    pub max_recvs: u32,
}

pub use crate::os::wait::PollFd;

/// Identifies a request posted on a comm; valid until `test` reports it done.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReqId(pub u32);

/// A registered memory region (`mhandle` in NCCL). Opaque to the caller.
#[derive(Debug)]
pub struct MemHandle {
    /// Start of the region.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Network-specific key (lkey/rkey for RDMA; unused by TCP).
    pub key: u64,
}

/// One buffer of a (grouped) receive.
#[derive(Clone, Copy, Debug)]
pub struct RecvBuf {
    /// Where to write.
    pub ptr: *mut u8,
    /// Capacity in bytes; the matching send may be shorter, never longer.
    pub len: usize,
    /// Tag that the matching send carries.
    pub tag: u32,
}

/// A copy on the GPU that a network's own host buffers need when GPU memory meets them
/// (eager messages sent from or received into GPU memory): `(dst, src, bytes)`, done when
/// it returns.
pub type DeviceCopy = Arc<dyn Fn(usize, usize, usize) -> Result<()> + Send + Sync>;

/// A network: TCP, shared memory, RDMA... (`ncclNet_t`).
pub trait Net: Send + Sync {
    /// Short name (`tcp`, ...).
    fn name(&self) -> &'static str;
    /// Number of devices.
    fn devices(&self) -> usize;
    /// Properties of device `dev`.
    fn properties(&self, dev: usize) -> Result<NetProperties>;
    /// Start listening on `dev`. Never blocks.
    fn listen(&self, dev: usize) -> Result<(NetHandle, Box<dyn ListenComm>)>;
    /// Start connecting to the peer that produced `handle`. Never blocks; poll the result.
    fn connect(&self, dev: usize, handle: &NetHandle) -> Result<Box<dyn Connecting>>;
    /// GPU memory may be posted from now on (a plugin that advertises `NCCL_PTR_CUDA` /
    /// `NCCL_PTR_DMABUF`): connections made afterwards move data without CPU copies (no
    /// eager messages through bounce buffers, no inline sends). Networks that cannot carry
    /// GPU memory ignore it (they never advertise it).
    fn expect_device_buffers(&self) {}
    /// Whether a connection between the owners of handles `mine` and `theirs` can carry
    /// messages both ways ([`SendComm::reverse`], [`RecvComm::reverse`]). Both sides must
    /// answer alike, so it depends on the two handles only. An extension of `ncclNet_t`
    /// (whose connections go one way): over TCP the peer's data then carries the
    /// acknowledgements of ours instead of separate packets.
    fn duplex(&self, _mine: &NetHandle, _theirs: &NetHandle) -> bool {
        false
    }
    /// Like [`Net::connect`], for a connection whose sides will be reversed (where
    /// [`Net::duplex`] says so; other networks connect one way).
    fn connect_duplex(&self, dev: usize, handle: &NetHandle) -> Result<Box<dyn Connecting>> {
        self.connect(dev, handle)
    }
    /// The communicator's deadline (`Waiter::timeout`, `ROCCL_TIMEOUT` by default): how long
    /// a connection may go without progress before it fails. The userspace RoCE v2 engine
    /// retransmits, backing off, until then (a NIC keeps IB's retry count); networks that
    /// never give up on their own ignore it. Applies to connections made afterwards.
    fn set_timeout(&self, _timeout: std::time::Duration) {}
    /// The key of the job (from its unique id, [`crate::bootstrap::UniqueId::job_key`]):
    /// listeners made afterwards admit only connections whose hello proves knowledge of it
    /// and of the listener's handle, checked before anything is allocated for them; connections
    /// made afterwards prove it. Without a call, connections prove knowledge of the
    /// listener's handle only (a random token in it). Networks without listeners of their
    /// own ignore it.
    fn set_job_key(&self, _key: &JobKey) {}
    /// Encrypt the connections made afterwards (the job's unique id says so,
    /// [`crate::bootstrap::UniqueId::encrypted`]; keys from the job key). Networks that
    /// cannot ignore it and say so in [`Net::encrypts`].
    fn set_encryption(&self, _on: bool) {}
    /// Append this network's counters (`name`, value) for the metrics endpoint (RoCE v2:
    /// the provider's retransmissions, NAKs, drops...). Networks without counters add none.
    fn counters(&self, out: &mut Vec<(&'static str, u64)>) {
        let _ = out;
    }
    /// Whether this network encrypts what it carries after [`Net::set_encryption`]: TCP
    /// does; RDMA cannot without losing zero copy, and shared memory never leaves the host.
    fn encrypts(&self) -> bool {
        false
    }
    /// The virtual clock of this rank's endpoint on a simulated network ([`sim`]): calls
    /// and messages move it by what the link model predicts. `None` on real networks.
    fn virtual_clock(&self) -> Option<Arc<sim::Clock>> {
        None
    }
}

/// How long a listener waits for a new connection's hello (a roccl peer sends it at once):
/// idle and half-sent connections are dropped after it.
pub(crate) const SETUP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Most connections a setup listener keeps that have not proved they belong to the job; a
/// new one past it replaces the oldest (a rank's connection, which proves itself within
/// milliseconds, is never the oldest for long), so strangers by the thousand cost a listener
/// a bounded number of sockets and buffers and never stop it accepting.
pub(crate) const MAX_STRANGERS: usize = 256;

/// Where a listener keeps connections that have not proved themselves: with
/// [`MAX_STRANGERS`] of them (those `unproved` says are) pending, the index of the oldest
/// (by `born`), to drop for a new one.
pub(crate) fn oldest_stranger<T>(
    pending: &[T],
    unproved: impl Fn(&T) -> bool,
    born: impl Fn(&T) -> std::time::Instant,
) -> Option<usize> {
    let strangers = pending.iter().filter(|p| unproved(p)).count();
    if strangers < MAX_STRANGERS {
        return None;
    }
    pending
        .iter()
        .enumerate()
        .filter(|(_, p)| unproved(p))
        .min_by_key(|(_, p)| born(p))
        .map(|(i, _)| i)
}

/// The job key a network authenticates its connections with ([`Net::set_job_key`]), and the
/// keys of its listeners: HMAC-SHA256 of the job key over the network's name and the
/// listener's token, a random 128-bit value published in the listener's handle.
pub(crate) struct NetKey(
    parking_lot::Mutex<JobKey>,
    /// Connections are encrypted ([`Net::set_encryption`]).
    std::sync::atomic::AtomicBool,
);

impl NetKey {
    /// Before [`Net::set_job_key`]: a fixed key, so that the token alone authenticates.
    pub(crate) fn new() -> NetKey {
        NetKey(
            parking_lot::Mutex::new(JobKey::from_secret(&[], b"no job key")),
            std::sync::atomic::AtomicBool::new(false),
        )
    }

    pub(crate) fn set(&self, key: &JobKey) {
        *self.0.lock() = *key;
    }

    /// Encrypt the connections made afterwards (or not).
    pub(crate) fn set_encryption(&self, on: bool) {
        self.1.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether connections made now are encrypted.
    pub(crate) fn encrypting(&self) -> bool {
        self.1.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The key of connections to the listener of `net` whose handle holds `token`.
    pub(crate) fn for_token(&self, net: &str, token: &[u8]) -> JobKey {
        let label = [
            b"roccl listener v1 ".as_slice(),
            net.as_bytes(),
            b" ",
            token,
        ]
        .concat();
        self.0.lock().derive(&label)
    }

    /// A new listener's token and the key of its connections.
    pub(crate) fn listener(&self, net: &str) -> Result<([u8; TOKEN_BYTES], JobKey)> {
        let token = crate::bootstrap::auth::random::<TOKEN_BYTES>()?;
        Ok((token, self.for_token(net, &token)))
    }
}

/// Bytes of a listener's token in its handle.
pub(crate) const TOKEN_BYTES: usize = 16;

/// The hello tags a listener has accepted, to refuse a replayed hello (bounded: the oldest
/// are forgotten first).
pub(crate) struct SeenTags {
    set: std::collections::HashSet<[u8; TAG_BYTES]>,
    order: std::collections::VecDeque<[u8; TAG_BYTES]>,
}

impl SeenTags {
    const MAX: usize = 1 << 16;

    pub(crate) fn new() -> SeenTags {
        SeenTags {
            set: Default::default(),
            order: Default::default(),
        }
    }

    /// False if `tag` was seen before (a replay); remembers it.
    pub(crate) fn first(&mut self, tag: &[u8]) -> bool {
        let Ok(t) = <[u8; TAG_BYTES]>::try_from(tag) else {
            return false;
        };
        if !self.set.insert(t) {
            return false;
        }
        self.order.push_back(t);
        if self.order.len() > Self::MAX {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }

    /// Whether `tag` was seen (without remembering it).
    pub(crate) fn contains(&self, tag: &[u8]) -> bool {
        <[u8; TAG_BYTES]>::try_from(tag).is_ok_and(|t| self.set.contains(&t))
    }
}

/// The error of a network that cannot register GPU memory.
fn no_device_memory() -> Error {
    Error::InvalidUsage(
        "this network cannot register GPU memory (only RDMA on a NIC can, through dmabuf or peer memory): stage GPU buffers through host memory".into(),
    )
}

/// A listening endpoint (`listenComm`).
pub trait ListenComm: Send {
    /// Accept the next fully established connection, if any. Never blocks. Each call
    /// reads every connection waiting at the listener (refusing strangers) and may find
    /// several complete; it hands out one and keeps the rest for the next calls, which no
    /// descriptor of [`ListenComm::poll_fds`] signals: call until `None` before polling.
    fn accept(&mut self) -> Result<Option<Box<dyn RecvComm>>>;
    /// Descriptors to poll while waiting for a connection.
    fn poll_fds(&self, out: &mut Vec<PollFd>);
}

/// A connection in progress (the state NCCL keeps inside the handle between `connect` calls).
pub trait Connecting: Send {
    /// Advance; returns the send comm once established. Never blocks.
    fn poll(&mut self) -> Result<Option<Box<dyn SendComm>>>;
    /// Descriptors to poll while waiting.
    fn poll_fds(&self, out: &mut Vec<PollFd>);
}

/// The sending side of a connection (`sendComm`).
pub trait SendComm: Send {
    /// Register memory for sends (no-op bookkeeping for networks that need none).
    ///
    /// # Safety
    /// `addr..addr+len` must stay allocated, and readable and writable, until the
    /// registration is released with [`SendComm::dereg_mr`] or the comm is dropped: an RDMA
    /// network registers it with its provider for local and remote access
    /// ([`Access::ALL`](crate::rdma::verbs::Access::ALL)), so the provider (or the peer,
    /// by RDMA) may read or write it whenever work targets it, inside a request or not.
    unsafe fn reg_mr(&mut self, addr: usize, len: usize) -> Result<MemHandle> {
        Ok(MemHandle { addr, len, key: 0 })
    }
    /// Register GPU memory for sends: with `dmabuf = Some((fd, offset))` through the NIC's
    /// dmabuf support, else through its peer-memory support. Sent without CPU copies.
    ///
    /// # Safety
    /// As [`SendComm::reg_mr`], for GPU memory: `addr..addr+len` stays allocated until the
    /// registration is released or the comm is dropped, and with `dmabuf = Some((fd,
    /// offset))`, `fd` is a dmabuf whose `offset..offset+len` is that memory.
    unsafe fn reg_mr_device(
        &mut self,
        addr: usize,
        len: usize,
        dmabuf: Option<(i32, u64)>,
    ) -> Result<MemHandle> {
        let _ = (addr, len, dmabuf);
        Err(no_device_memory())
    }
    /// Release a registration.
    fn dereg_mr(&mut self, _mr: MemHandle) -> Result<()> {
        Ok(())
    }
    /// How to copy GPU memory registered with [`SendComm::reg_mr_device`] into the
    /// network's own host buffers (eager messages), on a connection set up without
    /// [`Net::expect_device_buffers`]. Networks without such buffers ignore it.
    fn set_device_copy(&mut self, _copy: DeviceCopy) {}
    /// Post a send of `len` bytes at `data` with `tag`. `Ok(None)` when out of request slots.
    ///
    /// # Safety
    /// `data..data+len` must stay valid for reads, and unmodified, until `test` reports the
    /// request done or the comm is dropped.
    unsafe fn isend(
        &mut self,
        data: *const u8,
        len: usize,
        tag: u32,
        mr: Option<&MemHandle>,
    ) -> Result<Option<ReqId>>;
    /// Progress and report whether `req` is done (`Some(bytes sent)`).
    fn test(&mut self, req: ReqId) -> Result<Option<usize>>;
    /// Descriptors to poll while waiting for progress (empty when nothing is pending).
    fn poll_fds(&self, out: &mut Vec<PollFd>);
    /// The connection is being closed after a failure or an abort: closing need not wait
    /// for what was sent to be acknowledged (networks that drain at close skip it).
    fn abandon(&mut self) {}
    /// A fault on this host's side that explains a silent peer (the operating system
    /// refuses every send, say), if the network knows of one now.
    fn local_fault(&self) -> Option<String> {
        None
    }
    /// The connection's current round-trip time as the transport measures it (TCP's
    /// smoothed RTT, the RoCE engine's), where it has one.
    fn rtt(&self) -> Option<std::time::Duration> {
        None
    }

    /// The receiving side of this connection for messages the peer sends back through its
    /// [`RecvComm::reverse`] (on networks where [`Net::duplex`] says so; once per
    /// connection, else `None`).
    fn reverse(&mut self) -> Option<Box<dyn RecvComm>> {
        None
    }
}

/// The receiving side of a connection (`recvComm`).
pub trait RecvComm: Send {
    /// Register memory for receives.
    ///
    /// # Safety
    /// As [`SendComm::reg_mr`]: `addr..addr+len` stays allocated, and readable and
    /// writable, until [`RecvComm::dereg_mr`] or the comm is dropped.
    unsafe fn reg_mr(&mut self, addr: usize, len: usize) -> Result<MemHandle> {
        Ok(MemHandle { addr, len, key: 0 })
    }
    /// Register GPU memory for receives (see [`SendComm::reg_mr_device`]); receives into it
    /// need [`RecvComm::flush`] before the GPU reads them.
    ///
    /// # Safety
    /// As [`SendComm::reg_mr_device`].
    unsafe fn reg_mr_device(
        &mut self,
        addr: usize,
        len: usize,
        dmabuf: Option<(i32, u64)>,
    ) -> Result<MemHandle> {
        let _ = (addr, len, dmabuf);
        Err(no_device_memory())
    }
    /// Release a registration.
    fn dereg_mr(&mut self, _mr: MemHandle) -> Result<()> {
        Ok(())
    }
    /// How to copy from the network's own host buffers (eager messages) into GPU memory
    /// registered with [`RecvComm::reg_mr_device`] (see [`SendComm::set_device_copy`]).
    fn set_device_copy(&mut self, _copy: DeviceCopy) {}
    /// Post a grouped receive: the next `bufs.len()` messages, each matched to the buffer
    /// with its tag. `Ok(None)` when out of request slots.
    ///
    /// # Safety
    /// Every buffer must stay valid for writes, and not be accessed otherwise, until `test`
    /// reports the request done or the comm is dropped.
    unsafe fn irecv(&mut self, bufs: &[RecvBuf]) -> Result<Option<ReqId>>;
    /// Progress; when `req` is done, write each buffer's received size into `sizes` and
    /// return true.
    fn test(&mut self, req: ReqId, sizes: &mut [usize]) -> Result<bool>;
    /// Make received data visible to the device (`iflush`): for buffers in GPU memory
    /// registered with [`RecvComm::reg_mr_device`], a read through the NIC that completes
    /// only after its earlier writes reached the GPU; host memory needs nothing. Fails once
    /// the flush has taken over `limit` (the communicator's deadline).
    fn flush(&mut self, bufs: &[RecvBuf], limit: std::time::Duration) -> Result<()> {
        if let Some(id) = self.iflush(bufs)? {
            let t0 = std::time::Instant::now();
            while !self.test_flush(id)? {
                if t0.elapsed() > limit {
                    return Err(Error::timeout(Vec::new(), format!(
                        "flushing received GPU memory took over {limit:.0?} (ROCCL_TIMEOUT): the NIC did not complete the flush"
                    )));
                }
                std::thread::yield_now();
            }
        }
        Ok(())
    }
    /// Start a [`RecvComm::flush`] and return at once: `Ok(None)` when there is nothing to
    /// wait for (host memory), else an id for [`RecvComm::test_flush`].
    fn iflush(&mut self, _bufs: &[RecvBuf]) -> Result<Option<u64>> {
        Ok(None)
    }
    /// Progress; true once flush `id` (from [`RecvComm::iflush`]) has completed. Flushes
    /// complete in the order they were started.
    fn test_flush(&mut self, id: u64) -> Result<bool> {
        let _ = id;
        Ok(true)
    }
    /// Descriptors to poll while waiting for progress.
    fn poll_fds(&self, out: &mut Vec<PollFd>);
    /// As [`SendComm::local_fault`].
    fn local_fault(&self) -> Option<String> {
        None
    }
    /// The sending side of this connection back to the peer that opened it, received by its
    /// [`SendComm::reverse`] (see there).
    fn reverse(&mut self) -> Option<Box<dyn SendComm>> {
        None
    }
    /// On a simulated network ([`sim`]): the virtual arrival (ps) of the receive `test` last
    /// reported done, for the caller to move the rank's clock ([`sim::Clock::received`])
    /// when it uses the data. `None` on real networks.
    fn virtual_arrival(&self) -> Option<u64> {
        None
    }
}

/// A message whose tag matches no buffer the other side posted: the two ranks are in
/// different calls (the executor tags every message with its call, see `comm::agree`).
/// `theirs`: the tag of the side that is not this one's — the received message's, or, for
/// a sender, the receiver's posted buffer's.
pub(crate) fn unexpected_tag(theirs: u32) -> Error {
    Error::TagMismatch { theirs }
}

/// The source of a network error caused on this host's side (it cannot send at all): the
/// executor then blames this rank, not the peer.
#[derive(Debug)]
pub(crate) struct LocalFault;

impl std::fmt::Display for LocalFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("this host's network failed")
    }
}

impl std::error::Error for LocalFault {}

/// Whether `e` is [`LocalFault`].
pub(crate) fn is_local_fault(e: &std::io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<LocalFault>())
}

pub(crate) fn refuse_if_failed(failed: &Option<String>, what: &str) -> Result<()> {
    match failed {
        Some(f) => Err(Error::InvalidUsage(format!("{what} failed earlier: {f}"))),
        None => Ok(()),
    }
}

/// Remember the first error of a comm (see [`refuse_if_failed`]).
pub(crate) fn remember_failure<T>(failed: &mut Option<String>, r: Result<T>) -> Result<T> {
    if let Err(e) = &r {
        failed.get_or_insert_with(|| e.to_string());
    }
    r
}

/// The outstanding request `req` of a comm whose requests live in `reqs`, the
/// front one numbered `base` (ids wrap at `u32`); an unknown or already reaped
/// id is a usage error naming `what` ("send" or "receive").
pub(crate) fn pending_request<'a, T>(
    reqs: &'a mut std::collections::VecDeque<T>,
    base: u64,
    req: ReqId,
    reaped: impl Fn(&T) -> bool,
    what: &str,
) -> Result<&'a mut T> {
    let idx = req.0.wrapping_sub(base as u32) as usize;
    reqs.get_mut(idx)
        .filter(|r| !reaped(r))
        .ok_or_else(|| Error::InvalidUsage(format!("test on unknown {what} request {}", req.0)))
}

/// Whether `fd` has any of `events` (or an error) pending; never blocks.
pub(crate) fn poll_one(fd: i32, events: i16) -> bool {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: `p` is a valid pollfd for the duration of the call; timeout 0 never blocks.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0 && p.revents != 0
}

/// Start connecting the non-blocking socket `s` to `peer`. Every network opens its TCP
/// connections this way: a blocking `connect` to a peer that does not answer waits out the
/// kernel's SYN retries (minutes), past `ROCCL_TIMEOUT` and past an abort. The caller polls
/// [`connect_done`] in its wait loop, which holds the deadline and watches the abort flag.
/// An error names `peer` after `label` (e.g. "RoCE v2 setup: ").
pub(crate) fn start_connect(
    s: &socket2::Socket,
    peer: std::net::SocketAddr,
    label: &str,
) -> Result<()> {
    match s.connect(&peer.into()) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(()),
        Err(e) => Err(Error::sys(format!("{label}connect({peer})"), e)),
    }
}

/// Whether the connect [`start_connect`] began is done: `Ok(false)` while it is under way,
/// an error naming `peer` (after `label`, e.g. "RoCE v2 setup: ") when it failed. `hint`
/// says what to check.
pub(crate) fn connect_done(
    s: &socket2::Socket,
    peer: std::net::SocketAddr,
    label: &str,
    hint: &str,
) -> Result<bool> {
    use std::os::fd::AsRawFd;
    if !poll_one(s.as_raw_fd(), libc::POLLOUT) {
        return Ok(false);
    }
    match s
        .take_error()
        .map_err(|e| Error::sys("getsockopt(SO_ERROR)", e))?
    {
        Some(e) => Err(Error::sys(format!("{label}connect to {peer} ({hint})"), e)),
        None => Ok(true),
    }
}

/// Non-blocking exchange of fixed-size messages on the side channel.
pub(crate) struct Side {
    pub(crate) s: std::net::TcpStream,
    out: Vec<u8>,
    sent: usize,
    pub(crate) inb: Vec<u8>,
    want: usize,
    /// A connect still under way (see [`Side::dial`]): the peer and the error's label.
    dialing: Option<(std::net::SocketAddr, &'static str)>,
    /// When it was made (an accepted side that has not sent its part by [`SETUP_DEADLINE`]
    /// is dropped).
    born: std::time::Instant,
}

impl Side {
    pub(crate) fn new(s: std::net::TcpStream) -> Result<Side> {
        s.set_nonblocking(true)
            .map_err(|e| Error::sys("fcntl on a setup socket", e))?;
        let _ = s.set_nodelay(true);
        Ok(Side {
            s,
            out: Vec::new(),
            sent: 0,
            inb: Vec::new(),
            want: 0,
            dialing: None,
            born: std::time::Instant::now(),
        })
    }

    /// Whether [`SETUP_DEADLINE`] has passed since the side was made.
    pub(crate) fn overdue(&self) -> bool {
        self.born.elapsed() > SETUP_DEADLINE
    }

    /// When it was made.
    pub(crate) fn born(&self) -> std::time::Instant {
        self.born
    }

    /// The peer's IP address, for the log of a refused stranger.
    pub(crate) fn peer_ip(&self) -> Option<std::net::IpAddr> {
        self.s.peer_addr().ok().map(|a| a.ip())
    }

    /// Start connecting to `peer` without blocking: [`Side::pump`] moves nothing until the
    /// connection is up, and fails naming `peer` (after `label`) if it cannot be made.
    pub(crate) fn dial(peer: std::net::SocketAddr, label: &'static str) -> Result<Side> {
        use socket2::{Domain, Protocol, Socket, Type};
        let s = Socket::new(Domain::for_address(peer), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::sys(format!("{label}socket() to connect to {peer}"), e))?;
        s.set_nonblocking(true)
            .map_err(|e| Error::sys("fcntl on a setup socket", e))?;
        let _ = s.set_nodelay(true);
        start_connect(&s, peer, label)?;
        let mut side = Side::new(s.into())?;
        side.dialing = Some((peer, label));
        Ok(side)
    }
    pub(crate) fn queue(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }
    pub(crate) fn expect(&mut self, n: usize) {
        self.want += n;
    }
    /// Move bytes; true when everything queued is sent and everything expected arrived.
    pub(crate) fn pump(&mut self) -> Result<bool> {
        if let Some((peer, label)) = self.dialing {
            let s = socket2::SockRef::from(&self.s);
            if !connect_done(
                &s,
                peer,
                label,
                "is the peer alive and the address reachable?",
            )? {
                return Ok(false);
            }
            self.dialing = None;
        }
        while self.sent < self.out.len() {
            match self.s.write(&self.out[self.sent..]) {
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(Error::sys("connection setup (send)", e)),
            }
        }
        let mut tmp = [0u8; 128];
        while self.inb.len() < self.want {
            let k = (self.want - self.inb.len()).min(tmp.len());
            match self.s.read(&mut tmp[..k]) {
                Ok(0) => {
                    return Err(Error::sys(
                        "connection setup: the peer closed the connection",
                        std::io::ErrorKind::UnexpectedEof.into(),
                    ))
                }
                Ok(n) => self.inb.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(Error::sys("connection setup (receive)", e)),
            }
        }
        Ok(self.sent == self.out.len() && self.inb.len() >= self.want)
    }
}

/// Watches the setup connection, which stays open for the comm's lifetime: when the peer's
/// process exits, the kernel closes it. RDMA (or shared memory) alone does not notice a dead peer
/// soon; a rank waiting for a clear-to-send or for data would otherwise wait for
/// `ROCCL_TIMEOUT`.
pub(crate) struct Liveness {
    pub(crate) side: std::net::TcpStream,
    label: &'static str,
    polls: u32,
    gone_since: Option<std::time::Instant>,
}

/// After the peer closed, pending work may still complete (its engine lingers to deliver
/// inline sends); give it this long.
const PEER_GONE_GRACE: std::time::Duration = std::time::Duration::from_millis(300);

impl Liveness {
    pub(crate) fn new(side: std::net::TcpStream, label: &'static str) -> Liveness {
        let _ = side.set_nonblocking(true);
        Liveness {
            side,
            label,
            polls: 0,
            gone_since: None,
        }
    }

    /// Err when the peer is gone and `waiting` says we still need it.
    pub(crate) fn check(&mut self, waiting: bool, what: &str) -> Result<()> {
        self.polls = self.polls.wrapping_add(1);
        if self.gone_since.is_none() && self.polls % 32 == 0 {
            let mut b = [0u8; 1];
            match self.side.peek(&mut b) {
                Ok(0) => self.gone_since = Some(std::time::Instant::now()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => self.gone_since = Some(std::time::Instant::now()),
            }
        }
        match self.gone_since {
            Some(t) if waiting && t.elapsed() > PEER_GONE_GRACE => Err(Error::sys(
                format!("{} {what}: the peer closed its connection (its process exited or it destroyed the communicator) while this rank still waits for it", self.label),
                std::io::ErrorKind::UnexpectedEof.into(),
            )),
            _ => Ok(()),
        }
    }
}

/// The buffers of one (grouped) receive and what arrived in them, as the networks that match
/// incoming messages themselves (shared memory, eager RDMA) keep them: message `k` of the
/// receive goes to the first buffer not yet filled whose tag it carries.
#[derive(Clone, Copy)]
pub(crate) struct RecvGroup {
    n: u8,
    got: u8,
    filled: u8,
    /// Each buffer's (address, length, tag).
    pub bufs: [(usize, usize, u32); MAX_RECVS],
    sizes: [usize; MAX_RECVS],
}

impl RecvGroup {
    /// The buffers of a receive (1 to MAX_RECVS of them, else an error).
    pub(crate) fn new(bufs: &[RecvBuf]) -> Result<RecvGroup> {
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(Error::arg(format!(
                "a grouped receive takes 1 to {MAX_RECVS} buffers, got {}",
                bufs.len()
            )));
        }
        let mut g = RecvGroup {
            n: bufs.len() as u8,
            got: 0,
            filled: 0,
            bufs: [(0, 0, 0); MAX_RECVS],
            sizes: [0; MAX_RECVS],
        };
        for (d, b) in g.bufs.iter_mut().zip(bufs) {
            *d = (b.ptr as usize, b.len, b.tag);
        }
        Ok(g)
    }

    /// Buffers in the receive.
    pub(crate) fn len(&self) -> usize {
        self.n as usize
    }

    /// The buffer a message with `tag` and `len` bytes goes to (errors on an unknown tag or
    /// a message larger than its buffer).
    pub(crate) fn buffer_for(&self, tag: u32, len: usize) -> Result<usize> {
        let Some(e) =
            (0..self.len()).find(|&e| self.filled & (1 << e) == 0 && self.bufs[e].2 == tag)
        else {
            return Err(unexpected_tag(tag));
        };
        if len > self.bufs[e].1 {
            return Err(Error::InvalidUsage(format!(
                "received {len} bytes but the buffer holds only {} (mismatched counts between sender and receiver?)",
                self.bufs[e].1
            )));
        }
        Ok(e)
    }

    /// Buffer `e` received `len` bytes; true when the receive is complete. Errors when the
    /// buffer does not exist or was filled already.
    pub(crate) fn fill(&mut self, e: usize, len: usize) -> Result<bool> {
        if e >= self.len() || self.filled & (1 << e) != 0 {
            return Err(Error::Internal(format!(
                "a message for buffer {e} of a receive of {} (filled {:#b})",
                self.n, self.filled
            )));
        }
        self.sizes[e] = len;
        self.filled |= 1 << e;
        self.got += 1;
        Ok(self.done())
    }

    /// Every buffer received its message.
    pub(crate) fn done(&self) -> bool {
        self.got == self.n
    }

    /// The sizes received, one per buffer.
    pub(crate) fn sizes(&self) -> &[usize] {
        &self.sizes[..self.len()]
    }
}

/// Drop the requests reaped at the front of `reqs` (ids start at `base`).
pub(crate) fn pop_reaped<T>(
    reqs: &mut std::collections::VecDeque<T>,
    base: &mut u64,
    reaped: impl Fn(&T) -> bool,
) {
    while reqs.front().is_some_and(&reaped) {
        reqs.pop_front();
        *base += 1;
    }
}

/// Which network to use (`ROCCL_NET`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetKind {
    /// Pick the best available per peer.
    Auto,
    /// TCP sockets.
    Tcp,
    /// RDMA over RoCE v2 through the userspace engine (UDP).
    RoceV2,
    /// RDMA over RoCE v2 on a NIC through libibverbs (cargo feature `verbs`).
    Verbs,
    /// Shared memory, for ranks all on one host.
    Shm,
    /// The simulated network: ranks that are threads of one process, with virtual time
    /// from a link model (`ROCCL_SIM`; [`sim`]).
    Sim,
}

impl NetKind {
    /// The networks that can run between hosts, in the order of their lanes beside the main
    /// network (`ROCCL_NETS`: lane 1 + the place here).
    pub const BETWEEN_HOSTS: [NetKind; 3] = [NetKind::Tcp, NetKind::RoceV2, NetKind::Verbs];

    /// The name `ROCCL_NET` takes for it (and its network's [`Net::name`]).
    pub fn name(self) -> &'static str {
        match self {
            NetKind::Auto => "auto",
            NetKind::Tcp => "tcp",
            NetKind::RoceV2 => "rocev2",
            NetKind::Verbs => "verbs",
            NetKind::Shm => "shm",
            NetKind::Sim => "sim",
        }
    }
}

impl std::str::FromStr for NetKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(NetKind::Auto),
            "tcp" | "socket" => Ok(NetKind::Tcp),
            "rocev2" | "roce" | "rdma" | "userspace" => Ok(NetKind::RoceV2),
            "verbs" | "ib" | "nic" => Ok(NetKind::Verbs),
            "shm" | "shared" => Ok(NetKind::Shm),
            "sim" | "simulated" => Ok(NetKind::Sim),
            other => Err(Error::arg(format!(
                "unknown network '{other}' (ROCCL_NET / --net): expected auto, tcp, rocev2 (userspace RoCE v2), verbs (RoCE v2 NIC), shm (shared memory, one host) or sim (simulated, ranks as threads of one process)"
            ))),
        }
    }
}

/// Open the network for `kind` on the local address `ip`, as `settings` say.
///
/// `Auto` picks a RoCE v2 NIC when roccl was built with the `verbs` feature and a usable
/// device exists, else TCP, and says why once per process (`ROCCL_DEBUG=INFO`).
pub fn open(kind: NetKind, ip: std::net::IpAddr, settings: &NetSettings) -> Result<Arc<dyn Net>> {
    match kind {
        NetKind::Tcp => Ok(Arc::new(tcp::TcpNet::with_addr(ip, &settings.tcp)?)),
        NetKind::RoceV2 => Ok(Arc::new(rocev2::RoceNet::userspace(
            ip,
            &settings.rocev2,
        )?)),
        NetKind::Verbs => open_verbs(ip, &settings.rocev2),
        NetKind::Shm => Ok(Arc::new(shm::ShmNet::new(&settings.shm)?)),
        NetKind::Sim => Err(Error::arg(
            "ROCCL_NET=sim: the simulated network is opened by a communicator, which knows its rank (Communicator::init with Config::net = NetKind::Sim); it cannot serve as a plugin's network",
        )),
        NetKind::Auto => match auto_nic(ip, &settings.rocev2) {
            Ok(n) => Ok(n),
            Err(why) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| crate::info!("network: tcp ({why})"));
                Ok(Arc::new(tcp::TcpNet::with_addr(ip, &settings.tcp)?))
            }
        },
    }
}

#[cfg(feature = "verbs")]
fn open_verbs(ip: std::net::IpAddr, settings: &rocev2::RoceSettings) -> Result<Arc<dyn Net>> {
    Ok(Arc::new(rocev2::RoceNet::nic(ip, settings)?))
}

#[cfg(not(feature = "verbs"))]
fn open_verbs(_ip: std::net::IpAddr, _settings: &rocev2::RoceSettings) -> Result<Arc<dyn Net>> {
    Err(Error::arg(
        "ROCCL_NET=verbs: this roccl was built without the `verbs` feature; rebuild with `cargo build --features verbs` (needs libibverbs-dev, librdmacm-dev and libclang-dev), or use ROCCL_NET=rocev2 for RoCE v2 in userspace",
    ))
}

/// The NIC network if one is usable, else why not.
fn auto_nic(
    ip: std::net::IpAddr,
    settings: &rocev2::RoceSettings,
) -> std::result::Result<Arc<dyn Net>, String> {
    use crate::rdma::select;
    let ports =
        select::scan(std::path::Path::new(select::SYSFS_ROOT)).map_err(|e| e.to_string())?;
    if ports.is_empty() {
        return Err(
            "no RDMA device in /sys/class/infiniband; ROCCL_NET=rocev2 runs RoCE v2 in userspace"
                .into(),
        );
    }
    if cfg!(not(feature = "verbs")) {
        return Err(format!(
            "RDMA device {} present but this roccl was built without the `verbs` feature",
            ports[0].dev
        ));
    }
    let choice = select::choose(&ports, &settings.criteria)
        .map_err(|e| format!("no usable RoCE v2 GID: {e}"))?;
    let n = open_verbs(ip, settings).map_err(|e| format!("{} unusable: {e}", choice.dev))?;
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        crate::info!(
            "network: verbs on {}:{} GID {} ({})",
            choice.dev,
            choice.port,
            choice.gid_index,
            choice.why
        )
    });
    Ok(n)
}

/// Test helper: connect a send comm to a receive comm of `net`, polling both sides.
#[cfg(test)]
pub(crate) fn connect_pair(net: &dyn Net) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
    let (h, mut l) = net.listen(0).unwrap();
    let mut c = net.connect(0, &h).unwrap();
    let (mut s, mut r) = (None, None);
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while s.is_none() || r.is_none() {
        assert!(
            std::time::Instant::now() < give_up,
            "{}: connecting a pair took over 20 s (broken handshake?)",
            net.name()
        );
        if s.is_none() {
            s = c.poll().unwrap();
        }
        if r.is_none() {
            r = l.accept().unwrap();
        }
    }
    (s.unwrap(), r.unwrap())
}

/// A rank of another job (or one without the secret) that has the listener's handle: its
/// well-formed hello, under another job key, is refused (counted) on every network and
/// never becomes a connection; a connection of the job then works.
#[cfg(test)]
#[test]
fn a_hello_under_another_jobs_key_is_refused_on_every_network() {
    use std::time::{Duration, Instant};
    let lo = std::net::IpAddr::from([127, 0, 0, 1]);
    type Make = fn(std::net::IpAddr) -> Box<dyn Net>;
    let makes: [Make; 3] = [
        |ip| Box::new(tcp::TcpNet::with_addr(ip, &Default::default()).unwrap()),
        |ip| Box::new(rocev2::RoceNet::userspace(ip, &Default::default()).unwrap()),
        |_| Box::new(shm::ShmNet::new(&Default::default()).unwrap()),
    ];
    for make in makes {
        let (ours, theirs) = (make(lo), make(lo));
        ours.set_job_key(&JobKey::from_secret(&[1; 16], b"job"));
        theirs.set_job_key(&JobKey::from_secret(&[2; 16], b"job"));
        let (h, mut l) = ours.listen(0).unwrap();
        let before = crate::bootstrap::auth::refused();
        let mut impostor = theirs.connect(0, &h).unwrap();
        let t = Instant::now();
        while crate::bootstrap::auth::refused() == before {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{}: the impostor's hello was not refused",
                ours.name()
            );
            let _ = impostor.poll();
            assert!(
                l.accept().unwrap().is_none(),
                "{}: an impostor was accepted",
                ours.name()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut c = ours.connect(0, &h).unwrap();
        let (mut s, mut r) = (None, None);
        while s.is_none() || r.is_none() {
            assert!(t.elapsed() < Duration::from_secs(20), "{}", ours.name());
            if s.is_none() {
                s = c.poll().unwrap();
            }
            if r.is_none() {
                r = l.accept().unwrap();
            }
        }
    }
}

/// The cap of every setup listener: with `MAX_STRANGERS` unproved connections pending, the
/// oldest of them (never a proved one) is the one to drop; below it, none.
#[cfg(test)]
#[test]
fn the_oldest_unproved_connection_gives_way_at_the_cap() {
    let t0 = std::time::Instant::now();
    let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
    // (born, proved)
    let mut p: Vec<(std::time::Instant, bool)> = (0..MAX_STRANGERS as u64 - 1)
        .map(|k| (at(k + 10), false))
        .collect();
    p.push((at(1), true)); // the oldest, but proved
    let unproved = |x: &(std::time::Instant, bool)| !x.1;
    assert_eq!(oldest_stranger(&p, unproved, |x| x.0), None);
    p.push((at(5), false));
    assert_eq!(oldest_stranger(&p, unproved, |x| x.0), Some(p.len() - 1));
}
