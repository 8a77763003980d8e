//! The receive comm: every receive registers its buffers and writes its clear-to-send entry
//! into the sender's FIFO (or, when only eager messages can fill it, none); messages are
//! matched to receives in the order they arrive, eager ones copied out of their bounce
//! buffers, and the receive work requests they consumed posted again and reported as
//! credits.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::cts::{Cts, CtsElem, CtsWriter, CTS_BYTES, CTS_EAGER_ONLY, CTS_SLOTS};
use super::eager::{Bounce, EAGER_SLOTS};
use super::flush::Flushes;
use super::regcache::RegCache;
use super::setup::{AcceptedConn, RoceListen, MAX_QPS};
use super::{explicit_rights, no_device_copy, reg_explicit, wc_error};
use super::{FIFO, IMM_SIZE_BITS, WCS};
use crate::error::{Error, Result};
use crate::net::MAX_RECVS;
use crate::net::{ListenComm, Liveness, MemHandle, PollFd, RecvBuf, RecvComm, RecvGroup, ReqId};
use crate::rdma::verbs::{Access, Mr, QpId, SendWr, Sge, Verbs, Wc, WcOpcode, WcStatus, WrOpcode};

/// How long the oldest receive waits for eager data before it describes itself to the
/// sender (one write per receive that waited this long; none on the fast path).
pub(super) const ANNOUNCE_AFTER: std::time::Duration = std::time::Duration::from_millis(10);

/// The buffer of receive `g` that an RDMA write with immediate `imm` from `peer` filled, and
/// its size: what the peer claims, checked against the posted receive (a size beyond the
/// buffer or an index beyond the group is the peer's error, never trusted).
pub(super) fn written(g: &RecvGroup, imm: u32, peer: SocketAddr) -> Result<(usize, usize)> {
    let (e, len) = if g.len() == 1 {
        (0usize, imm as usize)
    } else {
        (
            (imm >> IMM_SIZE_BITS) as usize,
            (imm & ((1 << IMM_SIZE_BITS) - 1)) as usize,
        )
    };
    if e >= g.len() {
        return Err(Error::InvalidUsage(format!(
            "RoCE v2 receive from {peer}: the peer says it wrote buffer {e} of a receive of {} buffers (corrupt immediate, or another roccl version?)",
            g.len()
        )));
    }
    let size = g.bufs[e].1;
    if len > size {
        return Err(Error::InvalidUsage(format!(
            "RoCE v2 receive from {peer}: the peer says it wrote {len} bytes into buffer {e}, which holds only {size} bytes (corrupt immediate, or another roccl version?)"
        )));
    }
    Ok((e, len))
}

pub(super) struct RReq {
    /// The buffers it fills.
    group: RecvGroup,
    mrs: [Option<Mr>; MAX_RECVS],
    reaped: bool,
    /// Its clear-to-send entry, kept for a receive whose buffers take eager messages only
    /// until it describes itself to the sender ([`CTS_EAGER_ONLY`]).
    eager_only: Option<(std::time::Instant, Cts)>,
    /// It did so.
    announced: bool,
}

/// A message that arrived, in arrival (= send) order, not yet matched to a receive.
#[derive(Clone, Copy)]
pub(super) enum Arrival {
    /// In bounce buffer `slot`.
    Eager { slot: usize, tag: u32, len: usize },
    /// Written into the buffer of a clear-to-send entry; the immediate says which and how much.
    Written { imm: u32 },
}

pub(super) struct RoceRecv {
    pub(super) verbs: Arc<dyn Verbs>,
    /// Copies eager messages out of bounce buffers into GPU memory.
    pub(super) device_copy: Option<crate::net::DeviceCopy>,
    /// The connection's queue pairs: message `m` arrives on `qps[m % len]`; clear-to-send
    /// entries leave on the first.
    pub(super) qps: Vec<QpId>,
    /// The peer's address (its GID).
    pub(super) peer: SocketAddr,
    pub(super) live: Liveness,
    pub(super) fifo_addr: u64,
    pub(super) fifo_rkey: u32,
    pub(super) staging: Box<[Cts; CTS_SLOTS]>,
    pub(super) staging_mr: Mr,
    pub(super) reqs: VecDeque<RReq>,
    pub(super) base: u64,
    pub(super) wcs: [Wc; WCS],
    pub(super) failed: Option<String>,
    /// Per queue pair, its bounce buffers (one per receive work request).
    pub(super) bounce: Vec<Bounce>,
    /// Per queue pair, the messages that arrived on it, in order, not yet matched.
    pub(super) arrived: Vec<VecDeque<Arrival>>,
    /// Messages matched to receives so far: the next comes on `qps[matched % len]`.
    pub(super) matched: u64,
    /// Request id of the receive the next arriving message belongs to.
    pub(super) filling: u64,
    /// The sequence numbers of the entries written and the credits they report.
    pub(super) cts: CtsWriter,
    /// Number (wrapping) of the first message of the next receive.
    pub(super) next_first: u32,
    /// Messages up to this size come eagerly (0: none).
    pub(super) eager: usize,
    pub(super) cache: RegCache,
    /// For flushes of GPU memory, made at the first one.
    pub(super) flushes: Flushes,
}

