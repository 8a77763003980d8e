//! The reports a selective-mode responder sends besides IBTA's acknowledgements (userspace
//! engine extensions, sent only to a peer that said at setup it is a roccl engine): hole
//! reports and duplicate reports, and how each is packed into its header. A report is a
//! packet of the manufacturer-specific opcode [`Opcode::Report`](super::wire::Opcode::Report)
//! (0xC0), so a capture reads it as a vendor packet, not a malformed acknowledgement; its one
//! header has the AETH's layout, its syndrome (in the class 0b010, which IBTA's AETH
//! reserves, so one is never mistaken for an acknowledgement) says the kind.

use std::time::Duration;

use super::{psn_add, psn_diff, Aeth, Opcode};

/// Syndrome of a hole report (a userspace-engine extension, selective mode only): a
/// report packet whose PSN is the first missing PSN of a gap and whose MSN field holds
/// the number of missing PSNs (bits 0–7) and the distance from the first missing PSN to
/// the packet that showed the gap (bits 8–23). The
/// responder reports each new gap past the one its sequence-error NAK names, and repeats
/// the report of the first gap every 16 out-of-sequence packets (instead of
/// repeating the NAK). It acknowledges nothing. With it the
/// requester resends every hole of a window in one round trip instead of one hole per
/// round trip, and resends a packet again only when a packet it sent after the resend
/// showed the gap (the resend was lost), however long the queue ahead of the resend.
pub const HOLE_SYNDROME: u8 = 0x40;
/// The AETH of a hole report: `missing` PSNs from `first`, shown by PSN `shown_by`.
pub(super) fn hole_report(first: u32, missing: u32, shown_by: u32) -> Aeth {
    let dist = (psn_diff(shown_by, first).max(0) as u32).min(0xffff);
    Aeth {
        syndrome: HOLE_SYNDROME,
        msn: missing.min(0xff) | dist << 8,
    }
}

/// The missing count and the showing PSN of a hole report for `first` with MSN `msn`.
pub(super) fn read_hole_report(first: u32, msn: u32) -> (u32, u32) {
    (msn & 0xff, psn_add(first, msn >> 8 & 0xffff))
}

/// Syndrome of a duplicate report (a userspace-engine extension, selective mode only,
/// beside [`HOLE_SYNDROME`]): a report packet, sent after
/// the re-acknowledgement of duplicate requests, whose PSN is the lowest of the duplicates
/// the responder received since its last report and whose MSN field holds their count
/// (bits 0–11) and the shortest time between one's arrival and the last advance of the
/// expected PSN, in 16 µs units (bits 12–23). The requester counts that many of its
/// retransmissions spurious (they were of packets that had arrived). When the lowest PSN
/// is the one its last retransmission timeout resent first and the time is short (the
/// original and its resend reached a responder that was late to answer, rather than the
/// acknowledgement of the original being lost), the timeout fired too early: the QP waits
/// longer before the next (TCP's D-SACK with Eifel's response). It acknowledges nothing.
pub const DUP_SYNDROME: u8 = 0x41;

/// The opcode of a packet with `syndrome`: hole and duplicate reports (the class 0b010) go
/// in the manufacturers' opcode space, the rest are IBTA's acknowledgements.
pub(super) fn report_or_ack(syndrome: u8) -> Opcode {
    if syndrome & 0xe0 == 0x40 {
        Opcode::Report
    } else {
        Opcode::Ack
    }
}

/// The MSN field of a duplicate report: `n` duplicates, the shortest `gap`.
pub(super) fn dup_report(n: u32, gap: Duration) -> u32 {
    let units = (gap.as_micros() / 16).min(0xfff) as u32;
    n.min(0xfff) | units << 12
}

/// The count and the gap of a duplicate report's MSN field.
pub(super) fn read_dup_report(msn: u32) -> (u32, Duration) {
    (
        msn & 0xfff,
        Duration::from_micros(u64::from(msn >> 12 & 0xfff) * 16),
    )
}

/// A duplicate that reached the responder within this of the last advance of its expected
/// PSN came with its original: the responder was late, not the acknowledgement lost.
pub(super) const LATE_GAP: Duration = Duration::from_micros(500);
