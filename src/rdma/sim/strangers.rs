//! Datagrams from strangers (issue 22): forged acknowledgements, ICRC and all, at the real
//! QP number. From an address other than the QP's peer they are dropped whatever they say;
//! from the peer's address an ACK or NAK whose PSN is not outstanding is a ghost and is
//! ignored. Only an in-range NAK from the peer fails the QP (the control).

use super::*;
use crate::rdma::wire;

/// Before the checks, the first forged NAK (a remote access error from a stranger's
/// address) put the QP in error: one datagram killed a connection.
#[test]
fn forged_acknowledgements_neither_complete_nor_fail_anything() {
    let mut s = Sim::new(41, Faults::default(), attr(1024));
    let mut src = pattern(3, 4096);
    let mut dst = vec![0u8; src.len()];
    let first = 0x00ff_fff0u32; // engine 0's first PSN (see Sim::new)
                                // Engine 0's write leaves but nothing reaches engine 1: it stays outstanding.
    s.cut = true;
    post_write(&mut s, &mut src, &mut dst);
    for _ in 0..20 {
        s.step();
    }
    let fatal = wire::Aeth::nak(0, wire::NakCode::RemoteAccessError);
    let stranger = SocketAddr::from(([10, 0, 0, 9], 50_001));
    let peer = SocketAddr::from((IPS[1], 50_001));
    let rts = |s: &mut Sim| s.eng[0].qp_state(s.qp[0]).unwrap() == QpState::Rts;
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
