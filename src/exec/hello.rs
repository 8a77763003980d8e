//! The hello protocol between ranks, as bytes (sans-IO): the first message on every
//! connection (which channel it carries), and the notices that travel on connections of
//! their own (whom to blame, which call the sender is in, a step of suspending).
//!
//! Every message starts with 16 bytes, little-endian: magic `ROLL`, the sender's rank, the
//! channel word, the communicator id. The channel word's top bits say what the message is
//! (`ABORT`, `MISMATCH`, `SUSPEND`, `DUPLEX`), its low bits a channel, a rank or a step kind.
//! A mismatch notice adds the sender's call tag (20 bytes in all); a suspend step adds its
//! body, up to [`MAX_LEN`] bytes in all.

/// "ROLL".
const MAGIC: u32 = 0x4c4c_4f52;
/// Bytes of the header every message starts with (and of a hello or abort notice).
pub(crate) const HEADER_LEN: usize = 16;
/// Bytes of a mismatch notice.
const MISMATCH_LEN: usize = 20;
/// Bytes of the longest message: a suspend step (the suspend module checks that its
/// layout fills exactly this).
pub(crate) const MAX_LEN: usize = 160;

/// Channel-word bit of an abort notice; the low bits name the failed rank.
const ABORT: u32 = 0x8000_0000;
/// Channel-word bit of a connection that carries both directions of its (peer, channel).
const DUPLEX: u32 = 0x4000_0000;
/// With [`ABORT`]: a mismatch notice.
const MISMATCH: u32 = 0x2000_0000;
/// Channel-word bit of a suspend step; the low bits say which step.
const SUSPEND: u32 = 0x1000_0000;
/// The bits of the channel word that are not flags.
const LOW: u32 = 0x0fff_ffff;

/// One message of the hello protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hello<'a> {
    /// The first message of a connection: it carries `channel`, both ways when `duplex`.
    Channel {
        /// The channel.
        channel: usize,
        /// Whether it carries both directions.
        duplex: bool,
    },
    /// The sender failed because of rank `failed` (or, naming the receiver, because it
    /// stopped hearing from it): the receiver should name it too.
    Abort {
        /// The rank to blame.
        failed: usize,
    },
    /// The sender found the receiver in another call than its own, whose tag is `tag`.
    Mismatch {
        /// The sender's call tag.
        tag: u32,
    },
    /// A step of closing idle connections: its kind and the whole message (the suspend
    /// module reads its body from byte 16 on).
    SuspendStep {
        /// Which step (request, answer, decision).
        kind: u32,
        /// The message as received.
        message: &'a [u8],
    },
}

/// Write `hello` from `rank` of communicator `comm_id` at the start of `out`; the bytes to
/// send. A suspend step's header only: its body is the suspend module's to write.
pub(crate) fn encode(hello: &Hello, rank: usize, comm_id: u32, out: &mut [u8; MAX_LEN]) -> usize {
    let (word, len) = match *hello {
        Hello::Channel { channel, duplex } => {
            let flag = if duplex { DUPLEX } else { 0 };
            ((channel as u32 & LOW) | flag, HEADER_LEN)
        }
        Hello::Abort { failed } => (ABORT | (failed as u32 & LOW), HEADER_LEN),
        Hello::Mismatch { tag } => {
            out[16..20].copy_from_slice(&tag.to_le_bytes());
            (ABORT | MISMATCH | (rank as u32 & LOW), MISMATCH_LEN)
        }
        Hello::SuspendStep { kind, .. } => (SUSPEND | (kind & LOW), MAX_LEN),
    };
    out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
    out[8..12].copy_from_slice(&word.to_le_bytes());
    out[12..16].copy_from_slice(&comm_id.to_le_bytes());
    len
}

/// The message in `bytes` (all that arrived) and its sender, if it is one of this
/// communicator's (`comm_id`, a sender below `nranks`): anything else is a stranger's or
/// another communicator's, and is dropped.
pub(crate) fn decode(bytes: &[u8], comm_id: u32, nranks: usize) -> Option<(usize, Hello<'_>)> {
    let word = |at: usize| Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?));
    let (magic, from, channel_word, id) = (word(0)?, word(4)? as usize, word(8)?, word(12)?);
    if magic != MAGIC || id != comm_id || from >= nranks {
        return None;
    }
    let low = channel_word & LOW;
    let hello = match (bytes.len(), channel_word & !LOW) {
        (MISMATCH_LEN, f) if f == ABORT | MISMATCH && low as usize == from => {
            Hello::Mismatch { tag: word(16)? }
        }
        (MAX_LEN, SUSPEND) => Hello::SuspendStep {
            kind: low,
            message: bytes,
        },
        (HEADER_LEN, ABORT) if (low as usize) < nranks => Hello::Abort {
            failed: low as usize,
        },
        (HEADER_LEN, 0) => Hello::Channel {
            channel: low as usize,
            duplex: false,
        },
        (HEADER_LEN, DUPLEX) => Hello::Channel {
            channel: low as usize,
            duplex: true,
        },
        _ => return None,
    };
    Some((from, hello))
}

