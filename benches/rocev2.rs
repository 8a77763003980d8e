//! The userspace RoCE v2 engine over real UDP on loopback, between two processes (this bench
//! binary starts a copy of itself as the peer): RDMA WRITE streaming of 1 MiB messages, and
//! an 8-byte WRITE_WITH_IMM ping-pong with both sides polling.
//!
//! The peer prints its QP endpoint and memory on stdout, reads ours on stdin, then polls its
//! completion queue forever: it answers every WRITE_WITH_IMM with one of its own (the pong)
//! and acknowledges the streamed writes. The bench kills it at the end.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use roccl::rdma::udp::UserVerbs;
use roccl::rdma::verbs::{
    Access, Mr, QpEndpoint, QpId, RecvWr, SendWr, Sge, Verbs, Wc, WcOpcode, WcStatus, WrOpcode,
};

const MB: usize = 1 << 20;
const PEER_ENV: &str = "ROCCL_BENCH_ROCEV2_PEER";
/// Receives kept posted for the pings.
const RECVS: u64 = 64;

/// One side: its provider, QP, a 1 MiB region and an 8-byte region.
struct Side {
    v: UserVerbs,
    qp: QpId,
    ep: QpEndpoint,
    big: Mr,
    small: Mr,
    _mem: (Vec<u8>, Vec<u8>),
}

fn side() -> Side {
    let v = UserVerbs::with(IpAddr::from([127, 0, 0, 1]), 0, None).unwrap();
    let (qp, ep) = v.create_qp().unwrap();
    let mut big = vec![7u8; MB];
    let mut small = vec![0u8; 64];
    // SAFETY: both buffers live in the returned Side, next to the provider, and are never
    // moved (Vec contents stay put); the process ends before they are freed.
    let (b, s) = unsafe {
        (
            v.reg_mr(big.as_mut_ptr() as u64, MB, Access::ALL).unwrap(),
            v.reg_mr(small.as_mut_ptr() as u64, 64, Access::ALL)
                .unwrap(),
        )
    };
    Side {
        v,
        qp,
        ep,
        big: b,
        small: s,
        _mem: (big, small),
    }
}

/// "addr qpn psn mtu big_addr big_rkey small_addr small_rkey"
fn describe(s: &Side) -> String {
    format!(
        "{} {} {} {} {} {} {} {}\n",
        s.ep.addr, s.ep.qpn, s.ep.psn, s.ep.mtu, s.big.addr, s.big.rkey, s.small.addr, s.small.rkey
    )
}

/// The peer's endpoint and its (big, small) regions as (address, rkey).
fn parse(line: &str) -> (QpEndpoint, (u64, u32), (u64, u32)) {
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f.len(), 8, "bad peer line {line:?}");
    let ep = QpEndpoint {
        addr: f[0].parse::<SocketAddr>().unwrap(),
        qpn: f[1].parse().unwrap(),
        psn: f[2].parse().unwrap(),
        mtu: f[3].parse().unwrap(),
        engine: true,
    };
    (
        ep,
        (f[4].parse().unwrap(), f[5].parse().unwrap()),
        (f[6].parse().unwrap(), f[7].parse().unwrap()),
    )
}

fn write_imm(s: &Side, wr_id: u64, to: (u64, u32)) -> SendWr {
    SendWr {
        wr_id,
        opcode: WrOpcode::WriteImm,
        sge: Some(Sge {
            addr: s.small.addr,
            len: 8,
            lkey: s.small.lkey,
        }),
        inline: true,
        imm: 1,
        remote_addr: to.0,
        rkey: to.1,
        signaled: false,
    }
}

/// The peer process: answer pings until killed.
fn peer() {
    let s = side();
    let mut out = std::io::stdout();
    out.write_all(describe(&s).as_bytes()).unwrap();
    out.flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let (ep, _, small) = parse(&line);
    s.v.connect_qp(s.qp, &ep).unwrap();
    for i in 0..RECVS {
        s.v.post_recv(
            s.qp,
            &RecvWr {
                wr_id: i,
                sge: None,
            },
        )
        .unwrap();
    }
    let mut wcs = [Wc::EMPTY; 16];
    let mut n = 0u64;
    loop {
        let k = s.v.poll_cq(s.qp, &mut wcs).unwrap();
        for w in &wcs[..k] {
            assert_eq!(w.status, WcStatus::Success, "peer: {w:?}");
            if w.opcode == WcOpcode::RecvRdmaWithImm {
                s.v.post_send(s.qp, &write_imm(&s, n, small)).unwrap();
                s.v.post_recv(
                    s.qp,
                    &RecvWr {
                        wr_id: n,
                        sge: None,
                    },
                )
                .unwrap();
                n += 1;
            }
        }
    }
}

fn start_peer(me: &Side) -> (Child, (u64, u32), (u64, u32)) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .env(PEER_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let (ep, big, small) = parse(&line);
    let stdin = child.stdin.as_mut().unwrap();
    stdin.write_all(describe(me).as_bytes()).unwrap();
    stdin.flush().unwrap();
    me.v.connect_qp(me.qp, &ep).unwrap();
    (child, big, small)
}

fn bench(c: &mut Criterion) {
    let me = side();
    let (mut child, peer_big, peer_small) = start_peer(&me);
    let mut g = c.benchmark_group("rocev2_userspace_2proc");
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(10);
    g.throughput(Throughput::Bytes(MB as u64));
    g.bench_function("write_1MiB_streaming", |bn| {
        bn.iter_custom(|iters| {
            let t = Instant::now();
            let (mut posted, mut done) = (0u64, 0u64);
            let mut wcs = [Wc::EMPTY; 16];
            while done < iters {
                while posted < iters && posted - done < 4 {
                    let wr = SendWr {
                        wr_id: posted,
                        opcode: WrOpcode::Write,
                        sge: Some(Sge {
                            addr: me.big.addr,
                            len: MB as u32,
                            lkey: me.big.lkey,
                        }),
                        inline: false,
                        imm: 0,
                        remote_addr: peer_big.0,
                        rkey: peer_big.1,
                        signaled: true,
                    };
                    me.v.post_send(me.qp, &wr).unwrap();
                    posted += 1;
                }
                let k = me.v.poll_cq(me.qp, &mut wcs).unwrap();
                for w in &wcs[..k] {
                    assert_eq!(w.status, WcStatus::Success);
                }
                done += k as u64;
            }
            t.elapsed()
        })
    });
    g.throughput(Throughput::Elements(1));
    g.bench_function("write_imm_8B_pingpong_rtt", |bn| {
        bn.iter_custom(|iters| {
            let mut wcs = [Wc::EMPTY; 16];
            let t = Instant::now();
            for i in 0..iters {
                me.v.post_recv(
                    me.qp,
                    &RecvWr {
                        wr_id: i,
                        sge: None,
                    },
                )
                .unwrap();
                me.v.post_send(me.qp, &write_imm(&me, i, peer_small))
                    .unwrap();
                'pong: loop {
                    let k = me.v.poll_cq(me.qp, &mut wcs).unwrap();
                    for w in &wcs[..k] {
                        assert_eq!(w.status, WcStatus::Success);
                        if w.opcode == WcOpcode::RecvRdmaWithImm {
                            break 'pong;
                        }
                    }
                }
            }
            t.elapsed()
        })
    });
    g.finish();
    let _ = child.kill();
    let _ = child.wait();
}

fn main() {
    if std::env::var_os(PEER_ENV).is_some() {
        peer();
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
