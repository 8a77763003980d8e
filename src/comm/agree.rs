//! What every rank agrees on from the rendezvous table (every rank's blob, `blob.rs`): the
//! cost model's inputs are computed for every rank from the table and combined the same way
//! on all of them ([`agreed_cost`]), so every rank picks the same algorithm and pipeline for
//! the same call, however the hosts differ; and the NICs every rank and host has.

use super::blob::Blob;
use crate::algo::calibrate::{self, HostSpeeds};
use crate::algo::model::LinkCost;

/// How one rank sees the job, from the table alone.
struct View {
    local_ranks: usize,
    cores: usize,
    all_local: bool,
    all_shm: bool,
}

fn view(blobs: &[Blob], r: usize, shm_net: bool) -> View {
    let n = blobs.len();
    let same_host = |p: usize| blobs[p].host == blobs[r].host;
    let local_ranks = (0..n).filter(|&p| same_host(p)).count();
    // A pair of one host talks through shared memory when both offer it.
    let shm_peers = (0..n)
        .filter(|&p| p != r && same_host(p) && blobs[r].shm.is_some() && blobs[p].shm.is_some())
        .count();
    View {
        local_ranks,
        cores: blobs[r].inputs.cores.max(1) as usize,
        all_local: local_ranks == n,
        all_shm: (shm_peers > 0 && shm_peers == n - 1) || shm_net,
    }
}

/// The cost model's inputs, the same on every rank: each rank's own view (its host's cores
/// and ranks, its network's latency and speed) is worked out for every rank from the table,
/// and the views are combined pessimistically (the highest latency and per-message cost, the
/// lowest bandwidth and core share) with the slowest measured speeds. `shm_net`: the network
/// is shared memory itself; `node`: the shared-memory segments' slot size and whether
/// single copies work (agreed by every rank when the segments were mapped).
pub(super) fn agreed_cost(blobs: &[Blob], shm_net: bool, node: Option<(usize, bool)>) -> LinkCost {
    let measured = calibrate::slowest(blobs.iter().map(|b| b.speeds));
    let speeds = calibrate::for_model(measured);
    let mut cost: Option<LinkCost> = None;
    for r in 0..blobs.len() {
        let v = view(blobs, r, shm_net);
        let inputs = blobs[r].inputs;
        let share = (v.cores as f64 / v.local_ranks as f64).min(1.0);
        let mine = LinkCost {
            // Software overhead of a TCP message on top of the wire: two syscalls and a wakeup.
            alpha_us: if v.all_shm {
                1.0
            } else if v.all_local {
                10.0
            } else {
                inputs.latency_us as f64 + 5.0
            },
            // TCP is bound by one core's copy speed long before the link on fast NICs.
            // Ranks sharing cores also share the CPU that copies the bytes.
            // Over shared memory the rings' bandwidth is a memory copy's: scaled with the
            // measured copy speed like the shared-memory algorithms' costs, so that a host
            // measured slow (or loaded at init) does not tip the choice between them.
            beta_gbs: if v.all_shm {
                speeds.copy_gbs
            } else if v.all_local {
                3.0
            } else {
                (inputs.speed_mbps as f64 / 8000.0).min(3.0)
            } * share,
            gamma_gbs: speeds.reduce_gbs,
            // Network algorithms reduce what just arrived in their own buffers: about the
            // kernel's speed, 4x the shared-memory algorithms' effective one (fitted with
            // scripts/algo-sweep.sh; docs/PERFORMANCE-LOG.md).
            wire_gamma_gbs: 4.0 * speeds.reduce_gbs,
            // Measured on 2 cores with 4 ranks: each message costs about a context switch
            // over TCP; over shared-memory rings a yield to the peer that runs next.
            msg_cpu_us: if v.local_ranks <= v.cores {
                0.0
            } else if v.all_shm {
                v.local_ranks as f64 / v.cores as f64
            } else {
                10.0 * v.local_ranks as f64 / v.cores as f64
            },
            flat_sync_us: node.map(|_| crate::algo::model::flat_sync_us(v.local_ranks, v.cores)),
            copy_gbs: speeds.copy_gbs,
            cpu_share: share,
            flat_slot: node.map_or(256 << 10, |n| n.0),
            flat_cma: node.is_some_and(|n| n.1),
            // Set once the hosts are known (init).
            nic_share: 1.0,
        };
        cost = Some(match cost {
            None => mine,
            Some(c) => LinkCost {
                alpha_us: c.alpha_us.max(mine.alpha_us),
                beta_gbs: c.beta_gbs.min(mine.beta_gbs),
                msg_cpu_us: c.msg_cpu_us.max(mine.msg_cpu_us),
                flat_sync_us: c.flat_sync_us.zip(mine.flat_sync_us).map(|(a, b)| a.max(b)),
                cpu_share: c.cpu_share.min(mine.cpu_share),
                ..c
            },
        });
    }
    cost.unwrap_or_default()
}

