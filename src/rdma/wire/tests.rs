use super::*;
use std::net::{Ipv4Addr, Ipv6Addr};

fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn ip4(src: [u8; 4], dst: [u8; 4], src_port: u16, dst_port: u16) -> IpInfo {
    IpInfo {
        src: IpAddr::V4(Ipv4Addr::from(src)),
        dst: IpAddr::V4(Ipv4Addr::from(dst)),
        src_port,
        dst_port,
    }
}

fn ip6(src: &str, dst: &str, src_port: u16, dst_port: u16) -> IpInfo {
    IpInfo {
        src: IpAddr::V6(src.parse::<Ipv6Addr>().unwrap()),
        dst: IpAddr::V6(dst.parse::<Ipv6Addr>().unwrap()),
        src_port,
        dst_port,
    }
}

fn bth(opcode: Opcode, dest_qp: u32, psn: u32) -> Bth {
    Bth {
        opcode,
        solicited: false,
        mig_req: false,
        pad: 0,
        pkey: DEFAULT_PKEY,
        fecn: false,
        becn: false,
        dest_qp,
        ack_req: false,
        psn,
    }
}

/// A packet with the extension headers `op` calls for.
fn packet(op: Opcode, payload: &[u8], i: u32) -> Packet<'_> {
    let mut b = bth(op, 0x00ab_cd00 ^ i, (0x00ff_fff0 + i) & MASK24);
    b.solicited = i % 2 == 0;
    b.mig_req = i % 3 == 0;
    b.fecn = i % 5 == 0;
    b.becn = i % 7 == 0;
    b.ack_req = i % 2 == 1;
    b.pkey = 0x8000 | i as u16;
    b.pad = pad_len(payload.len()) as u8;
    Packet {
        bth: b,
        reth: op.has_reth().then_some(Reth {
            va: 0x0123_4567_89ab_cdef ^ u64::from(i),
            rkey: 0xfeed_0000 | i,
            dma_len: 1 << 20,
        }),
        imm: op.has_imm().then_some(0xa5a5_0000 | i),
        aeth: op
            .has_aeth()
            .then_some(Aeth::nak(i, NakCode::RemoteAccessError)),
        payload,
    }
}

#[test]
fn gso_segments_carry_their_ipv4_id_in_the_icrc_alone() {
    let ip = ip4([10, 0, 0, 1], [10, 0, 0, 2], 49152, ROCEV2_PORT);
    let payload: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let p = packet(Opcode::WriteMiddle, &payload, 3);
    let mut zero = vec![0u8; 4200];
    let n = encode(&p, &ip, &mut zero).unwrap();
    assert_eq!(zero[4] & 0x3f, 0, "reserved bits are sent as zero");
    for seg in [1u8, 2, 17, 63] {
        let mut b = vec![0u8; 4200];
        assert_eq!(encode_segment(&p, &ip, seg, &mut b).unwrap(), n);
        // Same packet, reserved bits zero, ICRC over IPv4 id `seg`.
        assert_eq!(b[..n - 4], zero[..n - 4]);
        let crc = u32::from_le_bytes(b[n - 4..n].try_into().unwrap());
        assert_eq!(crc, icrc_ipv4_id(&ip, u16::from(seg), IPV4_DF, &b[..n - 4]));
        assert_ne!(crc, icrc(&ip, &b[..n - 4]));
        let d = decode(&b[..n], &ip, true).unwrap();
        assert_eq!(d.payload, &payload[..]);
        assert_eq!(d.bth, p.bth);
        assert_eq!(
            segment_of(&ip, n - 4, crc ^ icrc(&ip, &b[..n - 4])),
            Some(u16::from(seg))
        );
        // Any flipped bit (in the payload or in the ICRC) is still caught.
        for bit in [0, 8 * 20 + 3, 8 * (n - 5), 8 * (n - 1) + 7] {
            let mut bad = b.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(
                matches!(
                    decode(&bad[..n], &ip, true),
                    Err(DecodeError::BadIcrc { .. })
                ),
                "segment {seg}, bit {bit}"
            );
        }
        // Resealed for position 0: identical to a packet sent on its own.
        super::reseal(&mut b[..n], &ip, 0).unwrap();
        assert_eq!(b[..n], zero[..n]);
        super::reseal(&mut b[..n], &ip, seg).unwrap();
        assert!(decode(&b[..n], &ip, true).is_ok());
    }
    // Identifications of 64 and above are not taken (no GSO send is that long).
    let mut b = zero.clone();
    let crc = icrc_ipv4_id(&ip, 64, IPV4_DF, &b[..n - 4]);
    b[n - 4..n].copy_from_slice(&crc.to_le_bytes());
    assert!(decode(&b[..n], &ip, true).is_err());
    // Packets of other lengths, interleaved, each find their own table.
    for len in [0usize, 1, 100, 1500, 4096, 9000] {
        let body = vec![0x5au8; len];
        let p = packet(Opcode::SendOnly, &body, 9);
        let mut b = vec![0u8; 9200];
        let n = encode_segment(&p, &ip, 5, &mut b).unwrap();
        assert_eq!(decode(&b[..n], &ip, true).unwrap().payload, &body[..]);
    }
    assert!(encode_segment(&p, &ip, MAX_SEGMENTS as u8, &mut zero).is_err());
    assert!(super::reseal(&mut zero[..n], &ip, 64).is_err());
    assert!(super::reseal(&mut zero[..8], &ip, 1).is_err());
    // IPv6 has no identification: the index changes nothing.
    let ip = ip6("fd00::1", "fd00::2", 49152, ROCEV2_PORT);
    let mut a = vec![0u8; 4200];
    let mut b = vec![0u8; 4200];
    encode(&p, &ip, &mut a).unwrap();
    encode_segment(&p, &ip, 5, &mut b).unwrap();
    assert_eq!(a[..n], b[..n]);
    assert!(decode(&b[..n], &ip, true).is_ok());
}