impl RoceRecv {
    fn progress(&mut self) -> Result<()> {
        crate::net::refuse_if_failed(&self.failed, "RoCE v2 receive comm")?;
        let r = self.progress_inner();
        crate::net::remember_failure(&mut self.failed, r)
    }

    fn repost(&mut self, q: usize, slot: usize) -> Result<()> {
        self.bounce[q].post(&*self.verbs, self.qps[q], slot)?;
        self.cts.reposted();
        Ok(())
    }

    /// RDMA-write `cts` (with our sequence number, credits and next message number) into the
    /// sender's FIFO.
    fn write_entry(&mut self, cts: Cts) -> Result<()> {
        self.write_entry_as(cts, false)
    }

    /// As [`RoceRecv::write_entry`]; `unhurried`: an entry that only reports credits, which
    /// the provider may send with its next progress ([`Verbs::post_send_unhurried`]).
    fn write_entry_as(&mut self, cts: Cts, unhurried: bool) -> Result<()> {
        let (slot, cts) = self.cts.stamp(cts);
        self.staging[slot] = cts;
        let wr = SendWr {
            // No completion is asked for; below the bit providers keep (the NIC provider
            // refuses ids with it).
            wr_id: crate::rdma::verbs::PROVIDER_WR_ID_BIT - 1,
            opcode: WrOpcode::Write,
            sge: Some(Sge {
                addr: &self.staging[slot] as *const Cts as u64,
                len: CTS_BYTES as u32,
                lkey: self.staging_mr.lkey,
            }),
            inline: CTS_BYTES <= self.verbs.qp_max_inline(self.qps[0]),
            imm: 0,
            remote_addr: self.fifo_addr + (slot * CTS_BYTES) as u64,
            rkey: self.fifo_rkey,
            signaled: false,
        };
        if unhurried {
            self.verbs.post_send_unhurried(self.qps[0], &wr)?;
        } else {
            self.verbs.post_send(self.qps[0], &wr)?;
        }
        self.cts.written();
        Ok(())
    }

    /// Tell the sender about freed receive buffers once a quarter of them piled up (receives
    /// with a clear-to-send carry credits anyway; eager-only ones do not).
    fn report_credits(&mut self) -> Result<()> {
        if self.cts.credits_due() {
            let first = self.next_first;
            // The sender still holds most of its credits: it does not wait for these.
            self.write_entry_as(
                Cts {
                    n: 0,
                    first,
                    ..Cts::default()
                },
                true,
            )?;
        }
        Ok(())
    }

    fn progress_inner(&mut self) -> Result<()> {
        let mut counts = [0usize; MAX_QPS];
        self.verbs.poll_cqs(&self.qps, &mut self.wcs, &mut counts)?;
        let mut at = 0;
        for (q, &n) in counts.iter().enumerate().take(self.qps.len()) {
            at += n;
            for k in at - n..at {
                let w = self.wcs[k];
                if w.status != WcStatus::Success {
                    return Err(wc_error(&w, "receive", &*self.verbs, self.peer));
                }
                let slot = w.wr_id as usize;
                match w.opcode {
                    WcOpcode::Recv => self.arrived[q].push_back(Arrival::Eager {
                        slot,
                        tag: w.imm.unwrap_or(0),
                        len: w.byte_len as usize,
                    }),
                    WcOpcode::RecvRdmaWithImm => {
                        // The data is in place: the receive (and its bounce buffer) is free
                        // again.
                        self.repost(q, slot)?;
                        self.arrived[q].push_back(Arrival::Written {
                            imm: w.imm.unwrap_or(0),
                        });
                    }
                    _ => {} // our clear-to-send writes are unsignaled; nothing else expected
                }
            }
        }
        self.match_arrivals()?;
        self.announce_eager_only()?;
        self.report_credits()?;
        let waiting = self.reqs.iter().any(|r| !r.group.done());
        self.live.check(waiting, "receive").map_err(|e| {
            let idx = (self.filling - self.base) as usize;
            match (self.reqs.get(idx), e) {
                (Some(r), Error::System { what, call, source }) if r.announced => {
                    let n: usize = r.group.bufs[..r.group.len()].iter().map(|b| b.1).sum();
                    Error::System {
                        what: format!("{what}; the receive it was to fill holds only {n} bytes, for eager messages: a larger message fails at the sender (mismatched counts between sender and receiver?)"),
                        call,
                        source,
                    }
                }
                (_, e) => e,
            }
        })
    }

