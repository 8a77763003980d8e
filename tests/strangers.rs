//! Strangers at every listener (issue 22): processes that reach a rank's ports without
//! belonging to the job — port scanners, idle and half-open connections, random bytes,
//! well-formed messages without the job secret, a forged abort notice — while a job runs.
//! The job completes with checked results; the impostor cannot register, connect or abort.
//!
//! The ranks are threads of this process, so the ports attacked are found the way a
//! stranger on the host would: every TCP port this process listens on (`/proc`).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use common::strangers::*;
use common::*;
use roccl::algo::model::Tuning;
use roccl::bootstrap::{rendezvous, UniqueId};
use roccl::net::NetKind;
use roccl::{Communicator, Config, RedOp};

/// The tests of this file one at a time: a test that attacks "every port this process
/// listens on" must not reach the listeners of another test's job (a root already done, a
/// fake peer), which nobody accepts on any more and which would keep the stranger's socket.
static ALONE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// The job secret of the launcher-mode tests.
const SECRET: [u8; 16] = *b"0123456789abcdef";

/// Launcher mode with a job secret: rank 0 serves the root at `addr` (port 0: any).
fn launcher_root(addr: SocketAddr) -> UniqueId {
    roccl::bootstrap::serve_root_with(addr, Some(SECRET)).unwrap()
}

/// The id every other rank computes from the root's address and the job secret.
fn launcher_id(addr: SocketAddr) -> UniqueId {
    UniqueId::for_address_with(addr, Some(SECRET))
}

fn cfg(net: NetKind) -> Config {
    let mut c = config(Tuning::default());
    c.net = net;
    // Through the network's connections (not the shared segments of ranks on one host).
    c.algo = Some(roccl::Algo::Ring);
    c.waiter.timeout = Duration::from_secs(20);
    c
}

/// `n` ranks join (`id`) and, if `warm`, run one all-reduce (their connections are open);
/// strangers attack every listener of this process, then each rank runs `rounds`
/// all-reduces (without `warm`, the connections open after the attack) and checks them;
/// `after` runs once they all have, while their communicators are still alive.
fn job_under_attack(
    net: NetKind,
    n: usize,
    rounds: usize,
    warm: bool,
    attack: &(dyn Fn() + Sync),
    after: &(dyn Fn() + Sync),
) {
    let id = UniqueId::new().unwrap();
    let joined = Barrier::new(n + 1);
    let attacked = Barrier::new(n + 1);
    let finished = Barrier::new(n + 1);
    let checked = Barrier::new(n + 1);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (joined, attacked, c) = (&joined, &attacked, cfg(net));
                let (finished, checked) = (&finished, &checked);
                s.spawn(move || {
                    let c = Communicator::init_with(&id, n, r, c);
                    if let (true, Ok(c)) = (warm, &c) {
                        let mut v = vec![1f32; 64];
                        c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
                    }
                    joined.wait();
                    attacked.wait();
                    let c = c.expect("init");
                    for round in 0..rounds {
                        let mut v: Vec<f32> =
                            (0..1000).map(|i| (r * 1000 + i + round) as f32).collect();
                        c.all_reduce_in_place(&mut v, RedOp::Sum)
                            .unwrap_or_else(|e| panic!("rank {r} round {round}: {e}"));
                        for (i, x) in v.iter().enumerate() {
                            let want: usize = (0..n).map(|q| q * 1000 + i + round).sum();
                            assert_eq!(*x, want as f32, "rank {r} round {round} element {i}");
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    finished.wait();
                    checked.wait();
                })
            })
            .collect();
        joined.wait();
        attack();
        attacked.wait();
        finished.wait();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(after));
        checked.wait();
        if let Err(e) = r {
            std::panic::resume_unwind(e);
        }
        for (r, h) in hs.into_iter().enumerate() {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(Box::new(format!(
                    "rank {r} failed: {:?}",
                    e.downcast_ref::<String>()
                )));
            }
        }
    });
}

