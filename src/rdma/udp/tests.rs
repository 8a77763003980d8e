//! Tests of the userspace provider over loopback UDP: offloads, wake-ups, the progress
//! thread's takeover, QP teardown, path MTU.

use super::*;
use crate::rdma::engine::{Sge, WcStatus, WrOpcode};

/// Write `len` bytes from one provider to another over loopback and return both providers'
/// socket counters (sender, receiver).
fn write_over_loopback(offload: bool, len: usize) -> (UdpStats, UdpStats) {
    let lo = IpAddr::from([127, 0, 0, 1]);
    let a = UserVerbs::with_offload(lo, 0, None, offload).unwrap();
    let b = UserVerbs::with_offload(lo, 0, None, offload).unwrap();
    let (qa, ea) = a.create_qp().unwrap();
    let (qb, eb) = b.create_qp().unwrap();
    a.connect_qp(qa, &eb).unwrap();
    b.connect_qp(qb, &ea).unwrap();
    let mut src: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4099) as u8).collect();
    let mut dst = vec![0u8; len];
    // SAFETY: both buffers outlive the providers' use of them (the regions are only
    // used until the completion below, and the providers are dropped before the buffers).
    let (ms, md) = unsafe {
        (
            a.reg_mr(src.as_mut_ptr() as u64, len, Access::LOCAL_WRITE)
                .unwrap(),
            b.reg_mr(
                dst.as_mut_ptr() as u64,
                len,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )
            .unwrap(),
        )
    };
    b.post_recv(
        qb,
        &RecvWr {
            wr_id: 9,
            sge: None,
        },
    )
    .unwrap();
    a.post_send(
        qa,
        &SendWr {
            wr_id: 1,
            opcode: WrOpcode::WriteImm,
            sge: Some(Sge {
                addr: ms.addr,
                len: len as u32,
                lkey: ms.lkey,
            }),
            inline: false,
            imm: 77,
            remote_addr: md.addr,
            rkey: md.rkey,
            signaled: true,
        },
    )
    .unwrap();
    let empty = Wc::EMPTY;
    let (mut sent, mut got) = (false, false);
    let start = Instant::now();
    while !(sent && got) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "write did not complete"
        );
        let mut w = [empty; 4];
        let n = a.poll_cq(qa, &mut w).unwrap();
        for c in &w[..n] {
            assert_eq!((c.status, c.wr_id), (WcStatus::Success, 1));
            sent = true;
        }
        let n = b.poll_cq(qb, &mut w).unwrap();
        for c in &w[..n] {
            assert_eq!(c.status, WcStatus::Success);
            assert_eq!((c.wr_id, c.imm, c.byte_len), (9, Some(77), len as u32));
            got = true;
        }
    }
    assert!(dst == src, "data arrived corrupted");
    assert_eq!(b.stats().icrc_errors, 0);
    let stats = (a.udp_stats(), b.udp_stats());
    drop((a, b));
    stats
}

pub(super) fn connected(a: &UserVerbs, b: &UserVerbs) -> (QpId, QpId) {
    let (qa, ea) = a.create_qp().unwrap();
    let (qb, eb) = b.create_qp().unwrap();
    a.connect_qp(qa, &eb).unwrap();
    b.connect_qp(qb, &ea).unwrap();
    (qa, qb)
}

/// A zero-length write with immediate from `qa` to `qb` (`b` has a receive posted).
pub(super) fn ping(a: &UserVerbs, qa: QpId, b: &UserVerbs, qb: QpId, id: u64) {
    b.post_recv(
        qb,
        &RecvWr {
            wr_id: id,
            sge: None,
        },
    )
    .unwrap();
    let wr = SendWr {
        wr_id: id,
        opcode: WrOpcode::WriteImm,
        sge: None,
        inline: false,
        imm: 5,
        remote_addr: 0,
        rkey: 0,
        signaled: true,
    };
    a.post_send(qa, &wr).unwrap();
}

