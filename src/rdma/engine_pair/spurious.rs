//! Spurious retransmissions: a peer that is merely late to acknowledge (descheduled) is
//! told apart from a lost packet, and the sender learns to wait for it.

use super::*;

/// Write 64 bytes while engine 1 is descheduled for `stall` µs; returns the packets
/// engine 0 resent, of those the ones it counted spurious, and its timeouts.
fn write_past_a_stall(s: &mut Pair, stall: u64) -> (u64, u64, u64) {
    let before = s.eng[0].stats();
    s.stall_1_until = s.t + stall;
    write_through(s, &mut [5u8; 64], &mut [0u8; 64]);
    let after = s.eng[0].stats();
    (
        after.retransmits - before.retransmits,
        after.spurious_retransmits - before.spurious_retransmits,
        after.timeouts - before.timeouts,
    )
}

/// A descheduled responder makes the requester probe and time out (nothing was lost); the
/// responder's duplicate report marks every resend spurious, and the requester's timer
/// then waits out a pause of that length (its cheap tail-loss probes still go). The extra
/// wait fades within two seconds of quiet.
#[test]
fn a_late_acknowledgement_is_told_from_a_loss_and_waited_for() {
    let mut s = Pair::new(3, Faults::default(), provider_attr());
    write_through(&mut s, &mut [7u8; 64], &mut [0u8; 64]);
    // A 6 ms pause, past the 3 ms timer: probes and a timeout; every resend arrives as a
    // duplicate, is reported, and counts spurious.
    let (resent, spurious, timeouts) = write_past_a_stall(&mut s, 6_000);
    assert!(timeouts >= 1, "no timeout during a 6 ms pause");
    assert_eq!(
        spurious, resent,
        "every resend was of a packet that had arrived"
    );
    assert_eq!(s.eng[1].stats().duplicates, resent);
    // The next pause of 5 ms passes without a timeout.
    let (resent, spurious, timeouts) = write_past_a_stall(&mut s, 5_000);
    assert_eq!(timeouts, 0, "timed out again after learning");
    assert_eq!(spurious, resent);
    // Two quiet seconds later the timer is short again.
    s.t += 2_500_000;
    assert!(
        write_past_a_stall(&mut s, 5_000).2 >= 1,
        "the slack did not fade"
    );
}

/// A timeout whose resend is a duplicate because the acknowledgement of the original was
/// lost (not late) counts the resend spurious but leaves the timer as it was.
#[test]
fn a_lost_acknowledgement_does_not_lengthen_the_timer() {
    let mut s = Pair::new(4, Faults::default(), provider_attr());
    write_through(&mut s, &mut [7u8; 64], &mut [0u8; 64]);
    // Engine 1 answers nothing for 6 ms: it has the packet, every answer is lost.
    s.mute_1_until = s.t + 6_000;
    let before = s.eng[0].stats();
    write_through(&mut s, &mut [5u8; 64], &mut [0u8; 64]);
    let st = s.eng[0].stats();
    assert!(st.timeouts > before.timeouts, "no timeout while muted");
    // A 5 ms pause right after still times out: the timer did not grow.
    assert!(
        write_past_a_stall(&mut s, 5_000).2 >= 1,
        "the lost answers lengthened the timer"
    );
}

/// A lost packet is not spurious: under loss the retransmissions outnumber the ones the
/// responder reports as duplicates.
#[test]
fn lost_packets_are_not_counted_spurious() {
    let mut s = Pair::new(5, Faults::default(), provider_attr());
    write_through(&mut s, &mut [7u8; 64], &mut [0u8; 64]);
    let first = 0x00ff_fff0u32 + 1;
    s.lose_once = [3u32, 9, 17]
        .iter()
        .map(|o| (first + o) & 0x00ff_ffff)
        .collect();
    let mut src = pattern(2, 96 << 10);
    let mut dst = vec![0u8; src.len()];
    write_through(&mut s, &mut src, &mut dst);
    let st = s.eng[0].stats();
    assert!(st.retransmits >= 3, "{st:?}");
    assert!(st.retransmits - st.spurious_retransmits >= 3, "{st:?}");
}

/// A gap the peer reports (a packet really lost) drops what the timer learned: on a lossy
/// path a timeout is more likely a loss than a late peer.
#[test]
fn a_reported_gap_drops_the_slack() {
    let mut s = Pair::new(6, Faults::default(), provider_attr());
    write_through(&mut s, &mut [7u8; 64], &mut [0u8; 64]);
    assert!(write_past_a_stall(&mut s, 6_000).2 >= 1);
    assert_eq!(write_past_a_stall(&mut s, 5_000).2, 0, "did not learn");
    // Three one-packet writes so far from Pair::new's first PSN: lose the third packet of
    // the next write, so the responder reports the gap.
    s.lose_once = vec![(0x00ff_fff0 + 3 + 2) & 0x00ff_ffff];
    let naks = s.eng[0].stats().seq_naks_received;
    let mut src = pattern(3, 64 << 10);
    let mut dst = vec![0u8; src.len()];
    write_through(&mut s, &mut src, &mut dst);
    assert!(s.eng[0].stats().seq_naks_received > naks, "no gap reported");
    assert!(
        write_past_a_stall(&mut s, 5_000).2 >= 1,
        "the slack outlived a loss"
    );
}

/// Resends of packets the responder keeps out of order (behind a gap) are duplicates too:
/// only the packet that was really lost, twice, is left when the spurious ones are taken
/// away.
#[test]
fn resends_of_packets_kept_out_of_order_count_spurious() {
    let mut s = Pair::new(7, Faults::default(), provider_attr());
    write_through(&mut s, &mut [7u8; 64], &mut [0u8; 64]);
    // Packet 10 of the next write is lost at its first send and at its first resend; the
    // responder is descheduled meanwhile, so the timeout resends what it keeps.
    let p = (0x00ff_fff0u32 + 1 + 10) & 0x00ff_ffff;
    s.lose_once = vec![p, p];
    s.stall_1_until = s.t + 6_000;
    let before = s.eng[0].stats();
    let mut src = pattern(4, 256 << 10);
    let mut dst = vec![0u8; src.len()];
    write_through(&mut s, &mut src, &mut dst);
    let st = s.eng[0].stats();
    let (resent, spurious) = (
        st.retransmits - before.retransmits,
        st.spurious_retransmits - before.spurious_retransmits,
    );
    assert!(st.timeouts > before.timeouts, "{st:?}");
    assert_eq!(resent - spurious, 2, "resent {resent}, spurious {spurious}");
}