    /// Describe the receive the next message belongs to to the sender, once, if its buffers
    /// take eager messages only and it has waited [`ANNOUNCE_AFTER`]: a sender with a
    /// message too large for them waits for a clear-to-send and would otherwise never learn
    /// of the mismatch.
    fn announce_eager_only(&mut self) -> Result<()> {
        let idx = (self.filling - self.base) as usize;
        let Some(r) = self.reqs.get_mut(idx) else {
            return Ok(());
        };
        match r.eager_only {
            Some((posted, cts)) if posted.elapsed() >= ANNOUNCE_AFTER => {
                r.eager_only = None;
                r.announced = true;
                self.write_entry(Cts {
                    flags: CTS_EAGER_ONLY,
                    ..cts
                })
            }
            _ => Ok(()),
        }
    }

    /// Give arrived messages, in order, to the receives they belong to: the sender fills the
    /// buffers of each receive in turn, so the next message belongs to the oldest receive
    /// not yet filled (an eager message that comes before its receive waits in its bounce
    /// buffer).
    fn match_arrivals(&mut self) -> Result<()> {
        loop {
            // The next message comes on its queue pair, after those before it there.
            let q = (self.matched % self.qps.len() as u64) as usize;
            let Some(&a) = self.arrived[q].front() else {
                return Ok(());
            };
            let idx = (self.filling - self.base) as usize;
            let Some(r) = self.reqs.get_mut(idx) else {
                if let Arrival::Written { .. } = a {
                    return Err(Error::Internal(
                        "RoCE v2 receive: data was written for a receive that was never posted"
                            .into(),
                    ));
                }
                return Ok(());
            };
            let complete = match a {
                Arrival::Eager { slot, tag, len } => {
                    let e = r.group.buffer_for(tag, len)?;
                    let addr = r.group.bufs[e].0;
                    if len > 0 && self.cache.is_device(addr as u64, len) {
                        // Into GPU memory: the GPU copies it.
                        let copy = self.device_copy.as_ref().ok_or_else(no_device_copy)?;
                        copy(addr, self.bounce[q].slot(slot) as usize, len)?;
                    } else if len > 0 {
                        // SAFETY: the irecv contract keeps the buffer valid (and writable for
                        // `size >= len` bytes) until the receive completes; the bounce buffer
                        // holds `len <= bounce.size` bytes, complete since its receive
                        // completed (the provider wrote them before reporting it).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                self.bounce[q].slot(slot),
                                addr as *mut u8,
                                len,
                            )
                        };
                    }
                    let complete = r.group.fill(e, len)?;
                    self.arrived[q].pop_front();
                    self.repost(q, slot)?;
                    complete
                }
                Arrival::Written { imm } => {
                    let (e, len) = written(&r.group, imm, self.peer)?;
                    let complete = r.group.fill(e, len)?;
                    self.arrived[q].pop_front();
                    complete
                }
            };
            self.matched += 1;
            let r = &mut self.reqs[idx];
            if complete {
                for m in r.mrs.iter_mut().filter_map(Option::take) {
                    self.cache.release(&*self.verbs, &m);
                }
                self.filling += 1;
            }
        }
    }
}

impl RoceRecv {
    /// The receive comm of a completed setup.
    fn accepted(a: AcceptedConn) -> RoceRecv {
        let cts = CtsWriter::new(a.bounce[0].slots);
        let n = a.bounce.len();
        RoceRecv {
            cache: RegCache::new(&*a.verbs),
            verbs: a.verbs,
            device_copy: None,
            qps: a.qps,
            peer: a.peer,
            live: Liveness::new(a.side, "RoCE v2"),
            fifo_addr: a.fifo_addr,
            fifo_rkey: a.fifo_rkey,
            staging: a.staging,
            staging_mr: a.staging_mr,
            reqs: VecDeque::with_capacity(FIFO),
            base: 0,
            wcs: [Wc::EMPTY; WCS],
            failed: None,
            bounce: a.bounce,
            arrived: (0..n)
                .map(|_| VecDeque::with_capacity(EAGER_SLOTS as usize))
                .collect(),
            matched: 0,
            filling: 0,
            cts,
            next_first: 0,
            eager: a.eager,
            flushes: Flushes::default(),
        }
    }
}

impl ListenComm for RoceListen {
    fn accept(&mut self) -> Result<Option<Box<dyn RecvComm>>> {
        self.drive(|a| Box::new(RoceRecv::accepted(a)))?;
        Ok(self.ready.pop_front())
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        self.setup_fds(out)
    }
}

impl RecvComm for RoceRecv {
    fn local_fault(&self) -> Option<String> {
        self.verbs.local_fault()
    }

