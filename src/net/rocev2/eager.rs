//! Eager messages: their configuration (`ROCCL_ROCEV2_EAGER`), and the buffers they pass
//! through — the receiver's bounce buffers, one per receive work request, posted at setup,
//! and the sender's staging, where an eager message is copied at post.

use crate::error::{Error, Result};
use crate::rdma::verbs::{Access, Mr, QpId, RecvWr, Sge, Verbs};

/// Eager messages: a message of at most `size` bytes is sent at once with SEND_WITH_IMM
/// (immediate = tag) into one of the receiver's `slots` pre-posted bounce buffers of `size`
/// bytes, without waiting for a clear-to-send; the receiver copies it out when it matches a
/// receive. Every message (eager or not) consumes one of the receiver's `slots` receive work
/// requests, which the receiver posts again as it consumes them and reports in each
/// clear-to-send (`credits`), so the sender never has more than `slots` messages unconsumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct EagerCfg {
    pub(super) size: u32,
    pub(super) slots: u32,
}

/// Receive work requests (and bounce buffers) per connection; at least [`FIFO`](super::FIFO), so that
/// messages sent against clear-to-send entries never lack one.
pub(super) const EAGER_SLOTS: u32 = 64;
/// Default and largest eager size (`ROCCL_ROCEV2_EAGER`, 0 turns eager messages off).
pub(super) const EAGER_DEFAULT: u32 = 16384;
pub(super) const EAGER_MAX: u32 = 65536;

/// A `ROCCL_ROCEV2_EAGER` value: the largest eager message in bytes, 0 to [`EAGER_MAX`].
pub(super) fn parse_eager(v: &str) -> Result<u32> {
    match v.trim().parse::<u32>() {
        Ok(n) if n <= EAGER_MAX => Ok(n),
        _ => Err(Error::arg(format!(
            "ROCCL_ROCEV2_EAGER={v}: want the largest eager message in bytes, 0 to {EAGER_MAX} (0: off)"
        ))),
    }
}

impl EagerCfg {
    /// Eager messages up to `size` bytes (at most [`EAGER_MAX`]; 0: off), with the usual
    /// number of slots.
    pub(super) fn with_size(size: u32) -> EagerCfg {
        EagerCfg {
            size: size.min(EAGER_MAX),
            slots: EAGER_SLOTS,
        }
    }
}

/// The receiver's bounce buffers: one per receive work request, posted at setup. The
/// provider writes them (possibly from its progress thread), hence the cells.
pub(super) struct Bounce {
    buf: Box<[std::cell::UnsafeCell<u8>]>,
    pub(super) mr: Mr,
    size: usize,
    pub(super) slots: u32,
}

impl Bounce {
    /// Register `cfg.slots` buffers of `cfg.size` bytes and post a receive for each.
    pub(super) fn new(verbs: &dyn Verbs, qp: QpId, cfg: EagerCfg) -> Result<Bounce> {
        let b = Bounce::alloc(verbs, cfg)?;
        for slot in 0..cfg.slots as usize {
            if let Err(e) = b.post(verbs, qp, slot) {
                let _ = verbs.dereg_mr(&b.mr);
                return Err(e);
            }
        }
        Ok(b)
    }

    /// Register `cfg.slots` buffers of `cfg.size` bytes.
    pub(super) fn alloc(verbs: &dyn Verbs, cfg: EagerCfg) -> Result<Bounce> {
        let size = cfg.size as usize;
        let buf: Box<[std::cell::UnsafeCell<u8>]> = (0..(size * cfg.slots as usize).max(1))
            .map(|_| std::cell::UnsafeCell::new(0))
            .collect();
        let addr = std::cell::UnsafeCell::raw_get(buf.as_ptr()) as u64;
        // SAFETY: the boxed slice has a stable address and is owned by the receive side,
        // which deregisters it before freeing it.
        let mr = unsafe { verbs.reg_mr(addr, buf.len(), Access::LOCAL_WRITE)? };
        Ok(Bounce {
            buf,
            mr,
            size,
            slots: cfg.slots,
        })
    }

    pub(super) fn post(&self, verbs: &dyn Verbs, qp: QpId, slot: usize) -> Result<()> {
        let sge = (self.size > 0).then(|| Sge {
            addr: self.mr.addr + (slot * self.size) as u64,
            len: self.size as u32,
            lkey: self.mr.lkey,
        });
        verbs.post_recv(
            qp,
            &RecvWr {
                wr_id: slot as u64,
                sge,
            },
        )
    }

    /// Start of buffer `slot` (a receive's data is valid once the receive completed).
    pub(super) fn slot(&self, slot: usize) -> *mut u8 {
        std::cell::UnsafeCell::raw_get(self.buf[slot * self.size..].as_ptr())
    }
}
