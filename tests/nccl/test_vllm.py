#!/usr/bin/env python3
"""libroccl-nccl.so as vLLM 0.33's pynccl wrapper loads and calls it (standard library only):
the same function list and argument types, the same rules for which symbols are optional on
the CUDA and the ROCm platform (missing required ones fail the load, as they would fail
vLLM), and the same use: a unique id made on rank 0 and handed to the others out of band,
all-reduce, all-gather, reduce-scatter, broadcast, reduce, grouped send/recv, window
registration, suspend and resume (CUDA platform), ncclCommQueryProperties with vLLM's
144-byte 2.31.2 layout and its version clamp, an invalid call followed by a good one, and
abort. Plus what NCCL 2.32 added that vLLM does not call yet: gather, scatter, all-to-all,
the *Config variants, ncclMemAlloc/Free. Host memory, NULL streams.

    tests/nccl/test_vllm.py LIB [NRANKS]     (runs NRANKS processes per platform mode)
"""
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time

R, C = ctypes.c_int, ctypes.c_void_p
FLOAT32, INT32 = 7, 2
SUM, MAX = 0, 2


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class ncclCommProperties(ctypes.Structure):
    # NCCL 2.31.2's ncclCommProperties_t, as vLLM 0.33 declares it (144 bytes).
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("rank", ctypes.c_int), ("nRanks", ctypes.c_int), ("cudaDev", ctypes.c_int),
                ("nvmlDev", ctypes.c_int), ("deviceApiSupport", ctypes.c_bool),
                ("multimemSupport", ctypes.c_bool), ("ginType", ctypes.c_int),
                ("nLsaTeams", ctypes.c_int), ("hostRmaSupport", ctypes.c_bool),
                ("railedGinType", ctypes.c_int), ("commHash", ctypes.c_uint64),
                ("ginMinStride", ctypes.c_int), ("ginConnectionType", ctypes.c_int),
                ("ginSupport", ctypes.c_bool * 64), ("devCommRuntimeVersionSize", ctypes.c_size_t)]


assert ctypes.sizeof(ncclCommProperties) == 144

P, B = ctypes.POINTER, C
# name: (restype, argtypes), in vLLM 0.33's order.
VLLM = {
    "ncclGetErrorString": (ctypes.c_char_p, [R]),
    "ncclGetLastError": (ctypes.c_char_p, [C]),
    "ncclGetVersion": (R, [P(ctypes.c_int)]),
    "ncclGetUniqueId": (R, [P(ncclUniqueId)]),
    "ncclCommInitRank": (R, [P(C), ctypes.c_int, ncclUniqueId, ctypes.c_int]),
    "ncclAllReduce": (R, [B, B, ctypes.c_size_t, R, R, C, C]),
    "ncclAllGather": (R, [B, B, ctypes.c_size_t, R, C, C]),
    "ncclReduceScatter": (R, [B, B, ctypes.c_size_t, R, R, C, C]),
    "ncclSend": (R, [B, ctypes.c_size_t, R, ctypes.c_int, C, C]),
    "ncclRecv": (R, [B, ctypes.c_size_t, R, ctypes.c_int, C, C]),
    "ncclBroadcast": (R, [B, B, ctypes.c_size_t, R, ctypes.c_int, C, C]),
    "ncclReduce": (R, [B, B, ctypes.c_size_t, R, R, ctypes.c_int, C, C]),
    "ncclCommDestroy": (R, [C]),
    "ncclCommAbort": (R, [C]),
    "ncclCommSuspend": (R, [C, ctypes.c_int]),
    "ncclCommResume": (R, [C]),
    "ncclGroupStart": (R, []),
    "ncclGroupEnd": (R, []),
    "ncclCommWindowRegister": (R, [C, B, ctypes.c_size_t, P(C), ctypes.c_int]),
    "ncclCommWindowDeregister": (R, [C, C]),
    "ncclCommQueryProperties": (R, [C, P(ncclCommProperties)]),
}
# NCCL 2.32 calls beyond vLLM's list.
EXTRA = {
    "ncclGather": (R, [B, B, ctypes.c_size_t, R, ctypes.c_int, C, C]),
    "ncclScatter": (R, [B, B, ctypes.c_size_t, R, ctypes.c_int, C, C]),
    "ncclAlltoAll": (R, [B, B, ctypes.c_size_t, R, C, C]),
    "ncclAllReduceConfig": (R, [B, B, ctypes.c_size_t, R, R, C, C, C]),
    "ncclMemAlloc": (R, [P(C), ctypes.c_size_t]),
    "ncclMemFree": (R, [C]),
    "ncclCommShrink": (R, [C, P(ctypes.c_int), ctypes.c_int, P(C), C, ctypes.c_int]),
}


