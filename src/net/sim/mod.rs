//! The simulated network (`ROCCL_NET=sim`): ranks that are threads of one process, with a
//! virtual clock per rank and a link model that says how long each message would take on a
//! cluster of a given shape ([`SimSpec`], `ROCCL_SIM`).
//!
//! Data moves for real, in memory: a connection is a queue shared by its two sides. A
//! message of up to [`EAGER_MAX`] bytes is copied into the connection's byte queue at once
//! (its send is done), while the queue holds at most [`EAGER_BUDGET`] bytes; a larger one
//! waits in the sender's buffer and the receiver copies it straight out of it (its send is
//! done once copied). Nothing is allocated per message once the queues have grown.
//!
//! With `data=0` in the spec, messages larger than [`DATA_FREE_ABOVE`] move no bytes: the
//! queues count their lengths only and a receive leaves its buffer as it was (for timing
//! sizes whose buffers would not fit in memory). Smaller ones still carry theirs: the
//! executor's connection hellos and notices are messages too.
//!
//! Virtual time: a send costs the sender `msg_us` of its clock and is stamped with the
//! clock; `model::arrival` books the sender's port (the host's NIC between hosts, the
//! rank's own link inside one) for the message's serialisation time and the receiver's port
//! as long after the latency. A receive, when `test` reports it done, moves the receiver's
//! clock to the latest arrival of its messages if that is later, plus `msg_us`.
//!
//! Waking: each rank's network has one eventfd. A side that is about to sleep
//! (`poll_fds` with work pending) says so in the connection; the other side, after it
//! queued or copied a message, writes the eventfd of the sleeper's rank.
//!
//! Endpoints are found through a process-wide registry keyed by the job (a fingerprint
//! of the job key) and a listener number; a handle from another process is refused naming
//! both processes.

pub mod model;

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::Mutex;

use super::{
    Connecting, ListenComm, MemHandle, Net, NetHandle, NetProperties, PollFd, PtrSupport, RecvBuf,
    RecvComm, RecvGroup, ReqId, SendComm, MAX_RECVS, MAX_REQUESTS,
};
use crate::bootstrap::auth::JobKey;
use crate::error::{Error, Result};
use model::{arrival, Port};
pub use model::{Clock, SimSpec, SIM_KEYS};

const HANDLE_MAGIC: u32 = 0x4d49_5352; // "RSIM"
/// Messages up to this size are copied into the connection at once (eager): their send is
/// done in real time at once, as in virtual time. Every slice of a pipelined algorithm
/// (at most 512 KiB) is: a send that waited in real time for the receiver would let the
/// sender's clock run on (it takes other messages meanwhile) and stamp its next send late.
pub const EAGER_MAX: usize = 4 << 20;
/// Most bytes of eager messages a connection holds before later sends wait for the
/// receiver (they go direct): the algorithms' windows of slices in flight fit.
pub const EAGER_BUDGET: usize = 16 << 20;

/// With `data=0`, messages of more bytes than this carry none.
pub const DATA_FREE_ABOVE: usize = 64 << 10;

/// One job's shared state: its spec and the NICs of each host, by (host, NIC).
struct Job {
    spec: SimSpec,
    nics: Mutex<HashMap<(usize, usize), Arc<Port>>>,
}

/// The process-wide registry: jobs by fingerprint, listeners by (job, number).
#[derive(Default)]
struct Registry {
    jobs: HashMap<u64, Weak<Job>>,
    listeners: HashMap<(u64, u64), Weak<Listener>>,
    next: u64,
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// A rank's eventfd, with a flag that says it may be readable (see [`Wake::drain`]).
struct Wake {
    fd: std::fs::File,
    signalled: AtomicBool,
}

impl Wake {
    fn new() -> Result<Wake> {
        // SAFETY: eventfd(2) takes no pointers; a non-negative result is a new descriptor
        // that nothing else owns.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::sys(
                "sim network: eventfd for waking a rank (out of file descriptors? raise `ulimit -n`: each simulated rank takes about 4)",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: `fd` was just created and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Wake {
            fd: fd.into(),
            signalled: AtomicBool::new(false),
        })
    }

    /// Wake the rank: write the eventfd, then raise the flag (a reader that sees the flag
    /// finds the write).
    fn ring(&self) {
        let _ = (&self.fd).write(&1u64.to_ne_bytes());
        self.signalled.store(true, Ordering::Release);
    }

