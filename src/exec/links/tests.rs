//! The connection table: blame, connects to silent peers, duplex pairs.

use super::*;

fn links(rank: usize, nranks: usize) -> Links {
    Links::new(
        rank,
        nranks,
        0,
        Vec::new(),
        vec![0; nranks],
        vec![Vec::new(); nranks],
        LinkSettings::default(),
    )
}

/// Rank 2 waited on rank 0, which waits on the hung rank 1; rank 3 blames rank 1. Until
/// rank 0 reports, rank 2 keeps listening (here: the whole grace), then blames by votes;
/// once rank 0 has reported, rank 1 is the culprit.
#[test]
fn blame_waits_for_the_rank_it_suspects() {
    let mut l = links(2, 4);
    l.blame.notices.push((3, 1));
    let t = Instant::now();
    let (grace, long) = (Duration::from_millis(300), Duration::from_secs(10));
    // Rank 0 (own suspect) and rank 1 have a vote each: a tie, settled by rank order,
    // but only after the grace period, waiting for rank 0 to speak.
    assert_eq!(l.blame(Some(0), grace), Some(0));
    assert!(t.elapsed() >= grace, "{:?}", t.elapsed());
    l.blame.notices.push((0, 1));
    let t = Instant::now();
    assert_eq!(l.blame(Some(0), long), Some(1));
    assert!(t.elapsed() < long / 2, "{:?}", t.elapsed());
    // Fan-in: rank 4 blames rank 0 too; that does not settle it, rank 0's own notice
    // does.
    let mut l = links(2, 5);
    l.blame.notices.push((3, 1));
    l.blame.notices.push((4, 0));
    assert_eq!(l.blame(Some(0), grace), Some(0));
    l.blame.notices.push((0, 1));
    let t = Instant::now();
    assert_eq!(l.blame(Some(0), long), Some(1));
    assert!(t.elapsed() < long / 2, "{:?}", t.elapsed());
}

/// A TCP listener that never answers: backlog 0 and its one queue place taken, so the
/// kernel drops further SYNs (a connect retries them for minutes). Keep both alive.
fn silent_listener() -> (socket2::Socket, std::net::TcpStream, u16) {
    use socket2::{Domain, Socket, Type};
    let l = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    l.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    l.listen(0).unwrap();
    let port = l.local_addr().unwrap().as_socket().unwrap().port();
    let first = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    (l, first, port)
}

/// Rank 0 of 2 connects over `net` to a rank 1 whose setup port never answers, under a
/// `timeout`, with the application's abort raised after `abort_after` if given; the
/// error. Fails (instead of waiting out the kernel's SYN retries) if it takes 30 s.
fn connect_to_silent_peer(
    net: Arc<dyn Net>,
    redirect: fn(&NetHandle, u16) -> NetHandle,
    timeout: Duration,
    abort_after: Option<Duration>,
) -> String {
    let (_l, _first, port) = silent_listener();
    let (h, listen) = net.listen(0).unwrap();
    let handles = vec![vec![h.clone()], vec![redirect(&h, port)]];
    let ep = Endpoint {
        net,
        dev: 0,
        listen,
    };
    let mut l = Links::new(
        0,
        2,
        7,
        vec![ep],
        vec![0; 2],
        handles,
        LinkSettings::default(),
    );
    let abort = Arc::clone(&l.blame.abort);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let w = Waiter {
            timeout,
            ..Waiter::default()
        };
        let r = l.ensure(&[(1, 0)], &[], &w);
        let _ = tx.send(r.err().map(|e| e.to_string()));
    });
    if let Some(d) = abort_after {
        std::thread::sleep(d);
        abort.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    rx.recv_timeout(Duration::from_secs(30))
        .expect("connecting to a peer that does not answer hung past 30 s")
        .expect("connected to a peer that does not answer")
}

/// The RoCE v2 and shared-memory networks set up over TCP; a peer whose port does not
/// answer fails the connect at the communicator's deadline, naming it, and an abort
/// ends the wait at once (a blocking connect sat in SYN retries for minutes).
#[test]
fn a_peer_that_does_not_answer_fails_at_the_deadline_or_on_abort() {
    type Mk = fn() -> Arc<dyn Net>;
    type Redirect = fn(&NetHandle, u16) -> NetHandle;
    let nets: [(Mk, Redirect); 2] = [
        (
            || {
                Arc::new(
                    crate::net::rocev2::RoceNet::userspace(
                        std::net::Ipv4Addr::LOCALHOST.into(),
                        &Default::default(),
                    )
                    .unwrap(),
                )
            },
            crate::net::rocev2::handle_with_port,
        ),
        (
            || Arc::new(crate::net::shm::ShmNet::new(&Default::default()).unwrap()),
            crate::net::shm::handle_with_port,
        ),
    ];
    for (mk, redirect) in nets {
        let e = connect_to_silent_peer(mk(), redirect, Duration::from_secs(1), None);
        assert!(e.contains("could not connect with rank 1 within 1s"), "{e}");
        let e = connect_to_silent_peer(
            mk(),
            redirect,
            Duration::from_secs(60),
            Some(Duration::from_millis(200)),
        );
        assert!(
            e.contains("aborted by the application while connecting"),
            "{e}"
        );
    }
}

