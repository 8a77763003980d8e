//! The call tag every message of a call carries: what the call is (collective, reduction,
//! data type, algorithm, a hash of its byte count, root), so that ranks in different calls
//! are told apart, and the words that say how two calls differ.

use super::blob::ALGOS;
use super::Collective;
use crate::algo::Algo;
use crate::types::{DataType, RedOp};

/// The tag every message of a call carries: what the call is, so that a rank in another
/// call is found out by the first message it exchanges (each network matches a message to a
/// posted buffer by tag and fails on a tag nobody posted). Bit 31 is set (tags below are
/// point-to-point exchanges and connection set-up); bits 27–30: the collective; 23–26: the
/// data type of reductions (moves are checked by size only); 20–22: the reduction; 16–19:
/// the algorithm (added by [`with_algo`]); 8–15: a hash of the call's byte count (`bytes`:
/// the buffer every rank passes alike), so that calls whose messages happen to have equal
/// sizes still differ; 0–7: the root, mod 256.
pub(super) fn call_tag(coll: &Collective, dt: DataType, bytes: usize) -> u32 {
    let (kind, op, root): (u32, Option<RedOp>, usize) = match *coll {
        Collective::AllReduce(op) => (0, Some(op), 0),
        Collective::Broadcast { root } => (1, None, root),
        Collective::Reduce { op, root } => (2, Some(op), root),
        Collective::AllGather => (3, None, 0),
        Collective::ReduceScatter(op) => (4, Some(op), 0),
        Collective::AllToAll => (5, None, 0),
        Collective::Barrier => (6, None, 0),
        Collective::SendRecv { .. } => return 0,
    };
    let (dt, op) = op.map_or((0, 0), |op| (dt as u32 + 1, op as u32 + 1));
    let b = bytes as u64;
    let count = (b ^ b >> 8 ^ b >> 16 ^ b >> 24 ^ b >> 32 ^ b >> 40) as u32 & 0xff;
    1 << 31 | kind << 27 | (dt & 0xf) << 23 | (op & 7) << 20 | count << 8 | (root as u32 & 0xff)
}

/// The bits of a call tag that hold its byte count.
const COUNT_BITS: u32 = 0xff << 8;

/// `tag` with the algorithm that runs the call.
pub(super) fn with_algo(tag: u32, algo: Algo) -> u32 {
    if tag == 0 {
        return 0;
    }
    let a = ALGOS.iter().position(|&x| x == algo).unwrap_or(15) as u32 + 1;
    (tag & !(0xf << 16)) | (a & 0xf) << 16
}

/// How the call of tag `theirs` differs from this rank's (`mine`), for errors.
pub(super) fn differ(mine: u32, theirs: u32) -> String {
    if mine & 1 << 31 != 0 && (mine ^ theirs) & !COUNT_BITS == 0 {
        format!("{} with another count of bytes", describe(theirs))
    } else {
        describe(theirs)
    }
}

/// What a call tag says, for errors: `all_reduce(sum, f32) by ring`.
pub(super) fn describe(tag: u32) -> String {
    if tag & 1 << 31 == 0 {
        return "a point-to-point exchange (send/receive), not a collective".into();
    }
    let kind = match (tag >> 27) & 0xf {
        0 => "all_reduce",
        1 => "broadcast",
        2 => "reduce",
        3 => "all_gather",
        4 => "reduce_scatter",
        5 => "all_to_all",
        6 => "barrier",
        _ => "an unknown collective",
    };
    let mut args = Vec::new();
    if let Some(op) = ((tag >> 20) & 7).checked_sub(1) {
        args.push(
            [RedOp::Sum, RedOp::Prod, RedOp::Max, RedOp::Min, RedOp::Avg]
                .get(op as usize)
                .map_or("?".to_string(), |o| o.to_string()),
        );
    }
    if let Some(dt) = ((tag >> 23) & 0xf).checked_sub(1) {
        args.push(
            DataType::ALL
                .get(dt as usize)
                .map_or("?".to_string(), |d| d.to_string()),
        );
    }
    if matches!(kind, "broadcast" | "reduce") {
        args.push(format!("root {}", tag & 0xff));
    }
    let algo = ((tag >> 16) & 0xf)
        .checked_sub(1)
        .and_then(|a| ALGOS.get(a as usize))
        .map_or(String::new(), |a| format!(" by {a}"));
    format!("{kind}({}){algo}", args.join(", "))
}
