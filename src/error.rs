//! Errors returned by roccl. Every message says what failed and, where known, the likely cause.

/// Result alias used throughout roccl.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in roccl.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller passed something invalid (wrong count, bad rank, unknown name...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The communicator was used in a way it does not support (e.g. after an error).
    #[error("invalid usage: {0}")]
    InvalidUsage(String),
    /// A setting (`ROCCL_*` variable, or the same field of a `Config`) has a value it
    /// does not take.
    #[error("invalid argument: {name}={value:?} is not valid: {name} takes {accepts} (or unset it for the default)")]
    Setting {
        /// The setting, `ROCCL_...`.
        name: String,
        /// The value given.
        value: String,
        /// What it takes, in words.
        accepts: String,
    },
    /// An operating-system call, or a call into a system library (an RDMA verb), failed.
    #[error("system error: {what}: {source}")]
    System {
        /// What roccl was doing.
        what: String,
        /// The C function that failed, where one did (`ibv_post_send`, ...).
        call: Option<&'static str>,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A peer closed its connection, sent garbage, or reported an error.
    #[error("remote error: rank {rank}: {msg}")]
    Remote {
        /// The peer rank involved.
        rank: usize,
        /// What is known of the cause, for code to decide on (the message is for people).
        cause: PeerCause,
        /// What happened.
        msg: String,
    },
    /// Waiting for peers took longer than the configured timeout.
    #[error("timeout: {msg}")]
    Timeout {
        /// The ranks waited for, where known (empty: not one peer's doing, or unknown).
        waiting_on: Vec<usize>,
        /// What was waited for, and the likely fix.
        msg: String,
    },
    /// A bug or broken invariant inside roccl.
    #[error("internal error: {0}")]
    Internal(String),
    /// A message from the peer carried a tag that matches no buffer posted on this side:
    /// the two ranks are in different calls. The networks return it; the executor turns it
    /// into [`Error::Remote`] with [`PeerCause::OtherCall`], naming the peer.
    #[error("invalid usage: the other side's message tag ({theirs:#010x}) matches no buffer posted on this side: the ranks are in different calls")]
    TagMismatch {
        /// The peer's tag (its call's).
        theirs: u32,
    },
}

/// What is known of why a peer is blamed ([`Error::Remote`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerCause {
    /// It closed its connection, sent something wrong or failed (the message says what).
    Failed,
    /// It did not answer in time: hung, stopped or unreachable.
    Unresponsive,
    /// Its process (on this host) has exited.
    Exited,
    /// Its process (on this host) is stopped.
    Stopped,
    /// It was in another call: its message carried the tag `theirs`, this rank's call has
    /// the tag `ours` (the communicator's error message describes both calls).
    OtherCall {
        /// This rank's tag.
        ours: u32,
        /// The peer's tag.
        theirs: u32,
    },
}

/// The class of an [`Error`], without its details (what the C ABI maps to result codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// [`Error::InvalidArgument`].
    InvalidArgument,
    /// [`Error::InvalidUsage`].
    InvalidUsage,
    /// [`Error::System`].
    System,
    /// [`Error::Remote`].
    Remote,
    /// [`Error::Timeout`].
    Timeout,
    /// [`Error::Internal`].
    Internal,
}

impl Error {
    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidArgument(_) | Error::Setting { .. } => ErrorKind::InvalidArgument,
            Error::InvalidUsage(_) => ErrorKind::InvalidUsage,
            Error::System { .. } => ErrorKind::System,
            Error::Remote { .. } => ErrorKind::Remote,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::Internal(_) => ErrorKind::Internal,
            Error::TagMismatch { .. } => ErrorKind::InvalidUsage,
        }
    }

    /// Build an [`Error::System`] from an io error and a description.
    pub fn sys(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::System {
            what: what.into(),
            call: None,
            source,
        }
    }

    /// An [`Error::Timeout`] waiting on `waiting_on` (empty where no peer is known).
    pub fn timeout(waiting_on: Vec<usize>, msg: impl Into<String>) -> Self {
        Error::Timeout {
            waiting_on,
            msg: msg.into(),
        }
    }

    /// Build an [`Error::System`] from `errno` and a description.
    pub fn last_os(what: impl Into<String>) -> Self {
        Error::sys(what, std::io::Error::last_os_error())
    }

    /// An [`Error::Remote`] blaming `rank` for `cause`.
    pub fn remote(rank: usize, cause: PeerCause, msg: impl Into<String>) -> Self {
        Error::Remote {
            rank,
            cause,
            msg: msg.into(),
        }
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub fn arg(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}

/// The error that made a communicator unusable, as it reports it later
/// (`Communicator::async_error`, `ncclCommGetAsyncError`): its class, the peer it blames
/// and why, where known, and its message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AsyncError {
    /// The class of the error.
    pub kind: ErrorKind,
    /// The rank blamed, for an [`Error::Remote`].
    pub rank: Option<usize>,
    /// Why that rank is blamed.
    pub cause: Option<PeerCause>,
    /// The error's message, as its `Display` says it.
    pub message: String,
}

impl AsyncError {
    /// What `e` says, kept.
    pub fn of(e: &Error) -> AsyncError {
        let (rank, cause) = match e {
            Error::Remote { rank, cause, .. } => (Some(*rank), Some(*cause)),
            _ => (None, None),
        };
        AsyncError {
            kind: e.kind(),
            rank,
            cause,
            message: e.to_string(),
        }
    }

    /// An error of class `kind` with `message` and no peer to blame.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> AsyncError {
        AsyncError {
            kind,
            rank: None,
            cause: None,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for AsyncError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// "rank 3" or "ranks 1, 2, 5", for messages that name peers.
pub fn ranks_list(ranks: &[usize]) -> String {
    match ranks {
        [] => "no rank".to_string(),
        [r] => format!("rank {r}"),
        many => format!(
            "ranks {}",
            many.iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