#[test]
fn opcode_table() {
    for (i, op) in Opcode::ALL.iter().enumerate() {
        assert_eq!(*op as usize, i);
        assert_eq!(Opcode::from_u8(i as u8), Some(*op));
        let kinds = [op.is_send(), op.is_write(), op.is_read_response()];
        assert!(kinds.iter().filter(|k| **k).count() <= 1, "{op}");
        let pos = [op.is_first(), op.is_middle(), op.is_last(), op.is_only()];
        let n = pos.iter().filter(|k| **k).count();
        assert_eq!(n, usize::from(kinds.contains(&true)), "{op}");
        assert!(!(op.has_aeth() && (op.has_imm() || op.has_reth())), "{op}");
    }
    assert_eq!(Opcode::from_u8(0x15), None);
    assert_eq!(Opcode::from_u8(0x81), None);
    assert_eq!(Opcode::from_u8(0x24), None);
    assert_eq!(
        Opcode::WriteOnlyImm.name(),
        "RDMA WRITE ONLY WITH IMMEDIATE"
    );
    assert!(Opcode::SendOnlyImm.is_send() && Opcode::SendOnlyImm.is_only());
    assert!(Opcode::ReadRespMiddle.is_read_response() && Opcode::ReadRespMiddle.is_middle());
    assert!(!Opcode::ReadRequest.is_only() && !Opcode::ReadRequest.is_write());
    assert_eq!(header_len(Opcode::WriteOnlyImm), 32);
    assert_eq!(header_len(Opcode::ReadRespMiddle), 12);
    assert_eq!(header_len(Opcode::Ack), 16);
    assert_eq!(wire_len(Opcode::SendOnly, 5), 12 + 8 + 4);
    assert_eq!(wire_len(Opcode::SendOnly, 0), 16);
}

#[test]
fn aeth_syndromes() {
    assert_eq!(Aeth::ack(7).kind(), Some(AckKind::Ack { credits: 0x1f }));
    assert_eq!(Aeth::ack(0x0100_0005).msn, 5);
    assert_eq!(Aeth::rnr_nak(1, 14).syndrome, 0x2e);
    assert_eq!(
        Aeth::rnr_nak(1, 14).kind(),
        Some(AckKind::RnrNak { timer: 14 })
    );
    for code in [
        NakCode::PsnSequenceError,
        NakCode::InvalidRequest,
        NakCode::RemoteAccessError,
        NakCode::RemoteOperationalError,
    ] {
        let a = Aeth::nak(3, code);
        assert_eq!(a.syndrome, 0x60 | code as u8);
        assert_eq!(a.kind(), Some(AckKind::Nak(code)));
    }
    for reserved in [0x40, 0x64, 0x7f, 0x80, 0xe0] {
        let a = Aeth {
            syndrome: reserved,
            msn: 0,
        };
        assert_eq!(a.kind(), None, "{reserved:#x}");
    }
}