/// The progress thread takes a datagram off the shared socket and
/// fills a completion queue while the application sleeps in poll(2) on the QP's
/// descriptors; the application must be woken (the socket itself stays quiet).
#[test]
fn a_completion_wakes_a_thread_asleep_on_its_qp() {
    let lo = IpAddr::from([127, 0, 0, 1]);
    let a = UserVerbs::with_offload(lo, 0, None, false).unwrap();
    let b = UserVerbs::with_offload(lo, 0, None, false).unwrap();
    let (qa, qb) = connected(&a, &b);
    // The application is about to sleep on b's QP: it takes the descriptors.
    let mut fds = Vec::new();
    b.qp_fds(qb, &mut fds);
    ping(&a, qa, &b, qb, 3);
    // Nobody polls b: its progress thread receives the write (and fills the queue),
    // leaving the socket empty.
    let start = Instant::now();
    while b.stats().rx_packets == 0 {
        assert!(start.elapsed() < Duration::from_secs(20), "nothing arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|f| libc::pollfd {
            fd: f.fd,
            events: f.events,
            revents: 0,
        })
        .collect();
    // SAFETY: `p` is a valid pollfd array for the duration of the call.
    let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, 5000) };
    assert!(
        r > 0,
        "a thread asleep on the QP's descriptors was not woken though its completion is ready"
    );
    let mut w = [Wc::EMPTY; 4];
    assert_eq!(b.poll_cq(qb, &mut w).unwrap(), 1);
    assert_eq!((w[0].wr_id, w[0].imm), (3, Some(5)));
    // Taken: the descriptor is quiet again (no busy wake-ups).
    let mut fds = Vec::new();
    b.qp_fds(qb, &mut fds);
    let wake = fds.last().unwrap().fd;
    let mut p = libc::pollfd {
        fd: wake,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::poll(&mut p, 1, 0) }, 0, "still readable");
}

