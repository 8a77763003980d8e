#!/usr/bin/env python3
"""ncclCommShrink, ncclCommGrow, ncclCommGetUniqueId and ncclCommRevoke through
libroccl-nccl.so with ctypes, ranks as processes (standard library only):

  - 4 ranks all-reduce; rank 3 is killed (SIGKILL); the survivors' next all-reduce fails,
    naming rank 3; they shrink with NCCL_SHRINK_ABORT and all-reduce on the 3 of them;
  - the 3 grow back to 4 with a new process that joins with ncclCommGetUniqueId's id;
  - revoke: calls fail, ncclCommGetAsyncError says ncclSuccess (quiescent), destroy works;
  - bad arguments (unknown flags, a rank excluding itself) are refused with a message.

    tests/nccl/test_shrink.py LIB
"""
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time

FLOAT32, SUM = 7, 0
SHRINK_ABORT = 1


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def lib(path):
    n = ctypes.CDLL(path)
    P = ctypes.c_void_p
    n.ncclGetUniqueId.argtypes = [ctypes.POINTER(ncclUniqueId)]
    n.ncclCommInitRank.argtypes = [ctypes.POINTER(P), ctypes.c_int, ncclUniqueId, ctypes.c_int]
    n.ncclAllReduce.argtypes = [P, P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, P, P]
    n.ncclCommShrink.argtypes = [P, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.POINTER(P), P,
                                 ctypes.c_int]
    n.ncclCommGetUniqueId.argtypes = [P, ctypes.POINTER(ncclUniqueId)]
    n.ncclCommGrow.argtypes = [P, ctypes.c_int, ctypes.POINTER(ncclUniqueId), ctypes.c_int,
                               ctypes.POINTER(P), P]
    n.ncclCommRevoke.argtypes = [P, ctypes.c_int]
    n.ncclCommGetAsyncError.argtypes = [P, ctypes.POINTER(ctypes.c_int)]
    n.ncclCommCount.argtypes = [P, ctypes.POINTER(ctypes.c_int)]
    n.ncclCommUserRank.argtypes = [P, ctypes.POINTER(ctypes.c_int)]
    n.ncclCommDestroy.argtypes = [P]
    n.ncclGetLastError.argtypes = [P]
    n.ncclGetLastError.restype = ctypes.c_char_p
    return n


def last(n):
    return n.ncclGetLastError(None).decode()


def all_reduce(n, comm, values):
    buf = (ctypes.c_float * len(values))(*values)
    r = n.ncclAllReduce(buf, buf, len(values), FLOAT32, SUM, comm, None)
    return r, list(buf)


