//! The harness of the engine tests: two RC engines (`Pair`) joined by a link that drops,
//! duplicates, reorders and corrupts datagrams, driven in virtual time (`now`), as
//! quinn-proto's tests drive its connections; workloads and packet injection on top.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crate::rdma::engine::*;
use crate::rdma::mem::Access;

pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(super) fn chance(&mut self, p: f64) -> bool {
        (self.next() % 1_000_000) as f64 / 1e6 < p
    }
}

#[derive(Clone, Copy, Default)]
pub(super) struct Faults {
    pub(super) drop: f64,
    pub(super) dup: f64,
    pub(super) reorder: f64,
    pub(super) corrupt: f64,
}

pub(super) struct InFlight {
    pub(super) at: u64,
    pub(super) to: usize,
    pub(super) from: SocketAddr,
    pub(super) data: Vec<u8>,
}

pub(super) struct Pair {
    pub(super) eng: [Engine; 2],
    pub(super) cq: [CqId; 2],
    pub(super) qp: [Qpn; 2],
    pub(super) t0: Instant,
    pub(super) t: u64,
    pub(super) link: Vec<InFlight>,
    pub(super) rng: Rng,
    pub(super) faults: Faults,
    /// Drop everything (a dead link).
    pub(super) cut: bool,
    /// Drop engine 0's requests from this PSN on.
    pub(super) drop_psn_from: Option<u32>,
    /// Drop engine 1's positive acknowledgements (NAKs pass).
    pub(super) drop_acks: bool,
    /// Link speed in bytes per µs (0: unlimited) and when each direction is free again:
    /// a datagram waits for the ones before it to leave.
    pub(super) bytes_per_us: u64,
    pub(super) busy_until: [u64; 2],
    /// Engine 0's request PSNs lost at their first transmission only.
    pub(super) lose_once: Vec<u32>,
    /// Everything engine 1 sends is lost until this virtual time (µs).
    pub(super) mute_1_until: u64,
    /// Engine 1 is descheduled until this virtual time (µs): it neither receives (its
    /// datagrams wait, as in a socket buffer), sends nor runs its timers.
    pub(super) stall_1_until: u64,
    /// What left the engines, by kind (see [`Tally`]).
    pub(super) tally: Tally,
}

/// Packets that left the engines: roccl reports (opcode 0xC0), and acknowledgements that
/// carry a syndrome IBTA reserves (none may: a NIC would take them as malformed).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Tally {
    pub(super) reports: u64,
    pub(super) reserved_acks: u64,
}

impl Tally {
    pub(super) fn note(&mut self, datagram: &[u8]) {
        let op = datagram[0];
        if op == crate::rdma::wire::Opcode::Report as u8 {
            self.reports += 1;
        } else if op == crate::rdma::wire::Opcode::Ack as u8 && datagram[12] & 0xe0 == 0x40 {
            // The AETH follows the 12-byte BTH.
            self.reserved_acks += 1;
        }
    }
}

pub(super) const IPS: [[u8; 4]; 2] = [[10, 0, 0, 1], [10, 0, 0, 2]];

impl Pair {
    pub(super) fn new(seed: u64, faults: Faults, attr: QpAttr) -> Pair {
        Pair::build(seed, faults, attr, None)
    }

    /// `any`: `None`, each engine on its address; `Some(sourced)`, each engine on every
    /// address (unspecified), its QP given its address (`set_qp_source`) when `sourced`.
    pub(super) fn build(seed: u64, faults: Faults, attr: QpAttr, any: Option<bool>) -> Pair {
        let mk = |i: usize| match any {
            None => Engine::new(IpAddr::from(IPS[i]), 4791),
            Some(_) => Engine::new(IpAddr::from([0u8; 4]), 4791),
        };
        let mut eng = [mk(0), mk(1)];
        let cq = [eng[0].create_cq(), eng[1].create_cq()];
        let qp = [
            eng[0].create_qp(cq[0], cq[0], 50_000).unwrap(),
            eng[1].create_qp(cq[1], cq[1], 50_001).unwrap(),
        ];
        if any == Some(true) {
            for i in 0..2 {
                eng[i].set_qp_source(qp[i], IpAddr::from(IPS[i])).unwrap();
            }
        }
        // Start PSNs near the 24-bit wrap to exercise it.
        let psn = [0x00ff_fff0u32, 0x00ff_ff00];
        for i in 0..2 {
            let j = 1 - i;
            let a = QpAttr {
                dest: SocketAddr::from((IPS[j], 4791)),
                dest_qpn: qp[j],
                rq_psn: psn[j],
                sq_psn: psn[i],
                ..attr
            };
            eng[i].modify_qp(qp[i], QpState::Init, &a).unwrap();
            eng[i].modify_qp(qp[i], QpState::Rtr, &a).unwrap();
            eng[i].modify_qp(qp[i], QpState::Rts, &a).unwrap();
        }
        Pair {
            eng,
            cq,
            qp,
            t0: Instant::now(),
            t: 0,
            link: Vec::new(),
            rng: Rng(seed | 1),
            faults,
            cut: false,
            drop_psn_from: None,
            drop_acks: false,
            bytes_per_us: 0,
            busy_until: [0; 2],
            lose_once: Vec::new(),
            mute_1_until: 0,
            stall_1_until: 0,
            tally: Tally::default(),
        }
    }

