"""Training through the "roccl" backend gives what one process computes alone: DDP and FSDP2
(fully_shard on a CPU device mesh) trained a few steps on shards of a batch equal one
process trained on the whole batch, and a tensor-parallel MLP (ColwiseParallel /
RowwiseParallel) gives the single-process output."""

import torch
import torch.distributed as dist
import torch.nn as nn

from common import run

STEPS = 4


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(world, per_rank=3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * per_rank, 8, generator=g)
    y = torch.randn(world * per_rank, 4, generator=g)
    return x, y


def train(m, x, y, steps=STEPS):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return m


def reference(world):
    x, y = batch(world)
    return [p.detach() for p in train(model(), x, y).parameters()]


def ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    x, y = batch(world)
    shard = slice(rank * 3, (rank + 1) * 3)
    m = DistributedDataParallel(model())
    train(m, x[shard], y[shard])
    for got, want in zip(m.module.parameters(), reference(world)):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    # A comm hook (futures): the default all-reduce hook, through get_future().
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    m2 = DistributedDataParallel(model())
    m2.register_comm_hook(None, default_hooks.allreduce_hook)
    train(m2, x[shard], y[shard])
    for got, want in zip(m2.module.parameters(), reference(world)):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)


def test_ddp_equals_one_process_on_the_whole_batch():
    run(2, ddp)


def test_ddp_with_three_ranks():
    run(3, ddp)


def fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    m = model()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    x, y = batch(world)
    shard = slice(rank * 3, (rank + 1) * 3)
    train(m, x[shard], y[shard])
    for got, want in zip(m.parameters(), reference(world)):
        torch.testing.assert_close(got.full_tensor().detach(), want, rtol=1e-5, atol=1e-6)


def test_fsdp2_equals_one_process_on_the_whole_batch():
    run(2, fsdp2)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def tensor_parallel(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    want = MLP()(x).detach()
    m = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    got = m(x)
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)
    # And the backward pass: the input's gradient matches too.
    xr = x.clone().requires_grad_()
    MLP()(xr).sum().backward()
    xt = x.clone().requires_grad_()
    m(xt).sum().backward()
    torch.testing.assert_close(xt.grad, xr.grad, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_mlp_equals_one_process():
    run(2, tensor_parallel)


def test_tensor_parallel_mlp_with_four_ranks():
    run(4, tensor_parallel)
