//! When to kick a QP, and what its send PSN says of its requester. No clock or device of its
//! own: the caller passes `now` and the PSNs it read, so the rule is tested without either.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How soon after a kick that found the requester idle one look reads its PSN once more
/// (for a kernel that runs the requester after the doorbell's system call, not inside it).
const FOLLOW_UP: Duration = Duration::from_millis(1);

/// One QP's sends: how many signaled ones were posted and completed, and how many posts of
/// any kind began (counted on the data path with relaxed adds, only where kicks are on), and
/// what the last look saw.
#[derive(Default)]
pub(in crate::rdma::ibv) struct SendWatch {
    posted: AtomicU64,
    completed: AtomicU64,
    posts: AtomicU64,
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
    /// The send PSN last read since then: half a wait into the quiet, then after each
    /// kick's ring (what the next kick compares with).
    base: Option<Base>,
    /// Whether the look half a wait into the quiet asked for it (once, even if it failed).
    base_asked: bool,
    /// Since when the kicks in a row that found the requester idle say it was.
    idle_since: Option<Instant>,
    /// After a kick that found the requester idle: the one look that reads it again.
    follow_up: Option<FollowUp>,
}

/// A read of the send PSN: when, what, and the posts begun by then.
#[derive(Clone, Copy)]
struct Base {
    at: Instant,
    psn: u32,
    posts: u64,
}

/// A kick that found the requester idle: when, its PSN after the ring, how long it had been
/// idle, and the counts a restart is judged by (posts: those begun by the base read).
#[derive(Clone, Copy)]
struct FollowUp {
    at: Instant,
    psn: u32,
    idle_for: Duration,
    posts: u64,
    completed: u64,
}

/// What the caller does after a look ([`SendWatch::due`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub(in crate::rdma::ibv) struct Look {
    /// Read the send PSN, ring the doorbell, read the PSN again: [`SendWatch::at_kick`].
    pub kick: Option<Kick>,
    /// Read the send PSN: [`SendWatch::at_read`].
    pub read_psn: bool,
}

/// A kick the watch asks for.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::rdma::ibv) struct Kick {
    /// Sends outstanding.
    pub outstanding: u64,
    /// How long nothing was posted or completed.
    pub idle: Duration,
    /// Which kick since the sends last moved (1-based).
    pub nth: u32,
}

/// What a kick, or the look after it, found of the requester.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::rdma::ibv) enum Requester {
    /// Its send PSN had not moved for `idle_for` with sends outstanding, and the ring did not
    /// move it: stalled, or waiting on the peer's acknowledgement of all it sent.
    Idle {
        /// The send PSN.
        psn: u32,
        /// How long it had not moved (since the first read that saw it so).
        idle_for: Duration,
    },
    /// Idle for `idle_for`, its send PSN moved forward from `from` to `to` with nothing
    /// posted meanwhile: inside the ring's system call (`by_the_ring`), or by the look
    /// `within` after it.
    Restarted {
        /// How long it had been idle.
        idle_for: Duration,
        /// How long after the ring the look that saw it move came (zero: by the ring).
        within: Duration,
        /// The PSN before.
        from: u32,
        /// The PSN after.
        to: u32,
        /// Whether it moved inside the ring's system call.
        by_the_ring: bool,
    },
}

/// Whether PSN `to` lies ahead of `from` (24-bit serial numbers; a retry that went back is
/// not ahead).
fn ahead(to: u32, from: u32) -> bool {
    let d = to.wrapping_sub(from) & 0x00ff_ffff;
    d != 0 && d < 0x0080_0000
}

impl SendWatch {
    /// A post (of any kind) begins: counted before it reaches the device, so a kick whose
    /// ring it overlaps does not take its effect for the kick's.
    pub(in crate::rdma::ibv) fn posting(&self) {
        self.posts.fetch_add(1, Ordering::Relaxed);
    }