#[test]
fn round_trip_every_opcode() {
    let data: Vec<u8> = (0..=255u8).collect();
    let ips = [
        ip4([10, 0, 0, 1], [10, 0, 0, 2], 49152, ROCEV2_PORT),
        ip6("fd00::1", "fd00::2", 50000, ROCEV2_PORT),
    ];
    let mut buf = [0xeeu8; 512];
    let mut i = 0;
    for ip in &ips {
        for op in Opcode::ALL {
            for len in [0, 1, 2, 3, 4, 255] {
                i += 1;
                let p = packet(op, &data[..len], i);
                let n = encode(&p, ip, &mut buf).unwrap();
                assert_eq!(n, wire_len(op, len));
                assert_eq!((n - ICRC_LEN) % 4, 0);
                let pad = pad_len(len);
                assert!(buf[n - ICRC_LEN - pad..n - ICRC_LEN]
                    .iter()
                    .all(|b| *b == 0));
                let q = decode(&buf[..n], ip, true).unwrap();
                assert_eq!(q, p, "{op} len {len}");
                // bth.pad is recomputed, never taken from the argument.
                let mut r = p;
                r.bth.pad = 3 - p.bth.pad;
                let mut buf2 = [0u8; 512];
                assert_eq!(encode(&r, ip, &mut buf2), Ok(n));
                assert_eq!(buf[..n], buf2[..n]);
                // Too small a buffer.
                assert!(encode(&p, ip, &mut buf2[..n - 1]).is_err());
            }
        }
    }
}

#[test]
fn icrc_depends_on_addresses_but_not_masked_fields() {
    let ip = ip4([10, 0, 0, 1], [10, 0, 0, 2], 49152, ROCEV2_PORT);
    let p = packet(Opcode::SendOnly, b"abcdefgh", 1);
    let mut buf = [0u8; 64];
    let n = encode(&p, &ip, &mut buf).unwrap();
    // FECN/BECN are masked: a switch marking the packet keeps the ICRC valid.
    buf[4] |= 0xc0;
    let q = decode(&buf[..n], &ip, true).unwrap();
    assert!(q.bth.fecn && q.bth.becn);
    for other in [
        ip4([10, 0, 0, 3], [10, 0, 0, 2], 49152, ROCEV2_PORT),
        ip4([10, 0, 0, 1], [10, 0, 0, 3], 49152, ROCEV2_PORT),
        ip4([10, 0, 0, 1], [10, 0, 0, 2], 49153, ROCEV2_PORT),
        ip4([10, 0, 0, 1], [10, 0, 0, 2], 49152, 4792),
    ] {
        assert!(matches!(
            decode(&buf[..n], &other, true),
            Err(DecodeError::BadIcrc { .. })
        ));
        assert!(decode(&buf[..n], &other, false).is_ok());
    }
    // IPv4-mapped IPv6 addresses (a dual-stack socket's view) mean the IPv4 header.
    let mapped = IpInfo {
        src: IpAddr::V6(Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped()),
        dst: IpAddr::V6(Ipv4Addr::new(10, 0, 0, 2).to_ipv6_mapped()),
        ..ip
    };
    assert_eq!(icrc(&mapped, &buf[..n - 4]), icrc(&ip, &buf[..n - 4]));
}

/// A known-answer vector: the UDP payload (BTH .. ICRC) and the addresses around it.
struct Vector {
    name: &'static str,
    ip: IpInfo,
    udp_payload: &'static str,
}

