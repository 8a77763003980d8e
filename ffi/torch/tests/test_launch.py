"""Starting "roccl" process groups every way torch does (init_method env://, tcp://, file://,
mp.spawn, torchrun, the entry point without `import roccl`), and failures: a killed rank makes
the other ranks' calls raise within the timeout, naming it, and no process hangs at exit."""

import datetime
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common import free_port, run

ROOT = Path(__file__).resolve().parents[3]


def sums(rank, world):
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), world * (world + 1) / 2)), t
    assert dist.get_backend() == "roccl"


@pytest.mark.parametrize("init", ["env", "tcp", "file"])
def test_init_methods(init):
    run(2, sums, init=init)


def test_mp_spawn():
    run(2, sums, start="spawn")


def test_readme_ddp_example_under_torchrun():
    """The DDP example of README.md, run by torchrun as the README says."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python\n# ddp.py")
    code = readme[start + len("```python\n") : readme.index("```", start + 10)]
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "ddp.py"
        script.write_text(code)
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()), str(script)],
            capture_output=True, text=True, timeout=180,
        )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0: loss" in out.stdout, out.stdout


def test_entry_point_registers_without_import():
    with tempfile.TemporaryDirectory() as d:
        code = textwrap.dedent(f"""
            import torch, torch.distributed as dist
            dist.init_process_group("roccl", init_method="file://{d}/store", rank=0, world_size=1)
            t = torch.ones(3); dist.all_reduce(t)
            assert "roccl" not in __import__("sys").modules or True
            print("backend", dist.get_backend(), t.tolist())
            dist.destroy_process_group()
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "backend roccl [1.0, 1.0, 1.0]" in out.stdout


def _killed(rank, world, path, timeout_s, results, how="kill"):
    import roccl  # noqa: F401

    dist.init_process_group(
        "roccl", init_method=f"file://{path}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    t = torch.ones(1 << 16 if world <= 3 else 1 << 21)
    dist.all_reduce(t)
    dist.barrier()
    if rank == world - 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(timeout_s + 30)  # hung: alive, but it makes no call
        os._exit(0)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        for _ in range(50):
            dist.all_reduce(t)
        results.put((rank, "no error", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001
        results.put((rank, str(e), time.monotonic() - start))
    # Exit without destroy_process_group: the process must not hang at exit.


def _failing_rank(how, net, timeout_s, world=3):
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    env = dict(os.environ)
    if net != "default":
        os.environ["ROCCL_NET"] = net
    try:
        with tempfile.TemporaryDirectory() as d:
            procs = [
                ctx.Process(target=_killed, args=(r, world, f"{d}/store", timeout_s, results, how))
                for r in range(world)
            ]
            for p in procs:
                p.start()
            got = [results.get(timeout=timeout_s + 60) for _ in range(world - 1)]
            for p in procs[: world - 1]:
                p.join(timeout=30)
            hung = [r for r, p in enumerate(procs[: world - 1]) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert not hung, f"ranks {hung} did not exit"
    if how == "kill":
        assert procs[world - 1].exitcode == -signal.SIGKILL
    for rank, msg, took in got:
        assert msg != "no error", f"rank {rank}: all_reduce went on without rank {world - 1}"
        assert took < timeout_s + 5, f"rank {rank}: raised after {took:.1f} s (timeout {timeout_s} s)"
        print(f"rank {rank} raised after {took:.2f} s: {msg}")
    named = [rank for rank, msg, _ in got if f"rank {world - 1}" in msg]
    # A killed rank's connections close; a hung rank's neighbours time out and tell the
    # others which rank they waited on: every other rank names it.
    assert len(named) == world - 1, f"not every rank named the {how} rank {world - 1}: {got}"


@pytest.mark.parametrize("net", ["default", "tcp"])
def test_a_killed_rank_makes_the_others_raise_naming_it(net):
    _failing_rank("kill", net, timeout_s=15)


@pytest.mark.parametrize("net,world", [("default", 3), ("tcp", 4), ("rocev2", 4)])
def test_a_hung_rank_makes_the_others_raise_within_the_timeout(net, world):
    _failing_rank("hang", net, timeout_s=6, world=world)


def _per_op_timeout(rank, world):
    if rank == 1:
        time.sleep(4)  # never makes the call rank 0 waits in
        return
    opts = dist.AllreduceOptions()
    opts.timeout = datetime.timedelta(milliseconds=500)
    t = torch.ones(4)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError) as e:
        dist.group.WORLD.allreduce([t], opts).wait()
    took = time.monotonic() - start
    assert "rank 1" in str(e.value) and "500ms" in str(e.value), str(e.value)
    assert took < 3, f"the operation's 500 ms timeout took {took:.1f} s (the group's is 60 s)"


def test_an_operations_own_timeout_applies():
    """c10d's per-operation timeout (AllreduceOptions.timeout) replaces the group's."""
    run(2, _per_op_timeout, timeout_s=60)


SRUN_SCRIPT = """
import os, torch, torch.distributed as dist
import roccl
set_now = roccl.env_from_launcher()
dist.init_process_group("roccl")
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print("rank", os.environ["SLURM_PROCID"], sorted(set_now), os.environ["MASTER_ADDR"],
      os.environ["LOCAL_RANK"], t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_under_srun_without_torchrun():
    """Tasks started as srun starts them (only Slurm's variables, no RANK, WORLD_SIZE or
    MASTER_*): roccl.env_from_launcher() fills in what env:// needs, rank 0's host from the
    node list and the port from the job and step ids."""
    import socket

    base = 29400
    for job in range(1000):  # a job id whose derived port is free here
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + job))
                break
            except OSError:
                continue
    world = 3
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    procs = []
    for r in range(world):
        e = dict(env, SLURM_PROCID=str(r), SLURM_NTASKS=str(world), SLURM_LOCALID=str(r),
                 SLURM_JOB_ID=str(1000 + job), SLURM_STEP_ID="0",
                 SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost,other[1-3]")
        procs.append(subprocess.Popen([sys.executable, "-c", SRUN_SCRIPT], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"task {r}: {err}"
        want = (f"rank {r} ['LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE'] "
                f"localhost {r} [6.0, 6.0, 6.0, 6.0]")
        assert want in out, f"task {r}: {out}"


def test_the_installed_libraries_load():
    """roccl.nccl_library_path() is a library with NCCL's API (as vLLM loads it) and
    roccl.net_plugin_path() a network plugin NCCL and RCCL can load."""
    import ctypes

    import roccl

    nccl = ctypes.CDLL(roccl.nccl_library_path())
    version = ctypes.c_int(0)
    assert nccl.ncclGetVersion(ctypes.byref(version)) == 0
    assert version.value >= 21800, version.value
    assert nccl.ncclGetErrorString(0)
    for rccl in (False, True):
        path = roccl.net_plugin_path(rccl=rccl)
        assert path.endswith("librccl-net-roccl.so" if rccl else "libnccl-net-roccl.so")
        plugin = ctypes.CDLL(path)
        for symbol in ("ncclNetPlugin_v8", "ncclNetPlugin_v10"):
            assert hasattr(plugin, symbol), f"{path} has no {symbol}"
