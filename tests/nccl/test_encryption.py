#!/usr/bin/env python3
"""ncclSetEncryption (NCCL 2.32's call, roccl's ROCCL_ENCRYPT) through libroccl-nccl.so with
ctypes, ranks as processes over TCP on loopback (standard library only):

  - bad configs (NULL, wrong magic, too small, PSK mode without a key, unknown mode) are
    ncclInvalidArgument;
  - a job whose ranks all call it with one pre-shared key all-reduces a buffer filled with a
    marker; while it runs, a packet capture on lo (AF_PACKET, needs root) must not see the
    marker; the same job without encryption must (so the capture is shown to work);
  - a rank with another pre-shared key cannot join: it fails naming the key.

    tests/nccl/test_encryption.py LIB
"""
import ctypes
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

MARKER = b"ROCCL-ENCRYPTION-MARKER:"
COUNT = 1 << 20
UINT8, MAX = 1, 2
API_MAGIC = 0xCAFEBEEF


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class ncclEncryptionConfig(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("mode", ctypes.c_int), ("psk", ctypes.c_char_p)]


def lib(path):
    nccl = ctypes.CDLL(path)
    nccl.ncclSetEncryption.argtypes = [ctypes.c_void_p]
    nccl.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ncclUniqueId,
                                      ctypes.c_int]
    nccl.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    nccl.ncclCommDestroy.argtypes = [ctypes.c_void_p]
    nccl.ncclGetLastError.argtypes = [ctypes.c_void_p]
    nccl.ncclGetLastError.restype = ctypes.c_char_p
    return nccl


def config(mode, psk, size=None, magic=API_MAGIC):
    c = ncclEncryptionConfig(ctypes.sizeof(ncclEncryptionConfig) if size is None else size, magic,
                             23203, mode, psk)
    return c


def bad_configs(path):
    nccl = lib(path)
    for what, arg in [
        ("NULL", None),
        ("wrong magic", ctypes.byref(config(1, b"k" * 32, magic=0x1234))),
        ("too small", ctypes.byref(config(1, b"k" * 32, size=8))),
        ("PSK without a key", ctypes.byref(config(1, None))),
        ("empty key", ctypes.byref(config(1, b""))),
        ("short key", ctypes.byref(config(1, b"hunter2"))),
        ("unknown mode", ctypes.byref(config(7, b"k" * 32))),
    ]:
        r = nccl.ncclSetEncryption(arg)
        assert r == 4, f"{what}: ncclSetEncryption returned {r}, not ncclInvalidArgument"
        msg = nccl.ncclGetLastError(None).decode()
        assert "ncclSetEncryption" in msg, f"{what}: {msg}"
        if what in ("empty key", "short key"):
            assert "at least 16" in msg, f"{what}: {msg}"
    assert nccl.ncclSetEncryption(ctypes.byref(config(0, None))) == 0
    print("test_encryption: bad configs are ncclInvalidArgument, each with a message")


def rank_main(path, rank, world, id_file, psk):
    nccl = lib(path)
    if psk:
        r = nccl.ncclSetEncryption(ctypes.byref(config(1, psk.encode())))
        assert r == 0, r
    uid = ncclUniqueId()
    if rank == 0:
        assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
        with open(id_file + ".tmp", "wb") as fh:
            fh.write(bytes(uid.internal))
        os.rename(id_file + ".tmp", id_file)
    else:
        deadline = time.time() + 60
        while not os.path.exists(id_file):
            assert time.time() < deadline, "rank 0 never wrote the unique id"
            time.sleep(0.01)
        with open(id_file, "rb") as fh:
            ctypes.memmove(ctypes.addressof(uid.internal), fh.read(), 128)
    comm = ctypes.c_void_p()
    r = nccl.ncclCommInitRank(ctypes.byref(comm), world, uid, rank)
    if r != 0:
        print(f"rank {rank}: init failed: {nccl.ncclGetLastError(None).decode()}", flush=True)
        sys.exit(3)
    data = (MARKER * (COUNT // len(MARKER) + 1))[:COUNT]
    send = ctypes.create_string_buffer(data, COUNT)
    recv = ctypes.create_string_buffer(COUNT)
    for _ in range(3):
        assert nccl.ncclAllReduce(send, recv, COUNT, UINT8, MAX, comm, None) == 0
        assert recv.raw == data, "all-reduce result"
    assert nccl.ncclCommDestroy(comm) == 0


class Capture:
    """Every frame on lo while running (AF_PACKET; root only)."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.1)
        self.seen = False
        self.frames = 0
        self.stop = False
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def run(self):
        while not self.stop:
            try:
                f = self.sock.recv(65536)
            except socket.timeout:
                continue
            self.frames += 1
            if MARKER in f:
                self.seen = True

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


def job(path, psks, expect_ok=True):
    """Run len(psks) ranks; returns their exit codes and outputs."""
    with tempfile.TemporaryDirectory() as d:
        kids = []
        for r, psk in enumerate(psks):
            env = dict(os.environ, ENC_TEST_RANK=str(r), ENC_TEST_WORLD=str(len(psks)),
                       ENC_TEST_ID=os.path.join(d, "uid"), ENC_TEST_PSK=psk or "",
                       ROCCL_NET="tcp", ROCCL_TIMEOUT="6", ROCCL_SOCKET_IFNAME="lo")
            env.pop("ROCCL_ENCRYPT", None)
            kids.append(subprocess.Popen([sys.executable, __file__, path], env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        out = []
        for k in kids:
            try:
                o, _ = k.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                k.kill()
                o, _ = k.communicate()
            out.append((k.returncode, o.decode(errors="replace")))
        if expect_ok:
            for r, (rc, o) in enumerate(out):
                assert rc == 0, f"rank {r} exited with {rc}:\n{o}"
        return out


def main():
    if os.environ.get("ENC_TEST_RANK") is not None:
        rank_main(sys.argv[1], int(os.environ["ENC_TEST_RANK"]), int(os.environ["ENC_TEST_WORLD"]),
                  os.environ["ENC_TEST_ID"], os.environ["ENC_TEST_PSK"])
        return
    path = os.path.abspath(sys.argv[1])
    bad_configs(path)
    key = os.urandom(16).hex()
    can_capture = os.geteuid() == 0 and hasattr(socket, "AF_PACKET")
    for psk in [None, key]:
        cap = Capture() if can_capture else None
        job(path, [psk, psk])
        if cap:
            cap.close()
            what = "encrypted" if psk else "plain"
            print(f"test_encryption: {what} job: {cap.frames} frames on lo, marker seen: {cap.seen}")
            assert cap.frames > 0, "the capture saw nothing"
            assert cap.seen == (psk is None), \
                f"marker {'not ' if psk is None else ''}seen on the wire of a {what} job"
    if not can_capture:
        print("test_encryption: capture SKIPPED (needs root and AF_PACKET): the wire was not checked")
    out = job(path, [key, os.urandom(16).hex()], expect_ok=False)
    rc, o = out[1]
    assert rc != 0, "a rank with another pre-shared key joined"
    assert "pre-shared key" in o, o
    assert out[0][0] != 0, "rank 0 finished without rank 1"
    print("test_encryption: a rank with another pre-shared key is refused, naming the key")
    print("test_encryption passed")


if __name__ == "__main__":
    main()