// Vectors generated with scapy 2.8.0's RoCE layer (scapy.contrib.roce, `BTH.compute_icrc`), an
// implementation independent of this one, from complete IPv4|IPv6/UDP/BTH packets. Scapy
// masks exactly the fields the fact sheet lists (IPv4 TOS, TTL, checksum; IPv6 traffic class,
// flow label, hop limit with the version nibble kept; UDP checksum; BTH byte 4), so no
// adjustment was needed. The IPv4 packets use identification 0 with DF; the TOS, TTL, IPv6
// traffic class / flow label / hop limit, and BECN in the WRITE vector, were set to non-zero
// values, which the masking must make irrelevant.
fn scapy_vectors() -> [Vector; 4] {
    [
        Vector {
            // SEND ONLY, SE, AckReq, 7 payload bytes + 1 pad; TOS 0x8a, TTL 64.
            name: "send_only_v4",
            ip: ip4([10, 0, 0, 1], [10, 0, 0, 2], 49152, 4791),
            udp_payload: "0490ffff000001238000abcd4142434445464700ca8d51c7",
        },
        Vector {
            // RDMA WRITE ONLY WITH IMMEDIATE, BECN set, RETH + ImmDt + 16 bytes; TOS 2, TTL 63.
            name: "write_only_imm_v4",
            ip: ip4([192, 168, 1, 10], [192, 168, 1, 20], 50001, 4791),
            udp_payload: "0b00ffff40abcdef80fffffe00007f1234567800deadbeef00000010\
                          11223344000102030405060708090a0b0c0d0e0f568e0761",
        },
        Vector {
            // ACKNOWLEDGE, syndrome 0x1F (ACK, unlimited credits), MSN 5.
            name: "ack_v4",
            ip: ip4([192, 168, 1, 20], [192, 168, 1, 10], 50002, 4791),
            udp_payload: "1100ffff0000004200fffffe1f000005016a197a",
        },
        Vector {
            // SEND LAST WITH IMMEDIATE over IPv6 (tc 0x68, flow label 0x12345, hop limit 17),
            // P_Key 0x8001, 5 payload bytes + 3 pad.
            name: "send_last_imm_v6",
            ip: ip6("fd00::1", "fd00::2:3", 61000, 4791),
            udp_payload: "033080010000077780000010cafef00d68656c6c6f000000419e044f",
        },
    ]
}

#[test]
fn icrc_known_answers_scapy() {
    let mut buf = [0u8; 128];
    for v in scapy_vectors() {
        let wire = unhex(v.udp_payload);
        let p = decode(&wire, &v.ip, true).unwrap_or_else(|e| panic!("{}: {e}", v.name));
        let n = encode(&p, &v.ip, &mut buf).unwrap();
        assert_eq!(&buf[..n], &wire[..], "{}", v.name);
    }

    let [send, write, ack, send6] = scapy_vectors().map(|v| unhex(v.udp_payload));
    let p = decode(&send, &scapy_vectors()[0].ip, true).unwrap();
    assert_eq!(p.bth.opcode, Opcode::SendOnly);
    assert!(p.bth.solicited && p.bth.ack_req && !p.bth.mig_req);
    assert_eq!((p.bth.pad, p.bth.dest_qp, p.bth.psn), (1, 0x123, 0xabcd));
    assert_eq!(p.payload, b"ABCDEFG");

    let p = decode(&write, &scapy_vectors()[1].ip, true).unwrap();
    assert_eq!(p.bth.opcode, Opcode::WriteOnlyImm);
    assert!(p.bth.becn && !p.bth.fecn && p.bth.ack_req);
    assert_eq!((p.bth.dest_qp, p.bth.psn), (0xabcdef, 0xfffffe));
    assert_eq!(
        p.reth,
        Some(Reth {
            va: 0x7f12_3456_7800,
            rkey: 0xdead_beef,
            dma_len: 16
        })
    );
    assert_eq!(p.imm, Some(0x1122_3344));
    assert_eq!(p.payload, &(0..16).collect::<Vec<u8>>()[..]);

    let p = decode(&ack, &scapy_vectors()[2].ip, true).unwrap();
    assert_eq!(p.aeth, Some(Aeth::ack(5)));
    assert_eq!(p.aeth.unwrap().kind(), Some(AckKind::Ack { credits: 0x1f }));
    assert!(p.payload.is_empty());

    let p = decode(&send6, &scapy_vectors()[3].ip, true).unwrap();
    assert_eq!(p.bth.opcode, Opcode::SendLastImm);
    assert_eq!((p.bth.pkey, p.bth.pad), (0x8001, 3));
    assert_eq!(p.imm, Some(0xcafe_f00d));
    assert_eq!(p.payload, b"hello");
}

