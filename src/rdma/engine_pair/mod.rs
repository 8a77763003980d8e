//! Tests of the RC engine: two engines over a simulated link that drops, duplicates,
//! reorders and corrupts datagrams, in virtual time (the harness: `harness.rs`).

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crate::rdma::engine::*;
use crate::rdma::mem::Access;
use harness::*;

mod harness;
#[test]
fn clean_link_delivers_everything() {
    let st = lossy_workload(1, Faults::default());
    assert_eq!(st.retransmits, 0);
    assert_eq!(st.icrc_errors, 0);
}

#[test]
fn lossy_links_deliver_everything_exactly_once() {
    for (seed, p) in [(7u64, 0.01), (11, 0.05), (13, 0.10)] {
        let f = Faults {
            drop: p,
            dup: p,
            reorder: p,
            corrupt: p,
        };
        let st = lossy_workload(seed, f);
        assert!(
            st.retransmits > 0,
            "p={p}: the link lost packets but nothing was retransmitted"
        );
        assert!(
            st.icrc_errors > 0,
            "p={p}: corrupted packets must fail the ICRC"
        );
        assert!(
            st.duplicates > 0 || p < 0.02,
            "p={p}: duplicates must be seen and dropped"
        );
    }
}

/// The engine's own reports go only to a peer that is this engine (selective mode, agreed at
/// setup), and only in the manufacturers' opcode space: a NIC peer (IB mode) sees IBTA's
/// packets alone, and no acknowledgement ever carries a reserved syndrome.
#[test]
fn reports_go_only_to_an_engine_and_in_the_vendor_opcode() {
    let lossy = Faults {
        drop: 0.05,
        dup: 0.05,
        reorder: 0.05,
        corrupt: 0.0,
    };
    let (_, _, to_engine) = lossy_workload_tally(17, lossy, provider_attr());
    assert!(
        to_engine.reports > 0,
        "{to_engine:?}: a lossy link must show reports"
    );
    assert_eq!(to_engine.reserved_acks, 0, "{to_engine:?}");
    let ibta = QpAttr {
        retry_for: Some(Duration::from_secs(30)),
        ..attr(1024)
    };
    let (_, _, to_nic) = lossy_workload_tally(17, lossy, ibta);
    assert_eq!(to_nic.reports, 0, "{to_nic:?}: reports sent to a NIC");
    assert_eq!(to_nic.reserved_acks, 0, "{to_nic:?}");
}

#[test]
fn dead_link_exhausts_retries() {
    let mut s = Pair::new(
        3,
        Faults::default(),
        QpAttr {
            retry_cnt: 3,
            ..attr(4096)
        },
    );
    let mut buf = vec![1u8; 100];
    let k = s.reg(0, &mut buf, Access::LOCAL_WRITE);
    s.cut = true;
    let sge = Some(Sge {
        addr: buf.as_ptr() as u64,
        len: 100,
        lkey: k,
    });
    for id in 0..3 {
        let wr = SendWr {
            wr_id: id,
            opcode: WrOpcode::Write,
            sge,
            inline: false,
            imm: 0,
            remote_addr: 0x1000,
            rkey: 7,
            signaled: true,
        };
        s.eng[0].post_send(s.qp[0], &wr).unwrap();
    }
    let mut a = Vec::new();
    s.run_until(|s| {
        s.drain(0, &mut a);
        a.len() == 3
    });
    assert_eq!(a[0].status, WcStatus::RetryExcErr);
    assert_eq!(a[1].status, WcStatus::WrFlushErr);
    assert_eq!(a[2].status, WcStatus::WrFlushErr);
    assert_eq!(s.eng[0].qp_state(s.qp[0]).unwrap(), QpState::Error);
    // 1 + 3 tries of ~1 ms each (timeout code 8: 4.096 µs × 2^8).
    assert!(s.t >= 4 * 1000 && s.t < 20_000, "gave up after {} µs", s.t);
    // New work on an ERROR QP is flushed.
    let wr = SendWr {
        wr_id: 9,
        opcode: WrOpcode::Write,
        sge,
        inline: false,
        imm: 0,
        remote_addr: 0,
        rkey: 0,
        signaled: false,
    };
    s.eng[0].post_send(s.qp[0], &wr).unwrap();
    s.drain(0, &mut a);
    assert_eq!(
        a.last().map(|w| (w.wr_id, w.status)),
        Some((9, WcStatus::WrFlushErr))
    );
}

