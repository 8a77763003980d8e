"""The deterministic mode through torch: a group made with
``pg_options=roccl.Options(deterministic=True)`` returns the sum in rank order, bitwise,
even where the ring is asked for (``ROCCL_ALGO=ring``, which sums each block starting at
another rank); without the option the same ring gives other bits (so the check can tell)."""

import torch
import torch.distributed as dist

from common import run

SIZES = (1, 1000, 100_001)


def inputs(rank, n):
    g = torch.Generator().manual_seed(1000 + rank)
    mant = torch.rand(n, generator=g) - 0.5
    exp = torch.randint(-8, 9, (n,), generator=g).float()
    return mant * torch.exp2(exp)


def rank_order_sum(world, n):
    s = inputs(0, n)
    for r in range(1, world):
        s = s + inputs(r, n)
    return s


def all_reduce_bits(rank, world, deterministic):
    import roccl

    group = dist.new_group(pg_options=roccl.Options(deterministic=deterministic))
    same = []
    for n in SIZES:
        t = inputs(rank, n)
        dist.all_reduce(t, group=group)
        same.append(torch.equal(t.view(torch.int32), rank_order_sum(world, n).view(torch.int32)))
    if deterministic:
        assert all(same), f"rank {rank}: deterministic group, bitwise equal per size: {same}"
    else:
        assert not all(same), f"rank {rank}: the ring gave the rank-order sum everywhere"


def test_a_deterministic_group_sums_in_rank_order_bitwise():
    run(3, all_reduce_bits, True, env={"ROCCL_ALGO": "ring", "ROCCL_NET": "tcp", "ROCCL_SHM": "0"})


def test_without_the_option_the_ring_sums_in_another_order():
    run(3, all_reduce_bits, False, env={"ROCCL_ALGO": "ring", "ROCCL_NET": "tcp", "ROCCL_SHM": "0"})


def bad_options(rank, world):
    try:
        dist.new_group(pg_options={"deterministic": True})
    except TypeError as e:
        assert "roccl.Options" in str(e), e
    else:
        raise AssertionError("a dict as pg_options was accepted")


def test_options_of_another_type_are_refused():
    run(2, bad_options)
