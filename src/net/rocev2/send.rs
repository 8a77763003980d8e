//! The send comm: sends wait, in order, for a credit and (unless eager) for the
//! clear-to-send entry of their receive, then go out as an RDMA write with immediate into
//! the receiver's buffer, or as an eager SEND from the staging; a closing comm drains what
//! the peer has not acknowledged yet.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::cts::{dist, Cts, CtsReader, Pieces, CTS_EAGER_ONLY, CTS_SLOTS};
use super::eager::Bounce;
use super::regcache::RegCache;
use super::setup::{Connected, RoceConnecting, MAX_QPS};
use super::{explicit_rights, no_device_copy, reg_explicit, wc_error};
use super::{FIFO, IMM_SIZE_BITS, WCS};
use crate::error::{Error, Result};
use crate::net::{Connecting, Liveness, MemHandle, PollFd, ReqId, SendComm};
use crate::rdma::verbs::{Access, Mr, QpId, SendWr, Sge, Verbs, Wc, WcStatus, WrOpcode};

#[derive(Clone, Copy)]
pub(super) enum SendState {
    /// Not posted yet (waiting for a clear-to-send entry or a credit).
    Waiting,
    /// Posted; waiting for the completion (and the registration to release).
    Posted(Option<Mr>),
    /// Completed.
    Done,
}

pub(super) struct SReq {
    addr: u64,
    len: usize,
    tag: u32,
    state: SendState,
    reaped: bool,
}

pub(super) struct RoceSend {
    pub(super) verbs: Arc<dyn Verbs>,
    /// Copies GPU memory into eager staging slots (set by the caller that posts GPU memory).
    pub(super) device_copy: Option<crate::net::DeviceCopy>,
    /// The connection's queue pairs: message `m` goes on `qps[m % len]`.
    pub(super) qps: Vec<QpId>,
    /// The peer's address (its GID).
    pub(super) peer: SocketAddr,
    pub(super) live: Liveness,
    pub(super) fifo_mr: Mr,
    pub(super) fifo: Box<[Cts; CTS_SLOTS]>,
    pub(super) reqs: VecDeque<SReq>,
    pub(super) base: u64,
    pub(super) wcs: [Wc; WCS],
    pub(super) failed: Option<String>,
    /// Largest eager message (0: none).
    pub(super) eager_size: usize,
    /// Where eager messages are copied before they leave (one buffer per receiver slot).
    pub(super) staging: Bounce,
    /// The walk over the FIFO and the receiver's credits.
    pub(super) cts: CtsReader,
    pub(super) cache: RegCache,
}

impl RoceSend {
    fn progress(&mut self) -> Result<()> {
        crate::net::refuse_if_failed(&self.failed, "RoCE v2 send comm")?;
        let r = self.progress_inner();
        crate::net::remember_failure(&mut self.failed, r)
    }

    /// Address of the FIFO (the peer writes it: no reference to it is made).
    fn fifo_addr(&self) -> u64 {
        self.fifo.as_ptr() as u64
    }

    /// Whether the receiver has a receive work request for one more message.
    fn has_credit(&self) -> bool {
        self.cts.has_credit()
    }

    /// The clear-to-send entry of the receive that message `m` belongs to, once written
    /// ([`CtsReader::cts_for`]).
    fn cts_for(&mut self, m: u32) -> Option<Cts> {
        let (verbs, fifo) = (&self.verbs, self.fifo_addr());
        // SAFETY: `CtsReader` reads only inside the FIFO at `fifo`, registered with this
        // provider at connect and deregistered only when this comm is dropped.
        let read = |p: Pieces<'_, '_>| unsafe { verbs.read_registered_in_order(p) };
        self.cts.cts_for(read, fifo, m)
    }

    /// Take the credits of every entry written so far ([`CtsReader::refresh_credits`]).
    fn refresh_credits(&mut self) {
        let (verbs, fifo) = (&self.verbs, self.fifo_addr());
        // SAFETY: as in `cts_for`: reads inside the FIFO, registered while this comm lives.
        let read = |p: Pieces<'_, '_>| unsafe { verbs.read_registered_in_order(p) };
        self.cts.refresh_credits(read, fifo);
    }

    /// Post `wr` for request `i`; `done_now`: the data was copied (inline or staged), so the
    /// request completes at once.
    fn post(&mut self, i: usize, wr: SendWr, done_now: bool, mr: Option<Mr>) -> Result<()> {
        let qp = self.qp_for(self.cts.next_message());
        self.verbs.post_send(qp, &wr)?;
        self.cts.posted(self.reqs[i].tag);
        if done_now {
            if let Some(m) = mr {
                self.cache.release(&*self.verbs, &m);
            }
            self.reqs[i].state = SendState::Done;
        } else {
            self.reqs[i].state = SendState::Posted(mr);
        }
        Ok(())
    }

