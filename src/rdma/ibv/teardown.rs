//! Destroying a QP: first wait for its sends to be acknowledged ([`drain`]), then free it
//! with its completion queue and channel ([`free_qp`]).

use std::ptr;

use rdma_sys as ffi;

use super::convert::wr_opcode;
use super::{Qp, DESTROY_DRAIN, DRAIN_ID};
use crate::rdma::verbs::WrOpcode;

/// Wait (at most [`DESTROY_DRAIN`]) until every send posted on `q` was acknowledged, so that
/// `ibv_destroy_qp` loses none of them: a signaled zero-length RDMA WRITE (no memory, no rkey
/// check) completes only after them, RC completing in order. A QP that cannot take it (not
/// in RTS, full) or that fails ends the wait at once.
pub(super) fn drain(q: &Qp) {
    // SAFETY: a zeroed work request is valid; the fields used are set below.
    let mut w: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
    w.wr_id = DRAIN_ID;
    w.opcode = wr_opcode(WrOpcode::Write);
    w.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    let mut bad = ptr::null_mut();
    // SAFETY: `q.qp` is live (it left the table but is not destroyed yet); `w` outlives the
    // call and names no memory.
    if unsafe { ffi::ibv_post_send(q.qp, &mut w, &mut bad) } != 0 {
        return;
    }
    let start = std::time::Instant::now();
    while start.elapsed() < DESTROY_DRAIN {
        // SAFETY: ibv_wc is plain data; zeroed entries are valid and overwritten by the poll.
        let mut wcs: [ffi::ibv_wc; 16] = unsafe { std::mem::zeroed() };
        // SAFETY: `q.cq` is live; `wcs` holds 16 entries.
        let n = unsafe { ffi::ibv_poll_cq(q.cq, 16, wcs.as_mut_ptr()) };
        if n < 0 {
            return;
        }
        if wcs[..n as usize]
            .iter()
            .any(|c| c.wr_id == DRAIN_ID || c.status != 0)
        {
            return;
        }
        if n == 0 {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
}

pub(super) fn free_qp(q: Qp) {
    // SAFETY: the QP left the table (or never entered it); destroy it, then its CQ (after
    // acknowledging nothing further: events were acknowledged as they were read) and channel.
    unsafe {
        ffi::ibv_destroy_qp(q.qp);
        ffi::ibv_destroy_cq(q.cq);
        ffi::ibv_destroy_comp_channel(q.chan);
    }
}
