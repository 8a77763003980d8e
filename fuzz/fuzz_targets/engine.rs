//! The userspace RoCE v2 engine (`Engine::handle_datagram`) driven by sequences of datagrams:
//! two engines with one connected queue pair each exchange their real traffic (some of it
//! dropped), and between them arrive arbitrary bytes and structurally valid packets built
//! from arbitrary fields with a good ICRC, aimed at the real queue pair from its peer's
//! address or a stranger's; the clock advances, work is posted and completions polled. The
//! engine must never panic, and never write outside the memory registered with it.
#![no_main]

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use roccl::rdma::engine::{CqId, Engine, QpAttr, QpState, Qpn, RecvWr, SendWr, Sge, Wc, WrOpcode};
use roccl::rdma::mem::Access;
use roccl::rdma::wire::{self, Aeth, Bth, IpInfo, Opcode, Packet, Reth};
use roccl_fuzz::Reader;

const IPS: [[u8; 4]; 2] = [[10, 0, 0, 1], [10, 0, 0, 2]];
const PORT: u16 = 4791;
/// Bytes of each engine's registered region.
const REGION: usize = 16 * 1024;
/// Guard bytes after each region: the engine must never write them.
const GUARD: usize = 64;
/// First PSNs (near the 24-bit wrap).
const PSN: [u32; 2] = [0x00ff_fff0, 0x00ff_ff00];

/// One step, from its record: a kind byte, then its fields (see [`step`]).
#[derive(Debug)]
enum Step<'a> {
    /// Arbitrary bytes to engine `to`.
    Raw {
        to: bool,
        stranger: bool,
        data: &'a [u8],
    },
    /// A packet with a good ICRC built from these fields, to engine `to`.
    Forged(Forged),
    /// Deliver what both engines have to send, dropping those whose bit is set in `drop`.
    Pump { drop: u32 },
    /// Advance the clock.
    Wait { us: u16 },
    /// Post a send-queue request.
    Post(Post),
    /// Post a receive on engine `e`.
    Recv { e: bool, off: u16, len: u16 },
    /// Close engine `e`'s queue pair.
    Close { e: bool },
}

/// A send-queue request on engine `e`.
#[derive(Debug)]
struct Post {
    e: bool,
    op: u8,
    off: u16,
    len: u16,
    remote_off: u16,
    inline: bool,
    signaled: bool,
}

#[derive(Debug)]
struct Forged {
    to: bool,
    stranger: bool,
    wrong_qp: bool,
    ack_req: bool,
    /// RETH address: relative to the target's region, or absolute.
    absolute_va: bool,
    good_rkey: bool,
    opcode: u8,
    /// PSN relative to the first one the target expects (requests) or sent (responses).
    psn: i16,
    va: u32,
    rkey: u32,
    dma_len: u16,
    imm: u32,
    syndrome: u8,
    msn: u16,
    payload: u16,
    fill: u8,
}

/// The next step: kind (mod 7) — 0 raw (flags: to, stranger; bytes with a u16 length),
/// 1 forged (flags: to, stranger, wrong QP, AckReq, absolute VA, good rkey; opcode, PSN
/// offset i16, VA u32, rkey u32, DMA length u16, immediate u32, syndrome, MSN u16, payload
/// length u16, fill byte), 2 pump (drop mask u32), 3 wait (µs u16), 4 post (flags: engine,
/// inline, signaled; opcode, offset, length, remote offset u16), 5 receive (engine; offset,
/// length u16), 6 close (engine).
fn step<'a>(r: &mut Reader<'a>) -> Step<'a> {
    match r.u8() % 7 {
        0 => {
            let f = r.u8();
            Step::Raw {
                to: f & 1 != 0,
                stranger: f & 2 != 0,
                data: r.chunk(),
            }
        }
        1 => {
            let f = r.u8();
            Step::Forged(Forged {
                to: f & 1 != 0,
                stranger: f & 2 != 0,
                wrong_qp: f & 4 != 0,
                ack_req: f & 8 != 0,
                absolute_va: f & 16 != 0,
                good_rkey: f & 32 != 0,
                opcode: r.u8(),
                psn: r.u16() as i16,
                va: r.u32(),
                rkey: r.u32(),
                dma_len: r.u16(),
                imm: r.u32(),
                syndrome: r.u8(),
                msn: r.u16(),
                payload: r.u16(),
                fill: r.u8(),
            })
        }
        2 => Step::Pump { drop: r.u32() },
        3 => Step::Wait { us: r.u16() },
        4 => {
            let f = r.u8();
            Step::Post(Post {
                e: f & 1 != 0,
                inline: f & 2 != 0,
                signaled: f & 4 != 0,
                op: r.u8(),
                off: r.u16(),
                len: r.u16(),
                remote_off: r.u16(),
            })
        }
        5 => Step::Recv {
            e: r.bool(),
            off: r.u16(),
            len: r.u16(),
        },
        _ => Step::Close { e: r.bool() },
    }
}