    pub(super) fn now(&self) -> Instant {
        self.t0 + Duration::from_micros(self.t)
    }

    /// One round: transmit everything, deliver what is due, or jump to the next event.
    pub(super) fn step(&mut self) {
        let now = self.now();
        let mut buf = vec![0u8; 9000];
        let mut moved = false;
        let stalled = self.t < self.stall_1_until;
        for (e, ip) in IPS.iter().enumerate() {
            if e == 1 && stalled {
                continue;
            }
            while let Some(tx) = self.eng[e].poll_transmit(now, &mut buf) {
                moved = true;
                self.tally.note(&buf[..tx.len]);
                let from = SocketAddr::new(IpAddr::from(*ip), tx.src_port);
                let to = IPS
                    .iter()
                    .position(|ip| IpAddr::from(*ip) == tx.dest.ip())
                    .expect("known peer");
                if self.cut || self.rng.chance(self.faults.drop) || self.filtered(e, &buf[..tx.len])
                {
                    continue;
                }
                let mut data = buf[..tx.len].to_vec();
                if self.rng.chance(self.faults.corrupt) {
                    let i = (self.rng.next() as usize) % data.len();
                    data[i] ^= 1 << (self.rng.next() % 8);
                }
                let mut delay = if self.rng.chance(self.faults.reorder) {
                    5 + self.rng.next() % 200
                } else {
                    5
                };
                if self.bytes_per_us > 0 {
                    // Serialise: leave after the datagrams queued before this one.
                    let start = self.busy_until[e].max(self.t);
                    self.busy_until[e] = start + (data.len() as u64).div_ceil(self.bytes_per_us);
                    delay += self.busy_until[e] - self.t;
                }
                if self.rng.chance(self.faults.dup) {
                    self.link.push(InFlight {
                        at: self.t + delay + 3,
                        to,
                        from,
                        data: data.clone(),
                    });
                }
                self.link.push(InFlight {
                    at: self.t + delay,
                    to,
                    from,
                    data,
                });
            }
        }
        let due: Vec<InFlight> = {
            let (d, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.link)
                .into_iter()
                .partition(|p| p.at <= self.t && !(p.to == 1 && stalled));
            self.link = keep;
            d
        };
        for p in due {
            moved = true;
            self.eng[p.to].handle_datagram(now, p.from, &p.data);
        }
        if !moved {
            let stall = self.stall_1_until;
            let next_packet = self
                .link
                .iter()
                .map(|p| if p.to == 1 { p.at.max(stall) } else { p.at })
                .min();
            let next_timer = self
                .eng
                .iter()
                .filter_map(|e| e.poll_timeout())
                .min()
                .map(|i| (i.saturating_duration_since(self.t0).as_micros() as u64).max(self.t + 1));
            self.t = match (next_packet, next_timer) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => self.t + 1000,
            };
            let now = self.now();
            let stalled = self.t < self.stall_1_until;
            for (i, e) in self.eng.iter_mut().enumerate() {
                if i == 0 || !stalled {
                    e.handle_timeout(now);
                }
            }
        } else {
            self.t += 1;
        }
    }

    /// Whether the targeted drops (`drop_psn_from`, `drop_acks`, `lose_once`,
    /// `mute_1_until`) take this datagram.
    pub(super) fn filtered(&mut self, from: usize, d: &[u8]) -> bool {
        let opcode = d[0];
        let psn = u32::from_be_bytes([0, d[9], d[10], d[11]]);
        if from == 1 && self.t < self.mute_1_until {
            return true;
        }
        if from == 0 && opcode != 0x11 {
            if let Some(i) = self.lose_once.iter().position(|&p| p == psn) {
                self.lose_once.swap_remove(i);
                return true;
            }
        }
        match from {
            0 => opcode != 0x11 && self.drop_psn_from.is_some_and(|p| psn_diff(psn, p) >= 0),
            _ => self.drop_acks && opcode == 0x11 && d[12] >> 5 == 0,
        }
    }

    pub(super) fn run_until(&mut self, mut done: impl FnMut(&mut Pair) -> bool) {
        for _ in 0..5_000_000 {
            if done(self) {
                return;
            }
            self.step();
        }
        panic!(
            "simulation did not finish (t = {} µs): states {:?} {:?}, stats {:?} {:?}",
            self.t,
            self.eng[0].qp_state(self.qp[0]),
            self.eng[1].qp_state(self.qp[1]),
            self.eng[0].stats(),
            self.eng[1].stats()
        );
    }

    pub(super) fn reg(&mut self, e: usize, buf: &mut [u8], access: Access) -> u32 {
        // SAFETY: every test keeps its buffers alive until the simulation ends.
        unsafe {
            self.eng[e]
                .mrs
                .register(buf.as_mut_ptr() as usize, buf.len(), access)
        }
        .unwrap()
    }

    pub(super) fn drain(&mut self, e: usize, out: &mut Vec<Wc>) {
        let mut w = [Wc::EMPTY; 16];
        loop {
            let n = self.eng[e].poll_cq(self.cq[e], &mut w);
            if n == 0 {
                return;
            }
            out.extend_from_slice(&w[..n]);
        }
    }
}