    /// A signaled send was posted.
    pub(in crate::rdma::ibv) fn posted(&self) {
        self.posted.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` send completions were polled.
    pub(in crate::rdma::ibv) fn completed(&self, n: u64) {
        if n > 0 {
            self.completed.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Posts begun so far.
    fn posts(&self) -> u64 {
        self.posts.load(Ordering::Relaxed)
    }

    /// What to do at `now`: kick when signaled sends are outstanding and nothing was posted
    /// or completed for `after` since the counts last moved or the last kick, whichever came
    /// later (the ring moves no count); else read the send PSN half a wait into the quiet
    /// (what the first kick compares with), or once, a millisecond after a kick that found
    /// the requester idle.
    pub(in crate::rdma::ibv) fn due(&self, now: Instant, after: Duration) -> Look {
        let posted = self.posted.load(Ordering::Relaxed);
        let completed = self.completed.load(Ordering::Relaxed);
        let mut s = self.seen.lock();
        let moved = (posted, completed) != (s.posted, s.completed);
        if moved || s.moved.is_none() || posted <= completed {
            *s = Seen {
                posted,
                completed,
                moved: Some(now),
                ..Seen::default()
            };
            return Look::default();
        }
        let Some(quiet_since) = s.moved else {
            return Look::default();
        };
        let since = now.saturating_duration_since(s.kicked.unwrap_or(quiet_since));
        if since < after {
            let base_due = s.base.is_none() && !s.base_asked && since >= after / 2;
            s.base_asked |= base_due;
            let follow_up_due = s
                .follow_up
                .is_some_and(|f| now.saturating_duration_since(f.at) >= FOLLOW_UP);
            return Look {
                kick: None,
                read_psn: base_due || follow_up_due,
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

    /// A kick at `now`: the send PSN read `before` and `after` the ring (`None`: the read
    /// failed), and whether the ring went through (`rung`). The requester was idle when
    /// `before` is the PSN read last (half a wait into the quiet, or after the kick
    /// before); then the ring restarted it when `after` lies ahead and no post began since
    /// that read.
    pub(in crate::rdma::ibv) fn at_kick(
        &self,
        before: Option<u32>,
        after: Option<u32>,
        rung: bool,
        now: Instant,
    ) -> Option<Requester> {
        let mut s = self.seen.lock();
        let base = s.base.take();
        let posts = self.posts();
        s.base = after.map(|psn| Base {
            at: now,
            psn,
            posts,
        });
        s.base_asked = false;
        s.follow_up = None;
        let idle_since = s.idle_since.take();
        let (b, a) = (before?, after?);
        let base = base.filter(|base| base.psn == b)?;
        let idle_for = now.saturating_duration_since(idle_since.unwrap_or(base.at));
        let alone = rung && posts == base.posts;
        if a != b {
            return (alone && ahead(a, b)).then_some(Requester::Restarted {
                idle_for,
                within: Duration::ZERO,
                from: b,
                to: a,
                by_the_ring: true,
            });
        }
        s.idle_since = Some(idle_since.unwrap_or(base.at));
        s.follow_up = alone.then(|| FollowUp {
            at: now,
            psn: a,
            idle_for,
            posts: base.posts,
            completed: self.completed.load(Ordering::Relaxed),
        });
        Some(Requester::Idle { psn: b, idle_for })
    }

    /// A read of the send PSN that [`SendWatch::due`] asked for, at `now` (`None`: it
    /// failed): the base for the first kick, or the follow-up of a kick that found the
    /// requester idle, which is a restart when the PSN moved ahead with nothing posted or
    /// completed since.
    pub(in crate::rdma::ibv) fn at_read(
        &self,
        psn: Option<u32>,
        now: Instant,
    ) -> Option<Requester> {
        let mut s = self.seen.lock();
        let posts = self.posts();
        if let Some(f) = s.follow_up.take() {
            let psn = psn?;
            if psn == f.psn {
                return None;
            }
            // It moved: the next kick compares with this read.
            s.base = Some(Base {
                at: now,
                psn,
                posts,
            });
            s.idle_since = None;
            let alone = posts == f.posts && self.completed.load(Ordering::Relaxed) == f.completed;
            return (alone && ahead(psn, f.psn)).then(|| Requester::Restarted {
                idle_for: f.idle_for,
                within: now.saturating_duration_since(f.at),
                from: f.psn,
                to: psn,
                by_the_ring: false,
            });
        }
        if s.base.is_none() {
            s.base = psn.map(|psn| Base {
                at: now,
                psn,
                posts,
            });
        }
        None
    }
}

#[cfg(test)]
mod tests;
