//! The executor that algorithms run on: a scoped view of one call's buffers plus the
//! network requests in flight.
//!
//! Algorithms name memory as [`Reg`]ions of three buffers — the call's input (`Src`), its
//! output (`Dst`) and the communicator's staging area (`Stage`) — never as pointers. The
//! executor borrows the buffers for the call, resolves regions to addresses, checks bounds,
//! and refuses any access that would race with a request in flight (a local write or a new
//! receive over memory the network is still reading or writing). All requests are finished
//! or their connections closed before the borrow ends, so the network never touches memory
//! the caller got back. This module and the network backends are the only places that turn
//! addresses into memory.

use std::marker::PhantomData;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use crate::device::Device;
use crate::error::{Error, PeerCause, Result};
use crate::net::{MemHandle, PollFd, RecvBuf, ReqId};
use crate::reduce;
use crate::types::{DataType, RedOp};

use crate::os::wait::Waiter;
use links::Links;

mod conn_failure;
mod group;
pub(crate) mod hello;
mod mem;
use mem::gpu_memory_on_cpu_path;
pub(crate) use mem::{Mem, MemMut};
pub(crate) mod links;
mod requests;
use requests::{Op, UserBuf};
mod virtual_time;

/// Which buffer a region lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Buf {
    /// The call's input (the output itself for in-place calls).
    Src,
    /// The call's output.
    Dst,
    /// The communicator's staging buffer.
    Stage,
    /// Extra caller buffer `i` (grouped point-to-point calls).
    User(u16),
}

/// A byte range of one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reg {
    pub buf: Buf,
    pub off: usize,
    pub len: usize,
}

impl Reg {
    pub fn new(buf: Buf, off: usize, len: usize) -> Reg {
        Reg { buf, off, len }
    }
}

/// A registration of a GPU buffer on one connection, for one call.
struct DevReg {
    peer: usize,
    ch: usize,
    send: bool,
    buf: Buf,
    mr: Option<MemHandle>,
}

/// Token of a request in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tok(u32);

const MAX_OPS: usize = 128;

/// The peer's round-trip time is read from the transport (into the metrics) once per this
/// many sends.
const RTT_EVERY: u64 = 64;
/// Smallest send whose time counts toward the peer's throughput estimate (smaller ones
/// measure latency, not bandwidth).
const THROUGHPUT_MIN: usize = 64 << 10;

/// One call's buffers and requests.
pub(crate) struct Exec<'a> {
    src: UserBuf,
    dst: UserBuf,
    stage: (usize, usize),
    /// Extra caller buffers.
    users: Vec<UserBuf>,
    /// The GPU runtime of device buffers (copies between them), when there are any.
    dev: Option<&'a Arc<dyn Device>>,
    /// GPU buffers registered on connections during the call, released at its end.
    dregs: Vec<DevReg>,
    /// Each GPU buffer's dmabuf, exported once per call, and its identity.
    dmabufs: Vec<(Buf, std::fs::File, u64, (u64, u64))>,
    _borrow: PhantomData<(&'a [u8], &'a mut [u8])>,
    links: &'a mut Links,
    waiter: &'a Waiter,
    ops: Vec<Op>,
    inflight: usize,
    fds: Vec<PollFd>,
    /// The tag every message of the call carries (see [`Exec::set_tag`]).
    tag: u32,
    /// The group the algorithm runs on (see [`Exec::set_group`]): global ranks by the
    /// algorithm's rank numbers; empty for every rank in rank order.
    members: Vec<usize>,
    /// This rank's number in `members`.
    me: usize,
    /// When the bytes the call wrote are ready in virtual time (simulated network).
    ready: virtual_time::Ready,
}

impl<'a> Exec<'a> {
    /// Borrow the buffers of one call. `src == None` means in place (`Src` is `Dst`).
    /// `dev`: the GPU runtime of device buffers (needed when any buffer is one).
    pub fn new(
        src: Option<Mem<'a>>,
        dst: MemMut<'a>,
        stage: &'a mut [u8],
        links: &'a mut Links,
        waiter: &'a Waiter,
        dev: Option<&'a Arc<dyn Device>>,
    ) -> Self {
        let d = UserBuf {
            addr: dst.addr,
            len: dst.len,
            write: true,
            device: dst.device,
        };
        let s = src.map_or(d, |s| UserBuf {
            addr: s.addr,
            len: s.len,
            write: false,
            device: s.device,
        });
        // Reuse the vectors of the previous call: no allocation per call.
        let ops = std::mem::take(&mut links.scratch.ops);
        let fds = std::mem::take(&mut links.scratch.fds);
        let users = std::mem::take(&mut links.scratch.users);
        let members = std::mem::take(&mut links.scratch.members);
        // Calls are told apart for the GPU registration cache.
        links.gpu.epoch += 1;
        Exec {
            src: s,
            dst: d,
            stage: (stage.as_mut_ptr() as usize, stage.len()),
            users,
            dev,
            dregs: Vec::new(),
            dmabufs: Vec::new(),
            _borrow: PhantomData,
            links,
            waiter,
            ops,
            inflight: 0,
            fds,
            tag: 0,
            members,
            me: 0,
            ready: Default::default(),
        }
    }

