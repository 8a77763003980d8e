//! Kicking a stalled soft-RoCE requester.
//!
//! Linux's soft-RoCE (`rdma_rxe`, Debian's 6.1, read in its source) can stop sending in the
//! middle of a message and never start again: its requester gives up the CPU when too many of its
//! packets are still in the NIC's queue (`need_req_skb`) or unacknowledged (`wait_psn`),
//! and counts on the packet's destructor or the next acknowledgement to wake it. Each of
//! those checks a flag the requester sets only after it looked at the counter, so a wake-up
//! that falls between the two is lost. With every packet sent so far acknowledged, rxe's
//! retransmission timer does not restart it either: the peer waits for the rest of the
//! message until the job's timeout. A post runs the requester again (`rxe_post_send` calls
//! it for a user QP), and so does the post's doorbell alone: the uverbs `POST_SEND` command
//! with no work requests, which librxe writes to the device's command descriptor after
//! every post.
//!
//! So on a soft-RoCE device, a QP whose signaled sends have been outstanding for a while
//! with none posted or completed gets its doorbell rung, and again after each such while
//! until its sends move: behind a write that is merely long it costs one system call, and
//! behind a stalled one it restarts the requester, however late in the message the stall
//! comes. (Kicks were zero-length RDMA WRITEs until 2026-12-07: each took a send-queue entry
//! until the long write before it completed, so at most 3 went out, all in the first
//! second of a 64 MiB write, and a stall later in it was never kicked.) [`SendWatch`]
//! decides when; it reads no clock itself (the caller passes `now`), so its rule is tested
//! without a device.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdma_sys as ffi;

use super::IbSettings;

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

/// `IB_USER_VERBS_CMD_POST_SEND` in the kernel's uverbs ABI (`enum ib_uverbs_write_cmds`,
/// `<rdma/ib_user_verbs.h>`).
const CMD_POST_SEND: u32 = 28;

/// The uverbs write command `POST_SEND`: `struct ib_uverbs_cmd_hdr`, then `struct
/// ib_uverbs_post_send` without work requests (`<rdma/ib_user_verbs.h>`).
#[repr(C)]
struct PostSendCommand {
    command: u32,
    in_words: u16,
    out_words: u16,
    /// Where the kernel writes `struct ib_uverbs_post_send_resp` (a `u32`).
    response: u64,
    qp_handle: u32,
    wr_count: u32,
    sge_count: u32,
    wqe_size: u32,
}

/// The command [`ring`] writes for the QP with kernel handle `qp_handle`, the kernel's
/// answer going to `response`.
fn doorbell_command(qp_handle: u32, response: u64) -> PostSendCommand {
    let bytes = std::mem::size_of::<PostSendCommand>();
    PostSendCommand {
        command: CMD_POST_SEND,
        in_words: (bytes / 4) as u16,
        out_words: (std::mem::size_of::<u32>() / 4) as u16,
        response,
        qp_handle,
        wr_count: 0,
        sge_count: 0,
        // What librxe passes; the kernel only checks it is at least its own entry's size.
        wqe_size: std::mem::size_of::<ffi::ibv_send_wr>() as u32,
    }
}

/// Rings `qp`'s doorbell: the uverbs `POST_SEND` command with no work requests, written to
/// its device's command descriptor as librxe does after each post, which runs a soft-RoCE
/// requester (another device's kernel driver gets a post of no work requests). Returns 0,
/// or the errno.
///
/// # Safety
/// `qp` must be a live QP of this process (its context lives at least as long).
pub(super) unsafe fn ring(qp: *mut ffi::ibv_qp) -> i32 {
    // SAFETY: the caller guarantees a live QP, whose context outlives it.
    let (fd, handle) = unsafe { ((*(*qp).context).cmd_fd, (*qp).handle) };
    let mut answer = 0u32;
    let cmd = doorbell_command(handle, std::ptr::addr_of_mut!(answer) as u64);
    let bytes = std::mem::size_of::<PostSendCommand>();
    // SAFETY: writes `cmd` (live through the call) to the device's command descriptor; the
    // kernel writes its 4-byte answer to `answer`, also live through the call.
    let n = unsafe { libc::write(fd, std::ptr::addr_of!(cmd).cast(), bytes) };
    if n < 0 {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    } else if n as usize != bytes {
        libc::EIO
    } else {
        0
    }
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
    moved: Option<Instant>,
    /// The last kick since then.
    kicked: Option<Instant>,
    /// Kicks since then.
    kicks: u32,
}