    unsafe fn reg_mr(&mut self, addr: usize, len: usize) -> Result<MemHandle> {
        // SAFETY: this function's contract is `reg_explicit`'s.
        unsafe {
            let access = explicit_rights(true, false);
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
            let access = explicit_rights(true, true);
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

    fn iflush(&mut self, bufs: &[RecvBuf]) -> Result<Option<u64>> {
        self.progress()?;
        let r = self.flushes.start(&*self.verbs, &mut self.cache, bufs);
        if r.is_err() {
            self.flushes.reset(&*self.verbs, &mut self.cache);
        }
        crate::net::remember_failure(&mut self.failed, r)
    }

    fn test_flush(&mut self, id: u64) -> Result<bool> {
        crate::net::refuse_if_failed(&self.failed, "RoCE v2 receive comm")?;
        if !self.flushes.started(id) {
            return Err(Error::InvalidUsage(format!("test on unknown flush {id}")));
        }
        let r = self.flushes.done(&*self.verbs, &mut self.cache, id);
        if r.is_err() {
            self.flushes.reset(&*self.verbs, &mut self.cache);
        }
        crate::net::remember_failure(&mut self.failed, r)
    }

    unsafe fn irecv(&mut self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        crate::net::refuse_if_failed(&self.failed, "RoCE v2 receive comm")?;
        let group = RecvGroup::new(bufs)?;
        if self.reqs.len() >= FIFO {
            // Reap first; the fast path posts without polling (`test` polls).
            self.progress()?;
            if self.reqs.len() >= FIFO {
                return Ok(None);
            }
        }
        let id = self.base + self.reqs.len() as u64;
        let mut r = RReq {
            group,
            mrs: [None; MAX_RECVS],
            reaped: false,
            eager_only: None,
            announced: false,
        };
        let mut cts = Cts {
            n: bufs.len() as u32,
            first: self.next_first,
            ..Cts::default()
        };
        // Buffers that only eager messages can fill (all of them no larger than the eager
        // size) need no clear-to-send: the sender sends those messages without one.
        let eager_only = self.eager > 0 && bufs.iter().all(|b| b.len <= self.eager);
        for (i, b) in bufs.iter().enumerate() {
            let (addr, rkey) = if b.len > 0 && !eager_only {
                // SAFETY: the irecv contract keeps the buffer valid until completion; the
                // registration is released when the data has arrived.
                let m = unsafe {
                    self.cache.acquire(
                        &*self.verbs,
                        b.ptr as u64,
                        b.len,
                        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                    )
                };
                let m = match m {
                    Ok(m) => m,
                    Err(e) => {
                        for m in r.mrs.iter_mut().filter_map(Option::take) {
                            self.cache.release(&*self.verbs, &m);
                        }
                        return Err(e);
                    }
                };
                r.mrs[i] = Some(m);
                (b.ptr as u64, m.rkey)
            } else {
                (0, 0)
            };
            cts.elems[i] = CtsElem {
                addr,
                size: b.len.min(u32::MAX as usize) as u32,
                rkey,
                tag: b.tag,
                _pad: 0,
            };
        }
        if eager_only {
            r.eager_only = Some((std::time::Instant::now(), cts));
        }
        self.next_first = self.next_first.wrapping_add(bufs.len() as u32);
        self.reqs.push_back(r);
        // Eager messages that came first land now (and free their bounce buffers, which the
        // credits then report).
        self.match_arrivals()?;
        if eager_only {
            self.report_credits()?;
        } else {
            self.write_entry(cts)?;
        }
        Ok(Some(ReqId(id as u32)))
    }

    fn test(&mut self, req: ReqId, sizes: &mut [usize]) -> Result<bool> {
        self.progress()?;
        let r =
            crate::net::pending_request(&mut self.reqs, self.base, req, |r| r.reaped, "receive")?;
        if !r.group.done() {
            return Ok(false);
        }
        for (d, s) in sizes.iter_mut().zip(r.group.sizes()) {
            *d = *s;
        }
        r.reaped = true;
        crate::net::pop_reaped(&mut self.reqs, &mut self.base, |r| r.reaped);
        Ok(true)
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        self.verbs.qps_fds(&self.qps, out);
        out.push(PollFd {
            fd: self.live.side.as_raw_fd(),
            events: libc::POLLIN,
        });
    }
}

impl Drop for RoceRecv {
    fn drop(&mut self) {
        for &q in &self.qps {
            self.verbs.destroy_qp(q);
        }
        self.flushes.reset(&*self.verbs, &mut self.cache);
        for r in &mut self.reqs {
            for m in r.mrs.iter_mut().filter_map(Option::take) {
                self.cache.release(&*self.verbs, &m);
            }
        }
        self.cache.clear(&*self.verbs);
        let _ = self.verbs.dereg_mr(&self.staging_mr);
        for b in &self.bounce {
            let _ = self.verbs.dereg_mr(&b.mr);
        }
    }
}
