//! Writes the seed corpus of every fuzz target into `fuzz/corpus/<target>/` (run it from
//! `fuzz/`: `cargo run --example make_corpus`): real encoded packets, engine traffic, real
//! handles and setup messages of every network, signed registrations and real rendezvous
//! blobs, launcher environments and C ABI call sequences.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;

use roccl::net::shm::ShmNet;
use roccl::net::tcp::TcpNet;
use roccl::net::Net;
use roccl::rdma::verbs::QpEndpoint;
use roccl::rdma::wire::{self, Aeth, Bth, IpInfo, Opcode, Packet, Reth};
use roccl::UniqueId;
use roccl_fuzz::Writer;

fn put(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("corpus").join(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
}

fn packets() {
    let ip = IpInfo {
        src: IpAddr::from([10, 0, 0, 1]),
        dst: IpAddr::from([10, 0, 0, 2]),
        src_port: 50_000,
        dst_port: wire::ROCEV2_PORT,
    };
    let payload: Vec<u8> = (0..61u8).collect();
    let cases = [
        ("send_only", Opcode::SendOnly, 61),
        ("write_first", Opcode::WriteFirst, 61),
        ("write_only_imm", Opcode::WriteOnlyImm, 8),
        ("read_request", Opcode::ReadRequest, 0),
        ("read_resp_only", Opcode::ReadRespOnly, 33),
        ("ack", Opcode::Ack, 0),
    ];
    for (name, op, len) in cases {
        let p = Packet {
            bth: Bth {
                opcode: op,
                solicited: false,
                mig_req: false,
                pad: 0,
                pkey: wire::DEFAULT_PKEY,
                fecn: false,
                becn: false,
                dest_qp: 0x1234,
                ack_req: true,
                psn: 0x00ff_fffe,
            },
            reth: op.has_reth().then_some(Reth {
                va: 0x7f00_0000_0000,
                rkey: 0x55,
                dma_len: 4096,
            }),
            imm: op.has_imm().then_some(0xdead_beef),
            aeth: op.has_aeth().then_some(Aeth::ack(7)),
            payload: &payload[..len],
        };
        let mut buf = [0u8; 256];
        let n = wire::encode(&p, &ip, &mut buf).unwrap();
        let mut w = Writer::default();
        w.u8(2)
            .bytes(&[10, 0, 0, 1])
            .bytes(&[10, 0, 0, 2])
            .bytes(&[0; 24]);
        w.u16(50_000).u16(wire::ROCEV2_PORT).chunk(&buf[..n]);
        w.u8(op as u8)
            .u8(1 << 4)
            .u16(wire::DEFAULT_PKEY)
            .u32(0x1234)
            .u32(0x00ff_fffe);
        w.u64(0x7f00_0000_0000)
            .u32(0x55)
            .u32(4096)
            .u32(0xdead_beef)
            .u8(0)
            .u32(7)
            .u8(0);
        w.bytes(&payload[..len]);
        put("packet", name, &w.0);
    }
}

fn engine() {
    // Step kinds: 0 raw, 1 forged, 2 pump, 3 wait, 4 post, 5 receive, 6 close.
    let pump = |w: &mut Writer| {
        w.u8(2).u32(0);
    };
    let wait = |w: &mut Writer, us: u16| {
        w.u8(3).u16(us);
    };
    // A signaled write of 3000 bytes from engine 0, delivered, acknowledged.
    let mut w = Writer::default();
    w.u8(4).u8(0b100).u8(2).u16(64).u16(3000).u16(128);
    for _ in 0..4 {
        pump(&mut w);
        wait(&mut w, 50);
    }
    put("engine", "write", &w.0);
    // A receive on engine 1, a send with immediate from engine 0, some packets lost.
    let mut w = Writer::default();
    w.u8(5).u8(1).u16(0).u16(4096);
    w.u8(4).u8(0b100).u8(1).u16(0).u16(2500).u16(0);
    w.u8(2).u32(0b10);
    for _ in 0..4 {
        wait(&mut w, 5000);
        pump(&mut w);
    }
    put("engine", "send_lossy", &w.0);
    // A read by engine 1, then its queue pair closed.
    let mut w = Writer::default();
    w.u8(4).u8(0b101).u8(4).u16(0).u16(2048).u16(1024);
    pump(&mut w);
    pump(&mut w);
    w.u8(6).u8(1);
    pump(&mut w);
    put("engine", "read_close", &w.0);
    // Forged packets at the real QP: a write with a good rkey from the peer, a NAK from a
    // stranger, an ACK of nothing, a read request past the region.
    let mut w = Writer::default();
    w.u8(1)
        .u8(0b10_1001)
        .u8(Opcode::WriteOnly as u8)
        .u16(0)
        .u32(100)
        .u32(0);
    w.u16(64).u32(0).u8(0).u16(0).u16(64).u8(0xab);
    pump(&mut w);
    w.u8(4).u8(0b100).u8(2).u16(0).u16(100).u16(0);
    w.u8(1)
        .u8(0b0011)
        .u8(Opcode::Ack as u8)
        .u16(0)
        .u32(0)
        .u32(0);
    w.u16(0).u32(0).u8(0x62).u16(0).u16(0).u8(0);
    w.u8(1)
        .u8(0b0001)
        .u8(Opcode::Ack as u8)
        .u16(500)
        .u32(0)
        .u32(0);
    w.u16(0).u32(0).u8(0).u16(9).u16(0).u8(0);
    w.u8(1)
        .u8(0b10_1000)
        .u8(Opcode::ReadRequest as u8)
        .u16(1)
        .u32(16_000)
        .u32(0);
    w.u16(4096).u32(0).u8(0).u16(0).u16(0).u8(0);
    pump(&mut w);
    put("engine", "forged", &w.0);
    // Raw garbage, then normal traffic.
    let mut w = Writer::default();
    w.u8(0)
        .u8(1)
        .chunk(&[0x0a, 0, 0xff, 0xff, 0, 0, 0, 1, 0x80, 0, 0, 0, 1, 2, 3, 4]);
    w.u8(4).u8(0b100).u8(2).u16(0).u16(10).u16(0);
    pump(&mut w);
    put("engine", "raw", &w.0);
}

fn net_setup() {
    let tcp = TcpNet::with_addr(IpAddr::V4(Ipv4Addr::LOCALHOST), &Default::default()).unwrap();
    let (th, _l) = tcp.listen(0).unwrap();
    let th = th.as_bytes();
    let mut hello = Vec::new();
    hello.extend_from_slice(&0x4f4c_4548u32.to_le_bytes()); // "HELO"
    hello.extend_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
    hello.extend_from_slice(&1u16.to_le_bytes());
    hello.extend_from_slice(&(5u16 | 0x8000).to_le_bytes()); // duplex, 2 per way
    hello.extend_from_slice(&[0x5a; 16]);
    let mut w = Writer::default();
    w.u8(0).u8(th.len() as u8).bytes(th).bytes(&hello);
    put("net_setup", "tcp", &w.0);

    let ep = QpEndpoint {
        addr: SocketAddr::from(([10, 0, 0, 2], wire::ROCEV2_PORT)),
        qpn: 0x12_3456,
        psn: 0x00ab_cdef,
        mtu: 4096,
        engine: true,
    };
    let (rh, info) = roccl::fuzzing::seed_rocev2(SocketAddr::from(([10, 0, 0, 2], 40_000)), &ep);
    let mut w = Writer::default();
    w.u8(1).u8(rh.len() as u8).bytes(&rh).bytes(&info);
    put("net_setup", "rocev2", &w.0);

    let shm = ShmNet::new(&Default::default()).unwrap();
    let (sh, _l) = shm.listen(0).unwrap();
    let sh = sh.as_bytes();
    let mut msg = vec![0u8; 96];
    let name = b"/roccl-4242-0-1f2e3d4c5b6a7988";
    msg[0] = name.len() as u8;
    msg[1..1 + name.len()].copy_from_slice(name);
    msg[96 - 24..96 - 20].copy_from_slice(&4242u32.to_le_bytes());
    msg[96 - 16..96 - 8].copy_from_slice(&0x5555_0000_1000u64.to_le_bytes());
    msg[96 - 8..].copy_from_slice(&(1u64 << 20).to_le_bytes());
    let mut w = Writer::default();
    w.u8(2).u8(sh.len() as u8).bytes(sh).bytes(&msg);
    put("net_setup", "shm", &w.0);
}

fn rendezvous() {
    let tcp = TcpNet::with_addr(IpAddr::V4(Ipv4Addr::LOCALHOST), &Default::default()).unwrap();
    let (th, _l) = tcp.listen(0).unwrap();
    let shm = ShmNet::new(&Default::default()).unwrap();
    let (sh, _s) = shm.listen(0).unwrap();
    let blob = roccl::fuzzing::seed_blob(&th, "tcp", Some(&sh)).unwrap();
    let reg = roccl::fuzzing::seed_registration(1, 3, &blob);
    put("registration", "whole", &[&[0u8][..], &reg].concat());
    put("registration", "signed", &[&[1u8][..], &reg].concat());
    put(
        "registration",
        "partial",
        &[&[0u8][..], &reg[..40]].concat(),
    );
    let id = UniqueId::for_address(SocketAddr::from(([192, 168, 1, 7], 29_500)));
    put("rendezvous", "id", &[&[0u8][..], id.as_bytes()].concat());
    let id6 = UniqueId::for_address("[fe80::1]:29500".parse().unwrap());
    put(
        "rendezvous",
        "id_hex",
        &[&[1u8][..], id6.to_hex().as_bytes()].concat(),
    );
    let other = roccl::fuzzing::seed_blob(&th, "tcp", None).unwrap();
    let mut w = Writer::default();
    w.u8(4)
        .u8(0b110)
        .u32(256 << 10)
        .chunk(&blob)
        .chunk(&other)
        .chunk(&blob);
    put("rendezvous", "table", &w.0);
}

fn launch_env() {
    // Kind 3 of the rendezvous target; variable indices: see VARS in
    // fuzz_targets/rendezvous.rs.
    let env = |nodes: &str, vars: &[(u8, &str)]| {
        let mut w = Writer::default();
        w.u8(3).chunk(nodes.as_bytes());
        for (k, v) in vars {
            w.u8(*k).chunk(v.as_bytes());
        }
        w.0
    };
    put(
        "rendezvous",
        "env_torchrun",
        &env("", &[(2, "1"), (3, "4"), (13, "10.0.0.1"), (14, "29500")]),
    );
    put(
        "rendezvous",
        "env_slurm",
        &env(
            "node[01-04,7],gpu-[1-2]",
            &[
                (8, "0"),
                (9, "2"),
                (16, "node[01-04,7]"),
                (18, "1234"),
                (19, "0"),
            ],
        ),
    );
    put(
        "rendezvous",
        "env_roccl",
        &env(
            "",
            &[(0, "0"), (1, "2"), (11, "[::1]:1234"), (20, "s3cret")],
        ),
    );
    let id = UniqueId::for_address(SocketAddr::from(([127, 0, 0, 1], 29_500)));
    put(
        "rendezvous",
        "env_unique_id",
        &env("", &[(4, "3"), (5, "8"), (10, &id.to_hex())]),
    );
}

fn capi() {
    // Comm: 0 NULL, 1 live, 2 stale, 3 made-up (u64 follows).
    let mut w = Writer::default();
    w.u8(3).u8(1).u8(1); // count
    w.u8(14)
        .u8(0)
        .u8(1)
        .u64(16)
        .u32(7)
        .u32(0)
        .u32(0)
        .u8(0)
        .u64(0); // all-reduce f32 sum
    w.u8(14)
        .u8(2)
        .u8(1)
        .u64(16)
        .u32(0)
        .u32(0)
        .u32(0)
        .u8(2)
        .u64(0); // bcast in place
    w.u8(12).u8(15).u16(100).u32(9).u8(13); // group: send/receive pair
    put("capi", "calls", &w.0);
    let mut w = Writer::default();
    w.u8(9).u8(1).u32(0).u32(0).u8(1); // split
    w.u8(4).u8(2).u8(1); // rank of the stale handle
    w.u8(7).u8(3).u64(0x1000); // destroy a made-up handle
    w.u8(1).u8(0);
    put("capi", "handles", &w.0);
    let id = UniqueId::for_address(SocketAddr::from(([127, 0, 0, 1], 29_500)));
    let mut w = Writer::default();
    w.u8(10).u8(1).u32(2).u32(5).bytes(id.as_bytes()); // rank out of range
    w.u8(11).u8(1).u32(0); // ndev 0
    w.u8(14)
        .u8(5)
        .u8(1)
        .u64(u64::MAX)
        .u32(7)
        .u32(0)
        .u32(0)
        .u8(1)
        .u64(0); // NULL, huge
    w.u8(0).u32(3);
    put("capi", "arguments", &w.0);
}

fn hellos() {
    let id = 0x5eed_0001u32;
    for (i, m) in roccl::fuzzing::seed_hellos(id).iter().enumerate() {
        put("hello", &format!("kind{i}"), &[&id.to_le_bytes()[..], m].concat());
    }
}

fn main() {
    hellos();
    packets();
    engine();
    net_setup();
    rendezvous();
    launch_env();
    capi();
}