/// The fuzz target's check: whatever `bytes` are, decoding returns (never panics), and what
/// decodes encodes back to the same bytes.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz(bytes: &[u8], comm_id: u32, nranks: usize) {
    let Some((from, h)) = decode(bytes, comm_id, nranks) else {
        return;
    };
    let mut out = [0u8; MAX_LEN];
    if let Hello::SuspendStep { message, .. } = h {
        out.copy_from_slice(message);
    }
    let n = encode(&h, from, comm_id, &mut out);
    assert_eq!(&out[..n], bytes, "{h:?} from {from} does not encode back");
}

/// A message of each kind from rank 1 of communicator `comm_id`: seeds of the fuzz target.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_seeds(comm_id: u32) -> Vec<Vec<u8>> {
    let step = [0u8; MAX_LEN];
    let kinds = [
        Hello::Channel {
            channel: 2,
            duplex: true,
        },
        Hello::Abort { failed: 0 },
        Hello::Mismatch { tag: 0x0102_0304 },
        Hello::SuspendStep {
            kind: 1,
            message: &step,
        },
    ];
    kinds
        .iter()
        .map(|h| {
            let mut out = [0u8; MAX_LEN];
            let n = encode(h, 1, comm_id, &mut out);
            out[..n].to_vec()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind reads back as written; other communicators' messages, strangers' bytes,
    /// wrong lengths and unknown flag combinations do not read at all.
    #[test]
    fn messages_read_back_and_strangers_do_not() {
        let suspend = [7u8; MAX_LEN];
        let cases = [
            Hello::Channel {
                channel: 3,
                duplex: false,
            },
            Hello::Channel {
                channel: 7,
                duplex: true,
            },
            Hello::Abort { failed: 5 },
            Hello::Mismatch { tag: 0xdead_beef },
            Hello::SuspendStep {
                kind: 2,
                message: &suspend,
            },
        ];
        for h in cases {
            let mut b = [0u8; MAX_LEN];
            if let Hello::SuspendStep { message, .. } = h {
                b.copy_from_slice(message);
            }
            let n = encode(&h, 6, 0x1234, &mut b);
            let (from, got) = decode(&b[..n], 0x1234, 8).expect("reads back");
            let got = match got {
                Hello::SuspendStep { kind, .. } => Hello::SuspendStep {
                    kind,
                    message: &suspend,
                },
                g => g,
            };
            assert_eq!((from, got), (6, h));
            assert_eq!(decode(&b[..n], 0x1235, 8), None, "another communicator");
            assert_eq!(decode(&b[..n], 0x1234, 6), None, "a rank out of range");
            assert_eq!(decode(&b[..n - 1], 0x1234, 8), None, "cut short");
        }
        let mut b = [0u8; MAX_LEN];
        let n = encode(&Hello::Abort { failed: 1 }, 0, 9, &mut b);
        b[0] ^= 1;
        assert_eq!(decode(&b[..n], 9, 2), None, "not the magic");
        b[0] ^= 1;
        b[11] |= 0x60; // ABORT | DUPLEX | MISMATCH on a 16-byte message
        assert_eq!(decode(&b[..n], 9, 2), None, "flags that mean nothing");
        let n = encode(&Hello::Abort { failed: 2 }, 0, 9, &mut b);
        assert_eq!(
            decode(&b[..n], 9, 2),
            None,
            "blaming a rank that is not one"
        );
        assert_eq!(decode(&[], 9, 2), None);
    }

    /// Any byte of a valid message changed: it does not read, or it reads as a message that
    /// writes back to exactly those bytes (nothing is read that the sender did not say).
    #[test]
    fn changed_messages_read_as_written_or_not_at_all() {
        let step = [3u8; MAX_LEN];
        let kinds = [
            Hello::Channel {
                channel: 1,
                duplex: false,
            },
            Hello::Abort { failed: 2 },
            Hello::Mismatch { tag: 77 },
            Hello::SuspendStep {
                kind: 3,
                message: &step,
            },
        ];
        for h in kinds {
            let mut b = [0u8; MAX_LEN];
            if let Hello::SuspendStep { message, .. } = h {
                b.copy_from_slice(message);
            }
            let n = encode(&h, 1, 5, &mut b);
            for at in 0..n.min(24) {
                for bit in 0..8 {
                    let mut c = b;
                    c[at] ^= 1 << bit;
                    let Some((from, got)) = decode(&c[..n], 5, 4) else {
                        continue;
                    };
                    let mut out = c;
                    let m = encode(&got, from, 5, &mut out);
                    assert_eq!(&out[..m], &c[..n], "byte {at} bit {bit} of {h:?}");
                }
            }
        }
    }
}
