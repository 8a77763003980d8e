"""roccl.Communicator: roccl's collectives for Python programs that are not torch.distributed
programs, on numpy arrays, other buffers and CPU tensors, each result checked against the
one computed here from the same inputs; bad buffers are refused with a reason."""

import array
import multiprocessing
import traceback

import numpy as np
import pytest
import torch

import roccl


def data(rank, n, dtype, salt=0):
    return ((np.arange(n) * 7 + rank * 13 + salt) % 11).astype(dtype)


def _checks(comm, rank, world):
    for dtype in (np.float32, np.float64, np.float16, np.int8, np.uint8, np.int32, np.int64,
                  np.uint64, np.bool_):
        for n in (0, 1, 7, 300_001):
            x = data(rank, n, dtype)
            want = sum(data(r, n, dtype).astype(np.float64) for r in range(world))
            if dtype == np.bool_:
                want = np.logical_or.reduce([data(r, n, dtype) for r in range(world)]) if n else want
                comm.all_reduce(x, "max")
            else:
                comm.all_reduce(x)
            assert np.array_equal(x.astype(np.float64), np.asarray(want, dtype=np.float64)), \
                f"all_reduce {dtype.__name__} n={n}"
    # Out of place, every reduction, in 2-D.
    for op, fn in (("sum", np.sum), ("prod", np.prod), ("max", np.max), ("min", np.min)):
        x = data(rank, 12, np.float64).reshape(3, 4) + 1
        out = np.empty_like(x)
        comm.all_reduce(x, op, out=out)
        want = fn(np.stack([data(r, 12, np.float64).reshape(3, 4) + 1 for r in range(world)]), axis=0)
        assert np.array_equal(out, want), op
    # broadcast, reduce, all_gather, reduce_scatter, all_to_all.
    for root in range(world):
        b = data(rank, 9, np.int32)
        comm.broadcast(b, root)
        assert np.array_equal(b, data(root, 9, np.int32))
        r = data(rank, 5, np.float32)
        comm.reduce(r, root, "sum")
        if rank == root:
            assert np.array_equal(r, sum(data(q, 5, np.float32) for q in range(world)))
    g = np.empty(world * 6, np.float32)
    comm.all_gather(data(rank, 6, np.float32), g)
    assert np.array_equal(g, np.concatenate([data(r, 6, np.float32) for r in range(world)]))
    rs = np.empty(4, np.int64)
    comm.reduce_scatter(data(rank, 4 * world, np.int64), rs)
    assert np.array_equal(rs, sum(data(r, 4 * world, np.int64) for r in range(world))[4 * rank:4 * rank + 4])
    a2a = np.empty(3 * world, np.uint8)
    comm.all_to_all(data(rank, 3 * world, np.uint8, salt=rank), a2a)
    want = np.concatenate([data(r, 3 * world, np.uint8, salt=r)[3 * rank:3 * rank + 3] for r in range(world)])
    assert np.array_equal(a2a, want)
    # Other buffers: bytearray, array.array, memoryview, and a torch tensor (bfloat16 too).
    ba = bytearray([rank + 1] * 5)
    comm.all_reduce(ba)
    assert list(ba) == [sum(range(1, world + 1))] * 5
    arr = array.array("d", [rank + 0.5] * 3)
    comm.all_reduce(memoryview(arr), "max")
    assert list(arr) == [world - 0.5] * 3
    t = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(sum(range(1, world + 1))), dtype=torch.bfloat16))
    # Send and receive round the ring.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = np.empty(1000, np.float32)
    if rank % 2 == 0:
        comm.send(data(rank, 1000, np.float32), nxt)
        comm.recv(got, prv)
    else:
        comm.recv(got, prv)
        comm.send(data(rank, 1000, np.float32), nxt)
    assert np.array_equal(got, data(prv, 1000, np.float32))
    comm.barrier()


def _refusals(comm, rank, world):
    def refused(fn, text):
        with pytest.raises(ValueError) as e:
            fn()
        assert text in str(e.value), str(e.value)

    x = np.zeros((4, 4), np.float32)
    refused(lambda: comm.all_reduce(x[:, 1]), "not C-contiguous")
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    refused(lambda: comm.all_reduce(ro), "read-only")
    refused(lambda: comm.all_reduce(np.zeros(4, np.complex64)), "no data type")
    refused(lambda: comm.all_reduce(np.zeros(4, np.int16)), "no data type")
    refused(lambda: comm.all_reduce([1.0, 2.0]), "neither a buffer")
    refused(lambda: comm.all_reduce(np.zeros(4, np.float32), "xor"), "unknown reduction")
    refused(lambda: comm.all_gather(np.zeros(2, np.float32), np.zeros(2 * world, np.int32)),
            "different element types")
    refused(lambda: comm.all_reduce(torch.zeros(4, 4)[:, 1]), "not contiguous")
    # roccl's own checks come back as errors with its message; the communicator stays usable.
    with pytest.raises(RuntimeError) as e:
        comm.all_gather(np.zeros(2, np.float32), np.zeros(3, np.float32))
    assert "rank" in str(e.value), str(e.value)
    y = np.ones(3, np.float32)
    comm.all_reduce(y)
    assert np.array_equal(y, np.full(3, float(world), np.float32))


def _rank(rank, world, uid, test, errors):
    try:
        comm = roccl.Communicator(uid, world, rank, timeout=30)
        assert (comm.rank, comm.nranks) == (rank, world)
        test(comm, rank, world)
    except BaseException:  # noqa: BLE001
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


def spawn(world, test):
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    uid = roccl.unique_id()
    procs = [ctx.Process(target=_rank, args=(r, world, uid, test, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    for p in procs:
        if p.is_alive():
            p.kill()
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_on_numpy_and_other_buffers(world):
    spawn(world, _checks)


def test_bad_buffers_are_refused_with_a_reason():
    spawn(2, _refusals)


def test_a_bad_unique_id_is_refused():
    with pytest.raises(RuntimeError) as e:
        roccl.Communicator(b"not an id", 2, 0)
    assert "unique id" in str(e.value)