    /// Empty the eventfd if it was written since the last look, so that a poll sleeps again.
    fn drain(&self) {
        if self.signalled.load(Ordering::Relaxed) && self.signalled.swap(false, Ordering::AcqRel) {
            let mut b = [0u8; 8];
            let _ = (&self.fd).read(&mut b);
        }
    }

    fn poll_fd(&self) -> PollFd {
        PollFd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
        }
    }
}

/// One rank's side of the simulated network.
struct Endpoint {
    rank: usize,
    host: usize,
    clock: Arc<Clock>,
    /// This rank's NIC, shared with the other ranks of its host that use it.
    nic: Arc<Port>,
    /// This rank's link to the other ranks of its host.
    local: Port,
    wake: Wake,
    /// Keeps the job (its NICs) alive while a rank of it is.
    _job: Arc<Job>,
}

/// The simulated network of one rank.
pub struct SimNet {
    rank: usize,
    spec: SimSpec,
    clock: Arc<Clock>,
    /// Fingerprint of the job key ([`Net::set_job_key`]; 0 without one).
    job: AtomicU64,
    ep: Mutex<Option<Arc<Endpoint>>>,
    /// Messages and bytes sent.
    sent: Arc<[AtomicU64; 2]>,
}

impl SimNet {
    /// The network of `rank` in a cluster shaped as `spec`.
    pub fn new(rank: usize, spec: SimSpec) -> Result<SimNet> {
        spec.host_of(rank)?;
        let clock = Arc::new(Clock::default());
        clock.set_reduce_speed(spec.reduce_gbs);
        clock.set_msg_ps(spec.msg_ps());
        Ok(SimNet {
            rank,
            spec,
            clock,
            job: AtomicU64::new(0),
            ep: Mutex::new(None),
            sent: Arc::new([AtomicU64::new(0), AtomicU64::new(0)]),
        })
    }

    /// This rank's endpoint, made at the first listen or connect (after the job key).
    fn endpoint(&self) -> Result<Arc<Endpoint>> {
        let mut ep = self.ep.lock();
        if let Some(e) = &*ep {
            return Ok(Arc::clone(e));
        }
        let fp = self.job.load(Ordering::Relaxed);
        let job = {
            let mut reg = registry().lock();
            reg.jobs.retain(|_, j| j.strong_count() > 0);
            match reg.jobs.get(&fp).and_then(Weak::upgrade) {
                Some(j) if j.spec != self.spec => {
                    return Err(Error::arg(format!(
                        "rank {}: ROCCL_SIM={} differs from the job's ({}): every rank must simulate the same cluster",
                        self.rank, self.spec, j.spec
                    )))
                }
                Some(j) => j,
                None => {
                    let j = Arc::new(Job {
                        spec: self.spec.clone(),
                        nics: Mutex::new(HashMap::new()),
                    });
                    reg.jobs.insert(fp, Arc::downgrade(&j));
                    j
                }
            }
        };
        let host = self.spec.host_of(self.rank)?;
        let nic = Arc::clone(
            job.nics
                .lock()
                .entry((host, self.spec.nic_of(self.rank)))
                .or_default(),
        );
        let e = Arc::new(Endpoint {
            rank: self.rank,
            host,
            clock: Arc::clone(&self.clock),
            nic,
            local: Port::default(),
            wake: Wake::new()?,
            _job: job,
        });
        *ep = Some(Arc::clone(&e));
        Ok(e)
    }

    /// The rank's virtual clock.
    pub fn clock(&self) -> Arc<Clock> {
        Arc::clone(&self.clock)
    }
}

fn fingerprint(key: &JobKey) -> u64 {
    let d = key.derive(b"roccl sim job v1");
    u64::from_le_bytes(d.bytes()[..8].try_into().expect("8 bytes"))
}

impl Net for SimNet {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn devices(&self) -> usize {
        1
    }

