"""The call without torch.distributed's machinery: `roccl.all_reduce` (the operator
`torch.ops.roccl.all_reduce_`) and `roccl.direct_all_reduce()` (torch.distributed.all_reduce's
blocking calls on roccl groups routed to it). Results are checked against the sums computed
here; that the call skipped torch's path is checked through torch's flight recorder, which
records every call it sees; order against queued async works, errors, subgroups and
torch.compile are covered too."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from common import run

OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]


def inputs(rank, n, dtype):
    g = torch.Generator().manual_seed(7919 + rank)
    return torch.randint(-2, 3, (n,), generator=g).to(torch.float32).to(dtype)


def expected(world, n, dtype, op):
    xs = torch.stack([inputs(r, n, torch.float64) for r in range(world)])
    out = {
        ReduceOp.SUM: xs.sum(0),
        ReduceOp.AVG: xs.mean(0),
        ReduceOp.PRODUCT: xs.prod(0),
        ReduceOp.MIN: xs.min(0).values,
        ReduceOp.MAX: xs.max(0).values,
    }[op]
    if not dtype.is_floating_point:
        out = out.trunc()
    return out.to(dtype)


def fr_entries():
    """The entries torch's flight recorder holds for roccl's groups (the hook torch attaches
    to backends that do not record themselves)."""
    raw = torch._C._distributed_c10d._dump_fr_trace_json(
        includeCollectives=True, onlyActive=False, backend="roccl"
    )
    return json.loads(raw).get("entries", [])


def _ops_and_sizes(rank, world):
    import roccl

    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for op in OPS:
            if op == ReduceOp.AVG and not dtype.is_floating_point:
                continue
            for n in (0, 1, 7, (1 << 20) // 4 + 3):
                t = inputs(rank, n, dtype)
                roccl.all_reduce(t, op=op)
                # Sums, products, minima and maxima of small integers are exact; a mean
                # over 3 ranks is rounded (once here, in the data type by roccl).
                tol = {"rtol": 1e-2, "atol": 1e-2} if op == ReduceOp.AVG else {"rtol": 0, "atol": 0}
                torch.testing.assert_close(t, expected(world, n, dtype, op), **tol)
    # Not contiguous: through the work path (a contiguous copy), the result written back.
    t = inputs(rank, 2 * 1000, torch.float32).view(1000, 2).t()
    roccl.all_reduce(t)
    want = expected(world, 2000, torch.float32, ReduceOp.SUM).view(1000, 2).t()
    torch.testing.assert_close(t, want, rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 3])
def test_every_reduction_and_size(world):
    run(world, _ops_and_sizes)


def _skips_torch_path(rank, world):
    import roccl

    before = len(fr_entries())
    t = torch.ones(16)
    dist.all_reduce(t)
    seen = len(fr_entries())
    assert seen == before + 1, f"torch's path: {before} -> {seen} recorder entries"
    for _ in range(5):
        roccl.all_reduce(t)
    assert len(fr_entries()) == seen, "roccl.all_reduce went through torch's hooks"
    assert torch.equal(t, torch.full((16,), float(world**6)))
    roccl.direct_all_reduce()
    try:
        dist.all_reduce(t)  # blocking, roccl group: direct
        assert len(fr_entries()) == seen, "direct_all_reduce left the call on torch's path"
        w = dist.all_reduce(t, async_op=True)  # async: torch's path, a work
        assert w is not None and w.wait()
        assert len(fr_entries()) == seen + 1
    finally:
        roccl.direct_all_reduce(False)
    assert dist.all_reduce is roccl._plain_all_reduce
    assert torch.equal(t, torch.full((16,), float(world**8)))


def test_skips_torch_path():
    run(2, _skips_torch_path, env={"TORCH_FR_BUFFER_SIZE": "2000"})


def _after_queued_works(rank, world):
    import roccl

    # Async works queued ahead: the direct call must run after them, in issue order on
    # every rank, whichever rank's queue has emptied first.
    for i in range(20):
        big = torch.full((1 << 18,), float(rank + i))
        works = [dist.all_reduce(big, async_op=True) for _ in range(2)]
        small = torch.full((3,), float(rank * 10 + i))
        roccl.all_reduce(small)
        for w in works:
            w.wait()
        want_big = float(sum(r + i for r in range(world))) * world
        assert torch.equal(big, torch.full((1 << 18,), want_big))
        assert torch.equal(small, torch.full((3,), float(sum(r * 10 + i for r in range(world)))))


def test_after_queued_works():
    run(2, _after_queued_works)


def _subgroup_and_names(rank, world):
    import roccl

    g = dist.new_group([0, 2])
    if rank in (0, 2):
        t = torch.full((5,), float(rank + 1))
        roccl.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((5,), 4.0))
        roccl.all_reduce(t, group=g.group_name)
        assert torch.equal(t, torch.full((5,), 8.0))
    # A group of another backend (gloo) is served by its own all-reduce.
    gl = dist.new_group(list(range(world)), backend="gloo")
    t = torch.ones(4)
    roccl.all_reduce(t, group=gl)
    assert torch.equal(t, torch.full((4,), float(world)))
    dist.barrier()


def test_subgroup_and_other_backend():
    run(3, _subgroup_and_names)


def _errors(rank, world):
    import roccl

    t = torch.ones(4)
    with pytest.raises(RuntimeError, match="PREMUL_SUM"):
        torch.ops.roccl.all_reduce_(t, dist.group.WORLD.group_name, int(ReduceOp.PREMUL_SUM))
    with pytest.raises(RuntimeError, match="not one of"):
        torch.ops.roccl.all_reduce_(t, dist.group.WORLD.group_name, 42)
    with pytest.raises(RuntimeError, match="no-such-group"):
        torch.ops.roccl.all_reduce_(t, "no-such-group", 0)
    with pytest.raises(RuntimeError, match="(?i)complex"):
        roccl.all_reduce(torch.ones(4, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match="no process group"):
        roccl._C._all_reduce_direct(t, None, 0)
    # Still in step after the refusals (nothing was sent).
    roccl.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(world)))


def test_errors():
    run(2, _errors)


def _compiled(rank, world):
    import roccl

    name = dist.group.WORLD.group_name

    def step(x):
        y = x * 2
        roccl.all_reduce(y, group=name)
        return y + 1

    f = torch.compile(step, fullgraph=True, backend="aot_eager")
    for k in range(3):
        x = torch.full((8,), float(rank + k))
        want = torch.full((8,), 2.0 * sum(r + k for r in range(world)) + 1)
        assert torch.equal(f(x), want)
    # torch.distributed.all_reduce patched, in compiled code: torch's traceable path.
    roccl.direct_all_reduce()
    try:

        def plain(x):
            y = x + 1
            dist.all_reduce(y)
            return y

        g = torch.compile(plain, backend="aot_eager")
        assert torch.equal(g(torch.ones(4)), torch.full((4,), 2.0 * world))
    finally:
        roccl.direct_all_reduce(False)


def test_under_torch_compile():
    run(2, _compiled)


def _from_environment(rank, world):
    import roccl

    assert dist.all_reduce is roccl._direct
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(sum(range(world)))))


def test_turned_on_by_environment():
    # Spawned, not forked: the variable is read when roccl is imported, and a forked rank
    # inherits the module pytest already imported (as torchrun's fresh processes do not).
    run(2, _from_environment, start="spawn", env={"ROCCL_TORCH_DIRECT": "1"})