/// The progress thread leaves the engine to an application that polls more often than
/// the takeover time, and takes over when it polls less often.
#[test]
fn the_progress_thread_takes_over_only_from_a_quiet_application() {
    let lo = IpAddr::from([127, 0, 0, 1]);
    let open = |takeover| {
        let settings = EngineSettings {
            port: 0,
            takeover,
            ..EngineSettings::default()
        };
        UserVerbs::open(lo, &settings).unwrap()
    };
    // Polls every `gap` for 40 ms: the progress thread's rounds meanwhile, and the
    // longest time the application really stayed away.
    let rounds = |a: &UserVerbs, qa: QpId, gap: Duration| {
        let mut w = [Wc::EMPTY; 4];
        let before = a.udp_stats().background;
        let (start, mut last, mut longest) = (Instant::now(), Instant::now(), Duration::ZERO);
        while start.elapsed() < Duration::from_millis(40) {
            a.poll_cq(qa, &mut w).unwrap();
            longest = longest.max(last.elapsed());
            last = Instant::now();
            std::thread::sleep(gap);
        }
        (a.udp_stats().background - before, longest)
    };
    let (a, b) = (
        open(Duration::from_millis(4)),
        open(Duration::from_millis(4)),
    );
    let (qa, _) = connected(&a, &b);
    std::thread::sleep(Duration::from_millis(10)); // a's thread may take over at first
                                                   // A loaded machine may keep this thread away longer than asked: a few tries.
    let mut seen = Vec::new();
    let quiet = (0..5).any(|_| {
        let (n, longest) = rounds(&a, qa, Duration::from_millis(1));
        seen.push((n, longest));
        n == 0 && longest < Duration::from_millis(3)
    });
    assert!(
        quiet,
        "polled every 1 ms, takeover 4 ms: (rounds, longest gap) {seen:?}"
    );
    // Polled every 1 ms with a 300 µs takeover: the thread takes over in the gaps it
    // wakes in (it sleeps up to 10 ms when no timer is due).
    let (c, d) = (
        open(Duration::from_micros(300)),
        open(Duration::from_micros(300)),
    );
    let (qc, _) = connected(&c, &d);
    let (n, _) = rounds(&c, qc, Duration::from_millis(1));
    assert!(n >= 2, "takeover 300 µs, polled every 1 ms: {n} rounds");
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Destroyed QPs are freed (engine slot, completion queue, send
/// socket, wake-up descriptor), so a process that creates and destroys connections
/// keeps its descriptors and tables flat.
#[test]
fn the_mtu_follows_the_route_to_the_peer() {
    // IB MTUs for IP MTUs: a 1500-byte link carries 1024-byte payloads, jumbo frames 4096.
    assert_eq!(ib_mtu_for(1500), 1024);
    assert_eq!(ib_mtu_for(9000), 4096);
    assert_eq!(ib_mtu_for(100), 256);
    // The route to a peer on loopback has lo's MTU (65536 on Linux).
    let lo = std::net::Ipv4Addr::LOCALHOST.into();
    let m = route_mtu(lo, SocketAddr::new(lo, 4791)).expect("IP_MTU toward 127.0.0.1");
    assert!(m >= 1500, "{m}");
}

#[test]
fn destroyed_queue_pairs_are_freed() {
    let lo = IpAddr::from([127, 0, 0, 1]);
    let a = UserVerbs::with_offload(lo, 0, None, false).unwrap();
    let b = UserVerbs::with_offload(lo, 0, None, false).unwrap();
    let fds0 = open_fds();
    for i in 0..1000u64 {
        let (qa, qb) = connected(&a, &b);
        ping(&a, qa, &b, qb, i);
        let (mut sent, mut got) = (false, false);
        let start = Instant::now();
        let mut w = [Wc::EMPTY; 4];
        while !(sent && got) {
            assert!(start.elapsed() < Duration::from_secs(20), "round {i} hung");
            sent |= a.poll_cq(qa, &mut w).unwrap() > 0;
            got |= b.poll_cq(qb, &mut w).unwrap() > 0;
        }
        a.destroy_qp(qa);
        b.destroy_qp(qb);
    }
    // Freed once quiet (a few hundred milliseconds after the last packet).
    let start = Instant::now();
    while a.open_qps() != (0, 0) || b.open_qps() != (0, 0) {
        if start.elapsed() > Duration::from_secs(10) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let fds = open_fds();
    // Other tests of this binary open descriptors meanwhile: allow some, far below the
    // 4000 that 1000 leaked QP pairs would hold.
    assert!(
        fds < fds0 + 200,
        "descriptors grew from {fds0} to {fds} over 1000 QP pairs"
    );
    assert_eq!(a.open_qps(), (0, 0), "queue pairs left in the table");
    assert_eq!(b.open_qps(), (0, 0), "queue pairs left in the table");
}

#[test]
fn gso_sends_many_packets_per_datagram() {
    let len = (1 << 20) + 12345;
    let (tx, rx) = write_over_loopback(true, len);
    if !tx.gso {
        // UDP_SEGMENT is in every kernel from 4.18: there, no GSO is a failure of the
        // probe, not a reason to skip.
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut v = release
            .trim()
            .split(['.', '-'])
            .map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
        assert!(
            (major, minor) < (4, 18),
            "kernel {} has UDP GSO, but the engine did not turn it on: {tx:?}",
            release.trim()
        );
        eprintln!(
            "SKIPPED: kernel {} has no UDP GSO (UDP_SEGMENT, 4.18+); nothing to check",
            release.trim()
        );
        return;
    }
    let pkts = len.div_ceil(4096) as u64;
    assert!(tx.packets >= pkts, "{tx:?}");
    // Equal packets of one QP leave together: at most 15 per 64 KiB datagram, but far
    // fewer datagrams than packets.
    assert!(tx.sends * 4 < tx.packets, "{tx:?}");
    eprintln!("sender {tx:?}\nreceiver {rx:?}");
}

#[test]
fn without_offload_every_packet_is_a_datagram() {
    let len = 300_000;
    let (tx, rx) = write_over_loopback(false, len);
    assert!(!tx.gso && !rx.gro);
    assert_eq!(tx.sends, tx.packets);
    assert!(tx.packets >= len.div_ceil(4096) as u64);
    assert_eq!(rx.merged, 0);
}