pub(super) fn psn_diff(a: u32, b: u32) -> i32 {
    ((a.wrapping_sub(b) & 0x00ff_ffff) << 8) as i32 >> 8
}

pub(super) fn attr(mtu: u32) -> QpAttr {
    QpAttr {
        mtu,
        timeout: 8,
        retry_cnt: 7,
        rnr_retry: 7,
        min_rnr_timer: 1,
        ..QpAttr::default()
    }
}

pub(super) fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131 + seed * 7919) >> 3) as u8)
        .collect()
}

/// Sends, writes, writes with immediate and reads of many sizes through a bad link: each
/// delivered exactly once, in order, bit-exact.
pub(super) fn lossy_workload(seed: u64, faults: Faults) -> Stats {
    lossy_workload_with(seed, faults, attr(1024)).0
}

/// [`lossy_workload`] with QP attributes `a`; also returns the virtual time it took (µs).
pub(super) fn lossy_workload_with(seed: u64, faults: Faults, a: QpAttr) -> (Stats, u64) {
    let (st, t, _) = lossy_workload_tally(seed, faults, a);
    (st, t)
}

/// [`lossy_workload_with`], also returning what left the engines.
pub(super) fn lossy_workload_tally(seed: u64, faults: Faults, a: QpAttr) -> (Stats, u64, Tally) {
    let mut s = Pair::new(seed, faults, a);
    let sizes = [0usize, 1, 3, 1023, 1024, 1025, 4096, 5000, 20_000, 7];
    const N: usize = 80;
    let mut srcs: Vec<Vec<u8>> = (0..N).map(|i| pattern(i, sizes[i % sizes.len()])).collect();
    let mut recv_bufs: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; 20_000]).collect();
    let mut target = vec![0u8; N * 20_000];
    let mut read_src = pattern(999, 20_016);
    let mut read_dst: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; 20_000]).collect();
    let src_keys: Vec<u32> = srcs
        .iter_mut()
        .map(|b| s.reg(0, b, Access::LOCAL_WRITE))
        .collect();
    let dst_keys: Vec<u32> = read_dst
        .iter_mut()
        .map(|b| s.reg(0, b, Access::LOCAL_WRITE))
        .collect();
    let recv_keys: Vec<u32> = recv_bufs
        .iter_mut()
        .map(|b| s.reg(1, b, Access::LOCAL_WRITE))
        .collect();
    let tkey = s.reg(1, &mut target, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let rkey = s.reg(1, &mut read_src, Access::REMOTE_READ);
    for (i, b) in recv_bufs.iter().enumerate() {
        let sge = Sge {
            addr: b.as_ptr() as u64,
            len: b.len() as u32,
            lkey: recv_keys[i],
        };
        s.eng[1]
            .post_recv(
                s.qp[1],
                &RecvWr {
                    wr_id: 1000 + i as u64,
                    sge: Some(sge),
                },
            )
            .unwrap();
    }
    let mut expect_recv = Vec::new(); // (message index, len, imm)
    for i in 0..N {
        let len = srcs[i].len();
        let op = [
            WrOpcode::Send,
            WrOpcode::Write,
            WrOpcode::WriteImm,
            WrOpcode::Read,
            WrOpcode::SendImm,
        ][i % 5];
        let sge = if op == WrOpcode::Read {
            Some(Sge {
                addr: read_dst[i].as_ptr() as u64,
                len: len as u32,
                lkey: dst_keys[i],
            })
        } else {
            Some(Sge {
                addr: srcs[i].as_ptr() as u64,
                len: len as u32,
                lkey: src_keys[i],
            })
        };
        let (remote_addr, rk) = match op {
            WrOpcode::Read => (read_src.as_ptr() as u64 + (i % 7) as u64, rkey),
            _ => (target.as_ptr() as u64 + (i * 20_000) as u64, tkey),
        };
        let wr = SendWr {
            wr_id: i as u64,
            opcode: op,
            sge,
            inline: len <= 16 && op != WrOpcode::Read,
            imm: 0xabc0_0000 + i as u32,
            remote_addr,
            rkey: rk,
            signaled: true,
        };
        s.eng[0].post_send(s.qp[0], &wr).unwrap();
        if matches!(op, WrOpcode::Send | WrOpcode::SendImm | WrOpcode::WriteImm) {
            let imm = (op != WrOpcode::Send).then_some(0xabc0_0000 + i as u32);
            expect_recv.push((i, len, imm, op));
        }
    }
    let mut a = Vec::new();
    let mut b = Vec::new();
    s.run_until(|s| {
        s.drain(0, &mut a);
        s.drain(1, &mut b);
        a.len() == N && b.len() == expect_recv.len()
    });
    check_workload(
        &a,
        &b,
        &expect_recv,
        (&srcs, &recv_bufs, &target, &read_src, &read_dst),
    );
    let st = [s.eng[0].stats(), s.eng[1].stats()];
    drop((srcs, recv_bufs, target, read_src, read_dst));
    let st = Stats {
        icrc_errors: st[0].icrc_errors + st[1].icrc_errors,
        retransmits: st[0].retransmits + st[1].retransmits,
        duplicates: st[0].duplicates + st[1].duplicates,
        out_of_sequence: st[0].out_of_sequence + st[1].out_of_sequence,
        ..st[0]
    };
    (st, s.t, s.tally)
}