    fn properties(&self, dev: usize) -> Result<NetProperties> {
        if dev != 0 {
            return Err(Error::arg(format!("sim network: no device {dev}")));
        }
        Ok(NetProperties {
            // Ranks of a host that share a NIC of the spec show the same device.
            name: format!("sim-nic{}", self.spec.nic_of(self.rank)),
            pci_path: None,
            guid: ((self.spec.host_of(self.rank)? as u64) << 16)
                | self.spec.nic_of(self.rank) as u64,
            ptr_support: PtrSupport {
                host: true,
                device: false,
                dmabuf: false,
            },
            speed_mbps: (self.spec.nic_gbps * 1000.0).min(u32::MAX as f64) as u32,
            port: 1,
            latency_us: (self.spec.nic_us + 2.0 * self.spec.msg_us) as f32,
            max_comms: u32::MAX,
            max_recvs: MAX_RECVS as u32,
        })
    }

    fn set_job_key(&self, key: &JobKey) {
        self.job.store(fingerprint(key), Ordering::Relaxed);
    }

    fn listen(&self, dev: usize) -> Result<(NetHandle, Box<dyn ListenComm>)> {
        self.properties(dev)?;
        let ep = self.endpoint()?;
        let fp = self.job.load(Ordering::Relaxed);
        let l = Arc::new(Listener {
            ep: Arc::clone(&ep),
            queue: Mutex::new(VecDeque::new()),
        });
        let id = {
            let mut reg = registry().lock();
            reg.next += 1;
            let id = reg.next;
            reg.listeners.insert((fp, id), Arc::downgrade(&l));
            id
        };
        let mut h = [0u8; 28];
        h[0..4].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
        h[4..8].copy_from_slice(&std::process::id().to_le_bytes());
        h[8..16].copy_from_slice(&fp.to_le_bytes());
        h[16..24].copy_from_slice(&id.to_le_bytes());
        h[24..28].copy_from_slice(&(self.rank as u32).to_le_bytes());
        Ok((
            NetHandle::from_bytes(&h)?,
            Box::new(SimListen { l, key: (fp, id) }),
        ))
    }

    fn connect(&self, _dev: usize, handle: &NetHandle) -> Result<Box<dyn Connecting>> {
        let b = handle.as_bytes();
        let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let long = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        if word(0) != HANDLE_MAGIC {
            return Err(Error::arg(
                "sim network: the peer's handle is not a sim handle (does every rank use ROCCL_NET=sim?)",
            ));
        }
        let (pid, fp, id, peer) = (word(4), long(8), long(16), word(24));
        if pid != std::process::id() {
            return Err(Error::arg(format!(
                "sim network: rank {peer} is in process {pid}, not in this one ({}): ROCCL_NET=sim connects only ranks that are threads of one process (use tcp or shm between processes)",
                std::process::id()
            )));
        }
        let Some(l) = registry()
            .lock()
            .listeners
            .get(&(fp, id))
            .and_then(Weak::upgrade)
        else {
            return Err(Error::Remote {
                rank: peer as usize,
                cause: crate::error::PeerCause::Failed,
                msg: format!(
                    "sim network: rank {peer}'s endpoint is gone (its communicator was destroyed) or belongs to another job"
                ),
            });
        };
        let ep = self.endpoint()?;
        let same_host = ep.host == l.ep.host;
        let ch = Arc::new(Channel {
            data: self.spec.data,
            src: ep,
            dst: Arc::clone(&l.ep),
            link: self.spec.link(same_host),
            same_host,
            direct_done: AtomicU64::new(0),
            inner: Mutex::new(Inner::default()),
        });
        l.queue.lock().push_back(Arc::clone(&ch));
        l.ep.wake.ring();
        Ok(Box::new(SimConnecting(Some(SimSend {
            ch,
            reqs: VecDeque::with_capacity(MAX_REQUESTS),
            base: 0,
            direct_sent: 0,
            failed: None,
            sent: Arc::clone(&self.sent),
        }))))
    }

