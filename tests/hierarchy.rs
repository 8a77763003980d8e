//! Jobs over several hosts: ranks of one machine named apart with `Config::host`
//! (`ROCCL_HOSTID`) behave as hosts of a cluster — shared memory inside a host, TCP between
//! hosts. Every collective is checked against a reference with the hierarchical algorithm
//! forced, with the host-ordered ring, and as the cost model chooses, on even hosts, uneven
//! hosts and ranks dealt round-robin over hosts.

mod common;

use roccl::comm::Hier;
use roccl::net::NetKind;
use roccl::{Algo, CallOpts, Collective, Communicator, Config, DataType, RedOp, UniqueId};

/// Run `f` on one thread per rank; rank `r` is on host `hosts[r]`.
fn on_hosts(hosts: &[usize], cfg: Config, f: impl Fn(Communicator) + Send + Sync) {
    let id = UniqueId::new().unwrap();
    let n = hosts.len();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let mut cfg = cfg.clone();
                cfg.host = Some(format!("host-{}", hosts[r]));
                let f = &f;
                let id = &id;
                s.spawn(move || f(Communicator::init_with(id, n, r, cfg).expect("init")))
            })
            .collect();
        for (r, h) in hs.into_iter().enumerate() {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(e)
            }
            let _ = r;
        }
    });
}

fn cfg() -> Config {
    let mut c = common::config(Default::default());
    c.net = NetKind::Auto;
    c
}

/// Rank `r`'s input element `i`: distinct per rank and element, exact in f32 sums.
fn val(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 19) as f32 + r as f32
}

fn forced(a: Algo) -> CallOpts {
    CallOpts {
        algo: Some(a),
        ..Default::default()
    }
}

