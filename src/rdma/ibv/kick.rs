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
//!
//! Each kick also reads the QP's send PSN (rxe reports its requester's next PSN), as does a
//! look half a wait into the quiet: one that has not moved since that read, or since the
//! kick before, finds the requester idle with sends outstanding: stalled, or waiting on the
//! peer's acknowledgement of all it sent. The
//! looks after such a kick read the PSN again until it moves (the kick restarted a stalled
//! requester, which is logged and counted: [`KickCounts`]) or the sends complete without it
//! (it was waiting on the peer).

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

/// `qp`'s send PSN as its device reports it (`ibv_query_qp` with `IBV_QP_SQ_PSN`: rxe's
/// requester's next PSN), or the errno.
///
/// # Safety
/// `qp` must be a live QP of this process.
pub(super) unsafe fn send_psn(qp: *mut ffi::ibv_qp) -> Result<u32, i32> {
    // SAFETY: zeroed out-parameters are valid.
    let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut i: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    let mask = ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN.0 as std::os::raw::c_int;
    // SAFETY: the caller guarantees a live QP; both out-parameters live through the call.
    match unsafe { ffi::ibv_query_qp(qp, &mut a, mask, &mut i) } {
        0 => Ok(a.sq_psn),
        e => Err(e),
    }
}

/// The kicks of one provider, for its counters.
#[derive(Default)]
pub(super) struct KickCounts {
    kicks: AtomicU64,
    idle: AtomicU64,
    restarted: AtomicU64,
}