/// Checks the ICRC at the end of `wire` against [`icrc_ipv4_id`].
fn check_with_id(ip: &IpInfo, id: u16, flags_frag: u16, wire: &[u8]) {
    let n = wire.len() - 4;
    let got = u32::from_le_bytes(wire[n..].try_into().unwrap());
    assert_eq!(icrc_ipv4_id(ip, id, flags_frag, &wire[..n]), got);
}

#[test]
fn icrc_known_answers_nonzero_ipv4_id() {
    // scapy 2.8.0: RDMA READ REQUEST, 10.1.2.3:4791 -> 10.4.5.6:4791, identification 0x1234
    // with DF, and the same packet with identification 0xbeef and no flags.
    let ip = ip4([10, 1, 2, 3], [10, 4, 5, 6], 4791, 4791);
    let df = unhex("0c00ffff0000010080000200000000000000100000c0ffee00001000c30ffed9");
    let no_df = unhex("0c00ffff0000010080000200000000000000100000c0ffee000010000d012db6");
    check_with_id(&ip, 0x1234, 0x4000, &df);
    check_with_id(&ip, 0xbeef, 0, &no_df);
    // decode assumes identification 0 + DF, so it must reject these unless told not to check.
    for wire in [&df, &no_df] {
        assert!(matches!(
            decode(wire, &ip, true),
            Err(DecodeError::BadIcrc { .. })
        ));
        let p = decode(wire, &ip, false).unwrap();
        assert_eq!(p.bth.opcode, Opcode::ReadRequest);
        assert_eq!(
            p.reth,
            Some(Reth {
                va: 0x1000,
                rkey: 0x00c0_ffee,
                dma_len: 4096
            })
        );
    }
    // With identification 0 + DF, icrc_ipv4_id is icrc.
    assert_eq!(
        icrc_ipv4_id(&ip, 0, 0x4000, &df[..df.len() - 4]),
        icrc(&ip, &df[..df.len() - 4])
    );
}

#[test]
fn icrc_known_answers_published() {
    // A CNP captured from ConnectX-4 Lx hardware, published in scapy's RoCE regression tests
    // (test/contrib/roce.uts, "RoCE CNP captured on ConnectX-4 Lx"): IPv4 10.0.17.1 ->
    // 10.0.18.1, TOS 0xc2, identification 0x718c, DF, TTL 64; UDP 0 -> 4791; BTH opcode 0x81
    // (CNP, not RC: only the ICRC is checked), BECN set, 16 reserved zero bytes.
    let ip = ip4([10, 0, 17, 1], [10, 0, 18, 1], 0, 4791);
    let cnp = unhex("8100ffff400001180000000000000000000000000000000000000000 82fd002a");
    assert_eq!(cnp.len(), 32); // UDP length 40 in the capture
    check_with_id(&ip, 0x718c, 0x4000, &cnp);
    assert_eq!(
        decode(&cnp, &ip, false),
        Err(DecodeError::UnknownOpcode(0x81))
    );

    // The UC SEND ONLY packet of the same test file (ICRC 0x78f353f3 as scapy prints the
    // big-endian field): 192.168.0.7 -> 192.168.0.7, identification 1144, DF; UDP 49152 ->
    // 4791; MigReq, pad 2, destination QP 211, PSN 13571856.
    let ip = ip4([192, 168, 0, 7], [192, 168, 0, 7], 49152, 4791);
    let uc = unhex("2460ffff000000d300cf17104630818be28935d90e9a95505401be885e50000078f353f3");
    check_with_id(&ip, 1144, 0x4000, &uc);
}