#[test]
fn rkey_bounds_and_rights_are_enforced() {
    // (rkey ok, offset, len, access granted, opcode)
    let cases: [(bool, usize, u32, Access, WrOpcode); 4] = [
        (false, 0, 10, Access::ALL, WrOpcode::Write),
        (true, 60, 10, Access::ALL, WrOpcode::Write), // past the end
        (true, 0, 10, Access::LOCAL_WRITE, WrOpcode::Write), // no remote write
        (
            true,
            0,
            10,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            WrOpcode::Read,
        ), // no remote read
    ];
    for (good_key, off, len, access, op) in cases {
        let mut s = Pair::new(5, Faults::default(), attr(1024));
        let mut local = vec![5u8; 64];
        let mut remote = vec![0u8; 64];
        let lk = s.reg(0, &mut local, Access::LOCAL_WRITE);
        let rk = s.reg(1, &mut remote, access);
        let wr = SendWr {
            wr_id: 1,
            opcode: op,
            sge: Some(Sge {
                addr: local.as_ptr() as u64,
                len,
                lkey: lk,
            }),
            inline: false,
            imm: 0,
            remote_addr: remote.as_ptr() as u64 + off as u64,
            rkey: if good_key { rk } else { rk ^ 0x100 },
            signaled: true,
        };
        s.eng[0].post_send(s.qp[0], &wr).unwrap();
        let mut a = Vec::new();
        s.run_until(|s| {
            s.drain(0, &mut a);
            !a.is_empty()
        });
        assert_eq!(
            a[0].status,
            WcStatus::RemAccessErr,
            "case key={good_key} off={off} {op:?}"
        );
        assert!(remote.iter().all(|b| *b == 0), "nothing may be written");
        assert_eq!(s.eng[0].qp_state(s.qp[0]).unwrap(), QpState::Error);
    }
}

#[test]
fn receiver_not_ready() {
    // No receive ever posted: RNR retries run out.
    let mut s = Pair::new(
        9,
        Faults::default(),
        QpAttr {
            rnr_retry: 2,
            ..attr(1024)
        },
    );
    let mut buf = vec![1u8; 10];
    let k = s.reg(0, &mut buf, Access::LOCAL_WRITE);
    let wr = SendWr {
        wr_id: 4,
        opcode: WrOpcode::Send,
        sge: Some(Sge {
            addr: buf.as_ptr() as u64,
            len: 10,
            lkey: k,
        }),
        inline: false,
        imm: 0,
        remote_addr: 0,
        rkey: 0,
        signaled: true,
    };
    s.eng[0].post_send(s.qp[0], &wr).unwrap();
    let mut a = Vec::new();
    s.run_until(|s| {
        s.drain(0, &mut a);
        !a.is_empty()
    });
    assert_eq!(a[0].status, WcStatus::RnrRetryExcErr);
    assert!(s.eng[1].stats().rnr_naks_sent >= 3);

    // A receive posted late: the RNR NAKs hold the send until it is there.
    let mut s = Pair::new(10, Faults::default(), attr(1024));
    let mut buf = vec![7u8; 3000];
    let mut rbuf = vec![0u8; 3000];
    let k = s.reg(0, &mut buf, Access::LOCAL_WRITE);
    let rk = s.reg(1, &mut rbuf, Access::LOCAL_WRITE);
    let wr = SendWr {
        wr_id: 5,
        opcode: WrOpcode::Send,
        sge: Some(Sge {
            addr: buf.as_ptr() as u64,
            len: 3000,
            lkey: k,
        }),
        inline: false,
        imm: 0,
        remote_addr: 0,
        rkey: 0,
        signaled: true,
    };
    s.eng[0].post_send(s.qp[0], &wr).unwrap();
    for _ in 0..200 {
        s.step();
    }
    assert!(s.eng[1].stats().rnr_naks_sent >= 1);
    let sge = Some(Sge {
        addr: rbuf.as_ptr() as u64,
        len: 3000,
        lkey: rk,
    });
    s.eng[1]
        .post_recv(s.qp[1], &RecvWr { wr_id: 6, sge })
        .unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    s.run_until(|s| {
        s.drain(0, &mut a);
        s.drain(1, &mut b);
        !a.is_empty() && !b.is_empty()
    });
    assert_eq!(a[0].status, WcStatus::Success);
    assert_eq!((b[0].wr_id, b[0].byte_len), (6, 3000));
    assert_eq!(rbuf, buf);
}