impl KickCounts {
    /// Counts a kick.
    pub(super) fn kicked(&self) {
        self.kicks.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts what a look at the send PSN found.
    pub(super) fn found(&self, what: &Requester) {
        let c = match what {
            Requester::Idle { .. } => &self.idle,
            Requester::Restarted { .. } => &self.restarted,
            Requester::Acknowledged { .. } => return,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Appends the counts that are not zero: `kicks`, `kicks_on_an_idle_requester`,
    /// `requesters_restarted_by_a_kick`.
    pub(super) fn report(&self, out: &mut Vec<(&'static str, u64)>) {
        for (name, c) in [
            ("kicks", &self.kicks),
            ("kicks_on_an_idle_requester", &self.idle),
            ("requesters_restarted_by_a_kick", &self.restarted),
        ] {
            let n = c.load(Ordering::Relaxed);
            if n > 0 {
                out.push((name, n));
            }
        }
    }
}

/// Carries out `look` (from `watch.due` at `now`) on `qp`, the QP `qpn` of device `dev`:
/// rings its doorbell and reads its send PSN, or only reads the PSN, and says what that
/// found. The first kick of a stall and every tenth are logged, with the errno where the
/// ring failed (which is left to the job's timeout).
///
/// # Safety
/// `qp` must be a live QP of this process, `watch` and `counts` its own and its provider's.
pub(super) unsafe fn act(
    look: Look,
    watch: &SendWatch,
    counts: &KickCounts,
    qp: *mut ffi::ibv_qp,
    now: Instant,
    (dev, qpn): (&str, u32),
) {
    let rung = look.kick.map(|k| {
        // SAFETY: the caller guarantees a live QP.
        let r = unsafe { ring(qp) };
        counts.kicked();
        (k, r)
    });
    // SAFETY: as above.
    let psn = unsafe { send_psn(qp) };
    let found = psn.ok().and_then(|p| watch.at_psn(p, now, rung.is_some()));
    if let Some((k, r)) = rung.filter(|(k, _)| k.nth == 1 || k.nth % 10 == 0) {
        crate::info!(
            "{dev}: QP {qpn:#x}: {} send(s) outstanding, nothing posted or completed for {} ms: kick {} (its doorbell rung, which runs a stalled soft-RoCE requester again){}{}",
            k.outstanding,
            k.idle.as_millis(),
            k.nth,
            if r == 0 { String::new() } else { format!("; the ring failed: errno {r}") },
            match psn {
                Ok(p) => format!("; send PSN {p:#x}"),
                Err(e) => format!("; reading its send PSN failed: errno {e}"),
            }
        );
    }
    let Some(found) = found else { return };
    counts.found(&found);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    match found {
        Requester::Idle { psn, idle_for } => crate::info!(
            "{dev}: QP {qpn:#x}: its requester sent nothing for {:.0} ms with sends outstanding (send PSN {psn:#x} at this kick and the one before): stalled, or waiting on the peer's acknowledgement",
            ms(idle_for)
        ),
        Requester::Restarted { idle_for, within, from, to } => crate::info!(
            "{dev}: QP {qpn:#x}: its requester, idle for {:.0} ms with sends outstanding, sent again within {:.1} ms of a kick (send PSN {from:#x} -> {to:#x}, nothing posted since): a stalled requester restarted by its doorbell",
            ms(idle_for),
            ms(within)
        ),
        Requester::Acknowledged { within } => crate::info!(
            "{dev}: QP {qpn:#x}: its idle requester's sends completed {:.1} ms after the kick without a packet sent: it had waited on the peer's acknowledgement, not stalled",
            ms(within)
        ),
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
    /// The send PSN read since then, and when: half a wait into the quiet, then at each
    /// kick (what the next kick compares with).
    base: Option<(Instant, u32)>,
    /// Whether the look half a wait into the quiet asked for it (once, even if the read
    /// fails).
    base_asked: bool,
    /// After a kick that found the requester idle (kept when the counts move).
    idle: Option<IdleKick>,
    /// When the PSN was last read after such a kick.
    read_at: Option<Instant>,
}

/// A kick that found the requester idle: when, its PSN, how long it had not moved, and the
/// counts then.
#[derive(Clone, Copy)]
struct IdleKick {
    at: Instant,
    psn: u32,
    idle_for: Duration,
    posted: u64,
    completed: u64,
}

/// What a look at the send PSN found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Requester {
    /// At a kick: the PSN has not moved since the kick before, `idle_for` ago.
    Idle {
        /// The send PSN.
        psn: u32,
        /// How long it has not moved (at least).
        idle_for: Duration,
    },
    /// After a kick that found it idle for `idle_for`, the PSN moved: seen `within` of the
    /// kick.
    Restarted {
        /// How long it had been idle before the kick.
        idle_for: Duration,
        /// When the look that saw it move came, after the kick.
        within: Duration,
        /// The PSN before and after.
        from: u32,
        /// See `from`.
        to: u32,
    },
    /// After a kick that found it idle, the sends completed with the PSN unmoved: it had
    /// sent everything and waited on the peer.
    Acknowledged {
        /// How long after the kick.
        within: Duration,
    },
}

/// What the caller does after a look ([`SendWatch::due`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Look {
    /// Ring the doorbell, then read the PSN and pass it to [`SendWatch::at_psn`].
    pub kick: Option<Kick>,
    /// Read the PSN and pass it to [`SendWatch::at_psn`] (a kick found the requester idle).
    pub read_psn: bool,
}

/// How often the looks after a kick that found the requester idle read its PSN (a system
/// call each).
const READ_EVERY: Duration = Duration::from_millis(1);

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

    /// What to do at `now`: kick when sends are outstanding and nothing was posted or
    /// completed for `after` since the counts last moved or the last kick, whichever came
    /// later (the caller rings the doorbell, which moves no count); else read the send PSN
    /// half a wait into the quiet (what the first kick compares with), and after a kick
    /// that found the requester idle, at most every millisecond.
    pub(super) fn due(&self, now: Instant, after: Duration) -> Look {
        let posted = self.posted.load(Ordering::Relaxed);
        let completed = self.completed.load(Ordering::Relaxed);
        let mut s = self.seen.lock();
        let moved = (posted, completed) != (s.posted, s.completed);
        if moved || s.moved.is_none() || posted <= completed {
            *s = Seen {
                posted,
                completed,
                moved: Some(now),
                idle: s.idle,
                read_at: s.read_at,
                ..Seen::default()
            };
            return Look {
                kick: None,
                read_psn: read_due(&mut s, now),
            };
        }
        let Some(quiet_since) = s.moved else {
            return Look::default();
        };
        let since = now.saturating_duration_since(s.kicked.unwrap_or(quiet_since));
        if since < after {
            let base_due =
                s.idle.is_none() && s.base.is_none() && !s.base_asked && since >= after / 2;
            s.base_asked |= base_due;
            return Look {
                kick: None,
                read_psn: base_due || read_due(&mut s, now),
            };
        }
        s.kicks += 1;
        s.kicked = Some(now);
        Look {
            kick: Some(Kick {
                outstanding: posted - completed,
                idle: now.saturating_duration_since(quiet_since),
                nth: s.kicks,
            }),
            read_psn: false,
        }
    }

    /// The send PSN read at `now`, at a kick (`at_kick`) or at a look [`SendWatch::due`]
    /// asked to read it: what it says of the requester, if anything new. A kick finds it
    /// idle when the PSN is the one read before it (half a wait into the quiet, or at the
    /// kick before); after that, the PSN moving
    /// (with nothing posted since) is a restart, and the sends completing without it an
    /// acknowledgement it waited for.
    pub(super) fn at_psn(&self, psn: u32, now: Instant, at_kick: bool) -> Option<Requester> {
        let mut s = self.seen.lock();
        if let Some(i) = s.idle {
            let within = now.saturating_duration_since(i.at);
            let found = if s.posted != i.posted {
                // A post of its own ran the requester: nothing to tell.
                Some(None)
            } else if psn != i.psn {
                Some(Some(Requester::Restarted {
                    idle_for: i.idle_for,
                    within,
                    from: i.psn,
                    to: psn,
                }))
            } else if s.completed != i.completed {
                Some(Some(Requester::Acknowledged { within }))
            } else {
                None
            };
            if let Some(found) = found {
                s.idle = None;
                s.base = at_kick.then_some((now, psn));
                return found;
            }
            if at_kick {
                s.base = Some((now, psn));
            }
            return None;
        }
        if !at_kick {
            s.base.get_or_insert((now, psn));
            return None;
        }
        let before = s.base.replace((now, psn));
        let (at, _) = before.filter(|&(_, p)| p == psn)?;
        let idle_for = now.saturating_duration_since(at);
        s.idle = Some(IdleKick {
            at: now,
            psn,
            idle_for,
            posted: s.posted,
            completed: s.completed,
        });
        s.read_at = Some(now);
        Some(Requester::Idle { psn, idle_for })
    }
}

/// Whether a look reads the send PSN: only after a kick found the requester idle, and at
/// most every [`READ_EVERY`].
fn read_due(s: &mut Seen, now: Instant) -> bool {
    if s.idle.is_none()
        || s.read_at
            .is_some_and(|t| now.saturating_duration_since(t) < READ_EVERY)
    {
        return false;
    }
    s.read_at = Some(now);
    true
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
        assert_eq!(w.due(at(0), AFTER).kick, None, "nothing posted");
        w.posted();
        assert_eq!(
            w.due(at(10), AFTER).kick,
            None,
            "just posted: the look starts the clock"
        );
        assert_eq!(w.due(at(900), AFTER).kick, None, "not idle long enough");
        let k = w
            .due(at(1010), AFTER)
            .kick
            .expect("idle for 1 s with a send out");
        assert_eq!(
            (k.outstanding, k.idle, k.nth),
            (1, Duration::from_millis(1000), 1)
        );
        assert_eq!(
            w.due(at(1500), AFTER).kick,
            None,
            "not again within `after`"
        );
        // A long write that stalls late: kicked every `after`, without end (a doorbell takes
        // no send-queue entry), the 20th kick 20 s in.
        for n in 2..=20u64 {
            let t = 10 + 1000 * n;
            assert_eq!(w.due(at(t - 10), AFTER).kick, None, "kick {n} early");
            let k = w.due(at(t), AFTER).kick.expect("kicked again");
            assert_eq!((k.outstanding, k.nth), (1, n as u32));
            assert_eq!(
                k.idle,
                Duration::from_millis(1000 * n),
                "since the last move"
            );
        }
        // The send completes: nothing outstanding, no kick; the count restarts.
        w.completed(1);
        assert_eq!(w.due(at(30000), AFTER).kick, None);
        assert_eq!(w.due(at(40000), AFTER).kick, None, "nothing outstanding");
        w.posted();
        assert_eq!(w.due(at(40010), AFTER).kick, None);
        assert_eq!(w.due(at(41010), AFTER).kick.map(|k| k.nth), Some(1));
    }

    /// A watch with one send posted at 0 ms and kicks at 1000 and 2000 ms, the PSN read at
    /// each: `first` at the first kick, `second` at the second, and what the second found.
    fn kicked_twice(first: u32, second: u32) -> (SendWatch, Instant, Option<Requester>) {
        let w = SendWatch::default();
        let t0 = Instant::now();
        w.posted();
        assert_eq!(w.due(t0, AFTER), Look::default());
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(w.due(at(1000), AFTER).kick.is_some());
        assert_eq!(
            w.at_psn(first, at(1000), true),
            None,
            "nothing to compare with"
        );
        assert!(
            w.due(at(1500), AFTER) == Look::default(),
            "no read before a kick found it idle"
        );
        assert!(w.due(at(2000), AFTER).kick.is_some());
        let found = w.at_psn(second, at(2000), true);
        (w, t0, found)
    }

    #[test]
    fn the_first_kick_compares_with_the_psn_read_half_a_wait_into_the_quiet() {
        let w = SendWatch::default();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        w.posted();
        assert_eq!(w.due(t0, AFTER), Look::default());
        assert_eq!(
            w.due(at(499), AFTER),
            Look::default(),
            "not half a wait yet"
        );
        let half = w.due(at(500), AFTER);
        assert!(half.read_psn && half.kick.is_none(), "{half:?}");
        assert_eq!(w.at_psn(100, at(500), false), None, "the base");
        assert_eq!(w.due(at(600), AFTER), Look::default(), "read once");
        assert!(w.due(at(1000), AFTER).kick.is_some());
        let ms = Duration::from_millis;
        assert_eq!(
            w.at_psn(100, at(1000), true),
            Some(Requester::Idle {
                psn: 100,
                idle_for: ms(500)
            }),
            "unmoved since the base"
        );
        assert!(w.due(at(1002), AFTER).read_psn);
        assert!(matches!(
            w.at_psn(101, at(1002), false),
            Some(Requester::Restarted { within, idle_for, .. }) if within == ms(2) && idle_for == ms(500)
        ));
        // The counts move and go quiet again: a new base half a wait in.
        w.completed(1);
        w.posted();
        assert_eq!(w.due(at(2000), AFTER), Look::default());
        assert!(w.due(at(2500), AFTER).read_psn);
        assert_eq!(w.at_psn(900, at(2500), false), None);
        assert!(w.due(at(3000), AFTER).kick.is_some());
        assert_eq!(
            w.at_psn(1900, at(3000), true),
            None,
            "it moved: a long write"
        );
    }

    #[test]
    fn a_requester_whose_psn_moves_between_kicks_is_not_idle() {
        let (w, t0, found) = kicked_twice(100, 5000);
        assert_eq!(
            found, None,
            "a long write: it sent 4900 packets between the kicks"
        );
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(
            w.due(at(2005), AFTER),
            Look::default(),
            "and no reads follow"
        );
        assert!(w.due(at(3000), AFTER).kick.is_some());
        assert_eq!(w.at_psn(9000, at(3000), true), None);
    }

    #[test]
    fn an_idle_requester_that_sends_again_after_the_kick_was_restarted_by_it() {
        let (w, t0, found) = kicked_twice(100, 100);
        let ms = Duration::from_millis;
        assert_eq!(
            found,
            Some(Requester::Idle {
                psn: 100,
                idle_for: ms(1000)
            })
        );
        let at = |us: u64| t0 + Duration::from_micros(us);
        assert!(
            !w.due(at(2_000_500), AFTER).read_psn,
            "read at most every ms"
        );
        assert!(w.due(at(2_001_000), AFTER).read_psn);
        assert_eq!(w.at_psn(100, at(2_001_000), false), None, "not yet");
        assert!(w.due(at(2_003_000), AFTER).read_psn);
        assert_eq!(
            w.at_psn(140, at(2_003_000), false),
            Some(Requester::Restarted {
                idle_for: ms(1000),
                within: ms(3),
                from: 100,
                to: 140
            })
        );
        assert!(
            !w.due(at(2_010_000), AFTER).read_psn,
            "told once; no more reads"
        );
        assert_eq!(w.at_psn(300, at(2_010_000), false), None);
    }

    #[test]
    fn an_idle_requester_whose_sends_complete_unmoved_waited_on_the_peer() {
        let (w, t0, found) = kicked_twice(7, 7);
        assert!(matches!(found, Some(Requester::Idle { psn: 7, .. })));
        let at = |ms| t0 + Duration::from_millis(ms);
        w.completed(1);
        assert!(
            w.due(at(2010), AFTER).read_psn,
            "a read still follows the counts moving"
        );
        assert_eq!(
            w.at_psn(7, at(2010), false),
            Some(Requester::Acknowledged {
                within: Duration::from_millis(10)
            })
        );
        assert!(!w.due(at(2020), AFTER).read_psn);
    }

    #[test]
    fn a_post_after_an_idle_kick_leaves_nothing_to_tell() {
        let (w, t0, _) = kicked_twice(7, 7);
        let at = |ms| t0 + Duration::from_millis(ms);
        w.posted();
        assert!(w.due(at(2010), AFTER).read_psn);
        assert_eq!(
            w.at_psn(9, at(2010), false),
            None,
            "the post ran the requester"
        );
        assert!(!w.due(at(2020), AFTER).read_psn);
    }

    #[test]
    fn an_idle_requester_still_idle_at_the_next_kick_is_told_once() {
        let (w, t0, found) = kicked_twice(7, 7);
        assert!(found.is_some());
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(w.due(at(3000), AFTER).kick.is_some());
        assert_eq!(
            w.at_psn(7, at(3000), true),
            None,
            "still idle: said at the first"
        );
        assert!(w.due(at(4000), AFTER).kick.is_some());
        assert!(matches!(
            w.at_psn(8, at(4000), true),
            Some(Requester::Restarted { within, .. }) if within == Duration::from_millis(2000)
        ));
        let c = KickCounts::default();
        c.kicked();
        c.found(&Requester::Idle {
            psn: 7,
            idle_for: Duration::ZERO,
        });
        let mut out = Vec::new();
        c.report(&mut out);
        assert_eq!(out, [("kicks", 1), ("kicks_on_an_idle_requester", 1)]);
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
            assert_eq!(w.due(now, AFTER).kick, None, "at look {i}");
        }
    }
}