/// A NIC's identification, whatever it is, is found from the ICRC (the hardware
/// captures above, and every identification of a generated packet), and a corrupt packet
/// is still refused.
#[test]
fn a_nics_ipv4_identification_is_solved_from_the_icrc() {
    let cases = [
        (
            ip4([10, 0, 17, 1], [10, 0, 18, 1], 0, 4791),
            unhex("8100ffff400001180000000000000000000000000000000000000000 82fd002a"),
            0x718c,
        ),
        (
            ip4([192, 168, 0, 7], [192, 168, 0, 7], 49152, 4791),
            unhex("2460ffff000000d300cf17104630818be28935d90e9a95505401be885e50000078f353f3"),
            1144,
        ),
    ];
    for (ip, pkt, id) in &cases {
        let body = pkt.len() - 4;
        let got = u32::from_le_bytes(pkt[body..].try_into().unwrap());
        let diff = got ^ icrc_ipv4_id(ip, 0, 0x4000, &pkt[..body]);
        assert_eq!(any_ipv4_id(ip, body, diff), Some(*id));
    }
    let ip = ip4([10, 99, 0, 2], [10, 99, 0, 1], 51234, ROCEV2_PORT);
    let p = packet(Opcode::WriteOnly, &[0x5a; 1000], 77);
    let mut buf = vec![0u8; 1100];
    let n = encode(&p, &ip, &mut buf).unwrap();
    let body = n - 4;
    for id in [1u16, 2, 0x8000, 0x1234, 0xffff, 0xbeef] {
        let diff = icrc_ipv4_id(&ip, id, 0x4000, &buf[..body]) ^ icrc(&ip, &buf[..body]);
        assert_eq!(any_ipv4_id(&ip, body, diff), Some(id), "id {id:#x}");
    }
    // Corruption: a flipped payload bit with identification 0x1234 is not any
    // identification (these flips, checked once, are not among the 1 in 65536 that
    // would pass), and IPv6 has no identification to solve.
    for bit in [0usize, 77, 1000, 4321] {
        let mut bad = buf[..n].to_vec();
        bad[BTH_LEN + RETH_LEN + bit / 8] ^= 1 << (bit % 8);
        let diff = icrc_ipv4_id(&ip, 0x1234, 0x4000, &bad[..body]) ^ icrc(&ip, &buf[..body]);
        assert_eq!(any_ipv4_id(&ip, body, diff), None, "bit {bit}");
    }
    let v6 = ip6("fd00::1", "fd00::2", 50000, ROCEV2_PORT);
    assert_eq!(any_ipv4_id(&v6, body, 1), None);
}

#[test]
fn any_single_bit_flip_is_rejected() {
    let ips = [
        ip4([10, 0, 0, 1], [10, 0, 0, 2], 49152, ROCEV2_PORT),
        ip6("fd00::1", "fd00::2", 50000, ROCEV2_PORT),
    ];
    let data: Vec<u8> = (0..37u8).map(|b| b.wrapping_mul(29)).collect();
    let mut buf = [0u8; 128];
    for ip in &ips {
        for op in [
            Opcode::SendOnly,
            Opcode::WriteOnlyImm,
            Opcode::ReadRespLast,
            Opcode::Ack,
        ] {
            let p = packet(op, &data, 9);
            let n = encode(&p, ip, &mut buf).unwrap();
            for bit in 0..n * 8 {
                // BTH byte 4 (FECN, BECN, reserved) is outside the ICRC by design:
                // switches may set FECN/BECN, and receivers ignore the reserved bits.
                if bit / 8 == 4 {
                    continue;
                }
                let mut w = buf;
                w[bit / 8] ^= 0x80 >> (bit % 8);
                assert!(decode(&w[..n], ip, true).is_err(), "{op} bit {bit}");
            }
        }
    }
}

/// Re-computes the ICRC of a hand-edited packet so that the check is not what rejects it.
fn reseal(ip: &IpInfo, w: &mut [u8]) {
    let n = w.len() - 4;
    let c = icrc(ip, &w[..n]);
    w[n..].copy_from_slice(&c.to_le_bytes());
}

