#!/usr/bin/env python3
"""Tensor-parallel decode through Hugging Face transformers: tokens/s with roccl, Gloo and a
no-op backend (the bound: what the model reaches if communication cost nothing).

The model is a small random Llama (8 layers, hidden 1024, 16 heads, MLP 2816, vocabulary
8192; `--layers`/`--hidden` change it) made from a config and saved to disk once (no
download). Each run is a torchrun job: every process loads it with
`from_pretrained(..., tp_plan="auto")` (transformers' own tensor-parallel plan: q/k/v, gate
and up by columns, o and down by rows, an all-reduce after each row-wise layer), one thread
per process, then decodes greedily (`generate`, a fixed number of new tokens, a 16-token
prompt) at each batch size, a warm-up generation first. A job's tokens/s is its slowest
rank's (the tokens are done when every rank is done; rank 0's alone is printed beside it).
Configurations:

  noop          torch's no-op backend ("fake": every collective returns at once, nothing is
                sent; its tokens are not the model's), the communication-free bound
  roccl-shm     roccl over shared memory (its default for ranks on one host)
  roccl-tcp     roccl with ROCCL_NET=tcp
  roccl-rocev2  roccl with ROCCL_NET=rocev2 (the userspace RoCE v2 engine over UDP)
  roccl-*-direct  the same with ROCCL_TORCH_DIRECT=1: transformers' blocking
                dist.all_reduce calls take roccl.all_reduce (torch.ops.roccl.all_reduce_)
  gloo          torch's Gloo (TCP)

Runs alternate between the configurations (noop, roccl-shm, ..., gloo, noop, ...), as this
machine is noisy; each figure is the median over --reps runs, with its ratio to noop. The
tokens generated with roccl are checked to be the ones Gloo generates. In brackets: the share of
the time spent in `dist.all_reduce` (waiting for the other ranks included).

With DECODE_BENCH_PERF=DIR, each rank records `perf record -g` of its timed generations there.
With DECODE_BENCH_THREADS=1, rank 0's threads are shown from the scheduler's accounting: time
run, time runnable but waiting for a core (what other threads took from it) and slices.

  python3 scripts/decode-bench.py [--reps 3] [--procs 2 4] [--batch 1 8] [--tokens 32]
      [--configs noop roccl-shm roccl-tcp roccl-rocev2 gloo] [--json out.json]

Needs torch, transformers and the roccl package (pip install --no-build-isolation ./ffi/torch).
"""

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "noop": ("fake", {}),
    "roccl-shm": ("roccl", {"ROCCL_NET": "auto"}),
    "roccl-tcp": ("roccl", {"ROCCL_NET": "tcp"}),
    "roccl-rocev2": ("roccl", {"ROCCL_NET": "rocev2"}),
    "roccl-shm-direct": ("roccl", {"ROCCL_NET": "auto", "ROCCL_TORCH_DIRECT": "1"}),
    "roccl-tcp-direct": ("roccl", {"ROCCL_NET": "tcp", "ROCCL_TORCH_DIRECT": "1"}),
    "roccl-rocev2-direct": ("roccl", {"ROCCL_NET": "rocev2", "ROCCL_TORCH_DIRECT": "1"}),
    "gloo": ("gloo", {}),
}
PROMPT = 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(layers, hidden):
    """The random Llama, saved once under ~/.cache/roccl (its path)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch

    key = f"llama-l{layers}-h{hidden}-v8192"
    path = Path.home() / ".cache" / "roccl" / "decode-models" / key
    if (path / "config.json").exists():
        return path
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tmp = path.with_name(key + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------
# one torchrun process


def profile_start(rank, batch):
    """With DECODE_BENCH_PERF=DIR: `perf record -g` of this process during the timed
    generation, into DIR/rank<r>-batch<b>.data."""
    out = os.environ.get("DECODE_BENCH_PERF")
    if not out:
        return None
    path = Path(out) / f"rank{rank}-batch{batch}.data"
    p = subprocess.Popen(
        ["perf", "record", "-F", "4999", "-g", "-p", str(os.getpid()), "-o", str(path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)  # perf attached
    return p


def profile_stop(p):
    if p is not None:
        p.send_signal(2)  # SIGINT: perf writes its file
        p.wait(timeout=60)


def thread_times():
    """This process's threads from the scheduler's accounting (/proc/self/task/*/schedstat):
    by thread name, nanoseconds run, nanoseconds runnable but waiting for a core, and times
    scheduled in."""
    out = {}
    for t in Path("/proc/self/task").iterdir():
        try:
            name = (t / "comm").read_text().strip()
            run, wait, slices = map(int, (t / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        # Threads of one name (torch's pool, a network's helpers) are summed.
        name = "main" if t.name == str(os.getpid()) else name
        acc = out.setdefault(name, [0, 0, 0])
        for k, v in enumerate((run, wait, slices)):
            acc[k] += v
    return out


def threads_during(before, after):
    """What each thread did between two thread_times(), in ms run / ms waiting for a core /
    times scheduled in; threads that did nothing are left out."""
    out = {}
    for name, (run, wait, slices) in after.items():
        r0, w0, s0 = before.get(name, (0, 0, 0))
        if slices - s0:
            out[name] = [(run - r0) / 1e6, (wait - w0) / 1e6, slices - s0]
    return out


def worker(a):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    else:
        if a.backend == "roccl":
            import roccl  # noqa: F401  (registers the backend)
        dist.init_process_group(a.backend)
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    # Time spent in all-reduce (transformers' row-wise layers call dist.all_reduce).
    # Each call's entry and exit on the host's monotonic clock (perf_counter), the same
    # clock in every process: the driver tells the wait for the last rank to arrive from
    # the call's own cost (the last rank's time in it).
    in_comm = [0.0, 0]
    calls = []
    all_reduce = dist.all_reduce

    def timed_all_reduce(*args, **kwargs):
        start = time.perf_counter()
        out = all_reduce(*args, **kwargs)
        end = time.perf_counter()
        in_comm[0] += end - start
        in_comm[1] += 1
        calls.append((start, end))
        return out

    dist.all_reduce = timed_all_reduce
    mesh = init_device_mesh("cpu", (world,))
    model = AutoModelForCausalLM.from_pretrained(
        a.model, tp_plan="auto", device_mesh=mesh, dtype=torch.float32
    )
    model.eval()
    rows = []
    for batch in a.batch:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=g)
        kw = dict(
            max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )
        with torch.no_grad():
            model.generate(ids, **dict(kw, max_new_tokens=4, min_new_tokens=4))  # warm-up
            if a.backend != "fake":
                dist.barrier()
            in_comm[:] = [0.0, 0]
            calls.clear()
            perf = profile_start(rank, batch)
            threads = thread_times()
            start = time.perf_counter()
            out = model.generate(ids, **kw)
            took = time.perf_counter() - start
            threads = threads_during(threads, thread_times())
            profile_stop(perf)
        new = out[:, PROMPT:]
        digest = hashlib.sha256(new.numpy().tobytes()).hexdigest()[:16]
        rows.append({
            "batch": batch, "tokens_per_s": batch * a.tokens / took, "tokens": digest,
            "comm_share": in_comm[0] / took, "calls_per_token": in_comm[1] / a.tokens,
            "calls": list(calls), "threads": threads,
        })
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(rows))
    if a.backend != "fake":
        dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# the driver


def launch(name, procs, a, model):
    backend, extra = CONFIGS[name]
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env.setdefault("ROCCL_JOB_SECRET", os.urandom(16).hex())
    with tempfile.TemporaryDirectory(prefix="decode-bench-") as out:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            __file__, "--worker", "--backend", backend, "--model", str(model), "--out", out,
            "--tokens", str(a.tokens), "--batch", *map(str, a.batch),
        ]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        ranks = {
            int(f.stem[len("rank"):]): json.loads(f.read_text()) for f in Path(out).glob("rank*.json")
        }
    if run.returncode != 0 or len(ranks) != procs:
        sys.stderr.write(run.stdout[-3000:] + run.stderr[-6000:])
        raise RuntimeError(f"{name} at {procs} processes failed (exit {run.returncode})")
    # The job's figure is its slowest rank's (rank 0's alone beside it): without
    # communication the ranks do not wait for each other, and a rank that the machine's
    # noise slowed does not slow rank 0.
    out = []
    for i, row in enumerate(ranks[0]):
        slowest = min(ranks[r][i]["tokens_per_s"] for r in ranks)
        row = dict(row, rank0_tokens_per_s=row["tokens_per_s"], tokens_per_s=slowest,
                   threads={r: ranks[r][i].get("threads", {}) for r in sorted(ranks)})
        row.update(call_split([ranks[r][i].pop("calls") for r in sorted(ranks)], backend))
        row.pop("calls", None)
        out.append(row)
    return out


def call_split(per_rank, backend):
    """Per call, in µs: the median time the last rank to arrive spent in it (the call's own
    cost, waiting for nobody) and the median spread of the ranks' arrivals (what the others
    waited for it). Without communication, each rank's own time in its call."""
    n = min(len(c) for c in per_rank)
    if n == 0:
        return {}
    own, spread = [], []
    for k in range(n):
        enters = [c[k][0] for c in per_rank]
        last = max(range(len(per_rank)), key=lambda r: enters[r])
        if backend == "fake":
            own.append(statistics.median(c[k][1] - c[k][0] for c in per_rank))
            spread.append(0.0)
        else:
            own.append(per_rank[last][k][1] - enters[last])
            spread.append(enters[last] - min(enters))
    return {"last_arrival_us": 1e6 * statistics.median(own), "arrival_spread_us": 1e6 * statistics.median(spread),
            "last_arrival_mean_us": 1e6 * statistics.fmean(own), "arrival_spread_mean_us": 1e6 * statistics.fmean(spread)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--json", help="write the medians here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=BASE[:VAR=VALUE...]",
                    help="one more configuration: BASE's backend and settings with these variables "
                    "(e.g. shm-nospin=roccl-shm:ROCCL_SPIN_US=0)")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    for spec in a.extra:
        name, _, rest = spec.partition("=")
        base, *pairs = rest.split(":")
        backend, env = CONFIGS[base]
        CONFIGS[name] = (backend, dict(env, **dict(p.split("=", 1) for p in pairs)))
        a.configs.append(name)

    import torch
    import transformers

    model = make_model(a.layers, a.hidden)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"Llama {a.layers} layers hidden {a.hidden}, {a.tokens} new tokens, {a.reps} alternated runs",
        flush=True,
    )
    table = []
    for procs in a.procs:
        runs = {name: [] for name in a.configs}
        for _ in range(a.reps):
            for name in a.configs:
                runs[name].append(launch(name, procs, a, model))
        for i, batch in enumerate(a.batch):
            med = {n: statistics.median(r[i]["tokens_per_s"] for r in runs[n]) for n in a.configs}
            tokens = {n: {r[i]["tokens"] for r in runs[n]} for n in a.configs}
            rank0 = {n: statistics.median(r[i]["rank0_tokens_per_s"] for r in runs[n]) for n in a.configs}
            bound = med.get("noop")
            cells = []
            share = {n: statistics.median(r[i]["comm_share"] for r in runs[n]) for n in a.configs}
            for n in a.configs:
                ratio = f" ({med[n] / bound:.2f})" if bound and n != "noop" else ""
                cells.append(f"{n} {med[n]:7.1f}{ratio} [{100 * share[n]:.0f}%]")
            same = {n: tokens[n] == tokens.get("gloo", tokens[n]) for n in a.configs if CONFIGS[n][0] == "roccl"}
            print(
                f"{procs} procs batch {batch}: tokens/s " + "  ".join(cells)
                + ("  tokens as gloo: " + ", ".join(f"{n} {'yes' if s else 'NO'}" for n, s in same.items())
                   if "gloo" in a.configs else ""),
                flush=True,
            )
            split = {n: (statistics.median(r[i].get("last_arrival_us", 0) for r in runs[n]),
                         statistics.median(r[i].get("arrival_spread_us", 0) for r in runs[n]))
                     for n in a.configs}
            print("  per call (medians, µs): the last rank's time in it / spread of arrivals: "
                  + ", ".join(f"{n} {own:.1f} / {sp:.0f}" for n, (own, sp) in split.items()), flush=True)
            if os.environ.get("DECODE_BENCH_THREADS"):
                for n in a.configs:
                    # The last run's rank 0: per thread, ms run / ms runnable but waiting
                    # for a core / times scheduled in, over the timed generation.
                    t = runs[n][-1][i]["threads"].get(0, {})
                    print(f"  threads of rank 0, {n} (ms run / ms waiting for a core / slices): "
                          + ", ".join(f"{k} {v[0]:.0f}/{v[1]:.0f}/{v[2]}" for k, v in sorted(t.items())),
                          flush=True)
            if bound:
                print(f"  rank 0 alone (not the job): noop {rank0['noop']:.1f}, "
                      + ", ".join(f"{n} {rank0[n]:.1f} ({rank0[n] / rank0['noop']:.2f})"
                                  for n in a.configs if n != "noop"), flush=True)
            table.append({"procs": procs, "batch": batch, "tokens_per_s": med, "comm_share": share,
                          "rank0_tokens_per_s": rank0, "per_call_us": split,
                          "calls_per_token": runs[a.configs[0]][0][i]["calls_per_token"],
                          "runs": {n: [r[i]["tokens_per_s"] for r in runs[n]] for n in a.configs},
                          "same_tokens_as_gloo": same})
            if any(not s for s in same.values()):
                print(f"  tokens differ: {tokens}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