/// The cost model's links on a simulated cluster (`ROCCL_NET=sim`), from its spec rather
/// than from this machine: the simulated cluster's latencies and speeds between hosts
/// (`.1`, also every flat call's) and inside one (`.0`), a core per simulated rank, the
/// spec's reduction speed (none given: reductions take no time) and free copies, as the
/// simulator charges them. `base`: the agreed cost, whose other inputs (shared-memory
/// slots) stay. The model then chooses as it
/// would on that cluster, which is what a simulation is for.
pub(super) fn simulated_costs(
    spec: &crate::net::sim::SimSpec,
    base: LinkCost,
) -> (LinkCost, LinkCost) {
    // The simulator charges its software overhead per message at both ends.
    let link = |us: f64, gbps: f64| LinkCost {
        alpha_us: us + 2.0 * spec.msg_us,
        beta_gbs: gbps / 8.0,
        gamma_gbs: if spec.reduce_gbs > 0.0 {
            spec.reduce_gbs
        } else {
            1e6
        },
        wire_gamma_gbs: if spec.reduce_gbs > 0.0 {
            spec.reduce_gbs
        } else {
            1e6
        },
        msg_cpu_us: 0.0,
        cpu_share: 1.0,
        flat_sync_us: None,
        // The simulator's copies take no virtual time.
        copy_gbs: 1e6,
        ..base
    };
    (
        link(spec.local_us, spec.local_gbps),
        link(spec.nic_us, spec.nic_gbps),
    )
}

/// The fewest NICs the ranks of any host use, at least 1: how many ways the traffic between
/// hosts spreads on every host. A host's NICs: the distinct ones its ranks name
/// ([`HostInputs::nic`]), or the devices each of its ranks has (the fewest), whichever is
/// more (ranks that each have every NIC of the host start on different ones).
pub(super) fn nics_per_host(blobs: &[Blob]) -> usize {
    let mut by_host: std::collections::HashMap<u64, (std::collections::HashSet<u64>, u32)> =
        std::collections::HashMap::new();
    for b in blobs {
        let e = by_host
            .entry(b.host)
            .or_insert_with(|| (Default::default(), u32::MAX));
        e.0.insert(b.inputs.nic);
        e.1 = e.1.min(b.inputs.devices.max(1));
    }
    by_host
        .values()
        .map(|(fps, devices)| fps.len().max(*devices as usize))
        .min()
        .unwrap_or(1)
        .max(1)
}

/// The fewest network devices (NICs) any rank has, at least 1: every rank spreads its
/// channels over that many ([`crate::algo::model::Tuning::nics`]).
pub(super) fn nics_per_rank(blobs: &[Blob]) -> usize {
    blobs
        .iter()
        .map(|b| b.inputs.devices.max(1) as usize)
        .min()
        .unwrap_or(1)
}

/// The measured speeds the model uses (the slowest rank's), for the log.
pub(super) fn slowest_speeds(blobs: &[Blob]) -> HostSpeeds {
    calibrate::slowest(blobs.iter().map(|b| b.speeds))
}

