//! Networks chosen per peer and call size (`ROCCL_NETS`, `Config::extra_nets`): ranks named
//! onto hosts with `Config::host` offer TCP and the userspace RoCE v2 engine between hosts,
//! one host offers only TCP; the links are measured at init and each pair of ranks takes,
//! for a collective of each size, the network both offer that the measurements say is
//! fastest. Every collective must be correct whichever network carries it, and the choice
//! must be the one the table implies.

mod common;

use std::time::Duration;

use roccl::comm::MeasuredLink;
use roccl::net::NetKind;
use roccl::os::wait::Waiter;
use roccl::{Collective, Communicator, Config, DataType, RedOp, UniqueId};

/// Ranks and their hosts: two ranks on host 0 (shared memory between them), one on host 1,
/// one on host 2, which offers only TCP.
const HOSTS: [usize; 4] = [0, 0, 1, 2];

/// Run `f` on one thread per rank of [`HOSTS`]: TCP between hosts, the engine offered
/// beside it except on host 2.
fn on_hosts(f: impl Fn(Communicator) + Send + Sync) {
    on_ranks(HOSTS.len(), hosts_config, f);
}

/// Rank `r`'s settings in [`on_hosts`].
fn hosts_config(r: usize) -> Config {
    let mut cfg: Config = common::config(Default::default());
    cfg.net = NetKind::Tcp;
    cfg.extra_nets = if HOSTS[r] == 2 {
        Vec::new()
    } else {
        vec![NetKind::RoceV2]
    };
    cfg.host = Some(format!("host-{}", HOSTS[r]));
    cfg
}

/// Run `f` on one thread per rank of `n`, rank `r` with the settings `cfg(r)`.
fn on_ranks(
    n: usize,
    cfg: impl Fn(usize) -> Config + Sync,
    f: impl Fn(Communicator) + Send + Sync,
) {
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (f, id, cfg) = (&f, &id, &cfg);
                s.spawn(move || f(Communicator::init_with(id, n, r, cfg(r)).expect("init")))
            })
            .collect();
        for h in hs {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(e)
            }
        }
    });
}

fn val(r: usize, i: usize) -> f32 {
    ((r * 5 + i * 3) % 23) as f32 + r as f32
}

/// Every collective on `count` f32 elements, checked against a reference.
fn check_collectives(c: &Communicator, count: usize) {
    let (r, n) = (c.rank(), c.nranks());
    let input: Vec<f32> = (0..count).map(|i| val(r, i)).collect();
    let sum: Vec<f32> = (0..count)
        .map(|i| (0..n).map(|q| val(q, i)).sum())
        .collect();
    let run = |coll, send: Option<&[f32]>, recv: &mut [f32]| {
        c.run_raw(
            coll,
            DataType::F32,
            send.map(bytemuck::cast_slice),
            bytemuck::cast_slice_mut(recv),
            &Default::default(),
        )
        .unwrap_or_else(|e| panic!("{coll:?} of {count} on rank {r}: {e}"))
    };
    let mut out = vec![0f32; count];
    run(Collective::AllReduce(RedOp::Sum), Some(&input), &mut out);
    assert_eq!(out, sum, "all-reduce, rank {r}, {count}");
    for root in [0, n - 1] {
        let mut b = if r == root {
            input.clone()
        } else {
            vec![-1f32; count]
        };
        run(Collective::Broadcast { root }, None, &mut b);
        let want: Vec<f32> = (0..count).map(|i| val(root, i)).collect();
        assert_eq!(b, want, "broadcast from {root}, rank {r}, {count}");
        let mut out = vec![0f32; count];
        run(
            Collective::Reduce {
                op: RedOp::Sum,
                root,
            },
            Some(&input),
            &mut out,
        );
        if r == root {
            assert_eq!(out, sum, "reduce to {root}, {count}");
        }
    }
    let mut all = vec![0f32; count * n];
    run(Collective::AllGather, Some(&input), &mut all);
    for q in 0..n {
        let want: Vec<f32> = (0..count).map(|i| val(q, i)).collect();
        assert_eq!(
            &all[q * count..(q + 1) * count],
            &want[..],
            "all-gather block {q}, rank {r}"
        );
    }
    let big: Vec<f32> = (0..count * n).map(|i| val(r, i)).collect();
    let mut part = vec![0f32; count];
    run(Collective::ReduceScatter(RedOp::Sum), Some(&big), &mut part);
    let want: Vec<f32> = (0..count)
        .map(|i| (0..n).map(|q| val(q, r * count + i)).sum())
        .collect();
    assert_eq!(part, want, "reduce-scatter, rank {r}, {count}");
    let mut got = vec![0f32; count * n];
    run(Collective::AllToAll, Some(&big), &mut got);
    for q in 0..n {
        let want: Vec<f32> = (0..count).map(|i| val(q, r * count + i)).collect();
        assert_eq!(
            &got[q * count..(q + 1) * count],
            &want[..],
            "all-to-all from {q}, rank {r}"
        );
    }
}