    /// The queue pair of message `m` (the receiver expects it there).
    fn qp_for(&self, m: u32) -> QpId {
        self.qps[m as usize % self.qps.len()]
    }

    fn progress_inner(&mut self) -> Result<()> {
        // Waiting for a clear-to-send, or for the completion of a posted write: a peer that
        // is gone answers neither (the engine retries until the deadline), so its closed
        // setup connection ends the wait.
        let waiting = self
            .reqs
            .iter()
            .any(|r| matches!(r.state, SendState::Waiting | SendState::Posted(_)));
        self.live.check(waiting, "send")?;
        let mut counts = [0usize; MAX_QPS];
        self.verbs.poll_cqs(&self.qps, &mut self.wcs, &mut counts)?;
        let n: usize = counts.iter().sum();
        for w in &self.wcs[..n] {
            if w.status != WcStatus::Success {
                return Err(wc_error(w, "send", &*self.verbs, self.peer));
            }
            let idx = (w.wr_id - self.base) as usize;
            if let Some(r) = self.reqs.get_mut(idx) {
                if let SendState::Posted(Some(mr)) = r.state {
                    self.cache.release(&*self.verbs, &mr);
                }
                r.state = SendState::Done;
            }
        }
        self.post_waiting()
    }

    /// Post the waiting sends in order (the receiver matches messages by their order), as
    /// far as clear-to-send entries and credits allow.
    fn post_waiting(&mut self) -> Result<()> {
        while let Some(i) = self
            .reqs
            .iter()
            .position(|r| matches!(r.state, SendState::Waiting))
        {
            let (addr, len, tag) = (self.reqs[i].addr, self.reqs[i].len, self.reqs[i].tag);
            let m = self.cts.next_message();
            let eager = self.eager_size > 0 && len <= self.eager_size;
            // Rendezvous needs the clear-to-send entry; either kind needs a credit, which
            // clear-to-send entries bring.
            if !self.has_credit() {
                self.refresh_credits();
            }
            let cts = if eager && self.has_credit() {
                None
            } else {
                match self.cts_for(m) {
                    Some(c) => Some(c),
                    None if eager && self.has_credit() => None,
                    None => return Ok(()),
                }
            };
            if !self.has_credit() {
                self.refresh_credits();
                if !self.has_credit() {
                    return Ok(()); // a later entry brings credits
                }
            }
            // GPU memory is never read by the CPU (inline copies at post time).
            let inline =
                len <= self.verbs.qp_max_inline(self.qp_for(m)) && !self.cache.is_device(addr, len);
            if eager {
                // Eager: copied to staging slot `m % slots`, sent into one of the receiver's
                // bounce buffers without a clear-to-send; complete for the caller at once
                // (an error still surfaces as an error completion of the QP).
                let slot = m as usize % self.cts.slots() as usize;
                let at = self.staging.slot(slot);
                if len > 0 && self.cache.is_device(addr, len) {
                    // GPU memory: the GPU copies it (the CPU may not reach it).
                    let copy = self.device_copy.as_ref().ok_or_else(no_device_copy)?;
                    copy(at as usize, addr as usize, len)?;
                } else if len > 0 {
                    // SAFETY: the isend contract keeps `addr..addr+len` readable; the staging
                    // slot holds eager_size >= len bytes and is ours (see `staging`).
                    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, at, len) };
                }
                let wr = SendWr {
                    wr_id: self.base + i as u64,
                    opcode: WrOpcode::SendImm,
                    sge: (len > 0).then_some(Sge {
                        addr: at as u64,
                        len: len as u32,
                        lkey: self.staging.mr.lkey,
                    }),
                    inline,
                    imm: tag,
                    remote_addr: 0,
                    rkey: 0,
                    signaled: false,
                };
                self.post(i, wr, true, None)?;
                continue;
            }
            // Small messages go inline: the provider copies them at post time, so the send
            // is complete for the caller at once (no wait for the acknowledgement; an error
            // still surfaces as an error completion).
            let mr = self.register(addr, len)?;
            let wr = {
                let cts = cts.expect("rendezvous has its entry");
                let checked = if dist(m, cts.first) < 0 {
                    // The receive of message `m` wrote no clear-to-send: all its buffers
                    // take eager messages only, i.e. they are smaller than this one.
                    Err(Error::InvalidUsage(format!(
                        "sent {len} bytes but the receiver's buffer holds only {} bytes at most (mismatched counts between sender and receiver?)",
                        self.eager_size
                    )))
                } else {
                    self.cts.buffer_for(&cts, m, tag, len).and_then(|e| {
                        if cts.flags & CTS_EAGER_ONLY == 0 {
                            return Ok(e);
                        }
                        // Its buffers are no larger than the eager size, which this message
                        // exceeds: `buffer_for` refused it already.
                        Err(Error::InvalidUsage(format!(
                            "sent {len} bytes but the receiver's buffer holds only {} bytes, for eager messages (mismatched counts between sender and receiver?)",
                            cts.elems[e].size
                        )))
                    })
                };
                let e = match checked {
                    Ok(e) => e,
                    Err(err) => {
                        if let Some(m) = mr {
                            self.cache.release(&*self.verbs, &m);
                        }
                        return Err(err);
                    }
                };
                let el = cts.elems[e];
                let imm = if cts.n == 1 {
                    len as u32
                } else {
                    ((e as u32) << IMM_SIZE_BITS) | len as u32
                };
                SendWr {
                    wr_id: self.base + i as u64,
                    opcode: WrOpcode::WriteImm,
                    sge: sge(addr, len, mr),
                    inline,
                    imm,
                    remote_addr: el.addr,
                    rkey: el.rkey,
                    signaled: !inline,
                }
            };
            self.post(i, wr, inline, mr)?;
        }
        Ok(())
    }

    /// Register a send buffer (none when empty), through the cache.
    fn register(&mut self, addr: u64, len: usize) -> Result<Option<Mr>> {
        if len == 0 {
            return Ok(None);
        }
        // SAFETY: the isend contract keeps the buffer valid until completion; the
        // registration is released at completion (inline: right after the post).
        let m = unsafe {
            self.cache
                .acquire(&*self.verbs, addr, len, Access::default())?
        };
        Ok(Some(m))
    }
}

