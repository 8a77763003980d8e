"""Every c10d operation of the "roccl" backend, over 2-4 processes, on every data type and on
sizes 0, 1, odd and over 1 MiB, each result checked against the result computed here from
the same seeded inputs of every rank (no other backend is involved)."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from common import run

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
F8 = [torch.float8_e4m3fn, torch.float8_e5m2]


# Sizes over 1 MiB run for every data type with 2 ranks; with 3 and 4 ranks (several ranks
# per core here) for these only.
BIG = {torch.float32, torch.bfloat16, torch.uint8}
FULL = {"on": True}


def sizes(dtype):
    esize = torch.empty((), dtype=dtype).element_size()
    big = [(1 << 20) // esize + 3] if FULL["on"] or dtype in BIG else []
    return [0, 1, 7] + big


@functools.lru_cache(maxsize=64)
def values(rank, n, dtype, seed, low=-2, high=3):
    """Rank `rank`'s input: small integers, so that sums and products of up to 4 ranks are
    exact in every data type (float8 included)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype == torch.uint8:
        low = max(low, 0)
    return torch.randint(low, high, (n,), generator=g).to(torch.float32).to(dtype)


def f64(t):
    return t.to(torch.float64)


def reduced(xs, op, dtype, world):
    x = torch.stack([f64(t) for t in xs])
    if op == ReduceOp.SUM:
        e = x.sum(0)
    elif op == ReduceOp.PRODUCT:
        e = x.prod(0)
    elif op == ReduceOp.MIN:
        e = x.min(0).values
    elif op == ReduceOp.MAX:
        e = x.max(0).values
    elif op == ReduceOp.AVG:
        e = x.sum(0) / world
        if not dtype.is_floating_point:
            e = torch.floor(e)  # integer division (inputs are not negative)
    else:
        raise ValueError(op)
    return e


def tolerance(dtype, op):
    if op != ReduceOp.AVG:
        return 0.0
    return {
        torch.float32: 1e-6,
        torch.float64: 1e-12,
        torch.float16: 2e-3,
        torch.bfloat16: 1.6e-2,
        torch.float8_e4m3fn: 0.13,
        torch.float8_e5m2: 0.26,
    }.get(dtype, 0.0)


class Checks:
    def __init__(self, rank):
        self.rank = rank
        self.failures = []
        self.count = 0

    def equal(self, what, got, want, rtol=0.0):
        self.count += 1
        g, w = f64(got).reshape(-1), f64(want).reshape(-1)
        if g.shape != w.shape:
            self.failures.append(f"rank {self.rank}: {what}: shape {tuple(g.shape)} != {tuple(w.shape)}")
            return
        if rtol == 0.0:
            ok = torch.equal(g, w)
        else:
            ok = torch.allclose(g, w, rtol=rtol, atol=rtol)
        if not ok:
            bad = (g - w).abs().argmax().item()
            self.failures.append(
                f"rank {self.rank}: {what}: got {g[bad].item()} want {w[bad].item()} at {bad}"
            )

    def summary(self):
        """The failures, one line per kind of check (what comes before its size)."""
        kinds = {}
        for f in self.failures:
            kinds.setdefault(f.split(" n=")[0].split(":")[1].strip(), []).append(f)
        return "\n".join(f"{len(v):4} x {k}; first: {v[0]}" for k, v in kinds.items())

    def done(self):
        assert not self.failures, f"{len(self.failures)} of {self.count} checks failed:\n" + self.summary()
        assert self.count > 0


