//! The cost model's choices and estimates.

use super::*;

#[test]
fn small_all_reduce_is_one_shot_large_is_ring() {
    let c = LinkCost::default();
    let t = Tuning::default();
    assert_eq!(
        choose(CollKind::AllReduce, 4, 8, &c, None, &t).0,
        Algo::Direct
    );
    assert_eq!(
        choose(CollKind::AllReduce, 4, 64 << 20, &c, None, &t).0,
        Algo::Ring
    );
    assert_eq!(
        choose(CollKind::AllReduce, 4, 8, &c, Some(Algo::Tree), &t).0,
        Algo::Tree
    );
    // Forcing an algorithm a collective lacks falls back to the model.
    assert_eq!(
        choose(CollKind::AllGather, 4, 8, &c, Some(Algo::Tree), &t).0,
        Algo::Bruck
    );
}

#[test]
fn shared_cores_favour_fewer_messages() {
    let c = LinkCost {
        msg_cpu_us: 20.0,
        ..LinkCost::default()
    };
    let t = Tuning::default();
    // Tree and recursive doubling measured alike (~70 µs); direct (~150) and ring
    // (~190-340) send more messages per rank.
    let a = choose(CollKind::AllReduce, 4, 8, &c, None, &t).0;
    assert!(matches!(a, Algo::Tree | Algo::Doubling), "{a}");
    assert_eq!(
        choose(CollKind::AllReduce, 4, 8, &LinkCost::default(), None, &t).0,
        Algo::Direct
    );
}

/// Ranks of one host, each with a core, over shared memory with mapped segments.
fn shm_host() -> LinkCost {
    LinkCost {
        alpha_us: 1.0,
        beta_gbs: 8.0,
        flat_sync_us: Some(0.3),
        ..LinkCost::default()
    }
}

#[test]
fn shared_memory_algorithms_only_where_mapped() {
    let t = Tuning::default();
    let flat = shm_host();
    // Small calls go through the segments; large 2-rank all-reduce stays on the ring
    // (measured: 1 MiB ring 77 µs, doubling 91, direct 86, shm1 151, shm2 129).
    assert_eq!(
        choose(CollKind::AllReduce, 2, 8, &flat, None, &t).0,
        Algo::ShmOneShot
    );
    assert_eq!(
        choose(CollKind::AllReduce, 2, 1 << 20, &flat, None, &t).0,
        Algo::Ring
    );
    // Up to 4 KiB per rank the slots win, their copies still in cache (measured, 2 ranks:
    // all-reduce 0.58 µs through the slots, 1.6-1.8 direct; reduce-scatter 0.55 against
    // 2.1 ring); from 32 KiB the network's direct exchange.
    for k in [
        CollKind::AllReduce,
        CollKind::AllGather,
        CollKind::ReduceScatter,
        CollKind::Broadcast,
        CollKind::Reduce,
    ] {
        assert_eq!(
            choose(k, 2, 4 << 10, &flat, None, &t).0,
            Algo::ShmOneShot,
            "{k:?}"
        );
    }
    assert_eq!(
        choose(CollKind::AllReduce, 2, 32 << 10, &flat, None, &t).0,
        Algo::Direct
    );
    // Four ranks on two cores: two-shot from tens of KiB.
    let shared = LinkCost {
        flat_sync_us: Some(2.0),
        cpu_share: 0.5,
        msg_cpu_us: 20.0,
        ..flat
    };
    assert_eq!(
        choose(CollKind::AllReduce, 4, 32 << 10, &shared, None, &t).0,
        Algo::ShmTwoShot
    );
    for k in [CollKind::Broadcast, CollKind::AllGather, CollKind::AllToAll] {
        assert_eq!(choose(k, 4, 64, &shared, None, &t).0, Algo::ShmOneShot);
    }
    // Without mapped segments they are neither chosen nor can they be forced.
    let net = LinkCost::default();
    assert_ne!(
        choose(CollKind::AllReduce, 2, 8, &net, None, &t).0,
        Algo::ShmOneShot
    );
    assert_eq!(
        choose(CollKind::AllReduce, 2, 8, &net, Some(Algo::ShmTwoShot), &t).0,
        Algo::Direct
    );
}