struct World {
    eng: [Engine; 2],
    cq: [CqId; 2],
    qp: [Qpn; 2],
    keys: [u32; 2],
    mem: [Box<[u8]>; 2],
    t0: Instant,
    t: u64,
    wr_id: u64,
}

impl World {
    fn new() -> World {
        let mk = |i: usize| Engine::new(IpAddr::from(IPS[i]), PORT);
        let mut eng = [mk(0), mk(1)];
        let cq = [eng[0].create_cq(), eng[1].create_cq()];
        let qp = [
            eng[0].create_qp(cq[0], cq[0], 50_000).unwrap(),
            eng[1].create_qp(cq[1], cq[1], 50_001).unwrap(),
        ];
        for i in 0..2 {
            let j = 1 - i;
            let a = QpAttr {
                mtu: 1024,
                dest: SocketAddr::from((IPS[j], PORT)),
                dest_qpn: qp[j],
                rq_psn: PSN[j],
                sq_psn: PSN[i],
                timeout: 8,
                retry_cnt: 3,
                rnr_retry: 3,
                min_rnr_timer: 1,
                retry_for: None,
                selective: i == 1,
            };
            eng[i].modify_qp(qp[i], QpState::Init, &a).unwrap();
            eng[i].modify_qp(qp[i], QpState::Rtr, &a).unwrap();
            eng[i].modify_qp(qp[i], QpState::Rts, &a).unwrap();
        }
        let mut mem = [
            vec![0u8; REGION + GUARD].into_boxed_slice(),
            vec![0u8; REGION + GUARD].into_boxed_slice(),
        ];
        let mut keys = [0u32; 2];
        for i in 0..2 {
            // SAFETY: `mem` lives in the world with the engines and is dropped after them
            // (fields drop in order: `eng` first); the region leaves the guard bytes out.
            keys[i] = unsafe {
                eng[i]
                    .mrs
                    .register(mem[i].as_mut_ptr() as usize, REGION, Access::ALL)
            }
            .unwrap();
        }
        World {
            eng,
            cq,
            qp,
            keys,
            mem,
            t0: Instant::now(),
            t: 0,
            wr_id: 0,
        }
    }

    fn now(&self) -> Instant {
        self.t0 + Duration::from_micros(self.t)
    }

    /// The address engine `to` hears its peer (or a stranger) from.
    fn from(&self, to: usize, stranger: bool) -> SocketAddr {
        if stranger {
            SocketAddr::from(([10, 0, 0, 9], 50_000))
        } else {
            SocketAddr::from((IPS[1 - to], 50_000 + (1 - to) as u16))
        }
    }

    fn deliver(&mut self, to: usize, from: SocketAddr, data: &[u8]) {
        let now = self.now();
        self.eng[to].handle_datagram(now, from, data);
    }

    fn pump(&mut self, mut drop: u32) {
        let mut buf = vec![0u8; 9000];
        for _ in 0..4 {
            let mut moved = false;
            for e in 0..2 {
                let now = self.now();
                while let Some(tx) = self.eng[e].poll_transmit(now, &mut buf) {
                    moved = true;
                    assert!(tx.len <= buf.len());
                    let lost = drop & 1 != 0;
                    drop = drop.rotate_right(1);
                    if lost || tx.dest.ip() != IpAddr::from(IPS[1 - e]) {
                        continue;
                    }
                    let from = SocketAddr::new(IpAddr::from(IPS[e]), tx.src_port);
                    let data = buf[..tx.len].to_vec();
                    self.deliver(1 - e, from, &data);
                }
            }
            if !moved {
                break;
            }
        }
    }

