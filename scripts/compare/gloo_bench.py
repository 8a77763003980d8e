"""The same measurement as roccl-perf with PyTorch's gloo backend: per size, warm-up, then
per iteration each rank's time of the collective; per iteration the slowest rank's time
(all_reduce MAX), then the median. Prints "op bytes time_us busbw_gbs" per size.

    python3 gloo_bench.py OP NRANKS MIN MAX FACTOR ITERS WARMUP PORT
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, op, n, lo, hi, f, iters, warm, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    b = lo
    while b <= hi:
        # Sizes are totals (roccl-perf, nccl-tests): all_gather moves blocks of b / n bytes.
        count = max(b // 4 // (n if op == "all_gather" else 1), 1)
        x = torch.arange(count, dtype=torch.float32) % 97 + rank
        outs = [torch.empty(count) for _ in range(n)]
        times = []
        for it in range(-warm, iters):
            dist.barrier()
            t0 = time.perf_counter()
            if op == "all_reduce":
                dist.all_reduce(x)
                factor = 2 * (n - 1) / n
                nbytes = count * 4
            elif op == "all_gather":
                dist.all_gather(outs, x)
                factor = (n - 1) / n
                nbytes = count * 4 * n
            elif op == "broadcast":
                dist.broadcast(x, 0)
                factor = 1.0
                nbytes = count * 4
            else:
                raise SystemExit(f"gloo_bench: op {op} not supported")
            dt = (time.perf_counter() - t0) * 1e6
            if it >= 0:
                times.append(dt)
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        med = float(t.sort().values[len(times) // 2])
        if rank == 0:
            print(f"{op} {b} {med:.2f} {nbytes / med / 1e3 * factor:.3f}", flush=True)
        b *= f
    dist.destroy_process_group()


if __name__ == "__main__":
    op, n, lo, hi, f, iters, warm, port = sys.argv[1], *map(int, sys.argv[2:9])
    torch.set_num_threads(1)
    mp.spawn(run, args=(op, n, lo, hi, f, iters, warm, port), nprocs=n)