/// Four ranks on two cores, with the costs this machine's init takes (β 1.3 GB/s, γ 3.1
/// GB/s, copy 2.5 GB/s): the one-shot all-reduce up to a few KiB (a decode step's 4 KiB: its one
/// synchronisation against the two-shot's two), the two-shot from 16 KiB, as measured.
#[test]
fn ranks_sharing_cores_take_the_one_shot_for_small_all_reduces() {
    let t = Tuning::default();
    let shared = LinkCost {
        alpha_us: 1.0,
        beta_gbs: 1.3,
        gamma_gbs: 3.1,
        wire_gamma_gbs: 52.0,
        copy_gbs: 2.5,
        cpu_share: 0.5,
        msg_cpu_us: 2.0,
        flat_sync_us: Some(flat_sync_us(4, 2)),
        ..LinkCost::default()
    };
    let pick = |bytes: usize| choose(CollKind::AllReduce, 4, bytes, &shared, None, &t).0;
    assert_eq!(pick(4 << 10), Algo::ShmOneShot);
    assert_eq!(pick(16 << 10), Algo::ShmTwoShot);
    assert_eq!(pick(64 << 10), Algo::ShmTwoShot);
    assert_eq!(flat_sync_us(2, 2), 0.3, "a core per rank");
}

/// A 2-rank ring all-gather over a network link sends each block as one message (up to
/// 16 MiB); with more ranks (slices are forwarded), over shared memory or with a slice
/// set by the user, the usual slices stay.
#[test]
fn two_rank_all_gather_over_a_network_is_one_message() {
    let (c, t) = (LinkCost::default(), Tuning::default());
    assert!(c.alpha_us >= 5.0, "the default cost is a network's");
    let (a, pl) = choose(CollKind::AllGather, 2, 1 << 20, &c, None, &t);
    assert_eq!((a, pl.slice), (Algo::Ring, 512 << 10));
    let (_, pl) = choose(CollKind::AllGather, 2, 64 << 20, &c, None, &t);
    assert_eq!(pl.slice, 16 << 20);
    let (_, pl) = choose(CollKind::AllGather, 3, 3 << 20, &c, None, &t);
    assert!(pl.slice < 1 << 20, "{pl:?}");
    let (_, pl) = choose(CollKind::AllGather, 2, 1 << 20, &shm_host(), None, &t);
    assert!(pl.slice < 512 << 10, "{pl:?}");
    let user = Tuning {
        slice: Some(64 << 10),
        ..Tuning::default()
    };
    let (_, pl) = choose(CollKind::AllGather, 2, 1 << 20, &c, None, &user);
    assert_eq!(pl.slice, 64 << 10);
}

/// Several NICs: messages of 1 MiB and more take a channel per NIC (up to 8), smaller
/// ones one; a channel count the user set stays.
#[test]
fn large_messages_take_a_channel_per_nic() {
    let nics = |n: usize| Tuning {
        nics: n,
        ..Tuning::default()
    };
    assert_eq!(pipeline(1 << 20, 1 << 20, &nics(2)).channels, 2);
    assert_eq!(pipeline(64 << 10, 64 << 10, &nics(2)).channels, 1);
    assert_eq!(pipeline(1 << 20, 1 << 20, &nics(1)).channels, 1);
    assert_eq!(pipeline(32 << 20, 32 << 20, &nics(1)).channels, 2);
    assert_eq!(pipeline(32 << 20, 32 << 20, &nics(6)).channels, 6);
    assert_eq!(pipeline(32 << 20, 32 << 20, &nics(12)).channels, 8);
    let forced = Tuning {
        channels: Some(3),
        ..nics(2)
    };
    assert_eq!(pipeline(4 << 20, 4 << 20, &forced).channels, 3);
}