/// Ranks over TCP: `duplex` per rank decides what its handle offers.
fn tcp_links(duplex: [bool; 3]) -> Vec<Links> {
    let nets: Vec<Arc<dyn Net>> = duplex
        .iter()
        .map(|&d| {
            let n = crate::net::tcp::TcpNet::with_addr(
                std::net::Ipv4Addr::LOCALHOST.into(),
                &Default::default(),
            );
            Arc::new(n.unwrap().with_duplex(d)) as Arc<dyn Net>
        })
        .collect();
    let eps: Vec<(NetHandle, Box<dyn ListenComm>)> =
        nets.iter().map(|n| n.listen(0).unwrap()).collect();
    let handles: Vec<Vec<NetHandle>> = eps.iter().map(|(h, _)| vec![h.clone()]).collect();
    nets.into_iter()
        .zip(eps)
        .enumerate()
        .map(|(r, (net, (_, listen)))| {
            let ep = Endpoint {
                net,
                dev: 0,
                listen,
            };
            Links::new(
                r,
                3,
                7,
                vec![ep],
                vec![0; 3],
                handles.clone(),
                LinkSettings::default(),
            )
        })
        .collect()
}

/// Each rank opens send and receive connections to every other on channels 0 and 2,
/// then sends each a message on channel 2 and receives theirs.
fn all_pairs(l: &mut Links) -> Vec<u64> {
    let w = Waiter {
        timeout: Duration::from_secs(20),
        ..Waiter::default()
    };
    let me = l.rank;
    let peers: Vec<(usize, usize)> = (0..3)
        .filter(|&p| p != me)
        .flat_map(|p| [(p, 0), (p, 2)])
        .collect();
    l.ensure(&peers, &peers, &w).unwrap();
    let mine = [me as u64 + 100];
    let mut got = vec![0u64; 3];
    let mut reqs = Vec::new();
    for p in (0..3).filter(|&p| p != me) {
        let b = RecvBuf {
            ptr: got[p..].as_mut_ptr().cast(),
            len: 8,
            tag: 1,
        };
        // SAFETY: `mine` and `got` outlive the loop below, which completes every request.
        unsafe {
            let s = l
                .send_comm(p, 2)
                .unwrap()
                .isend(mine.as_ptr().cast(), 8, 1, None);
            let r = l.recv_comm(p, 2).unwrap().irecv(&[b]);
            reqs.push((p, s.unwrap().unwrap(), r.unwrap().unwrap(), false, false));
        }
    }
    let t0 = Instant::now();
    while !reqs.is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(20), "messages stuck");
        for (p, s, r, sent, recvd) in &mut reqs {
            if !*sent {
                *sent = l.send_comm(*p, 2).unwrap().test(*s).unwrap().is_some();
            }
            if !*recvd {
                *recvd = l.recv_comm(*p, 2).unwrap().test(*r, &mut [0]).unwrap();
            }
        }
        reqs.retain(|q| !(q.3 && q.4));
    }
    got
}

/// A rank's number, connections dialed, connections open and messages received.
type Outcome = (usize, usize, (usize, usize), Vec<u64>);

/// Over TCP each pair shares one connection per channel, opened by its lower rank; a rank
/// whose handle does not offer duplex connections gets one connection each way.
#[test]
fn duplex_pairs_dial_one_connection_per_channel() {
    for duplex in [[true; 3], [true, true, false]] {
        let links = tcp_links(duplex);
        let results: Vec<Outcome> = std::thread::scope(|s| {
            let hs: Vec<_> = links
                .into_iter()
                .map(|mut l| {
                    s.spawn(move || {
                        let got = all_pairs(&mut l);
                        (l.rank, l.dialed, l.open(), got)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, dialed, open, got) in results {
            for p in (0..3).filter(|&p| p != rank) {
                assert_eq!(got[p], p as u64 + 100, "{duplex:?}: rank {rank} from {p}");
            }
            // Two channels per peer: a duplex pair dials once per channel, at its lower
            // rank; otherwise each rank dials its own sends.
            let both = |a: usize, b: usize| duplex[a] && duplex[b];
            let expect: usize = (0..3)
                .filter(|&p| p != rank)
                .map(|p| match (both(rank, p), rank < p) {
                    (true, true) | (false, _) => 2,
                    (true, false) => 0,
                })
                .sum();
            assert_eq!(dialed, expect, "{duplex:?}: connections rank {rank} opened");
            assert_eq!(open, (4, 4), "{duplex:?}: rank {rank} has every way open");
        }
    }
}