def optional(name, platform):
    """vLLM 0.33's rule for a symbol the library lacks: skipped, or the load fails."""
    if name in ("ncclCommWindowRegister", "ncclCommWindowDeregister"):
        return platform == "rocm"
    if name in ("ncclCommQueryProperties", "ncclGetLastError"):
        return True
    if name in ("ncclCommSuspend", "ncclCommResume"):
        return platform == "rocm"
    return False


def load(path, platform):
    lib = ctypes.CDLL(path)
    funcs = {}
    for name, (res, args) in list(VLLM.items()) + list(EXTRA.items()):
        try:
            f = getattr(lib, name)
        except AttributeError:
            if name in EXTRA or optional(name, platform):
                continue
            raise
        f.restype, f.argtypes = res, args
        funcs[name] = f
    return funcs


def floats(vals):
    return (ctypes.c_float * len(vals))(*vals)


def expect(got, want, what):
    got = list(got)
    assert got == want, f"{what}: got {got[:8]}..., want {want[:8]}..."


def rank_main(path, platform, rank, world, d):
    f = load(path, platform)
    for name in VLLM:
        assert name in f, f"{name} missing (vLLM on {platform} needs or probes it)"

    def ok(r, what):
        if r != 0:
            raise AssertionError(f"{what}: {r} {f['ncclGetErrorString'](r)} {f['ncclGetLastError'](None)}")

    v = ctypes.c_int()
    ok(f["ncclGetVersion"](ctypes.byref(v)), "version")
    assert v.value >= 22907, f"version {v.value}: vLLM's CUDA path needs 2.29.7 for suspend"
    uid = ncclUniqueId()
    idf = os.path.join(d, "uid")
    if rank == 0:
        ok(f["ncclGetUniqueId"](ctypes.byref(uid)), "unique id")
        with open(idf + ".tmp", "wb") as fh:
            fh.write(bytes(uid.internal))
        os.rename(idf + ".tmp", idf)
    else:
        deadline = time.time() + 60
        while not os.path.exists(idf):
            assert time.time() < deadline
            time.sleep(0.01)
        with open(idf, "rb") as fh:
            ctypes.memmove(ctypes.addressof(uid.internal), fh.read(), 128)
    comm = C()
    ok(f["ncclCommInitRank"](ctypes.byref(comm), world, uid, rank), "init")
    n = 64
    send = floats([float(rank * 100 + i) for i in range(n)])
    recv = floats([0.0] * n)
    ok(f["ncclAllReduce"](send, recv, n, FLOAT32, SUM, comm, None), "all_reduce")
    expect(recv, [float(sum(r * 100 + i for r in range(world))) for i in range(n)], "all_reduce")
    ag = floats([0.0] * (n * world))
    ok(f["ncclAllGather"](send, ag, n, FLOAT32, comm, None), "all_gather")
    expect(ag, [float(r * 100 + i) for r in range(world) for i in range(n)], "all_gather")
    rs = floats([0.0] * 8)
    rs_in = floats([float(rank + j) for j in range(8 * world)])
    ok(f["ncclReduceScatter"](rs_in, rs, 8, FLOAT32, SUM, comm, None), "reduce_scatter")
    expect(rs, [float(sum(r + rank * 8 + i for r in range(world))) for i in range(8)], "reduce_scatter")
    b = floats([float(rank)] * n)
    ok(f["ncclBroadcast"](b, b, n, FLOAT32, world - 1, comm, None), "broadcast")
    expect(b, [float(world - 1)] * n, "broadcast")
    red = floats([0.0] * n)
    ok(f["ncclReduce"](send, red, n, FLOAT32, MAX, 0, comm, None), "reduce")
    if rank == 0:
        expect(red, [float((world - 1) * 100 + i) for i in range(n)], "reduce")
    # Grouped send/recv around a ring, as vLLM's pipeline parallelism does.
    out, inn = floats([float(rank)] * 4), floats([0.0] * 4)
    ok(f["ncclGroupStart"](), "group start")
    ok(f["ncclSend"](out, 4, FLOAT32, (rank + 1) % world, comm, None), "send")
    ok(f["ncclRecv"](inn, 4, FLOAT32, (rank - 1) % world, comm, None), "recv")
    ok(f["ncclGroupEnd"](), "group end")
    expect(inn, [float((rank - 1) % world)] * 4, "send/recv ring")
    # A window, and an all-reduce on it.
    win = C()
    wbuf = floats([1.0] * n)
    ok(f["ncclCommWindowRegister"](comm, wbuf, 4 * n, ctypes.byref(win), 1), "window register")
    ok(f["ncclAllReduce"](wbuf, wbuf, n, FLOAT32, SUM, comm, None), "all_reduce on a window")
    expect(wbuf, [float(world)] * n, "all_reduce on a window")
    ok(f["ncclCommWindowDeregister"](comm, win), "window deregister")
    # Properties, as vLLM asks for them.
    props = ncclCommProperties()
    props.size, props.magic = ctypes.sizeof(props), 0xCAFEBEEF
    props.version = min(v.value, 23102)
    ok(f["ncclCommQueryProperties"](comm, ctypes.byref(props)), "query properties")
    assert (props.rank, props.nRanks) == (rank, world), (props.rank, props.nRanks)
    assert props.ginType == 0 and props.railedGinType == 0 and not props.deviceApiSupport
    assert props.size == 144 and props.magic == 0xCAFEBEEF
    with open(os.path.join(d, f"hash{rank}"), "w") as fh:
        fh.write(str(props.commHash))
    bad = ncclCommProperties()
    assert f["ncclCommQueryProperties"](comm, ctypes.byref(bad)) == 4, "uninitialized props accepted"
    # Suspend and resume (the CUDA platform's sleep mode): calls refused meanwhile.
    if platform == "cuda":
        ok(f["ncclCommSuspend"](comm, 1), "suspend")
        r = f["ncclAllReduce"](send, recv, n, FLOAT32, SUM, comm, None)
        assert r == 5, f"a call on a suspended communicator returned {r}"
        assert b"suspended" in f["ncclGetLastError"](None)
        ok(f["ncclCommResume"](comm), "resume")
        ok(f["ncclAllReduce"](send, recv, n, FLOAT32, SUM, comm, None), "all_reduce after resume")
        expect(recv, [float(sum(r * 100 + i for r in range(world))) for i in range(n)], "after resume")
    # An invalid call, then a good one.
    assert f["ncclAllReduce"](send, recv, n, 99, SUM, comm, None) == 4
    assert f["ncclGetLastError"](None), "no message after a failing call"
    ok(f["ncclAllReduce"](send, recv, n, FLOAT32, SUM, comm, None), "all_reduce after an error")
    # NCCL 2.32 beyond vLLM's list.
    g = floats([0.0] * (4 * world))
    ok(f["ncclGather"](floats([float(rank)] * 4), g, 4, FLOAT32, 0, comm, None), "gather")
    if rank == 0:
        expect(g, [float(r) for r in range(world) for _ in range(4)], "gather")
    sc_in = floats([float(r * 10 + j) for r in range(world) for j in range(3)])
    sc = floats([0.0] * 3)
    ok(f["ncclScatter"](sc_in, sc, 3, FLOAT32, world - 1, comm, None), "scatter")
    expect(sc, [float(rank * 10 + j) for j in range(3)], "scatter")
    a2a_in = floats([float(rank * 1000 + j) for j in range(2 * world)])
    a2a = floats([0.0] * (2 * world))
    ok(f["ncclAlltoAll"](a2a_in, a2a, 2, FLOAT32, comm, None), "alltoall")
    expect(a2a, [float(r * 1000 + rank * 2 + k) for r in range(world) for k in range(2)], "alltoall")
    ok(f["ncclAllReduceConfig"](send, recv, n, FLOAT32, SUM, comm, None, None), "all_reduce config NULL")
    junk = (ctypes.c_byte * 64)()
    assert f["ncclAllReduceConfig"](send, recv, n, FLOAT32, SUM, comm, None, junk) == 4
    mem = C()
    ok(f["ncclMemAlloc"](ctypes.byref(mem), 4 * n), "mem alloc")
    ctypes.memmove(mem, send, 4 * n)
    ok(f["ncclAllReduce"](mem, mem, n, FLOAT32, SUM, comm, None), "all_reduce on ncclMemAlloc memory")
    got = (ctypes.c_float * n).from_address(mem.value)
    expect(got, [float(sum(r * 100 + i for r in range(world))) for i in range(n)], "on ncclMemAlloc memory")
    ok(f["ncclMemFree"](mem), "mem free")
    assert f["ncclMemFree"](mem) == 4, "a double free accepted"
    excl = (ctypes.c_int * 1)(0)
    newc = C()
    r = f["ncclCommShrink"](comm, excl, 1, ctypes.byref(newc), None, 0)
    if rank == 0:
        assert r == 5 and b"own exclude list" in f["ncclGetLastError"](None), r
    else:
        ok(r, "shrink without rank 0")
        ok(f["ncclAllReduce"](send, recv, n, FLOAT32, SUM, newc, None), "all_reduce after shrink")
        expect(recv, [float(sum(r * 100 + i for r in range(1, world))) for i in range(n)], "after shrink")
        ok(f["ncclCommDestroy"](newc), "destroy the shrunk communicator")
    if rank == world - 1:
        ok(f["ncclCommAbort"](comm), "abort")
    else:
        ok(f["ncclCommDestroy"](comm), "destroy")
    print(f"rank {rank} ({platform}): ok", flush=True)