/// With single copies (process_vm_readv between the ranks), large all-gathers and
/// all-reduces go through them; below their minimums, and without them, the ring stays.
#[test]
fn single_copies_for_large_shared_memory_calls() {
    let t = Tuning::default();
    let cma = LinkCost {
        flat_cma: true,
        ..shm_host()
    };
    let ag_min = crate::algo::shm::DIRECT_GATHER_MIN;
    let ar_min = crate::algo::shm::DIRECT_REDUCE_MIN;
    for n in [2, 4] {
        let pick = |k, bytes, c: &LinkCost| choose(k, n, bytes, c, None, &t).0;
        assert_eq!(
            pick(CollKind::AllGather, n * ag_min, &cma),
            Algo::ShmOneShot
        );
        assert_eq!(pick(CollKind::AllGather, 64 << 20, &cma), Algo::ShmOneShot);
        // (On 4 ranks Bruck's two steps beat the ring's three; docs/PERFORMANCE-LOG.md.)
        let below = pick(CollKind::AllGather, n * (ag_min / 4), &cma);
        assert!(matches!(below, Algo::Ring | Algo::Bruck), "{below}");
        assert_eq!(pick(CollKind::AllGather, 64 << 20, &shm_host()), Algo::Ring);
        assert_eq!(pick(CollKind::AllReduce, ar_min, &cma), Algo::ShmTwoShot);
        assert_eq!(pick(CollKind::AllReduce, 64 << 20, &cma), Algo::ShmTwoShot);
        assert_eq!(pick(CollKind::AllReduce, ar_min / 2, &cma), Algo::Ring);
        assert_eq!(pick(CollKind::AllReduce, 64 << 20, &shm_host()), Algo::Ring);
    }
}

/// Between the shared-memory algorithms, slow reductions favour the two-shot, which
/// reduces 1/n of the data per rank where the one-shot reduces all of it.
#[test]
fn slow_reductions_favour_two_shot() {
    let t = Tuning::default();
    // Network algorithms priced out, so that only shm1 and shm2 compete.
    let flat = LinkCost {
        alpha_us: 1000.0,
        ..shm_host()
    };
    let pick = |gamma: f64| {
        let c = LinkCost {
            gamma_gbs: gamma,
            wire_gamma_gbs: gamma,
            ..flat
        };
        choose(CollKind::AllReduce, 2, 4 << 10, &c, None, &t).0
    };
    assert_eq!(pick(0.5), Algo::ShmTwoShot);
    assert_eq!(pick(100.0), Algo::ShmOneShot);
}

#[test]
fn a_broadcast_between_two_ranks_is_one_message() {
    let (c, t) = (LinkCost::default(), Tuning::default());
    let (a, pl) = choose(CollKind::Broadcast, 2, 1 << 20, &c, None, &t);
    assert_eq!((a, pl.slice), (Algo::Ring, 1 << 20));
    // Bounded: a network bounds its messages (RoCE: 512 MiB).
    assert_eq!(
        choose(CollKind::Broadcast, 2, 1 << 30, &c, None, &t)
            .1
            .slice,
        16 << 20
    );
    // With a rank in the middle of the chain, slices pipeline.
    assert!(
        choose(CollKind::Broadcast, 3, 1 << 20, &c, None, &t)
            .1
            .slice
            < 1 << 20
    );
    // A slice the user set stays.
    let forced = Tuning {
        slice: Some(4096),
        ..Tuning::default()
    };
    assert_eq!(
        choose(CollKind::Broadcast, 2, 1 << 20, &c, None, &forced)
            .1
            .slice,
        4096
    );
}

#[test]
fn two_shot_between_one_shot_and_ring_over_the_network() {
    // A 25 GbE RoCE link between hosts: α ≈ 8 µs with the software, β ≈ 3 GB/s.
    let c = LinkCost {
        alpha_us: 8.0,
        beta_gbs: 3.0,
        ..LinkCost::default()
    };
    let t = Tuning::default();
    let pick = |n, b| choose(CollKind::AllReduce, n, b, &c, None, &t).0;
    assert_eq!(pick(4, 1024), Algo::Direct);
    // Middle sizes on few ranks: two steps, 2(n-1)/n of the data (one-shot: n-1 times).
    assert_eq!(pick(4, 256 << 10), Algo::TwoShot);
    assert_eq!(pick(8, 1 << 20), Algo::TwoShot);
    assert_eq!(pick(4, 64 << 20), Algo::Ring);
    // Over shared memory the flat two-shot does its job.
    let shm = LinkCost {
        alpha_us: 1.0,
        ..shm_host()
    };
    for b in [1024, 64 << 10, 1 << 20] {
        assert_ne!(
            choose(CollKind::AllReduce, 4, b, &shm, None, &t).0,
            Algo::TwoShot
        );
    }
}

