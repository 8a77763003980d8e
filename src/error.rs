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
    /// An operating-system call failed.
    #[error("system error: {what}: {source}")]
    System {
        /// What roccl was doing.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A peer closed its connection, sent garbage, or reported an error.
    #[error("remote error: rank {rank}: {msg}")]
    Remote {
        /// The peer rank involved.
        rank: usize,
        /// What happened.
        msg: String,
    },
    /// Waiting for peers took longer than the configured timeout.
    #[error("timeout: {0}")]
    Timeout(String),
    /// A bug or broken invariant inside roccl.
    #[error("internal error: {0}")]
    Internal(String),
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
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::InvalidUsage(_) => ErrorKind::InvalidUsage,
            Error::System { .. } => ErrorKind::System,
            Error::Remote { .. } => ErrorKind::Remote,
            Error::Timeout(_) => ErrorKind::Timeout,
            Error::Internal(_) => ErrorKind::Internal,
        }
    }

    /// Build an [`Error::System`] from an io error and a description.
    pub fn sys(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::System {
            what: what.into(),
            source,
        }
    }

    /// Build an [`Error::System`] from `errno` and a description.
    pub fn last_os(what: impl Into<String>) -> Self {
        Error::sys(what, std::io::Error::last_os_error())
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub fn arg(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
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