    fn counters(&self, out: &mut Vec<(&'static str, u64)>) {
        out.push(("sim_messages", self.sent[0].load(Ordering::Relaxed)));
        out.push(("sim_bytes", self.sent[1].load(Ordering::Relaxed)));
    }

    fn virtual_clock(&self) -> Option<Arc<Clock>> {
        Some(self.clock())
    }
}

/// A listener: connections made to it, not yet accepted.
struct Listener {
    ep: Arc<Endpoint>,
    queue: Mutex<VecDeque<Arc<Channel>>>,
}

struct SimListen {
    l: Arc<Listener>,
    key: (u64, u64),
}

impl Drop for SimListen {
    fn drop(&mut self) {
        registry().lock().listeners.remove(&self.key);
    }
}

impl ListenComm for SimListen {
    fn accept(&mut self) -> Result<Option<Box<dyn RecvComm>>> {
        self.l.ep.wake.drain();
        let Some(ch) = self.l.queue.lock().pop_front() else {
            return Ok(None);
        };
        Ok(Some(Box::new(SimRecv {
            ch,
            reqs: VecDeque::with_capacity(MAX_REQUESTS),
            base: 0,
            filling: 0,
            failed: None,
            last_arrival: 0,
        })))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(self.l.ep.wake.poll_fd());
        if !self.l.queue.lock().is_empty() {
            self.l.ep.wake.ring();
        }
    }
}

struct SimConnecting(Option<SimSend>);

impl Connecting for SimConnecting {
    fn poll(&mut self) -> Result<Option<Box<dyn SendComm>>> {
        Ok(self.0.take().map(|s| Box::new(s) as Box<dyn SendComm>))
    }

    fn poll_fds(&self, _out: &mut Vec<PollFd>) {}
}

/// A byte queue that keeps its memory: eager messages in order.
#[derive(Default)]
struct Bytes {
    buf: Vec<u8>,
    head: usize,
    len: usize,
}

impl Bytes {
    fn push(&mut self, src: &[u8]) {
        if self.len + src.len() > self.buf.len() {
            let cap = (self.len + src.len()).next_power_of_two().max(4096);
            let mut grown = vec![0u8; cap];
            self.copy_out(&mut grown[..self.len]);
            self.buf = grown;
            self.head = 0;
        }
        let cap = self.buf.len();
        let at = (self.head + self.len) % cap;
        let first = src.len().min(cap - at);
        self.buf[at..at + first].copy_from_slice(&src[..first]);
        self.buf[..src.len() - first].copy_from_slice(&src[first..]);
        self.len += src.len();
    }

    /// Copy the oldest `dst.len()` bytes out (without consuming them).
    fn copy_out(&self, dst: &mut [u8]) {
        let cap = self.buf.len();
        if dst.is_empty() {
            return;
        }
        let first = dst.len().min(cap - self.head);
        dst[..first].copy_from_slice(&self.buf[self.head..self.head + first]);
        let rest = dst.len() - first;
        dst[first..].copy_from_slice(&self.buf[..rest]);
    }

    fn pop(&mut self, n: usize) {
        self.len -= n;
        self.head = if self.len == 0 {
            0
        } else {
            (self.head + n) % self.buf.len()
        };
    }
}

struct Msg {
    len: usize,
    tag: u32,
    /// Virtual arrival, ps.
    arrival: u64,
    /// Sent direct: the sender's buffer, still its own until the receiver copied it.
    direct: Option<usize>,
}

#[derive(Default)]
struct Inner {
    msgs: VecDeque<Msg>,
    eager: Bytes,
    /// Bytes of queued eager messages that carry none (`data=0`).
    eager_free: usize,
    /// Direct messages the receiver copied.
    copied: u64,
    recv_sleeping: bool,
    send_sleeping: bool,
    send_closed: bool,
    recv_closed: bool,
}

/// One connection (one direction), shared by its two sides.
struct Channel {
    /// Messages carry their bytes (`SimSpec::data`).
    data: bool,
    src: Arc<Endpoint>,
    dst: Arc<Endpoint>,
    /// Latency and ps per byte of the link (between hosts or inside one).
    link: (u64, f64),
    same_host: bool,
    /// `Inner::copied`, readable without the lock.
    direct_done: AtomicU64,
    inner: Mutex<Inner>,
}

impl Channel {
    /// Whether a message of `len` bytes carries them (see [`DATA_FREE_ABOVE`]).
    fn carries(&self, len: usize) -> bool {
        self.data || len <= DATA_FREE_ABOVE
    }

    /// The port `ep` uses on this connection: its host's NIC, or its own local link.
    fn port<'a>(&self, ep: &'a Endpoint) -> &'a Port {
        if self.same_host {
            &ep.local
        } else {
            &ep.nic
        }
    }
}

struct SReq {
    len: usize,
    /// Sent direct: the number of direct messages copied that completes it.
    direct: Option<u64>,
    reaped: bool,
}

struct SimSend {
    ch: Arc<Channel>,
    reqs: VecDeque<SReq>,
    base: u64,
    direct_sent: u64,
    failed: Option<String>,
    sent: Arc<[AtomicU64; 2]>,
}

