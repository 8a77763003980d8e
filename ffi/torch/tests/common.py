"""Starting ranks for the tests: `run(world, fn, ...)` starts `world` processes (forked from
pytest by default, or spawned as mp.spawn does), joins each to a "roccl" process group and
runs `fn(rank, world, *args)`; an exception in any rank fails the test with its traceback,
and a rank still running after `limit` seconds fails it too (its processes are killed)."""

import datetime
import os
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

LIMIT = float(os.environ.get("ROCCL_TORCH_TEST_LIMIT", "240"))


def _entry(rank, world, init, path, timeout_s, env, fn, args, per_rank_env=None):
    os.environ.update(env)
    os.environ.update((per_rank_env or {}).get(rank, {}))
    import roccl  # noqa: F401  (registers the backend)

    if init == "file":
        method = f"file://{path}"
    elif init == "tcp":
        method = f"tcp://127.0.0.1:{env['TEST_PORT']}"
    else:
        method = "env://"
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = env["TEST_PORT"]
    kwargs = {} if init == "env" else {"rank": rank, "world_size": world}
    dist.init_process_group(
        "roccl",
        init_method=method,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    try:
        fn(rank, world, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world, fn, *args, start="fork", init="file", timeout_s=60, env=None, limit=LIMIT,
        per_rank_env=None):
    """`per_rank_env`: {rank: {variable: value}} set in that rank only, over `env`."""
    env = dict(env or {})
    env.setdefault("TEST_PORT", str(free_port()))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store")
        ctx = mp.start_processes(
            _entry,
            args=(world, init, path, timeout_s, env, fn, args, per_rank_env),
            nprocs=world,
            join=False,
            start_method=start,
        )
        deadline = time.monotonic() + limit
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"the ranks did not finish within {limit} s (hung)")