/// The userspace engine's packets sent by this communicator's ranks' network, if it has one.
fn engine_packets(c: &Communicator) -> Option<u64> {
    c.net_counters()
        .into_iter()
        .find(|(net, _)| *net == "rocev2")
        .map(|(_, v)| {
            v.iter()
                .find(|(k, _)| *k == "tx_packets")
                .map_or(0, |x| x.1)
        })
}

/// Measured at init: TCP for every pair of hosts, the engine only between hosts 0 and 1
/// (host 2 lacks it); every rank holds the same table and choices, each choice is the
/// network of least α + s/β at each size, and every collective is correct at sizes on
/// both sides of the choice.
#[test]
fn each_pair_uses_the_networks_both_offer_as_measured() {
    let tables = std::sync::Mutex::new(Vec::new());
    on_hosts(|c| {
        let m = c.measured_links().expect("3 hosts measure their links");
        // The first ranks of hosts 0 and 1 measured the engine through the engine: rank 0's
        // bursts (256 KiB and more) are hundreds of packets, rank 2 acknowledges them.
        let least = [(0, 200), (2, 10)].iter().find(|x| x.0 == c.rank());
        if let Some(&(r, least)) = least {
            let sent = engine_packets(&c).unwrap_or(0);
            assert!(
                sent > least,
                "rank {r}: the engine sent {sent} packets at init"
            );
        }
        for count in [1usize, 300, 20_000, 300_000] {
            check_collectives(&c, count);
        }
        // Host 2's rank never opened the engine; the others list it.
        assert_eq!(engine_packets(&c).is_some(), HOSTS[c.rank()] != 2);
        tables.lock().unwrap().push(m);
    });
    let tables = tables.into_inner().unwrap();
    assert!(
        tables.iter().all(|t| *t == tables[0]),
        "ranks differ: {tables:?}"
    );
    let t = &tables[0];
    let nets: Vec<_> = t.links.iter().map(|l| (l.hosts, l.net)).collect();
    assert_eq!(
        nets,
        [
            ((0, 1), "tcp"),
            ((0, 1), "rocev2"),
            ((0, 2), "tcp"),
            ((1, 2), "tcp")
        ],
        "{}",
        t.describe()
    );
    assert_eq!(t.choices.len(), 1, "{}", t.describe());
    let (hosts, steps) = &t.choices[0];
    assert_eq!(*hosts, (0, 1));
    let time = |net: &str, s: usize| {
        let l = t
            .links
            .iter()
            .find(|l| l.hosts == (0, 1) && l.net == net)
            .unwrap();
        l.alpha_us + s as f64 / (l.beta_gbs * 1e3)
    };
    for s in (0..30).map(|k| 1usize << k) {
        let chosen = steps.iter().take_while(|x| x.0 <= s).last().unwrap().1;
        let other = if chosen == "tcp" { "rocev2" } else { "tcp" };
        assert!(
            time(chosen, s) <= time(other, s) * (1.0 + 1e-9),
            "{s} bytes: {chosen} chosen, {other} faster: {}",
            t.describe()
        );
    }
    // The model takes each pair's best latency and bandwidth, then the slowest pair.
    let best = |h: (usize, usize), f: fn(&MeasuredLink) -> f64, max: bool| {
        let v = t.links.iter().filter(|l| l.hosts == h).map(f);
        if max {
            v.fold(0.0, f64::max)
        } else {
            v.fold(f64::INFINITY, f64::min)
        }
    };
    let pairs = [(0, 1), (0, 2), (1, 2)];
    let alpha = pairs
        .iter()
        .map(|&h| best(h, |l| l.alpha_us, false))
        .fold(0.0, f64::max);
    assert_eq!(t.model.0, alpha, "{}", t.describe());
}

/// Links measured slow stretch the waits' spin to 16 one-way latencies (at most 20 ms), so
/// that a call over them does not sleep while its packets are on the way; fast ones leave
/// it. Ranks that share cores never spin, whatever the links.
#[test]
fn slow_links_stretch_the_spin_of_waits() {
    // The waiting policy as a user gets it (the tests' own is fixed, and so left alone).
    let cfg = |r| {
        let mut c = hosts_config(r);
        c.waiter = Waiter {
            timeout: Duration::from_secs(60),
            ..Waiter::default()
        };
        c
    };
    on_ranks(HOSTS.len(), cfg, |c| {
        let link = |hosts, ranks, alpha_us| MeasuredLink {
            hosts,
            ranks,
            net: "tcp",
            lane: 0,
            alpha_us,
            beta_gbs: 1.0,
        };
        let table = |alpha_us| {
            vec![
                link((0, 1), (0, 2), 5.0),
                link((0, 2), (0, 3), alpha_us),
                link((1, 2), (2, 3), 5.0),
            ]
        };
        // The measurement at init may have stretched the spin already (a loaded machine
        // measures slow links): each table replaces the stretch of the one before.
        c.set_measured_links(table(5.0));
        let host = c.wait_spin();
        assert!(
            host <= Duration::from_millis(1),
            "rank {}: fast links: {host:?}",
            c.rank()
        );
        c.set_measured_links(table(300.0));
        let slow = c.wait_spin();
        if host.is_zero() {
            assert!(
                slow.is_zero(),
                "rank {}: spins {slow:?} sharing cores",
                c.rank()
            );
        } else {
            assert_eq!(slow, Duration::from_micros(4800), "rank {}", c.rank());
        }
        c.set_measured_links(table(5000.0));
        let slowest = c.wait_spin();
        assert!(
            slowest.is_zero() || slowest == Duration::from_millis(20),
            "{slowest:?}"
        );
        c.set_measured_links(table(5.0));
        assert_eq!(c.wait_spin(), host, "rank {}: fast links again", c.rank());
        check_collectives(&c, 64);
    });
}