    /// This rank's number in the group the algorithm runs on.
    pub fn rank(&self) -> usize {
        if self.members.is_empty() {
            self.links.rank
        } else {
            self.me
        }
    }

    /// Ranks of the group the algorithm runs on.
    pub fn nranks(&self) -> usize {
        if self.members.is_empty() {
            self.links.nranks
        } else {
            self.members.len()
        }
    }

    /// Connect what the algorithm is about to use.
    /// Checks without allocating when they all exist (every call after the first).
    pub fn ensure<I, J>(&mut self, sends: I, recvs: J) -> Result<()>
    where
        I: IntoIterator<Item = (usize, usize)> + Clone,
        J: IntoIterator<Item = (usize, usize)> + Clone,
    {
        // Channels become the slots of the current call's lanes (`Links::slot`).
        let links = &*self.links;
        let slot = |(p, c): (usize, usize)| (p, links.slot(p, c));
        if self.members.is_empty() {
            let (s2, r2) = (sends.clone(), recvs.clone());
            if links.has_all(s2.into_iter().map(slot), r2.into_iter().map(slot)) {
                return Ok(());
            }
            let s: Vec<_> = sends.into_iter().map(slot).collect();
            let r: Vec<_> = recvs.into_iter().map(slot).collect();
            return self.links.ensure(&s, &r, self.waiter);
        }
        let s = group::to_global(sends, &self.members)?;
        let r = group::to_global(recvs, &self.members)?;
        let s: Vec<_> = s.into_iter().map(slot).collect();
        let r: Vec<_> = r.into_iter().map(slot).collect();
        if self.links.has_all(s.iter().copied(), r.iter().copied()) {
            return Ok(());
        }
        self.links.ensure(&s, &r, self.waiter)
    }

    /// True for in-place calls (Src and Dst are the same memory).
    pub fn in_place(&self) -> bool {
        (self.src.addr, self.src.len) == (self.dst.addr, self.dst.len)
    }

    /// Borrow a caller buffer for reading only, for the whole call.
    pub fn add_read(&mut self, b: Mem<'a>) -> Buf {
        self.users.push(UserBuf {
            addr: b.addr,
            len: b.len,
            write: false,
            device: b.device,
        });
        Buf::User(self.users.len() as u16 - 1)
    }

    /// Borrow a caller buffer for writing, for the whole call.
    pub fn add_write(&mut self, b: MemMut<'a>) -> Buf {
        self.users.push(UserBuf {
            addr: b.addr,
            len: b.len,
            write: true,
            device: b.device,
        });
        Buf::User(self.users.len() as u16 - 1)
    }

    /// The caller buffer `b` (None: the staging area).
    fn user(&self, b: Buf) -> Result<Option<UserBuf>> {
        Ok(match b {
            Buf::Src => Some(self.src),
            Buf::Dst => Some(self.dst),
            Buf::Stage => None,
            Buf::User(i) => Some(
                *self
                    .users
                    .get(i as usize)
                    .ok_or_else(|| Error::Internal(format!("no caller buffer {i}")))?,
            ),
        })
    }

    /// Whether `b` is GPU memory.
    fn on_device(&self, b: Buf) -> Result<bool> {
        Ok(self.user(b)?.is_some_and(|u| u.device))
    }

    fn resolve(&self, r: Reg) -> Result<(usize, usize)> {
        let (base, len) = match self.user(r.buf)? {
            Some(u) => (u.addr, u.len),
            None => self.stage,
        };
        match r.off.checked_add(r.len) {
            Some(end) if end <= len => Ok((base + r.off, r.len)),
            _ => Err(Error::Internal(format!(
                "region {:?} [{}..{}) is outside its {}-byte buffer",
                r.buf,
                r.off,
                r.off.saturating_add(r.len),
                len
            ))),
        }
    }

    fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
        a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
    }

    fn check(&self, m: (usize, usize), write: bool, what: &str) -> Result<()> {
        for o in &self.ops {
            if o.active && !o.done && (write || !o.send) && Self::overlaps(m, (o.addr, o.len)) {
                return Err(Error::Internal(format!(
                    "algorithm bug: {what} over memory that a {} to/from rank {} still uses",
                    if o.send { "send" } else { "receive" },
                    o.peer
                )));
            }
        }
        Ok(())
    }

    fn slot(&mut self) -> Result<usize> {
        if let Some(i) = self.ops.iter().position(|o| !o.active) {
            return Ok(i);
        }
        if self.ops.len() >= MAX_OPS {
            return Err(Error::Internal("too many requests in flight".into()));
        }
        self.ops.push(Op {
            send: false,
            peer: 0,
            ch: 0,
            req: ReqId(0),
            addr: 0,
            len: 0,
            active: false,
            done: false,
            size: 0,
            posted: 0,
            arrival: 0,
        });
        Ok(self.ops.len() - 1)
    }

    fn remote(&mut self, peer: usize, e: Error) -> Error {
        match e {
            Error::Remote { .. } | Error::Timeout { .. } => e,
            Error::System { ref source, .. } => {
                let net = self.links.net_name(peer);
                let state = self.links.blame.peer_state(peer);
                let kind = (!crate::net::is_local_fault(source)).then(|| source.kind());
                let (silent, cause) =
                    match conn_failure::conn_failure(kind, self.links.rank, peer, net, state) {
                        // Nothing to ask the others: no notice could reach them either.
                        conn_failure::ConnFailure::Here(m) => {
                            return Error::sys(
                                format!("{m}: {e}"),
                                std::io::Error::other(crate::net::LocalFault),
                            )
                        }
                        conn_failure::ConnFailure::Silent(m) => (true, m),
                        conn_failure::ConnFailure::Gone(m) => (false, m),
                    };
                // If the peer failed because some other rank did, abort notices name that
                // rank: `failure` waits a moment for them. A silent peer is a timeout: the
                // others are told and heard as after one.
                let detail = format!("{cause}: over {net}: {e}");
                self.links.failure(Some(peer), silent, detail)
            }
            other => {
                let cause = match other {
                    Error::TagMismatch { theirs } => PeerCause::OtherCall {
                        ours: self.tag,
                        theirs,
                    },
                    _ => PeerCause::Failed,
                };
                let msg = format!("over {}: {other}", self.links.net_name(peer));
                Error::remote(peer, cause, msg)
            }
        }
    }

    /// Post a send of region `r` to `peer` on channel `ch`.
    pub fn send(&mut self, peer: usize, ch: usize, r: Reg) -> Result<Tok> {
        let peer = self.global(peer)?;
        let ch = self.links.slot(peer, ch);
        self.post(peer, ch, r, true)
    }

    /// Post a receive into region `r` from `peer` on channel `ch`.
    pub fn recv(&mut self, peer: usize, ch: usize, r: Reg) -> Result<Tok> {
        let peer = self.global(peer)?;
        let ch = self.links.slot(peer, ch);
        self.post(peer, ch, r, false)
    }

    /// Tag every message of this call with `tag` (what the call is): a peer in another
    /// call fails the first exchange with a tag mismatch instead of pairing bytes.
    pub fn set_tag(&mut self, tag: u32) {
        self.tag = tag;
        self.links.blame.call = tag;
    }

    fn post(&mut self, peer: usize, ch: usize, r: Reg, send: bool) -> Result<Tok> {
        if let (false, Buf::User(i)) = (send, r.buf) {
            if !self.users.get(i as usize).is_some_and(|u| u.write) {
                return Err(Error::Internal(format!(
                    "receive into read-only caller buffer {i}"
                )));
            }
        }
        self.check_abort()?;
        let m = self.resolve(r)?;
        self.check(m, !send, if send { "send" } else { "receive" })?;
        let i = self.slot()?;
        if r.len > 0 && self.on_device(r.buf)? {
            self.register_device(peer, ch, send, r.buf)?;
        } else if !self.links.gpu.cache.is_empty() {
            // Host memory where a cached GPU registration was (freed GPU memory whose
            // address came back as host memory): the network must not find that one.
            self.forget_device(peer, ch, send, m);
        }
        if send {
            self.sim_before_send(m);
        }
        let mut w = self.waiter.start();
        let req = loop {
            // SAFETY: `m` lies inside a buffer borrowed for 'a (checked by `resolve`); no
            // receive in flight writes it, and for a receive no request at all touches it
            // (checked above); local writes to it are refused until this request completes;
            // `Drop` closes the connections of unfinished requests before the borrow ends.
            let posted = unsafe {
                if send {
                    self.links
                        .send_comm(peer, ch)?
                        .isend(m.0 as *const u8, m.1, self.tag, None)
                } else {
                    let b = RecvBuf {
                        ptr: m.0 as *mut u8,
                        len: m.1,
                        tag: self.tag,
                    };
                    self.links.recv_comm(peer, ch)?.irecv(&[b])
                }
            };
            match posted {
                Ok(Some(req)) => {
                    self.links.count_posted(peer, ch, send);
                    break req;
                }
                Ok(None) => {
                    // Out of request slots: complete something first.
                    self.poll()?;
                    if w.idle(&[]).is_err() {
                        return Err(self.stuck());
                    }
                }
                Err(e) => return Err(self.remote(peer, e)),
            }
        };
        self.ops[i] = Op {
            send,
            peer: peer as u32,
            ch: ch as u8,
            req,
            addr: m.0,
            len: m.1,
            active: true,
            done: false,
            size: 0,
            arrival: 0,
            // Timed where traced, and big sends for the throughput estimate.
            posted: match &self.links.watch.metrics {
                Some(mt) if mt.trace().is_some() || (send && m.1 >= THROUGHPUT_MIN) => {
                    crate::metrics::now_ns()
                }
                _ => 0,
            },
        };
        self.inflight += 1;
        Ok(Tok(i as u32))
    }

    /// Register GPU buffer `buf` on the connection `(peer, ch)` for the rest of the call
    /// (once): through its dmabuf where the network takes dmabufs, else by address (peer
    /// memory). The network then moves it without the CPU. Registrations of memory whose
    /// allocation can be told apart are kept for later calls (`Links::dev_cache`).
    fn register_device(&mut self, peer: usize, ch: usize, send: bool, buf: Buf) -> Result<()> {
        if self
            .dregs
            .iter()
            .any(|d| (d.peer, d.ch, d.send, d.buf) == (peer, ch, send, buf))
        {
            return Ok(());
        }
        let u = self
            .user(buf)?
            .ok_or_else(|| Error::Internal("the staging area is not GPU memory".into()))?;
        let dev = Arc::clone(
            self.dev
                .ok_or_else(|| Error::Internal("GPU buffers without their runtime".into()))?,
        );
        let use_dmabuf = match self.links.device_memory(peer) {
            None => {
                return Err(Error::Internal(format!(
                    "GPU memory posted to rank {peer} over {}, which cannot carry it: the call should have been staged",
                    self.links.net_name(peer)
                )))
            }
            Some(d) => d,
        };
        // Registered by an earlier call? Looked up by allocation id before exporting
        // anything; without one, by the dmabuf's inode once exported.
        let alloc = dev.allocation_id(u.addr).map(|id| (u64::MAX, id));
        let mut hit = alloc.is_some_and(|id| self.cached(peer, ch, send, u, id));
        let (dmabuf, inode) = if use_dmabuf && !hit {
            self.dmabuf_of(&dev, buf, u)?
        } else {
            (None, None)
        };
        // Without an allocation id, the dmabuf's inode: the registration keeps the dmabuf,
        // so its inode is not reused while the entry lives.
        let ident = alloc.or(inode);
        if let (false, None, Some(id)) = (hit, alloc, ident) {
            hit = self.cached(peer, ch, send, u, id);
        }
        if hit {
            self.dregs.push(DevReg {
                peer,
                ch,
                send,
                buf,
                mr: None,
            });
            return Ok(());
        }
        let mr = self.register_on_connection(&dev, (peer, ch, send), u, dmabuf)?;
        let mr = self.keep_registration((peer, ch, send), u, ident, mr);
        self.dregs.push(DevReg {
            peer,
            ch,
            send,
            buf,
            mr,
        });
        Ok(())
    }

    /// The dmabuf of GPU buffer `buf` (`u`), exported once per call: its fd and offset, and
    /// its identity (device and inode of the file).
    #[allow(clippy::type_complexity)]
    fn dmabuf_of(
        &mut self,
        dev: &Arc<dyn Device>,
        buf: Buf,
        u: UserBuf,
    ) -> Result<(Option<(i32, u64)>, Option<(u64, u64)>)> {
        if !self.dmabufs.iter().any(|d| d.0 == buf) {
            let (fd, off) = dev.dmabuf_export(u.addr, u.len)?;
            let file = std::fs::File::from(fd);
            let m = file
                .metadata()
                .map_err(|e| Error::sys("fstat of an exported dmabuf", e))?;
            self.dmabufs.push((buf, file, off, (m.dev(), m.ino())));
        }
        let d = self
            .dmabufs
            .iter()
            .find(|d| d.0 == buf)
            .expect("exported above");
        Ok((Some((d.1.as_raw_fd(), d.2)), Some(d.3)))
    }

    /// Register GPU buffer `u` on the connection (peer, channel, whether it sends), handing
    /// the connection a GPU copy for the messages small enough to go eagerly (they pass
    /// through the network's host buffers).
    fn register_on_connection(
        &mut self,
        dev: &Arc<dyn Device>,
        (peer, ch, send): (usize, usize, bool),
        u: UserBuf,
        dmabuf: Option<(i32, u64)>,
    ) -> Result<MemHandle> {
        let copy_dev = Arc::clone(dev);
        // SAFETY (of the calls the network makes): it copies only between this request's
        // buffer, valid for the call, and its own staging or bounce buffers.
        let copy: crate::net::DeviceCopy =
            Arc::new(move |d, s, n| unsafe { crate::device::copy_now(&copy_dev, d, s, n) });
        let mr = if send {
            let c = self.links.send_comm(peer, ch)?;
            c.set_device_copy(copy);
            // SAFETY: `u` is the caller's GPU buffer, valid for this call; its registration
            // is released when the call ends (`release_device`), or is kept for later calls
            // only when the memory can be told apart (allocation id, or the dmabuf the
            // registration holds), and dropped before memory allocated again over it is
            // used (`cached`) or when its connection closes.
            unsafe { c.reg_mr_device(u.addr, u.len, dmabuf) }
        } else {
            let c = self.links.recv_comm(peer, ch)?;
            c.set_device_copy(copy);
            // SAFETY: as for the send side above.
            unsafe { c.reg_mr_device(u.addr, u.len, dmabuf) }
        };
        // A local failure (the NIC or its driver): no peer to blame.
        mr.map_err(|e| {
            Error::InvalidUsage(format!(
                "registering {} bytes of GPU memory on the connection {} rank {peer} over {}{} failed: {e}; set ROCCL_GPU_DIRECT=0 to stage GPU buffers through host memory instead",
                u.len,
                if send { "to" } else { "from" },
                self.links.net_name(peer),
                if dmabuf.is_some() { " (dmabuf)" } else { " (peer memory)" },
            ))
        })
    }

    /// Keep registration `mr` for later calls when its memory can be told apart (`ident`)
    /// and there is room (the least recently used entry that this call does not use goes):
    /// then `None`; else `mr`, released at the end of this call.
    fn keep_registration(
        &mut self,
        (peer, ch, send): (usize, usize, bool),
        u: UserBuf,
        ident: Option<(u64, u64)>,
        mr: MemHandle,
    ) -> Option<MemHandle> {
        let epoch = self.links.gpu.epoch;
        let keep = ident.filter(|_| {
            let cache = &self.links.gpu.cache;
            if cache.len() < links::DEV_CACHE {
                return true;
            }
            let lru = (0..cache.len())
                .filter(|&i| cache[i].call != epoch)
                .min_by_key(|&i| cache[i].used);
            lru.is_some_and(|i| self.links.drop_cached(i))
        });
        let Some(ident) = keep else {
            return Some(mr);
        };
        let used = self.links.gpu.clock;
        self.links.gpu.cache.push(links::DevCached {
            peer,
            ch,
            send,
            addr: u.addr,
            len: u.len,
            ident,
            mr,
            used,
            call: epoch,
        });
        None
    }

    /// Whether a kept registration of memory `ident` on the connection covers `u` (then
    /// marked as used by this call). Kept registrations of other memory that overlap `u`
    /// are stale (freed and allocated again): released before the network could find them
    /// by address, unless this call uses them.
    fn cached(
        &mut self,
        peer: usize,
        ch: usize,
        send: bool,
        u: UserBuf,
        ident: (u64, u64),
    ) -> bool {
        let epoch = self.links.gpu.epoch;
        self.links.gpu.clock += 1;
        let clock = self.links.gpu.clock;
        let (mut i, mut hit) = (0, false);
        while i < self.links.gpu.cache.len() {
            let e = &mut self.links.gpu.cache[i];
            let same_conn = (e.peer, e.ch, e.send) == (peer, ch, send);
            let overlaps = e.addr < u.addr + u.len && u.addr < e.addr + e.len;
            if !same_conn || !overlaps {
                i += 1;
            } else if e.ident == ident {
                if !hit && e.addr <= u.addr && u.addr + u.len <= e.addr + e.len {
                    (e.used, e.call, hit) = (clock, epoch, true);
                }
                i += 1;
            } else if e.call == epoch || !self.links.drop_cached(i) {
                i += 1;
            }
        }
        hit
    }

    /// Release cached GPU registrations of the connection that overlap `m` (not those this
    /// call uses).
    fn forget_device(&mut self, peer: usize, ch: usize, send: bool, m: (usize, usize)) {
        let epoch = self.links.gpu.epoch;
        let mut i = 0;
        while i < self.links.gpu.cache.len() {
            let e = &self.links.gpu.cache[i];
            let stale = (e.peer, e.ch, e.send) == (peer, ch, send)
                && e.call != epoch
                && Self::overlaps((e.addr, e.len), m);
            if !stale || !self.links.drop_cached(i) {
                i += 1;
            }
        }
    }

    /// End a call that moved GPU memory: make what the network wrote into it visible to the
    /// GPU (flush), then release the call's registrations. Every request must be done.
    pub fn device_done(&mut self) -> Result<()> {
        if self.dregs.is_empty() {
            return Ok(());
        }
        if self.inflight > 0 {
            return Err(Error::Internal(
                "GPU registrations released with requests in flight".into(),
            ));
        }
        let mut first = None;
        for i in 0..self.dregs.len() {
            let (peer, ch, send, buf) = {
                let d = &self.dregs[i];
                (d.peer, d.ch, d.send, d.buf)
            };
            if !send {
                let u = self
                    .user(buf)?
                    .expect("registered buffers are caller buffers");
                let b = RecvBuf {
                    ptr: u.addr as *mut u8,
                    len: u.len,
                    tag: 0,
                };
                if let Err(e) = self
                    .links
                    .recv_comm(peer, ch)?
                    .flush(&[b], self.waiter.timeout)
                {
                    first.get_or_insert(self.remote(peer, e));
                }
            }
        }
        self.release_device();
        first.map_or(Ok(()), Err)
    }

    /// Release the call's GPU registrations (those whose connection still exists).
    fn release_device(&mut self) {
        for mut d in std::mem::take(&mut self.dregs) {
            let Some(mr) = d.mr.take() else { continue };
            let r = if d.send {
                self.links
                    .send_comm(d.peer, d.ch)
                    .and_then(|c| c.dereg_mr(mr))
            } else {
                self.links
                    .recv_comm(d.peer, d.ch)
                    .and_then(|c| c.dereg_mr(mr))
            };
            if let Err(e) = r {
                crate::info!("releasing a GPU registration toward rank {}: {e}", d.peer);
            }
        }
        self.dmabufs.clear();
    }

    /// Test every request in flight; true if any completed.
    pub fn poll(&mut self) -> Result<bool> {
        let mut any = false;
        for i in 0..self.ops.len() {
            let o = self.ops[i];
            if !o.active || o.done {
                continue;
            }
            let peer = o.peer as usize;
            let ch = o.ch as usize;
            let done = if o.send {
                let r = self.links.send_comm(peer, ch)?.test(o.req);
                let r = match r {
                    Ok(r) => r,
                    Err(e) => return Err(self.remote(peer, e)),
                };
                r.inspect(|&n| self.ops[i].size = n).is_some()
            } else {
                let mut sz = [0usize; 1];
                let simulated = self.links.clock.is_some();
                let comm = self.links.recv_comm(peer, ch)?;
                let r = comm.test(o.req, &mut sz);
                let d = match r {
                    Ok(d) => d,
                    Err(e) => return Err(self.remote(peer, e)),
                };
                if d && simulated {
                    self.ops[i].arrival = comm.virtual_arrival().unwrap_or(0);
                }
                if d {
                    if sz[0] != o.len {
                        return Err(Error::Remote {
                            rank: peer,
                            cause: crate::error::PeerCause::Failed,
                            msg: format!(
                                "received {} bytes where {} were expected: the ranks called this operation with different counts or data types",
                                sz[0], o.len
                            ),
                        });
                    }
                    self.ops[i].size = sz[0];
                }
                d
            };
            if done {
                self.ops[i].done = true;
                self.inflight -= 1;
                any = true;
                // The transport's round-trip time, read once in a while (a system call on TCP).
                let mut rtt = None;
                if o.send && self.links.watch.metrics.is_some() {
                    self.links.watch.sends_done = self.links.watch.sends_done.wrapping_add(1);
                    if self.links.watch.sends_done % RTT_EVERY == 1 {
                        rtt = self.links.send_comm(peer, ch)?.rtt();
                    }
                }
                if let Some(m) = &self.links.watch.metrics {
                    let size = self.ops[i].size;
                    let dur = || crate::metrics::now_ns().saturating_sub(o.posted);
                    if o.send {
                        m.sent(peer, size);
                        if o.posted != 0 && size >= THROUGHPUT_MIN {
                            m.throughput(peer, size, dur());
                        }
                        if let Some(rtt) = rtt {
                            m.rtt(peer, rtt);
                        }
                    } else {
                        m.received(peer, size);
                    }
                    if let Some(t) = m.trace() {
                        t.message(o.send, peer, size, o.posted, dur());
                    }
                }
            }
        }
        Ok(any)
    }

    /// Has `t` completed? (Does not progress; call `poll`/`wait_any` for that.) Frees the
    /// token when it reports true.
    pub fn take(&mut self, t: Tok) -> Option<usize> {
        let o = &mut self.ops[t.0 as usize];
        if o.active && o.done {
            o.active = false;
            let size = o.size;
            self.sim_took(t.0 as usize);
            Some(size)
        } else {
            None
        }
    }

    fn stuck(&mut self) -> Error {
        // This host could not send at all: the fault is here (and no notice could reach
        // the others either).
        let fault = self
            .ops
            .iter()
            .filter(|o| o.active && !o.done)
            .find_map(|o| {
                let f = self
                    .links
                    .local_fault(o.peer as usize, o.ch as usize, o.send)?;
                Some((o.peer, f))
            });
        if let Some((peer, f)) = fault {
            return Error::sys(
                format!(
                    "rank {}: this rank's network failed: no progress for {:.0?} (ROCCL_TIMEOUT) with rank {peer} and possibly others: {f}",
                    self.links.rank, self.waiter.timeout
                ),
                std::io::Error::other(crate::net::LocalFault),
            );
        }
        // A peer waited on whose process this host sees stopped or gone is the suspect (and
        // says why); else the first peer waited on.
        let seen = self
            .ops
            .iter()
            .filter(|o| o.active && !o.done)
            .find_map(|o| {
                let p = o.peer as usize;
                Some((p, self.links.blame.peer_state(p)?))
            });
        let suspect = seen.as_ref().map(|s| s.0).or_else(|| {
            self.ops
                .iter()
                .find(|o| o.active && !o.done)
                .map(|o| o.peer as usize)
        });
        self.links.blame.suspect = suspect;
        let mut peers: Vec<String> = self
            .ops
            .iter()
            .filter(|o| o.active && !o.done)
            .map(|o| {
                format!(
                    "{} rank {}",
                    if o.send { "send to" } else { "receive from" },
                    o.peer
                )
            })
            .collect();
        peers.dedup();
        let mut waiting_on: Vec<usize> = self
            .ops
            .iter()
            .filter(|o| o.active && !o.done)
            .map(|o| o.peer as usize)
            .collect();
        waiting_on.sort_unstable();
        waiting_on.dedup();
        // What this host can see of the peer waited on (exited, stopped) says why.
        let why = seen.map_or_else(
            || "the peer may have died, hung, or called a different collective".into(),
            |(p, s)| format!("rank {p}: {s}"),
        );
        let detail = format!(
            "rank {} made no progress for {:.0?} (ROCCL_TIMEOUT) waiting on: {}; {why}",
            self.links.rank,
            self.waiter.timeout,
            if peers.is_empty() {
                "request slots".to_string()
            } else {
                peers.join(", ")
            }
        );
        match self.links.failure(suspect, true, detail) {
            Error::Timeout { msg, .. } => Error::timeout(waiting_on, msg),
            e => e,
        }
    }

    fn check_abort(&self) -> Result<()> {
        if self
            .links
            .blame
            .abort
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(Error::InvalidUsage(
                "the communicator was aborted by the application (Communicator::abort / rocclCommAbort), or revoked (ncclCommRevoke, ncclCommShrink with NCCL_SHRINK_ABORT)".into(),
            ));
        }
        Ok(())
    }

    /// Progress until at least one request completes (or none is in flight).
    pub fn wait_any(&mut self) -> Result<()> {
        let mut w = self.waiter.start();
        loop {
            self.check_abort()?;
            if self.poll()? || self.inflight == 0 {
                return Ok(());
            }
            let mut fds = std::mem::take(&mut self.fds);
            fds.clear();
            // Descriptors only when about to sleep: asking a network for them may arm its
            // wake-ups (shared memory then rings a doorbell per message).
            let ops = self.ops.iter().filter(|_| w.will_block());
            for o in ops.filter(|o| o.active && !o.done) {
                if o.send {
                    self.links
                        .send_fds(o.peer as usize, o.ch as usize, &mut fds);
                } else {
                    self.links
                        .recv_fds(o.peer as usize, o.ch as usize, &mut fds);
                }
            }
            if w.will_block() {
                self.links.listen_fds(&mut fds);
                self.note_waiting();
            }
            let r = w.idle(&fds);
            self.fds = fds;
            match r {
                Err(_) => return Err(self.stuck()),
                // Woken from sleep: a peer may have sent an abort notice.
                Ok(true) => {
                    self.links.accept_pending()?;
                    if self.links.blame.aborted() {
                        // Blamed while still waiting on someone: this rank is alive, so pass
                        // the blame on to the peer it waits for (and tell everyone), instead
                        // of letting the others settle on us.
                        let me = self.links.rank;
                        let blamed_me = self.links.blame.notices.iter().any(|n| n.1 == me);
                        let waiting_on = self
                            .ops
                            .iter()
                            .find(|o| o.active && !o.done)
                            .map(|o| o.peer as usize);
                        let detail = "another rank aborted the communicator".to_string();
                        return Err(match waiting_on.filter(|_| blamed_me) {
                            Some(p) => self.links.failure(
                                Some(p),
                                true,
                                format!("{detail} while this rank waited on rank {p}"),
                            ),
                            None => self.links.failure(None, false, detail),
                        });
                    }
                }
                Ok(false) => {}
            }
        }
    }

    /// About to sleep without progress: tell the counters which peers the call waits on
    /// (for `/status`), and log once per call when it has waited past `ROCCL_STUCK_WARN`.
    fn note_waiting(&self) {
        let Some(m) = &self.links.watch.metrics else {
            return;
        };
        let mut peers = arrayvec::ArrayVec::<usize, 64>::new();
        for o in self.ops.iter().filter(|o| o.active && !o.done) {
            let _ = peers.try_push(o.peer as usize);
        }
        if let Some(what) = m.waiting_on(&peers, self.links.watch.stuck_warn) {
            crate::warn!("{what} (ROCCL_STUCK_WARN; the call fails after ROCCL_TIMEOUT)");
        }
    }

    /// Wait for every request in flight, keeping their tokens.
    pub fn finish_keep(&mut self) -> Result<()> {
        while self.inflight > 0 {
            self.wait_any()?;
        }
        self.sim_waited_all();
        Ok(())
    }

    /// Wait for every request in flight and free all tokens.
    pub fn finish(&mut self) -> Result<()> {
        self.finish_keep()?;
        for o in &mut self.ops {
            o.active = false;
        }
        Ok(())
    }

    fn slices(&self, dst: Reg, src: Reg) -> Result<((usize, usize), (usize, usize))> {
        let d = self.resolve(dst)?;
        let s = self.resolve(src)?;
        if d.1 != s.1 {
            return Err(Error::Internal(format!(
                "local op on regions of {} and {} bytes",
                d.1, s.1
            )));
        }
        self.check(d, true, "local write")?;
        self.check(s, false, "local read")?;
        Ok((d, s))
    }

    /// Refuse CPU work on GPU memory.
    fn cpu_only(&self, regs: &[Reg]) -> Result<()> {
        for r in regs {
            if r.len > 0 && self.on_device(r.buf)? {
                return Err(gpu_memory_on_cpu_path());
            }
        }
        Ok(())
    }

    /// `dst = a op b`, or `dst op= b` when `a` is `dst` itself.
    pub fn reduce(&mut self, dst: Reg, a: Reg, b: Reg, dt: DataType, op: RedOp) -> Result<()> {
        self.cpu_only(&[dst, a, b])?;
        let (d, bm) = self.slices(dst, b)?;
        let (_, am) = self.slices(dst, a)?;
        if d.1 == 0 {
            return Ok(());
        }
        if Self::overlaps(d, bm) || (Self::overlaps(d, am) && d != am) {
            return Err(Error::Internal("reduce with overlapping operands".into()));
        }
        self.sim_reduced(d, am, bm);
        // SAFETY: all three ranges lie in buffers borrowed for 'a (resolve), no request in
        // flight writes any of them or reads `d` (check), and `d` overlaps neither input
        // except when it is exactly `a`, which then is not turned into a second slice.
        unsafe {
            let dst_s = std::slice::from_raw_parts_mut(d.0 as *mut u8, d.1);
            let b_s = std::slice::from_raw_parts(bm.0 as *const u8, bm.1);
            if d == am {
                reduce::reduce_into(dst_s, b_s, dt, op)
            } else {
                let a_s = std::slice::from_raw_parts(am.0 as *const u8, am.1);
                reduce::reduce_to(dst_s, a_s, b_s, dt, op)
            }
        }
    }

    /// Copy the first `bytes` of the input to the output (the whole collective on 1 rank).
    pub fn copy_input(&mut self, bytes: usize) -> Result<()> {
        self.copy(Reg::new(Buf::Dst, 0, bytes), Reg::new(Buf::Src, 0, bytes))
    }

    /// `dst = src` (no-op when they are the same memory). A copy from or to GPU memory
    /// runs on the GPU (and is done when this returns).
    pub fn copy(&mut self, dst: Reg, src: Reg) -> Result<()> {
        let (d, s) = self.slices(dst, src)?;
        if d == s || d.1 == 0 {
            return Ok(());
        }
        self.sim_copied(d, s);
        if self.on_device(dst.buf)? || self.on_device(src.buf)? {
            let dev = self
                .dev
                .ok_or_else(|| Error::Internal("GPU buffers without their runtime".into()))?;
            if Self::overlaps(d, s) {
                return Err(Error::Internal("overlapping copy in GPU memory".into()));
            }
            // SAFETY: both ranges lie in the call's borrowed buffers (`slices`) and are free
            // of requests; they do not overlap (checked above).
            return unsafe { crate::device::copy_now(dev, d.0, s.0, d.1) };
        }
        if Self::overlaps(d, s) {
            // SAFETY: both ranges lie in borrowed buffers and are free of requests (slices);
            // `copy` handles overlap.
            unsafe { std::ptr::copy(s.0 as *const u8, d.0 as *mut u8, d.1) };
        } else {
            // SAFETY: both ranges lie in borrowed buffers, are free of requests (slices) and
            // do not overlap, so one may be written while the other is read.
            let (dst, src) = unsafe {
                (
                    std::slice::from_raw_parts_mut(d.0 as *mut u8, d.1),
                    std::slice::from_raw_parts(s.0 as *const u8, d.1),
                )
            };
            crate::reduce::copy_large(dst, src);
        }
        Ok(())
    }

    /// Divide `r` by `n` (the end of an average).
    pub fn finish_avg(&mut self, r: Reg, dt: DataType, n: usize) -> Result<()> {
        self.cpu_only(&[r])?;
        let m = self.resolve(r)?;
        self.check(m, true, "average")?;
        if m.1 == 0 {
            return Ok(());
        }
        // SAFETY: in a borrowed buffer and free of requests.
        let s = unsafe { std::slice::from_raw_parts_mut(m.0 as *mut u8, m.1) };
        reduce::finish_avg(s, dt, n)
    }
}

impl Drop for Exec<'_> {
    fn drop(&mut self) {
        if self.inflight > 0 {
            // An error left requests unfinished: close every connection so the network
            // never touches the caller's memory after the borrow ends.
            self.links.close_all();
        }
        self.release_device();
        let mut ops = std::mem::take(&mut self.ops);
        ops.clear();
        self.links.scratch.ops = ops;
        let mut fds = std::mem::take(&mut self.fds);
        fds.clear();
        self.links.scratch.fds = fds;
        let mut users = std::mem::take(&mut self.users);
        users.clear();
        self.links.scratch.users = users;
        let mut members = std::mem::take(&mut self.members);
        members.clear();
        self.links.scratch.members = members;
    }
}