/// One message of the lossy workload a receive completes: its index, length, immediate
/// and opcode.
pub(super) type Expected = (usize, usize, Option<u32>, WrOpcode);

/// The lossy workload's checks: every request completed in order, every message arrived
/// once, in order, whole, and the writes and reads moved the right bytes. `bufs`: the send
/// sources, the receive buffers, the write target, the read source and the read targets.
#[allow(clippy::type_complexity)]
fn check_workload(
    a: &[Wc],
    b: &[Wc],
    expect_recv: &[Expected],
    (srcs, recv_bufs, target, read_src, read_dst): (
        &[Vec<u8>],
        &[Vec<u8>],
        &[u8],
        &[u8],
        &[Vec<u8>],
    ),
) {
    // Sender: every request completed successfully, in order.
    for (i, w) in a.iter().enumerate() {
        assert_eq!(
            (w.wr_id, w.status),
            (i as u64, WcStatus::Success),
            "sender completion {i}"
        );
    }
    // Receiver: one completion per message, in order, with the right length and data.
    for (k, (w, &(i, len, imm, op))) in b.iter().zip(expect_recv).enumerate() {
        assert_eq!(w.status, WcStatus::Success, "receive {k}");
        assert_eq!(w.wr_id, 1000 + k as u64, "receives are consumed in order");
        assert_eq!(w.byte_len as usize, len, "message {i} length");
        assert_eq!(w.imm, imm, "message {i} immediate");
        let expect_op = if op == WrOpcode::WriteImm {
            WcOpcode::RecvRdmaWithImm
        } else {
            WcOpcode::Recv
        };
        assert_eq!(w.opcode, expect_op);
        if op != WrOpcode::WriteImm {
            assert_eq!(&recv_bufs[k][..len], &srcs[i][..], "message {i} payload");
        }
    }
    for i in 0..srcs.len() {
        let len = srcs[i].len();
        match i % 5 {
            1 | 2 => assert_eq!(
                &target[i * 20_000..i * 20_000 + len],
                &srcs[i][..],
                "write {i}"
            ),
            3 => assert_eq!(
                &read_dst[i][..len],
                &read_src[i % 7..i % 7 + len],
                "read {i}"
            ),
            _ => {}
        }
    }
}