/// Shared-memory segments of roccl this process has mapped (named in `/proc/self/maps`,
/// unlinked ones included) or made (in `/dev/shm`, named `roccl-PID-...`: not those of
/// other processes, such as another test run on the machine).
fn shm_segments() -> usize {
    let mut names: std::collections::HashSet<String> = std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once("/dev/shm/roccl-").map(|(_, n)| n.to_string()))
        .map(|n| n.trim_end_matches(" (deleted)").to_string())
        .collect();
    if let Ok(d) = std::fs::read_dir("/dev/shm") {
        for e in d.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(&format!("roccl-{}-", std::process::id())) {
                names.insert(n["roccl-".len()..].to_string());
            }
        }
    }
    names.len()
}

/// What a job holds while it is alive, measured from `qps0`: queue pairs the userspace RoCE
/// engine created, and shared-memory segments.
fn footprint(qps0: u64) -> (u64, usize) {
    (
        roccl::rdma::udp::queue_pairs_created() - qps0,
        shm_segments(),
    )
}

/// Strangers at every listening port; the connections stay open until the job is over.
/// Once the job has run, no listener still holds the socket of a stranger that sent garbage,
/// and the job holds as many queue pairs and segments as the same job without strangers
/// (nothing leaked: each stranger was refused, closed and given nothing).
fn strangers_everywhere(net: NetKind) {
    let quiet = parking_lot::Mutex::new(None);
    let qps0 = roccl::rdma::udp::queue_pairs_created();
    job_under_attack(net, 3, 10, false, &|| {}, &|| {
        *quiet.lock() = Some(footprint(qps0));
    });
    let quiet = quiet.into_inner().expect("the quiet job ran");
    // The comparison means something: the job's own queue pairs and segments are counted.
    match net {
        NetKind::RoceV2 => assert!(quiet.0 > 0, "no queue pair counted: {quiet:?}"),
        NetKind::Shm => assert!(quiet.1 > 0, "no segment counted: {quiet:?}"),
        _ => {}
    }
    eprintln!("{net:?}: a job without strangers holds (queue pairs created, segments) {quiet:?}");
    let qps0 = roccl::rdma::udp::queue_pairs_created();
    let before = roccl::bootstrap::auth::refused();
    let held = parking_lot::Mutex::new(Vec::new());
    let attacked = parking_lot::Mutex::new(Vec::new());
    let after = || {
        let ports = attacked.lock().clone();
        // Each garbage stranger's connection as (its address, the listener's): a port the
        // kernel gave one stranger may also be the local port of the job's own connection to
        // another listener, so a stranger is told by both ends.
        let garbage: Vec<(SocketAddr, SocketAddr)> = held
            .lock()
            .iter()
            .filter(|(kind, _)| *kind == Stranger::Garbage)
            .filter_map(|(_, s): &(Stranger, TcpStream)| {
                Some((s.local_addr().ok()?, s.peer_addr().ok()?))
            })
            .collect();
        assert!(!garbage.is_empty());
        let give_up = Instant::now() + Duration::from_secs(5);
        loop {
            // (the listener's address, the stranger's)
            let kept: Vec<(SocketAddr, SocketAddr)> = own_connections()
                .into_iter()
                .filter(|(listener, peer)| garbage.contains(&(*peer, *listener)))
                .collect();
            if kept.is_empty() {
                break;
            }
            assert!(
                Instant::now() < give_up,
                "{net:?}: listeners still hold {} of the {} garbage strangers' sockets (listener, stranger): {kept:?}; listening: {ports:?}",
                kept.len(),
                garbage.len()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(
            footprint(qps0),
            quiet,
            "{net:?}: (queue pairs created, shared-memory segments) with strangers against without"
        );
    };
    job_under_attack(
        net,
        3,
        10,
        false,
        &|| {
            let ports = listening_ports();
            *attacked.lock() = ports.clone();
            assert!(!ports.is_empty(), "no listener found");
            for (k, p) in ports.iter().enumerate() {
                held.lock()
                    .extend(strangers_of_kinds_at(*p, 77 + 10 * k as u64));
            }
            // Let the listeners see them before the job connects.
            std::thread::sleep(Duration::from_millis(100));
        },
        &after,
    );
    // The strangers reached the listeners, which refused them.
    assert!(roccl::bootstrap::auth::refused() > before);
    drop(held);
}

/// Before the fix, the RoCE v2 setup listener kept a stranger's bad entry and failed every
/// later accept: the first all-reduce ended with "connecting over rocev2: … refused".
#[test]
fn strangers_do_not_stop_a_rocev2_job() {
    let _alone = ALONE.lock();
    strangers_everywhere(NetKind::RoceV2);
}

#[test]
fn strangers_do_not_stop_a_tcp_job() {
    let _alone = ALONE.lock();
    strangers_everywhere(NetKind::Tcp);
}

/// Before the fix, a stranger's bytes at the shared-memory setup port were read as a
/// segment name and the failure to open it was the listener's error: the job ended.
#[test]
fn strangers_do_not_stop_a_shm_job() {
    let _alone = ALONE.lock();
    strangers_everywhere(NetKind::Shm);
}

/// Whether the listener has closed its side of `s` (a stranger's connection): its read
/// ends (EOF, or a reset where the listener left bytes unread) within `within`.
fn closed_by_listener(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue, // a listener never answers a stranger, but read on
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// One setup listener, one of the job's connections, and strangers that send garbage (more
/// than any setup message) before the connection's first message and between its steps:
/// every call to the listener refuses every stranger whose bytes had arrived, including the
/// call that hands out the connection. Before the fix that call returned at the connection
/// and left the strangers queued after it, held until some later call that, once the job's
/// connections were made, never came (`strangers_do_not_stop_a_*_job` failed so now and
/// then on a loaded machine).
fn strangers_beside_a_connection(kind: NetKind) {
    let _alone = ALONE.lock();
    let ip = roccl::bootstrap::ifaces::local_addr(None).unwrap();
    let net = roccl::net::open(kind, ip, &roccl::net::NetSettings::default()).unwrap();
    let before = listening_ports();
    let (handle, mut listener) = net.listen(0).unwrap();
    let new: Vec<SocketAddr> = listening_ports()
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    assert_eq!(new.len(), 1, "{kind:?}: the listener's port: {new:?}");
    let at = new[0];
    let garbage = |seed: u64| {
        let mut s = TcpStream::connect_timeout(&at, Duration::from_secs(1)).unwrap();
        s.write_all(&noise(seed, 400)).unwrap();
        s
    };
    let mut strangers: Vec<TcpStream> = (0..3).map(|k| garbage(500 + k)).collect();
    let mut connecting = net.connect(0, &handle).unwrap();
    let mut sent = None;
    for call in 0..400 {
        // The dialer's next step, then (before the first four calls) more strangers behind it.
        for _ in 0..3 {
            if sent.is_none() {
                sent = connecting.poll().unwrap();
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if (1..=3).contains(&call) {
            strangers.extend((0..3).map(|k| garbage(600 + 10 * call + k)));
        }
        std::thread::sleep(Duration::from_millis(20));
        let accepted = listener.accept().unwrap();
        let n = strangers.len();
        for (k, s) in strangers.iter_mut().enumerate() {
            assert!(
                closed_by_listener(s, Duration::from_millis(500)),
                "{kind:?}: the listener's call {call} (connection accepted: {}) left garbage stranger {k} of {n} open",
                accepted.is_some(),
            );
        }
        if accepted.is_some() {
            return;
        }
    }
    panic!("{kind:?}: the connection was never accepted");
}

#[test]
fn strangers_beside_a_tcp_connection_are_refused_at_once() {
    strangers_beside_a_connection(NetKind::Tcp);
}

#[test]
fn strangers_beside_a_shm_connection_are_refused_at_once() {
    strangers_beside_a_connection(NetKind::Shm);
}

#[test]
fn strangers_beside_a_rocev2_connection_are_refused_at_once() {
    strangers_beside_a_connection(NetKind::RoceV2);
}

/// RoCE v2 datagrams a local stranger can send to the userspace engine's UDP ports from the
/// peers' own address (it binds the same IP): NAKs "remote access error" with valid ICRCs to
/// the queue-pair numbers the engine used to hand out in sequence (generations 1-8, slots
/// 0-31), with random PSNs, and random bytes. Before the engine checked PSNs against what is
/// outstanding and drew QP numbers from the OS random source, such NAKs ended the job.
#[test]
fn spoofed_datagrams_do_not_stop_a_rocev2_job() {
    let _alone = ALONE.lock();
    use roccl::rdma::wire;
    job_under_attack(
        NetKind::RoceV2,
        3,
        30,
        true,
        &|| {
            let targets = udp_ports();
            assert!(!targets.is_empty(), "no UDP port found");
            let mut sent = 0;
            for (k, at) in targets.iter().enumerate() {
                let Ok(s) = std::net::UdpSocket::bind(SocketAddr::new(at.ip(), 0)) else {
                    continue;
                };
                let from = s.local_addr().unwrap();
                let ip = wire::IpInfo {
                    src: from.ip(),
                    dst: at.ip(),
                    src_port: from.port(),
                    dst_port: at.port(),
                };
                let rnd = noise(900 + k as u64, 4 * 8 * 32);
                for gen in 1..=8u32 {
                    for slot in 0..32u32 {
                        let r = 4 * (((gen - 1) * 32 + slot) as usize);
                        let psn = u32::from_le_bytes(rnd[r..r + 4].try_into().unwrap()) & 0xff_ffff;
                        let p = wire::Packet {
                            bth: wire::Bth {
                                opcode: wire::Opcode::Ack,
                                solicited: false,
                                mig_req: false,
                                pad: 0,
                                pkey: wire::DEFAULT_PKEY,
                                fecn: false,
                                becn: false,
                                dest_qp: gen << 12 | slot,
                                ack_req: false,
                                psn,
                            },
                            reth: None,
                            imm: None,
                            aeth: Some(wire::Aeth::nak(0, wire::NakCode::RemoteAccessError)),
                            payload: &[],
                        };
                        let mut buf = [0u8; 128];
                        let n = wire::encode(&p, &ip, &mut buf).unwrap();
                        sent += usize::from(s.send_to(&buf[..n], at).is_ok());
                    }
                }
                for j in 0..32 {
                    let _ = s.send_to(&noise(77 + j, 20 + 40 * j as usize), at);
                }
            }
            assert!(sent > 0);
        },
        &|| {},
    );
}

/// A forged abort notice as the old wire format allowed, computed from the unique id's
/// nonce (in launcher mode a function of the root port): a TCP hello with one socket, then
/// one message carrying the executor's hello with the abort bit. Before the fix it ended a
/// TCP job ("another rank aborted the communicator").
fn forged_abort(at: SocketAddr, comm_id: u32, claimed: u32) -> Option<TcpStream> {
    let port = at.port();
    let mut s = TcpStream::connect_timeout(&at, Duration::from_secs(1)).ok()?;
    let mut m = Vec::new();
    m.extend_from_slice(&0x4f4c_4548u32.to_le_bytes()); // TCP hello "HELO"
    m.extend_from_slice(&(0x1234_5678_9abc_def0u64 ^ port as u64).to_le_bytes());
    m.extend_from_slice(&0u16.to_le_bytes()); // socket 0
    m.extend_from_slice(&1u16.to_le_bytes()); // of 1
    m.extend_from_slice(&16u64.to_le_bytes()); // message 0, 16 bytes
    m.extend_from_slice(&0u32.to_le_bytes()); // tag
    m.extend_from_slice(&0x4753_4d52u32.to_le_bytes()); // "RMSG"
    m.extend_from_slice(&0x4c4c_4f52u32.to_le_bytes()); // executor hello "ROLL"
    m.extend_from_slice(&claimed.to_le_bytes()); // from rank
    m.extend_from_slice(&(0x8000_0000u32 | claimed).to_le_bytes()); // abort, blaming it
    m.extend_from_slice(&comm_id.to_le_bytes());
    s.write_all(&m).ok()?;
    Some(s)
}

#[test]
fn a_forged_abort_notice_does_not_end_a_tcp_job() {
    let _alone = ALONE.lock();
    let held = parking_lot::Mutex::new(Vec::new());
    // Every rank of this process computes the id the old way: the nonce is in the id.
    let comm_id_of = |id: &UniqueId| {
        let b = id.as_bytes();
        let nonce = u64::from_le_bytes(b[24..32].try_into().unwrap());
        (nonce ^ (nonce >> 32)) as u32
    };
    let n = 3;
    let id = UniqueId::new().unwrap();
    let comm_id = comm_id_of(&id);
    let joined = Barrier::new(n + 1);
    let attacked = Barrier::new(n + 1);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (joined, attacked, c) = (&joined, &attacked, cfg(NetKind::Tcp));
                s.spawn(move || {
                    let c = Communicator::init_with(&id, n, r, c).expect("init");
                    let mut v = vec![1f32; 64];
                    c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
                    joined.wait();
                    attacked.wait();
                    // About 2.5 s of calls; as many on every rank (a rank that stopped on
                    // its own clock would leave the others waiting on a call it never makes).
                    for round in 0..50 {
                        let mut v = vec![(r + round) as f32; 64];
                        c.all_reduce_in_place(&mut v, RedOp::Sum)
                            .unwrap_or_else(|e| panic!("rank {r} round {round}: {e}"));
                        let want: usize = (0..n).map(|q| q + round).sum();
                        assert_eq!(v, vec![want as f32; 64], "rank {r} round {round}");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                })
            })
            .collect();
        joined.wait();
        for p in listening_ports() {
            held.lock().extend(forged_abort(p, comm_id, 1));
        }
        attacked.wait();
        for (r, h) in hs.into_iter().enumerate() {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(Box::new(format!(
                    "rank {r} failed: {:?}",
                    e.downcast_ref::<String>()
                )));
            }
        }
    });
}

/// A launcher-mode rendezvous of `n` ranks at `id`'s root (rank 0 with `id`, the others
/// with the id they compute from the address), each from a thread: every rank must get
/// every rank's blob.
fn launcher_rendezvous(id: UniqueId, n: usize) {
    let (addr, _) = id.root().unwrap();
    let others = launcher_id(addr);
    let hs: Vec<_> = (0..n)
        .map(|r| {
            register(
                if r == 0 { id } else { others },
                r,
                n,
                Duration::from_secs(8),
            )
        })
        .collect();
    let want: Vec<Vec<u8>> = (0..n).map(|r| vec![r as u8; 5]).collect();
    for h in hs {
        assert_eq!(h.join().unwrap().expect("rendezvous"), want);
    }
}

/// Register `rank` of `nranks` with `id` from a thread.
fn register(
    id: UniqueId,
    rank: usize,
    nranks: usize,
    timeout: Duration,
) -> std::thread::JoinHandle<roccl::Result<Vec<Vec<u8>>>> {
    std::thread::spawn(move || rendezvous(&id, rank, nranks, &[rank as u8; 5], timeout))
}

/// Before the fix the root read one connection at a time, blocking up to 10 s on each: idle
/// connections made the rendezvous time out ("ranks … never arrived" — they had).
#[test]
fn idle_slow_and_garbage_connections_do_not_stall_the_root() {
    let _alone = ALONE.lock();
    let id = launcher_root("127.0.0.1:0".parse().unwrap());
    let (addr, _) = id.root().unwrap();
    let mut held = strangers_at(addr, 5);
    for _ in 0..4 {
        held.push(TcpStream::connect(addr).unwrap());
    }
    // A slow sender: one byte of a registration every 300 ms.
    let slow = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        for b in 0x3253_4252u32.to_le_bytes().iter().cycle().take(20) {
            if s.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    launcher_rendezvous(id, 3);
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "the rendezvous took {:?}",
        t.elapsed()
    );
    drop(held);
    slow.join().unwrap();
}

/// An impostor who knows the root's address and port (launcher mode) but not the job
/// secret: it cannot register as a rank (before the fix it was accepted as rank 2 and got
/// every rank's blob), nor abort the rendezvous with a 1 ms timeout (before the fix: every
/// rank failed).
#[test]
fn an_impostor_that_knows_the_port_cannot_register_or_abort() {
    let _alone = ALONE.lock();
    let id = launcher_root("127.0.0.1:0".parse().unwrap());
    let (addr, _) = id.root().unwrap();
    // What anyone can compute from the port: the id without the secret.
    let forged = UniqueId::for_address(addr);
    let impostor = register(forged, 2, 3, Duration::from_millis(1));
    let e = impostor.join().unwrap();
    if let Ok(t) = &e {
        panic!("the impostor joined and got {} blobs", t.len());
    }
    let e = e.unwrap_err().to_string();
    assert!(e.contains("not authenticated"), "{e}");
    std::thread::sleep(Duration::from_millis(50));
    launcher_rendezvous(id, 3);
}

/// A rank that knows the secret but is late (the rendezvous is over) gets the usual error:
/// nobody serves the root any more.
#[test]
fn a_late_rank_with_the_secret_gets_the_usual_error() {
    let _alone = ALONE.lock();
    let id = launcher_root("127.0.0.1:0".parse().unwrap());
    let (addr, _) = id.root().unwrap();
    let hs: Vec<_> = (0..2)
        .map(|r| {
            register(
                if r == 0 { id } else { launcher_id(addr) },
                r,
                2,
                Duration::from_secs(8),
            )
        })
        .collect();
    for h in hs {
        h.join().unwrap().expect("rendezvous");
    }
    let e = rendezvous(&launcher_id(addr), 1, 2, b"x", Duration::from_millis(600))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("could not register with the bootstrap root"),
        "{e}"
    );
}

