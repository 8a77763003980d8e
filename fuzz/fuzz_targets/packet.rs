//! RoCE v2 packet decode (`rdma::wire::decode`) of arbitrary datagrams, and the round trips:
//! a decoded packet encodes back to a datagram that decodes to the same packet, and any
//! packet built from arbitrary fields that `encode` accepts decodes to itself.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use libfuzzer_sys::fuzz_target;
use roccl::rdma::wire::{self, Aeth, Bth, IpInfo, Opcode, Packet, Reth};
use roccl_fuzz::Reader;

/// Layout: flags (bit 0: IPv6, bit 1: check the ICRC), 32 bytes of addresses, two ports, the
/// datagram (u16 length first); then the fields of a packet to encode: opcode, flags
/// (solicited, migration, FECN, BECN, AckReq), pkey, QPN, PSN, VA, rkey, DMA length,
/// immediate, syndrome, MSN, GSO segment, and the rest is its payload.
fn ip_info(r: &mut Reader) -> (IpInfo, bool) {
    let flags = r.u8();
    let a = r.bytes(32);
    let mut addrs = [0u8; 32];
    addrs[..a.len()].copy_from_slice(a);
    let (src, dst): (IpAddr, IpAddr) = if flags & 1 != 0 {
        let s: [u8; 16] = addrs[..16].try_into().unwrap();
        let d: [u8; 16] = addrs[16..].try_into().unwrap();
        (Ipv6Addr::from(s).into(), Ipv6Addr::from(d).into())
    } else {
        let s: [u8; 4] = addrs[..4].try_into().unwrap();
        let d: [u8; 4] = addrs[4..8].try_into().unwrap();
        (Ipv4Addr::from(s).into(), Ipv4Addr::from(d).into())
    };
    let ip = IpInfo {
        src,
        dst,
        src_port: r.u16(),
        dst_port: r.u16(),
    };
    (ip, flags & 2 != 0)
}

/// A packet as `encode` writes it: the pad follows the payload.
fn normal(p: &Packet) -> Packet<'static> {
    let mut bth = p.bth;
    bth.pad = ((4 - p.payload.len() % 4) % 4) as u8;
    Packet {
        bth,
        reth: p.reth,
        imm: p.imm,
        aeth: p.aeth,
        payload: &[],
    }
}

fn same(a: &Packet, b: &Packet) {
    assert_eq!(normal(a), normal(b));
    assert_eq!(a.payload, b.payload);
}

fuzz_target!(|data: &[u8]| {
    let mut r = Reader::new(data);
    let (ip, check_icrc) = ip_info(&mut r);
    let datagram = r.chunk();
    let mut buf = vec![0u8; 16 * 1024];
    // Arbitrary bytes: decode returns a packet or an error, and a packet encodes back.
    if let Ok(p) = wire::decode(datagram, &ip, check_icrc) {
        assert!(p.payload.len() <= datagram.len());
        let n = wire::encode(&p, &ip, &mut buf).expect("a decoded packet encodes");
        let q = wire::decode(&buf[..n], &ip, true).expect("an encoded packet decodes");
        same(&p, &q);
    }
    // Fields: whatever encode accepts decodes to itself, ICRC checked.
    let Some(opcode) = Opcode::from_u8(r.u8()) else {
        return;
    };
    let flags = r.u8();
    let bit = |i: u8| flags & (1 << i) != 0;
    let bth = Bth {
        opcode,
        solicited: bit(0),
        mig_req: bit(1),
        pad: 0,
        pkey: r.u16(),
        fecn: bit(2),
        becn: bit(3),
        dest_qp: r.u32(),
        ack_req: bit(4),
        psn: r.u32(),
    };
    let reth = Reth {
        va: r.u64(),
        rkey: r.u32(),
        dma_len: r.u32(),
    };
    let imm = r.u32();
    let aeth = Aeth {
        syndrome: r.u8(),
        msn: r.u32(),
    };
    let seg = r.u8() % wire::MAX_SEGMENTS as u8;
    let p = Packet {
        bth,
        reth: opcode.has_reth().then_some(reth),
        imm: opcode.has_imm().then_some(imm),
        aeth: opcode.has_aeth().then_some(aeth),
        payload: r.rest(),
    };
    if let Ok(n) = wire::encode_segment(&p, &ip, seg, &mut buf) {
        assert_eq!(n, wire::wire_len(opcode, p.payload.len()));
        let q = wire::decode(&buf[..n], &ip, seg == 0 || ip.src.is_ipv4())
            .expect("an encoded packet decodes");
        same(&p, &q);
    }
});