impl SimSend {
    fn peer_gone(&self) -> Error {
        Error::sys(
            format!(
                "sim network send to rank {}: the peer closed its connection (it failed or destroyed its communicator) while this rank still has data for it",
                self.ch.dst.rank
            ),
            std::io::ErrorKind::UnexpectedEof.into(),
        )
    }
}

impl SendComm for SimSend {
    unsafe fn isend(
        &mut self,
        data: *const u8,
        len: usize,
        tag: u32,
        _mr: Option<&MemHandle>,
    ) -> Result<Option<ReqId>> {
        super::refuse_if_failed(&self.failed, "sim send comm")?;
        if self.reqs.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let ch = &*self.ch;
        let stamp = ch.src.clock.send_stamp();
        let at = arrival(stamp, len, ch.link, ch.port(&ch.src), ch.port(&ch.dst));
        let mut g = ch.inner.lock();
        if g.recv_closed {
            drop(g);
            let e = self.peer_gone();
            return super::remember_failure(&mut self.failed, Err(e));
        }
        let eager = len <= EAGER_MAX && g.eager.len + g.eager_free + len <= EAGER_BUDGET;
        let direct = if eager {
            if len > 0 && ch.carries(len) {
                // SAFETY: the isend contract: `data..data+len` is readable.
                g.eager
                    .push(unsafe { std::slice::from_raw_parts(data, len) });
            } else {
                g.eager_free += len;
            }
            None
        } else {
            self.direct_sent += 1;
            Some(self.direct_sent)
        };
        g.msgs.push_back(Msg {
            len,
            tag,
            arrival: at,
            direct: direct.map(|_| data as usize),
        });
        if g.recv_sleeping {
            g.recv_sleeping = false;
            ch.dst.wake.ring();
        }
        drop(g);
        self.sent[0].fetch_add(1, Ordering::Relaxed);
        self.sent[1].fetch_add(len as u64, Ordering::Relaxed);
        let id = self.base + self.reqs.len() as u64;
        self.reqs.push_back(SReq {
            len,
            direct,
            reaped: false,
        });
        Ok(Some(ReqId(id as u32)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>> {
        super::refuse_if_failed(&self.failed, "sim send comm")?;
        self.ch.src.wake.drain();
        let done = self.ch.direct_done.load(Ordering::Acquire);
        let r = super::pending_request(&mut self.reqs, self.base, req, |r| r.reaped, "send")?;
        if r.direct.is_some_and(|d| d > done) {
            if self.ch.inner.lock().recv_closed {
                let e = self.peer_gone();
                return super::remember_failure(&mut self.failed, Err(e));
            }
            return Ok(None);
        }
        r.reaped = true;
        let len = r.len;
        super::pop_reaped(&mut self.reqs, &mut self.base, |r| r.reaped);
        Ok(Some(len))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(self.ch.src.wake.poll_fd());
        let waiting = self.reqs.iter().any(|r| !r.reaped && r.direct.is_some());
        if waiting {
            let mut g = self.ch.inner.lock();
            g.send_sleeping = true;
            let last = self.reqs.iter().filter_map(|r| r.direct).max().unwrap_or(0);
            if g.copied >= last || g.recv_closed {
                self.ch.src.wake.ring();
            }
        }
    }
}

impl Drop for SimSend {
    fn drop(&mut self) {
        let mut g = self.ch.inner.lock();
        g.send_closed = true;
        // The receiver must never read a buffer the sender may now free: drop the first
        // direct message not copied and everything after it.
        if let Some(i) = g.msgs.iter().position(|m| m.direct.is_some()) {
            g.msgs.truncate(i);
        }
        if g.recv_sleeping {
            self.ch.dst.wake.ring();
        }
    }
}

struct RReq {
    g: RecvGroup,
    /// Latest virtual arrival of its messages, ps.
    arrival: u64,
    reaped: bool,
}

struct SimRecv {
    ch: Arc<Channel>,
    reqs: VecDeque<RReq>,
    base: u64,
    /// Request id of the receive the next message belongs to.
    filling: u64,
    failed: Option<String>,
    /// Virtual arrival of the receive `test` last reported done.
    last_arrival: u64,
}

impl SimRecv {
    fn progress(&mut self) -> Result<()> {
        super::refuse_if_failed(&self.failed, "sim receive comm")?;
        let r = self.progress_inner();
        super::remember_failure(&mut self.failed, r)
    }

    fn progress_inner(&mut self) -> Result<()> {
        let ch = &*self.ch;
        ch.dst.wake.drain();
        if (self.filling - self.base) as usize >= self.reqs.len() {
            return Ok(());
        }
        let mut g = ch.inner.lock();
        g.recv_sleeping = false;
        let mut woke = false;
        while let Some(r) = self.reqs.get_mut((self.filling - self.base) as usize) {
            let Some(m) = g.msgs.front() else {
                if g.send_closed {
                    return Err(Error::sys(
                        format!(
                            "sim network receive from rank {}: the peer closed its connection (it failed or destroyed its communicator) while this rank still waits for it",
                            ch.src.rank
                        ),
                        std::io::ErrorKind::UnexpectedEof.into(),
                    ));
                }
                break;
            };
            let (len, tag, at, direct) = (m.len, m.tag, m.arrival, m.direct);
            let e = r.g.buffer_for(tag, len)?;
            let dst = r.g.bufs[e].0 as *mut u8;
            if len > 0 && ch.carries(len) {
                // SAFETY: `buffer_for` returned a posted buffer of at least `len` bytes that
                // the irecv contract keeps writable and unaliased until the receive is done.
                let out = unsafe { std::slice::from_raw_parts_mut(dst, len) };
                match direct {
                    // SAFETY: the sender's isend contract keeps its buffer readable until its
                    // request is done, which needs `copied` to pass it, or until its comm
                    // is dropped, which takes this lock first and removes the message.
                    Some(src) => out.copy_from_slice(unsafe {
                        std::slice::from_raw_parts(src as *const u8, len)
                    }),
                    None => g.eager.copy_out(out),
                }
            }
            if direct.is_some() {
                g.copied += 1;
                ch.direct_done.store(g.copied, Ordering::Release);
                woke |= g.send_sleeping;
                g.send_sleeping = false;
            } else if ch.carries(len) {
                g.eager.pop(len);
            } else {
                g.eager_free -= len;
            }
            g.msgs.pop_front();
            r.arrival = r.arrival.max(at);
            if r.g.fill(e, len)? {
                self.filling += 1;
            }
        }
        drop(g);
        if woke {
            ch.src.wake.ring();
        }
        Ok(())
    }
}

impl RecvComm for SimRecv {
    unsafe fn irecv(&mut self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        super::refuse_if_failed(&self.failed, "sim receive comm")?;
        let g = RecvGroup::new(bufs)?;
        if self.reqs.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let id = self.base + self.reqs.len() as u64;
        self.reqs.push_back(RReq {
            g,
            arrival: 0,
            reaped: false,
        });
        self.progress()?;
        Ok(Some(ReqId(id as u32)))
    }

    fn test(&mut self, req: ReqId, sizes: &mut [usize]) -> Result<bool> {
        self.progress()?;
        let r = super::pending_request(&mut self.reqs, self.base, req, |r| r.reaped, "receive")?;
        if !r.g.done() {
            return Ok(false);
        }
        for (d, s) in sizes.iter_mut().zip(r.g.sizes()) {
            *d = *s;
        }
        r.reaped = true;
        // The rank's clock moves when it uses the data (`Clock::received`, called by the
        // executor when the algorithm takes the receive): moving it here would let a message
        // that a thread happens to see together with an earlier one (both arrived in real
        // time) delay what the rank does with the earlier one.
        self.last_arrival = r.arrival;
        super::pop_reaped(&mut self.reqs, &mut self.base, |r| r.reaped);
        Ok(true)
    }

    fn virtual_arrival(&self) -> Option<u64> {
        Some(self.last_arrival)
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(self.ch.dst.wake.poll_fd());
        if self.reqs.iter().any(|r| !r.g.done()) {
            let mut g = self.ch.inner.lock();
            g.recv_sleeping = true;
            if !g.msgs.is_empty() || g.send_closed {
                self.ch.dst.wake.ring();
            }
        }
    }
}

impl Drop for SimRecv {
    fn drop(&mut self) {
        let mut g = self.ch.inner.lock();
        g.recv_closed = true;
        if g.send_sleeping {
            self.ch.src.wake.ring();
        }
    }
}

#[cfg(test)]
mod tests;