/// A write of `len` bytes from engine 0 into a fresh buffer of engine 1, posted.
pub(super) fn post_write(s: &mut Pair, src: &mut [u8], dst: &mut [u8]) {
    let k = s.reg(0, src, Access::LOCAL_WRITE);
    let rk = s.reg(1, dst, Access::ALL);
    let wr = SendWr {
        wr_id: 1,
        opcode: WrOpcode::Write,
        sge: Some(Sge {
            addr: src.as_ptr() as u64,
            len: src.len() as u32,
            lkey: k,
        }),
        inline: false,
        imm: 0,
        remote_addr: dst.as_ptr() as u64,
        rkey: rk,
        signaled: true,
    };
    s.eng[0].post_send(s.qp[0], &wr).unwrap();
}

/// Write `src` into `dst` through the simulation and wait for the completion, which must
/// be a success with `dst` equal to `src`.
pub(super) fn write_through(s: &mut Pair, src: &mut [u8], dst: &mut [u8]) {
    post_write(s, src, dst);
    let mut w = Vec::new();
    s.run_until(|s| {
        s.drain(0, &mut w);
        !w.is_empty()
    });
    assert_eq!(w[0].status, WcStatus::Success);
    assert!(dst == src, "{}-byte write corrupted", src.len());
}

/// Hand engine 0 an acknowledgement `aeth` for `psn` that claims to come from `from` (ICRC
/// and all, at engine 0's QP number).
pub(super) fn inject_ack(s: &mut Pair, from: SocketAddr, aeth: crate::rdma::wire::Aeth, psn: u32) {
    use crate::rdma::wire;
    let p = wire::Packet {
        bth: wire::Bth {
            opcode: wire::Opcode::Ack,
            solicited: false,
            mig_req: false,
            pad: 0,
            pkey: wire::DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp: s.qp[0],
            ack_req: false,
            psn,
        },
        reth: None,
        imm: None,
        aeth: Some(aeth),
        payload: &[],
    };
    inject(s, 0, from, &p);
}

/// Hand engine `e` the packet `p` from `from`, ICRC and all, as its socket would.
pub(super) fn inject(s: &mut Pair, e: usize, from: SocketAddr, p: &crate::rdma::wire::Packet<'_>) {
    let ip = crate::rdma::wire::IpInfo {
        src: from.ip(),
        dst: IpAddr::from(IPS[e]),
        src_port: from.port(),
        dst_port: 4791,
    };
    let mut buf = [0u8; 256];
    let n = crate::rdma::wire::encode(p, &ip, &mut buf).unwrap();
    let now = s.now();
    s.eng[e].handle_datagram(now, from, &buf[..n]);
}

/// Hand engine 0 a sequence-error NAK from engine 1 for PSN `psn`.
pub(super) fn inject_nak(s: &mut Pair, psn: u32) {
    use crate::rdma::wire;
    let from = SocketAddr::from((IPS[1], 50_001));
    inject_ack(
        s,
        from,
        wire::Aeth::nak(0, wire::NakCode::PsnSequenceError),
        psn,
    );
}

/// QP attributes as the userspace provider sets them (selective, retry until a deadline).
pub(super) fn provider_attr() -> QpAttr {
    QpAttr {
        selective: true,
        retry_for: Some(Duration::from_secs(30)),
        timeout: 12,
        ..attr(4096)
    }
}

/// A `len`-byte write through a 2 GB/s, 5 µs link losing engine 0's packets at the PSN
/// offsets `lose` (first transmission only) and everything engine 1 sends until `mute`
/// µs; returns the virtual time until its completion and the packets resent.
pub(super) fn timed_write(len: usize, lose: &[u32], mute: u64) -> (u64, u64) {
    let mut s = Pair::new(1, Faults::default(), provider_attr());
    s.bytes_per_us = 2000;
    // Time one round trip first, as a running QP would have (the tail-loss probe and
    // the timer follow the measured round trip).
    write_through(&mut s, &mut [7u8; 64], &mut [0u8; 64]);
    // Pair::new's first send PSN of engine 0, plus the one packet just written.
    let first = 0x00ff_fff0u32 + 1;
    s.lose_once = lose.iter().map(|o| (first + o) & 0x00ff_ffff).collect();
    let mut src = pattern(9, len);
    let mut dst = vec![0u8; len];
    let t0 = s.t;
    s.mute_1_until = t0 + mute;
    let resent0 = s.eng[0].stats().retransmits;
    write_through(&mut s, &mut src, &mut dst);
    (s.t - t0, s.eng[0].stats().retransmits - resent0)
}