#[test]
fn too_long_send_is_a_length_error() {
    let mut s = Pair::new(12, Faults::default(), attr(256));
    let mut buf = vec![1u8; 1000];
    let mut rbuf = vec![0u8; 300];
    let k = s.reg(0, &mut buf, Access::LOCAL_WRITE);
    let rk = s.reg(1, &mut rbuf, Access::LOCAL_WRITE);
    s.eng[1]
        .post_recv(
            s.qp[1],
            &RecvWr {
                wr_id: 1,
                sge: Some(Sge {
                    addr: rbuf.as_ptr() as u64,
                    len: 300,
                    lkey: rk,
                }),
            },
        )
        .unwrap();
    let wr = SendWr {
        wr_id: 2,
        opcode: WrOpcode::Send,
        sge: Some(Sge {
            addr: buf.as_ptr() as u64,
            len: 1000,
            lkey: k,
        }),
        inline: false,
        imm: 0,
        remote_addr: 0,
        rkey: 0,
        signaled: true,
    };
    s.eng[0].post_send(s.qp[0], &wr).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    s.run_until(|s| {
        s.drain(0, &mut a);
        s.drain(1, &mut b);
        !a.is_empty() && !b.is_empty()
    });
    assert_eq!(b[0].status, WcStatus::LocLenErr);
    assert_eq!(a[0].status, WcStatus::RemInvReqErr);
}

#[test]
fn qp_transitions_are_checked() {
    let mut e = Engine::new(IpAddr::from([127, 0, 0, 1]), 4791);
    let cq = e.create_cq();
    let q = e.create_qp(cq, cq, 1).unwrap();
    let a = attr(1024);
    assert!(
        e.modify_qp(q, QpState::Rts, &a).is_err(),
        "RESET -> RTS skips states"
    );
    e.modify_qp(q, QpState::Init, &a).unwrap();
    assert!(
        e.modify_qp(q, QpState::Rtr, &QpAttr { mtu: 1000, ..a })
            .is_err(),
        "MTU 1000"
    );
    let wr = SendWr {
        wr_id: 0,
        opcode: WrOpcode::Send,
        sge: None,
        inline: false,
        imm: 0,
        remote_addr: 0,
        rkey: 0,
        signaled: true,
    };
    assert!(e.post_send(q, &wr).is_err(), "post_send before RTS");
    e.modify_qp(q, QpState::Rtr, &a).unwrap();
    e.modify_qp(q, QpState::Rts, &a).unwrap();
    e.modify_qp(q, QpState::Reset, &a).unwrap();
    assert_eq!(e.qp_state(q).unwrap(), QpState::Reset);
    assert!(e.post_send(q, &wr).is_err());
}

