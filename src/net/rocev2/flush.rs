//! Flushes of received GPU memory (`iflush`): a 1-byte RDMA read of each buffer through a
//! QP connected to itself completes only after the NIC's earlier writes to that memory.

use std::collections::VecDeque;
use std::sync::Arc;

use super::recv::RoceRecv;
use super::regcache::RegCache;
use crate::error::{Error, Result};
use crate::net::{RecvBuf, MAX_RECVS};
use crate::rdma::verbs::{Access, Mr, QpId, SendWr, Sge, Wc, WcStatus, WrOpcode};

/// A QP connected to itself and a scratch buffer: reads of received GPU memory through it
/// complete only after the NIC's earlier writes to that memory (`iflush`).
pub(super) struct Flusher {
    pub(super) qp: QpId,
    scratch: Box<[u8; 64]>,
    pub(super) mr: Mr,
    /// Id of the next flush.
    pub(super) next: u64,
    /// Flushes in flight, oldest first.
    pending: VecDeque<Flush>,
    /// Reads in flight over all of them (bounded by [`FLUSH_READS`]).
    reads: usize,
}

/// One flush in flight.
struct Flush {
    id: u64,
    /// Reads not yet completed.
    reads: usize,
    /// The registrations it reads, held (with their remote read right) until it is done.
    mrs: [Option<Mr>; MAX_RECVS],
}

/// Most flush reads in flight on the loopback QP (NCCL keeps at most 8 receives per
/// connection, each of up to `MAX_RECVS` buffers).
pub(super) const FLUSH_READS: usize = 8 * MAX_RECVS;

impl RoceRecv {
    fn flusher(&mut self) -> Result<&mut Flusher> {
        if self.flusher.is_none() {
            let (qp, ep) = self.verbs.create_qp()?;
            if let Err(e) = self.verbs.connect_qp(qp, &ep) {
                self.verbs.destroy_qp(qp);
                return Err(e);
            }
            let mut scratch = Box::new([0u8; 64]);
            // SAFETY: boxed (stable address), owned by this comm, deregistered in Drop
            // before it is freed.
            let mr = unsafe {
                self.verbs
                    .reg_mr(scratch.as_mut_ptr() as u64, 64, Access::LOCAL_WRITE)
            };
            let mr = match mr {
                Ok(m) => m,
                Err(e) => {
                    self.verbs.destroy_qp(qp);
                    return Err(e);
                }
            };
            self.flusher = Some(Flusher {
                qp,
                scratch,
                mr,
                next: 1,
                pending: VecDeque::with_capacity(FLUSH_READS),
                reads: 0,
            });
        }
        Ok(self.flusher.as_mut().expect("set above"))
    }

