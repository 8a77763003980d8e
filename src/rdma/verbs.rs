//! The verbs layer: what the RDMA network needs from a provider, shaped like libibverbs.
//!
//! Two providers implement it: the userspace RoCE v2 engine over UDP (`rdma::udp`) and, with
//! the `verbs` feature, real NICs through rdma-sys. Work requests, completions and
//! statuses are the engine's types, numbered as libibverbs numbers them.

use std::net::SocketAddr;

pub use super::engine::{QpState, RecvWr, SendWr, Sge, Wc, WcOpcode, WcStatus, WrOpcode};
pub use super::mem::Access;
use crate::error::Result;
use crate::os::wait::PollFd;

/// Completions in error, by status, as a provider counts them ([`Verbs::completion_error`])
/// and reports them among its counters (`completion_errors_<status>`).
#[derive(Default)]
pub struct WcErrors([std::sync::atomic::AtomicU64; 32]);

/// Counter names by status number (libibverbs' numbering).
const WC_ERROR_NAMES: [(WcStatus, &str); 15] = [
    (WcStatus::LocLenErr, "completion_errors_loc_len"),
    (WcStatus::LocQpOpErr, "completion_errors_loc_qp_op"),
    (WcStatus::LocProtErr, "completion_errors_loc_prot"),
    (WcStatus::WrFlushErr, "completion_errors_wr_flush"),
    (WcStatus::BadRespErr, "completion_errors_bad_resp"),
    (WcStatus::LocAccessErr, "completion_errors_loc_access"),
    (WcStatus::RemInvReqErr, "completion_errors_rem_inv_req"),
    (WcStatus::RemAccessErr, "completion_errors_rem_access"),
    (WcStatus::RemOpErr, "completion_errors_rem_op"),
    (WcStatus::RetryExcErr, "completion_errors_retry_exc"),
    (WcStatus::RnrRetryExcErr, "completion_errors_rnr_retry_exc"),
    (WcStatus::RemAbortErr, "completion_errors_rem_abort"),
    (WcStatus::FatalErr, "completion_errors_fatal"),
    (WcStatus::GeneralErr, "completion_errors_general"),
    (WcStatus::Success, "completion_errors_other"),
];