/// Checks of a rendezvous table without I/O, for the fuzz targets: every blob is parsed as
/// rank 0 of the table parses it (with rank 0's network and settings, read from its bytes,
/// so that a table of one job gets past the checks), then the cost model's inputs are agreed
/// from the parsed blobs and an algorithm chosen for a few calls.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz(table: &[&[u8]], shm_net: bool, node: Option<(usize, bool)>) {
    use super::blob::{parse_blob, ALGOS, AT_SETTINGS, BLOB_LEN, SETTINGS};
    use crate::error::Result;
    use crate::types::DataType;
    let Some(first) = table.first().filter(|b| b.len() == BLOB_LEN) else {
        return;
    };
    let net = std::str::from_utf8(&first[12..28])
        .unwrap_or("?")
        .trim_end_matches('\0');
    let mut mine = [0u64; SETTINGS.len()];
    for (i, m) in mine.iter_mut().enumerate() {
        let at = AT_SETTINGS + 8 * i;
        *m = u64::from_le_bytes(first[at..at + 8].try_into().expect("8 bytes"));
    }
    let Ok(blobs) = table
        .iter()
        .enumerate()
        .map(|(r, b)| parse_blob(r, b, 0, net, &mine))
        .collect::<Result<Vec<_>>>()
    else {
        return;
    };
    let cost = agreed_cost(&blobs, shm_net, node);
    let _ = slowest_speeds(&blobs);
    let tuning = crate::algo::model::Tuning::default();
    for kind in [
        crate::algo::model::CollKind::AllReduce,
        crate::algo::model::CollKind::Broadcast,
        crate::algo::model::CollKind::AllGather,
    ] {
        for bytes in [0usize, 8, 1 << 20, 1 << 30] {
            let forced = ALGOS.get(mine[0] as usize).copied();
            let _ = crate::algo::model::choose_for(
                kind,
                DataType::F32,
                blobs.len(),
                bytes,
                &cost,
                forced,
                &tuning,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::blob::*;
    use super::super::call_tag::*;
    use super::super::{Collective, Config};
    use super::*;
    use crate::algo::calibrate;
    use crate::algo::model::{self, CollKind, Tuning};
    use crate::algo::Algo;
    use crate::net::NetHandle;
    use crate::types::DataType;
    use crate::types::RedOp;

    fn handle(b: u8) -> NetHandle {
        NetHandle::from_bytes(&[b; 40]).unwrap()
    }

    fn inputs(cores: u32, latency_us: f32, speed_mbps: u32) -> HostInputs {
        HostInputs {
            cores,
            latency_us,
            speed_mbps,
            nic: 0,
            devices: 1,
        }
    }

    /// Hosts' NICs and every rank's devices: the NICs a host's ranks name, or the devices
    /// each has, whichever is more, the fewest over hosts; every rank's channels per NIC:
    /// the fewest devices.
    #[test]
    fn nics_per_host_and_per_rank_come_from_every_blob() {
        let s = settings(&cfg(), 4 << 20);
        let rank = |host: u64, nic: u64, devices: u32| {
            let i = HostInputs {
                nic,
                devices,
                ..inputs(4, 2.0, 100_000)
            };
            let b = blob(
                &handle(1),
                "rocev2",
                None,
                false,
                &s,
                (i, calibrate::REFERENCE),
                (None, &Default::default()),
                host,
            );
            parse_blob(0, &b, 0, "rocev2", &s).unwrap()
        };
        // Two hosts, two ranks each, every rank with both of its host's NICs.
        let both = [rank(1, 7, 2), rank(1, 7, 2), rank(2, 8, 2), rank(2, 8, 2)];
        assert_eq!((nics_per_host(&both), nics_per_rank(&both)), (2, 2));
        // One rank per NIC, each with one device.
        let one_each = [rank(1, 7, 1), rank(1, 9, 1), rank(2, 8, 1), rank(2, 6, 1)];
        assert_eq!((nics_per_host(&one_each), nics_per_rank(&one_each)), (2, 1));
        // A host with one NIC holds both back.
        let mixed = [rank(1, 7, 2), rank(1, 7, 2), rank(2, 8, 1), rank(2, 8, 1)];
        assert_eq!((nics_per_host(&mixed), nics_per_rank(&mixed)), (1, 1));
    }

    fn cfg() -> Config {
        Config::from_env().unwrap()
    }

    #[test]
    fn rendezvous_blob_carries_both_handles_and_the_host_inputs() {
        let s = settings(&cfg(), 4 << 20);
        let host = inputs(16, 2.5, 100_000);
        let spare: std::net::SocketAddr = "10.1.2.3:4567".parse().unwrap();
        let b = blob(
            &handle(7),
            "tcp",
            Some(&handle(9)),
            true,
            &s,
            (host, calibrate::REFERENCE),
            (Some(spare), &[None, Some(handle(5)), None]),
            0x5eed,
        );
        assert_eq!(b.len(), BLOB_LEN);
        let p = parse_blob(3, &b, 0, "tcp", &s).unwrap();
        assert!(p.extras[0].is_none() && p.extras[2].is_none());
        assert_eq!(p.extras[1].as_ref().unwrap().as_bytes()[..40], [5u8; 40]);
        assert!(p.node);
        assert_eq!(p.handle.as_bytes()[..40], [7u8; 40]);
        assert_eq!(p.shm.unwrap().as_bytes()[..40], [9u8; 40]);
        assert_eq!(p.inputs, host);
        assert_eq!(p.spare, Some(spare));
        assert_eq!(p.host, 0x5eed);
        let plain = blob(
            &handle(7),
            "tcp",
            None,
            false,
            &s,
            (host, calibrate::REFERENCE),
            (None, &Default::default()),
            1,
        );
        let p = parse_blob(3, &plain, 0, "tcp", &s).unwrap();
        assert!(p.shm.is_none() && p.spare.is_none());
        let e = parse_blob(3, &b, 0, "rocev2", &s).unwrap_err().to_string();
        assert!(e.contains("rank 3") && e.contains("ROCCL_NET"), "{e}");
        let e = parse_blob(5, &b[..100], 0, "tcp", &s)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 5") && e.contains("same roccl version"),
            "{e}"
        );
    }

    /// Every setting that cuts calls is compared, and the error names it, both values and
    /// both ranks.
    #[test]
    fn ranks_with_other_settings_are_refused_naming_the_setting() {
        let base = cfg();
        let mine = settings(&base, 4 << 20);
        let host = inputs(2, 10.0, 0);
        let mut cases: Vec<(Config, usize, &str)> = Vec::new();
        let mut c = base.clone();
        c.algo = Some(Algo::Doubling);
        cases.push((c, 4 << 20, "ROCCL_ALGO=doubling"));
        let mut c = base.clone();
        c.ring_window = 0;
        cases.push((c, 4 << 20, "ROCCL_RING_WINDOW=0"));
        let mut c = base.clone();
        c.tuning.slice = Some(1 << 20);
        cases.push((c, 4 << 20, "ROCCL_SLICE=1048576"));
        cases.push((base.clone(), 1 << 20, "ROCCL_STREAM_CHUNK=1048576"));
        let mut c = base.clone();
        c.gpu_direct_min = 1;
        cases.push((c, 4 << 20, "ROCCL_GPU_DIRECT_MIN=1"));
        let mut c = base.clone();
        c.deterministic = true;
        cases.push((c, 4 << 20, "ROCCL_DETERMINISTIC=1"));
        let mut c = base.clone();
        c.measure_links = false;
        cases.push((c, 4 << 20, "ROCCL_MEASURE=0"));
        for (c, chunk, want) in cases {
            let theirs = settings(&c, chunk);
            let b = blob(
                &handle(1),
                "tcp",
                None,
                false,
                &theirs,
                (host, calibrate::REFERENCE),
                (None, &Default::default()),
                1,
            );
            let e = parse_blob(2, &b, 1, "tcp", &mine)
                .expect_err("refused")
                .to_string();
            assert!(
                e.contains("rank 2") && e.contains("rank 1") && e.contains(want),
                "{e}"
            );
        }
        // Direct against doubling (both unset on one side): named too.
        let mut c = base.clone();
        c.algo = Some(Algo::Direct);
        let b = blob(
            &handle(1),
            "tcp",
            None,
            false,
            &settings(&c, 4 << 20),
            (host, calibrate::REFERENCE),
            (None, &Default::default()),
            1,
        );
        let e = parse_blob(0, &b, 1, "tcp", &mine).unwrap_err().to_string();
        assert!(e.contains("ROCCL_ALGO=direct") && e.contains("auto"), "{e}");
    }

    /// RoCE v2 through a NIC and through the userspace engine form one job; any other pair
    /// of networks is refused, naming both.
    #[test]
    fn roce_v2_ranks_of_either_provider_join_one_job() {
        let base = cfg();
        let mine = settings(&base, 4 << 20);
        let host = inputs(2, 10.0, 0);
        for (theirs, ours, ok) in [
            ("verbs", "rocev2", true),
            ("rocev2", "verbs", true),
            ("verbs", "verbs", true),
            ("tcp", "verbs", false),
            ("rocev2", "tcp", false),
            ("shm", "rocev2", false),
        ] {
            let b = blob(
                &handle(1),
                theirs,
                None,
                false,
                &mine,
                (host, calibrate::REFERENCE),
                (None, &Default::default()),
                1,
            );
            match parse_blob(2, &b, 1, ours, &mine) {
                Ok(_) => assert!(ok, "{theirs} and {ours} must be refused"),
                Err(e) => {
                    let e = e.to_string();
                    assert!(!ok, "{theirs} and {ours} refused: {e}");
                    assert!(e.contains(theirs) && e.contains(ours), "{e}");
                }
            }
        }
    }

    fn blobs(hosts: &[(u64, HostInputs)], shm: bool) -> Vec<Blob> {
        hosts
            .iter()
            .map(|&(host, inputs)| Blob {
                host,
                handle: handle(0),
                shm: shm.then(|| handle(1)),
                node: false,
                speeds: HostSpeeds {
                    reduce_gbs: 10.0,
                    copy_gbs: 8.0,
                },
                inputs,
                pid: 0,
                pid_ns: 0,
                spare: None,
                extras: Default::default(),
            })
            .collect()
    }

    /// Hosts with other core counts and NICs: every rank gets the same cost inputs, hence
    /// the same choice, whichever rank computes them (the table is the same on all).
    #[test]
    fn hosts_that_differ_give_every_rank_the_same_choice() {
        // Rank 0 alone on a 32-core host with a 100 Gbit/s, 2 µs NIC; ranks 1-3 share a
        // 2-core host with a 10 Gbit/s, 20 µs one.
        let big = inputs(32, 2.0, 100_000);
        let small = inputs(2, 20.0, 10_000);
        let t = blobs(&[(1, big), (2, small), (2, small), (2, small)], false);
        let cost = agreed_cost(&t, false, None);
        assert_eq!(cost.alpha_us, 25.0);
        assert!(
            (cost.beta_gbs - 1.25 * 2.0 / 3.0).abs() < 1e-9,
            "{}",
            cost.beta_gbs
        );
        assert!(cost.msg_cpu_us > 0.0);
        // What each host would have picked alone differs; the agreed pick is one.
        let alone_big = agreed_cost(&t[..1], false, None);
        let choose = |c: &LinkCost, bytes| {
            model::choose_for(
                CollKind::AllReduce,
                DataType::F32,
                4,
                bytes,
                c,
                None,
                &Tuning::default(),
            )
        };
        let differs = [8usize, 4096, 1 << 16, 1 << 20, 16 << 20]
            .iter()
            .any(|&b| choose(&alone_big, b).0 != choose(&cost, b).0);
        assert!(
            differs,
            "the test's hosts should disagree when each decides alone"
        );
        // The order of the table does not matter to the pessimistic combination.
        let mut rev = blobs(&[(2, small), (2, small), (2, small), (1, big)], false);
        rev.swap(0, 1);
        let c2 = agreed_cost(&rev, false, None);
        assert_eq!(
            (c2.alpha_us, c2.beta_gbs, c2.msg_cpu_us),
            (cost.alpha_us, cost.beta_gbs, cost.msg_cpu_us)
        );
    }

    /// Every collective, reduction, type and root gives its own tag, and the description
    /// reads back what was encoded.
    #[test]
    fn call_tags_tell_calls_apart() {
        let mut seen = std::collections::HashSet::new();
        let mut calls = vec![
            Collective::AllGather,
            Collective::AllToAll,
            Collective::Barrier,
        ];
        for op in [RedOp::Sum, RedOp::Prod, RedOp::Max, RedOp::Min, RedOp::Avg] {
            calls.push(Collective::AllReduce(op));
            calls.push(Collective::ReduceScatter(op));
            calls.push(Collective::Reduce { op, root: 3 });
        }
        calls.push(Collective::Broadcast { root: 0 });
        calls.push(Collective::Broadcast { root: 1 });
        for c in &calls {
            for dt in DataType::ALL {
                let t = call_tag(c, dt, 4096);
                assert!(t & 1 << 31 != 0);
                let moves = matches!(
                    c,
                    Collective::AllGather
                        | Collective::AllToAll
                        | Collective::Barrier
                        | Collective::Broadcast { .. }
                );
                // Moves are the same call whatever the element type.
                if !moves || dt == DataType::U8 {
                    assert!(seen.insert(t), "{c:?} {dt}: tag {t:#x} taken");
                }
                for a in ALGOS {
                    assert!(describe(with_algo(t, a)).ends_with(&format!(" by {a}")));
                }
            }
        }
        let t = with_algo(
            call_tag(&Collective::AllReduce(RedOp::Avg), DataType::Bf16, 64),
            Algo::Ring,
        );
        assert_eq!(describe(t), "all_reduce(avg, bf16) by ring");
        let t = call_tag(&Collective::Broadcast { root: 7 }, DataType::F32, 64);
        assert_eq!(describe(t), "broadcast(root 7)");
        assert_eq!(
            call_tag(
                &Collective::SendRecv {
                    to: Some(1),
                    from: None
                },
                DataType::U8,
                8
            ),
            0
        );
        // Counts that differ by one element, or by a power of two, give other tags.
        let ar = |b| call_tag(&Collective::AllReduce(RedOp::Sum), DataType::F32, b);
        for b in [4usize, 400, 4096, 1 << 20, 3 << 30] {
            assert_ne!(ar(b), ar(b + 4), "{b}");
            assert_ne!(ar(b), ar(2 * b), "{b}");
            assert!(differ(ar(b), ar(b + 4)).ends_with("with another count of bytes"));
        }
        assert!(describe(0).contains("point-to-point"));
    }
}