/// With a table that makes TCP the network of small calls and the engine that of large
/// ones (as a slow TCP link beside a fast RDMA one would), calls below the crossover leave
/// the engine idle and calls above it go through it, between hosts 0 and 1 only; every
/// collective is correct at both sizes.
#[test]
fn calls_above_the_crossover_take_the_other_network() {
    on_hosts(|c| {
        let link = |hosts, ranks, net, lane, alpha_us, beta_gbs| MeasuredLink {
            hosts,
            ranks,
            net,
            lane,
            alpha_us,
            beta_gbs,
        };
        let m = c.set_measured_links(vec![
            link((0, 1), (0, 2), "tcp", 0, 5.0, 0.1),
            link((0, 1), (0, 2), "rocev2", 2, 50.0, 10.0),
            link((0, 2), (0, 3), "tcp", 0, 5.0, 0.1),
            link((1, 2), (2, 3), "tcp", 0, 5.0, 0.1),
        ]);
        assert_eq!(
            m.choices,
            vec![((0, 1), vec![(0, "tcp"), (4546, "rocev2")])]
        );
        let on_engine = HOSTS[c.rank()] != 2;
        // Whatever the measurement at init left in flight settles first.
        check_collectives(&c, 4);
        std::thread::sleep(std::time::Duration::from_millis(100));
        let before = engine_packets(&c);
        for count in [1usize, 64, 200] {
            check_collectives(&c, count);
        }
        let small = engine_packets(&c);
        for count in [2000usize, 100_000] {
            check_collectives(&c, count);
        }
        let large = engine_packets(&c);
        match (before, small, large) {
            (Some(b), Some(s), Some(l)) if on_engine => {
                assert!(
                    s - b < 16,
                    "rank {}: {} engine packets for small calls",
                    c.rank(),
                    s - b
                );
                assert!(
                    l - s > 100,
                    "rank {}: {} engine packets for large calls",
                    c.rank(),
                    l - s
                );
            }
            (None, None, None) if !on_engine => {}
            other => panic!("rank {}: engine counters {other:?}", c.rank()),
        }
        // Suspending closes the main network's idle connections; those of the engine stay
        // open (between hosts 0 and 1), and their peers are said to be kept.
        let closed = c
            .close_idle_connections(std::time::Duration::from_secs(5))
            .unwrap();
        let want: Vec<usize> = match HOSTS[c.rank()] {
            0 => vec![2],
            1 => vec![0, 1],
            _ => vec![],
        };
        assert_eq!(closed.kept_with, want, "rank {}: {closed:?}", c.rank());
        assert!(closed.closed > 0, "rank {}: {closed:?}", c.rank());
        check_collectives(&c, 100_000);
    });
}

/// A network a rank lists but cannot open (here: `verbs`, with no RDMA NIC on this machine)
/// is left out: the job runs over the others, measures only them and chooses nothing.
#[test]
fn a_network_a_rank_cannot_open_is_left_out() {
    if std::path::Path::new("/sys/class/infiniband")
        .read_dir()
        .is_ok_and(|mut d| d.next().is_some())
    {
        eprintln!("SKIPPED: this machine has an RDMA device, so verbs would open");
        return;
    }
    let cfg = |r| {
        let mut cfg: Config = common::config(Default::default());
        cfg.net = NetKind::Tcp;
        cfg.extra_nets = vec![NetKind::Verbs];
        cfg.host = Some(format!("host-{r}"));
        cfg
    };
    on_ranks(2, cfg, |c| {
        let m = c.measured_links().expect("2 hosts measure their links");
        assert_eq!(m.links.len(), 1, "{}", m.describe());
        assert_eq!(m.links[0].net, "tcp");
        assert!(m.choices.is_empty(), "{}", m.describe());
        check_collectives(&c, 1000);
    });
}

/// On a job of one host, one rank offering networks to choose among and one not: both keep
/// shared memory (the choice is made from every rank's blob, alike), and calls work.
#[test]
fn ranks_of_one_host_agree_on_shared_memory_whatever_each_offers() {
    let cfg = |r| {
        let mut cfg: Config = common::config(Default::default());
        cfg.net = NetKind::Tcp;
        cfg.extra_nets = if r == 0 {
            vec![NetKind::RoceV2]
        } else {
            Vec::new()
        };
        cfg.waiter.timeout = std::time::Duration::from_secs(20);
        cfg
    };
    on_ranks(2, cfg, |c| {
        assert_eq!(c.net_name(), "shm", "rank {}", c.rank());
        check_collectives(&c, 1000);
    });
}