/// Small all-gathers and reduce-scatters on many ranks take Bruck's ⌈log2 n⌉ steps
/// instead of the ring's n-1; on 2 and 3 ranks (as many steps either way) and past
/// the fitted sizes the ring stays. Every rank computes this from the same agreed inputs.
#[test]
fn bruck_for_small_gathers_and_scatters_on_many_ranks() {
    let (c, t) = (LinkCost::default(), Tuning::default());
    let shared = LinkCost {
        msg_cpu_us: 40.0,
        ..LinkCost::default()
    };
    for cost in [&c, &shared] {
        for k in [CollKind::AllGather, CollKind::ReduceScatter] {
            for n in [4, 8, 9, 64] {
                assert_eq!(
                    choose(k, n, n * 8, cost, None, &t).0,
                    Algo::Bruck,
                    "{k:?} {n}"
                );
            }
            for n in [2, 3] {
                assert_eq!(
                    choose(k, n, n * 8, cost, None, &t).0,
                    Algo::Ring,
                    "{k:?} {n}"
                );
            }
            assert_eq!(
                choose(k, 8, 64 << 20, cost, None, &t).0,
                Algo::Ring,
                "{k:?}"
            );
        }
        let pick = |k, b| choose(k, 8, b, cost, None, &t).0;
        assert_eq!(pick(CollKind::AllGather, 64 << 10), Algo::Bruck);
        assert_eq!(pick(CollKind::AllGather, 1 << 20), Algo::Ring);
        assert_eq!(pick(CollKind::ReduceScatter, 256 << 10), Algo::Bruck);
        assert_eq!(pick(CollKind::ReduceScatter, 1 << 20), Algo::Ring);
    }
    // Over shared memory (without the segments' algorithms) up to 128 KiB.
    let shm = LinkCost {
        alpha_us: 1.0,
        beta_gbs: 8.0,
        ..LinkCost::default()
    };
    for k in [CollKind::AllGather, CollKind::ReduceScatter] {
        assert_eq!(choose(k, 8, 32 << 10, &shm, None, &t).0, Algo::Bruck);
        assert_eq!(choose(k, 8, 512 << 10, &shm, None, &t).0, Algo::Ring);
    }
    // Forced, it runs at any size; the collectives without it fall back to the model.
    assert_eq!(
        choose(CollKind::AllGather, 8, 64 << 20, &c, Some(Algo::Bruck), &t).0,
        Algo::Bruck
    );
    assert_ne!(
        choose(CollKind::Broadcast, 8, 64, &c, Some(Algo::Bruck), &t).0,
        Algo::Bruck
    );
}

#[test]
fn tree_wins_latency_bound_rooted_calls_on_many_ranks() {
    let c = LinkCost::default();
    let t = Tuning::default();
    assert_eq!(
        choose(CollKind::Broadcast, 16, 1024, &c, None, &t).0,
        Algo::Tree
    );
    assert_eq!(
        choose(CollKind::Broadcast, 2, 64 << 20, &c, None, &t).0,
        Algo::Ring
    );
}

