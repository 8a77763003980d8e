//! The userspace RoCE v2 engine over real UDP on loopback, two providers in one process:
//! RDMA WRITE streaming of 1 MiB messages and an 8-byte WRITE_WITH_IMM ping-pong.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use roccl::rdma::udp::UserVerbs;
use roccl::rdma::verbs::{
    Access, QpId, RecvWr, SendWr, Sge, Verbs, Wc, WcOpcode, WcStatus, WrOpcode,
};

const EMPTY: Wc = Wc {
    wr_id: 0,
    status: WcStatus::Success,
    opcode: WcOpcode::Send,
    byte_len: 0,
    imm: None,
    qpn: 0,
};

fn wait(v: &UserVerbs, qp: QpId, n: usize) {
    let mut got = 0;
    let mut wcs = [EMPTY; 16];
    while got < n {
        let k = v.poll_cq(qp, &mut wcs).unwrap();
        for w in &wcs[..k] {
            assert_eq!(w.status, WcStatus::Success);
        }
        got += k;
    }
}

fn bench(c: &mut Criterion) {
    let lo = std::net::IpAddr::from([127, 0, 0, 1]);
    let a = UserVerbs::with(lo, 0, None).unwrap();
    let b = UserVerbs::with(lo, 0, None).unwrap();
    let (qa, ea) = a.create_qp().unwrap();
    let (qb, eb) = b.create_qp().unwrap();
    a.connect_qp(qa, &eb).unwrap();
    b.connect_qp(qb, &ea).unwrap();
    const MB: usize = 1 << 20;
    let mut src = vec![7u8; MB];
    let mut dst = vec![0u8; MB];
    let mut small_a = vec![0u8; 64];
    let mut small_b = vec![0u8; 64];
    // SAFETY: all buffers outlive the providers' use (they are dropped after `a` and `b`
    // stop being used at the end of this function).
    let (ms, md, msa, msb) = unsafe {
        (
            a.reg_mr(src.as_mut_ptr() as u64, MB, Access::LOCAL_WRITE)
                .unwrap(),
            b.reg_mr(
                dst.as_mut_ptr() as u64,
                MB,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )
            .unwrap(),
            a.reg_mr(small_a.as_mut_ptr() as u64, 64, Access::ALL)
                .unwrap(),
            b.reg_mr(small_b.as_mut_ptr() as u64, 64, Access::ALL)
                .unwrap(),
        )
    };
    let mut g = c.benchmark_group("rocev2_userspace");
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(10);
    g.throughput(Throughput::Bytes(MB as u64));
    g.bench_function("write_1MiB_streaming", |bn| {
        bn.iter_custom(|iters| {
            let t = Instant::now();
            let mut posted = 0u64;
            let mut done = 0u64;
            let mut wcs = [EMPTY; 16];
            while done < iters {
                while posted < iters && posted - done < 4 {
                    let wr = SendWr {
                        wr_id: posted,
                        opcode: WrOpcode::Write,
                        sge: Some(Sge {
                            addr: ms.addr,
                            len: MB as u32,
                            lkey: ms.lkey,
                        }),
                        inline: false,
                        imm: 0,
                        remote_addr: md.addr,
                        rkey: md.rkey,
                        signaled: true,
                    };
                    a.post_send(qa, &wr).unwrap();
                    posted += 1;
                }
                done += a.poll_cq(qa, &mut wcs).unwrap() as u64;
                b.poll_cq(qb, &mut wcs).unwrap();
            }
            t.elapsed()
        })
    });
    g.throughput(Throughput::Elements(1));
    g.bench_function("write_imm_8B_pingpong_rtt", |bn| {
        bn.iter_custom(|iters| {
            let t = Instant::now();
            for i in 0..iters {
                let post = |v: &UserVerbs,
                            qp,
                            mr: &roccl::rdma::verbs::Mr,
                            rmr: &roccl::rdma::verbs::Mr| {
                    v.post_send(
                        qp,
                        &SendWr {
                            wr_id: i,
                            opcode: WrOpcode::WriteImm,
                            sge: Some(Sge {
                                addr: mr.addr,
                                len: 8,
                                lkey: mr.lkey,
                            }),
                            inline: true,
                            imm: 1,
                            remote_addr: rmr.addr,
                            rkey: rmr.rkey,
                            signaled: false,
                        },
                    )
                    .unwrap();
                };
                b.post_recv(
                    qb,
                    &RecvWr {
                        wr_id: i,
                        sge: None,
                    },
                )
                .unwrap();
                a.post_recv(
                    qa,
                    &RecvWr {
                        wr_id: i,
                        sge: None,
                    },
                )
                .unwrap();
                post(&a, qa, &msa, &msb);
                wait(&b, qb, 1);
                post(&b, qb, &msb, &msa);
                wait(&a, qa, 1);
            }
            t.elapsed()
        })
    });
    g.finish();
    drop((a, b));
    drop((src, dst, small_a, small_b));
}

criterion_group!(benches, bench);
criterion_main!(benches);
