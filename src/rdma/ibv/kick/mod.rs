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
//! Each kick also tells whether it restarted a stalled requester: it reads the QP's send PSN
//! (rxe answers with its requester's next PSN) before and after ringing, and compares with
//! a read half a wait into the quiet (or at the kick before). Unmoved since then, the
//! requester was idle with sends outstanding: stalled, or waiting on the peer's
//! acknowledgement of all it sent. Moved by the ring, with nothing posted since that read,
//! the doorbell restarted it (on Debian's 6.1 the requester runs inside the ring's system call);
//! where a kernel runs it later, one look soon after reads the PSN once more. Both are
//! logged and counted ([`KickCounts`]); the rule is [`watch`]'s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub(super) use watch::SendWatch;
use watch::{Look, Requester};

mod watch;

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
    fn kicked(&self) {
        self.kicks.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts what a kick or the look after it found.
    fn found(&self, what: &Requester) {
        let add = |c: &AtomicU64| {
            c.fetch_add(1, Ordering::Relaxed);
        };
        match what {
            Requester::Idle { .. } => add(&self.idle),
            Requester::Restarted { by_the_ring, .. } => {
                if *by_the_ring {
                    add(&self.idle);
                }
                add(&self.restarted);
            }
        }
    }

    /// Appends the counts that are not zero: `kicks`, `kicks_on_an_idle_requester` (the
    /// restarted ones among them), `requesters_restarted_by_a_kick`.
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
/// reads its send PSN, rings its doorbell and reads the PSN again, or only reads the PSN;
/// then says what that found. The first kick of a stall and every tenth are logged (with
/// the errno where the ring failed, which is left to the job's timeout), and every restart.
///
/// # Safety
/// `qp` must be a live QP of this process, `watch` its own and `counts` its provider's.
pub(super) unsafe fn act(
    look: Look,
    watch: &SendWatch,
    counts: &KickCounts,
    qp: *mut ffi::ibv_qp,
    now: Instant,
    (dev, qpn): (&str, u32),
) {
    let Some(k) = look.kick else {
        if look.read_psn {
            // SAFETY: the caller guarantees a live QP.
            let psn = unsafe { send_psn(qp) }.ok();
            if let Some(found) = watch.at_read(psn, now) {
                counts.found(&found);
                tell(dev, qpn, &found);
            }
        }
        return;
    };
    // SAFETY: as above.
    let before = unsafe { send_psn(qp) };
    // SAFETY: as above.
    let r = unsafe { ring(qp) };
    // SAFETY: as above.
    let after = unsafe { send_psn(qp) };
    counts.kicked();
    let found = watch.at_kick(before.ok(), after.ok(), r == 0, now);
    if let Some(f) = &found {
        counts.found(f);
    }
    if k.nth == 1 || k.nth % 10 == 0 {
        let psn = match (before, after) {
            (Ok(b), Ok(a)) => format!("; send PSN {b:#x} before, {a:#x} after"),
            (Err(e), _) | (_, Err(e)) => format!("; reading its send PSN failed: errno {e}"),
        };
        let idle = match &found {
            Some(Requester::Idle { idle_for, .. }) => format!(
                "; its requester had sent nothing for {} ms (stalled, or waiting on the peer's acknowledgement)",
                idle_for.as_millis()
            ),
            _ => String::new(),
        };
        crate::info!(
            "{dev}: QP {qpn:#x}: {} send(s) outstanding, nothing posted or completed for {} ms: kick {} (its doorbell rung, which runs a stalled soft-RoCE requester again){}{psn}{idle}",
            k.outstanding,
            k.idle.as_millis(),
            k.nth,
            if r == 0 { String::new() } else { format!("; the ring failed: errno {r}") },
        );
    }
    if let Some(f @ Requester::Restarted { .. }) = &found {
        tell(dev, qpn, f);
    }
}

/// Logs a restart (an idle requester is told in its kick's line).
fn tell(dev: &str, qpn: u32, found: &Requester) {
    let Requester::Restarted {
        idle_for,
        within,
        from,
        to,
        by_the_ring,
    } = found
    else {
        return;
    };
    let when = if *by_the_ring {
        "inside the doorbell's system call".to_string()
    } else {
        format!(
            "within {:.1} ms of its doorbell",
            within.as_secs_f64() * 1e3
        )
    };
    crate::info!(
        "{dev}: QP {qpn:#x}: its requester, idle for {} ms with sends outstanding, sent again {when} (send PSN {from:#x} -> {to:#x}, nothing posted meanwhile): a stalled requester restarted by a kick",
        idle_for.as_millis()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_by_the_ring_is_also_an_idle_kick_and_a_later_one_is_not() {
        let c = KickCounts::default();
        let d = Duration::ZERO;
        c.kicked();
        c.found(&Requester::Idle {
            psn: 1,
            idle_for: d,
        });
        let restart = |by_the_ring| Requester::Restarted {
            idle_for: d,
            within: d,
            from: 1,
            to: 2,
            by_the_ring,
        };
        c.found(&restart(false));
        c.kicked();
        c.found(&restart(true));
        let mut out = Vec::new();
        c.report(&mut out);
        assert_eq!(
            out,
            [
                ("kicks", 2),
                ("kicks_on_an_idle_requester", 2),
                ("requesters_restarted_by_a_kick", 2)
            ]
        );
        let mut none = Vec::new();
        KickCounts::default().report(&mut none);
        assert!(none.is_empty(), "zeros are left out");
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
}
