//! Flushes of received GPU memory (`iflush`): a 1-byte RDMA read of each buffer through a
//! QP connected to itself completes only after the NIC's earlier writes to that memory.

use std::collections::VecDeque;

use super::regcache::RegCache;
use crate::error::{Error, Result};
use crate::net::{RecvBuf, MAX_RECVS};
use crate::rdma::verbs::{Access, Mr, QpId, SendWr, Sge, Verbs, Wc, WcStatus, WrOpcode};

/// The flushes of one receive comm: its loopback QP, made at the first flush of GPU memory.
/// Its methods take the comm's provider and registration cache.
#[derive(Default)]
pub(super) struct Flushes {
    flusher: Option<Flusher>,
}

/// A QP connected to itself and a scratch buffer: reads of received GPU memory through it
/// complete only after the NIC's earlier writes to that memory (`iflush`).
struct Flusher {
    qp: QpId,
    scratch: Box<[u8; 64]>,
    mr: Mr,
    /// Id of the next flush.
    next: u64,
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

impl Flushes {
    /// Whether `id` names a flush this comm started.
    pub(super) fn started(&self, id: u64) -> bool {
        id != 0 && self.flusher.as_ref().is_some_and(|f| id < f.next)
    }

    fn flusher(&mut self, verbs: &dyn Verbs) -> Result<&mut Flusher> {
        if self.flusher.is_none() {
            let (qp, ep) = verbs.create_qp()?;
            if let Err(e) = verbs.connect_qp(qp, &ep) {
                verbs.destroy_qp(qp);
                return Err(e);
            }
            let mut scratch = Box::new([0u8; 64]);
            // SAFETY: boxed (stable address), owned here, deregistered by `reset` or
            // `close` before it is freed.
            let mr = unsafe { verbs.reg_mr(scratch.as_mut_ptr() as u64, 64, Access::LOCAL_WRITE) };
            let mr = match mr {
                Ok(m) => m,
                Err(e) => {
                    verbs.destroy_qp(qp);
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
    fn reap(&mut self, verbs: &dyn Verbs, cache: &mut RegCache) -> Result<()> {
        let Some(f) = self.flusher.as_mut() else {
            return Ok(());
        };
        let mut wcs = [Wc::EMPTY; MAX_RECVS];
        loop {
            let n = verbs.poll_cq(f.qp, &mut wcs)?;
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
                    release_all(cache, verbs, done.mrs);
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    /// Post a 1-byte read of each buffer in GPU memory through the NIC; the id to test.
    /// After an error, [`Flushes::reset`].
    pub(super) fn start(
        &mut self,
        verbs: &dyn Verbs,
        cache: &mut RegCache,
        bufs: &[RecvBuf],
    ) -> Result<Option<u64>> {
        let device = |c: &RegCache, b: &RecvBuf| {
            c.pinned_for(b.ptr as u64, b.len.max(1), Access::default())
                .filter(|p| p.device && b.len > 0)
        };
        let targets: [Option<RecvBuf>; MAX_RECVS] =
            std::array::from_fn(|i| bufs.get(i).filter(|b| device(cache, b).is_some()).copied());
        let count = targets.iter().flatten().count();
        if count == 0 {
            return Ok(None);
        }
        // Room on the loopback QP: wait for older flushes if NCCL ran far ahead.
        self.flusher(verbs)?;
        let t0 = std::time::Instant::now();
        let limit = verbs.drain_limit(); // the deadline the provider was told
        while self
            .flusher
            .as_ref()
            .is_some_and(|f| f.reads + count > FLUSH_READS)
        {
            self.reap(verbs, cache)?;
            if t0.elapsed() > limit {
                return Err(Error::timeout(Vec::new(), format!(
                    "flushing received GPU memory took over {limit:.0?}: the NIC did not complete reads on its loopback QP"
                )));
            }
            std::thread::yield_now();
        }
        // The registrations, with their remote read right while the flush reads them.
        let mut mrs = [None; MAX_RECVS];
        for (i, b) in targets.iter().enumerate() {
            let Some(b) = b else { continue };
            // SAFETY: an explicit registration (`device` above) covers the buffer, so this
            // only takes it; the application keeps it valid until it deregisters it.
            let m = unsafe { cache.acquire(verbs, b.ptr as u64, b.len, Access::REMOTE_READ) };
            match m {
                Ok(m) => mrs[i] = Some(m),
                Err(e) => {
                    release_all(cache, verbs, mrs);
                    return Err(e);
                }
            }
        }
        let f = self.flusher(verbs)?;
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

    /// Whether flush `id` completed: flushes before the oldest one in flight have. After
    /// an error, [`Flushes::reset`].
    pub(super) fn done(
        &mut self,
        verbs: &dyn Verbs,
        cache: &mut RegCache,
        id: u64,
    ) -> Result<bool> {
        self.reap(verbs, cache)?;
        Ok(self
            .flusher
            .as_ref()
            .and_then(|f| f.pending.front())
            .map_or(true, |p| p.id > id))
    }

    /// After a failed flush: reads may still be outstanding on the loopback QP, so a later
    /// flush would count their completions as its own. Start over with a new one. Also what
    /// the comm's drop calls.
    pub(super) fn reset(&mut self, verbs: &dyn Verbs, cache: &mut RegCache) {
        if let Some(f) = self.flusher.take() {
            verbs.destroy_qp(f.qp);
            let _ = verbs.dereg_mr(&f.mr);
            for p in f.pending {
                release_all(cache, verbs, p.mrs);
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