fn sge(addr: u64, len: usize, mr: Option<Mr>) -> Option<Sge> {
    mr.map(|m| Sge {
        addr,
        len: len as u32,
        lkey: m.lkey,
    })
}

impl RoceSend {
    /// The send comm of a completed setup.
    fn connected(c: Connected) -> RoceSend {
        RoceSend {
            cache: RegCache::new(&*c.verbs),
            verbs: c.verbs,
            device_copy: None,
            qps: c.qps,
            peer: c.peer,
            live: Liveness::new(c.side, "RoCE v2"),
            fifo_mr: c.fifo_mr,
            fifo: c.fifo,
            reqs: VecDeque::with_capacity(FIFO),
            base: 0,
            wcs: [Wc::EMPTY; WCS],
            failed: None,
            eager_size: c.eager_size,
            staging: c.staging,
            cts: CtsReader::new(c.peer_slots),
        }
    }
}

impl Connecting for RoceConnecting {
    fn poll(&mut self) -> Result<Option<Box<dyn SendComm>>> {
        let done = self.poll_connected()?;
        Ok(done.map(|c| Box::new(RoceSend::connected(c)) as Box<dyn SendComm>))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        self.setup_fds(out)
    }
}

impl SendComm for RoceSend {
    fn local_fault(&self) -> Option<String> {
        self.verbs.local_fault()
    }

    fn rtt(&self) -> Option<std::time::Duration> {
        self.verbs.qp_rtt(self.qps[0])
    }

    fn abandon(&mut self) {
        // Closing after a failure or an abort: no drain (the peer may be the failure).
        self.failed
            .get_or_insert_with(|| "closed after a failure or an abort".into());
    }

    unsafe fn reg_mr(&mut self, addr: usize, len: usize) -> Result<MemHandle> {
        // SAFETY: this function's contract is `reg_explicit`'s.
        unsafe {
            let access = explicit_rights(false, false);
            reg_explicit(
                &*self.verbs,
                &mut self.cache,
                (addr, len),
                access,
                false,
                None,
            )
        }
    }

    unsafe fn reg_mr_device(
        &mut self,
        addr: usize,
        len: usize,
        dmabuf: Option<(i32, u64)>,
    ) -> Result<MemHandle> {
        // SAFETY: this function's contract is `reg_explicit`'s.
        unsafe {
            let access = explicit_rights(false, true);
            reg_explicit(
                &*self.verbs,
                &mut self.cache,
                (addr, len),
                access,
                true,
                dmabuf,
            )
        }
    }

    fn dereg_mr(&mut self, mr: MemHandle) -> Result<()> {
        self.cache.unpin(&*self.verbs, mr.key)
    }

    fn set_device_copy(&mut self, copy: crate::net::DeviceCopy) {
        self.device_copy = Some(copy);
    }

