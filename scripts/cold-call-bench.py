#!/usr/bin/env python3
"""The cost of one small `dist.all_reduce` with cold caches, as a decode step sees it.

Between calls every rank streams through a buffer larger than the caches (`--sweep` MiB, as
a model's weights do between its all-reduces), then makes the call. Per call the cost is the
last-arriving rank's time inside it (entry to exit on the host clock: waiting for the others
is not counted), the median over `--calls` calls. Configurations alternate in one window:

  noop     torch's no-op backend ("fake"), torch's own cost
  roccl    roccl (shared memory between the ranks of this host)
  roccl-nofr  roccl with torch's flight recorder off (TORCH_FR_BUFFER_SIZE=0)
  gloo     torch's Gloo

  python3 scripts/cold-call-bench.py [--procs 2] [--rounds 3] [--calls 300] [--sweep 64]
      [--bytes 4096] [--configs noop roccl roccl-nofr roccl-direct gloo]
  (roccl-direct: ROCCL_TORCH_DIRECT=1, torch.distributed.all_reduce through roccl.all_reduce;
  *-warm: without the sweep between calls)

Needs torch and the roccl package (pip install --no-build-isolation ./ffi/torch).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

CONFIGS = {
    "noop": ("fake", {}),
    "roccl": ("roccl", {}),
    "roccl-nofr": ("roccl", {"TORCH_FR_BUFFER_SIZE": "0"}),
    "roccl-direct": ("roccl", {"ROCCL_TORCH_DIRECT": "1"}),
    "roccl-warm": ("roccl", {"COLD_CALL_SWEEP": "0"}),
    "roccl-direct-warm": ("roccl", {"ROCCL_TORCH_DIRECT": "1", "COLD_CALL_SWEEP": "0"}),
    "noop-warm": ("fake", {"COLD_CALL_SWEEP": "0"}),
    "gloo": ("gloo", {}),
}


def rank_main():
    import time

    import torch
    import torch.distributed as dist

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend, out = os.environ["COLD_CALL_BACKEND"], os.environ["COLD_CALL_OUT"]
    calls, elems = int(os.environ["COLD_CALL_CALLS"]), int(os.environ["COLD_CALL_BYTES"]) // 4
    sweep = int(os.environ.get("COLD_CALL_SWEEP", "64")) << 20
    torch.set_num_threads(1)
    if backend == "roccl":
        import roccl  # noqa: F401  (registers the backend)
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    else:
        dist.init_process_group(backend)
    t = torch.ones(elems)
    big = torch.zeros(max(sweep // 4, 1))
    times = []
    for i in range(calls + 20):
        if sweep:
            big.add_(1.0)
        a = time.time_ns()
        dist.all_reduce(t)
        b = time.time_ns()
        if i >= 20:
            times.append((a, b))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(times, f)
    dist.destroy_process_group()


def run(cfg, args, tmp):
    backend, env = CONFIGS[cfg]
    out = os.path.join(tmp, cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = dict(os.environ, COLD_CALL_BACKEND=backend, COLD_CALL_OUT=out,
             COLD_CALL_CALLS=str(args.calls), COLD_CALL_BYTES=str(args.bytes),
             COLD_CALL_SWEEP=str(args.sweep), OMP_NUM_THREADS="1")
    e.update(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.procs}",
           f"--master-port={port}", __file__, "--rank-main"]
    subprocess.run(cmd, env=e, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    per_rank = []
    for r in range(args.procs):
        with open(f"{out}.{r}") as f:
            per_rank.append(json.load(f))
    cost = []
    for i in range(len(per_rank[0])):
        calls = [p[i] for p in per_rank]
        last = max(calls, key=lambda c: c[0])
        cost.append((last[1] - last[0]) / 1000)
    return statistics.median(cost)


def main():
    if "--rank-main" in sys.argv:
        return rank_main()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--sweep", type=int, default=64, help="MiB streamed between calls")
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--configs", nargs="+", default=["noop", "roccl", "roccl-nofr", "gloo"])
    args = ap.parse_args()
    res = {c: [] for c in args.configs}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for c in args.configs:
                res[c].append(run(c, args, tmp))
    print(f"# {args.procs} procs, {args.bytes} B all-reduce, {args.sweep} MiB streamed between calls, "
          f"median µs of the last-arriving rank's time in the call, {args.rounds} alternated rounds")
    for c in args.configs:
        print(f"{c:12s} " + "  ".join(f"{v:7.1f}" for v in res[c]))


if __name__ == "__main__":
    main()
