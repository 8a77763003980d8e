//! Destroying a QP: free it with its completion queue and channel ([`free_qp`]). Waiting
//! for its sends to be acknowledged first is its owner's part: the network drains a closing
//! send comm once, bounded by the communicator's deadline (`Verbs::drain_limit`), before it
//! destroys the QP. The provider does not drain again here: that would post a second marker
//! and wait once more for every QP, after failures and aborts too.

use rdma_sys as ffi;

use super::Qp;

/// Destroy `q`'s QP, then its completion queue and channel.
pub(super) fn free_qp(q: Qp) {
    // SAFETY: the QP left the table (or never entered it); destroy it, then its CQ (after
    // acknowledging nothing further: events were acknowledged as they were read) and channel.
    unsafe {
        ffi::ibv_destroy_qp(q.qp);
        ffi::ibv_destroy_cq(q.cq);
        ffi::ibv_destroy_comp_channel(q.chan);
    }
}
