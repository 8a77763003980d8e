#!/usr/bin/env python3
"""torch.distributed with "roccl" against "gloo", side by side, on CPU tensors of this host.

  all-reduce: torch-level dist.all_reduce of 8 B and 16 MiB (float32), 2 and 4 processes,
    over roccl's default network (shared memory here) and with ROCCL_NET=tcp, next to
    roccl-perf's figure for the same size and network; at 8 B also with torch's flight
    recorder off (TORCH_FR_BUFFER_SIZE=0: torch attaches it to every backend that does not
    record itself, roccl included, Gloo not) and torch's own cost per call, timed on its
    no-op "fake" backend (also without the recorder), so that what roccl adds to a call,
    beyond torch and beyond roccl-perf's own time, shows;
  decode: a small random transformer (8 layers, hidden 1024, 16 heads, MLP 4x) split over 2
    and 4 processes as ColwiseParallel / RowwiseParallel split it (q, k, v and the MLP's up
    projection by columns, the attention's output and the MLP's down projection by rows, one
    all-reduce after each), one token at a time with a KV cache, batch 1 and 8: tokens/s and
    the share of the time spent in all-reduce, beside torch's no-op backend ("fake": nothing
    is sent), the communication-free bound. A job's tokens/s is its slowest rank's.

Runs alternate between the backends (roccl, gloo, roccl, gloo, ...) and the medians are
reported with their ratio: this machine is noisy, a single run says little.

  python3 scripts/torch-bench.py [--reps 3] [--quick] [--only allreduce|decode] [--bind]

Needs torch and the roccl package (pip install --no-build-isolation ./ffi/torch).
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, backend, env, port, task, args, results):
    os.environ.update(env)
    if os.environ.get("TORCH_BENCH_BIND") == "1" and world <= os.cpu_count():
        os.sched_setaffinity(0, {rank})  # as roccl-perf binds its ranks (--bind auto)
    torch.set_num_threads(1)
    import roccl  # noqa: F401

    if backend == "fake":
        # torch's own no-op backend: what a call costs in torch alone (nothing is sent).
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
    out = task(rank, world, *args)
    results.put((rank, out))
    if backend != "fake":
        dist.barrier()
    dist.destroy_process_group()


def launch(world, backend, env, task, *args):
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, backend, env, port, task, args, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outs = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"{backend} rank exited with {p.exitcode}")
    return [outs[r] for r in range(world)]


# ---------------------------------------------------------------------------------------
# all-reduce


def allreduce_task(rank, world, nbytes, seconds):
    t = torch.ones(max(nbytes // 4, 1))
    for _ in range(20):
        dist.all_reduce(t)
    # As many iterations as fit in about `seconds` (the same count on every rank).
    dist.barrier()
    start = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(t)
    per = (time.perf_counter() - start) / 10
    n = torch.tensor([max(10, min(20000, int(seconds / max(per, 1e-7))))])
    dist.broadcast(n, 0)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(int(n)):
        dist.all_reduce(t)
    took = torch.tensor([(time.perf_counter() - start) / int(n)])
    if dist.get_backend() != "fake":
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's time
    return took.item() * 1e6


def roccl_perf(world, nbytes, net):
    target = json.loads(
        subprocess.check_output(
            ["cargo", "metadata", "--format-version", "1", "--no-deps", "--manifest-path", str(ROOT / "Cargo.toml")]
        )
    )["target_directory"]
    subprocess.check_call(
        ["cargo", "build", "--release", "--quiet", "--bin", "roccl-perf", "--manifest-path", str(ROOT / "Cargo.toml")]
    )
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "perf.json"
        subprocess.check_call(
            [f"{target}/release/roccl-perf", "--ranks", str(world), "-b", str(nbytes), "-e", str(nbytes),
             "--iters", "2000" if nbytes < 4096 else "20", "--warmup", "20", "--out-of-place", "--net", net, "--json", str(out)],
            stdout=subprocess.DEVNULL,
        )
        # The mean per call, as the torch loop is timed (a loop over n calls, divided by n);
        # roccl-perf's printed figure is the median.
        return json.loads(out.read_text())["results"][0]["mean_us"]


def fmt_us(us):
    return f"{us:.1f} µs" if us < 1000 else f"{us / 1000:.2f} ms"


def bench_allreduce(reps, quick):
    rows = []
    worlds = [2] if quick else [2, 4]
    for net in ["auto", "tcp"]:
        env = {} if net == "auto" else {"ROCCL_NET": "tcp"}
        for world in worlds:
            for nbytes in [8, 16 << 20]:
                small = nbytes <= 4096
                runs = [("roccl", "roccl", env), ("gloo", "gloo", env)]
                if small:
                    no_fr = dict(env, TORCH_FR_BUFFER_SIZE="0")
                    runs += [("roccl, no FR", "roccl", no_fr), ("torch alone", "fake", no_fr)]
                times = {name: [] for name, _, _ in runs}
                times["roccl-perf"] = []
                for _ in range(reps):
                    for name, be, e in runs:
                        times[name].append(launch(world, be, e, allreduce_task, nbytes, 0.5 if quick else 1.5)[0])
                    # In the same alternation: TCP loopback here swings between a fast and a
                    # slow mode within a minute (8 B: 3.5 against 7.7 µs).
                    times["roccl-perf"].append(roccl_perf(world, nbytes, net))
                med = {name: statistics.median(t) for name, t in times.items()}
                r, g = med["roccl"], med["gloo"]
                perf = med["roccl-perf"]
                rows.append((net, world, nbytes, r, g, perf))
                extra = ""
                if small:
                    added = med["roccl, no FR"] - med["torch alone"] - perf
                    extra = (
                        f"  no FR: roccl {fmt_us(med['roccl, no FR'])}, torch alone "
                        f"{fmt_us(med['torch alone'])}: roccl's binding adds {added:.1f} µs"
                    )
                print(
                    f"all_reduce {nbytes:>9} B  {world} procs  net={net:<4}  roccl {fmt_us(r):>10}  "
                    f"gloo {fmt_us(g):>10}  gloo/roccl {g / r:5.1f}x  roccl-perf {fmt_us(perf):>10}{extra}  "
                    f"(runs: {'; '.join(name + ' ' + ', '.join(fmt_us(x) for x in t) for name, t in times.items())})",
                    flush=True,
                )
    return rows


# ---------------------------------------------------------------------------------------
# tensor-parallel decode


class ShardedBlock(torch.nn.Module):
    """One transformer block, this rank's shard: q/k/v and MLP-up by columns
    (ColwiseParallel), attention-out and MLP-down by rows (RowwiseParallel)."""

    def __init__(self, hidden, heads, world, g):
        super().__init__()
        self.local_heads = heads // world
        self.head_dim = hidden // heads
        width = self.local_heads * self.head_dim
        s = hidden**-0.5

        def w(*shape):
            return torch.randn(*shape, generator=g) * s

        self.qkv = w(hidden, 3 * width)
        self.out = w(width, hidden)
        self.up = w(hidden, 4 * hidden // world)
        self.down = w(4 * hidden // world, hidden)
        self.norm1 = torch.nn.LayerNorm(hidden)
        self.norm2 = torch.nn.LayerNorm(hidden)

    def forward(self, x, cache, comm):
        b = x.shape[0]
        q, k, v = (self.norm1(x) @ self.qkv).split(self.local_heads * self.head_dim, dim=-1)
        q = q.view(b, self.local_heads, 1, self.head_dim)
        k = k.view(b, self.local_heads, 1, self.head_dim)
        v = v.view(b, self.local_heads, 1, self.head_dim)
        cache["k"] = torch.cat([cache["k"], k], dim=2)
        cache["v"] = torch.cat([cache["v"], v], dim=2)
        a = torch.nn.functional.scaled_dot_product_attention(q, cache["k"], cache["v"])
        x = x + comm(a.reshape(b, -1) @ self.out)
        x = x + comm(torch.relu(self.norm2(x) @ self.up) @ self.down)
        return x


def decode_task(rank, world, batch, layers, hidden, heads, context, tokens):
    g = torch.Generator().manual_seed(1000 + rank)
    blocks = [ShardedBlock(hidden, heads, world, g) for _ in range(layers)]
    comm_time = [0.0]

    def comm(t):
        start = time.perf_counter()
        dist.all_reduce(t)
        comm_time[0] += time.perf_counter() - start
        return t

    def caches():
        hd = hidden // heads
        return [
            {"k": torch.randn(batch, heads // world, context, hd, generator=g),
             "v": torch.randn(batch, heads // world, context, hd, generator=g)}
            for _ in range(layers)
        ]

    with torch.no_grad():
        x0 = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(7))
        for warm in [True, False]:
            cs = caches()
            x = x0.clone()
            dist.barrier()
            comm_time[0] = 0.0
            start = time.perf_counter()
            for _ in range(3 if warm else tokens):
                for blk, c in zip(blocks, cs):
                    x = blk(x, c, comm)
            took = time.perf_counter() - start
    return {"tokens_per_s": batch * tokens / took, "comm_share": comm_time[0] / took}


def bench_decode(reps, quick):
    rows = []
    layers, hidden, heads, context = 8, 1024, 16, 128
    tokens = 16 if quick else 48
    for world in [2] if quick else [2, 4]:
        for batch in [1, 8]:
            res = {"roccl": [], "gloo": [], "fake": []}
            for _ in range(reps):
                for be in res:
                    ranks = launch(world, be, {}, decode_task, batch, layers, hidden, heads, context, tokens)
                    # The job's figure: its slowest rank's (without communication the ranks
                    # do not wait for each other).
                    res[be].append(min(ranks, key=lambda r: r["tokens_per_s"]))
            med = {
                be: (statistics.median(r["tokens_per_s"] for r in res[be]),
                     statistics.median(r["comm_share"] for r in res[be]))
                for be in res
            }
            rows.append((world, batch, med))
            print(
                f"decode {layers} layers hidden {hidden}  {world} procs  batch {batch}:  "
                f"roccl {med['roccl'][0]:7.1f} tok/s ({100 * med['roccl'][1]:4.1f}% in all-reduce)  "
                f"gloo {med['gloo'][0]:7.1f} tok/s ({100 * med['gloo'][1]:4.1f}% in all-reduce)  "
                f"roccl/gloo {med['roccl'][0] / med['gloo'][0]:4.2f}x  no-op backend {med['fake'][0]:7.1f} tok/s "
                f"(roccl {med['roccl'][0] / med['fake'][0]:.2f} of it, gloo {med['gloo'][0] / med['fake'][0]:.2f})",
                flush=True,
            )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="alternating runs per backend (median reported)")
    ap.add_argument("--quick", action="store_true", help="2 processes, shorter runs")
    ap.add_argument("--only", choices=["allreduce", "decode"])
    ap.add_argument("--bind", action="store_true",
                    help="bind rank r to CPU r (as roccl-perf does with a CPU per rank)")
    a = ap.parse_args()
    if a.bind:
        os.environ["TORCH_BENCH_BIND"] = "1"
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    if a.only in (None, "allreduce"):
        bench_allreduce(a.reps, a.quick)
    if a.only in (None, "decode"):
        bench_decode(a.reps, a.quick)


if __name__ == "__main__":
    sys.exit(main())
