//! What a broken connection says about its peer: the network's error kind, and what this
//! host can see of the peer's process, make the cause an error names.

use std::io::ErrorKind;

/// The cause of a connection's failure, as an error states it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ConnFailure {
    /// This host could not send at all: the fault is here, not at the peer.
    Here(String),
    /// The peer never answered (retries exhausted): like a timeout.
    Silent(String),
    /// The peer closed its connection, or another failure.
    Gone(String),
}

/// The cause of a failed connection to `peer` over `net`, from the network error's `kind`
/// (`None`: a fault on this host's side, [`crate::net::LocalFault`]) and, for a peer of
/// this host, what its process is (`state`: exited, stopped).
pub(crate) fn conn_failure(
    kind: Option<ErrorKind>,
    me: usize,
    peer: usize,
    net: &str,
    state: Option<super::links::PeerProcess>,
) -> ConnFailure {
    let Some(kind) = kind else {
        return ConnFailure::Here(format!(
            "rank {me}: this rank's network failed (rank {peer} and possibly others unreachable over {net})"
        ));
    };
    // A peer of this host: its process says which it is.
    if let Some(state) = state {
        let cause = format!("rank {peer} failed: {state}");
        return match kind {
            ErrorKind::TimedOut => ConnFailure::Silent(cause),
            _ => ConnFailure::Gone(cause),
        };
    }
    match kind {
        ErrorKind::TimedOut => ConnFailure::Silent(format!(
            "rank {peer} did not answer over {net} for as long as ROCCL_TIMEOUT allows (retries exhausted): it is stopped, hung or unreachable"
        )),
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe => ConnFailure::Gone(format!(
            "rank {peer} exited or aborted (it closed its connection)"
        )),
        _ => ConnFailure::Gone(format!("the connection to rank {peer} over {net} failed")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_exhausted_is_silence_not_an_exit() {
        let b = conn_failure(Some(ErrorKind::TimedOut), 0, 2, "rocev2", None);
        let ConnFailure::Silent(m) = b else {
            panic!("{b:?}")
        };
        assert!(m.contains("rank 2 did not answer over rocev2"), "{m}");
        assert!(!m.contains("exited"), "{m}");
    }

    #[test]
    fn a_closed_connection_is_an_exit() {
        for k in [
            ErrorKind::UnexpectedEof,
            ErrorKind::ConnectionReset,
            ErrorKind::BrokenPipe,
        ] {
            let b = conn_failure(Some(k), 0, 1, "tcp", None);
            assert_eq!(
                b,
                ConnFailure::Gone("rank 1 exited or aborted (it closed its connection)".into())
            );
        }
    }

    #[test]
    fn a_local_send_failure_blames_this_rank() {
        let b = conn_failure(None, 1, 0, "rocev2", None);
        let ConnFailure::Here(m) = b else {
            panic!("{b:?}")
        };
        assert!(m.starts_with("rank 1: this rank's network failed"), "{m}");
    }

    #[test]
    fn the_peer_process_state_names_the_cause() {
        let stopped = Some(crate::exec::links::PeerProcess::Stopped { pid: 7 });
        let b = conn_failure(Some(ErrorKind::TimedOut), 0, 1, "rocev2", stopped);
        assert_eq!(
            b,
            ConnFailure::Silent(
                "rank 1 failed: its process (pid 7 on this host) is stopped (SIGSTOP, a terminal's Ctrl-Z, or a debugger)"
                    .into()
            )
        );
    }
}