impl WcErrors {
    /// One completion in error with `status`.
    pub fn note(&self, status: WcStatus) {
        let i = (status as usize).min(31);
        self.0[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Append the statuses seen (every one when `all`), as counters.
    pub fn report(&self, out: &mut Vec<(&'static str, u64)>, all: bool) {
        for (s, name) in WC_ERROR_NAMES {
            let v = self.0[(s as usize).min(31)].load(std::sync::atomic::Ordering::Relaxed);
            if all || v > 0 {
                out.push((name, v));
            }
        }
    }
}

/// The top bit of a work request id belongs to the provider (the NIC provider marks the
/// sends it signals on its own with it and hides their completions): ids the network posts
/// stay below it, and the NIC provider refuses any that does not.
pub const PROVIDER_WR_ID_BIT: u64 = 1 << 63;

/// A registered memory region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mr {
    /// Start address.
    pub addr: u64,
    /// Length.
    pub len: usize,
    /// Local key (for our own work requests).
    pub lkey: u32,
    /// Remote key (for the peer's RDMA on this region).
    pub rkey: u32,
}

/// What a peer needs to connect its QP to ours (exchanged out of band).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpEndpoint {
    /// Our address: IP (the GID) and RoCE UDP port.
    pub addr: SocketAddr,
    /// QP number.
    pub qpn: u32,
    /// First PSN we will send.
    pub psn: u32,
    /// Path MTU we can do.
    pub mtu: u32,
    /// This end is roccl's userspace engine, which keeps out-of-order packets and takes the
    /// engine's own reports (selective retransmission); `false` for a NIC, which is sent
    /// IBTA's packets only.
    pub engine: bool,
}

/// A queue pair handle of a provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpId(pub u32);

/// A verbs provider: protection domain, memory regions, RC queue pairs with their own
/// completion queue.
pub trait Verbs: Send + Sync {
    /// Provider name (`userspace` or the device name).
    fn name(&self) -> String;
    /// A NIC (false: the userspace engine). Peers must use the same kind.
    fn hardware(&self) -> bool {
        false
    }
    /// Largest payload `post_send` copies at post time (`SendWr::inline`), on any queue pair.
    fn max_inline(&self) -> usize {
        0
    }
    /// Largest payload `post_send` copies at post time on `qp`: [`Verbs::max_inline`]
    /// unless the provider's queue pairs differ (a NIC grants each queue pair its own).
    fn qp_max_inline(&self, qp: QpId) -> usize {
        let _ = qp;
        self.max_inline()
    }
    /// Register memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid (writable if `access` allows writes) until
    /// [`Verbs::dereg_mr`]: the provider reads and writes it whenever work targets it.
    unsafe fn reg_mr(&self, addr: u64, len: usize, access: Access) -> Result<Mr>;
    /// Release a registration.
    fn dereg_mr(&self, mr: &Mr) -> Result<()>;
    /// Append the provider's counters (`name`, value) for the metrics endpoint:
    /// retransmissions, NAKs, timeouts, drops... Providers without counters add none.
    fn counters(&self, out: &mut Vec<(&'static str, u64)>) {
        let _ = out;
    }
    /// A completion of this provider came back in error with `status` (the network saw it):
    /// counted, for [`Verbs::counters`].
    fn completion_error(&self, status: WcStatus) {
        let _ = status;
    }
    /// Give registration `mr` the rights `access` and new keys, after which its old rkey
    /// reaches nothing (`ibv_rereg_mr` with `IBV_REREG_MR_CHANGE_ACCESS`, plus a new key):
    /// what the registration cache does to a receive buffer it keeps after the application
    /// got it back. Only providers with [`Verbs::cacheable_registrations`] need it.
    fn rekey_mr(&self, mr: &Mr, access: Access) -> Result<Mr> {
        let _ = (mr, access);
        Err(crate::error::Error::Internal(format!(
            "{}: changing a registration's rights is not supported",
            self.name()
        )))
    }
    /// Whether the provider registers dmabuf memory (GPU memory its driver exports).
    fn dmabuf_supported(&self) -> bool {
        false
    }
    /// Register `len` bytes at `offset` of the dmabuf `fd`, addressed as `iova` in work
    /// requests (`ibv_reg_dmabuf_mr`).
    ///
    /// # Safety
    /// The dmabuf stays alive until [`Verbs::dereg_mr`].
    unsafe fn reg_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Mr> {
        let _ = (fd, offset, len, iova, access);
        Err(crate::error::Error::InvalidUsage(format!(
            "{}: this provider cannot register dmabuf (GPU) memory; GPU buffers must be staged through host memory",
            self.name()
        )))
    }
    /// Whether registrations may be cached past the requests that use them: true when a
    /// registration pins nothing and the provider touches registered memory only while work
    /// targets it, so a buffer freed with its registration still cached is harmless (the
    /// reg_mr contract then only has to hold while requests use the memory). A NIC provider
    /// answers false until it can invalidate registrations of freed memory.
    fn cacheable_registrations(&self) -> bool {
        false
    }
    /// How long a QP connected afterwards may go without acknowledged progress before its
    /// work fails with RETRY_EXC_ERR (the communicator's deadline). The userspace engine
    /// retransmits with backoff until then; a NIC keeps its IB retry count and ignores it.
    fn set_timeout(&self, timeout: std::time::Duration) {
        let _ = timeout;
    }
    /// Whether the peer has acknowledged every send posted on `qp` (nothing to drain at
    /// close). `false` where the provider cannot tell (a NIC): the close then drains.
    /// The queue pair's smoothed round-trip time, where the provider measures one (the
    /// userspace engine does, from its acknowledgements; a NIC does not say).
    fn qp_rtt(&self, _qp: QpId) -> Option<std::time::Duration> {
        None
    }

    fn sends_acknowledged(&self, qp: QpId) -> bool {
        let _ = qp;
        false
    }
    /// Longest a closing connection waits for the peer to acknowledge what it sent
    /// (the peer or the QP failing ends the wait sooner).
    fn drain_limit(&self) -> std::time::Duration {
        crate::envvar::DEFAULT_TIMEOUT
    }
    /// Create an RC QP in INIT (receives may be posted) and return it with its endpoint.
    fn create_qp(&self) -> Result<(QpId, QpEndpoint)>;
    /// Bring the QP to RTS, connected to `remote` (INIT → RTR → RTS).
    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<()>;
    /// The local address `qp` told its peer it is at (a provider that takes packets on every
    /// address uses it as the QP's source, so that the two agree); before `connect_qp`.
    /// Providers bound to one address ignore it.
    fn set_qp_addr(&self, _qp: QpId, _ip: std::net::IpAddr) {}
    /// Destroy a QP.
    fn destroy_qp(&self, qp: QpId);
    /// Post a send work request.
    fn post_send(&self, qp: QpId, wr: &SendWr) -> Result<()>;
    /// A fault on this host's side that explains why peers stop acknowledging (sends that
    /// the operating system refuses, a port that is down), if the provider knows of one now;
    /// `None` when it knows of none (the default).
    fn local_fault(&self) -> Option<String> {
        None
    }
    /// Post a send work request that is in no hurry (a credit report, say): a provider that
    /// transmits from software may leave it for its next progress, which then sends it with
    /// whatever else is due, off the path of the caller's next message. A NIC sends it at
    /// once, as `post_send` does.
    fn post_send_unhurried(&self, qp: QpId, wr: &SendWr) -> Result<()> {
        self.post_send(qp, wr)
    }
    /// Post a receive work request.
    fn post_recv(&self, qp: QpId, wr: &RecvWr) -> Result<()>;
    /// Make progress and take up to `out.len()` completions of `qp`.
    fn poll_cq(&self, qp: QpId, out: &mut [Wc]) -> Result<usize>;
    /// Take the completions of several QPs at once (a connection's): `qps[i]`'s go to
    /// `out` after those of the QPs before it, at most `out.len() / qps.len()` each, and
    /// `counts[i]` says how many (`counts` is at least as long as `qps`). The default polls
    /// each; the userspace engine makes progress once for all.
    fn poll_cqs(&self, qps: &[QpId], out: &mut [Wc], counts: &mut [usize]) -> Result<()> {
        let share = (out.len() / qps.len().max(1)).max(1);
        let mut at = 0;
        for (i, &qp) in qps.iter().enumerate() {
            let end = (at + share).min(out.len());
            counts[i] = self.poll_cq(qp, &mut out[at..end])?;
            at += counts[i];
        }
        Ok(())
    }
    /// Descriptors to sleep on until completions may be ready.
    fn poll_fds(&self, out: &mut Vec<PollFd>);
    /// [`Verbs::qp_fds`] of several QPs (a connection's), each descriptor once.
    fn qps_fds(&self, qps: &[QpId], out: &mut Vec<PollFd>) {
        let start = out.len();
        for &qp in qps {
            let from = out.len();
            self.qp_fds(qp, out);
            let mut i = from;
            while i < out.len() {
                if out[start..from].iter().any(|p| p.fd == out[i].fd) {
                    out.swap_remove(i);
                } else {
                    i += 1;
                }
            }
        }
    }
    /// Descriptors that become readable when QP `qp` has a completion (or the provider's).
    /// Asked for only when the caller is about to sleep on them: a provider may arm its
    /// wake-ups here (a system call on some), and must then hand out a descriptor that is
    /// ready at once if a completion came before it armed them.
    fn qp_fds(&self, qp: QpId, out: &mut Vec<PollFd>) {
        let _ = qp;
        self.poll_fds(out)
    }
    /// State of the QP.
    fn qp_state(&self, qp: QpId) -> Result<QpState>;
    /// Copy `out.len()` bytes at `addr` — memory inside a region registered here that
    /// peers write by RDMA — consistently with the provider's own writes (the userspace
    /// engine writes under its lock; hardware providers order DMA with a fence). Each
    /// 4-byte word aligned to 4 is copied whole (one load), so a word the peer writes whole
    /// (a sequence marker) is never read half old, half new.
    ///
    /// # Safety
    /// `addr..addr + out.len()` must lie inside one region registered with this provider
    /// ([`Verbs::reg_mr`], [`Verbs::reg_dmabuf`] of host memory) and not yet released with
    /// [`Verbs::dereg_mr`]: the provider reads it as plain memory.
    unsafe fn read_registered(&self, addr: u64, out: &mut [u8]);
    /// [`Verbs::read_registered`] of several pieces as one read: each piece in the order
    /// given, copied whole before the next one begins (an acquire fence between), so that
    /// a seqlock reader's reads (end marker, body, start marker) keep their order. The
    /// userspace engine takes its lock once for all of them, not once per piece.
    ///
    /// # Safety
    /// Each piece as in [`Verbs::read_registered`].
    unsafe fn read_registered_in_order(&self, pieces: &mut [(u64, &mut [u8])]) {
        for (i, (addr, out)) in pieces.iter_mut().enumerate() {
            if i > 0 {
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            }
            // SAFETY: this function's contract, piece by piece.
            unsafe { self.read_registered(*addr, out) };
        }
    }
}