#[test]
fn by_hosts_for_latency_bound_calls_flat_rings_for_large_ones() {
    // 8 hosts of 8 ranks: shared memory inside (1 µs, 8 GB/s), a NIC between (10 µs,
    // 3 GB/s). Small calls pay 2(m-1) cheap steps and log2(h) dear ones instead of
    // log2(n) dear ones; a large all-reduce moves about as much over each NIC either way
    // and the flat ring skips the phases inside hosts.
    let t = Tuning::default();
    let intra = LinkCost {
        flat_sync_us: None,
        ..shm_host()
    };
    let inter = LinkCost {
        alpha_us: 10.0,
        beta_gbs: 3.0,
        ..LinkCost::default()
    };
    let l = Layers {
        hosts: 8,
        local: 8,
        even: true,
        nics: 1,
    };
    let flat = |kind, bytes| {
        let (a, pl) = choose(kind, 64, bytes, &inter, None, &t);
        estimate(kind, a, 64, bytes, &inter, &pl)
    };
    let hier =
        |kind, bytes| estimate_hier(kind, DataType::F32, bytes, l, &intra, &inter, &t).unwrap();
    for kind in [CollKind::AllReduce, CollKind::Broadcast, CollKind::Reduce] {
        assert!(hier(kind, 8) < flat(kind, 8), "{kind:?} 8 B");
    }
    assert!(hier(CollKind::AllReduce, 64 << 20) > flat(CollKind::AllReduce, 64 << 20));
    // A NIC per local index: the phases between hosts no longer share one NIC.
    let rails = Layers { nics: 8, ..l };
    let big = 64 << 20;
    let on_rails = estimate_hier(
        CollKind::AllReduce,
        DataType::F32,
        big,
        rails,
        &intra,
        &inter,
        &t,
    );
    assert!(on_rails.unwrap() < hier(CollKind::AllReduce, big) / 2.0);
    // Uneven hosts go through one rank per host (all-gather and reduce-scatter too).
    let uneven = Layers { even: false, ..l };
    let u = estimate_hier(
        CollKind::AllReduce,
        DataType::F32,
        8,
        uneven,
        &intra,
        &inter,
        &t,
    );
    assert!(u.unwrap() < flat(CollKind::AllReduce, 8));
    // All-gather and reduce-scatter go between hosts in a ring (h−1 steps): by host on 4
    // hosts of 16 (3 dear steps against Bruck's 6), not on 8 of 8 (7 against 6).
    let wide = Layers {
        hosts: 4,
        local: 16,
        even: true,
        nics: 1,
    };
    for kind in [CollKind::AllGather, CollKind::ReduceScatter] {
        let w = estimate_hier(kind, DataType::F32, 8 * 64, wide, &intra, &inter, &t);
        assert!(w.unwrap() < flat(kind, 8 * 64), "{kind:?}");
        assert!(hier(kind, 8 * 64) > flat(kind, 8 * 64), "{kind:?}");
        // Through leaders: two steps inside hosts and one exchange between them, against
        // Bruck's log2(n) steps between hosts.
        let u = estimate_hier(kind, DataType::F32, 8 * 64, uneven, &intra, &inter, &t);
        assert!(u.unwrap() < flat(kind, 8 * 64), "{kind:?} on uneven hosts");
    }
    assert!(estimate_hier(CollKind::AllToAll, DataType::F32, 8, l, &intra, &inter, &t).is_none());
}

/// The deterministic mode's choice is rank-ordered for every reducing collective, at every
/// size and rank count, over a network and over shared memory, whatever is forced.
#[test]
fn the_deterministic_choice_always_reduces_in_rank_order() {
    let t = Tuning::default();
    let flat = LinkCost {
        flat_sync_us: Some(1.0),
        ..LinkCost::default()
    };
    for c in [LinkCost::default(), flat] {
        for kind in [
            CollKind::AllReduce,
            CollKind::Reduce,
            CollKind::ReduceScatter,
        ] {
            for n in [2, 3, 8, 64] {
                for bytes in [0, 8, 4096, 1 << 20, 64 << 20] {
                    for forced in std::iter::once(None).chain(Algo::ALL.map(Some)) {
                        let (a, _) = choose_ordered(kind, DataType::F32, n, bytes, &c, forced, &t);
                        assert!(
                            rank_ordered(kind, a),
                            "{kind:?} n={n} {bytes} B forced {forced:?}: {a:?}"
                        );
                    }
                }
            }
        }
    }
    // Without the mode, large all-reduces take the ring, which is not.
    let (a, _) = choose_for(
        CollKind::AllReduce,
        DataType::F32,
        4,
        64 << 20,
        &LinkCost::default(),
        None,
        &t,
    );
    assert!(!rank_ordered(CollKind::AllReduce, a), "{a:?}");
}
