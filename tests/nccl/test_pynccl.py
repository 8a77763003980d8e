#!/usr/bin/env python3
"""Load libroccl-nccl.so with ctypes (standard library only) and call it the way vLLM's
pynccl wrapper does: the same symbol names and argument types, a unique id created on rank 0
and handed to the others out of band, out-of-place all-reduce, grouped broadcasts as an
all-gatherv, send/recv pairs in a group, reduce, all-gather, reduce-scatter, bad arguments,
window registration, destroy, and failing calls with stderr a closed pipe (their
WARN lines cannot be written; the calls still return their codes). Host memory; a NULL stream, or with
--streams a stream handle per rank on roccl's simulated device (ROCCL_DEVICE=sim: every call
returns at once and runs ordered on its stream; results are checked after a blocking call on
the same communicator, which runs after them).

    tests/nccl/test_pynccl.py LIB [NRANKS] [--streams]   (launches NRANKS processes of itself)
"""
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int
ncclWindow_t = ctypes.c_void_p


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


FLOAT32, BFLOAT16, INT32 = 7, 9, 2
SUM, MAX = 0, 2

SIGNATURES = {
    "ncclGetErrorString": (ctypes.c_char_p, [ncclResult_t]),
    "ncclGetVersion": (ncclResult_t, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (ncclResult_t, [ctypes.POINTER(ncclUniqueId)]),
    "ncclCommInitRank": (ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int]),
    "ncclAllReduce": (ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t]),
    "ncclReduce": (ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    "ncclAllGather": (ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclComm_t, cudaStream_t]),
    "ncclReduceScatter": (ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t]),
    "ncclSend": (ncclResult_t, [buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    "ncclRecv": (ncclResult_t, [buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    "ncclBroadcast": (ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    "ncclCommDestroy": (ncclResult_t, [ncclComm_t]),
    "ncclCommAbort": (ncclResult_t, [ncclComm_t]),
    "ncclGroupStart": (ncclResult_t, []),
    "ncclGroupEnd": (ncclResult_t, []),
    "ncclCommWindowRegister": (ncclResult_t, [ncclComm_t, buffer_type, ctypes.c_size_t, ctypes.POINTER(ncclWindow_t), ctypes.c_int]),
    "ncclCommWindowDeregister": (ncclResult_t, [ncclComm_t, ncclWindow_t]),
    # Not in vLLM's list: NCCL's pre-multiplied sums (torch's PREMUL_SUM over NCCL).
    "ncclRedOpCreatePreMulSum": (ncclResult_t, [ctypes.POINTER(ncclRedOp_t), buffer_type, ncclDataType_t, ctypes.c_int, ncclComm_t]),
    "ncclRedOpDestroy": (ncclResult_t, [ncclRedOp_t, ncclComm_t]),
}


def load(path):
    lib = ctypes.CDLL(path)
    funcs = {}
    for name, (res, args) in SIGNATURES.items():
        f = getattr(lib, name)  # AttributeError = a symbol vLLM needs is missing
        f.restype, f.argtypes = res, args
        funcs[name] = f
    return funcs


class Nccl:
    def __init__(self, path):
        self.f = load(path)

    def check(self, r, what):
        if r != 0:
            raise RuntimeError(f"{what}: NCCL error {r}: {self.f['ncclGetErrorString'](r).decode()}")

    def __getattr__(self, name):
        f = self.f["nccl" + name]
        return lambda *a: self.check(f(*a), name)


def floats(vals):
    return (ctypes.c_float * len(vals))(*vals)


def bf16s(vals):
    # bf16 = upper half of the float32 bits (exact for the small integers used here).
    return (ctypes.c_uint16 * len(vals))(*[struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in vals])


def from_bf16(buf):
    return [struct.unpack("<f", struct.pack("<I", x << 16))[0] for x in buf]


def expect(got, want, what):
    got, want = list(got), list(want)
    if got != want:
        bad = next(i for i in range(len(want)) if got[i] != want[i])
        raise AssertionError(f"{what}: element {bad}: got {got[bad]}, want {want[bad]}")


def rank_main(path, rank, world, id_file):
    nccl = Nccl(path)
    v = ctypes.c_int()
    nccl.GetVersion(ctypes.byref(v))
    assert v.value >= 21800, v.value  # vLLM parses it as an NCCL version code
    uid = ncclUniqueId()
    if rank == 0:
        nccl.GetUniqueId(ctypes.byref(uid))
        tmp = id_file + ".tmp"
        with open(tmp, "wb") as fh:
            fh.write(bytes(uid.internal))
        os.rename(tmp, id_file)
    else:
        deadline = time.time() + 60
        while not os.path.exists(id_file):
            assert time.time() < deadline, "rank 0 never wrote the unique id"
            time.sleep(0.01)
        with open(id_file, "rb") as fh:
            data = fh.read()
        ctypes.memmove(ctypes.addressof(uid.internal), data, 128)
    comm = ncclComm_t()
    nccl.CommInitRank(ctypes.byref(comm), world, uid, rank)
    null = None
    streams = os.environ.get("PYNCCL_TEST_STREAMS") == "1"
    stream = ctypes.c_void_p(0x5000 + 0x10 * rank) if streams else None
    one = floats([1.0])

    def sync():
        # A blocking call runs after everything enqueued before on this communicator.
        if streams:
            nccl.AllReduce(one, one, 1, FLOAT32, SUM, comm, null)

    # Out-of-place all-reduce, f32 sum and bf16 max.
    n = 1031
    send = floats([(rank * 3 + i) % 7 - 2 for i in range(n)])
    recv = floats([0.0] * n)
    nccl.AllReduce(send, recv, n, FLOAT32, SUM, comm, stream)
    sync()
    expect(recv, [float(sum((r * 3 + i) % 7 - 2 for r in range(world))) for i in range(n)], "all_reduce f32")
    sb = bf16s([(rank + i) % 5 for i in range(n)])
    rb = (ctypes.c_uint16 * n)()
    nccl.AllReduce(sb, rb, n, BFLOAT16, MAX, comm, stream)
    sync()
    expect(from_bf16(rb), [float(max((r + i) % 5 for r in range(world))) for i in range(n)], "all_reduce bf16 max")

    # vLLM's all_gatherv: one broadcast per root inside a group, NULL send buffer elsewhere.
    sizes = [100 * (r + 1) + r for r in range(world)]
    offs = [sum(sizes[:r]) for r in range(world)]
    mine = floats([rank * 1000 + i for i in range(sizes[rank])])
    out = floats([-1.0] * sum(sizes))
    nccl.GroupStart()
    for root in range(world):
        dst = ctypes.addressof(out) + 4 * offs[root]
        nccl.Broadcast(mine if root == rank else null, dst, sizes[root], FLOAT32, root, comm, stream)
    nccl.GroupEnd()
    sync()
    expect(out, [float(r * 1000 + i) for r in range(world) for i in range(sizes[r])], "all_gatherv")

    # Send/recv pairs in a group: a ring exchange.
    to, frm = (rank + 1) % world, (rank - 1) % world
    s = (ctypes.c_int32 * 77)(*[rank * 100 + i for i in range(77)])
    r_ = (ctypes.c_int32 * 77)()
    nccl.GroupStart()
    nccl.Send(s, 77, INT32, to, comm, stream)
    nccl.Recv(r_, 77, INT32, frm, comm, stream)
    nccl.GroupEnd()
    sync()
    expect(r_, [frm * 100 + i for i in range(77)], "send/recv")

    # Reduce to rank 1 % world, all-gather, reduce-scatter.
    root = 1 % world
    red = floats([0.0] * 64)
    # (Inputs stay referenced until the stream work ran: it reads them after the call.)
    red_in = floats([rank + i for i in range(64)])
    nccl.Reduce(red_in, red, 64, FLOAT32, SUM, root, comm, stream)
    sync()
    if rank == root:
        expect(red, [float(sum(r + i for r in range(world))) for i in range(64)], "reduce")
    ag = floats([0.0] * (world * 10))
    ag_in = floats([rank * 10 + i for i in range(10)])
    nccl.AllGather(ag_in, ag, 10, FLOAT32, comm, stream)
    sync()
    expect(ag, [float(r * 10 + i) for r in range(world) for i in range(10)], "all_gather")
    rs = floats([0.0] * 10)
    rs_in = floats([rank + j for j in range(world * 10)])
    nccl.ReduceScatter(rs_in, rs, 10, FLOAT32, SUM, comm, stream)
    sync()
    expect(rs, [float(sum(r + rank * 10 + i for r in range(world))) for i in range(10)], "reduce_scatter")

    # Bad arguments: an error code and a sentence, and the communicator stays usable.
    f = nccl.f
    assert f["ncclAllReduce"](send, null, n, FLOAT32, SUM, comm, null) == 4
    assert f["ncclAllReduce"](send, recv, n, 99, SUM, comm, null) == 4
    assert b"invalid argument" in f["ncclGetErrorString"](4)
    win = ncclWindow_t()
    assert f["ncclCommWindowRegister"](comm, recv, 4 * n, ctypes.byref(win), 0) == 0
    nccl.AllReduce(send, recv, n, FLOAT32, SUM, comm, null)
    assert f["ncclCommWindowDeregister"](comm, win) == 0
    assert f["ncclCommWindowDeregister"](comm, win) == 4, "a window deregistered twice"
    expect(recv, [float(sum((r * 3 + i) % 7 - 2 for r in range(world))) for i in range(n)], "all_reduce after errors")

    premul_sums(nccl, comm, rank, world, stream, sync)
    nccl.CommDestroy(comm)
    print(f"rank {rank}: ok (NCCL version code {v.value})", flush=True)


def premul_sums(nccl, comm, rank, world, stream, sync):
    """ncclRedOpCreatePreMulSum: a scalar read at creation (host immediate), one read when
    each call runs (ncclScalarDevice), integers; ops used on the wrong type or after
    ncclRedOpDestroy are refused."""
    f = nccl.f
    n = 1031
    x = [float((rank + i) % 4) for i in range(n)]
    xs = lambda r: [float((r + i) % 4) for i in range(n)]
    send, recv = floats(x), floats([0.0] * n)
    imm, scalar = ctypes.c_int(), ctypes.c_float(rank + 1.0)
    nccl.RedOpCreatePreMulSum(ctypes.byref(imm), ctypes.byref(scalar), FLOAT32, 1, comm)
    scalar.value = 100.0  # read at creation: this value is not used
    nccl.AllReduce(send, recv, n, FLOAT32, imm.value, comm, stream)
    sync()
    expect(recv, [sum((r + 1) * xs(r)[i] for r in range(world)) for i in range(n)], "premul sum (immediate)")
    late, dev = ctypes.c_int(), ctypes.c_float(0.0)
    nccl.RedOpCreatePreMulSum(ctypes.byref(late), ctypes.byref(dev), FLOAT32, 0, comm)
    per = n // world
    block = floats([0.0] * per)
    for k in (2.0, 0.5):
        dev.value = k * (rank + 1)
        nccl.ReduceScatter(send, block, per, FLOAT32, late.value, comm, stream)
        sync()
        want = [sum(k * (r + 1) * xs(r)[rank * per + i] for r in range(world)) for i in range(per)]
        expect(block, want, f"premul reduce-scatter (scalar read at run time, {k})")
    ints, iscalar = ctypes.c_int(), ctypes.c_int(-3)
    nccl.RedOpCreatePreMulSum(ctypes.byref(ints), ctypes.byref(iscalar), INT32, 1, comm)
    ibuf = (ctypes.c_int * n)(*[rank + i for i in range(n)])
    nccl.Reduce(ibuf, ibuf, n, INT32, ints.value, 0, comm, stream)
    sync()
    if rank == 0:
        expect(ibuf, [-3 * sum(r + i for r in range(world)) for i in range(n)], "premul reduce (int32)")
    assert f["ncclAllReduce"](send, recv, n, INT32, imm.value, comm, stream) == 4, "an f32 op on int32"
    assert f["ncclRedOpDestroy"](imm.value, comm) == 0
    assert f["ncclAllReduce"](send, recv, n, FLOAT32, imm.value, comm, stream) == 4, "a destroyed op"
    assert f["ncclRedOpDestroy"](imm.value, comm) == 4, "an op destroyed twice"
    assert f["ncclRedOpDestroy"](SUM, comm) == 4, "a built-in op destroyed"
    for o in (late, ints):
        assert f["ncclRedOpDestroy"](o.value, comm) == 0


def closed_stderr_main(path):
    """Child of closed_stderr_check: stderr is a pipe nobody reads any more and SIGPIPE is
    ignored (Python's default), so every write to stderr fails with EPIPE. Failing calls log a
    WARN line there; they must still return their error code, not abort the process."""
    f = load(path)
    lib = ctypes.CDLL(path)
    for name in ("ncclCommCount", "ncclCommUserRank"):
        f[name] = getattr(lib, name)
        f[name].restype, f[name].argtypes = ncclResult_t, [ncclComm_t, ctypes.POINTER(ctypes.c_int)]
    while True:  # until the parent has closed its end
        try:
            os.write(2, b".")
            time.sleep(0.001)
        except BrokenPipeError:
            break
    n = ctypes.c_int(-1)
    got = [f["ncclCommCount"](None, ctypes.byref(n)),
           f["ncclCommDestroy"](ncclComm_t(0x7777)),
           f["ncclCommUserRank"](ncclComm_t(0x7777), ctypes.byref(n))]
    print(" ".join(map(str, got)), flush=True)


def closed_stderr_check(path):
    env = dict(os.environ, PYNCCL_TEST_CLOSED_STDERR="1", ROCCL_DEBUG="INFO")
    k = subprocess.Popen([sys.executable, __file__, path], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    k.stderr.close()
    out, _ = k.communicate(timeout=60)
    codes = out.decode().split()
    if k.returncode != 0 or codes != ["4", "4", "4"]:
        sys.exit(f"closed-stderr test FAILED: exit {k.returncode} (negative: killed by that signal), "
                 f"codes {codes} (want invalid argument, 4, from each call)")
    print("closed-stderr test passed: failing calls return their code with stderr a closed pipe")


def main():
    if os.environ.get("PYNCCL_TEST_CLOSED_STDERR") is not None:
        closed_stderr_main(sys.argv[1])
        return
    if os.environ.get("PYNCCL_TEST_RANK") is not None:
        rank_main(sys.argv[1], int(os.environ["PYNCCL_TEST_RANK"]), int(os.environ["PYNCCL_TEST_WORLD"]),
                  os.environ["PYNCCL_TEST_ID"])
        return
    path = os.path.abspath(sys.argv[1])
    args = [a for a in sys.argv[2:] if not a.startswith("--")]
    world = int(args[0]) if args else 3
    streams = "--streams" in sys.argv
    closed_stderr_check(path)
    with tempfile.TemporaryDirectory() as d:
        kids = []
        for r in range(world):
            env = dict(os.environ, PYNCCL_TEST_RANK=str(r), PYNCCL_TEST_WORLD=str(world),
                       PYNCCL_TEST_ID=os.path.join(d, "uid"), PYNCCL_TEST_STREAMS=str(int(streams)))
            if streams:
                env["ROCCL_DEVICE"] = "sim"
            kids.append(subprocess.Popen([sys.executable, __file__, path], env=env))
        failed = []
        deadline = time.time() + 180
        for r, k in enumerate(kids):
            try:
                rc = k.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                k.kill()
                rc = "timeout"
            if rc != 0:
                failed.append(f"rank {r}: {rc}")
        if failed:
            for k in kids:
                k.kill()
            sys.exit("pynccl-style test FAILED: " + "; ".join(failed))
    print(f"pynccl-style test passed: {world} ranks, {path}{', streams on the simulated device' if streams else ''}")


if __name__ == "__main__":
    main()
