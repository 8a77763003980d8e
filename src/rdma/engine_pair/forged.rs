//! Datagrams from strangers: forged acknowledgements, ICRC and all, at the real
//! QP number. From an address other than the QP's peer they are dropped whatever they say;
//! from the peer's address an ACK or NAK whose PSN is not outstanding is a ghost and is
//! ignored. Only an in-range NAK from the peer fails the QP (the control).

use super::*;
use crate::rdma::wire;

/// Before the checks, the first forged NAK (a remote access error from a stranger's
/// address) put the QP in error: one datagram killed a connection.
#[test]
fn forged_acknowledgements_neither_complete_nor_fail_anything() {
    let mut s = Pair::new(41, Faults::default(), attr(1024));
    let mut src = pattern(3, 4096);
    let mut dst = vec![0u8; src.len()];
    let first = 0x00ff_fff0u32; // engine 0's first PSN (see Pair::new)
                                // Engine 0's write leaves but nothing reaches engine 1: it stays outstanding.
    s.cut = true;
    post_write(&mut s, &mut src, &mut dst);
    for _ in 0..20 {
        s.step();
    }
    let fatal = wire::Aeth::nak(0, wire::NakCode::RemoteAccessError);
    let stranger = SocketAddr::from(([10, 0, 0, 9], 50_001));
    let peer = SocketAddr::from((IPS[1], 50_001));
    let rts = |s: &mut Pair| s.eng[0].qp_state(s.qp[0]).unwrap() == QpState::Rts;
    // A stranger's NAK for an outstanding PSN, and its ACK of everything.
    inject_ack(&mut s, stranger, fatal, first);
    inject_ack(
        &mut s,
        stranger,
        wire::Aeth::ack(0),
        (first + 3) & 0x00ff_ffff,
    );
    assert!(rts(&mut s), "a stranger's NAK failed the QP");
    assert_eq!(s.eng[0].stats().wrong_source, 2);
    // From the peer's address: PSNs outside what is outstanding.
    inject_ack(&mut s, peer, fatal, (first + 100) & 0x00ff_ffff);
    inject_ack(&mut s, peer, fatal, (first - 1) & 0x00ff_ffff);
    inject_ack(
        &mut s,
        peer,
        wire::Aeth::ack(0),
        (first + 1000) & 0x00ff_ffff,
    );
    assert!(rts(&mut s), "a ghost NAK failed the QP");
    assert_eq!(s.eng[0].stats().ghost_acks, 3);
    let mut wc = Vec::new();
    s.drain(0, &mut wc);
    assert!(wc.is_empty(), "a ghost ACK completed the write: {wc:?}");
    // The control: the peer's NAK of an outstanding PSN is believed.
    inject_ack(&mut s, peer, fatal, (first + 1) & 0x00ff_ffff);
    assert!(!rts(&mut s));
    s.drain(0, &mut wc);
    assert_eq!(wc[0].status, WcStatus::RemAccessErr);
}

/// QP numbers and first PSNs are not sequential: their random part differs between QPs.
#[test]
fn qp_numbers_are_not_sequential() {
    let mut e = Engine::new(IpAddr::from(IPS[0]), 4791);
    let cq = e.create_cq();
    let gens: Vec<u32> = (0..8)
        .map(|_| e.create_qp(cq, cq, 1).unwrap() >> 12)
        .collect();
    let steps = gens.windows(2).filter(|w| w[1] == w[0] + 1).count();
    assert!(steps < 3, "sequential generations: {gens:?}");
}

/// An engine on every address (a switchless mesh) looks a datagram's QP up before checking
/// it: datagrams too short for a BTH, of every length, are dropped as malformed.
#[test]
fn short_datagrams_to_an_engine_on_every_address_are_dropped() {
    let mut e = Engine::new(IpAddr::from([0u8; 4]), 4791);
    let from = SocketAddr::from((IPS[1], 50_001));
    for len in 0..16 {
        e.handle_datagram(Instant::now(), from, &vec![0x11; len]);
    }
    assert_eq!(e.stats().malformed, 16);
}

/// Duplicate RDMA read requests (PSNs behind the expected one, a valid rkey) by the
/// thousand, as a stranger who guessed a QP number and a key could send: at most a few are
/// queued and executed again (executing every one would send 4 KiB for each, 4000
/// responses); the rest are dropped and counted.
#[test]
fn duplicate_reads_are_not_queued_without_bound() {
    let mut s = Pair::new(43, Faults::default(), attr(1024));
    let mut mem = pattern(5, 4096);
    let rkey = s.reg(1, &mut mem, Access::ALL);
    let peer = SocketAddr::from((IPS[0], 50_000));
    let epsn = 0x00ff_fff0u32; // engine 1's first expected PSN: engine 0's first (Pair::new)
    let before = s.eng[1].stats().tx_packets;
    for k in 1..=1000u32 {
        let p = wire::Packet {
            bth: wire::Bth {
                opcode: wire::Opcode::ReadRequest,
                solicited: false,
                mig_req: false,
                pad: 0,
                pkey: wire::DEFAULT_PKEY,
                fecn: false,
                becn: false,
                dest_qp: s.qp[1],
                ack_req: true,
                psn: epsn.wrapping_sub(k) & 0x00ff_ffff,
            },
            reth: Some(wire::Reth {
                va: mem.as_ptr() as u64,
                rkey,
                dma_len: 4096,
            }),
            imm: None,
            aeth: None,
            payload: &[],
        };
        inject(&mut s, 1, peer, &p);
    }
    for _ in 0..200 {
        s.step();
    }
    let sent = s.eng[1].stats().tx_packets - before;
    let dups = s.eng[1].stats().duplicates;
    assert_eq!(dups, 1000, "the requests were not taken as duplicates");
    assert!(
        sent <= 16 * 4 + 8,
        "{sent} packets sent for 1000 duplicate reads"
    );
    assert!(s.eng[1].stats().duplicate_reads_dropped >= 1000 - 16);
}