    /// Take the loopback QP's completions: each finished read counts down its flush.
    fn reap_flushes(&mut self) -> Result<()> {
        let Some(f) = self.flusher.as_mut() else {
            return Ok(());
        };
        let mut wcs = [Wc::EMPTY; MAX_RECVS];
        loop {
            let n = self.verbs.poll_cq(f.qp, &mut wcs)?;
            for wc in &wcs[..n] {
                if wc.status != WcStatus::Success {
                    return Err(Error::sys(
                        "flushing received GPU memory (RDMA read through a loopback QP)",
                        std::io::Error::other(format!("completion status {:?}", wc.status)),
                    ));
                }
                let Some(front) = f.pending.front_mut().filter(|p| p.id == wc.wr_id) else {
                    return Err(Error::Internal(format!(
                        "flush read {} completed out of order",
                        wc.wr_id
                    )));
                };
                front.reads -= 1;
                f.reads -= 1;
                if front.reads == 0 {
                    let done = f.pending.pop_front().expect("the front, above");
                    release_all(&mut self.cache, &*self.verbs, done.mrs);
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    /// Post a 1-byte read of each buffer in GPU memory through the NIC; the id to test.
    pub(super) fn iflush_device(&mut self, bufs: &[RecvBuf]) -> Result<Option<u64>> {
        let device = |c: &RegCache, b: &RecvBuf| {
            c.pinned_for(b.ptr as u64, b.len.max(1), Access::default())
                .filter(|p| p.device && b.len > 0)
        };
        let targets: [Option<RecvBuf>; MAX_RECVS] = std::array::from_fn(|i| {
            bufs.get(i)
                .filter(|b| device(&self.cache, b).is_some())
                .copied()
        });
        let count = targets.iter().flatten().count();
        if count == 0 {
            return Ok(None);
        }
        // Room on the loopback QP: wait for older flushes if NCCL ran far ahead.
        self.flusher()?;
        let t0 = std::time::Instant::now();
        let limit = self.verbs.drain_limit(); // the deadline the provider was told
        while self
            .flusher
            .as_ref()
            .is_some_and(|f| f.reads + count > FLUSH_READS)
        {
            self.reap_flushes()?;
            if t0.elapsed() > limit {
                return Err(Error::Timeout(format!(
                    "flushing received GPU memory took over {limit:.0?}: the NIC did not complete reads on its loopback QP"
                )));
            }
            std::thread::yield_now();
        }
        // The registrations, with their remote read right while the flush reads them.
        let verbs = Arc::clone(&self.verbs);
        let mut mrs = [None; MAX_RECVS];
        for (i, b) in targets.iter().enumerate() {
            let Some(b) = b else { continue };
            // SAFETY: an explicit registration (`device` above) covers the buffer, so this
            // only takes it; the application keeps it valid until it deregisters it.
            let m = unsafe {
                self.cache
                    .acquire(&*verbs, b.ptr as u64, b.len, Access::REMOTE_READ)
            };
            match m {
                Ok(m) => mrs[i] = Some(m),
                Err(e) => {
                    release_all(&mut self.cache, &*verbs, mrs);
                    return Err(e);
                }
            }
        }
        let f = self.flusher()?;
        let (qp, lkey, at, id) = (f.qp, f.mr.lkey, f.scratch.as_ptr() as u64, f.next);
        f.next += 1;
        // Counted as posted before the posts: a failed post fails the comm (and its flusher).
        f.pending.push_back(Flush {
            id,
            reads: count,
            mrs,
        });
        f.reads += count;
        let reads = targets
            .iter()
            .zip(&mrs)
            .filter_map(|(b, m)| Some((b.as_ref()?, m.as_ref()?)));
        for (i, (b, m)) in reads.enumerate() {
            let (addr, rkey) = (b.ptr as u64, m.rkey);
            verbs.post_send(
                qp,
                &SendWr {
                    wr_id: id,
                    opcode: WrOpcode::Read,
                    sge: Some(Sge {
                        addr: at + i as u64,
                        len: 1,
                        lkey,
                    }),
                    inline: false,
                    imm: 0,
                    remote_addr: addr,
                    rkey,
                    signaled: true,
                },
            )?;
        }
        Ok(Some(id))
    }

    /// Whether flush `id` completed: flushes before the oldest one in flight have.
    pub(super) fn flush_done(&mut self, id: u64) -> Result<bool> {
        self.reap_flushes()?;
        Ok(self
            .flusher
            .as_ref()
            .and_then(|f| f.pending.front())
            .map_or(true, |p| p.id > id))
    }

    /// After a failed flush: reads may still be outstanding on the loopback QP, so a later
    /// flush would count their completions as its own. Start over with a new one.
    pub(super) fn drop_flusher(&mut self) {
        if let Some(f) = self.flusher.take() {
            self.verbs.destroy_qp(f.qp);
            let _ = self.verbs.dereg_mr(&f.mr);
            for p in f.pending {
                release_all(&mut self.cache, &*self.verbs, p.mrs);
            }
        }
    }
}

/// Give back the registrations a flush held.
fn release_all(
    cache: &mut RegCache,
    verbs: &dyn crate::rdma::verbs::Verbs,
    mrs: [Option<Mr>; MAX_RECVS],
) {
    for m in mrs.iter().flatten() {
        cache.release(verbs, m);
    }
}
