//! What a call posts: the caller's buffers as the executor holds them, and its requests in
//! flight (the links keep both vectors between calls, so that a call allocates none).

use crate::net::ReqId;

/// A caller buffer as the executor holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UserBuf {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) write: bool,
    pub(super) device: bool,
}

/// A request in flight (a send or a receive of one region).
#[derive(Clone, Copy)]
pub(crate) struct Op {
    pub(super) send: bool,
    pub(super) peer: u32,
    pub(super) ch: u8,
    pub(super) req: ReqId,
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) active: bool,
    pub(super) done: bool,
    pub(super) size: usize,
    /// When it was posted (`metrics::now_ns`), where the communicator is traced; else 0.
    pub(super) posted: u64,
    /// A receive on a simulated network: its virtual arrival (ps), applied to the rank's
    /// clock when the algorithm takes it (0: none).
    pub(super) arrival: u64,
}

/// The executor's vectors, kept between calls (by the links) so that a call allocates none.
pub(crate) struct Scratch {
    pub(super) ops: Vec<Op>,
    pub(super) fds: Vec<crate::net::PollFd>,
    pub(super) users: Vec<UserBuf>,
    pub(super) members: Vec<usize>,
}

impl Default for Scratch {
    fn default() -> Self {
        Scratch {
            ops: Vec::with_capacity(128),
            fds: Vec::with_capacity(64),
            users: Vec::with_capacity(64),
            members: Vec::new(),
        }
    }
}