/// A kick the watch asks for.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Kick {
    /// Sends outstanding.
    pub outstanding: u64,
    /// How long nothing was posted or completed.
    pub idle: Duration,
    /// Which kick since the sends last moved (1-based).
    pub nth: u32,
}

impl SendWatch {
    /// A signaled send was posted.
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
    /// for `after` since the counts last moved or the last kick, whichever came later. The
    /// caller rings the doorbell (which moves no count).
    pub(super) fn due(&self, now: Instant, after: Duration) -> Option<Kick> {
        let posted = self.posted.load(Ordering::Relaxed);
        let completed = self.completed.load(Ordering::Relaxed);
        let mut s = self.seen.lock();
        let moved = (posted, completed) != (s.posted, s.completed);
        if moved || s.moved.is_none() || posted <= completed {
            *s = Seen {
                posted,
                completed,
                moved: Some(now),
                kicked: None,
                kicks: 0,
            };
            return None;
        }
        let quiet_since = s.moved?;
        if now.saturating_duration_since(s.kicked.unwrap_or(quiet_since)) < after {
            return None;
        }
        s.kicks += 1;
        s.kicked = Some(now);
        Some(Kick {
            outstanding: posted - completed,
            idle: now.saturating_duration_since(quiet_since),
            nth: s.kicks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_millis(1000);

    #[test]
    fn kicks_a_send_that_stays_outstanding_for_as_long_as_it_does() {
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
        assert_eq!(w.due(at(1500), AFTER), None, "not again within `after`");
        // A long write that stalls late: kicked every `after`, without end (a doorbell takes
        // no send-queue entry), the 20th kick 20 s in.
        for n in 2..=20u64 {
            let t = 10 + 1000 * n;
            assert_eq!(w.due(at(t - 10), AFTER), None, "kick {n} early");
            let k = w.due(at(t), AFTER).expect("kicked again");
            assert_eq!((k.outstanding, k.nth), (1, n as u32));
            assert_eq!(
                k.idle,
                Duration::from_millis(1000 * n),
                "since the last move"
            );
        }
        // The send completes: nothing outstanding, no kick; the count restarts.
        w.completed(1);
        assert_eq!(w.due(at(30000), AFTER), None);
        assert_eq!(w.due(at(40000), AFTER), None, "nothing outstanding");
        w.posted();
        assert_eq!(w.due(at(40010), AFTER), None);
        assert_eq!(w.due(at(41010), AFTER).map(|k| k.nth), Some(1));
    }

    #[test]
    fn the_doorbell_is_the_uverbs_post_send_without_work_requests() {
        let c = doorbell_command(0x1234, 0xdead_beef);
        // struct ib_uverbs_cmd_hdr (8 bytes) + struct ib_uverbs_post_send (24): 8 words in,
        // 1 word out (struct ib_uverbs_post_send_resp), as librxe's doorbell.
        assert_eq!(std::mem::size_of::<PostSendCommand>(), 32);
        let at = |o: usize, want: usize| assert_eq!(o, want);
        at(std::mem::offset_of!(PostSendCommand, in_words), 4);
        at(std::mem::offset_of!(PostSendCommand, out_words), 6);
        at(std::mem::offset_of!(PostSendCommand, response), 8);
        at(std::mem::offset_of!(PostSendCommand, qp_handle), 16);
        at(std::mem::offset_of!(PostSendCommand, wr_count), 20);
        at(std::mem::offset_of!(PostSendCommand, sge_count), 24);
        at(std::mem::offset_of!(PostSendCommand, wqe_size), 28);
        assert_eq!((c.command, c.in_words, c.out_words), (28, 8, 1));
        assert_eq!((c.qp_handle, c.wr_count, c.sge_count), (0x1234, 0, 0));
        assert_eq!(c.response, 0xdead_beef);
        assert!(
            c.wqe_size as usize >= 56,
            "at least struct ib_uverbs_send_wr"
        );
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