def main():
    if os.environ.get("VLLM_TEST_RANK") is not None:
        rank_main(sys.argv[1], os.environ["VLLM_TEST_PLATFORM"], int(os.environ["VLLM_TEST_RANK"]),
                  int(os.environ["VLLM_TEST_WORLD"]), os.environ["VLLM_TEST_DIR"])
        return
    path = os.path.abspath(sys.argv[1])
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    for platform in ("cuda", "rocm"):
        with tempfile.TemporaryDirectory() as d:
            kids = [subprocess.Popen([sys.executable, __file__, path],
                                     env=dict(os.environ, VLLM_TEST_RANK=str(r), VLLM_TEST_WORLD=str(world),
                                              VLLM_TEST_DIR=d, VLLM_TEST_PLATFORM=platform))
                    for r in range(world)]
            bad = []
            for r, k in enumerate(kids):
                try:
                    rc = k.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    k.kill()
                    rc = "timeout"
                if rc != 0:
                    bad.append(f"rank {r}: {rc}")
            if bad:
                sys.exit(f"vLLM-style test ({platform}) FAILED: " + "; ".join(bad))
            hashes = {open(os.path.join(d, f"hash{r}")).read() for r in range(world)}
            assert len(hashes) == 1, f"commHash differs between ranks: {hashes}"
        print(f"vLLM-style test passed: {world} ranks, platform {platform}")


if __name__ == "__main__":
    main()
