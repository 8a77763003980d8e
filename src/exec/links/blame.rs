//! What a rank knows when something fails: whom it waited on, what other ranks reported
//! (abort and mismatch notices), which peers' processes it can look at, and the flag that
//! aborts every wait. [`super::Links::failure`] turns it into the error that names a rank.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::{PeerProcess, TIMEOUT_GRACE_MIN};

/// A rank's evidence for blaming one (see [`super::Links::blame`]).
pub(crate) struct Blame {
    /// This rank.
    me: usize,
    /// Ranks of the communicator.
    nranks: usize,
    /// The peer last waited on in vain (blamed when a wait times out).
    pub suspect: Option<usize>,
    /// Abort notices received: (reporting rank, blamed rank).
    pub notices: Vec<(usize, usize)>,
    /// This rank has sent its abort notices.
    pub notified: bool,
    /// A peer that found this rank in another call: (its rank, its call's tag).
    pub mismatch: Option<(usize, u32)>,
    /// The tag of the call in progress (the executor's), told to a peer found in another
    /// call and named in the error.
    pub call: u32,
    /// How long a rank that timed out listens for other ranks' notices before blaming.
    pub timeout_grace: Duration,
    /// Set by `Communicator::abort` from any thread; every wait checks it.
    pub abort: Arc<AtomicBool>,
    /// Per rank, its process id where this rank can see that process (same host and pid
    /// namespace; set at init), to say in an error whether it exited or is stopped.
    pub local_pids: Vec<Option<u32>>,
}

impl Blame {
    /// No evidence yet, for rank `me` of `nranks`.
    pub fn new(
        me: usize,
        nranks: usize,
        timeout_grace: Option<Duration>,
        local_pids: Vec<Option<u32>>,
    ) -> Self {
        Blame {
            me,
            nranks,
            suspect: None,
            notices: Vec::new(),
            notified: false,
            mismatch: None,
            call: 0,
            timeout_grace: timeout_grace.unwrap_or(TIMEOUT_GRACE_MIN),
            abort: Arc::new(AtomicBool::new(false)),
            local_pids,
        }
    }

    /// Whether `peer`'s process, on this host, has exited or is stopped.
    pub fn peer_state(&self, peer: usize) -> Option<PeerProcess> {
        let pid = self.local_pids.get(peer).copied().flatten()?;
        if crate::os::process::process_gone(pid) {
            Some(PeerProcess::Exited { pid })
        } else if crate::os::process::process_stopped(pid) {
            Some(PeerProcess::Stopped { pid })
        } else {
            None
        }
    }

    /// Whether another rank has sent an abort notice.
    pub fn aborted(&self) -> bool {
        !self.notices.is_empty()
    }

    /// Whether rank `r` has sent a notice (so it is alive).
    pub fn reported(&self, r: usize) -> bool {
        self.notices.iter().any(|n| n.0 == r)
    }

    /// The most blamed rank that has not reported (`own` counts as a vote); when every
    /// blamed rank has reported, the one rank besides this one that sent no notice (in a
    /// tree, a hung rank's neighbours may each first suspect another live neighbour, but
    /// every live rank reports and the hung one never does).
    pub fn culprit(&self, own: Option<usize>) -> Option<usize> {
        let me = self.me;
        let mut votes: Vec<(usize, usize)> = Vec::new();
        let blamed = self.notices.iter().map(|n| n.1).chain(own);
        for c in blamed.filter(|c| *c != me && !self.reported(*c)) {
            match votes.iter_mut().find(|v| v.0 == c) {
                Some(v) => v.1 += 1,
                None => votes.push((c, 1)),
            }
        }
        votes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        if let Some(v) = votes.first() {
            return Some(v.0);
        }
        let mut silent = (0..self.nranks).filter(|&r| r != me && !self.reported(r));
        match (silent.next(), silent.next()) {
            (Some(r), None) if !self.notices.is_empty() => Some(r),
            _ => None,
        }
    }
}