    unsafe fn isend(
        &mut self,
        data: *const u8,
        len: usize,
        tag: u32,
        _mr: Option<&MemHandle>,
    ) -> Result<Option<ReqId>> {
        crate::net::refuse_if_failed(&self.failed, "RoCE v2 send comm")?;
        if self.reqs.len() >= FIFO {
            // Reap what completed first; the fast path posts without polling (a poll can
            // cost a receive system call before the message leaves).
            self.progress()?;
            if self.reqs.len() >= FIFO {
                return Ok(None);
            }
        }
        // A grouped receive's immediate carries the size in its low 29 bits: 2^29 itself
        // would spill into the buffer index.
        if len >= 1 << IMM_SIZE_BITS {
            return Err(Error::arg(format!(
                "RoCE v2 message of {len} bytes exceeds the limit of one message, 512 MiB less one byte"
            )));
        }
        let id = self.base + self.reqs.len() as u64;
        self.reqs.push_back(SReq {
            addr: data as u64,
            len,
            tag,
            state: SendState::Waiting,
            reaped: false,
        });
        // Post it now (and whatever waits before it); completions are reaped by `test`.
        let r = self.post_waiting();
        crate::net::remember_failure(&mut self.failed, r)?;
        Ok(Some(ReqId(id as u32)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>> {
        self.progress()?;
        let r = crate::net::pending_request(&mut self.reqs, self.base, req, |r| r.reaped, "send")?;
        if !matches!(r.state, SendState::Done) {
            return Ok(None);
        }
        r.reaped = true;
        let len = r.len;
        crate::net::pop_reaped(&mut self.reqs, &mut self.base, |r| r.reaped);
        Ok(Some(len))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        self.verbs.qps_fds(&self.qps, out);
        out.push(PollFd {
            fd: self.live.side.as_raw_fd(),
            events: libc::POLLIN,
        });
    }
}

/// `wr_id` of the marker a closing send comm posts (requests count up from 0), below the bit
/// providers keep: the NIC provider hides successful completions with it (those of the
/// sends it signals itself), and a marker of `u64::MAX` never came back.
const DRAIN_MARK: u64 = crate::rdma::verbs::PROVIDER_WR_ID_BIT - 1;

/// Wait until everything posted on `qp` so far has been acknowledged by the peer: RC
/// completes in order, so a signaled zero-length RDMA WRITE (which touches no memory and
/// needs no rkey) posted after it completes only then. Eager and inline sends were reported
/// done when posted, and the staging memory they are sent from is freed with the comm: a
/// destroy right after the last call would otherwise lose them. Ends early when the QP
/// fails, when the peer's process is gone, or after the provider's drain limit. The one
/// drain of a closing connection: providers' `destroy_qp` does not wait again.
fn drain_sends(verbs: &dyn Verbs, qp: QpId, live: &mut Liveness) {
    // Nothing unacknowledged (the userspace engine can tell): no marker, no wait — a peer
    // that already left would otherwise hold the close up until it is seen gone.
    if verbs.qp_state(qp).ok() != Some(crate::rdma::verbs::QpState::Rts)
        || verbs.sends_acknowledged(qp)
    {
        return;
    }
    let mark = SendWr {
        wr_id: DRAIN_MARK,
        opcode: WrOpcode::Write,
        sge: None,
        inline: false,
        imm: 0,
        remote_addr: 0,
        rkey: 0,
        signaled: true,
    };
    if verbs.post_send(qp, &mark).is_err() {
        return;
    }
    let (start, limit) = (std::time::Instant::now(), verbs.drain_limit());
    let mut wcs = [Wc::EMPTY; 16];
    let mut fds = Vec::new();
    loop {
        let Ok(n) = verbs.poll_cq(qp, &mut wcs) else {
            return;
        };
        if wcs[..n]
            .iter()
            .any(|w| w.wr_id == DRAIN_MARK || w.status != WcStatus::Success)
        {
            return;
        }
        if start.elapsed() >= limit || live.check(true, "close").is_err() {
            crate::info!("RoCE v2 send comm: closed before the peer acknowledged everything sent (peer gone or {limit:?} passed)");
            return;
        }
        fds.clear();
        verbs.qp_fds(qp, &mut fds);
        let mut p: arrayvec::ArrayVec<libc::pollfd, 8> = fds
            .iter()
            .take(8)
            .map(|f| libc::pollfd {
                fd: f.fd,
                events: f.events,
                revents: 0,
            })
            .collect();
        // SAFETY: `p` is a valid array of pollfd for the duration of the call.
        unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, 1) };
    }
}

impl Drop for RoceSend {
    fn drop(&mut self) {
        // A failed comm has nothing worth waiting for (its peer may be the failure).
        if self.failed.is_none() {
            for &q in &self.qps {
                drain_sends(&*self.verbs, q, &mut self.live);
            }
        }
        for &q in &self.qps {
            self.verbs.destroy_qp(q);
        }
        for r in &self.reqs {
            if let SendState::Posted(Some(mr)) = r.state {
                self.cache.release(&*self.verbs, &mr);
            }
        }
        self.cache.clear(&*self.verbs);
        let _ = self.verbs.dereg_mr(&self.fifo_mr);
        let _ = self.verbs.dereg_mr(&self.staging.mr);
    }
}
