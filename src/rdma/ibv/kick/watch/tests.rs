use super::*;

const AFTER: Duration = Duration::from_millis(1000);

#[test]
fn kicks_a_send_that_stays_outstanding_for_as_long_as_it_does() {
    let w = SendWatch::default();
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    assert_eq!(w.due(at(0), AFTER).kick, None, "nothing posted");
    w.posted();
    assert_eq!(
        w.due(at(10), AFTER).kick,
        None,
        "just posted: the look starts the clock"
    );
    assert_eq!(w.due(at(900), AFTER).kick, None, "not idle long enough");
    let k = w
        .due(at(1010), AFTER)
        .kick
        .expect("idle for 1 s with a send out");
    assert_eq!(
        (k.outstanding, k.idle, k.nth),
        (1, Duration::from_millis(1000), 1)
    );
    assert_eq!(
        w.due(at(1500), AFTER).kick,
        None,
        "not again within `after`"
    );
    // A long write that stalls late: kicked every `after`, without end (a doorbell takes
    // no send-queue entry), the 20th kick 20 s in.
    for n in 2..=20u64 {
        let t = 10 + 1000 * n;
        assert_eq!(w.due(at(t - 10), AFTER).kick, None, "kick {n} early");
        let k = w.due(at(t), AFTER).kick.expect("kicked again");
        assert_eq!((k.outstanding, k.nth), (1, n as u32));
        assert_eq!(
            k.idle,
            Duration::from_millis(1000 * n),
            "since the last move"
        );
    }
    // The send completes: nothing outstanding, no kick; the count restarts.
    w.completed(1);
    assert_eq!(w.due(at(30000), AFTER).kick, None);
    assert_eq!(w.due(at(40000), AFTER).kick, None, "nothing outstanding");
    w.posted();
    assert_eq!(w.due(at(40010), AFTER).kick, None);
    assert_eq!(w.due(at(41010), AFTER).kick.map(|k| k.nth), Some(1));
}

#[test]
fn a_moving_queue_is_never_kicked() {
    let w = SendWatch::default();
    let t0 = Instant::now();
    for i in 0..100u64 {
        w.posted();
        w.posted();
        w.completed(1);
        let now = t0 + Duration::from_millis(600 * i);
        assert_eq!(w.due(now, AFTER).kick, None, "at look {i}");
    }
}

/// A watch with one send posted at 0 ms whose PSN (`base`) was read half a wait in, and its
/// start.
fn read_at_half(base: u32) -> (SendWatch, Instant) {
    let w = SendWatch::default();
    let t0 = Instant::now();
    w.posting();
    w.posted();
    assert_eq!(w.due(t0, AFTER), Look::default());
    let at = |ms| t0 + Duration::from_millis(ms);
    assert_eq!(
        w.due(at(499), AFTER),
        Look::default(),
        "not half a wait yet"
    );
    let look = w.due(at(500), AFTER);
    assert!(look.read_psn && look.kick.is_none(), "{look:?}");
    assert_eq!(w.at_read(Some(base), at(500)), None, "the base");
    assert_eq!(w.due(at(600), AFTER), Look::default(), "read once");
    (w, t0)
}

