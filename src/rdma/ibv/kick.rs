//! Kicking a stalled soft-RoCE requester.
//!
//! Linux's soft-RoCE (`rdma_rxe`, Debian's 6.1, read in its source) can stop sending in the
//! middle of a message and never start again: its requester gives up the CPU when too many of its
//! packets are still in the NIC's queue (`need_req_skb`) or unacknowledged (`wait_psn`),
//! and counts on the packet's destructor or the next acknowledgement to wake it. Each of
//! those checks a flag the requester sets only after it looked at the counter, so a wake-up
//! that falls between the two is lost. With every packet sent so far acknowledged, rxe's
//! retransmission timer does not restart it either: the peer waits for the rest of the
//! message until the job's timeout. Posting any work request runs the requester again
//! (`rxe_post_send` calls it for a user QP).
//!
//! So on a soft-RoCE device, a QP whose signaled sends have been outstanding for a while
//! with none posted or completed gets a signaled zero-length RDMA WRITE (it touches no
//! memory and needs no key, IBTA C9-88; its completion is hidden). Behind a write that is
//! merely long it costs one small packet; behind a stalled one it restarts the requester.
//! [`SendWatch`] decides when; it reads no clock itself (the caller passes `now`), so its
//! rule is tested without a device.
//!
//! The 64 MiB stall seen in the cross suite is another one: there the kicks went out and
//! the queue pair stayed stopped (docs/ROCE.md, "The rxe stall").

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdma_sys as ffi;

use super::IbSettings;

/// Kicks in a row without a completion after which the watch stops kicking (the requester
/// is not what is stuck: the peer or the link is, and the retry timer or the job's timeout
/// reports it). Each takes a send queue entry until it completes.
pub(super) const MAX_KICKS: u32 = 3;

/// Send-queue entries kept for kicks beyond the network's own.
pub(super) const KICK_SLOTS: u32 = MAX_KICKS + 1;

/// Vendor id of Linux's soft-RoCE devices (`RXE_VENDOR_ID`).
pub(super) const SOFT_ROCE_VENDOR: u32 = 0x00ff_ffff;

/// The default wait before a kick on a soft-RoCE device (none on hardware).
pub(super) const SOFT_ROCE_KICK: Duration = Duration::from_millis(1000);

/// The wait before kicking a QP whose sends make no progress: `ROCCL_IB_KICK_MS` where set
/// (0: never), else [`SOFT_ROCE_KICK`] on Linux soft-RoCE and never on hardware.
pub(super) fn after(settings: &IbSettings, vendor_id: u32) -> Option<Duration> {
    match settings.kick_ms {
        Some(0) => None,
        Some(ms) => Some(Duration::from_millis(u64::from(ms))),
        None => (vendor_id == SOFT_ROCE_VENDOR).then_some(SOFT_ROCE_KICK),
    }
}

/// Posts the kick on `qp`: a signaled zero-length RDMA WRITE with work request id `wr_id`
/// (the provider's hidden bit). Returns `ibv_post_send`'s result (0: posted).
pub(super) fn post(qp: *mut ffi::ibv_qp, wr_id: u64) -> i32 {
    // SAFETY: a zeroed work request is valid: no scatter list, RDMA WRITE of 0 bytes.
    let mut w: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
    w.wr_id = wr_id;
    w.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
    w.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    let mut bad = std::ptr::null_mut();
    // SAFETY: the caller passes a live QP; `w` outlives the call (the device copies it).
    unsafe { ffi::ibv_post_send(qp, &mut w, &mut bad) }
}

/// One QP's signaled sends: how many were posted and completed (counted on the data path
/// with relaxed adds), and what the last look saw.
#[derive(Default)]
pub(super) struct SendWatch {
    posted: AtomicU64,
    completed: AtomicU64,
    seen: Mutex<Seen>,
}

#[derive(Default, Clone, Copy)]
struct Seen {
    posted: u64,
    completed: u64,
    /// When the counts last changed (or the look that first saw them).
    since: Option<Instant>,
    /// Kicks in a row: reset only once everything posted up to the last kick completed, so
    /// no more than [`MAX_KICKS`] are ever in the send queue.
    kicks: u32,
    /// Signaled sends posted up to the last kick (itself included, counted by the caller).
    kicked_at: u64,
}

/// A kick the watch asks for.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Kick {
    /// Sends outstanding.
    pub outstanding: u64,
    /// How long nothing was posted or completed.
    pub idle: Duration,
    /// Which kick in a row this is (1-based).
    pub nth: u32,
}