def all_reduce_checks(c, rank, world):
    seed = 1
    for dtype in DTYPES:
        for op in [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]:
            if dtype == torch.bool and op == ReduceOp.AVG:
                continue
            for n in sizes(dtype):
                low = 0 if op == ReduceOp.AVG and not dtype.is_floating_point else -2
                xs = [values(r, n, dtype, seed, low=low) for r in range(world)]
                t = xs[rank].clone()
                dist.all_reduce(t, op=op)
                want = reduced(xs, op, dtype, world).to(dtype)
                c.equal(f"all_reduce {op} {dtype} n={n}", t, want, tolerance(dtype, op))
    # PREMUL_SUM: every input times a factor, then the sum.
    for dtype in FLOATS:
        for n in sizes(dtype):
            seed += 1
            xs = [values(r, n, dtype, seed) for r in range(world)]
            t = xs[rank].clone()
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
            want = (torch.stack([f64(x) for x in xs]) * 0.5).sum(0)
            c.equal(f"all_reduce PREMUL_SUM {dtype} n={n}", t, want.to(dtype))
    # A non-contiguous tensor: reduced through a contiguous copy, written back.
    xs = [values(r, 6 * 5, torch.float32, 99).reshape(6, 5) for r in range(world)]
    t = xs[rank].clone().t()
    dist.all_reduce(t)
    c.equal("all_reduce non-contiguous", t, reduced([x.t() for x in xs], ReduceOp.SUM, None, world))


def rooted_checks(c, rank, world):
    seed = 5000
    for dtype in DTYPES:
        for n in sizes(dtype):
            # Every root for small sizes, the last rank for large ones.
            for root in range(world) if n < 100 else [world - 1]:
                xs = [values(r, n, dtype, seed) for r in range(world)]
                t = xs[rank].clone()
                dist.broadcast(t, src=root)
                c.equal(f"broadcast {dtype} n={n} root={root}", t, xs[root])
                for op in [ReduceOp.SUM, ReduceOp.MAX]:
                    t = xs[rank].clone()
                    dist.reduce(t, dst=root, op=op)
                    if rank == root:
                        c.equal(
                            f"reduce {op} {dtype} n={n} root={root}", t, reduced(xs, op, dtype, world).to(dtype)
                        )


def gather_checks(c, rank, world):
    seed = 9000
    for dtype in DTYPES:
        for n in sizes(dtype):
            seed += 1
            xs = [values(r, n, dtype, seed) for r in range(world)]
            everything = torch.cat(xs)
            # all_gather_into_tensor, separate and in place (the input is the output's block).
            out = torch.empty(n * world, dtype=dtype)
            dist.all_gather_into_tensor(out, xs[rank])
            c.equal(f"all_gather_into_tensor {dtype} n={n}", out, everything)
            out = torch.zeros(n * world, dtype=dtype)
            out[rank * n : (rank + 1) * n] = xs[rank]
            dist.all_gather_into_tensor(out, out[rank * n : (rank + 1) * n])
            c.equal(f"all_gather_into_tensor in place {dtype} n={n}", out, everything)
            # all_gather into a list of separate tensors.
            outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, xs[rank])
            c.equal(f"all_gather list {dtype} n={n}", torch.cat(outs), everything)
            # gather and scatter at every root (the last one for large sizes).
            for root in range(world) if n < 100 else [world - 1]:
                outs = [torch.empty(n, dtype=dtype) for _ in range(world)] if rank == root else None
                dist.gather(xs[rank], outs, dst=root)
                if rank == root:
                    c.equal(f"gather {dtype} n={n} root={root}", torch.cat(outs), everything)
                pieces = [values(r, n, dtype, seed + 77) for r in range(world)]
                got = torch.empty(n, dtype=dtype)
                dist.scatter(got, pieces if rank == root else None, src=root)
                c.equal(f"scatter {dtype} n={n} root={root}", got, pieces[rank])
    # A list of non-contiguous outputs (columns of a matrix).
    m = torch.zeros(5, world)
    dist.all_gather([m[:, j] for j in range(world)], torch.full((5,), float(rank)))
    c.equal("all_gather non-contiguous outputs", m, torch.arange(world).float().repeat(5, 1))