/// Long messages (hundreds of packets, several windows) through a lossy link keep moving:
/// recovery comes from NAKs, not from the retransmission timer.
#[test]
fn long_messages_recover_by_nak() {
    let f = Faults {
        drop: 0.02,
        dup: 0.02,
        reorder: 0.02,
        corrupt: 0.02,
    };
    let mut s = Pair::new(21, f, attr(1024));
    let len = 800_000usize;
    let mut src = pattern(3, len);
    let mut dst = vec![0u8; len];
    let k = s.reg(0, &mut src, Access::LOCAL_WRITE);
    let rk = s.reg(1, &mut dst, Access::ALL);
    for i in 0..4u64 {
        s.eng[1]
            .post_recv(
                s.qp[1],
                &RecvWr {
                    wr_id: i,
                    sge: None,
                },
            )
            .unwrap();
        let wr = SendWr {
            wr_id: i,
            opcode: WrOpcode::WriteImm,
            sge: Some(Sge {
                addr: src.as_ptr() as u64,
                len: len as u32,
                lkey: k,
            }),
            inline: false,
            imm: i as u32,
            remote_addr: dst.as_ptr() as u64,
            rkey: rk,
            signaled: true,
        };
        s.eng[0].post_send(s.qp[0], &wr).unwrap();
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    s.run_until(|s| {
        s.drain(0, &mut a);
        s.drain(1, &mut b);
        a.len() == 4 && b.len() == 4
    });
    assert!(a.iter().all(|w| w.status == WcStatus::Success), "{a:?}");
    assert_eq!(dst, src);
    // 4 × 782 packets at 2% loss: about 60 losses. Each timeout costs ~1 ms of virtual time
    // (timeout code 8); NAK recovery costs a round trip (~10 µs).
    eprintln!(
        "virtual time {} µs, stats {:?} {:?}",
        s.t,
        s.eng[0].stats(),
        s.eng[1].stats()
    );
    assert!(s.t < 60_000, "recovery relied on timeouts: {} µs", s.t);
}

#[test]
fn an_engine_on_every_address_uses_each_queue_pairs_own() {
    // A switchless mesh: the engine listens on every address, each QP is reached at (and
    // sends from) its address on the cable to its peer, and the ICRC covers that address.
    let mut s = Pair::build(3, Faults::default(), attr(1024), Some(true));
    let mut src = pattern(1, 10_000);
    let mut dst = vec![0u8; 10_000];
    write_through(&mut s, &mut src, &mut dst);
    assert_eq!(
        s.eng[0].stats().icrc_errors + s.eng[1].stats().icrc_errors,
        0
    );
    // Without its address a QP's packets carry an ICRC over 0.0.0.0, which the peer
    // (checking with its own address) drops: nothing arrives.
    let mut s = Pair::build(3, Faults::default(), attr(1024), Some(false));
    let mut dst = vec![0u8; 10_000];
    post_write(&mut s, &mut src, &mut dst);
    for _ in 0..50 {
        s.step();
    }
    assert!(s.eng[1].stats().icrc_errors > 0);
    assert!(dst.iter().all(|&b| b == 0));
}

/// A sequence-error NAK that acknowledges progress gives the requester
/// its retries back, as an ACK does. With one retry: a timeout uses it, a NAK acknowledges
/// half the message, the next timeout must retransmit rather than fail.
#[test]
fn a_nak_that_acknowledges_progress_resets_the_retry_count() {
    let mut s = Pair::new(
        31,
        Faults::default(),
        QpAttr {
            retry_cnt: 1,
            ..attr(1024)
        },
    );
    let mut src = pattern(5, 10 * 1024);
    let mut dst = vec![0u8; src.len()];
    let first = 0x00ff_fff0u32; // engine 0's first PSN (see Pair::new)
                                // The responder gets the first 5 packets; the rest and its ACKs are lost.
    s.drop_psn_from = Some((first + 5) & 0x00ff_ffff);
    s.drop_acks = true;
    post_write(&mut s, &mut src, &mut dst);
    // Until the first timeout has used the one retry.
    while s.eng[0].stats().retransmits == 0 {
        s.step();
    }
    // The responder's NAK for PSN first+5 (as it sends on a later packet) acknowledges
    // the first 5; the retransmission it starts is lost too.
    inject_nak(&mut s, (first + 5) & 0x00ff_ffff);
    s.step();
    // The link heals before the next timeout: with the count reset that timeout
    // retransmits instead of failing the request.
    s.drop_psn_from = None;
    s.drop_acks = false;
    let mut a = Vec::new();
    s.run_until(|s| {
        s.drain(0, &mut a);
        !a.is_empty()
    });
    assert_eq!(a[0].status, WcStatus::Success, "{a:?}");
    assert_eq!(dst, src);
}

/// With a deadline instead of a retry count, a QP rides out a link that
/// drops everything for a second (the retransmission timer backs off meanwhile) and fails
/// only when the deadline passes without progress.
#[test]
fn a_deadline_rides_out_a_one_second_outage() {
    let cfg = QpAttr {
        retry_cnt: 7,
        retry_for: Some(Duration::from_secs(3)),
        ..attr(1024) // timeout code 8: ~1 ms
    };
    let mut s = Pair::new(33, Faults::default(), cfg);
    let mut src = pattern(9, 20_000);
    let mut dst = vec![0u8; src.len()];
    s.cut = true;
    post_write(&mut s, &mut src, &mut dst);
    let mut a = Vec::new();
    s.run_until(|s| {
        if s.t >= 1_000_000 {
            s.cut = false;
        }
        s.drain(0, &mut a);
        !a.is_empty()
    });
    assert_eq!(a[0].status, WcStatus::Success, "{a:?}");
    assert_eq!(dst, src);
    // Back within the backoff cap of the link's return.
    assert!(
        s.t >= 1_000_000 && s.t < 1_000_000 + 2 * MAX_BACKOFF.as_micros() as u64,
        "completed at {} µs",
        s.t
    );
    // Backoff: far fewer retransmission rounds than 1 s / 1 ms.
    let rounds = s.eng[0].stats().retransmits / 20;
    assert!(
        rounds < 100,
        "{} retransmissions",
        s.eng[0].stats().retransmits
    );

    // A link that stays dead fails the request once the deadline passes without progress.
    let cfg = QpAttr {
        retry_for: Some(Duration::from_millis(700)),
        ..cfg
    };
    let mut s = Pair::new(35, Faults::default(), cfg);
    s.cut = true;
    post_write(&mut s, &mut src, &mut dst);
    let mut a = Vec::new();
    s.run_until(|s| {
        s.drain(0, &mut a);
        !a.is_empty()
    });
    assert_eq!(a[0].status, WcStatus::RetryExcErr);
    assert!(
        s.t >= 700_000 && s.t < 700_000 + 2 * MAX_BACKOFF.as_micros() as u64,
        "gave up at {} µs",
        s.t
    );
}

/// Closing a QP keeps delivering what was posted on it (a send its
/// owner was told is done) until the peer acknowledges it, here after the first
/// transmission was lost; the closed QP then goes quiet and can be freed.
#[test]
fn a_closed_queue_pair_delivers_what_was_posted() {
    let mut s = Pair::new(
        37,
        Faults::default(),
        QpAttr {
            retry_for: Some(Duration::from_secs(1)),
            ..attr(1024)
        },
    );
    let mut src = pattern(11, 3000);
    let mut dst = vec![0u8; src.len()];
    s.cut = true;
    post_write(&mut s, &mut src, &mut dst);
    s.step(); // sent, and lost
    let now = s.now();
    s.eng[0].close_qp(s.qp[0], now).unwrap();
    s.cut = false;
    let quiet = Duration::from_millis(50);
    s.run_until(|s| {
        let now = s.now();
        s.eng[0].closed_and_quiet(s.qp[0], now, quiet)
    });
    assert!(
        dst == src,
        "the write posted before the close was not delivered"
    );
    assert!(s.eng[0].stats().retransmits > 0);
}

/// With the responder keeping out-of-order packets, a requester that
/// resends only what was lost (`selective`) delivers everything exactly once, and a long
/// message through a lossy link costs far fewer retransmissions than going back N.
#[test]
fn selective_retransmission_resends_only_what_was_lost() {
    let sel_attr = |mtu| QpAttr {
        selective: true,
        ..attr(mtu)
    };
    for (seed, p) in [(7u64, 0.01), (11, 0.05), (13, 0.10)] {
        let f = Faults {
            drop: p,
            dup: p,
            reorder: p,
            corrupt: p,
        };
        let (st, t) = lossy_workload_with(seed, f, sel_attr(1024));
        eprintln!("p={p}: selective: {t} µs, {st:?}");
        assert!(st.retransmits > 0 && st.icrc_errors > 0, "p={p}: {st:?}");
    }
    let f = Faults {
        drop: 0.05,
        dup: 0.05,
        reorder: 0.05,
        corrupt: 0.05,
    };
    let run = |a: QpAttr| {
        let mut s = Pair::new(23, f, a);
        let len = 2_000_000usize;
        let mut src = pattern(4, len);
        let mut dst = vec![0u8; len];
        write_through(&mut s, &mut src, &mut dst);
        (s.eng[0].stats(), s.t)
    };
    let (gbn, t_gbn) = run(attr(4096));
    let (sel, t_sel) = run(sel_attr(4096));
    eprintln!("2 MB at 5%: go-back-N {t_gbn} µs {gbn:?}\n  selective {t_sel} µs {sel:?}");
    // 489 packets, ~10% of them lost or corrupted.
    assert!(
        sel.retransmits * 2 < gbn.retransmits,
        "selective resent {} packets, go-back-N {}",
        sel.retransmits,
        gbn.retransmits
    );
    assert!(
        t_sel <= t_gbn,
        "selective took {t_sel} µs, go-back-N {t_gbn} µs"
    );
}

/// A lost last packet (nothing after it makes the responder NAK) is resent by the
/// tail-loss probe after about two round trips, not after the retransmission timer
/// (at least `RTO_MIN`).
#[test]
fn a_lost_last_packet_is_probed_within_round_trips() {
    let (clean, _) = timed_write(32 << 10, &[], 0);
    let (lossy, resent) = timed_write(32 << 10, &[7], 0);
    eprintln!("32 KiB: clean {clean} µs, last packet lost {lossy} µs ({resent} resent)");
    assert!(resent >= 1);
    assert!(
        lossy < clean + RTO_MIN.as_micros() as u64 / 3,
        "the lost last packet cost {} µs (clean {clean} µs)",
        lossy - clean
    );
}

/// Several holes in one window are reported at once (hole reports), so they cost about one
/// round trip together rather than one each, one after the other.
#[test]
fn the_holes_of_a_window_are_resent_together() {
    let (clean, _) = timed_write(1 << 20, &[], 0);
    let holes = [20, 60, 100, 140, 180, 220];
    let (lossy, resent) = timed_write(1 << 20, &holes, 0);
    eprintln!("1 MiB: clean {clean} µs, 6 holes {lossy} µs ({resent} resent)");
    assert_eq!(
        resent,
        holes.len() as u64,
        "only the lost packets are resent"
    );
    // One hole after another would cost six round trips of ≥ 10 µs plus the time a
    // resend waits behind the packets queued before it.
    assert!(
        lossy <= clean + 25,
        "6 holes cost {} µs (clean {clean} µs)",
        lossy - clean
    );
}

/// After going back N, the responder acknowledges the packets it had kept, which can
/// overtake the resend cursor inside a long message: the requester continues from the
/// acknowledged point at once instead of waiting for a second timeout.
#[test]
fn acknowledgements_that_overtake_the_cursor_do_not_stall_it() {
    // 1024 packets; packet 10 lost, and every answer lost for 3 ms so the timer fires.
    const MUTE: u64 = 3_000;
    let (t, _) = timed_write(4 << 20, &[10], MUTE);
    let (clean, _) = timed_write(4 << 20, &[], 0);
    eprintln!("4 MiB, muted {MUTE} µs: {t} µs (clean {clean} µs)");
    // The timer fires once, during the time without answers; a second timeout would add
    // at least another RTO_MIN after it (5.4 ms with the cursor moved on, 8.4 ms without).
    assert!(
        t < clean + MUTE + RTO_MIN.as_micros() as u64 / 2,
        "{t} µs: a second timeout (clean {clean} µs)"
    );
}

/// Not a test: prints the virtual time of writes through a lossy link of 2 GB/s and 5 µs
/// against the same link without faults (`cargo test --release --lib loss_cost -- --ignored
/// --nocapture`), for tuning the loss recovery.
#[test]
#[ignore]
fn loss_cost() {
    let a = QpAttr {
        selective: true,
        retry_for: Some(Duration::from_secs(30)),
        timeout: 12,
        ..attr(4096)
    };
    let lens: Vec<usize> = std::env::var("LENS")
        .map_or(vec![32 << 10, 256 << 10, 2 << 20, 16 << 20], |v| {
            v.split(',').map(|x| x.parse().unwrap()).collect()
        });
    for len in lens {
        let mut line = format!("{len:>9} B:");
        let mut base = 0;
        let ps: Vec<f64> = std::env::var("PS").map_or(vec![0.0, 0.01, 0.05, 0.10], |v| {
            v.split(',').map(|x| x.parse().unwrap()).collect()
        });
        for p in ps {
            let f = Faults {
                drop: p,
                dup: p,
                reorder: p,
                corrupt: p,
            };
            let mut total = 0;
            let mut retrans = 0;
            let mut timeouts = 0;
            let mut probes = 0;
            let reps = std::env::var("REPS")
                .map_or(if len > 4 << 20 { 3 } else { 20 }, |v| v.parse().unwrap());
            for r in 0..reps {
                let mut s = Pair::new(100 + r, Faults::default(), a);
                s.bytes_per_us = 2000;
                // A running QP has measured its round trip: one clean write first.
                write_through(&mut s, &mut [7u8; 64], &mut [0u8; 64]);
                s.faults = f;
                let t0 = s.t;
                let mut src = pattern(4, len);
                let mut dst = vec![0u8; len];
                write_through(&mut s, &mut src, &mut dst);
                total += s.t - t0;
                retrans += s.eng[0].stats().retransmits;
                timeouts += s.eng[0].stats().timeouts;
                probes += s.eng[0].stats().tail_probes;
            }
            if p == 0.0 {
                base = total;
            }
            line += &format!(
                "  p={p}: {} µs ({:.2}x, {} resent, {} rto, {} tlp)",
                total / reps,
                total as f64 / base as f64,
                retrans / reps,
                timeouts,
                probes
            );
        }
        eprintln!("{line}");
    }
}

mod spurious;

mod forged;