    fn forged(&mut self, f: &Forged) {
        let to = usize::from(f.to);
        let Some(opcode) = Opcode::from_u8(f.opcode) else {
            return;
        };
        let from = self.from(to, f.stranger);
        let ip = IpInfo {
            src: from.ip(),
            dst: IpAddr::from(IPS[to]),
            src_port: from.port(),
            dst_port: PORT,
        };
        // Requests come from the peer's send queue, responses answer the target's.
        let base = if opcode.has_aeth() || opcode.is_read_response() {
            PSN[to]
        } else {
            PSN[1 - to]
        };
        let psn = (base as i64 + i64::from(f.psn)).rem_euclid(1 << 24) as u32;
        let region = self.mem[to].as_ptr() as u64;
        let va = if f.absolute_va {
            u64::from(f.va)
        } else {
            region.wrapping_add(u64::from(f.va))
        };
        let payload = vec![f.fill; usize::from(f.payload) % 4200];
        let p = Packet {
            bth: Bth {
                opcode,
                solicited: false,
                mig_req: false,
                pad: 0,
                pkey: wire::DEFAULT_PKEY,
                fecn: false,
                becn: false,
                dest_qp: if f.wrong_qp {
                    self.qp[to] ^ 1
                } else {
                    self.qp[to]
                },
                ack_req: f.ack_req,
                psn,
            },
            reth: opcode.has_reth().then_some(Reth {
                va,
                rkey: if f.good_rkey { self.keys[to] } else { f.rkey },
                dma_len: u32::from(f.dma_len),
            }),
            imm: opcode.has_imm().then_some(f.imm),
            aeth: opcode.has_aeth().then_some(Aeth {
                syndrome: f.syndrome,
                msn: u32::from(f.msn),
            }),
            payload: &payload,
        };
        let mut buf = vec![0u8; 9000];
        if let Ok(n) = wire::encode(&p, &ip, &mut buf) {
            self.deliver(to, from, &buf[..n]);
        }
    }

    fn post(&mut self, p: &Post) {
        let Post {
            e,
            op,
            off,
            len,
            remote_off,
            inline,
            signaled,
        } = *p;
        let e = usize::from(e);
        let opcode = [
            WrOpcode::Send,
            WrOpcode::SendImm,
            WrOpcode::Write,
            WrOpcode::WriteImm,
            WrOpcode::Read,
        ][usize::from(op) % 5];
        let off = usize::from(off) % REGION;
        let len = usize::from(len) % (REGION - off + 1);
        let roff = usize::from(remote_off) % REGION;
        self.wr_id += 1;
        let wr = SendWr {
            wr_id: self.wr_id,
            opcode,
            sge: (len > 0).then_some(Sge {
                addr: self.mem[e].as_ptr() as u64 + off as u64,
                len: len as u32,
                lkey: self.keys[e],
            }),
            inline,
            imm: 7,
            remote_addr: self.mem[1 - e].as_ptr() as u64 + roff as u64,
            rkey: self.keys[1 - e],
            signaled,
        };
        let _ = self.eng[e].post_send(self.qp[e], &wr);
    }

    fn recv(&mut self, e: usize, off: u16, len: u16) {
        let off = usize::from(off) % REGION;
        let len = usize::from(len) % (REGION - off + 1);
        self.wr_id += 1;
        let wr = RecvWr {
            wr_id: self.wr_id,
            sge: (len > 0).then_some(Sge {
                addr: self.mem[e].as_ptr() as u64 + off as u64,
                len: len as u32,
                lkey: self.keys[e],
            }),
        };
        let _ = self.eng[e].post_recv(self.qp[e], &wr);
    }

    fn poll(&mut self) {
        let mut wc = [Wc::EMPTY; 16];
        for e in 0..2 {
            let now = self.now();
            self.eng[e].handle_timeout(now);
            let _ = self.eng[e].poll_timeout();
            while self.eng[e].poll_cq(self.cq[e], &mut wc) > 0 {}
            let _ = self.eng[e].qp_state(self.qp[e]);
            let _ = self.eng[e].stats();
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut w = World::new();
    let mut r = Reader::new(data);
    for _ in 0..64 {
        if r.is_empty() {
            break;
        }
        match &step(&mut r) {
            Step::Raw { to, stranger, data } => {
                let to = usize::from(*to);
                let from = w.from(to, *stranger);
                w.deliver(to, from, data);
            }
            Step::Forged(f) => w.forged(f),
            Step::Pump { drop } => w.pump(*drop),
            Step::Wait { us } => w.t += u64::from(*us),
            Step::Post(p) => w.post(p),
            Step::Recv { e, off, len } => w.recv(usize::from(*e), *off, *len),
            Step::Close { e } => {
                let e = usize::from(*e);
                let now = w.now();
                let _ = w.eng[e].close_qp(w.qp[e], now);
            }
        }
        w.poll();
    }
    w.pump(0);
    w.poll();
    for m in &w.mem {
        assert!(
            m[REGION..].iter().all(|b| *b == 0),
            "a write past the region"
        );
    }
});