/// Plain bytes of a reply from the root (to see that strangers get nothing).
#[test]
fn garbage_gets_no_answer_from_the_root() {
    let _alone = ALONE.lock();
    let id = UniqueId::new().unwrap();
    let (addr, _) = id.root().unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&noise(9, 200)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    // The root's challenge, sent on every connection before anything arrives ...
    let mut c = [0u8; 20];
    s.read_exact(&mut c).unwrap();
    assert_eq!(&c[..4], b"RCH1");
    // ... then closed without a word (0 bytes) rather than answered.
    let mut b = [0u8; 16];
    assert_eq!(s.read(&mut b).unwrap_or(0), 0);
    // The root still serves the job.
    let hs: Vec<_> = (0..2)
        .map(|r| register(id, r, 2, Duration::from_secs(8)))
        .collect();
    for h in hs {
        h.join().unwrap().expect("rendezvous");
    }
}

/// Talk to a client as a root would, whichever protocol it speaks: when it sends nothing for
/// 300 ms, it waits for a challenge, which it gets. Returns what it sent and whether it was
/// challenged.
fn as_a_root(s: &mut TcpStream) -> (Vec<u8>, bool) {
    s.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 4096];
    let challenged = match s.read(&mut b) {
        Ok(n) if n > 0 => {
            got.extend_from_slice(&b[..n]);
            false
        }
        _ => {
            s.write_all(b"RCH1").unwrap();
            s.write_all(&[0x5a; 16]).unwrap();
            true
        }
    };
    while let Ok(n) = s.read(&mut b) {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&b[..n]);
    }
    (got, challenged)
}