def reduce_scatter_checks(c, rank, world):
    seed = 20000
    for dtype in DTYPES:
        for n in sizes(dtype):
            for op in [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.AVG]:
                if dtype == torch.bool and op == ReduceOp.AVG:
                    continue
                low = 0 if op == ReduceOp.AVG and not dtype.is_floating_point else -2
                xs = [values(r, n * world, dtype, seed, low=low) for r in range(world)]
                want = reduced(xs, op, dtype, world).to(dtype)[rank * n : (rank + 1) * n]
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, xs[rank], op=op)
                c.equal(f"reduce_scatter_tensor {op} {dtype} n={n}", out, want, tolerance(dtype, op))
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(out, list(xs[rank].clone().chunk(world)) if n else [torch.empty(0, dtype=dtype)] * world, op=op)
                c.equal(f"reduce_scatter list {op} {dtype} n={n}", out, want, tolerance(dtype, op))
    for dtype in FLOATS:
        n = 9
        xs = [values(r, n * world, dtype, 31337) for r in range(world)]
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, xs[rank], op=dist._make_nccl_premul_sum(2.0))
        want = (torch.stack([f64(x) for x in xs]) * 2.0).sum(0)[rank * n : (rank + 1) * n]
        c.equal(f"reduce_scatter_tensor PREMUL_SUM {dtype}", out, want.to(dtype))


def all_to_all_checks(c, rank, world):
    seed = 40000
    for dtype in DTYPES:
        for n in sizes(dtype):
            seed += 1
            rows = max(n // world, 0)
            xs = [values(r, rows * world * 3, dtype, seed).reshape(rows * world, 3) for r in range(world)]
            out = torch.empty_like(xs[rank])
            dist.all_to_all_single(out, xs[rank])
            want = torch.cat([xs[r][rank * rows : (rank + 1) * rows] for r in range(world)])
            c.equal(f"all_to_all_single even {dtype} rows={rows}", out, want)
            # Uneven: rank i sends ((i + 2j) % 3 + j % 2) * k rows to rank j (some none).
            k = 1 if n < 100 else 1000
            split = lambda i, j: ((i + 2 * j) % 3 + j % 2) * k  # noqa: E731
            ins = [values(r, sum(split(r, j) for j in range(world)) * 2, dtype, seed + 1).reshape(-1, 2) for r in range(world)]
            send_splits = [split(rank, j) for j in range(world)]
            recv_splits = [split(i, rank) for i in range(world)]
            out = torch.empty(sum(recv_splits), 2, dtype=dtype)
            dist.all_to_all_single(out, ins[rank], recv_splits, send_splits)
            want = torch.cat(
                [ins[i][sum(split(i, j) for j in range(rank)) :][: split(i, rank)] for i in range(world)]
            )
            c.equal(f"all_to_all_single uneven {dtype} k={k}", out, want)
            # all_to_all on lists.
            blocks = [[values(r * world + j, 3, dtype, seed + 2) for j in range(world)] for r in range(world)]
            outs = [torch.empty(3, dtype=dtype) for _ in range(world)]
            dist.all_to_all(outs, blocks[rank])
            c.equal(f"all_to_all list {dtype}", torch.cat(outs), torch.cat([blocks[i][rank] for i in range(world)]))


def p2p_checks(c, rank, world):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.bool]:
        for n in sizes(dtype):
            mine = values(rank, n, dtype, 7)
            got = torch.empty(n, dtype=dtype)
            # Even ranks send first, odd ranks receive first (unbatched send/recv).
            if rank % 2 == 0:
                dist.send(mine, dst=nxt)
                dist.recv(got, src=prv)
            else:
                dist.recv(got, src=prv)
                dist.send(mine, dst=nxt)
            if world % 2 == 0:
                c.equal(f"send/recv ring {dtype} n={n}", got, values(prv, n, dtype, 7))
            # batch_isend_irecv both ways round the ring.
            a, b = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            ops = [
                dist.P2POp(dist.isend, mine, nxt),
                dist.P2POp(dist.irecv, a, prv),
                dist.P2POp(dist.isend, mine, prv),
                dist.P2POp(dist.irecv, b, nxt),
            ]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            c.equal(f"batch_isend_irecv from prev {dtype} n={n}", a, values(prv, n, dtype, 7))
            c.equal(f"batch_isend_irecv from next {dtype} n={n}", b, values(nxt, n, dtype, 7))
    dist.barrier()