impl SendWatch {
    /// A signaled send (or kick) was posted.
    pub(super) fn posted(&self) {
        self.posted.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` send completions were polled.
    pub(super) fn completed(&self, n: u64) {
        if n > 0 {
            self.completed.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Whether to kick at `now`: sends are outstanding and nothing was posted or completed
    /// for `after` (and fewer than [`MAX_KICKS`] kicks went out since the last completion).
    /// A kick asked for counts as one: the caller posts it (and counts it with
    /// [`SendWatch::posted`]) or gives up.
    pub(super) fn due(&self, now: Instant, after: Duration) -> Option<Kick> {
        let posted = self.posted.load(Ordering::Relaxed);
        let completed = self.completed.load(Ordering::Relaxed);
        let mut s = self.seen.lock();
        if completed >= s.kicked_at {
            s.kicks = 0;
        }
        let moved = (posted, completed) != (s.posted, s.completed);
        if moved || s.since.is_none() || posted <= completed {
            *s = Seen {
                posted,
                completed,
                since: Some(now),
                ..*s
            };
            return None;
        }
        let idle = now.saturating_duration_since(s.since?);
        if idle < after || s.kicks >= MAX_KICKS {
            return None;
        }
        s.kicks += 1;
        s.kicked_at = posted + 1;
        s.since = Some(now);
        Some(Kick {
            outstanding: posted - completed,
            idle,
            nth: s.kicks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_millis(1000);

    #[test]
    fn kicks_a_send_that_stays_outstanding_and_stops_after_a_few() {
        let w = SendWatch::default();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(w.due(at(0), AFTER), None, "nothing posted");
        w.posted();
        assert_eq!(
            w.due(at(10), AFTER),
            None,
            "just posted: the look starts the clock"
        );
        assert_eq!(w.due(at(900), AFTER), None, "not idle long enough");
        let k = w
            .due(at(1010), AFTER)
            .expect("idle for 1 s with a send out");
        assert_eq!(
            (k.outstanding, k.idle, k.nth),
            (1, Duration::from_millis(1000), 1)
        );
        w.posted(); // the kick
        assert_eq!(w.due(at(1020), AFTER), None, "the kick moved the count");
        assert_eq!(w.due(at(2030), AFTER).map(|k| k.nth), Some(2));
        w.posted();
        assert_eq!(w.due(at(2040), AFTER), None);
        assert_eq!(w.due(at(3050), AFTER).map(|k| k.nth), Some(3));
        w.posted();
        assert_eq!(w.due(at(3060), AFTER), None);
        assert_eq!(
            w.due(at(9000), AFTER),
            None,
            "no more than MAX_KICKS in a row"
        );
        // The stalled send completes, its kicks not yet: no new kicks while they are queued,
        // whatever stalls next (at most MAX_KICKS in the send queue).
        w.completed(1);
        w.posted();
        assert_eq!(w.due(at(9010), AFTER), None);
        assert_eq!(
            w.due(at(11000), AFTER),
            None,
            "kicks still queued: none more"
        );
        // Everything completed, kicks too: the count restarts; nothing outstanding.
        w.completed(4);
        assert_eq!(w.due(at(11010), AFTER), None);
        assert_eq!(w.due(at(20000), AFTER), None, "nothing outstanding");
        w.posted();
        assert_eq!(w.due(at(20010), AFTER), None);
        assert_eq!(w.due(at(21010), AFTER).map(|k| k.nth), Some(1));
    }

    #[test]
    fn kicks_on_soft_roce_by_default_and_where_asked() {
        let with = |v: Option<&str>| {
            IbSettings::from_lookup(&|k| {
                (k == "ROCCL_IB_KICK_MS")
                    .then(|| v.map(str::to_string))
                    .flatten()
            })
            .unwrap()
        };
        let mlx5 = 0x02c9; // Mellanox's vendor id
        assert_eq!(after(&with(None), SOFT_ROCE_VENDOR), Some(SOFT_ROCE_KICK));
        assert_eq!(
            after(&with(None), mlx5),
            None,
            "never on hardware unless asked"
        );
        assert_eq!(after(&with(Some("0")), SOFT_ROCE_VENDOR), None);
        let ms = |n| Some(Duration::from_millis(n));
        assert_eq!(after(&with(Some("250")), mlx5), ms(250));
        assert_eq!(after(&with(Some("20")), SOFT_ROCE_VENDOR), ms(20));
    }

    #[test]
    fn a_moving_queue_is_never_kicked() {
        let w = SendWatch::default();
        let t0 = Instant::now();
        for i in 0..100u64 {
            w.posted();
            w.posted();
            w.completed(1);
            let now = t0 + Duration::from_millis(600 * i);
            assert_eq!(w.due(now, AFTER), None, "at look {i}");
        }
    }
}