/// A process that binds the launcher's root port before rank 0 does gets the ranks'
/// registrations and answers with a table of its own making. Before the fix (an unencrypted
/// job's reply was not authenticated) the rank took the table and went on to connect to the
/// addresses in it; now it refuses the reply, saying why.
#[test]
fn a_squatter_on_the_root_port_cannot_hand_out_a_table() {
    let _alone = ALONE.lock();
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = squatter.local_addr().unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = squatter.accept().unwrap();
        let (_, challenged) = as_a_root(&mut s);
        // Two blobs of its choosing, as the table of a 2-rank job.
        let table = [
            &5u32.to_le_bytes()[..],
            b"evil0",
            &5u32.to_le_bytes(),
            b"evil1",
        ]
        .concat();
        let reply = if challenged {
            [
                &[0u8][..],
                &(table.len() as u32).to_le_bytes(),
                &table,
                &[0u8; 16],
            ]
            .concat()
        } else {
            [&[0u8][..], &table].concat()
        };
        let _ = s.write_all(&reply);
    });
    let got = rendezvous(&launcher_id(addr), 1, 2, b"mine!", Duration::from_secs(5));
    fake.join().unwrap();
    match got {
        Ok(t) => panic!("the rank took the squatter's table {t:?}"),
        Err(e) => {
            let e = e.to_string();
            assert!(
                e.contains("not authenticated") && e.contains("stranger"),
                "{e}"
            );
        }
    }
}