def coalesced_checks(c, rank, world):
    from torch.distributed.distributed_c10d import _coalescing_manager

    xs = [[values(r, n, torch.float32, 300 + n) for n in (1, 5, 1000)] for r in range(world)]
    ts = [x.clone() for x in xs[rank]]
    with _coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for i, t in enumerate(ts):
        c.equal(f"all_reduce coalesced #{i}", t, reduced([xs[r][i] for r in range(world)], ReduceOp.SUM, None, world))
    outs = [torch.empty(world * x.numel()) for x in xs[rank]]
    with _coalescing_manager(async_ops=True) as cm:
        for o, x in zip(outs, xs[rank]):
            dist.all_gather_into_tensor(o, x)
    cm.wait()
    for i, o in enumerate(outs):
        c.equal(f"all_gather_into_tensor coalesced #{i}", o, torch.cat([xs[r][i] for r in range(world)]))
    ins = [values(rank, world * n, torch.float32, 400 + n) for n in (1, 6)]
    outs = [torch.empty(x.numel() // world) for x in ins]
    with _coalescing_manager(async_ops=True) as cm:
        for o, x in zip(outs, ins):
            dist.reduce_scatter_tensor(o, x)
    cm.wait()
    for i, (o, n) in enumerate(zip(outs, (1, 6))):
        full = reduced([values(r, world * n, torch.float32, 400 + n) for r in range(world)], ReduceOp.SUM, None, world)
        c.equal(f"reduce_scatter_tensor coalesced #{i}", o, full[rank * n : (rank + 1) * n])


def async_checks(c, rank, world):
    # Several calls in flight at once, waited for in reverse order.
    xs = [[values(r, 1000 * (i + 1), torch.float32, 600 + i) for i in range(8)] for r in range(world)]
    ts = [x.clone() for x in xs[rank]]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in reversed(works):
        assert w.wait()
    for i, t in enumerate(ts):
        c.equal(f"async all_reduce #{i}", t, reduced([xs[r][i] for r in range(world)], ReduceOp.SUM, None, world))
    # is_completed polls until done.
    t = torch.ones(1 << 16)
    w = dist.all_reduce(t, async_op=True)
    import time

    deadline = time.monotonic() + 30
    while not w.is_completed():
        assert time.monotonic() < deadline, "is_completed never became true"
        time.sleep(0.0005)
    c.equal("is_completed all_reduce", t, torch.full((1 << 16,), float(world)))
    # Futures: a continuation runs on the result (as DDP's comm hooks do).
    t = torch.full((4,), float(rank + 1))
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    c.equal("future then", fut.wait(), torch.full((4,), float(world * (world + 1))))
    # A continuation that issues another collective (chained, as PowerSGD does).
    t = torch.ones(3)
    fut2 = dist.all_reduce(t, async_op=True).get_future()
    chained = fut2.then(lambda f: dist.all_reduce(f.value()[0], async_op=True).get_future()).then(
        lambda f: f.value().wait()[0]
    )
    c.equal("chained futures", chained.wait(), torch.full((3,), float(world * world)))


def subgroup_checks(c, rank, world):
    # new_group: every rank calls it, the members use it.
    members = [0, world - 1]
    g = dist.new_group(members)
    if rank in members:
        t = torch.full((3,), float(rank))
        dist.all_reduce(t, group=g)
        c.equal("new_group all_reduce", t, torch.full((3,), float(sum(members))))
    # new_subgroups: even and odd ranks.
    evens = [r for r in range(world) if r % 2 == 0]
    odds = [r for r in range(world) if r % 2 == 1]
    groups = [dist.new_group(evens), dist.new_group(odds) if odds else None]
    mine = groups[rank % 2]
    t = torch.full((2,), float(rank))
    dist.all_reduce(t, group=mine)
    c.equal("subgroup all_reduce", t, torch.full((2,), float(sum(evens if rank % 2 == 0 else odds))))
    out = torch.empty(2 * len(evens if rank % 2 == 0 else odds))
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), group=mine)
    ranks = evens if rank % 2 == 0 else odds
    c.equal("subgroup all_gather", out, torch.tensor([float(r) for r in ranks]).repeat_interleave(2))
    dist.barrier()
    # split_group (c10d's Backend::split): the highest ranks in reverse order, then the rest
    # (a rank's place in its split is its rank in the new group); the last split may hold
    # one rank.
    high = list(range(world - 1, (world - 1) // 2, -1))
    low = [r for r in range(world) if r not in high]
    sub = dist.split_group(split_ranks=[high, low])
    assert sub is not None, f"rank {rank}: split_group gave no group"
    mine = high if rank in high else low
    c.equal("split rank", torch.tensor(float(dist.get_rank(sub))), torch.tensor(float(mine.index(rank))))
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=sub)
    c.equal("split all_reduce", t, torch.full((3,), float(sum(r + 1 for r in mine))))
    src = mine[0]
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=src, group=sub)
    c.equal("split broadcast", b, torch.full((2,), float(src)))
    dist.destroy_process_group(sub)
    dist.barrier()