def check_sum(n, comm, rank, total, what):
    for count in (1, 1000, (1 << 20) + 3):
        r, out = all_reduce(n, comm, [float(rank + 1)] * count)
        assert r == 0, f"{what}: all-reduce of {count} returned {r}: {last(n)}"
        assert out[0] == total and out[-1] == total and out[count // 2] == total, \
            f"{what}: {count} elements: {out[0]}, {out[-1]}, expected {total}"


def size_rank(n, comm):
    s, r = ctypes.c_int(), ctypes.c_int()
    assert n.ncclCommCount(comm, ctypes.byref(s)) == 0, last(n)
    assert n.ncclCommUserRank(comm, ctypes.byref(r)) == 0, last(n)
    return s.value, r.value


def rank_main(path, rank, ids, report, grow_ids):
    n = lib(path)
    uid = ncclUniqueId()
    if rank == 0:
        assert n.ncclGetUniqueId(ctypes.byref(uid)) == 0, last(n)
        for _ in range(3):
            ids.put(bytes(uid.internal))
    else:
        ctypes.memmove(uid.internal, ids.get(), 128)
    comm = ctypes.c_void_p()
    assert n.ncclCommInitRank(ctypes.byref(comm), 4, uid, rank) == 0, last(n)
    check_sum(n, comm, rank, 10.0, "4 ranks")
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    t0 = time.time()
    r, _ = all_reduce(n, comm, [1.0] * 1000)
    took = time.time() - t0
    msg = last(n)
    assert r != 0, "an all-reduce with a killed rank succeeded"
    assert "rank 3" in msg, msg
    # Bad arguments first: unknown flags, a rank excluding itself.
    new = ctypes.c_void_p()
    me = (ctypes.c_int * 1)(rank)
    assert n.ncclCommShrink(comm, me, 1, ctypes.byref(new), None, 7) == 4
    assert "shrinkFlags" in last(n), last(n)
    assert n.ncclCommShrink(comm, me, 1, ctypes.byref(new), None, 0) == 5
    assert "own exclude list" in last(n), last(n)
    dead = (ctypes.c_int * 1)(3)
    t1 = time.time()
    r = n.ncclCommShrink(comm, dead, 1, ctypes.byref(new), None, SHRINK_ABORT)
    assert r == 0, f"shrink returned {r}: {last(n)}"
    shrink_s = time.time() - t1
    assert size_rank(n, new) == (3, rank)
    check_sum(n, new, rank, 6.0, "3 survivors")
    # Grow back to 4 with a new process.
    gid = ncclUniqueId()
    assert n.ncclCommGetUniqueId(new, ctypes.byref(gid)) == 0, last(n)
    if rank == 1:
        grow_ids.put(bytes(gid.internal))
    big = ctypes.c_void_p()
    mine = ctypes.byref(gid) if rank == 1 else None
    r = n.ncclCommGrow(new, 4, mine, -1, ctypes.byref(big), None)
    assert r == 0, f"grow returned {r}: {last(n)}"
    assert size_rank(n, big) == (4, rank)
    check_sum(n, big, rank, 10.0, "grown to 4")
    # Revoke: quiescent at once, calls refused, destroy works.
    assert n.ncclCommRevoke(big, 0) == 0, last(n)
    st = ctypes.c_int(-1)
    assert n.ncclCommGetAsyncError(big, ctypes.byref(st)) == 0 and st.value == 0, st.value
    r, _ = all_reduce(n, big, [1.0])
    assert r != 0 and "revoked" in last(n), (r, last(n))
    for c in (big, new, comm):
        assert n.ncclCommDestroy(c) == 0, last(n)
    report.put((rank, took, shrink_s))


def new_rank_main(path, grow_ids, report):
    n = lib(path)
    gid = ncclUniqueId()
    ctypes.memmove(gid.internal, grow_ids.get(), 128)
    big = ctypes.c_void_p()
    r = n.ncclCommGrow(None, 4, ctypes.byref(gid), 3, ctypes.byref(big), None)
    assert r == 0, f"new rank's grow returned {r}: {last(n)}"
    assert size_rank(n, big) == (4, 3)
    check_sum(n, big, 3, 10.0, "new rank 3")
    report.put(("new", 0, 0))


def main():
    path = os.path.abspath(sys.argv[1])
    os.environ.setdefault("ROCCL_TIMEOUT", "20")
    os.environ.setdefault("ROCCL_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("fork")
    ids, report, grow_ids = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(path, r, ids, report, grow_ids)) for r in range(4)]
    procs.append(ctx.Process(target=new_rank_main, args=(path, grow_ids, report)))
    for p in procs:
        p.start()
    deadline = time.time() + 120
    for p in procs:
        p.join(max(1, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    assert codes[3] == -signal.SIGKILL, codes
    assert codes[:3] == [0, 0, 0] and codes[4] == 0, f"exit codes {codes}"
    got = sorted((report.get(timeout=5) for _ in range(4)), key=str)
    for rank, took, shrink_s in got:
        if rank != "new":
            print(f"test_shrink: rank {rank}: the call with a dead rank failed after {took:.2f} s; "
                  f"shrink took {shrink_s:.2f} s")
    print("test_shrink: 4 ranks, one killed, 3 shrank and all-reduced, grew back to 4 with a new "
          "process, revoked; bad arguments refused")


if __name__ == "__main__":
    main()