fn f32s(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// Every rooted and reducing collective, checked, on the hosts `hosts`, forcing `algo`
/// (None: the model's choice); asserts that `want` (if given) was the algorithm used.
fn check_all(hosts: &[usize], algo: Option<Algo>, want: Option<Algo>) {
    check_all_over(hosts, cfg(), algo, want)
}

fn check_all_over(hosts: &[usize], cfg: Config, algo: Option<Algo>, want: Option<Algo>) {
    let n = hosts.len();
    on_hosts(hosts, cfg, |c| {
        let r = c.rank();
        let opts = algo.map_or_else(CallOpts::default, forced);
        for count in [1usize, 3, 7, 1000, 70_001] {
            let input: Vec<f32> = (0..count).map(|i| val(r, i)).collect();
            let sum: Vec<f32> = (0..count)
                .map(|i| (0..n).map(|q| val(q, i)).sum())
                .collect();
            let max: Vec<f32> = (0..count)
                .map(|i| (0..n).map(|q| val(q, i)).fold(f32::MIN, f32::max))
                .collect();
            // All-reduce: sum out of place, max and average in place.
            let mut out = vec![0f32; count];
            let info = c
                .run_raw(
                    Collective::AllReduce(RedOp::Sum),
                    DataType::F32,
                    Some(f32s(&input)),
                    bytemuck::cast_slice_mut(&mut out),
                    &opts,
                )
                .unwrap();
            assert_eq!(
                out, sum,
                "all-reduce sum, rank {r}, {count} elements, {info:?}"
            );
            if let Some(w) = want {
                assert_eq!(info.algo, Some(w), "all-reduce of {count} on {hosts:?}");
            }
            let mut buf = input.clone();
            c.run_raw(
                Collective::AllReduce(RedOp::Max),
                DataType::F32,
                None,
                bytemuck::cast_slice_mut(&mut buf),
                &opts,
            )
            .unwrap();
            assert_eq!(buf, max, "all-reduce max, rank {r}, {count}");
            let mut buf = input.clone();
            c.run_raw(
                Collective::AllReduce(RedOp::Avg),
                DataType::F32,
                None,
                bytemuck::cast_slice_mut(&mut buf),
                &opts,
            )
            .unwrap();
            for (i, (a, s)) in buf.iter().zip(&sum).enumerate() {
                assert!(
                    (a - s / n as f32).abs() < 1e-3,
                    "average, rank {r}, element {i}: {a} vs {}",
                    s / n as f32
                );
            }
            // Broadcast and reduce from a root on each host (the first and the last rank).
            for root in [0, n - 1, n / 2] {
                let mut b = if r == root {
                    input.clone()
                } else {
                    vec![-1f32; count]
                };
                let info = c
                    .run_raw(
                        Collective::Broadcast { root },
                        DataType::F32,
                        None,
                        bytemuck::cast_slice_mut(&mut b),
                        &opts,
                    )
                    .unwrap();
                let want_b: Vec<f32> = (0..count).map(|i| val(root, i)).collect();
                assert_eq!(
                    b, want_b,
                    "broadcast from {root}, rank {r}, {count}, {info:?}"
                );
                if let Some(w) = want {
                    assert_eq!(info.algo, Some(w), "broadcast");
                }
                // Off the root the output of a reduce may be empty.
                let mut out = if r == root {
                    vec![0f32; count]
                } else {
                    Vec::new()
                };
                c.run_raw(
                    Collective::Reduce {
                        op: RedOp::Sum,
                        root,
                    },
                    DataType::F32,
                    Some(f32s(&input)),
                    bytemuck::cast_slice_mut(&mut out),
                    &opts,
                )
                .unwrap();
                if r == root {
                    assert_eq!(out, sum, "reduce to {root}, {count}");
                }
                // In place.
                let mut buf = input.clone();
                c.run_raw(
                    Collective::Reduce {
                        op: RedOp::Avg,
                        root,
                    },
                    DataType::F32,
                    None,
                    bytemuck::cast_slice_mut(&mut buf),
                    &opts,
                )
                .unwrap();
                if r == root {
                    for (a, s) in buf.iter().zip(&sum) {
                        assert!(
                            (a - s / n as f32).abs() < 1e-3,
                            "in-place average reduce to {root}"
                        );
                    }
                }
            }
            // All-gather and reduce-scatter: blocks in rank order whatever the ring's order
            // (by host on uneven hosts too: through each host's leader).
            let block: Vec<f32> = (0..count).map(|i| val(r, i)).collect();
            let mut all = vec![0f32; count * n];
            let info = c
                .run_raw(
                    Collective::AllGather,
                    DataType::F32,
                    Some(f32s(&block)),
                    bytemuck::cast_slice_mut(&mut all),
                    &opts,
                )
                .unwrap();
            let want_all: Vec<f32> = (0..n)
                .flat_map(|q| (0..count).map(move |i| val(q, i)))
                .collect();
            assert_eq!(all, want_all, "all-gather, rank {r}, {count}, {info:?}");
            if let Some(w) = want {
                assert_eq!(info.algo, Some(w), "all-gather of {count} on {hosts:?}");
            }
            let mut inplace = vec![0f32; count * n];
            inplace[r * count..(r + 1) * count].copy_from_slice(&block);
            c.run_raw(
                Collective::AllGather,
                DataType::F32,
                None,
                bytemuck::cast_slice_mut(&mut inplace),
                &opts,
            )
            .unwrap();
            assert_eq!(inplace, want_all, "in-place all-gather, rank {r}, {count}");
            let big: Vec<f32> = (0..count * n).map(|i| val(r, i)).collect();
            let want_rs: Vec<f32> = (0..count)
                .map(|i| (0..n).map(|q| val(q, r * count + i)).sum())
                .collect();
            for op in [RedOp::Sum, RedOp::Avg] {
                let mut mine = vec![0f32; count];
                let info = c
                    .run_raw(
                        Collective::ReduceScatter(op),
                        DataType::F32,
                        Some(f32s(&big)),
                        bytemuck::cast_slice_mut(&mut mine),
                        &opts,
                    )
                    .unwrap();
                let scale = if op == RedOp::Avg { n as f32 } else { 1.0 };
                for (i, (a, s)) in mine.iter().zip(&want_rs).enumerate() {
                    assert!(
                        (a - s / scale).abs() < 1e-3,
                        "reduce-scatter {op:?}, rank {r}, element {i} of {count}: {a} vs {} ({info:?})",
                        s / scale
                    );
                }
                if let Some(w) = want {
                    assert_eq!(info.algo, Some(w), "reduce-scatter of {count} on {hosts:?}");
                }
            }
            let mut inplace = big.clone();
            c.run_raw(
                Collective::ReduceScatter(RedOp::Sum),
                DataType::F32,
                None,
                bytemuck::cast_slice_mut(&mut inplace),
                &opts,
            )
            .unwrap();
            assert_eq!(
                &inplace[r * count..(r + 1) * count],
                &want_rs[..],
                "in-place reduce-scatter, rank {r}, {count}"
            );
        }
    });
}

#[test]
fn hierarchical_calls_on_two_hosts_of_two_ranks() {
    check_all(&[0, 0, 1, 1], Some(Algo::Hier), Some(Algo::Hier));
}

#[test]
fn hierarchical_calls_between_hosts_over_rocev2() {
    // The userspace RoCE v2 engine between hosts, shared memory inside them.
    let mut c = cfg();
    c.net = NetKind::RoceV2;
    check_all_over(&[0, 1, 0, 1], c.clone(), Some(Algo::Hier), Some(Algo::Hier));
    // A network named explicitly is the one between hosts; inside a host, shared memory.
    on_hosts(&[0, 1, 0, 1], c.clone(), |comm| {
        assert_eq!(comm.net_name(), "rocev2+shm");
    });
    // On one host, the network named carries every peer (what its tests measure).
    on_hosts(&[0, 0, 0], c, |comm| assert_eq!(comm.net_name(), "rocev2"));
}

#[test]
fn hierarchical_calls_with_ranks_dealt_round_robin() {
    // Hosts 0,1,0,1,0,1: the ring goes 0 2 4 1 3 5 and each host's first rank leads it.
    check_all(&[0, 1, 0, 1, 0, 1], Some(Algo::Hier), Some(Algo::Hier));
}

#[test]
fn hierarchical_calls_on_uneven_hosts() {
    check_all(&[0, 0, 0, 1], Some(Algo::Hier), Some(Algo::Hier));
    check_all(&[0, 1, 1, 2, 2], Some(Algo::Hier), Some(Algo::Hier));
    // Hosts whose ranks are not consecutive: a leader sends and receives several runs.
    check_all(&[0, 1, 0, 2, 0, 1], Some(Algo::Hier), Some(Algo::Hier));
}

#[test]
fn flat_rings_follow_hosts_and_the_model_chooses() {
    // Rings over ranks dealt round-robin: reordered by host, results in rank order.
    check_all(&[0, 1, 0, 1, 2, 2], Some(Algo::Ring), Some(Algo::Ring));
    // The model's own choice, whatever it is, gives the same results.
    check_all(&[0, 1, 1, 0], None, None);
}

#[test]
fn roccl_hier_decides() {
    // ROCCL_HIER=0: never hierarchical, even where the model would be.
    let mut off = cfg();
    off.hier = Hier::Off;
    let mut on = cfg();
    on.hier = Hier::On;
    for (c, want) in [(off, false), (on, true)] {
        on_hosts(&[0, 0, 1, 1], c, |comm| {
            let mut v = vec![1f32; 1024];
            let info = comm
                .run_raw(
                    Collective::AllReduce(RedOp::Sum),
                    DataType::F32,
                    None,
                    bytemuck::cast_slice_mut(&mut v),
                    &CallOpts::default(),
                )
                .unwrap();
            assert_eq!(v, vec![4f32; 1024]);
            assert_eq!(info.algo == Some(Algo::Hier), want, "{info:?}");
        });
    }
    // One host: hierarchical is not applicable, and a forced one falls back to the model.
    let mut one = cfg();
    one.hier = Hier::On;
    common::run_ranks(3, one, |comm| {
        let mut v = vec![1f32; 64];
        let info = comm
            .run_raw(
                Collective::AllReduce(RedOp::Sum),
                DataType::F32,
                None,
                bytemuck::cast_slice_mut(&mut v),
                &forced(Algo::Hier),
            )
            .unwrap();
        assert_eq!(v, vec![3f32; 64]);
        assert_ne!(info.algo, Some(Algo::Hier));
    });
}

#[test]
fn the_host_override_separates_shared_memory_from_the_network() {
    on_hosts(&[0, 0, 1], cfg(), |c| {
        // Ranks 0 and 1 share a host (shared memory), rank 2 is reached over TCP.
        assert_eq!(c.net_name(), if c.rank() == 2 { "tcp" } else { "tcp+shm" });
        let mut v = [c.rank() as f32; 4];
        c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
        assert_eq!(v, [3f32; 4]);
    });
}

/// Links between hosts are measured at init: every rank holds the same table (each pair of
/// hosts, measured by their first ranks), the cost model takes the slowest pair, and a
/// communicator of one host, or one with the measurement off, has none.
#[test]
fn the_links_between_hosts_are_measured_at_init_and_agreed() {
    let tables = std::sync::Mutex::new(Vec::new());
    on_hosts(&[0, 1, 1, 2], cfg(), |c| {
        let m = c
            .measured_links()
            .expect("a job of 3 hosts measures its links");
        // `/status` shows the same table for this communicator.
        let status = roccl::metrics::status();
        let shown = status["communicators"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["rank"] == c.rank() && e["nranks"] == 4)
            .map(|e| e["measured_links"].clone())
            .find(|l| {
                l.as_array().is_some_and(|l| {
                    l.len() == 3 && l[0]["latency_us"].as_f64() == Some(m.links[0].alpha_us)
                })
            });
        let shown = shown.unwrap_or_else(|| panic!("not in /status: {status}"));
        assert_eq!(shown[2]["hosts"], serde_json::json!([1, 2]), "{shown}");
        assert_eq!(
            shown[2]["bandwidth_GBps"].as_f64(),
            Some(m.links[2].beta_gbs)
        );
        tables.lock().unwrap().push(m);
        // The communicator still works after the measurement.
        let mut v = [1f32; 8];
        c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
        assert_eq!(v, [4f32; 8]);
    });
    let tables = tables.into_inner().unwrap();
    assert!(
        tables.iter().all(|t| *t == tables[0]),
        "ranks differ: {tables:?}"
    );
    let t = &tables[0];
    let pairs: Vec<_> = t.links.iter().map(|l| (l.hosts, l.ranks)).collect();
    assert_eq!(
        pairs,
        [((0, 1), (0, 1)), ((0, 2), (0, 3)), ((1, 2), (1, 3))]
    );
    for l in &t.links {
        assert!(l.alpha_us > 0.0 && l.alpha_us < 1e5, "{l:?}");
        assert!(l.beta_gbs > 0.0 && l.beta_gbs < 1e3, "{l:?}");
    }
    let slowest = t.links.iter().map(|l| l.alpha_us).fold(0.0, f64::max);
    assert_eq!(t.model.0, slowest, "{}", t.describe());
    assert!(t.model.1 > 0.0, "{}", t.describe());

    let mut off = cfg();
    off.measure_links = false;
    on_hosts(&[0, 1], off, |c| assert!(c.measured_links().is_none()));
    common::run_ranks(2, cfg(), |c| assert!(c.measured_links().is_none()));
}