def error_checks(c, rank, world):
    def raises(what, fn, text):
        c.count += 1
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            if text not in str(e):
                c.failures.append(f"rank {rank}: {what}: the error does not say '{text}': {e}")
            return
        c.failures.append(f"rank {rank}: {what}: no error")

    raises("BAND", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=ReduceOp.BAND), "roccl does not support")
    raises("complex MAX", lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=ReduceOp.MAX), "")
    raises("int16", lambda: dist.broadcast(torch.ones(2, dtype=torch.int16), src=0), "roccl does not support")
    raises("AVG on bool", lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=ReduceOp.AVG), "AVG on bool")
    raises(
        "all_gather size",
        lambda: dist.all_gather_into_tensor(torch.empty(3), torch.empty(2)),
        "must have",
    )
    raises("recv any source", lambda: dist.recv(torch.empty(2)), "any source")
    raises("sparse", lambda: dist.all_reduce(torch.ones(2).to_sparse()), "")
    # Complex sums: torch passes them as real views.
    z = torch.full((3,), complex(rank, 1), dtype=torch.complex64)
    dist.all_reduce(z)
    c.equal("complex all_reduce (real part)", z.real, torch.full((3,), float(sum(range(world)))))
    c.equal("complex all_reduce (imaginary part)", z.imag, torch.full((3,), float(world)))
    # The communicator is still good after refused calls.
    t = torch.ones(2)
    dist.all_reduce(t)
    c.equal("all_reduce after refused calls", t, torch.full((2,), float(world)))


SECTIONS = [
    all_reduce_checks,
    rooted_checks,
    gather_checks,
    reduce_scatter_checks,
    all_to_all_checks,
    p2p_checks,
    coalesced_checks,
    async_checks,
    subgroup_checks,
    error_checks,
]


def every_op(rank, world, full):
    FULL["on"] = full
    c = Checks(rank)
    import os
    import time

    for section in SECTIONS:
        start = time.monotonic()
        try:
            section(c, rank, world)
        except Exception:
            # Say what had failed before (the other ranks cannot go on past this).
            print(c.summary(), flush=True)
            raise
        if os.environ.get("ROCCL_TORCH_TEST_VERBOSE"):
            print(f"rank {rank}: {section.__name__}: {time.monotonic() - start:.2f} s", flush=True)
    c.done()
    if rank == 0:
        print(f"{c.count} checks on rank 0 over {world} ranks ({dist.get_backend()})")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_op(world):
    run(world, every_op, world == 2)


def test_every_op_over_tcp():
    run(2, every_op, False, env={"ROCCL_NET": "tcp"})


def test_every_op_encrypted_over_tcp():
    # ROCCL_ENCRYPT: rank 0's unique id says the job encrypts; bootstrap and TCP are sealed,
    # under the job secret every rank is given (torch's Store never holds it).
    run(2, every_op, False, env={"ROCCL_NET": "tcp", "ROCCL_ENCRYPT": "1",
                                 "ROCCL_JOB_SECRET": "0123456789abcdef0123456789abcdef"})