/// A registration recorded by whoever reached the root's port in an earlier run (a squatter,
/// or an observer of the wire) and sent again to a later run of the same launcher-mode job
/// (same address, port and secret, so the same id). Before the fix the root admitted it as
/// that rank, and the real rank then failed the job ("rank 0 joined twice"); now it answers
/// another challenge than the recorded one and is refused.
#[test]
fn a_replayed_registration_does_not_join_a_later_run() {
    let _alone = ALONE.lock();
    let recorder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = recorder.local_addr().unwrap();
    let rec = std::thread::spawn(move || {
        let (mut s, _) = recorder.accept().unwrap();
        as_a_root(&mut s).0
    });
    // The earlier run: rank 1 registers with the recorder (which never answers).
    let _ = rendezvous(
        &launcher_id(addr),
        1,
        2,
        &[1; 5],
        Duration::from_millis(800),
    );
    let recorded = rec.join().unwrap();
    assert!(recorded.len() > 28, "nothing recorded");
    // The later run on the same port: the recording arrives first.
    let id = launcher_root(addr);
    let mut replay = TcpStream::connect(addr).unwrap();
    replay
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut c = [0u8; 20];
    let _ = replay.read(&mut c);
    replay.write_all(&recorded).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    launcher_rendezvous(id, 2);
}

/// More idle connections than the root keeps pending (1024), as a stranger that opens them
/// by the thousand would: before the fix the root closed every connection past 1024 and a
/// rank whose connection was closed failed; now the oldest pending one gives way, a rank
/// whose connection closes tries again, and the rendezvous completes.
#[test]
fn a_thousand_idle_connections_do_not_deny_the_rendezvous() {
    let _alone = ALONE.lock();
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max.min(8192);
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
    if lim.rlim_cur < 4096 {
        eprintln!(
            "SKIPPED (idle flood): only {} descriptors allowed",
            lim.rlim_cur
        );
        return;
    }
    let id = launcher_root("127.0.0.1:0".parse().unwrap());
    let (addr, _) = id.root().unwrap();
    let idle: Vec<TcpStream> = (0..1100)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect();
    assert!(idle.len() >= 1050, "only {} connections", idle.len());
    std::thread::sleep(Duration::from_millis(300));
    launcher_rendezvous(id, 2);
    drop(idle);
}