#[test]
fn decode_errors() {
    let ip = ip4([10, 0, 0, 1], [10, 0, 0, 2], 49152, ROCEV2_PORT);
    let mut buf = [0u8; 128];

    // Truncation: below BTH + ICRC, then headers that do not fit.
    for len in 0..16 {
        assert_eq!(decode(&buf[..len], &ip, true), Err(DecodeError::TooShort));
    }
    let p = packet(Opcode::WriteOnlyImm, b"", 1);
    let n = encode(&p, &ip, &mut buf).unwrap();
    assert_eq!(n, 36);
    for len in 16..n {
        let mut w = buf[..len].to_vec();
        reseal(&ip, &mut w);
        assert_eq!(
            decode(&w, &ip, true),
            Err(DecodeError::MissingHeader),
            "{len}"
        );
    }
    let ack = packet(Opcode::Ack, b"", 1);
    let n = encode(&ack, &ip, &mut buf).unwrap();
    let mut w = buf[..n - 4].to_vec();
    reseal(&ip, &mut w);
    assert_eq!(decode(&w, &ip, true), Err(DecodeError::MissingHeader));

    // Transport version.
    let p = packet(Opcode::SendOnly, b"abcd", 1);
    let n = encode(&p, &ip, &mut buf).unwrap();
    for tver in 1..16u8 {
        let mut w = buf[..n].to_vec();
        w[1] |= tver;
        reseal(&ip, &mut w);
        assert_eq!(decode(&w, &ip, true), Err(DecodeError::BadVersion(tver)));
    }

    // Opcodes outside the RC set (UC, RD, UD, CNP, reserved RC values).
    for op in [0x15u8, 0x1f, 0x20, 0x24, 0x40, 0x64, 0x81, 0xff] {
        let mut w = buf[..n].to_vec();
        w[0] = op;
        reseal(&ip, &mut w);
        assert_eq!(decode(&w, &ip, true), Err(DecodeError::UnknownOpcode(op)));
    }

    // Pad count larger than the payload.
    let p = packet(Opcode::SendOnly, b"", 1);
    let n = encode(&p, &ip, &mut buf).unwrap();
    assert_eq!(n, 16);
    for pad in 1..4u8 {
        let mut w = buf[..n].to_vec();
        w[1] |= pad << 4;
        reseal(&ip, &mut w);
        assert_eq!(decode(&w, &ip, true), Err(DecodeError::MissingHeader));
    }
    // ...and a pad that fits is stripped.
    let mut w = buf[..n].to_vec();
    w.splice(12..12, [9, 8, 7, 6]);
    w[1] |= 2 << 4;
    reseal(&ip, &mut w);
    assert_eq!(decode(&w, &ip, true).unwrap().payload, &[9, 8]);

    // Wrong ICRC.
    let n = encode(&packet(Opcode::SendOnly, b"xyz", 1), &ip, &mut buf).unwrap();
    buf[n - 1] ^= 1;
    assert!(matches!(
        decode(&buf[..n], &ip, true),
        Err(DecodeError::BadIcrc { got, want }) if got ^ want == 0x0100_0000
    ));
    let e = decode(&buf[..n], &ip, true).unwrap_err().to_string();
    assert!(e.contains("ICRC"), "{e}");
}

#[test]
fn encode_errors() {
    let ip = ip4([10, 0, 0, 1], [10, 0, 0, 2], 49152, ROCEV2_PORT);
    let mut buf = [0u8; 128];
    let mut p = packet(Opcode::WriteOnly, b"data", 1);
    p.reth = None;
    assert_eq!(encode(&p, &ip, &mut buf), Err("opcode requires a RETH"));
    let mut p = packet(Opcode::SendOnly, b"data", 1);
    p.reth = Some(Reth {
        va: 0,
        rkey: 0,
        dma_len: 0,
    });
    assert!(encode(&p, &ip, &mut buf).is_err());
    let mut p = packet(Opcode::WriteOnlyImm, b"data", 1);
    p.imm = None;
    assert!(encode(&p, &ip, &mut buf).is_err());
    let mut p = packet(Opcode::SendOnly, b"data", 1);
    p.imm = Some(1);
    assert!(encode(&p, &ip, &mut buf).is_err());
    let mut p = packet(Opcode::Ack, b"", 1);
    p.aeth = None;
    assert!(encode(&p, &ip, &mut buf).is_err());
    let mut p = packet(Opcode::WriteLast, b"", 1);
    p.aeth = Some(Aeth::ack(0));
    assert!(encode(&p, &ip, &mut buf).is_err());
    let mut p = packet(Opcode::SendOnly, b"", 1);
    p.bth.psn = 1 << 24;
    assert!(encode(&p, &ip, &mut buf).is_err());
    let mut p = packet(Opcode::SendOnly, b"", 1);
    p.bth.dest_qp = 1 << 24;
    assert!(encode(&p, &ip, &mut buf).is_err());
    let mut p = packet(Opcode::Ack, b"", 1);
    p.aeth = Some(Aeth {
        syndrome: 0,
        msn: 1 << 24,
    });
    assert!(encode(&p, &ip, &mut buf).is_err());
    let big = vec![0u8; MAX_UDP_PAYLOAD];
    let mut huge = vec![0u8; MAX_UDP_PAYLOAD + 64];
    let p = packet(Opcode::SendOnly, &big, 1);
    assert!(encode(&p, &ip, &mut huge).is_err());
}