/// Asserts a kick is due at `now`, and passes it the reads before and after the ring.
fn kick(
    w: &SendWatch,
    now: Instant,
    before: Option<u32>,
    after: Option<u32>,
    rung: bool,
) -> Option<Requester> {
    assert!(w.due(now, AFTER).kick.is_some(), "a kick is due");
    w.at_kick(before, after, rung, now)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn a_kick_on_an_unmoved_psn_that_the_ring_does_not_move_finds_the_requester_idle() {
    let (w, t0) = read_at_half(100);
    let at = |n| t0 + ms(n);
    let found = kick(&w, at(1000), Some(100), Some(100), true);
    assert_eq!(
        found,
        Some(Requester::Idle {
            psn: 100,
            idle_for: ms(500)
        })
    );
    // Still idle at the next kick: idle since the first read that saw it so.
    let found = kick(&w, at(2000), Some(100), Some(100), true);
    assert_eq!(
        found,
        Some(Requester::Idle {
            psn: 100,
            idle_for: ms(1500)
        })
    );
}

#[test]
fn a_ring_that_moves_an_idle_psn_restarted_the_requester() {
    let (w, t0) = read_at_half(100);
    let found = kick(&w, t0 + ms(1000), Some(100), Some(140), true);
    assert_eq!(
        found,
        Some(Requester::Restarted {
            idle_for: ms(500),
            within: Duration::ZERO,
            from: 100,
            to: 140,
            by_the_ring: true
        })
    );
    // Across the PSN's wrap too.
    let (w, t0) = read_at_half(0xff_fffe);
    let found = kick(&w, t0 + ms(1000), Some(0xff_fffe), Some(3), true);
    assert!(
        matches!(found, Some(Requester::Restarted { to: 3, .. })),
        "{found:?}"
    );
}

#[test]
fn a_long_write_moves_its_psn_between_reads_and_is_never_idle() {
    let (w, t0) = read_at_half(100);
    let at = |n| t0 + ms(n);
    assert_eq!(kick(&w, at(1000), Some(5000), Some(5010), true), None);
    assert_eq!(
        w.due(at(1500), AFTER),
        Look::default(),
        "the kick's read is the base"
    );
    assert_eq!(kick(&w, at(2000), Some(9000), Some(9000), true), None);
}

#[test]
fn a_post_begun_since_the_base_read_takes_the_credit() {
    let (w, t0) = read_at_half(100);
    // Begun (its doorbell not yet rung) before the kick's first read: its own doorbell or
    // the kick's may move the PSN.
    w.posting();
    assert_eq!(kick(&w, t0 + ms(1000), Some(100), Some(140), true), None);
}

#[test]
fn a_ring_that_failed_restarted_nothing() {
    let (w, t0) = read_at_half(100);
    assert_eq!(kick(&w, t0 + ms(1000), Some(100), Some(140), false), None);
    let (w, t0) = read_at_half(100);
    let found = kick(&w, t0 + ms(1000), Some(100), Some(100), false);
    assert!(matches!(found, Some(Requester::Idle { .. })), "{found:?}");
    assert_eq!(w.due(t0 + ms(1001), AFTER), Look::default(), "no follow-up");
}

#[test]
fn after_a_restart_the_next_stall_is_measured_from_the_restart() {
    // By the ring: the kick's second read is the next base.
    let (w, t0) = read_at_half(100);
    let at = |n| t0 + ms(n);
    let found = kick(&w, at(1000), Some(100), Some(140), true);
    assert!(matches!(found, Some(Requester::Restarted { .. })));
    let found = kick(&w, at(2000), Some(140), Some(140), true);
    assert_eq!(
        found,
        Some(Requester::Idle {
            psn: 140,
            idle_for: ms(1000)
        })
    );
    // By the look after: its read is the next base.
    let (w, t0) = read_at_half(100);
    let at = |n| t0 + ms(n);
    assert!(kick(&w, at(1000), Some(100), Some(100), true).is_some());
    assert!(w.due(at(1001), AFTER).read_psn);
    let found = w.at_read(Some(120), at(1001));
    assert!(matches!(
        found,
        Some(Requester::Restarted {
            by_the_ring: false,
            ..
        })
    ));
    let found = kick(&w, at(2000), Some(120), Some(120), true);
    assert_eq!(
        found,
        Some(Requester::Idle {
            psn: 120,
            idle_for: ms(999)
        })
    );
}

#[test]
fn a_failed_read_after_the_ring_is_asked_again_half_a_wait_later() {
    let (w, t0) = read_at_half(100);
    let at = |n| t0 + ms(n);
    assert_eq!(kick(&w, at(1000), Some(100), None, true), None);
    assert_eq!(w.due(at(1499), AFTER), Look::default());
    assert!(w.due(at(1500), AFTER).read_psn);
    assert_eq!(w.at_read(Some(100), at(1500)), None);
    let found = kick(&w, at(2000), Some(100), Some(100), true);
    assert_eq!(
        found,
        Some(Requester::Idle {
            psn: 100,
            idle_for: ms(500)
        })
    );
}

#[test]
fn a_psn_that_went_back_is_a_retry_not_a_restart() {
    let (w, t0) = read_at_half(100);
    assert_eq!(kick(&w, t0 + ms(1000), Some(100), Some(90), true), None);
}

#[test]
fn one_look_soon_after_an_idle_kick_sees_a_later_restart() {
    let (w, t0) = read_at_half(100);
    let at = |us: u64| t0 + Duration::from_micros(us);
    assert!(w.due(at(1_000_000), AFTER).kick.is_some());
    assert!(w
        .at_kick(Some(100), Some(100), true, at(1_000_000))
        .is_some());
    assert!(!w.due(at(1_000_500), AFTER).read_psn, "not yet");
    assert!(w.due(at(1_001_000), AFTER).read_psn);
    assert_eq!(
        w.at_read(Some(120), at(1_001_000)),
        Some(Requester::Restarted {
            idle_for: ms(500),
            within: ms(1),
            from: 100,
            to: 120,
            by_the_ring: false
        })
    );
    assert!(!w.due(at(1_002_000), AFTER).read_psn, "one look only");
}

#[test]
fn the_look_after_an_idle_kick_reads_once_whatever_it_finds() {
    let (w, t0) = read_at_half(100);
    let at = |n| t0 + ms(n);
    assert!(kick(&w, at(1000), Some(100), Some(100), true).is_some());
    assert!(w.due(at(1001), AFTER).read_psn);
    assert_eq!(w.at_read(Some(100), at(1001)), None, "still idle");
    for n in [1002, 1100, 1999] {
        assert_eq!(w.due(at(n), AFTER), Look::default(), "no read at {n} ms");
    }
    // A failed read also ends it.
    assert!(kick(&w, at(2000), Some(100), Some(100), true).is_some());
    assert!(w.due(at(2001), AFTER).read_psn);
    assert_eq!(w.at_read(None, at(2001)), None);
    assert_eq!(w.due(at(2002), AFTER), Look::default());
}

#[test]
fn a_post_or_completion_before_the_look_after_leaves_nothing_to_tell() {
    let (w, t0) = read_at_half(100);
    let at = |n| t0 + ms(n);
    assert!(kick(&w, at(1000), Some(100), Some(100), true).is_some());
    w.posting();
    assert!(w.due(at(1001), AFTER).read_psn);
    assert_eq!(
        w.at_read(Some(130), at(1001)),
        None,
        "the post ran the requester"
    );

    let (w, t0) = read_at_half(100);
    let at = |n| t0 + ms(n);
    assert!(kick(&w, at(1000), Some(100), Some(100), true).is_some());
    w.completed(1);
    assert_eq!(
        w.due(at(1001), AFTER),
        Look::default(),
        "the counts moved: all anew"
    );
    assert_eq!(w.at_read(Some(130), at(1001)), None);
}

#[test]
fn a_failed_half_wait_read_is_not_retried_before_the_kick() {
    let w = SendWatch::default();
    let t0 = Instant::now();
    w.posted();
    assert_eq!(w.due(t0, AFTER), Look::default());
    assert!(w.due(t0 + ms(500), AFTER).read_psn);
    assert_eq!(w.at_read(None, t0 + ms(500)), None);
    for n in [501, 700, 999] {
        assert_eq!(
            w.due(t0 + ms(n), AFTER),
            Look::default(),
            "no read at {n} ms"
        );
    }
    assert!(w.due(t0 + ms(1000), AFTER).kick.is_some());
    assert_eq!(
        w.at_kick(Some(5), Some(5), true, t0 + ms(1000)),
        None,
        "no base"
    );
    assert!(
        w.due(t0 + ms(1001), AFTER) == Look::default(),
        "nothing to follow up"
    );
}
